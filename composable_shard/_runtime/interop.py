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
  ``get_total_norm``) returns a :class:`PartialNorm`: this rank's norm, tagged with the shard
  group it must be combined over. Moving it (``.to``) and stacking it keep the tag, so torch's
  ``vector_norm(stack(norms))`` reaches :meth:`PartialNorm.__torch_function__` with all of
  them and combines each group's contributions with one all-reduce per process group (usually
  one); any other operation on a partial norm first resolves it the same way. The clip
  coefficient is then the global one on every rank. Gradients of ``replicate`` and of
  ``NO_SHARD`` are whole and equal on every rank already: they stay plain tensors. Norm
  orders: any real one torch takes (p-norms, negative ones too, ``inf``, ``-inf``, and 0, the
  count of non-zero elements); a slice with no elements contributes the identity of its
  reduction.

  Nothing looks at who asked: the combination is recognised by what is computed. A whole-tensor
  norm of a sharded gradient (``vector_norm(grad, ord)``, ``_foreach_norm(grads, ord)``) is a
  :class:`PartialNorm` holding this rank's value, and stays one through ``.to`` and
  ``torch.stack``; every other operation on it sees this rank's value and issues no collective
  (a user's ``p.grad.norm()`` or ``vector_norm(p.grad)`` for logging, on rank 0 only, in a
  generator that torch's clipping consumes, under any torch function mode). Only the vector norm
  of stacked partial norms, torch's total-norm recipe (``get_total_norm``: the norm of the stack
  of the per-gradient norms; read in 2.6 through 2.13), combines them: one all-reduce per process
  group, on every rank, returning a plain tensor. So code that takes exactly that norm must run on
  every rank, as torch's clip does. (FSDP2's ``DTensor`` gradients communicate for every norm, even
  one taken on one rank only.)

  The library's ``clip_grad_norm_`` (``fully_shard.py``) uses the same combination
  (:func:`total_grad_norm`, sharing :func:`_combine_norms` with :func:`_resolve`), so the two
  clips cannot disagree: both are torch's norm of the per-parameter norms, each sharded
  parameter's norm combined over its handle's shard group only.

[Note: Foreign wrappers]
  torch's ``DistributedDataParallel`` and FSDP (FSDP1's class, FSDP2's ``fully_shard``, torch's
  composable ``replicate`` and its FSDP2-based ``replicate_with_fsdp``) around a module this
  library manages, or around a parent of one, would broadcast rank 0's parameter *slices* over
  the other ranks' (which silently corrupts them when the slices happen to have equal sizes),
  reduce gradients a second time, or reshard views of our shards. Each of them walks the module
  tree with ``named_modules()`` or ``named_children()`` (``named_parameters()`` goes through
  ``named_modules()``) before its first collective, and ours are overridden by
  :class:`ForeignWrapperGuard` to look at the functions running on this thread
  (``torch_compat.running_functions``, the package's one reader of Python frames): if one of them
  is such a wrapper (``_FOREIGN``), it raises, before anything was changed or communicated, on
  every rank (every rank constructs the wrapper). The ways torch reaches our modules:
    DDP, FSDP1     their constructors (``__init__`` frames) traverse the tree.
    FSDP2, both    torch's ``@contract`` decorator traverses the tree before it calls the API
    replicates     function (its ``wrapper`` function; the API is its ``func`` local), after it
                   put its own state and registry entries into each module's ``__dict__``:
                   the refusal takes those out again (:func:`_undo_contract_entries`).
    replicate,     torch's DDP-based ``replicate`` builds its DDP at the first forward (in
    lazily         ``_ReplicateState.init``, which walks ``module.modules()``): when it was
                   applied before ``fully_shard``, that first forward raises, before DDP's
                   broadcast.
  The functions are matched by module and function name (and the contract's locals read only to
  refuse); the library imports none of those wrappers. (FSDP1's composable ``fully_shard``, the ``fully_shard`` module of torch's
  ``_composable`` package, is gone from torch 2.13 and is no longer listed.)
