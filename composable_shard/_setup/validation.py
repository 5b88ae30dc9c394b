"""Argument checks of the public API: every wrong type or value raises ``TypeError`` /
``ValueError`` naming the API, the argument, what was found and what is accepted, before
anything changes. Used by ``fully_shard``, ``replicate``, the ``FSDPModule`` methods and
``clip_grad_norm_``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._base.pieces import piece_of
from .._base.float8 import is_float8_weight
from ..api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from ..wrap import _Policy

__all__ = ["check_bool", "check_real", "check_process_group", "check_device_id", "check_mixed_precision",
           "check_modules", "check_config", "check_fully_shard_arguments", "check_dense_gradients",
           "check_tensor_parallel", "check_all_gather_extensions"]


def check_bool(api: str, name: str, value: Any) -> None:
    """``TypeError`` unless ``value`` is a bool (``1`` or ``"yes"`` are mistakes, not flags)."""
    if not isinstance(value, bool):
        raise TypeError(f"{api}: {name} must be a bool (True or False), got {type(value).__name__} ({value!r})")


def _check_type(api: str, name: str, value: Any, types: Any, accepted: str, hint: str = "") -> None:
    """``TypeError`` unless ``value`` is None or one of ``types`` (``accepted`` names them)."""
    if value is not None and not isinstance(value, types):
        raise TypeError(f"{api}: {name} must be {accepted}, got {type(value).__name__} ({value!r}){hint}")


def check_real(api: str, name: str, value: Any) -> float:
    """``TypeError`` unless ``value`` is a real number (not a bool); ``ValueError`` for NaN."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{api}: {name} must be a number (int or float), got {type(value).__name__} ({value!r})")
    if math.isnan(float(value)):
        raise ValueError(f"{api}: {name} must be a number, got NaN")
    return float(value)


def check_process_group(api: str, group: Any, *, allow_pair: bool = False, name: str = "process_group") -> None:
    """A ``ProcessGroup`` this rank belongs to (or None; or a pair of them if ``allow_pair``)."""
    if group is None:
        return
    if allow_pair and isinstance(group, tuple):
        if len(group) != 2 or any(g is None for g in group):
            raise ValueError(f"{api}: a tuple {name} must be a (shard group, replicate group) pair of ProcessGroups, "
                             f"got {len(group)} elements")
        for i, g in enumerate(group):
            check_process_group(api, g, name=f"{name}[{i}]")
        return
    non_member = dist.GroupMember.NON_GROUP_MEMBER
    if (isinstance(group, int) and group == non_member) or (
            isinstance(group, dist.ProcessGroup) and dist.is_initialized() and dist.get_rank(group) < 0):
        rank = dist.get_rank() if dist.is_initialized() else "?"
        raise ValueError(f"{api}: this rank (global rank {rank}) is not a member of {name} (dist.new_group returns "
                         "GroupMember.NON_GROUP_MEMBER on ranks outside the group). Pass a group that contains "
                         "this rank, or make this call only on the group's ranks.")
    if not isinstance(group, dist.ProcessGroup):
        accepted = "a torch.distributed.ProcessGroup" + (", a (shard, replicate) pair of them" if allow_pair else "")
        raise TypeError(f"{api}: {name} must be {accepted} or None (the default group), got "
                        f"{type(group).__name__} ({group!r})")


def check_device_id(api: str, device_id: Any) -> None:
    """An int (CUDA index), a ``torch.device`` or None, naming a device that exists."""
    if device_id is None:
        return
    if isinstance(device_id, bool) or not isinstance(device_id, (int, torch.device)):
        hint = f"; for a device name pass torch.device({device_id!r})" if isinstance(device_id, str) else ""
        raise TypeError(f"{api}: device_id must be an int (CUDA device index), a torch.device or None, got "
                        f"{type(device_id).__name__} ({device_id!r}){hint}")
    if isinstance(device_id, int) and device_id < 0:
        raise ValueError(f"{api}: device_id must be a CUDA device index >= 0, got {device_id}")
    device = torch.device("cuda", device_id) if isinstance(device_id, int) else device_id
    if device.type == "meta":
        raise ValueError(f"{api}: device_id cannot be the meta device: it is where parameters are materialized "
                         "and computed; pass torch.device('cpu'), a CUDA device, or None")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{api}: device_id={device_id!r} names a CUDA device but CUDA is not available here; "
                         "pass torch.device('cpu') or None")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"{api}: device_id={device_id!r} but only {torch.cuda.device_count()} CUDA devices exist")


