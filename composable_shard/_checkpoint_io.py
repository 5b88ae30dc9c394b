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
  Verification reads the whole checkpoint once, on rank 0.

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

import hashlib
import io
import json
import os
import pickle
import re
import secrets
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from . import _collectives
from ._optim_state_dict import get_optimizer_state_dict, param_groups_by_fqn, set_optimizer_state_dict
from ._state_dict import get_model_state_dict, set_model_state_dict
from ._torch_compat import object_collectives_without_numpy, unwrap_compiled

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "export_safetensors", "SafeFileSystemReader",
           "SafeLoadPlanner", "UnsafeCheckpointError"]

CHECKSUMS = "checksums.json"
_STEP_DIR = re.compile(r"step_(\d+)")


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file holds something loading it would have to execute."""


_METADATA_CLASSES = {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                     "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING"}
_ALLOWED: Dict[str, set] = {
    "torch.distributed.checkpoint.metadata": _METADATA_CLASSES,
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size", "device"} | {n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)},
    "torch.serialization": {"_get_layout"},  # a layout by its name ("torch.strided")
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"{self.path}: refused to load global {module}.{name}: a DCP checkpoint's metadata "
                                    "holds only DCP's metadata classes, torch sizes, dtypes and paths. The file was "
                                    "altered or is not a checkpoint; nothing was loaded.")


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``.metadata`` is read with an allow-list unpickler
    (see [Note: Loading executes nothing]); pass it to ``dcp.load(storage_reader=...)``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = os.path.join(os.fspath(self.path), ".metadata" if rank is None else f"__{rank}.metadata")
        with open(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f, path).load()
            except UnsafeCheckpointError:
                raise
            except Exception as e:  # a truncated or garbled pickle
                raise UnsafeCheckpointError(f"{path}: not a readable DCP metadata file ({type(e).__name__}: {e})") from e
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # what FileSystemReader.read_metadata does after unpickling
        return metadata


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


def _training_state(model: nn.Module, optim: Optional[torch.optim.Optimizer]) -> Dict[str, Any]:
    state: Dict[str, Any] = {"model": get_model_state_dict(model, full=False)}
    if optim is not None:
        state["optim"] = get_optimizer_state_dict(model, optim, full=False)
    return state


# ---------------------------------------------------------------------------- rank-0 decisions
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _from_rank0(message: str) -> str:
    """Rank 0's ``message`` on every rank (UTF-8 bytes in a tensor broadcast; '' on others)."""
    if not _distributed():
        return message
    data = torch.tensor(list(message.encode()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    _collectives.broadcast(size, 0, None, tag="checkpoint_message_size")
    buffer = data if _rank() == 0 else torch.empty(int(size.item()), dtype=torch.uint8)
    if buffer.numel():
        _collectives.broadcast(buffer, 0, None, tag="checkpoint_message")
    return bytes(buffer.tolist()).decode()


def _agree_or_raise(error: str, api: str) -> None:
    """Raise on every rank if any rank has an error (rank 0's message, else the first failing rank's number)."""
    if _distributed():
        failed = [r for r, (flag,) in enumerate(_collectives.exchange([1 if error else 0], None, tag=api)) if flag]
        if failed and failed[0] != 0:
            raise RuntimeError(f"{api}: rank {failed[0]} refused the checkpoint" + (f": {error}" if error else ""))
    _raise_from_rank0(error if _rank() == 0 else "", api)


def _raise_from_rank0(error: str, api: str) -> None:
    error = _from_rank0(error)
    if error:
        raise RuntimeError(f"{api}: {error}")


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
    if _rank() == 0:
        tmp = f"{path}.tmp-{secrets.token_hex(6)}"
        if os.path.exists(path):
            error = f"{path} already exists; {advice}"
    _raise_from_rank0(error, api)
    return _from_rank0(tmp)


def _verify(path: str) -> str:
    """Rank 0: every file of ``path`` matches ``checksums.json``. Returns an error or ''."""
    listing = os.path.join(path, CHECKSUMS)
    if not os.path.isdir(path):
        return f"no checkpoint at {path} (a save that did not finish publishes nothing)"
    try:
        with open(listing) as f:
            expected = json.load(f)
        if not isinstance(expected, dict) or not all(isinstance(v, str) for v in expected.values()):
            raise ValueError("not a {file: sha256} object")
    except (OSError, ValueError) as e:
        return (f"{listing} is missing or unreadable ({type(e).__name__}: {e}); not a checkpoint that "
                "save_checkpoint published, or a damaged one")
    present = _files(path)
    missing, extra = sorted(set(expected) - set(present)), sorted(set(present) - set(expected))
    if missing:
        return f"{os.path.join(path, missing[0])} is missing (listed in {CHECKSUMS})"
    if extra:
        return f"{os.path.join(path, extra[0])} is not part of the checkpoint (not listed in {CHECKSUMS})"
    for name in sorted(expected):
        if os.path.basename(name) != name:
            return f"{listing} lists {name!r}, which is not a file of the checkpoint directory"
        actual = _sha256(os.path.join(path, name))
        if actual != expected[name]:
            return (f"{os.path.join(path, name)} is damaged: its sha256 is {actual}, the checkpoint recorded "
                    f"{expected[name]} (truncated, altered or overwritten after the save)")
    return ""


# ---------------------------------------------------------------------------- public
def save_checkpoint(path: str, model: nn.Module, optim: Optional[torch.optim.Optimizer] = None) -> None:
    """Save ``model`` (and ``optim``) sharded to the new directory ``path``, crash-safely:
    ``path`` appears complete, with checksums, or not at all. Collective: every rank calls it
    with the same ``path``, which must not exist.

    Example::

        save_checkpoint(f"ckpt/step_{step:06d}", model, optim)

    Args:
        path: the directory to create (one per checkpoint, e.g. ``step_<N>``).
        model: the model (sharded any way, or plain).
        optim: its optimizer, or None.
    """
    model = unwrap_compiled(model)  # torch.compile's wrapper: the names without its prefix
    path = os.path.abspath(os.fspath(path))
    api = "save_checkpoint"
    tmp = _claim_new_directory(path, api, "a published checkpoint is never written into. Save each checkpoint to a "
                                          "new directory (e.g. one per step).")
    with object_collectives_without_numpy():
        dcp.save(_training_state(model, optim), checkpoint_id=tmp)
    _raise_from_rank0(_publish(tmp, path) if _rank() == 0 else "", api)


def load_checkpoint(path: str, model: nn.Module, optim: Optional[torch.optim.Optimizer] = None) -> None:
    """Load a checkpoint that :func:`save_checkpoint` published into ``model`` (and
    ``optim``), at any world size and sharding strategy. Every file is checked against the
    checkpoint's checksums first: a missing, truncated or altered file raises, naming it, with
    model and optimizer untouched. Collective.

    Example::

        found = latest_checkpoint("ckpt")
        if found is not None:
            load_checkpoint(found[1], model, optim)

    Args:
        path: a directory :func:`save_checkpoint` published.
        model: the model to load into (sharded any way, or plain).
        optim: its optimizer (built on the model's parameters), or None.
    """
    model = unwrap_compiled(model)  # torch.compile's wrapper: the names without its prefix
    path = os.path.abspath(os.fspath(path))
    _raise_from_rank0(_verify(path) if _rank() == 0 else "", "load_checkpoint")
    error = ""
    try:  # everything that is not a tensor is checked first: a refusal then changes nothing
        SafeFileSystemReader(path).read_metadata()
        if optim is not None:
            groups = {"optim": {"param_groups": param_groups_by_fqn(model, optim)}}
            dcp.load(groups, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(allow_partial_load=True),
                     no_dist=True)
    except (UnsafeCheckpointError, OSError) as e:
        error = str(e)
    except dcp.api.CheckpointException as e:
        error = f"{path}: {e}"
    _agree_or_raise(error, "load_checkpoint")
    state = _training_state(model, optim)
    with object_collectives_without_numpy():
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
    set_model_state_dict(model, state["model"])
    if optim is not None:
        set_optimizer_state_dict(model, optim, state["optim"])


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
    if _rank() == 0 and os.path.isdir(root):
        steps = {int(m.group(1)): name for name in os.listdir(root) if (m := _STEP_DIR.fullmatch(name))}
        if steps:
            step = max(steps)
            found = f"{step}\n{os.path.join(os.path.abspath(root), steps[step])}"
    found = _from_rank0(found)
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
    if _rank() == 0:
        try:
            import safetensors  # noqa: F401  # DCP's Hugging Face storage writes through it
        except ImportError:
            missing = "needs the safetensors package (pip install safetensors; transformers installs it)."
    _raise_from_rank0(missing, api)
    tmp = _claim_new_directory(path, api, "export to a new directory.")
    state = get_model_state_dict(model, rank0_only=True, cpu_offload=True)  # collective
    error = ""
    if _rank() == 0:
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
