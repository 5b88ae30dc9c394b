"""Everything ``fully_shard(...)`` does before the first forward: check, plan, then mutate.

:func:`plan_agreed` runs everything that can refuse before the call's first collective --
the argument checks (``validation.check_fully_shard_arguments``), :func:`plan_fully_shard`
(the fully sharded modules, the called module plus the policy's targets, and which parameters
each one's handle owns; raises on any bad input or annotation without touching the model),
meta materialization (``param_init_fn`` may replace parameters, so they are collected again)
and the move to ``device_id`` -- then agrees on the outcome with every rank ([Note: Agreed
refusals] in ``_setup/data_parallel.py``). :func:`apply_plan` then synchronizes, flattens and hands each fully
sharded module to the caller to register hooks.

[Note: Shared parameters]
  One parameter object can be registered at several places (tied weights). Each registration
  lies under an innermost *target* (a module this call fully shards). Under a policy the
  parameter goes to the lowest target that contains all of its registrations (the call's module
  at worst), as torch's composable ``fully_shard`` does; that handle installs its views at
  every registration, so the parameter is flattened and reduced once. A parameter that an
  existing handle (from an earlier call) already owns cannot move any more: the call that would
  share it raises, naming both places and the fix (annotate the lowest common ancestor only; a
  child annotated after its parent: annotate children first, or not separately).
  :data:`_FULLY_SHARDED_MODULES` remembers every fully sharded module of the process (weakly)
  so that a call on a sibling or a descendant sees what earlier calls own.

[Note: Meta materialization]
  Without ``param_init_fn``, each managed module with meta tensors of its own gets them replaced
  by empty tensors on the compute device (ties kept), then runs ``reset_parameters()`` once, in
  ``.modules()`` order; a module with meta tensors and no ``reset_parameters`` is refused before
  anything changes. With ``param_init_fn`` the calls are torch FSDP1's (read in torch 2.13): for
  each fully sharded module with meta tensors left in its subtree, children first,
  ``param_init_fn(m)`` runs on every module ``m`` of the subtree breadth-first, the fully sharded
  module first (modules without tensors of their own too), not entering ignored modules, modules
  an earlier call fully sharded, or this call's nested targets (materialized before). A rank
  without meta tensors (rank 0 of the ``sync_module_states`` idiom) makes no call.
  ``m.to_empty(recurse=False)`` gives each registration of a tied meta parameter a tensor of its
  own; torch leaves them untied (accelerate re-ties them in a wrapper), which would give ranks
  != 0 other handles than rank 0's tied model, so :func:`_retie` ties them again, to the first
  registration's. The handles flatten what is registered after the calls. Meta tensors left
  raise, and the model then has no fully_shard state, hook or class change (the init may have
  materialized some).
  Either init often reaches beyond its module (a Hugging Face style ``reset_parameters``, a
  ``param_init_fn`` calling ``to_empty`` without ``recurse=False`` or re-initializing every
  submodule), and with hand annotation the children are already sharded when their parent's
  init runs: their parameters are 1-D views into flat shards, which the init would re-draw, zero,
  cut loose (``to_empty`` swaps ``.data``) or replace. So each init call runs inside
  :func:`_init_keeping_initialized`, which puts back afterwards, also on error, each tensor of
  the subtree (ignored ones aside) initialized before -- never on meta, a sharded child's, tied
  to an earlier module, or (for ``reset_parameters``) materialized for an earlier module -- as
  the same object under each of its names, with the same ``.data`` and value; a sharded child's
  replaced parameter put back is no model change for the watch. For ``param_init_fn``, what the
  calls of one fully sharded module materialized stays free: torch calls it per module, so a
  later call may initialize again what an earlier one reached (``to_empty()`` without
  ``recurse=False`` on the parent, then each child's own init: keeping the parent's garbage
  would be silent). No such tensor is changed by two inits (an init may still raise on a sharded
  child's 1-D view, e.g. a 2-D ``kaiming_uniform_``), except the tensors of this call's nested
  targets (materialized, not sharded yet): put back by object and ``.data`` but not by value,
  since copying them for each ancestor's call would double a meta-built model's memory (an init
  that re-draws them in place leaves its draw). Only the other kept tensors are copied, and
  there are few: in breadth-first or ``.modules()`` order a module's descendants are still on
  meta when it is initialized.
"""

from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import apply_guard as _apply_guard
from . import init_draws
from .._runtime.module_state import _FSDPState, _is_fsdp_flattened
from .._runtime.watch import ModelChange
from .data_parallel import (_expand_ignored_modules, _ignored_params, _join, _managed_modules, agreed, agreement_groups,
                            broadcast_from_rank0, check_composition, check_not_inside_other_api, normalize_device)
from .._runtime.flat_param import FlatParamHandle
from .._runtime.mixed_precision import full_precision_classes
from .._runtime.traversal import _get_fsdp_states
from ..api import CPUOffload, MixedPrecision, ShardingStrategy
from ..contract import _check_fqns_unchanged, _fqn_snapshot, _get_module_state
from .._base.pieces import Piece, as_dtensor, piece_of, take_piece
from .._base.tree import local_piece
from .validation import (check_all_gather_extensions, check_config, check_dense_gradients, check_fully_shard_arguments,
                         check_tensor_parallel)
