"""The standard CPU workload of BENCHMARK.md: every contender side by side in one run.

    python benchmarks/run.py --world-size 2 [--blocks 4] [--steps 10] [--warmup 3]
                             [--contenders local,ddp,torch_fsdp1,torch_fsdp2,fully_shard,replicate]
                             [--checkpoint] [--compile aot_eager|inductor]
                             [--json PATH] [--profile fully_shard,torch_fsdp2]

[Note: Protocol]
  launch     the parent picks a free port and spawns W gloo ranks (torch.multiprocessing),
             each with torch.set_num_threads(1).
  build      every contender's model is built once, from the same seed (identical init on
             every rank and in every contender), the API applied, then AdamW(lr=1e-3) on
             model.parameters().
  data       one list of batches per rank (seed per rank), the same list for every contender,
             so all distributed contenders see identical data and must end at the same loss.
  warm-up    --warmup rounds; a round runs one step of each contender in turn. During the
             last warm-up round ours run under record_collectives() (bytes per kind per step)
             and every contender's gradient bytes are measured between backward and step.
  timed      --steps rounds, contenders alternating (A B C A B C ...). A step is forward,
             backward, optimizer step, zero_grad, dist.barrier(), timed with perf_counter on
             every rank around all of it; rank 0's medians are reported.
  local      runs with no communication at all; by default on every rank at once (each rank
             an independent single-process run of the same per-rank workload, batch 4, so
             the cores are as busy as for the distributed contenders); --local-on rank0 runs
             it on rank 0 only while the others wait at the barrier.
  losses     per step the loss averaged over ranks (computed after the timed region); every
             distributed contender is compared with the first one, a difference > 1e-4
             is flagged loudly. local trains on rank 0's data only (W > 1) and is shown apart.
  profile    --profile NAMES: after the report, --profile-steps more steps of each named
             contender on every rank, profiled on rank 0 (cProfile, or torch.profiler with
             --profiler torch); the top functions are printed (raw files: --profile-dump DIR).
"""

from __future__ import annotations

import argparse
import gc
import cProfile
import io
import json
import math
import os
import pstats
import socket
import statistics
import sys
import time
import types
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.model import GPT, SEQ, VOCAB, Block, make_batch  # noqa: E402

ALL_CONTENDERS = ["local", "ddp", "torch_fsdp1", "torch_fsdp2", "fully_shard", "replicate"]
OURS = ("fully_shard", "replicate")
LOSS_TOLERANCE = 1e-4
INIT_SEED = 1234
DATA_SEED = 5678

# (numerator, denominator, target, world sizes where it applies)
RATIOS: List[Tuple[str, str, float, Optional[int]]] = [
    ("fully_shard", "torch_fsdp2", 0.85, None),
    ("fully_shard", "ddp", 1.10, None),
    ("replicate", "ddp", 1.02, None),
    ("fully_shard", "local", 1.05, 1),
]


# ---------------------------------------------------------------------------- contenders
@dataclass
class Contender:
    """One API applied to one model: ``module`` is what forward is called on (a wrapper for
    DDP/FSDP1), ``model`` the underlying GPT."""

    name: str
    module: nn.Module
    model: nn.Module
    optim: torch.optim.Optimizer
    times: Dict[str, List[float]] = field(default_factory=lambda: {k: [] for k in ("fwd", "bwd", "opt", "barrier", "step")})
    losses: List[float] = field(default_factory=list)
    info: Dict[str, Any] = field(default_factory=dict)


def import_replicate() -> Tuple[Optional[Callable[..., Any]], str]:
    """Our ``replicate`` or ``(None, why)``. ``from composable_shard import replicate`` gives
    the submodule when the package does not export the function yet; take the function then."""
    try:
        from composable_shard import replicate as imported
    except Exception as exc:  # being written concurrently: skip, don't crash
        return None, f"{type(exc).__name__}: {exc}"
    rep: Any = imported
    if isinstance(rep, types.ModuleType):
        rep = getattr(rep, "replicate", None)
    if not callable(rep):
        return None, "composable_shard.replicate is not a callable"
    return rep, ""


