"""``plan(model, example_batch, memory_budget=...)``: choose per block ``fully_shard`` /
``replicate`` / ``checkpoint`` so that a training step fits a per-rank memory budget at the least
communication plus recomputation.

Three steps:

1. **Measure** (``plan_profile.profile_model``): one forward and backward of the model on fake
   tensors (shapes and storage sizes, no memory: [Note: Planning on fake tensors] in
   ``_planning/plan_profile.py``) attributes every storage autograd saves for backward to the block whose
   forward saved it, records each block's inputs (what a checkpointed block keeps), outputs, the
   most its backward holds at once and its forward FLOPs; on a materialized model each block's
   forward is also timed on the real device (the recomputation cost). Parameters, gradients,
   buffers and RNG state are left as they were.
2. **Count** (:func:`_static_description`): parameter, gradient, optimizer bytes and bytes sent
   per step come from ``describe``'s own planning code (``_planning/describe.plan_handles``, which is
   ``fully_shard``'s planning, and ``_planning/describe``'s row arithmetic), so ``describe(model)`` after
   :meth:`MemoryPlan.apply` reports the same figures.
3. **Choose** (:func:`_choose`): the peak of a step is simulated moment by moment
   (:func:`_simulate`) for a candidate assignment; a greedy search lowers it at the least cost.

[Note: Plan cost model]
  seconds(plan) = bytes_sent(plan) / bandwidth + sum of the measured forward seconds of the
  checkpointed blocks (each is recomputed once in backward): timed on the real device, or, when
  the model is on the meta device (``profile="fake"``), its counted forward FLOPs at
  ``device_flops`` FLOP/s (``DEFAULT_DEVICE_FLOPS``, 400e12: about 40% of an H100's dense bf16
  peak). ``bytes_sent`` is counted exactly as
  ``describe``/``record_collectives`` count (bytes this rank sends per step). ``bandwidth``
  defaults to 10 GB/s (``DEFAULT_BANDWIDTH``): the order of an inter-node link or PCIe; on gloo
  over loopback it is lower, which only makes communication dearer relative to recomputation,
  so pass your own. Per block the options, cheapest first at W = 2: ``replicate`` (one
  all-reduce of the gradients), ``fully_shard(SHARD_GRAD_OP)`` (one all-gather, one
  reduce-scatter), ``fully_shard(FULL_SHARD)`` (two all-gathers, one reduce-scatter), each with or
  without ``checkpoint``.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ._setup import data_parallel as _data_parallel
from ._planning import describe as _describe
from ._runtime import shard_math as _shard_math
from ._planning.describe import ModuleRow, ShardingDescription
from ._planning.plan_profile import (DEFAULT_DEVICE_FLOPS, PROFILES, BlockProfile, Profile, agreed, compute_dtypes,
                                     profile_model)
from ._base.tree import convert, tensors_in
from .api import MixedPrecision, ShardingStrategy
from .checkpoint import checkpoint
from .fully_shard import fully_shard
from .replicate import replicate

__all__ = ["plan", "MemoryPlan", "Choice", "BlockProfile", "DEFAULT_BANDWIDTH", "DEFAULT_DEVICE_FLOPS"]

DEFAULT_BANDWIDTH = 10e9  # bytes per second, see [Note: Plan cost model]
OPTIMIZERS = ("adamw", "adam", "sgd")  # the optimizers whose state plan() counts (sgd: no momentum, no state)
COMPONENTS = ("parameters", "gradients", "optimizer", "activations", "unsharded_in_flight", "communication", "other")
# [Note: Headroom] The moments below count every tensor of the model, its step and its batch, but
# not the small ones (scalars, the used flags, a loss's reductions, autograd's bookkeeping): the
# counting allocator found 8-16 KB of them at the peak of the plans it checked
# (benchmarks/plan.py). "other" reserves max(OTHER_MIN_BYTES, OTHER_FRACTION of the rest) for them,
# so that a plan chosen right at its budget still measures under it.
OTHER_MIN_BYTES = 64 * 1024
OTHER_FRACTION = 0.0025
_FULL = ShardingStrategy.FULL_SHARD
_ZERO2 = ShardingStrategy.SHARD_GRAD_OP


@dataclass(frozen=True)
class Choice:
    """What :meth:`MemoryPlan.apply` does to one module: ``api`` is ``"fully_shard"``,
    ``"replicate"`` or ``"none"``; ``strategy`` the ShardingStrategy name (``"FULL_SHARD"``,
    ``"SHARD_GRAD_OP"``), ``"replicate"`` or ``"-"``; ``checkpoint`` whether
    ``composable_shard.checkpoint`` is applied to it; ``prefetch`` whether its handle is
    prefetched (``fully_shard``'s default forward and backward prefetch). When the root's api is
    ``"replicate"`` the whole model is one ``replicate`` call and the blocks listed as
    ``"replicate"`` are covered by it (one bucket set for the model)."""

    fqn: str
    api: str
    strategy: str
    checkpoint: bool
    prefetch: bool


@dataclass(frozen=True)
class _Option:
    api: str  # "fully_shard" or "replicate"
    strategy: Optional[ShardingStrategy]
    checkpoint: bool


_OPTIONS = tuple(_Option(api, strategy, ck) for api, strategy in (("replicate", None), ("fully_shard", _ZERO2),
                                                                   ("fully_shard", _FULL)) for ck in (False, True))


@dataclass(frozen=True)
class MemoryPlan:
    """What :func:`plan` chose. Byte figures are per rank.

    ``predicted_peak`` is the sum of ``components`` at the step's highest moment (tensor bytes the
    step holds above what existed before the model; one batch like ``example_batch`` counts as
    activations, alive all step).
    ``components["parameters"]`` and ``["optimizer"]`` are what the ranks hold all the time;
    ``["gradients"]`` the gradients alive at that moment (``grad_bytes`` is the figure after
    backward, as ``describe`` reports it). ``bytes_sent`` is per training step, counted as
    ``describe()`` and ``record_collectives`` count. ``description`` is what ``describe(model)``
    reports after :meth:`apply`. ``cost_seconds`` is the cost model's figure ([Note: Plan cost
    model] in ``plan.py``); ``str()`` is a table in ``describe``'s style.
    """

    world_size: int
    memory_budget: int
    predicted_peak: int
    components: Dict[str, int]
    peak_moment: str  # where in the step the peak falls, e.g. "backward of blocks.3"
    bytes_sent: int
    choices: Tuple[Choice, ...]
    cost_seconds: float
    bandwidth: float
    description: ShardingDescription
    profiles: Tuple[BlockProfile, ...]
    mixed_precision: Optional[MixedPrecision] = None
    profile_source: str = "measured"  # "measured": forward times from the device; "fake": FLOPs at a device model

    @property
    def param_bytes(self) -> int:
        """Parameter bytes per rank (``describe(model).param_bytes`` after :meth:`apply`)."""
        return self.description.param_bytes

    @property
    def grad_bytes(self) -> int:
        """Gradient bytes per rank after backward (``describe(model).grad_bytes`` after :meth:`apply`)."""
        return self.description.grad_bytes

    @property
    def optimizer_bytes(self) -> int:
        """Optimizer state bytes per rank (rank 0's, the largest)."""
        return self.components["optimizer"]

    def apply(self, model: nn.Module) -> nn.Module:
        """Annotate ``model`` in place as planned and return it: children first (``checkpoint``,
        then ``replicate``/``fully_shard`` per block), then the root. Needs the process group
        (``dist.init_process_group``) when planned for more than one rank. When the plan
        checkpoints a block of a model whose ``config.use_cache`` is True (Hugging Face), it sets
        it to False with a warning, as Hugging Face's own gradient checkpointing does: a
        recomputed layer would append its keys and values to the cache a second time, memory
        the plan does not hold (4.5 MB over the budget on benchmarks/plan.py's Llama).

        Raises:
            ValueError: ``model`` is not the model planned (other module names or parameter
                counts), or no process group of the planned size exists.
        """
        modules = dict(model.named_modules())
        missing = [c.fqn for c in self.choices if c.fqn not in modules]
        if missing or _numel(model) != sum(r.numel for r in self.description.rows):
            raise ValueError(f"MemoryPlan.apply: the model is not the one planned (modules {missing[:3]} missing or "
                             "other parameter counts); plan() the model you apply to")
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != self.world_size:
            raise ValueError(f"MemoryPlan.apply: planned for {self.world_size} ranks but the process group has {world}; "
                             "initialize the process group first, or plan(..., world_size=...) for this one")
        by_fqn = {c.fqn: c for c in self.choices}
        root = by_fqn[""]
        config = getattr(model, "config", None)
        if config is not None and any(c.checkpoint for c in self.choices) and getattr(config, "use_cache", False) is True:
            warnings.warn("MemoryPlan.apply: the plan checkpoints blocks, so model.config.use_cache is set to False "
                          "(a recomputed layer would fill the key/value cache again), as Hugging Face's gradient "
                          "checkpointing does", UserWarning, stacklevel=2)
            config.use_cache = False
        mp = self.mixed_precision
        for choice in self.choices:
            if choice.fqn == "":
                continue
            block = modules[choice.fqn]
            if choice.checkpoint:
                checkpoint(block)
            if choice.api == "fully_shard":
                fully_shard(block, strategy=ShardingStrategy[choice.strategy], mixed_precision=mp)
            elif choice.api == "replicate" and root.api != "replicate":
                replicate(block, mixed_precision=mp)
        if root.api == "replicate":
            return replicate(model, mixed_precision=mp)
        return fully_shard(model, mixed_precision=mp)

    def __str__(self) -> str:
        return _render(self)


def plan(model: nn.Module, example_batch: Any, *, memory_budget: int, world_size: Optional[int] = None,
         block_types: Optional[Iterable[type]] = None, optimizer: str = "adamw",
         mixed_precision: Optional[MixedPrecision] = None, loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
         bandwidth: float = DEFAULT_BANDWIDTH, profile: str = "auto",
         device_flops: float = DEFAULT_DEVICE_FLOPS) -> MemoryPlan:
    """Choose, per block, ``fully_shard`` (FULL_SHARD or SHARD_GRAD_OP) or ``replicate``, with or
    without ``checkpoint``, so that one training step (forward, backward, optimizer step) fits in
    ``memory_budget`` bytes per rank at the least communication plus recomputation.

    Activations are measured by one forward and backward of ``model`` on ``example_batch`` (one
    rank's batch) on fake tensors, which hold no memory: a model built on the meta device (no
    weights) plans as well as a materialized one, in a small fraction of its budget. Parameter, gradient and optimizer bytes and bytes sent come
    from the same planning code as :func:`describe`. The model is left exactly as it was
    (parameters, gradients, buffers, RNG state); nothing is applied until :meth:`MemoryPlan.apply`.
    A budget above one unsharded process's peak gives ``replicate(model)`` and no checkpointing.

    Example::

        p = plan(model, tokens, memory_budget=8 << 30, loss_fn=lambda out: out.loss)
        print(p)                     # per module: api, strategy, checkpoint; predicted bytes
        p.apply(model)               # checkpoint / fully_shard / replicate per block, then the root
        optim = torch.optim.AdamW(model.parameters())

    Args:
        model: a plain model (nothing applied yet), on the device it will train on or on the
            meta device.
        example_batch: one rank's batch: a tensor (``model(x)``), a tuple or list (``model(*b)``)
            or a dict (``model(**b)``); meta tensors are fine (only shapes and dtypes are read).
        memory_budget: bytes per rank the step may hold (tensor bytes above what exists before
            the model is built).
        world_size: ranks to plan for (default: the process group's size).
        block_types: classes whose instances are the blocks (default: the class repeated in the
            model's largest ``nn.ModuleList``).
        optimizer: ``"adamw"``/``"adam"`` (two states per element plus a step) or ``"sgd"`` (none).
        mixed_precision: the :class:`MixedPrecision` every call will get (``param_dtype`` rules
            ``replicate`` out: it computes in the parameters' dtype).
        loss_fn: ``loss_fn(output)`` -> scalar for the measured backward; default ``output.loss``
            when the output has one, else ``output.float().sum()`` (a tuple: its first element).
        bandwidth: bytes per second of the cost model ([Note: Plan cost model]).
        profile: where the recomputation costs come from: ``"measured"`` times each block's
            forward on the model's device, ``"fake"`` counts its FLOPs at ``device_flops``;
            ``"auto"`` (default) measures a materialized model and counts a meta-device one.
            The bytes are the fake pass's either way.
        device_flops: FLOP/s of the device model of ``profile="fake"``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or a batch/loss of an unsupported type.
        ValueError: a budget that is not a positive int, an unknown optimizer, no block found,
            a model already sharded, a model whose forward cannot run on fake tensors
            (data-dependent operations), ``profile="measured"`` on a meta-device model, or no
            plan fits (the message gives the smallest peak achievable, the ranks it would take,
            and the most batch rows per rank that fit, measured on the example's first rows, or
            that no batch fits: [Note: Fewer rows]).
        NotImplementedError: a tensor-parallel (``DTensor``) model: plan() models data
            parallelism only (size a 2-D run with :func:`describe` after applying the APIs).
    """
    world = _check_arguments(model, memory_budget, world_size, optimizer, bandwidth)
    source = _profile_source(model, example_batch, profile, device_flops)
    blocks = _find_blocks(model, block_types)
    group: Optional[List[Optional[dist.ProcessGroup]]] = \
        [None] if dist.is_initialized() and dist.get_world_size() > 1 else None
    measured = agreed(_data_parallel.agreed(  # a refusal on one rank ([Note: Agreed refusals]) raises on every rank
        "plan", group, lambda: profile_model(model, blocks, example_batch, loss_fn, mixed_precision, source, device_flops),
        lambda profile: [[b.fqn] for b in profile.blocks], applied="a plan", what="ranks disagree on the blocks plan() found (plan the same model, with the same block_types, on every rank)",
        tag="plan::profile", digest_first=True))
    search = _Search(model, blocks, measured, world, optimizer, mixed_precision, bandwidth)
    assignment = _choose(search, memory_budget, _Rows(example_batch, lambda batch: profile_model(
        model, blocks, batch, loss_fn, mixed_precision, "fake", device_flops)))
    return search.result(assignment, memory_budget)


# ---------------------------------------------------------------------------- arguments and blocks
def _check_arguments(model: nn.Module, memory_budget: int, world_size: Optional[int], optimizer: str,
                     bandwidth: float) -> int:
    if not isinstance(model, nn.Module):
        raise TypeError(f"plan: model must be an nn.Module, got {type(model).__name__}")
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget <= 0:
        raise ValueError(f"plan: memory_budget must be a positive int (bytes per rank), got {memory_budget!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"plan: unknown optimizer {optimizer!r}; plan() counts the state of {list(OPTIMIZERS)}")
    if not (isinstance(bandwidth, (int, float)) and 0 < bandwidth < math.inf):
        raise ValueError(f"plan: bandwidth must be a positive, finite number of bytes per second, got {bandwidth!r}")
    if _describe.is_managed(model):
        raise ValueError(f"plan: {type(model).__name__} already carries fully_shard or replicate; plan the plain "
                         "model (before any API is applied), then apply the plan to it")
    pieces = [(n, t) for n, t in (*model.named_parameters(), *model.named_buffers()) if isinstance(t, DTensor)]
    if pieces:
        name, t = pieces[0]
        raise NotImplementedError(
            f"plan: {type(model).__name__}.{name} is a DTensor (tensor parallelism: placements "
            f"{tuple(t.placements)}), and {len(pieces)} such tensors in all; plan() models data parallelism only: its "
            "activation and collective figures would leave out tensor parallelism's, so a plan that promises to fit "
            "could run out of memory. Apply fully_shard/replicate to a tensor-parallel model yourself and read its "
            "per-rank bytes with describe(model), which counts the local pieces.")
    return _describe.planned_world_size(world_size)


def _profile_source(model: nn.Module, example_batch: Any, profile: str, device_flops: float) -> str:
    """``"fake"`` or ``"measured"`` for ``profile`` ([Note: Measured times] in ``_planning/plan_profile.py``)."""
    if profile not in PROFILES:
        raise ValueError(f"plan: profile must be one of {list(PROFILES)}, got {profile!r}")
    if not (isinstance(device_flops, (int, float)) and not isinstance(device_flops, bool) and 0 < device_flops < math.inf):
        raise ValueError(f"plan: device_flops must be a positive, finite number of FLOP/s, got {device_flops!r}")
    meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    meta_batch = any(t.is_meta for t in tensors_in(example_batch, None))
    if profile == "measured" and (meta or meta_batch):
        where = f"parameters and buffers such as {meta[:3]}" if meta else "the example batch"
        raise ValueError(f"plan: profile='measured' times each block's forward on the real device, but {where} "
                         f"of {type(model).__name__} are on the meta device; use profile='fake' (recomputation "
                         "priced by FLOPs at device_flops) or plan the materialized model")
    if profile == "auto":
        return "fake" if meta or meta_batch else "measured"
    return profile


def _find_blocks(model: nn.Module, block_types: Optional[Iterable[type]]) -> List[Tuple[str, nn.Module]]:
    """The blocks, in ``named_modules`` order, none inside another.

    [Note: Default blocks] The repeated unit of a transformer (or any deep net) lives in its
    largest ``nn.ModuleList``; its most common class is the block. Only those instances count
    as blocks, so an odd module in the list (a different first layer) belongs to the root."""
    if block_types is None:
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
        if not lists:
            raise ValueError(f"plan: {type(model).__name__} has no nn.ModuleList to take blocks from; pass "
                             "block_types={YourBlock}")
        largest = max(lists, key=_numel)
        classes = [type(m) for m in largest]
        types: Tuple[type, ...] = (max(set(classes), key=classes.count),)
    else:
        types = tuple(block_types)
        if not types or not all(isinstance(t, type) for t in types):
            raise ValueError(f"plan: block_types must be classes, got {block_types!r}")
    found: List[Tuple[str, nn.Module]] = []
    for fqn, m in model.named_modules():
        if fqn and isinstance(m, types) and not any(fqn.startswith(f + ".") for f, _ in found):
            found.append((fqn, cast(nn.Module, m)))
    if not found:
        names = ", ".join(t.__name__ for t in types)
        raise ValueError(f"plan: no module of {type(model).__name__} is a {names} (block_types); pass the classes "
                         "of its repeated blocks")
    return found


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ---------------------------------------------------------------------------- count
@dataclass(frozen=True)
class _Cost:
    """One block (or the root) under one option: its describe row and the buffers of its step."""

    row: ModuleRow
    unsharded: int  # bytes of the unsharded parameter buffer (0 when computing on the shard)
    unsharded_grad: int  # bytes of the unsharded gradient before its reduction (+ its cast copy)
    replicate_grads: int  # replicate: the gradients autograd makes before they are copied into buckets
    largest_param: int  # the largest piece of one original parameter this rank's optimizer steps
    num_flag_params: int  # original parameters counted by fully_shard's used-flags all-reduce
    frozen_whole: int = 0  # replicate: frozen parameters it does not manage, held whole on every rank
    param_grads: int = 0  # its parameters' gradients as autograd makes them, before they are concatenated
    flat_grad: int = 0  # the unsharded gradient they are concatenated into (compute dtype, padded)


def _handle_cost(info: _describe.HandleInfo) -> _Cost:
    row = _describe.handle_row(info)
    gathered = info.gathers_in_group
    unsharded = sum(_shard_math.padded_numel(g.numel, info.shard_world) * g.compute_dtype.itemsize
                    for g in info.groups) if gathered else 0
    grad = made = flat = 0
    for g in info.groups:
        if g.requires_grad and info.shard_world > 1:
            padded = _shard_math.padded_numel(g.numel, info.shard_world)
            made += g.numel * g.compute_dtype.itemsize
            flat += padded * g.compute_dtype.itemsize
            grad += padded * g.compute_dtype.itemsize
            grad += padded * g.reduce_dtype.itemsize if g.reduce_dtype != g.compute_dtype else 0
    largest = max((min(g.numel, _shard_math.chunk_numel(g.numel, info.shard_world)) * g.dtype.itemsize
                   for g in info.groups if g.requires_grad), default=0)
    return _Cost(row, unsharded, grad, 0, largest, sum(g.num_params for g in info.groups if g.requires_grad),
                 param_grads=made, flat_grad=flat)


def _replicate_cost(row: ModuleRow, module: nn.Module) -> _Cost:
    """``replicate`` manages the trainable parameters (its row); frozen ones it leaves alone are
    still held whole on every rank (describe's "(not managed)" row): counted, or replicating a
    frozen block would look free."""
    trained = [p for p in module.parameters() if p.requires_grad]
    frozen = sum(p.numel() * p.dtype.itemsize for p in module.parameters() if not p.requires_grad)
    largest = max((p.numel() * p.dtype.itemsize for p in trained), default=0)
    return _Cost(row, 0, 0, sum(p.numel() * p.dtype.itemsize for p in trained), largest, 0, frozen)


class _Search:
    """Everything the choice needs, computed once: each block's cost under each option, the
    root's, the whole-model ``replicate``'s, and the measured profile."""

    def __init__(self, model: nn.Module, blocks: List[Tuple[str, nn.Module]], profile: Profile, world: int,
                 optimizer: str, mixed_precision: Optional[MixedPrecision], bandwidth: float) -> None:
        self.model, self.blocks, self.profile, self.world = model, blocks, profile, world
        self.optimizer, self.mixed_precision, self.bandwidth = optimizer, mixed_precision, bandwidth
        mp = mixed_precision
        self.can_replicate = mp is None or (mp.param_dtype is None and mp.buffer_dtype is None)
        reduce_dtype = mp.effective_reduce_dtype if mp is not None and self.can_replicate else None
        self.reduce_dtype = reduce_dtype
        self.options = [o for o in _OPTIONS if o.api == "fully_shard" or self.can_replicate]
        self.handles: Dict[Tuple[int, ShardingStrategy], _describe.HandleInfo] = {}
        self.costs: List[Dict[_Option, _Cost]] = []
        for fqn, block in blocks:
            per: Dict[_Option, _Cost] = {}
            for option in self.options:
                if option.api == "replicate":
                    per[option] = _replicate_cost(_describe.planned_replicate_row(fqn, block, world, reduce_dtype),
                                                  block)
                else:
                    assert option.strategy is not None
                    info = self.handles.setdefault((id(block), option.strategy), _describe.planned_handle(
                        model, block, fqn, world, option.strategy, mp))
                    per[option] = _handle_cost(info)
            self.costs.append(per)
        self.root_info = _describe.planned_handle(model, model, "", world, _FULL, mp, [b for _, b in blocks])
        self.root = _handle_cost(self.root_info)
        self.whole = _replicate_cost(_describe.planned_replicate_row("", model, world, reduce_dtype), model) \
            if self.can_replicate else None
        # the head's parameters by name ([Note: Identity on fake tensors]), each once (tied names share it)
        head = {id(p): p for name, p in model.named_parameters(remove_duplicate=False)
                if name in profile.after_params and p.requires_grad}
        dtypes = compute_dtypes(model, mp)
        self.after_grad = sum(p.numel() * dtypes.get(id(p), p.dtype).itemsize for p in head.values())

    def bytes_sent(self, assignment: Optional[Sequence[_Option]]) -> int:
        """Per step, as describe counts: the rows' collectives plus fully_shard's used flags."""
        if assignment is None:
            assert self.whole is not None
            return _row_bytes(self.whole.row)
        costs = [self.root] + [self.costs[k][o] for k, o in enumerate(assignment)]
        flag_params = sum(c.num_flag_params for c in costs)
        flags = _describe.STEP_BYTES * (flag_params + _describe.STEP_AGREEMENT_INTS) if flag_params and self.world > 1 else 0
        return sum(_row_bytes(c.row) for c in costs) + flags

    def seconds(self, assignment: Optional[Sequence[_Option]]) -> float:
        """[Note: Plan cost model]."""
        recompute = sum(p.forward_seconds for p, o in zip(self.profile.blocks, assignment or []) if o.checkpoint)
        return self.bytes_sent(assignment) / self.bandwidth + recompute

    def description(self, assignment: Optional[Sequence[_Option]]) -> ShardingDescription:
        if assignment is None:
            assert self.whole is not None
            whole = {id(p) for p in self.model.parameters() if p.requires_grad}
            return _describe.planned_description(self.model, self.world, {}, {id(self.model): self.whole.row}, whole)
        handles = {id(self.model): self.root_info}
        replicated: Dict[int, ModuleRow] = {}
        ids: Set[int] = set()
        for k, ((_, block), option) in enumerate(zip(self.blocks, assignment)):
            if option.api == "replicate":
                replicated[id(block)] = self.costs[k][option].row
                ids.update(id(p) for p in block.parameters() if p.requires_grad)
            else:
                assert option.strategy is not None
                handles[id(block)] = self.handles[(id(block), option.strategy)]
        return _describe.planned_description(self.model, self.world, handles, replicated, ids)

    def result(self, assignment: Optional[Sequence[_Option]], budget: int) -> MemoryPlan:
        moment = _simulate(self, assignment)
        description = self.description(assignment)
        root = Choice("", "replicate", "replicate", False, False) if assignment is None else \
            Choice("", "fully_shard", _FULL.name, False, True)
        options = assignment if assignment is not None else [_Option("replicate", None, False)] * len(self.blocks)
        choices = [root] + [Choice(fqn, o.api, o.strategy.name if o.strategy is not None else "replicate",
                                   o.checkpoint, o.api == "fully_shard") for (fqn, _), o in zip(self.blocks, options)]
        return MemoryPlan(self.world, budget, moment.total, dict(moment.parts), moment.name,
                          description.collective_bytes(), tuple(choices), self.seconds(assignment), self.bandwidth,
                          description, self.profile.blocks, self.mixed_precision, self.profile.source)


def _row_bytes(row: ModuleRow) -> int:
    return sum(nbytes for _, nbytes in row.collectives.values())


# ---------------------------------------------------------------------------- peak
@dataclass(frozen=True)
class _Moment:
    name: str
    parts: Dict[str, int]  # COMPONENTS -> bytes

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass(frozen=True)
class _Step:
    """The terms of :func:`_simulate` for one assignment (bytes per rank)."""

    params: int
    optimizer: int
    buckets: int  # replicate's gradient buckets: alive all the time
    root_unsharded: int  # the root's parameters, unsharded from its forward to its backward
    root_grad: int  # the root's unsharded gradient, before its reduction at the end of backward
    root_shard_grad: int
    head_grad: int  # gradients of the root's parameters used after the blocks, during the blocks' backward
    head_grad_is_comm: bool  # an unsharded gradient waiting for the root's reduce-scatter (else replicate's)
    late_grads: int  # replicate(model): every gradient autograd makes before the end of backward
    options: Tuple[_Option, ...]
    costs: Tuple[_Cost, ...]
    largest_param: int
    root_concat: int = 0  # the root's parameters' gradients and the unsharded gradient they are concatenated into


def _step_terms(s: _Search, assignment: Optional[Sequence[_Option]]) -> _Step:
    if assignment is None:
        assert s.whole is not None
        rep = _Option("replicate", None, False)
        costs = tuple(s.costs[k][rep] for k in range(len(s.blocks)))
        whole = s.whole
        return _Step(whole.row.param_bytes + whole.frozen_whole, _optimizer_bytes(s, [whole.row]), whole.row.grad_bytes,
                     0, 0, 0,
                     s.after_grad, False, whole.replicate_grads, (rep,) * len(costs), costs, whole.largest_param)
    options = tuple(assignment)
    costs = tuple(s.costs[k][o] for k, o in enumerate(options))
    rows = [s.root.row] + [c.row for c in costs]
    buckets = sum(c.row.grad_bytes for c, o in zip(costs, options) if o.api == "replicate")
    return _Step(sum(r.param_bytes for r in rows) + sum(c.frozen_whole for c in costs), _optimizer_bytes(s, rows),
                 buckets, s.root.unsharded,
                 s.root.unsharded_grad, s.root.row.grad_bytes, s.after_grad if s.root.unsharded_grad else 0, True,
                 sum(c.replicate_grads for c in costs), options, costs,
                 max(c.largest_param for c in (s.root,) + costs), s.root.param_grads + s.root.flat_grad)


def _optimizer_bytes(s: _Search, rows: Sequence[ModuleRow]) -> int:
    return sum(r.adamw_bytes for r in rows) if s.optimizer in ("adamw", "adam") else 0


def _simulate(s: _Search, assignment: Optional[Sequence[_Option]], scale: float = 1.0) -> _Moment:
    """The highest moment of one steady-state step (forward, backward, optimizer step); ``None``
    is ``replicate(model)``; ``scale`` multiplies the activations (a smaller batch)."""
    return max(_moments(s, assignment, scale), key=lambda m: m.total)


def _moments(s: _Search, assignment: Optional[Sequence[_Option]], scale: float = 1.0) -> List[_Moment]:
    """The candidate moments of one steady-state step, in the step's order.

    [Note: Peak moments] The runtime's buffers are released at known points (the life of a
    parameter, ``_runtime/hooks.py``), so the step's memory is a sum of known terms at a few
    candidate moments; the peak is the largest:
      always            parameters (shards, replicas), optimizer state, replicate's buckets
      forward after     + every kept activation (a checkpointed block keeps its inputs only:
                        [Note: Shared inputs] in ``_planning/plan_profile.py``),
      the blocks        the root's unsharded parameters (kept for its backward) and those of
                        SHARD_GRAD_OP blocks, and the most the head and loss held at once in the
                        measured forward (their saved tensors and temporaries)
      start of backward the same with the head's saved tensors and, at the highest moment of the
                        backward of the loss and head, what it held above them and the head's
                        parameters' gradients made by then (they wait for the root's reduction at
                        the end of backward; [Note: The head's gradients] in
                        ``_planning/plan_profile.py``); and the last block's unsharded parameters
                        if FULL_SHARD (the root's pre-backward prefetches them)
      backward of k     the highest of three phases, each with: the blocks after k have freed
                        their activations and hold their sharded gradients or replicate's (copied
                        into the buckets only at the end of backward), the root's parameters used
                        after the blocks their gradients (the head: [Note: The head's gradients]
                        in ``_planning/plan_profile.py``), k has its unsharded parameters and k-1
                        the prefetched ones ([Note: Handle order]).
                        Its backward's highest moment: k's activations (recomputed if
                        checkpointed), the gradient of its outputs, what its measured backward
                        held above its start and its parameters' gradients made by then ([Note:
                        Gradients in a backward] in ``_planning/plan_profile.py``), and the
                        unsharded gradient of the nearest later fully sharded block while its
                        reduction is in flight (released at k's pre-backward when k is fully
                        sharded and checkpointed, else just before k's gradients are
                        concatenated: [Note: Reductions in flight] in ``_runtime/flat_param.py``;
                        replicated blocks between release nothing).
                        Its recomputation (checkpointed): its input, the gradient of its outputs
                        and the most its measured forward held.
                        The concatenation (fully sharded): all its parameters' gradients beside
                        the unsharded gradient they are copied into (or, if larger, that gradient
                        and its reduce-dtype copy), its kept input and its input's gradient.
      end of backward   all gradients, the root's unsharded parameters and gradient: first its
                        parameters' gradients beside the unsharded gradient they are copied into,
                        then that gradient (and its reduce-dtype copy) beside the root's shard
      optimizer step    all gradients, two temporaries of the largest parameter piece (AdamW
                        without foreach; SGD none)
    A block's forward-time peak (its own temporaries) stays below its backward's, which holds the
    same saved tensors and more. Calibrated against benchmarks/memory.py's counting allocator,
    window by window of one step (benchmarks/NOTES.md): the highest moment of each measures within
    a few KB of its prediction less the headroom ([Note: Headroom])."""
    t = _step_terms(s, assignment)
    prof = s.profile
    kept = [int(scale * p.kept_bytes(o.checkpoint)) for p, o in zip(prof.blocks, t.options)]
    zero2 = [c.unsharded if o.strategy is _ZERO2 else 0 for c, o in zip(t.costs, t.options)]
    before, after = int(scale * (prof.before_bytes + prof.batch_bytes)), int(scale * prof.after_bytes)
    base = {"parameters": t.params, "optimizer": t.optimizer}
    prefetched = t.costs[-1].unsharded if t.options and t.options[-1].strategy is _FULL else 0
    in_flight = t.root_unsharded + sum(zero2)
    head_made = min(prof.head_backward_grads, t.head_grad)  # by the head backward's highest moment
    moments = [
        _Moment("forward after the blocks", dict(
            base, gradients=t.buckets, activations=before + sum(kept) + int(scale * prof.head_forward_extra),
            unsharded_in_flight=in_flight, communication=0)),
        _Moment("start of backward", dict(
            base, gradients=t.buckets + (0 if t.head_grad_is_comm else head_made),
            activations=before + sum(kept) + after + int(scale * prof.head_backward_extra),
            unsharded_in_flight=in_flight + prefetched, communication=head_made if t.head_grad_is_comm else 0))]
    moments.extend(max(_backward_phases(s, t, k, kept, zero2, before, scale), key=lambda m: m.total)
                   for k in reversed(range(len(kept))))
    block_grads = t.buckets + sum(c.row.grad_bytes for c, o in zip(t.costs, t.options) if o.api == "fully_shard")
    all_grads = block_grads + t.root_shard_grad
    moments.append(max(  # the root's gradients concatenated, then its reduction issued
        _Moment("end of backward", dict(base, gradients=block_grads + t.late_grads, activations=before,
                                        unsharded_in_flight=t.root_unsharded, communication=t.root_concat)),
        _Moment("end of backward", dict(base, gradients=all_grads + t.late_grads, activations=before,
                                        unsharded_in_flight=t.root_unsharded, communication=t.root_grad)),
        key=lambda m: m.total))
    temporaries = 2 * t.largest_param if s.optimizer in ("adamw", "adam") else 0
    moments.append(_Moment("optimizer step", dict(base, gradients=all_grads, activations=temporaries + before,
                                                  unsharded_in_flight=0, communication=0)))
    for moment in moments:
        moment.parts["other"] = max(OTHER_MIN_BYTES, int(OTHER_FRACTION * moment.total))
    return moments


def _backward_phases(s: _Search, t: _Step, k: int, kept: List[int], zero2: List[int], before: int,
                     scale: float) -> List[_Moment]:
    """Block k's backward ([Note: Peak moments]): its backward's highest moment, its
    recomputation (if checkpointed), the concatenation of its parameters' gradients into its
    unsharded gradient (if fully sharded), in this order."""
    block, options, costs = s.profile.blocks[k], t.options, t.costs
    option, cost = options[k], costs[k]
    later = range(k + 1, len(costs))
    shard_grads = sum(costs[j].row.grad_bytes for j in later if options[j].api == "fully_shard")
    rep_grads = sum(costs[j].replicate_grads for j in later)
    in_flight = t.root_unsharded + sum(zero2[:k + 1])
    if option.strategy is _FULL:
        in_flight += cost.unsharded
    if k > 0 and options[k - 1].strategy is _FULL:
        in_flight += costs[k - 1].unsharded
    head = 0 if t.head_grad_is_comm else t.head_grad
    head_comm = t.head_grad if t.head_grad_is_comm else 0
    # The latest reduction's unsharded gradient is in flight until k's handle releases it: just
    # before k's own gradients are concatenated, or at k's pre-backward when k recomputes first
    # ([Note: Reductions in flight] in _runtime/flat_param.py).
    releases_early = option.api == "fully_shard" and option.checkpoint
    comm = 0 if releases_early else _reduction_in_flight(options, costs, k)
    kept_before = before + sum(kept[:k])
    grads = t.buckets + shard_grads + rep_grads + head

    def phase(gradients: int, activations: int, communication: int) -> _Moment:
        return _Moment(f"backward of {block.fqn}", {
            "parameters": t.params, "optimizer": t.optimizer, "gradients": gradients, "activations": activations,
            "unsharded_in_flight": in_flight, "communication": communication})

    made = block.backward_grads  # its parameters' gradients made by its backward's highest moment
    phases = [phase(grads + (made if option.api == "replicate" else 0),
                    kept_before + int(scale * (block.saved_bytes + block.output_bytes + block.backward_extra)),
                    head_comm + comm + (made if option.api == "fully_shard" else 0))]
    if option.checkpoint:  # the kept input, the arriving gradient and the most its forward held
        phases.append(phase(grads, kept_before + int(scale * (block.input_bytes + block.output_bytes +
                                                               block.forward_extra)), head_comm + comm))
    if cost.flat_grad:  # every gradient made, beside the buffer they are concatenated into; then its reduction
        grad_in = s.profile.blocks[k - 1].output_bytes if k else block.input_bytes  # the gradient of its input
        phases.append(phase(grads, kept_before + (kept[k] if option.checkpoint else 0) + int(scale * grad_in),
                            head_comm + max(cost.param_grads + cost.flat_grad, cost.unsharded_grad)))
    return phases


def _reduction_in_flight(options: Sequence[_Option], costs: Sequence[_Cost], k: int) -> int:
    """Bytes of the unsharded gradient a reduction still holds when block k's backward begins:
    that of the nearest later fully sharded block making one, unless a fully sharded block
    between released it (a checkpointed one, at its pre-backward). ``replicate`` has no handle
    and releases nothing, so a gradient reduced below replicated blocks stays until the next
    fully sharded block's backward, or the root's (4-layer Llama, layers 0-2 replicated, layer 3
    SHARD_GRAD_OP: its 3.16 MB gradient was alive through the backward of layers 2, 1 and 0;
    counted only at layer 2's, the plan measured 4.5% over its prediction)."""
    for j in range(k + 1, len(costs)):
        if options[j].api == "fully_shard" and (costs[j].unsharded_grad or options[j].checkpoint):
            return costs[j].unsharded_grad
    return 0


# ---------------------------------------------------------------------------- choose
def _choose(s: _Search, budget: int, rows: Optional[_Rows] = None) -> Optional[List[_Option]]:
    """The assignment of least cost whose simulated peak fits ``budget``; ``None`` is
    ``replicate(model)``.

    [Note: Greedy choice] ``replicate(model)`` costs least (one all-reduce of the gradients, no
    recomputation), so it is taken whenever it fits. Otherwise, from the root sharded and every
    block on its cheapest option, one block at a time moves to the option that removes the most
    peak bytes per second of cost added, until the peak fits; then each block goes back to the
    cheapest option that still fits. Identical blocks are interchangeable, so only the first
    block of each (option, class, measured bytes) kind is tried, which keeps one step linear in
    the kinds rather than the blocks. The peak is a maximum over moments, not a sum, so an exact
    search over how many blocks take each option would be C(n+5, 5) simulations (20,349 at 16
    blocks); greedy by bytes per second is the knapsack heuristic, and the second pass removes
    the moves the last one made redundant."""
    if s.whole is not None and _simulate(s, None).total <= budget:
        return None
    smallest = [_Option("fully_shard", _FULL, True)] * len(s.blocks)
    if _simulate(s, smallest).total > budget:
        raise ValueError(_infeasible(s, smallest, budget, rows))
    assignment = [s.options[0]] * len(s.blocks)
    peak = _simulate(s, assignment).total
    while peak > budget:
        best: Optional[Tuple[float, int, _Option, int]] = None
        for k in _representatives(s, assignment):
            for option in s.options:
                trial = assignment[:k] + [option] + assignment[k + 1:]
                trial_peak = _simulate(s, trial).total
                if trial_peak >= peak:
                    continue
                added = max(s.seconds(trial) - s.seconds(assignment), 1e-12)
                gain = (peak - trial_peak) / added
                if best is None or gain > best[0]:
                    best = (gain, k, option, trial_peak)
        assert best is not None, "plan: the smallest assignment fits, so a move lowers the peak"
        _, k, option, peak = best
        assignment[k] = option
    return _relax(s, assignment, budget)


def _representatives(s: _Search, assignment: List[_Option]) -> List[int]:
    seen: Set[Tuple[Any, ...]] = set()
    out: List[int] = []
    for k, ((_, block), option) in enumerate(zip(s.blocks, assignment)):
        p = s.profile.blocks[k]
        kind = (option, type(block), p.saved_bytes, p.input_bytes, p.shared_bytes, s.costs[k][option].row.numel)
        if kind not in seen:
            seen.add(kind)
            out.append(k)
    return out


def _relax(s: _Search, assignment: List[_Option], budget: int) -> List[_Option]:
    """Each block to the cheapest option that still fits, over every block again until none
    moves: the plan returned is minimal (no one block can move to a cheaper option and fit)."""
    moved = True
    while moved:
        moved = False
        for k in range(len(assignment)):
            for option in sorted(s.options, key=lambda o: s.seconds(assignment[:k] + [o] + assignment[k + 1:])):
                trial = assignment[:k] + [option] + assignment[k + 1:]
                if s.seconds(trial) < s.seconds(assignment) and _simulate(s, trial).total <= budget:
                    assignment, moved = trial, True
                    break
    return assignment


@dataclass(frozen=True)
class _Rows:
    """The example batch, for the infeasible message's batch: its rows are the leading dimension
    every tensor of it shares; ``measure(batch)`` is the step's profile on another batch (raises
    when the model or ``loss_fn`` cannot run on it, as a ``loss_fn`` holding the targets of the
    example's rows cannot on fewer)."""

    batch: Any
    measure: Callable[[Any], Profile]

    def count(self) -> Optional[int]:
        """The rows of the example batch, or ``None`` when its tensors share no leading dimension."""
        leading = {t.shape[0] for t in tensors_in(self.batch, None) if t.dim()}
        return leading.pop() if len(leading) == 1 else None

    def first(self, rows: int) -> Any:
        """The example batch cut to its first ``rows`` rows."""
        return convert(self.batch, lambda t: t[:rows] if t.dim() else t)


def _infeasible(s: _Search, smallest: List[_Option], budget: int, rows: Optional[_Rows]) -> str:
    """The error text: the smallest peak, then the ranks, then the batch it would take."""
    moment = _simulate(s, smallest)
    parts = ", ".join(f"{k} {_mb(v)}" for k, v in moment.parts.items() if v)
    text = (f"plan: no plan fits {type(s.model).__name__} in memory_budget={budget:,} B per rank at {s.world} ranks: "
            f"the smallest peak is {moment.total:,} B (every block fully_shard(FULL_SHARD) + checkpoint; at the "
            f"{moment.name}: {parts}).")
    for world in (2 ** i for i in range(1, 13)):
        if world <= s.world:
            continue
        wider = _Search(s.model, s.blocks, s.profile, world, s.optimizer, s.mixed_precision, s.bandwidth)
        peak = _simulate(wider, smallest).total
        if peak <= budget:
            text += f" It fits at {world} ranks (peak {peak:,} B)."
            break
    else:
        text += " More ranks alone do not make it fit (up to 4096)."
    bare = _simulate(s, smallest, 0.0).total
    if bare > budget:
        return text + (f" No batch fits at {s.world} ranks: without activations (parameters, gradients, optimizer "
                       f"state and the unsharded and communication buffers alone) the peak is {bare:,} B; raise "
                       "memory_budget.")
    return text + f" At {s.world} ranks, " + _fewer_rows(s, smallest, budget, rows)


def _fewer_rows(s: _Search, smallest: List[_Option], budget: int, rows: Optional[_Rows]) -> str:
    """The most batch rows per rank that fit, measured on the example's first rows; estimated by
    scaling the activations when they cannot be measured ([Note: Fewer rows])."""
    total = rows.count() if rows is not None else None
    if rows is None or total is None or total < 2:
        low, high = 0.0, 1.0
        for _ in range(30):
            mid = (low + high) / 2
            low, high = (mid, high) if _simulate(s, smallest, mid).total <= budget else (low, mid)
        percent = math.floor(low * 1000) / 10  # rounded down: what the message suggests must fit
        what = "has one row" if total == 1 else "has tensors that share no leading dimension"
        return (f"activations at most {percent:.1f}% of the example's fit (its batch {what}: shorter sequences or "
                "smaller inputs); or raise memory_budget.")
    estimate = max((r for r in range(1, total) if _simulate(s, smallest, r / total).total <= budget), default=0)
    try:
        fits, peak = _largest_measured(s, smallest, budget, rows, estimate)
    except (ValueError, TypeError):  # the model or loss_fn cannot run on fewer rows: the estimate it is
        how = "the activations scaled with the rows: loss_fn could not run on fewer rows to measure them"
        if not estimate:
            return f"not even one of the example's {total} rows per rank fits ({how}); raise memory_budget."
        return (f"a per-rank batch of at most {estimate} of the example's {total} rows fits by an estimate ({how}); "
                "or raise memory_budget.")
    if not fits:
        return (f"not even one of the example's {total} rows per rank fits (measured on one row: smallest peak "
                f"{peak:,} B); raise memory_budget.")
    return (f"a per-rank batch of at most {fits} of the example's {total} rows fits (measured on {fits} "
            f"row{'s' if fits > 1 else ''}: smallest peak {peak:,} B); or raise memory_budget.")


def _largest_measured(s: _Search, smallest: List[_Option], budget: int, rows: _Rows, estimate: int) -> Tuple[int, int]:
    """(the most rows that fit, their smallest peak), or (0, the peak on one row).

    [Note: Fewer rows] Activations do not all scale with the rows (a Llama's rotary tables and
    position ids are per token, not per row), so the rows are measured: the fake pass runs on the
    example's first rows. Scaling every activation with the rows never over-counts, so the
    scaled estimate is the most that can fit; one pass checks it, and a bisection below it finds
    the most that do (a few passes)."""
    def peak(count: int) -> int:
        fewer = copy.copy(s)
        fewer.profile = rows.measure(rows.first(count))
        return _simulate(fewer, smallest).total

    if estimate:
        top = peak(estimate)
        if top <= budget:
            return estimate, top
    low, high, found, best = 1, estimate - 1, 0, 0  # above high nothing fits; found fits
    while low <= high:
        mid = (low + high) // 2
        value = peak(mid)
        if value <= budget:
            found, best, low = mid, value, mid + 1
        else:
            high = mid - 1
    return (found, best) if found else (0, peak(1))


# ---------------------------------------------------------------------------- text
def _render(p: MemoryPlan) -> str:
    header = ("module", "api", "strategy", "checkpoint", "prefetch", "saved act.", "input", "fwd ms")
    profiles = {b.fqn: b for b in p.profiles}
    body = []
    for c in p.choices:
        b = profiles.get(c.fqn)
        body.append(((c.fqn or "<root>") + (" (root)" if not c.fqn else ""), c.api, c.strategy,
                     "yes" if c.checkpoint else "no", "yes" if c.prefetch else "no",
                     f"{b.saved_bytes:,}" if b else "-", f"{b.input_bytes:,}" if b else "-",
                     f"{b.forward_seconds * 1e3:.3f}" if b else "-"))
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    numeric = {5, 6, 7}

    def line(cells: Tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [f"composable_shard.plan: world size {p.world_size}, budget {_mb(p.memory_budget)} per rank",
           line(header), line(tuple("-" * w for w in widths)), *(line(row) for row in body)]
    out.append(f"predicted peak per rank {_mb(p.predicted_peak)} at the {p.peak_moment}: " +
               ", ".join(f"{k} {_mb(p.components[k])}" for k in COMPONENTS))
    out.append(f"per step: {_mb(p.bytes_sent)} sent by this rank; cost {p.cost_seconds * 1e3:.2f} ms at "
               f"{p.bandwidth / 1e9:g} GB/s plus recomputation (fwd ms: " +
               ("timed on the device)" if p.profile_source == "measured" else "counted FLOPs at the device model)"))
    return "\n".join(out)


def _mb(nbytes: int) -> str:
    return f"{nbytes:,} B ({nbytes / 1e6:.2f} MB)"
