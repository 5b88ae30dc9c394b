"""``composable_shard.optim.Muon``'s refusals agreed across ranks (issue 42, item 5).

A Muon built (or a param group added) with something wrong on one rank only -- an unknown FQN,
a 1-D parameter, another model's parameter, a bad hyper-parameter -- used to raise on that rank
alone while the others waited in the plan exchange until gloo's timeout (or, if the refusing
rank caught its error and went on, paired that exchange with whatever collective came next).
Now every check runs before the one exchange in which the ranks agree, and every rank raises
within seconds: the refusing rank its own error, the others one of the same type naming the
refusing rank and quoting its message. Outcomes are compared through files, never a
collective, so a rank stuck in the exchange cannot be freed by the check itself.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import ShardingStrategy, fully_shard
from composable_shard._runtime.collectives import record_collectives
from composable_shard.optim import Muon
from tests._harness import outcomes_through_files, run_distributed, run_subtests
from tests._models import VOCAB, loss_fn, make_model, zip_same

MATRICES = ["blocks.0.fc1.weight", "blocks.0.fc2.weight", "blocks.1.fc1.weight", "blocks.1.fc2.weight"]
DEADLINE_S = 20.0  # a rank that has not returned from the call by then waits in a collective
# What each rank may take to raise: milliseconds on an idle machine (one 48-byte exchange, then
# a small gather), seconds with four ranks on two loaded cores; gloo's timeout is 100 s here.
SECONDS = 10.0
TIMEOUT_S = 40.0  # the harness's: a rank stuck anyway fails the test in 40 s, not at gloo's timeout


def _sharded_model(mesh: Any = None) -> nn.Module:
    model = make_model()
    kwargs: Dict[str, Any] = {"mesh": mesh, "strategy": ShardingStrategy.HYBRID_SHARD} if mesh is not None else {}
    for block in model.blocks:  # type: ignore[union-attr]  # a ParityModel's ModuleList
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _outcomes(directory: str, outcome: Dict[str, Any]) -> List[Dict[str, Any]]:
    return outcomes_through_files(directory, outcome, DEADLINE_S, "the Muon call")


def _attempt(call: Callable[[], Any]) -> Dict[str, Any]:
    """Run ``call`` once every rank is about to; what it raised (type, message with notes) and
    how long it took."""
    dist.barrier()  # the clock starts when every rank is about to call
    start = time.monotonic()
    try:
        call()
        error: Optional[BaseException] = None
    except Exception as e:
        error = e
    seconds = time.monotonic() - start
    if error is None:
        return {"error": None, "message": "", "seconds": seconds}
    return {"error": type(error).__name__, "seconds": seconds,
            "message": "\n".join([str(error), *getattr(error, "__notes__", [])])}


def _params(model: nn.Module, refuser: bool, case: str) -> Any:
    """Muon's ``params`` on this rank: MATRICES, or (on the refusing rank) what ``case`` breaks."""
    named = dict(model.named_parameters())
    if case == "other_groups" and not refuser:
        return [{"params": MATRICES[:2]}, {"params": MATRICES[2:], "lr": 0.03}]
    if not refuser:
        return MATRICES
    return {
        "unknown_fqn": MATRICES[:1] + ["blocks.0.nope"],
        "one_d": MATRICES + ["blocks.0.fc1.bias"],
        "one_d_object": [named[n] for n in MATRICES] + [named["blocks.1.ln.weight"]],
        "foreign": MATRICES[:3] + [nn.Parameter(torch.zeros(3, 3))],
        "single_tensor": named[MATRICES[0]],
        "empty": [],
        "group_lr": [{"params": MATRICES[:2]}, {"params": MATRICES[2:], "lr": -1.0}],
        "in_two_groups": [{"params": MATRICES}, {"params": MATRICES[:1]}],
        "fewer": MATRICES[:3],
        "other_matrix": MATRICES[:3] + ["frozen.weight"],
        "extra_group": [{"params": MATRICES[:2]}, {"params": MATRICES[2:]}],
        "other_groups": [{"params": MATRICES[:3]}, {"params": MATRICES[3:], "lr": 0.03}],
    }.get(case, MATRICES)


def _settings(refuser: bool, case: str) -> Dict[str, Any]:
    """Muon's hyper-parameters on this rank: torch's defaults, or (on the refusing rank) ``case``'s."""
    bad: Dict[str, Dict[str, Any]] = {
        "lr": {"lr": -1.0}, "ns_steps": {"ns_steps": 100}, "adjust_lr_fn": {"adjust_lr_fn": "x"},
        "ns_coefficients": {"ns_coefficients": (1.0, 2.0)}, "momentum": {"momentum": -0.1}, "other_lr": {"lr": 0.5}}
    return dict(bad.get(case, {})) if refuser else {}


