"""``composable_shard.plan`` against the counting allocator (issue 36, item 4): for budgets between
the smallest feasible peak and one unsharded process's peak (and one above it), plan, apply,
train, and compare the measured peak per rank with the plan's prediction and the budget.

    python benchmarks/plan.py                         # gpt4, gpt16, llama at W=2: the table; exit 1 on a miss
    python benchmarks/plan.py --workloads gpt_uneven,convnet,llama_v256,llama_frozen   # issue 44's workloads
    python benchmarks/plan.py --workloads gpt4 --fractions 0,0.5,1 [--world-size 2] [--tolerance 0.10]
                              [--warmup 1] [--steps 2] [--timed-steps 3] [--above 1.10] [--no-trace]
                              [--json PATH]
    python benchmarks/plan.py --from-json PATH        # re-print (and re-judge) a saved run

Needs the counting allocator (a C++ compiler and ``ninja``, as benchmarks/memory.py).

[Note: Plan verification]
  workloads  gpt4, gpt16: benchmarks/model.py's GPT at 4 and 16 blocks, seq 128, batch 4 per
             rank, next-token cross-entropy (the plan measures with the same loss, passed as
             ``loss_fn``). llama: transformers' LlamaForCausalLM, 4 layers, width 256, 8 heads,
             MLP 688, vocab 4096, seq 128, batch 4 per rank, ``labels=input_ids`` (the plan's
             default loss, ``output.loss``), LlamaConfig's defaults otherwise (``use_cache=True``:
             a DynamicCache is filled in training too). llama_nocache (not in the default set):
             the same with ``use_cache=False``, as HF's own gradient checkpointing sets it.
             llama_frozen: llama_nocache with layers 0-1 ``requires_grad=False``. llama_v256:
             llama_nocache with a 256-token vocabulary (a small head: plans peak inside a block's
             backward, SHARD_GRAD_OP ones among them). gpt_uneven: gpt4 with block 1's MLP 58x
             wide (10x the parameters of the others). convnet: a stem convolution, 4 residual
             conv + BatchNorm blocks (48 channels, 32x32), a pooled linear head, cross-entropy.
             Model seed 1234, data seed 5678 + rank.
  reference  "one unsharded process's peak": the plain model (no API) trained in one process
             under the counting allocator, measured as below. The smallest feasible peak is the
             plan's own (``plan`` with a budget of 1 B fails, naming it); both are computed
             per workload before the budgets are chosen.
  budgets    smallest + f * (top - smallest) for each f of ``--fractions`` (default six, 0 to
             1; top = max(unsharded peak, the plan's predicted peak of ``replicate(model)``, which
             is the larger when one block dominates the model)), plus ``--above`` (1.10) x max(unsharded peak, the plan's predicted peak of
             ``replicate(model)``): there the plan must be all ``replicate``, no checkpointing.
  ranks      per budget, W fresh gloo ranks install the allocator first, make their batches, then
             (baseline = live bytes) build the model, ``plan(model, batch, memory_budget=budget,
             world_size=W)``, ``p.apply(model)``, AdamW(lr=1e-3) on ``model.parameters()``;
             ``--warmup`` unmeasured steps, ``--steps`` measured ones (the peak counter reset at
             each phase: forward, backward, optimizer step, zero_grad(set_to_none=True)), then
             ``--timed-steps`` timed ones (perf_counter around the step and a barrier, median of
             rank 0; the allocator stays on, so times carry its small overhead).
  figures    measured = highest phase peak - baseline, max over measured steps and ranks: the
             bytes the model and its step hold, as the plan predicts them (the batch excluded).
             A row fails if measured > budget or |measured / predicted - 1| > ``--tolerance``;
             the run exits 1 if any row fails, a plan could not be made for a budget inside
             the range, or the ranks chose different plans.
  at peak    with tracing (default on): the sizes of the tensors alive at the highest peak,
             largest totals first, labelled by size (parameters, flat shards and unsharded flat
             buffers of the plan's handles, logits); printed for a failing row next to the
             plan's predicted components, so the model of the peak can be corrected.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# Nothing below may create a tensor at import time: ranks install the counting allocator first.
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402

from benchmarks import counting_allocator as ca  # noqa: E402

INIT_SEED = 1234
DATA_SEED = 5678
MB = 1e6
PHASES = ("fwd", "bwd", "opt", "zero")
WORKLOADS = ("gpt4", "gpt16", "llama", "llama_nocache", "llama_frozen", "llama_v256", "gpt_uneven", "convnet")
DEFAULT_WORKLOADS = ("gpt4", "gpt16", "llama")
DEFAULT_FRACTIONS = "0,0.2,0.4,0.6,0.8,1"
HUGE_BUDGET = 1 << 50  # above any peak: the plan of replicate(model)


# ---------------------------------------------------------------------------- workloads
class ConvBlock(nn.Module):
    """A residual convolution block with batch norm (running statistics: buffers)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class ConvNet(nn.Module):
    """A non-transformer workload: stem convolution, 4 residual blocks at 32x32, pooled linear head."""

    def __init__(self, channels: int = 48, blocks: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList([ConvBlock(channels) for _ in range(blocks)])
        self.head = nn.Linear(channels, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(images))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


class Workload:
    """One model, its per-rank batch and its loss; ``example``/``plan_loss`` are what plan() gets."""

    def __init__(self, name: str, batch: int = 4) -> None:
        self.name, self.batch = name, batch

    def build(self) -> nn.Module:
        torch.manual_seed(INIT_SEED)
        if self.name.startswith("llama"):
            from transformers import LlamaConfig, LlamaForCausalLM
            vocab = 256 if self.name == "llama_v256" else 4096  # a small head: the peak falls in a block's backward
            config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128)
            if self.name in ("llama_nocache", "llama_frozen", "llama_v256"):  # what HF's own gradient checkpointing sets
                config.use_cache = False
            model = LlamaForCausalLM(config)
            if self.name == "llama_frozen":  # fine-tuning the upper half: layers 0-1 frozen
                for layer in model.model.layers[:2]:
                    layer.requires_grad_(False)
            return model
        if self.name == "convnet":
            return ConvNet()
        from benchmarks.model import GPT, WIDTH, Block
        if self.name == "gpt_uneven":  # block 1 holds 10x the parameters of the others (its MLP 58x wide)
            model = GPT(blocks=4)
            model.blocks[1] = Block(hidden=58 * WIDTH)
            return model
        return GPT(blocks={"gpt4": 4, "gpt16": 16}[self.name])

    def make_batch(self, gen: torch.Generator) -> Any:
        if self.name == "convnet":
            return torch.randn(self.batch, 3, 32, 32, generator=gen), torch.randint(0, 10, (self.batch,), generator=gen)
        from benchmarks.model import SEQ, VOCAB, make_batch
        tokens, targets = make_batch(self.batch, SEQ, 256 if self.name == "llama_v256" else VOCAB, gen)
        if self.name.startswith("llama"):  # the model shifts the labels itself
            return {"input_ids": tokens, "labels": tokens}
        return tokens, targets

    def example(self, batch: Any) -> Any:
        return batch if self.name.startswith("llama") else batch[0]

    def plan_loss(self, batch: Any) -> Optional[Callable[[Any], torch.Tensor]]:
        """The loss plan() measures with: the training step's own (llama: ``output.loss``, the default)."""
        if self.name.startswith("llama"):
            return None
        import torch.nn.functional as F
        targets = batch[1]
        if self.name == "convnet":
            return lambda logits: F.cross_entropy(logits, targets)
        return lambda logits: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self.name.startswith("llama"):
            return model(**batch).loss
        import torch.nn.functional as F
        tokens, targets = batch
        if self.name == "convnet":
            return F.cross_entropy(model(tokens), targets)
        return F.cross_entropy(model(tokens).reshape(-1, 4096), targets.reshape(-1))


