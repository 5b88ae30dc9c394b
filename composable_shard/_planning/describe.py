"""``describe(model)``: what ``fully_shard`` and ``replicate`` do (or would do) to a model, per rank.

Two sources, one arithmetic:

* **Runtime** (the model already carries ``fully_shard``/``replicate`` states): every fully
  sharded module's handle is read as built (its flat groups' sizes, dtypes, shard group), and
  every ``replicate`` state's parameters and buckets.
* **Plan** (a plain model, possibly on the meta device, no process group needed): the fully
  sharded modules and the parameters each handle would own come from ``fully_shard``'s own
  planning (``_fully_shard_init._select_targets`` and ``_assign_params``, the code ``fully_shard``
  runs before it mutates anything); the handle's ``(dtype, requires_grad, kept in full
  precision)`` grouping is ``flat_param.plan_groups``, the function ``FlatParamHandle`` builds from.

Both become :class:`HandleInfo` / :class:`_GroupInfo` records, from which :func:`_rows`
computes the figures with ``_runtime/shard_math``. The figures are exact for a steady-state training
step (forward, backward, ``optim.step()``), counted the way ``collectives.record_collectives``
counts (bytes this rank sends into each collective):

[Note: Collectives per step]
  per flat group of a fully sharded module, shard group of W ranks, replicate group of R:
  all_gather      input = this rank's chunk in the compute dtype (a group of torchao's float8
                  weights: one byte per element, [Note: float8 all-gather]); 2 per step (forward, and again
                  before backward) under FULL_SHARD/HYBRID_SHARD, 1 under SHARD_GRAD_OP and
                  _HYBRID_SHARD_ZERO2 (kept from forward to backward), 1 for the root (its
                  backward follows its forward at once); none when the shard is the unsharded
                  buffer (W = 1, no cast) or for NO_SHARD (a local cast at most)
  reduce_scatter  input = the padded unsharded gradient in the reduce dtype, once, if W > 1
  all_reduce      the reduced shard across replicas, once, if R > 1 (NO_SHARD: the whole gradient);
                  a float8 group also agrees its weights' amaxes before each all-gather, if W > 1:
                  one all_reduce of 4 bytes per weight
  used flags      per root and (shard group, replicate group) pair, one all_reduce of 4 bytes per
                  original parameter of the groups that require grad, plus 8 (the optimizer-step
                  agreement, [Note: Step agreement] in ``_runtime/watch.py``), in each of the two groups
                  that has more than one rank ("which parameters got a gradient anywhere")
  replicate       one all_reduce per bucket (together the gradients' bytes in the reduce dtype,
                  recorded even at one rank), plus, over more than one rank, one of 4 bytes per
                  parameter and 8 more (used flags and the step agreement)
  The first iteration adds small agreement exchanges (``exchange``, ``all_gather_json``) and
  ``clip_grad_norm_`` (ours or torch's) one all_reduce per shard group, of 4 bytes per sharded
  parameter with a gradient: neither is counted here.

Memory per rank: parameters = each group's chunk (``ceil(N/W)`` elements, the padding included)
in its dtype; gradients = the same chunk for groups that require grad (the compute dtype with
``keep_low_precision_grads``); AdamW state on rank 0 (padding lies on the last ranks, so rank 0
holds the most) = ``exp_avg`` and ``exp_avg_sq`` of every element rank 0 holds plus a 4-byte
``step`` per original parameter. ``replicate`` and unmanaged parameters count in full.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Protocol, Sequence, Set, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._setup import fully_shard_init as _fully_shard_init
from .._runtime import shard_math as _shard_math
from .._runtime.module_state import _FSDPState
from .._runtime.flat_param import compute_dtype_of, plan_groups, reduce_dtype_of
from .._runtime.mixed_precision import full_precision_classes
from .._base.torch_compat import unwrap_compiled
from .._base.pieces import piece_of
from .._base.tree import local_piece
from .._state.model_state_dict import managed_params
from .._runtime.watch import STEP_AGREEMENT_INTS
from ..api import BackwardPrefetch, MixedPrecision, ShardingStrategy
from ..contract import _get_api_state, _get_module_state

REPLICATE_API = "replicate"  # replicate's name in the contract registry (its state is read by that name)


class _ReplicateBucket(Protocol):
    @property
    def nbytes(self) -> int: ...


class _ReplicateState(Protocol):
    """What ``describe`` reads of ``replicate``'s state (``replicate._ReplicateState``), which it
    may not import: ``replicate`` sits above ``describe`` in the import layers."""

    params: List[nn.Parameter]
    buckets: Sequence[_ReplicateBucket]
    world_size: int
    reduce_dtype: Optional[torch.dtype]


# What plan() builds on (the same planning code as describe's, so that describe(model) after
# MemoryPlan.apply reports the figures the plan predicted):
__all__ = ["describe", "ShardingDescription", "ModuleRow", "HandleInfo", "handle_row", "planned_replicate_row",
           "planned_handle", "planned_description", "is_managed", "planned_world_size", "STEP_BYTES", "plan_handles"]

_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
_KEPT_FROM_FORWARD_TO_BACKWARD = {ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2}
STEP_BYTES = 4  # AdamW's float32 ``step`` tensor per parameter; also one used flag (int32)
FLOAT8_AMAX_BYTES = 4  # one float32 amax per float8 weight, agreed before each all-gather


@dataclass(frozen=True)
class _GroupInfo:
    """One flat parameter of a handle: a ``(dtype, requires_grad, full precision)`` group."""

    dtype: torch.dtype  # the original parameters' dtype (the shard's)
    requires_grad: bool
    numel: int  # unpadded elements (shared parameters once)
    num_params: int  # original parameters (shared ones once)
    compute_dtype: torch.dtype  # of the unsharded buffer and the all-gather
    reduce_dtype: torch.dtype  # of the gradient reduction
    float8_dtype: Optional[torch.dtype] = None  # torchao's float8 weights: gathered as these bytes
    aliases_shard: bool = False  # the unsharded buffer is the shard itself: nothing to gather (W = 1, no cast)

    @property
    def gather_dtype(self) -> torch.dtype:
        """What the all-gather moves: float8 bytes for a float8-gathered group (see [Note: float8
        all-gather] in ``_base/float8.py``), else the compute dtype."""
        return self.float8_dtype if self.float8_dtype is not None else self.compute_dtype

    def label(self) -> str:
        name = str(self.dtype).replace("torch.", "")
        if self.compute_dtype != self.dtype:
            name += f"->{str(self.compute_dtype).replace('torch.', '')}"
        if self.float8_dtype is not None:
            name += f" (gathered as {str(self.float8_dtype).replace('torch.', '')})"
        return name if self.requires_grad else f"{name} (frozen)"


@dataclass(frozen=True)
class HandleInfo:
    """A fully sharded module, as built or as planned."""

    fqn: str
    strategy: ShardingStrategy
    is_root: bool
    shard_world: int  # ranks one flat parameter is sharded over
    replicate_world: int  # replicas of each shard (hybrid, NO_SHARD)
    gathers_in_group: bool  # False for NO_SHARD: the unsharded buffer is a local cast of the shard
    keep_low_precision_grads: bool
    groups: Tuple[_GroupInfo, ...]
    flag_key: Tuple[Any, ...]  # (root, shard group, replicate group): one used-flags all_reduce per key
    owned: FrozenSet[int]  # ids of the original parameters its handle flattens


@dataclass(frozen=True)
class ModuleRow:
    """One line of :class:`ShardingDescription`: a fully sharded or replicated module, or the
    parameters no data-parallel API manages (``api == "none"``). Byte figures are per rank
    (AdamW state: rank 0's, the largest); ``collectives`` maps a kind to ``(count, bytes)`` per
    training step, as ``collectives.record_collectives`` counts them."""

    fqn: str
    api: str
    strategy: str
    is_root: bool
    numel: int  # parameter elements this module's handle (or replicate call) manages
    shard_numel: int  # elements stored per rank (padding included)
    padding: int  # elements added so that each flat parameter divides by its shard group
    dtype_groups: Tuple[str, ...]
    param_bytes: int
    grad_bytes: int
    adamw_bytes: int
    collectives: Dict[str, Tuple[int, int]] = field(default_factory=dict)
    optimizer_bytes: Optional[int] = None  # state the optimizers given to describe() hold for these parameters here


@dataclass(frozen=True)
class ShardingDescription:
    """What :func:`describe` returns: ``rows`` in DFS (``named_modules``) order, totals as
    properties, and ``str()`` a table. ``planned`` is True when computed from a plan (a model
    nothing was applied to) rather than from the runtime's handles."""

    world_size: int
    planned: bool
    rows: Tuple[ModuleRow, ...]
    flag_collectives: Tuple[int, int]  # (count, bytes) of fully_shard's used-flags all_reduces per step
    # per tensor-parallel (DTensor) parameter: "fqn: global shape, placements on mesh dims -> this rank's piece"
    tensor_parallel: Tuple[str, ...] = ()

    @property
    def param_bytes(self) -> int:
        """Parameter bytes held per rank."""
        return sum(r.param_bytes for r in self.rows)

    @property
    def grad_bytes(self) -> int:
        """Gradient bytes held per rank after backward."""
        return sum(r.grad_bytes for r in self.rows)

    @property
    def adamw_bytes(self) -> int:
        """AdamW state bytes on rank 0 (``exp_avg``, ``exp_avg_sq``, ``step``)."""
        return sum(r.adamw_bytes for r in self.rows)

    @property
    def optimizer_bytes(self) -> Optional[int]:
        """State bytes this rank's optimizers given to :func:`describe` hold (None if none were given)."""
        held = [r.optimizer_bytes for r in self.rows if r.optimizer_bytes is not None]
        return sum(held) if held else None

    def collective_count(self, kind: Optional[str] = None) -> int:
        """Collectives of ``kind`` (all kinds if None) this rank issues per training step."""
        return sum(c for k, (c, _) in self._by_kind().items() if kind is None or k == kind)

    def collective_bytes(self, kind: Optional[str] = None) -> int:
        """Bytes this rank sends into collectives of ``kind`` (all if None) per training step."""
        return sum(b for k, (_, b) in self._by_kind().items() if kind is None or k == kind)

    def _by_kind(self) -> Dict[str, Tuple[int, int]]:
        out = {kind: (0, 0) for kind in _KINDS}
        for row in self.rows:
            for kind, (count, nbytes) in row.collectives.items():
                out[kind] = (out[kind][0] + count, out[kind][1] + nbytes)
        out["all_reduce"] = (out["all_reduce"][0] + self.flag_collectives[0],
                             out["all_reduce"][1] + self.flag_collectives[1])
        return out

    def __str__(self) -> str:
        return _render(self)


def describe(model: nn.Module, *, world_size: Optional[int] = None, policy: Any = None,
             strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
             mixed_precision: Optional[MixedPrecision] = None,
             ignored_modules: Optional[Iterable[nn.Module]] = None,
             optimizers: Iterable[torch.optim.Optimizer] = ()) -> ShardingDescription:
    """Per-rank memory and per-step communication of ``model`` under ``fully_shard``/``replicate``.

    On a model that carries ``fully_shard`` or ``replicate`` already, the handles and buckets
    are read as built (the planning arguments must then be left out). On a plain model (meta
    device is fine, no process group needed) it plans ``fully_shard(model, policy=policy,
    strategy=strategy, mixed_precision=mixed_precision, ignored_modules=ignored_modules)`` at
    ``world_size`` ranks with ``fully_shard``'s own planning code. ``print()`` the result for a
    table in DFS order (FQN, parameters, elements per rank, padding, dtype groups, strategy)
    with totals: parameter, gradient and AdamW bytes per rank, collectives per training step.

    Example::

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        print(describe(model))                 # after sharding: the runtime's handles
        with torch.device("meta"):
            plain = GPT()
        d = describe(plain, world_size=8, policy=ModuleWrapPolicy({Block}))   # before: a plan
        d.param_bytes, d.collective_bytes("all_gather")

    Args:
        model: a sharded model, or a plain one to plan for.
        world_size: ranks to plan for (default: the current process group's size).
        policy: the ``policy`` argument of the planned ``fully_shard`` call.
        strategy: FULL_SHARD, SHARD_GRAD_OP or NO_SHARD (hybrid needs real groups).
        mixed_precision: the planned call's :class:`MixedPrecision`.
        ignored_modules: the planned call's ``ignored_modules``.
        optimizers: on a sharded model, optimizers (e.g. ``optim.Muon`` and an AdamW) whose state
            bytes for each row's parameters this rank holds now are reported (``optimizer_bytes``).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: planning arguments given for a sharded model; no ``world_size`` and no
            process group; a hybrid strategy to plan; anything ``fully_shard`` itself refuses.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"describe: model must be an nn.Module, got {type(model).__name__}")
    model = unwrap_compiled(model)  # torch.compile's wrapper: the names without its prefix
    if is_managed(model):
        if world_size is not None or policy is not None or mixed_precision is not None or ignored_modules is not None \
                or strategy is not ShardingStrategy.FULL_SHARD:
            raise ValueError("describe: the model is already sharded, so its handles are read as built; leave out "
                             "world_size, policy, strategy, mixed_precision and ignored_modules (they plan a plain "
                             "model)")
        handles, replicas = _runtime_handles(model), _runtime_replicas(model)
        world = dist.get_world_size() if dist.is_initialized() else 1
        described = dataclasses.replace(_description(model, world, False, handles, replicas),
                                        tensor_parallel=_tensor_parallel_pieces(model))
        return _with_optimizer_state(model, described, handles, replicas, list(optimizers))
    if list(optimizers):
        raise ValueError("describe: optimizers=... reads the state of a sharded model's optimizers; plan a plain "
                         "model without it (its AdamW figure is adamw_bytes)")
    world = planned_world_size(world_size)
    handles = plan_handles(model, world, policy, strategy, mixed_precision, ignored_modules)
    return _description(model, world, True, handles, {})


# ---------------------------------------------------------------------------- runtime
def is_managed(model: nn.Module) -> bool:
    return any(_get_module_state(m, _FSDPState) is not None or _get_api_state(m, REPLICATE_API) is not None
               for m in model.modules())


def _runtime_handles(model: nn.Module) -> Dict[int, HandleInfo]:
    """id(fully sharded module) -> its handle as built."""
    states: List[Tuple[str, nn.Module, _FSDPState]] = []
    seen: Set[int] = set()
    names = {id(m): fqn for fqn, m in model.named_modules()}
    for fqn, m in model.named_modules():
        state = _get_module_state(m, _FSDPState)
        owner = state is not None and (state.module is m or (state.members is not None and state.members[0] is m))
        if state is not None and owner and id(state) not in seen:  # a group of modules: one row, its members named
            seen.add(id(state))
            if state.members is not None:
                fqn = "+".join(names.get(id(member), "?") for member in state.members)
            states.append((fqn, m, state))
    out: Dict[int, HandleInfo] = {}
    for fqn, m, state in states:
        root = _runtime_root(m, state, [other for _, other, _ in states])
        replicate_world = dist.get_world_size(state.replicate_group) if state.replicate_group is not None else 1
        mp = state.mixed_precision
        groups = tuple(_GroupInfo(g.flat_param.dtype, g.requires_grad, int(g.flat_param._unpadded_unsharded_size.numel()),
                                  len(g.orig_params), g.compute_dtype, reduce_dtype_of(mp, g.compute_dtype, g.full_precision),
                                  g.float8.dtype if g.float8 is not None else None, g.aliases_shard)
                       for g in (state.handle.groups if state.handle is not None else []))
        out[id(m)] = HandleInfo(
            fqn, state.strategy, root is m, state.world_size, replicate_world, state.process_group is not None, bool(mp is not None and mp.keep_low_precision_grads),
            groups, (id(root), id(state.process_group), id(state.replicate_group)),
            frozenset(id(p) for g in (state.handle.groups if state.handle is not None else []) for p in g.orig_params))
    return out


def _runtime_root(module: nn.Module, state: _FSDPState, sharded: List[nn.Module]) -> nn.Module:
    """The root of ``module``'s tree: the outermost fully sharded module containing it (the one
    whose forward runs first, as lazy init decides; read from the state once decided)."""
    if state.root is not None and state.root.module is not None:
        return state.root.module
    outer = [m for m in sharded if any(sub is module for sub in m.modules())]
    return next(m for m in outer if not any(o is not m and any(s is m for s in o.modules()) for o in outer))


def _runtime_replicas(model: nn.Module) -> Dict[int, _ReplicateState]:
    out: Dict[int, _ReplicateState] = {}
    seen: Set[int] = set()
    for m in model.modules():
        state = _get_api_state(m, REPLICATE_API)
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            out[id(m)] = state
    return out


def _with_optimizer_state(model: nn.Module, d: ShardingDescription, handles: Dict[int, HandleInfo],
                          replicas: Dict[int, _ReplicateState], optimizers: List[torch.optim.Optimizer]
                          ) -> ShardingDescription:
    """``d`` with each row's ``optimizer_bytes``: the tensors ``optimizers`` keep in their state
    for the row's parameters (on this rank: sharded parameters are this rank's slices)."""
    if not optimizers:
        return d
    state: Dict[int, int] = {}
    for opt in optimizers:
        for p, entries in opt.state.items():
            state[id(p)] = state.get(id(p), 0) + sum(local_piece(v).numel() * v.element_size() for v in entries.values()
                                                     if isinstance(v, torch.Tensor))
    owners = {h.fqn: h.owned for h in handles.values()}
    owners.update({fqn: frozenset(id(p) for p in replicas[id(m)].params)
                   for fqn, m in model.named_modules() if id(m) in replicas})
    claimed = frozenset().union(*owners.values())
    rest = frozenset(id(p) for p in model.parameters() if id(p) not in claimed)
    rows = tuple(dataclasses.replace(r, optimizer_bytes=sum(state.get(i, 0) for i in (
        rest if r.api == "none" else owners.get(r.fqn, frozenset())))) for r in d.rows)
    return dataclasses.replace(d, rows=rows)


# ---------------------------------------------------------------------------- plan
def planned_world_size(world_size: Optional[int]) -> int:
    if world_size is None:
        if not dist.is_initialized():
            raise ValueError("describe: pass world_size=... to plan a model without a process group")
        return dist.get_world_size()
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"describe: world_size must be an int >= 1, got {world_size!r}")
    return world_size


def plan_handles(model: nn.Module, world: int, policy: Any, strategy: ShardingStrategy,
                  mixed_precision: Optional[MixedPrecision], ignored_modules: Optional[Iterable[nn.Module]]
                  ) -> Dict[int, HandleInfo]:
    """``fully_shard``'s own plan (targets, parameter ownership), without a process group."""
    if not isinstance(strategy, ShardingStrategy):
        raise ValueError(f"describe: strategy must be a ShardingStrategy, got {strategy!r}")
    if strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        raise ValueError(f"describe: planning {strategy.name} needs the shard and replicate groups; apply "
                         "fully_shard and describe the sharded model instead")
    ignored = _fully_shard_init._expand_ignored_modules(model, list(ignored_modules or []), None)
    plan = _fully_shard_init.Plan(model, [], _fully_shard_init._ignored_params(ignored, None), ignored, torch.device("cpu"),
                            None, False, None)
    config: Dict[str, Any] = {"strategy": strategy, "mixed_precision": mixed_precision, "cpu_offload": None,
                              "forward_prefetch": False, "backward_prefetch": BackwardPrefetch.BACKWARD_PRE,
                              "limit_all_gathers": True}
    plan.targets = _fully_shard_init._select_targets(plan, policy, config)
    _fully_shard_init._assign_params(plan)
    out: Dict[int, HandleInfo] = {}
    for target in plan.targets:
        target_strategy: ShardingStrategy = target.config["strategy"]
        if target_strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
            raise ValueError(f"describe: the policy asks {target_strategy.name} for {target.fqn!r}; planning hybrid "
                             "sharding needs real groups")
        no_shard = target_strategy is ShardingStrategy.NO_SHARD
        mp: Optional[MixedPrecision] = target.config["mixed_precision"]
        shard_world = 1 if no_shard else world
        groups = _plan_groups(target.module, target.params, mp, shard_world)
        out[id(target.module)] = HandleInfo(
            target.fqn, target_strategy, target.module is model, shard_world, world if no_shard else 1, not no_shard, bool(mp is not None and mp.keep_low_precision_grads), groups,
            (id(model), no_shard), frozenset(id(p) for p in target.params))
    return out


