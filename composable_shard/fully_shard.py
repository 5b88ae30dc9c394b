"""``fully_shard``: ZeRO-3 data parallelism applied in place, with flat parameters.

Thin public layer: validate, plan, materialize, agreed by every rank (``fully_shard_init.plan_agreed``) -> build handles
(``_setup/fully_shard_init.apply_plan``) -> register hooks (``_runtime/hooks``) -> return the module.

[Note: Groups]  Every strategy is a (shard group, replicate group) pair: FULL_SHARD and
SHARD_GRAD_OP shard over the whole group and replicate over none; NO_SHARD shards over one
rank (the unsharded buffer is the shard itself) and replicates over the group; the hybrid
strategies shard within one group and replicate across the other. Gradients are
reduce-scattered in the shard group, all-reduced in the replicate group, and divided by the
product of both sizes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Union

import torch
import torch.nn as nn

from ._setup import apply_guard as _apply_guard
from ._setup import init_draws as _init_draws
from ._runtime.module_state import FSDP_API_NAME, _FSDPState
from ._runtime.flat_param import norm_groups, take_pending_init_values
from ._setup.data_parallel import check_set_requires_gradient_sync
from ._setup.fully_shard_init import apply_plan, plan_agreed, resolve_groups
from ._runtime.mixed_precision import apply_mixed_precision
from ._setup.validation import check_bool, check_real
from ._runtime.hooks import issue_unshard, reduce_accumulated, register_runtime_hooks
from ._state.optim_state_dict import register_optimizer_state_dict_hooks
from ._state.model_state_dict import check_model_state_dict, register_buffer_dtypes, register_state_dict_hooks
from ._setup.fsdp2_compat import FSDP2_ARGUMENTS, FSDP2Methods, UnshardHandle, fsdp2_arguments
from ._runtime.interop import ForeignWrapperGuard, shard_source, total_grad_norm
from ._base.torch_compat import FSDP2_MODULE_MARKER, set_module_tensor
from ._setup.subclass import _NoCopyMixin, make_subclass
from ._runtime.traversal import _get_fsdp_states
from ._state.unshard_params import check_between_steps, unshard_params
from .api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from .contract import _get_module_state, _register_api, _unregister_api, contract

__all__ = ["fully_shard", "FSDPModule", "clip_grad_norm_"]


class FSDPModule(ForeignWrapperGuard, _NoCopyMixin, _apply_guard.GuardedApply, FSDP2Methods, *FSDP2_MODULE_MARKER):  # type: ignore[misc]  # a tuple of bases
    """Mixin of every fully sharded module (its class becomes ``FSDP<Orig>`` with bases
    ``(FSDPModule, Orig)``). ``copy.deepcopy``/pickle raise: use the state-dict APIs.

    Also a subclass of torch FSDP2's ``FSDPModule``, so that code written for FSDP2 calls its
    methods here (see [Note: FSDP2 drop-in] in ``_setup/fsdp2_compat.py``): the FSDP2 methods are
    implemented, accepted where the step here already does what they ask, or refused."""

    _api_name = "fully_shard"

    def _fsdp_state(self) -> _FSDPState:
        state = _get_module_state(self, _FSDPState)  # type: ignore[arg-type]  # self is an nn.Module
        if state is None:
            raise RuntimeError(f"{type(self).__name__} has no fully_shard state")
        return state  # type: ignore[no-any-return]

    _apply_what = "the flat shards fully_shard gathers from"
    _apply_advice = ("the forward would keep computing on the old values and the optimizer would update copies "
                     "nothing reads. Cast or move the model before fully_shard (device_id= moves it there); for "
                     "low-precision compute use mixed_precision=MixedPrecision(param_dtype=...). A model built on "
                     "the meta device: call to_empty(device=...) on the fully sharded root before its first step, then "
                     "the model's own init; or let fully_shard initialize it (param_init_fn=, or reset_parameters()).")

    def _guarded_params(self) -> List[torch.Tensor]:
        """The original parameters of this module's own handle (for ``_setup/apply_guard``)."""
        handle = self._fsdp_state().handle
        return [p for g in handle.groups for p in g.orig_params] if handle is not None else []

    def _states(self, recurse: bool) -> List[_FSDPState]:
        state = self._fsdp_state()
        if not recurse:
            return [state]
        if state.is_root and state._all_fsdp_states:
            return state._all_fsdp_states
        return _get_fsdp_states(self)  # type: ignore[arg-type]  # self is an nn.Module

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """All-gather this module's parameters now (a later forward reuses them). Idempotent.
        ``async_op=True`` returns an :class:`UnshardHandle` at once, the gathers in flight."""
        check_bool(f"{type(self).__name__}.unshard", "async_op", async_op)
        take_pending_init_values()
        state = self._fsdp_state()
        if state.handle is not None and state.handle.needs_unshard():
            issue_unshard(state, state.handle)
        if async_op:
            return UnshardHandle(self)
        self._finish_unshard()
        return None

    def _finish_unshard(self) -> None:
        state = self._fsdp_state()
        if state.handle is not None:
            state.handle.wait_gathers()  # the views stay the shards' until a forward uses the buffers

    def reshard(self) -> None:
        """Free this module's unsharded parameters. Idempotent."""
        take_pending_init_values()
        state = self._fsdp_state()
        if state.handle is not None:
            state.handle.reshard(free=True)

    def to_empty(self, *, device: Any, recurse: bool = True) -> "FSDPModule":
        """FSDP2's initialization flow: build on the meta device, ``fully_shard``, then
        ``model.to_empty(device=...)`` and the model's own init (``init_weights()``). Buffers and
        tensors no handle owns get new, uninitialized storage on ``device``, as ``nn.Module.to_empty``
        gives; each sharded parameter becomes whole until the model is next used, so that the init
        writes whole parameters (the values an unsharded model gets with the same seed). See
        [Note: Initialization after to_empty] in ``_runtime/flat_param.py``."""
        every = self._states(True)
        trained = any(s._ctx is not None and s._ctx.exec_order_recorded for s in every)  # a backward finished
        if _apply_guard.in_init() or not recurse or trained:
            # fully_shard's own init, or after training began: nn.Module's (the guard refuses the latter)
            return super().to_empty(device=device, recurse=recurse)  # type: ignore[misc,no-any-return]  # nn.Module's
        target = torch.device(device)
        states = [s for s in every if s.handle is not None]
        check_between_steps(states, "to_empty()")
        for s in states:
            where = s.handle.shard_device  # type: ignore[union-attr]  # filtered above
            if target.type != where.type or (target.index is not None and where.index is not None
                                             and target.index != where.index):
                raise ValueError(f"{type(self).__name__}.to_empty(device={device!r}): fully_shard already placed "
                                 f"{s.describe()}'s shards on {where}; pass that device (device_id= at fully_shard "
                                 "chooses it).")
        _init_draws.give_back_draws(self)  # see [Note: Initial weights and the global RNG]
        slots = [(m, name, g.orig_params[i], g.orig_params[i].data) for s in states for g in s.handle.groups  # type: ignore[union-attr]  # filtered above
                 for m, _, name, i in g.registrations()]
        with _apply_guard.applying_during_init():
            super().to_empty(device=device, recurse=True)  # type: ignore[misc]  # buffers and unmanaged tensors
        for m, name, p, data in slots:  # the handles' parameters stay the objects they were, on their shards
            p.data = data
            set_module_tensor(m, name, p)
        for s in states:
            s.handle.expose_for_init()  # type: ignore[union-attr]  # filtered above
        for s in every:
            s.awaiting_init = False
        return self

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward communicates nothing and accumulates unsharded gradients; the next
        backward with True reduces their sum. Example: gradient accumulation over micro-batches."""
        check_set_requires_gradient_sync(self, requires_gradient_sync, recurse)
        for s in self._states(recurse):
            s.sync_gradients = requires_gradient_sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """FSDP1's (and DDP's) ``no_sync``: backward passes run inside communicate nothing and
        accumulate unsharded gradients in this module's tree; the first synced backward after it
        reduces their sum. The flag of :meth:`set_requires_gradient_sync` is read at backward,
        so run the backward inside too; each module's own setting comes back on exit."""
        states = self._states(True)
        before = [s.sync_gradients for s in states]
        for s in states:
            s.sync_gradients = False
        try:
            yield
        finally:
            for s, flag in zip(states, before):
                s.sync_gradients = flag

    def reduce_accumulated_gradients(self) -> None:
        """Reduce now, between steps, what backwards with ``set_requires_gradient_sync(False)``
        accumulated in this module's tree (what the next synced backward would have reduced):
        one reduction per flat group, then ``.grad`` is the reduced shard's view as after a synced
        backward. For loops whose last backward is unsynced too (torch's pipelining schedules,
        through ``composable_shard.integrations.pipelining``). Turns gradient sync back on."""
        take_pending_init_values()
        states = self._states(True)
        for s in states:
            s.sync_gradients = True
        for root in {id(s.root): s.root for s in states if s.root is not None}.values():
            reduce_accumulated(root)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: keep parameters unsharded after backward (saves the next forward's
        all-gather; the caller must reshard before the optimizer updates the shards)."""
        check_bool("FSDPModule.set_reshard_after_backward", "reshard_after_backward", reshard_after_backward)
        check_bool("FSDPModule.set_reshard_after_backward", "recurse", recurse)
        for s in self._states(recurse):
            s.reshard_after_backward = reshard_after_backward

    def summon_full_params(self, writeback: bool = True, rank0_only: bool = False, offload_to_cpu: bool = False,
                           with_grads: bool = False, recurse: bool = True) -> "contextlib.AbstractContextManager[None]":
        """Context manager exposing full parameters; same as :func:`unshard_params`."""
        return unshard_params(self, recurse=recurse, writeback=writeback, rank0_only=rank0_only,  # type: ignore[arg-type]  # self is an nn.Module
                              offload_to_cpu=offload_to_cpu, with_grads=with_grads)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict`` for a full or sharded state dict (see
        :func:`state_dict_type`), except that every key and shape is checked before anything
        is written: a state dict that does not fit raises and leaves the model unchanged."""
        if assign:
            raise NotImplementedError(f"{type(self).__name__}.load_state_dict(assign=True): a fully sharded module's "
                                      "parameters are views of its flat shards and cannot be replaced; load with "
                                      "assign=False (values are copied into the shards).")
        check_model_state_dict(self, state_dict, strict, check_dtype=False, api=f"{type(self).__name__}.load_state_dict")  # type: ignore[arg-type]  # self is an nn.Module
        return super().load_state_dict(state_dict, strict=strict)  # type: ignore[misc]  # nn.Module's, via the dynamic subclass

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients of the whole tree by their total norm over all shards and ranks;
        returns the total norm (before clipping)."""
        return clip_grad_norm_(self, max_norm, norm_type)  # type: ignore[arg-type]  # self is an nn.Module


@contract(state_cls=_FSDPState)
def fully_shard(
    module: nn.Module,
    *,
    process_group: Any = None,
    mesh: Any = None,
    policy: Any = None,
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
    mixed_precision: Optional[MixedPrecision] = None,
    cpu_offload: Optional[CPUOffload] = None,
    ignored_modules: Optional[Iterable[nn.Module]] = None,
    ignored_states: Optional[Iterable[Any]] = None,
    device_id: Union[int, torch.device, None] = None,
    param_init_fn: Optional[Callable[[nn.Module], None]] = None,
    sync_module_states: bool = False,
    forward_prefetch: bool = True,
    backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE,
    limit_all_gathers: bool = True,
    reshard_after_forward: Optional[bool] = None,
    mp_policy: Any = None,
    offload_policy: Any = None,
    ignored_params: Optional[Iterable[nn.Parameter]] = None,
    shard_placement_fn: Any = None,
    dp_mesh_dims: Any = None,
) -> nn.Module:
    """Shard ``module``'s parameters across ranks in place (ZeRO-3 by default).

    Example::

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)                      # or: fully_shard(model, policy=ModuleWrapPolicy({Block}))
        optim = torch.optim.AdamW(model.parameters())   # built after fully_shard
        loss = model(x).sum(); loss.backward(); optim.step()

    Args:
        module: the module to shard; returned, with class ``FSDP<Orig>``.
        process_group: shard group (default: world); a ``(shard, replicate)`` pair for hybrid.
        mesh: a 1-D ``DeviceMesh``, or 2-D ``(replicate, shard)`` for hybrid strategies.
        policy: a ``_Policy`` or function policy choosing more fully sharded modules. A
            parameter several chosen modules share (tied weights) goes to the handle of their
            lowest common fully sharded ancestor.
        strategy: a :class:`ShardingStrategy`.
        mixed_precision: low-precision compute/communication (:class:`MixedPrecision`).
        cpu_offload: :class:`CPUOffload` keeps shards and gradients on the CPU.
        ignored_modules: modules whose parameters are left alone (not sharded, not reduced).
        ignored_states: parameters (or modules) left alone.
        device_id: compute device; CPU-initialized modules are moved there first.
        param_init_fn: materializes meta-device tensors per module, as torch FSDP1's does
            (``param_init_fn(m)`` on each module of the subtree, breadth-first; see docs/api.md);
            without it each module's ``reset_parameters()`` runs once. Meta tensors left raise
            ``ValueError`` on every rank (refusals are agreed by all ranks first).
        sync_module_states: broadcast parameters and buffers from rank 0 first.
        forward_prefetch: all-gather the next handle before the current forward computes.
        backward_prefetch: when to all-gather the next handle in backward (None: never).
        limit_all_gathers: at most two handles' all-gathers in flight, always (prefetch runs one
            ahead); False raises ``ValueError`` ([Note: limit_all_gathers] in ``_setup/validation.py``).
        reshard_after_forward: FSDP2's name for the choice of strategy: True is FULL_SHARD
            (HYBRID_SHARD on a 2-D mesh), False SHARD_GRAD_OP (_HYBRID_SHARD_ZERO2); not with
            ``strategy``.
        mp_policy: FSDP2's ``MixedPrecisionPolicy``, mapped onto ``mixed_precision`` with
            FSDP2's casts (see [Note: FSDP2 drop-in] in ``_setup/fsdp2_compat.py``).
        offload_policy: FSDP2's ``OffloadPolicy``/``CPUOffloadPolicy``, mapped onto ``cpu_offload``.
        ignored_params: FSDP2's name for ``ignored_states`` given as parameters.
        shard_placement_fn: FSDP2's per-parameter placements; anything but None raises.
        dp_mesh_dims: FSDP2's data-parallel sub-mesh of an SPMD mesh; anything but None raises.
    """
    fsdp2 = dict(reshard_after_forward=reshard_after_forward, mp_policy=mp_policy, offload_policy=offload_policy,
                 ignored_params=ignored_params, shard_placement_fn=shard_placement_fn, dp_mesh_dims=dp_mesh_dims,
                 mixed_precision=mixed_precision, cpu_offload=cpu_offload, ignored_states=ignored_states,
                 strategy_given=strategy is not ShardingStrategy.FULL_SHARD)
    overrides = fsdp2_arguments(f"fully_shard({type(module).__name__})", fsdp2,
                                hybrid=mesh is not None and getattr(mesh, "ndim", 1) == 2) \
        if any(fsdp2[k] is not None for k in FSDP2_ARGUMENTS) or (mesh is not None and getattr(mesh, "ndim", 1) == 2) \
        else {}
    strategy = overrides.get("strategy", strategy)
    mixed_precision = overrides.get("mixed_precision", mixed_precision)
    cpu_offload = overrides.get("cpu_offload", cpu_offload)
    ignored_states = overrides.get("ignored_states", ignored_states)
    kwargs = dict(process_group=process_group, mesh=mesh, policy=policy, strategy=strategy,
                  mixed_precision=mixed_precision, cpu_offload=cpu_offload, ignored_modules=ignored_modules,
                  ignored_states=ignored_states, device_id=device_id, param_init_fn=param_init_fn,
                  sync_module_states=sync_module_states, forward_prefetch=forward_prefetch,
                  backward_prefetch=backward_prefetch, limit_all_gathers=limit_all_gathers)
    given = module
    if isinstance(module, (list, tuple)) and len({id(m) for m in module}) == 1:
        module = module[0]  # a list of one module is that module, as in FSDP2
    if isinstance(module, (list, tuple)):
        return _fully_shard_group(module, kwargs)
    plan = plan_agreed(module, kwargs)  # every refusal before the first collective, agreed by all ranks
    groups = {s: resolve_groups(s, process_group, mesh) for s in plan.strategies}
    apply_plan(plan, fully_shard.state(module), groups, _FSDPState, _finish_target)  # type: ignore[arg-type]  # state set by contract
    state = fully_shard.state(module)
    if reshard_after_forward and state is not None:  # FSDP2's, asked for explicitly: a root frees after forward too
        state.root_reshards_after_forward = True  # (hooks.frees_after_forward)
    return given  # type: ignore[no-any-return]  # the module, or the list it came in


class ModuleGroup(nn.Module):
    """The modules of one ``fully_shard([a, b, ...])`` call as the children of a module that is not
    part of the model: what the call plans and flattens, and its state's ``module``. Never called."""

    def __init__(self, members: List[nn.Module]) -> None:
        super().__init__()
        for i, member in enumerate(members):
            self.add_module(str(i), member)

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D102  # never called
        raise RuntimeError("a fully_shard group of modules is not a module of the model; call its members")


