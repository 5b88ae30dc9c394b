"""Sharded checkpoint save and load (model + AdamW state) with torch.distributed.checkpoint:
composable_shard's state-dict API against torch FSDP2's, side by side in one run.

    python benchmarks/checkpoint.py [--world-size 2] [--blocks 4] [--rounds 10] [--warmup 1]
                                    [--no-fsync] [--dir DIR] [--json PATH] [--quick] [--library DIR]

``--quick`` (a smoke run) is ``--warmup 1 --rounds 2``. Needs the counting CPU allocator of
``benchmarks/memory.py`` (a C++ compiler and ``pip install ninja``; built once, cached).

[Note: Protocol]
  launch     as benchmarks/memory.py: the parent builds the counting allocator and picks a free
             port, then spawns W gloo ranks; each installs the allocator as its first action
             (before it creates a tensor) and validates it (1 MiB self-test), then
             torch.set_num_threads(1).
  build      both contenders live in every rank, built by memory.py's ``build()``: the standard
             GPT (benchmarks/model.py, --blocks), seed 1234, AdamW(lr=1e-3) after the API.
             fully_shard: ours per block, then root. torch_fsdp2: torch ``fully_shard`` per block,
             then root.
  train      one training step of each on the same per-rank batch (seed 5678 + rank), so AdamW
             has state; the two losses must agree. Then each contender's *full* model and
             optimizer state dict is taken on every rank and cloned: the reference.
  save       state dicts with sharded values (ours: ``get_model_state_dict(full=False)`` +
             ``get_optimizer_state_dict(full=False)``: ShardedSlice values; FSDP2: torch's
             ``get_state_dict`` (DTensor values)), then ``dcp.save`` into a fresh directory.
  perturb    (not measured) every parameter and every optimizer state tensor is zeroed in place,
             so a load that writes nowhere, or into a copy, cannot pass the check.
  load       fresh sharded state dicts, ``dcp.load``, then ours ``set_model_state_dict`` +
             ``set_optimizer_state_dict``, FSDP2 torch's ``set_state_dict``.
  verify     (not measured) the full model and optimizer state dicts must equal the reference
             exactly (``torch.equal``; every key, shape, dtype, scalar), on every rank; the ranks
             agree on the verdict and every rank aborts on a mismatch.
  cleanup    rank 0 records the checkpoint's size on disk and removes the directory; all
             directories live under one temporary directory that the parent removes at the end.
  rounds     --warmup + --rounds rounds; a round runs save, perturb, load, verify of each
             contender in turn, the order flipped every other round (A B, B A, ...) so neither
             always goes first; the warm-up rounds are verified but not reported.
  timing     perf_counter on every rank around the operation and a trailing dist.barrier()
             (after a barrier, outside); rank 0's figures are reported (the max over ranks too).
             min / median / max over the timed rounds; ratios fully_shard / torch_fsdp2 as the
             ratio of the medians and the median of the per-round ratios (paired).
  memory     the counting allocator's peak during the operation minus the live bytes at its
             start ("extra": what save/load allocates on top of the training state), max over
             ranks and timed rounds; "retained" = live after the operation (state dicts dropped,
             gc.collect()) minus live at its start, which must be 0. Both contenders share each
             rank, so the absolute peak of one is reported as "alone" = its training state
             (parameters + AdamW state, memory.py's ``held_storages``) + extra.
  ours only  each round also runs, for fully_shard only, the library's own ``save_checkpoint``
             (checksums, atomic publish) and, after the same perturbation, ``load_checkpoint``
             (verification, then an all-or-nothing load: it keeps a copy of the rank's own model
             shard and optimizer state while it runs, see [Note: All-or-nothing loads]), then the
             same verify; measured like save and load ("save_checkpoint", "load_checkpoint").
             --library DIR imports composable_shard from DIR (e.g. a worktree of an earlier
             commit): the before/after figures of a library change from one benchmark file.
  storage    DCP's default FileSystemWriter (one file per rank, fsync'ed; --no-fsync passes
             ``FileSystemWriter(path, sync_files=False)`` to both) under --dir (default: the
             system's temporary directory). Loads read files just written: the page cache.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# Nothing below may create a tensor at import time: ranks install the counting allocator first.
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks import counting_allocator as ca  # noqa: E402
from benchmarks.memory import DATA_SEED, MB, _free_port, build, held_storages  # noqa: E402

CONTENDERS = ("fully_shard", "torch_fsdp2")
OURS, THEIRS = CONTENDERS
TARGET = 1.00  # every figure: fully_shard / torch_fsdp2 <= 1.00
OPS = ("save", "load")
CKPT_OPS = ("save_checkpoint", "load_checkpoint")  # the library's own API, fully_shard only
LOSS_TOLERANCE = 1e-4


@dataclass
class Contender:
    """One API applied to one model in this rank, and what its rounds measured."""

    name: str
    model: torch.nn.Module
    optim: torch.optim.Optimizer
    reference: Dict[str, Any] = field(default_factory=dict)  # flattened, cloned full state dict
    ms: Dict[str, List[float]] = field(default_factory=lambda: {op: [] for op in OPS + CKPT_OPS})
    extra: Dict[str, List[int]] = field(default_factory=lambda: {op: [] for op in OPS + CKPT_OPS})
    retained: Dict[str, List[int]] = field(default_factory=lambda: {op: [] for op in OPS + CKPT_OPS})
    disk_bytes: List[int] = field(default_factory=list)


# ---------------------------------------------------------------------------- the two APIs
def sharded_state_dict(c: Contender) -> Dict[str, Any]:
    """What a training script hands to ``dcp.save``/``dcp.load``: sharded model and optimizer state."""
    if c.name == OURS:
        from composable_shard import get_model_state_dict, get_optimizer_state_dict
        return {"model": get_model_state_dict(c.model, full=False),
                "optim": get_optimizer_state_dict(c.model, c.optim, full=False)}
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, optim_sd = get_state_dict(c.model, c.optim)
    return {"model": model_sd, "optim": optim_sd}


def apply_state_dict(c: Contender, sd: Dict[str, Any]) -> None:
    """After ``dcp.load`` filled ``sd``: make the model and optimizer take it."""
    if c.name == OURS:
        from composable_shard import set_model_state_dict, set_optimizer_state_dict
        set_model_state_dict(c.model, sd["model"])
        set_optimizer_state_dict(c.model, c.optim, sd["optim"])
        return
    from torch.distributed.checkpoint.state_dict import set_state_dict
    set_state_dict(c.model, c.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def full_state_dict(c: Contender) -> Dict[str, Any]:
    """Full (gathered) model and optimizer state dicts, on every rank."""
    if c.name == OURS:
        from composable_shard import get_model_state_dict, get_optimizer_state_dict
        return {"model": get_model_state_dict(c.model, full=True),
                "optim": get_optimizer_state_dict(c.model, c.optim, full=True)}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    model_sd, optim_sd = get_state_dict(c.model, c.optim, options=StateDictOptions(full_state_dict=True))
    return {"model": model_sd, "optim": optim_sd}


def save(c: Contender, path: str, fsync: bool) -> None:
    import torch.distributed.checkpoint as dcp
    writer = None if fsync else dcp.FileSystemWriter(path, sync_files=False)
    dcp.save(sharded_state_dict(c), checkpoint_id=path, storage_writer=writer)


def load(c: Contender, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    sd = sharded_state_dict(c)
    dcp.load(sd, checkpoint_id=path)
    apply_state_dict(c, sd)


def perturb(c: Contender) -> None:
    """Zero every parameter and optimizer state tensor in place (step counters included)."""
    with torch.no_grad():
        for p in c.model.parameters():
            p.zero_()
        for state in c.optim.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    value.zero_()


# ---------------------------------------------------------------------------- the guard
def flatten(obj: Any, prefix: str = "") -> Dict[str, Any]:
    """Nested dicts/lists of a state dict as ``{"model/blocks.0.ln1.weight": value, ...}``."""
    if isinstance(obj, Mapping):
        out: Dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}/{k}" if prefix else str(k)))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: obj}


def reference_of(c: Contender) -> Dict[str, Any]:
    """The full state dict, flattened, every tensor cloned (full state dicts may alias live
    tensors: an optimizer's step counter, or parameters at W=1)."""
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
            for k, v in flatten(full_state_dict(c)).items()}