def _plan_groups(module: nn.Module, params: List[nn.Parameter], mp: Optional[MixedPrecision],
                 shard_world: int) -> Tuple[_GroupInfo, ...]:
    """The flat groups ``FlatParamHandle(params, module, ...)`` builds: ``plan_groups``'s."""
    param_dtype = mp.param_dtype if mp is not None else None
    out: List[_GroupInfo] = []
    for (dtype, requires_grad, full_precision, float8), members in plan_groups(module, params, param_dtype,
                                                                               full_precision_classes(mp))[0].items():
        compute = compute_dtype_of(dtype, param_dtype, full_precision)
        out.append(_GroupInfo(dtype, requires_grad, sum(p.numel() for p, _ in members), len(members), compute,
                              reduce_dtype_of(mp, compute, full_precision), float8,
                              shard_world == 1 and compute == dtype and float8 is None))
    return tuple(out)


# ---------------------------------------------------------------------------- figures
def _description(model: nn.Module, world: int, planned: bool, handles: Dict[int, HandleInfo],
                 replicas: Dict[int, _ReplicateState]) -> ShardingDescription:
    rows: List[ModuleRow] = []
    for fqn, m in model.named_modules():
        if id(m) in handles:
            rows.append(handle_row(handles[id(m)]))
        if id(m) in replicas:
            rows.append(_replicate_row(fqn, replicas[id(m)]))
    unmanaged = _unmanaged_params(model, handles, replicas)
    if unmanaged:
        rows.append(_full_row("(not managed)", "none", "local", unmanaged, None, 0, {}))
    flags: Dict[Tuple[Any, ...], int] = {}
    flag_groups: Dict[Tuple[Any, ...], int] = {}
    for h in handles.values():
        flags[h.flag_key] = flags.get(h.flag_key, 0) + sum(g.num_params for g in h.groups if g.requires_grad)
        flag_groups[h.flag_key] = (h.shard_world > 1) + (h.replicate_world > 1)
    count = sum(flag_groups[k] for k, n in flags.items() if n)
    nbytes = sum(flag_groups[k] * (n + STEP_AGREEMENT_INTS) * STEP_BYTES for k, n in flags.items() if n)
    return ShardingDescription(world, planned, tuple(rows), (count, nbytes))


