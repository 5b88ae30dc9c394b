"""Everything ``fully_shard(...)`` does before the first forward: plan, validate, then mutate.

:func:`plan_fully_shard` computes the fully sharded modules (the called module plus the
policy's targets), which parameters each one's handle owns, and the process groups, and
raises on any bad input without touching the model. :func:`apply_plan` then materializes,
moves, synchronizes, flattens and registers hooks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _collectives
from ._common_utils import _FSDPState, _is_fsdp_flattened
from ._flat_param import FlatParamHandle
from ._traversal_utils import _composable, _get_fsdp_states
from .api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from .contract import _get_module_state, _get_registry
from .wrap import _as_policy

__all__ = ["Plan", "plan_fully_shard", "apply_plan"]

_HYBRID = {ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2}
_CONFIG_KEYS = ("strategy", "mixed_precision", "cpu_offload", "forward_prefetch", "backward_prefetch", "limit_all_gathers")


@dataclass
class _Groups:
    shard: Optional[dist.ProcessGroup]  # None: shard group of one rank (NO_SHARD)
    replicate: Optional[dist.ProcessGroup]  # None: no replication across groups
    rank: int
    world_size: int
    dp_world_size: int


@dataclass
class _Target:
    module: nn.Module
    fqn: str
    config: Dict[str, Any]
    params: List[nn.Parameter] = field(default_factory=list)


@dataclass
class Plan:
    """What ``fully_shard`` will do, computed and validated before any mutation."""

    root: nn.Module
    targets: List[_Target]  # bottom-up: every target after all targets it contains
    ignored_params: Set[nn.Parameter]
    ignored_modules: Set[nn.Module]
    compute_device: torch.device
    param_init_fn: Optional[Callable[[nn.Module], None]]
    sync_module_states: bool
    device_id: Optional[torch.device]


def plan_fully_shard(root: nn.Module, kwargs: Dict[str, Any]) -> Plan:
    """Validate ``fully_shard(root, **kwargs)`` and return the :class:`Plan`; raises with a
    message naming the module/parameter on bad input, leaving the model untouched."""
    registry: Dict[str, Any] = dict(_get_registry(root) or {})
    if "replicate" in registry:
        raise RuntimeError(
            f"fully_shard({type(root).__name__}): the module is already managed by replicate; a module can be "
            "managed by one data-parallel API. Apply fully_shard to its submodules, or use only replicate."
        )
    _validate_config(root, kwargs)
    ignored_modules = _expand_ignored_modules(root, kwargs.get("ignored_modules"), kwargs.get("ignored_states"))
    ignored_params = _ignored_params(root, ignored_modules, kwargs.get("ignored_states"))
    config = {k: kwargs[k] for k in _CONFIG_KEYS}
    targets = _select_targets(root, kwargs.get("policy"), ignored_modules, config)
    _assign_params(root, targets, ignored_modules, ignored_params)
    device_id = _normalize_device(kwargs.get("device_id"))
    return Plan(root, targets, ignored_params, ignored_modules, _compute_device(root, device_id),
                kwargs.get("param_init_fn"), bool(kwargs.get("sync_module_states")), device_id)


def _validate_config(root: nn.Module, kwargs: Dict[str, Any]) -> None:
    name = type(root).__name__
    if not isinstance(kwargs["strategy"], ShardingStrategy):
        raise TypeError(f"fully_shard({name}): strategy must be a ShardingStrategy, got {kwargs['strategy']!r}")
    mp = kwargs.get("mixed_precision")
    if mp is not None and not isinstance(mp, MixedPrecision):
        raise TypeError(f"fully_shard({name}): mixed_precision must be a MixedPrecision, got {type(mp).__name__}")
    off = kwargs.get("cpu_offload")
    if off is not None and not isinstance(off, CPUOffload):
        raise TypeError(f"fully_shard({name}): cpu_offload must be a CPUOffload, got {type(off).__name__}")
    bp = kwargs.get("backward_prefetch")
    if bp is not None and not isinstance(bp, BackwardPrefetch):
        raise TypeError(f"fully_shard({name}): backward_prefetch must be a BackwardPrefetch or None, got {bp!r}")
    if kwargs.get("mesh") is not None and kwargs.get("process_group") is not None:
        raise ValueError(f"fully_shard({name}): pass either process_group or mesh, not both")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"fully_shard({name}): torch.distributed is not initialized; call "
                           "dist.init_process_group(...) first (torchrun sets up the environment).")


def _expand_ignored_modules(root: nn.Module, ignored_modules: Optional[Iterable[nn.Module]],
                            ignored_states: Optional[Iterable[Any]]) -> Set[nn.Module]:
    """Ignored modules with their subtrees, plus every subtree another data-parallel API
    (replicate) manages."""
    tops: List[nn.Module] = list(ignored_modules or [])
    states = list(ignored_states or [])
    if states and all(isinstance(s, nn.Module) for s in states):
        tops.extend(states)
    elif states and not all(isinstance(s, nn.Parameter) for s in states):
        raise ValueError("fully_shard: ignored_states must be all nn.Parameters or all nn.Modules, got "
                         f"{sorted({type(s).__name__ for s in states})}")
    for m in tops:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard: ignored_modules must contain nn.Modules, got {type(m).__name__}")
    out: Set[nn.Module] = set()
    for m in tops:
        out.update(m.modules())
    for m in root.modules():
        if m is not root and not _composable(m):
            out.update(m.modules())
    return out


def _ignored_params(root: nn.Module, ignored_modules: Set[nn.Module], ignored_states: Optional[Iterable[Any]]) -> Set[nn.Parameter]:
    params: Set[nn.Parameter] = set()
    for m in ignored_modules:
        params.update(m.parameters(recurse=False))
    for s in ignored_states or []:
        if isinstance(s, nn.Parameter):
            params.add(s)
    return params


def _select_targets(root: nn.Module, policy: Any, ignored_modules: Set[nn.Module], config: Dict[str, Any]) -> List[_Target]:
    """The called module plus the policy's targets (modules already fully sharded by an
    earlier call are skipped), ordered bottom-up."""
    chosen: Dict[nn.Module, Dict[str, Any]] = {}
    if policy is not None:
        for m, kw in _as_policy(policy)._run_policy(root, set(ignored_modules), dict(config)).items():
            if m is root or m in ignored_modules or _get_module_state(m, _FSDPState) is not None:
                continue
            unknown = set(kw) - set(_CONFIG_KEYS)
            if unknown:
                raise ValueError(f"fully_shard: the policy returned unknown overrides {sorted(unknown)} for "
                                 f"{type(m).__name__}; allowed: {list(_CONFIG_KEYS)}")
            chosen[m] = {**config, **kw}
    fqns = {id(m): n for n, m in root.named_modules()}
    order = [m for m in root.modules() if m in chosen]
    targets = [_Target(m, fqns[id(m)], chosen[m]) for m in reversed(order)]
    targets.append(_Target(root, "", dict(config)))
    return targets


def _assign_params(root: nn.Module, targets: List[_Target], ignored_modules: Set[nn.Module],
                   ignored_params: Set[nn.Parameter]) -> None:
    """Give each parameter to the innermost target containing its module; raise if one
    parameter would belong to two handles, or is already a flat parameter."""
    target_of = {id(t.module): t for t in targets}
    names = {id(m): n for n, m in root.named_modules()}
    # id(param) -> (owner object, owner's module FQN, FQN of the module registering it)
    owner: Dict[int, Tuple[object, str, str]] = {}
    for s in _get_fsdp_states(root):
        if s.handle is not None and s.module is not root:
            for g in s.handle.groups:
                for p, info in zip(g.orig_params, g.flat_param._param_infos):
                    module_fqn = names.get(id(s.module), s.fqn)
                    owner[id(p)] = (s, module_fqn, _join(module_fqn, info.module_name))
    stack: List[Tuple[nn.Module, str, Optional[_Target]]] = [(root, "", None)]
    seen: Set[int] = set()
    while stack:
        module, fqn, current = stack.pop()
        if id(module) in seen or module in ignored_modules:
            continue
        seen.add(id(module))
        if module is not root and _get_module_state(module, _FSDPState) is not None:
            continue  # already fully sharded by an earlier call: its handle owns this subtree
        current = target_of.get(id(module), current)
        for name, p in module.named_parameters(recurse=False):
            _claim(p, _join(fqn, name), fqn, current, owner, ignored_params)
        for child_name, child in reversed(list(module.named_children())):
            stack.append((child, _join(fqn, child_name), current))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _claim(p: nn.Parameter, param_fqn: str, module_fqn: str, target: Optional["_Target"],
           owner: Dict[int, Tuple[object, str, str]], ignored_params: Set[nn.Parameter]) -> None:
    if p in ignored_params or target is None:
        return
    if _is_fsdp_flattened(p):
        raise ValueError(f"fully_shard: parameter {param_fqn!r} is a FlatParameter of another fully_shard handle; "
                         "flat parameters cannot be nested. Register the original parameters instead.")
    previous = owner.get(id(p))
    if previous is None:
        owner[id(p)] = (target, target.fqn, module_fqn)
        target.params.append(p)
        return
    if previous[0] is not target:
        lca = _common_prefix(previous[2], module_fqn)
        raise ValueError(
            f"fully_shard: parameter {param_fqn!r} is shared by fully_shard({previous[1] or '<root>'}) and "
            f"fully_shard({target.fqn or '<root>'}); a parameter can belong to one handle only. Apply fully_shard "
            f"to their lowest common ancestor {lca or '<root>'!r} instead of both."
        )


def _common_prefix(a: str, b: str) -> str:
    parts: List[str] = []
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        parts.append(x)
    return ".".join(p for p in parts if p)


def _normalize_device(device_id: Union[int, torch.device, None]) -> Optional[torch.device]:
    if device_id is None:
        return None
    if isinstance(device_id, int):
        return torch.device("cuda", device_id)
    if isinstance(device_id, torch.device):
        if device_id.type == "cuda" and device_id.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device_id
    raise TypeError(f"fully_shard: device_id must be an int or torch.device, got {type(device_id).__name__}")


def _compute_device(root: nn.Module, device_id: Optional[torch.device]) -> torch.device:
    if device_id is not None:
        return device_id
    for p in root.parameters():
        if p.device.type not in ("meta",):
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
        if len(process_group) != 2:
            raise ValueError("fully_shard: hybrid process_group must be a (shard group, replicate group) pair")
        return process_group[0], process_group[1]
    if process_group is not None:
        raise ValueError("fully_shard: hybrid sharding needs a (shard group, replicate group) pair or a 2-D mesh, "
                         "not a single process group")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    world = dist.get_world_size()
    if local <= 0 or world % local:
        raise ValueError("fully_shard: hybrid sharding without process groups shards within a node, which needs "
                         "LOCAL_WORLD_SIZE (set by torchrun); pass mesh= or process_group=(shard, replicate).")
    shard, _ = dist.new_subgroups_by_enumeration([list(range(i, i + local)) for i in range(0, world, local)])
    replicate, _ = dist.new_subgroups_by_enumeration([list(range(j, world, local)) for j in range(local)])
    return shard, replicate


def apply_plan(plan: Plan, root_state: _FSDPState, groups: _Groups,
               make_state: Callable[[], _FSDPState], finish_target: Callable[[nn.Module, _FSDPState], None]) -> None:
    """Mutate: materialize meta parameters, move to the device, synchronize from rank 0,
    then build each target's state and handle bottom-up and hand it to ``finish_target``."""
    _materialize(plan)
    _sync_module_states(plan, groups)
    for target in plan.targets:
        state = root_state if target.module is plan.root else make_state()
        _fill_state(state, target, plan, groups)
        if target.params:
            mp: Optional[MixedPrecision] = target.config["mixed_precision"]
            state.handle = FlatParamHandle(target.params, target.module, target.fqn, rank=groups.rank,
                                           world_size=groups.world_size, compute_device=plan.compute_device,
                                           param_dtype=mp.param_dtype if mp is not None else None)
            state.handle.state = state
        finish_target(target.module, state)


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
    state.reshard_after_backward = cfg["strategy"] is not ShardingStrategy.NO_SHARD


