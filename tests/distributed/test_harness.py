"""Tests of tests/_harness.py, the spawn harness every distributed test relies on.

If these break, distributed tests can pass without running, hang the suite, or report the
wrong rank. The rank functions below are module-level so spawned ranks can unpickle them.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._harness import (
    RankError,
    RankTimeoutError,
    SubtestError,
    assert_close_ranks,
    run_distributed,
    run_subtests,
    world_sizes,
)

HANG_TIMEOUT_S = 6.0  # long enough for a loaded machine to run rank 0 to its end; the test sleeps this long
SUBTEST_GRID: dict[str, list[Any]] = {"strategy": ["FULL_SHARD", "NO_SHARD"], "size": [1, 2, 3]}
FAILING_COMBO = {"strategy": "NO_SHARD", "size": 2}


def _processes() -> dict[int, tuple[int, str, bytes]]:
    """pid -> (parent pid, state, command line) of every process, from /proc."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        found[int(entry)] = (int(ppid), state, cmdline)
    return found


def _rank_processes(test_pid: int) -> list[int]:
    """Pids of the test process's ranks still alive or unreaped (zombies): children of its
    forkserver (see [Note: Ranks from a forkserver]), or spawned children of its own."""
    table = _processes()
    forkservers = {pid for pid, (ppid, _, cmd) in table.items() if ppid == test_pid and b"forkserver" in cmd}
    return [pid for pid, (ppid, state, cmd) in table.items()
            if ppid in forkservers or (ppid == test_pid and (b"spawn_main" in cmd or state == "Z"))]


def _assert_no_children_left() -> None:
    assert multiprocessing.active_children() == []
    if os.path.isdir("/proc"):
        assert _rank_processes(os.getpid()) == []


def _all_reduce_sum(out_dir: str) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    assert_close_ranks(total, "total")
    Path(out_dir, f"rank{rank}.txt").write_text(f"{world_size} {total.item()}")


def _hang_on_rank_one() -> None:
    if dist.get_rank() == 1:
        _sleep_forever()


def _sleep_forever() -> None:
    while True:
        time.sleep(1.0)


def _raise_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    dist.all_reduce(torch.ones(1))  # rank 1 never joins: rank 0 is stuck here


def _exit_on_rank_one() -> None:
    if dist.get_rank() == 1:
        os._exit(7)
    dist.all_reduce(torch.ones(1))


def _segfault() -> None:
    ctypes.string_at(0)  # reads address 0: SIGSEGV


def _check_helpers_then_fail_a_subtest() -> None:
    seen: list[dict[str, Any]] = []
    run_subtests(lambda **kw: seen.append(kw), SUBTEST_GRID, fixed=0)
    expected = [{"strategy": s, "size": n, "fixed": 0} for s in ["FULL_SHARD", "NO_SHARD"] for n in [1, 2, 3]]
    if seen != expected:
        raise AssertionError(f"combos ran as {seen}, expected {expected}")
    try:
        assert_close_ranks(torch.tensor([1.0, float(dist.get_rank() == 1)]), "weights")
    except AssertionError as exc:
        if "assert_close_ranks('weights')" not in str(exc) or "rank 1 differ" not in str(exc):
            raise AssertionError(f"assert_close_ranks message lacks name or rank: {exc}") from exc
    else:
        raise AssertionError("assert_close_ranks missed a difference on rank 1")

    def fail_on_combo(strategy: str, size: int) -> None:
        if {"strategy": strategy, "size": size} == FAILING_COMBO:
            raise RuntimeError("bad numerics")

    run_subtests(fail_on_combo, SUBTEST_GRID)


@pytest.mark.parametrize("world_size", world_sizes())
def test_all_reduce_sums_over_ranks(world_size: int, tmp_path: Path) -> None:
    """Every rank runs fn in one group of the right size: without it, tests pass vacuously."""
    run_distributed(_all_reduce_sum, world_size, str(tmp_path), timeout=60.0)
    expected = float(sum(range(1, world_size + 1)))
    results = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert results == {f"rank{r}.txt": f"{world_size} {expected}" for r in range(world_size)}
    _assert_no_children_left()


def test_hang_is_killed_and_reported_with_stack() -> None:
    """A hung rank fails the test within the timeout, named, with where it hung."""
    start = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        run_distributed(_hang_on_rank_one, 2, timeout=HANG_TIMEOUT_S)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "rank 1 hung" in message and "--- rank 1: inside fn or setup ---" in message, message
    assert "in _sleep_forever" in message and "in _hang_on_rank_one" in message, message
    assert "rank 0 returned from fn" in message, message
    assert info.value.hung_ranks == [1]
    assert HANG_TIMEOUT_S <= elapsed < 60.0, elapsed
    _assert_no_children_left()


def test_exception_on_one_rank_reports_that_rank() -> None:
    """The raising rank (the root cause) is reported, not the peer stuck waiting for it."""
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_distributed(_raise_on_rank_one, 2, timeout=60.0)
    message = str(info.value)
    assert message.startswith("rank 1 failed:\nTraceback"), message
    assert "ValueError: boom from rank one" in message and "in _raise_on_rank_one" in message
    assert info.value.rank == 1 and "hung" not in message and "timed out" not in message
    assert time.monotonic() - start < 45.0  # not the 60 s timeout: rank 0 was not waited for
    _assert_no_children_left()


