"""``replicate``: DDP semantics applied in place, built on per-parameter gradient hooks.

[Note: Life of a gradient in replicate]  one synced training step, default comm path
  init            module states broadcast from rank 0; buckets planned in reverse
                  registration order, each one flat ``flat_grad`` buffer with one slot per
                  parameter; one post-accumulate-grad hook per managed parameter
  forward         nothing: no forward hooks, parameters are full replicas
  grad ready      hook of parameter p in bucket b: slot = p.grad * 1/W (in place if p.grad
                  already is the slot, a view); b counts one more ready slot
  bucket full     launched once buckets 0..b-1 are (see [Note: Launch order]):
                  all_reduce(flat_grad) async -> overlaps the rest of backward
  end_backward    queued by the first hook: launch the buckets still waiting (missing gradients
                  contribute p.grad if set, else zeros), all-reduce the used-parameter counts,
                  wait every bucket, p.grad = its slot (a view; a cast copy if the reduce dtype
                  differs). Parameters no rank used keep their .grad untouched (DDP with
                  find_unused_parameters=True).
  first sync end  buckets rebuilt once from rank 0's gradient-ready order ([Note: Bucket rebuild])
  no sync         hooks only record use; gradients accumulate locally (in the slots once they
                  are views), and the next synced backward reduces the accumulated sum

[Note: Launch order]  Buckets are launched strictly by index: a full bucket waits until every
earlier bucket was launched. Ranks may see different unused parameters or a different hook
order, yet they issue the same all-reduces in the same order, so none can hang or pair the
wrong buffers.

[Note: Bucket rebuild]  Registration order is only a guess of the order gradients arrive.
The first backward records the order the hooks fired in; at the end of the first synced
backward rank 0 broadcasts its order and every rank rebuilds the same buckets from it, once.
Gradients that are slot views move to the new buffers.

[Note: Parameters unfrozen later]  A parameter frozen (``requires_grad=False``) when replicate
runs gets no bucket slot and no hook. If it is unfrozen later (progressive unfreezing, a head
trained first), the next forward of the replicated module adopts it: it joins the managed
parameters in registration order (managed ones frozen since leave them), the hooks are
registered again and the buckets are planned again (and rebuilt once more from the next synced
backward's gradient-ready order). No
collective runs at adoption, so a forward only some ranks run (an evaluation on rank 0) is
harmless; every rank must unfreeze the same parameters before its next backward, as every rank
must hold the same model. Without adoption its gradient would stay each rank's own, silently
(torch's DDP behaves that way). A backward that reaches such a parameter without a forward of
the replicated module first (a submodule called directly) raises at its end instead.

Limits: one gradient accumulation per parameter per backward (reentrant checkpointing is not
supported); buffers are broadcast at init only (DDP's ``broadcast_buffers=False``); a rank whose
backward gives no managed parameter a gradient while others do would leave them waiting.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import weakref
from typing import Any, Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Set, Tuple, Union, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from ._setup import apply_guard as _apply_guard
from ._runtime import collectives as _collectives
from ._runtime import watch as _watch
from ._runtime.module_state import WeakGroup, WeakHook
from ._setup.data_parallel import (_expand_ignored_modules, _ignored_params, _join, _managed_modules,
                                   agreed, agreement_groups, broadcast_from_rank0, check_composition,
                                   check_not_inside_other_api, check_set_requires_gradient_sync, normalize_device,
                                   note_replicated)
from ._runtime.agreement import agree_used_and_steps
from ._setup.validation import (check_dense_gradients, check_device_id, check_mixed_precision, check_modules,
                                check_process_group, check_real, check_tensor_parallel)
from ._runtime.interop import ForeignWrapperGuard
from ._setup.subclass import _NoCopyMixin, make_subclass
from ._base.torch_compat import queue_backward_callback
from ._base.tree import local_piece
from .api import MixedPrecision
from .comm_hooks import CommHook, GradBucket
from .contract import _State, _get_module_state, contract
from ._state.model_state_dict import agree_torch_load

__all__ = ["replicate", "ReplicateModule"]

logger = logging.getLogger("composable_shard")

_MB = 1024 * 1024
_FIRST_BUCKET_BYTES = 1 * _MB  # the first bucket closes early, so an all-reduce starts soon into backward
_SPARSE_WHY = "replicate's buckets cannot reduce (torch's DDP can; replicate reduces dense gradients only)"


class _Waitable(Protocol):
    """A launched bucket reduction: a ``_collectives.Pending`` or a comm hook's future."""

    def wait(self) -> torch.Tensor: ...


