"""The runtime's CPU cost per fully sharded module per step: ours against torch FSDP2 and local (issue 56, item 2).

    python benchmarks/overhead.py                         # W = 1 and 2 (gloo), 2 and 8 (simulated); both workloads
    python benchmarks/run.py --workload overhead [...]    # the same, through the benchmark tool
    python benchmarks/overhead.py --profile               # + cProfile of ours and FSDP2 on `small` at the last W
    options: [--world 1 2 2s 8s] [--workloads small,gpt] [--rounds 40] [--gpt-rounds 3] [--warmup 1]
             [--steps-per-round 4] [--optim sgd|adamw] [--profile] [--profile-steps 20] [--profile-top 25]
             [--json PATH]

[Note: Overhead protocol]
  workloads  small: 64 blocks, each ``Linear(64, 64)`` + ``Tanh``, and a ``Linear(64, 1)`` head on
             the root; batch 4, MSE loss: the step is almost all per-module overhead. 65 fully
             sharded modules (each block, then the root, which holds the head).
             gpt: benchmarks/model.py's GPT at BENCHMARK.md's CPU workload sizes (4 blocks, width
             256, vocab 4096, sequence 128, batch 4 per rank, cross-entropy). 5 fully sharded modules.
  contenders local (the model alone, no distribution), torch_fsdp2 (torch ``fully_shard`` on each
             block, then the root, on a 1-D DeviceMesh), fully_shard (ours the same way, library
             defaults), and on simulated ranks minimal (benchmarks/minimal_zero3.py: a ZeRO-3 with
             one flat parameter per module, the layout of ours, and four hooks; no prefetch, checks,
             mixed precision or state dicts: about the least a Python runtime on module and tensor
             hooks pays, printed as "floor"; it trains ours' model, checked like the others and by
             tests/unit/test_simulated_backend.py). Every model is built from the same seed; one
             optimizer for all
             (``--optim``, default SGD(lr=1e-3): the optimizer's own arithmetic is kept small, so the
             step is the runtime; AdamW(lr=1e-3) on request).
  world      ``--world``: W alone is W real gloo ranks (one process each, one thread each; W=1 a real
             one-rank group); W followed by ``s`` (``8s``) is one process on the ``simulated``
             backend (benchmarks/simulated.py), which plays rank 0 of W identical ranks: shards of
             1/W, every all-gather and reduce-scatter really run (copies in this process), no
             network. Default 1 2 2s 8s: W=2 both ways, because real gloo ranks measure gloo's
             transport as much as the runtime (two ranks on two shared cores, every exchange a
             socket round trip), which the simulated W=2 leaves out. Each W runs in freshly
             spawned processes.
  step       forward, loss, backward, ``optim.step()``, ``optim.zero_grad(set_to_none=True)``,
             timed per phase (forward + loss, backward, optimizer step + zero_grad) on two clocks:
             ``cpu``, this process's CPU time (``time.process_time``, every thread of the process:
             what the step costs the CPU, and insensitive to other processes on a shared machine,
             where the wall clock of a 10 ms step varies by 2x), and ``wall`` (``perf_counter``).
             The target is judged on ``cpu``; ``wall`` is printed beside it. W > 1 real: a barrier
             before each contender's steps, outside the timing, so the ranks start together; the
             figures are rank 0's (wall: waiting for the peer included; cpu: not).
  backend    simulated: the backend's own time inside each contender's collectives (its Python
             methods and copies, ``SimulatedProcessGroup.cpu_seconds``, timed with ``perf_counter``:
             ``process_time``, a system call, cost every contender 3 us per module) is also recorded; the
             row ``cpu-b`` gives the figures without it, i.e. with collectives that cost the caller
             only torch.distributed's Python API, as NCCL's (whose work runs in C++ threads) nearly do.
  rounds     ``--warmup`` rounds untimed, then ``--rounds`` timed rounds (``--gpt-rounds`` for gpt).
             A round runs ``--steps-per-round`` steps of each contender back to back, in the order
             local, torch_fsdp2, fully_shard (then minimal) on even rounds and reversed on odd ones;
             ``gc.collect()`` before each contender's steps, outside the timing. A round's figure
             per contender is the mean step time of its steps.
  figures    overhead per module per step = (contender's step - local's step) / fully sharded
             modules, per round (paired), in microseconds; reported as the median over rounds
             with the interquartile range. The ratio ours / FSDP2 is the median over rounds of the
             per-round ratio of the two overheads (BENCHMARK.md's "median of per-round ratios"),
             printed beside the ratio of the median overheads. Target (BENCHMARK.md, issue 56): the
             ratio <= 0.25 (cpu) on `small` at W=8 simulated. Phases are given the same way (cpu).
  losses     W=1: every contender's losses equal local's (the same model, the same data).
             W>1 real: ours equal FSDP2's (both average the ranks' gradients). Simulated: each
             contender computes on the model its rank-0 shards describe (the all-gather tiles
             them), which is not the local model and differs between ours (flat shards) and FSDP2
             (dim-0 shards of each tensor); the check there is the first step's loss against a
             local model built with those tiled parameters (tests/unit/test_simulated_backend.py
             checks whole training runs that way).
  denormals  every process flushes denormals to zero (``torch.set_flush_denormal(True)``), for every
             contender: a simulated rank computes on tiled shards (``losses`` above), which on the
             GPT drive attention's softmax to denormal values; without it ours' backward there took
             1.25 s instead of 0.15 s per step (denormal arithmetic), a property of the values, not
             of the runtime.
  profile    ``--profile``: after the timing, at the last ``--world`` entry, ``--profile-steps`` steps of ours and of
             FSDP2 on `small` under cProfile timed by CPU time (``time.process_time``: a wall-clock
             profile on a shared machine charges other processes' time slices to whatever function
             was running): the top functions by self and cumulative time, in microseconds per module
             per step (cProfile's own cost inflates every Python call: read it as where the time
             goes, not as the time).

Timing is never asserted in a test; this prints the figures and whether the target is met.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import math
import os
import pstats
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.model import GPT, SEQ, VOCAB, make_batch  # noqa: E402

CONTENDERS = ["local", "torch_fsdp2", "fully_shard"]
MINIMAL = "minimal"  # benchmarks/minimal_zero3.py: the floor, on simulated ranks only ([Note: Overhead protocol])
WORKLOADS = ["small", "gpt"]
SMALL_BLOCKS, SMALL_WIDTH, SMALL_BATCH = 64, 64, 4
GPT_BLOCKS, GPT_BATCH = 4, 4
INIT_SEED, DATA_SEED = 1234, 5678
TARGET = 0.25  # ours' overhead per module <= 1/4 of FSDP2's (issue 56, BENCHMARK.md)
TARGET_WORKLOAD = "small"
LOSS_TOLERANCE = 1e-5
PHASES = ("fwd", "bwd", "opt")  # forward + loss, backward, optimizer step + zero_grad
CLOCKS = ("cpu", "wall")  # this process's CPU time (time.process_time), and perf_counter


# ---------------------------------------------------------------------------- models
class Tower(nn.Module):
    """``blocks`` x (``Linear(width, width)`` + ``Tanh``), then a ``Linear(width, 1)`` head."""

    def __init__(self, blocks: int = SMALL_BLOCKS, width: int = SMALL_WIDTH) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # type: ignore[no-any-return]  # nn.Linear returns a Tensor


def make_model(workload: str) -> nn.Module:
    torch.manual_seed(INIT_SEED)
    if workload == "small":
        return Tower()
    if workload == "gpt":
        return GPT(blocks=GPT_BLOCKS)
    raise ValueError(f"unknown workload {workload!r}; choose from {WORKLOADS}")


def make_batches(workload: str, rank: int, count: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(DATA_SEED + rank)
    if workload == "small":
        return [(torch.randn(SMALL_BATCH, SMALL_WIDTH, generator=gen), torch.randn(SMALL_BATCH, 1, generator=gen))
                for _ in range(count)]
    return [make_batch(GPT_BATCH, SEQ, VOCAB, gen) for _ in range(count)]


def loss_of(workload: str, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    out = model(inputs)
    if workload == "small":
        return F.mse_loss(out, targets)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


@dataclass
class Contender:
    """One API applied to one fresh model, with its optimizer and what was measured."""

    name: str
    model: nn.Module
    optim: torch.optim.Optimizer
    modules: int  # fully sharded modules (0 for local)
    # rounds[clock][phase]: per timed round, the mean milliseconds per step ("step" = the three phases)
    rounds: Dict[str, Dict[str, List[float]]] = field(
        default_factory=lambda: {clock: {k: [] for k in ("step",) + PHASES} for clock in CLOCKS})
    losses: List[float] = field(default_factory=list)


def build(name: str, workload: str, mesh: Any, optim: str) -> Contender:
    model = make_model(workload)
    blocks = list(model.blocks)  # type: ignore[arg-type]  # Tower.blocks and GPT.blocks are ModuleLists
    modules = 0
    if name == "torch_fsdp2":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        for block in blocks:
            torch_fully_shard(block, mesh=mesh)
        torch_fully_shard(model, mesh=mesh)
        modules = len(blocks) + 1
    elif name == "fully_shard":
        from composable_shard import fully_shard
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
        modules = len(blocks) + 1
    elif name == MINIMAL:
        from benchmarks.minimal_zero3 import apply_minimal
        params: List[nn.Parameter] = apply_minimal(blocks + [model])
        modules = len(params)
    elif name != "local":
        raise ValueError(f"unknown contender {name!r}; choose from {CONTENDERS + [MINIMAL]}")
    if name != MINIMAL:
        params = list(model.parameters())
    opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=1e-3) if optim == "sgd" else torch.optim.AdamW(params, lr=1e-3)
    return Contender(name, model, opt, modules)


def train_step(workload: str, c: Contender, batch: Tuple[torch.Tensor, torch.Tensor]
               ) -> Tuple[Dict[str, List[float]], torch.Tensor]:
    """One step; returns, per clock, the seconds of forward + loss, backward, optimizer step + zero_grad,
    and the loss."""
    cpu, wall = time.process_time, time.perf_counter
    c0, w0 = cpu(), wall()
    loss = loss_of(workload, c.model, *batch)
    c1, w1 = cpu(), wall()
    loss.backward()
    c2, w2 = cpu(), wall()
    c.optim.step()
    c.optim.zero_grad(set_to_none=True)
    c3, w3 = cpu(), wall()
    return {"cpu": [c1 - c0, c2 - c1, c3 - c2], "wall": [w1 - w0, w2 - w1, w3 - w2]}, loss.detach()


# ---------------------------------------------------------------------------- one world size
def _tiled_local_loss(workload: str, name: str, world_size: int, batch: Tuple[torch.Tensor, torch.Tensor]) -> float:
    """The first step's loss of a local model whose parameters are what a simulated rank 0 computes on:
    its shard of each handle (ours: the flat concatenation of a module's own parameters, padded to a
    multiple of W) or of each tensor (FSDP2: dim-0 rows) tiled W times."""
    model = make_model(workload)
    owners = list(model.blocks) + [model]  # type: ignore[arg-type]  # ModuleList
    with torch.no_grad():
        for owner in owners:
            own = [p for n, p in owner.named_parameters() if owner is not model or not n.startswith("blocks.")]
            if name in ("fully_shard", MINIMAL):  # one layout
                flat = torch.cat([p.reshape(-1) for p in own])
                chunk = math.ceil(flat.numel() / world_size)
                tiled = flat[:chunk].repeat(world_size)[: flat.numel()]
                offset = 0
                for p in own:
                    p.copy_(tiled[offset: offset + p.numel()].view_as(p))
                    offset += p.numel()
            else:
                for p in own:
                    rows = math.ceil(p.shape[0] / world_size)
                    p.copy_(p[:rows].repeat(world_size, *[1] * (p.dim() - 1))[: p.shape[0]])
        return float(loss_of(workload, model, *batch))


def run_workload(workload: str, args: argparse.Namespace, rank: int, world_size: int, simulated: bool,
                 mesh: Any) -> Dict[str, Any]:
    rounds = args.rounds if workload == "small" else args.gpt_rounds
    per_round = args.steps_per_round
    batches = make_batches(workload, rank, per_round)
    cs = [build(n, workload, mesh, args.optim) for n in CONTENDERS + ([MINIMAL] if simulated else [])]
    real_peers = world_size > 1 and not simulated
    backend: Any = dist.group.WORLD if simulated else None  # the SimulatedProcessGroup: counts its own CPU time
    sanity: Dict[str, Any] = {}
    for i in range(args.warmup + rounds):
        order = cs if i % 2 == 0 else cs[::-1]
        for c in order:
            gc.collect()
            if real_peers:
                dist.barrier()
            sums = {clock: [0.0] * len(PHASES) for clock in CLOCKS}
            backend_start = backend.cpu_seconds if backend is not None else 0.0
            for k in range(per_round):
                times, loss = train_step(workload, c, batches[k])
                for clock in CLOCKS:
                    sums[clock] = [a + b for a, b in zip(sums[clock], times[clock], strict=True)]
                if i == 0 and k == 0 and simulated and c.name != "local":
                    expected = _tiled_local_loss(workload, c.name, world_size, batches[0])
                    sanity[c.name] = {"first_loss": float(loss), "tiled_local_first_loss": expected,
                                      "ok": abs(float(loss) - expected) <= LOSS_TOLERANCE * max(1.0, abs(expected))}
                if i >= args.warmup:
                    c.losses.append(float(loss))
            if i >= args.warmup:
                for clock in CLOCKS:
                    ms = [t * 1e3 / per_round for t in sums[clock]]
                    for phase, value in zip(PHASES, ms, strict=True):
                        c.rounds[clock][phase].append(value)
                    c.rounds[clock]["step"].append(sum(ms))
                if backend is not None:  # [Note: Overhead protocol], "backend"
                    backend_ms = (backend.cpu_seconds - backend_start) * 1e3 / per_round
                    c.rounds["cpu"].setdefault("less_backend", []).append(c.rounds["cpu"]["step"][-1] - backend_ms)
    out: Dict[str, Any] = {"rounds": rounds, "steps_per_round": per_round, "sanity": sanity,
                           "modules": cs[-1].modules, "contenders": {}}
    for c in cs:
        out["contenders"][c.name] = {"rounds_ms": c.rounds, "losses": c.losses}
    if args.profile and rank == 0 and workload == "small" and (world_size, simulated) == args.configs[-1]:
        out["profile"] = {c.name: profile(workload, c, batches, args) for c in cs if c.name != "local"}
        out["profile"]["steps"] = args.profile_steps
    del cs
    gc.collect()
    return out


# ---------------------------------------------------------------------------- profile
def _is_library(filename: str, name: str) -> bool:
    path = filename.replace(os.sep, "/")
    if name == "fully_shard":
        return "/composable_shard/" in path
    return "/torch/distributed/fsdp/" in path or "/torch/distributed/tensor/" in path


def profile(workload: str, c: Contender, batches: List[Tuple[torch.Tensor, torch.Tensor]],
            args: argparse.Namespace) -> Dict[str, Any]:
    """cProfile over ``--profile-steps`` steps: the top functions by self time, the library's and all."""
    steps = args.profile_steps
    gc.collect()
    prof = cProfile.Profile(time.process_time)  # CPU time: a wall-clock profile of a shared machine
    t0 = time.process_time()                    # charges other processes' slices to whatever ran
    prof.enable()
    for k in range(steps):
        train_step(workload, c, batches[k % len(batches)])
    prof.disable()
    cpu = time.process_time() - t0
    stats = pstats.Stats(prof)
    per = 1e6 / (steps * c.modules)  # seconds -> microseconds per module per step
    rows = []
    for (filename, line, func), (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]  # pstats' table
        rows.append({"function": f"{os.path.basename(filename)}:{line}({func})", "library": _is_library(filename, c.name),
                     "self_us": tottime * per, "cum_us": cumtime * per, "calls": ncalls / (steps * c.modules),
                     "path": filename})
    total_self = sum(r["self_us"] for r in rows)
    library = sorted((r for r in rows if r["library"]), key=lambda r: -r["self_us"])
    return {"cpu_us_per_module_step": cpu * per, "self_us_total": total_self,
            "library_self_us": sum(r["self_us"] for r in library),
            "top_library": library[: args.profile_top],
            "top_all": sorted(rows, key=lambda r: -r["self_us"])[: args.profile_top],
            "top_cumulative_library": sorted(library, key=lambda r: -r["cum_us"])[: args.profile_top]}


