"""Multi-process test harness: spawned gloo ranks, subtest grids, rank-tagged failures.

[Note: Harness protocol]
  parent  TCPStore master on port 0 (the OS picks a free port, so concurrent pytest-xdist
          workers never race for one); one process and one Pipe per rank, started by a
          forkserver that imported torch once (see [Note: Ranks from a forkserver]); waits on
          the pipes and process sentinels until every rank finished, the first failure is
          FAILURE_GRACE_S old, or the deadline passed; then kills the survivors.
  timeout counts from the moment the last rank is "ready", so spawn start-up (importing
          torch: seconds, or tens of seconds under pytest -n on a loaded machine) does not
          eat a test's time; start-up has its own limit, STARTUP_TIMEOUT_S.
  rank    own process group, dies with the test process (a lifeline pipe whose EOF kills
          the group). Sends ("ready", t) once
          its stack dumps are armed (after its imports), ("fn_done", t) when fn returns,
          ("finished", t) after barrier + teardown, or ("error", t, traceback) if
          anything raised; then os._exit (peers may be dead: no teardown). t is
          time.monotonic(), system-wide on Linux, so the earliest failure (the root cause)
          is reported, not the peers it broke.
  stacks  faulthandler writes a rank's stacks to its own file on a fatal signal and on
          SIGUSR1, which the parent sends at the deadline to ready ranks (before "ready"
          SIGUSR1 would kill it): a timeout shows where each rank hung.

[Note: Ranks from a forkserver]
  A spawned rank imports torch afresh: 1.2 s for one rank, 3 s for four on two cores, paid
  by every run_distributed call (hundreds per suite run). A forkserver imports torch, the
  library and this harness once per test process; each rank is a fork of it, so it starts in
  milliseconds and still behaves as a spawned rank: a fresh process (the test process's
  threads are not copied), sys.path and working directory set as spawn sets them, and the
  test process's environment at the call (passed in _RankSpec, since the forkserver's is
  the one from its own start). Nothing in the preloaded modules starts a thread or runs a
  tensor operation, so no thread pool is forked half-initialised.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import json
import math
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["RankError", "RankTimeoutError", "SubtestError", "run_distributed",
           "run_subtests", "world_sizes", "assert_close_ranks", "outcomes_through_files"]

FAILURE_GRACE_S = 3.0  # after the first failure, how long the other ranks get to exit
TERMINATE_GRACE_S = 1.0  # SIGTERM -> SIGKILL
STACK_DUMP_WAIT_S = 2.0  # how long the parent waits for the SIGUSR1 stack dumps
STARTUP_TIMEOUT_S = 90.0  # spawn to "ready" (imports), for every rank
PG_TIMEOUT_SLACK_S = 60.0  # gloo times out after the harness, so the harness reports first
# gloo's errors when a peer's sockets close (its tcp/pair.cc); see _lost_a_peer.
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
# Imported once by the forkserver, so that ranks start without importing them.
_PRELOAD = ["torch", "torch.distributed", "composable_shard", "tests._harness", "tests._models", "tests._preload"]
# Room for str(dtype) of every dtype this torch has (the same torch on every rank).
_DTYPE_NAME_BYTES = max(len(str(v)) for v in vars(torch).values() if isinstance(v, torch.dtype))


class RankError(AssertionError):
    """A rank raised or died; the message starts with ``rank {r} failed:``."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


class RankTimeoutError(AssertionError):
    """Not every rank finished within the timeout; names the hung ranks, with stacks."""

    def __init__(self, hung_ranks: list[int], message: str) -> None:
        super().__init__(message)
        self.hung_ranks = hung_ranks


class SubtestError(AssertionError):
    """One combination of a ``run_subtests`` grid failed; chained to the original error."""