class _Bucket:
    """Gradients of several parameters in one flat buffer, reduced by one collective."""

    def __init__(self, index: int, param_indices: List[int], params: List[nn.Parameter], dtype: torch.dtype) -> None:
        pieces = [local_piece(p) for p in params]  # a tensor-parallel parameter: this rank's piece
        numels = [t.numel() for t in pieces]
        offsets = [sum(numels[:k]) for k in range(len(numels))]
        device = params[0].device
        self.index: int = index  # launch position, the same on every rank ([Note: Launch order])
        self.param_indices: List[int] = param_indices  # positions in _ReplicateState.params
        self.params: List[nn.Parameter] = params  # parameters whose gradients fill the slots
        self.flat_grad: torch.Tensor = torch.zeros(sum(numels), dtype=dtype, device=device)  # one slot per parameter
        self.slots: List[torch.Tensor] = [  # flat_grad[offset:offset+numel] in the (local piece's) shape
            self.flat_grad[o : o + n].view(t.shape) for o, n, t in zip(offsets, numels, pieces)
        ]
        self.slots_are_grads: bool = all(p.dtype == dtype for p in params)  # slots may serve as p.grad
        self.num_ready: int = 0  # slots filled in the current backward
        self.pending: Optional[_Waitable] = None  # launched reduction of the current backward

    @property
    def nbytes(self) -> int:
        return self.flat_grad.numel() * self.flat_grad.element_size()


class _BackwardPass:
    """Bookkeeping of one backward, created by its first gradient hook."""

    def __init__(self, syncs: bool, num_params: int) -> None:
        self.syncs: bool = syncs  # reduce in this backward (the sync flag at its first hook)
        self.is_ready: List[bool] = [False] * num_params  # per parameter: its hook fired
        self.next_launch: int = 0  # index of the first bucket not launched yet


class _ReplicateState(_State):
    """Everything ``replicate`` keeps for one module; attached by ``@contract``."""

    process_group = WeakGroup()

    def __init__(self) -> None:
        super().__init__()
        self.process_group = None  # gradients averaged over it (None: default), held weakly (see WeakGroup)
        self.world_size: int = 1  # ranks in process_group
        self.device: torch.device = torch.device("cpu")  # device of the managed parameters
        self.params: List[nn.Parameter] = []  # managed parameters, registration order
        self.param_names: List[str] = []  # FQN (relative to the module) of each managed parameter
        self.bucket_cap_bytes: int = 0  # a bucket closes once its flat_grad reaches this size
        self.reduce_dtype: Optional[torch.dtype] = None  # dtype of flat_grad (None: the parameter's)
        self.buckets: List[_Bucket] = []  # in launch order
        self.slot_of: List[Tuple[_Bucket, int]] = []  # per parameter: (its bucket, slot position)
        self.sync_gradients: bool = True  # set_requires_gradient_sync flag
        self.comm_hook: Optional[CommHook] = None  # replaces the default average when set
        self.comm_hook_state: object = None  # first argument of comm_hook
        self.num_backwards: int = 0  # backward passes finished
        self.ready_order: List[int] = []  # parameter indices in hook order, first backward only
        self.num_rebuilds: int = 0  # bucket rebuilds done (0 or 1)
        self.used_since_sync: List[bool] = []  # per parameter: got a gradient since the last sync
        self.backward: Optional[_BackwardPass] = None  # the backward in progress, None when idle
        self.hook_handles: List[RemovableHandle] = []  # post-accumulate-grad hooks
        self.frozen: List[Tuple[str, nn.Parameter]] = []  # not managed yet: frozen at replicate (see [Note: Parameters unfrozen later])
        self.position: Dict[int, int] = {}  # id of a managed or frozen parameter -> its registration position
        self.api: str = ""  # "replicate(<class name>)", for messages
        self.step_counter: Optional[_watch.StepCounter] = None  # optimizer steps, agreed per sync ([Note: Step agreement])
        self.step_verdict: Optional[_watch.StepVerdict] = None  # the last sync's step agreement, read at the next one
        self.skipped: Set[nn.Module] = set()  # modules replicate leaves alone (ignored, another API's)
        self.sync_buffers: bool = True  # broadcast rank 0's buffers before the next forward ([Note: Buffers follow rank 0])

    def describe(self) -> str:
        return f"replicate (of the module with parameters {', '.join(self.param_names[:3])}{', ...' if len(self.param_names) > 3 else ''})"


