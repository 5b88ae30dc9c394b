"""Tensor-parallel (``DTensor``) modules with ``replicate`` and beside ``fully_shard``, at W = 4 on a
2 (data-parallel) x 2 (tensor-parallel) mesh: a residual MLP net whose blocks run ``up``
column-wise and ``down`` row-wise (torch's ``parallelize_module``), and torchtitan's sequence-parallel
plan on the same blocks. Every number is compared with one process on the combined batch.

- ``replicate(model, process_group=mesh["dp"].get_group())`` averages each parameter's local piece
  over the data-parallel group only, in buckets of the pieces: losses, gradient norms and
  parameters equal one process, with gradient accumulation, activation checkpointing, nested
  replicate calls and SequenceParallel norms (whose gradients are Partial sums); checkpoints
  round-trip and load at dp 4 x tp 1. Before: ``aten.cat ... got mixed torch.Tensor and DTensor``
  from the initial broadcast. A mesh overlapping the group, and a Partial placement, are refused.
- ``fully_shard`` flattens ``DTensor`` parameters (``test_fully_shard_tensor_parallel.py``); what
  it cannot (a Partial placement, a piece that is not its placements' split, a group holding the
  tensor-parallel peers) is refused naming the parameter, the model unchanged. With TP modules
  left out of it (``ignored_modules``, gradients averaged by the user), training equals one process, ours and torch's ``clip_grad_norm_`` give the global norm
  over dp x tp (before: both raised), and state dicts and checkpoints hold the pieces. Before:
  ``get_model_state_dict(full=False)`` and ``load_checkpoint`` raised "Attempted to access the data
  pointer on an invalid python storage", a full state dict held ``DTensor`` s instead of a plain
  model's tensors, and a plain model's full state dict could not be loaded. A load failing on one
  rank puts the pieces and their optimizer state back.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard  # private: the placement the refusal is about
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from composable_shard import (MixedPrecision, checkpoint, clip_grad_norm_, describe, fully_shard, get_model_state_dict,
                              get_optimizer_state_dict, load_checkpoint, plan, replicate, save_checkpoint, set_model_state_dict)
from composable_shard._runtime import collectives as _collectives
from composable_shard._state import load_transaction
from tests._harness import run_distributed

DP, TP = 2, 2
ROWS_PER_RANK = 3
MAX_NORM = 0.5


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(2)])
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _tp_net(mesh: DeviceMesh) -> Tuple[_Net, List[nn.Module]]:
    torch.manual_seed(0)
    model = _Net()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model, [m for block in model.blocks for m in (block.up, block.down)]


def _plain_net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _local_snapshot(model: nn.Module) -> List[Tuple[str, type, int, torch.Tensor]]:
    """Per parameter: name, its module's class, the object and this rank's elements."""
    modules = dict(model.named_modules())
    return [(n, type(modules[n.rpartition(".")[0]]), id(p), _local(p).detach().clone())
            for n, p in model.named_parameters()]


def _assert_same(before: List[Tuple[str, type, int, torch.Tensor]], model: nn.Module) -> None:
    after = _local_snapshot(model)
    assert [b[:3] for b in before] == [a[:3] for a in after]
    assert all(b[3].is_meta and a[3].is_meta or torch.equal(b[3], a[3]) for b, a in zip(before, after))


def _refusals() -> None:
    """What neither ``replicate`` nor ``fully_shard`` can average or flatten is refused before
    anything changes, naming the parameter: the default group (it holds the tensor-parallel peers),
    a Partial placement, and (``fully_shard``) a local piece that is not its placements' split and
    an optimizer built before fully_shard replaced the DTensors it holds (its step). (A meta-device
    DTensor is accepted since issue 55: ``test_fully_shard_tensor_parallel.py``'s ``_from_meta``.)"""
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model, _ = _tp_net(mesh)
    before = _local_snapshot(model)
    for api, call in {"replicate(_Net)": lambda: replicate(model), "fully_shard(_Net)": lambda: fully_shard(model)}.items():
        try:  # the default group holds the tensor-parallel peers: averaging over it would mix pieces
            call()
        except ValueError as error:
            for fragment in (api, "'blocks.0.up.weight'", "shares ranks", "mesh['dp'].get_group()"):
                assert fragment in str(error), (fragment, str(error))
        else:
            raise AssertionError(f"{api} averaged over the tensor-parallel peers")
        _assert_same(before, model)
    try:  # plan() models data parallelism only: its figures would leave tensor parallelism's out
        plan(model, torch.randn(2, 8), memory_budget=1 << 30, world_size=DP)
    except NotImplementedError as error:
        for fragment in ("plan: _Net.blocks.0.up.weight is a DTensor", "Shard(dim=0)", "8 such tensors", "describe(model)"):
            assert fragment in str(error), (fragment, str(error))
    else:
        raise AssertionError("plan() planned a tensor-parallel model as if it were data-parallel")
    _assert_same(before, model)
    early, _ = _tp_net(mesh)  # an optimizer built before fully_shard holds DTensors it replaced: its step raises
    early_optim = torch.optim.AdamW(early.parameters(), lr=0.01)
    fully_shard(early, mesh=mesh["dp"])
    nn.functional.mse_loss(early(_batch(0)[0][:2]), _batch(0)[1][:2]).backward()
    unchanged = get_model_state_dict(early)
    try:
        early_optim.step()
    except RuntimeError as error:
        for fragment in ("AdamW.step()", "'blocks.0.up.weight'", "Build the optimizer after fully_shard", "Nothing was stepped"):
            assert fragment in str(error), (fragment, str(error))
    else:
        raise AssertionError("an optimizer stepped DTensors fully_shard had replaced")
    _assert_full_equal(get_model_state_dict(early), unchanged, "after the refused step")
    torch.optim.AdamW(early.parameters(), lr=0.01).step()  # one built after fully_shard steps
    dp_group = mesh["dp"].get_group()
    partial = nn.Linear(2, 2)  # a Partial placement: a sum not taken yet
    partial.weight = nn.Parameter(DTensor.from_local(torch.ones(2, 2), mesh["tp"], [Partial()]))
    uneven = nn.Linear(2, 2)  # 3 rows and 1 row of 4: not torch.chunk's 2 and 2
    rows = 3 if mesh["tp"].get_local_rank() == 0 else 1
    uneven.weight = nn.Parameter(DTensor.from_local(torch.ones(rows, 2), mesh["tp"], [Shard(0)], run_check=False,
                                                    shape=torch.Size([4, 2]), stride=(2, 1)))
    strided = nn.Linear(2, 2)  # torch's strided sharding (FSDP2 over TP's dim-0 layout): not flattened
    strided.weight = nn.Parameter(DTensor.from_local(torch.ones(2, 2), mesh["tp"], [_StridedShard(0, split_factor=2)],
                                                     run_check=False, shape=torch.Size([4, 2]), stride=(2, 1)))
    cases = [("replicate", partial, "Partial", lambda m: replicate(m, process_group=dp_group)),
             ("fully_shard", partial, "Partial", lambda m: fully_shard(m, process_group=dp_group)),
             ("fully_shard", strided, "only Shard(dim) and Replicate()", lambda m: fully_shard(m, process_group=dp_group)),
             ("fully_shard", uneven, f"local piece of shape ({rows}, 2)", lambda m: fully_shard(m, mesh=mesh["dp"]))]
    for api, module, fragment, call in cases:
        snapshot = _local_snapshot(module)
        try:
            call(module)
        except NotImplementedError as error:
            assert "'weight'" in str(error) and fragment in str(error) and api in str(error), (api, str(error))
        else:
            raise AssertionError(f"{api} accepted {fragment}")
        _assert_same(snapshot, module)


def _batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The combined batch of a step (every data-parallel rank's rows)."""
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(DP * ROWS_PER_RANK, 8, generator=generator), torch.randn(DP * ROWS_PER_RANK, 4, generator=generator)


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int, dp_rank: int,
          tp_params: List[DTensor], dp_group: Any) -> Tuple[float, float]:
    x, y = _batch(step)
    rows = slice(dp_rank * ROWS_PER_RANK, (dp_rank + 1) * ROWS_PER_RANK)
    loss = nn.functional.mse_loss(model(x[rows]), y[rows])
    loss.backward()
    for p in tp_params:  # left out of fully_shard: their gradients are the user's to average over dp
        local = p.grad.to_local()
        dist.all_reduce(local, group=dp_group)
        local.div_(DP)
    # the global norm over dp x tp (each element once), ours and torch's clip on alternate steps
    norm = clip_grad_norm_(model, MAX_NORM) if step % 2 == 0 else torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optim.step()
    optim.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=dp_group)
    return mean.item() / DP, norm.item()


