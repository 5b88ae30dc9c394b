"""Casts and moves of a fully sharded or replicated module: ``model.half()``, ``.to(dtype)``,
``.cuda()``, ``.to_empty()`` (``nn.Module._apply``).

Each sharded original parameter is a view of its flat shard; ``_apply`` gives parameters new
storage (it swaps ``.data``, or the objects), which would cut them loose: the forward would go on
computing on the shards and the optimizer would update copies nothing reads, so training would
silently do nothing. Under ``replicate`` the gradient buckets and hooks were built for the
parameters as they were, and a cast leaves the gradients unaveraged. :func:`guard_apply` (behind
``_apply`` of ``FSDPModule`` and ``ReplicateModule``, through :class:`GuardedApply`) runs the
call and, if it cut any managed parameter loose, puts the module back as it was and raises; a call that leaves
every parameter where it is (``model.to(<its own device>)``, ``.float()`` on float32) is
allowed, and so is one that only copies parameters onto the device and dtype they already have
(``.to("cpu:0")`` on the CPU, as ``accelerate`` moves models): the originals are put back and
the call is a no-op. fully_shard's own initialization (``param_init_fn`` calling ``to_empty`` on a parent of
sharded children) puts parameters back itself and runs unchecked (:func:`applying_during_init`).
The outermost annotated module of a call checks every nested one's parameters too, so names are
relative to the module the user called. A plain submodule cast on its own (``model.blocks[0].fc1.half()``) is not seen
here; the next forward catches it (see [Note: Detached parameters] in ``_runtime/hooks.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._runtime.flat_param import set_grad_of_any_shape, take_pending_init_values
from .._base.torch_compat import GuardedApplyHook, set_module_tensor
from .._base.tree import local_piece

__all__ = ["guard_apply", "applying_during_init", "in_init", "GuardedApply", "same_view"]

_depth = {"init": 0, "apply": 0}  # fully_shard's init calls in progress; guarded _apply calls in progress


@contextlib.contextmanager
def applying_during_init() -> Iterator[None]:
    """fully_shard's initialization runs user init code that may cast or move sharded children
    (``to_empty``) and puts their parameters back itself: :func:`guard_apply` lets it through."""
    _depth["init"] += 1
    try:
        yield
    finally:
        _depth["init"] -= 1


def in_init() -> bool:
    """Is fully_shard's initialization running user init code (see :func:`applying_during_init`)?"""
    return _depth["init"] > 0


class GuardedApply(GuardedApplyHook):
    """Mixin of ``FSDPModule`` and ``ReplicateModule`` that puts :func:`guard_apply` behind
    ``.to()``, ``.half()``, ``.cuda()`` ...; the class names, for the error, what a cast cuts
    parameters loose from (``_apply_what``) and what to do instead (``_apply_advice``)."""

    def _cs_guarded_apply(self, apply: Callable[[], Any], fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        """Run ``apply()`` (``nn.Module._apply`` on this module, ``fn`` per tensor) through :func:`guard_apply`."""
        return guard_apply(self, apply, fn)  # type: ignore[arg-type]  # self is an nn.Module


_Saved = Tuple[nn.Module, List[Tuple[str, Any]], List[Tuple[str, Any]]]  # module, its parameter and buffer slots
_Tensors = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]  # p, .data, .grad, .grad.data


