"""The parts of ``MixedPrecision`` beyond casting parameters: modules kept in full precision,
buffers in ``buffer_dtype``, and gradients kept in ``param_dtype``.

[Note: Modules kept in full precision]
  Modules of ``MixedPrecision._module_classes_to_ignore`` (``_BatchNorm`` by default) compute
  in their parameters' own dtype whatever the handle's ``param_dtype``: their parameters form a
  separate flat group of the handle whose compute dtype is the parameters' dtype (see
  ``FlatParamHandle``'s ``full_precision_classes``), or, under a policy, a handle of their own
  without mixed precision (``fully_shard_init._select_targets``). A forward pre-hook casts their
  floating inputs up to that dtype and a forward hook casts floating outputs back to the dtype
  the first floating input had, so the surrounding low-precision computation is unchanged.
  Their buffers (running statistics) are never cast.

[Note: Buffer dtype]
  ``buffer_dtype`` casts the floating buffers of the modules a handle owns (not of modules
  kept in full precision) once, when ``fully_shard`` is applied; they stay in that dtype, as
  torch's FSDP keeps them. ``state_dict()`` returns each in its original dtype (the dtype is
  recorded per module, see ``model_state_dict.register_buffer_dtypes``); loading copies into the
  cast buffer.

[Note: Low-precision gradients]
  ``keep_low_precision_grads=True`` leaves each original parameter's ``.grad`` in the handle's
  compute dtype (``param_dtype``) after the reduction, instead of casting it to the
  parameter's dtype: the optimizer then sees low-precision gradients, as with torch's FSDP.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .module_state import _FSDPState
from .traversal import owned_modules
from .._base.tree import convert

__all__ = ["apply_mixed_precision", "full_precision_classes"]

_HOOKED = "_composable_shard_full_precision_hooks"  # in a module's __dict__: hooks registered


def full_precision_classes(state_or_mp: Any) -> Tuple[type, ...]:
    """The module classes kept in full precision under ``state_or_mp``'s mixed precision (a
    state or a ``MixedPrecision``); ``()`` when neither parameters nor buffers are cast."""
    mp = getattr(state_or_mp, "mixed_precision", state_or_mp)
    if mp is None or (mp.param_dtype is None and mp.buffer_dtype is None):
        return ()
    return tuple(mp._module_classes_to_ignore)


def apply_mixed_precision(state: _FSDPState, module: nn.Module) -> List[Tuple[nn.Module, Dict[str, torch.dtype]]]:
    """Called by ``fully_shard`` once per fully sharded module, after its handle is built.
    Returns the modules whose buffers it cast, each with its buffers' original dtypes (what the
    state dict restores: ``model_state_dict.register_buffer_dtypes``, called by ``fully_shard``)."""
    cast: List[Tuple[nn.Module, Dict[str, torch.dtype]]] = []
    mp = state.mixed_precision
    if mp is None:
        return cast
    if state.handle is not None:
        state.handle.keep_low_precision_grads = bool(mp.keep_low_precision_grads)
    classes = full_precision_classes(mp)
    if classes:
        for m in module.modules():
            if isinstance(m, classes):
                _keep_full_precision(m)
    if mp.buffer_dtype is not None:
        for _, m in owned_modules(state, module):
            if not isinstance(m, classes):
                original = _cast_buffers(m, mp.buffer_dtype)
                if original:
                    cast.append((m, original))
    return cast


def _module_dtype(module: nn.Module) -> Optional[torch.dtype]:
    for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
        if t.is_floating_point():
            return t.dtype
    return None


def _keep_full_precision(module: nn.Module) -> None:
    """The cast hooks of [Note: Modules kept in full precision] (once per module)."""
    if module.__dict__.get(_HOOKED):
        return
    module.__dict__[_HOOKED] = True
    input_dtypes: List[Optional[torch.dtype]] = []  # a stack: a module may be called re-entrantly

    def pre_hook(mod: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        dtype = _module_dtype(mod)
        first: List[torch.dtype] = []

        def up(t: torch.Tensor) -> torch.Tensor:
            if not t.is_floating_point():
                return t
            if not first:
                first.append(t.dtype)
            return t.to(dtype) if dtype is not None and t.dtype != dtype else t

        args, kwargs = convert(args, up), convert(kwargs, up)
        input_dtypes.append(first[0] if first else None)
        return args, kwargs

    def post_hook(mod: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any) -> Any:
        dtype = input_dtypes.pop() if input_dtypes else None
        if dtype is None:
            return output
        return convert(output, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)

    module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    module.register_forward_hook(post_hook, with_kwargs=True)


def _cast_buffers(module: nn.Module, dtype: torch.dtype) -> Dict[str, torch.dtype]:
    """Cast ``module``'s own floating buffers to ``dtype``; returns their original dtypes."""
    original: Dict[str, torch.dtype] = {}
    for name, buf in list(module.named_buffers(recurse=False, remove_duplicate=False)):
        if buf.is_floating_point() and buf.dtype != dtype:
            original[name] = buf.dtype
            setattr(module, name, buf.to(dtype))  # an existing buffer slot: keeps its persistence
    return original
