"""A process group backend that simulates ``W`` identical ranks in one process.

``register()`` registers the backend ``"simulated"`` with torch.distributed's public plugin API
(``dist.Backend.register_backend``); then::

    from benchmarks import simulated
    simulated.register()
    dist.init_process_group("simulated", rank=0, world_size=8, store=dist.HashStore())
    assert dist.get_world_size() == 8 and dist.get_rank() == 0

gives a group of 8 on which this process plays rank 0 and every other rank is assumed to hold
exactly what this one holds (same parameters, same batch). Each collective writes, on this one
device, what it would write on rank 0 if all ``W`` ranks ran it with the same input:

  all_gather_into_tensor   the input tiled ``W`` times into the output (every rank's shard is this one's)
  all_gather (a list)      every output tensor a copy of the input
  reduce_scatter_tensor    this rank's chunk of the input: SUM ``W x`` it, AVG/MAX/MIN it, PRODUCT it ** W
  reduce_scatter (lists)   the same, from this rank's entry of the input list
  all_reduce               SUM ``W x``, AVG/MAX/MIN/BAND/BOR unchanged, PRODUCT ** W, BXOR 0 for even W
  broadcast, barrier       nothing to do (every rank already holds the root's tensor)
  reduce                   the root's tensor as for all_reduce, the others' unchanged
  all_to_all_single        chunk ``j`` of the output is chunk ``rank`` of the input, for every ``j``
  gather / scatter         the root's list filled with copies / this rank's entry (root only)

Why: a benchmark of the runtime's CPU cost per module (``benchmarks/overhead.py``) or of a GPU
step at ``W = 8`` (``benchmarks/gpu.py``) needs the library's code paths for ``W`` ranks (shards
of ``1/W``, real all-gathers and reduce-scatters with their buffers, streams and events) without
``W`` processes or a network. Since every simulated rank holds the same data, the gradient rank 0
ends with is the one ``W`` identical ranks would produce, and training equals a local run on the
per-rank batch (the data-parallel APIs average the ``W`` equal contributions).

Copies run on the caller's current stream (on CUDA), synchronously with respect to it; the
returned work's ``wait()`` makes the waiting stream wait on an event recorded after the copy,
as NCCL's does, so the library's own streams and events are exercised as with NCCL, minus the
network. On the CPU every work is complete when it is returned.

Each group adds the time spent in its collectives to ``cpu_seconds`` (and counts them in
``calls``): NCCL or gloo do that work in C++ threads, so a benchmark of the caller's CPU cost can
report its figures with and without it.

Point-to-point ``send``/``recv`` raise ``NotImplementedError``: a message from a simulated peer
has no defined content. ``ReduceOp.PREMUL_SUM`` raises too (its factor is not readable from a
Python backend).
"""

from __future__ import annotations

import functools
import time
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist

__all__ = ["BACKEND_NAME", "SimulatedProcessGroup", "SimulatedWork", "register"]

BACKEND_NAME = "simulated"
_ReduceOp = dist.ReduceOp
_F = TypeVar("_F", bound=Callable[..., Any])
# torch's stubs type ProcessGroup's and Work's methods as the Python API calls them (overloads, other
# argument names); a Python backend overrides the C++ virtuals that torch's trampoline calls, with
# their positional arguments. Typed as Any, the bases do not hold these overrides to those stubs.
_ProcessGroupBase: Any = dist.ProcessGroup
_WorkBase: Any = dist.Work