@dataclass(frozen=True)
class _RankSpec:
    """Everything a spawned rank needs; pickled to it."""

    rank: int
    world_size: int
    port: int  # of the parent's TCPStore
    parent_pid: int  # the test process: a rank that finds it gone exits at once
    environ: dict[str, str]  # the test process's environment at the call
    stack_path: str  # this rank's faulthandler output
    pg_timeout_s: float
    backend: str  # of the process group: "gloo", or "nccl" (rank r on cuda:r)
    fn: Callable[..., None]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class _RankProc:
    """The parent's record of one rank."""

    rank: int
    process: BaseProcess
    conn: Optional[Connection]  # read end; None once closed
    lifeline: Connection  # write end of the rank's lifeline; closed when the call ends
    stack_path: str
    ready_at: float = math.inf  # time.monotonic() when imports were done, stack dumps armed
    fn_done: bool = False  # fn returned
    finished: bool = False  # barrier + teardown done too
    exited: bool = False  # reaped by _on_exit or _kill_all
    killed: bool = False  # still running at the end, so killed by the parent
    failed_at: float = math.inf  # time.monotonic() of the rank's first failure
    gone_at: float = math.inf  # last time seen alive before its pipe reached EOF
    report: str = ""  # traceback or exit description of that failure


def world_sizes() -> list[int]:
    """World sizes distributed tests are parametrized over: 1 (degenerate group), 2 and 4
    (uneven chunks, more than two peers). Without 1 and 4, off-by-one padding and
    single-rank shortcuts go untested."""
    return [1, 2, 4]


def run_distributed(
    fn: Callable[..., None], world_size: int, *args: Any, timeout: float = 120.0, backend: str = "gloo",
    **kwargs: Any
) -> None:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned ranks in one gloo process group
    (``backend="nccl"``: an NCCL group, rank r on ``cuda:r``, for the CUDA suite in tests/cuda).

    ``fn`` must be a module-level function (pickled by reference); it reads its rank with
    ``dist.get_rank()``. Raises ``RankError`` for the first rank that raised or died (the
    root cause, not the peers stuck waiting for it), or ``RankTimeoutError`` naming the
    ranks that hung, with their stacks, if not all finished within ``timeout`` seconds of
    the last rank starting (after its imports; start-up itself may take up to
    STARTUP_TIMEOUT_S). No rank outlives the call. Without it a rank's failed assertion
    never reaches pytest and a hang stalls the whole suite.
    """
    __tracebackhide__ = True  # pytest shows the failure at the test's call, not in here
    _check_arguments(fn, world_size, timeout, backend)
    ctx = _rank_context()
    pg_timeout_s = timeout + PG_TIMEOUT_SLACK_S
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,  # type: ignore[attr-defined]  # public, re-exported without __all__
                          wait_for_workers=False, timeout=timedelta(seconds=pg_timeout_s))
    stack_dir = tempfile.mkdtemp(prefix="cs_harness_")
    start = time.monotonic()
    procs: list[_RankProc] = []
    try:
        for rank in range(world_size):
            stack_path = os.path.join(stack_dir, f"rank{rank}.txt")
            spec = _RankSpec(rank, world_size, store.port, os.getpid(), dict(os.environ),
                             stack_path, pg_timeout_s, backend, fn, args, dict(kwargs))
            procs.append(_start_rank(ctx, spec))
        _supervise(procs, start, timeout)
        if not any(proc.failed_at < math.inf for proc in procs):
            _dump_stacks(procs)  # a timeout (if any rank runs): record where, before killing
        _kill_all(procs)
        name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"
        describe = f"run_distributed({name}, world_size={world_size})"
        error = _build_error(procs, describe, timeout)
    finally:
        _kill_all(procs)
        for proc in procs:
            _close_conn(proc)
            proc.lifeline.close()
        shutil.rmtree(stack_dir, ignore_errors=True)
    del store
    if error is not None:
        raise error


def run_subtests(fn: Callable[..., None], grid: Mapping[str, Sequence[Any]], **fixed: Any) -> None:
    """Inside a rank, run ``fn(**combo, **fixed)`` for every combination of ``grid``
    (``itertools.product`` in key order), with a barrier after each so ranks stay in step.

    A failure raises ``SubtestError("subtest {combo} failed: ...")`` chained to the original,
    so the report says which parametrization broke, not only that one did. Without a
    process group (unit tests) the barrier is skipped.
    """
    overlap = sorted(set(grid) & set(fixed))
    if overlap:
        raise ValueError(f"run_subtests: keys {overlap} are both in grid and fixed")
    empty = [key for key, values in grid.items() if len(values) == 0]
    if not grid or empty:  # a grid of no combination would run nothing and pass
        raise ValueError(f"run_subtests: the grid has no combination (empty: {empty or 'the grid itself'})")
    for values in itertools.product(*grid.values()):
        combo = dict(zip(grid, values))
        try:
            fn(**combo, **fixed)
        except Exception as exc:
            raise SubtestError(f"subtest {combo} failed: {type(exc).__name__}: {exc}") from exc
        if dist.is_available() and dist.is_initialized():
            dist.barrier()


def outcomes_through_files(directory: str, outcome: Dict[str, Any], deadline_s: float, call: str) -> List[Dict[str, Any]]:
    """Inside a rank, every rank's ``outcome`` (JSON), exchanged through files in ``directory``:
    no collective, so a rank stuck in one is not freed by it. Raises if a rank has not written
    its own within ``deadline_s`` of this rank's (it waits in a collective the others never
    joined); ``call`` names what the ranks were running, for that message."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f".{rank}"), "w") as f:
        json.dump(outcome, f)
    os.replace(os.path.join(directory, f".{rank}"), os.path.join(directory, f"{rank}.json"))
    paths = [os.path.join(directory, f"{r}.json") for r in range(world_size)]
    deadline = time.monotonic() + deadline_s
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            missing = [r for r, p in enumerate(paths) if not os.path.exists(p)]
            raise AssertionError(f"ranks {missing} did not return from {call} within {deadline_s} s of rank {rank}'s "
                                 f"outcome {outcome}: they wait in a collective the refusing rank never joins")
        time.sleep(0.02)
    outcomes = []
    for p in paths:
        with open(p) as f:
            outcomes.append(json.load(f))
    return outcomes


