"""torch FSDP2's surface on ``fully_shard``: its keyword arguments and its ``FSDPModule`` methods.

[Note: FSDP2 drop-in]
  Code written for torch's FSDP2 (torchtitan, torchtune, Lightning's ``ModelParallelStrategy``,
  research code) calls ``fully_shard(module, mesh=, reshard_after_forward=, mp_policy=,
  offload_policy=, ignored_params=)`` and then FSDP2's methods on the modules, found by
  ``isinstance(m, FSDPModule)`` against torch's class, of which ours is a subclass for that
  reason alone (``torch_compat.FSDP2_MODULE_MARKER``). Each FSDP2 argument and method is one
  of three kinds (docs/migration.md has the table):
    mapped       ``reshard_after_forward`` (True: FULL_SHARD or HYBRID_SHARD, False:
                 SHARD_GRAD_OP or _HYBRID_SHARD_ZERO2), ``mp_policy`` (a ``MixedPrecision`` with
                 FSDP2's casts: inputs of every fully sharded module when
                 ``cast_forward_inputs``, no buffer cast, no class kept in full precision),
                 ``offload_policy`` (``CPUOffloadPolicy``: ``CPUOffload(offload_params=True)``),
                 ``ignored_params`` (``ignored_states``), and the methods that change what the
                 step does: gradient divide factor, reshard after forward/backward, gradient
                 sync, chosen prefetch, ``unshard(async_op=)``/``reshard()``.
    no effect    calls whose effect the step here always has: ``set_is_last_backward`` (every
    here         backward finishes its reductions), ``set_force_sum_reduction_for_comms`` (the
                 reductions here are sums, divided afterwards), ``set_requires_all_reduce(True)``,
                 ``set_reduce_scatter_unused_params`` (unused parameters' zeros are always in the
                 reduction), ``reset_iter_state`` (the next forward recovers by itself).
                 Numbers equal FSDP2's either way.
    refused      everything else, raising ``NotImplementedError`` that names the FSDP2 call and
                 what to use here: custom collectives, symmetric memory, ``reshard_after_forward``
                 as an int, ``shard_placement_fn``, ``output_dtype``, HSDP's
                 ``set_requires_all_reduce(False)``. torch's own code that reaches for FSDP2's
                 internal state (``_get_fsdp_state``) is refused the same way.
  ``torch.distributed.pipelining`` drives FSDP2 stages through FSDP2's internal state at the end
  of each step (its ``perform_reduce_grad``), which these modules do not have, after turning
  gradient sync off for every micro-batch: the step would end with gradients never reduced; and
  its zero-bubble schedules' weight pass asks the original parameters for gradients, which a
  sharded forward never used. So ``integrations/pipelining.py`` refuses a fully sharded module's
  first forward and ``set_is_last_backward`` when torch's own stage drives them, through the
  caller checks ([Note: Caller checks] in ``_base/callers.py``); its ``PipelineStage`` drives
  them itself ([Note: Pipelined stages] there).
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional

import torch.nn as nn

from .._runtime.module_state import _FSDPState
from .._base.callers import check_callers
from .._base.torch_compat import TORCH_FSDP_PACKAGE
from .validation import check_bool, check_real
from ..api import CPUOffload, MixedPrecision, ShardingStrategy

__all__ = ["FSDP2Methods", "UnshardHandle", "fsdp2_arguments", "FSDP2_ARGUMENTS"]

FSDP2_ARGUMENTS = ("reshard_after_forward", "mp_policy", "offload_policy", "ignored_params", "shard_placement_fn",
                   "dp_mesh_dims")


# ---------------------------------------------------------------------------- arguments
def fsdp2_arguments(api: str, kwargs: Dict[str, Any], hybrid: bool) -> Dict[str, Any]:
    """Map FSDP2's keyword arguments in ``kwargs`` onto ours (see [Note: FSDP2 drop-in]);
    returns the overrides of ``strategy``, ``mixed_precision``, ``cpu_offload``,
    ``ignored_states``. ``hybrid``: the mesh is 2-D (replicate, shard)."""
    out: Dict[str, Any] = {}
    if kwargs.get("shard_placement_fn") is not None:
        raise NotImplementedError(f"{api}: FSDP2's shard_placement_fn (per-parameter Shard(dim) placements) has no "
                                  "counterpart: flat parameters shard the concatenation of a handle's parameters "
                                  "along dim 0. Leave it out (fully_shard shards every parameter evenly).")
    if kwargs.get("dp_mesh_dims") is not None:
        raise NotImplementedError(f"{api}: FSDP2's dp_mesh_dims (a data-parallel sub-mesh of a full SPMD mesh) has no "
                                  "counterpart: pass the data-parallel mesh itself as mesh= (1-D, or 2-D "
                                  "(replicate, shard) for HSDP).")
    raf = kwargs.get("reshard_after_forward")
    if raf is not None:
        if isinstance(raf, int) and not isinstance(raf, bool):
            raise NotImplementedError(f"{api}: reshard_after_forward={raf} (FSDP2's resharding to a smaller world "
                                      "after forward) has no counterpart; pass True or False.")
        check_bool(api, "reshard_after_forward", raf)
        if kwargs.get("strategy_given"):
            raise ValueError(f"{api}: pass either strategy= or FSDP2's reshard_after_forward=, not both "
                             "(reshard_after_forward=False is strategy=ShardingStrategy.SHARD_GRAD_OP).")
        if hybrid:
            out["strategy"] = ShardingStrategy.HYBRID_SHARD if raf else ShardingStrategy._HYBRID_SHARD_ZERO2
        else:
            out["strategy"] = ShardingStrategy.FULL_SHARD if raf else ShardingStrategy.SHARD_GRAD_OP
    elif hybrid and not kwargs.get("strategy_given"):
        out["strategy"] = ShardingStrategy.HYBRID_SHARD  # FSDP2 on a 2-D mesh is HSDP
    policy = kwargs.get("mp_policy")
    if policy is not None:
        if kwargs.get("mixed_precision") is not None:
            raise ValueError(f"{api}: pass either mixed_precision= or FSDP2's mp_policy=, not both.")
        out["mixed_precision"] = _mixed_precision_of(api, policy)
    offload = kwargs.get("offload_policy")
    if offload is not None:
        if kwargs.get("cpu_offload") is not None:
            raise ValueError(f"{api}: pass either cpu_offload= or FSDP2's offload_policy=, not both.")
        out["cpu_offload"] = _cpu_offload_of(api, offload)
    ignored = kwargs.get("ignored_params")
    if ignored is not None:
        if kwargs.get("ignored_states") is not None:
            raise ValueError(f"{api}: pass either ignored_states= or FSDP2's ignored_params=, not both.")
        out["ignored_states"] = list(ignored)
    return out


def _is_torch_fsdp_class(obj: Any, *names: str) -> bool:
    """Is ``obj`` an instance of torch FSDP2's class named one of ``names`` (or a subclass)? By
    name and module: the library does not import torch's FSDP package for it."""
    return any(c.__name__ in names and c.__module__.startswith(TORCH_FSDP_PACKAGE) for c in type(obj).__mro__)