def _accounted(method: _F) -> _F:
    """Add the time of each call to the group's ``cpu_seconds`` (and count it in ``calls``):
    what a real backend does in C++ is done here in Python, so a benchmark can tell it apart.
    Timed with ``perf_counter``: the call runs on this thread from start to end (its copies are
    synchronous), so its wall time is its CPU time but for preemption, and the clock costs 40 ns
    here; ``process_time`` (a system call, 460 ns) read twice per collective added about 3 us per
    fully sharded module and step to every contender's CPU time in ``benchmarks/overhead.py``."""
    @functools.wraps(method)
    def wrapper(self: "SimulatedProcessGroup", *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.cpu_seconds += time.perf_counter() - start
            self.calls += 1

    return wrapper  # type: ignore[return-value]  # same signature as method


class SimulatedWork(_WorkBase):
    """The work of one simulated collective: the result is already written (CPU) or enqueued on
    the caller's stream (CUDA). ``wait()`` orders the waiting stream after it."""

    def __init__(self, result: List[torch.Tensor]) -> None:
        super().__init__()
        self._result = result
        self._event: Optional[torch.cuda.Event] = None
        if result and result[0].is_cuda:  # a collective's tensors are all on one device
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(result[0].device))

    def wait(self, timeout: Optional[timedelta] = None) -> bool:  # noqa: ARG002  # completes without waiting
        """Make the current stream wait for the copies (CUDA); nothing to wait for on the CPU."""
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        """True once the copies have run (at once on the CPU; when the event is reached on CUDA)."""
        return self._event is None or bool(self._event.query())

    def is_success(self) -> bool:
        """Always: nothing can fail after the copies were issued."""
        return True

    def exception(self) -> None:
        """No work fails after it is returned."""
        return None

    def source_rank(self) -> int:
        """Rank 0, the only rank there is (what a receive-from-any-source would report)."""
        return 0

    def result(self) -> List[torch.Tensor]:
        """The tensors the collective wrote."""
        return self._result

    def synchronize(self) -> None:
        """The same as :meth:`wait` (NCCL's work has both)."""
        self.wait()

    def get_future(self) -> torch.futures.Future:
        """A completed future holding :meth:`result` (CUDA-aware: ``then`` callbacks run after the copies)."""
        devices: List[Any] = sorted({t.device for t in self._result if t.is_cuda}, key=str)
        future: torch.futures.Future = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
        future.set_result(self._result)
        return future


def _not_supported(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"the {BACKEND_NAME!r} process group (benchmarks/simulated.py) does not implement {what}: it simulates "
        f"identical ranks, and {what} has no defined result there. Run this on gloo or NCCL with real ranks.")


def _op_type(op: Any) -> Any:
    """The plain ``RedOpType`` of ``op`` (``ReduceOp`` or ``ReduceOp.RedOpType``)."""
    op_type = getattr(op, "op", op)
    if op_type == _ReduceOp.PREMUL_SUM:
        raise _not_supported("ReduceOp.PREMUL_SUM")
    return op_type


def _reduce_identical(output: torch.Tensor, value: torch.Tensor, op: Any, world_size: int) -> None:
    """``output`` <- the reduction under ``op`` of ``world_size`` copies of ``value`` (may alias ``output``)."""
    op_type = _op_type(op)
    if op_type == _ReduceOp.SUM:
        torch.mul(value, world_size, out=output)
    elif op_type == _ReduceOp.PRODUCT:
        torch.pow(value, world_size, out=output)
    elif op_type == _ReduceOp.BXOR:
        if world_size % 2 == 0:
            output.zero_()
        elif output.data_ptr() != value.data_ptr():
            output.copy_(value)
    elif op_type in (_ReduceOp.AVG, _ReduceOp.MAX, _ReduceOp.MIN, _ReduceOp.BAND, _ReduceOp.BOR):
        if output.data_ptr() != value.data_ptr():
            output.copy_(value)
    else:
        raise _not_supported(f"the reduction {op!r}")


