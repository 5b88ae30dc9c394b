"""The rest of ``MixedPrecision``: modules kept in full precision (BatchNorm), ``buffer_dtype``
and ``keep_low_precision_grads`` (API.md, "Mixed precision"; issue 12).

Without these, a model with BatchNorm could not train under a bf16 policy ("expected scalar
type BFloat16 but found Float"), and the two options raised ``NotImplementedError``.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import (MixedPrecision, ModuleWrapPolicy, fully_shard, get_model_state_dict, set_model_state_dict,
                              unshard_params)
from composable_shard._runtime.traversal import _get_fsdp_handles
from tests._harness import run_distributed, run_subtests
from tests._models import assert_grads_relative, global_mean, zip_same

BF16 = torch.bfloat16
STEPS = 3
RTOL = 0.02  # bf16 gradients vs a local bf16 model (observed < 1%): a 1.5x error misses by 25x


class NormBlock(nn.Module):
    """Linear -> BatchNorm1d -> ReLU -> Linear, with a float buffer of its own and an integer one
    (positions, as a transformer's ``position_ids``), which ``buffer_dtype`` must leave alone."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 8)
        self.register_buffer("gain", torch.linspace(0.9, 1.1, 8))
        self.register_buffer("order", torch.arange(7, -1, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(torch.relu(self.norm(self.fc1(x))))
        return (out * self.gain.to(out.dtype))[:, self.order]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(NormBlock(), NormBlock(), nn.Linear(8, 4))


def _batch(step: int, rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)


def _shard(model: nn.Module, how: str, mp: MixedPrecision) -> nn.Module:
    if how == "policy":
        fully_shard(model, policy=ModuleWrapPolicy({NormBlock}), mixed_precision=mp)
    else:
        for block in list(model)[:2]:
            fully_shard(block, mixed_precision=mp)
        fully_shard(model, mixed_precision=mp)
    return model


def _train(model: nn.Module, steps: int, rows_per_rank: int = 4) -> List[float]:
    """SGD on this rank's rows of each step's batch; the global mean loss per step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = _batch(step, rows_per_rank * world_size)
        rows = slice(rank * rows_per_rank, (rank + 1) * rows_per_rank)
        loss = (model(x[rows]).float() - y[rows]).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(global_mean(loss))
    return losses


def _full_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}  # full tensors, as a plain model's


# ---------------------------------------------------------------------------- BatchNorm
def _batchnorm_full_precision(how: str) -> None:
    """Under a bf16 policy BatchNorm gets a handle of its own in fp32 (as torch FSDP gives it);
    annotated by hand, a full-precision group of its block's handle. Either way it computes in
    fp32 (inputs cast up, outputs back to bf16), its parameters, gradients and running stats
    stay fp32, the rest computes in bf16, and training equals torch FSDP1 with the same policy
    and mixed precision."""
    mp = MixedPrecision(param_dtype=BF16)
    model = _shard(_model(), how, mp)
    seen: Dict[str, torch.dtype] = {}
    norm = model[0].norm
    hooks = [norm.register_forward_hook(lambda m, a, out: seen.update(norm_in=a[0].dtype, norm_param=m.weight.dtype,
                                                                      norm_out=out.dtype)),
             model[0].fc2.register_forward_hook(lambda m, a, out: seen.update(fc2_in=a[0].dtype))]
    losses = _train(model, STEPS)
    for h in hooks:
        h.remove()
    assert seen == {"norm_in": torch.float32, "norm_param": torch.float32, "norm_out": BF16,  # cast back for the caller
                    "fc2_in": BF16}, seen
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point():
            assert t.dtype == torch.float32, (name, t.dtype)
    handles = _get_fsdp_handles(model)
    norm_groups = [g for h in handles for g in h.groups if any(i.module is norm for i in g.flat_param._param_infos)]
    assert len(norm_groups) == 1 and norm_groups[0].compute_dtype == torch.float32
    assert norm_groups[0].full_precision == (how == "manual")  # under a policy: a handle without mixed precision
    assert (fully_shard.state(norm) is not None) == (how == "policy")
    if how == "policy":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

        torch_model = FSDP(_model(), auto_wrap_policy=TorchModuleWrapPolicy({NormBlock}), use_orig_params=True,
                           device_id=torch.device("cpu"), mixed_precision=TorchMixedPrecision(param_dtype=BF16))
        torch_losses = _train(torch_model, STEPS)
        assert max(abs(a - b) for a, b in zip_same(losses, torch_losses)) <= 1e-6, (losses, torch_losses)
        with FSDP.summon_full_params(torch_model):
            expected = {k.replace("_fsdp_wrapped_module.", ""): v.detach().clone()
                        for k, v in torch_model.state_dict().items()}
        actual = _full_state(model)
        assert actual.keys() == expected.keys()
        for k in actual:
            torch.testing.assert_close(actual[k], expected[k], atol=1e-6, rtol=0, msg=k)
    else:  # the same numbers as the policy's separate handle: same casts, fp32 reduction
        reference = _shard(_model(), "policy", mp)
        assert losses == _train(reference, STEPS)
        # bitwise: BatchNorm's gradients reduced in bf16 would move its fp32 parameters by other amounts,
        # which bf16 losses can hide
        actual, expected = _full_state(model), _full_state(reference)
        assert actual.keys() == expected.keys()
        for k in actual:
            assert torch.equal(actual[k], expected[k]), k


# ---------------------------------------------------------------------------- buffer_dtype
def _buffer_dtype() -> None:
    """``buffer_dtype`` casts the blocks' own float buffers (not BatchNorm's running stats) and
    training equals a local model whose buffers were cast the same way; ``state_dict()`` gives
    every buffer in its original dtype and a plain model's state dict loads strictly."""
    world_size = dist.get_world_size()
    model = _shard(_model(), "manual", MixedPrecision(buffer_dtype=BF16))
    assert model[0].gain.dtype == BF16 and model[1].gain.dtype == BF16
    assert model[0].order.dtype == torch.int64 and model[1].order.dtype == torch.int64  # integers are not cast
    assert model[0].norm.running_mean.dtype == torch.float32 and model[0].norm.running_var.dtype == torch.float32
    local = _model()
    for block in list(local)[:2]:
        block.gain = block.gain.to(BF16)
    optim = torch.optim.SGD(local.parameters(), lr=0.1)
    expected = []
    for step in range(STEPS):
        x, y = _batch(step, 4 * world_size)
        per_rank = [(local(x[r * 4:(r + 1) * 4]) - y[r * 4:(r + 1) * 4]).pow(2).mean() for r in range(world_size)]
        (sum(per_rank) / world_size).backward()
        optim.step()
        optim.zero_grad()
        expected.append(sum(v.item() for v in per_rank) / world_size)
    losses = _train(model, STEPS)
    assert max(abs(a - b) for a, b in zip_same(losses, expected)) <= 1e-5, (losses, expected)
    state = _full_state(model)
    assert state["0.gain"].dtype == torch.float32 and state["0.norm.running_mean"].dtype == torch.float32
    local_state = local.state_dict()
    for k, v in state.items():
        if ".norm.running_" in k or k.endswith("num_batches_tracked"):
            continue  # per-rank statistics of each rank's rows (not synchronized, as with torch FSDP)
        torch.testing.assert_close(v, local_state[k].to(v.dtype), atol=1e-5, rtol=0, msg=k)
    fresh = _model().state_dict()
    model.load_state_dict(fresh)  # strict: original-dtype buffers load into the cast ones
    assert model[0].gain.dtype == BF16 and torch.equal(model[0].gain, fresh["0.gain"].to(BF16))
    # set_model_state_dict, which also checks floating dtypes: the model's own (full and sharded) state
    # dicts and a plain model's load (buffers in their original dtype); a buffer in another dtype is refused
    for full in (True, False):
        set_model_state_dict(model, get_model_state_dict(model, full=full))
    set_model_state_dict(model, fresh)
    assert model[0].gain.dtype == BF16 and torch.equal(model[0].gain, fresh["0.gain"].to(BF16))
    with pytest.raises(RuntimeError, match="0.gain"):
        set_model_state_dict(model, dict(fresh, **{"0.gain": fresh["0.gain"].double()}))
    _ignored_module_is_left_alone()


def _ignored_module_is_left_alone() -> None:
    """A module in ``ignored_modules`` is the user's, as with torch FSDP: ``buffer_dtype`` does not
    cast its buffers, and replacing one of its parameters between steps is not refused as a change
    to the sharded model (the fully sharded blocks beside it are still watched)."""
    model = _model()
    fully_shard(model[0], mixed_precision=MixedPrecision(buffer_dtype=BF16))
    fully_shard(model, ignored_modules=[model[1]], mixed_precision=MixedPrecision(buffer_dtype=BF16))
    assert model[0].gain.dtype == BF16, model[0].gain.dtype
    assert model[1].gain.dtype == torch.float32 and model[1].fc1.weight.dtype == torch.float32, model[1].gain.dtype
    x, y = _batch(0, 4)
    (model(x).float() - y).pow(2).mean().backward()
    with torch.no_grad():
        model[1].fc1.weight = nn.Parameter(model[1].fc1.weight.detach() * 0.5)  # the user's own module
    (model(x).float() - y).pow(2).mean().backward()  # not refused
    assert model[1].fc1.weight.grad is not None and model[1].fc1.weight.grad.shape == (16, 8)
    with torch.no_grad():
        model[0].fc1.weight = nn.Parameter(torch.zeros(16, 8))  # a sharded block's: refused
    with pytest.raises(RuntimeError, match="fc1.weight"):
        model(x)


# ---------------------------------------------------------------------------- keep_low_precision_grads
def _low_precision_grads() -> None:
    """``keep_low_precision_grads=True``: after backward each parameter's ``.grad`` is in
    ``param_dtype`` (BatchNorm's in fp32), exactly the full-precision run's gradient before its
    cast to fp32, and close to a local model computing in bf16 on the global batch."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    x, y = _batch(0, 4 * world_size)
    rows = slice(rank * 4, (rank + 1) * 4)
    grads: Dict[bool, List[Tuple[str, torch.Tensor]]] = {}
    for keep in (True, False):
        model = _shard(_model(), "manual", MixedPrecision(param_dtype=BF16, keep_low_precision_grads=keep))
        (model(x[rows]).float() - y[rows]).pow(2).mean().backward()
        grads[keep] = [(n, p.grad) for n, p in model.named_parameters()]
        if keep:
            for name, g in grads[keep]:
                want = torch.float32 if ".norm." in name else BF16
                assert g.dtype == want, (name, g.dtype)
            with unshard_params(model, with_grads=True):
                full = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    for (name, low), (_, high) in zip_same(grads[True], grads[False], what="parameters"):
        assert high.dtype == torch.float32
        assert torch.equal(low.float(), high), name
    local = _model()
    for name, m in local.named_modules():
        if isinstance(m, nn.Linear):
            m.to(BF16)
    h = [local[i].norm.register_forward_pre_hook(lambda m, a: (a[0].float(),)) for i in range(2)]
    h += [local[i].norm.register_forward_hook(lambda m, a, o: o.to(BF16)) for i in range(2)]
    losses = [(local(x[r * 4:(r + 1) * 4].to(BF16)).float() - y[r * 4:(r + 1) * 4]).pow(2).mean() for r in range(world_size)]
    (sum(losses) / world_size).backward()
    for hook in h:
        hook.remove()
    # Within RTOL of each gradient's largest element (bf16 computed and reduced on other row
    # splits): a gradient off by 1.5x misses by 0.5 / RTOL times the tolerance.
    assert sorted(full) == sorted(n for n, _ in local.named_parameters())
    assert_grads_relative([(n, full[n]) for n, _ in local.named_parameters()],
                          [(n, p.grad.float()) for n, p in local.named_parameters()], rtol=RTOL, what="[bf16 vs local bf16]")


def _grid(world_size: int) -> None:
    run_subtests(_batchnorm_full_precision, {"how": ["policy", "manual"]})
    _buffer_dtype()
    _low_precision_grads()


@pytest.mark.parametrize("world_size", [2, 4])
def test_mixed_precision_options(world_size: int) -> None:
    run_distributed(_grid, world_size, world_size, timeout=240)
