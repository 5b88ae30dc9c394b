"""All-or-nothing loads: ``load_checkpoint``, ``set_model_state_dict`` and
``set_optimizer_state_dict`` either succeed on every rank or change nothing on any rank.

[Note: All-or-nothing loads]
  A load writes into live state as it goes (DCP copies each tensor it reads into the shard it
  belongs to; torch's ``load_state_dict`` copies parameter by parameter; an optimizer's
  ``load_state_dict`` replaces its state and ``param_groups``), and it can fail on one rank
  only: a data file that this rank reads is truncated, this rank's state dict has one entry of
  the wrong shape. Checking everything first is not enough (a read fails midway, a peer fails
  after this rank finished), so a load is a *transaction*:

  * snapshot  before anything is written, this rank's own model state (each storage under its
              parameters and persistent buffers once: the flat shards under ``fully_shard``,
              whole tensors otherwise) and optimizer state (its tensors, each per-parameter dict
              and each param group) are copied. That is the extra memory of a load: at most this
              rank's shard of the parameters plus its optimizer state, on their devices.
  * steps     the load runs in local steps. A step that precedes a collective (DCP's plan and
              read) ends with an agreement, so a rank that fails there never leaves its peers
              waiting inside that collective: every rank learns of the failure and stops.
  * final     after the last write, every rank reports success or its error (the final
    agreement  agreement) before any rank returns. If any rank failed, every rank puts its
              snapshot back and raises the same error (the lowest failing rank's type and
              message, naming that rank); else the snapshot is dropped.

  Restoring copies the snapshot's bytes back into the very storages it was taken from (views,
  tied parameters and the optimizer's references stay valid), puts back any tensor object or
  ``.data`` a load replaced, reinstates the optimizer's original ``state`` and ``param_groups``
  objects, and bumps each restored tensor's version counter, so a kept unsharded buffer
  gathered from the loaded values is gathered again (see [Note: Views] in ``_runtime/flat_param.py``).
  A transaction nested in another (``load_checkpoint`` calls ``set_*``) is part of the outer
  one: no second snapshot, no agreement of its own.

  Agreement messages travel as UTF-8 bytes in tensor collectives (no pickled objects). The
  group is the world for ``load_checkpoint`` (DCP's group); for ``set_*`` it is the process
  group of the model's ``fully_shard``/``replicate`` states (the world if they differ), and
  no collective at all for a model without any, which loads as a plain module.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import increment_version
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.tensor import DTensor

from .._runtime import collectives as _collectives
from .._runtime.traversal import _get_fsdp_handles, _get_fsdp_states
from ..contract import _STATE_KEY
from .._base.torch_compat import tensor_slots, unwrap_compiled

__all__ = ["is_distributed", "rank_of", "from_rank", "agree_or_raise", "agree_steps_now", "transaction", "Transaction", "transactional",
           "model_group", "before_final_agreement", "state_entries"]

T = TypeVar("T")

# [Note: Fault hook]  For tests only; None otherwise. Called on each rank with the API's name
# just before a transaction's final agreement, once everything was written on this rank; what
# it raises counts as this rank's failure. It exists because no real input can fail a load at
# that point: every write has succeeded here, and only a peer's failure (which this hook
# stands in for) can still undo it.
before_final_agreement: Optional[Callable[[str], None]] = None

# Types an agreed error keeps on every rank; any other error is raised as RuntimeError.
_KEPT_TYPES: Dict[str, type] = {"RuntimeError": RuntimeError, "ValueError": ValueError, "TypeError": TypeError}


# ---------------------------------------------------------------------------- agreement
def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_of(group: Optional[dist.ProcessGroup] = None) -> int:
    """This process's rank in ``group`` (the world by default); 0 outside a distributed job."""
    return dist.get_rank(group) if is_distributed() else 0