def assert_close_ranks(t: torch.Tensor, name: str) -> None:
    """Inside a rank, check ``t`` is bitwise identical on every rank (NaNs in the same places).

    Every rank gathers all copies and raises the same ``AssertionError`` naming the ranks
    that differ from rank 0, so no rank is left waiting in a collective. Without it,
    replicas drifting apart (a missed all-reduce, a rank-dependent seed) go unnoticed.
    """
    world_size = dist.get_world_size()
    metas = _gather_shape_dtype(t, world_size)
    if any(meta != metas[0] for meta in metas):
        raise AssertionError(f"assert_close_ranks({name!r}): (shape, dtype) differ across "
                             f"ranks: {dict(enumerate(metas))}")
    local = t.detach().contiguous()
    local = local.to(torch.uint8) if local.dtype == torch.bool else local  # gloo has no bool
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    differing = [rank for rank, other in enumerate(gathered) if not _identical(other, gathered[0])]
    if differing:
        diffs = {rank: _max_abs_diff(gathered[rank], gathered[0]) for rank in differing}
        raise AssertionError(f"assert_close_ranks({name!r}) on rank {dist.get_rank()}: "
                             f"{_ranks_phrase(differing)} differ from rank 0 "
                             f"(max abs diff per rank: {diffs})")