# ---------------------------------------------------------------------------- processes
def worker(rank: int, world_size: int, simulated: bool, port: int, args: argparse.Namespace, out_path: str) -> None:
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # [Note: Overhead protocol], "denormals"
    if simulated:
        from benchmarks import simulated as sim
        sim.register()
        dist.init_process_group(sim.BACKEND_NAME, rank=0, world_size=world_size, store=dist.HashStore(),
                                timeout=timedelta(seconds=600))
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=600))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world_size,))
        result: Dict[str, Any] = {"world_size": world_size, "simulated": simulated, "workloads": {},
                                  "load_start": list(os.getloadavg())}
        for workload in args.workloads:
            t0 = time.perf_counter()
            result["workloads"][workload] = run_workload(workload, args, rank, world_size, simulated, mesh)
            result["workloads"][workload]["wall_s"] = time.perf_counter() - t0
        result["load_end"] = list(os.getloadavg())
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(result, f)
    finally:
        gc.collect()  # FSDP2 holds its groups: free them before the group goes
        dist.destroy_process_group()


def steady_loop(name: str, workload: str = "small", world_size: int = 8, steps: int = 1000) -> None:
    """``steps`` steady-state steps of one contender on ``world_size`` simulated ranks, in this process
    and nothing else: the loop to run under an external sampling profiler (which sees this
    process only, so a shared machine's other processes do not enter its samples), e.g.::

        py-spy record -r 500 -f raw -o ours.txt -- python -c \\
            "from benchmarks.overhead import steady_loop; steady_loop('fully_shard')"
    """
    from benchmarks import simulated as sim
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    sim.register()
    dist.init_process_group(sim.BACKEND_NAME, rank=0, world_size=world_size, store=dist.HashStore())
    try:
        from torch.distributed.device_mesh import init_device_mesh
        c = build(name, workload, init_device_mesh("cpu", (world_size,)), "sgd")
        batches = make_batches(workload, 0, 4)
        for k in range(steps + 5):  # 5 warm-up steps: lazy init, first-step recording
            train_step(workload, c, batches[k % len(batches)])
        del c
    finally:
        gc.collect()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(world_size: int, simulated: bool, args: argparse.Namespace) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cs_overhead_") as tmp:
        out_path = os.path.join(tmp, "rank0.json")
        procs = 1 if simulated else world_size
        t0 = time.perf_counter()
        mp.spawn(worker, args=(world_size, simulated, _free_port(), args, out_path), nprocs=procs,  # type: ignore[attr-defined]
                 join=True)
        with open(out_path) as f:
            result: Dict[str, Any] = json.load(f)
    result["wall_s"] = time.perf_counter() - t0
    return result


