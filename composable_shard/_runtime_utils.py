"""The training step of ``fully_shard``: one function per transition, hook registration, and
the end-of-backward callback.

[Note: Life of a parameter]  FULL_SHARD, one handle, one training step
  idle          data: group.flat_param (ceil(N/W) elems)        module.weight: orig param, 1-D view of my slice
  pre_forward   all-gather -> group.padded_unsharded_flat        module.weight: full-shape view (plain tensor)
  post_forward  free unsharded storage                           module.weight: orig param again
  pre_backward  all-gather again (or prefetched earlier)         module.weight: full-shape view
  post_backward unsharded_grad = leaf.grad -> reduce-scatter (async); free unsharded storage
  end_backward  wait pending reductions; divide; orig.grad = view of group.sharded_grad
  optim.step    updates my slice in place (orig params share storage with flat_param)
SHARD_GRAD_OP keeps the unsharded storage from pre_forward to post_backward; NO_SHARD (and a
shard group of one rank) computes on the shard itself and all-reduces gradients.

[Note: Hook order]  for fully_shard, checkpoint and replicate stacked on one module
  forward pre-hooks:  fully_shard (registered with prepend=True) -> checkpoint -> others
  forward post-hooks: checkpoint (prepend=True) -> others -> fully_shard (appended)
So parameters are unsharded before checkpoint starts hiding activations, and checkpoint has
stopped before fully_shard reshards, in either application order. Recomputation in backward
calls ``module.forward`` directly: fully_shard's hooks do not run again, and the pre-backward
hook (on the forward outputs) has already unsharded the parameters and reinstalled views.

[Note: Handle order]  During the first iteration the root records the order in which handles
run their pre-forward (``exec_order``) and their post-forward (``post_forward_order``).
Forward prefetch unshards the next handle in ``exec_order``; backward prefetch unshards the
handle that finished its forward just before the current one (backward runs in reverse
post-forward order, so the root, whose forward finishes last and whose backward starts first,
prefetches the last block). A later forward in another order warns once; prefetch is only a
hint, every handle still unshards itself when it runs.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

import torch
import torch.nn as nn

from . import _collectives
from ._common_utils import HandleTrainingState, TrainingState, _FSDPState
from ._flat_param import FlatGroup, FlatParamHandle
from ._torch_compat import queue_backward_callback
from ._traversal_utils import _get_fsdp_states
from .api import BackwardPrefetch, ShardingStrategy

__all__ = ["register_runtime_hooks", "lazy_init", "unshard", "wait_unshard", "reshard_handle"]

log = logging.getLogger("composable_shard")

_FREES_AFTER_FORWARD = {ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD}


_F = TypeVar("_F", bound=Callable[..., Any])


def _profiled(name: str) -> Callable[[_F], _F]:
    """Give a transition a profiler range named after it (``cs::post_backward``)."""
    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]  # same signature as fn

    return decorate


# ---------------------------------------------------------------------------- predicates
def frees_after_forward(state: _FSDPState) -> bool:
    """Does this strategy release unsharded parameters between forward and backward?"""
    return state.strategy in _FREES_AFTER_FORWARD


def frees_after_backward(state: _FSDPState) -> bool:
    """Does this module release unsharded parameters at the end of its backward?"""
    return state.reshard_after_backward


def _transition(handle: FlatParamHandle, expect: Tuple[HandleTrainingState, ...], to: HandleTrainingState,
                where: str) -> None:
    if handle.training_state not in expect:
        raise RuntimeError(
            f"handle of {handle.fqn or '<root>'!r}: expected {'/'.join(s.name for s in expect)}, "
            f"found {handle.training_state.name} in {where}"
        )
    handle.training_state = to


# ---------------------------------------------------------------------------- streams
class _Streams:
    """CUDA: all-gathers and reduce-scatters on their own streams, ordered with events (no
    ``record_stream``: buffers are allocated and freed on the compute stream). CPU: no-ops;
    gloo's async works provide the overlap."""

    def __init__(self, device: torch.device) -> None:
        self.is_cuda: bool = device.type == "cuda"
        self.all_gather: Optional[Any] = torch.cuda.Stream(device) if self.is_cuda else None
        self.reduce_scatter: Optional[Any] = torch.cuda.Stream(device) if self.is_cuda else None

    def run_on(self, stream: Optional[Any]) -> Any:
        """Context issuing on ``stream`` after everything the compute stream queued so far."""
        if stream is None:
            return _NullContext()
        stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(stream)

    def record(self, stream: Optional[Any]) -> Optional[Any]:
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    @staticmethod
    def wait(event: Optional[Any]) -> None:
        if event is not None:
            torch.cuda.current_stream().wait_event(event)


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _streams_of(state: _FSDPState) -> _Streams:
    streams = state.streams
    if streams is None:
        raise AssertionError(f"{state.describe()}: no streams (fully_shard did not finish initializing)")
    return streams


