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

This file registers no hooks and issues no collectives: ``unshard()`` delegates to the
runtime (``_runtime_utils.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from . import _shard_math
from ._common_utils import HandleTrainingState, _set_fsdp_flattened
from ._torch_compat import set_module_tensor

__all__ = ["FlatParameter", "FlatParamHandle", "ParamInfo", "SharedParamInfo", "FlatGroup"]


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
    sharded_grad: Optional[torch.Tensor] = None  # reduced gradient shard the .grad views point into
    pending_unshard: Optional[Any] = None  # _collectives.Pending of an in-flight all-gather
    comm_shard: Optional[torch.Tensor] = None  # cast/moved shard kept alive during the all-gather
    grad_ready: bool = False  # this backward's gradient was accumulated and taken

    @property
    def requires_grad(self) -> bool:
        return self.flat_param.requires_grad

    @property
    def padded_numel(self) -> int:
        return int(self.flat_param._padded_unsharded_size.numel())


def _alloc_storage(tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def _free_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def _storage_is_allocated(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().size() > 0


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
    ) -> None:
        self.module: nn.Module = module  # the fully sharded module that owns this handle
        self.fqn: str = module_fqn  # its FQN (for messages)
        self.rank: int = rank  # rank in the shard group
        self.world_size: int = world_size  # shard group size
        self.compute_device: torch.device = compute_device  # where the unsharded buffer lives
        self.training_state: HandleTrainingState = HandleTrainingState.IDLE
        self.groups: List[FlatGroup] = []  # one per (dtype, requires_grad), first-seen order
        self.is_unsharded: bool = False  # True while module slots hold unsharded views
        self.needs_pre_backward: bool = True  # False once this backward's pre-backward ran
        self.exec_index: Optional[int] = None  # position in the root's pre-forward order
        self.post_forward_index: Optional[int] = None  # position in the root's post-forward order
        self.pending_reductions: List[Any] = []  # reductions of this handle not yet finished
        self.unreduced_grads: Dict[int, torch.Tensor] = {}  # group index -> accumulated grad (no sync)
        self.state: Optional[Any] = None  # the owning _FSDPState (set by fully_shard; for unshard())
        self._build(params, module, module_fqn, param_dtype)

    # ------------------------------------------------------------------ construction
    def _build(self, params: Sequence[nn.Parameter], module: nn.Module, module_fqn: str,
               param_dtype: Optional[torch.dtype]) -> None:
        wanted = {id(p) for p in params}
        by_group: Dict[Tuple[torch.dtype, bool], List[Tuple[nn.Parameter, ParamInfo]]] = {}
        shared: Dict[Tuple[torch.dtype, bool], List[Tuple[SharedParamInfo, nn.Parameter]]] = {}
        first_index: Dict[int, Tuple[Tuple[torch.dtype, bool], int]] = {}
        for sub_name, sub in module.named_modules(remove_duplicate=False):
            for name, p in sub.named_parameters(recurse=False, remove_duplicate=False):
                if p is None or id(p) not in wanted:
                    continue
                key = (p.dtype, p.requires_grad)
                if id(p) in first_index:
                    gkey, index = first_index[id(p)]
                    shared.setdefault(gkey, []).append((SharedParamInfo(name, sub, sub_name, index), p))
                    continue
                group = by_group.setdefault(key, [])
                first_index[id(p)] = (key, len(group))
                group.append((p, ParamInfo(name, sub, sub_name)))
        for key, members in by_group.items():
            self.groups.append(self._build_group(key, members, shared.get(key, []), module_fqn, param_dtype))

    def _build_group(self, key: Tuple[torch.dtype, bool], members: List[Tuple[nn.Parameter, ParamInfo]],
                     shared: List[Tuple[SharedParamInfo, nn.Parameter]], module_fqn: str,
                     param_dtype: Optional[torch.dtype]) -> FlatGroup:
        dtype, requires_grad = key
        prefix = f"{module_fqn}." if module_fqn else ""
        numels = [p.numel() for p, _ in members]
        total = sum(numels)
        padded = _shard_math.padded_numel(total, self.world_size)
        start, end = _shard_math.chunk_bounds(total, self.world_size, self.rank)
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1).to(self.compute_device) for p, _ in members]) if members else torch.empty(0, dtype=dtype)
            shard = torch.zeros(end - start, dtype=dtype, device=self.compute_device)
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
        compute_dtype = param_dtype if (param_dtype is not None and dtype.is_floating_point) else dtype
        aliases = self.world_size == 1 and compute_dtype == dtype
        if aliases:
            unsharded = flat_param.data  # same storage, own version counter (see [Note: Views])
        else:
            unsharded = torch.empty(padded, dtype=compute_dtype, device=self.compute_device)
            _free_storage(unsharded)
        unsharded.requires_grad_(requires_grad)
        orig_params = [p for p, _ in members]
        group = FlatGroup(flat_param, orig_params, compute_dtype, unsharded, aliases,
                          numels + ([padded - total] if padded > total else []))
        self._point_params_at_shard(group)
        return group

    def _point_params_at_shard(self, group: FlatGroup) -> None:
        """Make each original parameter's data its (1-D) slice of the shard."""
        shard = group.flat_param.data
        for p, s in zip(group.orig_params, group.flat_param._shard_slices):
            p.data = shard[s.shard_start:s.shard_start + s.numel]

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
        compute dtype/device (kept alive on the group until the gather is waited)."""
        _alloc_storage(group.padded_unsharded_flat)
        shard = group.flat_param.data
        if shard.dtype != group.compute_dtype or shard.device != self.compute_device:
            shard = shard.to(device=self.compute_device, dtype=group.compute_dtype, non_blocking=True)
        group.comm_shard = shard
        return group.padded_unsharded_flat.data, shard

    def use_unsharded_views(self) -> None:
        """Install full-shape views of the unsharded buffers in the module slots.
        Pre: every group's unsharded buffer is filled."""
        for group in self.groups:
            fp = group.flat_param
            pieces = torch.split(group.padded_unsharded_flat, group.split_sizes)
            views = [piece.view(shape) for piece, shape in zip(pieces, fp._shapes)]
            for view, info in zip(views, fp._param_infos):
                set_module_tensor(info.module, info.param_name, view)
            for sinfo in fp._shared_param_infos:
                set_module_tensor(sinfo.module, sinfo.param_name, views[sinfo.prim_param_index])
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
        from ._runtime_utils import wait_unshard  # the runtime imports this module

        if self.state is None:
            raise RuntimeError(f"{self!r} is not owned by a fully sharded module")
        wait_unshard(self.state, self)

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

    # ------------------------------------------------------------------ gradients
    def take_unsharded_grad(self, group: FlatGroup) -> Optional[torch.Tensor]:
        """Detach the padded unsharded gradient from the leaf (so the next backward starts a
        fresh one) and return it, added to any gradient kept from unsynced backwards."""
        grad = group.padded_unsharded_flat.grad
        group.padded_unsharded_flat.grad = None
        index = self.groups.index(group)
        kept = self.unreduced_grads.pop(index, None)
        if kept is not None:
            grad = kept if grad is None else kept.add_(grad)
        return grad

    def keep_unreduced(self, group: FlatGroup, grad: torch.Tensor) -> None:
        """Keep an unsynced backward's unsharded gradient for the next synced one."""
        self.unreduced_grads[self.groups.index(group)] = grad

    def accumulate_sharded_grad(self, group: FlatGroup, reduced: torch.Tensor) -> None:
        """Make ``reduced`` (this rank's averaged shard, any dtype) the group's gradient, or add
        it to the existing one if the user kept gradients (no ``zero_grad``)."""
        fp = group.flat_param
        reduced = reduced.to(dtype=fp.dtype, device=fp.device)
        if group.sharded_grad is not None and self._grads_attached(group):
            group.sharded_grad.add_(reduced)
        else:
            group.sharded_grad = reduced
        self._attach_grads(group)

    def _grads_attached(self, group: FlatGroup) -> bool:
        return any(p.grad is not None for p in group.orig_params)

    def _attach_grads(self, group: FlatGroup) -> None:
        sharded_grad = group.sharded_grad
        if sharded_grad is None:
            return
        for p, s in zip(group.orig_params, group.flat_param._shard_slices):
            p.grad = sharded_grad[s.shard_start:s.shard_start + s.numel]

    def __repr__(self) -> str:
        return f"FlatParamHandle({self.fqn or '<root>'}, groups={len(self.groups)}, state={self.training_state.name})"
