"""The library's small synchronous exchanges (the cross-rank agreements before collectives that
must match, and ``all_gather_json``), and what happens when the ranks are not in the same one
([Note: Exchanges name themselves] in ``_runtime/collectives.py``).

A user who calls a collective API on one rank only -- ``if rank == 0: sd = model.state_dict()``
before the first forward -- met the other ranks' next exchange (the first forward's layout
check): the two gathers paired up, rank 0 read rank 1's layout digest as its optimizer step count
and raised that the optimizer had stepped 3.7e18 times on rank 1, and rank 1 died of "Connection
closed by peer". Each exchange now carries what it is about, in a frame of a fixed size, and every
rank raises naming what it was doing and which ranks were elsewhere; the group stays usable.
"""

from __future__ import annotations

from typing import List

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import fully_shard
from composable_shard._runtime import collectives
from composable_shard._runtime.collectives import record_collectives
from tests._harness import run_distributed


def _values(rank: int, count: int) -> List[int]:
    """This rank's ``count`` values: different per rank and position, with signs and 64-bit sizes."""
    return [(-1) ** i * (rank * 1000 + i) * 2 ** (i * 4) for i in range(count)]


def _exchanges_return_every_ranks_values() -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    groups = [(None, list(range(world_size)))]
    if world_size == 4:  # a subgroup in an order of its own: rows in the group's rank order
        members = [3, 1]
        groups.append((dist.new_group(members), sorted(members)))
    for group, members in groups:
        if rank not in members:
            continue
        for count in (0, 1, 6, 7, 13):  # 7 and 13: more than a frame holds, the rest in a second gather
            with record_collectives() as rec:
                rows = collectives.exchange(_values(rank, count), group, tag=f"count {count}")
            assert rows == [_values(r, count) for r in members], (count, rows)
            extra = [("exchange", 8 * (count - 6))] if count > 6 else []
            assert [(r.kind, r.nbytes) for r in rec.records] == [("exchange", 64)] + extra, (count, rec.records)
        objects = collectives.all_gather_json({"rank": rank, "text": "x" * (rank * 37)}, group, tag="json")
        assert objects == [{"rank": r, "text": "x" * (r * 37)} for r in members], objects
    dist.barrier()


def _other(rank: int, what: str) -> str:
    return f"rank {rank} was exchanging {what!r} with its process group"


def _ranks_in_different_exchanges_raise_on_every_rank() -> None:
    """Rank 0 in another exchange than the rest (the same count of values, then another count,
    then one with more values than a frame holds against one with fewer): every rank raises,
    naming its own exchange and the ranks that were elsewhere, with the hint of its call; the
    group then works (nothing was left half sent)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    others = list(range(1, world_size))
    for mine, theirs in (((2, "A"), (2, "B")), ((2, "A"), (3, "A")), ((9, "A"), (1, "A"))):
        count, tag = mine if rank == 0 else theirs
        with pytest.raises(RuntimeError) as raised:
            collectives.exchange(_values(rank, count), None, tag=tag, hint="THE HINT")
        message = str(raised.value)
        assert _other(rank, tag) in message and "THE HINT" in message, message
        assert f"rank(s) {others if rank == 0 else [0]} were in another collective" in message, message
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == world_size


def _state_dict_on_rank_0_only_before_the_first_forward() -> None:
    """The user's case: every rank raises at once (no wait for the group's timeout, no "Connection
    closed by peer"), rank 0 naming the state dict and saying it is collective."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    fully_shard(model[0])
    fully_shard(model)
    with pytest.raises(RuntimeError) as raised:
        if rank == 0:
            model.state_dict()
        else:
            model(torch.randn(2, 8))
    message = str(raised.value)
    if rank == 0:
        assert _other(0, "state_dict(): optimizer steps since the last synced backward") in message, message
        assert "is collective: every rank of the process group must call it" in message, message
        assert f"rank(s) {list(range(1, dist.get_world_size()))} were in another collective" in message, message
    else:
        assert _other(rank, "lazy_init_check") in message and "rank(s) [0] were in another collective" in message, \
            message
    dist.barrier()


