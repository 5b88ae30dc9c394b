"""Whatever a training script does between steps, fully_shard gives the numbers local training
gives (API.md, "Lifecycle and safety"): a backward that raised, an eval forward followed by an
optimizer step, freezing and unfreezing, parameters without a gradient, outputs of any
structure, unshard_params in every idle state, and parameters swapped after sharding.

Each test compares with a single-process model doing the same steps on the global batch
(gradients, not only losses: Adam hides a wrong gradient scale), and each pattern gave silently
wrong numbers, a broken model or a refusal before the runtime handled it.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import MixedPrecision, ShardingStrategy, fully_shard, get_model_state_dict, unshard_params
from composable_shard._runtime.traversal import _get_fsdp_handles
from tests._harness import assert_close_ranks, run_distributed, run_subtests
from tests._models import (arm_backward_failure, assert_params_close, batch, expect_backward_failure, local_rows,
                           loss_fn, make_model, zip_same)

_STRATEGIES = [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD,
               ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2]


def _strategy_kwargs(strategy: ShardingStrategy) -> Dict[str, Any]:
    if strategy not in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        return {"strategy": strategy}
    from torch.distributed.device_mesh import init_device_mesh

    world_size = dist.get_world_size()
    shard = 2 if world_size % 2 == 0 and world_size > 2 else world_size
    return {"strategy": strategy, "mesh": init_device_mesh("cpu", (world_size // shard, shard))}


def _shard(model: nn.Module, **kwargs: Any) -> nn.Module:
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, **kwargs)
    fully_shard(model.scale, **kwargs)  # type: ignore[arg-type]
    fully_shard(model, **kwargs)
    return model


def _full_grads(model: nn.Module) -> List[Tuple[str, Optional[torch.Tensor]]]:
    with unshard_params(model, with_grads=True):
        return [(n, None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()]


def _full_params(model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    with unshard_params(model):
        return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def _assert_grads_equal(model: nn.Module, reference: nn.Module, what: str, atol: float = 1e-5) -> None:
    """Same gradients as the reference, and None exactly where the reference has None; the
    same on every rank."""
    actual = _full_grads(model)
    expected = [(n, None if p.grad is None else p.grad.detach()) for n, p in reference.named_parameters()]
    assert len(actual) == len(expected), (what, len(actual), len(expected))
    for (name, a), (name_e, e) in zip(actual, expected):
        assert name == name_e, (what, name, name_e)
        assert (a is None) == (e is None), f"{what} {name}: .grad {'None' if a is None else 'set'} here, " \
                                           f"{'None' if e is None else 'set'} in local training"
        if a is not None and e is not None:
            diff = (a - e).abs().max().item() if a.numel() else 0.0
            assert diff <= atol, f"{what} {name}: max abs grad diff {diff}"
            assert_close_ranks(a, f"{what} {name} grad")


def _local_step(model: nn.Module, step: int) -> torch.Tensor:
    """Forward + backward on this rank's rows of ``step``'s batch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    inputs, targets = batch(step, world_size)
    loss = loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank))
    loss.backward()
    return loss


def _global_step(model: nn.Module, step: int) -> torch.Tensor:
    inputs, targets = batch(step, dist.get_world_size())
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    return loss


# ---------------------------------------------------------------------------- failed backward
def _failed_backward(strategy: ShardingStrategy, after_unsynced: bool = False) -> None:
    """``after_unsynced``: an unsynced micro-batch (kept, unreduced sums on every handle) comes
    before the backward that raises; zero_grad then drops those sums too, as locally."""
    reference = make_model()
    model = _shard(make_model(), **_strategy_kwargs(strategy))
    armed = arm_backward_failure(model.blocks[0])
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.5)
    if after_unsynced:
        armed[0] = False
        model.set_requires_gradient_sync(False)  # type: ignore[operator]  # FSDPModule's
        _local_step(model, 2)
        model.set_requires_gradient_sync(True)  # type: ignore[operator]  # FSDPModule's
        armed[0] = True
    expect_backward_failure(lambda: _local_step(model, 0))  # after scale's and blocks.1's reductions
    armed[0] = False
    optim.zero_grad()
    for m in (model, reference):  # the clean step leaves blocks.1's norm out: its parameters, which the failed
        m.blocks[1].ln.forward = lambda x: x  # backward reached, get no gradient now (None, as locally; not zeros)
    _local_step(model, 1)  # while the rest of their flat group gets one
    _global_step(reference, 1)
    for m in (model, reference):
        del m.blocks[1].ln.forward
    _assert_grads_equal(model, reference, f"[{strategy.name}] after a failed backward")
    optim.step()
    ref_optim.step()
    assert_params_close(_full_params(model), list(reference.named_parameters()), what=f"[{strategy.name}] params")


def test_failed_backward_leaks_nothing_into_the_next_step() -> None:
    """A backward raising after some handles' gradients were reduce-scattered (on every rank),
    then zero_grad and a clean step: exactly the clean step's gradients and SGD update. Every
    strategy at 2 ranks; the hybrid ones on a 2 x 2 mesh in test_hybrid_sharding_at_four_ranks."""
    run_distributed(_all_world_sizes_entry, 2, "failed_backward", timeout=180)


