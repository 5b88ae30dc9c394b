"""The training step of ``fully_shard``: the hooks, which decide *when*; the handle
(``flat_param.FlatParamHandle``) does each transition; the root's end-of-backward callback.

[Note: Life of a parameter]  FULL_SHARD, one handle, one training step. Left: the hook here;
middle: the handle method it calls (``_runtime/flat_param.py``; collectives in ``_runtime/collectives.py``);
right: what ``module.weight`` is.
  idle          group.flat_param holds ceil(N/W) elements                     orig param, 1-D view of my slice
  pre_forward   enter(FORWARD); unshard(): issue_gathers (all-gather into      full-shape view (plain tensor)
                group.padded_unsharded_flat), wait_gathers, use_unsharded_views
  post_forward  enter(IDLE); reshard(free) (the root keeps its storage)       orig param again
  pre_backward  enter(BACKWARD_PRE); gather again (or prefetched: issue_gathers  the forward's view again
                earlier); the forward's views installed again ([Note: Kept views])
  split hook    release_earlier_reductions(): earlier handles' unsharded gradients dropped, shards accumulated
  post_backward take_unsharded_grad(); reduce(): a Reduction issues the reduce-scatter (async);
                enter(BACKWARD_POST); reshard(free)
  end_backward  (here) finish_reductions -> Reduction.finish -> accumulate_sharded_grad; agree on which
                parameters got a gradient; attach_grads: orig.grad = view of the sharded gradient; enter(IDLE)
  optim.step    updates my slice in place (orig params share storage with flat_param)
  zero_grad     .grad = None everywhere -> the sharded gradient is freed (the views own it)
SHARD_GRAD_OP keeps the unsharded storage from pre_forward to post_backward; NO_SHARD (and a
shard group of one rank) computes on the shard itself and all-reduces gradients. The root
keeps its parameters unsharded from its forward to its backward (its backward comes first).
Kept buffers are gathered again if an optimizer holding their parameters stepped, or a parameter
was edited in place, since (see ``_runtime/watch.py``); a forward with no backward to follow frees them.

[Note: Hook order]  for fully_shard, checkpoint and replicate stacked on one module
  forward pre-hooks:  fully_shard (registered with prepend=True) -> checkpoint -> others
  forward post-hooks: checkpoint (prepend=True) -> others -> fully_shard (appended, always_call)
So parameters are unsharded before checkpoint starts hiding activations, and checkpoint has
stopped before fully_shard reshards, in either application order. The library's checkpoint
recomputes by calling ``module.forward`` directly: fully_shard's hooks do not run again, and the
pre-backward hook (on the forward outputs) has already unsharded the parameters and reinstalled
views (made with grad mode on, see [Note: Views made in backward] in ``_runtime/flat_param.py``).

[Note: Recomputation in backward]  ``torch.utils.checkpoint`` around a module's ``__call__``
(what older ``transformers`` layers do), or around a parent whose children are fully sharded,
runs fully_shard's forward hooks again inside the backward. A forward while this root's backward
runs is such a recomputation: its pre-hook pushes the handle's state (IDLE, BACKWARD_PRE or
BACKWARD_POST), enters RECOMPUTE, unshards (gathering again only if the storage was freed) and installs views;
its post-hook pops the state and keeps the storage, because the recomputed tensors are views of
it and the handle's backward still needs them. Exec order, prefetch, the root's iteration
state and the reshard-after-forward are untouched, so post-backward still counts one gradient
arrival per group: a non-reentrant recomputation's graph is never differentiated (the original
forward's views carry the gradient), and a reentrant one's is the only graph through the
handle. A reentrant recomputation of a plain submodule inside a fully sharded module (no hook
of ours runs for it) adds an arrival of its own: see [Note: Reentrant arrivals]. The post-hook also runs when ``torch.utils.checkpoint`` stops the recomputation early
with an exception; it then does the same.
Both post-hooks run even when the forward raised (``always_call``): fully_shard then puts its
handle back to IDLE, and the root puts every handle back, so nothing of a failed forward stays.

[Note: Handle order]  During the first iteration the root records the order in which handles
run their pre-forward (``exec_order``) and their post-forward (``post_forward_order``).
Forward prefetch unshards the next handle in ``exec_order``; backward prefetch unshards the
handle that finished its forward just before the current one (backward runs in reverse
post-forward order, so the root, whose forward finishes last and whose backward starts first,
prefetches the last block). Ranks agree on each handle before gathering it in the first
iteration (see [Note: Agreement] in ``_runtime/agreement.py``); a later forward in another order
warns once; prefetch is only a hint, every handle still unshards itself when it runs.
Both orders hold each handle's first use in an iteration: a module called again in the same
forward (a block applied twice, weights shared across steps of a loop) neither records a second
position, nor counts as an order change, nor prefetches again (its successor in ``exec_order``
has already run, and gathering it again would only hold its storage until its backward).
"""

from __future__ import annotations

import functools
import logging
import sys
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

import torch
import torch.nn as nn

from . import collectives as _collectives
from . import agreement as _agreement
from . import watch as _watch
from .agreement import agree_used_and_steps
from .module_state import HandleTrainingState, RootContext, TrainingState, WeakHook, _FSDPState
from .flat_param import FlatGroup, FlatParamHandle, param_list, take_pending_init_values
from .streams import Streams
from .._base.callers import check_callers
from .._base.torch_compat import current_graph_task, is_in_backward, profiler_enabled, queue_backward_callback
from .traversal import _get_fsdp_states, owned_modules
from .._base.tree import convert, tensors_in
from ..contract import _get_registry
from ..api import BackwardPrefetch

__all__ = ["register_runtime_hooks", "lazy_init", "wait_unshard", "issue_unshard", "reduce_accumulated",
           "recover_interrupted_backward", "raise_detached", "assert_internal", "begin_weight_pass",
           "end_weight_pass", "end_weight_passes"]

log = logging.getLogger("composable_shard")


def _in_profiler_range(name: str, hook: Callable[..., Any], *args: Any) -> Any:
    """[Note: Profiler ranges]  Each transition runs in a profiler range named after it
    (``cs::post_backward``) while a profiler records; a range costs tens of microseconds even when
    none does, so each hook first asks ``profiler_enabled`` (``_base/torch_compat.py``) and, only
    when one records, calls itself again inside the range with ``in_range=True`` (its last
    parameter). The check sits in the hook itself rather than in a wrapper around it: a Python
    frame less per hook call, four per fully sharded module and step."""
    with torch.profiler.record_function(name):
        return hook(*args, True)


# ---------------------------------------------------------------------------- predicates
def frees_after_forward(state: _FSDPState) -> bool:
    """Does this module release unsharded parameters between forward and backward? FULL_SHARD
    and HYBRID_SHARD do, unless ``set_reshard_after_forward(False)``; not the root (its backward
    comes first, right after its forward), unless FSDP2's ``reshard_after_forward=True`` was asked
    for it explicitly (torch 2.13's FSDP2 keeps the root's only while the choice is its default)."""
    return state.reshard_after_forward and (not state.is_root or state.root_reshards_after_forward)


def frees_after_backward(state: _FSDPState) -> bool:
    """Does this module release unsharded parameters at the end of its backward?"""
    return state.reshard_after_backward


def assert_internal(condition: bool, message: str) -> None:
    """Internal invariant check that survives ``python -O``."""
    if not condition:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        raise AssertionError(f"[rank {rank}] composable_shard internal error: {message}")


