"""Seams with the training stacks users already run: torch's own gradient clipping on sharded
gradients, and torch's data-parallel wrappers around managed modules.

[Note: torch's clip_grad_norm_ on sharded gradients]
  Every framework loop (Hugging Face ``Trainer``/``accelerate``, Lightning, torchtune, a plain
  loop) clips with ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``. Under
  ``fully_shard`` each original parameter's ``.grad`` is a view of this rank's slice only, so
  the norm torch computes would be this rank's, each rank would scale its slices by a different
  factor, and the ranks' updates would silently stop being those of one model. So a synced
  backward attaches each sharded ``.grad`` as a :class:`ShardedGrad`: a plain tensor in every
  respect (every operation on it runs unchanged and returns plain tensors), except that a norm
  asked for by torch's ``torch.nn.utils.clip_grad`` module (``clip_grad_norm_``,
  ``get_total_norm``; recognised by the calling frame's module) returns a :class:`PartialNorm`:
  this rank's norm, tagged with the shard group it must be combined over. Moving it
  (``.to``) and stacking it keep the tag, so torch's ``vector_norm(stack(norms))`` reaches
  :meth:`PartialNorm.__torch_function__` with all of them and combines each group's
  contributions with one all-reduce per process group (usually one); any other operation on a
  partial norm first resolves it the same way. The clip coefficient is then the global one on
  every rank, exactly as the library's ``clip_grad_norm_``. A norm taken anywhere else (a
  user's ``p.grad.norm()`` for logging, perhaps on rank 0 only) stays this rank's and issues
  no collective, as before. Gradients of ``replicate`` and of ``NO_SHARD`` are whole and equal
  on every rank already: they stay plain tensors. Norm orders: any p-norm, ``inf``, ``-inf``
  and 0 (an empty slice contributes the identity of its reduction).

[Note: Foreign wrappers]
  torch's ``DistributedDataParallel`` and FSDP (FSDP1's class, FSDP2's ``fully_shard``, torch's
  composable ``replicate``) around a module this library manages, or around a parent of one,
  would broadcast rank 0's parameter *slices* over the other ranks' (which silently corrupts
  them when the slices happen to have equal sizes), reduce gradients a second time, or reshard
  views of our shards. Each of them walks the module tree with ``named_modules()`` or
  ``named_children()`` before its first collective, and ours are overridden by
  :class:`ForeignWrapperGuard` to look at the Python frames that called them: if one belongs to
  such a constructor, it raises, before anything was changed or communicated, on every rank
  (every rank constructs the wrapper). The frames are matched by module and function name only;
  the library imports none of those wrappers.
"""

from __future__ import annotations

import inspect
import math
import weakref
from types import FrameType
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _collectives
from ._torch_compat import FOREACH_NORM as _FOREACH_NORM, as_plain, plain_torch_function
from ._tree_utils import convert

__all__ = ["ShardedGrad", "PartialNorm", "as_sharded_grad", "ForeignWrapperGuard"]

_CLIP_MODULE = "torch.nn.utils.clip_grad"
_VECTOR_NORM = torch.linalg.vector_norm
_CLIP_HINT = _collectives.collective_call_hint(
    "torch.nn.utils.clip_grad_norm_ on a fully sharded model",
    "Every rank needs the global norm: call it on every rank after the same backward.")

_METADATA = frozenset({"__get__", "dim", "size", "numel", "element_size", "is_floating_point", "is_complex"})
# (the shard group, weakly: see [Note: Process groups held weakly]; the device its collectives run
# on); None: the gradient is whole and equal on every rank
_Source = Optional[Tuple["weakref.ReferenceType[Any]", torch.device]]


class ShardedGrad(torch.Tensor):
    """This rank's slice of a fully sharded parameter's averaged gradient, as ``.grad`` shows
    it after a synced backward: an ordinary tensor, except that torch's ``clip_grad_norm_`` and
    ``get_total_norm`` see the norm over every rank's slices (see [Note: torch's
    clip_grad_norm_ on sharded gradients])."""

    _cs_source: Tuple["weakref.ReferenceType[Any]", torch.device]  # the shard group (weakly) and its collectives' device

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Sequence[Any] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        if (func is _VECTOR_NORM or func is _FOREACH_NORM) and _called_from_torch_clipping():
            return _partial_norms(func, args, kwargs or {})
        return plain_torch_function(func, args, kwargs or {})