class ReplicateModule(ForeignWrapperGuard, _NoCopyMixin, _apply_guard.GuardedApply):
    """Methods a module gains from :func:`replicate` (its class becomes ``Replicate<Orig>``)."""

    _api_name = "replicate"

    _apply_what = "the gradient buckets replicate built for them"
    _apply_advice = ("their gradients would no longer be averaged across ranks (each rank would keep its own). "
                     "Cast or move the model before replicate (device_id= moves it there).")

    def _guarded_params(self) -> List[torch.Tensor]:
        """The parameters this module's replicate manages (for ``_setup/apply_guard``)."""
        return list(_state_of(self).params)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """``False``: backward passes communicate nothing and gradients accumulate locally;
        the next backward with ``True`` averages the accumulated sum (DDP's ``no_sync``). Not a
        bool: ``TypeError``, the flag unchanged ([Note: One behaviour for both APIs])."""
        check_set_requires_gradient_sync(self, requires_gradient_sync)
        _state_of(self).sync_gradients = requires_gradient_sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's ``no_sync``: the backward passes run inside communicate nothing and gradients
        accumulate locally; the first backward after it averages the accumulated sum. The flag
        of :meth:`set_requires_gradient_sync` is read at backward (DDP reads it at forward), so
        run the backward inside too; the setting it had comes back on exit."""
        state = _state_of(self)
        before = state.sync_gradients
        state.sync_gradients = False
        try:
            yield
        finally:
            state.sync_gradients = before

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> Future[Tensor]`` (torch DDP's
        signature; see ``composable_shard.comm_hooks``). The future's tensor is written back
        as the bucket's averaged gradient. Once, before the first backward."""
        replicate_state = _state_of(self)
        if not callable(hook):
            raise TypeError(f"replicate.register_comm_hook: hook must be callable, got {hook!r}")
        if replicate_state.comm_hook is not None:
            raise RuntimeError(f"replicate({type(self).__name__}): a comm hook is already registered; "
                               "register_comm_hook may be called once.")
        if replicate_state.num_backwards > 0 or replicate_state.backward is not None:
            raise RuntimeError(f"replicate({type(self).__name__}): register_comm_hook must be called "
                               "before the first backward; register it right after replicate(...).")
        replicate_state.comm_hook, replicate_state.comm_hook_state = hook, state


def _state_of(module: object) -> _ReplicateState:
    state = _get_module_state(cast(nn.Module, module), _ReplicateState)
    if state is None:  # pragma: no cover - the mixin exists only on replicated modules
        raise RuntimeError(f"{type(module).__name__} is not managed by replicate")
    return cast(_ReplicateState, state)


@contract(state_cls=_ReplicateState)
def replicate(
    module: nn.Module,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    device_id: Union[int, torch.device, None] = None,
    ignored_modules: Optional[Iterable[nn.Module]] = None,
    bucket_cap_mb: float = 25.0,
    mixed_precision: Optional[MixedPrecision] = None,
) -> nn.Module:
    """Make ``module`` data parallel in place with DDP semantics; returns the same object.

    Parameters and buffers are broadcast from rank 0; in backward, bucketed all-reduces average
    gradients over ``process_group`` as buckets fill (done when ``backward()`` returns). The
    class becomes ``Replicate<Orig>``; FQNs and ``state_dict`` are unchanged.

    Example::

        dist.init_process_group("gloo")
        model = replicate(Net(), bucket_cap_mb=25)
        optim = torch.optim.AdamW(model.parameters())
        model(batch).sum().backward()      # gradients averaged across ranks
        optim.step()

    Args:
        module: the module to replicate; must not be managed by ``fully_shard``.
        process_group: the group to average over (default: the default group). With
            tensor-parallel (``DTensor``) parameters, the data-parallel dimension's group (e.g.
            ``mesh["dp"].get_group()``): each parameter's local piece is averaged over it, and
            its gradient stays a ``DTensor`` placed as the parameter.
        device_id: an int (CUDA index) or device to move the module to first.
        ignored_modules: subtrees whose parameters are neither broadcast nor reduced.
            Subtrees managed by ``fully_shard`` or ``replicate`` are skipped too, as are
            frozen (``requires_grad=False``) parameters until they are unfrozen (see
            [Note: Parameters unfrozen later]).
        bucket_cap_mb: the size of a bucket's flat buffer (MiB, in the reduce dtype).
        mixed_precision: only ``effective_reduce_dtype`` is used: the dtype of the all-reduce.
    """
    api = f"replicate({type(module).__name__})"
    check_process_group(api, process_group)  # the group the checks are agreed in ([Note: Agreed refusals])
    skipped = agreed(api, agreement_groups(process_group, None), functools.partial(
        _check, api, module, process_group, device_id, ignored_modules, bucket_cap_mb, mixed_precision),
        lambda skipped: [[n, list(t.shape), str(t.dtype), t.requires_grad] for n, t in _module_states(module, skipped)],
        applied="replicate", what="ranks disagree on the parameters and buffers replicate broadcasts from rank 0 "
        "and reduces", tag="replicate::check_states", digest_first=False)
    device = normalize_device(device_id)
    if device is not None:
        module.to(device)
    states = _module_states(module, skipped)
    broadcast_from_rank0([local_piece(t) for _, t in states], [_group_or_world(process_group)], None,
                         tag="replicate::init_broadcast")
    make_subclass(module, "Replicate", ReplicateModule)
    _state_of(module).skipped = skipped
    _init_state(_state_of(module), module, api, process_group, states, int(bucket_cap_mb * _MB), mixed_precision)
    module.register_forward_pre_hook(WeakHook(_broadcast_buffers, _state_of(module)))
    module.register_forward_hook(WeakHook(_after_forward, _state_of(module)))
    return module


