"""What ``fully_shard`` and ``replicate`` share (``composable_shard/_setup/data_parallel.py``) behaves
the same in both APIs, and ``describe`` plans the flat groups the runtime builds.

One process group of 2 gloo ranks for every case ([Note: One behaviour for both APIs] in
``_setup/data_parallel.py``): each case runs once per API. References are single-process models
trained on the same rows; collectives are counted by ``collectives.record_collectives``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import (FSDPModule, MixedPrecision, ModuleWrapPolicy, describe, fully_shard, replicate,
                              unshard_params)
from composable_shard._runtime.collectives import record_collectives
from composable_shard._runtime.traversal import _get_fsdp_handles
from composable_shard.contract import _get_registry
from tests._harness import run_distributed, run_subtests
from tests._models import Block, batch, local_rows, loss_fn, make_model, reference_grads, zip_same

APIS = ["fully_shard", "replicate"]


def _apply(api: str, model: nn.Module, **kwargs: Any) -> nn.Module:
    return fully_shard(model, **kwargs) if api == "fully_shard" else replicate(model, **kwargs)


def _grads(model: nn.Module) -> List[Any]:
    """Every parameter's full gradient (None where it has none), in ``named_parameters()`` order."""
    if isinstance(model, FSDPModule):
        with unshard_params(model, with_grads=True, writeback=False):
            return [(n, None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()]
    return [(n, None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()]


def _assert_grads(actual: List[Any], expected: List[Any], what: str) -> None:
    for (name, a), (_, e) in zip_same(actual, expected, what=what):
        assert (a is None) == (e is None), (what, name, a, e)
        if a is not None:
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {name}: {m}")


def _local_backward(model: nn.Module, step: int) -> None:
    inputs, targets = batch(step, dist.get_world_size())
    rank = dist.get_rank()
    loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank)).backward()


def _gradient_sync_flag(api: str) -> None:
    """``set_requires_gradient_sync`` takes a bool, on both APIs. Before, ``replicate``'s turned
    ``"no"`` (or ``0``) into a flag silently (``"no"`` meant True: every micro-batch of a
    gradient accumulation all-reduced), while ``FSDPModule``'s raised. Now both raise
    ``TypeError`` naming the module's class and the argument, the flag as it was: the
    unsynced backward communicates nothing and the synced one averages the sum of both."""
    world_size = dist.get_world_size()
    model = _apply(api, make_model())
    model.set_requires_gradient_sync(False)
    for bad in ("no", "yes", 0, 1, None):
        try:
            model.set_requires_gradient_sync(bad)
        except TypeError as e:
            message = str(e)
            assert f"{type(model).__name__}.set_requires_gradient_sync" in message and "must be a bool" in message \
                and repr(bad) in message, (api, bad, message)
        else:
            raise AssertionError(f"{api}: set_requires_gradient_sync({bad!r}) did not raise")
    with record_collectives() as rec:
        _local_backward(model, 0)
    reductions = [r for r in rec.records if r.kind in ("all_reduce", "reduce_scatter")]
    assert reductions == [], (api, "the flag is no longer False", reductions)
    model.set_requires_gradient_sync(True)
    _local_backward(model, 1)
    reference = make_model()
    expected = [(n, a + b) for (n, a), (_, b) in zip_same(reference_grads(reference, 0, world_size),
                                                          reference_grads(reference, 1, world_size))]
    _assert_grads([(n, g) for n, g in _grads(model) if g is not None], expected, f"{api} accumulated")


def _init_broadcast(api: str) -> None:
    """Rank 0's parameters and buffers reach every rank in one broadcast per dtype chunk, the
    same bytes under both APIs (the tied weight once). Before, ``fully_shard(sync_module_states=True)``
    issued one broadcast per tensor (here 15), one latency each, where ``replicate`` and
    torch's DDP/FSDP bucket them."""
    rank = dist.get_rank()
    model = make_model(seed=rank)  # different weights on every rank
    model.register_buffer("seen", torch.tensor([rank, 7 * rank], dtype=torch.int64))
    model.register_buffer("ema", torch.full((3,), float(rank)))
    reference = make_model(seed=0)
    unique = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    expected_bytes = sorted({dtype: sum(t.numel() * t.element_size() for t in unique if t.dtype == dtype)
                             for dtype in {t.dtype for t in unique}}.values())
    with record_collectives() as rec:
        _apply(api, model, **({"sync_module_states": True} if api == "fully_shard" else {}))
    sent = sorted(r.nbytes for r in rec.records if r.kind == "broadcast")
    assert sent == expected_bytes, (api, "broadcasts (bytes each)", sent, expected_bytes)
    assert model.seen.tolist() == [0, 0] and model.ema.tolist() == [0.0] * 3, (api, model.seen, model.ema)
    with unshard_params(model, writeback=False) if api == "fully_shard" else contextlib.nullcontext():
        for (name, p), (_, q) in zip_same(list(model.named_parameters()), list(reference.named_parameters())):
            assert torch.equal(p, q), (api, name)


