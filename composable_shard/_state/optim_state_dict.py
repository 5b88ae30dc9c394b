"""Optimizer state dicts keyed by parameter FQN: full and sharded.

An optimizer built on ``model.parameters()`` holds, for each sharded parameter, state tensors
shaped like the parameter's 1-D slice on this rank (AdamW's ``exp_avg``, SGD's
``momentum_buffer``) and scalars (``step``). Layout, as torch's distributed state-dict API::

    {"state": {fqn: {name: tensor_or_scalar}},
     "param_groups": [{"lr": ..., ..., "params": [fqn, ...]}]}

* Full: each slice-shaped state is all-gathered with its flat group (one all-gather per group
  and state name) into the parameter's full shape.
* Sharded: each slice-shaped state becomes a :class:`ShardedSlice` of the parameter's global
  shape over the rank's elements: no collective. :func:`get_optimizer_state_dict` copies the
  rank's elements; :func:`sharded_optim_views` (the checkpoint functions') gives views of the
  optimizer's state tensors, which ``dcp.save`` reads and ``dcp.load`` writes in place.
* Ownership (API.md, [Note: State dicts own their tensors] in ``_state/model_state_dict.py``): nothing
  :func:`get_optimizer_state_dict` returns aliases the optimizer's state (``step`` tensors,
  tensor hyper-parameters included): what is gathered is new, everything else is copied.
  :func:`set_optimizer_state_dict` copies what it loads (torch's ``Optimizer.load_state_dict``
  keeps the given tensors: two optimizers loaded from one state dict would share ``step``),
  except a value that is already the optimizer's own state for that parameter (a view load).
* An optimizer that has not stepped has no state to describe (or to load a checkpoint into):
  its state is created first as its own first ``step()`` would create it, with zero
  gradients and ``lr=0`` (parameters unchanged) and the step counters reset to 0.

[Note: torch's state-dict API]
  torch's ``torch.distributed.checkpoint.state_dict`` functions (``get_state_dict``,
  ``get_optimizer_state_dict``, ``set_state_dict``, ...: what Lightning, Fabric, torchtitan and
  DCP's own recipes call), ``dcp.save({"optim": optim})`` (DCP's ``Stateful``) and
  ``dcp.save({"optim": optim.state_dict()})`` all take an optimizer's state from
  ``optimizer.state_dict()`` and treat a plain tensor as one replicated on every rank: DCP keeps one
  rank's copy per key. Our per-rank slices would be saved as one rank's slice (partial), or,
  where every rank's slices have equal shapes, loaded into every rank as rank 0's (swapped).
  So every optimizer that steps a fully sharded parameter carries a ``state_dict`` post-hook and
  a ``load_state_dict`` pre-hook (torch's per-optimizer hooks; installed at its first step, seen
  through the global step hook of ``_runtime/watch.py``, by :class:`OptimizerStateDictWatch`):

  * ``state_dict()``: each slice-shaped state of a sharded parameter (``exp_avg``, a momentum
    buffer) becomes a :class:`ShardedSlice` of the parameter's global shape, a view of the
    optimizer's state tensor, as FSDP2's optimizer state is a ``DTensor`` that aliases it: DCP
    saves each rank's elements and loads them in place, at any world size, with no collective.
    Called by one of torch's state-dict functions asking for a full state dict
    (``StateDictOptions(full_state_dict=True)``), they are gathered into full tensors instead
    (torch gathers only ``DTensor`` s); :func:`torch_request` reads what was asked. Pickled
    (``torch.save``) a ``ShardedSlice`` is its plain 1-D local elements, as before.
  * ``load_state_dict(sd)``: each such state may be a ``ShardedSlice`` (its elements for this
    rank are taken), a full tensor of the parameter's shape, a ``DTensor`` (either is sliced),
    the whole parameter flattened (a one-rank or NO_SHARD optimizer's: sliced), or this rank's
    own slice (kept, as torch keeps what it is given; another rank's is refused, see [Note:
    Per-rank optimizer state dicts say whose they are]); anything else raises, naming the
    parameter. An optimizer loaded before its first step (no hooks yet) is converted the same
    way before that step. The model side: under torch's functions, ``module.state_dict()`` of a
    fully sharded module gives ``ShardedSlice`` views (sharded request) or full tensors (full
    request; on rank 0 only when they offload), see ``effective_type`` in ``_state/model_state_dict.py``.

  One hook pair per optimizer, whatever the number of fully sharded modules it steps: a
  gather must run in the same order on every rank, and it follows the optimizer's parameter
  order. An optimizer that never stepped has no state to convert; torch's ``set_*`` functions
  step it first (``lr=0``), which installs the hooks before they load.
"""