# [Note: Buffers follow rank 0]  As torch's DDP (``broadcast_buffers=True``, its default): before
# a forward, the buffers replicate manages (a BatchNorm's running statistics and step count,
# any registered buffer; not those of skipped subtrees) are broadcast from the group's rank 0, so
# every rank computes with, and ends up holding, rank 0's, unless the previous forward ran without
# grad or with gradient sync off (an eval forward, or a no_sync micro-batch: DDP skips the
# broadcast after those too). Without it each rank kept statistics of its own data: eval outputs
# differed between ranks and from DDP's. One broadcast per dtype of buffers, none without buffers.
def _broadcast_buffers(state: _ReplicateState, module: nn.Module, args: Tuple[Any, ...]) -> None:
    if not state.sync_buffers or state.world_size == 1:
        return
    buffers = [b for _, m in _managed_modules(module, state.skipped) for b in m.buffers(recurse=False)
               if type(b) is torch.Tensor]  # a tensor-parallel (DTensor) buffer is each rank's own piece
    by_kind: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
    for b in buffers:
        by_kind.setdefault((b.dtype, b.device), []).append(b)
    with torch.no_grad():
        for same in by_kind.values():
            flat = torch.cat([b.reshape(-1) for b in same])
            _collectives.broadcast(flat, 0, state.process_group, tag=f"{state.api}::buffers")
            for b, piece in zip(same, flat.split([b.numel() for b in same])):
                b.copy_(piece.view_as(b))


def _after_forward(state: _ReplicateState, module: nn.Module, args: Tuple[Any, ...], output: Any) -> None:
    state.sync_buffers = torch.is_grad_enabled() and state.sync_gradients


# ---------------------------------------------------------------- init: validate, plan
def _check(api: str, module: nn.Module, process_group: Optional[dist.ProcessGroup],
           device_id: Union[int, torch.device, None], ignored_modules: Optional[Iterable[nn.Module]],
           bucket_cap_mb: float, mixed_precision: Optional[MixedPrecision]) -> Set[nn.Module]:
    """Every refusal before the first collective; returns the modules replicate leaves alone:
    ignored subtrees and those another data-parallel API manages (``fully_shard`` or a nested
    ``replicate``)."""
    check_device_id(api, device_id)
    ignored = check_modules(api, "ignored_modules", ignored_modules)
    if not 0 < check_real(api, "bucket_cap_mb", bucket_cap_mb) < math.inf:
        raise ValueError(f"{api}: bucket_cap_mb must be a positive, finite number of MiB, got {bucket_cap_mb!r}")
    check_mixed_precision(api, mixed_precision)
    check_composition(api, module, "fully_shard", "Apply replicate to a module fully_shard does not manage, or use "
                      "fully_shard(..., strategy=ShardingStrategy.NO_SHARD) for DDP-like behaviour.")
    check_not_inside_other_api(api, module, [], _watch.owner_of(module))  # [Note: Inside another API's module]
    if mixed_precision is not None and (mixed_precision.param_dtype is not None
                                        or mixed_precision.buffer_dtype is not None):
        raise NotImplementedError(f"{api}: replicate computes in the parameters' dtype and only supports "
                                  "MixedPrecision(reduce_dtype=...); use fully_shard for param_dtype/buffer_dtype.")
    skipped = _expand_ignored_modules(module, ignored, None, {"fully_shard", "replicate"})
    states = _module_states(module, skipped)
    check_tensor_parallel(api, states, [process_group])
    trainable = [t for _, t in states if isinstance(t, nn.Parameter) and t.requires_grad]
    check_dense_gradients(api, _managed_modules(module, skipped), {id(p) for p in trainable}, _SPARSE_WHY)
    if device_id is None:
        _check_one_device(module, trainable)
    return skipped