def _root_of(state: _FSDPState) -> _FSDPState:
    root = state.root
    if root is None:  # the message is built only when it is raised (this runs several times per module and step)
        assert_internal(False, f"{state.describe()} used before lazy init")
    return root  # type: ignore[return-value]  # checked above


# ---------------------------------------------------------------------------- lazy init
def lazy_init(state: _FSDPState) -> None:
    """Once, at the first forward: the state whose forward runs first is the root; it caches
    every state and handle of its tree and checks that all ranks built the same handles."""
    if state.is_root is not None:
        return
    module = state.module
    assert_internal(module is not None, "state without module")
    check_callers(module, "first_forward")  # [Note: Caller checks] in _base/callers.py
    states = _get_fsdp_states(module)  # type: ignore[arg-type]  # checked above
    names = {id(m): n for n, m in module.named_modules()}  # type: ignore[union-attr]  # checked above
    for s in states:
        s.is_root = s is state
        s.root = state
        s.fqn = names.get(id(s.module), s.fqn)  # FQNs relative to the root, for messages and tags
        if s.members is not None:
            s.fqn = "+".join(names.get(id(m), "?") or "<root>" for m in s.members)
        if s.handle is not None:
            s.handle.fqn = s.fqn
    state._ctx = RootContext(states, [s.handle for s in states if s.handle is not None])
    for index, handle in enumerate(state._all_handles):
        handle.index = index
    for s in states:
        if s.handle is not None and s.module is not None:
            s.handle.recomputes_in_backward |= any("checkpoint" in (_get_registry(m) or {})
                                                   for _, m in owned_modules(s, s.module))
    state.streams = Streams(state.compute_device)
    for s in states:
        s.streams = state.streams
    state.ctx.debug_checks = _agreement.debug_mode()
    state.ctx.step_counter = _watch.StepCounter(
        (p for h in state._all_handles for g in h.groups for p in g.orig_params),
        dp_world_size=state.dp_world_size, ignored=(p for s in states for p in s.ignored_params))
    _agreement.check_layout_across_ranks(state)


# ---------------------------------------------------------------------------- unshard / reshard
def _state_of(handle: FlatParamHandle) -> _FSDPState:
    """The runtime state of the fully sharded module that owns ``handle``."""
    return cast(_FSDPState, handle.owner())


def _issue_gathers(state: _FSDPState, handle: FlatParamHandle) -> None:
    """The ranks agree on the gather first (first iteration, debug mode: see [Note: Agreement]
    in ``_runtime/agreement.py``), then the handle issues it."""
    root = state.root
    ctx = root._ctx if root is not None else None
    if ctx is not None and (ctx.check_order or ctx.debug_checks) and handle.will_gather():
        _agreement.agree_before_gather(root, state, handle)  # type: ignore[arg-type]  # not None: ctx is its
    handle.issue_gathers()


def issue_unshard(state: _FSDPState, handle: FlatParamHandle) -> None:
    """Issue ``handle``'s all-gathers (agreed, see :func:`_issue_gathers`) without waiting."""
    _issue_gathers(state, handle)


def wait_unshard(state: _FSDPState, handle: FlatParamHandle, forward: bool = False, fresh: bool = False) -> None:
    """Gather ``handle`` (agreed, see :func:`_issue_gathers`) and install its unsharded views
    (``forward``, ``fresh``: see ``FlatParamHandle.use_unsharded_views``)."""
    _issue_gathers(state, handle)
    handle.wait_gathers()
    handle.use_unsharded_views(forward=forward, fresh=fresh)


def _prefetch_forward(state: _FSDPState, handle: FlatParamHandle) -> None:
    """Unshard the handle whose forward comes after ``handle``'s (pre-forward order); marked
    so that the end of the forward releases it if this forward never runs it."""
    root = _root_of(state)
    if handle.exec_index is not None:
        target = _prefetch(root, root.ctx.exec_order, handle.exec_index + 1)
        if target is not None:
            target.prefetched_for_forward = True


def _release_unused_prefetches(root: _FSDPState) -> None:
    """[Note: Prefetched but not run]  Forward prefetch gathers the next handle of the first
    iteration's order. A forward that then skips it (a block behind data-dependent control flow,
    an early exit) would hold its unsharded parameters through the whole backward; the root's
    post-forward releases every handle still marked as prefetched (its gather landed first)."""
    for handle in root.ctx.handles:
        if handle.prefetched_for_forward:
            handle.prefetched_for_forward = False
            handle.reshard(free=True)


def _prefetch_backward(state: _FSDPState, handle: FlatParamHandle) -> None:
    """Unshard the handle whose backward comes after ``handle``'s: the one that finished its
    forward just before it (so the root, which finishes last, prefetches the last block)."""
    root = _root_of(state)
    if handle.post_forward_index is not None and not handle.backward_prefetch_wasted:
        target = _prefetch(root, root.ctx.post_forward_order, handle.post_forward_index - 1)
        if target is not None:
            target.prefetched_in_backward_by = handle


def _prefetch_chosen(states: List[_FSDPState], for_forward: bool) -> None:
    """[Note: Chosen prefetch]  ``set_modules_to_forward_prefetch``/``..._backward_prefetch``
    (FSDP2's explicit prefetch) replace the one-ahead prefetch of a module: its pre-forward
    (pre-backward) issues the all-gathers of each chosen module, in the order given, from the
    first iteration on. Each still unshards itself when it runs (waiting for the gather); one
    prefetched for a forward that then skips it is released at the end of the forward."""
    for chosen in states:
        target = chosen.handle
        if target is not None and target.training_state in (HandleTrainingState.IDLE, HandleTrainingState.BACKWARD_PRE) \
                and target.needs_unshard():
            _collectives.trace("prefetch", target.fqn)
            _issue_gathers(chosen, target)
            if for_forward:
                target.prefetched_for_forward = True


def _prefetch(root: _FSDPState, order: List[FlatParamHandle], index: int) -> Optional[FlatParamHandle]:
    """Issue the gathers of ``order[index]`` if it is idle and sharded; returns it if they were."""
    if 0 <= index < len(order):
        target = order[index]
        if target.training_state in (HandleTrainingState.IDLE, HandleTrainingState.BACKWARD_PRE) and target.needs_unshard():
            if _collectives._ACTIVE:
                _collectives.trace("prefetch", target.fqn)
            _issue_gathers(target.owner(), target)  # type: ignore[arg-type]  # the owner is a _FSDPState
            return target
    return None