# ---------------------------------------------------------------------------- one rank
def rank_worker(rank: int, cfg: Dict[str, Any], so_path: str, port: int, outdir: str) -> None:
    ca.install(so_path)  # first: before this process creates any tensor
    if cfg["trace"]:
        ca.set_tracing(True)
    validation = ca.validate()
    torch.set_num_threads(1)
    import torch.distributed as dist
    distributed = cfg["budget"] is not None
    if distributed:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=cfg["world_size"], timeout=timedelta(seconds=600))
    try:
        out = _measure(rank, cfg, distributed)
        out["validation_ok"] = bool(validation["ok"])
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        if distributed:
            gc.collect()
            dist.destroy_process_group()


def _plan_info(p: Any) -> Dict[str, Any]:
    return {"predicted": int(p.predicted_peak), "components": {k: int(v) for k, v in p.components.items()},
            "moment": str(getattr(p, "peak_moment", "")), "bytes_sent": int(p.bytes_sent),
            "choices": [{"fqn": c.fqn, "api": c.api, "strategy": c.strategy, "checkpoint": bool(c.checkpoint),
                         "prefetch": bool(c.prefetch)} for c in p.choices],
            "text": str(p), "labels": _handle_labels(p, cfg_world=int(p.world_size))}


def _measure(rank: int, cfg: Dict[str, Any], distributed: bool) -> Dict[str, Any]:
    import torch.distributed as dist

    wl = Workload(cfg["workload"], cfg["batch"])
    gen = torch.Generator().manual_seed(DATA_SEED + rank)
    batches = [wl.make_batch(gen) for _ in range(cfg["warmup"] + cfg["steps"] + cfg["timed_steps"])]

    def barrier() -> None:
        if distributed:
            dist.barrier()

    gc.collect()
    barrier()
    baseline = ca.live()
    model = wl.build()
    info: Dict[str, Any] = {}
    if distributed:
        from composable_shard import plan
        p = plan(model, wl.example(batches[0]), memory_budget=cfg["budget"], world_size=cfg["world_size"],
                 loss_fn=wl.plan_loss(batches[0]), profile=cfg.get("profile", "auto"))
        info = _plan_info(p)
        p.apply(model)
        del p
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = [_one_step(wl, model, optim, batches[i], barrier, cfg["trace"]) for i in range(cfg["warmup"] + cfg["steps"])]
    times = []
    for i in range(cfg["timed_steps"]):
        barrier()
        t0 = time.perf_counter()
        _one_step(wl, model, optim, batches[cfg["warmup"] + cfg["steps"] + i], barrier, False)
        times.append((time.perf_counter() - t0) * 1e3)
    measured = steps[cfg["warmup"]:]
    top = max(measured, key=lambda s: s["peak"])
    return {"rank": rank, "baseline": baseline, "plan": info, "step_ms": times,
            "peak": max(s["peak"] for s in measured) - baseline, "start": top["start"] - baseline,
            "phase": top["phase"], "peak_sizes": top.get("peak_sizes", [])}