def _module_states(module: nn.Module, skipped: Set[nn.Module]) -> List[Tuple[str, torch.Tensor]]:
    """Parameters (frozen ones too) and buffers outside skipped modules, once each, registration order."""
    seen = {id(p) for p in _ignored_params(skipped, None)}
    states: List[Tuple[str, torch.Tensor]] = []
    for prefix, m in _managed_modules(module, skipped):
        for name, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
            if id(t) not in seen:
                seen.add(id(t))
                states.append((_join(prefix, name), t))
    return states


def _check_one_device(module: nn.Module, params: List[nn.Parameter]) -> None:
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise NotImplementedError(f"replicate({type(module).__name__}): parameters on several devices "
                                  f"{sorted(map(str, devices))}; move the module to one device (device_id=...).")


# ---------------------------------------------------------------- init: mutate
def _init_state(state: _ReplicateState, module: nn.Module, api: str, group: Optional[dist.ProcessGroup],
                states: List[Tuple[str, torch.Tensor]], bucket_cap_bytes: int,
                mixed_precision: Optional[MixedPrecision]) -> None:
    """Fill the state and manage the trainable parameters; with frozen ones, a forward pre-hook
    adopts them once unfrozen ([Note: Parameters unfrozen later])."""
    candidates = [(n, cast(nn.Parameter, t)) for n, t in states if isinstance(t, nn.Parameter)]
    state.api, state.position = api, {id(p): k for k, (_, p) in enumerate(candidates)}
    state.process_group, state.world_size = group, dist.get_world_size(group)
    state.device = next((p.device for _, p in candidates if p.requires_grad), torch.device("cpu"))
    state.bucket_cap_bytes = bucket_cap_bytes
    state.reduce_dtype = mixed_precision.effective_reduce_dtype if mixed_precision is not None else None
    _manage(state, candidates, {})
    note_replicated(module, [p for _, p in candidates])  # [Note: Inside another API's module] in _setup/data_parallel.py
    state.step_counter = _ReplicateSteps((p for _, p in candidates), dp_world_size=state.world_size,
                                         ignored=(p for m in state.skipped for p in m.parameters()))
    module.register_load_state_dict_pre_hook(_agree_before_model_load)
    if state.frozen:
        module.register_forward_pre_hook(WeakHook(_adopt_unfrozen, state))


class _ReplicateSteps(_watch.StepCounter):
    """The step counter of a replicated module, which also hooks the loads of every optimizer it
    counts: [Note: torch's loads on every rank] in ``_state/model_state_dict.py`` (torch's
    ``set_state_dict`` with a model state dict on rank 0 only loaded the replicas there alone:
    replicas silently apart)."""

    def stepped(self, optimizer: torch.optim.Optimizer) -> None:
        super().stepped(optimizer)
        if optimizer not in _LOADS_HOOKED:
            _LOADS_HOOKED.add(optimizer)
            optimizer.register_load_state_dict_pre_hook(_agree_before_optimizer_load)