# ---------------------------------------------------------------------------- stale parameters
def _eval_forward_then_step(strategy: ShardingStrategy, edit: str, mp: bool) -> None:
    """Each step: train forward/backward, an eval forward with grad on (loss discarded), then
    the update (optimizer step, or an in-place edit of the parameters); the next forward must
    compute on the updated values. Two steps: the second step's forward and the final one each
    read shards updated after an eval forward, with forward prefetch on (it starts at the
    second forward), so a third step repeats what they show."""
    kwargs = _strategy_kwargs(strategy)
    if mp:
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16)
    model = _shard(make_model(), **kwargs)
    twin = _shard(make_model(), **kwargs)  # the same, without the eval forwards
    reference = make_model()
    models = [(model, True), (twin, False)] + ([] if mp else [(reference, None)])
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=(edit == "fused")) for m, _ in models]
    rank = dist.get_rank()
    losses: Dict[int, List[float]] = {0: [], 1: [], 2: []}
    for step in range(2):
        for i, ((m, eval_forward), optim) in enumerate(zip_same(models, optims)):
            loss = _global_step(m, step) if eval_forward is None else _local_step(m, step)
            if eval_forward:
                inputs, _ = batch(step, dist.get_world_size())
                m(local_rows(inputs, rank)).sum()  # grad on, no backward
            if edit == "in_place":
                with torch.no_grad():
                    for p in m.parameters():
                        if p.grad is not None:
                            p.sub_(0.1 * p.grad)
            else:
                optim.step()
            optim.zero_grad()
            losses[i].append(loss.item())
    out = {i: m(local_rows(batch(2, dist.get_world_size())[0], rank)) for i, (m, e) in enumerate(models) if e is not None}
    what = f"[{strategy.name}/{edit}/mp={mp}]"
    assert torch.equal(out[0], out[1]), f"{what} eval forwards changed what the next forward computes"
    assert_params_close(_full_params(model), _full_params(twin), atol=0.0, what=what)
    if not mp:
        expected = reference(batch(2, dist.get_world_size())[0])[rank * 2:(rank + 1) * 2]
        assert (out[0] - expected).abs().max().item() < 1e-5, what


_EDITS = ["foreach", "fused", "in_place"]


def _stale_cases() -> List[Tuple[ShardingStrategy, str, bool]]:
    """(strategy, edit, mp) for ``_eval_forward_then_step``. What goes stale is an unsharded
    buffer kept from the eval forward (SHARD_GRAD_OP, _HYBRID_SHARD_ZERO2, NO_SHARD's bf16
    copy); what must tell is a version counter (foreach, in place) or an optimizer step
    (fused: no version bump). SHARD_GRAD_OP and NO_SHARD take every edit in fp32 and bf16;
    FULL_SHARD and HYBRID_SHARD (at W=2 a 1 x 2 mesh: both reshard after forward) take every
    edit once each, in complementary precisions, and so does _HYBRID_SHARD_ZERO2 (SHARD_GRAD_OP's
    behaviour, with a replicate group)."""
    kept = [ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD]
    full = [(strategy, edit, mp) for strategy in kept for edit in _EDITS for mp in (False, True)]
    shifted = [(ShardingStrategy.FULL_SHARD, 0), (ShardingStrategy.HYBRID_SHARD, 1),
               (ShardingStrategy._HYBRID_SHARD_ZERO2, 0)]
    paired = [(strategy, edit, (k + shift) % 2 == 1) for strategy, shift in shifted for k, edit in enumerate(_EDITS)]
    return full + paired


def _stale_case(case: Tuple[ShardingStrategy, str, bool]) -> None:
    _eval_forward_then_step(*case)


def _uneven_in_place_edits() -> None:
    """SHARD_GRAD_OP keeps blocks.0's unsharded buffer from a grad-mode forward to the next, and
    in between its parameters are edited in place a different number of times each (the user's
    own updates, ``torch.no_grad()``): the next forward computes on the edited values, whatever
    the counts. The counts here are the ones a check over the set of distinct version counters
    (rather than all of them) would miss: every parameter first brought to the same version M,
    one edited once before the buffer is gathered (versions {M, M + 1}), then each brought to
    2M + 1 (versions {2M + 1}: distinct values summing as before)."""
    rank = dist.get_rank()
    model = _shard(make_model(), strategy=ShardingStrategy.SHARD_GRAD_OP)
    inputs = local_rows(batch(0, dist.get_world_size())[0], rank)
    model(inputs).sum().backward()
    params = list(model.blocks[0].parameters())
    with torch.no_grad():
        level = max(p._version for p in params)
        for p in params:
            while p._version < level:
                p.add_(0.0)  # a version, no value
        params[0].mul_(0.9)
    model(inputs).sum()  # grad on, no backward: gathered now and kept
    with torch.no_grad():
        for i, p in enumerate(params):
            for _ in range(level if i == 0 else level + 1):
                p.add_(0.01 * (i + 1))
        assert len({p._version for p in params}) == 1, [p._version for p in params]
        after_edits = model(inputs)
        from_scratch = model(inputs)  # the no-grad forward before freed every buffer: gathered anew
    assert torch.equal(after_edits, from_scratch), \
        f"a forward after uneven in-place edits computed on a stale buffer: {(after_edits - from_scratch).abs().max()}"