from ..wrap import _as_policy

__all__ = ["Plan", "plan_fully_shard", "plan_agreed", "apply_plan", "resolve_groups"]

_HYBRID = {ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2}
_FREES_AFTER_FORWARD = {ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD}  # the others keep until backward
_CONFIG_KEYS = ("strategy", "mixed_precision", "cpu_offload", "forward_prefetch", "backward_prefetch", "limit_all_gathers")

# Every module a fully_shard call made a fully sharded module, held weakly (see [Note: Shared parameters]).
_FULLY_SHARDED_MODULES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


# ---------------------------------------------------------------------------- plan
@dataclass
class _Groups:
    shard: Optional[dist.ProcessGroup]  # None: shard group of one rank (NO_SHARD)
    replicate: Optional[dist.ProcessGroup]  # None: no replication across groups
    rank: int
    world_size: int
    dp_world_size: int


@dataclass(eq=False)
class _Target:
    module: nn.Module  # a module this call makes a fully sharded module
    fqn: str  # relative to the call's module
    config: Dict[str, Any]  # the _CONFIG_KEYS options for it (a policy may override some)
    params: List[nn.Parameter] = field(default_factory=list)  # what its handle flattens


@dataclass
class Plan:
    """What ``fully_shard`` will do, computed and validated before any mutation."""

    root: nn.Module
    targets: List[_Target]  # children before parents, left to right (the order handles are built)
    ignored_params: Set[nn.Parameter]
    ignored_modules: Set[nn.Module]
    compute_device: torch.device
    param_init_fn: Optional[Callable[[nn.Module], None]]
    sync_module_states: bool
    device_id: Optional[torch.device]
    deferred: bool = False  # sharded on the meta device, initialized after to_empty (see [Note: Meta materialization])

    @property
    def strategies(self) -> List[ShardingStrategy]:
        """The distinct strategies of the targets, in target order (same on every rank)."""
        return list(dict.fromkeys(t.config["strategy"] for t in self.targets))


def plan_fully_shard(root: nn.Module, kwargs: Dict[str, Any]) -> Plan:
    """Return the :class:`Plan` of ``fully_shard(root, **kwargs)`` (arguments already checked by
    :func:`check_fully_shard_arguments`); raises with a message naming the module/parameter on a
    bad composition or annotation, leaving the model untouched."""
    check_composition(f"fully_shard({type(root).__name__})", root, "replicate",
                      "Apply fully_shard to its submodules, or use only replicate.")
    ignored_modules = _expand_ignored_modules(root, kwargs["ignored_modules"], kwargs["ignored_states"])
    ignored_params = _ignored_params(ignored_modules, kwargs["ignored_states"])
    device_id = normalize_device(kwargs["device_id"])
    plan = Plan(root, [], ignored_params, ignored_modules, _compute_device(root, device_id),
                kwargs["param_init_fn"], kwargs["sync_module_states"], device_id)
    plan.targets = _select_targets(plan, kwargs["policy"], {k: kwargs[k] for k in _CONFIG_KEYS})
    _assign_params(plan)
    managed = {id(p) for target in plan.targets for p in target.params}
    check_dense_gradients(f"fully_shard({type(root).__name__})", root.named_modules(), managed,
                          "a flat parameter can neither hold nor reduce")
    check_not_inside_other_api(f"fully_shard({type(root).__name__})", root,
                               [(n, p) for n, p in root.named_parameters() if id(p) in managed], None)
    _check_not_inside_initialized_root(root)
    if plan.param_init_fn is None and _uninitializable(plan):
        plan.deferred = True
        if plan.sync_module_states:
            raise ValueError(f"fully_shard({type(root).__name__}): sync_module_states=True on a model left on the meta "
                             f"device ({', '.join(_uninitializable(plan)[:3])} have no reset_parameters()): there is "
                             "nothing to broadcast. Pass param_init_fn=... to materialize it (rank 0's weights then "
                             "reach every rank), or leave sync_module_states out and initialize after "
                             "model.to_empty(device=...).")
    return plan


def _check_not_inside_initialized_root(root: nn.Module) -> None:
    """A module inside a tree that already ran forward would become a second root (checked
    after the parameter conflicts, which give the more precise message)."""
    for other in list(_FULLY_SHARDED_MODULES):
        state = _get_module_state(other, _FSDPState)
        if other is not root and state is not None and state.is_root and any(m is root for m in other.modules()):
            raise RuntimeError(
                f"fully_shard({type(root).__name__}): an ancestor ({type(other).__name__}) is already fully sharded "
                "and has run forward; fully_shard must be applied to children before their parents and before the "
                "first forward. Annotate this module first, then its ancestors, on a fresh model.")