_LOADS_HOOKED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def _agree_before_optimizer_load(optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Also gives the optimizer copies of the state's tensors (torch's loader keeps the caller's: after
    ``get_state_dict(a)``, ``set_state_dict(b)`` in one process, two optimizers stepped one ``step`` and one
    ``exp_avg``), as the library's own loads and fully_shard's hooks do."""
    agree_torch_load(at_model=False)
    if not isinstance(state_dict.get("state"), dict):
        return None
    owned = {key: {name: value.detach().clone() if type(value) is torch.Tensor else value  # not a ShardedSlice
                   for name, value in entries.items()} if isinstance(entries, dict) else entries
             for key, entries in state_dict["state"].items()}
    return {**state_dict, "state": owned}


def _agree_before_model_load(module: nn.Module, *args: Any) -> None:
    agree_torch_load(at_model=True)


def _manage(state: _ReplicateState, candidates: List[Tuple[str, nn.Parameter]], used: Dict[int, bool]) -> None:
    """Manage the trainable ``candidates`` (registration order; ``used``: id -> got a gradient
    since the last sync), the frozen ones wait: plan the buckets in reverse order and register
    one gradient hook per managed parameter."""
    managed = [(n, p) for n, p in candidates if p.requires_grad]
    state.param_names, state.params = [n for n, _ in managed], [p for _, p in managed]
    state.frozen = [(n, p) for n, p in candidates if not p.requires_grad]
    state.used_since_sync = [used.get(id(p), False) for p in state.params]
    _install_buckets(state, _build_buckets(state, list(reversed(range(len(state.params))))))
    for handle in state.hook_handles:
        handle.remove()
    state.hook_handles = [  # see [Note: Hooks on tensors hold weakly]
        p.register_post_accumulate_grad_hook(WeakHook(functools.partial(_on_grad_ready, param_index=i), state))
        for i, p in enumerate(state.params)
    ]


def _adopt_unfrozen(state: _ReplicateState, module: nn.Module, args: Tuple[Any, ...]) -> None:
    """Forward pre-hook, registered only when some parameter was frozen at replicate: manage
    the ones unfrozen since (see [Note: Parameters unfrozen later])."""
    unfrozen = [(n, p) for n, p in state.frozen if p.requires_grad]
    if not unfrozen or state.backward is not None:
        return
    check_dense_gradients(state.api, module.named_modules(), {id(p) for _, p in unfrozen}, _SPARSE_WHY)
    _check_one_device(module, state.params + [p for _, p in unfrozen])
    used = {id(p): u for p, u in zip(state.params, state.used_since_sync)}
    candidates = sorted(list(zip(state.param_names, state.params)) + state.frozen, key=lambda np: state.position[id(np[1])])
    _manage(state, candidates, used)  # managed ones frozen since leave too
    state.ready_order, state.num_rebuilds = [], 0
    logger.debug("replicate: adopted %d unfrozen parameter(s): %s", len(unfrozen), [n for n, _ in unfrozen])


def _build_buckets(state: _ReplicateState, order: Sequence[int]) -> List[_Bucket]:
    """Fill buckets greedily along ``order`` (parameter indices), one open bucket per
    (dtype, device); a bucket closes when its flat_grad reaches bucket_cap_bytes, the first one
    already at 1 MiB (as torch's DDP does: the gradients that are ready first start
    communicating at once instead of waiting for a whole bucket). Buckets are ordered by the
    position of their first parameter in ``order``."""
    open_buckets: Dict[Tuple[torch.dtype, torch.device], Tuple[List[int], int]] = {}
    closed: List[List[int]] = []
    for i in order:
        p = state.params[i]
        key = (p.dtype, p.device)
        members, nbytes = open_buckets.pop(key, ([], 0))
        members.append(i)
        nbytes += local_piece(p).numel() * (state.reduce_dtype or p.dtype).itemsize
        if nbytes >= (state.bucket_cap_bytes if closed else min(state.bucket_cap_bytes, _FIRST_BUCKET_BYTES)):
            closed.append(members)
        else:
            open_buckets[key] = (members, nbytes)
    closed.extend(members for members, _ in open_buckets.values())
    position = {i: k for k, i in enumerate(order)}
    closed.sort(key=lambda members: position[members[0]])
    return [
        _Bucket(k, members, [state.params[i] for i in members], state.reduce_dtype or state.params[members[0]].dtype)
        for k, members in enumerate(closed)
    ]


@torch.no_grad()
def _install_buckets(state: _ReplicateState, buckets: List[_Bucket]) -> None:
    """Make ``buckets`` current; gradients that are slot views move into the new slots."""
    where: Dict[int, Tuple[_Bucket, int]] = {}
    for bucket in buckets:
        for slot, (i, p) in enumerate(zip(bucket.param_indices, bucket.params)):
            where[i] = (bucket, slot)
            if p.grad is not None and bucket.slots_are_grads and state.buckets:
                bucket.slots[slot].copy_(local_piece(p.grad))
                p.grad = _as_grad(p, bucket.slots[slot])
    state.buckets, state.slot_of = buckets, [where[i] for i in range(len(state.params))]


# ---------------------------------------------------------------- runtime: backward


def _on_grad_ready(state: _ReplicateState, param: nn.Parameter, *, param_index: int) -> None:
    """Post-accumulate-grad hook of ``state.params[param_index]``.

    Pre: ``param.grad`` holds the gradient accumulated in this backward.
    Post: the parameter is ready; when syncing, its slot is filled and every bucket that is
    full and next in launch order is launched ([Note: Launch order])."""
    if state.backward is None:  # the first hook of a backward opens its bookkeeping and queues its end
        state.backward = _BackwardPass(state.sync_gradients, len(state.params))
        queue_backward_callback(functools.partial(_end_backward, state))
    backward = state.backward
    _mark_ready(state, backward, param_index)
    if not backward.syncs:
        return
    bucket, slot = state.slot_of[param_index]
    _fill_slot(bucket, slot, _pre_scale(state))
    bucket.num_ready += 1
    if _is_full(bucket):
        _launch_buckets(state, backward)


def _mark_ready(state: _ReplicateState, backward: _BackwardPass, param_index: int) -> None:
    if backward.is_ready[param_index]:
        raise RuntimeError(
            f"replicate: parameter '{state.param_names[param_index]}' received its gradient twice in "
            "one backward; replicate supports one gradient accumulation per parameter per backward "
            "(use non-reentrant activation checkpointing).")
    backward.is_ready[param_index] = True
    state.used_since_sync[param_index] = True
    if state.num_backwards == 0:
        state.ready_order.append(param_index)


def _pre_scale(state: _ReplicateState) -> Optional[float]:
    """Factor the default path applies while filling slots (1/W, as DDP), so the summing
    all-reduce yields the average; comm hooks get the raw sum and divide themselves."""
    return None if state.comm_hook is not None or state.world_size == 1 else 1.0 / state.world_size


def _fill_slot(bucket: _Bucket, slot: int, scale: Optional[float]) -> None:
    """Put the parameter's local gradient times ``scale`` (zeros if it has none) into its
    slot: one pass over the gradient whether or not it already is the slot."""
    grad, view = bucket.params[slot].grad, bucket.slots[slot]
    grad = None if grad is None else _placed_piece(bucket.params[slot], grad)
    if grad is None:
        view.zero_()
    elif _apply_guard.same_view(grad, view):
        if scale is not None:
            view.mul_(scale)
    elif scale is None:
        view.copy_(grad)
    else:
        torch.mul(grad, scale, out=view)


def _placed_piece(param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``grad``, placed as ``param`` is: a tensor-parallel gradient with
    other placements (the ``Partial`` sums a ``SequenceParallel`` norm's weight gets) is
    redistributed over its mesh first, so the data-parallel average adds whole values."""
    if _placed_otherwise(param, grad):
        grad = cast(DTensor, grad).redistribute(cast(DTensor, param).device_mesh, cast(DTensor, param).placements)
    return local_piece(grad)