def _fully_shard_group(modules: Any, kwargs: Dict[str, Any]) -> Any:
    """``fully_shard([a, b, ...])``: one handle over the listed modules' parameters (FSDP2's
    grouping; see [Note: Groups of modules] in ``_runtime/hooks.py``). Planned and applied on a
    :class:`ModuleGroup` of them; each member then gets the state, the class and the hooks."""
    members = list({id(m): m for m in modules}.values())
    api = f"fully_shard([{', '.join(type(m).__name__ for m in members)}])"
    nested = [type(m).__name__ for m in members if any(o is not m and any(x is m for x in o.modules()) for o in members)]
    if nested:
        raise ValueError(f"{api}: {nested} lie inside other modules of the list; list modules that are not inside "
                         "one another (the outer one's handle already takes the inner one's parameters).")
    if kwargs["policy"] is not None:
        raise ValueError(f"{api}: a policy chooses fully sharded modules inside one module; with a list of modules "
                         "pass policy=None (or call fully_shard on each module with its policy).")
    state = fully_shard.state(members[0])
    if state is None:
        raise AssertionError("composable_shard internal error: the contract attached no state to the group")
    for m in members:  # the group carries the state while it is planned, so the members are not "already sharded"
        _unregister_api(m, FSDP_API_NAME)
    group = ModuleGroup(members)
    _register_api(group, FSDP_API_NAME, state)
    state.members = members
    try:
        plan = plan_agreed(group, kwargs)
        groups = {s: resolve_groups(s, kwargs["process_group"], kwargs["mesh"]) for s in plan.strategies}
        apply_plan(plan, state, groups, _FSDPState, _finish_target)  # type: ignore[arg-type]  # state set above
    except BaseException:
        state.members = None
        for m in members:
            _register_api(m, FSDP_API_NAME, state)  # as the contract left it: it takes them out again
        raise
    return modules