class PartialNorm(torch.Tensor):
    """Norms of this rank's gradient slices that still have to be combined across ranks: one
    element per gradient, each with its source (see [Note: torch's clip_grad_norm_ on sharded
    gradients]). Exists only inside torch's clipping functions."""

    _cs_sources: Tuple[_Source, ...]  # per element, in order
    _cs_ord: float  # the norm order of every element

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Sequence[Any] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _METADATA:  # .device, .dim(), ...: nothing to combine
            return plain_torch_function(func, args, kwargs)
        if func is torch.Tensor.to and isinstance(args[0], PartialNorm):
            moved = plain_torch_function(func, args, kwargs)
            return _make_partial(moved, args[0]._cs_sources, args[0]._cs_ord)
        if func is torch.stack and not kwargs.get("dim") and len(args) == 1 and _stackable(args[0]):
            return _stack_partials(args[0])
        return plain_torch_function(func, [_resolve_all(a) for a in args],
                                    {k: _resolve_all(v) for k, v in kwargs.items()})


def as_sharded_grad(grad: torch.Tensor, group: Any, device: torch.device) -> ShardedGrad:
    """``grad`` (a view of this rank's gradient shard) as a :class:`ShardedGrad` over ``group``,
    sharing its storage; ``device``: where the group's collectives run (the compute device,
    also when the gradient was offloaded to the CPU)."""
    shown = grad.as_subclass(ShardedGrad)
    shown._cs_source = (weakref.ref(group), device)
    return shown  # type: ignore[return-value]  # as_subclass returns the subclass


def _called_from_torch_clipping() -> bool:
    """Is the Python frame that called the torch function in torch's clipping module?"""
    frame = inspect.currentframe()
    caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
    return caller is not None and caller.f_globals.get("__name__") == _CLIP_MODULE


def _ord_of(func: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any]) -> float:
    if "ord" in kwargs:
        return float(kwargs["ord"])
    if len(args) > 1 and not isinstance(args[1], (torch.dtype, bool)) and args[1] is not None:
        return float(args[1])
    return 2.0