def _mixed_precision_of(api: str, policy: Any) -> Optional[MixedPrecision]:
    """FSDP2's ``MixedPrecisionPolicy`` as our ``MixedPrecision`` with FSDP2's casts."""
    if not _is_torch_fsdp_class(policy, "MixedPrecisionPolicy"):
        raise TypeError(f"{api}: mp_policy must be the MixedPrecisionPolicy of torch's FSDP package, got "
                        f"{type(policy).__name__}; or pass mixed_precision=MixedPrecision(...)")
    if policy.output_dtype is not None:
        raise NotImplementedError(f"{api}: MixedPrecisionPolicy(output_dtype={policy.output_dtype}) has no "
                                  "counterpart: cast the module's output yourself (e.g. logits.float()).")
    if policy.param_dtype is None and policy.reduce_dtype is None:
        return None
    return MixedPrecision(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,
                          cast_forward_inputs=False, cast_root_forward_inputs=bool(policy.cast_forward_inputs),
                          _module_classes_to_ignore=())


def _cpu_offload_of(api: str, policy: Any) -> Optional[CPUOffload]:
    if _is_torch_fsdp_class(policy, "CPUOffloadPolicy"):
        return CPUOffload(offload_params=True)
    if _is_torch_fsdp_class(policy, "OffloadPolicy"):
        return None  # FSDP2's default: no offload
    raise TypeError(f"{api}: offload_policy must be torch's OffloadPolicy or CPUOffloadPolicy, got "
                    f"{type(policy).__name__}; or pass cpu_offload=CPUOffload(offload_params=True)")