def check_mixed_precision(api: str, mixed_precision: Any) -> None:
    """A :class:`MixedPrecision` (or None) whose dtypes are floating ``torch.dtype``s and whose
    flags are bools."""
    hint = "; build one with MixedPrecision(**your_dict)" if isinstance(mixed_precision, dict) else ""
    _check_type(api, "mixed_precision", mixed_precision, MixedPrecision, "a composable_shard.MixedPrecision or None", hint)
    if mixed_precision is None:
        return
    for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        dtype = getattr(mixed_precision, name)
        _check_type(api, f"mixed_precision.{name}", dtype, torch.dtype, "a torch.dtype or None")
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"{api}: mixed_precision.{name} must be a floating-point dtype, got {dtype}")
    for name in ("keep_low_precision_grads", "cast_forward_inputs", "cast_root_forward_inputs"):
        check_bool(api, f"mixed_precision.{name}", getattr(mixed_precision, name))


def check_modules(api: str, name: str, value: Any) -> Optional[List[nn.Module]]:
    """An iterable of ``nn.Module`` (or None), returned as a list so it can be read twice."""
    if value is None:
        return None
    if isinstance(value, nn.Module) and not isinstance(value, (nn.ModuleList, nn.Sequential)):
        raise TypeError(f"{api}: {name} must be an iterable of nn.Modules, got a single {type(value).__name__}; "
                        f"pass [module]")
    if isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, Iterable):
        raise TypeError(f"{api}: {name} must be an iterable of nn.Modules (e.g. a list), got {type(value).__name__}")
    modules = list(value)
    for i, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise TypeError(f"{api}: {name} must contain nn.Modules only, got {type(m).__name__} at index {i}")
    return modules