def _activation_checkpointing(name: str, model: nn.Module) -> None:
    """``--checkpoint``: every block recomputes its activations in backward. Ours use the
    library's ``checkpoint``; torch's contenders torch's composable ``checkpoint`` (the same
    hook-based, non-reentrant design), applied before the data-parallel API."""
    if name in OURS:
        from composable_shard import checkpoint
    else:
        from torch.distributed._composable import checkpoint  # type: ignore[no-redef]  # torch's, for its contenders
    for block in model.blocks:
        checkpoint(block)


def build_contender(name: str, blocks: int, world_size: int, mesh: Any, activation_checkpointing: bool = False,
                    compile_backend: str = "") -> Contender:
    torch.manual_seed(INIT_SEED)
    model = GPT(blocks=blocks)
    module: nn.Module = model
    if activation_checkpointing:
        _activation_checkpointing(name, model)
    if name == "local":
        pass
    elif name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        module = DDP(model)
    elif name == "torch_fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        module = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
                      device_id=torch.device("cpu"))
    elif name == "torch_fsdp2":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        for block in model.blocks:
            torch_fully_shard(block, mesh=mesh)
        torch_fully_shard(model, mesh=mesh)
    elif name == "fully_shard":
        from composable_shard import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif name == "replicate":
        rep, why = import_replicate()
        if rep is None:
            raise RuntimeError(f"replicate unavailable: {why}")
        rep(model)
    else:
        raise ValueError(f"unknown contender {name!r}; choose from {ALL_CONTENDERS}")
    if compile_backend:  # --compile: each block's forward compiled after the API is applied
        for block in model.blocks:
            block.compile(backend=compile_backend)
    optim = torch.optim.AdamW(module.parameters(), lr=1e-3)
    return Contender(name, module, model, optim)


# ---------------------------------------------------------------------------- byte accounting
def _local_bytes(t: Optional[torch.Tensor]) -> int:
    if t is None:
        return 0
    if hasattr(t, "to_local"):  # DTensor (FSDP2)
        t = t.to_local()
    return t.numel() * t.element_size()


def _fsdp1_flat_params(module: nn.Module) -> List[nn.Parameter]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    flat = []
    for m in FSDP.fsdp_modules(module):
        handle = getattr(m, "_handle", None)
        if handle is not None:
            flat.append(handle.flat_param)
    return flat


def _our_handles(model: nn.Module) -> List[Any]:
    from composable_shard._traversal_utils import _get_fsdp_handles
    return _get_fsdp_handles(model)


def param_bytes(c: Contender) -> Dict[str, int]:
    """Parameter bytes this rank holds: ``params`` as seen through ``model.parameters()``
    (local shards), plus ``flat`` (padded flat shards) and ``expected`` for flat-param APIs."""
    out = {"params": sum(_local_bytes(p) for p in c.model.parameters())}
    if c.name == "torch_fsdp1":
        out["flat"] = sum(_local_bytes(fp) for fp in _fsdp1_flat_params(c.module))
    elif c.name == "fully_shard":
        handles = _our_handles(c.model)
        out["flat"] = sum(_local_bytes(fp) for h in handles for fp in h.flat_params)
        out["expected"] = sum(
            math.ceil(fp._unpadded_unsharded_size.numel() / h.world_size) * fp.element_size()
            for h in handles for fp in h.flat_params)
        out["handles"] = len(handles)
        # collectives one FULL_SHARD step must issue (BENCHMARK.md): 2 all-gathers per group
        # that does not alias its shard (W > 1), 1 for the root's (kept unsharded from its
        # forward to its backward), 1 reduce-scatter per such group that requires grad, and
        # one small all-reduce agreeing on which parameters got a gradient (W > 1)
        root = handles[0] if handles and handles[0].fqn == "" else None
        gathered = [(h, g) for h in handles for g in h.groups if not g.aliases_shard and h.world_size > 1]
        out["expected_all_gathers"] = sum(1 if h is root else 2 for h, _ in gathered)
        out["expected_reduce_scatters"] = sum(1 for _, g in gathered if g.requires_grad)
        out["expected_all_reduces"] = 1 if gathered else 0
    return out


