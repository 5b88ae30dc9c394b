"""Mixed precision fits the flat-parameter runtime: the shard is cast to ``param_dtype``
before the all-gather (half the bytes), the module computes in low precision, gradients are
reduced in ``reduce_dtype`` (``param_dtype`` when unset) and land in full-precision shards.

Without it, a low-precision all-gather could silently widen back to fp32 (no saving), or
gradients could be reduced at the wrong precision or left in bf16 for the optimizer.
"""

from __future__ import annotations

import collections
import copy
from typing import Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import MixedPrecision, ModuleWrapPolicy, fully_shard, unshard_params
from composable_shard._runtime.collectives import record_collectives
from tests._harness import run_distributed, run_subtests, world_sizes
from tests._models import (Block, Named, Scale, assert_grads_relative, assert_params_close, batch, full_grads, global_mean,
                           local_rows, loss_fn, make_model, reference_training, zip_same)

STEPS = 3


# Flat parameters per handle under ModuleWrapPolicy({Block, Scale}), counted by hand from
# tests/_models.py: (numel, trainable). Root: tied emb/head 13 x 6, frozen Linear(6, 6).
_HAND_GROUPS = {"": [(78, True), (42, False)], "blocks.0": [(109, True)], "blocks.1": [(109, True)], "scale": [(1, True)]}


def _torch_full_grads(torch_model: nn.Module) -> Named:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(torch_model, with_grads=True, writeback=False):
        return [(n.replace("_fsdp_wrapped_module.", ""), p.grad.detach().clone())  # torch shows zeros for frozen ones
                for n, p in torch_model.named_parameters() if p.grad is not None and p.requires_grad]


