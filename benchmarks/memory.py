"""Peak tensor bytes per rank during a training step, every contender, with and without
per-block activation checkpointing (BENCHMARK.md's memory target; issue 18).

    python benchmarks/memory.py --world-size 2 --blocks 4,8,16 --checkpoint both
                                [--contenders local,ddp,torch_fsdp2,fully_shard,replicate]
                                [--warmup 1] [--steps 2] [--plain-ac ours|torch]
                                [--device cpu|cuda] [--json PATH] [--keep-logits]
                                [--library DIR] [--trace-peak [--trace-top N]]
    python benchmarks/memory.py --from-json PATH      # re-print a saved report

Needs a C++ compiler and ``ninja`` (``pip install ninja``) for the counting allocator on CPU
(built once, about a minute; cached under torch's extension directory). See benchmarks/NOTES.md,
section "Memory", for the method, its validation and the figures.

[Note: Method]
  counting   CPU: every rank process installs ``benchmarks/counting_allocator.py`` (a C++
             ``c10::Allocator`` forwarding to c10's ``alloc_cpu``/``free_cpu`` and counting
             live and peak requested bytes with atomics, so gloo's threads are counted too)
             as its first action, before it creates any tensor. The allocator is validated in
             every process: a 1 MiB tensor must raise live and peak by exactly 1 MiB, and
             freeing it must return live to where it was. CUDA (``--device cuda``):
             ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` /
             ``reset_peak_memory_stats`` instead, NCCL instead of gloo.
  isolation  each (blocks, checkpointing, contender) runs in its own freshly spawned ranks,
             so contenders never share a process; ``local`` is one process (W=1, no process
             group), the others W ranks.
  model      benchmarks/model.py's GPT (vocab 4096, width 256), ``--blocks`` blocks, seed 1234;
             data: seq 128, batch 4 per rank, seed 5678 + rank (as benchmarks/run.py).
  APIs       ddp: torch DDP(model). torch_fsdp2: torch ``fully_shard`` per block, then root.
             torch_fsdp1: FSDP(ModuleWrapPolicy({Block}), use_orig_params=True).
             fully_shard: ours per block, then root. replicate: ours on the root.
             Then AdamW(lr=1e-3) on ``module.parameters()``.
  AC         (``--checkpoint on``) per block, before the API is applied:
             fully_shard, replicate: ``composable_shard.checkpoint(block)``;
             torch_fsdp2, torch_fsdp1: torch's composable
             ``torch.distributed._composable.checkpoint(block)``;
             local, ddp: ``composable_shard.checkpoint(block)`` by default (``--plain-ac ours``),
             or ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` around each
             block's forward (``--plain-ac torch``).
  step       forward + cross-entropy, backward, ``optim.step()``, ``zero_grad(set_to_none=True)``;
             no Python reference to the logits is kept. The peak counter is reset at the start of
             each phase, so each phase's peak is known, and the step's peak is their maximum.
             A ``dist.barrier()`` before each step, outside the measured region.
  steps      ``--warmup`` steps (the first one contains lazy init and creates AdamW's state),
             then ``--steps`` measured steps; figures are the maximum over measured steps and
             ranks.
  figures    peak      bytes alive at the step's highest point (the headline figure);
             start     bytes alive when the step starts;
             accounted what the step's start should hold, from the tensors themselves: the
                       unique storages of the parameters (DTensor: local shard; flat-parameter
                       APIs: the flat shards), of gradients still held (``.grad`` and, for
                       flat-parameter APIs, the flat gradient buffers), and of the optimizer
                       state, plus the model's cached causal mask; the baseline (bytes alive
                       before the model is built: batches, process-group state) is subtracted
                       from ``start`` before comparing. ``other = start - baseline - accounted``:
                       0 means nothing else is alive; DDP's (and replicate's) gradient buckets
                       show up here;
             fwd_keep  bytes alive at the end of forward above the start (saved activations
                       and whatever the API keeps for backward);
             peak-start, bwd_peak-start: the step's and backward's peaks above the start.
  units      MB = 10^6 bytes.
  options    --keep-logits keeps a Python reference to the logits through the step (as
             benchmarks/run.py's step does): +8.4 MB (B*T*vocab*4) for every contender; issue 18's
             figures were taken that way. --library DIR imports composable_shard from DIR (e.g.
             an export of a committed version, to measure it while the checkout is being
             edited). --trace-peak records the sizes of every tensor alive at each step's peak
             (CPU) and prints the largest groups with candidate names matched by size.
"""