# ---------------------------------------------------------------------------- lazy init
def lazy_init(state: _FSDPState) -> None:
    """Once, at the first forward: the state whose forward runs first is the root; it caches
    every state and handle of its tree and checks that all ranks built the same handles."""
    if state.is_root is not None:
        return
    module = state.module
    assert_internal(module is not None, "state without module")
    states = _get_fsdp_states(module)  # type: ignore[arg-type]  # checked above
    names = {id(m): n for n, m in module.named_modules()}  # type: ignore[union-attr]  # checked above
    for s in states:
        s.is_root = s is state
        s.root = state
        s.fqn = names.get(id(s.module), s.fqn)  # FQNs relative to the root, for messages and tags
        if s.handle is not None:
            s.handle.fqn = s.fqn
    state.all_states = states
    state.all_handles = [s.handle for s in states if s.handle is not None]
    state.handle_states = {id(s.handle): s for s in states if s.handle is not None}
    state.streams = _Streams(state.compute_device)
    for s in states:
        s.streams = state.streams
    _check_handles_match_across_ranks(state)


def _check_handles_match_across_ranks(root: _FSDPState) -> None:
    """Ranks that built different handles would issue mismatched collectives and hang; compare
    names, shapes and dtypes now and raise with the first difference."""
    mine = [(h.fqn, [(tuple(g.flat_param._fqns), [tuple(s) for s in g.flat_param._shapes], str(g.flat_param.dtype))
                     for g in h.groups]) for h in root.all_handles]
    for group in {id(g): g for g in (root.process_group, root.replicate_group) if g is not None}.values():
        everyone = _collectives.all_gather_object(mine, group, tag="lazy_init_check")
        for other_rank, theirs in enumerate(everyone):
            if theirs != mine:
                raise RuntimeError(_describe_mismatch(root, mine, theirs, other_rank))


def _describe_mismatch(root: _FSDPState, mine: List[Any], theirs: List[Any], other_rank: int) -> str:
    head = f"fully_shard: rank {root.rank} and rank {other_rank} of the process group built different handles; "
    if len(mine) != len(theirs):
        return head + (f"{len(mine)} handles here vs {len(theirs)} there. Apply fully_shard identically "
                       "(same model, same policy) on every rank.")
    for (fqn_a, groups_a), (fqn_b, groups_b) in zip(mine, theirs):
        if fqn_a != fqn_b:
            return head + f"handle {fqn_a!r} here vs {fqn_b!r} there."
        for ga, gb in zip(groups_a, groups_b):
            for name_a, name_b, shape_a, shape_b in zip(ga[0], gb[0], ga[1], gb[1]):
                if name_a != name_b or shape_a != shape_b:
                    return head + (f"in handle {fqn_a or '<root>'!r}: parameter {name_a!r} {list(shape_a)} here vs "
                                   f"{name_b!r} {list(shape_b)} there. Build the same model on every rank.")
            if ga != gb:
                return head + f"in handle {fqn_a or '<root>'!r}: {ga} here vs {gb} there."
    return head + "parameter layouts differ."


def assert_internal(condition: bool, message: str) -> None:
    """Internal invariant check that survives ``python -O``."""
    if not condition:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        raise AssertionError(f"[rank {rank}] composable_shard internal error: {message}")


