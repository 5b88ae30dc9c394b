"""``unshard_params`` / ``summon_full_params``: full parameters (and optionally gradients)
outside forward/backward, with optional write-back into the shards.

Inside the context every original ``nn.Parameter`` of the selected handles has its full shape
and value (on rank 0 only with ``rank0_only``): its ``.data`` is a view of a full-precision
buffer gathered for the occasion, independent of the runtime's (possibly low-precision)
unsharded buffers. ``writeback=True`` copies this rank's chunk of that buffer back into the
shard on exit; ``writeback=False`` discards edits.

[Note: Tensor-parallel parameters under unshard_params]  A tensor-parallel parameter (see
[Note: Tensor-parallel pieces] in ``_runtime/flat_param.py``) is shown as forward shows it: its
slot holds a ``DTensor`` parameter with the parameter's mesh and placements whose local tensor is
the piece's view of the gathered buffer, so ``p.full_tensor()``, ``p.norm()`` and an EMA's
``lerp_`` see the global tensor, and edits of the local piece are what is written back. On exit the
slot gets the plain parameter back (the one an optimizer holds; inside the context its ``.data`` is
the piece, as before). A local tensor ``DTensor.from_local`` had to move to the mesh's device (a
CPU copy of ``offload_to_cpu`` on an accelerator mesh) is copied back before the write-back.

``writeback=True`` with ``rank0_only=True`` raises ``NotImplementedError``: other ranks would
have nothing to write back, so the shards would silently diverge from what rank 0 edited.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._runtime import collectives as _collectives
from .._runtime.module_state import HandleTrainingState, TrainingState, _FSDPState
from .._runtime.flat_param import FlatGroup, FlatParamHandle, set_grad_of_any_shape, take_pending_init_values
from .._runtime.hooks import raise_detached, recover_interrupted_backward, take_step_verdicts
from .._runtime.shard_math import param_offsets
from .._base.pieces import as_dtensor
from .._base.torch_compat import is_in_backward, set_module_tensor
from .._setup.validation import check_bool
from .._runtime.traversal import _get_fsdp_states
from ..contract import _get_module_state
from .load_transaction import agree_steps_now

__all__ = ["unshard_params", "check_between_steps", "check_module", "gather_flat", "local_flat", "param_views"]


@dataclass
class _Summoned:
    state: _FSDPState
    handle: FlatParamHandle
    group: FlatGroup
    full: torch.Tensor  # padded full-precision flat values (aliases the shard for one rank)
    saved_shard: Optional[torch.Tensor]  # copy to restore when writeback=False and full aliases the shard
    full_grad: Optional[torch.Tensor]  # padded full gradient (with_grads)
    grad_on_some_rank: List[bool]  # with_grads: per original parameter, some rank has a .grad
    saved_grads: List[Optional[torch.Tensor]]  # each original parameter's .grad on entry, restored on exit
    offloaded: bool = False  # full parameters exposed as CPU copies of ``full``
    shown: List[Optional[torch.Tensor]] = field(default_factory=list)  # per original parameter: the DTensor in
    # its slot while exposed (a tensor-parallel piece), else None; see [Note: Tensor-parallel parameters under unshard_params]


@contextlib.contextmanager
def unshard_params(module: nn.Module, *, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
                   offload_to_cpu: bool = False, with_grads: bool = False) -> Iterator[None]:
    """Expose full parameters of ``module``'s fully sharded modules inside the context.

    Example::

        with unshard_params(model):
            print(model.layers[0].weight.shape)   # full shape on every rank
        with unshard_params(model, writeback=True):
            model.head.weight.zero_()              # written back to every rank's shard

    A tensor-parallel (``DTensor``) parameter is a ``DTensor`` parameter with its placements and
    mesh, as in forward: its local tensor is this rank's whole piece (gathered over the
    data-parallel group), so ``p.full_tensor()`` and ``p.norm()`` are global; edits of the piece
    are written back.

    Args:
        module: a module containing fully sharded modules (or one itself).
        recurse: all handles in the subtree; False: only ``module``'s own handle.
        writeback: copy edits back to the shards on exit (False: discard them).
        rank0_only: only rank 0 of the shard group sees full parameters (others keep their
            shards); with tensor parallelism, each tensor-parallel rank of it.
        offload_to_cpu: full parameters are CPU copies (edits still written back); a
            tensor-parallel one stays on its mesh's device (a ``DTensor``'s local tensor is there).
        with_grads: also expose full gradients as ``.grad`` (``None`` where no rank has one;
            a ``DTensor`` with the parameter's placements for a tensor-parallel one).
    """
    check_module("unshard_params", module)
    for name, flag in (("recurse", recurse), ("writeback", writeback), ("rank0_only", rank0_only),
                       ("offload_to_cpu", offload_to_cpu), ("with_grads", with_grads)):
        check_bool("unshard_params", name, flag)
    if rank0_only and writeback:
        raise NotImplementedError("unshard_params(writeback=True, rank0_only=True) is not supported: ranks other "
                                  "than 0 have no full parameters to write back. Use writeback=False with rank0_only.")
    states = _selected_states(module, recurse)
    check_between_steps(states)
    agree_steps_now(module, "unshard_params", _UNSHARD_HINT)  # see [Note: Steps agreed before a saved model] in load_transaction.py
    if with_grads:
        _check_no_unsynced_views(states)
    summoned: List[_Summoned] = []
    for s in states:
        s.training_state = TrainingState.SUMMON_FULL_PARAMS
        if s.handle is not None:
            s.handle.enter(HandleTrainingState.SUMMON_FULL_PARAMS, "unshard_params")
            summoned.extend(_gather(s, s.handle, g, writeback, with_grads) for g in s.handle.groups)
    try:
        for item in summoned:
            _expose(item, rank0_only, offload_to_cpu)
        yield
    finally:
        for item in summoned:
            _restore(item, writeback and not rank0_only)
        for s in states:
            s.training_state = TrainingState.IDLE
            if s.handle is not None:
                s.handle.enter(HandleTrainingState.IDLE, "unshard_params exit")


def _check_no_unsynced_views(states: List[_FSDPState]) -> None:
    """``with_grads=True`` shows the reduced full gradient; between unsynced backwards there is
    none yet, and ``.grad`` already is this rank's full-shape local sum."""
    for s in states:
        if s.handle is not None and any(v is not None for g in s.handle.groups for v in g.unsynced_views):
            raise RuntimeError(f"unshard_params(with_grads=True) on {s.describe()} between backwards without gradient "
                               "sync: no gradient has been reduced yet, and each parameter's .grad already is this "
                               "rank's full-shape accumulated local gradient; read it directly, or run the synced "
                               "backward first.")


def check_module(api: str, module: Any) -> None:
    """``TypeError`` naming ``api`` unless ``module`` is an ``nn.Module``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{api}: module must be an nn.Module, got {type(module).__name__}")


def check_between_steps(states: List[_FSDPState], what: str = "unshard_params/summon_full_params",
                        detached: bool = True) -> None:
    """Refuse to run ``what`` during a forward or backward, or nested in ``unshard_params``;
    finish off a backward that raised (its end-of-backward step never ran), so any state
    between steps is accepted. ``detached``: also refuse a parameter cut loose from its flat
    shard ([Note: Detached parameters] in ``_runtime/hooks.py``): a state dict would hold the shard's
    old values (a user's trial saved them after ``vector_to_parameters``)."""
    take_pending_init_values()  # see [Note: Initialization after to_empty] in _runtime/flat_param.py
    roots = {id(s.root): s.root for s in states if s.root is not None}
    for root in roots.values():
        if root.ctx.forward_in_progress or (root.ctx.final_callback_queued and is_in_backward()):
            raise RuntimeError(f"{root.describe()}: {what} cannot be used during forward "
                               "or backward; call it between steps.")
        if root.ctx.final_callback_queued:
            recover_interrupted_backward(root)
        steps_disagree = take_step_verdicts(root)  # the last synced backward's, not read yet ([Note: Step agreement])
        if steps_disagree is not None:
            raise RuntimeError(steps_disagree)
    for s in states:
        if detached and s.handle is not None:
            cut_loose, _ = s.handle.unusable_params()
            if cut_loose:
                raise_detached(s, cut_loose)
        handle_state = s.handle.training_state if s.handle is not None else HandleTrainingState.IDLE
        if s.training_state is TrainingState.SUMMON_FULL_PARAMS or handle_state is not HandleTrainingState.IDLE:
            raise RuntimeError(f"{s.describe()}: {what} cannot be used during forward/backward "
                               f"or nested on the same module (handle state {handle_state.name}); call it between steps.")


def _selected_states(module: nn.Module, recurse: bool) -> List[_FSDPState]:
    if recurse:
        return _get_fsdp_states(module)
    state = _get_module_state(module, _FSDPState)
    if state is None:
        raise ValueError(f"unshard_params(recurse=False): {type(module).__name__} is not a fully sharded module; "
                         "pass a module fully_shard was applied to, or recurse=True.")
    return [state]


_UNSHARD_HINT = _collectives.collective_call_hint(
    "`unshard_params`", "To see the full parameters on rank 0 only, enter `unshard_params(model, rank0_only=True)` "
    "on every rank.")


def _gather(state: _FSDPState, handle: FlatParamHandle, group: FlatGroup, writeback: bool, with_grads: bool) -> _Summoned:
    shard = handle.on_compute_device(group.flat_param.data)
    full = gather_flat(state, shard, group.padded_numel, f"summon:{handle.fqn}", _UNSHARD_HINT)
    saved = shard.clone() if full is shard and not writeback else None  # one rank: edits land in the shard
    saved_grads = [p.grad for p in group.orig_params]
    full_grad, on_some_rank = _gather_grad(state, handle, group) if with_grads else (None, [])
    return _Summoned(state, handle, group, full, saved, full_grad, on_some_rank, saved_grads)


def _gather_grad(state: _FSDPState, handle: FlatParamHandle, group: FlatGroup) -> Tuple[Optional[torch.Tensor], List[bool]]:
    """The padded full gradient of ``group`` (this rank's ``.grad`` slices, zeros where a
    parameter has none), and per parameter whether some rank has a ``.grad``."""
    has = torch.tensor([p.grad is not None for p in group.orig_params], dtype=torch.int32, device=handle.compute_device)
    if state.world_size > 1:
        _collectives.all_reduce(has, state.process_group, tag="summon_has_grad", hint=_UNSHARD_HINT).wait()
    on_some_rank = [bool(v) for v in has.tolist()]
    if not any(on_some_rank):
        return None, on_some_rank
    local = local_flat(group, [p.grad for p in group.orig_params], group.flat_param.dtype)
    return gather_flat(state, local, group.padded_numel, f"summon_grad:{handle.fqn}", _UNSHARD_HINT), on_some_rank


def gather_flat(state: _FSDPState, shard: torch.Tensor, padded_numel: int, tag: str, hint: str,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The padded full flat tensor whose chunk ``rank`` is ``shard`` on each rank of the shard
    group (``shard`` itself for a group of one), in ``out`` if given: the one full-precision
    gather of ``unshard_params`` and of model and optimizer state dicts. ``hint``: the advice
    of the error raised if a rank never joins (see :func:`_collectives.collective_call_hint`)."""
    if state.world_size == 1:
        return shard
    if shard.device != state.compute_device:  # offloaded shards: collectives run on the compute device
        shard = shard.to(state.compute_device)
    full = torch.empty(padded_numel, dtype=shard.dtype, device=shard.device) if out is None else out
    _collectives.all_gather_into(full, shard.contiguous(), state.process_group, tag=tag, hint=hint).wait()
    return full


def local_flat(group: FlatGroup, values: Sequence[Optional[torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """A tensor laid out like ``group``'s shard holding ``values``, each original parameter's
    slice on this rank (``None``: zeros), e.g. its ``.grad`` or an optimizer state."""
    fp = group.flat_param
    local = torch.zeros(fp.numel(), dtype=dtype, device=fp.device)
    for value, s in zip(values, fp._shard_slices):
        if value is not None and s.numel:
            local[s.shard_start:s.shard_start + s.numel].copy_(value.reshape(-1))
    return local


def param_views(group: FlatGroup, full: torch.Tensor) -> List[torch.Tensor]:
    """Each original parameter of ``group``, in its shape, as a view of ``full`` (padded full flat)."""
    fp = group.flat_param
    return [full[o:o + n].view(shape) for o, n, shape in zip(param_offsets(fp._numels), fp._numels, fp._shapes)]


def _expose(item: _Summoned, rank0_only: bool, offload_to_cpu: bool) -> None:
    if rank0_only and item.state.rank != 0:
        return
    full = item.full.cpu() if offload_to_cpu and item.full.device.type != "cpu" else item.full
    pieces = param_views(item.group, full)
    grad_pieces = param_views(item.group, item.full_grad) if item.full_grad is not None else None
    for i, p in enumerate(item.group.orig_params):
        p.grad = None  # a sharded grad would not match the full shape; restored on exit
        p.data = pieces[i]
        if grad_pieces is not None and item.grad_on_some_rank[i]:
            p.grad = grad_pieces[i].to(p.device)
    item.offloaded = full is not item.full
    item.shown = _show_pieces(item.group)
    item.handle.full_params_exposed = True


def _show_pieces(group: FlatGroup) -> List[Optional[torch.Tensor]]:
    """Put a ``DTensor`` parameter over each exposed tensor-parallel piece (its ``.data``, and its
    ``.grad`` if any) in its slots; per original parameter the one shown, or ``None``."""
    fp = group.flat_param
    shown: List[Optional[torch.Tensor]] = []
    for p, piece, info in zip(group.orig_params, fp._pieces, fp._param_infos):
        if piece is None:
            shown.append(None)
            continue
        dtensor = nn.Parameter(as_dtensor(piece, p.data), requires_grad=p.requires_grad)
        if p.grad is not None:
            dtensor.grad = as_dtensor(piece, p.grad)
        set_module_tensor(info.module, info.param_name, dtensor)
        shown.append(dtensor)
    for sinfo in fp._shared_param_infos:
        tied = shown[sinfo.prim_param_index]
        if tied is not None:
            set_module_tensor(sinfo.module, sinfo.param_name, tied)
    return shown


def _unshow_pieces(item: _Summoned, writeback: bool) -> None:
    """Give the slots of the tensor-parallel pieces their plain parameters back; ``writeback``:
    first take each shown ``DTensor``'s local tensor into the piece if it is not the piece's
    memory (``from_local`` moved it to the mesh's device)."""
    group, fp = item.group, item.group.flat_param
    for p, tied, info in zip(group.orig_params, item.shown, fp._param_infos):
        if not isinstance(tied, DTensor):  # a plain parameter, shown as itself
            continue
        with torch.no_grad():
            local = tied.to_local()
            if writeback and local.data_ptr() != p.data.data_ptr():
                p.data.copy_(local)
        set_module_tensor(info.module, info.param_name, p)
    for sinfo in fp._shared_param_infos:
        if item.shown[sinfo.prim_param_index] is not None:
            set_module_tensor(sinfo.module, sinfo.param_name, group.orig_params[sinfo.prim_param_index])
    item.shown = []


def _restore(item: _Summoned, writeback: bool) -> None:
    group, handle, fp = item.group, item.handle, item.group.flat_param
    if item.shown:
        _unshow_pieces(item, writeback)
    if writeback and group.orig_params and item.offloaded:
        # Edits landed in the CPU copy: bring them back into the gathered buffer first.
        full_cpu = torch.cat([p.data.reshape(-1) for p in group.orig_params])
        item.full[: full_cpu.numel()].copy_(full_cpu)
    if writeback and item.full.data_ptr() != fp.data.data_ptr():
        # The full parameters are not the shard itself (a gather, or one rank's device copy of an
        # offloaded shard): this rank's chunk of them goes back into the shard.
        start = item.state.rank * fp.numel()
        fp.data.copy_(item.full[start:start + fp.numel()])
    if item.saved_shard is not None:
        fp.data.copy_(item.saved_shard)
    if writeback:
        handle.reshard(free=True)  # a kept unsharded buffer (reshard_after_backward=False) is stale now
    for p in group.orig_params:
        p.grad = None
    handle._point_params_at_shard(group)
    handle.full_params_exposed = False
    for p, grad in zip(group.orig_params, item.saved_grads):
        if grad is None:
            p.grad = None
        else:
            set_grad_of_any_shape(p, grad)  # a low-precision or placeholder-held gradient as it was
