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
from torch.distributed.checkpoint.metadata import MetadataIndex

from composable_shard._state.sharded_slice import boxes_of_range, split_boxes


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


@pytest.mark.parametrize("shape,world_size", [((7,), 2), ((5, 3), 2), ((5, 3), 4), ((4, 3, 2), 3), ((), 2), ((3, 0), 2), ((5, 3), 1)])
def test_split_boxes_cover_the_range_and_stay_within_one_part(shape: Tuple[int, ...], world_size: int) -> None:
    """Cut at the row boundaries of ``torch.chunk(full, world_size)``: every box lies inside one
    chunk, and together they cover the range in order."""
    numel = int(torch.Size(shape).numel())
    index = torch.arange(numel).view(shape)
    chunks = [c.reshape(-1).tolist() for c in torch.chunk(index, world_size)] if shape else [[0]]
    for start, end in itertools.combinations_with_replacement(range(numel + 1), 2):
        seen = []
        for offsets, sizes, flat in split_boxes(shape, start, end, world_size):
            box = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] if shape else index
            assert box.reshape(-1).tolist() == list(range(flat, flat + box.numel())), (shape, start, end)
            assert any(set(box.reshape(-1).tolist()) <= set(c) for c in chunks), (shape, start, end, offsets, sizes)
            seen += box.reshape(-1).tolist()
        assert seen == list(range(start, end)), (shape, start, end)


def test_boxes_share_the_slices_memory_over_exact_storages(tmp_path: object) -> None:
    """What DCP's writer gets for a box is the slice's own memory over a storage of exactly the
    box's bytes, so it neither copies it nor writes the rest of the flat shard into the file."""
    rows, cols = 1024, 512  # above UNCUT_NUMEL: cut at row 512 for two ranks
    flat = torch.arange(float(rows * cols + 1000))[:rows * cols]  # a view of a larger storage
    start, end = 3, 600 * cols + 5
    value = ShardedSlice(flat[start:end], start, (rows, cols), world_size=2)
    assert [(o, s) for o, s, _ in value.boxes] == [((0, 3), (1, cols - 3)), ((1, 0), (511, cols)), ((512, 0), (88, cols)),
                                                   ((600, 0), (1, 5))]
    assert [(o, s) for o, s, _ in ShardedSlice(flat[start:end], start, (rows, cols)).boxes] == [
        ((0, 3), (1, cols - 3)), ((1, 0), (599, cols)), ((600, 0), (1, 5))]
    small = ShardedSlice(torch.arange(40.0)[3:35], 3, (5, 8), world_size=2)  # small tensors are not cut
    assert [(o, s) for o, s, _ in small.boxes] == [((0, 3), (1, 5)), ((1, 0), (3, 8)), ((4, 0), (1, 3))]
    for offsets, sizes, _ in value.boxes:
        box = value.__get_tensor_shard__(MetadataIndex("w", torch.Size(offsets)))
        assert box.untyped_storage().nbytes() == box.nbytes
        box.add_(1e7)
    assert torch.equal(flat[start:end], torch.arange(float(start), float(end)) + 1e7)
    assert not (flat[:start] >= 1e7).any() and not (flat[end:] >= 1e7).any()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": value}, checkpoint_id=str(tmp_path))
    data_files = [p for p in __import__("pathlib").Path(str(tmp_path)).iterdir() if p.suffix == ".distcp"]
    assert sum(p.stat().st_size for p in data_files) < (end - start) * 4 + 3 * 4096, "a box's whole base storage was written"
