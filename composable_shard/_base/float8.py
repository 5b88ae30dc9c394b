"""float8 all-gather of torchao's float8 training weights (issue 57): what the runtime's flat
groups of such weights need, apart from the collectives (``_runtime/flat_param.py`` issues those).

[Note: float8 all-gather]  ``torchao.float8.convert_to_float8_training`` with
``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` makes each converted linear's weight a
``WeightWithDynamicFloat8CastTensor``: under torch's FSDP2 the weight is all-gathered already cast
to float8 (one byte per element), with the tensorwise dynamic scale of the *whole* weight agreed
across ranks. Here such weights form their own flat group (``plan_groups``' fourth key; norms and
biases of the same module keep their own groups and dtypes):

* The shard (``flat_param``) and the original parameters stay in the weight's own precision: the
  optimizer, clipping, state dicts and ``unshard_params`` see plain tensors (a plain parameter
  takes the converted one's place in its module, as for tensor-parallel pieces), so a checkpoint
  loads into an unconverted model.
* Gather: each weight's amax over this rank's slice of it, then **one** ``MAX`` all-reduce of the
  group's amaxes over the shard group (not one per weight), torchao's ``amax_to_scale`` per weight,
  the slices cast to float8 with torchao's own cast, and one all-gather of those bytes (as
  ``uint8``, which every backend moves) into the group's gathered buffer (:class:`Float8Group`).
  Each rank casts its slice with the scale of the whole weight, so the gathered bytes are the cast
  of the whole weight: exactly what FSDP2 gathers.
* The module slot holds torchao's ``Float8TrainingTensor`` over the weight's bytes and scale,
  with the compute dtype as its original dtype, made by :class:`_AsFloat8Weight` from a view of
  the group's gradient leaf (``padded_unsharded_flat``: the compute dtype, a single element
  expanded, no storage of its own): ``Float8Linear`` uses it as its already cast weight, and the
  weight's high-precision gradient reaches the leaf through the usual split, so the reduction is
  the usual one.

torchao's ``precompute_float8_dynamic_scale_for_fsdp`` finds no torchao weight after
``fully_shard`` and does nothing: the scales are agreed at each gather in the one all-reduce,
which is what precomputing them saves FSDP2 (one all-reduce per weight otherwise).
Supported: tensorwise dynamic scaling, the only recipe torchao offers with float8 all-gather;
not tensor-parallel float8 weights (refused at ``fully_shard``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from .torch_compat import float8_bytes, float8_weight_parts

__all__ = ["Float8Group", "float8_weight_info", "is_float8_weight", "cast_shard", "float8_view"]

_WEIGHT_CLASS = ("torchao.float8.fsdp_utils", "WeightWithDynamicFloat8CastTensor")


def is_float8_weight(tensor: Any) -> bool:
    """Whether ``tensor`` is torchao's float8 training weight with float8 all-gather on."""
    cls = type(tensor)
    return (cls.__module__, cls.__name__) == _WEIGHT_CLASS


def float8_weight_info(tensor: Any) -> Tuple[torch.Tensor, torch.dtype, Any]:
    """``(plain high-precision tensor, float8 dtype, linear_mm_config)`` of torchao's weight."""
    return float8_weight_parts(tensor)


@dataclass(eq=False)
class Float8Group:
    """What a flat group of float8-gathered weights keeps beside its hp shard (see [Note: float8
    all-gather]): the gathered ``uint8`` buffer (storage freed when sharded), the scales of the
    last gather (one float32 per weight, written in place so views made earlier read the new
    values), the float8 dtype and torchao's matmul configuration of each weight."""

    dtype: torch.dtype
    linear_mm_configs: List[Any]  # torchao's per weight
    gathered: torch.Tensor  # uint8, padded unsharded numel; storage freed when sharded
    scales: torch.Tensor  # float32, one per weight