def handle_row(h: HandleInfo) -> ModuleRow:
    numel = padded = chunk = param_bytes = grad_bytes = adamw = 0
    collectives = {kind: (0, 0) for kind in _KINDS}

    def add(kind: str, count: int, nbytes: int) -> None:
        collectives[kind] = (collectives[kind][0] + count, collectives[kind][1] + count * nbytes)

    gathers = 1 if h.is_root or h.strategy in _KEPT_FROM_FORWARD_TO_BACKWARD else 2
    for g in h.groups:
        g_padded = _shard_math.padded_numel(g.numel, h.shard_world)
        g_chunk = _shard_math.chunk_numel(g.numel, h.shard_world)
        start, end = _shard_math.chunk_bounds(g.numel, h.shard_world, 0)
        numel, padded, chunk = numel + g.numel, padded + g_padded, chunk + g_chunk
        param_bytes += g_chunk * _itemsize(g.dtype)
        if h.gathers_in_group and not g.aliases_shard:
            add("all_gather", gathers, g_chunk * _itemsize(g.gather_dtype))
        if g.float8_dtype is not None and h.shard_world > 1:  # each gather agrees the weights' amaxes first
            add("all_reduce", gathers, FLOAT8_AMAX_BYTES * g.num_params)
        if not g.requires_grad:
            continue
        grad_dtype = g.compute_dtype if h.keep_low_precision_grads else g.dtype
        grad_bytes += g_chunk * _itemsize(grad_dtype)
        adamw += 2 * (min(end, g.numel) - start) * _itemsize(g.dtype) + STEP_BYTES * g.num_params
        if h.shard_world > 1:
            add("reduce_scatter", 1, g_padded * _itemsize(g.reduce_dtype))
        if h.replicate_world > 1:
            add("all_reduce", 1, g_chunk * _itemsize(g.reduce_dtype))
    return ModuleRow(h.fqn, "fully_shard", h.strategy.name, h.is_root, numel, chunk, padded - numel,
                     tuple(g.label() for g in h.groups), param_bytes, grad_bytes, adamw,
                     {k: v for k, v in collectives.items() if v[0]})