# ---------------------------------------------------------------------------- unshard / reshard
def unshard(state: _FSDPState, handle: FlatParamHandle) -> None:
    """Issue the all-gathers of ``handle`` (async) unless its buffers are filled or in flight."""
    if not handle.needs_unshard() or any(g.pending_unshard is not None for g in handle.groups):
        return
    streams = _streams_of(state)
    # Buffers are allocated on the compute stream, which also frees them (no record_stream).
    gathers = [(group, *handle.prepare_gather(group)) for group in handle.groups if not group.aliases_shard]
    with streams.run_on(streams.all_gather):
        for group, output, shard in gathers:
            group.pending_unshard = _collectives.all_gather_into(output, shard, state.process_group, tag=handle.fqn)
        event = streams.record(streams.all_gather)
    for group in handle.groups:
        if group.pending_unshard is not None:
            group.pending_unshard.event = event


def wait_unshard(state: _FSDPState, handle: FlatParamHandle) -> None:
    """Unshard ``handle`` if needed, wait for its all-gathers, and install unsharded views."""
    unshard(state, handle)
    for group in handle.groups:
        pending = group.pending_unshard
        if pending is not None:
            pending.wait()
            _Streams.wait(pending.event)
            group.pending_unshard = None
            group.comm_shard = None
    handle.use_unsharded_views()


def reshard_handle(state: _FSDPState, handle: FlatParamHandle, free: bool) -> None:
    """Original parameters back in the module; unsharded storage freed if ``free``."""
    for group in handle.groups:  # a prefetched gather must land before its buffer is freed
        if group.pending_unshard is not None:
            group.pending_unshard.wait()
            group.pending_unshard = None
    handle.reshard(free=free)


def _prefetch_forward(state: _FSDPState, handle: FlatParamHandle) -> None:
    """Unshard the handle whose forward comes after ``handle``'s (pre-forward order)."""
    root = state.root
    if root is not None and handle.exec_index is not None:
        _prefetch(root, root.exec_order, handle.exec_index + 1)


def _prefetch_backward(state: _FSDPState, handle: FlatParamHandle) -> None:
    """Unshard the handle whose backward comes after ``handle``'s: the one that finished its
    forward just before it (so the root, which finishes last, prefetches the last block)."""
    root = state.root
    if root is not None and handle.post_forward_index is not None:
        _prefetch(root, root.post_forward_order, handle.post_forward_index - 1)


def _prefetch(root: _FSDPState, order: List[FlatParamHandle], index: int) -> None:
    if 0 <= index < len(order):
        target = order[index]
        if target.training_state in (HandleTrainingState.IDLE, HandleTrainingState.BACKWARD_PRE) and target.needs_unshard():
            _collectives.trace("prefetch", target.fqn)
            unshard(root.handle_states[id(target)], target)


