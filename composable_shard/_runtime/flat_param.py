"""Flat parameters and their handle: flattening, views, storage alloc/free, gradients.

A fully sharded module owns one :class:`FlatParamHandle` over the parameters of its subtree
that no nested fully sharded module owns. The handle groups those parameters by
``(dtype, requires_grad)``; each group is one :class:`FlatParameter` (this rank's shard, the
storage the optimizer updates through the original parameters) plus one padded unsharded
buffer that all-gathers write into and the module computes on.

[Note: Views]
* Idle: each original ``nn.Parameter`` is registered on its module and its data is a 1-D view
  of this rank's slice of the shard (possibly empty). An optimizer built on
  ``model.parameters()`` therefore steps the shard in place.
* Forward/backward: the module's slot holds a full-shape plain-tensor view of
  ``padded_unsharded_flat`` (a leaf requiring grad), made with one ``torch.split`` so that
  autograd's backward of the split writes the whole padded gradient in one buffer: that buffer
  is the reduce-scatter's input, with no copy.
* The all-gather writes into ``padded_unsharded_flat.data`` (an alias with its own version
  counter), so refilling the storage before backward does not trip autograd's version check.
* When the shard group has one rank and no dtype cast is needed, the unsharded buffer *is* the
  shard (no all-gather, nothing freed).

[Note: Views made in backward]
The pre-backward hook installs the views again, and autograd runs hooks with grad mode off.
A view made with grad mode off reports ``requires_grad=True`` but is cut from its base:
operations on it neither save what a weight gradient needs nor route a gradient to the flat
buffer. Activation checkpointing recomputes the forward on exactly these views, so the views
are always made with grad mode on: a reentrant recomputation then sends its gradients into
the flat buffer, and a non-reentrant one saves the same tensors as the original forward.

[Note: Gradients follow the user]
* After a synced backward each original parameter's ``.grad`` is a view of the group's sharded
  gradient (``None`` for a parameter that requires no grad or got no gradient on any rank).
  The handle keeps only a weak reference to that buffer: the views own it, so
  ``zero_grad(set_to_none=True)`` frees it at once, as it frees a plain model's gradients; with
  ``set_to_none=False`` the zeroed views keep it and the next backward accumulates into it.
* The next backward adds to whatever ``.grad`` holds, per parameter, as autograd does: ``None``
  starts from zero, our view accumulates in place, a tensor the user assigned is added to.
* Between unsynced backwards (``set_requires_gradient_sync(False)``) each original parameter
  that got a gradient has as ``.grad`` this rank's full-shape local gradient sum: a view of
  the kept unreduced gradient (``group.unreduced_grad``), as torch's FSDP with
  ``use_orig_params=True`` gives. It is summed in the reduce dtype when that is wider than the
  compute dtype (fp32 under ``param_dtype=bf16, reduce_dtype=fp32``, as torch's FSDP2 keeps
  it), else in the compute dtype. Its shape (and possibly dtype) differs from the sharded
  parameter's, so it is installed through ``.data`` (autograd's ``.grad`` setter checks
  both). What ``.grad`` held before is kept aside (``grads_before_views``). The next
  backward of the group first folds the views back (:meth:`FlatParamHandle.take_unsharded_grad`):
  a view the user left in place (possibly scaled in place) stays in the sum, ``None`` drops
  that parameter's sum (``zero_grad()``), another tensor replaces it (where parameters are whole;
  refused on a real shard: [Note: A tensor of the user's in place of an unsynced sum]); then ``.grad`` is what
  it was before the views, so the synced path above adds it.

[Note: CPU offload]  ``CPUOffload(offload_params=True)``: each shard (``flat_param``) lives on the
CPU, pinned when the compute device is a GPU, so the original parameters, their ``.grad`` views
and the optimizer's state are CPU tensors and the optimizer steps on the CPU.
* Unshard: the shard is copied to the compute device (``non_blocking`` from pinned memory, on
  the compute stream, which the all-gather stream then waits for) and gathered from there;
  the copy lives until the gather is waited. The unsharded buffer never aliases the shard.
* Reduce: the averaged gradient shard (on the compute device) is copied into a new host
  buffer without waiting (``landing_grad``, an event recorded after the copy); the end of
  backward waits for that event (a CPU sync, needed anyway before a CPU optimizer reads the
  gradient) and only then accumulates it into ``.grad`` as above. Every earlier copy from a
  pinned shard was queued on the same stream before that event, so by the time the optimizer
  writes the shards no copy still reads them.
* Collectives outside the step (``unshard_params``, full state dicts) copy the shard to the
  compute device first: NCCL takes device tensors only.
On a CPU compute device the copies are CPU to CPU and the events absent, but the same path runs
(host buffer, accumulation at the end of backward), which is what the CPU tests check.
``device_id`` moves buffers to the device but leaves offloaded parameters on the CPU, so the
whole model never has to fit on the device.

[Note: Tensor-parallel pieces]  A ``DTensor`` parameter (tensor parallelism inside each
data-parallel rank, on a mesh that shares no rank with the shard group) is flattened as its
local piece: ``_shapes``/``_numels`` are the piece's, so the shard group shards the pieces
(ceil(local N / W) elements per rank) and reduces their gradients, and tensor parallelism's
collectives are never ours. Its :class:`Piece` (``_pieces``) says where the piece lies.
* Idle: a plain 1-D parameter (made by fully_shard, registered in the ``DTensor``'s slots) is the
  piece's slice of the shard, as any other parameter's; the optimizer steps it.
* Forward/backward: the slot holds ``DTensor.from_local`` of the piece's view of the unsharded
  buffer, with the parameter's placements, so tensor parallelism's hooks and collectives run
  unchanged; ``from_local``'s backward puts the piece's gradient (a ``Partial`` one summed first,
  as SequenceParallel's norms give) into the flat gradient.
* Norms (clipping) of a piece's gradient are completed over the mesh dimensions that shard it
  (:func:`pieces.shard_groups`); state dicts describe pieces in global coordinates.
* ``unshard_params``: the slot holds a ``DTensor`` parameter over the piece's view of the gathered
  buffer, the plain parameter back on exit ([Note: Tensor-parallel parameters under
  unshard_params] in ``_state/unshard_params.py``).

[Note: The handle owns its transitions]  The runtime's hooks (``_runtime/hooks.py``) decide
*when*; the handle does each step of a parameter's life itself, as a method: ``unshard``
(``issue_gathers`` + ``wait_gathers`` + views), ``reshard``, ``reduce`` (a :class:`Reduction`),
``release_earlier_reductions``, ``accumulate_sharded_grad``, ``attach_grads``; every change of
its ``training_state`` goes through ``enter`` and the :data:`TRANSITIONS` table. It reads its
process groups, divisor and streams from its owner's state (:class:`_Owner`) and registers no
hooks but the autograd pre-hook of its own split.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, NamedTuple, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import collectives as _collectives
from . import shard_math as _shard_math
from .interop import ShardedGrad, as_sharded_grad, shard_source
from . import watch as _watch
from .._base.sharded_reads import stand_in_for
from .streams import Streams
from .._base import float8 as _float8
from .._base.pieces import Piece, as_dtensor, piece_of, shard_groups, take_piece
from .._base.torch_compat import (current_graph_task, has_grad_hooks, is_view_of, set_module_tensor, set_module_tensors,
                                  versions_sum)

__all__ = ["FlatParameter", "FlatParamHandle", "HandleTrainingState", "TRANSITIONS", "ParamInfo", "SharedParamInfo", "FlatGroup", "set_grad_of_any_shape",
           "plan_groups", "norm_groups", "compute_dtype_of", "reduce_dtype_of", "take_pending_init_values", "param_list"]


class HandleTrainingState(enum.Enum):
    """Where a handle is in one training step (see [Note: Life of a parameter])."""

    IDLE = enum.auto()
    FORWARD = enum.auto()
    RECOMPUTE = enum.auto()  # activation checkpointing runs its forward again inside a backward
    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()
    SUMMON_FULL_PARAMS = enum.auto()


_S = HandleTrainingState
TRANSITIONS: Dict[HandleTrainingState, FrozenSet[HandleTrainingState]] = {
    # [Note: Handle transitions]  The only changes of a handle's training_state; every one goes
    # through FlatParamHandle.enter, which raises on any other, naming both states.
    _S.IDLE: frozenset({_S.FORWARD, _S.BACKWARD_PRE, _S.RECOMPUTE, _S.SUMMON_FULL_PARAMS}),
    _S.FORWARD: frozenset({_S.IDLE}),  # post-forward, or a forward that raised
    # a recomputation returns to the state it interrupted; the end of backward (or the recovery
    # from a backward that raised) puts every handle back to IDLE
    _S.RECOMPUTE: frozenset({_S.IDLE, _S.BACKWARD_PRE, _S.BACKWARD_POST}),
    _S.BACKWARD_PRE: frozenset({_S.BACKWARD_POST, _S.RECOMPUTE, _S.IDLE}),
    _S.BACKWARD_POST: frozenset({_S.RECOMPUTE, _S.IDLE}),
    _S.SUMMON_FULL_PARAMS: frozenset({_S.IDLE}),
}
# TRANSITIONS by the identity of each state (members are singletons), as tuples: ``enter`` runs
# five times per module and step, and an Enum hashes in Python (two calls per dict or set lookup).
_ALLOWED: Dict[int, Tuple[HandleTrainingState, ...]] = {id(state): tuple(to) for state, to in TRANSITIONS.items()}

_FLATTENED_ATTR = "_composable_shard_flattened"


def _is_fsdp_flattened(tensor: torch.Tensor) -> bool:
    """True if ``tensor`` is (or is marked as) a flat parameter of composable_shard."""
    return bool(getattr(tensor, _FLATTENED_ATTR, False))


def _set_fsdp_flattened(tensor: torch.Tensor) -> None:
    """Mark ``tensor`` as flattened by composable_shard (nesting one raises)."""
    setattr(tensor, _FLATTENED_ATTR, True)


def handle_streams(owner: "_Owner", device: torch.device) -> Streams:
    """The owner's streams: the root's, shared by its whole tree from lazy init on; a module used
    before any forward (``FSDPModule.unshard()``) makes its own for ``device`` until then."""
    if owner.streams is None:
        owner.streams = Streams(device)
    return owner.streams


class _Owner(Protocol):
    """What a handle reads of the runtime state of the fully sharded module that owns it
    (``module_state._FSDPState``; typed here so this module imports nothing above it)."""

    process_group: Optional[dist.ProcessGroup]  # shard group (None: one rank)
    replicate_group: Optional[dist.ProcessGroup]  # HYBRID: across replicas
    rank: int
    world_size: int  # shard group size
    dp_world_size: int  # data-parallel world size
    gradient_divide_factor: Optional[float]  # set_gradient_divide_factor's (None: divide by dp_world_size)

    @property
    def gradient_divisor(self) -> float:  # what reduced gradients are divided by (dp_world_size unless set otherwise)
        ...

    mixed_precision: Any  # Optional[MixedPrecision]
    streams: Optional[Streams]
    sync_gradients: bool
    root: Optional[Any]  # the root's state: pending_reductions (a list of Reduction)


class ParamInfo(NamedTuple):
    """Where an original parameter is registered: ``module.<param_name>``."""

    param_name: str
    module: nn.Module
    module_name: str


class SharedParamInfo(NamedTuple):
    """A second registration of an already-flattened parameter (tied weights)."""

    param_name: str
    module: nn.Module
    module_name: str
    prim_param_index: int  # index into the group's _param_infos of the first registration


class FlatParameter(nn.Parameter):
    """This rank's shard of the flat concatenation of one ``(dtype, requires_grad)`` group of
    a handle's parameters. Never registered on a module; the original parameters are views of
    it. Metadata (all set by :meth:`FlatParamHandle._build_group`):

    ``_fqns`` (prefixed from the fully sharded module), ``_param_infos``,
    ``_shared_param_infos``, ``_numels``, ``_shapes``, ``_unpadded_unsharded_size``,
    ``_padded_unsharded_size``, ``_shard_slices`` (this rank's :class:`ParamSlice` per
    parameter), ``_pieces`` (per parameter: its tensor-parallel :class:`Piece`, or ``None``;
    ``_shapes`` and ``_numels`` are then the local piece's, see [Note: Tensor-parallel
    pieces])."""

    _fqns: Tuple[str, ...]
    _param_infos: Tuple[ParamInfo, ...]
    _shared_param_infos: Tuple[SharedParamInfo, ...]
    _numels: Tuple[int, ...]
    _shapes: Tuple[torch.Size, ...]
    _unpadded_unsharded_size: torch.Size
    _padded_unsharded_size: torch.Size
    _shard_slices: Tuple[_shard_math.ParamSlice, ...]
    _pieces: Tuple[Optional[Piece], ...]


class KeptViews(NamedTuple):
    """[Note: Kept views]  Making a group's full-shape views (a split, a view per parameter, a
    backward pre-hook on the split) was the largest single cost of the runtime's CPU time per
    module (issue 56), paid twice per step: in the pre-forward and again in the pre-backward.
    The views a grad-mode forward made stay valid while the buffer's storage is freed and
    refilled (the all-gather writes into the same storage through ``.data``, so no version
    counter moves), so the pre-backward installs them again instead of making new ones; the
    end of backward drops them. Not across steps: autograd runs ready nodes newest first, and a
    split made in an earlier step would run after every other node of the backward, holding
    each handle's reduction until the end (no overlap, every unsharded gradient alive at once).
    New views are made in backward for a handle that recomputes its forward there (activation
    checkpointing: the recomputation's part of the gradient must be told apart from the
    forward's, see [Note: Reentrant arrivals] in ``_runtime/hooks.py``). A reentrant
    recomputation that reaches the kept views without any hook of ours (``torch.utils.checkpoint``
    around a plain submodule) is recognised in the split's pre-hook by its nested graph task:
    its arrival is treated as a recomputation's, and the handle makes new views in later
    backwards."""

    base: torch.Tensor  # the unsharded buffer they view
    mask: Tuple[bool, ...]  # requires_grad per parameter when they were made
    views: List[torch.Tensor]


@dataclass(eq=False)
class FlatGroup:
    """Runtime buffers of one flat parameter. Names say the state of each tensor."""

    flat_param: FlatParameter  # sharded_flat: ceil(N/W) elements, the optimizer's storage
    orig_params: List[nn.Parameter]  # original parameters, 1-D views of their slices when idle
    compute_dtype: torch.dtype  # dtype of the unsharded buffer (param_dtype under mixed precision)
    padded_unsharded_flat: torch.Tensor  # leaf the module computes on; storage freed when sharded
    aliases_shard: bool  # True: padded_unsharded_flat shares the shard's storage (no all-gather)
    split_sizes: List[int]  # numels plus the padding, for torch.split
    index: int = 0  # position in the handle's groups
    reduced_grad: Optional[torch.Tensor] = None  # this backward's gradient shard until attached to .grad
    sharded_grad_ref: Optional[Callable[[], Optional[torch.Tensor]]] = None  # weak: the .grad views own it
    unreduced_grad: Optional[torch.Tensor] = None  # unsynced backwards' padded unsharded gradient sum
    pending_unshard: Optional[Any] = None  # _collectives.Pending of an in-flight all-gather
    comm_shard: Optional[torch.Tensor] = None  # cast/moved shard kept alive during the all-gather
    gathered_at: Tuple[int, int] = (-1, -1)  # (params' version sum, its optimizer steps' epoch) at the last gather
    grad_ready: bool = False  # this backward's gradient was accumulated and taken
    requires_grad_mask: Tuple[bool, ...] = ()  # orig params' requires_grad at the last refresh
    post_backward_hook: Optional[Any] = None  # RemovableHandle of the post-accumulate-grad hook
    used: List[bool] = field(default_factory=list)  # per orig param: got a gradient since the last sync
    had_grad: List[bool] = field(default_factory=list)  # per orig param: .grad was set before accumulating
    reduced: bool = False  # a reduced gradient was accumulated and awaits attaching to .grad
    full_precision: bool = False  # a group of modules kept in full precision: no param/reduce cast
    unsynced_views: List[Optional[torch.Tensor]] = field(default_factory=list)  # per orig param: .grad showing unreduced_grad
    grads_before_views: List[Optional[torch.Tensor]] = field(default_factory=list)  # per orig param: .grad before that
    landing_grad: Optional[torch.Tensor] = None  # offloaded: this backward's gradient shard being copied to the CPU
    landing_event: Optional[Any] = None  # CUDA: recorded after that copy was issued (None on CPU)
    forward_grad_due: bool = False  # a grad-mode forward's views may still bring their gradient (see [Note: Reentrant arrivals])
    kept_views: Optional["KeptViews"] = None  # this step's forward views, for its backward (see [Note: Kept views])
    float8: Optional[_float8.Float8Group] = None  # float8-gathered weights (see [Note: float8 all-gather] in _base/float8.py)
    grad_sources: Optional[Tuple[Any, torch.device, List[Any]]] = None  # see FlatParamHandle._grad_sources
    averages: Optional[Tuple[Any, Tuple[torch.dtype, bool]]] = None  # see Reduction._plan: its key and result
    gather_alias: Optional[torch.Tensor] = None  # padded_unsharded_flat.data, made once: what the all-gather writes
    gathered: torch.Tensor = field(init=False)  # see gathered_buffer (set by FlatParamHandle._build_group)
    storage: Any = field(init=False)  # gathered's storage, one Python object for the group's life (see gathered_buffer)
    gathered_nbytes: int = 0  # its size while allocated
    has_pieces: bool = False  # some parameter is a tensor-parallel piece (its views are DTensors)
    shard_split_sizes: List[int] = field(default_factory=list)  # per orig param its slice's numel, then the padding:
    # one split of a gradient shard gives every parameter's slice (see shard_split_sizes_of)
    slices_are_params: bool = False  # the original parameters are 1-D slices of the shard (no stand-ins)
    view_shapes: Tuple[Optional[torch.Size], ...] = ()  # per orig param: its shape, None where its piece of a split has it
    split_hooks: Dict[bool, Any] = field(default_factory=dict)  # from_forward -> the split's _SplitBackwardHook, made once

    @property
    def sharded_grad(self) -> Optional[torch.Tensor]:
        """The gradient shard the original parameters' ``.grad`` views point into: alive only
        while some view is (see [Note: Gradients follow the user]), or not attached yet."""
        if self.reduced_grad is not None:
            return self.reduced_grad
        return self.sharded_grad_ref() if self.sharded_grad_ref is not None else None

    def registrations(self) -> List[Tuple[nn.Module, str, str, int]]:
        """Every slot holding one of the group's original parameters, tied second registrations
        included: ``(module, module name relative to the fully sharded module, parameter name,
        index into orig_params)``."""
        fp = self.flat_param
        return ([(i.module, i.module_name, i.param_name, k) for k, i in enumerate(fp._param_infos)]
                + [(s.module, s.module_name, s.param_name, s.prim_param_index) for s in fp._shared_param_infos])

    @property
    def requires_grad(self) -> bool:
        """True if some original parameter requires grad (as of the last refresh)."""
        return any(self.requires_grad_mask)

    @property
    def gathered_buffer(self) -> torch.Tensor:
        """The buffer the all-gather fills, whose storage is allocated exactly while the group is
        unsharded: ``padded_unsharded_flat``, or a float8 group's bytes (both set at build, never
        replaced: kept in ``gathered``, a plain attribute, and its storage in ``storage``: resizing
        keeps a storage's identity, so the per-step checks and resizes use that one Python object
        instead of making one per ``untyped_storage()`` call)."""
        return self.gathered

    @property
    def padded_numel(self) -> int:
        return int(self.flat_param._padded_unsharded_size.numel())


GroupKey = Tuple[torch.dtype, bool, bool, Optional[torch.dtype]]  # (dtype, requires_grad, kept in full precision, float8 gathered as)


def plan_groups(module: nn.Module, params: Sequence[nn.Parameter], param_dtype: Optional[torch.dtype],
                full_precision_classes: Tuple[type, ...]
                ) -> Tuple[Dict[GroupKey, List[Tuple[nn.Parameter, ParamInfo]]],
                           Dict[GroupKey, List[Tuple[SharedParamInfo, nn.Parameter]]]]:
    """The flat groups a handle over ``params`` of ``module`` is built from (``describe`` plans
    with this same function): parameters in ``named_modules`` order, each once, grouped by
    ``(dtype, requires_grad, kept in full precision, float8 dtype)`` in first-seen order; the third
    is True for parameters of a module of ``full_precision_classes`` under a ``param_dtype`` (see
    [Note: Modules kept in full precision] in ``_runtime/mixed_precision.py``), the fourth the
    float8 dtype torchao's float8 weights are gathered in (see [Note: float8 all-gather] in
    ``_base/float8.py``), else ``None``. Second registrations (tied weights) are returned
    apart, per group."""
    wanted = {id(p) for p in params}
    by_group: Dict[GroupKey, List[Tuple[nn.Parameter, ParamInfo]]] = {}
    shared: Dict[GroupKey, List[Tuple[SharedParamInfo, nn.Parameter]]] = {}
    first_index: Dict[int, Tuple[GroupKey, int]] = {}
    for sub_name, sub in module.named_modules(remove_duplicate=False):
        full_precision = param_dtype is not None and isinstance(sub, full_precision_classes)
        for name, p in sub.named_parameters(recurse=False, remove_duplicate=False):
            if p is None or id(p) not in wanted:
                continue
            if id(p) in first_index:
                gkey, index = first_index[id(p)]
                shared.setdefault(gkey, []).append((SharedParamInfo(name, sub, sub_name, index), p))
                continue
            key = (p.dtype, p.requires_grad, full_precision,
                   _float8.float8_weight_info(p)[1] if _float8.is_float8_weight(p) else None)
            group = by_group.setdefault(key, [])
            first_index[id(p)] = (key, len(group))
            group.append((p, ParamInfo(name, sub, sub_name)))
    return by_group, shared


def reduce_dtype_of(mixed_precision: Any, compute_dtype: torch.dtype, full_precision: bool) -> torch.dtype:
    """The dtype a group computing in ``compute_dtype`` reduces its gradients in: the mixed
    precision's reduce dtype for a low-precision floating group, else ``compute_dtype``."""
    if mixed_precision is None:
        return compute_dtype
    return mixed_precision._reduce_dtype_for(compute_dtype, full_precision)