# ---------------------------------------------------------------------------- methods
class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns: the all-gathers are in flight;
    :meth:`wait` waits for them (FSDP2's ``UnshardHandle``). Waiting is optional: the module's
    next forward waits too."""

    def __init__(self, module: Any) -> None:
        self._module: Any = module

    def wait(self) -> None:
        """Wait for the all-gathers (idempotent)."""
        if self._module is not None:
            self._module._finish_unshard()
            self._module = None


def _refuse(module: nn.Module, call: str, instead: str) -> NotImplementedError:
    return NotImplementedError(f"{type(module).__name__}.{call} (torch FSDP2) is not supported by composable_shard's "
                               f"fully_shard. {instead}")


class FSDP2Methods:
    """FSDP2's ``FSDPModule`` methods, for ``FSDPModule`` (see [Note: FSDP2 drop-in])."""

    def _fsdp_state(self) -> _FSDPState:
        raise NotImplementedError  # FSDPModule's

    def _states(self, recurse: bool) -> List[_FSDPState]:
        raise NotImplementedError  # FSDPModule's

    def _finish_unshard(self) -> None:
        raise NotImplementedError  # FSDPModule's

    # -- mapped
    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the reduced gradients of this module's own parameters by ``factor`` instead of
        the data-parallel world size (1.0: sum them, for a loop that scales the loss itself, e.g.
        by the global token count). Not recursive, as FSDP2's: the fully sharded modules inside
        keep theirs, so call it on each (torchtitan loops over ``model.modules()``)."""
        value = check_real(f"{type(self).__name__}.set_gradient_divide_factor", "factor", factor)
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{type(self).__name__}.set_gradient_divide_factor: factor must be a positive finite "
                             f"number, got {factor!r}")
        self._fsdp_state().gradient_divide_factor = value

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's older name of :meth:`set_gradient_divide_factor`, deprecated there: it warns
        (``DeprecationWarning``) as FSDP2's does."""
        warnings.warn("Use `set_gradient_divide_factor` instead", DeprecationWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """False: keep the unsharded parameters from forward to backward (no all-gather in
        backward, more memory); True: free them after forward, the root's too (as FSDP2's, once
        asked for explicitly; by default the root keeps them: its backward comes first)."""
        api = f"{type(self).__name__}.set_reshard_after_forward"
        if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
            raise NotImplementedError(f"{api}({reshard_after_forward}): resharding to a smaller world after forward "
                                      "has no counterpart; pass True or False.")
        check_bool(api, "reshard_after_forward", reshard_after_forward)
        check_bool(api, "recurse", recurse)
        for s in self._states(recurse):
            if reshard_after_forward and s.strategy is ShardingStrategy.NO_SHARD:
                continue  # nothing is gathered: the shard is the whole parameter
            s.reshard_after_forward = s.root_reshards_after_forward = reshard_after_forward

    def set_modules_to_forward_prefetch(self, modules: List[Any]) -> None:
        """In this module's forward, start the all-gathers of ``modules`` (fully sharded
        modules of the same model), in that order, instead of the next module's."""
        self._fsdp_state().forward_prefetch_states = self._prefetch_states("set_modules_to_forward_prefetch", modules)

    def set_modules_to_backward_prefetch(self, modules: List[Any]) -> None:
        """In this module's backward, start the all-gathers of ``modules``, in that order,
        instead of the previous module's."""
        self._fsdp_state().backward_prefetch_states = self._prefetch_states("set_modules_to_backward_prefetch", modules)

    def _prefetch_states(self, call: str, modules: Any) -> List[_FSDPState]:
        api = f"{type(self).__name__}.{call}"
        if isinstance(modules, nn.Module) or not isinstance(modules, (list, tuple)):
            raise TypeError(f"{api}: modules must be a list of fully sharded modules, got {type(modules).__name__}")
        states = []
        for i, m in enumerate(modules):
            state = m._fsdp_state() if isinstance(m, FSDP2Methods) else None
            if state is None:
                raise TypeError(f"{api}: modules[{i}] ({type(m).__name__}) is not a module fully_shard manages; pass "
                                "modules that fully_shard was applied to.")
            states.append(state)
        return states

    # -- no effect here
    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 code: every backward here waits for its reductions at its end,
        whatever this says (FSDP2 lets a backward that is not the last skip the wait)."""
        check_bool(f"{type(self).__name__}.set_is_last_backward", "is_last_backward", is_last_backward)
        check_callers(self, "set_is_last_backward")  # [Note: Caller checks] in _base/callers.py
        self._fsdp_state().is_last_backward = is_last_backward

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted for FSDP2 code: the reductions here are always sums, divided afterwards."""
        check_bool(f"{type(self).__name__}.set_force_sum_reduction_for_comms", "enable", enable)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """True (the default) is accepted; False (HSDP: reduce-scatter without the all-reduce
        across replicas, for accumulation) is refused on a module that has replicas."""
        api = f"{type(self).__name__}.set_requires_all_reduce"
        check_bool(api, "requires_all_reduce", requires_all_reduce)
        check_bool(api, "recurse", recurse)
        if requires_all_reduce:
            return
        for s in self._states(recurse):
            if s.replicate_group is not None and s.dp_world_size > s.world_size:
                raise _refuse(self, "set_requires_all_reduce(False)",  # type: ignore[arg-type]  # self is an nn.Module
                              "For gradient accumulation use set_requires_gradient_sync(False) on the micro-batches "
                              "before the last (no communication at all; the last backward reduces their sum).")

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Accepted for FSDP2 code: a parameter unused on some ranks always takes part in the
        reduction here (its zeros), and one unused on every rank keeps ``.grad = None``."""
        check_bool(f"{type(self).__name__}.set_reduce_scatter_unused_params", "reduce_scatter_unused_params",
                   reduce_scatter_unused_params)

    def reset_iter_state(self) -> None:
        """Accepted for FSDP2 code: after a forward or backward that raised, the next forward
        (or ``unshard_params``) puts everything back by itself."""

    # -- refused
    def set_custom_all_gather(self, comm: Any) -> None:  # noqa: D102  # refused
        raise _refuse(self, "set_custom_all_gather", "The all-gather writes straight into the unsharded flat "  # type: ignore[arg-type]  # self is an nn.Module
                      "buffer; there is no hook for another collective.")

    def set_custom_reduce_scatter(self, comm: Any) -> None:  # noqa: D102  # refused
        raise _refuse(self, "set_custom_reduce_scatter", "Use set_gradient_divide_factor to change the averaging.")  # type: ignore[arg-type]  # self is an nn.Module

    def set_all_reduce_hook(self, hook: Any, *, stream: Any = None) -> None:  # noqa: D102  # refused
        raise _refuse(self, "set_all_reduce_hook", "Gradients are reduced over the data-parallel groups only; "  # type: ignore[arg-type]  # self is an nn.Module
                      "for replicate's bucketed all-reduce, replicate(...).register_comm_hook takes a hook.")

    def set_post_optim_event(self, event: Any) -> None:  # noqa: D102  # refused
        raise _refuse(self, "set_post_optim_event", "The next forward's all-gathers are ordered after the optimizer "  # type: ignore[arg-type]  # self is an nn.Module
                      "step on the compute stream; leave the call out.")

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:  # noqa: D102  # refused
        raise _refuse(self, "set_unshard_in_backward", "Every handle is gathered for its backward; to skip a "  # type: ignore[arg-type]  # self is an nn.Module
                      "module's parameters, freeze them (requires_grad=False) or leave them out with ignored_states.")

    def set_reduce_scatter_max_input_buffers(self, *args: Any, **kwargs: Any) -> None:  # noqa: D102  # refused
        raise _refuse(self, "set_reduce_scatter_max_input_buffers", "At most two handles' unsharded gradients are "  # type: ignore[arg-type]  # self is an nn.Module
                      "alive at once, always; leave the call out.")

    def set_separate_reduce_scatter_group(self, *args: Any, **kwargs: Any) -> None:  # noqa: D102  # refused
        raise _refuse(self, "set_separate_reduce_scatter_group", "Reductions use the module's own groups.")  # type: ignore[arg-type]  # self is an nn.Module

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:  # noqa: D102  # refused
        raise _refuse(self, "set_allocate_memory_from_process_group_for_comm", "Collectives read and write the "  # type: ignore[arg-type]  # self is an nn.Module
                      "flat buffers directly; leave the call out.")

    def set_symm_mem_for_comm(self, *args: Any, **kwargs: Any) -> None:  # noqa: D102  # refused
        raise _refuse(self, "set_symm_mem_for_comm", "Symmetric-memory collectives are not used; leave the call out.")  # type: ignore[arg-type]  # self is an nn.Module

    def _set_unshard_async_op(self, async_op: bool) -> None:
        raise _refuse(self, "_set_unshard_async_op", "Gathers are issued on their own stream already; use "  # type: ignore[arg-type]  # self is an nn.Module
                      "unshard(async_op=True) for an explicit one.")

    def _get_fsdp_state(self) -> Any:
        raise RuntimeError(f"{type(self).__name__} is managed by composable_shard's fully_shard, not torch's FSDP2, "
                           "and has no FSDP2 state: code that reaches for FSDP2's internals (_get_fsdp_state, "
                           "fully_shard.state(...)) cannot drive it. Use the public FSDPModule methods.")