def _replicate_row(fqn: str, state: _ReplicateState) -> ModuleRow:
    bucket_bytes = sum(b.nbytes for b in state.buckets)
    flags = 1 if state.world_size > 1 else 0  # the used flags' all_reduce (skipped over one rank)
    collectives = {"all_reduce": (len(state.buckets) + flags,
                                  bucket_bytes + flags * STEP_BYTES * (len(state.params) + STEP_AGREEMENT_INTS))}
    return _full_row(fqn, "replicate", "replicate", state.params, state.reduce_dtype, bucket_bytes, collectives)


def _full_row(fqn: str, api: str, strategy: str, params: List[nn.Parameter], reduce_dtype: Optional[torch.dtype],
              bucket_bytes: int, collectives: Dict[str, Tuple[int, int]]) -> ModuleRow:
    """Parameters every rank of the data-parallel group holds in full (``replicate``'s, or no
    API's); a tensor-parallel parameter's bytes are its piece's on this rank."""
    trained = [p for p in params if p.requires_grad]
    here = {id(p): local_piece(p).numel() for p in params}
    param_bytes = sum(here[id(p)] * _itemsize(p.dtype) for p in params)
    # replicate's buckets hold one parameter dtype each (``replicate._build_buckets``): a parameter whose dtype is the
    # reduction's gets a bucket slot as its .grad, any other one a .grad of its own beside the bucket
    own_grads = [p for p in trained if api != "replicate" or reduce_dtype not in (None, p.dtype)]
    grad_bytes = bucket_bytes + sum(here[id(p)] * _itemsize(p.dtype) for p in own_grads)
    adamw = sum(2 * here[id(p)] * _itemsize(p.dtype) + STEP_BYTES for p in trained)
    dtypes = tuple(dict.fromkeys(str(p.dtype).replace("torch.", "") for p in params))
    numel, per_rank = sum(p.numel() for p in params), sum(here.values())
    return ModuleRow(fqn, api, strategy, False, numel, per_rank, 0, dtypes, param_bytes, grad_bytes, adamw, collectives)