# ---------------------------------------------------------------------------- figures
def _quartiles(values: Sequence[float]) -> Tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


def figures(w: Dict[str, Any], clock: str) -> Dict[str, Any]:
    """Overheads per module per step (us) and ours / FSDP2, per round and summarized, per phase, on ``clock``."""
    mods = w["modules"]
    cs = w["contenders"]
    out: Dict[str, Any] = {"modules": mods}
    for phase in [p for p in ("step", "less_backend") + PHASES if p in cs["local"]["rounds_ms"][clock]]:
        local = cs["local"]["rounds_ms"][clock][phase]
        over = {n: [(t - l) * 1e3 / mods for t, l in zip(cs[n]["rounds_ms"][clock][phase], local, strict=True)]
                for n in ("torch_fsdp2", "fully_shard", MINIMAL) if n in cs}
        ratios = [o / f if f > 0 else math.nan for o, f in zip(over["fully_shard"], over["torch_fsdp2"], strict=True)]
        finite = [r for r in ratios if math.isfinite(r)]
        fsdp2_med = statistics.median(over["torch_fsdp2"])
        ours_med = statistics.median(over["fully_shard"])
        floor = over.get(MINIMAL)
        out[phase] = {
            "ms": {n: statistics.median(cs[n]["rounds_ms"][clock][phase]) for n in cs},
            # the floor against FSDP2, as ours is (median of per-round ratios), when it ran
            "floor_ratio": statistics.median(m / f if f > 0 else math.nan for m, f in
                                             zip(floor, over["torch_fsdp2"], strict=True)) if floor else None,
            "overhead_us": {n: _quartiles(v) for n, v in over.items()},
            "ratio_rounds": _quartiles(finite) if finite else (math.nan,) * 3,
            "ratio_of_medians": ours_med / fsdp2_med if fsdp2_med > 0 else math.nan,
        }
    return out