def _optimizer_grown_after_its_first_step() -> None:
    """A fused optimizer (no version bump) built on blocks.0 alone steps once, then is given the
    other parameters with ``add_param_group``: its next step must count for the other handles
    too, so the buffers SHARD_GRAD_OP kept from a grad-mode forward before it are gathered again
    (whether an optimizer holds a handle's parameters is worked out again when its groups grow)."""
    rank = dist.get_rank()
    model = _shard(make_model(), strategy=ShardingStrategy.SHARD_GRAD_OP)
    optim = torch.optim.AdamW(model.blocks[0].parameters(), lr=1e-2, fused=True)
    _local_step(model, 0)
    optim.step()
    optim.zero_grad()
    optim.add_param_group({"params": [p for n, p in model.named_parameters()
                                      if not n.startswith("blocks.0.") and p.requires_grad]})
    _local_step(model, 1)
    inputs = local_rows(batch(2, dist.get_world_size())[0], rank)
    model(inputs).sum()  # grad on, no backward: gathered now and kept
    optim.step()
    with torch.no_grad():
        after_step = model(inputs)
        from_scratch = model(inputs)  # the no-grad forward before freed every buffer: gathered anew
    assert torch.equal(after_step, from_scratch), \
        f"a forward after a grown optimizer's step computed on a stale buffer: {(after_step - from_scratch).abs().max()}"


def test_updates_are_visible_after_a_forward_without_backward() -> None:
    """Eval forward with grad on, then optimizer.step() (foreach, fused) or an in-place edit,
    under every strategy, fp32 and bf16 (``_stale_cases``): the next forward computes on the
    updated shards (SHARD_GRAD_OP used to keep the stale unsharded buffer; fused optimizers
    bump no version counter); also after in-place edits a different number of times per
    parameter (``_uneven_in_place_edits``), and after the step of an optimizer given the other
    handles' parameters after its first step (``_optimizer_grown_after_its_first_step``)."""
    run_distributed(_all_world_sizes_entry, 2, "stale", timeout=240)


# ---------------------------------------------------------------------------- freeze / unfreeze
def _freeze_unfreeze(strategy: ShardingStrategy) -> None:
    """Step 0 all trainable; steps 1-2 blocks.0 frozen and fc2.bias of blocks.1 frozen; step 3
    the weight of the originally frozen Linear unfrozen (a part of a group built frozen), step 4
    its bias too and everything back. AdamW with weight decay, so a frozen parameter that still
    got a gradient would move."""
    reference = make_model()
    model = _shard(make_model(), **_strategy_kwargs(strategy))
    pairs = [(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)),
             (reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1))]
    what = f"[{strategy.name}]"

    def set_trainable(m: nn.Module, step: int) -> None:
        m.blocks[0].requires_grad_(step not in (1, 2))
        m.blocks[1].fc2.bias.requires_grad_(step not in (1, 2))
        m.frozen.weight.requires_grad_(step >= 3)
        m.frozen.bias.requires_grad_(step >= 4)

    # what each Linear's forward sees: a frozen parameter's unsharded view (a 1-D bias's too) must not
    # require grad, or its module computes a gradient for it and code branching on requires_grad misreads it
    seen: Dict[int, Dict[str, bool]] = {id(model): {}, id(reference): {}}
    for m, _ in pairs:
        for name, sub in m.named_modules():
            if isinstance(sub, nn.Linear):
                sub.register_forward_hook(lambda mod, args, out, name=name, into=seen[id(m)]: into.update(
                    {f"{name}.{p}": t.requires_grad for p, t in mod.named_parameters(recurse=False)}))

    for step in range(5):
        for m, _ in pairs:
            set_trainable(m, step)
        frozen_before = model.blocks[0].fc1.weight.detach().clone()
        _local_step(model, step)
        _global_step(reference, step)
        _assert_grads_equal(model, reference, f"{what} step {step}")
        assert seen[id(model)] == seen[id(reference)] and seen[id(model)], \
            f"{what} step {step}: requires_grad seen in forward {seen[id(model)]} != local {seen[id(reference)]}"
        if step in (1, 2):
            assert model.blocks[0].fc1.weight.grad is None and model.blocks[1].fc2.bias.grad is None
        for m, optim in pairs:
            optim.step()
            optim.zero_grad()
        if step in (1, 2):
            assert torch.equal(model.blocks[0].fc1.weight, frozen_before), f"{what} frozen parameter updated"
    assert_params_close(_full_params(model), list(reference.named_parameters()), what=what)


def _frozen_module_first(strategy: ShardingStrategy) -> None:
    """A frozen fully sharded module first in the model (its input needs no gradient either) returns
    a tensor that needs none: its forward neither hooks that output for a backward (torch refuses a
    hook on such a tensor) nor keeps its parameters gathered for one; the head after it trains as in
    one process, and the frozen module keeps ``.grad`` None."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def build() -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        m[0].requires_grad_(False)
        return m

    reference, model = build(), build()
    kwargs = _strategy_kwargs(strategy)
    fully_shard(model[0], **kwargs)
    fully_shard(model[2], **kwargs)
    fully_shard(model, **kwargs)
    for step in range(2):
        torch.manual_seed(100 + step)
        inputs = torch.randn(4 * world, 6)
        reference.zero_grad()
        reference(inputs).pow(2).mean().backward()
        out = model(inputs.view(world, 4, 6)[rank])
        frozen_handles = _get_fsdp_handles(model[0])
        assert frozen_handles and all(h.unsharded_storage_freed() for h in frozen_handles), \
            f"[{strategy.name}] the frozen first module kept its parameters gathered after its forward"
        out.pow(2).mean().backward()
        _assert_grads_equal(model, reference, f"[{strategy.name}] frozen first module, step {step}")
        model.zero_grad()


def test_freeze_and_unfreeze_after_fully_shard() -> None:
    """requires_grad changed after fully_shard (a block, one parameter, a group built frozen)
    is honoured from the next forward: frozen parameters get .grad None and are not updated,
    unfrozen ones train; gradients equal local training at every step. Every strategy at 2
    ranks; the hybrid ones on a 2 x 2 mesh in test_hybrid_sharding_at_four_ranks. Also a frozen
    module first in the model, whose output needs no gradient (``_frozen_module_first``)."""
    run_distributed(_all_world_sizes_entry, 2, "freeze", timeout=240)


# ---------------------------------------------------------------------------- unused parameters
class _Gated(nn.Module):
    """A Linear that only some ranks' data uses (``use`` set per call), and one never used."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(6, 6)
        self.sometimes = nn.Linear(6, 6)
        self.never = nn.Linear(6, 6)
        self.use = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.main(x)
        return y + self.sometimes(x) if self.use else y