def _gather_shape_dtype(t: torch.Tensor, world_size: int) -> list[tuple[tuple[int, ...], str]]:
    """Every rank's ``(shape, str(dtype))``, with tensor all-gathers only: first a fixed-size
    header (ndim, dtype name as bytes), then the shapes padded to the largest ndim.
    ``dist.all_gather_object`` would need numpy, which the test extras do not install."""
    name = str(t.dtype).encode()  # fits: see _DTYPE_NAME_BYTES
    header = torch.zeros(1 + _DTYPE_NAME_BYTES, dtype=torch.int64, device=t.device)
    header[0] = t.dim()
    header[1:1 + len(name)] = torch.tensor(list(name), dtype=torch.int64)
    headers = [torch.empty_like(header) for _ in range(world_size)]
    dist.all_gather(headers, header)
    max_ndim = max(int(h[0]) for h in headers)
    shape = torch.full((max(max_ndim, 1),), -1, dtype=torch.int64, device=t.device)
    shape[:t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    shapes = [torch.empty_like(shape) for _ in range(world_size)]
    dist.all_gather(shapes, shape)
    metas: list[tuple[tuple[int, ...], str]] = []
    for h, s in zip(headers, shapes):
        ndim, codes = int(h[0]), [int(c) for c in h[1:].tolist() if c]
        metas.append((tuple(int(d) for d in s[:ndim].tolist()), bytes(codes).decode()))
    return metas


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    a_nan, b_nan = torch.isnan(a), torch.isnan(b)
    return torch.equal(a_nan, b_nan) and torch.equal(a[~a_nan], b[~b_nan])


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    diff = (a.to(torch.complex128) - b.to(torch.complex128)).abs()
    return float(diff.max()) if diff.numel() else 0.0


def _check_arguments(fn: Callable[..., None], world_size: int, timeout: float, backend: str) -> None:
    qualname = getattr(fn, "__qualname__", "")  # functools.partial has none, and pickles
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(f"run_distributed: fn must be a module-level function (it is pickled "
                        f"by reference into spawned ranks), got {fn!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_distributed: world_size must be an int >= 1, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"run_distributed: timeout must be > 0 seconds, got {timeout!r}")
    if backend not in ("gloo", "nccl"):  # fn's own argument of that name goes positionally
        raise ValueError(f"run_distributed: backend must be 'gloo' or 'nccl' (the process group's), got {backend!r}")


def _rank_context() -> BaseContext:
    """The forkserver context, preloaded; see [Note: Ranks from a forkserver]."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when this process starts its server
    return ctx


def _start_rank(ctx: BaseContext, spec: _RankSpec) -> _RankProc:
    reader, writer = ctx.Pipe(duplex=False)
    lifeline_reader, lifeline = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_rank_main, args=(spec, writer, lifeline_reader), name=f"rank{spec.rank}")
    try:
        process.start()
    finally:
        writer.close()  # else the reader never sees EOF when the rank exits
        lifeline_reader.close()  # else the rank never sees EOF when this process dies
    return _RankProc(spec.rank, process, reader, lifeline, spec.stack_path)


def _rank_main(spec: _RankSpec, conn: Connection, lifeline: Connection) -> None:
    """Entry point of a rank; see [Note: Harness protocol]."""
    try:
        _detach_and_die_with_test_process(spec.parent_pid, lifeline)
        os.environ.clear()
        os.environ.update(spec.environ)
        # see [Note: The other worker yields] in conftest.py (the forkserver may run at it already)
        os.nice(max(0, int(os.environ.get("COMPOSABLE_SHARD_TEST_NICENESS", "0")) - os.nice(0)))
        stack_file = open(spec.stack_path, "w")  # stays open: faulthandler writes to its fd
        faulthandler.enable(file=stack_file, all_threads=True)
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        conn.send(("ready", time.monotonic(), ""))
        torch.set_num_threads(1)
        pg_timeout = timedelta(seconds=spec.pg_timeout_s)
        store = dist.TCPStore("127.0.0.1", spec.port, spec.world_size, is_master=False,  # type: ignore[attr-defined]  # as above
                              timeout=pg_timeout)
        if spec.backend == "nccl":  # one device per rank, current before NCCL picks one
            torch.cuda.set_device(spec.rank)
        dist.init_process_group(spec.backend, store=store, rank=spec.rank,
                                world_size=spec.world_size, timeout=pg_timeout)
        spec.fn(*spec.args, **spec.kwargs)
        conn.send(("fn_done", time.monotonic(), ""))
        dist.barrier()
        dist.destroy_process_group()
        conn.send(("finished", time.monotonic(), ""))
        code = 0
    except BaseException:
        code = 1
        with contextlib.suppress(Exception):
            conn.send(("error", time.monotonic(), traceback.format_exc()))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skips interpreter teardown: ~1.5 s with torch, and may block on peers


def _detach_and_die_with_test_process(test_pid: int, lifeline: Connection) -> None:
    """Own process group: the test process kills it with killpg (grandchildren too) and a
    terminal's Ctrl-C reaches only the test process, which then kills the ranks. The
    lifeline's write end lives only in the test process: when it dies, even by SIGKILL, the
    read ends EOF and a watcher thread kills the rank's group, so no orphan keeps a core
    busy. (Not PDEATHSIG: the parent is the forkserver, which outlives the test process for
    as long as its children hold the descriptor that keeps it alive.)"""
    os.setpgid(0, 0)
    threading.Thread(target=_kill_group_at_eof, args=(lifeline,), name="lifeline", daemon=True).start()
    if not _alive(test_pid):  # gone before the watcher started
        os._exit(1)


def _kill_group_at_eof(lifeline: Connection) -> None:
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv()  # nothing is ever sent: returns at EOF
    os.killpg(0, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _supervise(procs: list[_RankProc], start: float, timeout: float) -> None:
    """Post: every rank exited, or the first failure is FAILURE_GRACE_S old, or the
    deadline passed (survivors still run). See [Note: Harness protocol] for the deadline."""
    while True:
        running = [proc for proc in procs if not proc.exited]
        last_ready = max(proc.ready_at for proc in procs)
        deadline = last_ready + timeout if last_ready < math.inf else start + STARTUP_TIMEOUT_S
        limit = min(deadline, min(proc.failed_at for proc in procs) + FAILURE_GRACE_S)
        now = time.monotonic()
        if not running or now >= limit:
            return
        waitables: list[Any] = [proc.conn for proc in procs if proc.conn is not None]
        ready = wait(waitables + [proc.process.sentinel for proc in running], limit - now)
        for proc in procs:
            if proc.conn is not None and proc.conn in ready:
                _drain(proc)
                if proc.conn is None:  # EOF: the rank exited (only it holds the write end)
                    proc.gone_at = min(proc.gone_at, now)
            if not proc.exited and proc.process.sentinel in ready:
                _on_exit(proc, last_seen_alive=now)


def _drain(proc: _RankProc) -> None:
    while proc.conn is not None and proc.conn.poll():
        try:
            kind, when, text = proc.conn.recv()
        except EOFError:
            _close_conn(proc)
            return
        proc.ready_at = when if kind == "ready" else proc.ready_at
        proc.fn_done |= kind == "fn_done"
        proc.finished |= kind == "finished"
        if kind == "error" and proc.failed_at == math.inf:
            proc.failed_at, proc.report = when, text


def _on_exit(proc: _RankProc, last_seen_alive: float) -> None:
    """Reap an exited rank. An exit without a reported exception is a failure dated
    ``last_seen_alive`` or, if earlier, when its pipe reached EOF (the forkserver reports an
    exit only after reaping it, later than a peer's error can arrive): the earliest it can
    have died, so a peer's "connection reset" error counts as its consequence, not as the
    root cause."""
    proc.process.join()
    proc.exited = True
    _drain(proc)  # the rank sent before exiting, so its messages are already in the pipe
    code = proc.process.exitcode
    if proc.failed_at < math.inf or (code == 0 and proc.finished):
        return
    how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"code {code}"
    stage = "after returning from fn" if proc.fn_done else "inside fn or setup"
    dump = _read(proc.stack_path)  # faulthandler's report of a fatal signal, if any
    proc.failed_at = min(last_seen_alive, proc.gone_at)  # a forkserver reports exits late
    proc.report = f"process exited with {how} {stage}, without raising a Python exception"
    proc.report += f"\n{dump}" if dump else ""


def _dump_stacks(procs: list[_RankProc]) -> None:
    """Ask every running, ready rank's faulthandler for its stacks (SIGUSR1); wait for them."""
    for proc in procs:
        _drain(proc)  # a "ready" may have arrived just now
    running = [proc for proc in procs if not proc.exited and proc.ready_at < math.inf]
    for proc in running:
        _signal(proc.process, signal.SIGUSR1, group=False)
    end = time.monotonic() + (STACK_DUMP_WAIT_S if running else 0.0)
    while time.monotonic() < end and not all(_read(proc.stack_path) for proc in running):
        time.sleep(0.05)
    time.sleep(0.1 if running else 0.0)  # let the last dump finish writing


def _kill_all(procs: list[_RankProc]) -> None:
    """SIGTERM every running rank's process group, SIGKILL what is left after a grace."""
    for proc in procs:
        if not proc.exited and proc.process.exitcode is not None:
            _on_exit(proc, last_seen_alive=time.monotonic())  # exited on its own just now
    alive = [proc for proc in procs if not proc.exited]
    for proc in alive:
        _signal(proc.process, signal.SIGTERM, group=True)
    end = time.monotonic() + TERMINATE_GRACE_S
    for proc in alive:
        proc.process.join(max(end - time.monotonic(), 0.0))
    for proc in alive:
        if proc.process.is_alive():
            _signal(proc.process, signal.SIGKILL, group=True)
        proc.process.join()
        proc.exited = proc.killed = True


def _signal(process: BaseProcess, sig: signal.Signals, group: bool) -> None:
    """Signal a started, unreaped rank (so its pid cannot have been reused) or its group."""
    pid = process.pid
    if pid is None or pid <= 1:  # os.kill(-1 or 0, ...) would hit other processes
        raise RuntimeError(f"run_distributed: refusing to signal pid {pid!r}")
    with contextlib.suppress(ProcessLookupError):
        try:
            os.killpg(pid, sig) if group else os.kill(pid, sig)
        except ProcessLookupError:  # the rank has not made its own process group yet
            os.kill(pid, sig)


def _close_conn(proc: _RankProc) -> None:
    if proc.conn is not None:
        proc.conn.close()
        proc.conn = None


def _read(path: str) -> str:
    with contextlib.suppress(OSError), open(path) as f:
        return f.read().strip()
    return ""


def _ranks_phrase(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _lost_a_peer(report: str) -> bool:
    """Whether a rank's failure is gloo losing its connection to a peer: the consequence of a
    peer's exit, never the root cause while another rank failed. Time alone cannot tell: a
    rank killed by a signal closes its sockets before the kernel closes its pipe to this
    process, so a peer's "connection reset" error can arrive first (seen under load)."""
    lines = report.strip().splitlines()
    return bool(lines) and any(text in lines[-1] for text in _PEER_LOST)


def _build_error(procs: list[_RankProc], describe: str, timeout: float) -> Optional[AssertionError]:
    failed = sorted((proc for proc in procs if proc.failed_at < math.inf),
                    key=lambda p: (_lost_a_peer(p.report), p.failed_at))
    killed = [proc for proc in procs if proc.killed]
    if failed:
        notes = [f"rank {p.rank} also failed afterwards: {p.report.strip().splitlines()[-1]}"
                 for p in failed[1:] if p.report.strip()]
        if killed:
            notes.append(f"{_ranks_phrase([p.rank for p in killed])} still running "
                         f"{FAILURE_GRACE_S:g} s after the first failure, killed")
        context = f"\n[{describe}]" + "".join(f"\n  {note}" for note in notes)
        return RankError(failed[0].rank, f"rank {failed[0].rank} failed:\n{failed[0].report}{context}")
    if not killed:
        return None
    hung = [p for p in killed if not p.fn_done] or killed
    started = all(proc.ready_at < math.inf for proc in procs)
    why = f"{timeout:g} s after all ranks started" if started else f"{STARTUP_TIMEOUT_S:g} s start-up"
    lines = [f"{describe} timed out ({why}): {_ranks_phrase([p.rank for p in hung])} hung"]
    waiting = [p.rank for p in killed if p not in hung]
    if waiting:
        lines.append(f"{_ranks_phrase(waiting)} returned from fn and waited for the others")
    for proc in hung:
        where = ("in the final barrier or teardown" if proc.fn_done else "inside fn or setup"
                 if proc.ready_at < math.inf else "still in spawn start-up (imports), no stack")
        lines.append(f"--- rank {proc.rank}: {where} ---\n{_read(proc.stack_path)}".rstrip())
    return RankTimeoutError([p.rank for p in hung], "\n".join(lines))