def _reference_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> Tuple[float, float]:
    x, y = _batch(step)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optim.step()
    optim.zero_grad()
    return loss.item(), norm.item()


def _assert_full_equal(ours: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor], what: str) -> None:
    assert list(ours) == list(reference), (what, list(ours), list(reference))
    for key, value in ours.items():
        assert type(value) is torch.Tensor, (what, key, type(value))  # a plain model's tensors, not DTensors
        torch.testing.assert_close(value, reference[key], atol=1e-5, rtol=0, msg=lambda m: f"{what} {key}: {m}")


def _left_out_and_checkpointed(directory: str) -> None:
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_group, dp_rank = mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    model, tp_linears = _tp_net(mesh)
    for block in model.blocks:
        fully_shard(block, process_group=dp_group, ignored_modules=[block.up, block.down])
    fully_shard(model, process_group=dp_group, ignored_modules=tp_linears)
    tp_params = [p for m in tp_linears for p in m.parameters()]
    assert all(isinstance(p, DTensor) for p in tp_params)
    reference = _plain_net()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    reference_optim = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for step in range(3):
        ours, theirs = _step(model, optim, step, dp_rank, tp_params, dp_group), _reference_step(reference, reference_optim, step)
        assert all(abs(a - b) <= 1e-5 for a, b in zip(ours, theirs)), (step, ours, theirs)  # loss, norm before clipping
        assert theirs[1] > MAX_NORM, theirs  # the clipping changed the step
    full = get_model_state_dict(model)
    _assert_full_equal(full, reference.state_dict(), "after 3 steps")
    assert full._metadata == reference.state_dict()._metadata  # type: ignore[attr-defined]  # module versions kept

    sharded = get_model_state_dict(model, full=False)
    assert {k for k, v in sharded.items() if isinstance(v, DTensor)} == {
        f"blocks.{i}.{m}.{p}" for i in range(2) for m in ("up", "down") for p in ("weight", "bias")}
    assert "blocks.0.up.weight" in get_optimizer_state_dict(model, optim)["state"]

    path = os.path.join(directory, "step3")
    save_checkpoint(path, model, optim)
    saved = get_model_state_dict(model)
    step4 = _step(model, optim, 3, dp_rank, tp_params, dp_group)
    after_step4 = get_model_state_dict(model)
    load_checkpoint(path, model, optim)
    _assert_full_equal(get_model_state_dict(model), saved, "after load_checkpoint")
    assert _step(model, optim, 3, dp_rank, tp_params, dp_group) == step4  # the optimizer's moments came back too
    _assert_full_equal(get_model_state_dict(model), after_step4, "step 4 again after the load")

    before = get_model_state_dict(model)  # a load failing on one rank after writing: every piece restored
    optim_before = {(id(p), k): _local(v).clone() for p, entry in optim.state.items() for k, v in entry.items()}

    def fail(api: str) -> None:
        if dist.get_rank() == 1:
            raise RuntimeError("injected failure")

    load_transaction.before_final_agreement = fail
    try:
        load_checkpoint(os.path.join(directory, "step3"), model, optim)
    except RuntimeError as error:
        assert "injected failure" in str(error), error
    else:
        raise AssertionError("the injected failure did not raise")
    finally:
        load_transaction.before_final_agreement = None
    _assert_full_equal(get_model_state_dict(model), before, "after a failed load")
    optim_after = {(id(p), k): _local(v) for p, entry in optim.state.items() for k, v in entry.items()}
    assert optim_after.keys() == optim_before.keys()
    assert all(torch.equal(optim_after[key], value) for key, value in optim_before.items())

    plain = _plain_net()  # a plain model's full state dict loads into the tensor-parallel one
    set_model_state_dict(model, copy.deepcopy(plain.state_dict()))
    _assert_full_equal(get_model_state_dict(model), plain.state_dict(), "after set_model_state_dict")
    assert all(isinstance(p, DTensor) for p in tp_params)

    # a gradient that is still a Partial sum over tp (a SequenceParallel norm's, left to the user): our
    # clip takes the norm of the sum, 1 + 2 = 3 in each of 4 elements -> 6, not of this rank's addend
    holder = nn.Linear(2, 2)
    holder.weight = nn.Parameter(DTensor.from_local(torch.ones(2, 2), mesh["tp"], [Replicate()]))
    tp_rank = mesh["tp"].get_local_rank()
    holder.weight.grad = DTensor.from_local(torch.full((2, 2), float(1 + tp_rank)), mesh["tp"], [Partial()])
    assert abs(clip_grad_norm_(holder, 1e9).item() - 6.0) <= 1e-6


