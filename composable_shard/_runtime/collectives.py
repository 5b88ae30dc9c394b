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
import json
import os
import sys
import threading
import time
import warnings
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from .._base.torch_compat import all_gather_work, reduce_scatter_work

__all__ = [
    "Pending",
    "CollectiveRecord",
    "CollectiveRecorder",
    "record_collectives",
    "trace",
    "all_gather_into",
    "reduce_scatter_into",
    "averages_natively",
    "group_size",
    "all_reduce",
    "broadcast",
    "exchange",
    "all_gather_json",
]


TRAINING_HINT = ("Ranks that run different handles, or run backward or set_requires_gradient_sync differently, "
                 "leave collectives unmatched; rerun with COMPOSABLE_SHARD_DEBUG=1 to find where the ranks diverge.")


def collective_call_hint(api: str, instead: str) -> str:
    """What to check when a collective of a user-called API (a state dict, ``unshard_params``)
    does not complete: typically one rank called it alone (``if rank == 0: ...``), so it waited
    for the others until the process group's timeout. ``instead``: how to get the same on one rank."""
    return (f"{api} is collective: every rank of the process group must call it, in the same order; "
            f"a call made on one rank only (under `if rank == 0:`) waits for the others until the process "
            f"group's timeout. {instead}")


# [Note: Stuck waits]  A collective that a rank never joins blocks the others' CPU wait until
# the process group's timeout (gloo's default: 30 minutes) and only then raises. So every
# blocking wait is registered (start time, what it waits for) in ``_WAITING``, per thread,
# and one daemon thread per process looks at them every second (more often for a setting under
# 4 s): a wait older than ``STUCK_WARNING_AFTER_S`` gets one ``RuntimeWarning`` naming the
# collective, its handle and the hint (what usually causes it), long before the timeout.
# Registering costs a clock read and two dict operations per wait (1.7 us measured); nothing
# else runs in the step. CUDA waits only order streams, so they return at once and are never
# reported (NCCL has its own watchdog).
STUCK_WARNING_AFTER_S = 60.0


# A blocking wait in progress: ``(since, kind, tag, hint)``, a plain tuple (made three times per
# module and step). Strings only: a reference to the collective's tensors here would keep them
# alive in the watchdog thread after the wait (the last one it looked at).
_Wait = Tuple[float, str, str, str]
_WAITING: Dict[int, _Wait] = {}  # per thread (its ident): its wait in progress
_WARNED: Dict[int, _Wait] = {}  # per thread: the last of its waits warned about (watchdog thread only)
_WATCHDOG: List[threading.Thread] = []  # the running watchdog, if started in this process
_WATCHDOG_LOCK = threading.Lock()


def _watch_forever() -> None:
    while True:
        after = STUCK_WARNING_AFTER_S
        time.sleep(min(max(after / 4, 0.05), 1.0))  # a change of the setting is seen within 1 s
        now = time.monotonic()
        for ident, wait in list(_WAITING.items()):
            if _WARNED.get(ident) is not wait and now - wait[0] >= after and _WAITING.get(ident) is wait:
                _WARNED[ident] = wait
                _report_stuck(wait, now)


def _report_stuck(wait: _Wait, now: float) -> None:
    since, kind, tag, hint = wait
    rank = dist.get_rank() if dist.is_initialized() else "?"
    message = (f"composable_shard: rank {rank} has waited {now - since:.0f} s for the {kind} "
               f"of {tag or '<root>'!r}; it fails at the process group's timeout if a rank never joins. "
               f"{hint or TRAINING_HINT}")
    try:
        warnings.warn(message, RuntimeWarning)
    except Exception:  # warnings made errors: the watchdog thread must live on, so print it
        print(message, file=sys.stderr, flush=True)


def _start_watchdog() -> None:
    with _WATCHDOG_LOCK:
        if not _WATCHDOG:
            thread = threading.Thread(target=_watch_forever, name="composable_shard-watchdog", daemon=True)
            thread.start()
            _WATCHDOG.append(thread)


def _forget_watchdog() -> None:
    """In a forked child: the parent's thread did not come along; start anew when needed."""
    _WATCHDOG.clear()
    _WAITING.clear()
    _WARNED.clear()


os.register_at_fork(after_in_child=_forget_watchdog)


