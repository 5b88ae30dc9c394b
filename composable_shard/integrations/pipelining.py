"""torch's pipeline parallelism (``torch.distributed.pipelining``) with stages whose modules this
library manages: :class:`PipelineStage`, used in place of torch's, and :func:`check_caller`, which
refuses torch's own stage over fully sharded modules, and the zero-bubble schedules over
replicated ones.

[Note: Pipelined stages]
  torch's schedules run a stage's micro-batches through ``stage.forward_one_chunk`` and
  ``stage.backward_maybe_with_nosync`` (a full backward, or, under the zero-bubble schedules, an
  input pass and later a weight pass), then once per step ``stage.perform_reduce_grad``. For a
  stage module that is an FSDP2 module (``isinstance`` against torch's ``FSDPModule``, which
  ours are) torch's stage turns gradient sync and resharding after backward off for every
  micro-batch and finishes the step through FSDP2's internal state, which our modules do not
  have. This stage keeps torch's micro-batch code and replaces the two seams:
    every backward  fully sharded modules of the stage accumulate without communicating and keep
                    their parameters unsharded (FSDP2's settings under torch's stage); what each
                    was configured with (``reshard_after_backward``: True, or False under NO_SHARD
                    or the user's ``set_reshard_after_backward(False)``) is recorded once per
                    step, at its first micro-batch; replicated ones accumulate too
    input pass and  torch's own code runs them, shown as the stage's parameters the tensors the
    weight pass     forward computed on: each fully sharded group's unsharded flat buffer (a leaf
                    the forward's views were split from) in place of its original parameters
                    (1-D views of the shards, which the forward never used), and every other
                    parameter as it is. The input pass keeps the graph between the stage's inputs
                    and those buffers; for the weight pass every fully sharded module of the stage
                    is put into backward first (unsharded views, gathered again where a later
                    forward freed them), torch's code asks autograd for the buffers' gradients and
                    adds them to their ``.grad``, which is then kept with the step's unreduced sum
                    ([Note: Weight passes] in ``_runtime/hooks.py``)
    end of step     the recorded settings restored; fully sharded modules reduce the sum once
                    (``reduce_accumulated_gradients``: one reduce-scatter per flat group, as
                    FSDP2's ``post_backward``; gradient sync on again) and reshard as
                    configured; replicated ones reduce during the last micro-batch's backward
                    (one all-reduce per bucket per step) and sync again; then torch's gradient
                    scaling by the number of micro-batches.
  So after a step every module is as a plain step leaves it: parameters sharded again (or kept
  unsharded where the user asked), the same bytes held, sync on.
  Replicated modules cannot take a weight pass: torch's weight pass sets ``.grad`` itself, so
  replicate's bucket hooks never see those gradients. The zero-bubble schedules are refused over
  them (below).

[Note: Which stage drives a module]
  The library's runtime asks :func:`check_caller` (entry point ``composable_shard.caller_checks``,
  [Note: Caller checks] in ``_base/callers.py``) while code of ``torch.distributed.pipelining`` is
  running, with the names of its running functions (never their locals):
    "first_forward"        a fully sharded root's first forward (torch 2.13: the stage's metadata
                           inference at the schedule's first step; with static shapes its first
                           micro-batch). Refused unless a :class:`PipelineStage` of ours was built
                           over it (``_DRIVEN``, in the module's ``__dict__``): ours marks its
                           stage module at construction, every fully sharded module inside it then,
                           and again at the stage module's first forward (a forward pre-hook it
                           removes then), so ``fully_shard`` may come before the stage or after it
                           (torchtitan builds the stage first). So torch's own stage is refused
                           there, before any collective, whether its module is our fully sharded
                           root or a plain module holding fully sharded blocks.
    "set_is_last_backward" called from torch's stage's ``backward_maybe_with_nosync`` or
                           ``perform_reduce_grad``, where torch's stage drives an FSDP2 module
                           (ours never reaches them with one: it shows torch's code a plain view
                           during backward and replaces ``perform_reduce_grad``). Refused before
                           the backward runs: this catches torch's stage over a module whose first
                           forward ran elsewhere, or that a stage of ours once marked.
    "traverse"             a zero-bubble schedule's ``__init__`` walks the stage modules
                           (torch 2.13: ``_check_torch_compile_compatibility``, its first
                           statement) and reaches a replicated module: refused, with either
                           stage, before the schedule or the stages changed (recognised by the
                           running function's qualified name, ``ScheduleZBVZeroBubble.__init__``:
                           Python 3.11+). A schedule given as an action list (``_load_csv``), or
                           built where the qualified name is not known, is refused by this stage
                           at its first split backward over a replicated module, before that
                           backward computes anything (on the ranks that reach one; a rank waiting
                           for another's gradient then waits, as after any error inside a step).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Set, Tuple

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from .. import FSDPModule, ReplicateModule
from .._runtime.hooks import begin_weight_pass, end_weight_passes

__all__ = ["PipelineStage", "check_caller"]

_SPLIT_BACKWARD_SCHEDULES = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
_SPLIT_SCHEDULE_INITS = {f"{name}.__init__": name for name in _SPLIT_BACKWARD_SCHEDULES}
# torch's stage methods that call set_is_last_backward on an FSDP2 stage module ([Note: Which stage drives a module])
_TORCH_STAGE_FSDP_SEAMS = frozenset({"backward_maybe_with_nosync", "perform_reduce_grad"})
_DRIVEN = "_cs_driven_by_pipeline_stage"  # key in a module's __dict__: a stage of ours drives it


def _refusal(schedule: str, module: Any) -> NotImplementedError:
    return NotImplementedError(
        f"composable_shard.integrations.pipelining: {schedule} splits each backward into an input pass and a weight "
        f"pass, and torch's weight pass sets the gradients of replicated parameters itself "
        f"({type(module).__name__} is managed by replicate): replicate's all-reduce would never see them and each "
        "rank would keep its own. Manage the stage's modules with fully_shard (NO_SHARD keeps whole parameters, "
        "as replicate does), or use ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B or ScheduleLoopedBFS.")


def _torch_stage_refusal(module: nn.Module) -> RuntimeError:
    return RuntimeError(
        f"torch.distributed.pipelining on a stage whose modules fully_shard manages ({type(module).__name__}): "
        "torch's schedules finish each step through torch FSDP2's internal state (gradient sync is off for "
        "every micro-batch until then), which composable_shard modules do not have, and their zero-bubble "
        "weight pass asks the original parameters for gradients, which the sharded forward never used: "
        "gradients would go unreduced or missing. Build the stage with "
        "composable_shard.integrations.pipelining.PipelineStage (same arguments) instead of torch's.")


def check_caller(subject: Any, point: str, functions: Sequence[Any]) -> None:
    """Refuse torch's own pipelining stage driving a fully sharded module, and zero-bubble
    schedules over replicated modules, before anything changed. See [Note: Which stage drives a
    module]; the library calls it (entry point ``composable_shard.caller_checks``, [Note: Caller
    checks] in ``composable_shard/_base/callers.py``), a user never needs to.

    Example::

        check_caller(model, "first_forward", [])     # nothing of torch's pipelining running: returns

    Args:
        subject: the managed module that was reached; fully sharded ones are checked at
            ``"first_forward"`` and ``"set_is_last_backward"``, replicated ones at ``"traverse"``.
        point: where it was reached: ``"first_forward"``, ``"set_is_last_backward"`` and
            ``"traverse"`` are checked, other points return.
        functions: the running functions of ``torch.distributed.pipelining``, innermost first,
            each with ``module``, ``name`` and ``qualname``; only their names are read.

    Raises:
        RuntimeError: torch's stage (not :class:`PipelineStage`) runs the module's first forward
            or calls its ``set_is_last_backward``.
        NotImplementedError: a zero-bubble schedule is being built over a replicated module.
    """
    if not functions:
        return
    if point == "traverse":
        if isinstance(subject, ReplicateModule):
            schedule = next((_SPLIT_SCHEDULE_INITS[f.qualname] for f in functions
                             if f.qualname in _SPLIT_SCHEDULE_INITS), None)
            if schedule is not None:
                raise _refusal(schedule, subject)
    elif isinstance(subject, FSDPModule) and _torch_stage_drives(subject, point, functions):
        raise _torch_stage_refusal(subject)


def _torch_stage_drives(subject: Any, point: str, functions: Sequence[Any]) -> bool:
    """Does torch's own stage (not :class:`PipelineStage`) drive ``subject`` here? See [Note: Which
    stage drives a module]."""
    if point == "first_forward":
        return not subject.__dict__.get(_DRIVEN, False)
    if point == "set_is_last_backward":
        return any(f.name in _TORCH_STAGE_FSDP_SEAMS for f in functions)
    return False


def _mark_driven(stage_module: nn.Module) -> None:
    """Mark the stage module and every fully sharded module in it as driven by a stage of ours."""
    stage_module.__dict__[_DRIVEN] = True
    for module in stage_module.modules():
        if isinstance(module, FSDPModule):
            module.__dict__[_DRIVEN] = True


class _MarkAtFirstForward:
    """Forward pre-hook of a stage module: marks what ``fully_shard`` managed after the stage was
    built (its first forward comes first), then removes itself."""

    def __init__(self, stage_module: nn.Module) -> None:
        self.removable = stage_module.register_forward_pre_hook(self)

    def __call__(self, module: nn.Module, args: Any) -> None:
        _mark_driven(module)
        self.removable.remove()


class PipelineStage(_TorchPipelineStage):
    """torch's ``PipelineStage`` for a stage module this library manages (``fully_shard`` per
    block and on the stage root, ``replicate``, or both), with the same arguments. Gradients are
    reduced once per step; the numbers are those of single-process training on the combined
    batch, and after each step the modules are as a plain step leaves them. Every torch schedule
    runs over fully sharded stage modules, the zero-bubble ones (``ScheduleInterleavedZeroBubble``,
    ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``) included; those are refused over replicated
    ones. See [Note: Pipelined stages].

    Example::

        fully_shard(block) for each block of the stage; fully_shard(stage_module, mesh=dp_mesh)
        stage = PipelineStage(stage_module, stage_index, num_stages, device, group=pp_group)
        schedule = ScheduleZBVZeroBubble([stage, other_stage], n_microbatches=4, loss_fn=loss_fn)
        schedule.step(x) / schedule.step(target=y); optimizer.step()
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """torch's arguments. Marks the stage module's fully sharded modules as driven by this
        stage, now and at the stage module's first forward, so their first forward under the
        schedule is let through ([Note: Which stage drives a module]): ``fully_shard`` may be
        applied before building the stage or after it."""
        super().__init__(*args, **kwargs)
        _mark_driven(self.submod)
        _MarkAtFirstForward(self.submod)

    def _managed(self) -> Tuple[List[FSDPModule], List[ReplicateModule], List[FSDPModule]]:
        """The stage's fully sharded modules (the first of each group sharing one state), its
        replicated ones, and the outermost fully sharded ones (each reduces its subtree), found
        once, at the first backward: not per micro-batch."""
        found = self.__dict__.get("_cs_managed")
        if found is None:
            states: Set[int] = set()  # one module per state: a group (fully_shard([norm, head])) shares one
            sharded = [m for m in self.submod.modules() if isinstance(m, FSDPModule)
                       and id(m._fsdp_state()) not in states and not states.add(id(m._fsdp_state()))]  # type: ignore[func-returns-value]  # set.add: None
            replicated = [m for m in self.submod.modules() if isinstance(m, ReplicateModule)]
            outermost: List[FSDPModule] = []
            covered: Set[int] = set()
            for m in sharded:  # pre-order: an outer module comes before what it contains
                if id(m) not in covered:
                    outermost.append(m)
                    covered.update(id(x) for x in m.modules())
            found = self.__dict__["_cs_managed"] = (sharded, replicated, outermost)
        return found  # type: ignore[no-any-return,return-value]  # built above

    def _computed_on(self, sharded: List[FSDPModule]) -> List[torch.Tensor]:
        """The tensors the stage's forward computed on, in place of its parameters: each fully
        sharded group's unsharded flat buffer (trainable groups), then every parameter no fully
        sharded module owns (see [Note: Pipelined stages])."""
        buffers: List[torch.Tensor] = []
        owned: Set[int] = set()
        for m in sharded:
            handle = m._fsdp_state().handle
            for group in handle.groups if handle is not None else []:
                owned.update(id(p) for p in group.orig_params)
                if group.requires_grad:
                    buffers.append(group.padded_unsharded_flat)
        return buffers + [p for p in self.submod.parameters() if id(p) not in owned]

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: Dict[str, Any],
                                   last_backward: bool = False) -> Any:
        """A micro-batch's backward (full, input pass or weight pass): fully sharded modules
        accumulate and stay unsharded, replicated ones accumulate until the last micro-batch
        (see [Note: Pipelined stages])."""
        sharded, replicated, _ = self._managed()
        if backward_type != "full" and replicated:
            raise _refusal(f"this schedule (a {backward_type!r} backward pass)", replicated[0])
        saved = self.__dict__.setdefault("_cs_reshard_after_backward", {})
        for m in sharded:
            state = m._fsdp_state()
            saved.setdefault(id(state), (state, state.reshard_after_backward))
            m.set_requires_gradient_sync(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
        for r in replicated:
            r.set_requires_gradient_sync(last_backward)
        plain = self.submod
        if backward_type != "full" and sharded:
            self.submod = _PlainView(plain, self._computed_on(sharded))
        elif isinstance(plain, FSDPModule):  # torch's stage would drive it as an FSDP2 module
            self.submod = _PlainView(plain, None)
        weight_pass = backward_type == "weight"
        if weight_pass:
            for m in sharded:
                begin_weight_pass(m._fsdp_state())
        completed = False
        try:
            result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
            completed = True
        finally:
            self.submod = plain
            if weight_pass:
                end_weight_passes([m._fsdp_state() for m in sharded], completed)
        return result

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """End of the step: the fully sharded modules' recorded ``reshard_after_backward``
        restored, their accumulated gradients reduced once and resharded as configured, gradient
        sync on again everywhere; then torch's scaling by the number of micro-batches."""
        _, replicated, outermost = self._managed()
        for state, value in self.__dict__.pop("_cs_reshard_after_backward", {}).values():
            state.reshard_after_backward = value  # as configured (NO_SHARD keeps)
        for m in outermost:
            m.reduce_accumulated_gradients()
        for r in replicated:
            r.set_requires_gradient_sync(True)
        if grad_scale_factor != 1:
            self.scale_grads(grad_scale_factor)


class _PlainView(nn.Module):
    """The stage module seen as a plain module by torch's stage during one backward: torch then
    runs the backward itself and leaves gradient synchronization to the flags set above. Its
    ``parameters()`` are ``computed_on`` where given (an input or weight pass), else the module's."""

    def __init__(self, module: nn.Module, computed_on: Any) -> None:
        super().__init__()
        object.__setattr__(self, "_viewed", module)  # not registered: no second owner of the module
        object.__setattr__(self, "_computed_on", computed_on)

    def parameters(self, recurse: bool = True) -> Any:  # noqa: D102  # the viewed module's, or what it computed on
        computed_on = self.__dict__["_computed_on"]
        if computed_on is not None:
            return iter(computed_on)
        viewed: nn.Module = self.__dict__["_viewed"]
        return viewed.parameters(recurse)
