"""Item 5 of issue 46: 2-D parallelism (tensor parallelism inside data parallelism) side by side
with torch's FSDP2 + TP, on the standard CPU workload's model.

    python benchmarks/two_d.py                  # dp 2 x tp 2 (W = 4), 4 blocks, 8 timed rounds
    python benchmarks/two_d.py --rounds 12 --json out.json

Both contenders build the same ``benchmarks.model.GPT`` (seeded), make each block's MLP
tensor-parallel with torch's ``parallelize_module`` (``mlp.0`` column-wise, ``mlp.2`` row-wise:
attention stays whole, ``nn.MultiheadAttention`` has no TP plan), then fully shard each block and
the root over the dp dimension: ``composable_shard.fully_shard`` or torch's
``torch.distributed.fsdp.fully_shard``; AdamW(lr=1e-3). Each rank of a dp group feeds the same
rows (batch 4 per dp rank, sequence 128).

- **Step time**: rounds run one step of each contender back to back (order alternating); a step
  is forward, backward, optimizer step, zero_grad and a barrier. Reported: the median over rounds
  of ours / FSDP2 + TP in the same round (target <= 0.85), and each one's median step.
- **Peak tensor bytes per rank** (``benchmarks/counting_allocator.py``, a separate spawn before the
  timed one): the highest live bytes during a step less those before the contender was built,
  max over ranks and steps (target: ours <= FSDP2 + TP's).
- **Collectives per step**: count and input bytes per kind on rank 0 during one warm step, data-
  and tensor-parallel apart: tensor parallelism's (``DTensor``'s functional collectives) and
  FSDP2's from a dispatch mode on the c10d operators; ours from ``record_collectives`` (some of
  them never reach the dispatcher).
- **Losses**: the two must agree (same model, data and arithmetic); a difference > 1e-4 is printed.

W = 4 on 2 cores is oversubscribed: the figures are for comparison in one run, not tuned.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.model import GPT, SEQ, VOCAB, make_batch  # noqa: E402

CONTENDERS = ("fully_shard_tp", "torch_fsdp2_tp")
TARGET_TIME_RATIO = 0.85


class CollectiveBytes(TorchDispatchMode):
    """Count and input bytes per ``"<dp|tp> <kind>"`` of every collective reaching the c10d
    dispatcher on this thread while active: ``tp`` for the functional collectives ``DTensor``
    issues (tensor parallelism's), ``dp`` for the others (FSDP2's)."""

    KINDS = {"_allgather_base_": "all_gather", "allgather_": "all_gather", "all_gather_into_tensor": "all_gather",
             "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
             "reduce_scatter_tensor": "reduce_scatter", "allreduce_": "all_reduce", "all_reduce": "all_reduce",
             "broadcast_": "broadcast"}

    def __init__(self) -> None:
        super().__init__()
        self.by_kind: Dict[str, List[int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace in ("c10d", "_c10d_functional"):
            kind = self.KINDS.get(func.__name__.split(".")[0])
            if kind is not None:
                # gloo's in-place ops take (output, input) or a list of tensors; functional ones the input first
                tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
                if func.__name__.split(".")[0] in ("_allgather_base_", "_reduce_scatter_base_"):
                    tensors = [args[1]]
                flat = [t for item in tensors for t in (item if isinstance(item, (list, tuple)) else [item])]
                entry = self.by_kind.setdefault(f"{'tp' if func.namespace == '_c10d_functional' else 'dp'} {kind}", [0, 0])
                entry[0] += 1
                entry[1] += sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))
        return func(*args, **(kwargs or {}))


def build(name: str, blocks: int, mesh: Any) -> Tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = GPT(blocks=blocks)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})
    if name == "fully_shard_tp":
        from composable_shard import fully_shard
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:
        from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference
        for block in model.blocks:
            torch_fully_shard(block, mesh=mesh["dp"])
        torch_fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(model: nn.Module, optim: torch.optim.Optimizer, batch: Tuple[torch.Tensor, torch.Tensor]) -> float:
    tokens, targets = batch
    loss = F.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return float(loss.detach())


def _init(rank: int, world: int, port: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    return init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))


def _batches(mesh: Any, n: int, batch: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1000 + mesh["dp"].get_local_rank())  # tp peers: the same rows
    return [make_batch(batch, SEQ, VOCAB, generator) for _ in range(n)]


def memory_worker(rank: int, args: argparse.Namespace, so_path: str, port: int, outdir: str) -> None:
    from benchmarks import counting_allocator as ca

    ca.install(so_path)  # before this process creates any tensor
    mesh = _init(rank, args.world, port)
    batches = _batches(mesh, 3, args.batch)
    out: Dict[str, int] = {}
    for name in CONTENDERS:
        gc.collect()
        dist.barrier()
        before = ca.live()
        model, optim = build(name, args.blocks, mesh)
        peaks = []
        for i, batch in enumerate(batches):
            dist.barrier()
            ca.reset_peak()
            step(model, optim, batch)
            if i:  # the first step allocates AdamW's state: measured from the second on
                peaks.append(ca.peak() - before)
        out[name] = max(peaks)
        del model, optim
        gc.collect()
    with open(os.path.join(outdir, f"mem{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def timed_worker(rank: int, args: argparse.Namespace, port: int, outdir: str) -> None:
    mesh = _init(rank, args.world, port)
    built = {name: build(name, args.blocks, mesh) for name in CONTENDERS}
    batches = _batches(mesh, args.warmup + args.rounds, args.batch)
    times: Dict[str, List[float]] = {name: [] for name in CONTENDERS}
    losses: Dict[str, List[float]] = {name: [] for name in CONTENDERS}
    collectives: Dict[str, Dict[str, List[int]]] = {}
    for i, batch in enumerate(batches):
        order = CONTENDERS if i % 2 == 0 else CONTENDERS[::-1]
        for name in order:
            model, optim = built[name]
            dist.barrier()
            if i == args.warmup - 1:  # the last warm-up step: collectives per kind
                from composable_shard._runtime.collectives import record_collectives

                with CollectiveBytes() as counter, record_collectives() as ours:
                    losses[name].append(step(model, optim, batch))
                collectives[name] = counter.by_kind
                if name == "fully_shard_tp":  # ours run partly off the dispatcher: our own record of them
                    collectives[name] = {k: v for k, v in counter.by_kind.items() if k.startswith("tp ")}
                    for record in ours.records:
                        entry = collectives[name].setdefault(f"dp {record.kind}", [0, 0])
                        entry[0] += 1
                        entry[1] += record.nbytes
                dist.barrier()
                continue
            t0 = time.perf_counter()
            losses[name].append(step(model, optim, batch))
            dist.barrier()
            if i >= args.warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)
    if rank == 0:
        with open(os.path.join(outdir, "timed.json"), "w") as f:
            json.dump({"times": times, "losses": losses, "collectives": collectives}, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: argparse.Namespace) -> Dict[str, Any]:
    result: Dict[str, Any] = {"world": args.world, "blocks": args.blocks, "rounds": args.rounds, "batch": args.batch}
    with tempfile.TemporaryDirectory(prefix="cs_two_d_") as outdir:
        if args.memory == "on":
            from benchmarks import counting_allocator as ca
            mp.spawn(memory_worker, args=(args, ca.build(), _free_port(), outdir), nprocs=args.world, join=True)
            ranks = []
            for r in range(args.world):
                with open(os.path.join(outdir, f"mem{r}.json")) as f:
                    ranks.append(json.load(f))
            result["peak_bytes"] = {name: max(r[name] for r in ranks) for name in CONTENDERS}
        mp.spawn(timed_worker, args=(args, _free_port(), outdir), nprocs=args.world, join=True)
        with open(os.path.join(outdir, "timed.json")) as f:
            result.update(json.load(f))
    ours, theirs = result["times"][CONTENDERS[0]], result["times"][CONTENDERS[1]]
    result["time_ratio"] = statistics.median(a / b for a, b in zip(ours, theirs))
    result["loss_diff"] = max(abs(a - b) for a, b in zip(*(result["losses"][n] for n in CONTENDERS)))
    return result


def report(result: Dict[str, Any]) -> List[str]:
    """Print the tables; returns the targets missed."""
    misses = []
    print(f"2-D: dp {result['world'] // 2} x tp 2 (W = {result['world']}), {result['blocks']} blocks, batch "
          f"{result['batch']} per dp rank, {result['rounds']} paired rounds")
    for name in CONTENDERS:
        print(f"  {name:16s} median step {statistics.median(result['times'][name]):8.1f} ms")
    ok = result["time_ratio"] <= TARGET_TIME_RATIO
    print(f"  step time fully_shard_tp / torch_fsdp2_tp (median of paired ratios): {result['time_ratio']:.3f} "
          f"(target <= {TARGET_TIME_RATIO}) {'ok' if ok else 'MISSES'}")
    misses += [] if ok else ["step time"]
    if "peak_bytes" in result:
        peaks = result["peak_bytes"]
        ok = peaks[CONTENDERS[0]] <= peaks[CONTENDERS[1]]
        print(f"  peak tensor bytes per rank: fully_shard_tp {peaks[CONTENDERS[0]]:,}  torch_fsdp2_tp "
              f"{peaks[CONTENDERS[1]]:,}  ratio {peaks[CONTENDERS[0]] / peaks[CONTENDERS[1]]:.3f} "
              f"(target <= 1) {'ok' if ok else 'MISSES'}")
        misses += [] if ok else ["peak bytes"]
    print("  collectives per step on rank 0 (count, bytes sent), every c10d collective (data- and tensor-parallel):")
    kinds = sorted({k for n in CONTENDERS for k in result["collectives"][n]})
    for kind in kinds:
        cells = [result["collectives"][n].get(kind, [0, 0]) for n in CONTENDERS]
        print(f"    {kind:15s} " + "   ".join(f"{n}: x{c} {b:,} B" for n, (c, b) in zip(CONTENDERS, cells)))
    flag = "" if result["loss_diff"] <= 1e-4 else "  <-- LOSSES DIFFER"
    print(f"  max loss difference between the two: {result['loss_diff']:.2e}{flag}")
    return misses


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="two_d.py", description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4, help="ranks; tp is 2, dp is world / 2 (default: %(default)s)")
    p.add_argument("--blocks", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="sequences per dp rank (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="(default: %(default)s)")
    p.add_argument("--rounds", type=int, default=8, help="timed paired rounds (default: %(default)s)")
    p.add_argument("--memory", choices=("on", "off"), default="on", help="(default: %(default)s)")
    p.add_argument("--json", default="", help="also write the results here")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.world % 2 or args.world < 2:
        raise SystemExit("two_d.py: --world must be even (tp is 2)")
    result = run(args)
    misses = report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
