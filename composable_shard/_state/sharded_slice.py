"""``ShardedSlice``: one rank's contiguous slice of a row-major tensor, described to
``torch.distributed.checkpoint`` (DCP) as the boxes it covers.

A fully sharded module's rank holds, of each original parameter, the flattened elements
``[start, end)``: a contiguous range that in general starts and ends mid-row. A ``DTensor``
cannot describe it (``Shard(0)`` fixes the row split to ``torch.chunk`` boundaries), so the
sharded state dict uses this type instead. It reports the parameter's global shape and dtype,
owns no full-size storage, and implements DCP's extension hooks (``torch_compat.DCPTensorHooks``):

* ``dcp_write_items`` / ``dcp_chunk_list``: the boxes (global offsets and sizes)
  this rank holds. A contiguous range of a row-major tensor is a partial row, whole rows and a
  partial row, each partial row recursively the same in the lower dimensions: for a matrix, at
  most three boxes.
* ``dcp_tensor_shard``: the box's elements, sharing memory with the slice, so ``dcp.save``
  reads and ``dcp.load`` writes the rank's storage directly (for a parameter, the flat shard).

[Note: Boxes DCP handles without copies]
  Two properties of DCP's file storage decide what a save and a load allocate:

  * ``FileSystemWriter`` copies every tensor whose storage is larger than the tensor (a view
    would otherwise save its whole base) and keeps each written tensor until the rank's file is
    finished. A plain view of the flat shard would be copied: a rank's whole sharded state,
    alive at once. ``dcp_tensor_shard`` therefore returns the box over a storage of exactly
    its bytes that shares the slice's memory (``UntypedStorage`` slicing keeps the base alive):
    nothing is copied on the CPU. (On an accelerator DCP copies each item to the host anyway.)
  * A load reads each saved chunk that overlaps a request whole, into fresh host buffers.
    With the flat layout one rank may hold a whole large parameter (the first rank all of an
    embedding), so its chunk, and the loader's buffers, would be ``world_size`` times the ones
    of a row-sharded layout. ``ShardedSlice(..., world_size=W)`` cuts the range at the row
    boundaries of an even row split among ``W`` ranks (``ceil(rows / W)`` rows per part, the
    split of ``torch.chunk`` and FSDP2), so no box is larger than such a part. Tensors of at
    most ``UNCUT_NUMEL`` elements (1 MiB in float32) are not cut: their read buffers do not
    matter, and every box is one more entry in the plans DCP gathers on the coordinator (a
    pickled byte tensor: more entries, a larger peak there).

DCP matches boxes by global offsets, so a checkpoint loads at any world size or strategy, and
into any model whose state dict describes the same global tensors (a plain model, torch's
FSDP2). Any other tensor operation raises: the value is not a full tensor.

[Note: Slices of tensor-parallel pieces]  A fully sharded tensor-parallel parameter flattens
its local piece, so a rank holds a contiguous range of the *piece*, which in the global tensor
is not one range (a data-parallel slice of a row-wise piece is a set of partial rows). With
``piece=(offsets, sizes)`` the range and its boxes are the piece's (``start``, :meth:`elements`
and ``local`` count in the piece's flattened elements) and each box is moved by ``offsets``
into global coordinates: the exact boxes, whatever the placements.

[Note: Staged copies]  ``dcp.async_save`` copies the state dict before it returns (its stager,
``staging.DefaultStager``), then writes the copy in the background. The stager copies a tensor
subclass without storage of its own (``data_ptr() == 0``: this one, ``DTensor``) as
``new_empty(shape, device="cpu")`` followed by a deep copy of each attribute in its
``__dict__``. ``new_empty`` of the slice's own shape therefore returns the same slice over a
new, uninitialised ``local``, which the stager then replaces by its copy of ``local``: a view of
a copy of the whole storage ``local`` views (for a parameter the handle's flat shard, padding
included, copied once for all the parameters over it), pinned or in shared memory as its
options ask. Nothing of the copy aliases the live state, so training may go on at once.
With ``AsyncCheckpointerType.PROCESS`` the staged dict is then sent to a checkpoint process by
``multiprocessing``'s pickler (``ForkingPickler``); a slice is registered there to travel as
itself, its ``local`` in shared memory. (``__reduce_ex__``, which ``torch.save`` uses, pickles
only ``local``: the process would save per-rank plain tensors under global names.)
"""