def loss_checks(result: Dict[str, Any], workload: str) -> List[Tuple[str, bool, str]]:
    w = result["workloads"][workload]
    cs = w["contenders"]
    checks: List[Tuple[str, bool, str]] = []

    def close(a: List[float], b: List[float]) -> Tuple[bool, float]:
        diff = max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)
        return diff <= LOSS_TOLERANCE * max(1.0, max((abs(y) for y in b), default=1.0)), diff

    if result["simulated"]:
        for name, s in w["sanity"].items():
            checks.append((f"{name}'s first loss = local's on the tiled rank-0 shards", s["ok"],
                           f"{s['first_loss']:.6f} vs {s['tiled_local_first_loss']:.6f}"))
    elif result["world_size"] == 1:
        for name in ("torch_fsdp2", "fully_shard"):
            ok, diff = close(cs[name]["losses"], cs["local"]["losses"])
            checks.append((f"{name}'s losses = local's", ok, f"max difference {diff:.2e}"))
    else:
        ok, diff = close(cs["fully_shard"]["losses"], cs["torch_fsdp2"]["losses"])
        checks.append(("fully_shard's losses = torch_fsdp2's", ok, f"max difference {diff:.2e}"))
    return checks


def _label(r: Dict[str, Any]) -> str:
    return f"W={r['world_size']} {'simulated' if r['simulated'] else 'gloo'}"