# [Note: Never poll a work]  ``Work.is_completed()`` keeps the GIL while it takes the work's
# lock, and gloo's worker thread finishes a work holding that lock. Under torch's profiler that
# finish first restores the issuing thread's state, and when that state holds Python objects
# (the saved-tensor hooks of a non-reentrant checkpoint: a handle gathered inside a checkpointed
# block's forward) restoring it needs the GIL: each thread waits for the other for ever. Seen on
# torch 2.13 (gloo, CPU): one rank stuck in ``is_completed`` with its worker in
# ``Work::finish`` -> ``gil_scoped_acquire``, the other rank waiting for it at the next gather
# (at the 161st repetition of the two selective-checkpointing subtests under the profiler, loaded machine).
# ``Work.wait()`` lets the GIL go, so the library only ever waits: no ``is_completed`` poll, no
# fast path for a work that looks done (tests/distributed/test_host_reads.py checks that no
# library frame calls it during a step).


def _wait_watched(work: Any, pending: "Pending") -> None:
    """``work.wait()``, registered for the watchdog meanwhile (see [Note: Stuck waits]); never
    polls the work first ([Note: Never poll a work])."""
    if not _WATCHDOG:
        _start_watchdog()
    ident = threading.get_ident()
    _WAITING[ident] = (time.monotonic(), pending.kind, pending.tag, pending.hint)
    try:
        work.wait()
    finally:
        _WAITING.pop(ident, None)


@dataclass
class Pending:
    """An issued collective: ``wait()`` blocks (CPU) or orders the current stream (CUDA)
    until ``output`` holds the result."""

    work: Optional[Any]  # dist.Work, or None when the collective ran synchronously / W == 1
    output: torch.Tensor
    kind: str = ""
    event: Optional[Any] = None  # CUDA: event recorded on the issuing stream (None on CPU)
    tag: str = ""  # the handle (or bucket) the collective is for, for error messages
    then: Optional[Callable[[], Any]] = None  # runs once after the work completed (fills ``output``)
    hint: str = ""  # what to check when it does not complete (default: TRAINING_HINT)

    def wait(self) -> torch.Tensor:
        """Wait for the collective; a failure or timeout is re-raised naming what was pending."""
        if self.work is not None:
            work, self.work = self.work, None
            try:
                _wait_watched(work, self)
                if self.then is not None:
                    self.then()
                    self.then = None
            except RuntimeError as e:
                raise RuntimeError(
                    f"composable_shard: the {self.kind} of {self.tag or '<root>'!r} did not complete on rank "
                    f"{dist.get_rank()}: {e}. {self.hint or TRAINING_HINT}"
                ) from e
        return self.output


@dataclass
class CollectiveRecord:
    """One collective as seen by this rank: what, how many bytes this rank sent, on how
    many ranks, a tag naming the handle or bucket, and a weak reference to its input (so a
    test can tell how long the library keeps a collective's input alive)."""

    kind: str
    nbytes: int
    group_size: int
    tag: str
    input_ref: Optional[Callable[[], Optional[torch.Tensor]]] = None


@dataclass(eq=False)  # compared by identity: two recorders holding the same events are two recorders
class CollectiveRecorder:
    """Collects :class:`CollectiveRecord` s and trace events while active (see
    :func:`record_collectives`). ``events`` interleaves ``("collective", kind, tag)`` with
    ``("trace", name, tag)`` in issue order; ``on_event``, if set, is called with each event
    as it happens (tests use it to look at live storage at a given point of the step)."""

    records: List[CollectiveRecord] = field(default_factory=list)
    events: List[Tuple[str, str, str]] = field(default_factory=list)
    on_event: Optional[Callable[[Tuple[str, str, str]], None]] = None

    def count(self, kind: Optional[str] = None) -> int:
        return sum(1 for r in self.records if kind is None or r.kind == kind)

    def nbytes(self, kind: Optional[str] = None) -> int:
        return sum(r.nbytes for r in self.records if kind is None or r.kind == kind)

    def _add_event(self, event: Tuple[str, str, str]) -> None:
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)


class _Local(threading.local):
    def __init__(self) -> None:  # runs once in each thread that reads it
        self.recorders: List[CollectiveRecorder] = []  # the active recorders of this thread


