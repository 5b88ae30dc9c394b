"""The peak a plan predicts is the peak it gets: ``plan()`` -> ``apply()`` -> training steps under
the counting CPU allocator (``benchmarks/counting_allocator.py``, every allocation of every thread,
gloo's included) at W=2, on three 4-layer Hugging Face Llamas (benchmarks/plan.py's, ``use_cache=False``),
an uneven GPT, a conv net and a 16-block GPT, each at budgets chosen for the bug it catches (below):
the measured peak per rank is within the budget and within 10% of the prediction, and every rank
chose the same plan. The full table (0, 0.2, ..., 1 of the way from the smallest plan to
``replicate(model)``'s peak, every workload) is ``python benchmarks/plan.py`` (benchmarks/NOTES.md).

The allocator is a small C++ extension built once per machine (about a minute on 2 cores, then
cached; it needs a C++ compiler and ``ninja``, which the ``test`` extra installs).
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch.distributed as dist

from benchmarks import counting_allocator as ca
from benchmarks.plan import _measure, plan_extremes
from tests._harness import run_distributed

_CFG: Dict[str, Any] = {"workload": "llama_nocache", "world_size": 2, "batch": 4, "warmup": 1, "steps": 1, "timed_steps": 0,
                        "trace": False}


def _rank(so_path: str, budgets: List[int], workload: str = "llama_nocache", zero2_peak: bool = False) -> None:
    ca.install(so_path)  # tensors made before are invisible to it; the measure counts from its own baseline
    assert ca.validate()["ok"]
    rank = dist.get_rank()
    for budget in budgets:
        out = _measure(rank, dict(_CFG, budget=budget, workload=workload), True)
        predicted, choices = out["plan"]["predicted"], out["plan"]["choices"]
        everyone: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, [(c["fqn"], c["api"], c["strategy"], c["checkpoint"]) for c in choices])
        assert all(theirs == everyone[0] for theirs in everyone), f"ranks chose different plans: {everyone}"
        assert predicted <= budget, (predicted, budget)
        assert out["peak"] <= budget, f"budget {budget:,} B: measured {out['peak']:,} B (predicted {predicted:,})"
        assert abs(out["peak"] / predicted - 1) <= 0.10, (out["peak"], predicted)
        if zero2_peak:  # the test is about a peak inside a SHARD_GRAD_OP block's backward: check it is one
            moment = out["plan"]["moment"]
            strategy = {c["fqn"]: c["strategy"] for c in choices}
            assert moment.startswith("backward of ") and strategy[moment[len("backward of "):]] == "SHARD_GRAD_OP", \
                (moment, choices)


# The workloads and budgets, one spawn for all (each spawn imports transformers on every rank), and
# what each one catches:
# - llama_nocache at its smallest plan and a fifth of the way to replicate(model)'s peak: a plan
#   that forgets the block the root's pre-backward prefetches, or the headroom for small tensors,
#   measures over its budget at both (the GPT workload happens not to show the first).
# - llama_frozen (layers 0-1 frozen, fine-tuning the upper half), a fifth of the way: the plan
#   replicates blocks, and replicate leaves frozen parameters whole on every rank without managing
#   them. Before they were counted, this plan measured 79.2 MB against its 75.4 MB budget.
# - gpt_uneven (block 1 of benchmarks/model.py's GPT with 10x the parameters of the others, its MLP
#   58x wide) at its smallest plan, and convnet (a residual conv + batch-norm net: no attention,
#   buffers) 40% of the way (both measured at 0, 0.2, ..., 1 in benchmarks/NOTES.md). Before the
#   fake pass measured each block's backward (the convolution's scratch copies included), the conv
#   net measured 3-6% over every budget and the uneven GPT's plans were 10% over-predicted.
# - llama_v256 (a 256-token vocabulary: a small head, so the step's peak falls inside a block's
#   backward) at 10% and 40%: plans that peak in the backward of a SHARD_GRAD_OP block, which holds
#   its own unsharded parameters there (a simulator that forgot them chose plans measured over budget).
# - gpt16 (benchmarks/model.py's GPT at 16 blocks) at the smallest plan (every block fully sharded
#   and checkpointed): during block k's backward, block k+1's unsharded gradient is still alive (its
#   reduce-scatter is waited on only when k's own gradient buffer is made) beside k's parameters'
#   gradients. Counting one of the two, every block's backward measured 2.1 MB above its prediction
#   and the plan 142.39 MB against its 140.65 MB budget.
_LLAMAS: List[Tuple[str, Tuple[int, ...], int, bool]] = [  # workload, fractions of the way, denominator, SHARD_GRAD_OP peak
    ("llama_nocache", (0, 1), 5, False), ("llama_frozen", (1,), 5, False), ("llama_v256", (1, 4), 10, True)]
_GPTS_AND_CONV: List[Tuple[str, Tuple[int, ...], int, bool]] = [
    ("gpt_uneven", (0,), 5, False), ("convnet", (2,), 5, False), ("gpt16", (0,), 5, False)]


def _all_cases(so_path: str, cases: List[Tuple[str, List[int], bool]]) -> None:
    for workload, budgets, zero2_peak in cases:
        try:
            _rank(so_path, budgets, workload, zero2_peak)
        except AssertionError as error:
            raise AssertionError(f"{workload}: {error}") from error


def _run(table: List[Tuple[str, Tuple[int, ...], int, bool]]) -> None:
    so_path = ca.build()
    cases = []
    for workload, fractions, denominator, zero2_peak in table:
        smallest, replicated = plan_extremes(workload, 2, 4)
        assert smallest < replicated, workload
        cases.append((workload, [smallest + f * (replicated - smallest) // denominator for f in fractions], zero2_peak))
    run_distributed(_all_cases, 2, so_path, cases, timeout=600)


def test_llama_peaks_are_within_their_budgets_and_predictions() -> None:
    _run(_LLAMAS)


def test_gpt_and_conv_peaks_are_within_their_budgets_and_predictions() -> None:
    _run(_GPTS_AND_CONV)
