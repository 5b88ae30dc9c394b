"""``boxes_of_range`` and ``ShardedSlice``: the boxes a rank's contiguous slice of a row-major
tensor forms, and a single-process DCP round trip through them.

Without these, a box off by one row, or a partial row of a 3-D tensor described as a box of
the wrong shape, would save a checkpoint whose chunks overlap or miss elements: DCP would load
other ranks' values into the wrong places, silently.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Tuple

import pytest
import torch
import torch.distributed.checkpoint as dcp

from composable_shard import ShardedSlice
from composable_shard._sharded_tensor import boxes_of_range


@pytest.mark.parametrize("shape", [(7,), (5, 3), (4, 3, 2), (), (2, 1, 3, 4), (3, 0)])
def test_boxes_cover_exactly_the_range_in_order(shape: Tuple[int, ...]) -> None:
    numel = int(torch.Size(shape).numel())
    index = torch.arange(numel).view(shape)
    for start, end in itertools.combinations_with_replacement(range(numel + 1), 2):
        seen = []
        for offsets, sizes, flat in boxes_of_range(shape, start, end):
            box = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] if shape else index
            assert box.reshape(-1).tolist() == list(range(flat, flat + box.numel())), (shape, start, end)
            seen += box.reshape(-1).tolist()
        assert seen == list(range(start, end)), (shape, start, end)
        if len(shape) == 2:
            assert len(boxes_of_range(shape, start, end)) <= 3


def test_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="outside a tensor of 15 elements"):
        boxes_of_range((5, 3), 4, 16)


def test_dcp_round_trip_writes_into_the_slice(tmp_path: object) -> None:
    full = torch.randn(5, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save({"w": ShardedSlice(full.reshape(-1).clone(), 0, (5, 3))}, checkpoint_id=str(tmp_path))
        target = torch.zeros(15)
        dcp.load({"w": ShardedSlice(target[4:11], 4, (5, 3))}, checkpoint_id=str(tmp_path))
        plain = {"w": torch.zeros(5, 3)}
        dcp.load(plain, checkpoint_id=str(tmp_path))
    assert torch.equal(target[4:11], full.reshape(-1)[4:11])
    assert not target[:4].any() and not target[11:].any()
    assert torch.equal(plain["w"], full)
    with pytest.raises(RuntimeError, match="holds only this rank's elements"):
        ShardedSlice(target[4:11], 4, (5, 3)) * 2
