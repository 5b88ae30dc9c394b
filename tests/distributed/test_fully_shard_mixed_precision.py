"""Mixed precision fits the flat-parameter runtime: the shard is cast to ``param_dtype``
before the all-gather (half the bytes), the module computes in low precision, gradients are
reduced in ``reduce_dtype`` (``param_dtype`` when unset) and land in full-precision shards.

Without it, a low-precision all-gather could silently widen back to fp32 (no saving), or
gradients could be reduced at the wrong precision or left in bf16 for the optimizer.
"""

from __future__ import annotations

from typing import Dict, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import MixedPrecision, ModuleWrapPolicy, fully_shard
from composable_shard._collectives import record_collectives
from composable_shard._traversal_utils import _get_fsdp_handles
from tests._harness import run_distributed, run_subtests
from tests._models import Block, Scale, distributed_training, make_model, reference_training

STEPS = 3


def _mixed_precision(reduce_dtype: Optional[torch.dtype]) -> None:
    world_size = dist.get_world_size()
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    expected = reference_training(make_model(), STEPS, world_size)
    model = make_model()
    fully_shard(model, policy=ModuleWrapPolicy({Block, Scale}), mixed_precision=mp)
    with record_collectives() as rec:
        losses = distributed_training(model, STEPS)
    for a, e in zip(losses, expected):
        assert abs(a - e) < 5e-2, (losses, expected)  # bf16 compute tracks fp32 training
    handles = _get_fsdp_handles(model)
    shard_numels = {h.fqn: [fp.numel() for fp in h.flat_params] for h in handles}
    for r in rec.records:
        if r.kind == "all_gather":
            assert r.nbytes in [2 * n for n in shard_numels[r.tag]], (r, shard_numels)
        elif r.kind == "reduce_scatter":
            element = 4 if reduce_dtype == torch.float32 else 2
            numels = [fp._padded_unsharded_size.numel() for h in handles if h.fqn == r.tag for fp in h.flat_params]
            assert r.nbytes in [element * n for n in numels], (r, numels)
    for p in model.parameters():
        assert p.dtype == torch.float32
    for h in handles:
        for g in h.groups:
            if g.requires_grad and g.sharded_grad is not None:
                assert g.sharded_grad.dtype == torch.float32

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

    torch_model = FSDP(make_model(), auto_wrap_policy=TorchModuleWrapPolicy({Block, Scale}), use_orig_params=True,
                       device_id=torch.device("cpu"),
                       mixed_precision=TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype))
    torch_losses = distributed_training(torch_model, STEPS)
    assert losses == torch_losses, (losses, torch_losses)  # same casts, same reductions: identical


def _grid() -> None:
    run_subtests(_mixed_precision, {"reduce_dtype": [None, torch.float32]})


def test_bf16_param_dtype() -> None:
    """bf16 all-gathers (2 bytes/element), reduce-scatters in reduce_dtype (bf16 when unset,
    fp32 when set), fp32 shards and gradients; losses track fp32 training and torch FSDP1
    with the same MixedPrecision."""
    run_distributed(_grid, 2, timeout=120)


# ---------------------------------------------------------------------------- per-unit input casting
class _SaveInputs(nn.Module):
    """Linear layers that record the dtype of what they received."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Linear(8, 8)
        self.c2 = nn.Linear(8, 8)
        self.seen: Dict[str, torch.dtype] = {}
        for name in ("c1", "c2"):
            getattr(self, name).register_forward_pre_hook(  # appended: runs after fully_shard's cast
                lambda m, args, name=name: self.seen.__setitem__(name, args[0].dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(self.c1(x)).float()


def _float16_submodule(cast_root: bool, cast_each: bool) -> None:
    """c2 in float16 under a float32 root without mixed precision, as torch's composable
    fully_shard allows: c2's inputs are cast at c2 (its own fully_shard unit) by
    cast_root_forward_inputs, or by cast_forward_inputs; with neither, torch's dtype error."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _SaveInputs()
    torch.manual_seed(0)
    model = _SaveInputs()
    mp = MixedPrecision(param_dtype=torch.float16, cast_root_forward_inputs=cast_root, cast_forward_inputs=cast_each)
    fully_shard(model.c2, mixed_precision=mp)
    fully_shard(model)
    x = torch.randn(world_size * 2, 8, generator=torch.Generator().manual_seed(1))
    if not (cast_root or cast_each):
        try:
            model(x[rank * 2:(rank + 1) * 2])
        except RuntimeError as e:
            assert "dtype" in str(e), e
            return
        raise AssertionError("float32 inputs into float16 weights must raise torch's dtype error")
    model(x[rank * 2:(rank + 1) * 2]).pow(2).sum().backward()
    assert model.seen == {"c1": torch.float32, "c2": torch.float16}, model.seen
    # The same casts locally: c2 computes in float16 on float16 copies of its weights, and its
    # gradients are reduced in float16 (param_dtype), averaged over the ranks.
    ref_c2 = nn.Linear(8, 8).half()
    with torch.no_grad():
        ref_c2.weight.copy_(reference.c2.weight)
        ref_c2.bias.copy_(reference.c2.bias)
    total = torch.zeros(())
    for r in range(world_size):
        rows = x[r * 2:(r + 1) * 2]
        total = total + ref_c2(reference.c1(rows).half()).float().pow(2).sum() / world_size
    total.backward()
    from composable_shard import unshard_params

    with unshard_params(model, with_grads=True):
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
    expected = {"c1.weight": reference.c1.weight.grad, "c1.bias": reference.c1.bias.grad,
                "c2.weight": ref_c2.weight.grad.float(), "c2.bias": ref_c2.bias.grad.float()}
    assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
    for name, grad in expected.items():
        tol = 1e-5 if name.startswith("c1") else 2e-3  # float16 reductions
        diff = (got[name] - grad).abs().max().item()
        assert diff <= tol * max(1.0, grad.abs().max().item()), (name, diff)
        assert got[name].dtype == torch.float32


@pytest.mark.parametrize("world_size", [2, 4])
def test_cast_root_forward_inputs_applies_to_every_fully_shard_unit(world_size: int) -> None:
    """A float16 submodule under a float32 root: all four combinations of cast_root_forward_inputs
    and cast_forward_inputs behave as torch's composable fully_shard (cast at the unit's own
    root, or per handle; neither: torch's dtype error), with gradients equal to local training
    doing the same casts."""
    run_distributed(run_subtests, world_size, _float16_submodule, {"cast_root": [True, False], "cast_each": [True, False]},
                    timeout=90)