def _placed_otherwise(param: nn.Parameter, grad: torch.Tensor) -> bool:
    """Is ``grad`` a tensor-parallel gradient placed otherwise than its parameter?"""
    return isinstance(param, DTensor) and isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements)


def _launch_buckets(state: _ReplicateState, backward: _BackwardPass, remaining: bool = False) -> None:
    """Launch, in order ([Note: Launch order]), the buckets that are full; ``remaining``: every
    bucket that still waits, where parameters whose hook did not fire contribute their current
    .grad (from unsynced backwards), else zeros."""
    while backward.next_launch < len(state.buckets):
        bucket = state.buckets[backward.next_launch]
        if remaining:
            for slot, i in enumerate(bucket.param_indices):
                if not backward.is_ready[i]:
                    _fill_slot(bucket, slot, _pre_scale(state))
        elif not _is_full(bucket):
            return
        _launch(state, bucket)
        backward.next_launch += 1


def _is_full(bucket: _Bucket) -> bool:
    return bucket.num_ready == len(bucket.params)


def _launch(state: _ReplicateState, bucket: _Bucket) -> None:
    """Start the bucket's reduction (async): the comm hook's, else average by all-reduce."""
    with torch.profiler.record_function("replicate::launch_bucket"):
        if state.comm_hook is None:
            bucket.pending = _collectives.all_reduce(
                bucket.flat_grad, state.process_group, tag=f"replicate::bucket{bucket.index}")
            return
        is_last = bucket.index == len(state.buckets) - 1
        grad_bucket = GradBucket(bucket.index, bucket.flat_grad, bucket.params, bucket.slots, is_last)
        future = state.comm_hook(state.comm_hook_state, grad_bucket)
        if not callable(getattr(future, "wait", None)):  # .then() futures are not torch.futures.Future instances
            raise TypeError(f"replicate: the comm hook must return a torch.futures.Future, got {type(future).__name__}")
        bucket.pending = future