def compute_dtype_of(dtype: torch.dtype, param_dtype: Optional[torch.dtype], full_precision: bool) -> torch.dtype:
    """The dtype a group of ``dtype`` parameters computes in: ``param_dtype`` for a floating
    group not kept in full precision, else its own."""
    if param_dtype is not None and dtype.is_floating_point and not full_precision:
        return param_dtype
    return dtype


def set_grad_of_any_shape(p: nn.Parameter, grad: torch.Tensor, like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Make ``grad`` (any shape and dtype) ``p.grad`` and return the tensor ``p.grad`` now is.
    Autograd's setter wants ``p``'s shape, dtype and device, so a placeholder that has them
    (no storage of its own) is set first and ``grad`` put in through ``.data``. ``like``: a plain
    tensor with ``grad``'s metadata to compare instead (each attribute read of a ``ShardedGrad``
    runs its ``__torch_function__``)."""
    meta = grad if like is None else like
    if meta.shape == p.shape and meta.dtype == p.dtype and meta.device == p.device:
        p.grad = grad
    else:
        placeholder = torch.empty((), dtype=p.dtype, device=p.device).expand(p.shape)
        if isinstance(grad, ShardedGrad):  # the object .grad shows keeps clipping's global norm
            placeholder = placeholder.as_subclass(ShardedGrad)
            placeholder._cs_source = grad._cs_source
        p.grad = placeholder
        p.grad.data = grad
    return p.grad  # type: ignore[return-value]  # set above


def shard_split_sizes_of(slices: Sequence[_shard_math.ParamSlice], shard_numel: int) -> List[int]:
    """The sizes that split a rank's shard into each parameter's slice (empty for a parameter it
    holds nothing of) and the padding after them: the slices a rank holds are consecutive, in
    parameter order, from the shard's start."""
    sizes = [s.numel for s in slices]
    offset = 0
    for s, size in zip(slices, sizes):
        if size:
            if s.shard_start != offset:
                raise AssertionError(f"composable_shard internal error: shard slices not consecutive: {slices}")
            offset += size
    return sizes + [shard_numel - offset]