def _group_size(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def from_rank(message: str, src: int, group: Optional[dist.ProcessGroup] = None) -> str:
    """Group rank ``src``'s ``message`` on every rank of ``group`` (UTF-8 bytes in a tensor
    broadcast; what the other ranks pass is ignored)."""
    if _group_size(group) == 1:
        return message
    data = torch.tensor(list(message.encode()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    _collectives.broadcast(size, src, group, tag="checkpoint_message_size")
    buffer = data if rank_of(group) == src else torch.empty(int(size.item()), dtype=torch.uint8)
    if buffer.numel():
        _collectives.broadcast(buffer, src, group, tag="checkpoint_message")
    return bytes(buffer.tolist()).decode()


def agree_or_raise(error: Any, api: str, group: Optional[dist.ProcessGroup] = None) -> None:
    """Collective over ``group``: return if no rank has an error, else raise on every rank the
    same exception: the lowest failing rank's message (an exception or a non-empty string),
    prefixed with ``api`` and, unless it is rank 0, that rank; its type if ValueError or
    TypeError, else RuntimeError. One all-gather of a flag; two broadcasts if some rank failed."""
    kind = type(error).__name__ if isinstance(error, BaseException) else "RuntimeError"
    message = _describe(error) if isinstance(error, BaseException) else str(error or "")
    failed = error is not None and error != ""
    src = 0
    if _group_size(group) > 1:
        flags = _collectives.exchange([1 if failed else 0], group, tag=api)
        failing = [r for r, (flag,) in enumerate(flags) if flag]
        if not failing:
            return
        src = failing[0]
        kind, _, message = from_rank(f"{kind}\n{message}" if rank_of(group) == src else "", src, group).partition("\n")
    elif not failed:
        return
    text = message[len(api) + 2:] if message.startswith(f"{api}: ") else message
    agreed = _KEPT_TYPES.get(kind, RuntimeError)(f"{api}: {text}" if src == 0 else f"{api}: rank {src}: {text}")
    if isinstance(error, BaseException) and rank_of(group) == src:
        raise agreed from error
    raise agreed


def _describe(error: BaseException) -> str:
    """An error's message; for DCP's ``CheckpointException`` (raised on every rank, holding
    every failing rank's exception), the lowest failing rank's exception, named."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _) = min(error.failures.items(), key=lambda item: item[0])
        text = str(cause).strip() or type(cause).__name__
        return (f"torch.distributed.checkpoint failed on rank {rank}: {type(cause).__name__}: {text}. Every rank must "
                "read the same, complete checkpoint: copy it again (or load an earlier one). The model and optimizer "
                "were left as they were on every rank.")
    return str(error)


# ---------------------------------------------------------------------------- snapshot
@dataclass
class _Snapshot:
    """What a load may write on this rank, as it was (see [Note: All-or-nothing loads])."""

    storages: List[Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (live storage as bytes, copy)
    clones: List[Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # storage-less tensors: (live, copy)
    views: List[Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (tensor, its .data as it was)
    slots: List[Tuple[Dict[str, Any], str, Any]] = field(default_factory=list)  # (a slot dict of tensor_slots, name, object)
    extra_states: List[Tuple[nn.Module, Any]] = field(default_factory=list)  # (module, deep copy of get_extra_state())
    optims: List[Tuple[torch.optim.Optimizer, Any, List[Tuple[Any, Dict[str, Any], Dict[str, Any]]], List[Any],
                       List[Tuple[Dict[str, Any], Dict[str, Any], List[Any]]]]] = field(default_factory=list)
    seen: Dict[Tuple[str, int], None] = field(default_factory=dict)  # (device, data_ptr) of storages copied

    @property
    def nbytes(self) -> int:
        """Bytes this snapshot holds (the load's extra memory)."""
        return sum(c.numel() * c.element_size() for _, c in self.storages + self.clones)

    def keep(self, tensor: torch.Tensor) -> None:
        """Copy ``tensor``'s storage (once per storage) and remember its view."""
        if tensor.is_meta:
            return
        if isinstance(tensor, DTensor):  # a wrapper: its elements are its local piece's, copied whole
            self.clones.append((tensor, tensor.detach().clone()))
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage of its own
            self.clones.append((tensor, tensor.detach().clone()))
            return
        self.views.append((tensor, tensor.data))
        key = (str(tensor.device), storage.data_ptr())
        if storage.nbytes() and key not in self.seen:
            self.seen[key] = None
            # The whole storage as a byte tensor (no version counter of the tensor's): cloned through
            # the device's allocator, which UntypedStorage.clone() bypasses on the CPU.
            live = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            self.storages.append((live, live.clone()))


def state_entries(module: nn.Module, prefix: str = "") -> Iterator[Tuple[str, str, Optional[torch.Tensor]]]:
    """``(key, name, live tensor)`` for each entry ``module.state_dict()`` holds of ``module``
    itself (``name`` in its slots); extra state: ``(prefix + "_extra_state", "_extra_state", None)``."""
    for _, name, value, saved in tensor_slots(module):
        if saved and value is not None:
            yield prefix + name, name, value
    if type(module).get_extra_state is not nn.Module.get_extra_state:
        yield prefix + "_extra_state", "_extra_state", None


def _take_model(snapshot: _Snapshot, module: nn.Module) -> None:
    for m in module.modules():
        snapshot.slots.extend((slots, name, value) for slots, name, value, _ in tensor_slots(m))
        for _, _, value in state_entries(m):
            if value is None:
                snapshot.extra_states.append((m, copy.deepcopy(m.get_extra_state())))
            else:
                snapshot.keep(value)
    for handle in _get_fsdp_handles(module):  # the shards themselves (their storage is the parameters')
        for group in handle.groups:
            snapshot.keep(group.flat_param)


def _take_optim(snapshot: _Snapshot, optim: torch.optim.Optimizer) -> None:
    entries = [(p, entry, dict(entry)) for p, entry in optim.state.items()]
    groups = [(group, dict(group), list(group["params"])) for group in optim.param_groups]
    for values in [content for _, _, content in entries] + [content for _, content, _ in groups]:
        for value in values.values():
            if isinstance(value, torch.Tensor):
                snapshot.keep(value)
    snapshot.optims.append((optim, optim.state, entries, optim.param_groups, groups))


def _restore(snapshot: _Snapshot) -> None:
    """Put back everything :func:`_take_model`/:func:`_take_optim` recorded, bit for bit."""
    with torch.no_grad():
        for slots, name, value in snapshot.slots:
            if slots.get(name) is not value:
                slots[name] = value
        for tensor, data in snapshot.views:
            if not _same_view(tensor.data, data):
                tensor.data = data
        for live, saved in snapshot.storages:
            live.copy_(saved)
        for tensor, value in snapshot.clones:
            tensor.detach().copy_(value)
        for module, extra in snapshot.extra_states:
            module.set_extra_state(extra)
        for optim in snapshot.optims:
            _restore_optim(*optim)
        for tensor, _ in snapshot.views + snapshot.clones:
            if not tensor.is_inference():
                increment_version(tensor)  # a buffer gathered from the failed load's values is stale


def _restore_optim(optim: torch.optim.Optimizer, state: Any, entries: List[Tuple[Any, Dict[str, Any], Dict[str, Any]]],
                   param_groups: List[Any], groups: List[Tuple[Dict[str, Any], Dict[str, Any], List[Any]]]) -> None:
    state.clear()
    for p, entry, content in entries:
        entry.clear()
        entry.update(content)
        state[p] = entry
    for group, content, params in groups:
        group.clear()
        group.update(content)
        group["params"][:] = params
    param_groups[:] = [group for group, _, _ in groups]
    optim.state, optim.param_groups = state, param_groups  # an optimizer's load_state_dict replaces both


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.storage_offset() == b.storage_offset()
            and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype)


# ---------------------------------------------------------------------------- transactions
_local = threading.local()  # .depth: transactions in progress on this thread


class Transaction:
    """A load in progress (see [Note: All-or-nothing loads]); :meth:`step` runs a local step."""

    def __init__(self, api: str, group: Optional[dist.ProcessGroup]) -> None:
        self.api = api  # names the API in every error
        self.group = group  # the ranks that agree
        self.agreed: Optional[BaseException] = None  # an error every rank already raised

    def step(self, fn: Callable[[], T]) -> T:
        """``fn()`` (no collective inside), then an agreement: if it failed on any rank, every
        rank raises the same error here."""
        error: Optional[BaseException] = None
        result: Any = None
        try:
            result = fn()
        except (Exception, CheckpointException) as e:
            error = e
        try:
            agree_or_raise(error, self.api, self.group)
        except Exception as agreed:
            self.agreed = agreed
            raise
        return result  # type: ignore[no-any-return]


@contextlib.contextmanager
def transaction(api: str, module: Optional[nn.Module], optims: Sequence[torch.optim.Optimizer],
                group: Optional[dist.ProcessGroup], collective: bool = True) -> Iterator[Transaction]:
    """Run the body as one all-or-nothing load of ``module``'s (None: not written) and
    ``optims``' state. ``collective``: the ranks of ``group`` agree; False: this rank alone."""
    if getattr(_local, "depth", 0):  # inside another load: it snapshots and agrees
        yield Transaction(api, group)
        return
    snapshot = _Snapshot()
    if module is not None:
        _take_model(snapshot, module)
    for optim in optims:
        _take_optim(snapshot, optim)
    txn = Transaction(api, group if collective else None)
    _local.depth = 1
    try:
        error: Optional[BaseException] = None
        try:
            yield txn
            if before_final_agreement is not None:
                before_final_agreement(api)
        except (Exception, CheckpointException) as e:
            if e is txn.agreed:
                _restore(snapshot)
                raise
            error = e
        except BaseException:  # KeyboardInterrupt, SystemExit: no agreement possible
            _restore(snapshot)
            raise
        try:
            if collective:
                agree_or_raise(error, api, group)
            elif error is not None:
                raise error
        except BaseException:
            _restore(snapshot)
            raise
    finally:
        _local.depth = 0


def model_group(module: Any, exact: bool = False) -> Tuple[bool, Optional[dist.ProcessGroup]]:
    """``(collective, group)`` for a ``set_*`` call on ``module``: the one process group of
    its ``fully_shard``/``replicate`` states (None: the world, also when they differ), or
    ``(False, None)`` if it has none with more than one rank (a plain module: a local load)."""
    if not is_distributed() or not isinstance(module, nn.Module):
        return False, None
    groups = states_groups(_get_fsdp_states(module))
    for m in module.modules():
        rstate = m.__dict__.get(_STATE_KEY, {}).get("replicate")  # by name: replicate.py imports this file
        if rstate is not None and getattr(rstate, "world_size", 1) > 1:
            groups.append(rstate.process_group)
    return common_group(groups, exact)


def states_groups(states: Any) -> List[Optional[dist.ProcessGroup]]:
    """The process groups the fully sharded ``states``' collectives run over (shard and replica
    groups of more than one rank)."""
    groups: List[Optional[dist.ProcessGroup]] = []
    for state in states:
        if state.world_size > 1:
            groups.append(state.process_group)
        if state.replicate_group is not None:
            groups.append(state.replicate_group)
    return groups


def common_group(groups: List[Optional[dist.ProcessGroup]], exact: bool = False) -> Tuple[bool, Optional[dist.ProcessGroup]]:
    """``(collective, group)`` over ``groups`` as :func:`model_group` gives it."""
    if not groups:
        return False, None
    world = tuple(range(dist.get_world_size()))
    rank_sets = {world if g is None else tuple(dist.get_process_group_ranks(g)): g for g in reversed(groups)}  # first wins
    if len(rank_sets) != 1:
        return bool(rank_sets), None
    ((ranks, group),) = rank_sets.items()
    return True, None if ranks == world and not exact else group


# [Note: Steps agreed before a saved model]  The step agreement ([Note: Step agreement] in
# _runtime/watch.py) rides on each synced backward's all-reduce and is read one synced backward
# later, so after an optimizer step taken on some ranks only (torch.amp.GradScaler skipping it
# where this rank's slices overflowed) the model is one no process computed until then: a user's
# trial saved it with save_checkpoint and read it with get_model_state_dict, without an error.
# The calls that read or save the model across ranks (save_checkpoint, save_checkpoint_async,
# full model and optimizer state dicts, unshard_params) first exchange each step counter's steps
# since the last synced backward (not consumed: the backward's agreement counts them still) and
# raise on every rank, before anything is read or written, if the ranks differ. One exchange of a
# few integers per call, over the model's group; none for a model whose groups have one rank.
def agree_steps_now(module: Any, api: str, hint: str = "") -> None:
    """See [Note: Steps agreed before a saved model]. ``hint``: what the stuck-wait warning and
    the timeout error advise (the caller's: the call is collective)."""
    if not isinstance(module, nn.Module):
        return
    collective, group = model_group(module, exact=True)  # the model's own group object (its timeout)
    if not collective:
        return
    counters = [getattr(root.ctx, "step_counter", None) for root in {id(s.root): s.root for s in _get_fsdp_states(module)
                                                   if s.root is not None}.values()]
    for m in module.modules():
        rstate = m.__dict__.get(_STATE_KEY, {}).get("replicate")
        counters.append(getattr(rstate, "step_counter", None))
    steps = [min(c.pending, 255) if c is not None else 0 for c in counters]
    if not steps:
        return
    # the most steps, and a checksum of every counter's (each fits a byte): two integers whatever the
    # count of counters (one per module), which differ between ranks whenever some counter does
    everyone = _collectives.exchange([max(steps), zlib.crc32(bytes(steps))], group,
                                     tag=f"{api}: optimizer steps since the last synced backward", hint=hint)
    if any(theirs != everyone[0] for theirs in everyone):
        per_rank = [most for most, _ in everyone]
        raise RuntimeError(
            f"{api}: since the last synchronized backward, the optimizer(s) holding this model's parameters stepped "
            f"{per_rank} time(s) on ranks 0..{len(per_rank) - 1}: the model is one that no single process computed "
            "(each rank updates its own slices). Every rank must call optimizer.step() together: a step skipped on "
            "some ranks (torch.amp.GradScaler skips it where this rank's gradients overflowed: use torch's "
            "ShardedGradScaler, which agrees on it; or a step guarded by a per-rank condition) must be agreed first "
            "(all_reduce the condition). Nothing was saved or read.")


def transactional(api: str, *, model: bool, optim: bool) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorate a ``set_*`` entry point ``fn(module, [optim,] ...)``: its whole body is one
    transaction over the model's ranks, snapshotting the model (``model``) and/or the optimizer
    (``optim``, its second argument)."""
    def decorate(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def call(module: Any, *args: Any, **kwargs: Any) -> T:
            target = unwrap_compiled(module)
            optimizer = (args[0] if args else kwargs.get("optim")) if optim else None
            collective, group = model_group(target)
            with transaction(api, target if model and isinstance(target, nn.Module) else None,
                             [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else [], group, collective):
                return fn(module, *args, **kwargs)
        return call
    return decorate