def test_tensor_parallel_modules_are_refused_naming_the_parameter() -> None:
    run_distributed(_refusals, DP * TP, timeout=120)


def test_tensor_parallel_modules_left_out_train_exactly_and_checkpoint(tmp_path: Any) -> None:
    run_distributed(_left_out_and_checkpointed, DP * TP, str(tmp_path), timeout=180)


def _replicated(how: str, directory: str) -> None:
    """replicate over the tensor-parallel net (``how``: the whole model, or each block
    checkpointed and replicated under a replicated root): 4 AdamW steps, each clipped (ours),
    step 1 accumulated over two micro-batches without sync, equal to one process; each step's
    all-reduces carry this rank's pieces (half of each tensor-parallel matrix), which
    ``describe`` reports; a checkpoint round trip, and its load into a plain model replicated
    over all 4 ranks (dp 4 x tp 1)."""
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_group, dp_rank = mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    model, tp_linears = _tp_net(mesh)
    if how == "blocks":
        for block in model.blocks:
            checkpoint(block)
            replicate(block, process_group=dp_group)
    replicate(model, process_group=dp_group)
    local_numel = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    assert local_numel < sum(p.numel() for p in model.parameters())  # the pieces are halves
    rows = describe(model).rows
    assert sum(r.shard_numel for r in rows) == local_numel and sum(r.param_bytes for r in rows) == 4 * local_numel, rows
    reference = _plain_net()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    reference_optim = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for step in range(4):
        x, y = _batch(step)
        mine = x[dp_rank * ROWS_PER_RANK:(dp_rank + 1) * ROWS_PER_RANK], y[dp_rank * ROWS_PER_RANK:(dp_rank + 1) * ROWS_PER_RANK]
        with _collectives.record_collectives() as rec:
            if step == 1:  # two micro-batches, the first without gradient sync
                for module in (model.blocks[0], model.blocks[1], model) if how == "blocks" else (model,):
                    module.set_requires_gradient_sync(False)
                (nn.functional.mse_loss(model(mine[0][:1]), mine[1][:1]) / ROWS_PER_RANK).backward()
                for module in (model.blocks[0], model.blocks[1], model) if how == "blocks" else (model,):
                    module.set_requires_gradient_sync(True)
                loss = nn.functional.mse_loss(model(mine[0][1:]), mine[1][1:]) * (ROWS_PER_RANK - 1) / ROWS_PER_RANK
                loss.backward()
                loss = loss * ROWS_PER_RANK / (ROWS_PER_RANK - 1)  # not the step's loss: compared by parameters
            else:
                loss = nn.functional.mse_loss(model(mine[0]), mine[1])
                loss.backward()
        buckets = [r for r in rec.records if r.tag.startswith("replicate::bucket")]
        assert sum(r.nbytes for r in buckets) == 4 * local_numel, (step, [r.nbytes for r in buckets], local_numel)
        with _collectives.record_collectives() as clipping:
            norm = clip_grad_norm_(model, MAX_NORM)
        # the pieces' norms completed over tp in one all-reduce (not one full_tensor per gradient)
        assert [r.kind for r in clipping.records] == ["all_reduce"], (step, clipping.records)
        optim.step()
        optim.zero_grad()
        theirs = _reference_step(reference, reference_optim, step)
        assert abs(norm.item() - theirs[1]) <= 1e-5, (how, step, norm.item(), theirs)
        if step != 1:
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=dp_group)
            assert abs(mean.item() / DP - theirs[0]) <= 1e-5, (how, step, mean.item() / DP, theirs)
    _assert_full_equal(get_model_state_dict(model), reference.state_dict(), f"{how}: after 4 steps")
    assert all(isinstance(p.grad, DTensor) or p.grad is None for m in tp_linears for p in m.parameters())

    before = _local_snapshot(model)  # a cast would cut the pieces loose from the buckets: refused, nothing changed
    try:
        model.to(torch.float64)
    except RuntimeError as error:
        assert "tensor-parallel" in str(error) and "'blocks.0.up.weight'" in str(error), str(error)
    else:
        raise AssertionError("a cast of the replicated tensor-parallel model went through")
    _assert_same(before, model)
    assert model.to("cpu") is model and model.float() is model  # no-ops stay allowed
    _assert_same(before, model)

    path = os.path.join(directory, f"replicated_{how}")
    save_checkpoint(path, model, optim)
    saved = get_model_state_dict(model)
    x, y = _batch(9)
    nn.functional.mse_loss(model(x[:ROWS_PER_RANK]), y[:ROWS_PER_RANK]).backward()
    optim.step()
    optim.zero_grad()
    load_checkpoint(path, model, optim)
    _assert_full_equal(get_model_state_dict(model), saved, f"{how}: after load_checkpoint")
    resharded = replicate(_plain_net())  # (dp 4, tp 1): the pieces are read into whole tensors
    load_checkpoint(path, resharded, torch.optim.AdamW(resharded.parameters(), lr=0.01))
    _assert_full_equal(get_model_state_dict(resharded), saved, f"{how}: loaded at dp 4 x tp 1")
    if how == "whole":
        _buckets_hold_the_pieces(mesh)