class _GatedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Gated()
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


def _unused_parameters(strategy: ShardingStrategy, sometimes_on: str) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _GatedModel()
    torch.manual_seed(0)
    model = _GatedModel()
    kwargs = _strategy_kwargs(strategy)
    fully_shard(model.inner, **kwargs)
    fully_shard(model, **kwargs)
    uses = {"all": [True] * world_size, "none": [False] * world_size, "rank0": [r == 0 for r in range(world_size)]}
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.5)
    # Steps 0 and 1 gated by ``sometimes_on``; step 2 uses ``sometimes`` on no rank: after zero_grad its
    # .grad is None again (the flags of what a backward used start empty every backward).
    for step, use in enumerate((uses[sometimes_on], uses[sometimes_on], uses["none"])):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(world_size * 2, 6, generator=g)
        model.inner.use = use[rank]
        model(x[rank * 2:(rank + 1) * 2]).pow(2).mean().backward()
        total = torch.zeros(())
        for r in range(world_size):  # the global batch, each rank's rows with that rank's gating
            reference.inner.use = use[r]
            total = total + reference(x[r * 2:(r + 1) * 2]).pow(2).mean() / world_size
        total.backward()
        what = f"[{strategy.name}/sometimes used on {sometimes_on}, step {step}]"
        _assert_grads_equal(model, reference, what)
        for p in model.inner.never.parameters():
            assert p.grad is None, f"{what} a never-used parameter got a .grad"
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    # Two synced backwards without zero_grad: gated as above in the first, used on no rank in the
    # second. A parameter that had a .grad keeps it (plus nothing), as autograd leaves it.
    for step, use in ((3, uses[sometimes_on]), (4, [False] * world_size)):
        x = torch.randn(world_size * 2, 6, generator=torch.Generator().manual_seed(step))
        model.inner.use = use[rank]
        model(x[rank * 2:(rank + 1) * 2]).pow(2).mean().backward()
        for r in range(world_size):
            reference.inner.use = use[r]
            (reference(x[r * 2:(r + 1) * 2]).pow(2).mean() / world_size).backward()
    _assert_grads_equal(model, reference, f"[{strategy.name}/used on {sometimes_on}, then on none, no zero_grad]")
    assert_params_close(_full_params(model), list(reference.named_parameters()), what=f"[{strategy.name}]")


class _TwoHeads(nn.Module):
    """A trunk and two heads; ``head`` chooses per call which head the forward uses."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 6)
        self.a = nn.Linear(6, 3)
        self.b = nn.Linear(6, 3)
        self.head = "a"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.head)(self.trunk(x))


def _unit_used_only_unsynced(heads_sharded: bool = True) -> None:
    """Head ``a`` gets gradients in an unsynced backward and none in the synced one after it:
    its kept sum is reduced at that backward's end, as local training keeps it; two such steps
    in a row (the per-backward flags reset between backwards, or the second step's leftover was
    never reduced). ``heads_sharded``: each head a fully sharded unit of its own; else the heads
    share the root's handle (and its one group) with the trunk, so the synced backward reaches
    that group through head ``b`` while ``a``'s use is only in the unsynced one's record."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _TwoHeads()
    torch.manual_seed(0)
    model = _TwoHeads()
    if heads_sharded:
        fully_shard(model.a)
        fully_shard(model.b)
    fully_shard(model)
    for step in range(2):
        for micro, head in enumerate(("a", "b")):
            model.set_requires_gradient_sync(micro == 1)  # type: ignore[operator]  # FSDPModule's
            x = torch.randn(world_size * 2, 6, generator=torch.Generator().manual_seed(10 * step + micro))
            model.head = reference.head = head
            model(x[rank * 2:(rank + 1) * 2]).pow(2).mean().backward()
            for r in range(world_size):
                (reference(x[r * 2:(r + 1) * 2]).pow(2).mean() / world_size).backward()
        _assert_grads_equal(model, reference, f"[heads sharded: {heads_sharded}, step {step}: head a unsynced, "
                                              "head b synced]")
        model.zero_grad()
        reference.zero_grad()


def test_parameters_without_gradient_keep_grad_none() -> None:
    """A parameter no rank used keeps .grad None (AdamW's weight decay leaves it alone, as
    locally); one used on some ranks only gets the averaged gradient on every rank; one that had
    a .grad and is used on no rank in the next synced backward (no zero_grad) keeps it; a unit
    used only in an unsynced backward gets its sum reduced by the next synced one. Every
    strategy at 2 ranks; the hybrid ones on a 2 x 2 mesh in test_hybrid_sharding_at_four_ranks."""
    run_distributed(_all_world_sizes_entry, 2, "unused", timeout=180)


def _partial_grad_reset() -> None:
    """The user sets one parameter's .grad to None between two backwards without zero_grad: it
    restarts from zero, the others accumulate, as with autograd."""
    reference = make_model()
    model = _shard(make_model())
    for m in (model, reference):
        (_local_step if m is model else _global_step)(m, 0)
        m.blocks[1].fc1.weight.grad = None
        m.emb.weight.grad = m.emb.weight.grad * 2  # a tensor of the user's, not our view
        (_local_step if m is model else _global_step)(m, 1)
    _assert_grads_equal(model, reference, "partial reset")


