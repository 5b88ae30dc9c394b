"""BENCHMARK.md's GPU workload: ``python benchmarks/run.py --workload gpu [--check] [--json PATH]``.

One GPU, one process, a W=1 NCCL process group (``--world``/``--blocks`` do not apply). Model: benchmarks/model.py's GPT with width
2048, 16 heads, 16 blocks, vocab 4096, sequence 2048; batch 4; AdamW(lr=1e-3). Contenders:

  local        the model alone, fp32 parameters, forward under ``torch.autocast("cuda", bfloat16)``
               (torch's own way to compute in bf16 without a data-parallel API);
  torch_fsdp2  torch ``fully_shard`` per block, then the root, ``MixedPrecisionPolicy(param_dtype=bf16)``;
  fully_shard  ours per block, then the root, ``MixedPrecision(param_dtype=bf16)``;
  torch_fsdp2_fp8, fully_shard_fp8  the same after torchao's ``convert_to_float8_training`` of the
               blocks' linears with ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` (float8
               matmuls, weights all-gathered as float8; FSDP2 also runs torchao's
               ``precompute_float8_dynamic_scale_for_fsdp`` after each optimizer step, as torchtitan
               does); the MLPs' linears (attention's projections are used through
               ``F.multi_head_attention_forward``, not their forward). Only where torchao is installed and the GPU has float8 matmuls (compute
               capability 8.9 or later); issue 57.

Every model is built on the GPU from the same seed. ``--warmup`` rounds, then ``--steps`` timed
rounds, contenders alternating; a step is forward + fp32 cross-entropy, backward, optimizer
step, zero_grad, then ``torch.cuda.synchronize()``, timed with perf_counter. Memory: after the
timed rounds every model is freed; then each contender alone is built, runs one step, and runs
one more with the peak statistics reset: its figure is ``torch.cuda.max_memory_allocated()``
during that step minus the bytes allocated before it was built.

Targets (BENCHMARK.md): fully_shard step time <= torch_fsdp2's and <= 1.03 x local's; peak
memory <= torch_fsdp2's. All three models are alive during the timed rounds: about 10 GB each at
rest (fp32 parameters and AdamW state) plus one step's gradients and activations, so about
40-60 GB of GPU memory in all.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from typing import Any, Dict, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.model import GPT, make_batch

WIDTH, HEADS, BLOCKS, SEQ, BATCH, VOCAB = 2048, 16, 16, 2048, 4, 4096
CONTENDERS = ["local", "torch_fsdp2", "fully_shard"]
FLOAT8_CONTENDERS = ["torch_fsdp2_fp8", "fully_shard_fp8"]
DEVICE = "cuda"  # a CPU dry run of the logic sets "cpu" (memory figures are then 0)
SEED, DATA_SEED = 1234, 5678
GB = 1e9
# (numerator, denominator, target, what)
TARGETS = [("fully_shard", "torch_fsdp2", 1.00, "step time"), ("fully_shard", "local", 1.03, "step time"),
           ("fully_shard", "torch_fsdp2", 1.00, "peak memory")]
FLOAT8_TARGETS = [("fully_shard_fp8", "torch_fsdp2_fp8", 1.00, "step time"),
                  ("fully_shard_fp8", "torch_fsdp2_fp8", 1.00, "peak memory")]


def float8_available() -> bool:
    """torchao importable and float8 matmuls on this device (CUDA compute capability >= 8.9; the CPU
    dry run has torch's CPU kernel)."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return DEVICE != "cuda" or torch.cuda.get_device_capability(0) >= (8, 9)


def contenders() -> List[str]:
    return CONTENDERS + (FLOAT8_CONTENDERS if float8_available() else [])


def _convert_float8(model: nn.Module) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                               module_filter_fn=lambda module, fqn: ".mlp." in fqn)  # attention's out_proj is used
                               # through F.multi_head_attention_forward (its weight, not its forward): left alone


def build(name: str, mesh: Any) -> Tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(SEED)
    with torch.device(DEVICE):
        model = GPT(blocks=BLOCKS, vocab=VOCAB, width=WIDTH, heads=HEADS, max_seq=SEQ)
    if name.endswith("_fp8"):
        _convert_float8(model)
        name = name[:-len("_fp8")]
    if name == "torch_fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for block in model.blocks:
            torch_fully_shard(block, mesh=mesh, mp_policy=policy)
        torch_fully_shard(model, mesh=mesh, mp_policy=policy)
    elif name == "fully_shard":
        from composable_shard import MixedPrecision, fully_shard
        mp = MixedPrecision(param_dtype=torch.bfloat16)
        for block in model.blocks:
            fully_shard(block, mixed_precision=mp)
        fully_shard(model, mixed_precision=mp)
    elif name != "local":
        raise ValueError(f"unknown GPU contender {name!r}")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(name: str, model: nn.Module, optim: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    """One training step, synchronized at the end; returns the loss."""
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=name == "local"):
        logits = model(tokens)
    loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
    del logits
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    if name == "torch_fsdp2_fp8":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
        precompute_float8_dynamic_scale_for_fsdp(model)
    _sync()
    return float(loss.detach())


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _allocated() -> int:
    return int(torch.cuda.memory_allocated()) if DEVICE == "cuda" else 0