# Worked out by hand for _buckets_hold_the_pieces: fp32 pieces at tp 2, in reverse registration order
# (replicate's bucket order; the gradient-ready order it rebuilds from after the first backward is the same):
# 2.bias 256 (Replicate) = 1,024 B, 2.weight 256 x 512 = 524,288 B, 0.bias 512 = 2,048 B, 0.weight
# 512 x 256 = 524,288 B; 1,051,648 B in all. A bucket closes once it reaches bucket_cap_mb, the first
# already at min(bucket_cap_mb, replicate's _FIRST_BUCKET_BYTES = 1 MiB = 1,048,576 B):
# - bucket_cap_mb 25: the first closes only with the last piece: one bucket. (Sized by the global tensors,
#   2.bias + 2.weight = 1,049,600 B would close it after two: two bucket all-reduces.)
# - bucket_cap_mb 513/1024 (525,312 B, exactly 2.bias + 2.weight): a bucket per Linear, 525,312 B and
#   526,336 B (a first bucket closing at 1 MiB would hold all; one closing only above the cap, three pieces).
# Then the used flags: 4 B per parameter (4) and the step agreement's 8.
_PIECES_BYTES = 1024 + 524288 + 2048 + 524288
_BUCKETS_BY_CAP = {25.0: [_PIECES_BYTES], 513 / 1024: [1024 + 524288, 2048 + 524288]}
_USED_FLAGS_BYTES = 4 * (4 + 2)