def differences(want: Dict[str, Any], got: Dict[str, Any]) -> List[str]:
    """Every way ``got`` differs from ``want`` (keys, shapes, dtypes, values), named."""
    problems = [f"missing {k}" for k in want if k not in got] + [f"unexpected {k}" for k in got if k not in want]
    for k in want.keys() & got.keys():
        a, b = want[k], got[k]
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            problems.append(f"{k}: {type(a).__name__} saved, {type(b).__name__} after load")
        elif not isinstance(a, torch.Tensor):
            if a != b:
                problems.append(f"{k}: {a!r} saved, {b!r} after load")
        elif a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"{k}: {tuple(a.shape)} {a.dtype} saved, {tuple(b.shape)} {b.dtype} after load")
        elif not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            problems.append(f"{k}: values differ (max |diff| {diff:.3e})")
    return sorted(problems)


def verify(c: Contender, what: str) -> None:
    """Abort on every rank unless the full state dict equals the reference on every rank."""
    import torch.distributed as dist
    problems = differences(c.reference, flatten(full_state_dict(c)))
    bad = torch.tensor([len(problems)], dtype=torch.int64)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item():
        shown = "\n  ".join(problems[:20]) or "(this rank matched; another rank did not)"
        raise RuntimeError(f"CHECKPOINT MISMATCH ({c.name}, {what}): after load the full state dict differs from "
                           f"the saved one on rank {dist.get_rank()} ({len(problems)} entries):\n  {shown}")