# ---------------------------------------------------------------------------- forward
# [Note: Groups of modules]  ``fully_shard([a, b, ...])`` gives the listed modules one handle
# (FSDP2's grouping: ``[model.norm, model.output]``), its state shared by all of them. Each member's
# forward runs the handle's pre- and post-forward, with two differences: a member called inside
# another member's forward only has its inputs cast (``group_depth``), and a post-forward keeps the
# unsharded parameters while some member has not run its forward yet in this round
# (``group_pending``: filled by the first member's pre-forward, each member taken out by its
# post-forward; every root forward starts a new round), as the next one will compute on them. A
# member called several times (a loss
# applying ``output`` chunk by chunk) starts a new round each time the previous one ended; its
# gathers are no-ops while the storage is kept (``set_reshard_after_forward(False)``).
def _pre_forward(state: _FSDPState, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                 in_range: bool = False) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """Pre: handle IDLE (its storage possibly kept). Post: handle FORWARD, unsharded views in
    place, next handle's all-gather issued when forward prefetch is on."""
    if not in_range and profiler_enabled():  # see [Note: Profiler ranges]
        return _in_profiler_range("cs::pre_forward", _pre_forward, state, module, args, kwargs)
    take_pending_init_values()  # see [Note: Initialization after to_empty] in _runtime/flat_param.py
    if state.is_root is None:
        lazy_init(state)
    if _recomputing(state):
        return _pre_recompute(state, args, kwargs)
    if state.training_state is TrainingState.SUMMON_FULL_PARAMS:
        _check_forward_on_full_params(state)
        return args, kwargs
    if state.members is not None:  # see [Note: Groups of modules]
        state.group_depth += 1
        if state.group_depth > 1:
            return _cast_inputs(state, args, kwargs)
        if not state.group_pending:
            state.group_pending = {id(m) for m in state.members}
    if state.is_root:
        args, kwargs = _root_pre_forward(state, args, kwargs)
    if state.mixed_precision is not None:
        args, kwargs = _cast_inputs(state, args, kwargs)
    handle = state.handle
    if handle is None:
        return args, kwargs
    if _collectives._ACTIVE:  # a recorder is active (tests): report the hook
        _collectives.trace("pre_forward", handle.fqn)
    handle.enter(HandleTrainingState.FORWARD, "pre_forward", expect=(HandleTrainingState.IDLE,))
    handle.prefetched_for_forward = False  # this forward uses it
    first_use = _record_exec_order(state, handle)
    if handle.is_stale():  # kept from an earlier step; the shards changed since
        handle.reshard(free=True)
    wait_unshard(state, handle, forward=torch.is_grad_enabled())
    if first_use and state.forward_prefetch_states is not None:
        _prefetch_chosen(state.forward_prefetch_states, for_forward=True)
    elif first_use and state.forward_prefetch and _root_of(state).ctx.exec_order_recorded:
        _prefetch_forward(state, handle)
    return args, kwargs