def _buckets_hold_the_pieces(mesh: DeviceMesh) -> None:
    """replicate (dp) over ColwiseParallel Linear(256, 1024) -> RowwiseParallel Linear(1024, 256)
    (tp), fp32, and a frozen LayerNorm(256), at two bucket caps: each backward (the first, which
    rebuilds the buckets, and the next) all-reduces the buckets of the pieces' bytes worked out
    above and the used flags, counted by the library's recorder and by c10d's operators, and
    ``describe`` reports that count and those bytes; the replicate row's gradient is the
    pieces' bytes and its AdamW state 2 x those + 4 B per parameter; the frozen norm has neither."""
    from tests._c10d_count import C10dCount

    for bucket_cap_mb, buckets in _BUCKETS_BY_CAP.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.LayerNorm(256))
        model[3].requires_grad_(False)
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        replicate(model, process_group=mesh["dp"].get_group(), bucket_cap_mb=bucket_cap_mb)
        d = describe(model)
        assert (d.collective_count("all_reduce"), d.collective_bytes("all_reduce")) == \
            (len(buckets) + 1, _PIECES_BYTES + _USED_FLAGS_BYTES), (bucket_cap_mb, d)
        row, frozen = d.rows
        assert (row.api, 4 * row.shard_numel, row.grad_bytes, row.adamw_bytes) == \
            ("replicate", _PIECES_BYTES, _PIECES_BYTES, 2 * _PIECES_BYTES + 4 * 4), row
        assert (frozen.fqn, frozen.numel, frozen.grad_bytes, frozen.adamw_bytes) == ("(not managed)", 512, 0, 0), frozen
        expected = [(f"replicate::bucket{k}", nbytes, DP) for k, nbytes in enumerate(buckets)]
        for step in range(2):
            loss = model(torch.randn(2, 256, generator=torch.Generator().manual_seed(step))).sum()
            with _collectives.record_collectives() as rec, C10dCount() as c10d:
                loss.backward()
            reduced = [(r.tag, r.nbytes, r.group_size) for r in rec.records if r.kind == "all_reduce"]
            assert reduced == expected + [("replicate::used_params", _USED_FLAGS_BYTES, DP)], (bucket_cap_mb, step, reduced)
            assert c10d.counts["all_reduce"] == len(buckets) + 1, (bucket_cap_mb, step, c10d.counts)
            model.zero_grad()