def test_rank_dying_without_exception_reports_exit_code() -> None:
    """A rank that exits (os._exit, segfault) is a failure with its exit code, not a hang."""
    with pytest.raises(RankError) as info:
        run_distributed(_exit_on_rank_one, 2, timeout=60.0)
    assert str(info.value).startswith("rank 1 failed:\nprocess exited with code 7"), str(info.value)
    _assert_no_children_left()


def _peer_error_before_the_death() -> None:
    """Rank 1 raises gloo's peer-loss error at once; rank 0 exits silently 0.5 s later: the
    order in which a killed rank's peer can be seen (see _lost_a_peer), made deterministic. The
    barrier first: without it, rank 1 could exit while rank 0 was still connecting to it, and
    rank 0 then failed inside init with a peer-loss error of its own (seen once under load)."""
    dist.barrier()
    if dist.get_rank() == 1:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1234: Connection reset by peer")
    time.sleep(0.5)
    os._exit(9)


def test_peer_loss_error_is_not_reported_as_the_root_cause() -> None:
    """A gloo "connection reset by peer" error is a consequence of a peer's exit, so the rank
    that exited is reported even when the error was seen first."""
    with pytest.raises(RankError) as info:
        run_distributed(_peer_error_before_the_death, 2, timeout=60.0)
    message = str(info.value)
    assert info.value.rank == 0 and message.startswith("rank 0 failed:\nprocess exited with code 9"), message
    assert "rank 1 also failed afterwards: RuntimeError: [gloo" in message, message
    _assert_no_children_left()


def test_segfault_reports_signal_and_stack() -> None:
    """A crashing rank reports its signal and faulthandler's stack of where it crashed."""
    with pytest.raises(RankError) as info:
        run_distributed(_segfault, 1, timeout=60.0)
    message = str(info.value)
    assert message.startswith("rank 0 failed:\nprocess exited with signal SIGSEGV"), message
    assert "Segmentation fault" in message and "in _segfault" in message, message
    _assert_no_children_left()


def test_in_rank_helpers_and_failing_subtest_names_combo() -> None:
    """Subtest combos run in product order; assert_close_ranks names a drifting rank; a
    failing combo reaches pytest with its parameters and the original error."""
    with pytest.raises(RankError) as info:
        run_distributed(_check_helpers_then_fail_a_subtest, 2, timeout=60.0)
    message = str(info.value)
    assert f"SubtestError: subtest {FAILING_COMBO} failed: RuntimeError: bad numerics" in message
    assert "RuntimeError: bad numerics" in message.split("direct cause")[0], message


def test_subtests_validate_and_chain_without_process_group() -> None:
    """Grid/fixed clashes are rejected; the original error is the __cause__."""
    with pytest.raises(ValueError, match="both in grid and fixed"):
        run_subtests(lambda **kw: None, {"a": [1]}, a=2)

    def only_one(a: int) -> None:
        {1: None}[a]

    with pytest.raises(SubtestError, match=r"subtest \{'a': 2\} failed: KeyError") as info:
        run_subtests(only_one, {"a": [1, 2]})
    assert isinstance(info.value.__cause__, KeyError)
    for empty in ({}, {"a": [1], "b": []}):  # no combination: nothing would run, and it would pass
        with pytest.raises(ValueError, match="no combination"):
            run_subtests(lambda **kw: None, empty)


def test_back_to_back_runs_get_fresh_ports(tmp_path: Path) -> None:
    """Two runs in a row each get their own OS-picked store port: no EADDRINUSE flakes."""
    for attempt in range(2):
        out_dir = tmp_path / str(attempt)
        out_dir.mkdir()
        run_distributed(_all_reduce_sum, 1, str(out_dir), timeout=60.0)
        assert [p.read_text() for p in out_dir.iterdir()] == ["1 1.0"]
    _assert_no_children_left()


def test_rejects_unpicklable_fn() -> None:
    """A local function would fail obscurely inside spawn; it is rejected up front."""

    def local_fn() -> None:
        pass

    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(local_fn, 2)


def _write_pid_and_sleep(out_dir: str) -> None:
    Path(out_dir, f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))
    _sleep_forever()


_KILLED_PARENT = """
import sys
from tests._harness import run_distributed
from tests.distributed.test_harness import _write_pid_and_sleep
run_distributed(_write_pid_and_sleep, 2, sys.argv[1], timeout=300.0)
"""


def test_ranks_die_with_a_killed_test_process(tmp_path: Path) -> None:
    """A test process killed by SIGKILL (no cleanup runs) takes its ranks along: their
    lifelines reach EOF and each rank kills its group. No orphan keeps a core busy. (With
    PDEATHSIG alone they survived: their parent, the forkserver, outlives the test process.)"""
    root = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen([sys.executable, "-c", _KILLED_PARENT, str(tmp_path)], cwd=root)
    try:
        deadline = time.monotonic() + 120.0
        while len(list(tmp_path.glob("*.pid"))) < 2:
            assert parent.poll() is None, f"the test process exited early with {parent.returncode}"
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.1)
        ranks = sorted(int(f.read_text()) for f in tmp_path.glob("*.pid"))
        assert sorted(_rank_processes(parent.pid)) == ranks  # what the other tests rely on
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 30.0
    alive = ranks
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in ranks if _running(pid)]
    assert alive == [], f"ranks {alive} outlived their killed test process"


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
