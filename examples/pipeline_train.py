"""Pipeline parallelism with fully sharded stages: ``train_gpt.py``'s GPT split into two stages
(torch's ``torch.distributed.pipelining``), each stage data-parallel over its own ranks with
``fully_shard`` per block and on the stage root.

    torchrun --standalone --nproc-per-node 4 examples/pipeline_train.py            # 2 stages x 2 data-parallel
    torchrun --standalone --nproc-per-node 4 examples/pipeline_train.py --schedule gpipe

Ranks form a (pipeline, data-parallel) mesh: ranks 0 and 1 hold stage 0 (embeddings, first half
of the blocks), ranks 2 and 3 stage 1 (the other blocks, final norm, head). The stage is built
with ``composable_shard.integrations.pipelining.PipelineStage`` (torch's, with gradients reduced
once per step: one reduce-scatter per flat group, after the last micro-batch), and any of torch's
schedules without split backward runs it: ``Schedule1F1B`` (default), ``ScheduleGPipe``. Each
data-parallel rank feeds its own rows, split into micro-batches; the loss is averaged over them.
Rank 2 (the last stage's first data-parallel rank) prints the loss. (Gradient clipping is left
out: ``clip_grad_norm_`` on a stage would clip by that stage's norm, not the whole model's.)
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import ALPHABET, GPT, CharData  # noqa: E402  # the sibling example

from composable_shard import fully_shard  # noqa: E402


class FirstStage(nn.Module):
    """Token and position embeddings and the first blocks of a :class:`GPT`."""

    def __init__(self, gpt: GPT, blocks: int) -> None:
        super().__init__()
        self.tok, self.pos = gpt.tok, gpt.pos
        self.blocks = nn.ModuleList(list(gpt.blocks)[:blocks])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return x


class LastStage(nn.Module):
    """The remaining blocks, the final LayerNorm and the head of a :class:`GPT`."""

    def __init__(self, gpt: GPT, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(list(gpt.blocks)[blocks:])
        self.ln, self.head = gpt.ln, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pipeline_train.py", description="A GPT in two fully sharded pipeline "
                                     "stages, each data-parallel over two ranks (4 processes).")
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"], help="(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per data-parallel rank (default: %(default)s)")
    parser.add_argument("--microbatches", type=int, default=4, help="(default: %(default)s)")
    parser.add_argument("--seq", type=int, default=64, help="characters per sequence (default: %(default)s)")
    parser.add_argument("--width", type=int, default=64, help="model width (default: %(default)s)")
    parser.add_argument("--blocks", type=int, default=4, help="transformer blocks, split evenly (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=4, help="(default: %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3, help="(default: %(default)s)")
    parser.add_argument("--log-every", type=int, default=10, help="(default: %(default)s)")
    parser.add_argument("--text-chars", type=int, default=500_000, help="(default: %(default)s)")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    """Train; returns ``{"losses": {step: loss}}`` on the rank that computes the loss (else empty)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from composable_shard.integrations.pipelining import PipelineStage

    args = parse_args(argv)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("gloo")
    if dist.get_world_size() != 4:
        raise SystemExit("pipeline_train.py runs on 4 processes: torchrun --standalone --nproc-per-node 4 ...")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    torch.manual_seed(0)  # the same GPT on every rank; each keeps its stage
    gpt = GPT(len(ALPHABET), args.width, args.blocks, args.heads, max_seq=args.seq)
    half = args.blocks // 2
    stage_module: nn.Module = FirstStage(gpt, half) if pp_rank == 0 else LastStage(gpt, half)
    for block in stage_module.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(stage_module, mesh=mesh["dp"])
    stage = PipelineStage(stage_module, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    schedule_cls = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
    schedule = schedule_cls(stage, args.microbatches, loss_fn=loss_fn)
    optim = torch.optim.AdamW(stage_module.parameters(), lr=args.lr)
    data = CharData(args.text_chars, seed=0)
    losses: Dict[int, float] = {}
    for step in range(args.steps):
        inputs, targets = data.batch(step, dp_rank, args.batch, args.seq)
        if pp_rank == 0:
            schedule.step(inputs)
        else:
            micro: List[torch.Tensor] = []
            schedule.step(target=targets, losses=micro)
            losses[step] = float(torch.stack(micro).detach().mean())
        optim.step()
        optim.zero_grad()
        if pp_rank == 1 and dp_rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[step]:.4f}  ({args.schedule}, {args.microbatches} micro-batches)")
    if owns:
        dist.destroy_process_group()
    return {"losses": losses}


if __name__ == "__main__":
    main()