def _local_norm(grad: torch.Tensor, order: float, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """This rank's norm of its slice; an empty slice gives the identity of the reduction."""
    plain = as_plain(grad)
    if plain.numel() == 0 and math.isinf(order):
        value = math.inf if order < 0 else 0.0
        return torch.full((), value, dtype=dtype or plain.dtype, device=plain.device)
    return torch.linalg.vector_norm(plain, order, dtype=dtype)


def _partial_norms(func: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """``vector_norm(grad, ord)`` or ``_foreach_norm(grads, ord)`` as partial norms."""
    order = _ord_of(func, args, kwargs)
    dtype = kwargs.get("dtype")
    if func is _FOREACH_NORM:
        return [_make_partial(_local_norm(g, order, dtype), (_source_of(g),), order) for g in args[0]]
    if kwargs.get("dim") is not None or kwargs.get("keepdim"):
        return plain_torch_function(func, args, kwargs)  # not a whole-tensor norm: not clipping's
    return _make_partial(_local_norm(args[0], order, dtype), (_source_of(args[0]),), order)


def _source_of(tensor: Any) -> _Source:
    return tensor._cs_source if isinstance(tensor, ShardedGrad) else None


def _make_partial(value: torch.Tensor, sources: Tuple[_Source, ...], order: float) -> PartialNorm:
    partial = value.as_subclass(PartialNorm)
    partial._cs_sources, partial._cs_ord = sources, order
    return partial  # type: ignore[return-value]  # as_subclass returns the subclass


def _stackable(items: Any) -> bool:
    """A list of 0-d norms, some partial, all partial ones of one order."""
    if not isinstance(items, (list, tuple)) or not items:
        return False
    orders = {t._cs_ord for t in items if isinstance(t, PartialNorm)}
    return len(orders) == 1 and all(isinstance(t, torch.Tensor) and as_plain(t).dim() == 0 for t in items)


def _stack_partials(items: Sequence[torch.Tensor]) -> PartialNorm:
    """One partial norm of the stacked ``items`` (see :func:`_stackable`); a plain one has no source."""
    sources = [source for t in items for source in (t._cs_sources if isinstance(t, PartialNorm) else (None,))]
    order = next(t._cs_ord for t in items if isinstance(t, PartialNorm))
    return _make_partial(torch.stack([as_plain(t) for t in items]), tuple(sources), order)


def _resolve_all(value: Any) -> Any:
    """``value`` with every partial norm in it resolved (see :func:`_resolve`)."""
    return convert(value, lambda t: _resolve(t) if isinstance(t, PartialNorm) else t)


def _resolve(partial: PartialNorm) -> torch.Tensor:
    """Each element's norm over every rank: this rank's contributions of each shard group
    combined with one all-reduce per group (in order of first appearance: the same on every
    rank, which holds the same gradients)."""
    local = as_plain(partial)
    flat = local.reshape(-1)
    order = partial._cs_ord
    out = flat.clone()
    groups: Dict[int, List[int]] = {}
    for i, source in enumerate(partial._cs_sources):
        if source is not None:
            groups.setdefault(id(source[0]()), []).append(i)
    for members in groups.values():
        group_ref, device = partial._cs_sources[members[0]]  # type: ignore[misc]  # members are sourced
        group = group_ref()
        if group is None:
            raise RuntimeError("torch.nn.utils.clip_grad_norm_: the process group these fully sharded gradients were "
                               "reduced over was destroyed; clip before dist.destroy_process_group.")
        index = torch.tensor(members, device=flat.device)
        contribution = _to_sum_space(flat.index_select(0, index).to(device=device, dtype=torch.float32), order)
        op = dist.ReduceOp.SUM if not math.isinf(order) else dist.ReduceOp.MAX if order > 0 else dist.ReduceOp.MIN
        _collectives.all_reduce(contribution, group, tag="torch_clip_grad_norm", op=op, hint=_CLIP_HINT).wait()
        out.index_copy_(0, index, _from_sum_space(contribution, order).to(device=flat.device, dtype=flat.dtype))
    return out.reshape(local.shape)


def _to_sum_space(norms: torch.Tensor, order: float) -> torch.Tensor:
    """What adds up across ranks: ``|x|_p ** p`` (a count for p = 0; the norm itself for ±inf)."""
    return norms if math.isinf(order) or order == 0 else norms.pow(order)


def _from_sum_space(summed: torch.Tensor, order: float) -> torch.Tensor:
    return summed if math.isinf(order) or order == 0 else summed.pow(1.0 / order)


# ---------------------------------------------------------------------------------- wrappers

# (defining module's last component, function name) of the constructors that must not wrap a
# managed module, in modules under ``torch.``: DistributedDataParallel.__init__ (in torch's nn
# package, ``parallel.distributed``), FSDP1's FullyShardedDataParallel.__init__, FSDP2's
# fully_shard, torch's composable replicate. See [Note: Foreign wrappers].
_DDP_MODULE_SUFFIX = ".parallel.distributed"  # torch's nn package
_FOREIGN = {("distributed", "__init__"): "DistributedDataParallel",
            ("fully_sharded_data_parallel", "__init__"): "torch's FullyShardedDataParallel",
            ("_fully_shard", "fully_shard"): "torch's fully_shard (FSDP2)",
            ("fully_shard", "fully_shard"): "torch's composable fully_shard",
            ("replicate", "replicate"): "torch's composable replicate",
            ("replicate_with_fsdp", "replicate"): "torch's composable replicate"}
_OWN_PACKAGE = __name__.rsplit(".", 1)[0]


def _foreign_wrapper(frame: Optional[FrameType]) -> Optional[str]:
    """The torch wrapper whose constructor is on the stack above ``frame`` (walking through
    torch's and this library's frames only, up to the first frame of user code), or None."""
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module.startswith("torch.") or module.startswith(_OWN_PACKAGE)):
            return None
        found = _FOREIGN.get((module.rsplit(".", 1)[-1], frame.f_code.co_name)) if module.startswith("torch.") else None
        if found is not None and (found != "DistributedDataParallel" or module.endswith(_DDP_MODULE_SUFFIX)):
            return found
        frame = frame.f_back
    return None


class ForeignWrapperGuard:
    """Mixin of ``FSDP<Orig>`` and ``Replicate<Orig>``: torch's data-parallel wrappers that walk
    the module tree through a managed module raise (see [Note: Foreign wrappers])."""

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[Tuple[str, nn.Module]]:
        """As ``nn.Module.named_modules``; refuses torch's data-parallel wrappers."""
        _refuse_foreign_wrapper(self, inspect.currentframe())
        yield from super().named_modules(*args, **kwargs)  # type: ignore[misc]  # nn.Module's, through the dynamic class

    def named_children(self) -> Iterator[Tuple[str, nn.Module]]:
        """As ``nn.Module.named_children``; refuses torch's data-parallel wrappers."""
        _refuse_foreign_wrapper(self, inspect.currentframe())
        yield from super().named_children()  # type: ignore[misc]  # nn.Module's, through the dynamic class


def _refuse_foreign_wrapper(module: Any, frame: Optional[FrameType]) -> None:
    wrapper = _foreign_wrapper(frame.f_back if frame is not None else None)
    if wrapper is None:
        return
    api = getattr(module, "_api_name", "composable_shard")
    raise RuntimeError(
        f"{wrapper} cannot wrap a module managed by {api} ({type(module).__name__}), nor a parent "
        f"of one: {api} already makes it data-parallel in place. A second wrapper would broadcast "
        "rank 0's parameter shards over the other ranks' and reduce gradients twice. Train the module as it "
        "is (it needs no wrapper): with Hugging Face Trainer or accelerate use ShardedTrainer or "
        "ShardedAccelerator from composable_shard.integrations.transformers; to mix strategies, use "
        "fully_shard/replicate on submodules. Nothing was changed.")