def grad_bytes(c: Contender) -> int:
    """Gradient bytes this rank holds right after backward (local shards for sharded APIs)."""
    if c.name == "torch_fsdp1":
        return sum(_local_bytes(fp.grad) for fp in _fsdp1_flat_params(c.module))
    if c.name == "fully_shard":
        return sum(_local_bytes(g.sharded_grad) for h in _our_handles(c.model) for g in h.groups)
    return sum(_local_bytes(p.grad) for p in c.model.parameters())


def optim_bytes(c: Contender) -> int:
    return sum(_local_bytes(v) for s in c.optim.state.values() for v in s.values() if isinstance(v, torch.Tensor))


# ---------------------------------------------------------------------------- the step
def run_step(c: Contender, tokens: torch.Tensor, targets: torch.Tensor, *, active: bool = True,
             after_backward: Optional[Callable[[Contender], None]] = None, record: bool = True) -> None:
    """Forward, backward, optimizer step, zero_grad, barrier; timed (rank-local perf_counter)."""
    t0 = time.perf_counter()
    if active:
        logits = c.module(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if after_backward is not None:
            after_backward(c)
            t2 = time.perf_counter()  # accounting is not part of the step
        c.optim.step()
        c.optim.zero_grad()
        t3 = time.perf_counter()
    else:
        t1 = t2 = t3 = t0
    dist.barrier()
    t4 = time.perf_counter()
    if record:
        for key, value in (("fwd", t1 - t0), ("bwd", t2 - t1), ("opt", t3 - t2), ("barrier", t4 - t3), ("step", t4 - t0)):
            c.times[key].append(value * 1e3)
        c.losses.append(loss.item() if active else float("nan"))


# ---------------------------------------------------------------------------- one rank
def worker(rank: int, args: argparse.Namespace, port: int, contenders: List[str]) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    W = args.world_size
    dist.init_process_group("gloo", rank=rank, world_size=W, timeout=timedelta(seconds=600))
    try:
        _worker(rank, W, args, contenders)
    finally:
        gc.collect()  # torch's FSDP2/DDP hold their groups: free them before the groups go ([Note: Process groups held weakly])
        dist.destroy_process_group()


def _worker(rank: int, W: int, args: argparse.Namespace, names: List[str]) -> None:
    mesh = None
    if "torch_fsdp2" in names:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (W,))
    load_start = list(os.getloadavg())
    t_build = time.perf_counter()
    cs = [build_contender(n, args.blocks, W, mesh, args.checkpoint, args.compile) for n in names]
    t_build = time.perf_counter() - t_build
    for c in cs:
        c.info["param_bytes"] = param_bytes(c)
    gen = torch.Generator().manual_seed(DATA_SEED + rank)
    batches = [make_batch(args.batch, SEQ, VOCAB, gen) for _ in range(args.warmup + args.steps)]
    local_active = args.local_on == "all" or rank == 0

    def measure_grads(c: Contender) -> None:
        c.info["grad_bytes"] = grad_bytes(c)

    from composable_shard._collectives import record_collectives
    t_warm = time.perf_counter()
    for i in range(args.warmup):
        last = i == args.warmup - 1
        for c in cs:
            active = c.name != "local" or local_active
            if last and c.name in OURS:
                with record_collectives() as rec:
                    run_step(c, *batches[i], active=active, after_backward=measure_grads, record=False)
                c.info["collectives"] = {k: {"count": rec.count(k), "bytes": rec.nbytes(k)}
                                         for k in sorted({r.kind for r in rec.records})}
            else:
                run_step(c, *batches[i], active=active, after_backward=measure_grads if last else None, record=False)
    t_warm = time.perf_counter() - t_warm

    t_timed = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        for c in cs:
            run_step(c, *batches[i], active=c.name != "local" or local_active)
    t_timed = time.perf_counter() - t_timed
    for c in cs:
        c.info["optim_bytes"] = optim_bytes(c)

    # Losses averaged over ranks, per step and contender (local: rank 0's own loss).
    loss_t = torch.tensor([c.losses for c in cs], dtype=torch.float64)
    dist.all_reduce(loss_t)
    loss_t /= W
    losses = {c.name: (c.losses if c.name == "local" else loss_t[k].tolist()) for k, c in enumerate(cs)}
    # Max step time over ranks, per step (rank 0's is reported; this checks it is representative).
    step_t = torch.tensor([c.times["step"] for c in cs], dtype=torch.float64)
    dist.all_reduce(step_t, op=dist.ReduceOp.MAX)

    if rank == 0:
        result = report(args, cs, losses, step_t, {"build_s": t_build, "warmup_s": t_warm, "timed_s": t_timed,
                                                        "loadavg_start": load_start})
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
            print(f"\nwrote {args.json}")
        sys.stdout.flush()

    for name in [n for n in args.profile.split(",") if n]:
        by_name = {c.name: c for c in cs}
        if name not in by_name:
            if rank == 0:
                print(f"\n(profile: no contender {name!r} in this run)")
            continue
        profile(rank, args, by_name[name], batches, local_active)