from __future__ import annotations

import functools
import math
import weakref
import zlib
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from .._runtime import collectives as _collectives
from .._runtime import watch as _watch
from .._runtime.module_state import _FSDPState
from .sharded_slice import ShardedSlice
from .._base.pieces import to_global
from .model_state_dict import Managed, agree_torch_load, check_get_flags, local_slice, managed_params, on_cpu, torch_request
from .load_transaction import agree_steps_now, common_group, is_distributed, rank_of, states_groups, transactional
from .._base.torch_compat import unwrap_compiled
from .._base.tree import convert
from .unshard_params import check_module, gather_flat, local_flat, param_views

__all__ = ["get_optimizer_state_dict", "set_optimizer_state_dict", "param_groups_by_fqn", "sharded_optim_views",
           "OptimizerStateDictWatch", "register_optimizer_state_dict_hooks"]


def _check(api: str, module: Any, optim: Any) -> None:
    check_module(api, module)
    if not isinstance(optim, torch.optim.Optimizer):
        raise TypeError(f"{api}: optim must be a torch.optim.Optimizer, got {type(optim).__name__}")


def _param_names(api: str, module: nn.Module, optim: torch.optim.Optimizer) -> Tuple[List[str], Dict[str, Managed]]:
    """Each optimizer parameter's FQN in the optimizer's order, and where the sharded ones live."""
    names = {id(p): n for n, p in module.named_parameters()}
    first_names = set(names.values())
    managed: Dict[str, Managed] = {}
    for path, m in module.named_modules():
        for name, where in managed_params(m).items():
            fqn = f"{path}.{name}" if path else name
            if fqn in first_names:
                managed[fqn] = where
    fqns = []
    for i, group in enumerate(optim.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"{api}: a parameter of the optimizer's param_groups[{i}] (shape {tuple(p.shape)}) is not "
                                 f"a parameter of {type(module).__name__}; pass the module the optimizer was built for.")
            fqns.append(names[id(p)])
    return fqns, managed


def _copied(value: Any) -> Any:
    """``value`` with every tensor in it (in tuples, lists, dicts, dataclasses) copied."""
    return convert(value, lambda t: t.detach().clone())


def _groups(optim: torch.optim.Optimizer, fqns: List[str]) -> List[Dict[str, Any]]:
    """``optim``'s ``param_groups``, hyper-parameters copied, each listing its parameters' FQNs."""
    groups = []
    position = 0
    for group in optim.param_groups:
        n = len(group["params"])
        groups.append({**{k: _copied(v) for k, v in group.items() if k != "params"}, "params": fqns[position:position + n]})
        position += n
    return groups


def param_groups_by_fqn(module: nn.Module, optim: torch.optim.Optimizer) -> List[Dict[str, Any]]:
    """``optim``'s ``param_groups`` as in :func:`get_optimizer_state_dict` (parameters by FQN),
    without creating any optimizer state."""
    return _groups(optim, _param_names("get_optimizer_state_dict", module, optim)[0])


