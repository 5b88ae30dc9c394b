"""Mix the three APIs on one model: checkpointed, fully sharded blocks; a replicated head; the
embeddings fully sharded at the root.

    torchrun --standalone --nproc-per-node 2 examples/compose.py
    python examples/compose.py --steps 20

The model and data are ``train_gpt.py``'s (a character-level GPT on the standard library's
source). What each part gets:

* every block: ``checkpoint`` (activations recomputed in backward) and ``fully_shard`` (one flat
  parameter, 1/W of it per rank, all-gathered around its forward and backward);
* the head: ``replicate`` (DDP semantics: every rank keeps all of it, gradients all-reduced in
  buckets during backward) -- a fit for a small, hot layer;
* the root ``fully_shard(model)``: what is left (embeddings, final norm). It skips the subtree
  ``replicate`` manages, so the APIs must be applied children first: blocks and head, then root.

``clip_grad_norm_`` computes one norm over the shards and the replicated parameters, and an
optimizer built afterwards on ``model.parameters()`` steps all of them. Rank 0 prints
``describe(model)`` (one row per fully sharded or replicated module) and the loss.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import ALPHABET, GPT, CharData, Dist, init_distributed, loss_of  # noqa: E402  # the sibling example

from composable_shard import checkpoint, clip_grad_norm_, describe, fully_shard, replicate  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="compose.py", description="Checkpointed fully sharded blocks, a replicated head and a fully sharded "
                                       "root on one model, trained a few steps.")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=64, help="characters per sequence (default: %(default)s)")
    parser.add_argument("--width", type=int, default=64, help="model width (default: %(default)s)")
    parser.add_argument("--blocks", type=int, default=2, help="transformer blocks (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate (default: %(default)s)")
    parser.add_argument("--log-every", type=int, default=10, help="print every N steps (default: %(default)s)")
    parser.add_argument("--text-chars", type=int, default=500_000, help="characters of text (default: %(default)s)")
    return parser.parse_args(argv)


def build(args: argparse.Namespace, env: Dist) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """The model with the three APIs applied (children first), and AdamW built afterwards."""
    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT(len(ALPHABET), args.width, args.blocks, 4, args.seq).to(env.device)
    for block in model.blocks:
        checkpoint(block)
        fully_shard(block)
    replicate(model.head)
    fully_shard(model)  # embeddings and final norm; leaves the replicated head alone
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    args = parse_args(argv)
    env = init_distributed()
    try:
        model, optim = build(args, env)
        if env.rank == 0:
            print(describe(model), flush=True)
        data = CharData(args.text_chars, seed=1)
        losses: Dict[int, float] = {}
        for step in range(args.steps):
            inputs, targets = data.batch(step, env.rank, args.batch, args.seq)
            loss = loss_of(model, inputs.to(env.device), targets)
            loss.backward()
            clip_grad_norm_(model, 1.0)  # one norm over shards (all ranks) and the replicated head
            optim.step()
            optim.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses[step] = float(mean) / env.world_size
            if env.rank == 0 and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
                print(f"step {step + 1:4d}/{args.steps}  loss {losses[step]:.4f}", flush=True)
        dist.barrier()
    finally:
        if env.owns_group:
            dist.destroy_process_group()
    return {"losses": losses}


if __name__ == "__main__":
    main()