def profile(rank: int, args: argparse.Namespace, c: Contender, batches: List[Tuple[torch.Tensor, torch.Tensor]],
            local_active: bool) -> None:
    active = c.name != "local" or local_active
    steps = args.profile_steps
    if rank != 0:
        for i in range(steps):
            run_step(c, *batches[i % len(batches)], active=active, record=False)
        return
    print(f"\n=== profile: {c.name}, {steps} steps on rank 0 ({args.profiler}) ===")
    if args.profiler == "torch":
        from torch.profiler import ProfilerActivity, profile as tprofile
        with tprofile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
            for i in range(steps):
                run_step(c, *batches[i % len(batches)], active=active, record=False)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_top))
        if args.profile_dump:
            os.makedirs(args.profile_dump, exist_ok=True)
            prof.export_chrome_trace(os.path.join(args.profile_dump, f"{c.name}.json"))
        return
    prof = cProfile.Profile()
    prof.enable()
    for i in range(steps):
        run_step(c, *batches[i % len(batches)], active=active, record=False)
    prof.disable()
    if args.profile_dump:
        os.makedirs(args.profile_dump, exist_ok=True)
        prof.dump_stats(os.path.join(args.profile_dump, f"{c.name}.prof"))
    for sort in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).strip_dirs().sort_stats(sort).print_stats(args.profile_top)
        text = s.getvalue()
        print(f"--- sorted by {sort} ---")
        print(text[text.find("   ncalls"):] if "   ncalls" in text else text)
    sys.stdout.flush()


