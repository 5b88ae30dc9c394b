"""Muon on the standard CPU workload (issue 37): step time and peak memory per rank.

    python -m benchmarks.muon [--world-size 2] [--blocks 4] [--steps 6] [--warmup 2] [--json PATH]

Contenders, each in its own freshly spawned ranks (gloo, one thread each), on benchmarks/model.py's
GPT (seed 1234) with batch 4 x seq 128 per rank; Muon (lr 0.02, torch's other defaults) on every
block's four matrices (attention in/out projections, the two MLP weights), AdamW (lr 1e-3) on
everything else, as torch's Muon documentation advises:

  sharded    ``fully_shard`` per block, then the root; ``composable_shard.optim.Muon``.
  replicate  ``replicate(model)``; ``torch.optim.Muon`` on the full matrices.
  unshard    ``fully_shard`` as ``sharded``; ``torch.optim.Muon`` built and stepped inside
             ``unshard_params(model, with_grads=True)`` (the workaround of issue 37): full
             parameters, gradients and every matrix's momentum on every rank.

Memory: benchmarks/counting_allocator.py installed first in every rank (every CPU allocation,
gloo's threads included). ``peak``: bytes alive at the highest point of a step (forward, backward
and both optimizers' steps) above what was alive before the model was built, maximum over the
measured steps and ranks; ``muon state``: the Muon momentum bytes this rank holds. Time: the
median over the measured steps of rank 0's wall time of a whole step (barriers around it).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.multiprocessing as mp
import torch.nn as nn

CONTENDERS = ["sharded", "replicate", "unshard"]
BATCH = 4


def _matrix_names(model: nn.Module) -> List[str]:
    return [n for n, p in model.named_parameters()
            if n.startswith("blocks.") and (n.endswith("in_proj_weight") or n.endswith("out_proj.weight")
                                            or n.endswith("mlp.0.weight") or n.endswith("mlp.2.weight"))]


def _build(name: str, blocks: int) -> Tuple[nn.Module, Any, torch.optim.Optimizer, List[str]]:
    """The model and its two optimizers; ``Any``: Muon, or a callable stepping it (workaround)."""
    from benchmarks.model import GPT
    from composable_shard import fully_shard, replicate, unshard_params
    from composable_shard.optim import Muon

    torch.manual_seed(1234)
    model = GPT(blocks=blocks)
    matrices = _matrix_names(model)
    if name == "replicate":
        replicate(model)
    else:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    named = dict(model.named_parameters())
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in matrices], lr=1e-3)
    if name == "sharded":
        return model, Muon(model, matrices, lr=0.02), adamw, matrices
    if name == "replicate":
        return model, torch.optim.Muon([named[n] for n in matrices], lr=0.02), adamw, matrices
    with unshard_params(model, with_grads=True):  # the parameters are full matrices only in here
        torch_muon = torch.optim.Muon([named[n] for n in matrices], lr=0.02)

    class _Workaround:
        state = torch_muon.state

        def step(self) -> None:
            with unshard_params(model, with_grads=True):
                torch_muon.step()

        def zero_grad(self) -> None:
            torch_muon.zero_grad()

    return model, _Workaround(), adamw, matrices


def _rank(rank: int, cfg: Dict[str, Any], port: int, outdir: str) -> None:
    from benchmarks import counting_allocator as ca

    ca.install(cfg["so_path"])  # first: before this process creates any tensor
    torch.set_num_threads(1)
    import torch.distributed as dist
    from benchmarks.model import SEQ, VOCAB, make_batch

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=cfg["world_size"], timeout=timedelta(seconds=600))
    base = ca.live()
    model, muon, adamw, _ = _build(cfg["contender"], cfg["blocks"])
    times: List[float] = []
    peaks: List[int] = []
    loss = torch.zeros(())
    for step in range(cfg["warmup"] + cfg["steps"]):
        tokens, targets = make_batch(BATCH, SEQ, VOCAB, torch.Generator().manual_seed(5678 + 1000 * step + rank))
        dist.barrier()
        ca.reset_peak()
        start = time.perf_counter()
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        del logits
        loss.backward()
        muon.step()
        adamw.step()
        muon.zero_grad()  # set_to_none, torch's default
        adamw.zero_grad()
        dist.barrier()
        if step >= cfg["warmup"]:
            times.append(time.perf_counter() - start)
            peaks.append(ca.peak() - base)
    total = torch.tensor([loss.item()])
    dist.all_reduce(total)
    state_bytes = sum(t.numel() * t.element_size() for s in muon.state.values() for t in s.values()
                      if isinstance(t, torch.Tensor))
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump({"times": times, "peak": max(peaks), "muon_state": state_bytes,
                   "loss": total.item() / cfg["world_size"]}, f)
    del model, muon, adamw
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(contender: str, world_size: int, blocks: int, steps: int, warmup: int, so_path: str) -> Dict[str, Any]:
    """One contender in fresh ranks; rank 0's median step time, the peak and state over ranks."""
    cfg = {"contender": contender, "world_size": world_size, "blocks": blocks, "steps": steps, "warmup": warmup,
           "so_path": so_path}
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_rank, args=(cfg, _free_port(), outdir), nprocs=world_size,  # type: ignore[no-untyped-call]  # untyped in torch
                           start_method="spawn")
        ranks = []
        for r in range(world_size):
            with open(os.path.join(outdir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    return {"step_ms": statistics.median(ranks[0]["times"]) * 1e3, "peak_mb": max(r["peak"] for r in ranks) / 2**20,
            "muon_state_mb": max(r["muon_state"] for r in ranks) / 2**20, "loss": ranks[0]["loss"]}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from benchmarks import counting_allocator as ca

    so_path = ca.build()
    results = {name: run(name, args.world_size, args.blocks, args.steps, args.warmup, so_path)
               for name in args.contenders.split(",")}
    print(f"W={args.world_size} blocks={args.blocks} steps={args.steps} (after {args.warmup} warm-up), CPU/gloo")
    print(f"{'contender':<10} {'step ms':>9} {'peak MB':>9} {'Muon state MB':>14} {'loss':>10}")
    for name, r in results.items():
        print(f"{name:<10} {r['step_ms']:>9.1f} {r['peak_mb']:>9.2f} {r['muon_state_mb']:>14.2f} {r['loss']:>10.5f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