def _unmanaged_params(model: nn.Module, handles: Dict[int, HandleInfo],
                      replicas: Dict[int, _ReplicateState]) -> List[nn.Parameter]:
    """Parameters of ``model`` no handle and no replicate call manages (ignored ones)."""
    owned = {i for h in handles.values() for i in h.owned}
    owned.update(id(p) for state in replicas.values() for p in state.params)
    return [p for p in model.parameters() if id(p) not in owned]


def _itemsize(dtype: Optional[torch.dtype]) -> int:
    return 0 if dtype is None else dtype.itemsize


# ---------------------------------------------------------------------------- text
def _render(d: ShardingDescription) -> str:
    header = ("module", "api", "strategy", "params", "per rank", "padding", "dtype groups")
    body = [((r.fqn or "<root>") + (" (root)" if r.is_root and r.fqn else ""), r.api, r.strategy, f"{r.numel:,}",
             f"{r.shard_numel:,}", f"{r.padding:,}", ", ".join(r.dtype_groups) or "-") for r in d.rows]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    numeric = {3, 4, 5}

    def line(cells: Tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    source = "planned without a process group" if d.planned else "read from the runtime's handles"
    out = [f"composable_shard.describe: world size {d.world_size}, {source}", line(header),
           line(tuple("-" * w for w in widths)), *(line(row) for row in body)]
    out.append(f"per rank: parameters {_mb(d.param_bytes)}, gradients {_mb(d.grad_bytes)}, "
               f"AdamW state {_mb(d.adamw_bytes)} (rank 0)")
    if d.optimizer_bytes is not None:
        out.append(f"optimizer state held now (this rank, the optimizers given): {_mb(d.optimizer_bytes)}")
    comm = ", ".join(f"{kind} x{d.collective_count(kind)} {_mb(d.collective_bytes(kind))}" for kind in _KINDS
                     if d.collective_count(kind))
    out.append(f"collectives per training step (bytes this rank sends): {comm or 'none'}")
    if d.tensor_parallel:
        out.append(f"tensor-parallel parameters ({len(d.tensor_parallel)}; the figures above count this rank's pieces):")
        out += [f"  {line}" for line in d.tensor_parallel]
    return "\n".join(out)


def _tensor_parallel_pieces(model: nn.Module) -> Tuple[str, ...]:
    """One line per tensor-parallel parameter of a sharded ``model``: a ``DTensor`` ``replicate``
    averages, or a piece a fully sharded module flattened (its slot holds a plain parameter)."""
    lines = []
    for fqn, m in model.named_modules():
        managed = managed_params(m)
        for name, p in m.named_parameters(recurse=False):
            where = managed.get(name)
            piece = where.piece if where is not None else (piece_of(p) if isinstance(p, DTensor) else None)
            if piece is not None:
                lines.append(f"{fqn + '.' if fqn else ''}{name}: {tuple(piece.shape)}, {', '.join(map(repr, piece.placements))} "
                             f"on {piece.dims} -> this rank's piece {piece.sizes} at {piece.offsets}")
    return tuple(lines)


def _mb(nbytes: int) -> str:
    return f"{nbytes:,} B ({nbytes / 1e6:.2f} MB)"


# ---------------------------------------------------------------------------- plan() (plan.py)
def planned_handle(model: nn.Module, module: nn.Module, fqn: str, world: int, strategy: ShardingStrategy,
                    mixed_precision: Optional[MixedPrecision], ignored_modules: Iterable[nn.Module] = ()
                    ) -> HandleInfo:
    """The handle ``fully_shard(module, strategy=..., mixed_precision=...)`` builds when each
    module is annotated by its own call, children first, under ``model``'s root: ``fully_shard``'s
    planning of ``module`` alone (its annotated children passed as ``ignored_modules``, whose
    parameters it then does not own), placed in ``model``'s tree (its FQN, root or not, the
    root's used-flags key)."""
    info = plan_handles(module, world, None, strategy, mixed_precision, list(ignored_modules))[id(module)]
    return dataclasses.replace(info, fqn=fqn, is_root=module is model, flag_key=(id(model), info.flag_key[1]))


def planned_replicate_row(fqn: str, module: nn.Module, world: int, reduce_dtype: Optional[torch.dtype]) -> ModuleRow:
    """The row :func:`_replicate_row` reads from ``replicate(module)``'s state, computed before
    the call: its managed parameters (those requiring grad, once), one bucket per 25 MiB and
    parameter dtype in reverse registration order (the first closing at 1 MiB, as ``replicate._build_buckets``;
    the count may change when buckets are rebuilt after the first backward, the bytes do not)."""
    params = list(dict.fromkeys(p for p in module.parameters() if p.requires_grad))
    bucket_bytes = sum(p.numel() * (reduce_dtype or p.dtype).itemsize for p in params)
    buckets = 0
    open_bytes: Dict[torch.dtype, int] = {}  # one open bucket per parameter dtype
    for p in reversed(params):
        nbytes = open_bytes.pop(p.dtype, 0) + p.numel() * (reduce_dtype or p.dtype).itemsize
        if nbytes >= (_REPLICATE_BUCKET_BYTES if buckets else _REPLICATE_FIRST_BUCKET_BYTES):
            buckets += 1
        else:
            open_bytes[p.dtype] = nbytes
    buckets += len(open_bytes)
    flags = 1 if world > 1 else 0
    collectives = {"all_reduce": (buckets + flags, bucket_bytes + flags * STEP_BYTES * (len(params) + STEP_AGREEMENT_INTS))}
    return _full_row(fqn, "replicate", "replicate", params, reduce_dtype, bucket_bytes, collectives)


def planned_description(model: nn.Module, world: int, handles: Dict[int, HandleInfo],
                         replicated: Dict[int, ModuleRow], replicated_params: Set[int]) -> ShardingDescription:
    """What :func:`describe` reads from ``model`` once the planned handles (``fully_shard`` calls)
    and ``replicate`` calls (their rows; ``replicated_params`` the ids of the parameters they
    manage) are applied: rows in DFS order, fully_shard's used-flags all-reduces as
    :func:`_description` counts them."""
    flags = _description(model, world, True, handles, {}).flag_collectives
    rows: List[ModuleRow] = []
    for _, m in model.named_modules():
        if id(m) in handles:
            rows.append(handle_row(handles[id(m)]))
        if id(m) in replicated:
            rows.append(replicated[id(m)])
    owned = {i for h in handles.values() for i in h.owned} | replicated_params
    unmanaged = [p for p in model.parameters() if id(p) not in owned]
    if unmanaged:
        rows.append(_full_row("(not managed)", "none", "local", unmanaged, None, 0, {}))
    return ShardingDescription(world, True, tuple(rows), flags)


_REPLICATE_BUCKET_BYTES = 25 * 1024 * 1024  # replicate's default bucket_cap_mb=25.0
_REPLICATE_FIRST_BUCKET_BYTES = 1024 * 1024  # replicate's first bucket closes at 1 MiB
