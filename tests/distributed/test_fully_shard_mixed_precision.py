"""Mixed precision fits the flat-parameter runtime: the shard is cast to ``param_dtype``
before the all-gather (half the bytes), the module computes in low precision, gradients are
reduced in ``reduce_dtype`` (``param_dtype`` when unset) and land in full-precision shards.

Without it, a low-precision all-gather could silently widen back to fp32 (no saving), or
gradients could be reduced at the wrong precision or left in bf16 for the optimizer.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

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