def _finish_target(module: nn.Module, state: _FSDPState) -> None:
    """Attach the state, swap the class, register the hooks."""
    if _get_module_state(module, _FSDPState) is not state:
        _register_api(module, FSDP_API_NAME, state)
    if state.members is not None and module is state.module:
        for member in state.members:
            _register_api(member, FSDP_API_NAME, state)
            make_subclass(member, "FSDP", FSDPModule)
    else:
        make_subclass(module, "FSDP", FSDPModule)
    register_runtime_hooks(state, module)
    register_state_dict_hooks(state)
    register_optimizer_state_dict_hooks(state)
    for cast, original in apply_mixed_precision(state, module):
        register_buffer_dtypes(cast, original)


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of every parameter of ``module`` by their total norm over all shards
    on all ranks: what ``torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm,
    norm_type)`` returns and does on one process holding the whole model (the norm of the
    per-parameter norms; any real ``norm_type``, ``inf``, ``-inf`` and 0 included), on any mix
    of strategies, process groups and ``replicate``. Returns the total norm.

    Example::

        loss.backward()
        total = clip_grad_norm_(model, 1.0)
        optim.step()
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"clip_grad_norm_: module must be an nn.Module, got {type(module).__name__}")
    max_norm = _check_clip_arguments(max_norm, norm_type)
    norm_type = float(norm_type)
    states = _get_fsdp_states(module)
    unsynced = [s.describe() for s in states if s.handle is not None
                and any(v is not None for g in s.handle.groups for v in g.unsynced_views)]
    if unsynced:  # checked identically on every rank: sync flags and backwards match across ranks
        raise RuntimeError(f"clip_grad_norm_ between backwards without gradient sync ({', '.join(unsynced)}): "
                           ".grad holds each rank's own unreduced gradient, whose norm is not the global one. "
                           "Clip after the synced backward (set_requires_gradient_sync(True)).")
    sources = _shard_sources(states)
    params = [p for p in module.parameters() if p.grad is not None]
    grads: List[torch.Tensor] = [p.grad for p in params]  # type: ignore[misc]  # filtered above
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=states[0].compute_device if states else None)
    total = total_grad_norm(grads, [sources.get(id(p)) for p in params], norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's clip_grads_with_norm_
    for grad in grads:
        grad.mul_(coef.to(grad.device))
    return total


def _check_clip_arguments(max_norm: Any, norm_type: Any) -> float:
    """``max_norm`` a number >= 0, ``norm_type`` any number but NaN (``float('inf')``: the max
    norm, ``-inf``: the min, 0: the count of non-zero elements, as torch's); raises before any
    collective, identically on every rank."""
    max_norm = check_real("clip_grad_norm_", "max_norm", max_norm)
    check_real("clip_grad_norm_", "norm_type", norm_type)
    if max_norm < 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be >= 0, got {max_norm}")
    return max_norm


def _shard_sources(states: List[_FSDPState]) -> Dict[int, Any]:
    """``id(parameter)`` -> the groups its gradient's norm is combined over (see
    :func:`interop.shard_source`), for the original parameters of handles sharded over more
    than one rank (FULL_SHARD, SHARD_GRAD_OP, the hybrids: their shard group only, never the
    replicate group) and for tensor-parallel pieces (the mesh dimensions that shard them). NO_SHARD, ``replicate`` and unmanaged gradients are whole and equal on
    every rank: absent, counted once (so is a parameter of a handle above ``module``, whose
    sharded ``.grad`` carries its group: see :func:`interop.total_grad_norm`)."""
    sources: Dict[int, Any] = {}
    for s in states:
        group = s.process_group if s.world_size > 1 else None
        for g in s.handle.groups if s.handle is not None else ():
            for p, piece in zip(g.orig_params, g.flat_param._pieces):
                over = norm_groups(group, piece)
                if over:
                    sources[id(p)] = shard_source(over, s.compute_device)
    return sources