# case -> (exception type on every rank, what every rank's message says). The refusing rank's
# own error names the parameter; the others name the refusing rank and quote its error. Where the
# plans differ, every rank's message is the same and names the first setting or matrix that
# differs, what each rank holds there ({others}: the ranks other than {refuser}, which differs).
_CONSTRUCTION = {
    "unknown_fqn": ("ValueError", "'blocks.0.nope'"),
    "one_d": ("ValueError", "'blocks.0.fc1.bias' has shape (7,)"),
    "one_d_object": ("ValueError", "'blocks.1.ln.weight' has shape (6,)"),
    "foreign": ("ValueError", "((3, 3)) is not a parameter of FSDPParityModel"),
    "single_tensor": ("TypeError", "got a single Parameter"),
    "empty": ("ValueError", "empty parameter list"),
    "group_lr": ("ValueError", "lr must be >= 0"),
    "in_two_groups": ("ValueError", "more than one parameter group"),
    "lr": ("ValueError", "lr must be >= 0, got -1.0"),
    "ns_steps": ("ValueError", "ns_steps must be an int in [0, 100), got 100"),
    "adjust_lr_fn": ("ValueError", "adjust_lr_fn must be one of"),
    "ns_coefficients": ("ValueError", "ns_coefficients must be three floats"),
    "momentum": ("ValueError", "momentum must be >= 0"),
    # no refusal, but the ranks' plans differ (a step would mix matrices or settings): every rank
    # raises naming the first difference
    "fewer": ("RuntimeError", "first difference is in the matrices: 'blocks.1.fc2.weight' (6, 7) in param group 0 "
              "on {others}; nothing on rank {refuser} (rank {refuser} differs from rank 0)"),
    "other_matrix": ("RuntimeError", "first difference is in the matrices: 'blocks.1.fc2.weight' (6, 7) in param "
                     "group 0 on {others}; 'frozen.weight' (6, 6) in param group 0 on rank {refuser} (rank {refuser} "
                     "differs from rank 0)"),
    "extra_group": ("RuntimeError", "first difference is in the number of param groups: 1 param group on {others}; "
                    "2 param groups on rank {refuser} (rank {refuser} differs from rank 0)"),
    "other_groups": ("RuntimeError", "first difference is in the matrices: 'blocks.1.fc1.weight' (7, 6) in param group "
                     "1 on {others}; 'blocks.1.fc1.weight' (7, 6) in param group 0 on rank {refuser} (rank {refuser} "
                     "differs from rank 0)"),
    "other_lr": ("RuntimeError", "first difference is in a param group setting: param group 0's lr=0.001 on {others}; "
                 "param group 0's lr=0.5 on rank {refuser} (rank {refuser} differs from rank 0)"),
}


def _check_outcomes(case: str, outcomes: List[Dict[str, Any]], expected: Dict[str, Any], refuser: int) -> None:
    kind, text = expected[case]
    others = [r for r in range(len(outcomes)) if r != refuser]
    text = text.format(refuser=refuser, others=(f"rank {others[0]}" if len(others) == 1 else
                                                "ranks " + ", ".join(map(str, others))))
    for r, o in enumerate(outcomes):
        assert o["error"] == kind and text in o["message"], (case, r, o, text)
        assert o["seconds"] < SECONDS, (case, r, o)
        if kind == "RuntimeError":  # the plans differ: every rank raises the same message, naming the ranks
            assert o["message"] == outcomes[0]["message"], (case, r, o, outcomes[0])
            assert o["message"].startswith("Muon") and "none applied" in o["message"], (case, r, o)
        elif r != refuser:  # the others' message names it
            assert f"rank {refuser} refused" in o["message"], (case, r, o)
        elif sys.version_info >= (3, 11):  # and the refusing rank's note (exception notes: Python >= 3.11)
            assert f"refused on rank {refuser}" in o["message"], (case, r, o)


def _in_step() -> None:
    """Every rank is out of the call and in step: a collective after it pairs with its peers'."""
    check = torch.ones(1)
    dist.all_reduce(check)
    assert check.item() == dist.get_world_size()


def _construction_refused(case: str, model: nn.Module, directory: str, refuser: int) -> None:
    rank = dist.get_rank()
    before = [p.detach().clone() for p in model.parameters()]
    outcome = _attempt(lambda: Muon(model, _params(model, rank == refuser, case), **_settings(rank == refuser, case)))
    _check_outcomes(case, _outcomes(os.path.join(directory, f"construct-{case}"), outcome), _CONSTRUCTION, refuser)
    for p, b in zip_same(list(model.parameters()), before):
        assert torch.equal(p.detach(), b), case
    _in_step()


# add_param_group on a Muon of blocks.0's matrices: what the refusing rank adds instead of blocks.1's.
_ADDED = {
    "one_d": ({"params": ["blocks.1.fc1.weight", "blocks.1.fc1.bias"]}, ("ValueError", "'blocks.1.fc1.bias'")),
    "unknown_fqn": ({"params": ["blocks.1.nope"]}, ("ValueError", "'blocks.1.nope'")),
    "lr": ({"params": MATRICES[2:], "lr": -1.0}, ("ValueError", "param group: lr must be >= 0")),
    "already_added": ({"params": MATRICES[1:]}, ("ValueError", "more than one parameter group")),
    "not_a_dict": (MATRICES[2:], ("TypeError", "a param group must be a dict")),
    "other_lr": ({"params": MATRICES[2:], "lr": 0.5}, ("RuntimeError", "param group 1's lr=0.02 on {others}; param "
                                                       "group 1's lr=0.5 on rank {refuser} (rank {refuser} differs")),
}