_local = _Local()
# Recorders active in any thread of the process: while none is (training), reporting costs one
# read of this list, not a thread-local lookup per event (several events per module and step).
_ACTIVE: List[CollectiveRecorder] = []
_ACTIVE_LOCK = threading.Lock()


@contextlib.contextmanager
def record_collectives() -> Iterator[CollectiveRecorder]:
    """Record every collective issued by this thread (autograd's CPU backward runs on the
    calling thread) while the context is active."""
    recorder = CollectiveRecorder()
    _local.recorders.append(recorder)
    with _ACTIVE_LOCK:
        _ACTIVE.append(recorder)
    try:
        yield recorder
    finally:
        _local.recorders.remove(recorder)
        with _ACTIVE_LOCK:
            _ACTIVE.remove(recorder)


def trace(name: str, tag: str = "") -> None:
    """Report a runtime event (a hook firing) to this thread's active recorders; free when no
    thread records."""
    if not _ACTIVE:
        return
    for r in _local.recorders:
        r._add_event(("trace", name, tag))


# Per process group (None: the default one): (size, backend). Asked of c10d once, not per collective
# (tens of microseconds per call, several collectives per module and step); a group's size and
# backend never change, and the entry goes with the group.
_GROUP_FACTS: "weakref.WeakKeyDictionary[Any, Tuple[int, str]]" = weakref.WeakKeyDictionary()


# The last group asked about, held weakly, and its facts: the runtime asks about the same
# group for every collective of a step (a WeakKeyDictionary lookup makes a weak reference each time).
_LAST_FACTS: List[Any] = [None, None]  # [weakref to the group, its facts]


def _group_facts(group: Optional[dist.ProcessGroup]) -> Tuple[int, str]:
    last_ref, last_facts = _LAST_FACTS
    if group is not None and last_ref is not None and last_ref() is group:
        return last_facts  # type: ignore[no-any-return]  # (size, backend), set below
    key = group if group is not None else dist.group.WORLD
    facts = _GROUP_FACTS.get(key) if key is not None else None
    if facts is None:
        facts = (dist.get_world_size(group), str(dist.get_backend(group)))
        if key is not None:
            _GROUP_FACTS[key] = facts
    if group is not None:
        _LAST_FACTS[:] = [weakref.ref(group), facts]
    return facts


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """The number of ranks of ``group`` (``None``: the default group), asked of c10d once per group."""
    return _group_facts(group)[0]


INPUT_BYTES = -1  # ``_report``'s nbytes: those of its input, worked out only when a recorder records


def _report(kind: str, nbytes: int, group: Optional[dist.ProcessGroup], tag: str,
            input: Optional[torch.Tensor] = None) -> Tuple[int, str]:
    """Report a collective to the active recorders; returns the group's ``(size, backend)``."""
    facts = _group_facts(group)
    if _ACTIVE and _local.recorders:
        if nbytes == INPUT_BYTES and input is not None:
            nbytes = input.numel() * input.element_size()
        rec = CollectiveRecord(kind, nbytes, facts[0], tag, weakref.ref(input) if input is not None else None)
        for r in _local.recorders:
            r.records.append(rec)
            r._add_event(("collective", kind, tag))
    return facts


def _copy_alone(output: torch.Tensor, input: torch.Tensor, kind: str, tag: str, hint: str = "") -> Pending:
    """A gather or reduce-scatter on a group of one rank: ``input`` is the result."""
    if output.data_ptr() != input.data_ptr():
        output.copy_(input)
    return Pending(None, output, kind, tag=tag, hint=hint)


def _gather_now(output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup], kind: str, tag: str,
                hint: str = "") -> None:
    """All-gather ``input`` into ``output`` and wait (the synchronous gathers of small data below)."""
    Pending(all_gather_work(output, input, group), output, kind, tag=tag, hint=hint).wait()