def _exchanges_in_flight_pair_by_kind_and_handle() -> None:
    """[Note: Collectives on gloo]: the library's all-gathers and reduce-scatters run as
    point-to-point messages on gloo, tagged by kind and by handle (``match``), and gloo pairs a
    message with the receive of its tag. Two exchanges in flight at once, posted in opposite
    orders on rank 0 and on the others, must each land where it belongs: were two of them to
    share a tag, rank 0 would receive the peer's other message in its place (the messages are
    all 4 floats, so gloo cannot tell them apart by size), and train on another handle's
    parameters or a gradient's bytes, silently. Every pair of kinds (gather with reduce-scatter,
    and each kind with itself), handles 0 to 3 apart. With more than two ranks a reduce-scatter
    is an all-reduce, a collective that pairs by program order (as NCCL's do): two of them are
    not posted in opposite orders there."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    n = 4

    def post(kind: str, match: int) -> "tuple[torch.Tensor, torch.Tensor, collectives.Pending]":
        if kind == "all_gather":  # this rank's shard: distinct per rank and per handle
            shard = torch.arange(n, dtype=torch.float32) + 100 * rank + 10_000 * match
            out = torch.full((n * world_size,), float("nan"))
            expected = torch.cat([torch.arange(n, dtype=torch.float32) + 100 * r + 10_000 * match
                                  for r in range(world_size)])
            return out, expected, collectives.all_gather_into(out, shard, None, tag=f"gather {match}", match=match)
        full = torch.arange(n * world_size, dtype=torch.float32) * (rank + 1) - 7_000 * match  # a gradient
        expected = sum(torch.arange(n * world_size, dtype=torch.float32) * (r + 1) - 7_000 * match
                       for r in range(world_size))[rank * n:(rank + 1) * n]
        out = torch.full((n,), float("nan"))
        return out, expected, collectives.reduce_scatter_into(out, full, None, tag=f"scatter {match}", match=match)

    cases = [(first, second, distance) for first, second in (("all_gather", "reduce_scatter"),
                                                           ("reduce_scatter", "all_gather"),
                                                           ("all_gather", "all_gather"),
                                                           ("reduce_scatter", "reduce_scatter"))
             for distance in (0, 1, 2, 3) if (first != second or distance > 0)
             and (world_size == 2 or (first, second) != ("reduce_scatter", "reduce_scatter"))]
    for first, second, distance in cases:
        a, b = (first, 1), (second, 1 + distance)
        posted = [post(*a), post(*b)] if rank == 0 else [post(*b), post(*a)]
        for _, _, pending in posted:
            pending.wait()
        for (out, expected, _), (kind, match) in zip(posted, [a, b] if rank == 0 else [b, a]):
            assert torch.equal(out, expected), (rank, kind, match, (first, second, distance), out, expected)
    dist.barrier()


def _gather_and_scatter_on_three_ranks() -> None:
    """At 4 ranks, over a subgroup of three in an order of its own ([3, 0, 2]; rank 1 outside):
    gloo's all-gather lands every member's shard in group-rank order, and the reduce-scatter,
    which with more than one peer runs as an all-reduce of the input (see [Note: Collectives on
    gloo]), leaves each member the sum over all three of its chunk. An odd group size is what
    users run on 3 or 6 GPUs, and the only one where one peer and "more than one" differ by one;
    pairing with one peer there left ranks without a member's share, and one of them waiting."""
    rank = dist.get_rank()
    members = [3, 0, 2]
    group = dist.new_group(members)  # every rank creates it, as torch requires
    if rank in members:
        grank, size, n = dist.get_rank(group), len(members), 5
        shard = torch.arange(n, dtype=torch.float32) * (grank + 2) + 1000 * grank
        gathered = torch.full((n * size,), float("nan"))
        collectives.all_gather_into(gathered, shard, group, tag="three gather", match=1).wait()
        expected = torch.cat([torch.arange(n, dtype=torch.float32) * (r + 2) + 1000 * r for r in range(size)])
        assert torch.equal(gathered, expected), (rank, gathered, expected)
        full = torch.arange(n * size, dtype=torch.float32) * (grank + 1) - 50 * grank
        out = torch.full((n,), float("nan"))
        collectives.reduce_scatter_into(out, full, group, tag="three scatter", match=1).wait()
        want = sum(torch.arange(n * size, dtype=torch.float32) * (r + 1) - 50 * r for r in range(size))
        assert torch.equal(out, want[grank * n:(grank + 1) * n]), (rank, out, want)  # type: ignore[index]
    dist.barrier()