def _is_sliced(value: Any, param: torch.Tensor) -> bool:
    """A per-element state (same shape as the parameter's local slice), not a scalar."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def _init_state(optim: torch.optim.Optimizer) -> None:
    """Create the state of an optimizer that has not stepped (see the module docstring)."""
    if optim.state:
        return
    params = [p for g in optim.param_groups for p in g["params"]]
    if any(p.grad is not None for p in params):
        return  # a step is under way; do not touch gradients
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    saved = [group.get("lr") for group in optim.param_groups]
    for group, lr in zip(optim.param_groups, saved):
        if lr is not None:
            group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
    try:
        optim.step()
    finally:
        for group, lr in zip(optim.param_groups, saved):
            if lr is not None:
                group["lr"] = lr
        optim.zero_grad(set_to_none=True)
    for state in optim.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            state["step"] = 0


def get_optimizer_state_dict(module: nn.Module, optim: torch.optim.Optimizer, *, full: bool = True,
                             cpu_offload: bool = False, rank0_only: bool = False) -> Dict[str, Any]:
    """``optim``'s state dict keyed by parameter FQN (see the module docstring); its tensors
    are its own (``step`` included): none aliases the optimizer's state.

    Example::

        osd = get_optimizer_state_dict(model, optim, full=False)
        dcp.save({"model": get_model_state_dict(model, full=False), "optim": osd}, checkpoint_id=path)

    Args:
        module: the model the optimizer was built on.
        optim: its optimizer (state created first if it has not stepped).
        full: True: full-shaped state tensors (all-gathered); False: :class:`ShardedSlice`
            values over copies of this rank's elements, no collective.
        cpu_offload: every tensor on the CPU.
        rank0_only: (full only) ranks other than 0 take part and get ``{}``.
    """
    module = unwrap_compiled(module)  # torch.compile's wrapper: the names without its prefix
    _check("get_optimizer_state_dict", module, optim)
    check_get_flags("get_optimizer_state_dict", full, cpu_offload, rank0_only)
    if full:  # gathered across ranks: see [Note: Steps agreed before a saved model] in load_transaction.py
        agree_steps_now(unwrap_compiled(module), "get_optimizer_state_dict", _OPTIM_HINT)
    dropped = rank0_only and rank_of() != 0  # takes part in the gathers, keeps nothing
    osd = _by_fqn(module, optim, full=full, cpu_offload=cpu_offload, copy=not dropped)
    if dropped:
        return {}
    if cpu_offload:
        osd["state"] = {f: on_cpu(s) for f, s in osd["state"].items()}
    return osd


def sharded_optim_views(module: nn.Module, optim: torch.optim.Optimizer) -> Dict[str, Any]:
    """``get_optimizer_state_dict(module, optim, full=False)`` as views of the optimizer's
    state (``step`` tensors themselves), for ``dcp.save`` to read and ``dcp.load`` to write in
    place without a copy of the rank's state (what the checkpoint functions use). Not public:
    the values change with training (see the module docstring)."""
    module = unwrap_compiled(module)
    _check("get_optimizer_state_dict", module, optim)
    return _by_fqn(module, optim, full=False, cpu_offload=False, copy=False)


def _by_fqn(module: nn.Module, optim: torch.optim.Optimizer, *, full: bool, cpu_offload: bool,
            copy: bool) -> Dict[str, Any]:
    """The state dict, its state created first (see the module docstring). A sharded
    parameter's slice-shaped states: gathered into new full tensors (``full``), else a
    :class:`ShardedSlice` over the rank's elements (copied if ``copy``, else a view). Every
    other value (``step``, a whole parameter's state) is copied if ``copy``, else the
    optimizer's own."""
    fqns, managed = _param_names("get_optimizer_state_dict", module, optim)
    _init_state(optim)
    params = [p for g in optim.param_groups for p in g["params"]]
    state: Dict[str, Dict[str, Any]] = {}
    for fqn, p in zip(fqns, params):
        if p not in optim.state:
            continue
        where, entries = managed.get(fqn), {}
        for name, value in optim.state[p].items():
            if where is None or not _is_sliced(value, p):
                entries[name] = _copied(value) if copy else value
            elif full:
                entries[name] = value  # replaced by its gathered full tensor below
            else:
                local = value.detach().reshape(-1)
                if cpu_offload and local.device.type != "cpu":
                    local = local.cpu()  # a new tensor already
                elif copy:
                    local = local.clone()
                entries[name] = where.sharded(local)
        state[fqn] = entries
    if full:
        _gather_states(state, managed, params, fqns)
    return {"state": state, "param_groups": _groups(optim, fqns)}


_OPTIM_HINT = _collectives.collective_call_hint(
    "`get_optimizer_state_dict(full=True)`",
    "Call it on every rank with `rank0_only=True` and save on rank 0, or save the sharded form "
    "(`full=False`) from every rank.")


def _gather_states(state: Dict[str, Dict[str, Any]], managed: Dict[str, Managed], params: List[torch.Tensor],
                   fqns: List[str], keep: bool = True) -> None:
    """Replace each sharded parameter's slice-shaped states by full tensors, one all-gather
    per flat group and state name, in an order every rank agrees on. ``keep=False``: take
    part in the all-gathers and keep nothing (the states stay as they were)."""
    local_kinds = {f: sorted((k, str(v.dtype)) for k, v in state.get(f, {}).items() if _is_sliced(v, p))
                   for f, p in zip(fqns, params) if f in managed}
    everyone = (_collectives.all_gather_json(local_kinds, None, tag="optim_state_kinds", hint=_OPTIM_HINT)
                if is_distributed() else [local_kinds])
    kinds: Dict[str, Dict[str, str]] = {}
    for per_rank in everyone:
        for f, pairs in per_rank.items():
            kinds.setdefault(f, {}).update(pairs)
    by_group: Dict[int, Tuple[Managed, Dict[int, str]]] = {}
    for f in fqns:
        where = managed.get(f)
        if where is not None and kinds.get(f):
            by_group.setdefault(id(where.group), (where, {}))[1][where.param_index] = f
    for where, members in by_group.values():
        group = where.group
        names = sorted({name for f in members.values() for name in kinds[f]})
        for name in names:
            dtype = next(getattr(torch, kinds[f][name].split(".")[-1]) for f in members.values() if name in kinds[f])
            locals_: List[Optional[torch.Tensor]] = [None] * len(group.orig_params)
            for index, f in members.items():
                value = state.get(f, {}).get(name)
                locals_[index] = value if isinstance(value, torch.Tensor) else None
            full = gather_flat(where.state, local_flat(group, locals_, dtype), group.padded_numel,
                               f"optim_state:{name}", _OPTIM_HINT)
            views = param_views(group, full)
            pieces = group.flat_param._pieces
            for index, f in members.items():
                if name not in kinds[f]:
                    continue
                piece = pieces[index]
                if piece is not None:  # joined over its tensor-parallel mesh on every rank: its peers need it
                    value = to_global(piece, views[index])
                elif keep:
                    value = views[index].clone()
                if keep:
                    state.setdefault(f, {})[name] = value


@transactional("set_optimizer_state_dict", model=False, optim=True)  # see [Note: All-or-nothing loads]
def set_optimizer_state_dict(module: nn.Module, optim: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
    """Load an FQN-keyed optimizer state dict (full or sharded, from any world size or
    strategy) into ``optim``. Everything is checked before the optimizer changes. Values are
    copied in (``step`` included): unlike torch's ``Optimizer.load_state_dict``, ``optim``
    never keeps a tensor of ``state_dict``, so two optimizers loaded from one state dict
    train independently.

    Example::

        osd = get_optimizer_state_dict(model, optim, full=False)
        dcp.load({"optim": osd}, checkpoint_id=path)
        set_optimizer_state_dict(model, optim, osd)
    """
    module = unwrap_compiled(module)  # torch.compile's wrapper: the names without its prefix
    api = "set_optimizer_state_dict"
    _check(api, module, optim)
    if not isinstance(state_dict, Mapping) or set(state_dict) != {"state", "param_groups"}:
        raise ValueError(f"{api}: expected {{'state': ..., 'param_groups': [...]}} (from get_optimizer_state_dict), "
                         f"got {type(state_dict).__name__} with keys {sorted(state_dict) if isinstance(state_dict, Mapping) else '-'}")
    by_index = [k for k in state_dict["state"] if not isinstance(k, str)] + [
        k for g in state_dict["param_groups"] if isinstance(g, Mapping) for k in g.get("params", []) if not isinstance(k, str)]
    if by_index:
        raise ValueError(f"{api}: the state dict names its parameters by {type(by_index[0]).__name__} ({by_index[0]!r}), "
                         "not by FQN: it is torch's optimizer.state_dict() layout (parameter positions). Load it with "
                         "optim.load_state_dict(state_dict) (a single-process optimizer's whole-parameter state is sliced "
                         "for this rank), or pass what get_optimizer_state_dict() returns. Nothing was loaded.")
    fqns, managed = _param_names(api, module, optim)
    params = dict(zip(fqns, (p for g in optim.param_groups for p in g["params"])))
    saved_groups = list(state_dict["param_groups"])
    if len(saved_groups) != len(optim.param_groups):
        raise ValueError(f"{api}: the state dict has {len(saved_groups)} param_groups, the optimizer "
                         f"{len(optim.param_groups)}")
    index_of = {f: i for i, f in enumerate(fqns)}
    local_groups = []
    for i, (saved, mine) in enumerate(zip(saved_groups, (group["params"] for group in _groups(optim, fqns)))):
        theirs = list(saved.get("params", []))
        if set(theirs) != set(mine):
            raise ValueError(f"{api}: param_groups[{i}] holds {sorted(set(theirs) ^ set(mine), key=str)} in only one of the "
                             "state dict and the optimizer; build the optimizer on the same parameters, in the same groups.")
        local_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": [index_of[f] for f in mine]})
    unknown = [f for f in state_dict["state"] if f not in params]
    if unknown:
        raise ValueError(f"{api}: state for parameters the optimizer does not hold: {unknown}")
    local_state: Dict[int, Dict[str, Any]] = {}
    for f, entries in state_dict["state"].items():
        where, p = managed.get(f), params[f]
        current, converted = optim.state.get(p, {}), {}
        for name, value in entries.items():
            if where is not None and isinstance(value, torch.Tensor) and value.dim() > 0:
                try:
                    piece = local_slice(where, f"state[{f!r}][{name!r}]", value)
                except ValueError as e:
                    raise ValueError(f"{api}: {e}") from None
                # a ShardedSlice's elements: kept or copied; a full tensor's: copied (no view keeping it alive)
                converted[name] = _kept(p, name, piece, current.get(name)) if isinstance(value, ShardedSlice) else piece.clone()
                continue
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != p.shape:
                raise ValueError(f"{api}: size mismatch for state[{f!r}][{name!r}]: {tuple(value.shape)} in the state "
                                 f"dict, {tuple(p.shape)} in the model")
            converted[name] = _kept(p, name, value, current.get(name))
        local_state[index_of[f]] = converted
    optim.load_state_dict({"state": local_state, "param_groups": local_groups})


def _kept(param: torch.Tensor, name: str, value: Any, current: Any) -> Any:
    """What the optimizer is given for ``value`` (its state ``name`` of ``param``): never the
    caller's tensor (torch's loader keeps what it is given), so a copy, made in the dtype and on
    the device torch's loader would cast it to (one copy, not two); or ``current``, the
    optimizer's own tensor, if ``value`` is exactly its elements (a load into views of the
    optimizer's state, e.g. :func:`sharded_optim_views`, wrote them in place)."""
    if not isinstance(value, torch.Tensor):
        return _copied(value)
    if isinstance(current, torch.Tensor) and _same_elements(value, current):
        return current
    if name == "step":
        return value.detach().clone()  # torch's loader keeps a step's dtype and device
    dtype = param.dtype if param.is_floating_point() else value.dtype
    return value.detach().to(device=param.device, dtype=dtype, copy=True)


def _same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    if isinstance(a, DTensor) or isinstance(b, DTensor):  # state of a tensor-parallel parameter: its local pieces
        return (isinstance(a, DTensor) and isinstance(b, DTensor) and a.placements == b.placements
                and _same_elements(a.to_local(), b.to_local()))
    return (a.dtype == b.dtype and a.device == b.device and a.numel() == b.numel() and a.is_contiguous()
            and b.is_contiguous() and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() == b.storage_offset())


# ---------------------------------------------------------------------------- optimizer hooks
class _Link:
    """The fully sharded modules (their states, weakly) whose parameters one optimizer steps:
    what its hooks convert (see [Note: torch's state-dict API])."""

    def __init__(self) -> None:
        self.states: "weakref.WeakSet[_FSDPState]" = weakref.WeakSet()

    def managed(self) -> Dict[int, Managed]:
        """``id(param)`` -> where it lives, for every parameter of the linked states' handles."""
        return {id(p): Managed(state, group, index) for state in list(self.states) if state.handle is not None
                for group in state.handle.groups for index, p in enumerate(group.orig_params)}


# optimizer -> its link; weak keys: an optimizer's hooks hold the link only weakly, so nothing
# here keeps an optimizer or a model alive (see [Note: Hooks for as long as a model needs them]).
_LINKS: "weakref.WeakKeyDictionary[Optimizer, _Link]" = weakref.WeakKeyDictionary()


def _link(optimizer: Optimizer, state: _FSDPState) -> None:
    """Link ``optimizer`` to ``state``; the first link installs its hook pair."""
    link = _LINKS.get(optimizer)
    if link is None:
        link = _LINKS[optimizer] = _Link()
        ref = weakref.ref(link)
        optimizer.register_state_dict_post_hook(functools.partial(_state_dict_post_hook, ref))
        optimizer.register_load_state_dict_pre_hook(functools.partial(_load_state_dict_pre_hook, ref))
    link.states.add(state)


class OptimizerStateDictWatch(_watch.OptimizerSteps):
    """Links every optimizer that steps one of ``state``'s parameters to it, at its steps (see
    [Note: torch's state-dict API]). Linking is idempotent, so it is done at an optimizer's first
    step after its groups (or the set of watches) changed, not at every step."""

    every_step = False

    def __init__(self, state: _FSDPState) -> None:
        self.state_ref: "weakref.ReferenceType[_FSDPState]" = weakref.ref(state)
        handle = state.handle
        super().__init__(p for g in (handle.groups if handle is not None else []) for p in g.orig_params)
        _STATE_WATCHES.add(self)

    def stepped(self, optimizer: Optimizer) -> None:
        state = self.state_ref()
        if state is not None:
            _link(optimizer, state)


_STATE_WATCHES: "weakref.WeakSet[OptimizerStateDictWatch]" = weakref.WeakSet()  # alive with their states


def register_optimizer_state_dict_hooks(state: _FSDPState) -> None:
    """Called once by ``fully_shard`` per fully sharded module with a handle."""
    if state.handle is not None:
        state.optimizer_state_dict_watch = OptimizerStateDictWatch(state)


def _saved_keys(state_dict: Mapping[str, Any], optimizer: Optimizer) -> Optional[List[Tuple[Any, torch.Tensor]]]:
    """``(key in state_dict["state"], parameter)`` pairs, by position in the param groups (as
    torch's loader pairs them); None if the groups' sizes differ (torch's loader raises)."""
    saved = [list(g.get("params", [])) for g in state_dict.get("param_groups", [])]
    mine = [list(g["params"]) for g in optimizer.param_groups]
    if [len(g) for g in saved] != [len(g) for g in mine]:
        return None
    return [(key, p) for keys, params in zip(saved, mine) for key, p in zip(keys, params)]


def _state_dict_post_hook(link_ref: Any, optimizer: Optimizer, state_dict: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """``optimizer.state_dict()``: slice-shaped states of sharded parameters as ``ShardedSlice``
    views, or gathered when torch's state-dict API asks for full tensors."""
    link = link_ref()
    managed = link.managed() if link is not None else {}
    pairs = _saved_keys(state_dict, optimizer) if managed else None
    if not pairs:
        return None
    request = torch_request(f"{type(optimizer).__name__}.state_dict()", optimizer)
    state = dict(state_dict["state"])  # torch's values are the optimizer's own per-parameter dicts: never edited
    members: Dict[str, Managed] = {}
    for key, p in pairs:
        where = managed.get(id(p))
        if where is None or key not in state:
            continue
        state[key] = entries = dict(state[key])
        members[str(key)] = where
        if request is None or not request.full_state_dict:
            for name, value in entries.items():
                if _is_sliced(value, p):
                    entries[name] = where.sharded(value.detach().reshape(-1))
    if request is not None and request.full_state_dict and members:
        by_name = {str(key): state[key] for key, _ in pairs if str(key) in members}
        keep = not request.cpu_offload or rank_of() == 0  # torch keeps an offloaded full state dict on rank 0 only
        _gather_states(by_name, members, [p for key, p in pairs if str(key) in members], list(by_name), keep=keep)
    if request is None and members:  # this rank's slices, pickled as plain tensors: say whose
        saved_by = {"rank": rank_of(), "world_size": _world_size(),
                    "slices": _layout([(p, state.get(key, {})) for key, p in pairs], managed)}
        return {**state_dict, "state": state,
                "param_groups": [{**group, SAVED_BY: dict(saved_by)} for group in state_dict["param_groups"]]}
    return {**state_dict, "state": state}


def _load_state_dict_pre_hook(link_ref: Any, optimizer: Optimizer, state_dict: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """``optimizer.load_state_dict(sd)``: each state of a sharded parameter as this rank's slice."""
    link = link_ref()
    managed = link.managed() if link is not None else {}
    if managed:
        agree_torch_load(at_model=False)  # see [Note: torch's loads on every rank] in model_state_dict.py
    saved_by, unstamped = _without_saved_by(state_dict)
    pairs = _saved_keys(unstamped, optimizer) if managed and "state" in unstamped else None
    if not pairs:
        return None if unstamped is state_dict else unstamped
    api = f"{type(optimizer).__name__}.load_state_dict()"
    torch_request(api, optimizer)  # refuses what cannot be loaded
    state = dict(unstamped["state"])
    assert link is not None
    _agree_saved_by(api, saved_by, [(p, state.get(key, {})) for key, p in pairs], managed, link,
                    "Nothing was loaded on any rank.")
    for key, p in pairs:
        where = managed.get(id(p))
        if where is None or key not in state:
            continue
        current = optimizer.state.get(p, {})
        state[key] = {name: _this_ranks(where, p, name, value, current.get(name))
                      for name, value in state[key].items()}
    return {**unstamped, "state": state}


def _this_ranks(where: Managed, param: torch.Tensor, name: str, value: Any, current: Any) -> Any:
    """``value`` (state ``name`` of ``param``, a sharded parameter) as this rank's slice."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() == 0:  # a step: the caller's own (torch's loader would keep it: two optimizers counting on one)
        return value.detach().clone()
    label = f"optimizer state {name!r} of {where.name!r}"
    if isinstance(value, ShardedSlice):
        piece = local_slice(where, label, value)
        if isinstance(current, torch.Tensor) and _same_elements(piece, current):
            return current  # loaded in place (DCP into the views state_dict() gave)
        return piece if piece.numel() == value.local.numel() else piece.clone()  # no view keeping a larger tensor alive
    from torch.distributed.tensor import DTensor  # deferred: importing DTensor is slow and seldom needed

    if isinstance(value, DTensor) or tuple(value.shape) == tuple(where.shape):
        return local_slice(where, label, value).clone()
    if value.shape == param.shape:
        return value  # this rank's slice (a per-rank optimizer.state_dict()), kept as torch keeps it
    if value.dim() == 1 and value.numel() == math.prod(where.shape):  # the whole parameter, flat (one rank's or NO_SHARD's)
        return local_slice(where, label, value.reshape(where.shape)).clone()
    raise ValueError(f"optimizer.load_state_dict: {label} has shape {tuple(value.shape)}; expected the parameter's "
                     f"{tuple(where.shape)} (full), a ShardedSlice of it, or this rank's slice {tuple(param.shape)}.")


# ---------------------------------------------------------------------------- whose slices
# [Note: Per-rank optimizer state dicts say whose they are]
#   optimizer.state_dict() holds this rank's slices of each fully sharded parameter's states, and
#   torch.save keeps them as plain 1-D tensors. DDP's habit, "rank 0 saves optimizer.state_dict(),
#   every rank loads it", then gave every rank rank 0's slices: where the slices have equal shapes
#   the other ranks trained on with rank 0's moments, silently (a user's trial: 1e-2 off local
#   training after the next step); where they differ, a size error inside the step. So:
#   * optimizer.state_dict() (not torch's state-dict functions, which describe slices
#     themselves) marks every param group with SAVED_BY: the saving rank and world size (for
#     messages) and a checksum of which elements of each parameter its slices are (_layout).
#     Plain integers: torch.load(weights_only=True) reads them.
#   * Loading a marked state dict (the load pre-hook) takes the mark out and refuses it if a
#     fully sharded parameter's state is a plain slice (not the whole parameter, flat or not; not
#     a ShardedSlice or DTensor) and this rank's slices are other elements than the saver's: a
#     file saved by another rank (HSDP's ranks of one shard index hold the same elements: loaded),
#     at another world size or by a model sharded otherwise. A whole parameter's state (NO_SHARD,
#     a one-rank group, a plain model's optimizer) is sliced for this rank: it loads anywhere.
#   * An optimizer's hooks are installed when it is first seen stepping our parameters, so a
#     fresh optimizer's load_state_dict (the usual resume) runs without them: torch's loader keeps
#     whatever it is given, the mark too (in the param groups). A check before each optimizer's
#     first step (then one size comparison per step) finds state given before it, links the
#     optimizer, checks the mark and converts the state as the load hook would have; refused, the
#     step raises before anything is stepped and the mark stays, so a retry refuses again.
#   * The verdict is exchanged over the parameters' group (one exchange per load of a marked
#     state dict), so every rank raises, naming the ranks given other elements: a rank that
#     loaded its own file would otherwise go on, and wait for the others forever.
#   A state dict without the mark (hand-made, or from before it) loads as before: a slice-shaped
#   value is taken as this rank's own.
SAVED_BY = "composable_shard_saved_by"

_SAVED_BY_HINT = _collectives.collective_call_hint(
    "`optimizer.load_state_dict()` of a state dict made by `optimizer.state_dict()` (or the first step after it)",
    "Call it on every rank, each with the state dict its own rank saved.")


def _world_size() -> int:
    return torch.distributed.get_world_size() if is_distributed() else 1


class _SavedBy(NamedTuple):
    rank: int
    world_size: int
    slices: int  # _layout() of the saving rank


def _layout(entries: List[Tuple[torch.Tensor, Mapping[str, Any]]], managed: Dict[int, Managed]) -> int:
    """A checksum of which elements this rank holds of each fully sharded parameter with a
    per-element state in ``entries`` (``(parameter, its states)`` in the optimizer's order): equal
    on two ranks iff their slices of those parameters are the same elements."""
    layout = []
    for position, (p, states) in enumerate(entries):
        where = managed.get(id(p))
        if where is not None and any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in states.values()):
            layout.append(f"{position}:{where.param_range[0]}:{p.numel()}")
    return zlib.crc32(",".join(layout).encode())


def _without_saved_by(state_dict: Dict[str, Any]) -> Tuple[Optional[_SavedBy], Dict[str, Any]]:
    """The mark of [Note: Per-rank optimizer state dicts say whose they are], and ``state_dict``
    without it (itself if unmarked)."""
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or not any(isinstance(g, Mapping) and SAVED_BY in g for g in groups):
        return None, state_dict
    marks = [g[SAVED_BY] for g in groups if isinstance(g, Mapping) and SAVED_BY in g]
    return _as_saved_by(marks[0]), {**state_dict, "param_groups": [
        {k: v for k, v in g.items() if k != SAVED_BY} if isinstance(g, Mapping) else g for g in groups]}


def _as_saved_by(mark: Any) -> _SavedBy:
    try:
        return _SavedBy(int(mark["rank"]), int(mark["world_size"]), int(mark["slices"]))
    except (TypeError, KeyError, ValueError):
        return _SavedBy(-1, -1, -1)  # malformed: matches no rank's slices


def _agree_saved_by(api: str, saved_by: Optional[_SavedBy], entries: List[Tuple[torch.Tensor, Mapping[str, Any]]],
                    managed: Dict[int, Managed], link: "_Link", consequence: str) -> None:
    """Raise on every rank of the linked parameters' group if some rank is given slices of other
    elements than its own (see the Note above); ``entries``: ``(parameter, its states to load)``
    for every parameter of the optimizer, in its order."""
    if saved_by is None:
        return
    first = ""
    for p, states in entries:
        where = managed.get(id(p))
        if where is None:
            continue
        whole = math.prod(where.shape)
        for name, value in states.items():
            # a plain slice (a whole parameter, flat or not, is the same whoever saved it)
            if (isinstance(value, torch.Tensor) and not isinstance(value, (ShardedSlice, DTensor)) and value.dim() > 0
                    and value.numel() != whole):
                first = first or f"{where.name!r} ({name!r}: shape {tuple(value.shape)}, this rank's slice {tuple(p.shape)})"
    verdict = int(bool(first) and saved_by.slices != _layout(entries, managed))
    collective, group = common_group(states_groups(list(link.states)))
    mine = [verdict, saved_by.rank, saved_by.world_size]
    rows = (_collectives.exchange(mine, group, tag=f"{api}: whose optimizer slices each rank loads", hint=_SAVED_BY_HINT)
            if collective else [mine])
    if not any(row[0] for row in rows):
        return
    ranks = ([r if group is None else torch.distributed.get_global_rank(group, r) for r in range(len(rows))]
             if collective else [rank_of()])
    world = _world_size()
    wrong = [f"rank {r} of {world} was given the slices saved by rank {row[1]} of {row[2]}" for r, row in zip(ranks, rows) if row[0]]
    here = f" On this rank (rank {rank_of()} of {_world_size()}): {first}." if verdict else ""
    raise RuntimeError(
        f"{api}: an optimizer.state_dict() holds only its rank's own slices of each fully sharded parameter's state "
        f"(exp_avg, momentum_buffer), and {'; '.join(wrong)}, which are other elements than its own: it would step "
        f"with them, silently where the shapes agree.{here} To save once for every rank, call get_optimizer_state_dict(model, optim) "
        "on every rank (full tensors; rank0_only=True keeps them on rank 0 only, for torch.save) and load with "
        "set_optimizer_state_dict(model, optim, osd) on every rank; or use save_checkpoint / torch.distributed.checkpoint; "
        "or have each rank save its own optimizer.state_dict() and load it on the same rank of the same world size and "
        f"sharding. {consequence}")


# optimizer -> the size of its param groups at the first step checked (see the Note above)
_FIRST_STEP_SEEN: "weakref.WeakKeyDictionary[Optimizer, Tuple[int, int]]" = weakref.WeakKeyDictionary()


def _complete_loads_before_first_step(optimizer: Optimizer) -> None:
    """Before every optimizer step, at once after the first for each optimizer (and after each
    growth of its groups): state an optimizer was given before it had hooks (``load_state_dict``
    before its first step, see the Note above) is checked and converted now, as the load hook
    would have: each fully sharded parameter's state becomes this rank's slice."""
    groups = optimizer.param_groups
    size = (len(groups), sum(len(g["params"]) for g in groups))
    if _FIRST_STEP_SEEN.get(optimizer) == size:
        return
    marked = [g for g in groups if SAVED_BY in g]
    if optimizer.state or marked:
        params = [p for g in groups for p in g["params"]]
        ids = {id(p) for p in params}
        for watch in list(_STATE_WATCHES):
            state = watch.state_ref()
            if state is not None and not watch.param_ids.isdisjoint(ids):
                _link(optimizer, state)
        link = _LINKS.get(optimizer)
        managed = link.managed() if link is not None else {}
        if link is not None and managed:
            api = f"{type(optimizer).__name__}.step()"
            _agree_saved_by(api, _as_saved_by(marked[0][SAVED_BY]) if marked else None,
                            [(p, optimizer.state.get(p, {})) for p in params], managed, link,
                            "Nothing was stepped (the state loaded before this first step stays; load another into it).")
            for p in params:
                where, entries = managed.get(id(p)), optimizer.state.get(p)
                if where is not None and entries:
                    optimizer.state[p] = {name: _this_ranks(where, p, name, value, value) for name, value in entries.items()}
    for g in marked:
        del g[SAVED_BY]
    _FIRST_STEP_SEEN[optimizer] = size


_watch.check_before_optimizer_steps(_complete_loads_before_first_step)
