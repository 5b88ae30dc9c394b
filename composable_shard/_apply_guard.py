"""Casts and moves of a fully sharded module: ``model.half()``, ``.to(dtype)``, ``.cuda()``,
``.to_empty()`` (``nn.Module._apply``).

Each sharded original parameter is a view of its flat shard; ``_apply`` gives parameters new
storage (it swaps ``.data``, or the objects), which would cut them loose: the forward would go on
computing on the shards and the optimizer would update copies nothing reads, so training would
silently do nothing. :func:`guard_apply` (behind ``FSDPModule._apply``) runs the call and, if it
cut any managed parameter loose, puts the module back as it was and raises; a call that leaves
every parameter where it is (``model.to(<its own device>)``, ``.float()`` on float32) is
allowed. fully_shard's own initialization (``param_init_fn`` calling ``to_empty`` on a parent of
sharded children) puts parameters back itself and runs unchecked (:func:`applying_during_init`).
Only the outermost fully sharded module of a call checks, so names are relative to the module
the user called. A plain submodule cast on its own (``model.blocks[0].fc1.half()``) is not seen
here; the next forward catches it (see [Note: Detached parameters] in ``_runtime_utils.py``).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from ._flat_param import set_grad_of_any_shape
from ._torch_compat import set_module_tensor

if TYPE_CHECKING:
    from ._common_utils import _FSDPState

__all__ = ["guard_apply", "applying_during_init"]

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


_Saved = Tuple[nn.Module, List[Tuple[str, Any]], List[Tuple[str, Any]]]  # module, its parameter and buffer slots
_Tensors = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]  # p, .data, .grad, .grad.data


def guard_apply(module: nn.Module, states: Iterable["_FSDPState"], apply: Callable[[], nn.Module]) -> nn.Module:
    """Run ``apply()`` (``nn.Module._apply`` on ``module``, a fully sharded module whose subtree
    holds ``states``); if it gave any of their original parameters new storage, dtype, device or
    object, put every parameter (object, ``.data``, ``.grad``) and buffer of the subtree back and
    raise ``RuntimeError`` naming them. See "Casts and moves" above."""
    if _depth["init"] or _depth["apply"]:  # init, or inside an outer guarded call
        return apply()
    managed = [(p, slot) for s in states if s.handle is not None
               for g in s.handle.groups for p, slot in zip(g.orig_params, g.flat_param._param_infos)]
    if not managed:
        return apply()
    order = {id(p): (i, n) for i, (n, p) in reversed(list(enumerate(module.named_parameters(remove_duplicate=False))))}
    saved: List[_Saved] = [(m, list(m.named_parameters(recurse=False, remove_duplicate=False)),
                            list(m.named_buffers(recurse=False, remove_duplicate=False))) for m in module.modules()]
    tensors: Dict[int, _Tensors] = {}
    for _, slots, _ in saved:
        for _, p in slots:
            if p is not None and id(p) not in tensors:
                tensors[id(p)] = (p, p.data, p.grad, None if p.grad is None else p.grad.data)
    _depth["apply"] += 1
    try:
        result = apply()
    except BaseException:
        _put_back(saved, tensors)
        raise
    finally:
        _depth["apply"] -= 1
    cut = [n for _, n in sorted(order.get(id(p), (len(order), slot.param_name)) for p, slot in managed
                                if getattr(slot.module, slot.param_name, None) is not p or _moved(p, tensors[id(p)][1]))]
    if not cut:
        return result
    _put_back(saved, tensors)
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p, _ in managed})
    raise RuntimeError(
        f"{type(module).__name__}._apply (.to(), .half(), .cuda(), ...): it would give {cut[:3]}"
        f"{' and others' if len(cut) > 3 else ''} new storage, cutting them loose from the flat shards fully_shard "
        "gathers from: the forward would keep computing on the old values and the optimizer would update copies "
        f"nothing reads. The module is unchanged (parameters {', '.join(dtypes)}, on {managed[0][0].device}). Cast or "
        "move the model before fully_shard (device_id= moves it there); for low-precision compute use "
        "mixed_precision=MixedPrecision(param_dtype=...). A model built on the meta device needs no to_empty() "
        "afterwards: fully_shard materialized it (param_init_fn=, or each module's reset_parameters()).")


def _moved(p: torch.Tensor, before: torch.Tensor) -> bool:
    return (p.dtype != before.dtype or p.device != before.device or p.shape != before.shape
            or p.storage_offset() != before.storage_offset()
            or p.untyped_storage().data_ptr() != before.untyped_storage().data_ptr())


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

