"""``save_checkpoint_async``: a crash-safe checkpoint written in the background while
training goes on.

[Note: Async saves]
  On the calling thread (every rank calls it, at the same point of training):

  * check the arguments as ``save_checkpoint`` does; rank 0 pickles ``extra`` (a failure
    raises on every rank; nothing was started) and draws the temporary directory (see
    [Note: Publishing] in ``checkpoint_files.py``); these collectives are on the default
    group, like the synchronous save's;
  * the *staging copy*: every tensor of the model's and optimizers' sharded state (each
    ``ShardedSlice``'s elements, each ``step``, each buffer) is copied to CPU memory, a tensor
    viewed under two names (a tied parameter) once; every other value is deep-copied. This is
    the save's extra memory, ``AsyncSave.staging_bytes``, held until the write ends. Nothing
    of it aliases live state: the checkpoint holds the state of the call, whatever the
    training does next;
  * every rank reports whether its copy succeeded (an agreement: a rank out of host memory makes
    every rank raise, before any thread starts); a thread starts and the call returns.

  The thread ``dcp.save``s the copy into the temporary directory, then every rank reports its
  success or error (an agreement), and only if every rank succeeded does rank 0 write
  ``extra``, hash, rename and broadcast its verdict, as the synchronous save. A failure
  anywhere (a full disk, a rank whose write raised) publishes nothing, and ``result()`` raises
  the same error on every rank.

  Every collective of the thread is on its own gloo process group (``process_group``, or one
  the call creates and ``result()`` destroys): the training thread issues collectives on the
  default group meanwhile, and two threads' collectives on one group would pair with each
  other's (a hang, or tensors exchanged between unrelated calls). For the same reason two
  saves must not run on one group at a time: wait for the previous save's ``result()`` before
  passing its group again.
"""

from __future__ import annotations

import concurrent.futures
import copy
import io
import os
import threading
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import CheckpointException

from .checkpoint_files import (EXTRA, Optimizers, _claim_new_directory, _optimizers, _publish, _raise_from_rank0,
                               _require_numpy, _training_state)
from .load_transaction import agree_or_raise, agree_steps_now, from_rank, is_distributed, rank_of
from .sharded_slice import ShardedSlice
from .._base.torch_compat import unwrap_compiled

__all__ = ["AsyncSave", "save_checkpoint_async"]

_API = "save_checkpoint_async"
_ADVICE = "a published checkpoint is never written into. Save each checkpoint to a new directory (e.g. one per step)."


class AsyncSave:
    """A checkpoint being written in the background by :func:`save_checkpoint_async`.

    Attributes: ``path`` (the directory it publishes), ``staging_bytes`` (this rank's staging
    copy: the CPU memory the save holds until its write ends)."""

    def __init__(self, path: str, staging_bytes: int, group: Optional[dist.ProcessGroup], owns_group: bool) -> None:
        self.path: str = path  # the directory published when the write succeeded on every rank
        self.staging_bytes: int = staging_bytes  # bytes of this rank's staging copy
        self._future: concurrent.futures.Future[None] = concurrent.futures.Future()  # set by the writing thread
        self._group: Optional[dist.ProcessGroup] = group  # every collective of the writing thread
        self._owns_group: bool = owns_group  # created by the call: destroyed once the write ended

    def done(self) -> bool:
        """True once the write has ended (published, or failed on every rank)."""
        return self._future.done()

    def result(self, timeout: Optional[float] = None) -> None:
        """Wait until the write has ended; return if ``path`` was published, else raise the
        error every rank agreed on (``RuntimeError`` naming the failing rank). Raises
        ``TimeoutError`` if it has not ended within ``timeout`` seconds. Call it on every rank
        (it releases the process group the save created), before the process exits."""
        error = self._future.exception(timeout)  # concurrent.futures.TimeoutError is TimeoutError (3.11)
        if self._owns_group and self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
        if error is not None:
            raise error

    def _write(self, state: Dict[str, Any], tmp: str, extra: Optional[bytes]) -> None:
        """The writing thread: ``state`` (the staging copy) written into ``tmp`` and published."""
        try:
            _write_and_publish(state, tmp, self.path, extra, self._group)
        except BaseException as e:  # handed to result(), on every rank
            self._future.set_exception(e)
        else:
            self._future.set_result(None)


def _copied(tensor: torch.Tensor, copies: Dict[Tuple[Any, ...], torch.Tensor]) -> torch.Tensor:
    """A CPU copy of ``tensor``, the same copy for every view of the same elements."""
    key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()),
           tensor.dtype, tensor.device)
    if key not in copies:
        copies[key] = tensor.detach().to("cpu", copy=True)
    return copies[key]


def _staged(value: Any, copies: Dict[Tuple[Any, ...], torch.Tensor], memo: Dict[int, Any]) -> Any:
    """``value`` (a state dict) with every tensor copied to the CPU, every other leaf deep-copied."""
    if isinstance(value, ShardedSlice):
        return value.with_local(_copied(value.local, copies))
    if isinstance(value, torch.Tensor):
        return _copied(value, copies)
    if isinstance(value, Mapping):
        return {key: _staged(item, copies, memo) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_staged(item, copies, memo) for item in value)
    return copy.deepcopy(value, memo)