def param_list(module_fqn: str, fqns: Sequence[str]) -> str:
    """Up to three parameter FQNs (``fqns`` relative to the module at ``module_fqn``), for messages."""
    names = [f"{module_fqn}.{f}" if module_fqn else f for f in fqns]
    return f"{names[:3]}{' and others' if len(names) > 3 else ''}"


def _stand_in(param: nn.Parameter, info: ParamInfo, shared: Sequence[Tuple[SharedParamInfo, nn.Parameter]],
              index: int, module_fqn: str) -> nn.Parameter:
    """A plain parameter that takes a tensor-parallel one's place in every slot that registers it
    (``index``: its position in the group; ``module_fqn``: the fully sharded module's, for
    messages; see [Note: Tensor-parallel pieces]). An optimizer's step on ``param`` raises from now on."""
    stand_in = nn.Parameter(torch.empty(0, dtype=param.dtype, device=param.device), requires_grad=param.requires_grad)
    set_module_tensor(info.module, info.param_name, stand_in)
    _watch.watch_replaced(param, ".".join(part for part in (module_fqn, info.module_name, info.param_name) if part))
    for sinfo, _ in shared:
        if sinfo.prim_param_index == index:
            set_module_tensor(sinfo.module, sinfo.param_name, stand_in)
    return stand_in


def norm_groups(shard_group: Any, piece: Optional[Piece]) -> List[Any]:
    """The groups a norm of a parameter's gradient slice is completed over, in order: its shard
    group (``None``: one rank), then, for a tensor-parallel piece, the mesh dimensions that
    shard it. Empty: the slice is the whole gradient, equal on every rank."""
    return ([shard_group] if shard_group is not None else []) + (shard_groups(piece) if piece is not None else [])


def _wider(dtype: torch.dtype, than: torch.dtype) -> bool:
    """Whether floating ``dtype`` has more mantissa bits than floating ``than``."""
    return (dtype.is_floating_point and than.is_floating_point
            and torch.finfo(dtype).eps < torch.finfo(than).eps)


def _free_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.nbytes() != 0:
        storage.resize_(0)


class _SplitBackwardHook:
    """Autograd pre-hook of the split that makes a group's unsharded views; it runs when every
    view's gradient is computed, just before they are concatenated into the group's unsharded
    gradient. ``grad_outputs`` holds ``None`` for every view no gradient reached, so the others
    were used; and earlier reductions' buffers are released, before this one is allocated.
    Holds the handle and group weakly: the group's kept views hold the split, and so this hook
    (see [Note: Hooks on tensors hold weakly] in ``_runtime/module_state.py``)."""

    def __init__(self, handle: "FlatParamHandle", group: FlatGroup, from_forward: bool) -> None:
        self.handle = weakref.ref(handle)
        self.group = weakref.ref(group)
        self.from_forward = from_forward  # the split a grad-mode forward made (not a backward's or a recomputation's)

    def __call__(self, grad_outputs: Tuple[Optional[torch.Tensor], ...]) -> None:
        handle, group = self.handle(), self.group()
        if handle is None or group is None:
            return
        if self.from_forward and group.forward_grad_due:
            if handle.backward_task is not None and current_graph_task() != handle.backward_task:
                # a reentrant recomputation's nested backward computed on the kept views: its part
                # arrives apart (see [Note: Reentrant arrivals]); later backwards make it fresh views
                handle.recomputes_in_backward = True
            else:
                group.forward_grad_due = False
        used = group.used
        for i in range(len(used)):
            if grad_outputs[i] is not None:
                used[i] = True
        handle.release_earlier_reductions()