def _select_targets(plan: Plan, policy: Any, config: Dict[str, Any]) -> List[_Target]:
    """The policy's targets among the managed modules, children before parents, then the
    called module. A policy's overrides are checked like the arguments themselves."""
    chosen: Dict[nn.Module, Dict[str, Any]] = {}
    if policy is not None:
        for m, kw in _as_policy(policy)._run_policy(plan.root, set(plan.ignored_modules), dict(config)).items():
            unknown = set(kw) - set(_CONFIG_KEYS)
            if unknown:
                raise ValueError(f"fully_shard: the policy returned unknown overrides {sorted(unknown)} for "
                                 f"{type(m).__name__}; allowed: {list(_CONFIG_KEYS)}")
            chosen[m] = {**config, **kw}
        _keep_full_precision_modules(plan, chosen, config)
    targets: List[_Target] = []
    for fqn, m in _managed_modules(plan.root, plan.ignored_modules, post_order=True):
        if m is not plan.root and m in chosen:
            check_config(f"fully_shard({type(plan.root).__name__}): the policy's options for {fqn!r}", chosen[m])
            targets.append(_Target(m, fqn, chosen[m]))
    targets.append(_Target(plan.root, "", dict(config)))
    return targets


def _keep_full_precision_modules(plan: Plan, chosen: Dict[nn.Module, Dict[str, Any]], config: Dict[str, Any]) -> None:
    """Under a policy, each module of a class its mixed precision keeps in full precision
    (``MixedPrecision._module_classes_to_ignore``) and with parameters of its own gets a handle
    without mixed precision, as torch's FSDP does (see [Note: Modules kept in full precision]
    in ``_runtime/mixed_precision.py``). The mixed precision in force is the nearest chosen ancestor's."""
    def visit(m: nn.Module, inherited: Dict[str, Any]) -> None:
        inherited = chosen.get(m, inherited)
        classes = full_precision_classes(inherited.get("mixed_precision"))
        if m is not plan.root and classes and isinstance(m, classes) and any(True for _ in m.parameters()):
            chosen[m] = {**inherited, "mixed_precision": None}
            return
        for child in m.children():
            if child not in plan.ignored_modules:
                visit(child, inherited)

    visit(plan.root, config)


# ---------------------------------------------------------------------------- parameter ownership
@dataclass
class _Registration:
    param: nn.Parameter
    target: _Target  # the innermost target above this registration
    fqn: str  # ``module.name`` relative to the call's module


@dataclass
class _Walk:
    """One traversal of the call's tree (see [Note: Shared parameters])."""

    registrations: Dict[int, List[_Registration]] = field(default_factory=dict)  # id(param) -> first-seen order
    parent: Dict[int, Optional[_Target]] = field(default_factory=dict)  # id(target) -> enclosing target
    sharded: Dict[int, str] = field(default_factory=dict)  # id(module an earlier call fully sharded) -> its FQN


def _walk(plan: Plan) -> _Walk:
    """Every registration of every parameter under the call's module, with its innermost
    target; a module shared between targets is walked under each."""
    target_of = {id(t.module): t for t in plan.targets}
    walk = _Walk()
    stack: List[Tuple[nn.Module, str, Optional[_Target]]] = [(plan.root, "", None)]
    seen: Set[Tuple[int, int]] = set()
    while stack:
        module, fqn, current = stack.pop()
        if module in plan.ignored_modules:
            continue
        if module is not plan.root and _get_module_state(module, _FSDPState) is not None:
            walk.sharded.setdefault(id(module), fqn)
            continue
        target = target_of.get(id(module))
        if target is not None and target is not current:
            if id(target) in walk.parent:
                continue  # a target module reached twice is walked from its first place only
            walk.parent[id(target)] = current
            current = target
        if current is None or (id(module), id(current)) in seen:
            continue
        seen.add((id(module), id(current)))
        for name, p in module.named_parameters(recurse=False):
            walk.registrations.setdefault(id(p), []).append(_Registration(p, current, _join(fqn, name)))
        stack.extend((c, _join(fqn, n), current) for n, c in reversed(list(module.named_children())))
    return walk


def _assign_params(plan: Plan) -> None:
    """Give each parameter to the lowest target containing all its registrations; raise if an
    earlier call's handle owns it, or if it is a flat parameter."""
    walk = _walk(plan)
    owners = _existing_owners(plan.root)
    for target in plan.targets:
        target.params = []
    for registrations in walk.registrations.values():
        p = registrations[0].param
        if p in plan.ignored_params:
            continue
        if _is_fsdp_flattened(p):
            raise ValueError(f"fully_shard: parameter {registrations[0].fqn!r} is a FlatParameter of another "
                             "fully_shard handle; flat parameters cannot be nested. Register the original parameters "
                             "instead.")
        owner = owners.get(id(p))
        if owner is not None:
            raise _ownership_error(plan.root, registrations[0].fqn, owner, walk)
        _lowest_common_target([r.target for r in registrations], walk.parent).params.append(p)


def _lowest_common_target(targets: List[_Target], parent: Dict[int, Optional[_Target]]) -> _Target:
    def chain(target: _Target) -> List[_Target]:
        out: List[_Target] = []
        current: Optional[_Target] = target
        while current is not None:
            out.append(current)
            current = parent.get(id(current))
        return out

    common = chain(targets[0])
    for other in targets[1:]:
        ids = {id(t) for t in chain(other)}
        common = [t for t in common if id(t) in ids]
    return common[0]  # the root target is on every chain


@dataclass
class _Owner:
    module: nn.Module  # fully sharded by an earlier call; its handle owns the parameter
    fqn: str  # the parameter's FQN relative to ``module``