def test_replicate_over_tensor_parallel_modules_is_one_process(tmp_path: Any) -> None:
    """Without it (besides the training parity): replicate's buckets sized by the global
    tensors instead of this rank's pieces close early, one all-reduce more per backward, and
    ``describe`` of a replicated tensor-parallel model counting AdamW state or gradients for
    frozen parameters, all silently."""
    for how in ("whole", "blocks"):
        run_distributed(_replicated, DP * TP, how, str(tmp_path), timeout=180)


def _sequence_parallel_both_ways() -> None:
    for reduce_dtype in (None, torch.float64):  # float64: reduced in a copy, written back into the gradients
        _sequence_parallel(reduce_dtype)


def _sequence_parallel(reduce_dtype: Any) -> None:
    """torchtitan's plan on the same blocks: the norms ``SequenceParallel`` (their weights'
    gradients are ``Partial`` sums over the tensor-parallel ranks), ``up`` column-wise from a
    sequence-sharded input, ``down`` row-wise back to it, the head column-wise from the sequence
    shards to a replicated output; replicate over dp. Each rank feeds its sequence shard; losses and
    parameters equal one process, reduced in the parameters' dtype (gradients are bucket views) and
    in float64 (copied back). (Averaging the Partial pieces over dp alone left the norms' gradients
    a tensor-parallel sum short, silently.)"""
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_group, dp_rank, tp_rank = mesh["dp"].get_group(), mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    torch.manual_seed(0)
    model = _Net()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                                               "down": RowwiseParallel(output_layouts=Shard(1))})
    parallelize_module(model.head, mesh["tp"], ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()))
    replicate(model, process_group=dp_group,
              mixed_precision=None if reduce_dtype is None else MixedPrecision(reduce_dtype=reduce_dtype))
    reference = _plain_net()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    reference_optim = torch.optim.AdamW(reference.parameters(), lr=0.01)
    seq = 4
    for step in range(3):
        generator = torch.Generator().manual_seed(200 + step)
        x, y = torch.randn(DP * 2, seq, 8, generator=generator), torch.randn(DP * 2, seq, 4, generator=generator)
        rows, cols = slice(dp_rank * 2, dp_rank * 2 + 2), slice(tp_rank * seq // TP, (tp_rank + 1) * seq // TP)
        loss = nn.functional.mse_loss(model(x[rows, cols]), y[rows])
        loss.backward()
        norm = clip_grad_norm_(model, MAX_NORM)
        optim.step()
        optim.zero_grad()
        reference_loss = nn.functional.mse_loss(reference(x), y)
        reference_loss.backward()
        reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        reference_optim.step()
        reference_optim.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp_group)
        assert abs(mean.item() / DP - reference_loss.item()) <= 1e-5, (step, mean.item() / DP, reference_loss.item())
        assert abs(norm.item() - reference_norm.item()) <= 1e-5, (step, norm.item(), reference_norm.item())
    _assert_full_equal(get_model_state_dict(model), reference.state_dict(), "sequence parallel: after 3 steps")