class FlatParamHandle:
    """The flat parameters of one fully sharded module and every transition of their storage.

    Example (what the runtime does each step)::

        handle.enter(HandleTrainingState.FORWARD, "pre_forward")
        handle.unshard()            # all-gather into the unsharded buffer, wait, full-shape views
        ...                         # module computes
        handle.reshard(free=True)   # storage freed, original parameters back
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        module: nn.Module,
        module_fqn: str,
        *,
        rank: int,
        world_size: int,
        compute_device: torch.device,
        param_dtype: Optional[torch.dtype] = None,
        full_precision_classes: Tuple[type, ...] = (),
        offload_params: bool = False,
    ) -> None:
        self.module: nn.Module = module  # the fully sharded module that owns this handle
        self.fqn: str = module_fqn  # its FQN (for messages)
        self.rank: int = rank  # rank in the shard group
        self.world_size: int = world_size  # shard group size
        self.compute_device: torch.device = compute_device  # where the unsharded buffer lives
        self.offload_params: bool = offload_params  # shards and gradients on the CPU (see [Note: CPU offload])
        self.shard_device: torch.device = torch.device("cpu") if offload_params else compute_device  # where shards live
        self.training_state: HandleTrainingState = HandleTrainingState.IDLE
        self.groups: List[FlatGroup] = []  # one per (dtype, requires_grad), first-seen order
        self.is_unsharded: bool = False  # True while module slots hold unsharded views
        self.full_params_exposed: bool = False  # True while unshard_params shows full parameters on this rank
        self.needs_pre_backward: bool = True  # False once this backward's pre-backward ran
        self.exec_index: Optional[int] = None  # position in the root's pre-forward order
        self.post_forward_index: Optional[int] = None  # position in the root's post-forward order
        self.index: int = -1  # position in the root's handles (set at lazy init; names it across ranks)
        self.prefetched_for_forward: bool = False  # gathered by forward prefetch, its forward not run yet
        self.prefetched_in_backward_by: Optional["FlatParamHandle"] = None  # this backward's prefetch source
        self.backward_prefetch_wasted: bool = False  # its backward prefetch once gathered a handle that never ran
        self.recomputes_in_backward: bool = False  # its forward runs again in backward (activation checkpointing)
        self.states_before_recompute: List[HandleTrainingState] = []  # pushed per recomputed forward in progress
        self.backward_task: Optional[int] = None  # autograd graph task of this backward's pre-backward (see [Note: Kept views])
        self.state: Optional[_Owner] = None  # the owning module's runtime state (set by fully_shard)
        self.keep_low_precision_grads: bool = False  # .grad in the compute dtype (see _runtime/mixed_precision.py)
        self.init_buffers: Optional[List[torch.Tensor]] = None  # after to_empty: full buffers being initialized
        # first forwards: what each group's sharded slots hold (see [Note: Sharded parameters read in forward])
        self.stand_ins: Optional[List[List[torch.Tensor]]] = None
        # (module holding parameters of this handle, its guard): the guard is its forward while the
        # handle is sharded (see [Note: Calls while sharded] in _runtime/hooks.py)
        self.call_guards: List[Tuple[nn.Module, Any]] = []
        self._build(params, module, module_fqn, param_dtype, tuple(full_precision_classes))
        # The steps of the optimizers holding its parameters (not another model's): see is_stale.
        self.optimizer_steps: _watch.OptimizerSteps = _watch.OptimizerSteps(
            p for g in self.groups for p in (*g.orig_params, g.flat_param))

    # ------------------------------------------------------------------ construction
    def _build(self, params: Sequence[nn.Parameter], module: nn.Module, module_fqn: str,
               param_dtype: Optional[torch.dtype], full_precision_classes: Tuple[type, ...]) -> None:
        by_group, shared = plan_groups(module, params, param_dtype, full_precision_classes)
        for key, members in by_group.items():
            built = self._build_group(key, members, shared.get(key, []), module_fqn, param_dtype)
            built.index = len(self.groups)
            self.groups.append(built)

    def _build_group(self, key: GroupKey, members: List[Tuple[nn.Parameter, ParamInfo]],
                     shared: List[Tuple[SharedParamInfo, nn.Parameter]], module_fqn: str,
                     param_dtype: Optional[torch.dtype]) -> FlatGroup:
        dtype, requires_grad, full_precision, float8_dtype = key
        prefix = ""  # _fqns are relative to the owning module (API.md); module_fqn only names the handle
        pieces = [piece_of(p) if isinstance(p, DTensor) else None for p, _ in members]
        locals_ = [p.to_local() if isinstance(p, DTensor) else p for p, _ in members]
        if float8_dtype is not None:  # see [Note: float8 all-gather] in _base/float8.py
            locals_ = [_float8.float8_weight_info(p)[0] for p, _ in members]
        numels = [t.numel() for t in locals_]
        total = sum(numels)
        padded = _shard_math.padded_numel(total, self.world_size)
        start, end = _shard_math.chunk_bounds(total, self.world_size, self.rank)
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1).to(self.shard_device) for t in locals_]) if members else torch.empty(0, dtype=dtype)
            shard = torch.zeros(end - start, dtype=dtype, device=self.shard_device, pin_memory=self._pins())
            valid = max(0, min(end, total) - start)
            if valid > 0:
                shard[:valid].copy_(flat[start:start + valid])
        flat_param = FlatParameter(shard, requires_grad=requires_grad)
        flat_param._fqns = tuple(f"{prefix}{info.module_name + '.' if info.module_name else ''}{info.param_name}" for _, info in members)
        flat_param._param_infos = tuple(info for _, info in members)
        flat_param._shared_param_infos = tuple(info for info, _ in shared)
        flat_param._numels = tuple(numels)
        flat_param._shapes = tuple(t.shape for t in locals_)
        flat_param._pieces = tuple(pieces)
        flat_param._unpadded_unsharded_size = torch.Size([total])
        flat_param._padded_unsharded_size = torch.Size([padded])
        flat_param._shard_slices = tuple(_shard_math.rank_param_slices(numels, self.world_size, self.rank))
        _set_fsdp_flattened(flat_param)
        compute_dtype = compute_dtype_of(dtype, param_dtype, full_precision)
        aliases = (self.world_size == 1 and compute_dtype == dtype and self.shard_device == self.compute_device
                   and float8_dtype is None)
        float8: Optional[_float8.Float8Group] = None
        if float8_dtype is not None:  # gathered as float8 bytes; the leaf only receives gradients
            float8 = _float8.new_group_state(float8_dtype, [_float8.float8_weight_info(p)[2] for p, _ in members],
                                             padded, len(members), self.compute_device)
            unsharded = _float8.gradient_leaf(padded, compute_dtype, self.compute_device)
        elif aliases:
            unsharded = flat_param.data  # same storage, own version counter (see [Note: Views])
        else:
            unsharded = torch.empty(padded, dtype=compute_dtype, device=self.compute_device)
            _free_storage(unsharded)
        unsharded.requires_grad_(requires_grad)
        orig_params = [p if piece is None and float8 is None else _stand_in(p, members[k][1], shared, k, module_fqn)
                       for k, ((p, _), piece) in enumerate(zip(members, pieces))]
        group = FlatGroup(flat_param, orig_params, compute_dtype, unsharded, aliases,
                          numels + ([padded - total] if padded > total else []))
        group.float8 = float8
        group.gathered = float8.gathered if float8 is not None else unsharded
        group.storage = group.gathered.untyped_storage()
        group.gathered_nbytes = group.gathered.numel() * group.gathered.element_size()
        group.has_pieces = any(piece is not None for piece in pieces)
        group.shard_split_sizes = shard_split_sizes_of(flat_param._shard_slices, flat_param.numel())
        group.view_shapes = tuple(None if len(shape) == 1 else shape for shape in flat_param._shapes)
        group.slices_are_params = all(p is orig for (p, _), orig in zip(members, orig_params))
        group.requires_grad_mask = tuple(p.requires_grad for p in orig_params)
        group.full_precision = full_precision
        group.used = [False] * len(orig_params)
        group.had_grad = [False] * len(orig_params)
        group.unsynced_views = [None] * len(orig_params)
        group.grads_before_views = [None] * len(orig_params)
        self._point_params_at_shard(group)
        return group

    def _pins(self) -> bool:
        """Offloaded shards of an accelerator run live in pinned memory (asynchronous copies)."""
        return self.offload_params and self.compute_device.type == "cuda"

    def on_compute_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (a shard-sized tensor) where collectives and compute run: itself, or an
        asynchronous copy on the current stream when shards are offloaded."""
        if tensor.device == self.compute_device:
            return tensor
        return tensor.to(self.compute_device, non_blocking=True)

    # ------------------------------------------------------------------ initialization after to_empty
    def expose_for_init(self) -> None:
        """[Note: Initialization after to_empty]  FSDP2's documented flow builds the model on the
        meta device, shards it, then calls ``model.to_empty(device=...)`` and the model's own
        initialization (``init_weights()``, ``reset_parameters()``), which writes the original
        parameters in place, each whole. So ``to_empty`` makes each original parameter a
        full-shape view of a temporary full flat buffer per group (the shard's dtype and device,
        uninitialized), and the initialization writes whole parameters, on every rank the same
        values as an unsharded model's with the same seed. The next use of the model (its
        forward, a state dict, ``unshard_params``, a cast, an FSDPModule method) first takes
        each rank's chunk of the buffers into its shards, points the parameters back at their
        slices and drops the buffers (:func:`take_pending_init_values`): no collective. Between
        the two the handle holds its full parameters once per rank (what the unsharded init
        writes); the same parameter objects are seen throughout, so an optimizer built in
        between holds the right ones."""
        if self.init_buffers is not None:
            return
        buffers = []
        for group in self.groups:
            fp = group.flat_param
            full = torch.empty(group.padded_numel, dtype=fp.dtype, device=fp.device)
            pieces = torch.split(full, group.split_sizes)
            for p, piece, shape, tp in zip(group.orig_params, pieces, fp._shapes, fp._pieces):
                # a tensor-parallel parameter is initialized whole (its global shape: the unsharded
                # model's fans and draws); take_init_values keeps this rank's piece of it
                p.data = piece.view(shape) if tp is None else torch.empty(tp.shape, dtype=fp.dtype, device=fp.device)
            buffers.append(full)
        self.init_buffers = buffers
        _PENDING_INIT.add(self)
        _PENDING_INIT_ADDED[0] += 1

    def take_init_values(self) -> None:
        """This rank's chunk of what the initialization wrote into the shards; parameters back
        to their slices (see [Note: Initialization after to_empty])."""
        if self.init_buffers is None:
            return
        with torch.no_grad():
            for group, full in zip(self.groups, self.init_buffers):
                pieces = torch.split(full, group.split_sizes)
                for p, piece, shape, tp in zip(group.orig_params, pieces, group.flat_param._shapes,
                                               group.flat_param._pieces):
                    if tp is not None:
                        piece.view(shape).copy_(take_piece(tp, p.data))
                group.flat_param.data.copy_(full.view(self.world_size, -1)[self.rank])
                self._point_params_at_shard(group)
        self.init_buffers = None
        _PENDING_INIT.discard(self)

    def _point_params_at_shard(self, group: FlatGroup) -> None:
        """Make each original parameter's data its (1-D) slice of the shard."""
        shard = group.flat_param.data
        for p, s in zip(group.orig_params, group.flat_param._shard_slices):
            p.data = shard[s.shard_start:s.shard_start + s.numel]

    def unusable_params(self) -> Tuple[List[str], List[str]]:
        """FQNs (relative to the owning module) of original parameters the runtime cannot
        follow, in one pass: ``(detached, hooked)``. Detached ones no longer share storage with
        their group's flat shard (their ``.data`` was replaced after fully_shard); hooked ones
        carry gradient hooks, which never run here (see :func:`torch_compat.has_grad_hooks`)."""
        detached: List[str] = []
        hooked: List[str] = []
        for group in self.groups:
            base = group.flat_param.untyped_storage().data_ptr()
            for p, fqn in zip(group.orig_params, group.flat_param._fqns):
                if p.untyped_storage().data_ptr() != base:
                    detached.append(fqn)
                if has_grad_hooks(p):
                    hooked.append(fqn)
        return detached, hooked

    # ------------------------------------------------------------------ queries
    @property
    def flat_params(self) -> List[FlatParameter]:
        """One flat parameter per ``(dtype, requires_grad)`` group."""
        return [g.flat_param for g in self.groups]

    @property
    def flat_param(self) -> FlatParameter:
        """The first flat parameter (the only one when all parameters share dtype/grad-ness)."""
        return self.groups[0].flat_param

    # The storage checks below run several times per module and step: plain loops, no generator.
    def needs_unshard(self) -> bool:
        """True if some group's unsharded storage is not allocated and filled."""
        for g in self.groups:
            if not g.aliases_shard and g.storage.nbytes() == 0:
                return True
        return False

    def unsharded_storage_freed(self) -> bool:
        """True if every group that owns an unsharded buffer has freed its storage."""
        for g in self.groups:
            if not g.aliases_shard and g.storage.nbytes() > 0:
                return False
        return True

    def shard_metadata(self) -> List[List[Tuple[str, torch.Size, int, int]]]:
        """Per group, per original parameter: ``(fqn, full shape, start, end)`` of the
        flattened elements this rank holds (``start == end`` if none)."""
        return [[(fqn, shape, s.param_start, s.param_end)
                 for fqn, shape, s in zip(g.flat_param._fqns, g.flat_param._shapes, g.flat_param._shard_slices)]
                for g in self.groups]

    # ------------------------------------------------------------------ storage transitions
    def prepare_gather(self, group: FlatGroup) -> Tuple[torch.Tensor, torch.Tensor]:
        """Allocate the unsharded storage and return ``(output, input)`` for the all-gather:
        the output aliases ``padded_unsharded_flat``; the input is the shard cast/moved to the
        compute dtype/device (kept alive on the group until the gather is waited). Records
        what the buffer is gathered from (see :meth:`is_stale`). A float8 group gathers its
        weights cast to float8 bytes (see [Note: float8 all-gather] in ``_base/float8.py``)."""
        storage = group.storage
        if storage.nbytes() != group.gathered_nbytes:
            storage.resize_(group.gathered_nbytes)
        if group.float8 is not None:
            shard = self.on_compute_device(group.flat_param.data)
            owner = self.owner()
            shard_group = owner.process_group if owner.world_size > 1 else None
            tag = f"float8_amax:{self.fqn}"

            def agree(amaxes: torch.Tensor) -> None:  # one MAX all-reduce of the group's amaxes
                _collectives.all_reduce(amaxes, shard_group, tag=tag, op=dist.ReduceOp.MAX).wait()

            cast = _float8.cast_shard(group.float8, shard, group.flat_param._shard_slices,
                                      agree if shard_group is not None else None)
            group.comm_shard = cast
            group.gathered_at = (versions_sum(group.orig_params), self.optimizer_steps.epoch)
            return group.float8.gathered, cast
        output = group.gather_alias
        if output is None:  # the buffer and its data are never replaced: one alias for the group's life
            output = group.gather_alias = group.padded_unsharded_flat.data
        shard = group.flat_param.data
        if shard.dtype != group.compute_dtype or shard.device != self.compute_device:
            shard = shard.to(device=self.compute_device, dtype=group.compute_dtype, non_blocking=True)
        group.comm_shard = shard
        group.gathered_at = (versions_sum(group.orig_params), self.optimizer_steps.epoch)
        return output, shard

    def is_stale(self) -> bool:
        """True if a kept unsharded buffer may no longer hold the shards' values: an original
        parameter was edited in place, or an optimizer holding one of its parameters stepped,
        since it was gathered."""
        epoch = self.optimizer_steps.epoch
        for g in self.groups:
            if not g.aliases_shard and g.storage.nbytes() > 0 \
                    and g.gathered_at != (versions_sum(g.orig_params), epoch):
                return True
        return False

    def use_unsharded_views(self, forward: bool = False, fresh: bool = False) -> None:
        """Install full-shape views of the unsharded buffers in the module slots. Pre: every
        group's unsharded buffer is filled. A parameter frozen after fully_shard gets a view that
        does not require grad; each view's use in backward is recorded in ``group.used`` (a
        parameter no backward reached keeps ``.grad = None``). ``forward``: for a forward with
        grad enabled, whose gradient the runtime waits for (see [Note: Reentrant arrivals] in
        ``_runtime/hooks.py``); its views are kept for the backward, which installs them again
        unless ``fresh`` (a recomputation in backward) asks for new ones (see [Note: Kept views])."""
        for group in self.groups:
            fp = group.flat_param
            views = None if forward or fresh else self._kept_views(group)
            if views is None:
                views = self._make_views(group, from_forward=forward)
            set_module_tensors(fp._param_infos, views)
            for sinfo in fp._shared_param_infos:
                set_module_tensor(sinfo.module, sinfo.param_name, views[sinfo.prim_param_index])
        self.is_unsharded = True
        if self.call_guards:
            self.guard_calls(False)

    def _kept_views(self, group: FlatGroup) -> Optional[List[torch.Tensor]]:
        """The views this step's forward kept, if they still describe the group's buffer (same
        buffer, same frozen parameters), else ``None``."""
        kept = group.kept_views
        if kept is None or kept.base is not group.padded_unsharded_flat or kept.mask != group.requires_grad_mask:
            return None
        return kept.views

    def _make_views(self, group: FlatGroup, from_forward: bool) -> List[torch.Tensor]:
        """New full-shape views of the group's unsharded buffer (one split, a view per
        parameter), with the split's backward pre-hook; a grad-mode forward's are kept for its
        backward (see [Note: Kept views])."""
        fp = group.flat_param
        if torch.is_grad_enabled():  # a forward's: no context to enter (two Python calls)
            pieces, views = self._split_views(group, fp)
        else:
            with torch.enable_grad():  # see [Note: Views made in backward]
                pieces, views = self._split_views(group, fp)
        split = pieces[0].grad_fn if pieces else None
        if split is not None:
            hook = group.split_hooks.get(from_forward)
            if hook is None:  # it holds nothing of a step: one per group and kind, reused
                hook = group.split_hooks[from_forward] = _SplitBackwardHook(self, group, from_forward)
            split.register_prehook(hook)
            if from_forward:
                group.forward_grad_due = True
        if from_forward and not torch.is_inference_mode_enabled():
            group.kept_views = KeptViews(group.padded_unsharded_flat, group.requires_grad_mask, views)
        return views

    @staticmethod
    def _split_views(group: FlatGroup, fp: FlatParameter) -> Tuple[Sequence[torch.Tensor], List[torch.Tensor]]:
        """Under grad mode: one split of the group's unsharded buffer, and a full-shape view per
        parameter (a DTensor for a tensor-parallel piece, a float8 view for a float8 group)."""
        pieces = group.padded_unsharded_flat.split_with_sizes(group.split_sizes)  # torch.split's op, no wrapper
        # a 1-D parameter's piece has its shape already: no view of it (a view op costs microseconds)
        views = [(piece if trainable else piece.detach()) if shape is None
                 else piece.view(shape) if trainable else piece.detach().view(shape)
                 for piece, shape, trainable in zip(pieces, group.view_shapes, group.requires_grad_mask)]
        if group.has_pieces:
            views = [view if tp is None else as_dtensor(tp, view) for view, tp in zip(views, fp._pieces)]
        if group.float8 is not None:  # see [Note: float8 all-gather] in _base/float8.py
            starts = _float8.offsets(list(fp._numels))
            views = [_float8.float8_view(group.float8, view, i, start, shape)
                     for i, (view, start, shape) in enumerate(zip(views, starts, fp._shapes))]
        return pieces, views

    def use_sharded_views(self) -> None:
        """Put the original parameters (views of the shard) back in the module slots, or their
        stand-ins while :meth:`guard_sharded_reads` is on."""
        for index, group in enumerate(self.groups):
            fp = group.flat_param
            params = group.orig_params if self.stand_ins is None else self.stand_ins[index]
            set_module_tensors(fp._param_infos, params)
            for sinfo in fp._shared_param_infos:
                set_module_tensor(sinfo.module, sinfo.param_name, params[sinfo.prim_param_index])
        self.is_unsharded = False
        if self.call_guards:
            self.guard_calls(True)

    def guard_calls(self, on: bool) -> None:
        """Make each guard the forward of its module (``on``: the handle is sharded), or take it
        away again; a forward the module got from elsewhere is left alone (see [Note: Calls while
        sharded] in ``_runtime/hooks.py``)."""
        displaced = False
        for holder, guard in self.call_guards:
            slots = holder.__dict__
            if on:
                forward = slots.get("forward")
                if forward is None:
                    slots["forward"] = guard
                elif forward is not guard:  # set on the module since: the guard gives way to a hook
                    guard.displaced()
                    displaced = True
            elif slots.get("forward") is guard:
                del slots["forward"]
        if displaced:
            self.call_guards = [(h, g) for h, g in self.call_guards if not g.is_displaced]

    def guard_sharded_reads(self, on: bool) -> None:
        """While ``on``, the sharded slots hold stand-ins that refuse computation (see [Note:
        Sharded parameters read in forward] in ``_base/sharded_reads.py``); off, the original
        parameters again."""
        if on:
            owner = f"fully_shard({self.fqn or '<root>'})"
            self.stand_ins = [[stand_in_for(p, f"{self.fqn}.{name}" if self.fqn else name, owner)
                               for p, name in zip(group.orig_params, group.flat_param._fqns)] for group in self.groups]
        elif self.stand_ins is None:
            return
        else:
            self.stand_ins = None
        if not self.is_unsharded:
            self.use_sharded_views()

    # ------------------------------------------------------------------ gather transitions
    def will_gather(self) -> bool:
        """True if :meth:`issue_gathers` would issue all-gathers now (the ranks agree on exactly
        these, see [Note: Agreement] in ``_runtime/agreement.py``): some group's storage is not
        allocated and none has a gather in flight."""
        needed = False
        for g in self.groups:
            if g.pending_unshard is not None:
                return False
            if not needed and not g.aliases_shard and g.storage.nbytes() == 0:
                needed = True
        return needed

    def issue_gathers(self) -> None:
        """Issue the all-gathers of every group (async) unless its buffers are filled or in
        flight. Buffers are allocated on the compute stream, which also frees them (no
        ``record_stream``); the gathers run on the all-gather stream."""
        if not self.will_gather():
            return
        owner = self.owner()
        streams = handle_streams(owner, self.compute_device)
        gathers = [(group, *self.prepare_gather(group)) for group in self.groups if not group.aliases_shard]
        if streams.all_gather is None:  # CPU: no stream to issue on, no event to record
            self._gather_each(gathers, owner.process_group)
            return
        with streams.run_on(streams.all_gather):
            self._gather_each(gathers, owner.process_group)
            event = streams.record(streams.all_gather)
        for group in self.groups:
            if group.pending_unshard is not None:
                group.pending_unshard.event = event

    def _gather_each(self, gathers: List[Tuple[FlatGroup, torch.Tensor, torch.Tensor]], process_group: Any) -> None:
        for group, output, shard in gathers:
            if process_group is None:  # a shard group of one rank (NO_SHARD): the shard, cast
                output.copy_(shard)
                group.pending_unshard = _collectives.Pending(None, output, "all_gather", tag=self.fqn)
            else:
                group.pending_unshard = _collectives.all_gather_into(output, shard, process_group,
                                                                     tag=self.fqn, match=self.index + 1)

    def wait_gathers(self) -> None:
        """Wait for the all-gathers in flight (the compute stream waits for their event)."""
        for group in self.groups:
            pending = group.pending_unshard
            if pending is not None:
                pending.wait()
                if pending.event is not None:
                    Streams.wait(pending.event)
                group.pending_unshard = None
                group.comm_shard = None

    def unshard(self, forward: bool = False, fresh: bool = False) -> None:
        """Gather (unless filled or in flight), wait, and install full-shape views in the module
        slots (``forward``, ``fresh``: see :meth:`use_unsharded_views`)."""
        self.issue_gathers()
        self.wait_gathers()
        self.use_unsharded_views(forward=forward, fresh=fresh)

    def reshard(self, free: bool = True) -> None:
        """Original parameters back in the slots; if ``free``, release unsharded storage (a
        gather in flight lands first). Post: ``is_unsharded`` is False."""
        self.wait_gathers()
        self.use_sharded_views()
        for group in self.groups:
            if free and not group.aliases_shard and group.storage.nbytes() != 0:
                group.storage.resize_(0)
            group.comm_shard = None

    def enter(self, to: HandleTrainingState, where: str,
              expect: Optional[Tuple[HandleTrainingState, ...]] = None) -> None:
        """Change ``training_state`` to ``to`` (no change if it is already there). Raises naming
        both states if :data:`TRANSITIONS` does not allow it, or if ``expect`` is given and the
        current state is not in it."""
        now = self.training_state
        if (expect is not None and now not in expect) or (to is not now and to not in _ALLOWED[id(now)]):
            wanted = f" (expected {'/'.join(s.name for s in expect)})" if expect is not None else ""
            raise RuntimeError(f"handle of {self.fqn or '<root>'!r}: illegal transition {now.name} -> {to.name} in "
                               f"{where}{wanted}")
        self.training_state = to

    def owner(self) -> "_Owner":
        """The runtime state of the fully sharded module that owns this handle."""
        if self.state is None:
            raise RuntimeError(f"{self!r} is not owned by a fully sharded module")
        return self.state

    # ------------------------------------------------------------------ requires_grad
    def refresh_requires_grad(self) -> List[FlatGroup]:
        """Follow ``requires_grad`` changed on original parameters since the last call
        (freeze/unfreeze after fully_shard): the unsharded buffer requires grad iff some
        parameter of its group does. Returns the groups that became trainable."""
        became_trainable: List[FlatGroup] = []
        for group in self.groups:
            mask = tuple([p.requires_grad for p in group.orig_params])
            if mask == group.requires_grad_mask:
                continue
            if any(mask) and not group.requires_grad:
                became_trainable.append(group)
            group.requires_grad_mask = mask
            group.padded_unsharded_flat.requires_grad_(any(mask))
        return became_trainable

    # ------------------------------------------------------------------ gradients
    def take_unsharded_grad(self, group: FlatGroup) -> Optional[torch.Tensor]:
        """Detach the padded unsharded gradient from the leaf (so the next backward starts a
        fresh one) and return it, added to any gradient kept from unsynced backwards (with
        the ``.grad`` views of those folded back first)."""
        grad = group.padded_unsharded_flat.grad
        group.padded_unsharded_flat.grad = None
        kept, group.unreduced_grad = group.unreduced_grad, None
        if kept is not None:
            self._fold_unsynced_views(group, kept)
            grad = kept if grad is None else kept.add_(grad)
        return grad

    def keep_unreduced(self, group: FlatGroup, grad: torch.Tensor, reduce_dtype: torch.dtype) -> None:
        """Keep an unsynced backward's unsharded gradient for the next synced one, and show
        each parameter that got a gradient since the last sync its full-shape part of it as
        ``.grad`` (see [Note: Gradients follow the user]). A low-precision gradient whose
        reduction is wider (``reduce_dtype=float32`` under ``param_dtype=bfloat16``) is kept,
        and later backwards' gradients are summed into it, in ``reduce_dtype``, as torch's
        FSDP2 does: summing micro-batches in bf16 would round at every addition."""
        if _wider(reduce_dtype, grad.dtype):
            grad = grad.to(reduce_dtype)
        group.unreduced_grad = grad
        fp = group.flat_param
        pieces = torch.split(grad, group.split_sizes)
        for i, (p, piece, shape) in enumerate(zip(group.orig_params, pieces, fp._shapes)):
            if not (group.requires_grad_mask[i] and group.used[i]):
                continue
            group.grads_before_views[i] = p.grad
            group.unsynced_views[i] = set_grad_of_any_shape(p, piece.view(shape))

    def _fold_unsynced_views(self, group: FlatGroup, kept: Optional[torch.Tensor]) -> None:
        """Take the unsynced ``.grad`` views back: what the user did to them goes into ``kept``
        (the sum they show; ``None``: it is being dropped), and each ``.grad`` is what it was
        before the views."""
        if not any(v is not None for v in group.unsynced_views):
            return
        if kept is not None:
            self._refuse_replaced_sums(group)
        pieces = torch.split(kept, group.split_sizes) if kept is not None else None
        for i, (p, shape) in enumerate(zip(group.orig_params, group.flat_param._shapes)):
            shown = group.unsynced_views[i]
            if shown is None:
                continue
            current, before = p.grad, group.grads_before_views[i]
            if current is not shown:  # the user set it to None or to a tensor of their own
                before = None
                if pieces is not None:
                    if current is None:
                        pieces[i].zero_()
                    else:  # a whole parameter's gradient (see _refuse_replaced_sums), flattened or not
                        pieces[i].view(shape).copy_(current.reshape(shape))
            p.grad = before
        group.unsynced_views = [None] * len(group.orig_params)
        group.grads_before_views = [None] * len(group.orig_params)

    def _refuse_replaced_sums(self, group: FlatGroup) -> None:
        """[Note: A tensor of the user's in place of an unsynced sum]  Between unsynced backwards
        ``.grad`` shows this rank's full-shape local sum, and a tensor the user puts in its place
        replaces that sum (as it would locally). Autograd's setter only takes a tensor of the
        parameter's own shape: on a group whose parameters are whole on every rank (NO_SHARD, a
        shard group of one rank) that is the whole parameter flattened, and it is taken; on a real
        shard it is this rank's slice, which cannot hold the sum, so the next backward raises
        here, before the group's sum is touched, naming the parameters. The decision reads only
        what every rank has alike (the same user code replaced the same views; the shard group's
        size), never a shape: a parameter one rank happens to hold whole must not take another
        path there than on the ranks holding part of it (they would raise and that rank would
        wait for them in the reduction)."""
        fp = group.flat_param
        replaced = [fqn for p, shown, fqn, numel in zip(group.orig_params, group.unsynced_views, fp._fqns, fp._numels)
                    if shown is not None and p.grad is not None and p.grad is not shown
                    and (self.world_size > 1 or p.grad.numel() != numel)]
        if not replaced:
            return
        raise RuntimeError(
            f"composable_shard: the .grad of {param_list(self.fqn, replaced)} (fully_shard({self.fqn or '<root>'})) was replaced by a "
            "tensor of your own between backwards with gradient sync off. There .grad shows this rank's full-shape "
            "local gradient sum, which replacing it would replace, but autograd only lets a tensor of the sharded "
            "parameter's shape (this rank's slice) be assigned, and a slice cannot hold that sum. This backward is "
            "stopped and the gradients accumulated since the last synced backward are dropped at the next forward. "
            "To drop the sum set .grad to None (optimizer.zero_grad()); to change it, change .grad in place "
            "(p.grad.mul_(0.5), p.grad.zero_(), p.grad.copy_(t)).")

    def accumulate_sharded_grad(self, group: FlatGroup, reduced: torch.Tensor) -> None:
        """Make ``reduced`` (this rank's averaged shard, any dtype) the group's gradient, plus
        whatever the original parameters' ``.grad`` held (as autograd accumulates): a parameter
        whose ``.grad`` the user set to None starts from zero, one holding our view or a tensor
        of the user's adds to it. Attached to ``.grad`` by :meth:`attach_grads`. An offloaded
        group's gradient is copied to the CPU without waiting and added when it has landed
        (:meth:`land_offloaded_grad`, see [Note: CPU offload])."""
        fp = group.flat_param
        dtype = group.compute_dtype if self.keep_low_precision_grads else fp.dtype
        if self.offload_params:
            host = torch.empty(reduced.shape, dtype=dtype, device=fp.device, pin_memory=self._pins())
            host.copy_(reduced, non_blocking=True)
            group.landing_grad, group.landing_event = host, Streams.record_current(reduced.device)
            group.reduced = True
            return
        if reduced.dtype is not dtype or reduced.device != fp.device:
            reduced = reduced.to(dtype=dtype, device=fp.device)
        self._accumulate(group, reduced)

    def land_offloaded_grad(self, group: FlatGroup) -> None:
        """Wait (CPU) for an offloaded group's gradient copy and accumulate it; no-op otherwise."""
        host = group.landing_grad
        if host is None:
            return
        if group.landing_event is not None:
            group.landing_event.synchronize()
        group.landing_grad, group.landing_event = None, None
        self._accumulate(group, host)

    def _accumulate(self, group: FlatGroup, reduced: torch.Tensor) -> None:
        fp = group.flat_param
        grads = [p.grad for p in group.orig_params]
        group.had_grad = had = [g is not None for g in grads]
        if not any(had):  # the usual step (zero_grad set every .grad to None): nothing to add
            group.reduced_grad = reduced
            group.reduced = True
            return
        old = group.sharded_grad
        if old is not None and all(g is not None and is_view_of(g, old) for g in grads):
            old.add_(reduced)  # every .grad is still our view: accumulate in place
            reduced = old
        else:
            for g, s in zip(grads, fp._shard_slices):
                if g is not None and s.numel > 0:
                    reduced[s.shard_start:s.shard_start + s.numel].add_(g.reshape(-1).to(reduced.dtype))
        group.reduced_grad = reduced
        group.reduced = True

    def attach_grads(self, group: FlatGroup, used: Sequence[int], shard_group: Any, collective_device: torch.device) -> None:
        """After a synced backward: each original parameter's ``.grad`` is its view of the
        sharded gradient if it requires grad and had a gradient before or got one on some rank
        in this backward (``used``: per parameter, the number of ranks it was used on); otherwise
        ``None``, as local training leaves it. With a
        ``shard_group`` (one of several ranks) the views are ShardedGrad tensors over it, so
        torch's ``clip_grad_norm_`` sees the global norm ([Note: torch's clip_grad_norm_ on
        sharded gradients] in ``_runtime/interop.py``)."""
        sharded_grad = group.reduced_grad
        sources = self._grad_sources(group, shard_group, collective_device)
        # every parameter's slice in one split (a slice per parameter costs an index parse each)
        views = sharded_grad.split_with_sizes(group.shard_split_sizes) if sharded_grad is not None else None
        # each slice has its parameter's shape (both are the parameter's elements on this rank), so
        # autograd's setter takes it as is when dtype and device agree too (one check for the group)
        fits = (sharded_grad is not None and group.slices_are_params and sharded_grad.dtype is group.flat_param.dtype
                and sharded_grad.device == group.flat_param.device)
        mask, had = group.requires_grad_mask, group.had_grad
        for i, p in enumerate(group.orig_params):
            if views is not None and mask[i] and (had[i] or used[i]):
                view = views[i]
                source = sources[i]
                shown = as_sharded_grad(view, (), collective_device, source) if source else view
                if fits:
                    p.grad = shown
                else:
                    set_grad_of_any_shape(p, shown, like=view)
            else:
                p.grad = None
        group.sharded_grad_ref = weakref.ref(sharded_grad) if sharded_grad is not None else None
        group.reduced_grad = None  # from here on the views own it
        group.reduced = False
        group.used = [False] * len(group.orig_params)

    @staticmethod
    def _grad_sources(group: FlatGroup, shard_group: Any, device: torch.device) -> List[Optional[Any]]:
        """Per original parameter, the :func:`interop.shard_source` its ``.grad`` carries (``None``:
        its slice is its whole gradient), made once per shard group and device and kept on the group
        holding the groups weakly only (a destroyed process group must be freed)."""
        kept = group.grad_sources
        if kept is not None and (kept[0]() if kept[0] is not None else None) is shard_group and kept[1] == device:
            return kept[2]
        sources = []
        for tp in group.flat_param._pieces:
            over = norm_groups(shard_group, tp)
            sources.append(shard_source(over, device) if over else None)
        group.grad_sources = (weakref.ref(shard_group) if shard_group is not None else None, device, sources)
        return sources

    def discard_backward(self) -> None:
        """Forget every gradient of a backward that raised (and of unsynced backwards before
        it, which the failed one may have added to): nothing of it reaches ``.grad``."""
        for group in self.groups:
            group.padded_unsharded_flat.grad = None
            self._fold_unsynced_views(group, None)
            group.unreduced_grad = None
            group.grad_ready = False
            group.reduced = False
            group.reduced_grad = None
            group.landing_grad, group.landing_event = None, None
            group.used = [False] * len(group.orig_params)

    # ------------------------------------------------------------------ reduce transitions
    def reduce_dtype(self, group: FlatGroup) -> torch.dtype:
        """The dtype ``group``'s gradients are reduced in: the mixed precision's reduce dtype for
        a low-precision floating group, else the group's compute dtype."""
        return reduce_dtype_of(self.owner().mixed_precision, group.compute_dtype, group.full_precision)

    def reduce(self, group: FlatGroup, unsharded_grad: torch.Tensor) -> None:
        """Release every earlier handle's reduction input, then issue this group's reduction
        (see [Note: Reductions in flight]); the root waits for it at the end of backward."""
        owner = self.owner()
        root = owner.root
        if root is None:
            raise AssertionError(f"{self!r}: a reduction before lazy init")
        ctx = root.ctx
        if ctx.pending_reductions and owner.sync_gradients:
            self.release_earlier_reductions()
        reduction = Reduction(self, group, unsharded_grad)
        reduction.issue()
        ctx.pending_reductions.append(reduction)

    def release_earlier_reductions(self) -> None:
        """Wait for the reductions of other handles and drop their inputs (see [Note: Reductions
        in flight]). Runs just before this handle's unsharded gradient is allocated (the split's
        backward pre-hook), and again when its reduction is issued."""
        owner = self.owner()
        root = owner.root
        ctx = root._ctx if root is not None else None
        if ctx is None or not ctx.pending_reductions or not owner.sync_gradients:
            return
        still_pending: List[Reduction] = []
        for earlier in ctx.pending_reductions:
            if earlier.handle is not self:
                if earlier.stage == ISSUED:
                    earlier.release_input()
                if earlier.stage == REDUCED:
                    earlier.finish()
            if earlier.stage != DONE:
                still_pending.append(earlier)
        ctx.pending_reductions = still_pending

    def __repr__(self) -> str:
        return f"FlatParamHandle({self.fqn or '<root>'}, groups={len(self.groups)}, state={self.training_state.name})"