# ---------------------------------------------------------------------------- output structures
@dataclasses.dataclass
class _DataOut:
    logits: torch.Tensor
    aux: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = dataclasses.field(init=False, default=None)  # filled after construction


def _block_out(out: torch.Tensor) -> _DataOut:
    """A block's dataclass output whose next block reads only ``hidden``, a field outside
    ``__init__`` (set afterwards, as outputs derived from other fields are): the backward
    reaches the block through that field alone."""
    result = _DataOut(out.mean(-1))
    result.hidden = out
    return result


class _TupleOut(NamedTuple):
    logits: torch.Tensor
    extra: List[torch.Tensor]


class _ModelOutputLike(collections.OrderedDict):
    """Like Hugging Face's ModelOutput: an OrderedDict subclass with attribute access."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as e:
            raise AttributeError(name) from e


class _Opaque:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.count = 1  # a field that is not a tensor beside it, as real output objects hold


class _Wrapped(nn.Module):
    """The ParityModel returning its logits inside ``kind`` of container (blocks too)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inner = make_model()
        self.kind = kind
        for block in self.inner.blocks:
            block.register_forward_hook(lambda m, a, out: _block_out(out) if kind == "dataclass" else None)

    def forward(self, tokens: torch.Tensor) -> Any:
        inner = self.inner
        x = inner.emb(tokens)
        for block in inner.blocks:
            out = block(x)
            x = out.hidden if isinstance(out, _DataOut) else out
        logits = inner.head(inner.scale(inner.frozen(x)))
        if self.kind == "dataclass":
            return _DataOut(logits, aux=None)
        if self.kind == "namedtuple":
            return _TupleOut(logits, [logits[:, :1] * 0])
        if self.kind == "model_output":
            return _ModelOutputLike(logits=logits)
        if self.kind == "dict_of_lists":
            return {"out": [(logits,)]}
        return _Opaque(logits)


def _logits_of(out: Any) -> torch.Tensor:
    if isinstance(out, (_DataOut, _TupleOut)):
        return out.logits
    if isinstance(out, dict) and "out" in out:
        return out["out"][0][0]
    return out["logits"]


def _output_structures(kind: str) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    reference = _Wrapped(kind)
    model = _Wrapped(kind)
    for block in model.inner.blocks:
        fully_shard(block)
    fully_shard(model)
    inputs, targets = batch(0, world_size)
    if kind == "opaque":
        try:
            model(local_rows(inputs, rank))
        except TypeError as e:
            assert "_Opaque" in str(e) and "fully_shard(<root>)" in str(e), e
        else:
            raise AssertionError("an output holding tensors in an opaque object must raise at forward")
        model.kind = reference.kind = "dataclass"  # the model is left usable
    loss_fn(_logits_of(model(local_rows(inputs, rank))), local_rows(targets, rank)).backward()
    loss_fn(_logits_of(reference(inputs)), targets).backward()
    _assert_grads_equal(model, reference, f"[{kind}]")


class _Stashing(nn.Module):
    """Keeps its result on itself and returns None (``stash``), or returns it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.stash = True
        self.out: Optional[torch.Tensor] = None

    def forward(self, h: torch.Tensor) -> Optional[torch.Tensor]:
        self.out = torch.tanh(self.lin(h))
        return None if self.stash else self.out


class _ReadsStash(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 6)
        self.mid = _Stashing()
        self.l3 = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.l1(x))
        return self.l3(self.mid.out if h is None else h)


def _output_kept_on_the_module() -> None:
    """A fully sharded module that keeps its output on itself and returns None: nothing gathers
    its parameters for backward, and the gradient's arrival raises on every rank naming the
    module and the fix (it named an internal state); returning the output then trains as one
    process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    local = _ReadsStash()
    model = copy.deepcopy(local)
    for name in ("l1", "mid", "l3"):
        fully_shard(getattr(model, name))
    fully_shard(model)
    rows = torch.randn(2 * world, 4, generator=torch.Generator().manual_seed(5))
    mine = rows.view(world, 2, 4)[rank]
    try:
        model(mine).square().sum().backward()
    except RuntimeError as e:
        assert "fully_shard(mid)" in str(e) and "returned no tensor that requires grad" in str(e), e
    else:
        raise AssertionError("a gradient reaching a module whose forward returned nothing must raise")
    model.zero_grad()
    model.mid.stash = local.mid.stash = False
    model(mine).square().sum().backward()
    local(rows).square().sum().div(world).backward()
    _assert_grads_equal(model, local, "[stashed then returned]")


def test_outputs_of_any_structure() -> None:
    """Root and block outputs as dataclass, namedtuple, OrderedDict subclass (ModelOutput-like)
    and nested dict/list/tuple: backward hooks reach every tensor and gradients equal local
    training; an opaque object holding tensors raises TypeError at forward naming the module
    and type, and the model keeps working."""
    run_distributed(_all_world_sizes_entry, 2, "outputs", timeout=180)


