"""Tests of tests/_harness.py, the spawn harness every distributed test relies on.

If these break, distributed tests can pass without running, hang the suite, or report the
wrong rank. The rank functions below are module-level so spawned ranks can unpickle them.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
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

HANG_TIMEOUT_S = 15.0
SUBTEST_GRID: dict[str, list[Any]] = {"strategy": ["FULL_SHARD", "NO_SHARD"], "size": [1, 2, 3]}
FAILING_COMBO = {"strategy": "NO_SHARD", "size": 2}


def _spawned_children() -> list[int]:
    """Pids of this process's spawned ranks still alive or unreaped (zombies), from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == os.getpid() and (b"spawn_main" in cmdline or state == "Z"):
            found.append(int(entry))
    return found


def _assert_no_children_left() -> None:
    assert multiprocessing.active_children() == []
    if os.path.isdir("/proc"):
        assert _spawned_children() == []


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
