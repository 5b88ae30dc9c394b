"""2-D parallelism: ``train_gpt.py``'s GPT with tensor parallelism inside each data-parallel rank.

    torchrun --standalone --nproc-per-node 4 examples/train_2d.py            # dp 2 x tp 2
    torchrun --standalone --nproc-per-node 4 examples/train_2d.py --tp 4     # dp 1 x tp 4

Ranks form a (dp, tp) mesh. Each block's MLP is tensor-parallel (torch's ``parallelize_module``:
``fc`` column-wise, ``out`` row-wise, so each tp rank holds half of both matrices and the block
all-reduces once over tp); attention, norms, embeddings and the head stay whole on every tp rank
(the fused ``qkv`` projection interleaves q, k and v, so a head-wise split would need them apart).
Then each block and the root are fully sharded over the dp group: every handle flattens this
rank's tensor-parallel pieces with the plain parameters and shards them over dp, so a rank holds
1/(dp x tp) of each MLP matrix and 1/dp of everything else. Each data-parallel rank feeds its own
rows (the tp ranks of one dp rank feed the same ones); AdamW, gradient clipping by the global
norm over dp x tp (each element counted once), and a checkpoint at the end that loads at any
other (dp, tp) layout or into a plain model. Rank 0 prints ``describe(model)`` and the loss.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import ALPHABET, GPT, CharData  # noqa: E402  # the sibling example

from composable_shard import clip_grad_norm_, describe, fully_shard, save_checkpoint  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="train_2d.py", description="A GPT with tensor-parallel MLPs inside "
                                     "each data-parallel rank, fully sharded over dp (4 processes).")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks; dp = world / tp (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per data-parallel rank (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=64, help="characters per sequence (default: %(default)s)")
    parser.add_argument("--width", type=int, default=64, help="model width (default: %(default)s)")
    parser.add_argument("--blocks", type=int, default=4, help="transformer blocks (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=4, help="(default: %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3, help="(default: %(default)s)")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping (default: %(default)s)")
    parser.add_argument("--log-every", type=int, default=10, help="(default: %(default)s)")
    parser.add_argument("--text-chars", type=int, default=500_000, help="(default: %(default)s)")
    parser.add_argument("--out", default="", help="save a checkpoint of the last step to this new directory")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    """Train; returns ``{"losses": {step: loss}, "model": the trained model}`` (losses: the mean over
    the data-parallel ranks, on every rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    args = parse_args(argv)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    if args.tp < 1 or world % args.tp:
        raise SystemExit(f"train_2d.py: --tp {args.tp} does not divide the world size {world}")
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    torch.manual_seed(0)  # the same GPT on every rank
    model = GPT(len(ALPHABET), args.width, args.blocks, args.heads, max_seq=args.seq)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"fc": ColwiseParallel(), "out": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    if dist.get_rank() == 0:
        print(describe(model), flush=True)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = CharData(args.text_chars, seed=0)
    losses: Dict[int, float] = {}
    for step in range(args.steps):
        inputs, targets = data.batch(step, dp_rank, args.batch, args.seq)
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        clip_grad_norm_(model, args.clip)  # the norm over dp x tp, each element once
        optim.step()
        optim.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh["dp"].get_group())
        losses[step] = mean.item() / dp_size
        if dist.get_rank() == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[step]:.4f}  (dp {dp_size} x tp {args.tp})", flush=True)
    if args.out:
        save_checkpoint(args.out, model, optim, extra={"step": args.steps})
    if owns:
        dist.destroy_process_group()
    return {"losses": losses, "model": model}


if __name__ == "__main__":
    main()