def _existing_owners(root: nn.Module) -> Dict[int, _Owner]:
    """id(param) -> its owner, for every handle built by earlier calls (this process)."""
    modules = list(_FULLY_SHARDED_MODULES)
    modules += [s.module for s in _get_fsdp_states(root) if s.module is not None]
    owners: Dict[int, _Owner] = {}
    for module in modules:
        state = _get_module_state(module, _FSDPState)
        if module is root or state is None or state.handle is None:
            continue
        for group in state.handle.groups:
            for p, info in zip(group.orig_params, group.flat_param._param_infos):
                owners[id(p)] = _Owner(module, _join(info.module_name, info.param_name))
    return owners


def _ownership_error(root: nn.Module, fqn: str, owner: _Owner, walk: _Walk) -> ValueError:
    """The message for a parameter an earlier call's handle owns (three cases)."""
    api = f"fully_shard({type(root).__name__})"
    inside = walk.sharded.get(id(owner.module))
    if inside is not None:  # an annotated child shares it with the rest of this module
        owner_fqn = _join(inside, owner.fqn)
        lca = ".".join(os.path.commonprefix([owner_fqn.split(".")[:-1], fqn.split(".")[:-1]])) or "<root>"
        return ValueError(
            f"{api}: parameter {fqn!r} is the same nn.Parameter as {owner_fqn!r}, which the earlier "
            f"fully_shard({inside}) owns; a parameter can belong to one handle only. Their lowest common ancestor is "
            f"{lca!r}: do not annotate {inside!r} separately and let fully_shard of {lca!r} own the parameter "
            f"(a policy on that call does this for tied weights), or untie the parameter.")
    if any(m is root for m in owner.module.modules()):  # a child annotated after its parent
        path = next(n for n, m in owner.module.named_modules() if m is root)
        return ValueError(
            f"{api}: this module is {path!r} inside {type(owner.module).__name__}, which an earlier fully_shard call "
            f"already sharded: its handle owns {_join(path, fqn)!r}, and a parameter can belong to one handle only. "
            f"Annotate children before their parents (fully_shard({path}) first, then the ancestor), or do not "
            f"annotate {path!r} separately: the ancestor's handle already shards it.")
    return ValueError(
        f"{api}: parameter {fqn!r} of this {type(root).__name__} is the same nn.Parameter as {owner.fqn!r} of the "
        f"{type(owner.module).__name__} an earlier fully_shard call sharded (each name relative to its own module); "
        "two modules annotated separately cannot share a parameter. Apply "
        "fully_shard to their lowest common ancestor (the innermost module containing both) instead of to each of "
        "them, or untie the parameter.")


# ---------------------------------------------------------------------------- meta materialization
def _direct_meta(module: nn.Module, ignored_params: Set[nn.Parameter]) -> Iterator[Tuple[str, torch.Tensor]]:
    """The module's own meta parameters (not ignored) and meta buffers."""
    for name, p in module.named_parameters(recurse=False):
        if p.is_meta and p not in ignored_params:
            yield name, p
    for name, b in module.named_buffers(recurse=False):
        if b.is_meta:
            yield name, b


def _uninitializable(plan: Plan) -> List[str]:
    """Without ``param_init_fn``: the meta tensors whose first module has no ``reset_parameters()``
    (then the call defers initialization: see [Note: Meta materialization])."""
    return [f"{_join(fqn, name)!r} ({type(module).__name__})" for (fqn, module, name), *_
            in _meta_registrations(plan).values() if not callable(getattr(module, "reset_parameters", None))]


def _materialize(plan: Plan) -> bool:
    """Materialize meta tensors (see [Note: Meta materialization]); True if there were any."""
    registrations = _meta_registrations(plan)
    if not registrations:
        return False
    if plan.deferred:
        _defer_meta_params(plan)
        return True
    if plan.param_init_fn is None:
        _reset_meta_modules(plan)
    else:
        _call_param_init_fn(plan, plan.param_init_fn)
        _retie(registrations)
    _raise_if_meta_left(plan)
    return True


def _meta_registrations(plan: Plan) -> Dict[int, List[Tuple[str, nn.Module, str]]]:
    """id(meta tensor) -> every ``(module FQN, module, name)`` it is registered under in the
    call's tree (several for tied weights), in ``.modules()`` order."""
    out: Dict[int, List[Tuple[str, nn.Module, str]]] = {}
    for fqn, module in _managed_modules(plan.root, plan.ignored_modules):
        for name, t in _direct_meta(module, plan.ignored_params):
            out.setdefault(id(t), []).append((fqn, module, name))
    return out


def _call_param_init_fn(plan: Plan, init_fn: Callable[[nn.Module], None]) -> None:
    """``init_fn(m)`` as torch's FSDP1 calls it; each call may change only what was on meta
    when its target's first call began (see [Note: Meta materialization])."""
    for target in plan.targets:
        # breadth-first, as torch's FSDP1 calls it; this call's nested targets were materialized before
        others = {t.module for t in plan.targets if t is not target}
        modules = [m for _, m in _managed_modules(target.module, plan.ignored_modules | others, breadth_first=True)]
        if not any(True for m in modules for _ in _direct_meta(m, plan.ignored_params)):
            continue
        inside = {id(m) for m in target.module.modules()}
        nested = {id(m) for t in plan.targets if t is not target and id(t.module) in inside
                  for _, m in _managed_modules(t.module, plan.ignored_modules)}
        initialized = {id(t) for m in target.module.modules() for t in (*m.parameters(recurse=False),
                                                                        *m.buffers(recurse=False)) if not t.is_meta}
        for module in modules:
            _init_keeping_initialized(functools.partial(init_fn, module), module, plan, by_reference=nested,
                                      only=initialized)