def _describe(workload: str) -> str:
    if workload == "small":
        return (f"{SMALL_BLOCKS} x (Linear({SMALL_WIDTH},{SMALL_WIDTH}) + Tanh) + Linear({SMALL_WIDTH},1) head, batch "
                f"{SMALL_BATCH}, MSE: {SMALL_BLOCKS + 1} fully sharded modules")
    return (f"GPT {GPT_BLOCKS} blocks, width 256, vocab {VOCAB}, seq {SEQ}, batch {GPT_BATCH}: "
            f"{GPT_BLOCKS + 1} fully sharded modules")


def print_report(results: List[Dict[str, Any]], args: argparse.Namespace) -> Dict[str, Any]:
    """The tables; returns the target's verdicts (CPU time, `small`, each simulated W)."""
    print(f"\n==== runtime CPU overhead per fully sharded module per step (torch {torch.__version__}, "
          f"optimizer {args.optim}, {args.steps_per_round} steps per contender per round) ====")
    print("cpu = this process's CPU time (time.process_time: what the step costs the CPU, insensitive to other "
          "processes), wall = perf_counter,\ncpu-b = cpu less the simulated backend's own CPU time (its copies; NCCL "
          "does them in C++);\nus/mod = (contender - local) / modules, median over rounds; ours/fsdp2 = "
          "median [quartiles] over rounds of the per-round ratio of overheads")
    verdict: Dict[str, Any] = {}
    for workload in args.workloads:
        print(f"\n-- workload {workload}: {_describe(workload)}")
        hdr = (f"{'W':>3} {'ranks':<10}{'clock':<6}{'rounds':>7}{'local ms':>10}{'fsdp2 ms':>10}{'ours ms':>9}"
               f"{'fsdp2 us/mod':>14}{'ours us/mod':>13}   {'ours/fsdp2 [quartiles]':<24}{'of medians':>11}"
               f"{'floor us/mod':>14}{'floor/fsdp2':>13}")
        print(hdr)
        print("-" * len(hdr))
        for r in results:
            if workload not in r["workloads"]:
                continue
            w = r["workloads"][workload]
            kind = "simulated" if r["simulated"] else "gloo"
            rows = [(clock, figures(w, clock)["step"]) for clock in CLOCKS]
            if "less_backend" in figures(w, "cpu"):
                rows.append(("cpu-b", figures(w, "cpu")["less_backend"]))
            for clock, s in rows:
                lo, med, hi = s["ratio_rounds"]
                noisy = lo < 0 or hi - lo > abs(med)  # the rounds disagree more than the figure says
                print(f"{r['world_size']:>3} {kind:<10}{clock:<6}{w['rounds']:>7}{s['ms']['local']:>10.2f}"
                      f"{s['ms']['torch_fsdp2']:>10.2f}{s['ms']['fully_shard']:>9.2f}"
                      f"{s['overhead_us']['torch_fsdp2'][1]:>14.1f}{s['overhead_us']['fully_shard'][1]:>13.1f}   "
                      f"{med:>6.3f} [{lo:.3f}, {hi:.3f}]{'':<6}{s['ratio_of_medians']:>11.3f}"
                      + (f"{s['overhead_us'][MINIMAL][1]:>14.1f}{s['floor_ratio']:>13.3f}" if MINIMAL in s["overhead_us"]
                         else f"{'-':>14}{'-':>13}")
                      + ("   noise > figure: more rounds" if noisy else ""))
                if workload == TARGET_WORKLOAD and r["simulated"] and clock == "cpu":
                    verdict[_label(r)] = med
        print("  per phase (cpu), overhead us per module per step, median over rounds: fsdp2 / ours (median ratio)")
        for r in results:
            if workload not in r["workloads"]:
                continue
            f = figures(r["workloads"][workload], "cpu")
            parts = []
            for phase, label in zip(PHASES, ("forward+loss", "backward", "optim+zero_grad"), strict=True):
                p = f[phase]
                parts.append(f"{label} {p['overhead_us']['torch_fsdp2'][1]:.1f} / {p['overhead_us']['fully_shard'][1]:.1f}"
                             f" ({p['ratio_rounds'][1]:.2f})")
            print(f"    {_label(r)}: " + "; ".join(parts))
        for r in results:
            if workload in r["workloads"]:
                for name, ok, detail in loss_checks(r, workload):
                    print(f"  losses {_label(r)}: {'ok' if ok else 'DIFFER'}  {name}: {detail}")
    print(f"  floor = {MINIMAL} (benchmarks/minimal_zero3.py, simulated ranks only): a ZeRO-3 with one flat parameter per "
          "module and four hooks, nothing else\n  (no prefetch, checks, mixed precision or state dicts): the least "
          "a Python runtime on module and tensor hooks pays")
    for key, med in verdict.items():
        print(f"\ntarget (issue 56): ours' overhead per module <= {TARGET} x FSDP2's (cpu) on `{TARGET_WORKLOAD}` at {key} "
              f": {med:.3f} -> {'met' if med <= TARGET else 'MISSED'}")
    for r in results:
        print(f"{_label(r)}: wall {r['wall_s']:.0f} s, load average {r['load_start'][0]:.1f} -> {r['load_end'][0]:.1f}")
    return verdict