# ---------------------------------------------------------------------------- unshard_params
class _NoParams(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def _unshard_params_when_idle(situation: str) -> None:
    reference = make_model()
    model = _shard(make_model())
    rank, world_size = dist.get_rank(), dist.get_world_size()
    inputs, _ = batch(0, world_size)
    if situation == "after eval forward":
        model(local_rows(inputs, rank)).sum()
    elif situation == "after failed forward":
        def fail(m: nn.Module, args: Any) -> None:
            raise ValueError("user error in forward")
        hook = model.blocks[1].register_forward_pre_hook(fail)
        try:
            model(local_rows(inputs, rank))
        except ValueError as e:
            assert "user error in forward" in str(e), e
        hook.remove()
    elif situation == "after failed backward":
        armed = arm_backward_failure(model.blocks[0])
        expect_backward_failure(lambda: _local_step(model, 0))
        armed[0] = False
    assert_params_close(_full_params(model), list(reference.named_parameters()), what=situation)
    model.zero_grad()
    _local_step(model, 1)  # and training goes on exactly
    _global_step(reference, 1)
    _assert_grads_equal(model, reference, situation)
    empty = _NoParams()
    fully_shard(empty)
    assert torch.equal(empty(torch.ones(2)), torch.full((2,), 2.0))
    with unshard_params(empty):
        assert fully_shard.state(empty).handle is None and list(empty.parameters()) == []


def test_unshard_params_in_every_idle_state() -> None:
    """unshard_params works after an eval forward without backward, after a forward or a
    backward that raised, and on a module without parameters; training continues exactly."""
    run_distributed(_all_world_sizes_entry, 2, "unshard", timeout=180)


# ---------------------------------------------------------------------------- model changes
def _model_changed_after_fully_shard(change: str, before_first_forward: bool = False) -> None:
    """``change`` after a step (or between fully_shard and the first forward): the next forward raises."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _shard(make_model())
    inputs, _ = batch(0, world_size)
    if not before_first_forward:
        model(local_rows(inputs, rank)).sum().backward()
    if change == "parameter reassigned":
        model.blocks[1].fc1.weight = nn.Parameter(torch.zeros(7, 6))
        expected = "fully_shard(blocks.1): parameter 'blocks.1.fc1.weight' was replaced"  # named in full either way
    elif change == "submodule added":
        model.blocks[0].adapter = nn.Linear(6, 6)
        expected = "fully_shard(blocks.0): submodule 'blocks.0.adapter' with parameters"
    elif change == "container added":  # the parameters one level down (an adapter as nn.Sequential)
        model.blocks[0].adapter = nn.Sequential(nn.Linear(6, 6))
        expected = "fully_shard(blocks.0): submodule 'blocks.0.adapter' with parameters ['0.weight', '0.bias']"
    elif change == "parameter on an added container":  # added empty, then given a parameter of its own
        model.blocks[0].adapter = nn.Sequential()
        model.blocks[0].adapter.register_parameter("gate", nn.Parameter(torch.ones(6)))
        expected = "fully_shard(blocks.0): parameter 'blocks.0.adapter.gate' was registered"
    elif change == "submodule cast":  # a plain submodule: FSDPModule._apply does not see it
        model.blocks[0].fc1.half()
        expected = "['blocks.0.fc1.weight', 'blocks.0.fc1.bias'] of fully_shard(blocks.0) no longer share storage"
    elif change == "data assigned":
        model.blocks[1].fc2.weight.data = model.blocks[1].fc2.weight.detach().clone()
        expected = "['blocks.1.fc2.weight'] of fully_shard(blocks.1) no longer share storage"
    elif change == "vector_to_parameters":  # assigns each parameter's .data
        torch.nn.utils.vector_to_parameters(torch.nn.utils.parameters_to_vector(model.parameters()), model.parameters())
        expected = "no longer share storage"
    else:  # a container without parameters around a managed module: not a change
        model.blocks[0].fc1 = nn.Sequential(model.blocks[0].fc1)
        model(local_rows(inputs, rank)).sum().backward()
        return
    if "no longer share storage" in expected:  # a state dict or a full view would show the shard's old values
        for what, read in (("get_model_state_dict", lambda: get_model_state_dict(model)),
                           ("unshard_params", lambda: unshard_params(model).__enter__())):
            try:
                read()
            except RuntimeError as e:
                assert "no longer share storage" in str(e) and "after fully_shard" in str(e), (what, e)
            else:
                raise AssertionError(f"{change}: {what} must raise (a user's trial saved the old values)")
    try:
        model(local_rows(inputs, rank))
    except RuntimeError as e:
        assert expected in str(e) and "after fully_shard" in str(e), e
    else:
        raise AssertionError(f"{change}: the next forward must raise")


# ---------------------------------------------------------------------------- casts and moves
def _snapshot_tensors(model: nn.Module) -> List[Tuple[str, int, torch.Tensor, Optional[torch.Tensor], int]]:
    """Per parameter and buffer: name, object, value, .grad and storage address."""
    out = [(n, id(p), p.detach().clone(), None if p.grad is None else p.grad.clone(), p.untyped_storage().data_ptr())
           for n, p in model.named_parameters()]
    return out + [(n, id(b), b.clone(), None, b.untyped_storage().data_ptr()) for n, b in model.named_buffers()]


def _cast_or_move_after_fully_shard(call: str) -> None:
    """``model.half()`` / ``.double()`` / ``.to(torch.float64)`` / ``.bfloat16()`` on the root or a
    block, before the first step or between steps (with gradients): refused, naming the
    parameters, with every parameter (object, storage, value, .grad) and buffer as it was. Before,
    the call went through and the next steps trained nothing: the forward computed on the flat
    shards while the optimizer updated the cast copies. ``.to(<its own device>)`` and ``.float()``
    on float32 change nothing and are allowed, and so is ``share_memory()`` (it moves each storage
    in place). Training afterwards equals local training."""
    model, reference = _shard(make_model()), make_model()
    model.register_buffer("counter", torch.zeros(3))
    reference.register_buffer("counter", torch.zeros(3))
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.5)

    def half_after_a_failed_move() -> None:
        try:  # a device that is not there: torch raises inside _apply, after the guard began
            model.to(torch.device("cuda", 99))
        except (RuntimeError, AssertionError) as e:
            assert "new storage" not in str(e), e  # torch's own error, not the refusal
        else:
            raise AssertionError("moving to cuda:99 must fail")
        cast: List[torch.Tensor] = []

        def half_until_the_third(t: torch.Tensor) -> torch.Tensor:  # a cast that fails part-way through the model
            cast.append(t)
            if len(cast) == 3:
                raise RuntimeError("injected: the third tensor cannot be cast")
            return t.half()

        try:  # the two tensors cast before the failure are put back (checked with the rest below)
            model._apply(half_until_the_third)
        except RuntimeError as e:
            assert "injected" in str(e), e
        else:
            raise AssertionError("the cast must fail at its third tensor")
        model.half()  # still guarded after the failed calls

    casts: Dict[str, Callable[[], Any]] = {
        "half": model.half, "double": model.double, "bfloat16": model.bfloat16,
        "to(float64)": lambda: model.to(torch.float64), "block.half": model.blocks[1].half,
        "to_empty": lambda: model.to_empty(device="cpu"), "half after a failed move": half_after_a_failed_move}
    for step in range(3):
        _local_step(model, step)
        _global_step(reference, step)
        if step == 1:  # between backward and optimizer step: gradients are there too
            before = _snapshot_tensors(model)
            try:
                casts[call]()
            except RuntimeError as e:
                assert "new storage" in str(e) and "before fully_shard" in str(e) and "MixedPrecision" in str(e), e
                assert call != "to_empty" or "to_empty(device=...) on the fully sharded root before its first step" \
                    in str(e), e
                target = model.blocks[1] if call == "block.half" else model
                assert f"[{next(n for n, _ in target.named_parameters())!r}," in str(e), e  # in model order
            else:
                raise AssertionError(f"{call}: must raise")
            after = _snapshot_tensors(model)
            for (n, i, v, g, ptr), (n2, i2, v2, g2, ptr2) in zip_same(before, after):
                assert (n, i, ptr) == (n2, i2, ptr2) and v.dtype == v2.dtype and torch.equal(v, v2), (call, n)
                assert (g is None) == (g2 is None) and (g is None or torch.equal(g, g2)), (call, n)  # type: ignore[arg-type]  # checked
            model.to("cpu")  # its own device: allowed, changes nothing
            model.float()
            assert [(n, i, ptr) for n, i, _, _, ptr in _snapshot_tensors(model)] == [(n, i, p) for n, i, _, _, p in after]
            model.share_memory()  # moves each storage in place: parameters stay views of their shards
        _assert_grads_equal(model, reference, f"[{call}] step {step}")
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    assert_params_close(_full_params(model), list(reference.named_parameters()), what=f"[{call}] params")


# ---------------------------------------------------------------------------- process groups
def _groups_released_when_destroyed() -> None:
    """After ``dist.destroy_process_group(group)`` the library holds no reference to the group,
    so torch really destroys it (and joins gloo's worker threads) then, not at interpreter exit,
    where a worker thread still freeing a finished collective's tensors aborts the process (see
    [Note: Process groups held weakly]); a model used after that raises, naming the module."""
    import gc
    import weakref

    from composable_shard import get_model_state_dict, replicate

    world_size, rank = dist.get_world_size(), dist.get_rank()
    everyone = dist.new_group(list(range(world_size)))
    half = world_size // 2  # HYBRID: (shard, replicate) groups, every rank creating every group
    shard_groups = [dist.new_group(list(range(s * half, (s + 1) * half))) for s in range(2)]
    replicate_groups = [dist.new_group([r, r + half]) for r in range(half)]
    shard, across = shard_groups[rank // half], replicate_groups[rank % half]
    model = make_model()
    fully_shard(model.blocks[0], process_group=everyone)
    fully_shard(model.blocks[1], process_group=(shard, across), strategy=ShardingStrategy.HYBRID_SHARD)
    replicate(model.scale, process_group=everyone)
    fully_shard(model, process_group=everyone)
    _local_step(model, 0)
    get_model_state_dict(model, full=False)
    get_model_state_dict(model)
    refs = {"everyone": weakref.ref(everyone), "shard": weakref.ref(shard), "replicate": weakref.ref(across)}
    dist.barrier()
    for group in [everyone, *shard_groups, *replicate_groups]:  # (other ranks' groups: a no-op)
        dist.destroy_process_group(group)
    del everyone, shard_groups, replicate_groups, shard, across, group
    gc.collect()
    alive = [name for name, ref in refs.items() if ref() is not None]
    assert not alive, f"groups {alive} still referenced after dist.destroy_process_group"
    try:
        model(batch(1, world_size)[0])
    except RuntimeError as e:
        assert "fully_shard(<root>): its process_group was destroyed" in str(e), e
    else:
        raise AssertionError("a forward on destroyed groups did not raise")


# ---------------------------------------------------------------------------- entry
_GRIDS: Dict[str, Callable[[], None]] = {
    "failed_backward": lambda: (run_subtests(_failed_backward, {"strategy": _STRATEGIES}),
                                run_subtests(_failed_backward, {"strategy": _STRATEGIES[:2]}, after_unsynced=True)),
    "stale": lambda: (run_subtests(_stale_case, {"case": _stale_cases()}), _uneven_in_place_edits(),
                      _optimizer_grown_after_its_first_step()),
    "freeze": lambda: (run_subtests(_freeze_unfreeze, {"strategy": _STRATEGIES}),
                       run_subtests(_frozen_module_first, {"strategy": _STRATEGIES})),
    "unused": lambda: (_unit_used_only_unsynced(), _unit_used_only_unsynced(heads_sharded=False),
                       run_subtests(_unused_parameters, {"strategy": _STRATEGIES, "sometimes_on": ["all", "none", "rank0"]}),
                       _partial_grad_reset()),
    "outputs": lambda: (run_subtests(_output_structures, {"kind": ["dataclass", "namedtuple", "model_output",
                                                                  "dict_of_lists", "opaque"]}),
                        _output_kept_on_the_module()),
    "unshard": lambda: run_subtests(_unshard_params_when_idle, {"situation": [
        "after eval forward", "after failed forward", "after failed backward"]}),
    "changes": lambda: (run_subtests(_model_changed_after_fully_shard, {"change": [
        "parameter reassigned", "submodule added", "container added", "parameter on an added container", "wrapped",
        "submodule cast", "data assigned",
        "vector_to_parameters"]}), run_subtests(_model_changed_after_fully_shard, {"change": [
            "parameter reassigned", "submodule added", "data assigned"]}, before_first_forward=True)),
    "casts": lambda: run_subtests(_cast_or_move_after_fully_shard, {"call": [
        "half", "double", "bfloat16", "to(float64)", "block.half", "to_empty", "half after a failed move"]}),
    "hooks": lambda: run_subtests(_hooks_on_parameters, {"kind": ["register_hook", "post_accumulate_grad"]}),
}


def _all_world_sizes_entry(name: str) -> None:
    _GRIDS[name]()


_HYBRID = _STRATEGIES[3:]
_AT_FOUR: Dict[str, Callable[[], None]] = {
    "failed backward": lambda: run_subtests(_failed_backward, {"strategy": _HYBRID}),
    "freeze and unfreeze": lambda: run_subtests(_freeze_unfreeze, {"strategy": _HYBRID}),
    "parameters without gradient": lambda: (  # _HYBRID_SHARD_ZERO2: the case that crosses replicas only
        run_subtests(_unused_parameters, {"strategy": _HYBRID[:1], "sometimes_on": ["all", "none", "rank0"]}),
        run_subtests(_unused_parameters, {"strategy": _HYBRID[1:], "sometimes_on": ["rank0"]})),
    "destroyed process groups released": _groups_released_when_destroyed,  # last: it destroys groups
}


def _at_four(case: str) -> None:
    _AT_FOUR[case]()


def test_hybrid_sharding_at_four_ranks() -> None:
    """What 4 ranks add, in one process group (each failure names its case): a failed backward,
    freezing and unfreezing, and parameters without a gradient (the tests above, at 2 ranks,
    where a hybrid mesh is 1 x 2) under HYBRID_SHARD and _HYBRID_SHARD_ZERO2 on a 2 x 2 mesh,
    so gradients cross a real replicate group; and ``_groups_released_when_destroyed``."""
    run_distributed(run_subtests, 4, _at_four, {"case": list(_AT_FOUR)}, timeout=300)


# ---------------------------------------------------------------------------- hooks on parameters
def _hooks_on_parameters(kind: str) -> None:
    torch.manual_seed(0)
    model = _shard(make_model())
    torch.manual_seed(0)
    reference = make_model()
    _local_step(model, 0)
    model.zero_grad()
    param = model.blocks[1].fc1.weight  # type: ignore[union-attr, index]
    seen: List[int] = []
    if kind == "register_hook":  # e.g. masking or clipping this parameter's gradient
        handle = param.register_hook(lambda g: g * 0)
    else:  # e.g. an optimizer stepped in backward
        handle = param.register_post_accumulate_grad_hook(lambda p: seen.append(1))
    try:
        _local_step(model, 1)
    except RuntimeError as e:
        assert "'blocks.1.fc1.weight'" in str(e) and "would never run" in str(e), e
    else:
        raise AssertionError(f"a {kind} hook on an original parameter, which never runs, was accepted")
    assert not seen
    # Nothing was left half-done: with the hook removed the model trains as a fresh one would.
    handle.remove()
    model.zero_grad()
    _local_step(model, 1)
    _global_step(reference, 1)
    _assert_grads_equal(model, reference, kind)


def test_changes_after_fully_shard_are_refused() -> None:
    """At 2 ranks, in one process group (each failure names its case):

    changes: a parameter reassigned, or a submodule with parameters added (or added empty and
    given a parameter afterwards), after fully_shard
    (after a step, or before the first forward) would be silently left out of training, and so
    would a parameter whose ``.data`` was
    replaced (a plain submodule cast with ``.half()``, ``p.data = ...``, torch's
    ``vector_to_parameters``: the forward kept computing on the flat shard, the optimizer
    updated the new tensor): the next forward raises naming the FQN. Wrapping a managed module
    in a container without parameters is allowed.

    casts: see ``_cast_or_move_after_fully_shard`` (refused at the call, nothing changed).

    hooks: ``p.register_hook(fn)`` and ``p.register_post_accumulate_grad_hook(fn)`` on an
    original parameter never ran under fully_shard (the forward computes on views of the
    gathered flat buffer, so autograd never reaches it): a gradient mask or an
    optimizer-in-backward was skipped, silently. The next forward now raises naming the
    parameter, changes nothing, and the model trains normally once the hook is removed."""
    run_distributed(run_subtests, 2, _all_world_sizes_entry, {"name": ["changes", "casts", "hooks"]}, timeout=180)