def _pickled_extra(extra: Optional[Mapping[str, Any]]) -> Tuple[Optional[bytes], str]:
    """Rank 0: ``extra`` as ``torch.save`` writes it (taken now, so later changes do not
    reach the checkpoint), and an error message or ''."""
    if extra is None:
        return None, ""
    buffer = io.BytesIO()
    try:
        torch.save(dict(extra), buffer)
    except Exception as e:  # an object that does not pickle: refused on every rank
        return None, f"could not pickle extra: {type(e).__name__}: {e}"
    return buffer.getvalue(), ""


def _write_and_publish(state: Dict[str, Any], tmp: str, path: str, extra: Optional[bytes],
                       group: Optional[dist.ProcessGroup]) -> None:
    """The writing thread (see [Note: Async saves]): raises the error every rank agreed on."""
    error = ""
    try:
        dcp.save(state, checkpoint_id=tmp, process_group=group)
    except (Exception, CheckpointException) as e:  # DCP raises a rank's failure on every rank; agreed on below
        error = _write_failure(tmp, e)
    agree_or_raise(error, _API, group)
    verdict = ""
    if rank_of(group) == 0:
        verdict = _write_bytes(os.path.join(tmp, EXTRA), extra) or _publish(tmp, path)
    verdict = from_rank(verdict, 0, group)
    if verdict:
        raise RuntimeError(f"{_API}: {verdict}")


def _write_failure(tmp: str, error: BaseException) -> str:
    """What failed in writing ``tmp``: for DCP's ``CheckpointException`` (every failing rank's
    exception), the lowest failing rank's, named."""
    where, cause = "", error
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _) = min(error.failures.items(), key=lambda item: item[0])
        where = f" on rank {rank}"
    first_line = (str(cause).strip().splitlines() or [""])[0]
    return f"writing {tmp} failed{where} ({type(cause).__name__}: {first_line}); nothing was published"


def _write_bytes(file: str, data: Optional[bytes]) -> str:
    """Rank 0: ``data`` into ``file`` (nothing if None). Returns an error message or ''."""
    if data is None:
        return ""
    try:
        with open(file, "wb") as f:
            f.write(data)
    except OSError as e:
        return f"could not write extra to {file}: {type(e).__name__}: {e}"
    return ""


def save_checkpoint_async(path: str, model: nn.Module, optim: Optimizers = None, *,
                          extra: Optional[Mapping[str, Any]] = None,
                          process_group: Optional[dist.ProcessGroup] = None) -> AsyncSave:
    """:func:`save_checkpoint`, written in the background: copies this rank's sharded state to
    CPU memory (the staging copy, ``.staging_bytes``), starts a thread that writes and
    publishes it, and returns. Training may go on at once: the checkpoint holds the state of
    the call. ``path`` appears complete, with checksums, or not at all (a failure on any rank
    publishes nothing). Collective: every rank calls it with the same ``path``, which must not
    exist, and later calls ``result()`` (see [Note: Async saves]).

    Example::

        pending = save_checkpoint_async(f"ckpt/step_{step:06d}", model, optim, extra={"step": step})
        for batch in batches:           # training goes on while it writes
            ...
        pending.result()                # raises on every rank if the save failed

    Args:
        path: the directory to create (one per checkpoint, e.g. ``step_<N>``).
        model: the model (sharded any way, or plain).
        optim: its optimizer, a list or tuple of its optimizers, or None.
        extra: anything else to resume with, as for :func:`save_checkpoint`; pickled at the call.
        process_group: a gloo process group of every rank for the writing thread's collectives
            (``dist.new_group(backend="gloo")``, made once and passed to every save, as
            torchtitan does); None: the call creates one and ``result()`` destroys it. One save
            at a time per group.

    Returns:
        an :class:`AsyncSave`: ``result()`` waits and raises the save's error, ``done()``,
        ``staging_bytes``, ``path``.
    """
    model = unwrap_compiled(model)  # torch.compile's wrapper: the names without its prefix
    if not isinstance(model, nn.Module):
        raise TypeError(f"{_API}: expected an nn.Module, got {type(model).__name__}")
    path = os.path.abspath(os.fspath(path))
    optims = _optimizers(_API, optim)
    if extra is not None and not (isinstance(extra, Mapping) and all(isinstance(k, str) for k in extra)):
        raise TypeError(f"{_API}: extra must be a dict with str keys (or None), got {type(extra).__name__}")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"{_API}: process_group must be a torch.distributed.ProcessGroup (a gloo group of every "
                        f"rank) or None, got {type(process_group).__name__}")
    _require_numpy(_API)
    agree_steps_now(model, _API)  # see [Note: Steps agreed before a saved model] in load_transaction.py
    extra_bytes, extra_error = _pickled_extra(extra) if rank_of() == 0 else (None, "")
    _raise_from_rank0(extra_error, _API)
    tmp = _claim_new_directory(path, _API, _ADVICE)
    copies: Dict[Tuple[Any, ...], torch.Tensor] = {}
    state: Dict[str, Any] = {}
    staging_error: Optional[Exception] = None
    try:
        state = _staged(_training_state(model, optims), copies, {})
    except Exception as e:  # out of host memory on one rank: every rank raises, no thread waits for it
        staging_error = e
    agree_or_raise(staging_error, _API)
    staging_bytes = sum(t.untyped_storage().nbytes() for t in copies.values())
    owns_group = process_group is None and is_distributed()
    group = dist.new_group(backend="gloo") if owns_group else process_group
    save = AsyncSave(path, staging_bytes, group, owns_group)
    threading.Thread(target=save._write, args=(state, tmp, extra_bytes), name=f"{_API}:{path}", daemon=True).start()
    return save