def print_profile(results: List[Dict[str, Any]], top: int) -> None:
    for r in results:
        prof = r["workloads"].get("small", {}).get("profile")
        if not prof:
            continue
        steps = prof["steps"]
        print(f"\n==== cProfile, `small` at {_label(r)}, {steps} steps "
              f"(us and calls per module per step; cProfile inflates each Python call) ====")
        for name in ("fully_shard", "torch_fsdp2"):
            p = prof[name]
            print(f"\n-- {name}: {p['cpu_us_per_module_step']:.1f} us of CPU per module per step under the profiler, "
                  f"library self time {p['library_self_us']:.1f} of {p['self_us_total']:.1f}")
            for title, key, col in (("library functions by self time", "top_library", "self_us"),
                                    ("library functions by cumulative time", "top_cumulative_library", "cum_us"),
                                    ("all functions by self time", "top_all", "self_us")):
                print(f"   {title}:")
                for row in p[key][:top]:
                    print(f"     {row[col]:>8.2f} us  {row['calls']:>6.2f} calls  {row['function']}")
    sys.stdout.flush()


def _configs(values: List[str], p: argparse.ArgumentParser) -> List[Tuple[int, bool]]:
    """``--world`` entries: ``W`` (real gloo ranks) or ``Ws`` (simulated), in order; the last is profiled."""
    out = []
    for v in values:
        for part in v.split(","):
            if not part:
                continue
            simulated = part.endswith("s")
            try:
                world_size = int(part[:-1] if simulated else part)
            except ValueError:
                p.error(f"--world: {part!r} is neither W nor Ws (an integer, optionally followed by 's')")
            if world_size < 1 or (simulated and world_size < 2):
                p.error(f"--world: {part!r}: W >= 1, and >= 2 when simulated")
            out.append((world_size, simulated))
    if not out:
        p.error("--world: give one or more world sizes")
    return out


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", nargs="+", default=["1", "2", "2s", "8s"], metavar="W",
                   help="world sizes: W = W real gloo ranks, Ws = W simulated ranks in one process "
                        "(default 1 2 2s 8s; the last one is profiled with --profile)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of " + ",".join(WORKLOADS))
    p.add_argument("--rounds", type=int, default=40,
                   help="timed rounds of `small` (default 40 of 4 steps each: the issue-56 judgment's recipe; 10 rounds "
                        "of 2 steps read up to 0.02 higher and wider on this machine, see benchmarks/NOTES.md)")
    p.add_argument("--gpt-rounds", type=int, default=3, help="timed rounds of `gpt`")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--steps-per-round", type=int, default=4, help="steps of each contender per round")
    p.add_argument("--optim", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--profile", action="store_true", help="cProfile ours and FSDP2 on `small` at the largest W")
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--profile-top", type=int, default=25)
    p.add_argument("--json", default="", help="also write the results to this path")
    args = p.parse_args(argv)
    args.configs = _configs(args.world, p)
    args.workloads = [w for w in args.workloads.split(",") if w]
    for w in args.workloads:
        if w not in WORKLOADS:
            p.error(f"--workloads: unknown {w!r}; choose from {WORKLOADS}")
    if args.rounds < 1 or args.gpt_rounds < 1 or args.steps_per_round < 1 or args.warmup < 1:
        p.error("--rounds, --gpt-rounds, --steps-per-round and --warmup must be >= 1 (the warm-up runs lazy init "
                "and the simulated sanity check)")
    return args


def library_version() -> str:
    """Which composable_shard is measured: its directory, the checkout's commit, and whether the
    library's files differ from it (a figure is only comparable to another of the same code)."""
    import subprocess

    import composable_shard
    where = os.path.dirname(os.path.abspath(composable_shard.__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True,
                                timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=where, capture_output=True, text=True,
                               timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"{where} (not a git checkout)"
    if not commit:
        return f"{where} (not a git checkout)"
    return f"{where} at commit {commit}" + (" + uncommitted changes to the library" if dirty else "")


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    version = library_version()
    print(f"composable_shard: {version}", flush=True)
    results = []
    for world_size, simulated in args.configs:
        print(f"W={world_size}: {'simulated' if simulated else 'gloo'} ...",
              flush=True)
        results.append(run_world(world_size, simulated, args))
    verdict = print_report(results, args)
    if args.profile:
        print_profile(results, args.profile_top)
    print(f"\nwall {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": "overhead", "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "library": version,
                       "torch": torch.__version__, "results": results, "verdict": verdict,
                       "figures": [{wl: {clock: figures(r["workloads"][wl], clock) for clock in CLOCKS}
                                    for wl in r["workloads"]} for r in results]}, f,
                      indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
