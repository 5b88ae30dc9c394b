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
  that parameter's sum (``zero_grad()``), another tensor replaces it; then ``.grad`` is what
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

This file registers no hooks and issues no collectives: ``unshard()`` delegates to the
runtime (``_runtime_utils.py``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from . import _shard_math
from ._common_utils import HandleTrainingState, _set_fsdp_flattened
from ._interop import ShardedGrad, as_sharded_grad
from . import _watch
from ._streams import Streams
from ._torch_compat import has_grad_hooks, set_module_tensor, tensor_version

__all__ = ["FlatParameter", "FlatParamHandle", "ParamInfo", "SharedParamInfo", "FlatGroup", "set_grad_of_any_shape",
           "plan_groups", "compute_dtype_of"]


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
    parameter)."""

    _fqns: Tuple[str, ...]
    _param_infos: Tuple[ParamInfo, ...]
    _shared_param_infos: Tuple[SharedParamInfo, ...]
    _numels: Tuple[int, ...]
    _shapes: Tuple[torch.Size, ...]
    _unpadded_unsharded_size: torch.Size
    _padded_unsharded_size: torch.Size
    _shard_slices: Tuple[_shard_math.ParamSlice, ...]


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
    gathered_at: Tuple[int, int] = (-1, -1)  # (params' version sum, optimizer epoch) at the last gather
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
    def padded_numel(self) -> int:
        return int(self.flat_param._padded_unsharded_size.numel())


GroupKey = Tuple[torch.dtype, bool, bool]  # (dtype, requires_grad, kept in full precision)


def plan_groups(module: nn.Module, params: Sequence[nn.Parameter], param_dtype: Optional[torch.dtype],
                full_precision_classes: Tuple[type, ...]
                ) -> Tuple[Dict[GroupKey, List[Tuple[nn.Parameter, ParamInfo]]],
                           Dict[GroupKey, List[Tuple[SharedParamInfo, nn.Parameter]]]]:
    """The flat groups a handle over ``params`` of ``module`` is built from (``describe`` plans
    with this same function): parameters in ``named_modules`` order, each once, grouped by
    ``(dtype, requires_grad, kept in full precision)`` in first-seen order; the last is True for
    parameters of a module of ``full_precision_classes`` under a ``param_dtype`` (see [Note:
    Modules kept in full precision] in ``_mixed_precision.py``). Second registrations (tied
    weights) are returned apart, per group."""
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
            group = by_group.setdefault((p.dtype, p.requires_grad, full_precision), [])
            first_index[id(p)] = ((p.dtype, p.requires_grad, full_precision), len(group))
            group.append((p, ParamInfo(name, sub, sub_name)))
    return by_group, shared


def compute_dtype_of(dtype: torch.dtype, param_dtype: Optional[torch.dtype], full_precision: bool) -> torch.dtype:
    """The dtype a group of ``dtype`` parameters computes in: ``param_dtype`` for a floating
    group not kept in full precision, else its own."""
    if param_dtype is not None and dtype.is_floating_point and not full_precision:
        return param_dtype
    return dtype


def set_grad_of_any_shape(p: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """Make ``grad`` (any shape and dtype) ``p.grad`` and return the tensor ``p.grad`` now is.
    Autograd's setter wants ``p``'s shape, dtype and device, so a placeholder that has them
    (no storage of its own) is set first and ``grad`` put in through ``.data``."""
    if grad.shape == p.shape and grad.dtype == p.dtype and grad.device == p.device:
        p.grad = grad
    else:
        placeholder = torch.empty((), dtype=p.dtype, device=p.device).expand(p.shape)
        if isinstance(grad, ShardedGrad):  # the object .grad shows keeps clipping's global norm
            placeholder = placeholder.as_subclass(ShardedGrad)
            placeholder._cs_source = grad._cs_source
        p.grad = placeholder
        p.grad.data = grad
    return p.grad  # type: ignore[return-value]  # set above


def _alloc_storage(tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def _wider(dtype: torch.dtype, than: torch.dtype) -> bool:
    """Whether floating ``dtype`` has more mantissa bits than floating ``than``."""
    return (dtype.is_floating_point and than.is_floating_point
            and torch.finfo(dtype).eps < torch.finfo(than).eps)


def _free_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def _storage_is_allocated(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().size() > 0


class _SplitBackwardHook:
    """Autograd pre-hook of the split that makes a group's unsharded views; it runs when every
    view's gradient is computed, just before they are concatenated into the group's unsharded
    gradient. ``grad_outputs`` holds ``None`` for every view no gradient reached, so the others
    were used; and the handle's ``before_unsharded_grad`` callback runs (the runtime releases
    earlier reductions' buffers there, before this one is allocated)."""

    def __init__(self, handle: "FlatParamHandle", group: FlatGroup, from_forward: bool) -> None:
        self.handle = handle
        self.group = group
        self.from_forward = from_forward  # the split a grad-mode forward made (not a backward's or a recomputation's)

    def __call__(self, grad_outputs: Tuple[Optional[torch.Tensor], ...]) -> None:
        if self.from_forward:
            self.group.forward_grad_due = False
        used = self.group.used
        for i in range(len(used)):
            if grad_outputs[i] is not None:
                used[i] = True
        if self.handle.before_unsharded_grad is not None:
            self.handle.before_unsharded_grad()