def max_difference(a: Dict[str, Any], b: Dict[str, Any]) -> Tuple[float, int]:
    """Largest |a - b| over the floating tensors both references hold, and how many keys they share."""
    common = [k for k in a.keys() & b.keys() if isinstance(a[k], torch.Tensor) and isinstance(b[k], torch.Tensor)
              and a[k].shape == b[k].shape and a[k].is_floating_point()]
    worst = max(((a[k].double() - b[k].double()).abs().max().item() for k in common if a[k].numel()), default=0.0)
    return worst, len(common)


# ---------------------------------------------------------------------------- one rank
def measured(fn: Callable[[], None]) -> Tuple[float, int, int]:
    """(ms, peak bytes above the start, bytes retained) of ``fn`` plus a trailing barrier."""
    import torch.distributed as dist
    gc.collect()
    dist.barrier()
    start = ca.live()
    ca.reset_peak()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    ms = (time.perf_counter() - t0) * 1e3
    extra = ca.peak() - start
    gc.collect()
    return ms, extra, ca.live() - start


def one_round(c: Contender, path: str, fsync: bool, record: bool, rank: int) -> None:
    import torch.distributed as dist
    figures = {"save": measured(lambda: save(c, path, fsync))}
    if rank == 0:
        c.disk_bytes.append(sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs))
    perturb(c)
    figures["load"] = measured(lambda: load(c, path))
    verify(c, f"checkpoint {os.path.basename(path)}")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path)
    if c.name == OURS:  # the library's own checkpoint API (no FSDP2 counterpart)
        from composable_shard import load_checkpoint, save_checkpoint
        published = path + "_published"
        figures["save_checkpoint"] = measured(lambda: save_checkpoint(published, c.model, c.optim))
        perturb(c)
        figures["load_checkpoint"] = measured(lambda: load_checkpoint(published, c.model, c.optim))
        verify(c, f"checkpoint {os.path.basename(published)}")
        dist.barrier()
        if rank == 0:
            shutil.rmtree(published)
    if record:
        for op, (ms, extra, retained) in figures.items():
            c.ms[op].append(ms)
            c.extra[op].append(extra)
            c.retained[op].append(retained)


