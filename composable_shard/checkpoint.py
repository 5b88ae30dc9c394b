"""``checkpoint``: non-reentrant activation checkpointing installed as module hooks.

``checkpoint(module)`` keeps ``module`` in place (same object, class and FQNs). Its forward
pre-hook records the inputs and the RNG state and pushes a
``torch.autograd.graph.saved_tensors_hooks`` context whose pack hook stores an integer
placeholder instead of each tensor autograd wants to save; the forward post-hook pops it.
In backward, the first unpack of a placeholder re-runs ``module.forward`` (a compiled module: its
compiled call, see [Note: Compiled modules]) on the recorded
inputs (same RNG state, autocast state and grad mode), capturing the tensors it saves in the
same order; each placeholder then returns its recomputed tensor, which is released once
autograd has taken it. Only public autograd APIs are used.

[Note: Frames]
Each forward call of a checkpointed module gets its own ``_Frame`` (inputs, RNG state,
saved-tensor metadata, recomputed tensors), so a module called twice in one forward, or
nested checkpointed modules, recompute independently. ``_CheckpointState.frames`` is the
stack of calls in progress (pre-hook pushes, post-hook pops); after the post-hook a frame is
owned only by the autograd graph (its unpack hook), so it is freed with the graph. The
recomputation runs the whole forward (no early stop) so that hooks of submodules, e.g. a
``fully_shard`` child that unshards in its pre-hook and reshards in its post-hook, always
run in pairs.

[Note: Hook order]
``fully_shard`` registers its forward pre-hook with ``prepend=True`` and its forward
post-hook appended. ``checkpoint`` does the opposite: pre-hook appended, post-hook
``prepend=True``. Whichever API is applied first, a forward of a module with both runs::

    fully_shard pre (unshard, cast inputs) -> checkpoint pre (record inputs, push pack hook)
      -> module.forward -> checkpoint post (pop pack hook) -> fully_shard post (reshard)

so FSDP's logic stays outside the checkpointed region: tensors it saves are not replaced by
placeholders, the recorded inputs are the ones ``forward`` actually received, and
recomputation calls ``module.forward`` directly, so the module's own hooks (FSDP's included)
do not run again; FSDP's pre-backward logic has unsharded the parameters before autograd
unpacks the first placeholder. Hooks of submodules do run during recomputation. Any other
hook that must stay outside ``checkpoint`` follows the same rule (pre prepended, post
appended).

[Note: Compiled modules]
After ``module.compile()``, the original forward ran the compiled graph, whose saved tensors
are not eager ``forward``'s (fewer or more, other shapes). The recomputation must run the same
graph, so it calls ``module(...)`` (the compiled call) with this module's checkpoint hooks
paused; the module's other hooks run again, as with torch's composable ``checkpoint``.
``fully_shard``'s treat that forward as a recomputation (see [Note: Recomputation in backward]
in ``_runtime/hooks.py``) and cast inputs idempotently; a user pre-hook that changes the inputs
would change them twice. The hooks are excluded from compilation (``torch.compiler.disable``).

Known limits (as in ``torch.utils.checkpoint``): modules that update buffers in forward
(BatchNorm running stats) update them again when recomputed, and inputs modified in place
after the forward are recomputed with their new values.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Set, Tuple

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from composable_shard._base.torch_compat import is_compiled_module
from composable_shard._base.tree import convert
from composable_shard.contract import _State, contract

__all__ = ["checkpoint"]

_ContextFn = Callable[[], Tuple[ContextManager[Any], ContextManager[Any]]]
_AUTOCAST_DEVICE_TYPES: Tuple[str, ...] = ("cpu", "cuda")


def _default_context_fn() -> Tuple[ContextManager[Any], ContextManager[Any]]:
    return contextlib.nullcontext(), contextlib.nullcontext()


class _CheckpointState(_State):
    """Per-module state of :func:`checkpoint`."""

    def __init__(self) -> None:
        # False: the hooks do nothing and the module saves its activations as usual.
        self.enable_hook: bool = True
        # True while a frame of this module recomputes: the hooks then let the call through.
        self.recomputing: bool = False
        # Restore the forward's CPU (and CUDA) RNG state for the recomputation.
        self.preserve_rng_state: bool = True
        # Called once per forward: (context around the forward, context around recomputation).
        self.context_fn: _ContextFn = _default_context_fn
        # Forward calls in progress, innermost last; None for a call that is not checkpointed.
        self.frames: List[Optional[_Frame]] = []
        # The forward pre-hook and post-hook, see [Note: Hook order].
        self.hook_handles: List[RemovableHandle] = []


def _detach_input(tensor: torch.Tensor) -> torch.Tensor:
    # A fresh leaf with the same requires_grad: ops decide what to save from requires_grad,
    # and the throwaway recomputation graph must not reach into the outer graph.
    return tensor.detach().requires_grad_(tensor.requires_grad)


class _Frame:
    """One checkpointed forward call of a module, see [Note: Frames]."""

    def __init__(
        self, state: _CheckpointState, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
        recompute_context: ContextManager[Any]
    ) -> None:
        self.state: _CheckpointState = state  # the module's checkpoint state (paused while recomputing)
        self.module: nn.Module = module  # whose forward is recomputed
        self.args: Tuple[Any, ...] = args  # positional inputs forward received
        self.kwargs: Dict[str, Any] = kwargs  # keyword inputs forward received
        self.recompute_context: ContextManager[Any] = recompute_context  # second item of context_fn()
        self.cpu_rng_state: Optional[torch.Tensor] = None  # None: RNG state not preserved
        self.cuda_rng_states: Dict[int, torch.Tensor] = {}  # device index -> state, inputs' devices
        # device type -> (autocast enabled, autocast dtype) during the forward
        self.autocast_states: Dict[str, Tuple[bool, torch.dtype]] = {
            device_type: (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
            for device_type in _AUTOCAST_DEVICE_TYPES
        }
        self.saved_metas: List[Tuple[torch.Size, torch.dtype, torch.device]] = []  # per placeholder
        self.recomputed: Dict[int, torch.Tensor] = {}  # placeholder -> tensor, popped on unpack
        self.forward_contexts: contextlib.ExitStack = contextlib.ExitStack()  # pack hook + forward ctx

    def record_rng_state(self) -> None:
        self.cpu_rng_state = torch.get_rng_state()
        devices: Set[torch.device] = set()

        def note_device(t: torch.Tensor) -> torch.Tensor:
            devices.add(t.device)
            return t

        convert((self.args, self.kwargs), note_device)
        for device in devices:  # a CUDA input implies CUDA is initialized
            if device.type == "cuda":
                index = torch.cuda.current_device() if device.index is None else device.index
                self.cuda_rng_states[index] = torch.cuda.get_rng_state(index)

    def enter_forward(self, forward_context: ContextManager[Any]) -> None:
        with contextlib.ExitStack() as stack:  # unwinds if entering forward_context raises
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack))
            stack.enter_context(forward_context)
            self.forward_contexts = stack.pop_all()

    def exit_forward(self) -> None:
        self.forward_contexts.close()

    def pack(self, tensor: torch.Tensor) -> int:
        self.saved_metas.append((tensor.shape, tensor.dtype, tensor.device))
        return len(self.saved_metas) - 1

    def unpack(self, placeholder: int) -> torch.Tensor:
        if placeholder not in self.recomputed:  # first unpack (or a retained graph used again)
            self.recomputed = self.recompute()
        return self.recomputed.pop(placeholder)

    def recompute(self) -> Dict[int, torch.Tensor]:
        """Re-run ``module.forward`` and return ``{placeholder: recomputed tensor}``."""
        captured: List[torch.Tensor] = []

        def pack(tensor: torch.Tensor) -> int:
            captured.append(tensor.detach())
            return len(captured) - 1

        def unpack(index: int) -> torch.Tensor:  # only if forward itself runs autograd
            return captured[index]

        args, kwargs = convert((self.args, self.kwargs), _detach_input)
        with contextlib.ExitStack() as stack:
            if self.cpu_rng_state is not None:
                devices = list(self.cuda_rng_states)
                stack.enter_context(torch.random.fork_rng(devices=devices, device_type="cuda"))
                torch.set_rng_state(self.cpu_rng_state)
                for index, state in self.cuda_rng_states.items():
                    torch.cuda.set_rng_state(state, index)
            for device_type, (enabled, dtype) in self.autocast_states.items():
                if enabled:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype))
                elif torch.is_autocast_enabled(device_type):
                    stack.enter_context(torch.autocast(device_type, enabled=False))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
            stack.enter_context(self.recompute_context)
            if is_compiled_module(self.module):  # see [Note: Compiled modules]
                stack.enter_context(_paused(self.state))
                self.module(*args, **kwargs)
            else:
                self.module.forward(*args, **kwargs)  # not module(...): see [Note: Hook order]
        self.check_recomputed(captured)
        recomputed = dict(enumerate(captured))
        # [Note: Recomputation graph]  The recomputation's own graph holds ``unpack`` and so this
        # list; a tensor of it that outlives the backward (a key/value cache entry the forward
        # stored outside) would keep every recomputed activation alive. Emptying the list leaves
        # them to ``self.recomputed``, which gives each away once.
        captured.clear()
        return recomputed

    def check_recomputed(self, captured: List[torch.Tensor]) -> None:
        name = type(self.module).__name__
        if len(captured) != len(self.saved_metas):
            raise RuntimeError(
                f"checkpoint({name}): recomputing forward in backward saved {len(captured)} tensors "
                f"for backward, but the original forward saved {len(self.saved_metas)}. The forward "
                "must be deterministic in what it computes (same control flow, same grad mode, "
                "no state changed since the forward); remove checkpoint from this module otherwise."
            )
        for index, (tensor, (shape, dtype, device)) in enumerate(zip(captured, self.saved_metas)):
            if (tensor.shape, tensor.dtype, tensor.device) != (shape, dtype, device):
                raise RuntimeError(
                    f"checkpoint({name}): saved tensor #{index} was {tuple(shape)} {dtype} on {device} "
                    f"in forward but {tuple(tensor.shape)} {tensor.dtype} on {tensor.device} when "
                    "recomputed in backward. The forward must be deterministic in what it computes."
                )


@contextlib.contextmanager
def _paused(state: _CheckpointState) -> Iterator[None]:
    """The module's own checkpoint hooks let its recomputation through."""
    previous, state.recomputing = state.recomputing, True
    try:
        yield
    finally:
        state.recomputing = previous