def guard_apply(module: nn.Module, apply: Callable[[], nn.Module],
                fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> nn.Module:
    """Run ``apply()`` (``nn.Module._apply`` on ``module``, a fully sharded or replicated
    module, applying ``fn`` to each tensor). If it gave a parameter some annotated module of the
    subtree manages (``_guarded_params()``) new storage, dtype, device or object, put every
    parameter (object, ``.data``, ``.grad``) and buffer of the subtree back and raise, with the
    owner's advice. A tensor-parallel (``DTensor``) parameter cannot be put back (``_apply``
    swaps the object's contents), so ``fn`` is tried on its local piece first and the call is
    refused before it runs if that would not leave the piece where it is."""
    if _depth["init"] or _depth["apply"]:  # init, or inside an outer guarded call
        return apply()
    take_pending_init_values()  # see [Note: Initialization after to_empty] in _runtime/flat_param.py
    owners: Dict[int, Any] = {id(p): m for m in module.modules() if hasattr(m, "_guarded_params")
                              for p in getattr(m, "_guarded_params")()}
    if not owners:
        return apply()
    _refuse_moving_pieces(module, owners, fn)
    saved: List[_Saved] = [(m, list(m.named_parameters(recurse=False, remove_duplicate=False)),
                            list(m.named_buffers(recurse=False, remove_duplicate=False))) for m in module.modules()]
    tensors: Dict[int, _Tensors] = {}
    for _, slots, _ in saved:
        for _, p in slots:
            if id(p) not in tensors:
                tensors[id(p)] = (p, p.data, p.grad, None if p.grad is None else p.grad.data)
    _depth["apply"] += 1
    try:
        result = apply()
    except BaseException:
        _put_back(saved, tensors)
        raise
    finally:
        _depth["apply"] -= 1
    cut_ids = {id(p) for m, slots, _ in saved for name, p in slots
               if id(p) in owners and (getattr(m, name, None) is not p or not same_view(*tensors[id(p)][:2]))}
    if not cut_ids:
        return result
    copies_only = all(_same_place_copy(getattr(m, name), tensors[id(p)][1])
                      for m, slots, _ in saved for name, p in slots if id(p) in cut_ids)
    cut = [(n, p) for n, p in module.named_parameters(remove_duplicate=False) if id(p) in cut_ids]  # model order
    _put_back(saved, tensors)
    if copies_only:
        return result  # e.g. .to("cpu:0") on the CPU: copies that change nothing; the originals are back
    raise _cut_loose(module, cut, owners, "")


def _cut_loose(module: nn.Module, cut: Sequence[Tuple[str, torch.Tensor]], owners: Dict[int, Any], kind: str) -> RuntimeError:
    """The refusal of a call that would give the parameters ``cut`` (named, model order) new
    storage; ``kind`` qualifies them in the message ("the tensor-parallel ")."""
    owner, first = owners[id(cut[0][1])], cut[0][1]
    return RuntimeError(
        f"{type(module).__name__}._apply (.to(), .half(), .cuda(), ...): it would give {kind}"
        f"{[n for n, _ in cut[:3]]}{' and others' if len(cut) > 3 else ''} new storage, cutting them loose from "
        f"{owner._apply_what}: {owner._apply_advice} The module is unchanged (parameters "
        f"{str(first.dtype).replace('torch.', '')}, on {first.device}).")


def _refuse_moving_pieces(module: nn.Module, owners: Dict[int, Any],
                          fn: Optional[Callable[[torch.Tensor], torch.Tensor]]) -> None:
    """Raise, changing nothing, if ``fn`` would give the local piece of a managed ``DTensor``
    parameter new storage (see :func:`guard_apply`)."""
    if fn is None:
        return
    moved = [(n, p) for n, p in module.named_parameters(remove_duplicate=False)
             if id(p) in owners and isinstance(p, DTensor) and not same_view(fn(p.to_local()), p.to_local())]
    if moved:
        raise _cut_loose(module, moved, owners, "the tensor-parallel ")


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do ``a`` and ``b`` (a parameter and its ``.data`` before a call) view the same elements of
    the same storage? Both storage addresses are read now: a call that moves the storage itself
    in place (``share_memory()``) keeps the parameter attached. A ``DTensor``: its local piece."""
    a, b = local_piece(a), local_piece(b)
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.device == b.device
            and a.dtype == b.dtype and a.storage_offset() == b.storage_offset()
            and a.shape == b.shape and a.stride() == b.stride())


def _same_place_copy(p: torch.Tensor, before: torch.Tensor) -> bool:
    """Was ``p``'s new value (read while it is in place, before :func:`_put_back`) a copy
    of ``before`` on the same device with the same dtype, shape and values? ``.to("cpu:0")`` on
    CPU tensors copies them although ``cpu:0`` is the device they are on; such a call changes
    nothing once the originals are put back, so it is a no-op rather than an error."""
    return p.dtype == before.dtype and p.device == before.device and p.shape == before.shape and bool(torch.equal(p, before))


def _put_back(saved: List[_Saved], tensors: Dict[int, _Tensors]) -> None:
    """Every parameter object back in its slots with its ``.data``; its ``.grad`` object back
    with its ``.data`` (``_apply`` swaps a gradient's ``.data`` in place); buffers back."""
    for p, data, grad, grad_data in tensors.values():
        p.data = data
        if grad is None or grad_data is None:
            p.grad = None
        else:
            grad.data = grad_data
            set_grad_of_any_shape(p, grad)  # type: ignore[arg-type]  # an nn.Parameter
    for m, params, buffers in saved:
        for name, p in params:
            set_module_tensor(m, name, p)
        for name, b in buffers:
            setattr(m, name, b)  # an existing buffer slot: keeps its persistence