# ---------------------------------------------------------------------------- forward
@_profiled("cs::pre_forward")
def _pre_forward(state: _FSDPState, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """Pre: handle IDLE (or unsharded and IDLE). Post: handle FORWARD, unsharded views in
    place, next handle's all-gather issued when forward prefetch is on."""
    lazy_init(state)
    if state.is_root:
        args, kwargs = _root_pre_forward(state, args, kwargs)
    args, kwargs = _cast_inputs(state, args, kwargs)
    handle = state.handle
    if handle is None:
        return args, kwargs
    _collectives.trace("pre_forward", handle.fqn)
    _transition(handle, (HandleTrainingState.IDLE,), HandleTrainingState.FORWARD, "pre_forward")
    _record_exec_order(state, handle)
    wait_unshard(state, handle)
    if state.forward_prefetch and state.root is not None and state.root.exec_order_recorded:
        _prefetch_forward(state, handle)
    return args, kwargs


def _root_pre_forward(state: _FSDPState, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """Start of an iteration: recover from an interrupted one, reset per-iteration state,
    move inputs to the compute device."""
    for s in state.all_states:
        if s.training_state is TrainingState.SUMMON_FULL_PARAMS:
            raise RuntimeError(f"{s.describe()}: forward called inside summon_full_params/unshard_params; "
                               "exit the context first.")
    _recover_interrupted_iteration(state)
    state.exec_index = 0
    if not state.exec_order_recorded:
        state.exec_order.clear()
        state.post_forward_order.clear()
        for h in state.all_handles:
            h.exec_index = None
            h.post_forward_index = None
    for s in state.all_states:
        s.training_state = TrainingState.FORWARD_BACKWARD
    if state.compute_device.type != "cpu":
        args, kwargs = _move_to(args, state.compute_device), _move_to(kwargs, state.compute_device)
    return args, kwargs


def _cast_inputs(state: _FSDPState, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """Mixed precision: floating inputs to ``param_dtype`` at the root (``cast_root_forward_inputs``)
    and at every fully sharded module (``cast_forward_inputs``)."""
    mp = state.mixed_precision
    if mp is None or mp.param_dtype is None:
        return args, kwargs
    if not (mp.cast_forward_inputs or (state.is_root and mp.cast_root_forward_inputs)):
        return args, kwargs
    return _convert(args, lambda t: t.to(mp.param_dtype) if t.is_floating_point() else t), \
        _convert(kwargs, lambda t: t.to(mp.param_dtype) if t.is_floating_point() else t)


def _recover_interrupted_iteration(root: _FSDPState) -> None:
    """A forward that raised leaves handles in FORWARD with unsharded views; a backward that
    raised leaves its end-of-backward callback unrun. Put everything back to IDLE (pending
    reductions are still waited, so every rank's collectives stay matched)."""
    if root.final_callback_queued:
        log.debug("finishing a backward that did not complete")
        _finalize_backward(root)
    for s in root.all_states:
        h = s.handle
        if h is not None and h.training_state is HandleTrainingState.FORWARD:
            log.debug("recovering handle %s left in FORWARD by an interrupted forward", h.fqn)
            reshard_handle(s, h, free=True)
            h.training_state = HandleTrainingState.IDLE


def _record_exec_order(state: _FSDPState, handle: FlatParamHandle) -> None:
    root = state.root
    if root is None or root.final_callback_queued:
        return  # a forward during backward is activation recomputation, not a new order
    if not root.exec_order_recorded:
        if handle.exec_index is None:
            handle.exec_index = len(root.exec_order)
            root.exec_order.append(handle)
        return
    expected = root.exec_order[root.exec_index] if root.exec_index < len(root.exec_order) else None
    if expected is not handle and not root.warned_order_change:
        root.warned_order_change = True
        warnings.warn(
            f"fully_shard: forward order changed after the first iteration (expected "
            f"{expected.fqn if expected else 'no more handles'!r}, got {handle.fqn!r}); prefetching "
            "follows the first iteration's order and may fetch the wrong handle.",
            stacklevel=3,
        )
    root.exec_index += 1


@_profiled("cs::post_forward")
def _post_forward(state: _FSDPState, module: nn.Module, args: Tuple[Any, ...], output: Any) -> Any:
    """Pre: handle FORWARD. Post: handle IDLE, resharded if the strategy frees after forward
    (or if no backward will follow), pre-backward hooks on the outputs."""
    handle = state.handle
    if handle is None:
        return output
    _collectives.trace("post_forward", handle.fqn)
    _transition(handle, (HandleTrainingState.FORWARD,), HandleTrainingState.IDLE, "post_forward")
    root = state.root
    if root is not None and not root.exec_order_recorded and not root.final_callback_queued \
            and handle.post_forward_index is None:
        handle.post_forward_index = len(root.post_forward_order)
        root.post_forward_order.append(handle)
    if frees_after_forward(state) or not torch.is_grad_enabled():
        reshard_handle(state, handle, free=True)
    if torch.is_grad_enabled():
        _register_pre_backward_hooks(state, handle, output)
    return output


def _register_pre_backward_hooks(state: _FSDPState, handle: FlatParamHandle, output: Any) -> None:
    def hook(grad: torch.Tensor) -> None:
        _pre_backward(state, handle)

    for tensor in _tensors_in(output):
        if tensor.requires_grad:
            tensor.register_hook(hook)


# ---------------------------------------------------------------------------- backward
@_profiled("cs::pre_backward")
def _pre_backward(state: _FSDPState, handle: FlatParamHandle) -> None:
    """Runs once per handle per backward, before its gradient computation.
    Pre: handle IDLE. Post: handle BACKWARD_PRE with unsharded views; the previous handle in
    forward order is being gathered (BACKWARD_PRE prefetch)."""
    if not handle.needs_pre_backward:
        return
    handle.needs_pre_backward = False
    root = state.root
    if root is not None and not root.final_callback_queued:
        root.final_callback_queued = True
        queue_backward_callback(lambda: _finalize_backward(root))
    _collectives.trace("pre_backward", handle.fqn)
    _transition(handle, (HandleTrainingState.IDLE,), HandleTrainingState.BACKWARD_PRE, "pre_backward")
    wait_unshard(state, handle)
    if state.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
        _prefetch_backward(state, handle)


@_profiled("cs::post_backward")
def _post_backward(state: _FSDPState, handle: FlatParamHandle, group: FlatGroup) -> None:
    """Runs when autograd has accumulated ``group``'s unsharded gradient.
    Pre: handle BACKWARD_PRE/POST. Post: reduction issued (or gradient kept when not syncing);
    once every group is done, handle BACKWARD_POST and resharded if it frees after backward."""
    _collectives.trace("post_backward", handle.fqn)
    if handle.training_state not in (HandleTrainingState.BACKWARD_PRE, HandleTrainingState.BACKWARD_POST):
        raise RuntimeError(f"handle of {handle.fqn or '<root>'!r}: expected BACKWARD_PRE/BACKWARD_POST, found "
                           f"{handle.training_state.name} in post_backward (did backward run without forward?)")
    unsharded_grad = handle.take_unsharded_grad(group)
    group.grad_ready = True
    if unsharded_grad is not None:
        if state.sync_gradients:
            _issue_reduction(state, handle, group, unsharded_grad)
        else:
            handle.keep_unreduced(group, unsharded_grad)
    if all(g.grad_ready for g in handle.groups if g.requires_grad):
        handle.training_state = HandleTrainingState.BACKWARD_POST
        if frees_after_backward(state):
            reshard_handle(state, handle, free=True)
        if state.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            _prefetch_backward(state, handle)


class _Reduction:
    """One group's gradient on its way to the sharded ``.grad``: a small state machine
    ISSUED (reduce-scatter in flight) -> REPLICATING (all-reduce across replicas in flight)
    -> DONE."""

    def __init__(self, state: _FSDPState, handle: FlatParamHandle, group: FlatGroup, unsharded_grad: torch.Tensor) -> None:
        self.state = state
        self.handle = handle
        self.group = group
        self.unsharded_grad: Optional[torch.Tensor] = unsharded_grad  # kept alive until the collective lands
        self.pending: Optional[_collectives.Pending] = None
        self.stage: str = "ISSUED"
        self.reduce_dtype: torch.dtype = _reduce_dtype(state, group)
        self.event: Optional[Any] = None

    def issue(self) -> None:
        state, grad = self.state, self.unsharded_grad
        if grad is None:
            raise AssertionError(f"[rank {state.rank}] reduction of {self.handle.fqn!r} issued twice")
        streams = _streams_of(state)
        grad = grad.to(self.reduce_dtype) if grad.dtype != self.reduce_dtype else grad
        if self.reduce_dtype not in (torch.float32, torch.float64):
            grad.div_(state.dp_world_size)  # pre-divide low precision to avoid overflow
        self.unsharded_grad = grad
        if state.world_size > 1:  # allocated on the compute stream, which reads it at finish()
            output = torch.empty(grad.numel() // state.world_size, dtype=grad.dtype, device=grad.device)
        with streams.run_on(streams.reduce_scatter):
            if state.world_size > 1:
                self.pending = _collectives.reduce_scatter_into(output, grad, state.process_group, tag=self.handle.fqn)
            else:
                self.pending = None
                self._replicate(grad)
            self.event = streams.record(streams.reduce_scatter)

    def _replicate(self, sharded: torch.Tensor) -> None:
        if self.state.replicate_group is not None and torch.distributed.get_world_size(self.state.replicate_group) > 1:
            self.pending = _collectives.all_reduce(sharded, self.state.replicate_group, tag=self.handle.fqn)
            self.stage = "REPLICATING"
        else:
            self.pending = _collectives.Pending(None, sharded, "none")
            self.stage = "REPLICATING"

    @property
    def needs_replication(self) -> bool:
        """True if an all-reduce across replicas must follow the reduce-scatter (hybrid)."""
        group = self.state.replicate_group
        return self.stage == "ISSUED" and group is not None and torch.distributed.get_world_size(group) > 1

    def advance(self, block: bool) -> bool:
        """Move ISSUED -> REPLICATING once the reduce-scatter landed (waiting for it only if
        ``block``). Returns False if it had to leave the reduction where it was."""
        if self.stage != "ISSUED":
            return True
        assert_internal(self.pending is not None, "no pending reduce-scatter")
        if not block and not self.pending.is_completed():  # type: ignore[union-attr]
            return False
        output = self.pending.wait()  # type: ignore[union-attr]
        self.unsharded_grad = None
        streams = _streams_of(self.state)
        with streams.run_on(streams.reduce_scatter):
            self._replicate(output)
        return True

    def finish(self) -> None:
        """Wait for everything, average, and hand the shard to the handle. Post: DONE."""
        self.advance(block=True)
        assert_internal(self.pending is not None, "no pending reduction")
        output = self.pending.wait()  # type: ignore[union-attr]
        _Streams.wait(self.event)
        self.unsharded_grad = None
        if self.reduce_dtype in (torch.float32, torch.float64):
            output.div_(self.state.dp_world_size)
        self.handle.accumulate_sharded_grad(self.group, output)
        self.stage = "DONE"


def _reduce_dtype(state: _FSDPState, group: FlatGroup) -> torch.dtype:
    mp = state.mixed_precision
    if mp is not None and mp.effective_reduce_dtype is not None and group.compute_dtype.is_floating_point:
        return mp.effective_reduce_dtype
    return group.compute_dtype


def _issue_reduction(state: _FSDPState, handle: FlatParamHandle, group: FlatGroup, unsharded_grad: torch.Tensor) -> None:
    root = state.root
    assert_internal(root is not None, "post_backward before lazy init")
    # Hybrid: start the replicate all-reduces of reductions whose reduce-scatter already
    # landed, in issue order (every rank must issue them in the same order), without waiting.
    for earlier in root.pending_reductions:  # type: ignore[union-attr]
        if earlier.needs_replication and not earlier.advance(block=False):
            break
    reduction = _Reduction(state, handle, group, unsharded_grad)
    reduction.issue()
    root.pending_reductions.append(reduction)  # type: ignore[union-attr]


@_profiled("cs::finalize_backward")
def _finalize_backward(root: _FSDPState) -> None:
    """End of backward (queued by the first pre-backward): wait every reduction, reshard every
    handle, reset per-iteration state. Post: all handles IDLE, all states IDLE."""
    _collectives.trace("finalize_backward", root.fqn)
    for reduction in root.pending_reductions:
        reduction.finish()
    root.pending_reductions.clear()
    for s in root.all_states:
        h = s.handle
        if h is not None:
            if h.is_unsharded or not h.unsharded_storage_freed():
                reshard_handle(s, h, free=frees_after_backward(s))
            h.training_state = HandleTrainingState.IDLE
            h.needs_pre_backward = True
            for g in h.groups:
                g.grad_ready = False
        s.training_state = TrainingState.IDLE
    root.final_callback_queued = False
    root.exec_order_recorded = True


# ---------------------------------------------------------------------------- registration
def register_runtime_hooks(state: _FSDPState, module: nn.Module) -> None:
    """Forward pre-hook first of all pre-hooks, forward post-hook appended, and one
    post-accumulate-grad hook per requires-grad group (see [Note: Hook order])."""
    module.register_forward_pre_hook(
        lambda m, a, k: _pre_forward(state, m, a, k), prepend=True, with_kwargs=True
    )
    module.register_forward_hook(lambda m, a, o: _post_forward(state, m, a, o))
    handle = state.handle
    if handle is None:
        return
    for group in handle.groups:
        if group.requires_grad:
            group.padded_unsharded_flat.register_post_accumulate_grad_hook(_make_post_backward(state, handle, group))


def _make_post_backward(state: _FSDPState, handle: FlatParamHandle, group: FlatGroup) -> Callable[[torch.Tensor], None]:
    def hook(_: torch.Tensor) -> None:
        _post_backward(state, handle, group)

    return hook


# ---------------------------------------------------------------------------- pytree helpers
def _tensors_in(obj: Any) -> List[torch.Tensor]:
    """Tensors inside nested tuples/lists/dicts (and dataclass-like objects' __dict__ values)."""
    out: List[torch.Tensor] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return out


def _move_to(obj: Any, device: torch.device) -> Any:
    return _convert(obj, lambda t: t.to(device, non_blocking=True))


def _convert(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor in nested tuples (named too), lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_convert(x, fn) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_convert(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: _convert(v, fn) for k, v in obj.items()}
    return obj