def _recorders_nest() -> None:
    """A recorder opened inside another leaves the outer one recording when it closes: the outer
    one sees the collectives and events before, inside and after the inner one, the inner one only
    its own (tests count collectives and bytes with nested recorders: an outer recorder gone deaf
    would let a test pass on whatever happened after)."""
    value = torch.ones(3)
    with record_collectives() as outer, record_collectives() as empty:  # two recorders with equal (no) contents
        pass
    assert outer is not empty and not outer.records and not empty.records
    with record_collectives() as outer:
        with record_collectives() as first_inner:  # leaves while the outer one has recorded nothing either
            pass
        collectives.all_reduce(value, None, tag="before").wait()
        assert [r.tag for r in first_inner.records] == [] and [r.tag for r in outer.records] == ["before"], \
            (first_inner.records, outer.records)
        with record_collectives() as inner:
            collectives.all_reduce(value, None, tag="inside").wait()
            collectives.trace("event inside")
        collectives.all_reduce(value, None, tag="after").wait()
        collectives.trace("event after")
    assert [r.tag for r in inner.records] == ["inside"], inner.records
    assert [r.tag for r in outer.records] == ["before", "inside", "after"], outer.records
    assert [e for e in outer.events if e[0] == "trace"] == [("trace", "event inside", ""), ("trace", "event after", "")], \
        outer.events
    with record_collectives() as later:  # and after both closed, a new one records from nothing
        collectives.all_reduce(value, None, tag="later").wait()
    assert [r.tag for r in later.records] == ["later"], later.records
    assert torch.equal(value, torch.full((3,), float(dist.get_world_size() ** 4))), value
    # (an inner recorder leaving while the outer one held the same events as it, none, took the outer
    # one out of the recording list by equality, and went on recording in its place)


def _collectives_straight_to_the_group() -> None:
    """The runtime's all-gather and reduce-scatter calls made straight to a process group's own
    method (``torch_compat.all_gather_work``/``reduce_scatter_work``: NCCL's and gloo-on-CUDA's path,
    and the simulated backend's) give what torch.distributed's functions give, on a real C++ group
    (gloo, which runs them on the CPU too): the whole group and, at W=4, a subgroup in an order of
    its own; float32 and complex64 (viewed as real, as torch's functions do); summed and, on the
    simulated backend where AVG exists, averaged (tests/unit/test_simulated_backend.py)."""
    from composable_shard._base.torch_compat import (ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE, all_gather_work,
                                                     reduce_scatter_work)

    rank, world_size = dist.get_rank(), dist.get_world_size()
    groups = [(dist.group.WORLD, list(range(world_size)))]
    if world_size == 4:
        members = [3, 1]
        groups.append((dist.new_group(members), sorted(members)))
    for group, members in groups:
        if rank not in members:
            continue
        size = len(members)
        for dtype in (torch.float32, torch.complex64):
            shard = (torch.arange(5.0) + 100 * rank).to(dtype) * (1 - 2j if dtype.is_complex else 1)
            got, want = torch.zeros(5 * size, dtype=dtype), torch.zeros(5 * size, dtype=dtype)
            all_gather_work(got, shard, group).wait()
            ALL_GATHER_SINGLE(want, shard, group=group)
            assert torch.equal(got, want), (members, dtype, got, want)
            full = (torch.arange(3.0 * size) * (rank + 1)).to(dtype) * (2 + 1j if dtype.is_complex else 1)
            got, want = torch.zeros(3, dtype=dtype), torch.zeros(3, dtype=dtype)
            reduce_scatter_work(got, full.clone(), False, group).wait()
            REDUCE_SCATTER_SINGLE(want, full.clone(), op=dist.ReduceOp.SUM, group=group)
            assert torch.equal(got, want), (members, dtype, got, want)
            index = sorted(members).index(rank)  # the chunk this rank keeps: the sum of every member's
            expected = sum((torch.arange(3.0 * size) * (r + 1)).to(dtype) * (2 + 1j if dtype.is_complex else 1)
                           for r in members)[3 * index:3 * index + 3]
            assert torch.equal(got, expected), (members, dtype, got, expected)


def _all() -> None:
    _collectives_straight_to_the_group()
    _recorders_nest()
    if dist.get_world_size() == 4:
        _gather_and_scatter_on_three_ranks()
    _exchanges_in_flight_pair_by_kind_and_handle()
    _exchanges_return_every_ranks_values()
    _ranks_in_different_exchanges_raise_on_every_rank()
    _state_dict_on_rank_0_only_before_the_first_forward()


@pytest.mark.parametrize("world_size", [2, 4])
def test_exchanges_and_ranks_in_different_ones(world_size: int) -> None:
    run_distributed(_all, world_size, timeout=120)