def _root_pre_forward(root: _FSDPState, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """Start of an iteration: finish off an interrupted backward, refuse a changed model,
    follow what the user changed since the last step, reset per-iteration state, move inputs
    to the compute device."""
    for s in root._all_fsdp_states:
        if s.training_state is TrainingState.SUMMON_FULL_PARAMS:
            raise RuntimeError(f"{s.describe()}: forward called inside summon_full_params/unshard_params; "
                               "exit the context first.")
        if s.awaiting_init:
            _raise_awaiting_init(s)
    if root.ctx.final_callback_queued and not is_in_backward():
        recover_interrupted_backward(root)
    if root.ctx.changes_to_check:
        _watch.raise_on_model_change(root._all_fsdp_states)
        root.ctx.changes_to_check = False
    _follow_user_changes(root)
    root.ctx.forward_in_progress = True
    root.ctx.exec_index = 0
    root.ctx.forward_seen.clear()
    root.ctx.check_order = not root.ctx.exec_order_recorded
    if not root.ctx.exec_order_recorded:
        root.ctx.exec_order.clear()
        root.ctx.post_forward_order.clear()
        for h in root._all_handles:
            h.exec_index = None
            h.post_forward_index = None
    for s in root._all_fsdp_states:
        s.training_state = TrainingState.FORWARD_BACKWARD
        if s.members is not None:  # a new round for every group of modules (see [Note: Groups of modules])
            s.group_pending, s.group_depth = set(), 0
    if torch.is_grad_enabled() not in root.ctx.reads_guarded_in:  # see [Note: Sharded parameters read in forward]
        root.ctx.reads_guarded_in.add(torch.is_grad_enabled())
        _guard_sharded_reads(root, True)
    if root.compute_device.type != "cpu":
        args, kwargs = convert(args, _to_device(root)), convert(kwargs, _to_device(root))
    return args, kwargs


def _to_device(state: _FSDPState) -> Callable[[torch.Tensor], torch.Tensor]:
    device = state.compute_device
    return lambda t: t.to(device, non_blocking=True)


def _follow_user_changes(root: _FSDPState) -> None:
    """``requires_grad`` flipped on original parameters (freeze/unfreeze) is honoured from this
    forward on. A parameter whose ``.data`` was replaced since fully_shard raises (see
    [Note: Detached parameters]), and so does one carrying gradient hooks (see
    :func:`_raise_hooked`)."""
    for handle in root._all_handles:
        detached, hooked = handle.unusable_params()
        if detached:
            raise_detached(_state_of(handle), detached)
        if hooked:
            _raise_hooked(_state_of(handle), hooked)
        for group in handle.refresh_requires_grad():
            _register_post_backward(_state_of(handle), handle, group)


def _raise_awaiting_init(state: _FSDPState) -> None:
    """A model fully_shard sharded on the meta device (its own init deferred: some module had no
    ``reset_parameters()``) holds uninitialized shards until ``to_empty`` and an init."""
    raise RuntimeError(
        f"composable_shard: {state.describe()} was sharded on the meta device and is not initialized yet (FSDP2's "
        "flow): call model.to_empty(device=...) on the fully sharded root and then the model's own initialization "
        "(e.g. `with torch.no_grad(): model.init_weights()`) before its first forward. "
        "Or pass param_init_fn=... to fully_shard to initialize while sharding.")


def raise_detached(state: _FSDPState, fqns: List[str]) -> None:
    """[Note: Detached parameters]  Each original parameter is a view of its flat shard: the
    runtime gathers the shards, and the optimizer's in-place update of the parameter is an update
    of the shard. A parameter whose ``.data`` was replaced afterwards (``submodule.half()`` or
    ``.to()`` on a module inside a fully sharded one, ``param.data = ...``,
    ``torch.nn.utils.vector_to_parameters``) is cut loose: the forward would compute on the old
    shard values and the optimizer would update a tensor nothing reads. The root checks every
    handle's parameters at each forward (one storage comparison per parameter) and raises."""
    raise RuntimeError(
        f"composable_shard: {_param_list(state, fqns)} of {state.describe()} no longer "
        "share storage with their flat shard: their .data was replaced after fully_shard (a cast or move of a "
        "submodule such as .half()/.to()/.cuda(), `param.data = ...`, torch.nn.utils.vector_to_parameters). "
        "The forward would compute on the old values and the optimizer would update the new tensors, which nothing "
        "reads. Cast or move the model before fully_shard; to overwrite values, write in place under "
        "torch.no_grad() or use `with unshard_params(model, writeback=True):`.")


def _param_list(state: _FSDPState, fqns: List[str]) -> str:
    """Up to three parameter FQNs (relative to the root), for messages."""
    return param_list(state.fqn, fqns)


def _raise_hooked(state: _FSDPState, fqns: List[str]) -> None:
    """A hook registered on an original parameter (``p.register_hook(fn)`` to mask or clip its
    gradient, ``p.register_post_accumulate_grad_hook(fn)`` to step an optimizer in backward)
    never runs under fully_shard: the forward computes on views of the unsharded flat buffer,
    so autograd never reaches the original parameter. Training would go on without the hook,
    silently. The root checks every handle's parameters at each forward and raises."""
    raise RuntimeError(
        f"composable_shard: {_param_list(state, fqns)} of {state.describe()} carry "
        "gradient hooks (Tensor.register_hook or register_post_accumulate_grad_hook). Under fully_shard the forward "
        "computes on views of the gathered flat parameter, so autograd never reaches the original parameters and "
        "these hooks would never run. Remove them (handle.remove()). Instead, change gradients after backward "
        "through .grad (this rank's slice; `unshard_params(model, with_grads=True)` shows full ones), step the "
        "optimizer after backward, or manage this module with replicate, which runs parameter hooks.")


def _cast_inputs(state: _FSDPState, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """Mixed precision: floating inputs to ``param_dtype`` at every module that owns a
    fully_shard state with ``cast_root_forward_inputs`` (each call's module and each module a
    policy selected: that is how one submodule gets its own precision), and at every module
    with a handle with ``cast_forward_inputs``."""
    mp = state.mixed_precision
    if mp is None or mp.param_dtype is None:
        return args, kwargs
    if not (mp.cast_root_forward_inputs or (mp.cast_forward_inputs and state.handle is not None)):
        return args, kwargs
    dtype = mp.param_dtype

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return convert(args, cast), convert(kwargs, cast)


def _record_exec_order(state: _FSDPState, handle: FlatParamHandle) -> bool:
    """Record (first iteration) or check (later ones) ``handle``'s place in the pre-forward
    order; False when it already ran its forward in this iteration (see [Note: Handle order])."""
    ctx = _root_of(state).ctx
    if id(handle) in ctx.forward_seen:
        return False
    ctx.forward_seen.add(id(handle))
    if not ctx.exec_order_recorded:
        handle.exec_index = len(ctx.exec_order)
        ctx.exec_order.append(handle)
        return True
    expected = ctx.exec_order[ctx.exec_index] if ctx.exec_index < len(ctx.exec_order) else None
    if expected is not handle and not ctx.warned_order_change:
        ctx.warned_order_change = True
        warnings.warn(
            f"fully_shard: forward order changed after the first iteration (expected "
            f"{expected.fqn if expected else 'no more handles'!r}, got {handle.fqn!r}); prefetching "
            "follows the first iteration's order and may fetch the wrong handle. If the order differs "
            "between ranks, collectives mismatch: run with COMPOSABLE_SHARD_DEBUG=1 to check every step.",
            stacklevel=3,
        )
    ctx.exec_index += 1
    return True


def _post_forward(state: _FSDPState, module: nn.Module, args: Tuple[Any, ...], output: Any, in_range: bool = False) -> Any:
    """Pre: handle FORWARD. Post: handle IDLE, resharded unless a backward will need it next
    (SHARD_GRAD_OP, NO_SHARD, the root), pre-backward hooks on the outputs. Also runs when the
    forward raised (``always_call``): then everything of this forward is undone."""
    if not in_range and profiler_enabled():  # see [Note: Profiler ranges]
        return _in_profiler_range("cs::post_forward", _post_forward, state, module, args, output)
    if _recomputing(state):
        return _post_recompute(state, output)
    if state.training_state is TrainingState.SUMMON_FULL_PARAMS:
        return output  # a forward inside unshard_params: plain computation, see _check_forward_on_full_params
    if state.is_root and state.ctx.guarding_reads:
        _guard_sharded_reads(state, False)
    others_pending = False
    if state.members is not None:  # see [Note: Groups of modules]
        state.group_depth = max(state.group_depth - 1, 0)
        state.group_pending.discard(id(module))
        if state.group_depth > 0 and sys.exc_info()[1] is None:
            return output
        others_pending = bool(state.group_pending)
    if output is None and sys.exc_info()[1] is not None:
        if state.members is not None:
            state.group_pending, state.group_depth = set(), 0
        _abort_forward(state)
        return None
    needs_backward = torch.is_grad_enabled()
    tensors: List[torch.Tensor] = []
    if needs_backward:
        if isinstance(output, torch.Tensor):  # the usual output: no traversal
            tensors = [output] if output.requires_grad else []
        else:
            try:
                tensors = [t for t in tensors_in(output, lambda: f"{state.describe()} ({type(module).__name__})")
                           if t.requires_grad]
            except TypeError:
                _abort_forward(state)
                raise
        needs_backward = bool(tensors)
    handle = state.handle
    if handle is not None:
        if _collectives._ACTIVE:
            _collectives.trace("post_forward", handle.fqn)
        handle.enter(HandleTrainingState.IDLE, "post_forward", expect=(HandleTrainingState.FORWARD,))
        _record_post_forward_order(state, handle)
        handle.reshard(free=(frees_after_forward(state) or not needs_backward) and not others_pending)
        if needs_backward:
            hook = functools.partial(_pre_backward, state, handle)
            for tensor in tensors:
                tensor.register_hook(hook)
    if state.is_root:
        state.ctx.forward_in_progress = False
        _release_unused_prefetches(state)
        # The last agreement's values are read at the next synced backward's end; held as values from
        # here on, so its tensor is under neither the loss nor the backward (the step's peak). Its
        # all-reduce finished long ago (this forward's gathers needed every rank past it): the wait
        # returns at once (host_mirror.py).
        for verdict in state.ctx.step_verdicts.values():
            verdict.settle()
        if not needs_backward:  # nothing to differentiate: the iteration ends here
            _end_iteration(state)
    return output


def _guard_sharded_reads(root: _FSDPState, on: bool) -> None:
    """Stand-ins in every sharded slot of the tree (``on``), or the original parameters back
    (see [Note: Sharded parameters read in forward] in ``_base/sharded_reads.py``)."""
    root.ctx.guarding_reads = on
    for handle in root._all_handles:
        handle.guard_sharded_reads(on)


def _record_post_forward_order(state: _FSDPState, handle: FlatParamHandle) -> None:
    if handle.post_forward_index is not None:  # recorded (every later iteration)
        return
    root = _root_of(state)
    if not root.ctx.exec_order_recorded:
        handle.post_forward_index = len(root.ctx.post_forward_order)
        root.ctx.post_forward_order.append(handle)


def _check_forward_on_full_params(state: _FSDPState) -> None:
    """A forward inside ``unshard_params`` (e.g. ``model.generate()``) computes plainly on the
    full parameters the context exposes, with no hook doing anything, provided no gradient can
    be asked for (it would land on the full parameters and be dropped on exit) and the whole
    tree is unsharded (a handle left out would run its runtime without its root's)."""
    root = _root_of(state)
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{state.describe()}: forward with grad enabled inside unshard_params/summon_full_params: gradients "
            "would reach the temporary full parameters, not the shards. Run it under torch.no_grad() (generate() "
            "does), or call forward outside the context.")
    left_out = [s.describe() for s in root._all_fsdp_states if s.training_state is not TrainingState.SUMMON_FULL_PARAMS]
    if left_out:
        raise RuntimeError(
            f"{state.describe()}: forward inside unshard_params, but {left_out[:3]} are not unsharded by it; "
            "use unshard_params(root_module) with recurse=True (the default) around the forward.")


# ---------------------------------------------------------------------------- recomputation
def _recomputing(state: _FSDPState) -> bool:
    """Is this forward running inside a backward of this root? Then it is activation
    checkpointing recomputing it (see [Note: Recomputation in backward]), or inside a weight pass
    (handle put into backward by :func:`begin_weight_pass`, no backward callback of the root:
    [Note: Weight passes])."""
    if not is_in_backward():
        return False
    root, handle = state.root, state.handle
    in_weight_pass = handle is not None and handle.training_state in (HandleTrainingState.BACKWARD_PRE,
                                                                      HandleTrainingState.RECOMPUTE)
    return (root is not None and root.ctx.final_callback_queued) or in_weight_pass


# No profiler range of their own: torch's selective activation checkpointing counts each profiler
# range opened inside a checkpointed region, and a recomputation must open as many as the forward
# did (cs::pre_forward, cs::post_forward, which enclose these), or it fails to find them.
def _pre_recompute(state: _FSDPState, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """Pre: a backward of this root is running. Post: the handle's previous state is pushed,
    handle RECOMPUTE with unsharded views (gathered again if its storage was freed). Inputs are
    cast as in the original forward; nothing of the iteration's bookkeeping changes."""
    args, kwargs = _cast_inputs(state, args, kwargs)
    handle = state.handle
    if handle is None:
        return args, kwargs
    _collectives.trace("pre_recompute", handle.fqn)
    handle.recomputes_in_backward = True
    handle.states_before_recompute.append(handle.training_state)
    handle.enter(HandleTrainingState.RECOMPUTE, "pre_recompute")
    wait_unshard(state, handle, fresh=True)
    return args, kwargs


def _post_recompute(state: _FSDPState, output: Any) -> Any:
    """Pre: :func:`_pre_recompute` ran for this forward (which may have been stopped early by
    an exception: ``torch.utils.checkpoint`` stops recomputing once it has what it needs).
    Post: the handle's previous state is back and its unsharded storage kept, since the
    recomputed tensors are views of it and its backward follows; a handle whose backward had
    not started gets pre-backward hooks on the outputs (a reentrant checkpoint differentiates
    the recomputation itself)."""
    handle = state.handle
    if handle is None:
        return output
    _collectives.trace("post_recompute", handle.fqn)
    assert_internal(bool(handle.states_before_recompute) and handle.training_state is HandleTrainingState.RECOMPUTE,
                    f"handle of {handle.fqn!r}: post-forward of a recomputation without its pre-forward")
    handle.enter(handle.states_before_recompute.pop(), "post_recompute")
    if handle.training_state is HandleTrainingState.IDLE and output is not None and torch.is_grad_enabled():
        hook = functools.partial(_pre_backward, state, handle)
        try:
            tensors = tensors_in(output, f"{state.describe()} (recomputed)")
        except TypeError:
            tensors = []  # an output we cannot traverse: its backward unshards when its turn comes
        for tensor in tensors:
            if tensor.requires_grad:
                tensor.register_hook(hook)
    return output


def _abort_forward(state: _FSDPState) -> None:
    """The forward raised: put this handle back (and, at the root, every handle) to IDLE with
    its unsharded storage freed, waiting for gathers in flight so ranks stay matched."""
    if state.handle is not None and state.handle.training_state is HandleTrainingState.FORWARD:
        state.handle.reshard(free=True)
        state.handle.enter(HandleTrainingState.IDLE, "forward that raised")
    if not state.is_root:
        return
    log.debug("forward raised: resharding every handle of %s", state.describe())
    for s in state._all_fsdp_states:
        h = s.handle
        if h is not None and h.training_state in (HandleTrainingState.IDLE, HandleTrainingState.FORWARD):
            h.reshard(free=True)
            h.enter(HandleTrainingState.IDLE, "forward that raised")
        if h is not None:
            h.prefetched_for_forward = False
    state.ctx.forward_in_progress = False
    _end_iteration(state)


def _end_iteration(root: _FSDPState) -> None:
    for s in root._all_fsdp_states:
        s.training_state = TrainingState.IDLE


# ---------------------------------------------------------------------------- backward
def _pre_backward(state: _FSDPState, handle: FlatParamHandle, grad: Optional[torch.Tensor] = None,
                  in_range: bool = False) -> None:
    """Runs once per handle per backward, before its gradient computation (the hook on each
    forward output, ``functools.partial(_pre_backward, state, handle)``: ``grad`` is the output's).
    Pre: handle IDLE. Post: handle BACKWARD_PRE with unsharded views; the previous handle in
    forward order is being gathered (BACKWARD_PRE prefetch)."""
    if not in_range and profiler_enabled():  # see [Note: Profiler ranges]
        return _in_profiler_range("cs::pre_backward", _pre_backward, state, handle, grad)
    if not handle.needs_pre_backward:
        return
    if torch.is_grad_enabled() and not all(g.aliases_shard for g in handle.groups):
        _refuse_graph_of_the_gradient(handle)
    handle.needs_pre_backward = False
    root = _root_of(state)
    if not root.ctx.final_callback_queued:
        root.ctx.final_callback_queued = True
        queue_backward_callback(functools.partial(_finalize_backward, root))
    if _collectives._ACTIVE:
        _collectives.trace("pre_backward", handle.fqn)
    handle.enter(HandleTrainingState.BACKWARD_PRE, "pre_backward", expect=(HandleTrainingState.IDLE,))
    handle.backward_task = current_graph_task()
    if handle.recomputes_in_backward:
        handle.release_earlier_reductions()  # before the recomputation, see [Note: Reductions in flight]
    wait_unshard(state, handle, fresh=handle.recomputes_in_backward)  # see [Note: Kept views] in _runtime/flat_param.py
    if state.backward_prefetch_states is not None:
        _prefetch_chosen(state.backward_prefetch_states, for_forward=False)
    elif state.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
        _prefetch_backward(state, handle)


def _refuse_graph_of_the_gradient(handle: FlatParamHandle) -> None:
    """[Note: Backward with create_graph]  A backward that builds a graph of the gradient
    (``create_graph=True``: a gradient penalty, a Hessian-vector product) runs with grad mode on,
    and the graph it builds holds the module's unsharded parameters, which this backward then
    frees; the second backward fails in torch with "setStorage: ... out of bounds for storage of
    size 0", naming nothing (FSDP2 fails the same way). Refused here, before anything of this
    backward ran, for a handle whose groups have a real shard (NO_SHARD and one-rank groups
    compute on the shard itself, which stays, and are exact)."""
    raise RuntimeError(
        f"fully_shard({handle.fqn or '<root>'}): a backward with create_graph=True (torch.autograd.grad(..., "
        "create_graph=True) or backward(create_graph=True): a gradient penalty, a double backward) reaches this "
        "fully sharded module. The graph it builds would hold the module's unsharded parameters, which are freed "
        "after this backward, so the second backward cannot run. Apply replicate, or fully_shard with "
        "strategy=ShardingStrategy.NO_SHARD, to the modules the penalty goes through.")


def _post_backward(state: _FSDPState, handle: FlatParamHandle, group: FlatGroup, _: Optional[torch.Tensor] = None,
                   in_range: bool = False) -> None:
    """Runs when autograd has accumulated ``group``'s unsharded gradient (the unsharded buffer's
    post-accumulate-grad hook passes the buffer as ``_``).
    Pre: handle BACKWARD_PRE/POST. Post: reduction issued (or gradient kept when not syncing);
    once every trainable group is done, handle BACKWARD_POST and resharded if it frees after
    backward."""
    if not in_range and profiler_enabled():  # see [Note: Profiler ranges]
        return _in_profiler_range("cs::post_backward", _post_backward, state, handle, group, _)
    if _collectives._ACTIVE:
        _collectives.trace("post_backward", handle.fqn)
    if handle.training_state is HandleTrainingState.IDLE:
        raise RuntimeError(
            f"{state.describe()}: a gradient reached its parameters in backward, but its forward returned no tensor "
            "that requires grad, so nothing gathered them for the backward. Return the tensors the model uses "
            "from the module's forward (in a tuple, list, dict or dataclass), instead of keeping them on the module "
            "or in an object of your own.")
    if handle.training_state not in (HandleTrainingState.BACKWARD_PRE, HandleTrainingState.BACKWARD_POST):
        raise RuntimeError(f"handle of {handle.fqn or '<root>'!r}: expected BACKWARD_PRE/BACKWARD_POST, found "
                           f"{handle.training_state.name} in post_backward (did backward run without forward?)")
    if group.forward_grad_due:  # a reentrant recomputation's part: it stays in .grad (see [Note: Reentrant arrivals])
        return
    root = _root_of(state)
    unsharded_grad = handle.take_unsharded_grad(group)
    group.grad_ready = True
    if unsharded_grad is not None:
        ctx = root.ctx
        if ctx.check_order or ctx.debug_checks:  # see [Note: Agreement] in _runtime/agreement.py
            _agreement.agree_before_reduction(root, state, handle, group.index, state.sync_gradients)
        if state.sync_gradients:
            handle.reduce(group, unsharded_grad)
        else:
            handle.keep_unreduced(group, unsharded_grad, handle.reduce_dtype(group))
    if len(handle.groups) == 1 or all(g.grad_ready for g in handle.groups if g.requires_grad):
        handle.enter(HandleTrainingState.BACKWARD_POST, "post_backward")
        if frees_after_backward(state):
            handle.reshard(free=True)
        if state.backward_prefetch_states is None and state.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            _prefetch_backward(state, handle)


def _finalize_backward(root: _FSDPState, in_range: bool = False) -> None:
    """End of backward (queued by the first pre-backward): reduce what unsynced backwards kept
    for handles this backward did not reach, wait every reduction, attach gradients, reshard
    every handle, reset per-iteration state. Post: all handles IDLE, all states IDLE."""
    if not in_range and profiler_enabled():  # see [Note: Profiler ranges]
        return _in_profiler_range("cs::finalize_backward", _finalize_backward, root)
    _collectives.trace("finalize_backward", root.fqn)
    _take_deferred_arrivals(root)
    _reduce_leftover_unsynced(root)
    finish_reductions(root)
    steps_disagree = attach_reduced_grads(root)
    _note_wasted_prefetches(root)
    _reset_after_backward(root)
    root.ctx.exec_order_recorded = True
    if steps_disagree is not None:  # raised last: the model is consistent and idle
        raise RuntimeError(steps_disagree)


def _take_deferred_arrivals(root: _FSDPState) -> None:
    """[Note: Reentrant arrivals]  A handle's gradient normally arrives once per backward: every
    use of its views, in forward and in a non-reentrant recomputation, is in the one graph, so
    autograd sums them before the leaf's post-accumulate-grad hook runs. A reentrant
    recomputation (``torch.utils.checkpoint(use_reentrant=True)``, the default of Hugging Face's
    ``gradient_checkpointing_enable()``) of a module inside a fully sharded module runs a nested
    backward of its own, so its part of the gradient arrives separately, before the forward's
    part (when the fully sharded module itself is recomputed, its forward ran without grad and
    the recomputation's arrival is the only one). Reducing and resharding at that first arrival
    lost one part, and a second recomputation then ran on sharded parameters. So while a
    grad-mode forward's views may still bring their gradient (``group.forward_grad_due``, cleared
    by that split's backward pre-hook), an arrival only accumulates in the leaf's ``.grad``; the
    forward's arrival reduces the sum. A group whose forward part never came (its forward views
    fed nothing that needed a gradient) is reduced here, at the end of backward, in handle order
    (the same on every rank)."""
    for handle in root._all_handles:
        for group in handle.groups:
            if group.forward_grad_due:
                group.forward_grad_due = False
                if group.padded_unsharded_flat.grad is not None and not group.grad_ready:
                    _post_backward(_state_of(handle), handle, group)


def _reduce_leftover_unsynced(root: _FSDPState) -> None:
    """A handle that got gradients in unsynced backwards but none in this synced one still
    has them to reduce (in handle order, the same on every rank)."""
    for handle in root._all_handles:
        state = _state_of(handle)
        if not state.sync_gradients:
            continue
        for group in handle.groups:
            if group.unreduced_grad is not None and not group.grad_ready:
                handle.reduce(group, handle.take_unsharded_grad(group))  # type: ignore[arg-type]  # not None


def reduce_accumulated(root: _FSDPState) -> None:
    """Between steps: reduce what backwards with gradient sync off accumulated, as the next synced
    backward would have (one reduction per group, ``.grad`` the reduced shards afterwards, handles
    resharded as after a backward). For a schedule whose last backward is unsynced too (torch's
    pipelining, ``composable_shard.integrations.pipelining``). Pre: every state of the tree syncs."""
    if root.ctx.forward_in_progress or (root.ctx.final_callback_queued and is_in_backward()):
        raise RuntimeError(f"{root.describe()}: gradients can be reduced between steps only, not during forward or "
                           "backward.")
    if root.ctx.final_callback_queued:
        recover_interrupted_backward(root)
    try:
        _reduce_leftover_unsynced(root)
    except BaseException:  # every rank raises at the same group (a refused .grad): drop what was issued before it
        recover_interrupted_backward(root)
        raise
    finish_reductions(root)
    steps_disagree = attach_reduced_grads(root)
    _reset_after_backward(root)
    if steps_disagree is not None:
        raise RuntimeError(steps_disagree)


def begin_weight_pass(state: _FSDPState) -> None:
    """[Note: Weight passes]  A schedule that splits each backward into an input pass and a
    weight pass (torch's zero-bubble pipeline schedules) runs the weight pass as
    ``torch.autograd.grad`` calls from nodes inside the graph (where the input pass stopped)
    w.r.t. the unsharded flat buffers the forward computed on, and adds the results to those
    buffers' ``.grad`` itself. Such a pass may start below every forward output that carries a
    pre-backward hook, so no hook of ours need run in it: the handle is put into backward here
    (its views unsharded, gathered again if a later forward freed the storage; a recomputation
    of activation checkpointing inside the pass computes on them, and one that runs fully_shard's
    forward hooks, torch's ``checkpoint_wrapper``, is told apart from a forward by this state:
    ``_recomputing``), and no pre-backward hook
    runs for it until :func:`end_weight_pass`, so no end-of-backward callback reshards it
    between the pass's ``autograd.grad`` calls.
    Pre: handle IDLE, gradient sync off for ``state`` (the caller accumulates a whole step).
    Post: handle BACKWARD_PRE with unsharded views."""
    handle = state.handle
    if handle is None:
        return
    assert_internal(not state.sync_gradients, f"{state.describe()}: a weight pass with gradient sync on")
    handle.enter(HandleTrainingState.BACKWARD_PRE, "begin_weight_pass", expect=(HandleTrainingState.IDLE,))
    handle.needs_pre_backward = False
    handle.backward_task = None
    wait_unshard(state, handle, fresh=True)


def end_weight_pass(state: _FSDPState, completed: bool) -> None:
    """After a weight pass ([Note: Weight passes]): if it ``completed``, each gradient it added to
    a flat buffer's ``.grad`` is taken as post-backward takes an unsynced one (added to the group's
    kept unreduced sum, the original parameters' ``.grad`` the usual full-shape views of it), so
    the step's one reduction (the next synced backward, or :func:`reduce_accumulated`) reduces it
    with the rest; if it raised, that gradient is dropped. Then the handle leaves backward as at
    the end of any backward, also when taking the gradient raised (see :func:`end_weight_passes`).
    Pre: :func:`begin_weight_pass`. Post: handle IDLE, original parameters in the slots, storage
    freed if the module frees after backward."""
    handle = state.handle
    if handle is None:
        return
    try:
        for group in handle.groups:
            if group.padded_unsharded_flat.grad is None:
                continue
            if not completed:
                group.padded_unsharded_flat.grad = None
                continue
            unsharded_grad = handle.take_unsharded_grad(group)
            handle.keep_unreduced(group, unsharded_grad, handle.reduce_dtype(group))  # type: ignore[arg-type]  # not None: checked above
    finally:  # the handle leaves backward even after a refusal (see end_weight_passes): the next forward finds it idle
        handle.reshard(free=frees_after_backward(state))
        handle.enter(HandleTrainingState.IDLE, "end_weight_pass", expect=(HandleTrainingState.BACKWARD_PRE,))
        handle.needs_pre_backward = True


def end_weight_passes(states: List[_FSDPState], completed: bool) -> None:
    """:func:`end_weight_pass` for each of ``states`` (a pipeline stage's fully sharded modules),
    each whatever the ones before did. If one raised (a refusal), the gradients every one of them
    accumulated since the last synced backward are dropped, as the refusal says (a backward that
    raises drops them for its whole root), and the first error is raised."""
    failure: Optional[BaseException] = None
    for state in states:
        try:
            end_weight_pass(state, completed)
        except BaseException as e:  # noqa: B036  # re-raised below, after the others ended
            failure = failure or e
    if failure is not None:
        for state in states:
            if state.handle is not None:
                state.handle.discard_backward()
        raise failure


def finish_reductions(root: _FSDPState) -> None:
    """End of a synced backward: finish every reduction still in flight, in issue order."""
    for reduction in root.ctx.pending_reductions:
        reduction.finish()
    root.ctx.pending_reductions = []


def discard_reductions(root: _FSDPState) -> None:
    """Recovery from a backward that raised: wait for and drop every reduction in flight."""
    for reduction in root.ctx.pending_reductions:
        reduction.discard()
    root.ctx.pending_reductions = []


def attach_reduced_grads(root: _FSDPState) -> Optional[str]:
    """Give original parameters their ``.grad`` views after the reductions of a synced
    backward. Whether a parameter got a gradient on *some* rank is agreed on with one small
    all-reduce per process-group pair (a parameter unused everywhere keeps ``.grad = None``, as
    in local training; one used on another rank gets the averaged gradient). The same
    all-reduce agrees on the optimizer steps taken since the last one ([Note: Step agreement] in
    ``_runtime/watch.py``), read at the next synced backward: returns the error to raise if the
    ranks differed in the window the previous agreement covered, else ``None``."""
    # per batch: (state, handle, group, the group's shard group: None for one rank); each state's
    # process groups read once (each read dereferences a weak reference, see WeakGroup)
    batches: Dict[Tuple[int, int], List[Tuple[_FSDPState, FlatParamHandle, FlatGroup, Any]]] = {}
    for handle in root._all_handles:
        state = _state_of(handle)
        key: Optional[Tuple[int, int]] = None
        shard_group = None
        for group in handle.groups:
            if group.reduced:
                if group.landing_grad is not None:
                    handle.land_offloaded_grad(group)
                if key is None:
                    process_group = state.process_group
                    key = (id(process_group), id(state.replicate_group))
                    shard_group = process_group if state.world_size > 1 else None
                batches.setdefault(key, []).append((state, handle, group, shard_group))
    disagreement = take_step_verdicts(root) if batches else None
    steps = root.ctx.step_counter.take() if batches and root.ctx.step_counter is not None else []
    for key, members in batches.items():
        first = members[0][0]
        local = [u for _, _, g, _ in members for u in g.used]
        used, verdict = agree_used_and_steps(local, steps, [first.process_group, first.replicate_group],
                                             first.compute_device, api="fully_shard", consequence=_SKIPPED,
                                             tag="used_params")
        if verdict is not None:
            root.ctx.step_verdicts[key] = verdict
        offset = 0
        for state, handle, group, shard_group in members:
            count = len(group.orig_params)
            handle.attach_grads(group, used[offset:offset + count], shard_group, state.compute_device)
            offset += count
    return disagreement


def take_step_verdicts(root: _FSDPState) -> Optional[str]:
    """Read the step verdicts of the previous synced backward's agreements (host memory their
    copies filled long ago: no wait in practice) and forget them; returns the first error."""
    verdicts, root.ctx.step_verdicts = root.ctx.step_verdicts, {}
    found = [v.disagreement() for v in verdicts.values()]
    return next((d for d in found if d is not None), None)


_SKIPPED = ("Each rank updates its own slice of every parameter, so the slices of the ranks that did not step were "
            "left behind: the model is now one that no single process would have computed. torch.amp.GradScaler "
            "skips steps this way (it looks at this rank's gradient slices only); use torch's ShardedGradScaler "
            "(the sharded_grad_scaler module of its FSDP package), which decides on all ranks' gradients together.")


def _note_wasted_prefetches(root: _FSDPState) -> None:
    """[Note: Backward prefetch that gathers for nothing]  A backward that stops short of the
    handle its prefetch gathered (a loss applying the output layer chunk by chunk, each chunk's
    backward ending at a detached input, as torchtitan's does) would gather it for nothing every
    time: that source stops prefetching from then on (the handle gathers itself when it runs)."""
    for h in root._all_handles:
        if h.prefetched_in_backward_by is not None and h.training_state is HandleTrainingState.IDLE:
            h.prefetched_in_backward_by.backward_prefetch_wasted = True


def _reset_after_backward(root: _FSDPState) -> None:
    for s in root._all_fsdp_states:
        h = s.handle
        if h is not None:
            h.prefetched_in_backward_by = None
            if h.is_unsharded or not h.unsharded_storage_freed():
                h.reshard(free=frees_after_backward(s))
            h.enter(HandleTrainingState.IDLE, "end of backward")
            h.states_before_recompute.clear()
            h.needs_pre_backward = True
            h.backward_task = None
            for g in h.groups:
                g.grad_ready = False
                g.forward_grad_due = False
                g.kept_views = None
        s.training_state = TrainingState.IDLE
    root.ctx.final_callback_queued = False


def recover_interrupted_backward(root: _FSDPState) -> None:
    """A backward raised, so its end-of-backward callback never ran. Wait for (and drop)
    every reduction it issued, forget every gradient it produced, reshard everything: after
    ``zero_grad()`` the next step is exactly a clean step."""
    log.debug("recovering from a backward that raised (%s)", root.describe())
    if root.ctx.debug_checks:
        _agreement.agree_on_failed_backward(root)
    discard_reductions(root)
    for handle in root._all_handles:
        handle.discard_backward()
        handle.reshard(free=True)
    _reset_after_backward(root)


# ---------------------------------------------------------------------------- registration
def register_runtime_hooks(state: _FSDPState, module: nn.Module) -> None:
    """Forward pre-hook first of all pre-hooks, forward post-hook appended (and run even if
    forward raises), one post-accumulate-grad hook per trainable group (see [Note: Hook
    order]), and the module's parameters tracked for changes (see ``_runtime/watch.py``).

    The forward hooks are excluded from ``torch.compile`` (``torch.compiler.disable``): a
    compiled block (``block.compile()``) runs them eagerly around its compiled forward, so
    dynamo never guards on the per-step bookkeeping they change, and a block compiles once."""
    members = state.members if state.members is not None else [module]
    for member in members:
        member.register_forward_pre_hook(torch.compiler.disable(functools.partial(_pre_forward, state)), prepend=True,
                                         with_kwargs=True)
        member.register_forward_hook(torch.compiler.disable(functools.partial(_post_forward, state)), always_call=True)
    handle = state.handle
    if handle is not None:
        for group in handle.groups:
            if group.requires_grad:
                _register_post_backward(state, handle, group)
        for name, holder in _param_holders(handle):
            if all(holder is not m for m in members):
                _guard_calls_of(state, handle, name, holder)
        if not handle.is_unsharded:
            handle.guard_calls(True)
    _track_modules(state, module)


# [Note: Calls while sharded]  A module holding parameters of a handle (other than the fully sharded
# module itself) must not be called while the handle is sharded: see _check_called_unsharded. The
# check was a forward pre-hook on each such module, and any hook sends torch's Module.__call__ down
# its slow path (about 2 us a call, 15,000 instructions per module and step measured under
# callgrind on the overhead benchmark; a transformer block holds about seven such modules). It is
# now the module's forward while, and only while, the handle is sharded: a _CallGuard in the
# module's instance __dict__ (which Module.__call__ reads as self.forward) runs the check and then
# the class's forward; the handle puts it there when it reshards and takes it away when it
# unshards (use_sharded_views / use_unsharded_views: two dict operations), so a call inside the
# fully sharded module's forward or backward finds no guard and takes torch's fast path (and a direct
# module.forward(...) call while sharded, which the hook never saw, is checked too). A module
# that already has a forward of its own in its __dict__ (a wrapper's patched forward), or holds
# parameters of another handle that guards it already, gets the forward pre-hook instead; so does
# one given a forward of its own later (the next reshard finds it there, leaves it, and registers
# the hook).
_GUARDED: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


class _CallGuard:
    """A module's forward while the handle holding its parameters is sharded ([Note: Calls while
    sharded]): the check of :func:`_check_called_unsharded`, then the class's forward."""

    def __init__(self, state: _FSDPState, name: str, holder: nn.Module) -> None:
        self.state = state
        self.name = name
        self.holder = weakref.ref(holder)
        self.is_displaced = False  # the module got a forward of its own: the hook checks instead

    def displaced(self) -> None:
        """The module's forward is someone else's now: check its calls with the pre-hook."""
        holder = self.holder()
        if holder is not None and not self.is_displaced:
            _check_calls_by_hook(self.state, self.name, holder)
        self.is_displaced = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        holder = self.holder()
        if holder is None:
            raise RuntimeError(f"composable_shard: the module {self.name!r} this forward belonged to is gone")
        _check_called_unsharded(self.state, self.name, holder, args)
        return type(holder).forward(holder, *args, **kwargs)

    @property
    def __wrapped__(self) -> Any:
        """The class's forward, bound (what ``inspect.signature`` reports)."""
        holder = self.holder()
        return None if holder is None else type(holder).forward.__get__(holder)


def _guard_calls_of(state: _FSDPState, handle: FlatParamHandle, name: str, holder: nn.Module) -> None:
    """Refuse calls of ``holder`` while ``handle`` is sharded ([Note: Calls while sharded]). A
    forward of the module's own is found by the first install (``guard_calls``), which hands the
    check to the hook."""
    if holder in _GUARDED:  # it holds parameters of another handle, whose guard it has
        _check_calls_by_hook(state, name, holder)
        return
    _GUARDED[holder] = True
    handle.call_guards.append((holder, _CallGuard(state, name, holder)))


def _check_calls_by_hook(state: _FSDPState, name: str, holder: nn.Module) -> None:
    """The check as a forward pre-hook on ``holder`` (every call, on torch's slow call path)."""
    holder.register_forward_pre_hook(functools.partial(_check_called_unsharded, state, name))


def _param_holders(handle: FlatParamHandle) -> List[Tuple[str, nn.Module]]:
    """Each module that registers one of ``handle``'s parameters (tied ones included), once,
    with its name relative to the fully sharded module."""
    holders: Dict[int, Tuple[str, nn.Module]] = {}
    for group in handle.groups:
        for module, name, _, _ in group.registrations():
            holders.setdefault(id(module), (name, module))
    return list(holders.values())


def _check_called_unsharded(state: _FSDPState, name: str, module: nn.Module, args: Tuple[Any, ...]) -> None:
    """Run by every call of a module that holds parameters of ``state``'s handle, other than the
    fully sharded module itself (whose own pre-forward unshards), while the handle is sharded
    (see [Note: Calls while sharded]).

    Such a module is meant to run inside the fully sharded module's forward or backward, when
    its slots hold full-shape views of the unsharded buffer, or inside ``unshard_params``. Called
    at any other time (``model.embed(ids)`` on a model sharded from its root, a module of one
    block called from another block's forward), its parameters are 1-D views of this rank's
    slice: torch fails far from the cause with a shape error, or, where a slice happens to
    broadcast (one element of a norm's weight), computes a wrong result on that rank alone.
    Compiled code skips the check, so dynamo guards on nothing here."""
    if torch.compiler.is_compiling():
        return
    handle = state.handle
    if handle is None or handle.is_unsharded:
        return
    full_name = f"{state.fqn}.{name}" if state.fqn and name else (state.fqn or name or "<root>")
    what = f"composable_shard: {type(module).__name__} {full_name!r}"
    if handle.full_params_exposed:
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{what} was called with grad enabled inside unshard_params/summon_full_params: gradients would reach "
                "the temporary full parameters and be dropped when the context exits. Call it under torch.no_grad().")
        return
    if handle.training_state is HandleTrainingState.SUMMON_FULL_PARAMS:
        raise RuntimeError(
            f"{what} was called on rank {state.rank} inside unshard_params(rank0_only=True), which shows full "
            "parameters on rank 0 only; call it on rank 0 only, or use rank0_only=False.")
    owner = repr(state.fqn) if state.fqn else "the model"
    raise RuntimeError(
        f"{what} was called while {state.describe()}, which holds its parameters, has them sharded (each is a 1-D "
        "view of this rank's slice): the call would fail with a shape error or compute with wrong values. They are "
        f"full only during the forward and backward of {owner}: call {owner} instead; for the full parameters "
        "outside training, call it under `with unshard_params(model), torch.no_grad():`; or apply fully_shard to "
        f"{full_name!r} so it gathers its own parameters.")


def _register_post_backward(state: _FSDPState, handle: FlatParamHandle, group: FlatGroup) -> None:
    if group.post_backward_hook is None:
        group.post_backward_hook = group.padded_unsharded_flat.register_post_accumulate_grad_hook(
            WeakHook(_post_backward, state, handle, group))  # see [Note: Hooks on tensors hold weakly]


def _track_modules(state: _FSDPState, module: nn.Module) -> None:
    """See [Note: Tracked modules] in ``_runtime/watch.py``."""
    slots: Dict[int, Dict[str, Any]] = {}
    handle = state.handle
    if handle is not None:
        for group in handle.groups:
            for holder, _, name, index in group.registrations():
                slots.setdefault(id(holder), {})[name] = group.orig_params[index]
    _watch.track(state, owned_modules(state, module), slots)