def _retie(registrations: Dict[int, List[Tuple[str, nn.Module, str]]]) -> None:
    """Make every registration of one meta tensor (tied weights) hold one tensor again: the
    first registration's (the name ``named_parameters()`` reports), as off meta."""
    for places in registrations.values():
        if len(places) < 2:
            continue
        current = [getattr(owner, name, None) for _, owner, name in places]
        keep = next((t for t in current if isinstance(t, torch.Tensor) and not t.is_meta), None)
        if keep is None:
            continue  # nothing materialized it: _raise_if_meta_left names it
        for (_, owner, name), t in zip(places, current):
            if t is not keep:
                setattr(owner, name, keep)


def _defer_meta_params(plan: Plan) -> None:
    """FSDP2's flow (see [Note: Meta materialization]): each meta parameter becomes a parameter of
    uninitialized storage on the compute device (ties kept), so that the handles shard it; meta
    buffers stay where they are. ``model.to_empty(device=...)`` and the model's own init follow."""
    mixed = [_join(fqn, name) for fqn, m in _managed_modules(plan.root, plan.ignored_modules)
             for name, p in m.named_parameters(recurse=False) if not p.is_meta and p not in plan.ignored_params]
    if mixed:
        raise ValueError(f"fully_shard({type(plan.root).__name__}): the model is partly on the meta device, and "
                         f"{', '.join(_uninitializable(plan)[:3])} have no reset_parameters() to initialize them, "
                         f"while {mixed[:3]} are materialized already. Build the whole model on the meta device "
                         "(then model.to_empty(device=...) and its own init after fully_shard, FSDP2's flow), or "
                         "pass param_init_fn=... to materialize the rest.")
    replaced: Dict[int, nn.Parameter] = {}
    for _, module in _managed_modules(plan.root, plan.ignored_modules):
        for name, p in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if p.is_meta and p not in plan.ignored_params:
                if id(p) not in replaced:
                    replaced[id(p)] = nn.Parameter(_empty_on(p, plan.compute_device), requires_grad=p.requires_grad)
                setattr(module, name, replaced[id(p)])


def _empty_on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Uninitialized storage for the meta tensor ``t`` on ``device``; a tensor-parallel one stays
    a ``DTensor`` of the same mesh and placements, holding this rank's piece."""
    if isinstance(t, DTensor):
        local = torch.empty(t.to_local().shape, dtype=t.dtype, device=device)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return torch.empty_like(t, device=device)