def _add_refused(case: str, model: nn.Module, directory: str, refuser: int) -> None:
    """The refused group is added on no rank: param groups and plan as before on every rank,
    and the good group added next (on every rank) steps all four matrices together."""
    rank = dist.get_rank()
    muon = Muon(model, MATRICES[:2], lr=0.02)
    added, _ = _ADDED[case]
    group = added if rank == refuser else {"params": MATRICES[2:]}
    outcome = _attempt(lambda: muon.add_param_group(group))  # type: ignore[arg-type]  # not_a_dict on purpose
    _check_outcomes(case, _outcomes(os.path.join(directory, f"add-{case}"), outcome),
                    {k: v for k, (_, v) in _ADDED.items()}, refuser)
    named = dict(model.named_parameters())
    assert [[id(p) for p in g["params"]] for g in muon.param_groups] == [[id(named[n]) for n in MATRICES[:2]]], case
    muon.add_param_group({"params": MATRICES[2:], "lr": 0.03})
    inputs = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(rank))
    loss_fn(model(inputs), inputs).backward()
    with record_collectives() as rec:
        muon.step()
    muon.zero_grad()
    # two block handles, one all-gather and one reduce-scatter each: both groups' matrices stepped
    assert sorted(r.kind for r in rec.records) == ["all_gather"] * 2 + ["reduce_scatter"] * 2, (case, rec.records)
    momenta = [muon.state[named[n]]["momentum_buffer"] for n in MATRICES]
    assert all(m.abs().sum() > 0 for m in momenta if m.numel()), case
    _in_step()


def _refusals(directory: str) -> None:
    refuser = dist.get_world_size() - 1
    model = _sharded_model()
    run_subtests(_construction_refused, {"case": list(_CONSTRUCTION)}, model=model, directory=directory,
                 refuser=refuser)
    run_subtests(_add_refused, {"case": list(_ADDED)}, model=model, directory=directory, refuser=refuser)
    # the agreement is one exchange of six int64 values per call (in a 64-byte frame: [Note: Exchanges
    # name themselves] in collectives.py), and nothing else
    with record_collectives() as rec:
        Muon(model, MATRICES[:2]).add_param_group({"params": MATRICES[2:], "lr": 0.1})
    assert [(r.kind, r.nbytes) for r in rec.records] == [("exchange", 64)] * 2, rec.records


def test_refusal_on_one_rank_raises_on_every_rank_within_seconds(tmp_path: Path) -> None:
    """W = 2, rank 1 alone refuses (catching its error and carrying on): Muon(...) with an
    unknown FQN, a 1-D parameter (by FQN and by object), another model's parameter, a single
    tensor, no parameter, each bad hyper-parameter (for the optimizer or one param group), a
    parameter in two groups; add_param_group with a 1-D or unknown parameter, a bad lr, a
    parameter already added, a list instead of a dict. Every rank raises the refusing rank's
    error type in under 10 s, the refusing rank its own message (noting its rank), the others
    naming rank 1 and quoting its message; the model is unchanged, a refused group is added on
    no rank, and the ranks stay in step (the next add_param_group and step run together).
    Valid but different plans (a matrix missing on one rank, another matrix in its place, an
    extra param group, a matrix in another param group, another lr): every rank raises the same
    message, naming the first matrix (its FQN, shape and param group) or setting that differs,
    what each rank holds there and the rank that differs (the agreement alone said only that the
    ranks differ). The agreement costs one 48-byte exchange per call. Without it rank 0 waited
    in the plan exchange."""
    run_distributed(_refusals, 2, str(tmp_path), timeout=TIMEOUT_S)


def _hybrid_refusals(directory: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    model = _sharded_model(init_device_mesh("cpu", (2, 2)))
    run_subtests(_construction_refused, {"case": ["unknown_fqn", "other_lr", "fewer"]}, model=model,
                 directory=directory, refuser=3)
    run_subtests(_add_refused, {"case": ["one_d"]}, model=model, directory=directory, refuser=3)


@pytest.mark.parametrize("world_size", [4])
def test_refusal_reaches_every_replica_of_a_hybrid_model(world_size: int, tmp_path: Path) -> None:
    """HYBRID_SHARD on a 2x2 mesh, rank 3 alone refuses: ranks 0 and 1 (another shard group,
    which Muon's step never talks to) raise too, within seconds, instead of training on until
    their gradient all-reduce waits for ranks 2 and 3. Rank 3 alone holding another plan: every
    rank names it alone as the one that differs, and what ranks 0, 1, 2 hold."""
    run_distributed(_hybrid_refusals, world_size, str(tmp_path), timeout=TIMEOUT_S)
