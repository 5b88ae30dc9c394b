"""Unit tests for composable_shard._runtime.shard_math: padding, chunk bounds and per-rank slices of
original parameters.

This is the arithmetic every rank relies on to agree on who owns which element. An off-by-one
here silently drops or duplicates elements of a parameter (wrong weights, wrong gradients),
or makes ranks all-gather different sizes. Exhaustive small grids (numel 0..40, world size
1..8) check the invariants; a few hand-written cases pin down the exact numbers.
"""

from __future__ import annotations

import random
from typing import List

import pytest

from composable_shard._runtime.shard_math import (
    ParamSlice,
    chunk_bounds,
    chunk_numel,
    padded_numel,
    param_offsets,
    rank_param_slices,
)

WORLD_SIZES = range(1, 9)


# --------------------------------------------------------------------------- hand-written cases


def test_padded_numel_examples() -> None:
    """Without it, padding could round to the wrong multiple while invariants still hold."""
    assert padded_numel(0, 1) == 0
    assert padded_numel(0, 4) == 0
    assert padded_numel(10, 4) == 12
    assert padded_numel(12, 4) == 12
    assert padded_numel(13, 4) == 16
    assert padded_numel(3, 8) == 8
    assert padded_numel(7, 1) == 7


def test_chunk_examples() -> None:
    """Without it, ranks could disagree on the chunk a rank owns."""
    assert chunk_numel(10, 4) == 3
    assert chunk_numel(0, 4) == 0
    assert chunk_numel(3, 8) == 1
    assert [chunk_bounds(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert [chunk_bounds(3, 8, r) for r in range(8)] == [(r, r + 1) for r in range(8)]
    assert chunk_bounds(0, 3, 2) == (0, 0)


def test_param_offsets_examples() -> None:
    """Without it, parameters would be viewed at the wrong place in the flat parameter."""
    assert param_offsets([]) == []
    assert param_offsets([4, 0, 3, 5]) == [0, 4, 4, 7]


def test_rank_param_slices_example() -> None:
    """Without it, a parameter straddling two ranks would be split at the wrong element.

    numels [5, 0, 4] -> flat 9, W=2 -> padded 10, chunk 5:
      rank 0 holds [0, 5)  = p0[0:5]
      rank 1 holds [5, 10) = p2[0:4] at shard offset 0, then 1 padding element."""
    assert rank_param_slices([5, 0, 4], 2, 0) == [
        ParamSlice(0, 0, 5, 0),
        ParamSlice(1, 0, 0, 0),
        ParamSlice(2, 0, 0, 0),
    ]
    assert rank_param_slices([5, 0, 4], 2, 1) == [
        ParamSlice(0, 0, 0, 0),
        ParamSlice(1, 0, 0, 0),
        ParamSlice(2, 0, 4, 0),
    ]
    # numels [3, 4] -> flat 7, W=3 -> padded 9, chunk 3: rank 1 holds p1[0:3], rank 2 p1[3:4].
    assert rank_param_slices([3, 4], 3, 1) == [ParamSlice(0, 0, 0, 0), ParamSlice(1, 0, 3, 0)]
    assert rank_param_slices([3, 4], 3, 2) == [ParamSlice(0, 0, 0, 0), ParamSlice(1, 3, 4, 0)]
    # numels [2, 3] -> flat 5, W=2 -> chunk 3: rank 0 holds p0[0:2] then p1[0:1] at offset 2.
    assert rank_param_slices([2, 3], 2, 0) == [ParamSlice(0, 0, 2, 0), ParamSlice(1, 0, 1, 2)]
    assert rank_param_slices([2, 3], 2, 1) == [ParamSlice(0, 0, 0, 0), ParamSlice(1, 1, 3, 0)]


def test_param_slice_numel() -> None:
    """Without it, ParamSlice.numel could disagree with its bounds."""
    assert ParamSlice(0, 2, 7, 1).numel == 5
    assert ParamSlice(3, 0, 0, 0).numel == 0


# --------------------------------------------------------------------------- exhaustive grids


def test_padding_and_chunks_grid() -> None:
    """Without it, some (numel, world size) pair could pad by >= W or leave gaps/overlaps
    between rank chunks."""
    for numel in range(0, 41):
        for world_size in WORLD_SIZES:
            padded = padded_numel(numel, world_size)
            assert padded >= numel
            assert padded - numel < world_size, (numel, world_size)
            assert padded % world_size == 0
            chunk = chunk_numel(numel, world_size)
            assert chunk * world_size == padded
            assert chunk == -(-numel // world_size)  # ceil, written independently
            expected_start = 0
            for rank in range(world_size):
                start, end = chunk_bounds(numel, world_size, rank)
                assert start == expected_start, (numel, world_size, rank)
                assert end - start == chunk
                expected_start = end
            assert expected_start == padded


def _random_numel_lists() -> List[List[int]]:
    rng = random.Random(1234)
    lists: List[List[int]] = [[], [0], [0, 0], [1], [7], [0, 5, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1]]
    for _ in range(60):
        length = rng.randint(1, 6)
        lists.append([rng.choice([0, 0, 1, 2, 3, 5, 8, 13, rng.randint(0, 40)]) for _ in range(length)])
    return lists


def test_slices_partition_each_parameter() -> None:
    """Without it, an element of some parameter would be held by no rank or by two ranks
    (lost updates or double-counted gradients)."""
    for numels in _random_numel_lists():
        offsets = param_offsets(numels)
        total = sum(numels)
        for world_size in WORLD_SIZES:
            chunk = chunk_numel(total, world_size)
            covered: List[List[int]] = [[0] * n for n in numels]
            shard_used: List[List[int]] = [[0] * chunk for _ in range(world_size)]
            for rank in range(world_size):
                slices = rank_param_slices(numels, world_size, rank)
                assert [s.param_index for s in slices] == list(range(len(numels)))
                for s in slices:
                    numel = numels[s.param_index]
                    assert s.numel >= 0
                    assert s.numel == s.param_end - s.param_start
                    if s.numel == 0:
                        continue
                    assert 0 <= s.param_start < s.param_end <= numel
                    assert 0 <= s.shard_start
                    assert s.shard_start + s.numel <= chunk
                    # Flat position computed two ways must agree.
                    assert rank * chunk + s.shard_start == offsets[s.param_index] + s.param_start
                    for i in range(s.param_start, s.param_end):
                        covered[s.param_index][i] += 1
                    for j in range(s.shard_start, s.shard_start + s.numel):
                        shard_used[rank][j] += 1
            for index, counts in enumerate(covered):
                assert counts == [1] * numels[index], (numels, world_size, index)
            # Every non-padding element of each shard belongs to exactly one param slice.
            for rank in range(world_size):
                real = max(0, min(chunk, total - rank * chunk))
                assert shard_used[rank] == [1] * real + [0] * (chunk - real), (numels, world_size, rank)


def test_zero_numel_params_hold_nothing() -> None:
    """Without it, an empty parameter could be given a bogus non-empty slice on some rank."""
    numels = [0, 3, 0, 0, 4, 0]
    for world_size in WORLD_SIZES:
        for rank in range(world_size):
            slices = rank_param_slices(numels, world_size, rank)
            for index in (0, 2, 3, 5):
                assert slices[index].numel == 0


def test_world_larger_than_numel() -> None:
    """Without it, small flat parameters on large worlds (most ranks hold only padding) break."""
    # numels [1, 2] -> flat 3, W=8 -> padded 8, chunk 1: ranks 0..2 hold one element each.
    assert padded_numel(3, 8) == 8
    per_rank = [rank_param_slices([1, 2], 8, r) for r in range(8)]
    assert per_rank[0] == [ParamSlice(0, 0, 1, 0), ParamSlice(1, 0, 0, 0)]
    assert per_rank[1] == [ParamSlice(0, 0, 0, 0), ParamSlice(1, 0, 1, 0)]
    assert per_rank[2] == [ParamSlice(0, 0, 0, 0), ParamSlice(1, 1, 2, 0)]
    for r in range(3, 8):
        assert [s.numel for s in per_rank[r]] == [0, 0]
    # All-empty flat parameter.
    assert [s.numel for s in rank_param_slices([0, 0], 4, 3)] == [0, 0]


# --------------------------------------------------------------------------- invalid inputs


@pytest.mark.parametrize("world_size", [0, -1])
def test_invalid_world_size_raises(world_size: int) -> None:
    """Without it, world size 0 would divide by zero deep inside, or give empty chunks."""
    with pytest.raises(ValueError):
        padded_numel(4, world_size)
    with pytest.raises(ValueError):
        chunk_numel(4, world_size)
    with pytest.raises(ValueError):
        chunk_bounds(4, world_size, 0)
    with pytest.raises(ValueError):
        rank_param_slices([4], world_size, 0)


def test_negative_numel_raises() -> None:
    """Without it, a negative size would produce nonsense chunks instead of an error."""
    with pytest.raises(ValueError):
        padded_numel(-1, 2)
    with pytest.raises(ValueError):
        chunk_numel(-5, 1)
    with pytest.raises(ValueError):
        chunk_bounds(-1, 2, 0)
    with pytest.raises(ValueError):
        rank_param_slices([-3], 2, 0)


def test_negative_numel_among_params_raises() -> None:
    """Without it, a negative entry next to positive ones is silently absorbed into the total
    (flat size 4 instead of an error) and the slices no longer cover the parameters."""
    with pytest.raises(ValueError):
        rank_param_slices([5, -1], 2, 0)


@pytest.mark.parametrize("rank", [-1, 4, 5])
def test_rank_out_of_range_raises(rank: int) -> None:
    """Without it, a wrong rank would silently read another rank's (or no) chunk."""
    with pytest.raises(ValueError):
        chunk_bounds(10, 4, rank)
    with pytest.raises(ValueError):
        rank_param_slices([10], 4, rank)


# --------------------------------------------------------------------------- one split of a shard
def test_one_split_of_a_shard_gives_each_parameters_slice() -> None:
    """``shard_split_sizes_of`` (flat_param.py) lets the runtime cut a gradient shard into every
    parameter's slice with one split instead of a slice per parameter. A wrong size hands a
    parameter another's gradient elements, or shifts every later one. The oracle here does not use
    ``rank_param_slices``: the flat range is numbered, each rank's chunk cut from it, and each
    parameter's elements in the chunk found by value; random layouts (empty parameters, parameters
    spanning several chunks, more ranks than elements) at every world size and rank."""
    import torch
    from composable_shard._runtime.flat_param import shard_split_sizes_of

    rng = random.Random(5)
    layouts = [[0], [5], [0, 3, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1], [7, 0, 2, 0, 0, 9]]
    layouts += [[rng.choice([0, 0, 1, 2, 3, 5, 8, 13, 40]) for _ in range(rng.randint(1, 7))] for _ in range(40)]
    for numels in layouts:
        total = sum(numels)
        owner = torch.tensor([i for i, n in enumerate(numels) for _ in range(n)], dtype=torch.long)  # per element
        for world_size in WORLD_SIZES:
            padded = padded_numel(total, world_size)
            flat = torch.cat([owner, torch.full((padded - total,), -1, dtype=torch.long)])
            chunk = padded // world_size
            for rank in range(world_size):
                shard = flat[rank * chunk:(rank + 1) * chunk]
                sizes = shard_split_sizes_of(rank_param_slices(numels, world_size, rank), chunk)
                pieces = shard.split(sizes)
                assert len(pieces) == len(numels) + 1, (numels, world_size, rank, sizes)
                for i, piece in enumerate(pieces[:-1]):
                    assert piece.numel() == int((shard == i).sum()), (numels, world_size, rank, sizes)
                    assert bool((piece == i).all()), (numels, world_size, rank, i, piece.tolist())
                assert bool((pieces[-1] == -1).all()), (numels, world_size, rank, sizes)  # the padding alone