class FlatParamHandle:
    """The flat parameters of one fully sharded module and every transition of their storage.

    Example (what the runtime does each step)::

        handle.unshard()            # all-gather issued via _runtime_utils; views installed
        handle.use_unsharded_views()
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
        self.before_unsharded_grad: Optional[Callable[[], None]] = None  # set by the runtime, see _SplitBackwardHook
        self.recomputes_in_backward: bool = False  # its forward runs again in backward (activation checkpointing)
        self.states_before_recompute: List[HandleTrainingState] = []  # pushed per recomputed forward in progress
        self.state: Optional[Any] = None  # the owning _FSDPState (set by fully_shard)
        self.unshard_fn: Optional[Callable[[], None]] = None  # the runtime's unshard of this handle (set with its hooks)
        self.keep_low_precision_grads: bool = False  # .grad in the compute dtype (see _mixed_precision.py)
        self._build(params, module, module_fqn, param_dtype, tuple(full_precision_classes))

    # ------------------------------------------------------------------ construction
    def _build(self, params: Sequence[nn.Parameter], module: nn.Module, module_fqn: str,
               param_dtype: Optional[torch.dtype], full_precision_classes: Tuple[type, ...]) -> None:
        by_group, shared = plan_groups(module, params, param_dtype, full_precision_classes)
        for key, members in by_group.items():
            built = self._build_group(key, members, shared.get(key, []), module_fqn, param_dtype)
            built.index = len(self.groups)
            self.groups.append(built)

    def _build_group(self, key: Tuple[torch.dtype, bool, bool], members: List[Tuple[nn.Parameter, ParamInfo]],
                     shared: List[Tuple[SharedParamInfo, nn.Parameter]], module_fqn: str,
                     param_dtype: Optional[torch.dtype]) -> FlatGroup:
        dtype, requires_grad, full_precision = key
        prefix = ""  # _fqns are relative to the owning module (API.md); module_fqn only names the handle
        numels = [p.numel() for p, _ in members]
        total = sum(numels)
        padded = _shard_math.padded_numel(total, self.world_size)
        start, end = _shard_math.chunk_bounds(total, self.world_size, self.rank)
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1).to(self.shard_device) for p, _ in members]) if members else torch.empty(0, dtype=dtype)
            shard = torch.zeros(end - start, dtype=dtype, device=self.shard_device, pin_memory=self._pins())
            valid = max(0, min(end, total) - start)
            if valid > 0:
                shard[:valid].copy_(flat[start:start + valid])
        flat_param = FlatParameter(shard, requires_grad=requires_grad)
        flat_param._fqns = tuple(f"{prefix}{info.module_name + '.' if info.module_name else ''}{info.param_name}" for _, info in members)
        flat_param._param_infos = tuple(info for _, info in members)
        flat_param._shared_param_infos = tuple(info for info, _ in shared)
        flat_param._numels = tuple(numels)
        flat_param._shapes = tuple(p.shape for p, _ in members)
        flat_param._unpadded_unsharded_size = torch.Size([total])
        flat_param._padded_unsharded_size = torch.Size([padded])
        flat_param._shard_slices = tuple(_shard_math.rank_param_slices(numels, self.world_size, self.rank))
        _set_fsdp_flattened(flat_param)
        compute_dtype = compute_dtype_of(dtype, param_dtype, full_precision)
        aliases = self.world_size == 1 and compute_dtype == dtype and self.shard_device == self.compute_device
        if aliases:
            unsharded = flat_param.data  # same storage, own version counter (see [Note: Views])
        else:
            unsharded = torch.empty(padded, dtype=compute_dtype, device=self.compute_device)
            _free_storage(unsharded)
        unsharded.requires_grad_(requires_grad)
        orig_params = [p for p, _ in members]
        group = FlatGroup(flat_param, orig_params, compute_dtype, unsharded, aliases,
                          numels + ([padded - total] if padded > total else []))
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

    def _point_params_at_shard(self, group: FlatGroup) -> None:
        """Make each original parameter's data its (1-D) slice of the shard."""
        shard = group.flat_param.data
        for p, s in zip(group.orig_params, group.flat_param._shard_slices):
            p.data = shard[s.shard_start:s.shard_start + s.numel]

    def unusable_params(self) -> Tuple[List[str], List[str]]:
        """FQNs (relative to the owning module) of original parameters the runtime cannot
        follow, in one pass: ``(detached, hooked)``. Detached ones no longer share storage with
        their group's flat shard (their ``.data`` was replaced after fully_shard); hooked ones
        carry gradient hooks, which never run here (see :func:`_torch_compat.has_grad_hooks`)."""
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

    def needs_unshard(self) -> bool:
        """True if some group's unsharded storage is not allocated and filled."""
        return any(not g.aliases_shard and not _storage_is_allocated(g.padded_unsharded_flat) for g in self.groups)

    def unsharded_storage_freed(self) -> bool:
        """True if every group that owns an unsharded buffer has freed its storage."""
        return all(g.aliases_shard or not _storage_is_allocated(g.padded_unsharded_flat) for g in self.groups)

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
        what the buffer is gathered from (see :meth:`is_stale`)."""
        _alloc_storage(group.padded_unsharded_flat)
        shard = group.flat_param.data
        if shard.dtype != group.compute_dtype or shard.device != self.compute_device:
            shard = shard.to(device=self.compute_device, dtype=group.compute_dtype, non_blocking=True)
        group.comm_shard = shard
        group.gathered_at = (self._version_sum(group), _watch.optimizer_epoch())
        return group.padded_unsharded_flat.data, shard

    def is_stale(self) -> bool:
        """True if a kept unsharded buffer may no longer hold the shards' values: an original
        parameter was edited in place, or an optimizer stepped, since it was gathered."""
        epoch = _watch.optimizer_epoch()
        return any(not g.aliases_shard and _storage_is_allocated(g.padded_unsharded_flat)
                   and g.gathered_at != (self._version_sum(g), epoch) for g in self.groups)

    @staticmethod
    def _version_sum(group: FlatGroup) -> int:
        return sum(tensor_version(p) for p in group.orig_params)

    def use_unsharded_views(self, forward: bool = False) -> None:
        """Install full-shape views of the unsharded buffers in the module slots.
        Pre: every group's unsharded buffer is filled. A parameter frozen after fully_shard
        gets a view that does not require grad; each view's use in backward is recorded in
        ``group.used`` (a parameter no backward reached keeps ``.grad = None``). ``forward``:
        made by a forward with grad enabled, whose gradient the runtime waits for (see
        [Note: Reentrant arrivals] in ``_runtime_utils.py``)."""
        for group in self.groups:
            fp = group.flat_param
            with torch.enable_grad():  # see [Note: Views made in backward]
                pieces = torch.split(group.padded_unsharded_flat, group.split_sizes)
                views = [piece.view(shape) if trainable else piece.detach().view(shape)
                         for piece, shape, trainable in zip(pieces, fp._shapes, group.requires_grad_mask)]
            for view, info in zip(views, fp._param_infos):
                set_module_tensor(info.module, info.param_name, view)
            for sinfo in fp._shared_param_infos:
                set_module_tensor(sinfo.module, sinfo.param_name, views[sinfo.prim_param_index])
            if pieces and pieces[0].grad_fn is not None:
                pieces[0].grad_fn.register_prehook(_SplitBackwardHook(self, group, forward))
                if forward:
                    group.forward_grad_due = True
        self.is_unsharded = True

    def use_sharded_views(self) -> None:
        """Put the original parameters (views of the shard) back in the module slots."""
        for group in self.groups:
            fp = group.flat_param
            for p, info in zip(group.orig_params, fp._param_infos):
                set_module_tensor(info.module, info.param_name, p)
            for sinfo in fp._shared_param_infos:
                set_module_tensor(sinfo.module, sinfo.param_name, group.orig_params[sinfo.prim_param_index])
        self.is_unsharded = False

    def unshard(self) -> None:
        """All-gather every group (through the runtime, which owns collectives and streams)
        and install unsharded views. Pre: owned by a fully sharded module."""
        if self.unshard_fn is None:
            raise RuntimeError(f"{self!r} is not owned by a fully sharded module")
        self.unshard_fn()

    def reshard(self, free: bool = True) -> None:
        """Original parameters back in the slots; if ``free``, release unsharded storage.
        Post: ``is_unsharded`` is False."""
        self.use_sharded_views()
        if free:
            for group in self.groups:
                if not group.aliases_shard:
                    _free_storage(group.padded_unsharded_flat)
        for group in self.groups:
            group.comm_shard = None

    # ------------------------------------------------------------------ requires_grad
    def refresh_requires_grad(self) -> List[FlatGroup]:
        """Follow ``requires_grad`` changed on original parameters since the last call
        (freeze/unfreeze after fully_shard): the unsharded buffer requires grad iff some
        parameter of its group does. Returns the groups that became trainable."""
        became_trainable: List[FlatGroup] = []
        for group in self.groups:
            mask = tuple(p.requires_grad for p in group.orig_params)
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
                    else:
                        pieces[i].view(shape).copy_(current)
            p.grad = before
        group.unsynced_views = [None] * len(group.orig_params)
        group.grads_before_views = [None] * len(group.orig_params)

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
        self._accumulate(group, reduced.to(dtype=dtype, device=fp.device))

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
        group.had_grad = [g is not None for g in grads]
        old = group.sharded_grad
        if old is not None and all(g is not None and g._base is old for g in grads):
            old.add_(reduced)  # every .grad is still our view: accumulate in place
            reduced = old
        else:
            for g, s in zip(grads, fp._shard_slices):
                if g is not None and s.numel > 0:
                    reduced[s.shard_start:s.shard_start + s.numel].add_(g.reshape(-1).to(reduced.dtype))
        group.reduced_grad = reduced
        group.reduced = True

    def attach_grads(self, group: FlatGroup, used: Sequence[bool], shard_group: Any, collective_device: torch.device) -> None:
        """After a synced backward: each original parameter's ``.grad`` is its view of the
        sharded gradient if it requires grad and had a gradient before or got one on some rank
        in this backward (``used``); otherwise ``None``, as local training leaves it. With a
        ``shard_group`` (one of several ranks) the views are ShardedGrad tensors over it, so
        torch's ``clip_grad_norm_`` sees the global norm ([Note: torch's clip_grad_norm_ on
        sharded gradients] in ``_interop.py``)."""
        sharded_grad = group.reduced_grad
        for i, (p, s) in enumerate(zip(group.orig_params, group.flat_param._shard_slices)):
            keep = sharded_grad is not None and group.requires_grad_mask[i] and (group.had_grad[i] or used[i])
            if keep:
                view = sharded_grad[s.shard_start:s.shard_start + s.numel]  # type: ignore[index]  # checked
                set_grad_of_any_shape(p, view if shard_group is None else as_sharded_grad(view, shard_group, collective_device))
            else:
                p.grad = None
        group.sharded_grad_ref = weakref.ref(sharded_grad) if sharded_grad is not None else None
        group.reduced_grad = None  # from here on the views own it
        group.reduced = False
        group.used = [False] * len(group.orig_params)

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

    def __repr__(self) -> str:
        return f"FlatParamHandle({self.fqn or '<root>'}, groups={len(self.groups)}, state={self.training_state.name})"