class SimulatedProcessGroup(_ProcessGroupBase):
    """``world_size`` identical ranks, played by this process as ``rank`` (see the module docstring).

    Built by ``dist.init_process_group(BACKEND_NAME, ...)`` or ``dist.new_group(..., backend=BACKEND_NAME)``
    after :func:`register`; not meant to be constructed directly."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self._rank = rank
        self._world_size = world_size
        self._group_name = ""  # set by torch.distributed when it registers the group
        self._group_desc = ""
        self.cpu_seconds = 0.0  # time spent inside this group's collectives (see _accounted)
        self.calls = 0  # collectives run
        self.reduce_ops: List[Tuple[str, str]] = []  # (collective, reduction asked for) per reduce-scatter and all-reduce

    # torch's C++ ProcessGroup keeps these names on its backends, and a Python group has none.
    def getGroupName(self) -> str:  # noqa: N802  # the C++ name torch's trampoline calls
        """The name torch.distributed gave this group."""
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        """Called by torch.distributed when it registers the group."""
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        """The description torch.distributed gave this group."""
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        """Called by torch.distributed when it registers the group."""
        self._group_desc = desc

    def getBackendName(self) -> str:  # noqa: N802  # the C++ name torch's trampoline calls
        """``"simulated"``."""
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"SimulatedProcessGroup(rank={self._rank}, world_size={self._world_size})"

    # -- all-gather ---------------------------------------------------------------------------
    def _gather_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if output.numel() != self._world_size * input.numel():
            raise ValueError(f"all_gather_into_tensor on {self!r}: output has {output.numel()} elements, expected "
                             f"world_size x input = {self._world_size} x {input.numel()}")
        output.view(self._world_size, -1).copy_(input.reshape(1, -1).expand(self._world_size, -1))

    @_accounted
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimulatedWork:
        """``all_gather_into_tensor``: ``input`` tiled ``W`` times."""
        self._gather_into(output, input)
        return SimulatedWork([output])

    _allgather_base = all_gather_single  # the name before torch 2.12

    @_accounted
    def all_gather_single_coalesced(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                                    opts: Any = None) -> SimulatedWork:
        """Several ``all_gather_into_tensor`` at once."""
        for output, input in zip(outputs, inputs, strict=True):
            self._gather_into(output, input)
        return SimulatedWork(list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # the name before torch 2.12

    @_accounted
    def allgather(self, output_lists: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor],
                  opts: Any = None) -> SimulatedWork:
        """``all_gather`` into a list: every entry a copy of the input."""
        written: List[torch.Tensor] = []
        for outputs, input in zip(output_lists, inputs, strict=True):
            if len(outputs) != self._world_size:
                raise ValueError(f"all_gather on {self!r}: {len(outputs)} output tensors, expected {self._world_size}")
            for output in outputs:
                output.copy_(input)
            written.extend(outputs)
        return SimulatedWork(written)

    @_accounted
    def allgather_coalesced(self, output_lists: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor],
                            opts: Any = None) -> SimulatedWork:
        """``all_gather_coalesced``: rank ``r``'s list of outputs receives rank ``r``'s inputs (here all equal)."""
        written: List[torch.Tensor] = []
        for outputs in output_lists:
            for output, input in zip(outputs, inputs, strict=True):
                output.copy_(input)
            written.extend(outputs)
        return SimulatedWork(written)

    # -- reductions ---------------------------------------------------------------------------
    @_accounted
    def allreduce(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> SimulatedWork:
        """``all_reduce`` in place (see the module docstring for each op)."""
        op = opts.reduceOp if opts is not None else _ReduceOp.SUM
        self.reduce_ops.append(("all_reduce", str(_op_type(op)).rsplit(".", 1)[-1]))
        for t in tensors:
            _reduce_identical(t, t, op, self._world_size)
        return SimulatedWork(list(tensors))

    allreduce_coalesced = allreduce

    @_accounted
    def reduce(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> SimulatedWork:
        """``reduce``: the root's tensors reduced, every other rank's unchanged."""
        if opts is None or opts.rootRank == self._rank:
            op = opts.reduceOp if opts is not None else _ReduceOp.SUM
            for t in tensors:
                _reduce_identical(t, t, op, self._world_size)
        return SimulatedWork(list(tensors))

    def _scatter_reduced(self, output: torch.Tensor, input: torch.Tensor, op: Any) -> None:
        self.reduce_ops.append(("reduce_scatter", str(_op_type(op)).rsplit(".", 1)[-1]))
        if input.numel() != self._world_size * output.numel():
            raise ValueError(f"reduce_scatter_tensor on {self!r}: input has {input.numel()} elements, expected "
                             f"world_size x output = {self._world_size} x {output.numel()}")
        mine = input.reshape(self._world_size, -1)[self._rank]
        _reduce_identical(output.view(-1), mine, op, self._world_size)

    @_accounted
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimulatedWork:
        """``reduce_scatter_tensor``: this rank's chunk of ``input`` reduced over ``W`` equal contributions."""
        self._scatter_reduced(output, input, opts.reduceOp if opts is not None else _ReduceOp.SUM)
        return SimulatedWork([output])

    _reduce_scatter_base = reduce_scatter_single  # the name before torch 2.12

    @_accounted
    def reduce_scatter_single_coalesced(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                                        opts: Any = None) -> SimulatedWork:
        """Several ``reduce_scatter_tensor`` at once."""
        op = opts.reduceOp if opts is not None else _ReduceOp.SUM
        for output, input in zip(outputs, inputs, strict=True):
            self._scatter_reduced(output, input, op)
        return SimulatedWork(list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # the name before torch 2.12

    @_accounted
    def reduce_scatter(self, outputs: Sequence[torch.Tensor], input_lists: Sequence[Sequence[torch.Tensor]],
                       opts: Any = None) -> SimulatedWork:
        """``reduce_scatter`` of lists: this rank's entry of each input list, reduced."""
        op = opts.reduceOp if opts is not None else _ReduceOp.SUM
        for output, inputs in zip(outputs, input_lists, strict=True):
            if len(inputs) != self._world_size:
                raise ValueError(f"reduce_scatter on {self!r}: {len(inputs)} input tensors, expected {self._world_size}")
            _reduce_identical(output, inputs[self._rank], op, self._world_size)
        return SimulatedWork(list(outputs))

    # -- data movement ------------------------------------------------------------------------
    @_accounted
    def broadcast(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> SimulatedWork:
        """Nothing to copy: every rank holds what the root holds."""
        return SimulatedWork(list(tensors))

    @_accounted
    def barrier(self, opts: Any = None) -> SimulatedWork:
        """Nothing to wait for."""
        return SimulatedWork([])

    @_accounted
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int],
                          input_split_sizes: Sequence[int], opts: Any = None) -> SimulatedWork:
        """Every peer sends this rank its chunk ``rank``, which equals this rank's own chunk ``rank``."""
        if not input_split_sizes:
            input_split_sizes = [input.size(0) // self._world_size] * self._world_size
        if not output_split_sizes:
            output_split_sizes = [output.size(0) // self._world_size] * self._world_size
        start = sum(input_split_sizes[: self._rank])
        mine = input.narrow(0, start, input_split_sizes[self._rank])
        offset = 0
        for size in output_split_sizes:
            output.narrow(0, offset, size).copy_(mine)
            offset += size
        return SimulatedWork([output])

    alltoall_base = all_to_all_single  # the name before torch 2.12

    @_accounted
    def alltoall(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], opts: Any = None) -> SimulatedWork:
        """``all_to_all`` of lists: every output is this rank's entry of the input list."""
        for output in outputs:
            output.copy_(inputs[self._rank])
        return SimulatedWork(list(outputs))

    @_accounted
    def gather(self, output_lists: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor],
               opts: Any = None) -> SimulatedWork:
        """The root's output list filled with copies of the input; nothing elsewhere."""
        written: List[torch.Tensor] = []
        if opts is None or opts.rootRank == self._rank:
            for outputs, input in zip(output_lists, inputs, strict=True):
                for output in outputs:
                    output.copy_(input)
                written.extend(outputs)
        return SimulatedWork(written)

    @_accounted
    def scatter(self, outputs: Sequence[torch.Tensor], input_lists: Sequence[Sequence[torch.Tensor]],
                opts: Any = None) -> SimulatedWork:
        """On the root: this rank's entry of the scatter list. Elsewhere the root's list is unknown here."""
        if opts is not None and opts.rootRank != self._rank:
            raise _not_supported("scatter to a rank other than the root")
        for output, inputs in zip(outputs, input_lists, strict=True):
            output.copy_(inputs[self._rank])
        return SimulatedWork(list(outputs))

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int) -> SimulatedWork:
        """Refused: see the module docstring."""
        raise _not_supported("point-to-point send")

    def recv(self, tensors: Sequence[torch.Tensor], src: int, tag: int) -> SimulatedWork:
        """Refused: see the module docstring."""
        raise _not_supported("point-to-point recv")

    def recv_anysource(self, tensors: Sequence[torch.Tensor], tag: int) -> SimulatedWork:
        """Refused: see the module docstring."""
        raise _not_supported("point-to-point recv")


def _create(store: Any, rank: int, world_size: int, timeout: timedelta) -> SimulatedProcessGroup:  # noqa: ARG001
    return SimulatedProcessGroup(rank, world_size)


def register() -> None:
    """Register the backend ``"simulated"`` for CPU and CUDA tensors (idempotent: registering again
    replaces the creator with the same one)."""
    dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
