"""Every collective the library issues, with async results and instrumentation.

Nothing else in the package calls a ``torch.distributed`` collective. Each call returns a
:class:`Pending` (the async work plus its output buffer) and is reported to every active
:class:`CollectiveRecorder`, which is how tests count collectives and bytes per rank without
mocking ``torch.distributed``, and how they observe the order in which collectives are
issued relative to the runtime's hooks (:func:`trace`).

On CUDA the caller chooses the stream (the runtime issues all-gathers and reduce-scatters
on their own streams); these functions issue on the current stream. On CPU/gloo the returned
work is a real async handle.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = [
    "Pending",
    "CollectiveRecord",
    "CollectiveRecorder",
    "record_collectives",
    "trace",
    "all_gather_into",
    "reduce_scatter_into",
    "all_reduce",
    "broadcast",
    "all_gather_object",
]

# torch 2.13 renamed the single-tensor collectives; older versions only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Pending:
    """An issued collective: ``wait()`` blocks (CPU) or orders the current stream (CUDA)
    until ``output`` holds the result."""

    work: Optional[Any]  # dist.Work, or None when the collective ran synchronously / W == 1
    output: torch.Tensor
    kind: str = ""
    event: Optional[Any] = None  # CUDA: event recorded on the issuing stream (None on CPU)

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.output

    def is_completed(self) -> bool:
        """True if ``wait()`` would not block (polls the work; never waits)."""
        return self.work is None or bool(self.work.is_completed())


@dataclass
class CollectiveRecord:
    """One collective as seen by this rank: what, how many bytes this rank sent, on how
    many ranks, and a tag naming the handle or bucket."""

    kind: str
    nbytes: int
    group_size: int
    tag: str


@dataclass
class CollectiveRecorder:
    """Collects :class:`CollectiveRecord` s and trace events while active (see
    :func:`record_collectives`). ``events`` interleaves ``("collective", kind, tag)`` with
    ``("trace", name, tag)`` in issue order."""

    records: List[CollectiveRecord] = field(default_factory=list)
    events: List[Tuple[str, str, str]] = field(default_factory=list)

    def count(self, kind: Optional[str] = None) -> int:
        return sum(1 for r in self.records if kind is None or r.kind == kind)

    def nbytes(self, kind: Optional[str] = None) -> int:
        return sum(r.nbytes for r in self.records if kind is None or r.kind == kind)


_local = threading.local()


def _recorders() -> List[CollectiveRecorder]:
    recs: Optional[List[CollectiveRecorder]] = getattr(_local, "recorders", None)
    if recs is None:
        recs = []
        _local.recorders = recs
    return recs


@contextlib.contextmanager
def record_collectives() -> Iterator[CollectiveRecorder]:
    """Record every collective issued by this thread (autograd's CPU backward runs on the
    calling thread) while the context is active."""
    recorder = CollectiveRecorder()
    _recorders().append(recorder)
    try:
        yield recorder
    finally:
        _recorders().remove(recorder)


def trace(name: str, tag: str = "") -> None:
    """Report a runtime event (a hook firing) to active recorders; free when none are."""
    recs = getattr(_local, "recorders", None)
    if recs:
        for r in recs:
            r.events.append(("trace", name, tag))


def _report(kind: str, nbytes: int, group_size: int, tag: str) -> None:
    recs = getattr(_local, "recorders", None)
    if recs:
        rec = CollectiveRecord(kind, nbytes, group_size, tag)
        for r in recs:
            r.records.append(rec)
            r.events.append(("collective", kind, tag))


def _group_size(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group)


def all_gather_into(
    output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup], *, tag: str = ""
) -> Pending:
    """All-gather ``input`` (this rank's shard) into ``output`` (W shards, rank order), async.

    ``output`` must be contiguous with ``W * input.numel()`` elements; no copies are made."""
    world_size = _group_size(group)
    _report("all_gather", input.numel() * input.element_size(), world_size, tag)
    if world_size == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return Pending(None, output, "all_gather")
    work = _all_gather_single(output, input, group=group, async_op=True)
    return Pending(work, output, "all_gather")


def reduce_scatter_into(
    output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup], *, tag: str = ""
) -> Pending:
    """Sum-reduce ``input`` (W equal chunks) across the group; chunk ``rank`` lands in
    ``output``. Async. The caller divides for averaging."""
    world_size = _group_size(group)
    _report("reduce_scatter", input.numel() * input.element_size(), world_size, tag)
    if world_size == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return Pending(None, output, "reduce_scatter")
    work = _reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return Pending(work, output, "reduce_scatter")


def all_reduce(tensor: torch.Tensor, group: Optional[dist.ProcessGroup], *, tag: str = "",
               op: Any = dist.ReduceOp.SUM) -> Pending:
    """Reduce ``tensor`` in place across the group (sum unless ``op`` says otherwise), async."""
    world_size = _group_size(group)
    _report("all_reduce", tensor.numel() * tensor.element_size(), world_size, tag)
    if world_size == 1:
        return Pending(None, tensor, "all_reduce")
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return Pending(work, tensor, "all_reduce")


def broadcast(tensor: torch.Tensor, src_rank: int, group: Optional[dist.ProcessGroup], *, tag: str = "") -> None:
    """Broadcast ``tensor`` in place from group rank ``src_rank`` (synchronous)."""
    world_size = _group_size(group)
    _report("broadcast", tensor.numel() * tensor.element_size(), world_size, tag)
    if world_size == 1:
        return
    global_src = dist.get_global_rank(group, src_rank) if group is not None else src_rank
    dist.broadcast(tensor, src=global_src, group=group)


def all_gather_object(obj: Any, group: Optional[dist.ProcessGroup], *, tag: str = "") -> List[Any]:
    """Gather a picklable object from every rank of the group (synchronous; init-time only)."""
    world_size = _group_size(group)
    _report("all_gather_object", 0, world_size, tag)
    if world_size == 1:
        return [obj]
    out: List[Any] = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out