def _materialize(plan: Plan) -> None:
    """Meta parameters: ``param_init_fn(module)`` if given, else ``to_empty`` on the compute
    device then ``reset_parameters()`` on every submodule that had meta tensors. Then move
    to ``device_id``."""
    root = plan.root
    on_meta = [m for m in root.modules() if m not in plan.ignored_modules and any(
        t.is_meta for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)))]
    if on_meta:
        if plan.param_init_fn is not None:
            plan.param_init_fn(root)
        else:
            for m in on_meta:
                m.to_empty(device=plan.compute_device, recurse=False)
                reset = getattr(m, "reset_parameters", None)
                if callable(reset):
                    reset()
    if plan.device_id is not None:
        for m in root.modules():
            if m not in plan.ignored_modules:
                _move_module_tensors(m, plan.device_id)


def _move_module_tensors(module: nn.Module, device: torch.device) -> None:
    for p in module.parameters(recurse=False):
        if p.device != device:
            p.data = p.data.to(device)
    for name, b in list(module.named_buffers(recurse=False)):
        if b.device != device:
            setattr(module, name, b.to(device))


def _sync_module_states(plan: Plan, groups: _Groups) -> None:
    if not plan.sync_module_states:
        return
    tensors = [p.data for t in plan.targets for p in t.params]
    tensors += [b for m in plan.root.modules() if m not in plan.ignored_modules for b in m.buffers(recurse=False)]
    for group in (groups.replicate, groups.shard):
        if group is None:
            continue
        for t in tensors:
            _collectives.broadcast(t, 0, group, tag="sync_module_states")
