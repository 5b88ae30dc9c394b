"""Pure shard arithmetic: padding, chunk bounds, and which slice of which original parameter
each rank holds. No ``torch.distributed`` here; the runtime only calls these functions.

A flat parameter of ``numel`` elements is padded at the end to ``padded_numel`` (a multiple of
``world_size``); rank ``r`` owns ``[r * chunk, (r + 1) * chunk)`` with ``chunk =
padded_numel // world_size``. Padding is always fewer than ``world_size`` elements.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import List, Sequence, Tuple

__all__ = ["padded_numel", "chunk_numel", "chunk_bounds", "ParamSlice", "rank_param_slices", "param_offsets"]


def padded_numel(numel: int, world_size: int) -> int:
    """Smallest multiple of ``world_size`` that is >= ``numel`` (``world_size`` >= 1)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return -(-numel // world_size) * world_size


def chunk_numel(numel: int, world_size: int) -> int:
    """Elements each rank stores: ``ceil(numel / world_size)``."""
    return padded_numel(numel, world_size) // world_size


def chunk_bounds(numel: int, world_size: int, rank: int) -> Tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s chunk in the padded flat range."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    chunk = chunk_numel(numel, world_size)
    return rank * chunk, (rank + 1) * chunk


def param_offsets(numels: Sequence[int]) -> List[int]:
    """Start offset of each parameter in the flat concatenation."""
    return list(itertools.accumulate(numels, initial=0))[:-1]


@dataclass(frozen=True)
class ParamSlice:
    """The part of original parameter ``param_index`` that one rank holds.

    ``param_start``/``param_end`` index the parameter's flattened elements;
    ``shard_start`` is where that part begins inside the rank's chunk. ``numel`` may be 0
    (the rank holds nothing of this parameter)."""

    param_index: int
    param_start: int
    param_end: int
    shard_start: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


def rank_param_slices(numels: Sequence[int], world_size: int, rank: int) -> List[ParamSlice]:
    """One :class:`ParamSlice` per parameter (empty ones included, in order) describing what
    rank ``rank`` holds of each parameter in a flat parameter built from ``numels``."""
    if any(n < 0 for n in numels):
        raise ValueError(f"parameter numels must be >= 0, got {list(numels)}")
    total = sum(numels)
    start, end = chunk_bounds(total, world_size, rank)
    slices: List[ParamSlice] = []
    for index, (offset, numel) in enumerate(zip(param_offsets(numels), numels)):
        lo = max(offset, start)
        hi = min(offset + numel, end)
        if hi <= lo:
            slices.append(ParamSlice(index, 0, 0, 0))
            continue
        slices.append(ParamSlice(index, lo - offset, hi - offset, lo - start))
    return slices