def train_one_step(c: Contender, batch: Tuple[torch.Tensor, torch.Tensor]) -> float:
    import torch.distributed as dist
    import torch.nn.functional as F
    tokens, targets = batch
    logits = c.model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    c.optim.step()
    c.optim.zero_grad(set_to_none=True)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def worker(rank: int, args: argparse.Namespace, so_path: str, port: int, base: str) -> None:
    ca.install(so_path)  # first: before this process creates any tensor
    validation = ca.validate()
    torch.set_num_threads(1)
    import torch.distributed as dist
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size, timeout=timedelta(seconds=600))
    try:
        _worker(rank, args, base, validation)
    finally:
        gc.collect()  # torch's FSDP2/DDP hold their groups: free them before the groups go ([Note: Process groups held weakly])
        dist.destroy_process_group()


def _worker(rank: int, args: argparse.Namespace, base: str, validation: Dict[str, Any]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.model import SEQ, VOCAB, make_batch

    mesh = init_device_mesh("cpu", (args.world_size,))
    batch = make_batch(args.batch, SEQ, VOCAB, torch.Generator().manual_seed(DATA_SEED + rank))
    cs, info = [], {"validation_ok": validation["ok"], "losses": {}, "held": {}}
    for name in CONTENDERS:
        _, model, optim, _ = build(name, args.blocks, False, "ours", torch.device("cpu"), mesh)
        c = Contender(name, model, optim)
        info["losses"][name] = train_one_step(c, batch)
        held = held_storages(name, model, model, optim)
        info["held"][name] = held["params"] + held["grads"] + held["optim"]
        c.reference = reference_of(c)
        cs.append(c)
    info["max_diff"], info["shared_keys"] = max_difference(cs[0].reference, cs[1].reference)
    loadavg = [os.getloadavg()[0]]
    for r in range(args.warmup + args.rounds):
        for c in (cs if r % 2 == 0 else cs[::-1]):
            one_round(c, os.path.join(base, f"{c.name}_round{r}"), args.fsync, record=r >= args.warmup, rank=rank)
    loadavg.append(os.getloadavg()[0])
    report_rank0(rank, args, cs, info, loadavg)


# ---------------------------------------------------------------------------- report
def _over_ranks(values: List[float], op: Any) -> List[float]:
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()


def _spread(xs: List[float], scale: float = 1.0) -> Dict[str, float]:
    return {"min": min(xs) / scale, "median": statistics.median(xs) / scale, "max": max(xs) / scale}


def report_rank0(rank: int, args: argparse.Namespace, cs: List[Contender], info: Dict[str, Any],
                 loadavg: List[float]) -> None:
    """Gather the figures over ranks (every rank takes part), print and save them on rank 0."""
    import torch.distributed as dist
    rows: Dict[str, Dict[str, Any]] = {}
    valid = _over_ranks([0.0 if info["validation_ok"] else 1.0], dist.ReduceOp.MAX)[0] == 0
    for c in cs:
        row: Dict[str, Any] = {"held_bytes": info["held"][c.name], "loss": info["losses"][c.name],
                               "disk_bytes": c.disk_bytes[0] if c.disk_bytes else 0}
        for op in OPS:
            row[f"{op}_ms"] = _spread(c.ms[op])
            row[f"{op}_ms_rounds"] = c.ms[op]
            row[f"{op}_ms_max_rank"] = _spread(_over_ranks(c.ms[op], dist.ReduceOp.MAX))
            extra = _over_ranks([float(x) for x in c.extra[op]], dist.ReduceOp.MAX)
            row[f"{op}_extra_bytes"] = _spread(extra)
            row[f"{op}_retained_bytes"] = max(_over_ranks([float(x) for x in c.retained[op]], dist.ReduceOp.MAX))
            row[f"{op}_alone_bytes"] = info["held"][c.name] + max(extra)
        for op in CKPT_OPS:
            if c.ms[op]:  # the same contenders on every rank: every rank takes part
                row[f"{op}_ms"] = _spread(c.ms[op])
                row[f"{op}_extra_bytes"] = _spread(_over_ranks([float(x) for x in c.extra[op]], dist.ReduceOp.MAX))
                row[f"{op}_retained_bytes"] = max(_over_ranks([float(x) for x in c.retained[op]], dist.ReduceOp.MAX))
        rows[c.name] = row
    if rank != 0:
        return
    result = print_report(args, cs, rows, info, loadavg, valid)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {args.json}")
    sys.stdout.flush()


def print_report(args: argparse.Namespace, cs: List[Contender], rows: Dict[str, Dict[str, Any]],
                 info: Dict[str, Any], loadavg: List[float], valid: bool) -> Dict[str, Any]:
    from benchmarks.model import GPT
    n_params = sum(p.numel() for p in GPT(blocks=args.blocks).parameters())
    print(f"\nworkload: GPT blocks={args.blocks} ({n_params:,} parameters), model + AdamW state after one step, "
          f"W={args.world_size} gloo, torch {torch.__version__}; {args.warmup} warm-up + {args.rounds} timed rounds "
          f"(contenders alternate, order flipped every round); fsync {'on' if args.fsync else 'off'}; "
          f"load average {loadavg[0]:.1f} at start, {loadavg[1]:.1f} at end ({os.cpu_count()} CPUs)")
    import composable_shard
    print(f"composable_shard from {os.path.dirname(os.path.dirname(os.path.abspath(composable_shard.__file__)))}")
    print(f"allocator validation (1 MiB self-test, every rank): {'ok' if valid else 'FAILED'}; "
          f"every save/load verified: full state dict after load == saved (exact)")
    print("training step losses (mean over ranks): " + ", ".join(f"{n} {v:.6f}" for n, v in info["losses"].items())
          + f"; max |diff| between the two contenders' full state dicts {info['max_diff']:.2e} over "
            f"{info['shared_keys']} tensors")
    hdr = (f"\n{'contender':<13}{'save ms min/med/max':>24}{'load ms min/med/max':>24}"
           f"{'save extra MB':>15}{'load extra MB':>15}{'state MB':>10}{'disk MB':>9}")
    print(hdr)
    print("-" * (len(hdr) - 1))
    for name, row in rows.items():
        s, lo = row["save_ms"], row["load_ms"]
        print(f"{name:<13}{s['min']:>8.1f}{s['median']:>8.1f}{s['max']:>8.1f}{lo['min']:>8.1f}{lo['median']:>8.1f}"
              f"{lo['max']:>8.1f}{row['save_extra_bytes']['max'] / MB:>15.2f}{row['load_extra_bytes']['max'] / MB:>15.2f}"
              f"{row['held_bytes'] / MB:>10.2f}{row['disk_bytes'] / MB:>9.2f}")
    print("(ms: rank 0; extra: peak tensor bytes above the live bytes at the operation's start, max over ranks and "
          "rounds; state: parameters + AdamW state per rank; disk: the checkpoint directory)")
    for name, row in rows.items():
        leaks = {op: row[f"{op}_retained_bytes"] for op in OPS if row[f"{op}_retained_bytes"]}
        print(f"  {name:<13} slowest rank's median: save {row['save_ms_max_rank']['median']:.1f} ms, load "
              f"{row['load_ms_max_rank']['median']:.1f} ms; alone peak (state + extra): save "
              f"{row['save_alone_bytes'] / MB:.2f} MB, load {row['load_alone_bytes'] / MB:.2f} MB; retained after: "
              + (", ".join(f"{op} {v:,.0f} B" for op, v in leaks.items()) + "  (NOT FREED)" if leaks else "0 B"))
    for name, row in rows.items():
        for op in CKPT_OPS:
            if f"{op}_ms" in row:
                t, extra = row[f"{op}_ms"], row[f"{op}_extra_bytes"]
                print(f"  {name:<13} {op}: ms {t['min']:.1f} / {t['median']:.1f} / {t['max']:.1f}; extra "
                      f"{extra['max'] / MB:.2f} MB (min {extra['min'] / MB:.2f}); retained after "
                      f"{row[f'{op}_retained_bytes']:,.0f} B")
    ratios = print_ratios(cs, rows)
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__, "world_size": args.world_size,
            "blocks": args.blocks, "rounds": args.rounds, "warmup": args.warmup, "fsync": args.fsync,
            "loadavg": loadavg, "allocator_ok": valid, **{k: v for k, v in info.items() if k != "validation_ok"},
            "contenders": rows, "ratios": ratios, "target": TARGET}