def _single_rank_group(api: str, solo: dist.ProcessGroup) -> None:
    """Over a process group of one rank nothing is reduced, so neither API issues the
    used-parameter all-reduce (before, ``replicate`` did, one per backward, and ``describe``
    counted it); gradients equal local training on this rank's rows, and ``describe``'s
    all-reduce figures equal what a steady step records."""
    model = _apply(api, make_model(), process_group=solo)
    reference = make_model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        described = describe(model)  # at step 1: the buckets as rebuilt
        with record_collectives() as rec:
            _local_backward(model, step)
        _local_backward(reference, step)
        _assert_grads(_grads(model), _grads(reference), f"{api} step {step}")
        flags = [r for r in rec.records if "used_params" in r.tag]
        assert flags == [], (api, step, flags)
        if step == 1:  # steady state: lazy init and the bucket rebuild are behind
            actual = (rec.count("all_reduce"), rec.nbytes("all_reduce"))
            assert actual == (described.collective_count("all_reduce"), described.collective_bytes("all_reduce")), \
                (api, actual, described)
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()


class _Mixed(nn.Module):
    """Every kind of flat group at once: a tied embedding/head, a float64 layer, a frozen layer, a
    frozen int64 parameter (never cast), a BatchNorm (kept in full precision) and Blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 6)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.bn = nn.BatchNorm1d(6)
        self.wide = nn.Linear(6, 6).double()
        self.frozen = nn.Linear(6, 5)
        self.frozen.requires_grad_(False)
        self.counts = nn.Parameter(torch.arange(3), requires_grad=False)
        self.head = nn.Linear(6, 13, bias=False)
        self.head.weight = self.emb.weight


def _describe_plans_the_built_groups(policy: bool) -> None:
    """``describe`` of a plain model (its plan, ``flat_param.plan_groups``) equals ``describe``
    of the same model after ``fully_shard`` (the handles as built), row by row, for a model
    with mixed dtypes, frozen parameters, tied weights and a BatchNorm kept in full precision
    under ``param_dtype=bfloat16`` (in the root's handle without a policy, in a handle of its own
    under one); and the built handles do have each kind of group."""
    mp = MixedPrecision(param_dtype=torch.bfloat16)
    kwargs: Dict[str, Any] = {"mixed_precision": mp, "policy": ModuleWrapPolicy({Block}) if policy else None}
    planned = describe(_Mixed(), world_size=dist.get_world_size(), **kwargs)
    model = fully_shard(_Mixed(), **kwargs)
    built = describe(model)
    assert planned.planned and not built.planned
    assert planned.rows == built.rows, (policy, planned.rows, built.rows)
    assert planned.flag_collectives == built.flag_collectives, (policy, planned.flag_collectives, built.flag_collectives)
    groups = [g for h in _get_fsdp_handles(model) for g in h.groups]
    kinds = {(g.flat_param.dtype, g.compute_dtype, g.requires_grad, g.full_precision) for g in groups}
    batch_norm = (torch.float32, torch.float32, True, not policy)  # under a policy: a handle without mixed precision
    assert {batch_norm, (torch.float32, torch.bfloat16, True, False),
            (torch.float64, torch.bfloat16, True, False), (torch.float32, torch.bfloat16, False, False),
            (torch.int64, torch.int64, False, False)} <= kinds, (policy, kinds)


def _different_models(api: str, differ: str) -> None:
    """Rank 1 holds another model than rank 0 (a buffer more, a wider layer, a parameter in
    float64): both APIs raise on every rank before the init broadcast, naming the first
    difference, and leave the model as it was (fully_shard with sync_module_states, whose
    layouts are compared by a digest first). Without it the broadcast would hang or mix up data."""
    rank = dist.get_rank()
    model = make_model()
    if rank == 1:
        if differ == "buffer":
            model.register_buffer("extra", torch.zeros(3))
        elif differ == "shape":
            model.blocks[0].fc1 = nn.Linear(model.blocks[0].fc1.in_features, model.blocks[0].fc1.out_features + 1)
        else:
            model.blocks[1].fc2.double()
    before = type(model)
    try:
        _apply(api, model, **({"sync_module_states": True} if api == "fully_shard" else {}))
    except RuntimeError as e:
        assert "rank 1 holds different parameters or buffers than rank 0" in str(e), (api, differ, str(e))
    else:
        raise AssertionError(f"{api}: rank {rank} applied it to ranks holding different models ({differ})")
    assert type(model) is before and _get_registry(model) is None, (api, differ, type(model))


def _all() -> None:
    solo, _ = dist.new_subgroups_by_enumeration([[r] for r in range(dist.get_world_size())])
    run_subtests(_different_models, {"api": APIS, "differ": ["buffer", "shape", "dtype"]})
    run_subtests(_gradient_sync_flag, {"api": APIS})
    run_subtests(_init_broadcast, {"api": APIS})
    run_subtests(_single_rank_group, {"api": APIS}, solo=solo)
    run_subtests(_describe_plans_the_built_groups, {"policy": [False, True]})


def test_fully_shard_and_replicate_share_one_behaviour() -> None:
    """The cases above in one process group of 2 ranks."""
    run_distributed(_all, 2, timeout=90)
