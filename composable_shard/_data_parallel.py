"""What ``fully_shard`` and ``replicate`` both do, written once: ``device_id``'s device, the
rank-0 broadcast at init, ``set_requires_gradient_sync``'s checks, and the end-of-backward
agreement on the parameters used on some rank (with [Note: Step agreement] of ``_watch.py``).

[Note: One behaviour for both APIs]  Where the two had drifted, both do what a DDP/FSDP user expects:
* ``set_requires_gradient_sync`` takes a bool, else ``TypeError`` naming the module, flag unchanged
  (``replicate``'s turned ``"no"`` into True).
* The init broadcast sends chunks of up to 250 MiB of one dtype, as DDP's and FSDP1's do
  (``fully_shard(sync_module_states=True)`` sent one broadcast per tensor).
* A group of one rank takes part in neither the used-flag all-reduce nor the init broadcast.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import _collectives, _watch
from ._validation import check_bool
from .contract import _get_registry

__all__ = ["check_composition", "normalize_device", "check_set_requires_gradient_sync", "broadcast_from_rank0", "agree_used_and_steps"]

BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024  # the init broadcast's chunk bound, as DDP's


def check_composition(api: str, module: Any, other: str, instead: str) -> None:
    """``RuntimeError`` if the ``other`` data-parallel API manages ``module`` (one API per module;
    ``instead`` says what to do) or torch.distributed is not initialized."""
    if other in (_get_registry(module) or ()):
        raise RuntimeError(f"{api}: the module is already managed by {other}, and a module can be managed by one "
                           f"data-parallel API. {instead}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{api}: torch.distributed is not initialized; call dist.init_process_group(...) first "
                           "(torchrun sets up the environment).")


def normalize_device(device_id: Union[int, torch.device, None]) -> Optional[torch.device]:
    """The device ``device_id`` (checked by ``_validation.check_device_id``) names: an int is a
    CUDA index, a CUDA device without an index the current one."""
    if device_id is None:
        return None
    if isinstance(device_id, int):
        return torch.device("cuda", device_id)
    if device_id.type == "cuda" and device_id.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device_id


def check_set_requires_gradient_sync(module: Any, requires_gradient_sync: Any, recurse: Any = True) -> None:
    """Either API's ``set_requires_gradient_sync`` arguments must be bools (``"no"`` is a mistake)."""
    api = f"{type(module).__name__}.set_requires_gradient_sync"
    check_bool(api, "requires_gradient_sync", requires_gradient_sync)
    check_bool(api, "recurse", recurse)


def _taking_part(groups: Sequence[Optional[dist.ProcessGroup]]) -> List[dist.ProcessGroup]:
    return [g for g in groups if g is not None and dist.get_world_size(g) > 1]


@torch.no_grad()
def broadcast_from_rank0(tensors: Sequence[torch.Tensor], groups: Sequence[Optional[dist.ProcessGroup]],
                         device: Optional[torch.device], *, tag: str) -> None:
    """Copy group rank 0's ``tensors`` into every rank's, group after group (None and single-rank
    groups skipped; hybrid: replicate group, then shard group, which reaches every rank from
    global rank 0), one broadcast per chunk of one dtype, assembled on ``device`` (None: where
    its tensors are; offloaded CPU parameters travel through the device, as NCCL wants)."""
    taking_part = _taking_part(groups)
    if not taking_part:
        return
    chunks: Dict[Tuple[torch.dtype, torch.device], List[Tuple[List[torch.Tensor], int]]] = {}
    for t in tensors:
        key_chunks = chunks.setdefault((t.dtype, t.device), [([], 0)])
        if key_chunks[-1][1] >= BROADCAST_CHUNK_BYTES:
            key_chunks.append(([], 0))
        members, nbytes = key_chunks[-1]
        members.append(t)
        key_chunks[-1] = (members, nbytes + t.numel() * t.element_size())
    for (_, where), key_chunks in chunks.items():
        for members, _ in key_chunks:
            flat = torch.cat([t.detach().reshape(-1) for t in members]).to(device or where)
            for group in taking_part:
                _collectives.broadcast(flat, 0, group, tag=tag)
            offset = 0
            for t in members:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def agree_used_and_steps(local_used: Sequence[int], steps: Sequence[int],
                         groups: Sequence[Optional[dist.ProcessGroup]], device: torch.device, *,
                         api: str, consequence: str, tag: str) -> Tuple[List[int], Optional[str]]:
    """One int32 all-reduce per group in ``groups`` (None and single-rank groups skipped, in order) of
    ``local_used + steps``; returns (the used flags summed over every rank of the groups, the
    StepCounter.disagreement message when ``steps`` is non-empty and more than one rank took part, else
    None)."""
    taking_part = _taking_part(groups)
    values = [int(v) for v in local_used] + [int(s) for s in steps]
    if not taking_part or not values:
        return values[:len(local_used)], None
    summed = torch.tensor(values, dtype=torch.int32, device=device)
    num_ranks = 1
    for group in taking_part:
        _collectives.all_reduce(summed, group, tag=tag).wait()
        num_ranks *= dist.get_world_size(group)
    out: List[int] = summed.tolist()
    disagreement = _watch.StepCounter.disagreement(steps, out[len(local_used):], num_ranks, api, consequence) \
        if steps else None
    return out[:len(local_used)], disagreement