def all_gather_into(
    output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup], *, tag: str = "", match: int = 0,
    hint: str = "",
) -> Pending:
    """All-gather ``input`` (this rank's shard) into ``output`` (W shards, rank order), async.

    ``output`` must be contiguous with ``W * input.numel()`` elements; no copies are made.
    ``match`` (a handle's index, the same on every rank) keeps gloo from pairing this gather
    with another handle's (see [Note: Collectives on gloo]). ``hint``: the advice of the error
    raised if it does not complete (default :data:`TRAINING_HINT`), and of the warning once it
    has waited :data:`STUCK_WARNING_AFTER_S` (see [Note: Stuck waits])."""
    world_size, backend = _report("all_gather", INPUT_BYTES, group, tag, input)
    if world_size == 1:
        return _copy_alone(output, input, "all_gather", tag, hint)
    if backend == "gloo" and input.device.type == "cpu":
        return Pending(_gloo_all_gather(output, input, group, _p2p_tag(_TAG_ALL_GATHER, match)), output, "all_gather",
                       tag=tag, hint=hint)
    return Pending(all_gather_work(output, input, group), output, "all_gather", tag=tag, hint=hint)


def reduce_scatter_into(
    output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup], *, tag: str = "", match: int = 0,
    average: bool = False,
) -> Pending:
    """Sum-reduce ``input`` (W equal chunks) across the group; chunk ``rank`` lands in
    ``output``. Async. ``average``: the backend averages (``ReduceOp.AVG``; only where
    :func:`averages_natively`), else the caller divides. ``input`` is the caller's scratch: its
    contents are undefined afterwards. ``match`` as for :func:`all_gather_into`.

    On gloo it runs point to point (see [Note: Collectives on gloo])."""
    world_size, backend = _report("reduce_scatter", INPUT_BYTES, group, tag, input)
    if world_size == 1:
        return _copy_alone(output, input, "reduce_scatter", tag)
    if backend == "gloo" and input.device.type == "cpu":
        if average:
            raise AssertionError("composable_shard internal error: gloo's reduce-scatter cannot average")
        return _gloo_reduce_scatter(output, input, group, tag, _p2p_tag(_TAG_REDUCE_SCATTER, match))
    return Pending(reduce_scatter_work(output, input, average, group), output, "reduce_scatter", tag=tag)


def averages_natively(group: Optional[dist.ProcessGroup], dtype: torch.dtype) -> bool:
    """Whether reductions of ``dtype`` over ``group`` average in the collective itself
    (``ReduceOp.AVG``, no division kernel afterwards), as torch's FSDP2 does for float32 and
    bfloat16: a group of several ranks on a backend other than gloo (no AVG; the library's own
    point-to-point reduce-scatter there) and MPI. Other dtypes (float16's narrow range) are
    divided by the caller."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    size, backend = _group_facts(group)
    return size > 1 and backend not in ("gloo", "mpi")



# [Note: Collectives on gloo]  gloo's all-gather and reduce-scatter run on the process group's
# worker threads, copy their buffers, and (reduce-scatter) keep a copy of the whole input
# until the work is destroyed; an all-reduce in place of a reduce-scatter sends twice the
# bytes. Point-to-point sends and receives go straight to the transport, from and into the
# final buffers. So on gloo, for CPU tensors:
# * all-gather: this rank's shard is sent to every peer and each peer's shard received
#   straight into its chunk of the output (W-1 sends and receives, no copy but our own chunk);
# * reduce-scatter on two ranks: each rank sends the peer's chunk of its input and receives
#   the peer's contribution to its own chunk into ``output``, then adds its own part (the same
#   bytes as a ring reduce-scatter, nothing allocated). With more ranks the sum would need
#   W-2 extra receive buffers or a ring driven step by step, so it runs as an in-place
#   all-reduce of ``input`` (twice the bytes, no extra memory) and ``wait()`` copies this
#   rank's chunk into ``output``.
# Measured at W=2 on one block's gradient (3.2 MB, 60 alternating rounds, load ~5): median
# 2.9 ms point to point against 5.6 ms for the all-reduce and 9.6 ms for gloo's
# reduce-scatter; all-gather CPU time 1.1 ms against 1.8 ms. Every rank posts its sends and
# receives in the same program order as its collectives, and gloo matches point-to-point
# messages between two ranks in order per tag, so exchanges in flight at once (a prefetched
# all-gather during a reduction) pair correctly; each kind has its own tag, outside the slot
# space gloo's collectives use. Receives are posted before sends, so a message finds its buffer
# waiting (about 10% less CPU per exchange in the same measurement).
# The runtime passes each handle's index as ``match``, and the tag carries it: gloo then pairs a
# rank's gather of one handle only with the peers' gathers of the same handle. Ranks that run
# handles in different orders (a block skipped or reordered on one rank) would otherwise exchange
# shards of different, equally sized handles and go on with wrong parameters and gradients,
# silently; with the tag they wait, and the process group's timeout raises naming the handle.
_TAG_ALL_GATHER = 0x6373_0001
_TAG_REDUCE_SCATTER = 0x6373_0002


def _p2p_tag(kind: int, match: int) -> int:
    """Distinct per kind (1 and 2 mod 4) and per ``match``; stays below 2**31."""
    return kind + 4 * (match % (1 << 24))


class _Works:
    """Several point-to-point works waited as one."""

    def __init__(self, works: List[Any]) -> None:
        self.works: List[Any] = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        self.works = []
        return True


def _peers(group: Optional[dist.ProcessGroup]) -> Tuple[int, List[Tuple[int, int]]]:
    """This rank's rank in ``group``, and ``(group rank, global rank)`` of every other member."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    return rank, [(r, dist.get_global_rank(group, r) if group is not None else r) for r in range(world_size) if r != rank]


