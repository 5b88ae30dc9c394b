"""A small real training run: a GPT-style decoder trained with fully_shard per block and at
the root, activation checkpointing in every block, on random next-token data.

    torchrun --nproc_per_node 2 examples/train.py        # 2 CPU processes, gloo
    python examples/train.py                              # one process
    torchrun --nproc_per_node 2 examples/train.py --steps 10 --checkpoint-dir ckpt
    torchrun --nproc_per_node 2 examples/train.py --steps 20 --checkpoint-dir ckpt   # resumes at 10

Every rank prints nothing but rank 0, which prints the global mean loss per step and, at the
end, the parameter elements this rank stores against the model's total.

With ``--checkpoint-dir DIR`` the run resumes from the newest checkpoint ``DIR/step_<N>`` if
there is one and saves ``DIR/step_<steps>`` at the end (model and optimizer, sharded, with
torch.distributed.checkpoint, through ``save_checkpoint``). A checkpoint directory appears complete,
with checksums, or not at all, so a run killed while saving resumes from the previous checkpoint;
``load_checkpoint`` refuses a damaged one, naming the file.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from composable_shard import (checkpoint, fully_shard, latest_checkpoint, load_checkpoint, save_checkpoint,
                              unshard_params)


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        mask = torch.triu(torch.full((seq, seq), float("-inf"), device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    def __init__(self, vocab: int, width: int, blocks: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(blocks)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="resume from its newest step_<N> if any; save step_<steps> at the end")
    args = parser.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    torch.manual_seed(0)  # same initial weights on every rank
    model = Decoder(args.vocab, args.width, args.blocks, 4, args.seq)
    total = sum(p.numel() for p in model.parameters())
    for block in model.blocks:
        checkpoint(block)
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first_step = 0
    found = latest_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else None
    if found is not None:
        first_step, path = found
        load_checkpoint(path, model, optim)
        if rank == 0:
            print(f"resumed from {path} at step {first_step}", flush=True)

    gen = torch.Generator().manual_seed(1234 + rank)  # different data on each rank
    for _ in range(first_step):  # the data of the steps before the checkpoint
        torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    start = time.perf_counter()
    for step in range(first_step, args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        model.clip_grad_norm_(1.0)
        optim.step()
        optim.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step:3d}  loss {mean.item() / world_size:.4f}", flush=True)
    elapsed = time.perf_counter() - start
    local = sum(p.numel() for p in model.parameters())
    with unshard_params(model, rank0_only=True, writeback=False):
        full = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"world size {world_size}: {max(args.steps - first_step, 0)} steps in {elapsed:.1f}s; rank 0 stores {local} of "
              f"{total} parameter elements (full model seen inside unshard_params: {full})")
    if args.checkpoint_dir and args.steps > first_step:
        path = os.path.join(args.checkpoint_dir, f"step_{args.steps:06d}")
        save_checkpoint(path, model, optim)
        if rank == 0:
            print(f"saved {path}", flush=True)
    dist.barrier()  # every rank done with every collective before any rank tears gloo down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