"""

from __future__ import annotations

import math
import sys
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import collectives as _collectives
from .._base.callers import check_callers
from .._base.host_mirror import to_device
from .._base.torch_compat import FOREACH_NORM as _FOREACH_NORM, PLAIN_TORCH_FUNCTION_IMPL, RunningFunction, as_plain, \
    plain_torch_function, running_functions
from .._base.tree import convert, local_piece

__all__ = ["ShardedGrad", "PartialNorm", "as_sharded_grad", "shard_source", "total_grad_norm", "ForeignWrapperGuard"]

_VECTOR_NORM = torch.linalg.vector_norm
_CLIP_HINT = _collectives.collective_call_hint(
    "torch.nn.utils.clip_grad_norm_ on a fully sharded model",
    "Every rank needs the global norm: call it on every rank after the same backward.")
_LIBRARY_CLIP_HINT = _collectives.collective_call_hint(
    "`clip_grad_norm_`", "Every rank needs the global norm: call it on every rank after the same backward.")

# (the groups a norm is completed over, in order, weakly: see [Note: Process groups held weakly];
# the device their collectives run on); None: the gradient is whole and equal on every rank
_Source = Optional[Tuple[Tuple["weakref.ReferenceType[Any]", ...], torch.device]]


class ShardedGrad(torch.Tensor):
    """This rank's slice of a fully sharded parameter's averaged gradient, as ``.grad`` shows
    it after a synced backward: an ordinary tensor, except that torch's ``clip_grad_norm_`` and
    ``get_total_norm`` see the norm over every rank's slices (see [Note: torch's
    clip_grad_norm_ on sharded gradients])."""

    _cs_source: Tuple[Tuple["weakref.ReferenceType[Any]", ...], torch.device]  # see shard_source
    # Every operation on a ShardedGrad runs __torch_function__ (about a microsecond), reading a
    # property too. Optimizers read ``grad.is_sparse`` for every gradient of every step; a
    # ShardedGrad is always a strided view of a dense shard, so it answers from the class.
    is_sparse = False

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Sequence[Any] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        if func is _VECTOR_NORM or func is _FOREACH_NORM:
            return _partial_norms(func, args, kwargs or {})
        if kwargs:  # passed only when there are some: a slot wrapper (a property's __get__) takes none
            return PLAIN_TORCH_FUNCTION_IMPL(func, types, args, kwargs)
        return PLAIN_TORCH_FUNCTION_IMPL(func, types, args)


class PartialNorm(torch.Tensor):
    """Norms of this rank's gradient slices that torch's total-norm recipe combines across ranks:
    one element per gradient, each with its source (see [Note: torch's clip_grad_norm_ on sharded
    gradients]). Every operation but ``.to``, ``torch.stack`` and the vector norm of a stack sees
    this rank's values and returns plain tensors."""

    _cs_sources: Tuple[_Source, ...]  # per element, in order
    _cs_ord: float  # the norm order of every element
    _cs_stacked: bool  # made by torch.stack: its vector norm is the total norm

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Sequence[Any] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.to and isinstance(args[0], PartialNorm):
            moved = plain_torch_function(func, args, kwargs)
            return _make_partial(moved, args[0]._cs_sources, args[0]._cs_ord, args[0]._cs_stacked)
        if func is torch.stack and not kwargs.get("dim") and len(args) == 1 and _stackable(args[0]):
            return _stack_partials(args[0])
        if func is _VECTOR_NORM and _is_total_norm(args, kwargs):
            return plain_torch_function(func, [_resolve(args[0]), *args[1:]], kwargs)
        return plain_torch_function(func, [_local_values(a) for a in args],
                                    {k: _local_values(v) for k, v in kwargs.items()})

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (``torch.save``, ``copy.deepcopy``) as a plain tensor of this rank's values: the
        process groups it would be combined over are not data."""
        return as_plain(self).clone().__reduce_ex__(protocol)


def as_sharded_grad(grad: torch.Tensor, groups: Sequence[Any], device: torch.device,
                    source: Optional[Tuple[Tuple["weakref.ReferenceType[Any]", ...], torch.device]] = None
                    ) -> ShardedGrad:
    """``grad`` (a view of this rank's gradient shard) as a :class:`ShardedGrad` over ``groups``
    (see :func:`shard_source`), sharing its storage; ``device``: where their collectives run
    (the compute device, also when the gradient was offloaded to the CPU). ``source``: that
    :func:`shard_source` already made (the runtime keeps one per parameter)."""
    shown = grad.as_subclass(ShardedGrad)
    shown._cs_source = source if source is not None else shard_source(groups, device)
    return shown  # type: ignore[return-value]  # as_subclass returns the subclass


def shard_source(groups: Sequence[Any], device: torch.device) -> Tuple[Tuple["weakref.ReferenceType[Any]", ...], torch.device]:
    """What a sharded gradient's norm is combined over: ``groups`` (held weakly), in order: its
    shard group, then, for a tensor-parallel piece, the mesh dimensions that shard the tensor
    (each element is on exactly one rank of their product); and the ``device`` their collectives
    run on."""
    return (tuple(weakref.ref(g) for g in groups), device)


def _ord_of(func: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any]) -> float:
    if "ord" in kwargs:
        return float(kwargs["ord"])
    if len(args) > 1 and not isinstance(args[1], (torch.dtype, bool)) and args[1] is not None:
        return float(args[1])
    return 2.0


def _local_norm(grad: torch.Tensor, order: float, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """This rank's norm of its slice; an empty slice gives the norm whose contribution is the
    identity of the combination (0 for a sum or a max, inf for a min or a sum of negative
    powers, where torch's own norm of an empty tensor raises)."""
    if isinstance(grad, DTensor):  # a tensor-parallel gradient: its norm over its mesh, each element once
        return torch.linalg.vector_norm(grad, order, dtype=dtype).full_tensor()
    plain = as_plain(grad)
    if plain.numel() == 0:
        value = math.inf if order < 0 else 0.0
        return torch.full((), value, dtype=dtype or plain.dtype, device=plain.device)
    return torch.linalg.vector_norm(plain, order, dtype=dtype)


def total_grad_norm(grads: Sequence[torch.Tensor], sources: Sequence[_Source], order: float) -> torch.Tensor:
    """The norm of ``grads`` that one process holding every parameter whole computes with
    torch's ``get_total_norm`` (the ``order``-norm of the per-gradient norms, on the first
    gradient's device, in their promoted dtype), where ``grads[i]`` is this rank's slice of a
    gradient sharded over ``sources[i]`` (None: the group a :class:`ShardedGrad` is tagged with,
    as for a parameter of a handle above the clipped module; else whole and equal on every
    rank). One all-reduce per distinct source and group in it; ``grads`` must not be empty and
    must be the same on every rank."""
    device = grads[0].device
    # a tensor-parallel (DTensor) gradient: its piece's norm, completed over the mesh dimensions that
    # shard it with the others of that mesh (one all-reduce per mesh, not one full_tensor per gradient)
    pieces = [source is None and _is_placed_piece(g) for g, source in zip(grads, sources)]
    local = torch.stack([_local_norm(local_piece(g) if piece else g, order, None).to(device)
                         for g, piece in zip(grads, pieces)])
    tagged = [_piece_source(g) if piece else source if source is not None else _source_of(g)
              for g, source, piece in zip(grads, sources, pieces)]
    combined = _combine_norms(local, tagged, order, "clip_grad_norm_", _LIBRARY_CLIP_HINT)
    return torch.linalg.vector_norm(combined, order)


def _is_placed_piece(grad: torch.Tensor) -> bool:
    """A ``DTensor`` gradient with ``Shard``/``Replicate`` placements only (a ``Partial`` one is
    resolved whole instead)."""
    return isinstance(grad, DTensor) and not any(p.is_partial() for p in grad.placements)


def _piece_source(grad: torch.Tensor) -> _Source:
    """What a placed piece's norm is completed over: the groups of the mesh dimensions that shard
    it (``None`` if none does: the piece is the whole gradient on every rank)."""
    placed = cast(DTensor, grad)
    groups = [placed.device_mesh.get_group(i) for i, p in enumerate(placed.placements) if p.is_shard()]
    return shard_source(groups, grad.device) if groups else None


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


def _make_partial(value: torch.Tensor, sources: Tuple[_Source, ...], order: float,
                  stacked: bool = False) -> PartialNorm:
    partial = value.as_subclass(PartialNorm)
    partial._cs_sources, partial._cs_ord, partial._cs_stacked = sources, order, stacked
    return partial  # type: ignore[return-value]  # as_subclass returns the subclass


def _is_total_norm(args: Sequence[Any], kwargs: Dict[str, Any]) -> bool:
    """``vector_norm(stacked, ord)`` over the whole stack of partial norms: torch's total norm."""
    return (len(args) >= 1 and isinstance(args[0], PartialNorm) and args[0]._cs_stacked
            and kwargs.get("dim") is None and not kwargs.get("keepdim") and len(args) <= 2)


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
    # a DTensor norm (torch's own of tensor-parallel gradients) is resolved over its mesh: whole on every rank
    wholes = [t.full_tensor() if isinstance(t, DTensor) else t for t in items]
    return _make_partial(torch.stack([as_plain(t) for t in wholes]), tuple(sources), order, stacked=True)


def _local_values(value: Any) -> Any:
    """``value`` with every partial norm in it as the plain tensor of this rank's values."""
    return convert(value, lambda t: as_plain(t) if isinstance(t, PartialNorm) else t)


def _resolve(partial: PartialNorm) -> torch.Tensor:
    """Each element's norm over every rank (see :func:`_combine_norms`)."""
    local = as_plain(partial)
    combined = _combine_norms(local.reshape(-1), partial._cs_sources, partial._cs_ord,
                              "torch.nn.utils.clip_grad_norm_", _CLIP_HINT)
    return combined.reshape(local.shape)


def _combine_norms(local: torch.Tensor, sources: Sequence[_Source], order: float, api: str, hint: str) -> torch.Tensor:
    """``local``: this rank's norms, one per gradient (1-D); returns each one's norm over every
    rank: a sharded gradient's contributions combined over its source's groups in turn (one
    all-reduce per distinct source and group, sources in order of first appearance: the same on
    every rank, which holds the same gradients), a whole one (source None) as it is."""
    out = local.clone()
    by_source: Dict[Tuple[int, ...], List[int]] = {}
    for i, source in enumerate(sources):
        if source is not None:
            by_source.setdefault(tuple(id(ref()) for ref in source[0]), []).append(i)
    op = dist.ReduceOp.SUM if not math.isinf(order) else dist.ReduceOp.MAX if order > 0 else dist.ReduceOp.MIN
    for members in by_source.values():
        refs, device = sources[members[0]]  # type: ignore[misc]  # members are sourced
        index = to_device(members, torch.int64, local.device)  # no host wait ([Note: No host reads in a step])
        contribution = _to_sum_space(local.index_select(0, index).to(device=device, dtype=torch.float32), order)
        for ref in refs:
            group = ref()
            if group is None:
                raise RuntimeError(f"{api}: a process group these sharded gradients were reduced over was "
                                   "destroyed; clip before dist.destroy_process_group.")
            _collectives.all_reduce(contribution, group, tag="clip_grad_norm", op=op, hint=hint).wait()
        out.index_copy_(0, index, _from_sum_space(contribution, order).to(device=local.device, dtype=local.dtype))
    return out


def _to_sum_space(norms: torch.Tensor, order: float) -> torch.Tensor:
    """What adds up across ranks: ``|x|_p ** p`` (also for p < 0; a count for p = 0; the norm
    itself for ±inf, combined by max or min)."""
    return norms if math.isinf(order) or order == 0 else norms.pow(order)


def _from_sum_space(summed: torch.Tensor, order: float) -> torch.Tensor:
    return summed if math.isinf(order) or order == 0 else summed.pow(1.0 / order)


# ---------------------------------------------------------------------------------- wrappers

# (defining module's last component, function name) of the wrappers that must not wrap a
# managed module, in modules under ``torch.``: DistributedDataParallel.__init__ (in torch's nn
# package, ``parallel.distributed``), FSDP1's FullyShardedDataParallel.__init__, FSDP2's
# fully_shard, torch's composable replicate (and the lazy DDP set-up of the DDP-based one,
# _ReplicateState.init), replicate_with_fsdp's replicate. Matched against running frames and
# against the API function torch's @contract wrapper is about to call. See [Note: Foreign wrappers].
_DDP_MODULE_SUFFIX = ".parallel.distributed"  # torch's nn package
_FOREIGN = {("distributed", "__init__"): "DistributedDataParallel",
            ("fully_sharded_data_parallel", "__init__"): "torch's FullyShardedDataParallel",
            ("_fully_shard", "fully_shard"): "torch's fully_shard (FSDP2)",
            ("replicate", "replicate"): "torch's composable replicate",
            ("replicate", "init"): "torch's composable replicate",
            ("replicate_with_fsdp", "replicate"): "torch's composable replicate (replicate_with_fsdp)"}
_CONTRACT = ("contract", "wrapper")  # torch's @contract decorator: torch.distributed._composable.contract
_OWN_PACKAGE = __name__.split(".", 1)[0]  # the top-level package, wherever this module sits in it


def _foreign_wrapper() -> Optional[Tuple[str, Optional[RunningFunction]]]:
    """The torch wrapper whose code is running on this thread (walking through torch's and this
    library's functions only, up to the first function of other code), with torch's ``@contract``
    wrapper that applies it, if any; or None."""
    found: Optional[str] = None
    contract: Optional[RunningFunction] = None
    for function in running_functions():
        module = function.module
        if not (module.startswith("torch.") or module.startswith(_OWN_PACKAGE)):
            break
        if module.startswith("torch."):
            key = (module.rsplit(".", 1)[-1], function.name)
            applied = _FOREIGN.get(_contract_api(function)) if key == _CONTRACT else None
            if applied is not None and contract is None:
                found, contract = found or applied, function
            elif found is None and key in _FOREIGN and (key[0] != "distributed" or module.endswith(_DDP_MODULE_SUFFIX)):
                found = _FOREIGN[key]
    return None if found is None else (found, contract)


def _contract_api(function: RunningFunction) -> Tuple[str, str]:
    """(defining module's last component, name) of the API function torch's ``@contract``
    wrapper running as ``function`` applies (its ``func`` local: torch 2.13's contract.py)."""
    func = function.local("func")
    return (str(getattr(func, "__module__", "")).rsplit(".", 1)[-1], str(getattr(func, "__name__", "")))


def _undo_contract_entries(function: RunningFunction) -> None:
    """Take out of each module's ``__dict__`` what torch's ``@contract`` wrapper running as
    ``function`` put there before it traversed the modules, so a refused wrapper leaves them as
    they were. Read in torch 2.13's ``torch/distributed/_composable/contract.py``: for each
    root module in turn (``modules``) the wrapper does ``__dict__.setdefault(STATE_KEY,
    default_all_state)`` and ``setdefault(REGISTRY_KEY, default_registry)`` (module globals,
    here: the keys torch's contract module defines; the defaults are fresh dicts, locals of the
    current iteration), adds ``func -> state`` and ``func.__name__ -> registry_item`` to them,
    then traverses that module. Only this call's entries are removed; a dict left empty is
    removed if this call created it (the current module: it is the iteration's default; an
    earlier module of a list: assumed, an empty dict and none meaning the same to torch).
    Anything unexpected: nothing is touched."""
    contract_module = sys.modules.get(function.module)
    keys = (getattr(contract_module, "STATE_KEY", None), getattr(contract_module, "REGISTRY_KEY", None))
    func, modules, current = function.local("func"), function.local("modules"), function.local("module")
    if func is None or not isinstance(modules, list) or not all(isinstance(k, str) for k in keys):
        return
    ours: Tuple[Tuple[Any, Any, Any, Any], ...] = (
        (keys[0], func, function.local("state"), function.local("default_all_state")),
        (keys[1], getattr(func, "__name__", None), function.local("registry_item"), function.local("default_registry")))
    for module in modules:
        for key, entry, value, default in ours:
            entries = module.__dict__.get(key) if isinstance(module, nn.Module) else None
            if not isinstance(entries, dict) or value is None or entries.get(entry) is not value:
                continue
            del entries[entry]
            if not entries and (entries is default or module is not current):
                del module.__dict__[key]


class ForeignWrapperGuard:
    """Mixin of ``FSDP<Orig>`` and ``Replicate<Orig>``: torch's data-parallel wrappers that walk
    the module tree through a managed module raise (see [Note: Foreign wrappers]), and so does
    code an integration refuses ([Note: Caller checks] in ``_base/callers.py``, point
    ``"traverse"``)."""

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[Tuple[str, nn.Module]]:
        """As ``nn.Module.named_modules``; refuses torch's data-parallel wrappers."""
        _refuse_foreign_callers(self)
        yield from super().named_modules(*args, **kwargs)  # type: ignore[misc]  # nn.Module's, through the dynamic class

    def named_children(self) -> Iterator[Tuple[str, nn.Module]]:
        """As ``nn.Module.named_children``; refuses torch's data-parallel wrappers."""
        _refuse_foreign_callers(self)
        yield from super().named_children()  # type: ignore[misc]  # nn.Module's, through the dynamic class


def _refuse_foreign_callers(module: Any) -> None:
    check_callers(module, "traverse")
    found = _foreign_wrapper()
    if found is None:
        return
    wrapper, contract = found
    if contract is not None:
        _undo_contract_entries(contract)
    api = getattr(module, "_api_name", "composable_shard")
    raise RuntimeError(
        f"{wrapper} cannot wrap a module managed by {api} ({type(module).__name__}), nor a parent "
        f"of one: {api} already makes it data-parallel in place. A second wrapper would broadcast "
        "rank 0's parameter shards over the other ranks' and reduce gradients twice. Train the module as it "
        "is (it needs no wrapper): with Hugging Face Trainer or accelerate use ShardedTrainer or "
        "ShardedAccelerator from composable_shard.integrations.transformers; to mix strategies, use "
        "fully_shard/replicate on submodules. Nothing was changed.")
