"""Tensor-parallel pieces: where a ``DTensor`` parameter's local piece lies in its global tensor.

A fully sharded module flattens each tensor-parallel (``DTensor``) parameter's *local piece*
into its flat parameter and shards that over the data-parallel group; the piece itself stays
what tensor parallelism made it. To show the module a ``DTensor`` again, to describe the
rank's elements to DCP in global coordinates, and to take a rank's piece out of a full tensor,
the runtime keeps a :class:`Piece` per such parameter: the mesh, placements, global shape and
stride, and the box (offsets, sizes) the local piece covers.

Placements: ``Replicate`` and ``Shard(d)`` on any mesh dimension (several mesh dimensions may
shard one tensor dimension: each splits what the previous left, as ``torch.chunk`` does, the
split ``DTensor`` uses). ``Partial`` (a sum not taken yet) and any other placement are refused
by :func:`piece_of`, as is a local piece whose shape that split does not give.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["Piece", "piece_of", "unsupported_placement", "as_dtensor", "to_global", "take_piece", "shard_groups"]


class Piece(NamedTuple):
    """Where one rank's local piece of a tensor-parallel parameter lies."""

    mesh: Any  # DeviceMesh
    placements: Tuple[Any, ...]
    shape: torch.Size  # global
    stride: Tuple[int, ...]  # global
    offsets: Tuple[int, ...]  # of the local piece in the global tensor
    sizes: Tuple[int, ...]  # the local piece's shape

    @property
    def dims(self) -> str:
        """The mesh's dimension names, for messages (``('tp',)``), or its shape."""
        names = self.mesh.mesh_dim_names
        return str(tuple(names)) if names else f"shape {tuple(self.mesh.mesh.shape)}"


def unsupported_placement(tensor: DTensor) -> Optional[str]:
    """Why ``tensor``'s placements cannot be flattened (``None``: they can)."""
    for placement in tensor.placements:
        if placement.is_partial():
            return (f"placement {placement} (a Partial placement holds a sum not taken yet; redistribute it to Shard "
                    "or Replicate first)")
        if type(placement) not in (Shard, Replicate):
            return f"placement {placement} (only Shard(dim) and Replicate() pieces are flattened)"
    return None


def _box(shape: torch.Size, mesh: Any, placements: Tuple[Any, ...]) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """The (offsets, sizes) this rank's piece covers: ``torch.chunk`` of each sharded dimension
    by each mesh dimension that shards it, in mesh-dimension order."""
    offsets, sizes = [0] * len(shape), list(shape)
    coordinate = mesh.get_coordinate()
    for i, placement in enumerate(placements):
        if not isinstance(placement, Shard):
            continue
        d, n, c = placement.dim % max(len(shape), 1), mesh.size(i), coordinate[i]
        chunk = -(-sizes[d] // n) if sizes[d] else 0
        start = min(c * chunk, sizes[d])
        offsets[d] += start
        sizes[d] = max(0, min(chunk, sizes[d] - start))
    return tuple(offsets), tuple(sizes)


def piece_of(tensor: DTensor) -> Piece:
    """The :class:`Piece` of ``tensor``; ``ValueError`` (a message fragment naming the placement
    or the mismatch, for the caller to prefix with the parameter's name) if it cannot be flattened."""
    why = unsupported_placement(tensor)
    if why is not None:
        raise ValueError(why)
    offsets, sizes = _box(tensor.shape, tensor.device_mesh, tuple(tensor.placements))
    local = tuple(tensor.to_local().shape)
    if local != sizes:
        raise ValueError(f"local piece of shape {local}, where placements {tuple(tensor.placements)} of a tensor of "
                         f"shape {tuple(tensor.shape)} give {sizes} (torch.chunk's split); build it with "
                         "distribute_tensor or parallelize_module")
    return Piece(tensor.device_mesh, tuple(tensor.placements), tensor.shape, tuple(tensor.stride()), offsets, sizes)


def as_dtensor(piece: Piece, local: torch.Tensor) -> DTensor:
    """``local`` (the piece's elements, in its shape) as the ``DTensor`` it is a piece of;
    differentiable: the gradient reaches ``local`` in the piece's placements."""
    return DTensor.from_local(local, piece.mesh, piece.placements, run_check=False, shape=piece.shape,
                              stride=piece.stride)


def to_global(piece: Piece, local: torch.Tensor) -> torch.Tensor:
    """The global tensor whose pieces every rank of the mesh passes as ``local`` (collective over
    the mesh dimensions that shard it); a plain tensor."""
    return as_dtensor(piece, local.detach()).full_tensor()


def take_piece(piece: Piece, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``full`` (a tensor of the global shape): a view, no communication."""
    index = tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.sizes))
    return full[index] if index else full


def shard_groups(piece: Piece) -> List[Any]:
    """The process groups of the mesh dimensions that shard the tensor: the ones a sum over the
    piece's elements (a gradient norm) is completed over, each element counted once."""
    return [piece.mesh.get_group(i) for i, p in enumerate(piece.placements) if isinstance(p, Shard)]