# Handles whose full parameters an initialization after ``to_empty`` is writing (see [Note:
# Initialization after to_empty]); usually empty. Whether it may hold one is read from a plain
# counter first (a WeakSet's truth value is a Python call, and this runs at every module's forward).
_PENDING_INIT: "weakref.WeakSet[FlatParamHandle]" = weakref.WeakSet()
_PENDING_INIT_ADDED = [0]  # at least len(_PENDING_INIT): added since it was last seen empty


def take_pending_init_values() -> None:
    """Before any use of a model: finish every initialization after ``to_empty`` (per process:
    handles of any model; no collective)."""
    if _PENDING_INIT_ADDED[0]:
        for handle in list(_PENDING_INIT):
            handle.take_init_values()
        _PENDING_INIT_ADDED[0] = len(_PENDING_INIT)


# ---------------------------------------------------------------------------- reductions
# [Note: Reductions in flight]  A handle's post-backward issues its reduce-scatter and returns;
# the next handle's backward computes while it runs. Its input, the unsharded gradient, is the
# largest buffer of the step, so it is released as soon as the next handle no longer overlaps
# it: when that handle's parameter gradients are all computed, just before they are concatenated into its own unsharded gradient (the pre-hook of
# its split backward), every earlier reduction is waited on (``Work.wait()`` on gloo; on CUDA the
# compute stream waits for the reduction's event, no CPU sync), its input dropped and its shard
# accumulated (FlatParamHandle.release_earlier_reductions). The reduction overlapped the whole
# backward of the next handle, and at most two handles' unsharded gradients are alive at once. A handle whose backward starts by recomputing
# its forward (activation checkpointing) releases them earlier, at its pre-backward: the
# recomputed activations are that handle's peak, and a user who checkpoints chose memory over
# speed (measured at W=2 on the standard model: about 2% slower with checkpointing, where the
# same early release would cost about 5% without it, and with it the peak equals torch FSDP2's,
# whose reduce-scatter on CPU is synchronous). The end of backward waits for the rest.
#
# Stages: ISSUED (reduce-scatter in flight, holds the unsharded gradient) -> REPLICATING (hybrid:
# all-reduce of the shard across replicas in flight) -> REDUCED (shard landed) -> DONE (divided,
# unless the collectives averaged: ``Reduction._averages_natively``, and accumulated into the
# group's sharded gradient). A backward that raised discards its
# reductions: they are still waited on, so every rank's collectives stay matched.