def _check_ignored_states(api: str, value: Any) -> Optional[List[Any]]:
    if value is None:
        return None
    if isinstance(value, (torch.Tensor, nn.Module, str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{api}: ignored_states must be an iterable of nn.Parameters or of nn.Modules (e.g. a list), "
                        f"got {type(value).__name__}")
    states = list(value)
    kinds = {"parameter" if isinstance(s, nn.Parameter) else "module" if isinstance(s, nn.Module) else type(s).__name__
             for s in states}
    if kinds - {"parameter", "module"}:
        raise TypeError(f"{api}: ignored_states must contain nn.Parameters or nn.Modules, got {sorted(kinds)}")
    if len(kinds) > 1:
        raise ValueError(f"{api}: ignored_states must be all nn.Parameters or all nn.Modules, not a mix")
    return states


def _check_policy(api: str, policy: Any) -> None:
    if policy is None or isinstance(policy, _Policy):
        return
    if isinstance(policy, type):
        raise TypeError(f"{api}: policy must be a policy object or a function policy, got the class {policy.__name__}; "
                        f"to fully shard every {policy.__name__}, pass policy=ModuleWrapPolicy({{{policy.__name__}}})")
    if not callable(policy):
        raise TypeError(f"{api}: policy must be a _Policy (ModuleWrapPolicy, CustomPolicy), a function policy "
                        f"(module, recurse, nonwrapped_numel) -> bool, or None, got {type(policy).__name__} "
                        f"({policy!r}); for classes pass ModuleWrapPolicy({{...}})")


def _check_mesh(api: str, mesh: Any) -> None:
    if mesh is None:
        return
    from torch.distributed.device_mesh import DeviceMesh

    _check_type(api, "mesh", mesh, DeviceMesh, "a torch.distributed.device_mesh.DeviceMesh (1-D, or 2-D (replicate, "
                "shard) for hybrid strategies) or None")


def check_config(api: str, config: Dict[str, Any]) -> None:
    """The per-module options (also what a CustomPolicy may override)."""
    strategy = config["strategy"]
    if not isinstance(strategy, ShardingStrategy):
        raise TypeError(f"{api}: strategy must be a ShardingStrategy (e.g. ShardingStrategy.FULL_SHARD), got "
                        f"{type(strategy).__name__} ({strategy!r})")
    check_mixed_precision(api, config["mixed_precision"])
    _check_type(api, "cpu_offload", config["cpu_offload"], CPUOffload, "a CPUOffload or None")
    if config["cpu_offload"] is not None:
        check_bool(api, "cpu_offload.offload_params", config["cpu_offload"].offload_params)
    _check_type(api, "backward_prefetch", config["backward_prefetch"], BackwardPrefetch, "a BackwardPrefetch or None")
    for name in ("forward_prefetch", "limit_all_gathers"):
        check_bool(api, name, config[name])
    # [Note: limit_all_gathers]  torch's FSDP1 rate-limits all-gathers because it frees unsharded
    # buffers with record_stream, so a CPU thread running ahead of the GPU could hold many. Here a
    # buffer is allocated and freed on the compute stream and prefetch runs one handle ahead, so
    # at most two handles' all-gathers are ever in flight without any limiter (the runtime tests
    # count them). There is no unbounded mode to switch to: False is refused, not ignored.
    if config["limit_all_gathers"] is False:
        raise ValueError(
            f"{api}: limit_all_gathers=False (unbounded all-gathers) is not supported: composable_shard always keeps "
            "at most two handles' all-gathers in flight (the current one and one prefetched), by stream order and "
            "without blocking the CPU, so that bound costs nothing to keep. Drop the argument (True is the default).")


def check_fully_shard_arguments(module: Any, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Raise ``TypeError``/``ValueError`` naming the argument for anything ``fully_shard`` does
    not accept; return ``kwargs`` with the iterables read into lists."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard: module must be one nn.Module, got {type(module).__name__}; "
                        "call fully_shard once per module (children first)")
    api = f"fully_shard({type(module).__name__})"
    check_process_group(api, kwargs["process_group"], allow_pair=True)
    _check_mesh(api, kwargs["mesh"])
    if kwargs["mesh"] is not None and kwargs["process_group"] is not None:
        raise ValueError(f"{api}: pass either process_group or mesh, not both")
    _check_policy(api, kwargs["policy"])
    check_config(api, kwargs)
    checked = dict(kwargs)
    checked["ignored_modules"] = check_modules(api, "ignored_modules", kwargs["ignored_modules"])
    checked["ignored_states"] = _check_ignored_states(api, kwargs["ignored_states"])
    check_device_id(api, kwargs["device_id"])
    init_fn = kwargs["param_init_fn"]
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"{api}: param_init_fn must be callable as param_init_fn(module) or None, got "
                        f"{type(init_fn).__name__} ({init_fn!r})")
    check_bool(api, "sync_module_states", kwargs["sync_module_states"])
    return checked


def check_dense_gradients(api: str, named_modules: Iterable[Tuple[str, nn.Module]], managed: Set[int], why: str) -> None:
    """``ValueError`` for an embedding with ``sparse=True`` whose trainable weight ``api`` would
    manage (``id`` in ``managed``): its gradient would be a sparse tensor, which ``why``. Without
    this the first backward fails inside autograd with torch's own message, naming neither the
    module nor the fix."""
    for fqn, module in named_modules:
        if (isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse and module.weight.requires_grad
                and id(module.weight) in managed):
            raise ValueError(
                f"{api}: {fqn or '<root>'!r} ({type(module).__name__}) has sparse=True, so the gradient of its weight "
                f"would be a sparse tensor, which {why}. Construct it with sparse=False (the default), or leave it "
                "out with ignored_modules.")


