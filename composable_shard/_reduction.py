"""A flat parameter's gradient on its way from the unsharded buffer to ``.grad``.

[Note: Reductions in flight]  A handle's post-backward issues its reduce-scatter and returns;
the next handle's backward computes while it runs. Its input, the unsharded gradient, is the
largest buffer of the step, so it is released as soon as the next handle no longer overlaps
it: when that handle's parameter gradients are
all computed, just before they are concatenated into its own unsharded gradient (the pre-hook of
its split backward), every earlier reduction is waited on (``Work.wait()`` on gloo; on CUDA the
compute stream waits for the reduction's event, no CPU sync), its input dropped and its shard
accumulated. The reduction overlapped the whole backward of the next handle, and at most two
handles' unsharded gradients are alive at once. A handle whose backward starts by recomputing
its forward (activation checkpointing) releases them earlier, at its pre-backward: the
recomputed activations are that handle's peak, and a user who checkpoints chose memory over
speed (measured at W=2 on the standard model: about 2% slower with checkpointing, where the
same early release would cost about 5% without it, and with it the peak equals torch FSDP2's,
whose reduce-scatter on CPU is synchronous). The end of backward waits for the rest.

Stages: ISSUED (reduce-scatter in flight, holds the unsharded gradient) -> REPLICATING (hybrid:
all-reduce of the shard across replicas in flight) -> REDUCED (shard landed) -> DONE (divided
and accumulated into the group's sharded gradient). A backward that raised discards its
reductions: they are still waited on, so every rank's collectives stay matched.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _collectives, _watch
from ._common_utils import _FSDPState
from ._flat_param import FlatGroup, FlatParamHandle
from ._streams import Streams

__all__ = ["Reduction", "release_earlier_reductions", "issue_reduction", "finish_reductions", "discard_reductions", "attach_reduced_grads"]

ISSUED, REPLICATING, REDUCED, DONE, DISCARDED = "ISSUED", "REPLICATING", "REDUCED", "DONE", "DISCARDED"


def _streams_of(state: _FSDPState) -> Streams:
    if state.streams is None:
        raise AssertionError(f"[rank {state.rank}] {state.describe()}: no streams (fully_shard did not finish)")
    return state.streams


class Reduction:
    """One group's gradient reduction (see [Note: Reductions in flight])."""

    def __init__(self, state: _FSDPState, handle: FlatParamHandle, group: FlatGroup, unsharded_grad: torch.Tensor) -> None:
        self.state: _FSDPState = state  # owns the process groups and the divisor
        self.handle: FlatParamHandle = handle
        self.group: FlatGroup = group
        self.unsharded_grad: Optional[torch.Tensor] = unsharded_grad  # the collective's input until it lands
        self.pending: Optional[_collectives.Pending] = None  # the collective in flight
        self.stage: str = ISSUED
        self.reduce_dtype: torch.dtype = reduce_dtype_of(state, group)
        self.event: Optional[Any] = None  # CUDA: recorded on the reduce-scatter stream after issuing

    def issue(self) -> None:
        """Start the reduce-scatter (or, for a shard group of one rank, the replica all-reduce)."""
        state = self.state
        grad = self.unsharded_grad
        if grad is None:
            raise AssertionError(f"[rank {state.rank}] reduction of {self.handle.fqn!r} issued twice")
        streams = _streams_of(state)
        if grad.dtype != self.reduce_dtype:
            grad = grad.to(self.reduce_dtype)
        if self.reduce_dtype not in (torch.float32, torch.float64):
            grad.div_(state.dp_world_size)  # pre-divide low precision to avoid overflow
        self.unsharded_grad = grad
        output = torch.empty(grad.numel() // state.world_size, dtype=grad.dtype, device=grad.device) \
            if state.world_size > 1 else grad  # allocated on the compute stream, which frees it
        with streams.run_on(streams.reduce_scatter):
            if state.world_size > 1:
                self.pending = _collectives.reduce_scatter_into(output, grad, state.process_group, tag=self.handle.fqn,
                                                                match=self.handle.index + 1)
            else:
                self._replicate(grad)
            self.event = streams.record(streams.reduce_scatter)

    def _replicate(self, shard: torch.Tensor) -> None:
        group = self.state.replicate_group
        if group is not None and dist.get_world_size(group) > 1:
            self.pending = _collectives.all_reduce(shard, group, tag=self.handle.fqn)
            self.stage = REPLICATING
        else:
            self.pending = _collectives.Pending(None, shard, "none", tag=self.handle.fqn)
            self.stage = REDUCED

    def release_input(self) -> None:
        """Wait for the reduce-scatter, drop its input, and start the replica all-reduce if
        there is one. Post: stage REPLICATING or REDUCED."""
        if self.stage != ISSUED:  # a one-rank shard group starts in REPLICATING or REDUCED
            return
        output = self._pending().wait()
        Streams.wait(self.event)
        self.unsharded_grad = None
        streams = _streams_of(self.state)
        with streams.run_on(streams.reduce_scatter):
            self._replicate(output)
            self.event = streams.record(streams.reduce_scatter)

    def finish(self) -> None:
        """Wait for everything, average, accumulate into the group's sharded gradient.
        Post: DONE."""
        self.release_input()
        output = self._pending().wait()
        Streams.wait(self.event)
        self.unsharded_grad = None
        self.pending = None
        if self.reduce_dtype in (torch.float32, torch.float64) and self.state.dp_world_size > 1:
            output.div_(self.state.dp_world_size)
        self.handle.accumulate_sharded_grad(self.group, output)
        self.stage = DONE

    def discard(self) -> None:
        """Wait for what is in flight (ranks stay matched), keep nothing. Post: DISCARDED."""
        if self.pending is not None:
            self.pending.wait()
            Streams.wait(self.event)
        self.pending = None
        self.unsharded_grad = None
        self.stage = DISCARDED

    def _pending(self) -> _collectives.Pending:
        if self.pending is None:
            raise AssertionError(f"[rank {self.state.rank}] reduction of {self.handle.fqn!r} has nothing pending "
                                 f"in stage {self.stage}")
        return self.pending


def reduce_dtype_of(state: _FSDPState, group: FlatGroup) -> torch.dtype:
    """The dtype ``group``'s gradients are reduced in: the mixed precision's reduce dtype for
    a low-precision floating group, else the group's compute dtype."""
    mp = state.mixed_precision
    return group.compute_dtype if mp is None else mp._reduce_dtype_for(group.compute_dtype, group.full_precision)


def release_earlier_reductions(root: _FSDPState, handle: FlatParamHandle) -> None:
    """Wait for the reductions of handles other than ``handle`` and drop their inputs (see
    [Note: Reductions in flight]). Runs just before ``handle``'s unsharded gradient is
    allocated, and again when its reduction is issued."""
    still_pending: List[Reduction] = []
    for earlier in root.pending_reductions:
        if earlier.handle is not handle:
            earlier.release_input()
            if earlier.stage == REDUCED:
                earlier.finish()
        if earlier.stage != DONE:
            still_pending.append(earlier)
    root.pending_reductions = still_pending


def issue_reduction(root: _FSDPState, state: _FSDPState, handle: FlatParamHandle, group: FlatGroup,
                    unsharded_grad: torch.Tensor) -> None:
    """Release every earlier handle's reduction input, then issue this group's reduction."""
    release_earlier_reductions(root, handle)
    reduction = Reduction(state, handle, group, unsharded_grad)
    reduction.issue()
    root.pending_reductions.append(reduction)


def finish_reductions(root: _FSDPState) -> None:
    """End of a synced backward: finish every reduction still in flight, in issue order."""
    for reduction in root.pending_reductions:
        reduction.finish()
    root.pending_reductions = []


def discard_reductions(root: _FSDPState) -> None:
    """Recovery from a backward that raised: wait for and drop every reduction in flight."""
    for reduction in root.pending_reductions:
        reduction.discard()
    root.pending_reductions = []


def attach_reduced_grads(root: _FSDPState) -> Optional[str]:
    """Give original parameters their ``.grad`` views after the reductions of a synced
    backward. Whether a parameter got a gradient on *some* rank is agreed on with one small
    all-reduce per process-group pair (a parameter unused everywhere keeps ``.grad = None``, as
    in local training; one used on another rank gets the averaged gradient). The same
    all-reduce agrees on the optimizer steps taken since the last one ([Note: Step agreement] in
    ``_watch.py``): returns the error to raise if the ranks differ, else ``None``."""
    batches: Dict[Tuple[int, int], List[Tuple[_FSDPState, FlatParamHandle, FlatGroup]]] = OrderedDict()
    for handle in root._all_handles:
        state = root.handle_states[id(handle)]
        for group in handle.groups:
            if group.reduced:
                handle.land_offloaded_grad(group)
                key = (id(state.process_group), id(state.replicate_group))
                batches.setdefault(key, []).append((state, handle, group))
    disagreement: Optional[str] = None
    steps = root.step_counter.take() if batches and root.step_counter is not None else []
    for members in batches.values():
        local = [u for _, _, g in members for u in g.used]
        used, num_ranks = _used_anywhere(members[0][0], local + steps)
        if num_ranks > 1 and steps and disagreement is None:
            disagreement = _watch.StepCounter.disagreement(steps, used[len(local):], num_ranks, "fully_shard", _SKIPPED)
        offset = 0
        for state, handle, group in members:
            shard_group = state.process_group if state.process_group is not None and state.world_size > 1 else None
            handle.attach_grads(group, [bool(u) for u in used[offset:offset + len(group.orig_params)]],
                                shard_group, state.compute_device)
            offset += len(group.orig_params)
    return disagreement


_SKIPPED = ("Each rank updates its own slice of every parameter, so the slices of the ranks that did not step were "
            "left behind: the model is now one that no single process would have computed. torch.amp.GradScaler "
            "skips steps this way (it looks at this rank's gradient slices only); use torch's ShardedGradScaler "
            "(the sharded_grad_scaler module of its FSDP package), which decides on all ranks' gradients together.")


def _used_anywhere(state: _FSDPState, local: List[int]) -> Tuple[List[int], int]:
    """``local`` summed over the shard and replicate groups, and the number of ranks summed."""
    groups = [g for g in (state.process_group, state.replicate_group) if g is not None and dist.get_world_size(g) > 1]
    if not groups or not local:
        return local, 1
    mask = torch.tensor(local, dtype=torch.int32, device=state.compute_device)
    num_ranks = 1
    for group in groups:
        _collectives.all_reduce(mask, group, tag="used_params").wait()
        num_ranks *= dist.get_world_size(group)
    return [int(v) for v in mask.tolist()], num_ranks