from __future__ import annotations

import argparse
import gc
import functools
import json
import math
import os
import socket
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# Nothing below may create a tensor at import time: ranks install the counting allocator first.
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks import counting_allocator as ca  # noqa: E402

ALL_CONTENDERS = ["local", "ddp", "torch_fsdp1", "torch_fsdp2", "fully_shard", "replicate"]
DEFAULT_CONTENDERS = ["local", "ddp", "torch_fsdp2", "fully_shard", "replicate"]
TABLE_CONTENDERS = ["local", "ddp", "torch_fsdp1", "torch_fsdp2", "fully_shard", "replicate"]
INIT_SEED = 1234
DATA_SEED = 5678
TARGET = 1.00  # BENCHMARK.md: peak fully_shard / torch_fsdp2 <= 1.00
MB = 1e6
PHASES = ("fwd", "bwd", "opt", "zero")


# ---------------------------------------------------------------------------- counters
class Counter:
    """live/peak/reset_peak over the counting CPU allocator or CUDA's caching allocator stats."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def live(self) -> int:
        return int(torch.cuda.memory_allocated()) if self.cuda else ca.live()

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated()) if self.cuda else ca.peak()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            ca.reset_peak()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def validate_cuda() -> Dict[str, Any]:
    mib = 1 << 20
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    live0, peak0 = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    t = torch.empty(mib, dtype=torch.uint8, device="cuda")
    live1, peak1 = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    del t
    live2 = torch.cuda.memory_allocated()
    return {"live_before": live0, "live_with_1MiB": live1, "live_after_free": live2,
            "peak_rise": peak1 - peak0, "live_rise": live1 - live0,
            "ok": peak1 - peak0 == mib and live1 - live0 == mib and live2 == live0}


# ---------------------------------------------------------------------------- contenders
def apply_checkpoint(name: str, block: torch.nn.Module, plain_ac: str) -> str:
    """Per-block activation checkpointing for contender ``name``; returns what was used."""
    if name in ("torch_fsdp2", "torch_fsdp1"):
        from torch.distributed._composable import checkpoint as torch_composable_checkpoint
        torch_composable_checkpoint(block)
        return "torch.distributed._composable.checkpoint"
    if name in ("local", "ddp") and plain_ac == "torch":
        from torch.utils.checkpoint import checkpoint as torch_utils_checkpoint
        inner = block.forward

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            return torch_utils_checkpoint(inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward  # type: ignore[method-assign]
        return "torch.utils.checkpoint(use_reentrant=False)"
    from composable_shard import checkpoint as our_checkpoint
    our_checkpoint(block)
    return "composable_shard.checkpoint"


def build(name: str, blocks: int, ac: bool, plain_ac: str, device: torch.device, mesh: Any
          ) -> Tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer, str]:
    """(module to call, underlying GPT, optimizer, checkpoint implementation used)."""
    from benchmarks.model import GPT, Block

    torch.manual_seed(INIT_SEED)
    model = GPT(blocks=blocks).to(device)
    ac_impl = "none"
    if ac:
        for block in model.blocks:
            ac_impl = apply_checkpoint(name, block, plain_ac)
    module: torch.nn.Module = model
    if name == "local":
        pass
    elif name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        module = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    elif name == "torch_fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        module = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=device)
    elif name == "torch_fsdp2":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        for block in model.blocks:
            torch_fully_shard(block, mesh=mesh)
        torch_fully_shard(model, mesh=mesh)
    elif name == "fully_shard":
        from composable_shard import fully_shard
        kw = {"device_id": device} if device.type == "cuda" else {}
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
    elif name == "replicate":
        from composable_shard import replicate as rep
        rep = getattr(rep, "replicate", rep)  # the submodule when the package does not re-export it
        rep(model, **({"device_id": device} if device.type == "cuda" else {}))
    else:
        raise ValueError(f"unknown contender {name!r}")
    optim = torch.optim.AdamW(module.parameters(), lr=1e-3)
    return module, model, optim, ac_impl


# ---------------------------------------------------------------------------- accounting
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor -> local shard


def held_storages(name: str, module: torch.nn.Module, model: torch.nn.Module, optim: torch.optim.Optimizer
                  ) -> Dict[str, int]:
    """Bytes of the unique storages the contender is known to hold, by category (each storage
    counted once, in the first category that reaches it). Creates no tensor storage."""
    seen: set = set()
    out = {"params": 0, "grads": 0, "optim": 0, "cache": 0}

    def add(cat: str, t: Optional[torch.Tensor]) -> None:
        if t is None or not isinstance(t, torch.Tensor):
            return
        t = _local(t)
        st = t.untyped_storage()
        key = (st.data_ptr(), st.device.type)
        if st.nbytes() == 0 or key in seen:
            return
        seen.add(key)
        out[cat] += st.nbytes()

    for p in model.parameters():
        add("params", p)
    if name == "fully_shard":
        try:
            from composable_shard._runtime.traversal import _get_fsdp_handles
            for h in _get_fsdp_handles(model):
                for g in getattr(h, "groups", []):
                    add("params", getattr(g, "flat_param", None))
                    add("params", getattr(g, "padded_unsharded_flat", None))  # 0 bytes when sharded
                    add("grads", getattr(g, "sharded_grad", None))
                for t in getattr(h, "unreduced_grads", {}).values():
                    add("grads", t)
        except Exception:  # the runtime is being rewritten: best effort
            pass
    if name == "torch_fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        for m in FSDP.fsdp_modules(module):
            handle = getattr(m, "_handle", None)
            if handle is not None:
                add("params", handle.flat_param)
                add("grads", handle.flat_param.grad)
    for p in model.parameters():
        add("grads", p.grad)
    for state in optim.state.values():
        for v in state.values():
            add("optim", v)
    for mask in getattr(model, "_masks", {}).values():
        add("cache", mask)
    return out


# ---------------------------------------------------------------------------- one rank
def worker(rank: int, cfg: Dict[str, Any], so_path: str, port: int, outdir: str) -> None:
    cuda = cfg["device"] == "cuda"
    if not cuda:
        ca.install(so_path)  # first: before this process creates any tensor
        if cfg["trace_peak"]:
            ca.set_tracing(True)
        validation = ca.validate()
    torch.set_num_threads(1)
    W = cfg["world_size"]
    distributed = cfg["contender"] != "local"
    import torch.distributed as dist
    if cuda:
        torch.cuda.set_device(rank)
        validation = validate_cuda()
    if distributed:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=W,
                                timeout=timedelta(seconds=600))
    try:
        result = _measure(rank, cfg, distributed, validation)
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        if distributed:
            gc.collect()  # torch's FSDP2/DDP hold their groups: free them before the groups go ([Note: Process groups held weakly])
            dist.destroy_process_group()


def _measure(rank: int, cfg: Dict[str, Any], distributed: bool, validation: Dict[str, Any]) -> Dict[str, Any]:
    import torch.distributed as dist
    import torch.nn.functional as F

    from benchmarks.model import SEQ, VOCAB, make_batch

    counter = Counter(cfg["device"])
    device = torch.device("cuda", torch.cuda.current_device()) if counter.cuda else torch.device("cpu")
    name = cfg["contender"]
    mesh = None
    if name == "torch_fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (cfg["world_size"],))
    gen = torch.Generator().manual_seed(DATA_SEED + rank)
    n_steps = cfg["warmup"] + cfg["steps"]
    batches = [tuple(t.to(device) for t in make_batch(cfg["batch"], SEQ, VOCAB, gen)) for _ in range(n_steps)]

    def barrier() -> None:
        counter.sync()
        if distributed:
            dist.barrier()

    barrier()
    baseline = counter.live()
    module, model, optim, ac_impl = build(name, cfg["blocks"], cfg["ac"], cfg["plain_ac"], device, mesh)
    barrier()
    after_build = counter.live()
    built = held_storages(name, module, model, optim)

    steps: List[Dict[str, Any]] = []
    for i in range(n_steps):
        tokens, targets = batches[i]
        barrier()
        start = counter.live()
        held = held_storages(name, module, model, optim)
        assert counter.live() == start, "accounting allocated tensor memory"
        rec: Dict[str, Any] = {"step": i, "measured": i >= cfg["warmup"], "start": start, "held": held}
        counter.reset_peak()
        peak_sizes: List[int] = []

        def end_phase(phase: str) -> None:
            """Record the phase's end and peak; keep the live block sizes if it is the step's peak."""
            nonlocal peak_sizes
            counter.sync()
            rec[f"{phase}_end"], rec[f"{phase}_peak"] = counter.live(), counter.peak()
            if cfg["trace_peak"] and rec[f"{phase}_peak"] >= max(rec.get(f"{q}_peak", 0) for q in PHASES):
                peak_sizes = ca.peak_sizes()
            counter.reset_peak()

        if cfg["keep_logits"]:  # as benchmarks/run.py's step: a Python reference to the logits
            logits = module(tokens)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        else:
            loss = F.cross_entropy(module(tokens).reshape(-1, VOCAB), targets.reshape(-1))
        end_phase("fwd")
        loss.backward()
        end_phase("bwd")
        rec["loss"] = float(loss.item())
        del loss
        optim.step()
        end_phase("opt")
        optim.zero_grad(set_to_none=True)
        end_phase("zero")
        rec["peak"] = max(rec[f"{p}_peak"] for p in PHASES)
        if cfg["trace_peak"]:
            rec["peak_sizes"] = peak_sizes
        if cfg["keep_logits"]:
            del logits
        steps.append(rec)
    barrier()
    out = {"rank": rank, "validation": validation, "baseline": baseline, "after_build": after_build,
           "built": built, "ac_impl": ac_impl, "steps": steps}
    if cfg["trace_peak"]:
        out["size_labels"] = {str(k): v for k, v in size_labels(model, cfg, distributed).items()}
        # tracing started right after install: its table must agree with the counter
        out["validation"]["trace_consistent"] = ca.traced_live() == ca.live()
        out["validation"]["ok"] = out["validation"]["ok"] and out["validation"]["trace_consistent"]
    return out


def size_labels(model: torch.nn.Module, cfg: Dict[str, Any], distributed: bool) -> Dict[int, str]:
    """Names for the block sizes seen at a peak: parameters (and gradients) by name, flat
    buffers and shards of a block and of the root, and the model's activation shapes."""
    from benchmarks.model import HEADS, SEQ, VOCAB, WIDTH

    W = cfg["world_size"] if distributed else 1
    labels: Dict[int, List[str]] = {}

    def put(nbytes: int, label: str) -> None:
        names = labels.setdefault(int(nbytes), [])
        if label not in names and len(names) < 3:
            names.append(label)

    B, T = cfg["batch"], SEQ
    f4 = 4
    put(B * T * VOCAB * f4, "logits-sized (B,T,V)")
    put(B * T * WIDTH * f4, "activation (B,T,W)")
    put(B * T * 4 * WIDTH * f4, "MLP hidden (B,T,4W)")
    put(B * HEADS * T * T * f4, "attention scores (B,H,T,T)")
    put(B * T * 3 * WIDTH * f4, "qkv (B,T,3W)")
    from benchmarks.model import GPT
    ref = GPT(blocks=1)  # full-size parameter shapes (model's own may be sharded)
    for n, p in ref.named_parameters():
        put(p.numel() * f4, "param/grad " + n.replace("blocks.0.", "block."))
    if W > 1:  # per-parameter shards (dim 0, as torch FSDP2 shards)
        for n, p in ref.named_parameters():
            put(math.ceil(p.shape[0] / W) * (p.numel() // p.shape[0]) * f4,
                "param/grad shard " + n.replace("blocks.0.", "block."))
    n_block = sum(p.numel() for p in ref.blocks[0].parameters())
    n_root = sum(p.numel() for p in ref.parameters()) - n_block
    for what, n in (("block", n_block), ("root", n_root)):
        shard = math.ceil(n / W)
        put(shard * W * f4, f"{what} unsharded flat/grad ({n:,} el)")
        if W > 1:
            put(shard * f4, f"{what} shard ({shard:,} el)")
    del ref
    return {k: ", ".join(v) for k, v in labels.items()}


# ---------------------------------------------------------------------------- parent
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def summarize(ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Max over ranks and measured steps of each figure; the start check per rank."""
    measured = [(r, s) for r in ranks for s in r["steps"] if s["measured"]]
    out: Dict[str, Any] = {}
    for key in ("peak", "start", "fwd_peak", "bwd_peak", "opt_peak", "zero_peak"):
        out[key] = max(s[key] for _, s in measured)
    out["peak_above_start"] = max(s["peak"] - s["start"] for _, s in measured)
    out["fwd_keep"] = max(s["fwd_end"] - s["start"] for _, s in measured)
    out["bwd_peak_above_start"] = max(s["bwd_peak"] - s["start"] for _, s in measured)
    out["bwd_peak_above_fwd_end"] = max(s["bwd_peak"] - s["fwd_end"] for _, s in measured)
    out["end_minus_start"] = max(s["zero_end"] - s["start"] for _, s in measured)
    # Which phase holds the step's peak (of the step/rank with the highest peak).
    _, top = max(measured, key=lambda rs: rs[1]["peak"])
    out["peak_phase"] = max(PHASES, key=lambda p: top[f"{p}_peak"])
    # Step-start accounting, rank 0's last measured step.
    r0 = min(ranks, key=lambda r: r["rank"])
    last = [s for s in r0["steps"] if s["measured"]][-1]
    held = last["held"]
    accounted = sum(held.values())
    out["baseline"] = r0["baseline"]
    out["held"] = held
    out["accounted"] = accounted
    out["other"] = last["start"] - r0["baseline"] - accounted
    starts = sorted({s["start"] for s in r0["steps"] if s["measured"]})
    out["start_stable"] = len(starts) == 1
    out["validation_ok"] = all(r["validation"]["ok"] for r in ranks)
    out["ac_impl"] = r0["ac_impl"]
    out["losses"] = [s["loss"] for s in r0["steps"]]
    top_rank = next(r for r in ranks if top in r["steps"])
    if "peak_sizes" in top:
        labels = top_rank.get("size_labels", {})
        hist: Dict[int, int] = {}
        for n in top["peak_sizes"]:
            hist[n] = hist.get(n, 0) + 1
        rows = sorted(hist.items(), key=lambda kv: -kv[0] * kv[1])
        out["at_peak"] = {"rank": top_rank["rank"], "step": top["step"], "phase": out["peak_phase"],
                          "traced_bytes": sum(top["peak_sizes"]), "blocks": len(top["peak_sizes"]),
                          "by_size": [{"nbytes": n, "count": c, "total": n * c, "label": labels.get(str(n), "")}
                                      for n, c in rows]}
    return out


def run_config(cfg: Dict[str, Any], so_path: str) -> Dict[str, Any]:
    nprocs = 1 if cfg["contender"] == "local" else cfg["world_size"]
    cfg = dict(cfg, world_size=nprocs)
    with tempfile.TemporaryDirectory(prefix="cs_mem_") as outdir:
        t0 = time.perf_counter()
        try:
            mp.spawn(worker, args=(cfg, so_path, _free_port(), outdir), nprocs=nprocs, join=True)  # type: ignore[attr-defined]
        except Exception as exc:  # a contender crashing must not stop the others
            lines = str(exc).strip().splitlines()
            where = [ln.strip() for ln in lines if ln.strip().startswith("File ")]
            msg = (lines[-1] if lines else type(exc).__name__) + (f"  [at {where[-1]}]" if where else "")
            return {"error": msg, "detail": str(exc)[-4000:]}
        ranks = []
        for r in range(nprocs):
            with open(os.path.join(outdir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    res = summarize(ranks)
    res["wall_s"] = time.perf_counter() - t0
    res["world_size"] = nprocs
    res["ranks"] = ranks
    return res


def fmt_mb(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x / MB:.1f}"


def print_validation(results: Dict[Tuple[int, bool, str], Dict[str, Any]]) -> None:
    vals = [(k, r["validation"]) for k, res in results.items() if "ranks" in res for r in res["ranks"]]
    if not vals:
        return
    k0, v0 = vals[0]
    print("allocator validation (every rank process; first one shown):")
    print(f"  1 MiB tensor: live +{v0['live_rise']:,} B, peak +{v0['peak_rise']:,} B; after free live "
          f"{v0['live_after_free']:,} B (before {v0['live_before']:,} B)  -> {'ok' if v0['ok'] else 'FAILED'}")
    bad = [k for k, v in vals if not v["ok"]]
    print(f"  {len(vals) - len(bad)}/{len(vals)} processes passed" + (f"; FAILED in {bad}" if bad else ""))
    print("step start = baseline + params + grads kept + optimizer state + mask cache (unique storages, "
          "rank 0, last measured step), exact bytes; and live after zero_grad - start:")
    for (b, ac, c), res in results.items():
        if "held" not in res:
            continue
        h, other = res["held"], res["other"]
        if other == 0:
            verdict = "exact"
        elif c in ("ddp", "replicate") and other == h["params"]:
            verdict = "+ gradient buckets (= parameter bytes)"
        else:
            verdict = "UNEXPLAINED"
        print(f"  blocks {b:>2} AC {'on ' if ac else 'off'} {c:<12} start {res['start']:>12,} = {res['baseline']:,} + "
              f"{h['params']:,} + {h['grads']:,} + {h['optim']:,} + {h['cache']:,} + other {other:,}  {verdict}; "
              f"end-start {res['end_minus_start']:,}" + ("" if res["start_stable"] else "  START GREW BETWEEN STEPS"))


def report(args: argparse.Namespace, results: Dict[Tuple[int, bool, str], Dict[str, Any]],
           names: List[str], blocks: List[int], acs: List[bool]) -> Dict[str, Any]:
    W = args.world_size
    cols = [n for n in TABLE_CONTENDERS if n in names]
    print(f"\npeak tensor bytes per rank during a step (MB = 1e6 B; max over {args.steps} measured steps "
          f"after {args.warmup} warm-up, and over ranks); local: 1 process, others: W={W} "
          f"{'nccl' if args.device == 'cuda' else 'gloo'}")
    ratio_name = "fully_shard/torch_fsdp2"
    hdr = f"{'blocks':>6} | {'AC':<3} | " + " | ".join(f"{c:>11}" for c in cols) + f" | {ratio_name}"
    print(hdr)
    print("-" * len(hdr))
    ratios = {}
    for b in blocks:
        for ac in acs:
            cells = []
            for c in cols:
                res = results.get((b, ac, c), {})
                cells.append(f"{fmt_mb(res['peak']) if 'peak' in res else 'FAILED':>11}")
            fs, t2 = results.get((b, ac, "fully_shard"), {}), results.get((b, ac, "torch_fsdp2"), {})
            if "peak" in fs and "peak" in t2:
                r = fs["peak"] / t2["peak"]
                ratios[f"{b}/{'ac' if ac else 'noac'}"] = r
                rtxt = f"{r:.2f}  {'ok' if r <= TARGET else 'MISSES TARGET'} (<= {TARGET:.2f})"
            else:
                rtxt = "n/a"
            print(f"{b:>6} | {'on' if ac else 'off':<3} | " + " | ".join(cells) + f" | {rtxt}")

    print("\nper contender (MB): start = alive at the step's start; accounted = params + grads kept + "
          "optimizer state + mask cache (from the tensors), other = start - baseline - accounted; "
          "fwd_keep = alive after forward - start; peaks above start; phase of the peak")
    hdr2 = (f"{'blocks':>6} {'AC':<3} {'contender':<12} {'peak':>7} {'start':>7} {'params':>7} {'grads':>7} "
            f"{'optim':>7} {'other':>7} {'fwd_keep':>8} {'peak-st':>8} {'bwd-st':>8} {'phase':>5}  ac")
    print(hdr2)
    for b in blocks:
        for ac in acs:
            for c in cols:
                res = results.get((b, ac, c))
                if res is None:
                    continue
                if "error" in res:
                    print(f"{b:>6} {'on' if ac else 'off':<3} {c:<12} FAILED: {res['error']}")
                    continue
                h = res["held"]
                flags = ("" if res["start_stable"] else "  START GREW BETWEEN STEPS") + \
                        ("" if res["validation_ok"] else "  VALIDATION FAILED")
                print(f"{b:>6} {'on' if ac else 'off':<3} {c:<12} {fmt_mb(res['peak']):>7} {fmt_mb(res['start']):>7} "
                      f"{fmt_mb(h['params']):>7} {fmt_mb(h['grads']):>7} {fmt_mb(h['optim']):>7} "
                      f"{fmt_mb(res['other']):>7} {fmt_mb(res['fwd_keep']):>8} {fmt_mb(res['peak_above_start']):>8} "
                      f"{fmt_mb(res['bwd_peak_above_start']):>8} {res['peak_phase']:>5}  {res['ac_impl']}{flags}")

    if len(blocks) > 1:
        from benchmarks.model import GPT
        ref = GPT(blocks=1)
        block_mb = sum(p.numel() for p in ref.blocks[0].parameters()) * 4 / MB
        del ref
        print("\nbackward peak above the step's start vs depth (MB), the part above the end of forward "
              "(beyond the activations forward kept), and the growth per added block (MB/block; one block's "
              f"gradient is {block_mb:.2f} MB unsharded, {block_mb / W:.2f} MB as a W={W} shard: "
              "a runtime that keeps only grad shards adds at most that much per block beyond activations)")
        for ac in acs:
            for c in cols:
                row = [results.get((b, ac, c), {}) for b in blocks]
                if not all("peak" in r for r in row):
                    continue
                a = " ".join(f"{fmt_mb(r['bwd_peak_above_start']):>7}" for r in row)
                k = " ".join(f"{fmt_mb(r['fwd_keep']):>7}" for r in row)
                d = " ".join(f"{fmt_mb(r['bwd_peak_above_fwd_end']):>7}" for r in row)
                span = blocks[-1] - blocks[0]
                slope = (row[-1]["bwd_peak_above_start"] - row[0]["bwd_peak_above_start"]) / span / MB
                act = (row[-1]["fwd_keep"] - row[0]["fwd_keep"]) / span / MB
                print(f"  AC {'on ' if ac else 'off'} {c:<12} blocks {blocks}: bwd-start {a} | fwd_keep {k} | "
                      f"bwd-fwd_end {d} | per added block: bwd-start {slope:+.2f}, fwd_keep {act:+.2f}, "
                      f"beyond activations {slope - act:+.2f}")

    traced = [(k, res) for k, res in results.items() if "at_peak" in res]
    if traced:
        print("\nwhat is alive at the peak (tracing; the rank/step with the highest peak; sizes grouped, "
              "largest totals first; labels are candidates matched by size)")
    for (b, ac, c), res in traced:
        ap = res["at_peak"]
        print(f"  blocks {b} AC {'on' if ac else 'off'} {c}: {fmt_mb(ap['traced_bytes'])} MB in {ap['blocks']} "
              f"tensors (rank {ap['rank']}, step {ap['step']}, phase {ap['phase']})")
        for row in ap["by_size"][:args.trace_top]:
            print(f"    {row['count']:>4} x {row['nbytes']:>11,} B = {fmt_mb(row['total']):>6} MB  {row['label']}")

    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__, "world_size": W,
            "device": args.device, "blocks": blocks, "checkpoint": args.checkpoint, "warmup": args.warmup,
            "steps": args.steps, "batch_per_rank": args.batch, "plain_ac": args.plain_ac,
            "keep_logits": args.keep_logits, "library": args.library or _ROOT,
            "ratios_fully_shard_over_torch_fsdp2": ratios, "target": TARGET,
            "results": [{"blocks": b, "ac": ac, "contender": c, **{k: v for k, v in res.items()}}
                        for (b, ac, c), res in results.items()]}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--blocks", default="4,8,16", help="comma-separated block counts")
    p.add_argument("--checkpoint", choices=("on", "off", "both"), default="both",
                   help="per-block activation checkpointing")
    p.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS),
                   help="comma-separated subset of " + ",".join(ALL_CONTENDERS))
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps first (>= 1: lazy init, AdamW state)")
    p.add_argument("--steps", type=int, default=2, help="measured steps")
    p.add_argument("--batch", type=int, default=4, help="batch per rank")
    p.add_argument("--plain-ac", choices=("ours", "torch"), default="ours",
                   help="checkpointing for local/ddp: composable_shard.checkpoint or torch.utils.checkpoint")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: torch.cuda memory stats, NCCL, one GPU per rank")
    p.add_argument("--keep-logits", action="store_true",
                   help="keep a Python reference to the logits for the whole step (as benchmarks/run.py "
                        "does); by default none is kept")
    p.add_argument("--library", default="",
                   help="import composable_shard from this directory instead of this checkout "
                        "(e.g. a `git archive` export of an older commit)")
    p.add_argument("--trace-peak", action="store_true",
                   help="CPU: record the sizes of the tensors alive at each step's peak and print the "
                        "largest groups (slower: a mutex per allocation)")
    p.add_argument("--trace-top", type=int, default=10, help="size groups shown per configuration")
    p.add_argument("--json", default="", help="also write the results to this path")
    p.add_argument("--from-json", default="", help="print the report of an earlier --json file; runs nothing")
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1")
    return args


def _git_state(root: str) -> str:
    import subprocess
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "composable_shard"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        return "git state unknown"
    return f"HEAD {head}" + (", composable_shard/ has uncommitted changes" if dirty else ", clean")


def reprint(path: str) -> None:
    with open(path) as f:
        saved = json.load(f)
    results = {(r["blocks"], r["ac"], r["contender"]): r for r in saved["results"]}
    names = list(dict.fromkeys(c for _, _, c in results))
    blocks = sorted({b for b, _, _ in results})
    acs = sorted({ac for _, ac, _ in results})
    args = argparse.Namespace(world_size=saved["world_size"], steps=saved["steps"], warmup=saved["warmup"],
                              device=saved["device"], checkpoint=saved["checkpoint"], batch=saved["batch_per_rank"],
                              plain_ac=saved["plain_ac"], keep_logits=saved.get("keep_logits", False),
                              library=saved.get("library", ""), trace_top=10)
    print(f"report of {path} (run {saved['date']}, torch {saved['torch']})")
    print_validation(results)
    report(args, results, names, blocks, acs)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.from_json:
        reprint(args.from_json)
        return
    names = [n for n in args.contenders.replace(",", " ").split() if n]
    unknown = [n for n in names if n not in ALL_CONTENDERS]
    if unknown:
        raise SystemExit(f"unknown contenders {unknown}; choose from {ALL_CONTENDERS}")
    if args.library:  # spawned ranks inherit sys.path
        sys.path.insert(0, os.path.abspath(args.library))
    import composable_shard
    lib = os.path.dirname(os.path.dirname(os.path.abspath(composable_shard.__file__)))
    print(f"composable_shard from {lib}" + ("" if args.library else f" ({_git_state(lib)})"))
    blocks = [int(b) for b in args.blocks.split(",") if b]
    acs = {"on": [True], "off": [False], "both": [False, True]}[args.checkpoint]
    so_path = ""
    if args.device == "cpu":
        t0 = time.perf_counter()
        so_path = ca.build()
        print(f"counting allocator: {so_path} ({time.perf_counter() - t0:.1f} s to build/load)")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"contenders {names}; blocks {blocks}; AC {['on' if a else 'off' for a in acs]}")
    sys.stdout.flush()
    results: Dict[Tuple[int, bool, str], Dict[str, Any]] = {}
    cfg_base = {"world_size": args.world_size, "warmup": args.warmup, "steps": args.steps, "batch": args.batch,
                "plain_ac": args.plain_ac, "device": args.device, "keep_logits": args.keep_logits,
                "trace_peak": args.trace_peak and args.device == "cpu"}
    for b in blocks:
        for ac in acs:
            for c in names:
                res = run_config(dict(cfg_base, blocks=b, ac=ac, contender=c), so_path)
                results[(b, ac, c)] = res
                status = (f"peak {fmt_mb(res['peak'])} MB, start {fmt_mb(res['start'])} MB, {res['wall_s']:.0f} s"
                          if "peak" in res else f"FAILED: {res['error']}")
                print(f"  blocks {b:>2} AC {'on ' if ac else 'off'} {c:<12} {status}")
                sys.stdout.flush()
    print()
    print_validation(results)
    out = report(args, results, names, blocks, acs)
    print(f"\nload average at end {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