def cast_shard(fp8: Float8Group, shard: torch.Tensor, slices: Sequence[Any],
               agree: Optional[Callable[[torch.Tensor], None]]) -> torch.Tensor:
    """This rank's ``shard`` (high precision, the flat shard) cast to float8 as bytes (``uint8``),
    every weight's slice with the scale of the whole weight: amaxes of the slices, ``agree`` (one
    ``MAX`` all-reduce of them, in place, over the shard group; ``None``: this rank holds every
    weight whole), torchao's scale and cast. Writes ``fp8.scales``."""
    from torchao.float8.float8_training_tensor import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        GemmInputRole, hp_tensor_and_scale_to_float8)
    from torchao.float8.float8_utils import amax_to_scale  # type: ignore[import-untyped,import-not-found,unused-ignore]

    with torch.no_grad():
        amaxes = torch.zeros(len(slices), dtype=torch.float32, device=shard.device)
        for i, s in enumerate(slices):
            if s.numel > 0:
                amaxes[i] = shard[s.shard_start:s.shard_start + s.numel].abs().max().to(torch.float32)
        if agree is not None:
            agree(amaxes)
        fp8.scales.copy_(amax_to_scale(amaxes, fp8.dtype))
        out = torch.zeros(shard.numel(), dtype=fp8.dtype, device=shard.device)
        for i, s in enumerate(slices):
            if s.numel > 0:
                part = shard[s.shard_start:s.shard_start + s.numel]
                out[s.shard_start:s.shard_start + s.numel] = float8_bytes(hp_tensor_and_scale_to_float8(
                    part, fp8.scales[i], fp8.dtype, fp8.linear_mm_configs[i], GemmInputRole.WEIGHT))
        return out.view(torch.uint8)


class _AsFloat8Weight(torch.autograd.Function):
    """The weight's ``Float8TrainingTensor`` (its gathered bytes, its scale) in place of
    ``hp_view``, a view of the group's gradient leaf: the gradient of the weight goes to that view."""

    @staticmethod
    def forward(ctx: Any, hp_view: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,  # type: ignore[override]
                linear_mm_config: Any) -> torch.Tensor:
        from torchao.float8.float8_training_tensor import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
            Float8TrainingTensor, GemmInputRole)

        return Float8TrainingTensor(data, scale, hp_view.dtype, linear_mm_config, GemmInputRole.WEIGHT)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None, None]:  # type: ignore[override]
        return grad, None, None, None


def float8_view(fp8: Float8Group, hp_view: torch.Tensor, index: int, start: int, shape: torch.Size) -> torch.Tensor:
    """Weight ``index`` of the group (its bytes at ``start`` of the gathered buffer, ``shape``) as
    torchao's float8 weight, differentiable with respect to ``hp_view``."""
    data = fp8.gathered[start:start + shape.numel()].view(fp8.dtype).view(shape)
    return _AsFloat8Weight.apply(hp_view, data, fp8.scales[index], fp8.linear_mm_configs[index])  # type: ignore[no-any-return]


def new_group_state(dtype: torch.dtype, linear_mm_configs: List[Any], padded_numel: int, count: int,
                    device: torch.device) -> Float8Group:
    """A group's :class:`Float8Group`, its gathered buffer's storage freed."""
    gathered = torch.empty(padded_numel, dtype=torch.uint8, device=device)
    gathered.untyped_storage().resize_(0)
    return Float8Group(dtype, linear_mm_configs, gathered, torch.ones(count, dtype=torch.float32, device=device))


def gradient_leaf(padded_numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The group's gradient leaf: ``padded_numel`` elements of ``dtype`` that are one element
    expanded, so views of it cost no memory (see [Note: float8 all-gather])."""
    return torch.zeros((), dtype=dtype, device=device).expand(padded_numel).detach()


def offsets(numels: List[int]) -> List[int]:
    """The start of each weight in the flat concatenation."""
    out, at = [], 0
    for n in numels:
        out.append(at)
        at += n
    return out