def _one_step(wl: Workload, model: nn.Module, optim: torch.optim.Optimizer, batch: Any,
              barrier: Callable[[], None], trace: bool) -> Dict[str, Any]:
    """Forward + loss, backward, optimizer step, zero_grad; the peak of each phase (a barrier
    first, outside the measured region)."""
    barrier()
    rec: Dict[str, Any] = {"start": ca.live(), "peak": 0, "phase": ""}
    ca.reset_peak()

    def end(phase: str) -> None:
        peak = ca.peak()
        if peak > rec["peak"]:
            rec.update(peak=peak, phase=phase)
            if trace:
                rec["peak_sizes"] = ca.peak_sizes()
        ca.reset_peak()

    loss = wl.loss(model, batch)
    end("fwd")
    loss.backward()
    del loss
    end("bwd")
    optim.step()
    end("opt")
    optim.zero_grad(set_to_none=True)
    end("zero")
    return rec


# ---------------------------------------------------------------------------- labels at the peak
def _handle_labels(p: Any, cfg_world: int) -> Dict[str, str]:
    """Candidate names for block sizes seen at the peak: each planned handle's shard and
    unsharded flat buffer (fp32), from the plan's description rows."""
    labels: Dict[int, List[str]] = {}
    for row in p.description.rows:
        name = re.sub(r"\.\d+(\.|$)", r".*\1", row.fqn) or "<root>"
        for nbytes, what in ((row.shard_numel * 4, f"{name} shard"),
                             (row.shard_numel * cfg_world * 4, f"{name} unsharded flat / its gradient"),
                             (row.numel * 4, f"{name} all parameters")):
            names = labels.setdefault(int(nbytes), [])
            if what not in names and len(names) < 3:
                names.append(what)
    return {str(k): ", ".join(v) for k, v in labels.items()}


