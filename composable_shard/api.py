"""Configuration types of the public API: strategies, prefetch modes, mixed precision,
CPU offload and state-dict types. Same names and meanings as PyTorch's FSDP."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Sequence, Type

import torch
import torch.nn as nn

from ._base.torch_compat import BATCH_NORM

__all__ = [
    "ShardingStrategy",
    "BackwardPrefetch",
    "MixedPrecision",
    "CPUOffload",
    "StateDictType",
    "FullStateDictConfig",
    "ShardedStateDictConfig",
]


class ShardingStrategy(enum.Enum):
    """How a fully sharded module stores parameters and reduces gradients.

    ``FULL_SHARD`` (ZeRO-3): parameters resharded after forward and after backward.
    ``SHARD_GRAD_OP`` (ZeRO-2): parameters stay unsharded between forward and backward.
    ``NO_SHARD``: every rank keeps everything; gradients are all-reduced (DDP-like).
    ``HYBRID_SHARD``: FULL_SHARD within a shard group, replicated across a replicate group.
    ``_HYBRID_SHARD_ZERO2``: SHARD_GRAD_OP within a shard group, replicated across groups.
    """

    FULL_SHARD = enum.auto()
    SHARD_GRAD_OP = enum.auto()
    NO_SHARD = enum.auto()
    HYBRID_SHARD = enum.auto()
    _HYBRID_SHARD_ZERO2 = enum.auto()


class BackwardPrefetch(enum.Enum):
    """When the next handle's all-gather is issued during backward.

    ``BACKWARD_PRE``: before the current handle's gradient computation (most overlap).
    ``BACKWARD_POST``: after the current handle's gradient computation.
    """

    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()


@dataclass(frozen=True)
class MixedPrecision:
    """Low-precision compute and communication; sharded parameters and optimizer state keep
    their original dtype.

    Example::

        fully_shard(model, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))

    If ``param_dtype`` is set and ``reduce_dtype`` is not, gradients are reduced in
    ``param_dtype``.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    buffer_dtype: Optional[torch.dtype] = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[Type[nn.Module]] = (BATCH_NORM,)

    @property
    def effective_reduce_dtype(self) -> Optional[torch.dtype]:
        """The dtype gradients are reduced in (``reduce_dtype``, else ``param_dtype``)."""
        return self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype

    def _reduce_dtype_for(self, compute_dtype: torch.dtype, full_precision: bool) -> torch.dtype:
        """The dtype a group computing in ``compute_dtype`` reduces its gradients in: the
        effective reduce dtype for a floating group not kept in full precision, else the
        compute dtype (the one rule for the runtime and for ``describe``)."""
        reduce = self.effective_reduce_dtype
        if reduce is not None and compute_dtype.is_floating_point and not full_precision:
            return reduce
        return compute_dtype


@dataclass(frozen=True)
class CPUOffload:
    """``offload_params=True`` keeps sharded parameters and gradients on the CPU; the
    optimizer steps there."""

    offload_params: bool = False


class StateDictType(enum.Enum):
    """What ``module.state_dict()`` returns inside :func:`state_dict_type`."""

    FULL_STATE_DICT = enum.auto()
    SHARDED_STATE_DICT = enum.auto()


@dataclass
class FullStateDictConfig:
    """Options of ``FULL_STATE_DICT``: move tensors to CPU, produce them on rank 0 only."""

    offload_to_cpu: bool = False
    rank0_only: bool = False


@dataclass
class ShardedStateDictConfig:
    """Options of ``SHARDED_STATE_DICT``."""

    offload_to_cpu: bool = False
