"""fully_shard's runtime: per-rank storage, freeing, prefetch order, mixed dtypes and frozen
parameters, cross-rank checks, recovery from a failed forward, and the FSDPModule methods.

Each figure checked here (elements per rank, collective counts, issue order) is counted by
``_collectives``' own instrumentation; nothing in torch.distributed is mocked.
"""

from __future__ import annotations

import math
from typing import List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import BackwardPrefetch, ShardingStrategy, clip_grad_norm_, fully_shard, unshard_params
from composable_shard._collectives import record_collectives
from composable_shard._traversal_utils import _get_fsdp_handles
from tests._harness import run_distributed, run_subtests
from tests._models import (assert_params_close, batch, local_backward, local_rows, loss_fn, make_model)


def _annotate(model: nn.Module, **kwargs: object) -> None:
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, **kwargs)
    fully_shard(model.scale, **kwargs)  # type: ignore[arg-type]
    fully_shard(model, **kwargs)


# ---------------------------------------------------------------------------- storage
def _storage() -> None:
    world_size = dist.get_world_size()
    model = make_model()
    expected_numels = {  # per handle, per (dtype, requires_grad) group, by hand from the model
        "blocks.0": [12 + 49 + 48], "blocks.1": [12 + 49 + 48], "scale": [1],
        "": [13 * 6, 6 * 6 + 6],  # root: tied emb/head once (trainable) + frozen Linear
    }
    _annotate(model)
    handles = _get_fsdp_handles(model)
    local_backward(model, 0)  # lazy init names handles by their FQN under the root
    assert [h.fqn for h in handles] == ["", "blocks.0", "blocks.1", "scale"], [h.fqn for h in handles]
    root = fully_shard.state(model)  # the root's cache, under API.md's names ("Root")
    cached_states, cached_handles = root._all_fsdp_states, root._all_handles
    assert [s.fqn for s in cached_states] == ["", "blocks.0", "blocks.1", "scale"]
    assert [h.fqn for h in cached_handles] == ["", "blocks.0", "blocks.1", "scale"]
    assert all(s is fully_shard.state(m) for s, m in zip(cached_states, [model, *model.blocks, model.scale]))
    model.zero_grad()
    for h in handles:
        numels = [fp._unpadded_unsharded_size.numel() for fp in h.flat_params]
        assert numels == expected_numels[h.fqn], (h.fqn, numels)
        for fp, numel in zip(h.flat_params, numels):
            assert fp.numel() == math.ceil(numel / world_size), (h.fqn, fp.numel())
    local = sum(p.numel() for p in model.parameters())
    assert local == sum(h.flat_params[i]._shard_slices[j].numel for h in handles
                        for i in range(len(h.flat_params)) for j in range(len(h.flat_params[i]._numels)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    local_backward(model, 0)
    optim.step()
    assert root._all_fsdp_states is cached_states and root._all_handles is cached_handles, "rebuilt after lazy init"
    for h in handles:
        assert h.unsharded_storage_freed(), f"{h.fqn}: unsharded storage alive after a FULL_SHARD step"
        for g in h.groups:
            if world_size > 1:
                assert g.padded_unsharded_flat.untyped_storage().size() == 0
    state_bytes = sum(t.numel() for s in optim.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    assert state_bytes == 2 * sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_storage_per_rank_and_freeing(world_size: int) -> None:
    """Each handle stores ceil(N/W) elements per group; unsharded storage is freed after a
    FULL_SHARD step; optimizer state is sized by the shard."""
    run_distributed(_storage, world_size, timeout=120)


# ---------------------------------------------------------------------------- prefetch order
def _prefetch_order(forward_prefetch: bool, backward_prefetch: object) -> None:
    model = make_model(num_blocks=3)
    for block in model.blocks:
        fully_shard(block, forward_prefetch=forward_prefetch, backward_prefetch=backward_prefetch)
    fully_shard(model, forward_prefetch=forward_prefetch, backward_prefetch=backward_prefetch)
    from composable_shard._collectives import trace

    for i, block in enumerate(model.blocks):  # appended after fully_shard's prepended pre-hook
        block.register_forward_pre_hook(lambda m, a, i=i: trace("compute", f"blocks.{i}"))
    local_backward(model, 0)  # iteration 1 records the order
    model.zero_grad()
    with record_collectives() as rec:
        local_backward(model, 1)
    events = rec.events

    def at(kind: str, name: str, tag: str) -> int:
        return events.index((kind, name, tag))

    for i in range(2):  # blocks.i and blocks.i+1
        gather_next = at("collective", "all_gather", f"blocks.{i + 1}")
        if forward_prefetch:
            assert gather_next < at("trace", "compute", f"blocks.{i}"), events
        else:
            assert gather_next > at("trace", "post_forward", f"blocks.{i}"), events
    for i in (2, 1):  # backward runs blocks.2, blocks.1, blocks.0
        start = at("trace", "pre_backward", f"blocks.{i}")
        end = at("trace", "post_backward", f"blocks.{i}")
        gathers = [k for k, e in enumerate(events) if e == ("collective", "all_gather", f"blocks.{i - 1}") and k > start]
        assert gathers, events
        if backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            assert start < gathers[0] < end, ("prefetch not issued during blocks.%d's backward" % i, events)
        else:
            assert gathers[0] > end, events
    # Exactly 2 all-gathers per flat parameter per step, 1 for the root's (kept unsharded from
    # its forward to its backward), and 1 reduce-scatter per trainable flat parameter (the
    # root has a trainable and a frozen flat parameter; the frozen one is never reduced).
    handles = _get_fsdp_handles(model)
    expected_gathers = {h.fqn: (1 if h.fqn == "" else 2) * len(h.flat_params) for h in handles}
    expected_reduces = {h.fqn: sum(fp.requires_grad for fp in h.flat_params) for h in handles}
    shard_bytes = {h.fqn: sorted(4 * fp.numel() for fp in h.flat_params) for h in handles}
    gathers = {h.fqn: 0 for h in handles}
    reduces = {h.fqn: 0 for h in handles}
    for r in rec.records:
        if r.kind == "all_gather":
            gathers[r.tag] += 1
            assert r.nbytes in shard_bytes[r.tag], (r, shard_bytes[r.tag])
        elif r.kind == "reduce_scatter":
            reduces[r.tag] += 1
    assert gathers == expected_gathers and reduces == expected_reduces, (gathers, reduces)
    # Plus one small all-reduce agreeing on which parameters got a gradient on some rank: one
    # int32 per trainable original parameter (3 blocks x 6, scale 1, tied emb/head 1).
    used = [r for r in rec.records if r.kind == "all_reduce"]
    assert [(r.tag, r.nbytes) for r in used] == [("used_params", 4 * (3 * 6 + 1 + 1))], used
    assert {r.kind for r in rec.records} == {"all_gather", "reduce_scatter", "all_reduce"}, rec.records


def _prefetch_grid() -> None:
    run_subtests(_prefetch_order, {"forward_prefetch": [True, False],
                                   "backward_prefetch": [BackwardPrefetch.BACKWARD_PRE, None]})


def test_prefetch_is_issued_before_compute() -> None:
    """With prefetch on, handle i+1's all-gather is issued before handle i's forward compute and
    handle i-1's during handle i's backward; with it off, only after. FULL_SHARD issues exactly
    2 all-gathers (the root: 1) and 1 reduce-scatter per handle per step."""
    run_distributed(_prefetch_grid, 2, timeout=120)


# ---------------------------------------------------------------------------- mixed dtypes / frozen
class MixedBlock(nn.Module):
    """fp32 Linear, a bf16 gain, and a frozen fp32 bias vector in one fully sharded module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.gain = nn.Parameter(torch.full((6,), 0.75, dtype=torch.bfloat16))
        self.offset = nn.Parameter(torch.linspace(-1, 1, 6), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.gain.float() + self.offset


def _mixed_dtypes() -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = nn.Sequential(MixedBlock(), nn.Linear(6, 3))
    torch.manual_seed(0)
    model = nn.Sequential(MixedBlock(), nn.Linear(6, 3))
    fully_shard(model[0])
    fully_shard(model)
    handle = _get_fsdp_handles(model[0])[0]
    # Groups in first-seen .named_modules() order: MixedBlock's own gain, offset, then fc.
    assert [(fp.dtype, fp.requires_grad) for fp in handle.flat_params] == [
        (torch.bfloat16, True), (torch.float32, False), (torch.float32, True)]
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(world_size * 2, 6, generator=g)
        reference(x).pow(2).mean().backward()
        opt_ref.step()
        opt_ref.zero_grad()
        with record_collectives() as rec:
            model(x[rank * 2:(rank + 1) * 2]).pow(2).mean().backward()
        assert model[0].offset.grad is None
        tags = [r.tag for r in rec.records if r.kind == "reduce_scatter"]
        assert tags.count("0") == 2, tags  # fp32 and bf16 groups; the frozen group is never reduced
        opt.step()
        opt.zero_grad()
    with unshard_params(model):
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            atol = 2e-2 if p.dtype == torch.bfloat16 else 1e-5
            assert p.dtype == q.dtype and torch.allclose(p.float(), q.float(), atol=atol), (name, (p.float() - q.float()).abs().max())
    assert handle.groups[1].padded_unsharded_flat.grad is None


@pytest.mark.parametrize("world_size", [2, 4])
def test_mixed_dtypes_and_frozen_in_one_module(world_size: int) -> None:
    """fp32 + bf16 + frozen parameters in one fully sharded module: three flat parameters,
    parity with local training, and the frozen group is never reduced and has no .grad."""
    run_distributed(_mixed_dtypes, world_size, timeout=120)


# ---------------------------------------------------------------------------- cross-rank mismatch
def _mismatch() -> None:
    torch.manual_seed(0)
    width = 6 if dist.get_rank() == 0 else 7
    model = nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2))
    fully_shard(model)
    model(torch.randn(2, 4))


def test_ranks_disagreeing_on_shapes_fail_at_lazy_init() -> None:
    """A rank that built a different model raises at lazy init naming the parameter instead of
    hanging in a mismatched all-gather."""
    with pytest.raises(AssertionError, match=r"parameter '0.weight' \[6, 4\] here vs '0.weight' \[7, 4\] there"):
        run_distributed(_mismatch, 2, timeout=60)


# ---------------------------------------------------------------------------- failed forward
class Flaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if self.fail:
            raise ValueError("user error in forward")
        return y


def _flaky_models() -> Tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    """(reference, fully sharded model, global batch, this rank's rows), same init."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = nn.Sequential(Flaky(), nn.Linear(6, 2))
    torch.manual_seed(0)
    model = nn.Sequential(Flaky(), nn.Linear(6, 2))
    fully_shard(model[0])
    fully_shard(model)
    x = torch.randn(world_size * 2, 6)
    return reference, model, x, x[rank * 2:(rank + 1) * 2]


def _check_next_step_matches(reference: nn.Module, model: nn.Module, x: torch.Tensor, local_x: torch.Tensor,
                             what: str) -> None:
    model(local_x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    with unshard_params(model, with_grads=True):
        grads = [(n, p.grad.clone()) for n, p in model.named_parameters()]
    assert_params_close(grads, [(n, p.grad) for n, p in reference.named_parameters()], what=what)
    assert all(h.unsharded_storage_freed() for h in _get_fsdp_handles(model))


def _exception_in_forward() -> None:
    reference, model, x, local_x = _flaky_models()
    model[0].fail = True
    try:
        model(local_x)
    except ValueError:
        pass
    else:
        raise AssertionError("forward should have raised")
    model[0].fail = False
    _check_next_step_matches(reference, model, x, local_x, "after failed forward")


def _exception_in_backward() -> None:
    reference, model, x, local_x = _flaky_models()

    def explode(grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("user error in backward")

    out = model(local_x)
    out.register_hook(explode)  # raises after the root's pre-backward queued the end-of-backward step
    try:
        out.pow(2).mean().backward()
    except (ValueError, RuntimeError) as e:
        assert "user error in backward" in str(e), e
    else:
        raise AssertionError("backward should have raised")
    model.zero_grad()
    _check_next_step_matches(reference, model, x, local_x, "after failed backward")


def _exceptions() -> None:
    _exception_in_forward()
    dist.barrier()
    _exception_in_backward()


def test_exception_in_forward_or_backward_leaves_model_usable() -> None:
    """A forward that raises leaves handles mid-forward, a backward that raises leaves its
    end-of-backward step unrun; the next step recovers and its gradients equal local training."""
    run_distributed(_exceptions, 2, timeout=60)


# ---------------------------------------------------------------------------- FSDPModule methods
def _no_sync_accumulation() -> None:
    world_size = dist.get_world_size()
    reference = make_model()
    expected = [(n, g) for n, g in _accumulated_reference(reference, world_size)]
    model = make_model()
    _annotate(model)
    model.set_requires_gradient_sync(False)
    with record_collectives() as rec:
        for step in range(3):
            local_backward(model, step)
    # Parameters are still all-gathered (FULL_SHARD); no gradient is communicated.
    reductions = [r for r in rec.records if r.kind in ("reduce_scatter", "all_reduce")]
    assert not reductions, f"gradients communicated during unsynced micro-batches: {reductions}"
    model.set_requires_gradient_sync(True)
    local_backward(model, 3)
    with unshard_params(model, with_grads=True):
        grads = [(n, p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None]
    assert_params_close(grads, expected, what="no_sync accumulation")


def _unsynced_grads_visible(strategy: ShardingStrategy, user_action: str) -> None:
    """Between unsynced backwards each parameter's .grad is this rank's full-shape local
    gradient sum (a view of the kept unreduced gradient, as torch FSDP with use_orig_params
    gives), equal to a local model's after the same micro-batches on this rank's rows; a
    frozen parameter keeps None. What the user does to those views counts, as it would locally:
    scaled in place, or zero_grad() mid-accumulation. The synced backward then gives sharded
    views again, equal to the local sum over all ranks' rows."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local, everyone = make_model(), make_model()
    model = make_model()
    _annotate(model, strategy=strategy, **_hybrid_mesh(strategy))
    model.set_requires_gradient_sync(False)
    for step in range(3):
        inputs, targets = batch(step, world_size)
        loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank)).backward()
        loss_fn(local(local_rows(inputs, rank)), local_rows(targets, rank)).backward()
        for r in range(world_size):  # what the synced reduction must give: every rank's rows, averaged
            (loss_fn(everyone(local_rows(inputs, r)), local_rows(targets, r)) / world_size).backward()
        for (name, p), (_, q) in zip(model.named_parameters(), local.named_parameters()):
            assert (p.grad is None) == (q.grad is None), f"[{strategy.name}] step {step} {name}: grad {p.grad is None}"
            if q.grad is not None:
                assert p.grad.shape == q.shape, f"[{strategy.name}] {name}: .grad shape {tuple(p.grad.shape)}"
                torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0, msg=f"[{strategy.name}] step {step} {name}")
        if step == 0 and user_action == "none":
            with pytest.raises(RuntimeError, match="already is this rank's full-shape accumulated local gradient"):
                with unshard_params(model, with_grads=True):
                    pass
            with pytest.raises(RuntimeError, match="clip_grad_norm_ between backwards without gradient sync"):
                clip_grad_norm_(model, 1.0)
        if step == 1 and user_action == "scale":
            for m in (model, local):
                for p in m.parameters():
                    if p.grad is not None:
                        p.grad.mul_(0.5)
            for r_p in everyone.parameters():  # each rank scaled its own part of the sum
                if r_p.grad is not None:
                    r_p.grad.mul_(0.5)
        if step == 1 and user_action == "zero_grad":
            for m in (model, local, everyone):
                m.zero_grad()
    model.set_requires_gradient_sync(True)
    inputs, targets = batch(3, world_size)
    loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank)).backward()
    for r in range(world_size):
        (loss_fn(everyone(local_rows(inputs, r)), local_rows(targets, r)) / world_size).backward()
    for p in model.parameters():
        assert p.grad is None or p.grad.shape == p.shape, "synced .grad is not the sharded view"
    with unshard_params(model, with_grads=True):
        grads = [(n, p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None]
    expected = [(n, p.grad) for n, p in everyone.named_parameters() if p.grad is not None]
    assert_params_close(grads, expected, what=f"[{strategy.name}/{user_action}] synced after unsynced")


def _hybrid_mesh(strategy: ShardingStrategy) -> dict:
    if strategy is not ShardingStrategy.HYBRID_SHARD:
        return {}
    from torch.distributed.device_mesh import init_device_mesh

    world_size = dist.get_world_size()
    return {"mesh": init_device_mesh("cpu", (world_size // 2, 2))}


def _unsynced_grid() -> None:
    strategies = [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD]
    if dist.get_world_size() == 4:
        strategies.append(ShardingStrategy.HYBRID_SHARD)
    run_subtests(_unsynced_grads_visible, {"strategy": strategies, "user_action": ["none", "scale", "zero_grad"]})


@pytest.mark.parametrize("world_size", [2, 4])
def test_unsynced_grads_are_full_local_sums(world_size: int) -> None:
    run_distributed(_unsynced_grid, world_size, timeout=240)


def _accumulated_reference(model: nn.Module, world_size: int, steps: int = 4) -> List[Tuple[str, torch.Tensor]]:
    for step in range(steps):
        inputs, targets = batch(step, world_size)
        loss_fn(model(inputs), targets).backward()
    return [(n, p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None]


def _methods() -> None:
    model = make_model()
    _annotate(model)
    block = model.blocks[0]
    handle = _get_fsdp_handles(block)[0]
    block.unshard()
    block.unshard()  # idempotent
    assert not handle.needs_unshard()
    block.reshard()
    block.reshard()
    assert handle.unsharded_storage_freed() or dist.get_world_size() == 1
    model.set_reshard_after_backward(False)
    local_backward(model, 0)
    if dist.get_world_size() > 1:
        assert not handle.unsharded_storage_freed(), "reshard_after_backward=False must keep parameters unsharded"
    with unshard_params(model, writeback=True):
        pass
    assert handle.unsharded_storage_freed(), "a written-back shard must not leave a stale unsharded buffer"
    model.set_reshard_after_backward(True)
    model.zero_grad()
    handle.unshard()  # the handle-level API: full-shape views installed in the module
    assert block.fc1.weight.shape == (7, 6) and not handle.needs_unshard()
    handle.reshard()
    assert block.fc1.weight.dim() == 1 and (handle.unsharded_storage_freed() or dist.get_world_size() == 1)
    model.reshard()
    for m in model.blocks:
        m.reshard()


def _synced_accumulation() -> None:
    """Two synced backwards without zero_grad add up, like plain autograd."""
    world_size = dist.get_world_size()
    expected = _accumulated_reference(make_model(), world_size, steps=2)
    model = make_model()
    _annotate(model)
    local_backward(model, 0)
    local_backward(model, 1)
    with unshard_params(model, with_grads=True):
        grads = [(n, p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None]
    assert_params_close(grads, expected, what="synced accumulation")


def _methods_grid() -> None:
    _no_sync_accumulation()
    dist.barrier()
    _synced_accumulation()
    dist.barrier()
    _methods()


@pytest.mark.parametrize("world_size", [2, 4])
def test_no_sync_and_manual_unshard(world_size: int) -> None:
    """set_requires_gradient_sync(False) for 3 micro-batches issues no collective and the next
    synced backward reduces the sum (equal to local accumulation); unshard()/reshard() are
    idempotent; set_reshard_after_backward(False) keeps parameters unsharded."""
    run_distributed(_methods_grid, world_size, timeout=120)




# ---------------------------------------------------------------------------- clip_grad_norm_
def _clip_grad_norm(norm_type: float) -> None:
    world_size = dist.get_world_size()
    reference = make_model()
    inputs, targets = batch(0, world_size)
    loss_fn(reference(inputs), targets).backward()
    expected_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05, norm_type=norm_type)
    model = make_model()
    _annotate(model)
    local_backward(model, 0)
    total = model.clip_grad_norm_(0.05, norm_type=norm_type)
    assert torch.allclose(total, expected_total, atol=1e-6), (total, expected_total)
    with unshard_params(model, with_grads=True):
        grads = [(n, p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None]
    assert_params_close(grads, [(n, p.grad) for n, p in reference.named_parameters() if p.grad is not None],
                        atol=1e-6, what=f"clipped grads (norm {norm_type})")


def _clip_grid() -> None:
    run_subtests(_clip_grad_norm, {"norm_type": [2.0, 1.0, float("inf")]})


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_clip_grad_norm_over_all_shards(world_size: int) -> None:
    """The total norm (2, 1, inf) over every shard on every rank equals the unsharded model's,
    and the clipped gradients equal torch.nn.utils.clip_grad_norm_ on local training."""
    run_distributed(_clip_grid, world_size, timeout=120)
