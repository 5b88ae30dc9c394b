"""Model state dicts of sharded modules: full (a plain model's) and sharded (DCP-ready).

[Note: State dict hooks]
  Every module that registers a parameter a handle owns (its *registration module*; a tied
  parameter has several) gets a state-dict post-hook and a load pre-hook that rewrite the
  entries of its own parameters, whatever module ``state_dict()``/``load_state_dict()`` was
  called on. Every fully sharded module with a handle also gets a state-dict pre-hook.

  * ``FULL_STATE_DICT`` (the default, outside any :func:`state_dict_type`): the entry becomes
    the full parameter. The owner's pre-hook opens a *session*; the first entry of a flat group
    all-gathers it (full precision, from the shards) and each parameter is copied out of the
    gathered buffer; the owner's post-hook, which runs after its whole subtree was saved, drops
    the buffer. Peak memory is therefore the output plus one handle's full size. A call on a
    module below the owner gathers for that call only. ``rank0_only``: other ranks take part
    in the all-gathers and drop the values.
  * ``SHARDED_STATE_DICT``: the entry becomes a :class:`ShardedSlice` over the rank's elements
    of the parameter, a view of the flat shard: no collective, no full parameter.
  * Loading: the entry, full tensor or ``ShardedSlice``, is replaced by this rank's 1-D slice
    of it, which torch's loader then copies into the parameter (a view of the shard). No
    collective. A value's global shape is checked first.

  * A value that is the registered parameter itself (between steps, a view of this rank's
    elements) loads as this rank's own elements, unchanged: torch's full-state-dict load fills
    each key its dict lacks with the model's own parameter (``ignore_frozen_params=True``, or
    ``strict=False`` with keys left out), as it does for FSDP2's ``DTensor`` s.

  ``FSDPModule.load_state_dict`` and :func:`set_model_state_dict` check every key and shape of
  the whole state dict before anything is written (torch's loader writes as it goes and
  reports errors at the end).

[Note: State dicts own their tensors]
  API.md: no tensor a ``get_*`` returns aliases live model or optimizer state, so a state dict
  taken, kept and loaded elsewhere never changes with training (nor training with it).
  * Inside :func:`state_dict_type` (``FULL_STATE_DICT``), every module below the context's
    module carries, for the context's duration, a state-dict pre-hook and post-hook (after the
    ones above). The post-hook replaces each of the module's own entries (parameter, buffer,
    tensor extra state) that shares storage with the live tensor (or, for a managed parameter
    at W = 1, with its flat shard) by a copy; entries that are new tensors already (gathered
    full parameters, buffers cast back to their original dtype) are kept, so no memory is
    doubled. Tied entries get one copy. ``keep_vars=True`` asks for the live variables: kept.
    With ``rank0_only``, ranks other than 0 drop every entry of the module once its hooks
    above have taken part in the gathers: ``{}``, buffers included.
  * ``SHARDED_STATE_DICT`` inside the context is the zero-copy interface for DCP: each value
    is a view (a ``ShardedSlice`` of the flat shard, buffers as they are), which ``dcp.save``
    reads and ``dcp.load`` writes in place; the checkpoint functions use it
    (:func:`sharded_model_views`). :func:`get_model_state_dict` ``(full=False)`` copies them.
  * Outside any context, ``state_dict()`` is a plain module's (which aliases its parameters
    and buffers).
  * Loading copies: torch's loader ``copy_``s every value into the parameter or buffer.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, NamedTuple, Optional, Set, Tuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .._runtime import collectives as _collectives
from .._runtime.module_state import _FSDPState
from .._runtime.flat_param import FlatGroup, take_pending_init_values
from .._base.callers import check_callers
from .._runtime.shard_math import param_offsets
from .._base.pieces import Piece, take_piece, to_global
from .._base.tree import local_piece
from .sharded_slice import ShardedSlice
from .._runtime.traversal import _get_fsdp_handles, _get_fsdp_states
from .load_transaction import agree_steps_now, model_group, rank_of, state_entries, transactional
from .._base.torch_compat import (UNKNOWN_REQUEST, TORCH_STATE_DICT_MODULE, torch_state_dict_load,
                                  torch_state_dict_request, unwrap_compiled)
from .unshard_params import check_between_steps, check_module, gather_flat
from .._setup.validation import check_bool
from ..api import FullStateDictConfig, ShardedStateDictConfig, StateDictType

__all__ = ["state_dict_type", "get_model_state_dict", "set_model_state_dict", "register_state_dict_hooks",
           "check_model_state_dict", "managed_params", "Managed", "local_slice", "register_buffer_dtypes",
           "sharded_model_views", "check_get_flags", "on_cpu", "torch_request", "agree_torch_load"]

_REGISTRY_KEY = "_composable_shard_state_dict"  # in a registration module's __dict__: {param name: Managed}
_BUFFER_DTYPES_KEY = "_composable_shard_buffer_dtypes"  # in a module's __dict__: {buffer name: dtype before buffer_dtype}
_OWNER_KEY = "_composable_shard_state_dict_owner"  # in an owner's __dict__: its _FSDPState
_HOOKED_KEY = "_composable_shard_sd_hooks"  # in a module's __dict__: True once it carries the hooks below
_STATE_DICT_HINT = _collectives.collective_call_hint(
    "Taking a full state dict (`state_dict()`, `get_model_state_dict`, Hugging Face's `save_pretrained`)",
    "To write it from one rank, call it on every rank and write on one: "
    "`model.save_pretrained(path, is_main_process=rank == 0)` on every rank, or "
    "`get_model_state_dict(model, rank0_only=True)` on every rank and `torch.save` on rank 0.")


class Managed(NamedTuple):
    """Where one registered parameter lives: ``group.orig_params[param_index]`` of ``state``'s handle."""

    state: _FSDPState
    group: FlatGroup
    param_index: int

    @property
    def piece(self) -> Optional[Piece]:
        """Its tensor-parallel piece (``None``: a plain parameter); see [Note: Tensor-parallel
        pieces] in ``_runtime/flat_param.py``."""
        return self.group.flat_param._pieces[self.param_index]

    @property
    def shape(self) -> torch.Size:
        """The parameter's global shape (a plain model's)."""
        piece = self.piece
        return piece.shape if piece is not None else self.group.flat_param._shapes[self.param_index]

    @property
    def local_shape(self) -> torch.Size:
        """The shape of what the flat parameter holds of it: the whole parameter, or its local piece."""
        return self.group.flat_param._shapes[self.param_index]

    @property
    def name(self) -> str:
        """The parameter's FQN relative to the module ``fully_shard`` was called on (for messages)."""
        return ".".join(part for part in (self.state.fqn, self.group.flat_param._fqns[self.param_index]) if part)

    @property
    def param_range(self) -> Tuple[int, int]:
        """The flattened elements of the parameter this rank holds."""
        s = self.group.flat_param._shard_slices[self.param_index]
        return (s.param_start, s.param_end) if s.numel else (0, 0)

    @property
    def local(self) -> torch.Tensor:
        """This rank's elements (a view of the flat shard)."""
        s = self.group.flat_param._shard_slices[self.param_index]
        return self.group.flat_param.data[s.shard_start:s.shard_start + s.numel]

    def sharded(self, local: torch.Tensor) -> ShardedSlice:
        """``local``, elements laid out like :attr:`local`, as a slice of the parameter's global shape."""
        piece = self.piece
        return ShardedSlice(local, self.param_range[0], self.shape, self.state.world_size,
                            None if piece is None else (piece.offsets, piece.sizes))