# ---------------------------------------------------------------------------- report
def _median(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(args: argparse.Namespace, cs: List[Contender], losses: Dict[str, List[float]], step_max: torch.Tensor,
           timing: Dict[str, Any]) -> Dict[str, Any]:
    W = args.world_size
    med = {c.name: _median(c.times["step"]) for c in cs}
    variant = "".join([", activation checkpointing per block" if args.checkpoint else "",
                       f", torch.compile per block ({args.compile})" if args.compile else ""])
    print(f"\nworkload: GPT blocks={args.blocks}{variant} width=256 vocab={VOCAB} seq={SEQ} batch={args.batch}/rank, "
          f"W={W} gloo, {args.warmup} warm-up + {args.steps} timed rounds (contenders alternate), "
          f"torch {torch.__version__}, local on {args.local_on}")
    timing["loadavg_end"] = list(os.getloadavg())
    print(f"params: {sum(p.numel() for p in GPT(blocks=args.blocks).parameters()):,}   "
          f"build {timing['build_s']:.1f}s  warm-up {timing['warmup_s']:.1f}s  timed {timing['timed_s']:.1f}s   "
          f"load average {timing['loadavg_start'][0]:.1f} at start, {timing['loadavg_end'][0]:.1f} at end "
          f"({os.cpu_count()} CPUs; > CPUs means other processes share the cores)\n")

    hdr = (f"{'contender':<13}{'median ms':>10}{'min':>8}{'max':>8}{'max-rank med':>13}"
           f"{'fwd':>8}{'bwd':>8}{'opt':>8}{'barrier':>9}{'final loss':>12}")
    print(hdr)
    print("-" * len(hdr))
    rows = {}
    for k, c in enumerate(cs):
        t = c.times
        rmax = _median(step_max[k].tolist())
        final = losses[c.name][-1] if losses[c.name] else float("nan")
        print(f"{c.name:<13}{med[c.name]:>10.1f}{min(t['step']):>8.1f}{max(t['step']):>8.1f}{rmax:>13.1f}"
              f"{_median(t['fwd']):>8.1f}{_median(t['bwd']):>8.1f}{_median(t['opt']):>8.1f}"
              f"{_median(t['barrier']):>9.1f}{final:>12.6f}")
        rows[c.name] = {
            "median_ms": med[c.name], "min_ms": min(t["step"]), "max_ms": max(t["step"]),
            "max_over_ranks_median_ms": rmax,
            "phases_median_ms": {p: _median(t[p]) for p in ("fwd", "bwd", "opt", "barrier")},
            "step_ms": t["step"], "losses_rank_mean": losses[c.name], **c.info,
        }

    print("\nratios (same run; ratio of medians, and the median of the per-round ratios, which pairs steps "
          "taken back to back)")
    ratios = {}
    for num, den, target, only_w in RATIOS:
        if only_w is not None and W != only_w:
            continue
        key = f"{num}/{den}"
        if num in med and den in med:
            r = med[num] / med[den]
            by_name = {c.name: c for c in cs}
            paired = _median([a / b for a, b in zip(by_name[num].times["step"], by_name[den].times["step"])])
            ok = "ok" if r <= target else "MISSES TARGET"
            print(f"  {key:<24}{r:>7.3f}   target <= {target:.2f}   {ok:<14}(median of per-round ratios {paired:.3f})")
            ratios[key] = {"value": r, "paired_median": paired, "target": target, "met": r <= target}
        else:
            print(f"  {key:<24}{'n/a':>7}   target <= {target:.2f}   (contender missing)")

    print("\nbytes held per rank (parameters via model.parameters(); flat = padded flat shards; "
          "grads right after backward; AdamW state)")
    for c in cs:
        pb = c.info["param_bytes"]
        extra = ""
        if "flat" in pb:
            extra += f"  flat {pb['flat']:>11,}"
        if "expected" in pb:
            extra += f"  (ceil(N/W) per handle: {pb['expected']:,} over {pb['handles']} handles" \
                     f"{', ok' if pb['flat'] == pb['expected'] else ', MISMATCH'})"
        print(f"  {c.name:<13} params {pb['params']:>11,}  grads {c.info.get('grad_bytes', 0):>11,}  "
              f"optim {c.info.get('optim_bytes', 0):>11,}{extra}")

    print("\ncollectives of ours, one step (last warm-up step, this rank" +
          ("; it is the first step, so it includes lazy init's and the first iteration's agreement checks)"
           if args.warmup == 1 else ")"))
    for c in cs:
        if "collectives" not in c.info:
            continue
        parts = [f"{k} x{v['count']} {v['bytes']:,} B" for k, v in c.info["collectives"].items()]
        line = f"  {c.name:<13}" + ("; ".join(parts) if parts else "none")
        if c.name == "fully_shard":
            pb = c.info["param_bytes"]
            eag, ers = pb["expected_all_gathers"], pb["expected_reduce_scatters"]
            ear = pb["expected_all_reduces"]
            ag = c.info["collectives"].get("all_gather", {}).get("count", 0)
            rs = c.info["collectives"].get("reduce_scatter", {}).get("count", 0)
            ar = c.info["collectives"].get("all_reduce", {}).get("count", 0)
            first_step = {"all_gather_json", "exchange"} if args.warmup == 1 else set()
            allowed = {"all_gather", "reduce_scatter", "all_reduce"} | first_step
            expect_ok = ag == eag and rs == ers and ar == ear and set(c.info["collectives"]) <= allowed
            line += (f"   [expected {eag} all_gather + {ers} reduce_scatter + {ear} all_reduce (used parameters; "
                     f"{pb['handles']} handles"
                     f"{'; W=1: shards alias, nothing to gather' if W == 1 else ''}): {'ok' if expect_ok else 'MISMATCH'}]")
        print(line)

    print("\nlosses (mean over ranks) per timed step")
    dist_names = [c.name for c in cs if c.name != "local"]
    mismatch = []
    for c in cs:
        print(f"  {c.name:<13}" + " ".join(f"{x:.6f}" for x in losses[c.name]))
    if dist_names:
        ref = dist_names[0]
        for n in dist_names[1:]:
            diff = max(abs(a - b) for a, b in zip(losses[ref], losses[n])) if losses[n] else float("nan")
            fdiff = abs(losses[ref][-1] - losses[n][-1])
            status = "ok" if fdiff <= LOSS_TOLERANCE and diff <= LOSS_TOLERANCE else "MISMATCH"
            print(f"  {n} vs {ref}: final |diff| {fdiff:.2e}, max over steps {diff:.2e}  {status}")
            if status != "ok":
                mismatch.append(n)
    if "local" in losses and W == 1 and dist_names:
        fdiff = abs(losses["local"][-1] - losses[dist_names[0]][-1])
        print(f"  local vs {dist_names[0]} (W=1, same data): final |diff| {fdiff:.2e}")
    if mismatch:
        bar = "!" * 78
        print(f"\n{bar}\n!!! LOSS MISMATCH > {LOSS_TOLERANCE}: {', '.join(mismatch)} vs {dist_names[0]}\n{bar}")

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__, "world_size": W,
        "blocks": args.blocks, "batch_per_rank": args.batch, "seq": SEQ, "warmup": args.warmup,
        "activation_checkpointing": args.checkpoint, "compile": args.compile,
        "steps": args.steps, "local_on": args.local_on, "timing_s": timing, "contenders": rows,
        "ratios": ratios, "loss_mismatch": mismatch, "skipped": args.skipped,
    }