def _mixed_precision(reduce_dtype: Optional[torch.dtype]) -> None:
    """Our bf16 training next to torch FSDP1 with the same MixedPrecision (the same casts and
    reductions), step by step: losses equal, the gradients of every backward within 1% of the
    largest element of each (a gradient off by 1.5x misses by 50x), parameters equal at the
    end; every all-gather and reduce-scatter of each step counted with its bytes against
    figures worked out by hand. Local fp32 training is only a sanity bound for bf16 compute."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

    rank, world_size = dist.get_rank(), dist.get_world_size()
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    fp32_losses = reference_training(make_model(), STEPS, world_size)
    model = make_model()
    fully_shard(model, policy=ModuleWrapPolicy({Block, Scale}), mixed_precision=mp)
    torch_model = FSDP(make_model(), auto_wrap_policy=TorchModuleWrapPolicy({Block, Scale}), use_orig_params=True,
                       device_id=torch.device("cpu"),
                       mixed_precision=TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype))
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, torch_model)]
    reduce_bytes = 4 if reduce_dtype == torch.float32 else 2
    # Per step: each flat parameter gathered in bf16 (2 bytes per element of the shard), once
    # for the root (kept from its forward to its backward), twice for the others; one
    # reduce-scatter of the padded gradient in reduce_dtype per trainable flat parameter.
    expected_collectives: collections.Counter = collections.Counter()
    for fqn, groups in _HAND_GROUPS.items():
        for numel, trainable in groups:
            chunk = -(-numel // world_size)
            expected_collectives[("all_gather", fqn, 2 * chunk)] += 1 if fqn == "" else 2
            if trainable:
                expected_collectives[("reduce_scatter", fqn, reduce_bytes * chunk * world_size)] += 1
    for step in range(STEPS):
        inputs, targets = batch(step, world_size)
        with record_collectives() as rec:
            loss = loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank))
            loss.backward()
        torch_loss = loss_fn(torch_model(local_rows(inputs, rank)), local_rows(targets, rank))
        torch_loss.backward()
        what = f"[reduce_dtype={reduce_dtype} step {step}]"
        seen = collections.Counter((r.kind, r.tag, r.nbytes) for r in rec.records
                                   if r.kind in ("all_gather", "reduce_scatter"))
        assert seen == expected_collectives, (what, seen, expected_collectives)
        assert global_mean(loss) == global_mean(torch_loss), what  # same casts, same reductions: identical
        assert abs(global_mean(loss) - fp32_losses[step]) < 5e-2, (what, fp32_losses)  # sanity: bf16 compute
        assert_grads_relative(full_grads(model), _torch_full_grads(torch_model), rtol=0.01, what=what)
        grads = [p.grad for p in model.parameters() if p.requires_grad]  # fp32 gradient shards for the optimizer
        assert grads and all(g is not None and g.dtype == torch.float32 for g in grads), what
        for optim in optims:
            optim.step()
            optim.zero_grad()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with FSDP.summon_full_params(torch_model):
        expected = [(n.replace("_fsdp_wrapped_module.", ""), p.detach().clone()) for n, p in torch_model.named_parameters()]
    with unshard_params(model):
        actual = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    assert_params_close(actual, expected, atol=1e-6, what="[vs torch FSDP1, trained]")


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
    with unshard_params(model, with_grads=True):
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
    expected = {"c1.weight": reference.c1.weight.grad, "c1.bias": reference.c1.bias.grad,
                "c2.weight": ref_c2.weight.grad.float(), "c2.bias": ref_c2.bias.grad.float()}
    assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
    for name, grad in expected.items():
        assert got[name].dtype == torch.float32
    # fp32 exactly; float16 (computed and reduced in float16 on other row splits) within 1% of
    # the largest element, which a gradient off by 1.5x misses by 50x.
    assert_params_close([(n, got[n]) for n in ("c1.weight", "c1.bias")],
                        [(n, expected[n]) for n in ("c1.weight", "c1.bias")], what="[fp32 c1]")
    assert_grads_relative([(n, got[n]) for n in ("c2.weight", "c2.bias")],
                          [(n, expected[n]) for n in ("c2.weight", "c2.bias")], rtol=0.01, what="[float16 c2]")


@pytest.mark.parametrize("world_size", [2, 4])
def test_cast_root_forward_inputs_applies_to_every_fully_shard_unit(world_size: int) -> None:
    """A float16 submodule under a float32 root: all four combinations of cast_root_forward_inputs
    and cast_forward_inputs behave as torch's composable fully_shard (cast at the unit's own
    root, or per handle; neither: torch's dtype error), with gradients equal to local training
    doing the same casts."""
    run_distributed(run_subtests, world_size, _float16_submodule, {"cast_root": [True, False], "cast_each": [True, False]},
                    timeout=90)


class _Batch(collections.OrderedDict):
    """A Hugging Face ``BatchEncoding``/``ModelOutput``-like input: an OrderedDict subclass."""


class _TakesContainers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, batch: _Batch, extra: Dict[str, List[torch.Tensor]]) -> torch.Tensor:
        assert batch["x"].dtype == extra["ys"][0].dtype == torch.bfloat16, (batch["x"].dtype, extra["ys"][0].dtype)
        return self.lin(batch["x"] + extra["ys"][0]).float()


def _inputs_cast_into_copies() -> None:
    """The cast of forward inputs makes new containers: the caller's own ``OrderedDict`` subclass, dict
    and list still hold its float32 tensors after the forward (a cast written into them would change
    what the caller computes with next, e.g. a loss on the same batch object, silently)."""
    model = _TakesContainers()
    fully_shard(model, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=True))
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    batch, ys = _Batch(x=x), [y]
    extra = {"ys": ys}
    model(batch, extra).sum().backward()
    assert type(batch) is _Batch and batch["x"] is x and extra["ys"] is ys and ys[0] is y, (batch, extra)
    assert x.dtype == y.dtype == torch.float32


def test_cast_inputs_leave_the_callers_containers_alone() -> None:
    run_distributed(_inputs_cast_into_copies, 2, timeout=60)


# ---------------------------------------------------------------------------- unsynced accumulation
MICRO_BATCHES = 8


def _micro_batch(m: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * m + rank))


def _bf16_grads_per_rank(model: nn.Module, world_size: int) -> Dict[int, List[List[torch.Tensor]]]:
    """For each rank and micro-batch, the bf16 gradients of a bf16 copy of ``model``."""
    low = copy.deepcopy(model).to(torch.bfloat16)
    grads: Dict[int, List[List[torch.Tensor]]] = {}
    for rank in range(world_size):
        grads[rank] = []
        for m in range(MICRO_BATCHES):
            low.zero_grad(set_to_none=True)
            low(_micro_batch(m, rank).to(torch.bfloat16)).float().pow(2).mean().backward()
            grads[rank].append([p.grad.clone() for p in low.parameters()])
    return grads


def _sum_then_average(grads: Dict[int, List[List[torch.Tensor]]], dtype: torch.dtype) -> List[torch.Tensor]:
    """Each rank's micro-batch gradients summed in ``dtype`` (in order), then the fp32 average
    over ranks: what a reduction in fp32 after accumulation in ``dtype`` gives."""
    sums = []
    for per_micro in grads.values():
        acc = [g.to(dtype) for g in per_micro[0]]
        for later in per_micro[1:]:
            for a, g in zip_same(acc, later):
                a.add_(g.to(dtype))
        sums.append([a.float() for a in acc])
    return [sum(parts) / len(sums) for parts in zip(*sums)]  # type: ignore[misc]  # tensors


def _unsynced_accumulation_in_reduce_dtype() -> None:
    """MixedPrecision(param_dtype=bf16, reduce_dtype=fp32): backwards without gradient sync
    accumulate each rank's bf16 gradients in fp32 (as torch FSDP2 does), so 8 micro-batches
    then a synced one give exactly the fp32 sum of the bf16 gradients, averaged; summing in
    bf16 instead is off by far more than the tolerance (checked here, so the test can fail)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    grads = _bf16_grads_per_rank(model, world_size)
    expected = _sum_then_average(grads, torch.float32)
    summed_in_bf16 = _sum_then_average(grads, torch.bfloat16)
    fully_shard(model[0], mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    fully_shard(model, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    for m in range(MICRO_BATCHES):
        model.set_requires_gradient_sync(m == MICRO_BATCHES - 1)
        if m == 1:
            views = [p.grad for p in model.parameters()]
            assert all(v is not None and v.dtype == torch.float32 for v in views), [getattr(v, "dtype", None) for v in views]
        model(_micro_batch(m, rank)).float().pow(2).mean().backward()
    got = [g for _, g in full_grads(model)]
    for (name, _), g, e, low in zip_same(list(model.named_parameters()), got, expected, summed_in_bf16):
        scale = e.abs().max().item()
        err = (g - e).abs().max().item()
        assert err <= 1e-6 * scale, f"rank {rank} {name}: max |diff| {err:.3g} against fp32 accumulation (scale {scale:.3g})"
        if world_size == 1 or name.endswith("weight"):
            assert (low - e).abs().max().item() > 100 * 1e-6 * scale, f"{name}: bf16 accumulation indistinguishable"


@pytest.mark.parametrize("world_size", world_sizes())
def test_unsynced_backwards_accumulate_in_reduce_dtype(world_size: int) -> None:
    """bf16 compute with an fp32 reduce_dtype: gradients of backwards without sync are summed
    in fp32, then reduced once; equal to the fp32 sum of a bf16 model's gradients."""
    run_distributed(_unsynced_accumulation_in_reduce_dtype, world_size, timeout=120)


class _Weights(nn.Module):
    """``(x * w).sum()`` over 8 weights: ``w[i]``'s gradient is the column sum of ``x``, so a
    large column overflows exactly one float16 gradient element."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.2, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w).sum()


def _float16_loss_scaling() -> None:
    """float16 compute with loss scaling: an overflow in one gradient element lands in one
    rank's slice only, so the skip-or-step decision must be taken by every rank together.
    torch's ShardedGradScaler (which all-reduces the overflow flag) does that on our gradients:
    every rank skips the overflowing step with the same new scale, and the next step equals
    SGD on the local fp32 model's gradient (float16 tolerance). torch.amp.GradScaler lets the
    ranks without the overflow step alone (see docs/api.md, MixedPrecision): the second synced
    backward after it raises on every rank."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # torch's, a documented recipe

    world_size = dist.get_world_size()
    model, reference = fully_shard(_Weights(), mixed_precision=MixedPrecision(param_dtype=torch.float16)), _Weights()
    owners = [0] * world_size
    dist.all_gather_object(owners, model.w.numel())
    assert world_size == 1 or owners[-1] < 8, owners  # w[7] lies in a slice other ranks do not hold
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=1024.0)
    start = reference.w.detach().clone()
    overflow = torch.ones(2, 8)
    overflow[:, 7] = 100.0  # 2 rows x 100 x 1024 > float16's 65504: w[7]'s scaled gradient is inf
    scaler.scale(model(overflow).float()).backward()
    scaler.step(optim)
    scaler.update()
    scales = [0.0] * world_size
    dist.all_gather_object(scales, scaler.get_scale())
    assert scales == [512.0] * world_size, scales  # every rank saw the overflow
    optim.zero_grad()
    with unshard_params(model):
        assert torch.equal(model.w.detach(), start), "a rank stepped on the overflowing gradient"

    x = torch.full((2 * world_size, 8), 0.25) + torch.arange(8.0) / 16
    mine = x.view(world_size, 2, 8)[dist.get_rank()]
    scaler.scale(model(mine).float() * world_size).backward()  # per rank: its rows; the mean over ranks is x's sum
    scaler.step(optim)
    scaler.update()
    reference(x).backward()
    with torch.no_grad():
        expected = start - 0.1 * reference.w.grad  # type: ignore[operator]  # set by backward
    with unshard_params(model):
        torch.testing.assert_close(model.w.detach(), expected, atol=2e-3, rtol=0)
        assert not torch.equal(model.w.detach(), start), "the step without overflow must update"

    # torch.amp.GradScaler on the same overflow: the ranks whose slices stayed finite step alone.
    # That used to go on silently; the second synced backward after it now raises on every rank,
    # naming the cure (the first carries the step counts; [Note: Step agreement] in _runtime/watch.py).
    model = fully_shard(_Weights(), mixed_precision=MixedPrecision(param_dtype=torch.float16))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    plain = torch.amp.GradScaler("cpu", init_scale=1024.0)
    plain.scale(model(overflow).float()).backward()
    plain.step(optim)
    plain.update()
    optim.zero_grad()
    plain.scale(model(mine).float()).backward()
    optim.zero_grad()
    try:
        plain.scale(model(mine).float()).backward()
    except RuntimeError as e:
        assert world_size > 1 and "ShardedGradScaler" in str(e) and "stepped 0 time(s)" in str(e) \
            if dist.get_rank() == world_size - 1 else "stepped 1 time(s)" in str(e), e
    else:
        assert world_size == 1, "a step skipped on one rank only went unreported"


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_float16_loss_scaling_skips_on_every_rank_together(world_size: int) -> None:
    """See ``_float16_loss_scaling``."""
    run_distributed(_float16_loss_scaling, world_size, timeout=120)
