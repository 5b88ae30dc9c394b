"""``ShardedSlice``: one rank's contiguous slice of a row-major tensor, described to
``torch.distributed.checkpoint`` (DCP) as the boxes it covers.

A fully sharded module's rank holds, of each original parameter, the flattened elements
``[start, end)``: a contiguous range that in general starts and ends mid-row. A ``DTensor``
cannot describe it (``Shard(0)`` fixes the row split to ``torch.chunk`` boundaries), so the
sharded state dict uses this type instead. It reports the parameter's global shape and dtype,
owns no full-size storage, and implements DCP's extension hooks:

* ``__create_write_items__`` / ``__create_chunk_list__``: the boxes (global offsets and sizes)
  this rank holds. A contiguous range of a row-major tensor is a partial row, whole rows and a
  partial row, each partial row recursively the same in the lower dimensions: for a matrix, at
  most three boxes.
* ``__get_tensor_shard__``: the box's elements as a view of the slice, so ``dcp.save`` reads
  and ``dcp.load`` writes the rank's storage directly (for a parameter, the flat shard).

DCP matches boxes by global offsets, so a checkpoint loads at any world size or strategy, and
into any model whose state dict describes the same global tensors (a plain model, torch's
FSDP2). Any other tensor operation raises: the value is not a full tensor.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ._torch_compat import make_wrapper_tensor

__all__ = ["ShardedSlice", "boxes_of_range"]

Box = Tuple[Tuple[int, ...], Tuple[int, ...], int]  # (global offsets, sizes, start in the flattened tensor)


def boxes_of_range(shape: Sequence[int], start: int, end: int) -> List[Box]:
    """The boxes that the flattened elements ``[start, end)`` of a row-major tensor of
    ``shape`` form, in order; each as ``(offsets, sizes, flat_start)``."""
    shape = tuple(int(d) for d in shape)
    numel = 1
    for d in shape:
        numel *= d
    if not 0 <= start <= end <= numel:
        raise ValueError(f"range [{start}, {end}) outside a tensor of {numel} elements")
    if start == end:
        return []
    if not shape:
        return [((), (), 0)]
    row = numel // shape[0]
    first, last = start // row, end // row  # rows containing start and end
    boxes: List[Box] = []

    def partial(r: int, lo: int, hi: int) -> None:
        for offsets, sizes, flat in boxes_of_range(shape[1:], lo, hi):
            boxes.append(((r,) + offsets, (1,) + sizes, r * row + flat))

    if first == last:  # inside one row
        partial(first, start - first * row, end - first * row)
        return boxes
    whole_from = first
    if start % row:
        partial(first, start % row, row)
        whole_from = first + 1
    if last > whole_from:
        boxes.append(((whole_from,) + (0,) * (len(shape) - 1), (last - whole_from,) + shape[1:], whole_from * row))
    if end % row:
        partial(last, 0, end % row)
    return boxes


class ShardedSlice(torch.Tensor):
    """A tensor of the global ``shape`` of which this rank holds the flattened elements
    ``[start, start + local.numel())`` in ``local`` (1-D). Saved and loaded by DCP without
    communication; other tensor operations raise.

    Attributes: ``local`` (the 1-D slice, a view of the rank's storage), ``start``,
    ``boxes`` (see :func:`boxes_of_range`)."""

    local: torch.Tensor
    start: int
    boxes: List[Box]

    @staticmethod
    def __new__(cls, local: torch.Tensor, start: int, shape: Sequence[int]) -> "ShardedSlice":
        if local.dim() != 1:
            raise ValueError(f"ShardedSlice: local must be 1-D, got shape {tuple(local.shape)}")
        out = make_wrapper_tensor(cls, torch.Size(shape), local.dtype, local.device)
        out.local = local
        out.start = int(start)
        out.boxes = boxes_of_range(shape, out.start, out.start + local.numel())
        return out  # type: ignore[no-any-return]  # make_wrapper_tensor returns cls

    def __init__(self, local: torch.Tensor, start: int, shape: Sequence[int]) -> None:
        super().__init__()

    def __repr__(self) -> str:  # type: ignore[override]  # no tensor data to print
        return (f"ShardedSlice(shape={tuple(self.shape)}, dtype={self.dtype}, elements=[{self.start}, "
                f"{self.start + self.local.numel()}), boxes={len(self.boxes)})")

    @property
    def end(self) -> int:
        """One past the last flattened element this rank holds."""
        return self.start + self.local.numel()

    def elements(self, start: int, end: int) -> torch.Tensor:
        """The flattened elements ``[start, end)`` (a view of ``local``); they must lie inside it."""
        if not self.start <= start <= end <= self.end:
            raise ValueError(f"ShardedSlice holds elements [{self.start}, {self.end}), not [{start}, {end})")
        return self.local[start - self.start:end - self.start]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]  # torch's stub is narrower
        if func is torch.ops.aten.detach.default:
            (self,) = args
            return ShardedSlice(self.local, self.start, self.shape)
        raise RuntimeError(  # not TypeError: operators turn that into NotImplemented and a vaguer message
            f"{func} on a ShardedSlice: it holds only this rank's elements of a sharded tensor (from a "
            "SHARDED_STATE_DICT). Save/load it with torch.distributed.checkpoint, or use a full state dict "
            "(get_model_state_dict(module, full=True)) for tensor operations.")

    # ------------------------------------------------------------------ DCP extension hooks
    def __create_write_items__(self, fqn: str, obj: Any) -> List[WriteItem]:
        properties = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                                      properties=properties, size=self.shape))
                for offsets, sizes, _ in self.boxes]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes, _ in self.boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, sizes, flat in self.boxes:
            if index.offset is not None and tuple(index.offset) == offsets:
                numel = 1
                for d in sizes:
                    numel *= d
                return self.local[flat - self.start:flat - self.start + numel].view(sizes)
        raise ValueError(f"{index.fqn}: this rank holds no box at offsets {index.offset}")
