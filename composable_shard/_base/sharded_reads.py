"""A sharded parameter read in a forward outside its own module's forward is refused, naming it.

[Note: Sharded parameters read in forward]
Between its own forward and backward a fully sharded module's parameters are 1-D views of this
rank's slice (see [Note: Views] in ``_runtime/flat_param.py``). Code that computes on one of
them elsewhere in the model's forward gets this rank's elements in the wrong shape, and where
they broadcast (a slice of one element, or as long as the last dimension) the result is
silently wrong on every rank, each differently:
  * a parent's forward reading a parameter of a separately fully sharded submodule without
    calling it (``h * self.gain.g``, ``F.linear(h, self.embed.weight)``);
  * a forward hook registered after ``fully_shard(child)``: the child's post-forward, which
    reshards, runs before it (a hook registered before ``fully_shard`` runs first and sees the
    full parameters).
torch's FSDP2 raises there (its sharded ``DTensor`` does not mix with plain tensors); FSDP1's
``use_orig_params=True`` computes on the slice as we did.

During the first forward with grad enabled and the first without (the root's pre-forward to its
post-forward), each sharded module slot holds a stand-in instead of the original parameter: a
:class:`ShardedInForward` over the same slice, whose ``__torch_function__`` answers what
describes a tensor (shape, dtype, device, ``requires_grad``, ``is_floating_point()``, ...) from
the original parameter, and lets a tensor lend its dtype and device (``x.to(w)``,
``x.type_as(w)``, ``w.new_zeros(...)``), and raises on everything else, naming the parameter
and what to do. A subclass costs nothing in the operations it takes no part in, and the
original parameters are back in their slots once the forward ends, where the optimizer, the
state dicts and a sum over the slices after the forward (a weight-decay term: correct, as the
gradient of each element lands on the rank that owns it) use them. A read on a path the first
forwards did not take is not seen.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, FrozenSet, Optional

import torch
import torch.nn as nn

from .tree import convert, tensors_in

__all__ = ["ShardedInForward", "stand_in_for"]


def _describing() -> FrozenSet[Callable[..., Any]]:
    T = torch.Tensor
    return frozenset([T.dim, T.size, T.numel, T.nelement, T.element_size, T.is_floating_point, T.is_complex,
                      T.is_contiguous, T.get_device, T.data_ptr, T.untyped_storage, T.__hash__, T.__repr__,
                      T.__format__, T.requires_grad_])


_DESCRIBING = _describing()
_LENDING_DTYPE = frozenset([torch.Tensor.to, torch.Tensor.type_as])  # another tensor takes this one's dtype/device
_NEW = frozenset([torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty, torch.Tensor.new_full,
                  torch.Tensor.new_tensor])  # a new tensor of the given shape, this one's dtype/device


class ShardedInForward(torch.Tensor):
    """What a sharded parameter's slot holds during the first forwards (see [Note: Sharded
    parameters read in forward]). ``_cs_param`` is the original parameter, ``_cs_name`` its FQN,
    ``_cs_owner`` the fully sharded module that holds it."""

    _cs_param: nn.Parameter
    _cs_name: str
    _cs_owner: str

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else None
        if (func in _DESCRIBING or getattr(func, "__name__", "") in ("__get__", "__set__")
                or (func in _LENDING_DTYPE and not isinstance(first, ShardedInForward))
                or (func in _NEW and isinstance(first, ShardedInForward))):
            return func(*convert(args, _original), **convert(kwargs, _original))
        stand_in = next((t for t in tensors_in((args, kwargs), None) if isinstance(t, ShardedInForward)), None)
        raise RuntimeError(_message(stand_in, func) if stand_in is not None else
                           "composable_shard: a sharded parameter was used in a forward outside its module's forward")


def _original(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._cs_param if isinstance(tensor, ShardedInForward) else tensor


def _message(stand_in: ShardedInForward, func: Callable[..., Any]) -> str:
    name, owner = stand_in._cs_name, stand_in._cs_owner
    what = getattr(func, "__name__", None) or repr(func)
    return (
        f"composable_shard: parameter {name!r} was used in a computation ({what}) during the model's forward while "
        f"{owner}, which holds it, has it sharded: outside {owner}'s own forward it is a 1-D view of this rank's "
        f"slice {tuple(stand_in._cs_param.shape)}, so the result would be computed on the wrong values. Either a "
        f"forward reads it without calling the module that holds it (call that module instead, or apply fully_shard "
        f"to a module whose forward contains the read, not to {owner} alone), or a forward hook registered after "
        f"fully_shard reads it (register the hook before fully_shard: it then runs before the parameters are "
        f"resharded). A sum over this rank's slices, such as a weight-decay term, belongs after the forward.")


def stand_in_for(param: nn.Parameter, name: str, owner: str) -> torch.Tensor:
    """The stand-in a sharded slot holds for ``param`` during the first forwards, or ``param``
    itself where it is not a plain tensor (a tensor-parallel or float8 piece: torch's own
    subclass refuses plain mixing already)."""
    if type(param.data) is not torch.Tensor:
        return param
    stand_in = param.detach().as_subclass(ShardedInForward)
    stand_in._cs_param = param
    stand_in._cs_name = name
    stand_in._cs_owner = owner
    return stand_in