def _pre_forward(state: _CheckpointState, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """Pre: ``module`` is about to run ``forward``. Post: a frame (or None) is pushed; if a
    frame, tensors saved by ``forward`` become placeholders of it."""
    if not state.enable_hook or state.recomputing or not torch.is_grad_enabled():
        state.frames.append(None)  # nothing will be saved for backward, or this is the recomputation: just run
        return
    forward_context, recompute_context = state.context_fn()
    frame = _Frame(state, module, args, kwargs, recompute_context)
    frame.enter_forward(forward_context)
    state.frames.append(frame)
    if state.preserve_rng_state:
        frame.record_rng_state()  # last, as close to forward as possible


def _post_forward(state: _CheckpointState, module: nn.Module, args: Tuple[Any, ...], output: Any) -> None:
    """Pre: ``forward`` returned (or raised: registered with ``always_call``). Post: the
    frame pushed by :func:`_pre_forward` is popped and its saved-tensor hooks exited."""
    if not state.frames:
        raise AssertionError(f"checkpoint({type(module).__name__}): forward post-hook without a pre-hook")
    frame = state.frames.pop()
    if frame is not None:
        frame.exit_forward()


@contract(state_cls=_CheckpointState)
def checkpoint(
    module: nn.Module,
    *,
    preserve_rng_state: bool = True,
    context_fn: Optional[_ContextFn] = None,
    use_reentrant: bool = False,
) -> nn.Module:
    """Apply non-reentrant activation checkpointing to ``module`` in place.

    Activations inside ``module`` are not kept after its forward; they are recomputed in
    backward by running ``module.forward`` again. Gradients are identical to running without
    checkpointing. The module keeps its object identity, class and FQNs. Composes with
    ``fully_shard`` on the same module or on parents, see [Note: Hook order].

    Example::

        model = nn.Sequential(Block(), Block())
        for block in model:
            checkpoint(block)
        model(x).sum().backward()         # each block's forward runs again in backward
        checkpoint.state(model[0]).enable_hook = False   # turn it off for that block

    Args:
        module: the module whose activations are recomputed.
        preserve_rng_state: restore the forward's CPU (and input devices' CUDA) RNG state
            for recomputation, so dropout masks match.
        context_fn: returns two context managers per forward call: the first is entered
            around the forward, the second around the recomputation.
        use_reentrant: only ``False`` is supported; ``True`` raises ``NotImplementedError``.

    Returns:
        ``module`` itself.
    """
    for name, flag in (("preserve_rng_state", preserve_rng_state), ("use_reentrant", use_reentrant)):
        if not isinstance(flag, bool):
            raise TypeError(f"checkpoint({type(module).__name__}): {name} must be a bool (True or False), got "
                            f"{type(flag).__name__} ({flag!r})")
    if use_reentrant:
        raise NotImplementedError(
            "checkpoint(use_reentrant=True) is not supported; composable_shard's checkpoint is "
            "non-reentrant only. Call checkpoint(module) with use_reentrant=False."
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint expects a single nn.Module, got {type(module).__name__}")
    if context_fn is not None and not callable(context_fn):
        raise TypeError(f"checkpoint(context_fn=...) must be callable, got {type(context_fn).__name__}")
    state = checkpoint.state(module)
    if state is None:
        raise AssertionError(f"checkpoint({type(module).__name__}): contract did not attach a state")
    state.preserve_rng_state = preserve_rng_state
    state.context_fn = context_fn if context_fn is not None else _default_context_fn
    state.hook_handles = [
        module.register_forward_pre_hook(torch.compiler.disable(functools.partial(_pre_forward, state)),
                                         with_kwargs=True),
        module.register_forward_hook(torch.compiler.disable(functools.partial(_post_forward, state)), prepend=True,
                                     always_call=True),
    ]
    return module