def _reset_meta_modules(plan: Plan) -> None:
    """``reset_parameters()`` of each managed module with meta tensors of its own, in
    ``.modules()`` order, on empty tensors of the compute device. A tensor-parallel (``DTensor``)
    parameter is initialized whole, as a plain tensor of its global shape (fans and draws those
    of the unsharded model), and then becomes the ``DTensor`` of this rank's piece. The draws
    are recorded (see [Note: Initial weights and the global RNG] in ``init_draws.py``)."""
    replaced: Dict[int, torch.Tensor] = {}  # id(meta tensor) -> what replaced it (keeps ties)
    pieces: Dict[int, Tuple[torch.Tensor, Piece]] = {}  # id(whole stand-in) -> (its meta DTensor, where the piece lies)
    with init_draws.drawing(plan.compute_device) as draws:
        for fqn, module in _managed_modules(plan.root, plan.ignored_modules):
            fresh: Set[int] = set()  # ids of the tensors materialized for this module
            for name, t in list(_direct_meta(module, plan.ignored_params)):
                if id(t) not in replaced:
                    empty = torch.empty(t.shape, dtype=t.dtype, device=plan.compute_device) if isinstance(
                        t, DTensor) else torch.empty_like(t, device=plan.compute_device)
                    is_param = isinstance(t, nn.Parameter)
                    replaced[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if is_param else empty
                    fresh.add(id(replaced[id(t)]))
                    if isinstance(t, DTensor):
                        pieces[id(replaced[id(t)])] = (t, piece_of(t))
                setattr(module, name, replaced[id(t)])
            if fresh:
                reset: Callable[[], None] = getattr(module, "reset_parameters")  # presence checked at plan time
                _init_keeping_initialized(reset, module, plan, just_materialized=fresh)
                draws.ran(fqn, module)
    if pieces:
        _pieces_of_whole(plan, pieces)


def _pieces_of_whole(plan: Plan, pieces: Dict[int, Tuple[torch.Tensor, Piece]]) -> None:
    """Register, in place of each whole stand-in, the ``DTensor`` of this rank's piece of it."""
    made: Dict[int, torch.Tensor] = {}
    for _, module in _managed_modules(plan.root, plan.ignored_modules):
        for name, t in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if id(t) in pieces:
                if id(t) not in made:
                    meta, piece = pieces[id(t)]
                    local = take_piece(piece, t.detach()).clone()
                    made[id(t)] = nn.Parameter(as_dtensor(piece, local), requires_grad=t.requires_grad)
                setattr(module, name, made[id(t)])


@dataclass(eq=False)
class _Kept:
    """A tensor an init call must leave as it was (see [Note: Meta materialization])."""

    tensor: torch.Tensor  # the registered parameter or buffer object
    data: torch.Tensor  # its ``.data`` before the call (a sharded parameter's: a view of its flat shard)
    value: Optional[torch.Tensor]  # a copy of its value before the call (None: put back by reference only)
    names: List[Tuple[nn.Module, str]]  # every (owner module, attribute name) it is registered under


_Registrations = Tuple[List[Tuple[str, int]], List[Tuple[str, int]]]  # a module's (parameter, child) ids by name


@dataclass
class _Snapshot:
    """What :func:`_init_keeping_initialized` puts back after an init call."""

    kept: List[_Kept] = field(default_factory=list)  # the subtree's initialized tensors, one per object
    changes: List[Tuple[_FSDPState, Optional[ModelChange]]] = field(default_factory=list)  # earlier calls' states in the
    # subtree, each with the model change the watch had recorded for it
    registrations: Dict[int, _Registrations] = field(default_factory=dict)  # id(module) -> its registrations, for
    # every module under those states


def _init_keeping_initialized(init: Callable[[], None], module: nn.Module, plan: Plan,
                              just_materialized: AbstractSet[int] = frozenset(),
                              by_reference: AbstractSet[int] = frozenset(),
                              only: Optional[AbstractSet[int]] = None) -> None:
    """Run ``init()`` (``module.reset_parameters()`` or ``param_init_fn(module)``); afterwards,
    also when it raises, put back every tensor of ``module``'s subtree (ignored ones aside) not
    on meta, not in ``just_materialized`` and (if given) in ``only``: object under each of its
    names, ``.data`` and value -- by object and ``.data`` only for modules whose ids are in
    ``by_reference`` (see [Note: Meta materialization])."""
    snapshot = _snapshot(module, plan, just_materialized, by_reference, only)
    try:
        with _apply_guard.applying_during_init():
            init()
    finally:
        _put_back(snapshot)


def _snapshot(module: nn.Module, plan: Plan, just_materialized: AbstractSet[int],
              by_reference: AbstractSet[int] = frozenset(), only: Optional[AbstractSet[int]] = None) -> _Snapshot:
    kept: Dict[int, _Kept] = {}
    snapshot = _Snapshot()
    for sub in module.modules():
        state = _get_module_state(sub, _FSDPState)
        if state is not None and state.module is sub:  # fully sharded by an earlier call
            snapshot.changes.append((state, state.model_change))
            snapshot.registrations.update((id(m), _registrations(m)) for m in sub.modules())
        if sub in plan.ignored_modules:
            continue
        tensors: List[Tuple[str, torch.Tensor]] = [
            (n, p) for n, p in sub.named_parameters(recurse=False, remove_duplicate=False) if p not in plan.ignored_params]
        tensors += list(sub.named_buffers(recurse=False, remove_duplicate=False))
        for name, t in tensors:
            if t.is_meta or id(t) in just_materialized or (only is not None and id(t) not in only):
                continue
            if id(t) not in kept:
                kept[id(t)] = _Kept(t, t.data, None if id(sub) in by_reference else t.detach().clone(), [])
            kept[id(t)].names.append((sub, name))
    snapshot.kept = list(kept.values())
    return snapshot


def _put_back(snapshot: _Snapshot) -> None:
    """Restore what :func:`_snapshot` recorded. A sharded child's parameter that ``init``
    replaced is registered again, which the watch (torch's registration hooks) had already
    recorded as a model change: that record is dropped when every registration under the
    child is as before; any other change (a parameter or module added) is still raised."""
    with torch.no_grad():
        for k in snapshot.kept:
            for owner, name in k.names:
                if getattr(owner, name, None) is not k.tensor:
                    setattr(owner, name, k.tensor)
            if not _apply_guard.same_view(k.tensor.data, k.data):
                k.tensor.data = k.data
            if k.value is not None:
                k.tensor.copy_(k.value)
    for state, change in snapshot.changes:
        if state.model_change != change and state.module is not None and all(
                _registrations(m) == snapshot.registrations.get(id(m)) for m in state.module.modules()):
            state.model_change = change


def _registrations(module: nn.Module) -> _Registrations:
    return ([(n, id(p)) for n, p in module.named_parameters(recurse=False, remove_duplicate=False)],
            [(n, id(c)) for n, c in module.named_children()])


def _raise_if_meta_left(plan: Plan) -> None:
    left = [_join(fqn, name) for fqn, m in _managed_modules(plan.root, plan.ignored_modules)
            for name, _ in _direct_meta(m, plan.ignored_params)]
    if left:
        how = ("param_init_fn(m) was called, as torch FSDP1 calls it, on every module of each fully sharded "
               "module's subtree (breadth-first) and must materialize m's own parameters and buffers, e.g. "
               "m.to_empty(device=..., recurse=False) and then initialize them (or sync_module_states=True)"
               if plan.param_init_fn is not None else "reset_parameters() ran on every module with meta tensors")
        raise ValueError(
            f"fully_shard({type(plan.root).__name__}): {left} are still on the meta device after materialization: "
            f"{how}. fully_shard was not applied.")


# ---------------------------------------------------------------------------- devices and groups
def _compute_device(root: nn.Module, device_id: Optional[torch.device]) -> torch.device:
    if device_id is not None:
        return device_id
    for p in root.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def resolve_groups(strategy: ShardingStrategy, process_group: Any, mesh: Any) -> _Groups:
    """Shard and replicate groups for a strategy (see [Note: Groups] in fully_shard.py)."""
    shard: Optional[dist.ProcessGroup]
    replicate: Optional[dist.ProcessGroup]
    if strategy in _HYBRID:
        shard, replicate = _hybrid_groups(process_group, mesh)
    else:
        if isinstance(process_group, tuple):
            raise ValueError("fully_shard: a (shard, replicate) process group pair needs HYBRID_SHARD or "
                             "_HYBRID_SHARD_ZERO2; pass one ProcessGroup for other strategies")
        if mesh is not None:
            if mesh.ndim != 1:
                raise ValueError(f"fully_shard: a {mesh.ndim}-D mesh needs a hybrid strategy; pass a 1-D mesh")
            process_group = mesh.get_group()
        group: Optional[dist.ProcessGroup] = process_group if process_group is not None else dist.group.WORLD
        shard = None if strategy is ShardingStrategy.NO_SHARD else group
        replicate = group if strategy is ShardingStrategy.NO_SHARD else None
    world = dist.get_world_size(shard) if shard is not None else 1
    rank = dist.get_rank(shard) if shard is not None else 0
    replicas = dist.get_world_size(replicate) if replicate is not None else 1
    return _Groups(shard, replicate, rank, world, world * replicas)


def _hybrid_groups(process_group: Any, mesh: Any) -> Tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]:
    if mesh is not None:
        if mesh.ndim != 2:
            raise ValueError(f"fully_shard: hybrid sharding needs a 2-D (replicate, shard) mesh, got {mesh.ndim}-D")
        return mesh.get_group(1), mesh.get_group(0)
    if isinstance(process_group, tuple):
        return process_group[0], process_group[1]
    if process_group is not None:
        raise ValueError("fully_shard: hybrid sharding needs a (shard group, replicate group) pair or a 2-D mesh, "
                         "not a single process group")
    return _node_groups(_local_world_size())