def check_tensor_parallel(api: str, named_tensors: Iterable[Tuple[str, torch.Tensor]],
                          groups: Sequence[Optional[dist.ProcessGroup]], flattened: bool = False) -> None:
    """The ``DTensor`` parameters and buffers (tensor-parallel pieces) ``api`` would average over
    the data-parallel ``groups`` (None: the default group): each placement ``Shard`` or
    ``Replicate`` (a ``Partial`` one is a sum not taken yet: ``NotImplementedError``), on a mesh
    that shares no rank but this one with the groups (``ValueError``: averaging over ranks that
    hold different pieces of one tensor would mix them). ``flattened``: the pieces go into flat
    parameters, so each must also be the ``torch.chunk`` split its placements give
    (:func:`pieces.piece_of`; else ``NotImplementedError``)."""
    named = [(fqn, t) for fqn, t in named_tensors if isinstance(t, DTensor)]
    if not named:
        return
    dp_ranks = {r for g in groups for r in dist.get_process_group_ranks(g if g is not None else dist.group.WORLD)}
    me = dist.get_rank()
    for fqn, tensor in named:
        mesh = tensor.device_mesh
        if any(placement.is_partial() for placement in tensor.placements):
            raise NotImplementedError(
                f"{api}: {fqn!r} is a DTensor with placements {tuple(tensor.placements)}: a Partial placement holds a "
                "sum not taken yet, which the data-parallel average cannot reduce. Redistribute it to Shard or "
                "Replicate placements first.")
        if flattened:
            try:
                piece_of(tensor)
            except ValueError as error:
                raise NotImplementedError(f"{api}: {fqn!r} is a DTensor that cannot be flattened: {error}.") from None
        shared = sorted(set(mesh.mesh.flatten().tolist()) & dp_ranks - {me})
        if shared:
            raise ValueError(
                f"{api}: {fqn!r} is a DTensor on a device mesh {tuple(mesh.mesh.shape)}"
                f"{f' {mesh.mesh_dim_names}' if mesh.mesh_dim_names else ''} that shares ranks {shared} with the "
                f"data-parallel group (ranks {sorted(dp_ranks)}): averaging over them would mix different pieces of "
                "one tensor. Pass the data-parallel dimension's group, e.g. process_group=mesh['dp'].get_group() "
                "for a mesh with dimensions ('dp', 'tp').")


def check_all_gather_extensions(api: str, root: nn.Module, named_params: Iterable[Tuple[str, torch.Tensor]]) -> None:
    """``NotImplementedError`` for a parameter whose tensor class customizes FSDP2's all-gather
    (it defines ``fsdp_pre_all_gather``: quantized weights, torchao's float8 weights of a
    tensor-parallel ``DTensor``), except torchao's float8 weights themselves, which the library
    gathers as float8 ([Note: float8 all-gather] in ``_base/float8.py``): a flat parameter
    gathers the values themselves, so such a weight would reach the module as a flat slice of its
    plain values and fail in the module's forward with a shape error naming nothing. Raised before
    anything changes, naming the parameter, its module and the setting to change."""
    for fqn, param in named_params:
        tensor = param.to_local() if isinstance(param, DTensor) else param
        if not callable(getattr(type(tensor), "fsdp_pre_all_gather", None)):
            continue
        if is_float8_weight(tensor) and not isinstance(param, DTensor):
            continue  # gathered as float8 bytes: [Note: float8 all-gather] in _base/float8.py
        owner_name = fqn.rpartition(".")[0]
        owner = root.get_submodule(owner_name) if owner_name else root
        kind = type(tensor).__name__
        if is_float8_weight(tensor):  # torchao.float8, as the local tensor of a tensor-parallel DTensor
            setting = ("torchao's float8 all-gather (Float8LinearConfig(enable_fsdp_float8_all_gather=True)) of a "
                       "tensor-parallel weight is not supported: convert the model with "
                       "enable_fsdp_float8_all_gather=False. Training is the same (each float8 linear casts its "
                       "gathered weight with the same dynamic tensorwise scale); the all-gather moves the weight in "
                       "its own dtype instead of float8.")
        else:
            setting = ("a tensor class that customizes FSDP2's all-gather (fsdp_pre_all_gather / "
                       "fsdp_post_all_gather) is not supported: keep the parameter a plain tensor or leave its module "
                       "out with ignored_modules.")
        raise NotImplementedError(f"{api}: parameter {fqn!r} of {owner_name or '<root>'!r} ({type(owner).__name__}) "
                                  f"is a {kind}: {setting}")