# ---------------------------------------------------------------------------- launch
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="timed rounds")
    p.add_argument("--warmup", type=int, default=3, help="warm-up rounds (>= 1: bytes are measured in the last)")
    p.add_argument("--batch", type=int, default=4, help="batch per rank")
    p.add_argument("--contenders", default=",".join(ALL_CONTENDERS),
                   help="comma- or space-separated subset of " + ",".join(ALL_CONTENDERS))
    p.add_argument("--local-on", choices=("all", "rank0"), default="all",
                   help="run `local` on every rank at once (default) or on rank 0 only")
    p.add_argument("--checkpoint", action="store_true",
                   help="activation checkpointing on every block, for every contender")
    p.add_argument("--compile", default="", metavar="BACKEND",
                   help="torch.compile every block after the API is applied (e.g. aot_eager, inductor); "
                        "torch_fsdp1 is left out (its blocks are wrappers)")
    p.add_argument("--json", default="", help="also write the results to this path")
    p.add_argument("--profile", default="", help="comma-separated contenders to profile after the report")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--profiler", choices=("cprofile", "torch"), default="cprofile")
    p.add_argument("--profile-top", type=int, default=30)
    p.add_argument("--profile-dump", default="", help="directory for rank 0's raw profiles "
                   "(<contender>.prof for cProfile/pstats, <contender>.json chrome trace for torch)")
    args = p.parse_args(argv)
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (bytes are measured during the last warm-up round)")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    names = [n for n in args.contenders.replace(",", " ").split() if n]
    unknown = [n for n in names if n not in ALL_CONTENDERS]
    if unknown:
        raise SystemExit(f"unknown contenders {unknown}; choose from {ALL_CONTENDERS}")
    args.skipped = {}
    if args.compile and "torch_fsdp1" in names:
        print("NOTE: skipping contender 'torch_fsdp1' with --compile (its blocks are FSDP wrappers)")
        args.skipped["torch_fsdp1"] = "--compile"
        names.remove("torch_fsdp1")
    if "replicate" in names:
        rep, why = import_replicate()
        if rep is None:
            print(f"NOTE: skipping contender 'replicate' (import failed: {why})")
            args.skipped["replicate"] = why
            names.remove("replicate")
    port = _free_port()
    print(f"spawning {args.world_size} gloo rank(s) on port {port}: {', '.join(names)}")
    sys.stdout.flush()
    mp.spawn(worker, args=(args, port, names), nprocs=args.world_size, join=True)  # type: ignore[attr-defined]  # re-exported by torch


if __name__ == "__main__":
    main()
