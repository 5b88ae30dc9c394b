"""What ``fully_shard`` and ``replicate`` both do, written once: the modules and parameters a
call manages, the agreement on every refusal before the first collective, ``device_id``'s device,
the rank-0 broadcast at init and ``set_requires_gradient_sync``'s checks. The end-of-backward
agreement on the parameters used on some rank, which both also share, is part of the step and lives
with the other agreements in ``_runtime/agreement.py`` (with [Note: Step agreement] of ``_runtime/watch.py``).

[Note: One behaviour for both APIs]  Where the two had drifted, both do what a DDP/FSDP user expects:
* ``set_requires_gradient_sync`` takes a bool, else ``TypeError`` naming the module, flag unchanged
  (``replicate``'s turned ``"no"`` into True).
* The init broadcast sends chunks of up to 250 MiB of one dtype, as DDP's and FSDP1's do
  (``fully_shard(sync_module_states=True)`` sent one broadcast per tensor).
* A group of one rank takes part in neither the used-flag all-reduce nor the init broadcast.
* A refusal on one rank, or ranks holding different models, raise on every rank through one
  mechanism, :func:`agreed` (below).

[Note: Agreed refusals]
  A rank that raised alone would leave the others waiting in the call's first collective (the
  init broadcast, a hybrid group's creation) or in the first forward, until the process group's
  timeout -- forever if the raising rank caught its error and went on. So each API runs every
  check before its first collective inside :func:`agreed`, and every rank of the call then learns
  the lowest refusing global rank and whether the ranks' *layouts* (what the init broadcast
  sends: names, shapes, dtypes) match; ranks whose models differ would hang or mix up data in it.
  ``fully_shard``, called once per block when annotating by hand, first exchanges six integers
  per group (the call's group; a hybrid call's shard group, then its replicate group, which
  together reach every rank): the lowest refusing rank and a digest of the layout. Only on a
  refusal or a difference does a gather of each rank's refusal or layout follow; ``replicate``
  (one call, one group) gathers them at once. A refusing rank re-raises its own exception (with a
  note); the others raise one of the same type (builtin ones; else ``RuntimeError``) naming the
  refusing rank and quoting its message. Ranks that did not refuse may have materialized meta
  tensors by then; none applied the API. Refusals with nothing to agree in raise alone:
  torch.distributed not initialized, a process_group or mesh that is no group holding this rank;
  ``@contract``'s checks (a module the API already manages) run before, on each rank.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import weakref
from typing import AbstractSet, Any, Callable, Deque, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple, TypeVar, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from .._runtime import collectives as _collectives
from .._runtime.module_state import _FSDPState
from .._runtime.agreement import taking_part as _taking_part
from .._runtime.traversal import _NON_COMPOSABLE_APIS
from .validation import check_bool
from ..contract import _get_module_state, _get_registry

__all__ = ["check_composition", "check_not_inside_other_api", "note_replicated", "normalize_device", "check_set_requires_gradient_sync", "broadcast_from_rank0",
           "agreement_groups", "agreed"]

BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024  # the init broadcast's chunk bound, as DDP's
_T = TypeVar("_T")
Layout = Optional[List[Any]]  # what the init broadcast sends, one [name, shape, dtype, ...] row per tensor
# Exception types rebuilt on the ranks that did not refuse (any other type: RuntimeError).
_REBUILT = {e.__name__: e for e in (ValueError, TypeError, RuntimeError, NotImplementedError, KeyError,
                                    AttributeError, IndexError, AssertionError)}


def check_composition(api: str, module: Any, other: str, instead: str) -> None:
    """``RuntimeError`` if the ``other`` data-parallel API manages ``module`` (one API per module;
    ``instead`` says what to do) or torch.distributed is not initialized."""
    if other in (_get_registry(module) or ()):
        raise RuntimeError(f"{api}: the module is already managed by {other}, and a module can be managed by one "
                           f"data-parallel API. {instead}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{api}: torch.distributed is not initialized; call dist.init_process_group(...) first "
                           "(torchrun sets up the environment).")


# [Note: Inside another API's module]  One API per parameter: fully_shard leaves a subtree that
# replicate manages alone, and replicate one that fully_shard manages, but only when the other
# API's call came *after*, on an ancestor. Called on a module *inside* a module the other API
# already manages, the call would take over parameters that are not free: replicate inside a
# fully sharded module broadcast rank 0's slices of the flat shards over the other ranks' (a
# silently different model), and fully_shard inside a replicated module turned the replicated
# parameters into shard views behind replicate's back. Both refuse, naming the ancestor. What
# fully_shard manages is known from its handles (``_runtime/watch.py`` tracks every module a
# handle owns); what replicate manages, from this map: each replicated module (weakly) -> the ids of
# the parameters it took.
_REPLICATED: "weakref.WeakKeyDictionary[nn.Module, FrozenSet[int]]" = weakref.WeakKeyDictionary()


def note_replicated(module: nn.Module, params: Sequence[nn.Parameter]) -> None:
    """Record that ``replicate(module)`` manages ``params`` ([Note: Inside another API's module]).
    By id, with no reference to the parameters: torch refuses to swap a tensor that has a weak
    reference (``module.to_empty()``/``_apply`` of a tensor-parallel parameter does), and the
    module is alive, so are the ids, for as long as the entry (the module weakly) is."""
    _REPLICATED[module] = frozenset(id(p) for p in params)


def _replicated_by(p: nn.Parameter, module: nn.Module) -> Optional[nn.Module]:
    """The replicated ancestor of ``module`` (not itself) that manages ``p``, if any."""
    for replicated, taken in list(_REPLICATED.items()):
        if replicated is not module and id(p) in taken and any(m is module for m in replicated.modules()):
            return replicated
    return None


def check_not_inside_other_api(api: str, module: nn.Module, named_params: Sequence[Tuple[str, nn.Parameter]],
                               fully_sharded_by: Optional[Tuple[nn.Module, str]]) -> None:
    """``RuntimeError`` if ``module`` lies inside a module the other data-parallel API manages
    ([Note: Inside another API's module]). ``named_params``: the parameters the call would take
    (checked against replicate's); ``fully_sharded_by``: the fully sharded module whose handle
    owns ``module`` and ``module``'s path in it, if any."""
    if fully_sharded_by is not None:
        owner, path = fully_sharded_by
        raise RuntimeError(
            f"{api}: this module is {path!r} inside {type(owner).__name__}, which fully_shard already manages: its "
            "handle holds this module's parameters as slices of its flat shards, and replicate would overwrite the "
            f"other ranks' slices with rank 0's. Apply replicate to {path!r} before fully_shard of its ancestor "
            "(fully_shard leaves a replicated submodule alone), or leave it to fully_shard.")
    for name, p in named_params:
        replicated = _replicated_by(p, module)
        if replicated is not None and "replicate" in (_get_registry(replicated) or ()):
            inside = next(n for n, m in replicated.named_modules() if m is module)
            raise RuntimeError(
                f"{api}: this module is {inside!r} inside {type(replicated).__name__}, which replicate already manages: its parameter {name!r} is replicated "
                "(each rank holds all of it, and replicate all-reduces its gradient). Apply fully_shard to the "
                "submodule before replicate of its ancestor (replicate leaves a fully sharded submodule alone), "
                "or leave it to replicate.")


# ---------------------------------------------------------------------------- what a call manages
def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _expand_ignored_modules(root: nn.Module, ignored_modules: Optional[List[nn.Module]],
                            ignored_states: Optional[List[Any]],
                            other_apis: AbstractSet[str] = _NON_COMPOSABLE_APIS) -> Set[nn.Module]:
    """Ignored modules with their subtrees, plus every subtree below ``root`` that one of
    ``other_apis`` manages (by default replicate's, which fully_shard leaves alone)."""
    tops: List[nn.Module] = list(ignored_modules or [])
    tops.extend(s for s in ignored_states or [] if isinstance(s, nn.Module))
    tops.extend(m for m in root.modules() if m is not root and not other_apis.isdisjoint(_get_registry(m) or ()))
    return {sub for m in tops for sub in m.modules()}


def _ignored_params(ignored_modules: Set[nn.Module], ignored_states: Optional[List[Any]]) -> Set[nn.Parameter]:
    params: Set[nn.Parameter] = set()
    for m in ignored_modules:
        params.update(m.parameters(recurse=False))
    params.update(s for s in ignored_states or [] if isinstance(s, nn.Parameter))
    return params


def _managed_modules(top: nn.Module, ignored_modules: AbstractSet[nn.Module], post_order: bool = False,
                     breadth_first: bool = False) -> List[Tuple[str, nn.Module]]:
    """``(fqn, module)`` of ``top``'s tree that a call on ``top`` manages: not ignored, not
    inside a module an earlier call fully sharded; each module once, left to right; pre-order
    (``.modules()`` order), post-order (children before parents) or breadth-first."""
    order: List[Tuple[str, nn.Module]] = []
    seen: Set[int] = set()
    stack: Deque[Tuple[str, nn.Module, bool]] = collections.deque([("", top, False)])
    while stack:
        fqn, module, expanded = stack.popleft() if breadth_first else stack.pop()
        if expanded:
            order.append((fqn, module))
            continue
        if id(module) in seen or module in ignored_modules:
            continue
        if module is not top and _get_module_state(module, _FSDPState) is not None:
            continue
        seen.add(id(module))
        if post_order:
            stack.append((fqn, module, True))
        else:
            order.append((fqn, module))
        children = [(_join(fqn, n), c, False) for n, c in module.named_children()]
        stack.extend(children if breadth_first else reversed(children))
    return order


def normalize_device(device_id: Union[int, torch.device, None]) -> Optional[torch.device]:
    """The device ``device_id`` (checked by ``validation.check_device_id``) names: an int is a
    CUDA index, a CUDA device without an index the current one."""
    if device_id is None:
        return None
    if isinstance(device_id, int):
        return torch.device("cuda", device_id)
    if device_id.type == "cuda" and device_id.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device_id


def check_set_requires_gradient_sync(module: Any, requires_gradient_sync: Any, recurse: Any = True) -> None:
    """Either API's ``set_requires_gradient_sync`` arguments must be bools (``"no"`` is a mistake)."""
    api = f"{type(module).__name__}.set_requires_gradient_sync"
    check_bool(api, "requires_gradient_sync", requires_gradient_sync)
    check_bool(api, "recurse", recurse)


@torch.no_grad()
def broadcast_from_rank0(tensors: Sequence[torch.Tensor], groups: Sequence[Optional[dist.ProcessGroup]],
                         device: Optional[torch.device], *, tag: str) -> None:
    """Copy group rank 0's ``tensors`` into every rank's, group after group (None and single-rank
    groups skipped; hybrid: replicate group, then shard group, which reaches every rank from
    global rank 0), one broadcast per chunk of one dtype, assembled on ``device`` (None: where
    its tensors are; offloaded CPU parameters travel through the device, as NCCL wants)."""
    taking_part = _taking_part(groups)
    if not taking_part:
        return
    chunks: Dict[Tuple[torch.dtype, torch.device], List[Tuple[List[torch.Tensor], int]]] = {}
    for t in tensors:
        key_chunks = chunks.setdefault((t.dtype, t.device), [([], 0)])
        if key_chunks[-1][1] >= BROADCAST_CHUNK_BYTES:
            key_chunks.append(([], 0))
        members, nbytes = key_chunks[-1]
        members.append(t)
        key_chunks[-1] = (members, nbytes + t.numel() * t.element_size())
    for (_, where), key_chunks in chunks.items():
        for members, _ in key_chunks:
            flat = torch.cat([t.detach().reshape(-1) for t in members]).to(device or where)
            for group in taking_part:
                _collectives.broadcast(flat, 0, group, tag=tag)
            offset = 0
            for t in members:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


# ---------------------------------------------------------------------------- agreed refusals
def agreement_groups(process_group: Any, mesh: Any) -> Optional[List[Optional[dist.ProcessGroup]]]:
    """The groups the call's ranks agree in (None: the default group), shard group first;
    None when there is none: torch.distributed not initialized, or process_group/mesh not a
    group or mesh holding this rank (the argument checks then raise on this rank alone)."""
    if not (dist.is_available() and dist.is_initialized()) or (process_group is not None and mesh is not None):
        return None
    groups: List[Optional[dist.ProcessGroup]]
    if mesh is not None:
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(mesh, DeviceMesh) or mesh.ndim not in (1, 2) or mesh.get_coordinate() is None:
            return None
        groups = [mesh.get_group(d) for d in reversed(range(mesh.ndim))]
    elif isinstance(process_group, tuple):
        groups = list(process_group) if len(process_group) == 2 else []
    else:
        groups = [process_group]
    if not groups or any(g is not None and (not isinstance(g, dist.ProcessGroup) or dist.get_rank(g) < 0)
                         for g in groups):
        return None
    return groups


def agreed(api: str, groups: Optional[List[Optional[dist.ProcessGroup]]], prepare: Callable[[], _T],
           layout: Callable[[_T], Layout], *, applied: str, what: str, tag: str, digest_first: bool) -> _T:
    """Run ``prepare()`` (every check of ``api`` before its first collective) and agree on the
    outcome with every rank of ``groups`` (None: nothing to agree in, it raises alone): a refusal
    on any rank raises on every rank, and so do layouts (``layout(result)``) that differ,
    saying ``what`` that breaks. ``digest_first``: compare digests before gathering."""
    if groups is None:
        return prepare()
    meet = functools.partial(_agree, api, groups, applied=applied, what=what, tag=tag, digest_first=digest_first)
    try:
        result = prepare()
    except Exception as e:
        meet(e, None)
        raise
    meet(None, layout(result))
    return result


def _agree(api: str, groups: List[Optional[dist.ProcessGroup]], error: Optional[Exception], layout: Layout, *,
           applied: str, what: str, tag: str, digest_first: bool) -> None:
    """If a rank refused (``error``), a rank that did not raises the lowest refusing rank's
    error, naming it (the refusing ranks return, to raise their own); on different layouts
    every rank raises."""
    if digest_first and not _digests_find_a_problem(groups, error, layout, tag):
        return
    refusal, difference = _gather_outcomes(groups, error, layout, tag)
    if refusal is not None:
        rank, kind, message = refusal
        if error is None:
            raise _REBUILT.get(kind, RuntimeError)(f"{api}: rank {rank} refused, so every rank raises and none "
                                                   f"applied {applied}. Rank {rank}'s error ({kind}): {message}")
        add_note = getattr(error, "add_note", None)  # Python >= 3.11
        if add_note is not None:
            add_note(f"{api}: refused on rank {dist.get_rank()}; every rank of the call raises, none applied {applied}.")
    elif difference is not None or digest_first:  # the digests differed, perhaps between other ranks
        raise RuntimeError(f"{api}: {what}, which would hang or mix up data; none applied {applied}: "
                           f"{difference or 'another pair of ranks differs (see their error)'}.")


def _digests_find_a_problem(groups: List[Optional[dist.ProcessGroup]], error: Optional[Exception], layout: Layout,
                            tag: str) -> bool:
    """One exchange of six integers per group: the lowest refusing global rank (-1: none), whether
    layouts differ so far, and four int64 words of a hash of this rank's layout."""
    digest = hashlib.sha256(repr(layout).encode()).digest()
    failed, differs = (dist.get_rank() if error is not None else -1), 0
    for group in groups:
        rows = _collectives.exchange([failed, differs, *[int.from_bytes(digest[i:i + 8], "little", signed=True)
                                                         for i in range(0, 32, 8)]], group, tag=tag)
        known = [row[0] for row in rows if row[0] >= 0]
        failed = min(known) if known else -1
        differs = int(any(row[1] or row[2:] != rows[0][2:] for row in rows))
    return failed >= 0 or bool(differs)


def _gather_outcomes(groups: List[Optional[dist.ProcessGroup]], error: Optional[Exception], layout: Layout,
                     tag: str) -> Tuple[Optional[List[Any]], Optional[str]]:
    """Every rank's refusal ``[global rank, type name, message]`` (one it learned in an earlier
    group, else its own) or layout, group after group: the lowest refusing rank's, else the
    first difference between two layouts of a group (None: none here)."""
    refusal = [dist.get_rank(), type(error).__name__, str(error)] if error is not None else None
    difference: Optional[str] = None
    for group in groups:
        everyone = _collectives.all_gather_json({"refused": refusal} if refusal else {"layout": layout}, group, tag=tag)
        refusals = [r["refused"] for r in everyone if "refused" in r]
        refusal = min(refusals, key=lambda r: int(r[0])) if refusals else None
        ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(len(everyone))]
        for rank, theirs in zip(ranks[1:], everyone[1:]):
            if difference is None and not refusals and theirs != everyone[0]:
                difference = _first_difference(ranks[0], everyone[0]["layout"], rank, theirs["layout"])
    return refusal, difference


def _first_difference(a: int, first: Layout, b: int, theirs: Layout) -> str:
    if first is None or theirs is None:  # fully_shard without sync_module_states sends nothing
        return (f"rank {a} passed sync_module_states={first is not None}, rank {b} "
                f"sync_module_states={theirs is not None}; pass the same value on every rank")
    k = next(k for k in range(max(len(first), len(theirs)) + 1) if first[k:k + 1] != theirs[k:k + 1])
    return (f"rank {b} holds different parameters or buffers than rank {a} (first difference, tensor {k}: rank {a} "
            f"has {first[k] if k < len(first) else 'nothing'}, rank {b} has "
            f"{theirs[k] if k < len(theirs) else 'nothing'}); build the same model on every rank")