def _model_labels(workload: str, batch: int) -> Dict[str, str]:
    """Parameter sizes by name (digits folded) and the logits' size."""
    wl = Workload(workload, batch)
    model = wl.build()
    labels: Dict[int, List[str]] = {batch * 128 * 4096 * 4: ["logits-sized (B,T,V) fp32"]}
    for name, prm in model.named_parameters():
        names = labels.setdefault(prm.numel() * prm.element_size(), [])
        short = "param/grad " + re.sub(r"\.\d+\.", ".*.", name)
        if short not in names and len(names) < 3:
            names.append(short)
    return {str(k): ", ".join(v) for k, v in labels.items()}


def at_peak(sizes: List[int], labels: Dict[str, str], top: int) -> List[str]:
    hist: Dict[int, int] = {}
    for n in sizes:
        hist[n] = hist.get(n, 0) + 1
    rows = sorted(hist.items(), key=lambda kv: -kv[0] * kv[1])[:top]
    return [f"{c:>5} x {n:>12,} B = {n * c / MB:>7.2f} MB  {labels.get(str(n), '')}" for n, c in rows]


# ---------------------------------------------------------------------------- parent
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(cfg: Dict[str, Any], so_path: str) -> Dict[str, Any]:
    """One set of ranks (1 process when ``budget`` is None: the unsharded reference)."""
    nprocs = 1 if cfg["budget"] is None else cfg["world_size"]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cs_plan_") as outdir:
        try:
            mp.spawn(rank_worker, args=(cfg, so_path, _free_port(), outdir),  # type: ignore[attr-defined]
                     nprocs=nprocs, join=True)
        except Exception as exc:  # one budget failing must not stop the others
            lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
            return {"error": lines[-1] if lines else type(exc).__name__, "detail": str(exc)[-3000:]}
        ranks = []
        for r in range(nprocs):
            with open(os.path.join(outdir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    top = max(ranks, key=lambda r: r["peak"])
    texts = {json.dumps(r["plan"].get("choices")) for r in ranks}
    return {"peak": top["peak"], "start": top["start"], "phase": top["phase"], "peak_sizes": top["peak_sizes"],
            "step_ms": statistics.median(ranks[0]["step_ms"]) if ranks[0]["step_ms"] else float("nan"),
            "plan": ranks[0]["plan"], "ranks_agree": len(texts) == 1,
            "validation_ok": all(r["validation_ok"] for r in ranks), "wall_s": time.perf_counter() - t0}


def plan_extremes(workload: str, world: int, batch: int) -> Tuple[int, int]:
    """(the smallest feasible peak, the predicted peak of replicate(model)), from plan() itself,
    in this (uninstrumented) process."""
    from composable_shard import plan
    wl = Workload(workload, batch)
    model = wl.build()
    example = wl.make_batch(torch.Generator().manual_seed(DATA_SEED))
    try:
        plan(model, wl.example(example), memory_budget=1, world_size=world, loss_fn=wl.plan_loss(example))
    except ValueError as exc:
        found = re.search(r"smallest peak is ([\d,]+) B", str(exc))
        if found is None:
            raise RuntimeError(f"plan()'s error no longer names the smallest peak: {exc}") from exc
        smallest = int(found.group(1).replace(",", ""))
    else:
        raise RuntimeError("plan() accepted a budget of 1 byte")
    whole = plan(model, wl.example(example), memory_budget=HUGE_BUDGET, world_size=world,
                 loss_fn=wl.plan_loss(example))
    return smallest, int(whole.predicted_peak)


def run_workload(name: str, args: argparse.Namespace, so_path: str) -> Dict[str, Any]:
    base = {"workload": name, "world_size": args.world_size, "batch": args.batch, "warmup": args.warmup,
            "steps": args.steps, "timed_steps": args.timed_steps, "trace": args.trace, "profile": args.profile}
    local = spawn(dict(base, budget=None), so_path)
    if "error" in local:
        return {"workload": name, "error": f"the unsharded reference failed: {local['error']}"}
    smallest, replicate_peak = plan_extremes(name, args.world_size, args.batch)
    unsharded = local["peak"]
    print(f"{name}: one unsharded process's peak {unsharded / MB:.2f} MB (measured), smallest feasible "
          f"{smallest / MB:.2f} MB, replicate(model) predicted {replicate_peak / MB:.2f} MB")
    top = max(unsharded, replicate_peak)  # a model dominated by one block may not shrink below one process
    if top <= smallest:
        return {"workload": name, "error": f"unsharded peak {unsharded:,} B and replicate(model)'s {replicate_peak:,} B "
                                           f"<= the smallest plan's {smallest:,} B"}
    budgets = [(f"{f:g}", smallest + int(f * (top - smallest))) for f in args.fractions]
    budgets.append(("above", int(math.ceil(args.above * max(unsharded, replicate_peak)))))
    rows = []
    for where, budget in budgets:
        res = spawn(dict(base, budget=budget), so_path)
        res.update(where=where, budget=budget)
        rows.append(res)
        print(f"  budget {budget / MB:8.2f} MB ({where}): " + (
            f"predicted {res['plan']['predicted'] / MB:.2f}, measured {res['peak'] / MB:.2f} MB, {res['wall_s']:.0f} s"
            if "error" not in res else f"FAILED: {res['error']}"))
        sys.stdout.flush()
    return {"workload": name, "unsharded": unsharded, "smallest": smallest, "replicate_predicted": replicate_peak,
            "labels": _model_labels(name, args.batch), "rows": rows}


# ---------------------------------------------------------------------------- report
def annotation(choices: List[Dict[str, Any]]) -> str:
    """The plan in a few words: the root's API, then the blocks grouped by what they got."""
    if not choices:
        return "-"
    root, blocks = choices[0], choices[1:]
    kinds: Dict[str, int] = {}
    for c in blocks:
        what = ("replicate" if c["api"] == "replicate" else c["strategy"]) + ("+ckpt" if c["checkpoint"] else "")
        kinds[what] = kinds.get(what, 0) + 1
    return f"root {root['api'] if root['api'] == 'replicate' else root['strategy']}; " + \
        ", ".join(f"{n}x {k}" for k, n in kinds.items())


def verdict(row: Dict[str, Any], tolerance: float) -> List[str]:
    """What is wrong with one budget's row (empty: nothing)."""
    if "error" in row:
        return [f"failed: {row['error']}"]
    problems = []
    predicted, measured, budget = row["plan"]["predicted"], row["peak"], row["budget"]
    if measured > budget:
        problems.append(f"measured {measured:,} B > budget {budget:,} B")
    if abs(measured / predicted - 1) > tolerance:
        problems.append(f"measured/predicted {measured / predicted:.3f} is off by more than {tolerance:.0%}")
    if row["where"] == "above" and any(c["api"] != "replicate" or c["checkpoint"] for c in row["plan"]["choices"]):
        problems.append("above the unsharded peak the plan must be all replicate without checkpointing")
    if not row["ranks_agree"]:
        problems.append("the ranks chose different plans")
    if not row["validation_ok"]:
        problems.append("allocator self-test failed")
    return problems


def print_workload(res: Dict[str, Any], tolerance: float, top: int) -> List[str]:
    """The table of one workload; returns its failures."""
    name = res["workload"]
    if "error" in res:
        print(f"\n{name}: FAILED: {res['error']}")
        return [f"{name}: {res['error']}"]
    print(f"\n==== {name}: unsharded peak {res['unsharded'] / MB:.2f} MB (one process, measured), smallest feasible "
          f"{res['smallest'] / MB:.2f} MB (plan), replicate(model) {res['replicate_predicted'] / MB:.2f} MB (plan) ====")
    hdr = (f"{'f':>6} {'budget MB':>10} {'predicted':>10} {'measured':>10} {'meas/pred':>10} {'<= budget':>10} "
           f"{'step ms':>8}  plan")
    print(hdr)
    print("-" * len(hdr))
    failures = []
    for row in res["rows"]:
        problems = verdict(row, tolerance)
        failures += [f"{name} budget {row['budget']:,} B ({row['where']}): {p}" for p in problems]
        if "error" in row:
            print(f"{row['where']:>6} {row['budget'] / MB:>10.2f}  FAILED: {row['error']}")
            continue
        pred = row["plan"]["predicted"]
        print(f"{row['where']:>6} {row['budget'] / MB:>10.2f} {pred / MB:>10.2f} {row['peak'] / MB:>10.2f} "
              f"{row['peak'] / pred:>10.3f} {'yes' if row['peak'] <= row['budget'] else 'NO':>10} "
              f"{row['step_ms']:>8.1f}  {annotation(row['plan']['choices'])}" + ("  <-- " + "; ".join(problems)
                                                                                 if problems else ""))
    for row in res["rows"]:
        if "error" not in row and verdict(row, tolerance):
            print_breakdown(res, row, top)
    return failures


def print_breakdown(res: Dict[str, Any], row: Dict[str, Any], top: int) -> None:
    """A failing row: the plan's predicted components next to what the allocator saw alive."""
    plan = row["plan"]
    comps = ", ".join(f"{k} {v / MB:.2f}" for k, v in plan["components"].items())
    print(f"\n  budget {row['budget'] / MB:.2f} MB ({row['where']}): predicted {plan['predicted'] / MB:.2f} MB at the "
          f"{plan['moment']} = {comps} (MB); measured {row['peak'] / MB:.2f} MB in phase {row['phase']}, "
          f"{row['start'] / MB:.2f} MB held at the step's start")
    if row["peak_sizes"]:
        labels = dict(res["labels"], **plan.get("labels", {}))
        print(f"  alive at the measured peak (every tensor of the process, the batch included; "
              f"{sum(row['peak_sizes']) / MB:.2f} MB in {len(row['peak_sizes'])} tensors):")
        for line in at_peak(row["peak_sizes"], labels, top):
            print("    " + line)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                   help="comma-separated subset of " + ",".join(WORKLOADS))
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="batch per rank")
    p.add_argument("--fractions", default=DEFAULT_FRACTIONS,
                   help="budgets: smallest + f * (unsharded - smallest) for each f (at least 5 between them)")
    p.add_argument("--above", type=float, default=1.10,
                   help="the last budget: this times max(unsharded peak, replicate(model)'s predicted peak)")
    p.add_argument("--tolerance", type=float, default=0.10, help="allowed |measured / predicted - 1|")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="measured steps")
    p.add_argument("--timed-steps", type=int, default=3)
    p.add_argument("--no-trace", dest="trace", action="store_false", help="skip recording the tensors alive at the peak")
    p.add_argument("--top", type=int, default=12, help="size groups shown for a failing row")
    p.add_argument("--profile", default="auto", choices=["auto", "fake", "measured"],
                   help="plan()'s profile source: fake prices recomputation by FLOPs (a meta-device model's default)")
    p.add_argument("--json", default="")
    p.add_argument("--from-json", default="")
    args = p.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    try:
        args.fractions = [float(f) for f in args.fractions.split(",") if f]
    except ValueError:
        p.error(f"--fractions: numbers between 0 and 1, got {args.fractions!r}")
    if not args.fractions or not all(0 <= f <= 1 for f in args.fractions):
        p.error("--fractions: numbers between 0 and 1")
    if args.above <= 1 or args.world_size < 2 or min(args.warmup, args.steps) < 1 or args.timed_steps < 0:
        p.error("--above > 1, --world-size >= 2, --warmup and --steps >= 1, --timed-steps >= 0")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        results = saved["results"]
    else:
        t0 = time.perf_counter()
        so_path = ca.build()
        print(f"counting allocator: {so_path}; torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f}; W={args.world_size}; workloads {args.workloads}")
        results = [run_workload(name, args, so_path) for name in args.workloads]
        print(f"\nwall {time.perf_counter() - t0:.0f} s, load average at end {os.getloadavg()[0]:.1f}")
    failures = [f for res in results for f in print_workload(res, args.tolerance, args.top)]
    print(f"\n==== plan verification: {len(failures)} problem(s) (measured <= budget and within "
          f"{args.tolerance:.0%} of the prediction; all replicate above the unsharded peak) ====")
    for failure in failures:
        print(f"  MISSED {failure}")
    if args.json and not args.from_json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__, "argv": sys.argv[1:],
                       "results": results}, f, indent=1)
        print(f"wrote {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