def _peak() -> int:
    return int(torch.cuda.max_memory_allocated()) if DEVICE == "cuda" else 0


def _reset_peak() -> None:
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("--workload gpu needs a CUDA GPU, and torch.cuda.is_available() is False on this machine "
              f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}). Run it on a GPU machine; "
              "the CPU workload is the default (--workload cpu).", file=sys.stderr)
        return 2
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=600))
    try:
        result = _run(args, init_device_mesh("cuda", (1,)))
    finally:
        gc.collect()
        dist.destroy_process_group()
    print_report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": "gpu", "argv": sys.argv[1:], "result": result}, f, indent=1)
        print(f"wrote {args.json}")
    missed = [c for c in result["checks"] if not c["ok"]]
    if args.check and missed:
        print(f"--check: {len(missed)} missed (listed above)")
        return 1
    return 0


def _run(args: argparse.Namespace, mesh: Any) -> Dict[str, Any]:
    gen = torch.Generator().manual_seed(DATA_SEED)
    batches = [tuple(t.to(DEVICE) for t in make_batch(BATCH, SEQ, VOCAB, gen)) for _ in range(args.warmup + args.steps)]
    t0 = time.perf_counter()
    names = contenders()
    models = {name: build(name, mesh) for name in names}
    print(f"built {', '.join(names)} in {time.perf_counter() - t0:.1f} s; "
          f"{_allocated() / GB:.1f} GB allocated")
    times: Dict[str, List[float]] = {n: [] for n in names}
    losses: Dict[str, List[float]] = {n: [] for n in names}
    for i, (tokens, targets) in enumerate(batches):
        for name, (model, optim) in models.items():
            _sync()
            t = time.perf_counter()
            loss = step(name, model, optim, tokens, targets)
            if i >= args.warmup:
                times[name].append((time.perf_counter() - t) * 1e3)
                losses[name].append(loss)
    del models
    gc.collect()
    _empty_cache()

    memory: Dict[str, Dict[str, int]] = {}
    for name in names:  # each alone: build, one step, one measured step
        gc.collect()
        _sync()
        before = _allocated()
        model, optim = build(name, mesh)
        step(name, model, optim, *batches[0])
        _reset_peak()
        step(name, model, optim, *batches[1 % len(batches)])
        memory[name] = {"peak_bytes": _peak() - before}
        del model, optim
        gc.collect()
        _empty_cache()

    rows: Dict[str, Dict[str, Any]] = {n: {"median_ms": statistics.median(times[n]), "min_ms": min(times[n]), "max_ms": max(times[n]),
                "step_ms": times[n], "losses": losses[n], **memory[n]} for n in names}
    checks = []
    for num, den, target, what in TARGETS + (FLOAT8_TARGETS if "fully_shard_fp8" in names else []):
        key = "median_ms" if what == "step time" else "peak_bytes"
        value = rows[num][key] / rows[den][key] if rows[den][key] else float("nan")
        checks.append({"name": f"GPU: {what} {num}/{den} <= {target:.2f}", "ok": value <= target, "checked": True,
                       "value": value, "detail": f"{value:.3f}"})
    device = torch.cuda.get_device_name(0) if DEVICE == "cuda" else f"{DEVICE} (dry run)"
    return {"device": device, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "width": WIDTH, "heads": HEADS, "blocks": BLOCKS, "seq": SEQ, "batch": BATCH, "vocab": VOCAB,
            "warmup": args.warmup, "steps": args.steps, "contenders": rows, "checks": checks,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "")}


def print_report(result: Dict[str, Any]) -> None:
    print(f"\n==== GPU workload: {result['device']}, torch {result['torch']}, W=1 NCCL ====")
    print(f"GPT width {result['width']}, {result['heads']} heads, {result['blocks']} blocks, vocab {result['vocab']}, "
          f"seq {result['seq']}, batch {result['batch']}; bf16 compute (local: autocast; ours: MixedPrecision; "
          f"FSDP2: MixedPrecisionPolicy); {result['warmup']} warm-up + {result['steps']} timed rounds, alternating\n")
    hdr = f"{'contender':<17}{'median ms':>10}{'min':>9}{'max':>9}{'peak GB':>9}{'final loss':>12}"
    print(hdr)
    print("-" * len(hdr))
    for name, r in result["contenders"].items():
        print(f"{name:<17}{r['median_ms']:>10.1f}{r['min_ms']:>9.1f}{r['max_ms']:>9.1f}{r['peak_bytes'] / GB:>9.2f}"
              f"{r['losses'][-1]:>12.5f}")
    print("\nchecks (step times: ratio of medians; peak: torch.cuda.max_memory_allocated during one step of the "
          "contender alone, minus what was allocated before it was built)")
    for c in result["checks"]:
        print(f"  {'ok' if c['ok'] else 'MISSED':<8}{c['name']}: {c['detail']}")
    sys.stdout.flush()