def _end_backward(state: _ReplicateState) -> None:
    """Queued by the first hook of a backward; runs when autograd is done.

    Pre: every bucket whose parameters all got gradients and whose predecessors were
    launched is launched. Post (syncing): every bucket reduced and written back into .grad;
    buckets rebuilt if this was the first synced backward. Nothing pending either way."""
    backward = state.backward
    state.backward = None
    state.num_backwards += 1
    if backward is None or not backward.syncs:
        return
    with torch.profiler.record_function("replicate::end_backward"):
        _launch_buckets(state, backward, remaining=True)
        steps = state.step_counter.take() if state.step_counter is not None else []
        previous, state.step_verdict = state.step_verdict, None
        steps_disagree = previous.disagreement() if previous is not None else None  # the previous window's
        is_used, state.step_verdict = agree_used_and_steps(
            state.used_since_sync, steps, [_group_or_world(state.process_group)], state.device, api=state.api,
            consequence=_REPLICAS_DRIFT, tag="replicate::used_params")
        _write_back(state, is_used)
        state.used_since_sync = [False] * len(state.params)
        if state.num_rebuilds == 0:
            _rebuild_buckets(state)
        _check_no_unmanaged_grads(state)  # the buckets are settled for the next backward
        if steps_disagree is not None:
            raise RuntimeError(steps_disagree)


def _check_no_unmanaged_grads(state: _ReplicateState) -> None:
    """A parameter unfrozen after replicate that got a gradient before a forward of the
    replicated module adopted it would keep each rank's own gradient: raise, naming it."""
    missed = [n for n, p in state.frozen if p.requires_grad and p.grad is not None]
    if missed:
        raise RuntimeError(
            f"{state.api}: parameter(s) {missed} were frozen when replicate was applied and have been unfrozen "
            "since, but this backward reached them before a forward of the replicated module could start "
            "averaging their gradients (a submodule called directly?). Their .grad holds this rank's gradient "
            "only. Run the forward through the replicated module itself after unfreezing.")


def _group_or_world(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    """The group replicate averages over (``None`` stands for the default group)."""
    return group if group is not None else cast(dist.ProcessGroup, dist.group.WORLD)


_REPLICAS_DRIFT = "The replicas now differ: from here on each rank trains a different model."


@torch.no_grad()
def _write_back(state: _ReplicateState, is_used: Sequence[int]) -> None:
    """Wait every bucket in order and make its result the gradients of the parameters some
    rank used; the gradients of parameters no rank used stay as they were."""
    for bucket in state.buckets:
        reduced = cast(_Waitable, bucket.pending).wait()
        bucket.pending, bucket.num_ready = None, 0
        if reduced is not bucket.flat_grad:
            bucket.flat_grad.copy_(reduced.view_as(bucket.flat_grad))
        for slot, (i, p) in enumerate(zip(bucket.param_indices, bucket.params)):
            if is_used[i]:
                _set_grad(p, bucket.slots[slot], bucket.slots_are_grads)


def _set_grad(param: nn.Parameter, reduced: torch.Tensor, as_view: bool) -> None:
    if as_view:
        if param.grad is None or not _apply_guard.same_view(local_piece(param.grad), reduced):
            param.grad = _as_grad(param, reduced)
    elif param.grad is None or _placed_otherwise(param, param.grad):
        param.grad = _as_grad(param, reduced.to(param.dtype))  # (a Partial gradient's piece is not the reduced one's)
    else:
        local_piece(param.grad).copy_(reduced)


def _as_grad(param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """``local`` (a bucket slot or its cast, in the shape of ``param``'s local piece) as a
    gradient ``param`` takes: a tensor-parallel parameter's is a ``DTensor`` placed as it is,
    over ``local`` (no copy)."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def _rebuild_buckets(state: _ReplicateState) -> None:
    """[Note: Bucket rebuild]: once, from rank 0's observed gradient-ready order."""
    seen = set(state.ready_order)
    local_order = state.ready_order + [i for i in reversed(range(len(state.params))) if i not in seen]
    order = torch.tensor(local_order, dtype=torch.int64, device=state.device)
    _collectives.broadcast(order, 0, state.process_group, tag="replicate::rebuild_order")
    _install_buckets(state, _build_buckets(state, order.tolist()))
    state.num_rebuilds += 1
    state.ready_order = []
    logger.debug("replicate: rebuilt %d buckets from the gradient-ready order", len(state.buckets))