def _gloo_all_gather(output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup],
                     p2p_tag: int = _TAG_ALL_GATHER) -> _Works:
    """See [Note: Collectives on gloo]."""
    rank, peers = _peers(group)
    chunks = output.view(len(peers) + 1, -1)
    if chunks[rank].data_ptr() != input.data_ptr():
        chunks[rank].copy_(input)
    works = [dist.irecv(chunks[peer], src=global_peer, group=group, tag=p2p_tag) for peer, global_peer in peers]
    works += [dist.isend(input, dst=global_peer, group=group, tag=p2p_tag) for _, global_peer in peers]
    return _Works(works)


def _gloo_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup], tag: str,
                         p2p_tag: int = _TAG_REDUCE_SCATTER) -> Pending:
    """See [Note: Collectives on gloo]."""
    rank, peers = _peers(group)
    chunks = input.view(len(peers) + 1, -1)
    mine = chunks[rank]
    if len(peers) > 1:
        work = dist.all_reduce(input, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return Pending(work, output, "reduce_scatter", tag=tag, then=lambda: output.copy_(mine))
    peer, global_peer = peers[0]
    works = [dist.irecv(output, src=global_peer, group=group, tag=p2p_tag),
             dist.isend(chunks[peer], dst=global_peer, group=group, tag=p2p_tag)]
    return Pending(_Works(works), output, "reduce_scatter", tag=tag, then=lambda: output.add_(mine))


def all_reduce(tensor: torch.Tensor, group: Optional[dist.ProcessGroup], *, tag: str = "",
               op: Any = dist.ReduceOp.SUM, hint: str = "") -> Pending:
    """Reduce ``tensor`` in place across the group (sum unless ``op`` says otherwise), async.
    ``hint`` as for :func:`all_gather_into`."""
    if _report("all_reduce", INPUT_BYTES, group, tag, tensor)[0] == 1:
        return Pending(None, tensor, "all_reduce", tag=tag, hint=hint)
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return Pending(work, tensor, "all_reduce", tag=tag, hint=hint)


def broadcast(tensor: torch.Tensor, src_rank: int, group: Optional[dist.ProcessGroup], *, tag: str = "") -> None:
    """Broadcast ``tensor`` in place from group rank ``src_rank`` (synchronous)."""
    if _report("broadcast", tensor.numel() * tensor.element_size(), group, tag)[0] == 1:
        return
    global_src = dist.get_global_rank(group, src_rank) if group is not None else src_rank
    dist.broadcast(tensor, src=global_src, group=group)


# [Note: Exchanges name themselves]  An exchange (and the lengths' gather of all_gather_json)
# travels in a frame of a fixed size: a word naming what is exchanged (a CRC-32 of its tag), the
# count of values, then up to _FRAME_VALUES values, zero-padded; more values follow in a second
# gather of a size every rank has just agreed on. A rank that calls a collective API alone (a full
# state dict under `if rank == 0:` before the first forward) meets the others' next exchange, which
# carries other values: unframed, the two gathers paired up and each rank read the other's values
# as its own (a state dict raised that the optimizer had stepped 3.6e18 times on rank 1), or gloo
# aborted the process on the different sizes. Framed, every gather of the exchanges has the same
# size, and each rank raises naming what it was exchanging and the ranks that were elsewhere.
_FRAME_VALUES = 6
_FRAME_WORDS = 2 + _FRAME_VALUES


def exchange(values: List[int], group: Optional[dist.ProcessGroup], *, tag: str = "", hint: str = "") -> List[List[int]]:
    """Every rank's ``values`` (a few integers, the same count on every rank), synchronously:
    the cross-rank agreement checks use it before collectives that must match. ``hint``: what
    the stuck-wait warning and the error of ranks exchanging different things advise (see [Note:
    Stuck waits] and [Note: Exchanges name themselves])."""
    world_size = _report("exchange", 8 * _FRAME_WORDS, group, tag)[0]
    if world_size == 1:
        return [list(values)]
    rows = _framed_gather(values, group, "exchange", tag, hint)
    if len(values) > _FRAME_VALUES:
        _report("exchange", 8 * (len(values) - _FRAME_VALUES), group, tag)
    return rows


def _framed_gather(values: List[int], group: Optional[dist.ProcessGroup], kind: str, tag: str,
                   hint: str) -> List[List[int]]:
    """Every rank's ``values`` through a frame (see [Note: Exchanges name themselves])."""
    device = _object_device(group)
    name = zlib.crc32(tag.encode("utf-8"))
    frame = [name, len(values)] + list(values[:_FRAME_VALUES])
    mine = torch.tensor(frame + [0] * (_FRAME_WORDS - len(frame)), dtype=torch.int64, device=device)
    frames = torch.empty(dist.get_world_size(group) * _FRAME_WORDS, dtype=torch.int64, device=device)
    _gather_now(frames, mine, group, kind, tag, hint)
    everyone = frames.view(-1, _FRAME_WORDS).cpu().tolist()
    elsewhere = [r for r, theirs in enumerate(everyone) if theirs[:2] != frame[:2]]
    if elsewhere:
        ranks = [r if group is None else dist.get_global_rank(group, r) for r in elsewhere]
        raise RuntimeError(
            f"composable_shard: rank {dist.get_rank()} was exchanging {tag or kind!r} with its process group, but "
            f"rank(s) {ranks} were in another collective at the same time (a different exchange, or this one with "
            f"another count of values), so the ranks have not called the same collectives in the same order. "
            f"{hint or TRAINING_HINT}")
    rows = [theirs[2:2 + min(len(values), _FRAME_VALUES)] for theirs in everyone]
    if len(values) > _FRAME_VALUES:  # the rest, in a gather of the size every rank has just agreed on
        rest = torch.tensor(values[_FRAME_VALUES:], dtype=torch.int64, device=device)
        more = torch.empty(len(everyone) * rest.numel(), dtype=torch.int64, device=device)
        _gather_now(more, rest, group, kind, tag, hint)
        rows = [row + tail for row, tail in zip(rows, more.view(len(everyone), -1).cpu().tolist())]
    return rows


def all_gather_json(obj: Any, group: Optional[dist.ProcessGroup], *, tag: str = "", hint: str = "") -> List[Any]:
    """Every rank's ``obj`` (plain data: lists, tuples, dicts with string keys, strings,
    numbers, booleans, None), decoded the same way for every rank including this one (tuples
    come back as lists). Synchronous; init-time and error paths only.

    JSON, not pickle: what a peer sends is decoded as data and can never run code here
    (``dist.all_gather_object`` unpickles, and needs numpy). Two tensor all-gathers: lengths
    (in an exchange's frame, [Note: Exchanges name themselves]), then padded bytes."""
    world_size = _report("all_gather_json", 0, group, tag)[0]
    encoded = json.dumps(obj, allow_nan=False).encode("utf-8")
    if world_size == 1:
        return [json.loads(encoded)]
    device = _object_device(group)
    payload = torch.frombuffer(bytearray(encoded), dtype=torch.uint8).to(device)
    lengths = [length for (length,) in _framed_gather([payload.numel()], group, "all_gather_json", tag, hint)]
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()].copy_(payload)
    everyone = torch.empty(world_size * longest, dtype=torch.uint8, device=device)
    _gather_now(everyone, padded, group, "all_gather_json", tag, hint)
    rows = everyone.view(world_size, longest).cpu()
    return [json.loads(bytes(rows[r, : lengths[r]].tolist()).decode("utf-8")) for r in range(world_size)]


def _object_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where a byte tensor must live for ``group``'s backend (NCCL needs CUDA tensors)."""
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
