"""``replicate`` vs torch DDP on the standard CPU workload (benchmarks/ BENCHMARK.md), side by side.

Both contenders live in every rank of one gloo group and step alternately (ddp, replicate,
ddp, ...) on the same per-rank batches, so machine noise hits both alike; the figure is the
ratio of the medians. Run: ``python -m benchmarks.bench_replicate [--world-size 2] [--blocks 4]``.
"""

from __future__ import annotations

import argparse
import gc
import copy
import os
import socket
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.model import GPT, SEQ, VOCAB, make_batch
from composable_shard._runtime import collectives as _collectives
from composable_shard.replicate import replicate

BATCH = 4
WARMUP_STEPS, TIMED_STEPS = 3, 10


def _batch(step: int, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    return make_batch(BATCH, SEQ, VOCAB, torch.Generator().manual_seed(10_000 * rank + step))


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int, rank: int) -> Tuple[float, float]:
    """One training step; returns (seconds, loss)."""
    ids, targets = _batch(step, rank)
    dist.barrier()
    start = time.perf_counter()
    logits = model(ids)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()
    dist.barrier()
    return time.perf_counter() - start, loss.item()


def _bytes_per_step(model: nn.Module, optim: torch.optim.Optimizer, rank: int) -> Dict[str, int]:
    with _collectives.record_collectives() as rec:
        _step(model, optim, 99, rank)
    return {kind: rec.nbytes(kind) for kind in sorted({r.kind for r in rec.records})}


def _rank_main(rank: int, world_size: int, port: int, num_blocks: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    base = GPT(blocks=num_blocks)
    models: Dict[str, nn.Module] = {"ddp": DDP(copy.deepcopy(base)), "replicate": replicate(copy.deepcopy(base))}
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    times: Dict[str, List[float]] = {name: [] for name in models}
    losses: Dict[str, float] = {}
    for step in range(WARMUP_STEPS + TIMED_STEPS):
        for name in models if step % 2 == 0 else reversed(list(models)):  # A B, B A, ...
            seconds, losses[name] = _step(models[name], optims[name], step, rank)
            if step >= WARMUP_STEPS:
                times[name].append(seconds)
    if rank == 0:
        medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        numel = sum(p.numel() for p in base.parameters())
        print(f"W={world_size} blocks={num_blocks} params={numel / 1e6:.2f}M  median step ms: "
              + ", ".join(f"{n} {ms:.1f}" for n, ms in medians.items())
              + f"  replicate/ddp = {medians['replicate'] / medians['ddp']:.3f}")
        print("final loss: " + ", ".join(f"{n} {loss:.6f}" for n, loss in losses.items()))
    ours_bytes = _bytes_per_step(models["replicate"], optims["replicate"], rank)
    if rank == 0:
        print(f"replicate collective bytes per step per rank: {ours_bytes}")
    del models, optims
    gc.collect()  # torch's FSDP2/DDP hold their groups: free them before the groups go ([Note: Process groups held weakly])
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run: Callable[..., None] = mp.spawn  # type: ignore[assignment]  # untyped in torch
    run(_rank_main, args=(args.world_size, _free_port(), args.blocks), nprocs=args.world_size)


if __name__ == "__main__":
    main()