# [Note: Hybrid groups made once]  HYBRID_SHARD without process groups shards within a node and
# replicates across nodes. Creating those groups is collective and each is a communicator of its
# own (buffers and set-up time on NCCL), so they are made once per process layout (the default
# group, the node size) and reused by every fully_shard call: per-block annotation of a 32-block
# model makes one (shard, replicate) pair, not 33. Held weakly, as every process group of ours
# is ([Note: Process groups held weakly]): c10d keeps them until they are destroyed, and a layout
# whose groups are gone (dist.destroy_process_group()) gets new ones.
_NODE_GROUPS: Dict[Tuple[int, int], Tuple["weakref.ReferenceType[Any]", ...]] = {}


def _node_groups(local: int) -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (shard within its node, replicate across nodes) groups, made on first use."""
    default = dist.group.WORLD
    key = (id(default), local)
    refs = _NODE_GROUPS.get(key, ())
    cached = [r() for r in refs]
    if len(cached) == 3 and cached[0] is default and cached[1] is not None and cached[2] is not None:
        return cached[1], cached[2]
    world = dist.get_world_size()
    shard, _ = dist.new_subgroups_by_enumeration([list(range(i, i + local)) for i in range(0, world, local)])
    replicate, _ = dist.new_subgroups_by_enumeration([list(range(j, world, local)) for j in range(local)])
    _NODE_GROUPS[key] = (weakref.ref(default), weakref.ref(shard), weakref.ref(replicate))  # type: ignore[arg-type]
    return shard, replicate


def _local_world_size() -> int:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if local <= 0 or dist.get_world_size() % local:
        raise ValueError("fully_shard: hybrid sharding without process groups shards within a node, which needs "
                         "LOCAL_WORLD_SIZE (set by torchrun); pass mesh= or process_group=(shard, replicate).")
    return local


# ---------------------------------------------------------------------------- agreed refusals
def plan_agreed(module: nn.Module, kwargs: Dict[str, Any]) -> Plan:
    """Check the arguments, plan, materialize and move: everything of ``fully_shard`` before its
    first collective, each refusal agreed by every rank of the call (see [Note: Agreed
    refusals] in ``_setup/data_parallel.py``). Returns the plan, ready for :func:`apply_plan`."""
    return agreed(f"fully_shard({type(module).__name__})", agreement_groups(kwargs["process_group"], kwargs["mesh"]),
                  functools.partial(_plan_and_prepare, module, kwargs), lambda plan: [
                      [name, list(t.shape), str(t.dtype)] for name, t in _sync_tensors(plan)
                  ] if plan.sync_module_states else None, applied="fully_shard",
                  what="ranks disagree on what sync_module_states broadcasts from rank 0 (names, shapes and dtypes "
                  "must match; a model built on the meta device elsewhere is fine)", tag="fully_shard::init",
                  digest_first=True)


def _plan_and_prepare(module: nn.Module, kwargs: Dict[str, Any]) -> Plan:
    kwargs = check_fully_shard_arguments(module, kwargs)
    plan = plan_fully_shard(module, kwargs)
    dp_groups: List[Optional[dist.ProcessGroup]] = []
    for strategy in plan.strategies:  # raise what resolve_groups will, creating no group (that is collective)
        if strategy in _HYBRID and kwargs["process_group"] is None and kwargs["mesh"] is None:
            _local_world_size()
            dp_groups.append(None)  # the node groups, not made yet: within the default group
        else:
            resolved = resolve_groups(strategy, kwargs["process_group"], kwargs["mesh"])
            dp_groups += [g for g in (resolved.shard, resolved.replicate) if g is not None]
    managed = {id(p) for target in plan.targets for p in target.params}
    check_tensor_parallel(f"fully_shard({type(module).__name__})",  # see [Note: Tensor-parallel pieces]
                          [(n, p) for n, p in module.named_parameters(remove_duplicate=False) if id(p) in managed],
                          dp_groups or [None], flattened=True)
    check_all_gather_extensions(f"fully_shard({type(module).__name__})", module,
                                [(n, p) for n, p in module.named_parameters(remove_duplicate=False) if id(p) in managed])
    before = _fqn_snapshot([module])
    if _materialize(plan):
        _assign_params(plan)  # the handles flatten what is registered now
        _check_fqns_unchanged(f"fully_shard({type(module).__name__}) (its param_init_fn)", before,
                              _fqn_snapshot([module]))
    if plan.device_id is not None:
        offloaded = {id(p) for t in plan.targets if (t.config["cpu_offload"] or CPUOffload()).offload_params
                     for p in t.params}  # never on the device whole
        for _, m in _managed_modules(plan.root, plan.ignored_modules):
            for p in m.parameters(recurse=False):
                if p.device != plan.device_id and id(p) not in offloaded:
                    p.data = p.data.to(plan.device_id)
            for name, b in list(m.named_buffers(recurse=False)):
                if b.device != plan.device_id and not b.is_meta:  # meta ones: to_empty's (plan.deferred)
                    setattr(m, name, b.to(plan.device_id))
    return plan


def _sync_tensors(plan: Plan) -> List[Tuple[str, torch.Tensor]]:
    """What ``sync_module_states`` broadcasts, named: the handles' parameters, target by
    target, then every buffer outside ignored modules."""
    names = {id(p): n for n, p in plan.root.named_parameters()}
    out = [(names.get(id(p), "?"), local_piece(p.data)) for t in plan.targets for p in t.params]  # TP: each its piece
    for fqn, m in plan.root.named_modules():
        if m not in plan.ignored_modules:
            out += [(_join(fqn, n), b) for n, b in m.named_buffers(recurse=False)]
    return out


# ---------------------------------------------------------------------------- apply
def apply_plan(plan: Plan, root_state: _FSDPState, groups: Dict[ShardingStrategy, _Groups],
               make_state: Callable[[], _FSDPState], finish_target: Callable[[nn.Module, _FSDPState], None]) -> None:
    """Mutate the plan :func:`plan_agreed` prepared (materialized, moved to ``device_id``):
    synchronize from rank 0, then build each target's state and handle, children first, and
    hand it to ``finish_target``. ``groups`` maps each of ``plan.strategies``."""
    root_groups = groups[plan.targets[-1].config["strategy"]]
    if plan.sync_module_states:
        broadcast_from_rank0([t for _, t in _sync_tensors(plan)], [root_groups.replicate, root_groups.shard],
                             plan.compute_device, tag="sync_module_states")
    for target in plan.targets:
        state = root_state if target.module is plan.root else make_state()
        target_groups = groups[target.config["strategy"]]
        _fill_state(state, target, plan, target_groups)
        if target.params:
            mp: Optional[MixedPrecision] = target.config["mixed_precision"]
            state.handle = FlatParamHandle(target.params, target.module, target.fqn, rank=target_groups.rank,
                                           world_size=target_groups.world_size, compute_device=plan.compute_device,
                                           param_dtype=mp.param_dtype if mp is not None else None,
                                           full_precision_classes=full_precision_classes(mp),
                                           offload_params=bool(state.cpu_offload.offload_params))
            state.handle.state = state
        state.awaiting_init = plan.deferred
        finish_target(target.module, state)
        _FULLY_SHARDED_MODULES.add(target.module)


def _fill_state(state: _FSDPState, target: _Target, plan: Plan, groups: _Groups) -> None:
    cfg = target.config
    state.module = target.module
    state.fqn = target.fqn
    state.process_group, state.replicate_group = groups.shard, groups.replicate
    state.rank, state.world_size, state.dp_world_size = groups.rank, groups.world_size, groups.dp_world_size
    state.strategy = cfg["strategy"]
    state.mixed_precision = cfg["mixed_precision"]
    state.cpu_offload = cfg["cpu_offload"] or CPUOffload()
    state.forward_prefetch = cfg["forward_prefetch"]
    state.backward_prefetch = cfg["backward_prefetch"]
    state.limit_all_gathers = cfg["limit_all_gathers"]
    state.compute_device = plan.compute_device
    state.ignored_params = plan.ignored_params
    state.ignored_modules = plan.ignored_modules
    state.reshard_after_backward = cfg["strategy"] is not ShardingStrategy.NO_SHARD
    state.reshard_after_forward = cfg["strategy"] in _FREES_AFTER_FORWARD

