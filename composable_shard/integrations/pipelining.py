"""torch's pipeline parallelism (``torch.distributed.pipelining``) with stages whose modules this
library manages: :class:`PipelineStage`, used in place of torch's.

[Note: Pipelined stages]
  torch's schedules run a stage's micro-batches through ``stage.forward_one_chunk`` and
  ``stage.backward_maybe_with_nosync``, then once per step ``stage.perform_reduce_grad``. For a
  stage module that is an FSDP2 module (``isinstance`` against torch's ``FSDPModule``, which
  ours are) torch's stage turns gradient sync and resharding after backward off for every
  micro-batch and finishes the step through FSDP2's internal state, which our modules do not
  have; so ``fully_shard`` refuses torch's own stage (``interop.refuse_pipelining``). This
  stage keeps torch's micro-batch code and replaces the two seams:
    every backward  fully sharded modules of the stage accumulate without communicating and keep
                    their parameters unsharded (FSDP2's settings under torch's stage); replicated
                    ones accumulate too
    end of step     fully sharded modules reduce the sum once (``reduce_accumulated_gradients``:
                    one reduce-scatter per flat group, as FSDP2's ``post_backward``) and reshard;
                    replicated ones reduce during the last micro-batch's backward (one
                    all-reduce per bucket per step); then torch's gradient scaling by the
                    number of micro-batches.
  Schedules that split a backward into an input pass and a weight pass (zero bubble:
  ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``) compute
  weight gradients with ``torch.autograd.grad`` on ``stage.submod.parameters()``, our 1-D views of
  the shards, which the sharded forward never used: they are refused when the schedule is built
  (it assigns ``stage_index_to_group_rank``) and, for a schedule given as an action list, at its
  first split backward.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Set, Tuple

import torch.nn as nn
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from .. import FSDPModule, ReplicateModule

__all__ = ["PipelineStage"]

_SPLIT_BACKWARD_SCHEDULES = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def _refusal(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"composable_shard.integrations.pipelining: {what} splits each backward into an input pass and a weight pass "
        "and takes weight gradients from stage.submod.parameters(); under fully_shard those are views of this rank's "
        "shards, which the sharded forward never used, so the stage would learn nothing. Use ScheduleGPipe, "
        "Schedule1F1B, ScheduleInterleaved1F1B or ScheduleLoopedBFS, or replicate the stage's modules.")


class PipelineStage(_TorchPipelineStage):
    """torch's ``PipelineStage`` for a stage module this library manages (``fully_shard`` per
    block and on the stage root, ``replicate``, or both), with the same arguments. Gradients are
    reduced once per step; the numbers are those of single-process training on the combined
    batch. Zero-bubble schedules are refused when built. See [Note: Pipelined stages].

    Example::

        fully_shard(block) for each block of the stage; fully_shard(stage_module, mesh=dp_mesh)
        stage = PipelineStage(stage_module, stage_index, num_stages, device, group=pp_group)
        schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
        schedule.step(x) / schedule.step(target=y); optimizer.step()
    """

    _composable_shard_stage = True  # lets fully_shard's pipelining check through ([Note: FSDP2 drop-in])

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "stage_index_to_group_rank":  # assigned by every multi-stage schedule's __init__
            frame = inspect.currentframe()
            caller = frame.f_back if frame is not None else None
            schedule = caller.f_locals.get("self") if caller is not None else None
            names = {c.__name__ for c in type(schedule).__mro__} if schedule is not None else set()
            split = names.intersection(_SPLIT_BACKWARD_SCHEDULES)
            if split and self._manages_fully_sharded():
                raise _refusal(sorted(split)[0])
        super().__setattr__(name, value)

    def _manages_fully_sharded(self) -> bool:
        return any(isinstance(m, FSDPModule) for m in self.submod.modules())

    def _managed(self) -> Tuple[List[FSDPModule], List[ReplicateModule], List[FSDPModule]]:
        """The stage's fully sharded modules, its replicated ones, and the outermost fully sharded
        ones (each reduces its subtree), found once: not per micro-batch."""
        found = self.__dict__.get("_cs_managed")
        if found is None:
            sharded = [m for m in self.submod.modules() if isinstance(m, FSDPModule)]
            replicated = [m for m in self.submod.modules() if isinstance(m, ReplicateModule)]
            outermost: List[FSDPModule] = []
            covered: Set[int] = set()
            for m in sharded:  # pre-order: an outer module comes before what it contains
                if id(m) not in covered:
                    outermost.append(m)
                    covered.update(id(x) for x in m.modules())
            found = self.__dict__["_cs_managed"] = (sharded, replicated, outermost)
        return found  # type: ignore[no-any-return,return-value]  # built above

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: Dict[str, Any],
                                   last_backward: bool = False) -> Any:
        """A micro-batch's backward: fully sharded modules accumulate and stay unsharded,
        replicated ones accumulate until the last micro-batch (see [Note: Pipelined stages])."""
        sharded, replicated, _ = self._managed()
        if backward_type != "full" and sharded:
            raise _refusal(f"this schedule (a {backward_type!r} backward pass)")
        saved = self.__dict__.setdefault("_cs_reshard_after_backward", {})
        for m in sharded:
            state = m._fsdp_state()
            saved.setdefault(id(state), (state, state.reshard_after_backward))
            m.set_requires_gradient_sync(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
        for r in replicated:
            r.set_requires_gradient_sync(last_backward)
        plain = self.submod
        if isinstance(plain, FSDPModule):  # torch's stage would drive it as an FSDP2 module
            self.submod = _PlainView(plain)
        try:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        finally:
            self.submod = plain

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """End of the step: the fully sharded modules' accumulated gradients reduced once and
        resharded; then torch's scaling by the number of micro-batches."""
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
    """The stage module seen as a plain module by torch's stage during one backward (its
    ``parameters()`` are the module's): torch then runs the backward itself and leaves gradient
    synchronization to the flags set above."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_viewed", module)  # not registered: no second owner of the module

    def parameters(self, recurse: bool = True) -> Any:  # noqa: D102  # the viewed module's
        viewed: nn.Module = self.__dict__["_viewed"]
        return viewed.parameters(recurse)