def print_ratios(cs: List[Contender], rows: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    by_name = {c.name: c for c in cs}
    ours, theirs = rows[OURS], rows[THEIRS]
    print(f"\nratios {OURS} / {THEIRS} (same run; target <= {TARGET:.2f})")
    ratios: Dict[str, Dict[str, float]] = {}
    for op in OPS:
        paired = statistics.median(a / b for a, b in zip(by_name[OURS].ms[op], by_name[THEIRS].ms[op]))
        ratios[f"{op}_time"] = {"value": ours[f"{op}_ms"]["median"] / theirs[f"{op}_ms"]["median"], "paired": paired}
        ratios[f"{op}_extra_bytes"] = {"value": ours[f"{op}_extra_bytes"]["max"] / max(theirs[f"{op}_extra_bytes"]["max"], 1),
                                       "bytes": ours[f"{op}_extra_bytes"]["max"] - theirs[f"{op}_extra_bytes"]["max"]}
        ratios[f"{op}_alone_bytes"] = {"value": ours[f"{op}_alone_bytes"] / theirs[f"{op}_alone_bytes"],
                                       "bytes": ours[f"{op}_alone_bytes"] - theirs[f"{op}_alone_bytes"]}
    for key, r in ratios.items():
        paired = f"   (median of per-round ratios {r['paired']:.3f})" if "paired" in r else ""
        paired = f"   ({r['bytes']:+,.0f} B)" if "bytes" in r else paired
        print(f"  {key:<20}{r['value']:>7.3f}   {'ok' if r['value'] <= TARGET else 'MISSES TARGET':<14}{paired}")
    return ratios


# ---------------------------------------------------------------------------- launch
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--rounds", type=int, default=10, help="timed rounds (each: save + load of every contender)")
    p.add_argument("--warmup", type=int, default=1, help="rounds first, verified but not reported")
    p.add_argument("--batch", type=int, default=4, help="batch per rank of the training step")
    p.add_argument("--no-fsync", dest="fsync", action="store_false",
                   help="FileSystemWriter(sync_files=False) for both contenders (default: DCP's, which fsyncs)")
    p.add_argument("--dir", default="", help="where the checkpoints are written (default: the system temp dir)")
    p.add_argument("--json", default="", help="also write the results to this path")
    p.add_argument("--quick", action="store_true", help="smoke run: --warmup 1 --rounds 2")
    p.add_argument("--library", default="", help="import composable_shard from this directory (e.g. a worktree)")
    args = p.parse_args(argv)
    if args.quick:
        args.warmup, args.rounds = 1, 2
    if args.rounds < 1 or args.warmup < 0:
        p.error("--rounds must be >= 1 and --warmup >= 0")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.library:  # spawned ranks inherit sys.path
        sys.path.insert(0, os.path.abspath(args.library))
    t0 = time.perf_counter()
    so_path = ca.build()
    print(f"counting allocator: {so_path} ({time.perf_counter() - t0:.1f} s to build/load)")
    with tempfile.TemporaryDirectory(prefix="cs_ckpt_", dir=args.dir or None) as base:
        port = _free_port()
        print(f"spawning {args.world_size} gloo rank(s) on port {port}: {', '.join(CONTENDERS)}; checkpoints under {base}")
        sys.stdout.flush()
        mp.spawn(worker, args=(args, so_path, port, base), nprocs=args.world_size, join=True)  # type: ignore[attr-defined]  # re-exported by torch


if __name__ == "__main__":
    main()