ISSUED, REPLICATING, REDUCED, DONE, DISCARDED = "ISSUED", "REPLICATING", "REDUCED", "DONE", "DISCARDED"


class Reduction:
    """One group's gradient reduction (see [Note: Reductions in flight])."""

    def __init__(self, handle: FlatParamHandle, group: FlatGroup, unsharded_grad: torch.Tensor) -> None:
        self.state: _Owner = handle.owner()  # owns the process groups and the divisor
        self.handle: FlatParamHandle = handle
        self.group: FlatGroup = group
        self.unsharded_grad: Optional[torch.Tensor] = unsharded_grad  # the collective's input until it lands
        self.pending: Optional[_collectives.Pending] = None  # the collective in flight
        self.reduced: Optional[torch.Tensor] = None  # the shard, once REDUCED with nothing left in flight
        self.stage: str = ISSUED
        self.event: Optional[Any] = None  # CUDA: recorded on the reduce-scatter stream after issuing
        # the dtype it is reduced in, and whether the collectives divide (ReduceOp.AVG), not finish
        self.reduce_dtype, self.averaged = self._plan()

    def _plan(self) -> Tuple[torch.dtype, bool]:
        """``(reduce dtype, averages natively)`` for the group, worked out again only when the
        state's mixed precision, divide factor or data-parallel world changes. The collectives
        average themselves (FSDP2's choice for float32 and bfloat16 on NCCL, saving a division
        kernel per reduction) when every group with several ranks averages natively and the
        divisor is the data-parallel world (not a custom divide factor)."""
        state = self.state
        key = (state.mixed_precision, state.gradient_divide_factor, state.dp_world_size)
        known = self.group.averages
        if known is not None and known[0] == key:
            return known[1]
        reduce_dtype = self.handle.reduce_dtype(self.group)
        groups = [g for g in (state.process_group if state.world_size > 1 else None, state.replicate_group)
                  if g is not None and _collectives.group_size(g) > 1]
        averages = (state.dp_world_size > 1 and state.gradient_divisor == state.dp_world_size and bool(groups)
                    and all(_collectives.averages_natively(g, reduce_dtype) for g in groups))
        self.group.averages = (key, (reduce_dtype, averages))
        return reduce_dtype, averages

    def issue(self) -> None:
        """Start the reduce-scatter (or, for a shard group of one rank, the replica all-reduce)."""
        state = self.state
        grad = self.unsharded_grad
        if grad is None:
            raise AssertionError(f"[rank {state.rank}] reduction of {self.handle.fqn!r} issued twice")
        streams = handle_streams(state, self.handle.compute_device)
        if grad.dtype != self.reduce_dtype:
            grad = grad.to(self.reduce_dtype)
        if not self.averaged and self.reduce_dtype not in (torch.float32, torch.float64) and state.gradient_divisor != 1:
            grad.div_(state.gradient_divisor)  # pre-divide low precision to avoid overflow
        self.unsharded_grad = grad
        output = torch.empty(grad.numel() // state.world_size, dtype=grad.dtype, device=grad.device) \
            if state.world_size > 1 else grad  # allocated on the compute stream, which frees it
        if streams.reduce_scatter is None:  # CPU: no stream to issue on, no event to record
            self._issue(output, grad)
            return
        with streams.run_on(streams.reduce_scatter):
            self._issue(output, grad)
            self.event = streams.record(streams.reduce_scatter)

    def _issue(self, output: torch.Tensor, grad: torch.Tensor) -> None:
        state = self.state
        if state.world_size > 1:
            self.pending = _collectives.reduce_scatter_into(output, grad, state.process_group, tag=self.handle.fqn,
                                                            match=self.handle.index + 1, average=self.averaged)
        else:
            self._replicate(grad)

    def _replicate(self, shard: torch.Tensor) -> None:
        group = self.state.replicate_group
        if group is not None and _collectives.group_size(group) > 1:
            op = dist.ReduceOp.AVG if self.averaged else dist.ReduceOp.SUM
            self.pending = _collectives.all_reduce(shard, group, tag=self.handle.fqn, op=op)
            self.stage = REPLICATING
        else:
            self.pending, self.reduced = None, shard
            self.stage = REDUCED

    def release_input(self) -> None:
        """Wait for the reduce-scatter, drop its input, and start the replica all-reduce if
        there is one. Post: stage REPLICATING or REDUCED."""
        if self.stage != ISSUED:  # a one-rank shard group starts in REPLICATING or REDUCED
            return
        output = self._pending().wait()
        Streams.wait(self.event)
        self.unsharded_grad = None
        streams = handle_streams(self.state, self.handle.compute_device)
        if streams.reduce_scatter is None:  # CPU: see issue
            self._replicate(output)
            return
        with streams.run_on(streams.reduce_scatter):
            self._replicate(output)
            self.event = streams.record(streams.reduce_scatter)

    def finish(self) -> None:
        """Wait for everything, average, accumulate into the group's sharded gradient.
        Post: DONE."""
        self.release_input()
        output = self.reduced if self.pending is None and self.reduced is not None else self._pending().wait()
        Streams.wait(self.event)
        self.unsharded_grad = None
        self.pending = self.reduced = None
        if not self.averaged and self.reduce_dtype in (torch.float32, torch.float64) and self.state.gradient_divisor != 1:
            output.div_(self.state.gradient_divisor)
        self.handle.accumulate_sharded_grad(self.group, output)
        self.stage = DONE

    def discard(self) -> None:
        """Wait for what is in flight (ranks stay matched), keep nothing. Post: DISCARDED."""
        if self.pending is not None:
            self.pending.wait()
            Streams.wait(self.event)
        self.pending = self.reduced = None
        self.unsharded_grad = None
        self.stage = DISCARDED

    def _pending(self) -> _collectives.Pending:
        if self.pending is None:
            raise AssertionError(f"[rank {self.state.rank}] reduction of {self.handle.fqn!r} has nothing pending "
                                 f"in stage {self.stage}")
        return self.pending
