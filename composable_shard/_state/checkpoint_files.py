"""Crash-safe, verified checkpoints: ``save_checkpoint`` / ``load_checkpoint`` /
``latest_checkpoint``.

[Note: Publishing]
  Every rank ``dcp.save``s the sharded model and optimizer state into ``<path>.tmp-<token>``
  (the token drawn on rank 0). ``dcp.save`` is collective and returns once every rank's data
  file and rank 0's ``.metadata`` are written. Rank 0 then hashes every file into
  ``checksums.json``, fsyncs, renames the directory to ``<path>`` (atomic on a POSIX
  filesystem) and fsyncs the parent; the other ranks wait for its verdict. A save killed at
  any point leaves no ``<path>``; an existing ``<path>`` is never written into (DCP would keep
  the old ``.metadata`` until its end, so a save killed there loads, without error, as a mix of
  two checkpoints).

[Note: Verifying]
  ``load_checkpoint`` first has rank 0 check every file against ``checksums.json`` (a missing,
  extra, truncated or altered file raises on every rank, naming it), before anything is read
  into the model or optimizer. DCP itself stores no checksum: a flipped bit in a tensor's bytes
  loads as a wrong value, and a truncated file fails with an error that does not name it.
  Verification reads the whole checkpoint once, on rank 0. A load that fails after that (a
  file changed since, a rank that reads another copy, any error on any rank) leaves model and
  optimizer as they were on every rank and raises the same error everywhere: see [Note:
  All-or-nothing loads] in ``_state/load_transaction.py``.

[Note: Reading stays in the folder]
  DCP's reader opens ``<folder>/<relative_path>`` for every entry of ``.metadata``'s
  ``storage_data``, as written there (a ``str`` or a ``pathlib`` path): an absolute path, a
  ``..`` component or a symbolic link in the folder would make it read any file the process
  can read (and hang on a FIFO), and checksums do not help. :class:`SafeFileSystemReader`
  refuses such an entry when it reads ``.metadata`` and again when DCP hands it metadata
  (``set_up_storage_reader``), naming the entry and its path, before any data is read; and
  checks each file again just before opening it. ``load_checkpoint`` reads ``.metadata`` on
  every rank before rank 0 hashes the files, and hashing, ``checksums.json`` and
  ``.metadata`` itself refuse a file that resolves outside the folder or is not a regular file.

[Note: Loading executes nothing]
  DCP's default reader unpickles ``.metadata`` with ``pickle.load`` and its default planner
  loads every non-tensor entry (optimizer ``param_groups``) with ``torch.load(weights_only=False)``:
  a tampered checkpoint runs code at load time, and checksums do not help (an attacker rewrites
  them too). ``load_checkpoint`` uses DCP's public extension points instead:
  :class:`SafeFileSystemReader` reads ``.metadata`` with an unpickler that resolves only an
  allow-list of globals (DCP's metadata classes, ``torch.Size``, dtypes, layouts, paths) and
  :class:`SafeLoadPlanner` checks non-tensor entries with ``torch.load(weights_only=True)``.
  Anything else raises, naming the file and the refused global, before anything is loaded.
  (Tensors DCP already reads with ``weights_only=True``.)

All cross-rank agreement here uses tensor collectives (no pickled objects). The filesystem is
assumed shared by all ranks, as DCP's ``FileSystemWriter`` assumes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import re
import secrets
import stat
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .load_transaction import agree_steps_now, from_rank, rank_of, transaction
from .optim_state_dict import param_groups_by_fqn, set_optimizer_state_dict, sharded_optim_views
from .model_state_dict import get_model_state_dict, set_model_state_dict, sharded_model_views
from .._base.torch_compat import DCP_METADATA_GLOBALS, unwrap_compiled

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "export_safetensors", "SafeFileSystemReader",
           "SafeLoadPlanner", "UnsafeCheckpointError"]

CHECKSUMS = "checksums.json"
EXTRA = "extra.pt"  # save_checkpoint(extra=...): written by rank 0 before publishing, so checksummed
_STEP_DIR = re.compile(r"step_(\d+)")


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file holds something loading it would have to execute."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in DCP_METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"{self.path}: refused to load global {module}.{name}: a DCP checkpoint's metadata "
                                    "holds only DCP's metadata classes, torch sizes, dtypes and paths. The file was "
                                    "altered or is not a checkpoint; nothing was loaded.")


def _leaves_folder(root: str, name: Any) -> str:
    """Why the file ``name`` (a path relative to the checkpoint folder ``root``, as stored in
    ``.metadata``) is not a file of that folder, or '' (see [Note: Reading stays in the folder])."""
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a file name"
    if not name or "\x00" in name:
        return "is not a file name"
    if os.path.isabs(name):
        return "is an absolute path"
    if ".." in name.replace(os.sep, "/").split("/"):
        return "has a '..' component"
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(root, name))
    if not real.startswith(real_root.rstrip(os.sep) + os.sep):
        return f"resolves (through a symbolic link) to {real}, outside the checkpoint folder"
    if not os.path.exists(real):
        return "does not exist"
    if not stat.S_ISREG(os.stat(real).st_mode):
        return "is not a regular file"
    return ""


def _check_storage_paths(metadata: Metadata, root: str, source: str) -> None:
    """Raise ``UnsafeCheckpointError`` naming an entry and its path if any entry of
    ``metadata.storage_data`` is stored outside ``root``; reads no data."""
    by_path: Dict[Any, List[Any]] = {}
    for index, info in (metadata.storage_data or {}).items():
        name = getattr(info, "relative_path", None)
        by_path.setdefault(name if isinstance(name, (str, os.PathLike)) else repr(name), []).append(index)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            raise UnsafeCheckpointError(f"{source}: the entry {_entry(index)} has no valid byte range ({offset!r}, "
                                        f"{length!r}); the file was altered. Nothing was read.")
    for name, indices in by_path.items():
        reason = _leaves_folder(root, name)
        if reason:
            first = sorted(indices, key=_entry)[0]
            more = f" (and {len(indices) - 1} more entries)" if len(indices) > 1 else ""
            raise UnsafeCheckpointError(
                f"{source}: the entry {_entry(first)}{more} is stored at {os.fspath(name)!r}, which {reason}. A "
                f"checkpoint's data files lie in its own folder ({root}); this .metadata was altered (checksums "
                "rewritten along with it prove nothing). Refused before reading any data; nothing was loaded.")


def _entry(index: Any) -> str:
    fqn, offset = getattr(index, "fqn", index), getattr(index, "offset", None)
    return f"{fqn!r}" + (f" (chunk at {tuple(offset)})" if offset is not None else "")


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``.metadata`` is read with an allow-list unpickler
    (see [Note: Loading executes nothing]) and which reads no file outside the checkpoint
    folder (see [Note: Reading stays in the folder]); pass it to ``dcp.load(storage_reader=...)``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        root = os.fspath(self.path)
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        path = os.path.join(root, name)
        reason = _leaves_folder(root, name)
        if reason:
            raise UnsafeCheckpointError(f"{path} {reason}; refused to read it")
        with open(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f, path).load()
            except UnsafeCheckpointError:
                raise
            except Exception as e:  # a truncated or garbled pickle
                raise UnsafeCheckpointError(f"{path}: not a readable DCP metadata file ({type(e).__name__}: {e})") from e
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
        _check_storage_paths(metadata, root, path)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # what FileSystemReader.read_metadata does after unpickling
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        _check_storage_paths(metadata, os.fspath(self.path), "the checkpoint's metadata")  # from wherever it came
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's reading, one file at a time, each checked (again, just before it is opened) to
        lie in the folder; a failure names the file and, read again one entry at a time, the
        entry (DCP's own error, e.g. a truncated zip archive, names neither)."""
        root = os.fspath(self.path)
        per_file: Dict[str, List[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(os.fspath(self.storage_data[item.storage_index].relative_path), []).append(item)
        for name, items in per_file.items():
            reason = _leaves_folder(root, name)
            if reason:
                raise UnsafeCheckpointError(f"{os.path.join(root, name)} {reason}; refused to read it")
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as e:
                raise RuntimeError(self._read_failure(plan, planner, name, items, e)) from e
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_failure(self, plan: LoadPlan, planner: LoadPlanner, name: str, items: List[ReadItem],
                      error: Exception) -> str:
        """The message for a failed read of file ``name``: the first of its entries that fails alone."""
        where = ""
        for item in items:
            try:
                super().read_data(dataclasses.replace(plan, items=[item]), planner).wait()
            except Exception as e:
                info = self.storage_data[item.storage_index]
                where, error = f" the entry {_entry(item.storage_index)} ({info.length} bytes at {info.offset})", e
                break
        first_line = (str(error).strip().splitlines() or [""])[0]
        return (f"{os.path.join(os.fspath(self.path), name)}: reading{where or ' it'} failed ({type(error).__name__}: "
                f"{first_line}); the file is truncated or damaged")


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner`` that accepts a non-tensor entry only if
    ``torch.load(weights_only=True)`` can read it (plain data: numbers, strings, lists, dicts,
    tensors); pass it to ``dcp.load(planner=...)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata is not None else None
            where = getattr(info, "relative_path", "?")
            raise UnsafeCheckpointError(
                f"{where}: refused to load the non-tensor entry {read_item.dest_index.fqn!r}: it is not plain data "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); nothing of it was executed") from e
        checked = io.BytesIO()
        torch.save(obj, checked)  # plain data only: what the default planner then unpickles is ours
        checked.seek(0)
        super().load_bytes(read_item, checked)


Optimizers = Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None]


def _optimizers(api: str, optim: Optimizers) -> List[torch.optim.Optimizer]:
    """``optim`` (None, one optimizer, or a list/tuple of them) as a list, checked."""
    if optim is None:
        return []
    if isinstance(optim, torch.optim.Optimizer):
        return [optim]
    if isinstance(optim, (list, tuple)) and all(isinstance(o, torch.optim.Optimizer) for o in optim):
        if len({id(o) for o in optim}) != len(optim):
            raise ValueError(f"{api}: the same optimizer is given twice in optim")
        return list(optim)
    raise TypeError(f"{api}: optim must be a torch.optim.Optimizer, a list or tuple of them, or None; got "
                    f"{type(optim).__name__}")


def _optim_key(index: int) -> str:
    """The checkpoint's key of the ``index``-th optimizer's state (the first: ``optim``)."""
    return "optim" if index == 0 else f"optim_{index}"


def _training_state(model: nn.Module, optims: Sequence[torch.optim.Optimizer]) -> Dict[str, Any]:
    # Views of the live state (the public get_* copy): dcp.save reads and dcp.load writes the
    # shards in place, no copy of the rank's state (see [Note: State dicts own their tensors]).
    state: Dict[str, Any] = {"model": sharded_model_views(model)}
    for index, optim in enumerate(optims):
        state[_optim_key(index)] = sharded_optim_views(model, optim)
    return state


# ---------------------------------------------------------------------------- rank-0 decisions
def _raise_from_rank0(error: str, api: str) -> None:
    """Rank 0's ``error`` (UTF-8 bytes in a tensor broadcast), raised on every rank unless ''."""
    error = from_rank(error, 0)
    if error:
        raise RuntimeError(f"{api}: {error}")


def _require_numpy(api: str) -> None:
    """DCP exchanges its plans through torch's object collectives, which decode what arrives
    with ``Tensor.numpy()``: without numpy one rank would raise inside ``dcp.save``/``dcp.load``
    and the others wait for it. Every rank raises here instead, before any collective."""
    try:
        import numpy  # noqa: F401  # only asks whether it can be imported
    except ImportError as e:
        raise ImportError(f"{api} needs numpy (torch.distributed.checkpoint decodes the plans it exchanges with "
                          "Tensor.numpy()); it is a dependency of composable_shard: pip install numpy") from e


# ---------------------------------------------------------------------------- files
def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(directory: str) -> List[str]:
    return sorted(name for name in os.listdir(directory) if name != CHECKSUMS)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: str, path: str) -> str:
    """Rank 0: checksums, then the atomic rename. Returns an error message or ''."""
    try:
        sums = {name: _sha256(os.path.join(tmp, name)) for name in _files(tmp)}
        with open(os.path.join(tmp, CHECKSUMS), "w") as f:
            json.dump(sums, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync(tmp)
        os.rename(tmp, path)
        _fsync(os.path.dirname(path))
    except OSError as e:
        return f"could not publish {tmp} as {path}: {type(e).__name__}: {e}"
    return ""


def _claim_new_directory(path: str, api: str, advice: str) -> str:
    """Collective: raise on every rank if ``path`` exists (rank 0 decides); else return, on
    every rank, the fresh temporary sibling rank 0 drew, to write into and publish as ``path``."""
    error, tmp = "", ""
    if rank_of() == 0:
        tmp = f"{path}.tmp-{secrets.token_hex(6)}"
        if os.path.exists(path):
            error = f"{path} already exists; {advice}"
    _raise_from_rank0(error, api)
    return from_rank(tmp, 0)


def _read_listing(path: str) -> Dict[str, str]:
    """Rank 0: ``{file: sha256}`` of ``path``'s ``checksums.json``, which must list exactly the
    folder's files (else ``RuntimeError``, naming the problem). Reads no other file."""
    listing = os.path.join(path, CHECKSUMS)
    if not os.path.isdir(path):
        raise RuntimeError(f"no checkpoint at {path} (a save that did not finish publishes nothing)")
    try:
        reason = _leaves_folder(path, CHECKSUMS) if os.path.lexists(listing) else ""
        if reason:
            raise ValueError(f"it {reason}")
        with open(listing) as f:
            expected = json.load(f)
        if not isinstance(expected, dict) or not all(isinstance(v, str) for v in expected.values()):
            raise ValueError("not a {file: sha256} object")
    except (OSError, ValueError) as e:
        raise RuntimeError(f"{listing} is missing or unreadable ({type(e).__name__}: {e}); not a checkpoint that "
                           "save_checkpoint published, or a damaged one") from None
    present = _files(path)
    missing, extra = sorted(set(expected) - set(present)), sorted(set(present) - set(expected))
    if missing:
        raise RuntimeError(f"{os.path.join(path, missing[0])} is missing (listed in {CHECKSUMS})")
    if extra:
        raise RuntimeError(f"{os.path.join(path, extra[0])} is not part of the checkpoint (not listed in {CHECKSUMS})")
    for name in sorted(expected):
        if os.path.basename(name) != name:
            raise RuntimeError(f"{listing} lists {name!r}, which is not a file of the checkpoint directory")
    return expected


def _check_before_loading(path: str) -> None:
    """Step 1 of a load: rank 0 checks the listing; every rank reads ``.metadata`` (refusing
    a storage path outside the folder, naming the entry); rank 0 checks that every listed file
    lies in the folder and matches its sha256. Raises the first problem found; nothing was
    read but ``checksums.json``, ``.metadata`` and, on rank 0, the folder's files."""
    expected = _read_listing(path) if rank_of() == 0 else {}
    SafeFileSystemReader(path).read_metadata()
    for name in sorted(expected):
        reason = _leaves_folder(path, name)
        if reason:
            raise RuntimeError(f"{os.path.join(path, name)} {reason}; refused to read it")
        actual = _sha256(os.path.join(path, name))
        if actual != expected[name]:
            raise RuntimeError(f"{os.path.join(path, name)} is damaged: its sha256 is {actual}, the checkpoint "
                               f"recorded {expected[name]} (truncated, altered or overwritten after the save)")


def _check_param_groups(path: str, model: nn.Module, optims: Sequence[torch.optim.Optimizer]) -> Dict[str, Any]:
    """Step 2 of a load: as many optimizers as the checkpoint holds (or none), each one's
    ``param_groups`` entries read alone (plain data, see [Note: Loading executes nothing]);
    then the sharded state dicts that DCP loads into."""
    if optims:
        saved = sorted({key.split(".", 1)[0] for key in SafeFileSystemReader(path).read_metadata().state_dict_metadata
                        if key.split(".", 1)[0] == "optim" or key.startswith("optim_")})
        wanted = sorted(_optim_key(i) for i in range(len(optims)))
        if saved != wanted:
            raise ValueError(f"{path} holds the state of {len(saved)} optimizer(s) and {len(optims)} were given; pass "
                             "the optimizers it was saved with, in the same order (or none, to load the model only)")
        groups = {_optim_key(i): {"param_groups": param_groups_by_fqn(model, optim)} for i, optim in enumerate(optims)}
        dcp.load(groups, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(allow_partial_load=True),
                 no_dist=True)
    return _training_state(model, optims)


def _write_extra(tmp: str, extra: Optional[Mapping[str, Any]]) -> str:
    """Rank 0: ``extra`` into the checkpoint (``torch.save``), before it is published. Returns
    an error message or ''."""
    if extra is None:
        return ""
    try:
        torch.save(dict(extra), os.path.join(tmp, EXTRA))
    except Exception as e:  # an object that does not pickle, a full disk: refused on every rank
        return f"could not write extra to {tmp}: {type(e).__name__}: {e}"
    return ""


def _read_extra(path: str) -> Optional[Dict[str, Any]]:
    """The ``extra`` dict the checkpoint was saved with (None if it has none), read with
    ``torch.load(weights_only=True)`` after the checksums were verified (see [Note: Loading
    executes nothing])."""
    file = os.path.join(path, EXTRA)
    if not os.path.exists(file):
        return None
    try:
        extra = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        refused = [line.strip().split(" Please use")[0] for line in str(e).splitlines() if "Unsupported global" in line]
        if not refused:
            raise
        raise UnsafeCheckpointError(
            f"{file}: refused to unpickle it with weights_only=True ({refused[0]}). If you trust the checkpoint's source, "
            "allow that class with torch.serialization.add_safe_globals([...]) and load again; or save plain data "
            "(dicts, lists, numbers, strings, tensors) as extra.") from None
    if not isinstance(extra, dict):
        raise RuntimeError(f"{file} holds a {type(extra).__name__}, not the dict save_checkpoint(extra=...) writes")
    return extra


# ---------------------------------------------------------------------------- public
def save_checkpoint(path: str, model: nn.Module, optim: Optimizers = None, *,
                    extra: Optional[Mapping[str, Any]] = None) -> None:
    """Save ``model`` (and ``optim``) sharded to the new directory ``path``, crash-safely:
    ``path`` appears complete, with checksums, or not at all. Collective: every rank calls it
    with the same ``path``, which must not exist.

    Example::

        save_checkpoint(f"ckpt/step_{step:06d}", model, optim)
        save_checkpoint(path, model, [muon, adamw], extra={"step": step, "scheduler": sched.state_dict()})

    Args:
        path: the directory to create (one per checkpoint, e.g. ``step_<N>``).
        model: the model (sharded any way, or plain).
        optim: its optimizer, a list or tuple of its optimizers (each one's state is saved;
            load them in the same order), or None.
        extra: anything else to resume with (a step counter, a scheduler's or a framework's
            state): a dict that ``torch.save`` pickles, taken from rank 0 and checksummed with
            the rest. :func:`load_checkpoint` returns it.
    """
    model = unwrap_compiled(model)  # torch.compile's wrapper: the names without its prefix
    path = os.path.abspath(os.fspath(path))
    api = "save_checkpoint"
    optims = _optimizers(api, optim)
    if extra is not None and not (isinstance(extra, Mapping) and all(isinstance(k, str) for k in extra)):
        raise TypeError(f"{api}: extra must be a dict with str keys (or None), got {type(extra).__name__}")
    _require_numpy(api)
    agree_steps_now(model, api)  # see [Note: Steps agreed before a saved model]
    tmp = _claim_new_directory(path, api, "a published checkpoint is never written into. Save each checkpoint to a "
                                          "new directory (e.g. one per step).")
    dcp.save(_training_state(model, optims), checkpoint_id=tmp)
    _raise_from_rank0((_write_extra(tmp, extra) or _publish(tmp, path)) if rank_of() == 0 else "", api)


def load_checkpoint(path: str, model: nn.Module, optim: Optimizers = None) -> Optional[Dict[str, Any]]:
    """Load a checkpoint that :func:`save_checkpoint` published into ``model`` (and
    ``optim``), at any world size and sharding strategy. Every file is checked against the
    checkpoint's checksums first: a missing, truncated or altered file raises, naming it, with
    model and optimizer untouched. A ``.metadata`` that points outside the folder is refused,
    naming the entry, before any data is read. All or nothing: if the load fails on any rank,
    at any point, model and optimizers are as they were on every rank and every rank raises the
    same error (this takes a copy of the rank's own model shard and optimizer state while
    loading). Collective. Returns the ``extra`` dict the checkpoint was saved with (None if
    none).

    Example::

        found = latest_checkpoint("ckpt")
        if found is not None:
            load_checkpoint(found[1], model, optim)

    Args:
        path: a directory :func:`save_checkpoint` published.
        model: the model to load into (sharded any way, or plain).
        optim: its optimizer (built on the model's parameters), the list of optimizers the
            checkpoint was saved with (same order), or None (the model only).

    ``extra`` is read with ``torch.load(weights_only=True)`` (tensors, containers, plain values;
    another class raises :class:`UnsafeCheckpointError` unless allowed with
    ``torch.serialization.add_safe_globals``).
    """
    model = unwrap_compiled(model)  # torch.compile's wrapper: the names without its prefix
    api = "load_checkpoint"
    if not isinstance(model, nn.Module):
        raise TypeError(f"{api}: expected an nn.Module, got {type(model).__name__}")
    optims = _optimizers(api, optim)
    path = os.path.abspath(os.fspath(path))
    _require_numpy(api)
    with transaction(api, model, optims, None) as txn:  # see [Note: All-or-nothing loads]
        txn.step(lambda: _check_before_loading(path))
        extra = txn.step(lambda: _read_extra(path))
        state = txn.step(lambda: _check_param_groups(path, model, optims))
        # collective: DCP raises any rank's failure on every rank
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
        set_model_state_dict(model, state["model"])  # part of this transaction (no snapshot, no agreement of its own)
        for index, optimizer in enumerate(optims):
            set_optimizer_state_dict(model, optimizer, state[_optim_key(index)])
    return extra


def latest_checkpoint(root: str) -> Optional[Tuple[int, str]]:
    """``(step, path)`` of the newest published ``root/step_<N>``, or None (decided on rank 0
    for every rank). Unfinished saves (``*.tmp-*``) never match.

    Example::

        found = latest_checkpoint("ckpt")            # e.g. (300, "/abs/ckpt/step_000300")
        start = 0
        if found is not None:
            start, path = found
            load_checkpoint(path, model, optim)
        for step in range(start, total_steps):
            ...
            if (step + 1) % 100 == 0:
                save_checkpoint(f"ckpt/step_{step + 1:06d}", model, optim)

    Args:
        root: the directory holding ``step_<N>`` checkpoints.
    """
    found = ""
    if rank_of() == 0 and os.path.isdir(root):
        steps = {int(m.group(1)): name for name in os.listdir(root) if (m := _STEP_DIR.fullmatch(name))}
        if steps:
            step = max(steps)
            found = f"{step}\n{os.path.join(os.path.abspath(root), steps[step])}"
    found = from_rank(found, 0)
    if not found:
        return None
    step_text, path = found.split("\n", 1)
    return int(step_text), path


def export_safetensors(path: str, model: nn.Module) -> None:
    """Write ``model``'s full state dict (original FQNs, full tensors, buffers in their
    original dtype) as Hugging Face safetensors to the new directory ``path``, through DCP's
    Hugging Face storage (``torch.distributed.checkpoint.hf_storage``): a weights file that
    loads with no unpickling at all, into a plain model (``safetensors.torch.load_file``) or,
    for a ``transformers`` model, with ``from_pretrained(path)`` (its ``config.json`` is
    written too). Collective: every rank calls it; rank 0 gathers one handle at a time to the
    CPU and writes; ``path`` is published like :func:`save_checkpoint` (complete or absent).
    Needs the ``safetensors`` package.

    Tied parameters (one tensor under several names) are written under each name, as separate
    copies: safetensors refuses tensors that share memory. Non-tensor entries (a module's
    ``_extra_state``) are not written.

    Example::

        export_safetensors("export/final", model)
    """
    model = unwrap_compiled(model)  # torch.compile's wrapper: the names without its prefix
    path = os.path.abspath(os.fspath(path))
    api = "export_safetensors"
    missing = ""
    if rank_of() == 0:
        try:
            import safetensors  # noqa: F401  # DCP's Hugging Face storage writes through it
        except ImportError:
            missing = "needs the safetensors package (pip install safetensors; transformers installs it)."
    _raise_from_rank0(missing, api)
    tmp = _claim_new_directory(path, api, "export to a new directory.")
    state = get_model_state_dict(model, rank0_only=True, cpu_offload=True)  # collective
    error = ""
    if rank_of() == 0:
        error = _write_safetensors(tmp, model, state)
        if not error:
            error = _publish(tmp, path)
    _raise_from_rank0(error, api)


def _write_safetensors(directory: str, model: nn.Module, state: Dict[str, Any]) -> str:
    """Rank 0: the tensors of ``state`` (aliases copied apart) into ``directory``, and a
    ``transformers`` config if the model has one. Returns an error message or ''."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    tensors: Dict[str, torch.Tensor] = {}
    seen: set = set()  # storage addresses already written
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        value = value.detach()
        storage = value.untyped_storage()
        shared = storage.data_ptr() in seen or storage.nbytes() != value.nbytes or not value.is_contiguous()
        tensors[name] = value.clone() if shared else value  # a tensor of its own: safetensors refuses aliases
        seen.add(tensors[name].untyped_storage().data_ptr())
    try:
        dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(directory), no_dist=True)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(directory)
    except Exception as e:  # reported on every rank by the caller
        return f"writing {directory} failed: {type(e).__name__}: {e}"
    return ""