from __future__ import annotations

import copy
import math
from multiprocessing.reduction import ForkingPickler
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .._base.torch_compat import TO_COPY, DCPTensorHooks, make_wrapper_tensor

__all__ = ["ShardedSlice", "boxes_of_range", "split_boxes", "part_numel"]

Box = Tuple[Tuple[int, ...], Tuple[int, ...], int]  # (global offsets, sizes, start in the flattened tensor)


UNCUT_NUMEL = 1 << 18


def part_numel(shape: Sequence[int], world_size: int) -> int:
    """Elements per part of an even row split of a row-major tensor of ``shape`` among
    ``world_size`` ranks (``ceil(rows / world_size)`` whole rows; a scalar is one part)."""
    shape = tuple(int(d) for d in shape)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    numel = math.prod(shape)
    if not shape or numel == 0:
        return max(numel, 1)
    row = numel // shape[0]
    return -(-shape[0] // world_size) * row


def split_boxes(shape: Sequence[int], start: int, end: int, world_size: int) -> List[Box]:
    """:func:`boxes_of_range` of ``[start, end)`` cut first at the boundaries of an even row
    split among ``world_size`` ranks, so no box holds more than one part's rows (see
    [Note: Boxes DCP handles without copies])."""
    if start == end:
        return boxes_of_range(shape, start, end)  # (checks the range; each piece below checks its own)
    part = part_numel(shape, world_size)
    boxes: List[Box] = []
    lo = start
    while lo < end:
        hi = min(end, (lo // part + 1) * part)
        boxes += boxes_of_range(shape, lo, hi)
        lo = hi
    return boxes


def _same_memory_exact_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` over a storage of exactly its bytes that shares ``t``'s memory and keeps its base
    storage alive (a copy if ``t`` is not contiguous)."""
    if not t.is_contiguous():
        return t.contiguous()
    if t.untyped_storage().nbytes() == t.nbytes:
        return t
    first = t.storage_offset() * t.element_size()
    storage = t.untyped_storage()[first:first + t.nbytes]
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, t.shape, t.stride())


def boxes_of_range(shape: Sequence[int], start: int, end: int) -> List[Box]:
    """The boxes that the flattened elements ``[start, end)`` of a row-major tensor of
    ``shape`` form, in order; each as ``(offsets, sizes, flat_start)``."""
    shape = tuple(int(d) for d in shape)
    numel = math.prod(shape)
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


class ShardedSlice(DCPTensorHooks, torch.Tensor):
    """A tensor of the global ``shape`` of which this rank holds the flattened elements
    ``[start, start + local.numel())`` in ``local`` (1-D). Saved and loaded by DCP without
    communication; other tensor operations raise. ``world_size``: the boxes of a tensor of more
    than ``UNCUT_NUMEL`` elements are cut at the boundaries of an even row split among that
    many ranks (see [Note: Boxes DCP handles without copies]); 1 cuts nothing.

    ``piece``: ``(offsets, sizes)`` of a tensor-parallel local piece the range is of (see
    [Note: Slices of tensor-parallel pieces]); ``None``: the whole tensor.

    Attributes: ``local`` (the 1-D slice, a view of the rank's storage), ``start``,
    ``world_size``, ``piece``, ``boxes`` (see :func:`split_boxes`; global offsets)."""

    local: torch.Tensor
    start: int
    world_size: int
    piece: Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]]
    boxes: List[Box]

    @staticmethod
    def __new__(cls, local: torch.Tensor, start: int, shape: Sequence[int], world_size: int = 1,
                piece: Optional[Tuple[Sequence[int], Sequence[int]]] = None) -> "ShardedSlice":
        if local.dim() != 1:
            raise ValueError(f"ShardedSlice: local must be 1-D, got shape {tuple(local.shape)}")
        out = make_wrapper_tensor(cls, torch.Size(shape), local.dtype, local.device)
        out.local = local
        out.start = int(start)
        out.world_size = int(world_size)
        out.piece = None if piece is None else (tuple(int(o) for o in piece[0]), tuple(int(n) for n in piece[1]))
        offsets, sizes = out.piece if out.piece is not None else ((0,) * len(shape), tuple(shape))
        cut = out.world_size if math.prod(sizes) > UNCUT_NUMEL else 1
        out.boxes = [(tuple(o + p for o, p in zip(box, offsets)), box_sizes, flat)
                     for box, box_sizes, flat in split_boxes(sizes, out.start, out.start + local.numel(), cut)]
        return out  # type: ignore[no-any-return]  # make_wrapper_tensor returns cls

    def __init__(self, local: torch.Tensor, start: int, shape: Sequence[int], world_size: int = 1,
                 piece: Optional[Tuple[Sequence[int], Sequence[int]]] = None) -> None:
        super().__init__()

    def with_local(self, local: torch.Tensor) -> "ShardedSlice":
        """The same slice of the same tensor over ``local`` (its elements, e.g. a copy)."""
        return ShardedSlice(local, self.start, self.shape, self.world_size, self.piece)

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

    def __deepcopy__(self, memo: Dict[int, Any]) -> "ShardedSlice":
        """A slice over a copy of ``local`` (``copy.deepcopy`` of a state dict that holds one)."""
        return self.with_local(copy.deepcopy(self.local, memo))

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (``torch.save``) as ``local``, a plain 1-D tensor of this rank's elements: a
        per-rank file of an optimizer's ``state_dict()`` holds what it held before optimizer
        state dicts described their global shape, and loads with ``weights_only=True``."""
        return self.local.__reduce_ex__(protocol)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]  # torch's stub is narrower
        if func is torch.ops.aten.detach.default:
            (self,) = args
            return self.with_local(self.local)
        if func is TO_COPY:  # .to(device/dtype), e.g. torch's cpu_offload of a state dict
            (self,) = args
            return self.with_local(func(self.local, **(kwargs or {})))
        if func is torch.ops.aten.new_empty.default:  # see [Note: Staged copies]
            self, size = args
            if tuple(size) != tuple(self.shape):
                raise RuntimeError(
                    f"new_empty({tuple(size)}) on a ShardedSlice of shape {tuple(self.shape)}: a ShardedSlice can only "
                    "be copied as the same slice of a tensor of its own shape (what DCP's async staging does).")
            return self.with_local(self.local.new_empty(self.local.shape, **(kwargs or {})))
        raise RuntimeError(  # not TypeError: operators turn that into NotImplemented and a vaguer message
            f"{func} on a ShardedSlice: it holds only this rank's elements of a sharded tensor (from a "
            "SHARDED_STATE_DICT). Save/load it with torch.distributed.checkpoint, or use a full state dict "
            "(get_model_state_dict(module, full=True)) for tensor operations.")

    # ------------------------------------------------------------------ DCP extension hooks
    def dcp_write_items(self, fqn: str) -> List[WriteItem]:
        """DCP's write items for this rank's boxes of the tensor saved as ``fqn``."""
        properties = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.shape))
                for chunk in self.dcp_chunk_list()]

    def dcp_chunk_list(self) -> List[ChunkStorageMetadata]:
        """This rank's boxes, as DCP's chunks."""
        return [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes, _ in self.boxes]

    def dcp_tensor_shard(self, index: MetadataIndex) -> torch.Tensor:
        """The box at ``index.offset`` over exactly its bytes of this rank's storage (no copy)."""
        for offsets, sizes, flat in self.boxes:
            if index.offset is not None and tuple(index.offset) == offsets:
                box = self.local[flat - self.start:flat - self.start + math.prod(sizes)].view(sizes)
                return _same_memory_exact_storage(box)
        raise ValueError(f"{index.fqn}: this rank holds no box at offsets {index.offset}")


def _rebuild_in_another_process(local: torch.Tensor, start: int, shape: Tuple[int, ...], world_size: int,
                                piece: Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]]) -> ShardedSlice:
    return ShardedSlice(local, start, shape, world_size, piece)


def _reduce_for_another_process(value: ShardedSlice) -> Any:
    """How ``multiprocessing`` sends a slice to another process: as a slice (see [Note: Staged copies])."""
    return _rebuild_in_another_process, (value.local, value.start, tuple(value.shape), value.world_size, value.piece)


ForkingPickler.register(ShardedSlice, _reduce_for_another_process)