@dataclass
class _Session:
    """One handle's gathered groups during a full ``state_dict()`` (see [Note: State dict hooks])."""

    gathered: Dict[int, Optional[torch.Tensor]] = field(default_factory=dict)  # id(group) -> padded full flat (None: dropped)
    values: Dict[Tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (id(group), param index) -> output


@dataclass(eq=False)  # compared by identity (on the stack of calls)
class _Call:
    """One ``state_dict()`` call in progress on this thread (see [Note: One call's state])."""

    module: Callable[[], Optional[nn.Module]]  # weak reference to the module it was called on
    depth: int = 0  # modules of the call whose state_dict() our hooks saw start and not yet end
    keep_vars: bool = False  # the call's keep_vars
    sessions: Dict[int, _Session] = field(default_factory=dict)  # id(handle) -> open session
    scratch: Dict[Tuple[torch.device, torch.dtype], torch.Tensor] = field(default_factory=dict)  # see _scratch
    owned: Dict[Tuple[Any, ...], torch.Tensor] = field(default_factory=dict)  # a live tensor's (storage, layout) -> its copy
    request: Any = None  # the options of torch's state-dict function that made the call (see torch_request), or None
    steps_agreed: bool = False  # see [Note: Steps agreed before a saved model] in load_transaction.py


# [Note: One call's state]  Sessions, the rank0_only scratch buffer and the ownership copies
# belong to one state_dict() call, kept on a per-thread stack of calls: a call made inside
# another (a module's get_extra_state taking another model's state dict) pushes its own and pops
# it when its last hooked module is done, so the outer call's gathered groups and tied copies
# survive it, and two threads never share one. torch gives pre-hooks no handle on the call, so a
# call starts at an outermost module (prefix "") or at the first hooked module when none is in
# progress; each module is counted once (by its state-dict hooks, or by the ownership hooks
# where it has none). A call that raised is never popped: the next call on its module drops it.
_LOCAL = threading.local()  # .calls: this thread's calls in progress, innermost last
# module -> (type, config) of each open state_dict_type over it, innermost last. Not in the
# module's __dict__: a copy of the module (deepcopy inside a context) must not inherit it.
_CONTEXTS: "weakref.WeakKeyDictionary[nn.Module, List[Tuple[StateDictType, Any]]]" = weakref.WeakKeyDictionary()


def _calls() -> List[_Call]:
    return _LOCAL.__dict__.setdefault("calls", [])  # type: ignore[no-any-return]  # threading.local's own dict


def _enter(module: nn.Module, prefix: str, keep_vars: bool) -> _Call:
    """The call ``module``'s ``state_dict()`` belongs to, counting it in (a new one if outermost)."""
    calls = _calls()
    if not prefix or not calls:
        calls[:] = [c for c in calls if c.module() is not None and c.module() is not module]  # left by a raise
        calls.append(_Call(weakref.ref(module), request=torch_request(f"{type(module).__name__}.state_dict()", module)))
    call = calls[-1]
    call.depth += 1
    call.keep_vars = keep_vars
    return call


def _current() -> _Call:
    calls = _calls()
    return calls[-1] if calls else _Call(lambda: None)  # (hooks installed in the middle of a call)


def _leave(call: _Call) -> None:
    """A module of ``call`` is done; the call too once its outermost one is."""
    call.depth -= 1
    calls = _calls()
    if call.depth <= 0 and call in calls:
        calls.remove(call)


# ---------------------------------------------------------------------------- torch's state-dict API
def torch_request(what: str, subject: Any) -> Any:
    """The options (``StateDictOptions``) of torch's ``torch.distributed.checkpoint.state_dict``
    function this ``state_dict()``/``load_state_dict()`` call of ``subject`` (a module or an
    optimizer) runs inside, or ``None``. Raises, before anything is saved or loaded, if this
    torch hides the options, or if an integration refuses the code that called torch's function
    (point ``"state_dict"`` of [Note: Caller checks] in ``_base/callers.py``: Lightning's
    ``ModelParallelStrategy``, for one)."""
    request = torch_state_dict_request()
    if request is UNKNOWN_REQUEST:
        raise RuntimeError(
            f"{what} was called by {TORCH_STATE_DICT_MODULE}, whose options (full or sharded) this torch version does "
            "not show to composable_shard; it would save or load each rank's slices as if they were whole. Use "
            "composable_shard's get_model_state_dict/get_optimizer_state_dict/set_model_state_dict/"
            "set_optimizer_state_dict (same layout, keyed by FQN) or save_checkpoint/load_checkpoint. Nothing was "
            "saved or loaded.")
    if request is not None:
        check_callers(subject, "state_dict")
    return request


# [Note: torch's loads on every rank]
#   torch's ``set_state_dict`` and ``set_model_state_dict`` skip the model on a rank whose model
#   state dict is empty, unless ``broadcast_from_rank0=True``; ``set_state_dict`` then even takes
#   the call as optimizer-only on that rank, ``broadcast_from_rank0`` or not. An empty dict on
#   ranks other than 0 is exactly what ``get_state_dict(..., StateDictOptions(full_state_dict=True,
#   cpu_offload=True))`` returns. Our full-state-dict load is local (each rank slices its own
#   elements), so rank 0 alone loaded its slices and returned: a model half trained, half fresh,
#   and no error (FSDP2 hangs in the same call, rank 0 waiting in a collective).
#   Under replicate the replicas came apart the same way (rank 0's loaded, the others' not).
#   So each torch load of a model with a group of more than one rank agrees, once per call, on
#   which ranks load the model:
#   * at the first optimizer's load (``set_state_dict`` loads the optimizers first, on every
#     rank, and ``set_optimizer_state_dict`` too): every rank says whether its call will load
#     the model. If some will and some will not, every rank raises before anything is loaded,
#     naming the ranks and the calls that work;
#   * at the model's first load hook, if no optimizer agreed already: the ranks loading the
#     model agree that all of them do. A rank that skipped never joins, so the others wait; the
#     stuck-wait warning (``_runtime/collectives.py``) then says why, and which calls work.
#   One exchange of a flag per call; none for a model whose groups have one rank.
_TORCH_LOADS = threading.local()  # .agreed: weak reference to the options of the call that agreed last

_SKIPPED_HINT = ("This rank loads the model in torch's set_state_dict/set_model_state_dict and waits for the other "
                 "ranks of its group to load it too: torch skips the model on a rank whose model state dict is empty "
                 "(as get_state_dict with StateDictOptions(full_state_dict=True, cpu_offload=True) returns on ranks "
                 "other than 0) unless broadcast_from_rank0=True. Load a state dict held by rank 0 only with "
                 "set_model_state_dict(model, msd, options=StateDictOptions(full_state_dict=True, "
                 "broadcast_from_rank0=True)), then set_optimizer_state_dict(model, optim, osd, options=<the same>), "
                 "or give every rank the whole state dicts.")


def agree_torch_load(at_model: bool) -> None:
    """See [Note: torch's loads on every rank]: called by the model's load hooks
    (``at_model``) and the optimizers' ones; raises ``RuntimeError`` on every rank if some ranks
    of the model's group would load the model and others would not."""
    load = torch_state_dict_load()
    if load is None or load.model is None:
        return
    agreed = getattr(_TORCH_LOADS, "agreed", None)
    if agreed is not None and agreed() is load.info:
        return
    collective, group = model_group(unwrap_compiled(load.model))
    if not collective:
        return
    try:
        _TORCH_LOADS.agreed = weakref.ref(load.info)
    except TypeError:  # options that take no weak reference: agree at every hook of the call
        _TORCH_LOADS.agreed = None
    flags = [flag for (flag,) in _collectives.exchange([1 if at_model or load.loads_model else 0], group,
                                                      tag=f"{load.api}: which ranks load the model",
                                                      hint=_SKIPPED_HINT)]
    if len(set(flags)) > 1:
        skip = [r for r, flag in enumerate(flags) if not flag]
        take = [r for r, flag in enumerate(flags) if flag]
        raise RuntimeError(
            f"torch's {load.api}: ranks {skip} of the model's group skip the model, ranks {take} load it, which "
            "would leave the model loaded on some ranks only (each rank's slices of a flat shard, or the replicas, no "
            "longer one model). torch skips the model on a rank whose model state dict is "
            "empty (set_state_dict then takes the call as optimizer-only, even with broadcast_from_rank0=True), as "
            "get_state_dict with StateDictOptions(full_state_dict=True, cpu_offload=True) returns on ranks other "
            "than 0. Load a state dict held by rank 0 only with set_model_state_dict(model, msd, "
            "options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)), then "
            "set_optimizer_state_dict(model, optim, osd, options=<the same>); or give every rank the whole state "
            "dicts. " + ("No flat shard was loaded on this rank." if at_model else "Nothing was loaded on any rank."))


# ---------------------------------------------------------------------------- registration
def register_state_dict_hooks(state: _FSDPState) -> None:
    """Install the hooks of [Note: State dict hooks] for ``state``'s handle (called once by
    ``fully_shard`` per fully sharded module)."""
    handle, owner = state.handle, state.module
    if owner is None:
        return
    owner.__dict__[_OWNER_KEY] = state
    _install_hooks(owner)
    for group in (handle.groups if handle is not None else []):
        for module, _, name, index in group.registrations():
            module.__dict__.setdefault(_REGISTRY_KEY, {})[name] = Managed(state, group, index)
            _install_hooks(module)


def _install_hooks(module: nn.Module) -> None:
    if module.__dict__.get(_HOOKED_KEY):
        return
    module.__dict__[_HOOKED_KEY] = True
    module.register_state_dict_pre_hook(_pre_state_dict)
    module.register_state_dict_post_hook(_post_state_dict)
    module.register_load_state_dict_pre_hook(_pre_load_state_dict)


def register_buffer_dtypes(module: nn.Module, original: Dict[str, torch.dtype]) -> None:
    """Buffers of ``module`` cast by ``MixedPrecision(buffer_dtype=...)``: ``state_dict()``
    returns them in these original dtypes (see [Note: Buffer dtype] in ``_runtime/mixed_precision.py``)."""
    module.__dict__.setdefault(_BUFFER_DTYPES_KEY, {}).update(original)
    _install_hooks(module)


def managed_params(module: nn.Module) -> Dict[str, Managed]:
    """``module``'s own registered parameters that a handle owns, by name."""
    return module.__dict__.get(_REGISTRY_KEY, {})  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------- state_dict_type
@contextlib.contextmanager
def state_dict_type(module: nn.Module, state_dict_type: StateDictType,
                    state_dict_config: Optional[Any] = None) -> Iterator[None]:
    """Inside the context, ``state_dict()``/``load_state_dict()`` of ``module`` (and of any
    module below it) use ``state_dict_type`` for every fully sharded module below ``module``.

    Example::

        with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            dcp.save({"model": model.state_dict()}, checkpoint_id=path)

    Args:
        module: the model (or any module containing fully sharded modules).
        state_dict_type: ``FULL_STATE_DICT`` (full tensors, a plain model's state dict) or
            ``SHARDED_STATE_DICT`` (per parameter, this rank's elements as a
            :class:`ShardedSlice` that ``torch.distributed.checkpoint`` saves and loads).
        state_dict_config: a :class:`FullStateDictConfig` / :class:`ShardedStateDictConfig`
            matching the type (default: the type's defaults).
    """
    check_module("state_dict_type", module)
    if not isinstance(state_dict_type, StateDictType):
        raise TypeError(f"state_dict_type: expected a StateDictType, got {state_dict_type!r}")
    expected = FullStateDictConfig if state_dict_type is StateDictType.FULL_STATE_DICT else ShardedStateDictConfig
    config = expected() if state_dict_config is None else state_dict_config
    if type(config) is not expected:
        raise TypeError(f"state_dict_type: {state_dict_type.name} takes a {expected.__name__}, "
                        f"got {type(config).__name__}")
    states = _get_fsdp_states(module)
    saved = [(s.state_dict_type, s.state_dict_config) for s in states]
    for s in states:
        s.state_dict_type, s.state_dict_config = state_dict_type, config
    modules, hooks = _open_context(module, state_dict_type, config)
    try:
        yield
    finally:
        _close_context(modules, hooks)
        for s, (kind, cfg) in zip(states, saved):
            s.state_dict_type, s.state_dict_config = kind, cfg


def _open_context(module: nn.Module, kind: StateDictType, config: Any) -> Tuple[List[nn.Module], List[Any]]:
    """Push ``(kind, config)`` on every module below ``module`` (the innermost context
    decides); the first context over a module installs the ownership hooks of [Note: State
    dicts own their tensors]. Returns the modules and the hooks for :func:`_close_context`."""
    modules, hooks = list(module.modules()), []
    for m in modules:
        stack = _CONTEXTS.setdefault(m, [])
        if not stack:
            hooks.append(m.register_state_dict_pre_hook(_pre_owned_state_dict))
            hooks.append(m.register_state_dict_post_hook(_post_owned_state_dict))
        stack.append((kind, config))
    return modules, hooks


def _close_context(modules: List[nn.Module], hooks: List[Any]) -> None:
    for m in modules:
        stack = _CONTEXTS.get(m)
        if stack:
            stack.pop()
        if not stack:
            _CONTEXTS.pop(m, None)
    for hook in hooks:
        hook.remove()


# ---------------------------------------------------------------------------- saving
def _pre_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    take_pending_init_values()  # see [Note: Initialization after to_empty] in _runtime/flat_param.py
    call = _enter(module, prefix, keep_vars)
    state = module.__dict__.get(_OWNER_KEY)
    if state is None or state.handle is None:
        return
    check_between_steps([state], "state_dict()")
    if effective_type(state, call.request)[0] is StateDictType.FULL_STATE_DICT:
        if not call.steps_agreed:  # a full state dict gathers across ranks: agree on the steps first
            call.steps_agreed = True
            agree_steps_now(call.module() or module, "state_dict()", _STATE_DICT_HINT)
        call.sessions[id(state.handle)] = _Session()


def _post_state_dict(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
    call = _current()
    try:
        for name, dtype in module.__dict__.get(_BUFFER_DTYPES_KEY, {}).items():
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and value.dtype != dtype:
                state_dict[prefix + name] = value.detach().to(dtype)
        registry = managed_params(module)
        if registry:
            check_between_steps(list({id(m.state): m.state for m in registry.values()}.values()), "state_dict()",
                                detached=False)  # the owner's pre-hook checked
            once = _Session()  # for handles whose owner's state_dict() is not running
            for name, m in registry.items():
                if prefix + name in state_dict:
                    _save_entry(state_dict, prefix + name, m, call.sessions.get(id(m.state.handle), once), call)
    finally:
        state = module.__dict__.get(_OWNER_KEY)
        if state is not None and state.handle is not None:
            call.sessions.pop(id(state.handle), None)
        if module not in _CONTEXTS:  # else its ownership post-hook, which runs next, counts it out
            _leave(call)


def effective_type(state: _FSDPState, request: Any) -> Tuple[StateDictType, Any]:
    """The state-dict type and config ``state`` uses in a call made by torch's state-dict
    function with options ``request`` (None: not made by one): inside :func:`state_dict_type`,
    the context's; else, for torch's functions, what their options ask for (see [Note: torch's
    state-dict API] in ``_state/optim_state_dict.py``); else the default, a full state dict."""
    if state.state_dict_config is not None or request is None:  # a context's config is never None
        return state.state_dict_type, state.state_dict_config or FullStateDictConfig()
    if request.full_state_dict:  # torch keeps a full state dict on rank 0 only when it offloads
        return StateDictType.FULL_STATE_DICT, FullStateDictConfig(request.cpu_offload, request.cpu_offload)
    return StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(request.cpu_offload)


def _save_entry(state_dict: Dict[str, Any], key: str, m: Managed, session: _Session, call: _Call) -> None:
    kind, config = effective_type(m.state, call.request)
    if kind is StateDictType.SHARDED_STATE_DICT:
        local = m.local.detach()
        state_dict[key] = m.sharded(local.cpu() if config.offload_to_cpu else local)
        return
    if config.rank0_only and rank_of() != 0:
        if m.piece is not None:  # its tensor-parallel peers (rank 0 among them) need this rank's piece
            _full_value(m, session)
        elif id(m.group) not in session.gathered:  # take part in the all-gather, keep nothing
            shard, numel = m.group.flat_param.data, m.group.padded_numel
            gather_flat(m.state, shard, numel, f"state_dict:{m.state.describe()}", _STATE_DICT_HINT,
                        _scratch(call, shard, numel, m.state.compute_device))
            session.gathered[id(m.group)] = None
        del state_dict[key]
        return
    value = _full_value(m, session)
    state_dict[key] = value.cpu() if config.offload_to_cpu else value


def _full_value(m: Managed, session: _Session) -> torch.Tensor:
    """The full parameter. Its flat group is all-gathered once per session and dropped as soon
    as each of its parameters was copied out, so one group's full buffer is alive at a time;
    tied registrations get the same tensor, as a plain model's state dict does."""
    cached = session.values.get((id(m.group), m.param_index))
    if cached is not None:
        return cached
    full = session.gathered.get(id(m.group))
    if full is None:
        full = gather_flat(m.state, m.group.flat_param.data, m.group.padded_numel, f"state_dict:{m.state.describe()}",
                           _STATE_DICT_HINT)
        session.gathered[id(m.group)] = full
    fp = m.group.flat_param
    start = param_offsets(fp._numels)[m.param_index]
    value = full[start:start + fp._numels[m.param_index]].view(m.local_shape)
    if m.piece is not None:  # the pieces of the tensor-parallel mesh, joined (a collective over it)
        value = to_global(m.piece, value)
    elif full is not fp.data:  # a plain model's state dict aliases the live parameter
        value = value.clone()
    session.values[(id(m.group), m.param_index)] = value
    if all((id(m.group), i) in session.values for i in range(len(fp._numels))):
        session.gathered[id(m.group)] = None
    return value


def _scratch(call: _Call, like: torch.Tensor, numel: int, device: torch.device) -> torch.Tensor:
    """A reused buffer for all-gathers whose result is dropped (``rank0_only`` on other
    ranks): one allocation however many handles, even while gloo's worker thread still holds
    the previous all-gather's output. Freed with the call."""
    key = (device, like.dtype)
    buffer = call.scratch.get(key)
    if buffer is None or buffer.numel() < numel:
        call.scratch.pop(key, None)
        buffer = call.scratch[key] = torch.empty(numel, dtype=like.dtype, device=device)
    return buffer[:numel]


# ---------------------------------------------------------------------------- ownership
def _pre_owned_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    if not module.__dict__.get(_HOOKED_KEY):  # else _pre_state_dict, which ran first, counted it in
        _enter(module, prefix, keep_vars)


def _post_owned_state_dict(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """See [Note: State dicts own their tensors]: this module's own entries, copied where they
    alias live state, or dropped on ranks other than 0 under ``rank0_only``."""
    call = _current()
    try:
        stack = _CONTEXTS.get(module)
        if not stack or stack[-1][0] is not StateDictType.FULL_STATE_DICT:
            return
        config = stack[-1][1]
        for key, live in _own_entries(module, prefix):
            if key not in state_dict:
                continue
            if config.rank0_only and rank_of() != 0:
                del state_dict[key]
            elif not call.keep_vars:
                state_dict[key] = owned(state_dict[key], live_storages(live), call.owned)
    finally:
        _leave(call)


def _own_entries(module: nn.Module, prefix: str) -> Iterator[Tuple[str, List[torch.Tensor]]]:
    """``module``'s own state-dict keys, each with the live tensors its value may alias."""
    registry = managed_params(module)  # parameter names only
    for key, name, t in state_entries(module, prefix):
        if t is None:  # extra state
            yield key, [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        else:
            yield key, [t] if name not in registry else [t, registry[name].group.flat_param]


def owned(value: Any, live: Set[int], memo: Dict[Tuple[Any, ...], torch.Tensor]) -> Any:
    """``value``, or a copy of it if it is a tensor (a ``ShardedSlice``: its ``local``) whose
    storage's address is in ``live`` (what is new already is kept: no memory doubled). Views
    of the same elements get the same copy through ``memo`` (tied weights stay tied)."""
    if not isinstance(value, torch.Tensor):
        return value
    source = value.local if isinstance(value, ShardedSlice) else local_piece(value)
    ptr = source.untyped_storage().data_ptr()
    if not ptr or ptr not in live:
        return value
    key = (ptr, source.storage_offset(), tuple(source.shape), tuple(source.stride()), source.dtype)
    copy = memo.get(key)
    if copy is None:
        copy = memo[key] = source.detach().clone()
    if isinstance(value, DTensor):  # a tensor-parallel parameter (replicated, or left out of fully_shard)
        return DTensor.from_local(copy, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                                  stride=value.stride())
    return value.with_local(copy) if isinstance(value, ShardedSlice) else copy



# ---------------------------------------------------------------------------- loading
def local_slice(m: Managed, key: str, value: Any) -> torch.Tensor:
    """This rank's 1-D slice of ``value`` (a full tensor or a ``ShardedSlice`` of the
    parameter's global shape). Raises ``ValueError`` naming ``key`` if it does not fit."""
    start, end = m.param_range
    piece = m.piece
    if isinstance(value, ShardedSlice):
        if tuple(value.shape) != tuple(m.shape):
            raise ValueError(f"size mismatch for {key}: the checkpoint's shape is {tuple(value.shape)}, "
                             f"the model's is {tuple(m.shape)}")
        mine = None if piece is None else (piece.offsets, piece.sizes)
        if value.piece != mine:
            raise ValueError(f"{key}: the ShardedSlice holds a range of the tensor-parallel piece {value.piece} "
                             f"(offsets, sizes), this rank's parameter is {'whole' if mine is None else mine}; "
                             "load a sharded checkpoint with torch.distributed.checkpoint into this model's own "
                             "sharded state dict.")
        if end > start and not value.start <= start <= end <= value.end:
            raise ValueError(f"{key}: the ShardedSlice holds elements [{value.start}, {value.end}) but this rank "
                             f"needs [{start}, {end}); load a sharded checkpoint with torch.distributed.checkpoint "
                             "into this model's own sharded state dict.")
        return value.elements(start, end) if end > start else value.local[:0]
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{key}: expected a tensor, got {type(value).__name__}")
    from torch.distributed.tensor import DTensor  # deferred: importing DTensor is slow and seldom needed

    if isinstance(value, DTensor):  # this rank's piece as it is, if laid out as the parameter's; else the whole
        same = (piece is not None and value.device_mesh == piece.mesh and tuple(value.placements) == piece.placements
                and value.shape == piece.shape)
        value = value.to_local() if same else value.full_tensor()
        if same:
            return value.reshape(-1)[start:end]
    if tuple(value.shape) != tuple(m.shape):
        raise ValueError(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from checkpoint, "
                         f"the shape in current model is {tuple(m.shape)}.")
    return (value if piece is None else take_piece(piece, value)).reshape(-1)[start:end]


def _pre_load_state_dict(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any,
                         strict: bool, missing_keys: List[str], unexpected_keys: List[str], error_msgs: List[str]) -> None:
    take_pending_init_values()  # see [Note: Initialization after to_empty] in _runtime/flat_param.py
    registry = managed_params(module)
    check_between_steps(list({id(m.state): m.state for m in registry.values()}.values()), "load_state_dict()",
                        detached=False)
    agree_torch_load(at_model=True)  # see [Note: torch's loads on every rank]
    for name, m in registry.items():
        key = prefix + name
        if key not in state_dict:
            continue
        if state_dict[key] is getattr(module, name, None):  # the parameter itself: left as it is (see [Note: State dict hooks])
            state_dict[key] = m.local.detach().clone()
            continue
        try:
            state_dict[key] = local_slice(m, key, state_dict[key])
        except ValueError as e:
            error_msgs.append(str(e))
            del state_dict[key]


# ---------------------------------------------------------------------------- checks
class _Expected(NamedTuple):
    shape: Optional[torch.Size]  # None: not a tensor entry (extra state)
    dtype: Optional[torch.dtype]
    live: Optional[torch.Tensor] = None  # the registered tensor itself (a value that is it loads as it is)


def _expected_entries(module: nn.Module) -> Dict[str, _Expected]:
    """The keys ``module.state_dict()`` produces, with each entry's full shape and dtype."""
    entries: Dict[str, _Expected] = {}
    for path, m in module.named_modules(remove_duplicate=False):
        registry = managed_params(m)
        cast = m.__dict__.get(_BUFFER_DTYPES_KEY, {})  # state dicts hold these in their original dtype
        for key, name, t in state_entries(m, path + "." if path else ""):  # registry: parameter names; cast: buffers'
            entries[key] = _Expected(None, None) if t is None else _Expected(
                registry[name].shape if name in registry else t.shape, cast.get(name, t.dtype), t)
    return entries


def check_model_state_dict(module: nn.Module, state_dict: Mapping[str, Any], strict: bool, check_dtype: bool,
                           api: str) -> None:
    """Raise ``RuntimeError`` listing every missing/unexpected key (if ``strict``) and every
    shape (and, with ``check_dtype``, floating dtype) mismatch, before anything is loaded."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{api}: expected a dict (Mapping) of tensors, got {type(state_dict).__name__}")
    expected = _expected_entries(module)
    errors: List[str] = []
    if strict:
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        if unexpected:
            errors.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
        if missing:
            errors.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
    slices = False  # a 1-D value smaller than its parameter: one rank's slice, pickled
    for key, want in expected.items():
        value = state_dict.get(key)
        if want.shape is None or not isinstance(value, torch.Tensor) or value is want.live:
            continue
        if tuple(value.shape) != tuple(want.shape):
            errors.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from checkpoint, "
                          f"the shape in current model is {tuple(want.shape)}.")
            slices |= value.dim() == 1 and len(want.shape) != 1 and value.numel() < math.prod(want.shape)
        elif check_dtype and value.dtype != want.dtype and (value.is_floating_point() or (want.dtype is not None and want.dtype.is_floating_point)):
            errors.append(f"dtype mismatch for {key}: the checkpoint's is {value.dtype}, the model's is {want.dtype}.")
    if slices:
        errors.append("A 1-D value smaller than its parameter is one rank's slice: a sharded state dict "
                      "(get_model_state_dict(full=False), SHARDED_STATE_DICT) pickled by torch.save keeps only that "
                      "rank's elements. Save sharded state dicts with torch.distributed.checkpoint (dcp.save) or "
                      "save_checkpoint, or torch.save a full one (get_model_state_dict(model, rank0_only=True)).")
    if errors:
        raise RuntimeError(f"{api}: error(s) in loading state_dict for {type(module).__name__} (nothing was loaded):\n\t"
                           + "\n\t".join(errors))


# ---------------------------------------------------------------------------- public helpers
def get_model_state_dict(module: nn.Module, *, full: bool = True, cpu_offload: bool = False,
                         rank0_only: bool = False) -> Dict[str, Any]:
    """``module``'s state dict with original FQNs. Its tensors are its own: none aliases a
    live parameter, buffer or shard (see [Note: State dicts own their tensors]).

    Example::

        sd = get_model_state_dict(model)                       # full tensors, every rank
        sd = get_model_state_dict(model, full=False)           # sharded: for torch.distributed.checkpoint
        dcp.save({"model": sd}, checkpoint_id=path)

    Args:
        module: the model (or any module containing fully sharded modules).
        full: True: full tensors, a plain model's state dict (parameters gathered one handle at
            a time); False: :class:`ShardedSlice` per sharded parameter over a copy of this
            rank's elements, made without any collective (other entries are plain tensors).
        cpu_offload: every tensor on the CPU.
        rank0_only: (full only) ranks other than 0 take part and get ``{}``.
    """
    module = unwrap_compiled(module)  # torch.compile's wrapper: the names without its prefix
    check_module("get_model_state_dict", module)
    check_get_flags("get_model_state_dict", full, cpu_offload, rank0_only)
    if full:
        kind, config = StateDictType.FULL_STATE_DICT, FullStateDictConfig(cpu_offload, rank0_only)
    else:
        kind, config = StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(cpu_offload)  # type: ignore[assignment]
    with state_dict_type(module, kind, config):
        sd = module.state_dict()  # full: owned by the context's hooks (see [Note: State dicts own their tensors])
    if full and any(isinstance(v, DTensor) for v in sd.values()):
        # tensor-parallel pieces (replicated, or left out of fully_shard): gathered over their mesh, on every rank
        sd = _with_metadata_of(sd, ((k, v.full_tensor() if isinstance(v, DTensor) else v) for k, v in sd.items()))
    if rank0_only and rank_of() != 0:
        return {}
    if not full:  # views of the shards and buffers: copied
        flat_params = [fp for h in _get_fsdp_handles(module) for fp in h.flat_params]
        live = live_storages(module.parameters(), module.buffers(), flat_params)
        memo: Dict[Tuple[Any, ...], torch.Tensor] = {}
        sd = type(sd)((k, owned(v, live, memo)) for k, v in sd.items())
    return on_cpu(sd) if cpu_offload else sd  # type: ignore[no-any-return]


def check_get_flags(api: str, full: Any, cpu_offload: Any, rank0_only: Any) -> None:
    """The flags of :func:`get_model_state_dict` and ``get_optimizer_state_dict``."""
    for name, flag in (("full", full), ("cpu_offload", cpu_offload), ("rank0_only", rank0_only)):
        check_bool(api, name, flag)
    if rank0_only and not full:
        raise ValueError(f"{api}: rank0_only=True needs full=True (a sharded state dict is per rank).")


def on_cpu(entries: Mapping[str, Any]) -> Any:
    """``entries`` (of its own mapping type) with every tensor but a ``ShardedSlice`` (made on
    the CPU already) moved to the CPU."""
    moved = ((k, v.cpu() if isinstance(v, torch.Tensor) and not isinstance(v, ShardedSlice) else v) for k, v in entries.items())
    return type(entries)(moved)  # type: ignore[call-arg]  # a dict type


def sharded_model_views(module: nn.Module) -> Dict[str, Any]:
    """``module``'s sharded state dict as views of its shards and buffers, for ``dcp.save`` to
    read and ``dcp.load`` to write in place without a copy of the rank's state (what the
    checkpoint functions use; see [Note: State dicts own their tensors]). Not public: the
    values change with training."""
    module = unwrap_compiled(module)
    with state_dict_type(module, StateDictType.SHARDED_STATE_DICT):
        return module.state_dict()  # type: ignore[no-any-return]


def live_storages(*groups: Iterable[torch.Tensor]) -> Set[int]:
    """The storage addresses of the tensors in ``groups`` (for :func:`owned`)."""
    return {local_piece(t).untyped_storage().data_ptr() for group in groups for t in group if isinstance(t, torch.Tensor)} - {0}


@transactional("set_model_state_dict", model=True, optim=False)  # see [Note: All-or-nothing loads]
def set_model_state_dict(module: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True) -> Any:
    """Load a full or sharded state dict into ``module``; every key, shape and floating dtype
    is checked before anything is written. Returns torch's ``(missing_keys, unexpected_keys)``.

    Example::

        sd = get_model_state_dict(model, full=False)
        dcp.load({"model": sd}, checkpoint_id=path)   # into sd's own tensors
        set_model_state_dict(model, sd)               # copied into the shards

    The model never keeps a tensor of ``state_dict`` (values are copied in).
    """
    module = unwrap_compiled(module)  # torch.compile's wrapper: the names without its prefix
    check_module("set_model_state_dict", module)
    check_bool("set_model_state_dict", "strict", strict)
    check_model_state_dict(module, state_dict, strict, check_dtype=True, api="set_model_state_dict")
    return nn.Module.load_state_dict(module, _distributed_to_dtensors(module, state_dict), strict=strict)


def _with_metadata_of(state_dict: Mapping[str, Any], entries: Iterable[Tuple[str, Any]]) -> Dict[str, Any]:
    """``entries`` in a mapping of ``state_dict``'s type that keeps its ``_metadata`` (the module
    versions ``load_state_dict`` reads)."""
    out = type(state_dict)(entries) if isinstance(state_dict, dict) else dict(entries)
    if hasattr(state_dict, "_metadata"):
        out._metadata = state_dict._metadata  # type: ignore[attr-defined]
    return out  # type: ignore[return-value]


def _distributed_to_dtensors(module: nn.Module, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state_dict`` with each full plain tensor meant for a ``DTensor`` of ``module`` (a
    tensor-parallel parameter or buffer, replicated or left out of fully_shard) placed
    as that ``DTensor`` is (this rank's piece), as a full state dict of a plain model is loaded
    into a tensor-parallel one. Collective over each such tensor's mesh, in the module's order."""
    targets = [(n, t) for n, t in itertools.chain(module.named_parameters(remove_duplicate=False),
                                                  module.named_buffers(remove_duplicate=False))
               if isinstance(t, DTensor)]
    if not targets:
        return state_dict
    placed = _with_metadata_of(state_dict, state_dict.items())
    for name, target in targets:
        value = placed.get(name)
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            placed[name] = distribute_tensor(value.detach().to(device=target.device, dtype=target.dtype),
                                             target.device_mesh, target.placements)
    return placed