def test_replicate_over_sequence_parallel_blocks_is_one_process() -> None:
    run_distributed(_sequence_parallel_both_ways, DP * TP, timeout=180)


def _hf_llama() -> None:
    """A tiny Hugging Face Llama parallelized with its config's ``base_model_tp_plan`` (q/k/v,
    gate and up column-wise, o and down row-wise, through ``parallelize_module``), replicated over
    dp: 3 SGD steps equal one process on the combined batch."""
    import transformers

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_group, dp_rank = mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(transformers.LlamaForCausalLM(config))
    model, reference = models
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    assert set(config.base_model_tp_plan.values()) <= set(styles), config.base_model_tp_plan
    parallelize_module(model.model, mesh["tp"], {k: styles[v]() for k, v in config.base_model_tp_plan.items()})
    assert isinstance(model.model.layers[1].mlp.down_proj.weight, DTensor)
    replicate(model, process_group=dp_group)
    # SGD: AdamW's normalized step turns a float32 rounding in a near-zero gradient into a 2e-5
    # parameter difference (1 element in 2048 here); SGD moves each parameter by its gradient
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        ids = torch.randint(0, 64, (DP * 2, 12), generator=torch.Generator().manual_seed(300 + step))
        mine = ids[dp_rank * 2:dp_rank * 2 + 2]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        reference_loss = reference(input_ids=ids, labels=ids).loss
        reference_loss.backward()
        reference_optim.step()
        reference_optim.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp_group)  # equal rows per rank and per row: the mean of the two means
        assert abs(mean.item() / DP - reference_loss.item()) <= 1e-5, (step, mean.item() / DP, reference_loss.item())
    _assert_full_equal(get_model_state_dict(model), reference.state_dict(), "Llama: after 3 steps")


def test_replicate_over_a_hugging_face_llama_with_its_tp_plan() -> None:
    run_distributed(_hf_llama, DP * TP, timeout=180)
