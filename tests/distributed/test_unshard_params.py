"""unshard_params / summon_full_params: every option, checked against the unsharded model.

Without these, a user reading or editing full parameters (evaluation, weight surgery,
checkpoint conversion) could see stale values, lose edits, or silently corrupt the shards.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import CPUOffload, fully_shard, unshard_params
from composable_shard._runtime.traversal import _get_fsdp_handles
from tests._harness import run_distributed, run_subtests
from tests._models import local_backward, make_model, reference_grads, zip_same


def _sharded_model() -> nn.Module:
    model = make_model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model.scale)
    fully_shard(model)
    return model


def _shards(model: nn.Module) -> list:
    return [p.detach().clone() for p in model.parameters()]


def _values(recurse: bool, via: str) -> None:
    """Inside: full shapes and values on every rank; recurse=False only the module's own (the
    root's: the tied embedding and the frozen Linear, not the blocks' or scale's). The same
    through the FSDPModule method summon_full_params."""
    reference = make_model()
    model = _sharded_model()
    module = model
    names = [n for n, _ in module.named_parameters()]
    context = unshard_params(module, recurse=recurse) if via == "unshard_params" else \
        module.summon_full_params(recurse=recurse)  # type: ignore[operator]
    with context:
        for name, p in model.named_parameters():
            expected = dict(reference.named_parameters())[name]
            inside = recurse or not name.startswith(("blocks.", "scale."))
            if inside:
                assert p.shape == expected.shape and torch.equal(p, expected), name
            elif dist.get_world_size() > 1 and expected.numel() > 1:
                assert p.dim() == 1 and p.numel() <= expected.numel(), (name, p.shape)
    assert names == [n for n, _ in module.named_parameters()]


def _forward_inside_raises() -> None:
    model = _sharded_model()
    with unshard_params(model):
        try:
            model(torch.randint(0, 13, (2, 5)))
        except RuntimeError as e:
            assert "summon_full_params" in str(e) or "unshard_params" in str(e), e
        else:
            raise AssertionError("forward inside unshard_params must raise")
    out = model(torch.randint(0, 13, (2, 5)))  # and the model still works afterwards
    assert out.shape == (2, 5, 13) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(h.unsharded_storage_freed() for h in _get_fsdp_handles(model))


def _writeback(writeback: bool, offload_to_cpu: bool) -> None:
    """Edits of the full parameters reach every rank's shard with writeback=True and none with
    writeback=False, with and without offload_to_cpu (on a CPU compute device the exposed
    parameters already are CPU tensors; the accelerator copy path is
    test_offload_to_cpu_writeback_from_an_accelerator's)."""
    model = _sharded_model()
    before = _shards(model)
    with unshard_params(model, writeback=writeback, offload_to_cpu=offload_to_cpu):
        with torch.no_grad():
            for p in model.parameters():
                assert p.device.type == "cpu" or not offload_to_cpu
                p.add_(1.0)
    after = _shards(model)
    for b, a in zip_same(before, after, what="shards"):
        if writeback:
            assert torch.equal(a, b + 1.0)
        else:
            assert torch.equal(a, b)
    reference = make_model()
    with unshard_params(model):
        for (name, p), (_, q) in zip_same(list(model.named_parameters()), list(reference.named_parameters())):
            assert torch.equal(p, q + 1.0 if writeback else q), name


def _rank0_only() -> None:
    model = _sharded_model()
    reference = make_model()
    with unshard_params(model, rank0_only=True, writeback=False):
        for (name, p), (_, q) in zip_same(list(model.named_parameters()), list(reference.named_parameters())):
            if dist.get_rank() == 0:
                assert torch.equal(p, q), name
            elif q.dim() > 1:
                assert p.shape != q.shape, name  # still this rank's 1-D slice
    try:
        with unshard_params(model, rank0_only=True, writeback=True):
            pass
    except NotImplementedError as e:
        assert "rank0_only" in str(e)
    else:
        raise AssertionError("writeback with rank0_only must raise")


def _offload_and_grads() -> None:
    world_size = dist.get_world_size()
    model = _sharded_model()
    expected = dict(reference_grads(make_model(), 0, world_size))
    local_backward(model, 0)
    sharded_grads = [(p.grad.clone() if p.grad is not None else None) for p in model.parameters()]
    with unshard_params(model, offload_to_cpu=True, with_grads=True, writeback=False):
        for name, p in model.named_parameters():
            assert p.device.type == "cpu"
            if name in expected:
                assert p.grad is not None and torch.allclose(p.grad, expected[name], atol=1e-6), name
            else:
                assert p.grad is None, name
    for g, p in zip_same(sharded_grads, list(model.parameters())):  # sharded grads restored on exit
        assert (g is None and p.grad is None) or torch.equal(g, p.grad)


class _PartlyUsed(nn.Module):
    """A trainable Linear the forward never calls, in the same flat parameter as one it calls."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 3)
        self.unused = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _grads_of_unused_parameters() -> None:
    """with_grads: a parameter no rank computed a gradient for shows ``.grad`` None (as after a
    local backward, and as FSDP1's summon_full_params), not zeros; its group's others show theirs."""
    torch.manual_seed(0)
    reference = _PartlyUsed()
    model = _PartlyUsed()
    model.load_state_dict(reference.state_dict())
    fully_shard(model)
    x = torch.randn(2 * dist.get_world_size(), 4)
    mine = x.chunk(dist.get_world_size())[dist.get_rank()]
    model(mine).square().mean().backward()
    reference(x).square().mean().backward()
    with unshard_params(model, with_grads=True):
        for (name, p), (_, q) in zip_same(list(model.named_parameters()), list(reference.named_parameters())):
            if q.grad is None:
                assert p.grad is None, f"{name}: .grad {p.grad} where no rank computed one"
            else:
                assert p.grad is not None and torch.allclose(p.grad, q.grad, atol=1e-6), name


def _all() -> None:
    run_subtests(_values, {"recurse": [True, False], "via": ["unshard_params", "summon_full_params"]})
    _forward_inside_raises()
    run_subtests(_writeback, {"writeback": [True, False], "offload_to_cpu": [False, True]})
    _rank0_only()
    _offload_and_grads()
    _grads_of_unused_parameters()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_unshard_params_options(world_size: int) -> None:
    """Full values inside (recurse True/False), forward inside raises, writeback True changes
    every rank's shard and False does not, rank0_only, writeback+rank0_only raises,
    offload_to_cpu, with_grads equal to local gradients and sharded grads restored."""
    run_distributed(_all, world_size, timeout=120)


def _offload_writeback_on(device: str) -> None:
    """On an accelerator, offload_to_cpu exposes CPU copies of the full parameters; with
    writeback=True the edits made to those copies must reach the shards on the device."""
    torch.cuda.set_device(dist.get_rank())
    model = make_model()
    for block in model.blocks:
        fully_shard(block, device_id=torch.device(device, dist.get_rank()))
    fully_shard(model, device_id=torch.device(device, dist.get_rank()))
    reference = make_model()
    with unshard_params(model, offload_to_cpu=True, writeback=True):
        with torch.no_grad():
            for p in model.parameters():
                assert p.device.type == "cpu", p.device
                p.mul_(2.0)
    with unshard_params(model):
        for (name, p), (_, q) in zip_same(list(model.named_parameters()), list(reference.named_parameters())):
            assert p.device.type == device and torch.equal(p.cpu(), 2.0 * q), name
    # Shards offloaded by fully_shard (CPUOffload) at one rank: the full parameters are the
    # device copy of the CPU shard, and edits to them must reach the shard (they were dropped).
    offloaded = make_model()
    for block in offloaded.blocks:
        fully_shard(block, device_id=torch.device(device, dist.get_rank()), cpu_offload=CPUOffload(offload_params=True))
    fully_shard(offloaded, device_id=torch.device(device, dist.get_rank()), cpu_offload=CPUOffload(offload_params=True))
    with unshard_params(offloaded, writeback=True):
        with torch.no_grad():
            for p in offloaded.parameters():
                p.mul_(2.0)
    with unshard_params(offloaded):
        for (name, p), (_, q) in zip_same(list(offloaded.named_parameters()), list(reference.named_parameters())):
            assert torch.equal(p.cpu(), 2.0 * q), f"{name}: the edit under CPUOffload at one rank was dropped"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload_to_cpu copies only from an accelerator (CUDA)")
def test_offload_to_cpu_writeback_from_an_accelerator() -> None:
    """unshard_params(offload_to_cpu=True, writeback=True) on CUDA shards (one rank: the exposed
    CPU copies are the only place the edits land), and on shards offloaded by CPUOffload: the
    edits are written back. On a CPU-only
    machine there is no copy to write back, so there is nothing to run."""
    run_distributed(_offload_writeback_on, 1, "cuda", timeout=120)
