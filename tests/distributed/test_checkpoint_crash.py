"""Crash safety of checkpoints (issue 10 item 7): a save killed midway never leaves a directory
that loads, and a damaged checkpoint fails to load, naming the file, instead of loading wrong
values.

Under test: ``save_checkpoint`` / ``load_checkpoint`` / ``latest_checkpoint`` (see
[Note: Publishing] and [Note: Verifying] in ``composable_shard/_state/checkpoint_files.py``). Without
these tests:

* a save killed midway could leave a directory under the checkpoint's name: torch 2.13's DCP
  saving in place over an older checkpoint keeps the old ``.metadata`` until the very end, so a
  rank killed after another rank rewrote its data file leaves a directory that loads without
  error as a mix of both checkpoints (checked by hand; see the README);
* the killed save could damage the checkpoint a resume needs (the previous one), or make
  ``latest_checkpoint`` pick an unfinished one;
* DCP alone loads a flipped bit inside a tensor's bytes as a wrong value (its files carry no
  checksum, ``torch.load`` checks none), and fails on a truncated data file with an error
  (``EOFError``, "failed reading zip archive") that does not name the file.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import pickle
import shutil
import signal
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter

from composable_shard import (get_model_state_dict, get_optimizer_state_dict, latest_checkpoint,
                              load_checkpoint, save_checkpoint)
from tests._harness import RankError, run_distributed, run_subtests
from tests._models import make_model, sharded_adamw_run, zip_same

WORLD_SIZE = 2
TIMEOUT_S = 60.0
DATA_FILE = "__1_0.distcp"  # rank 1's data file (DCP names them __<rank>_<n>.distcp)
STRAY_FILE = "__2_0.distcp"  # a third rank's data file name, not part of a 2-rank checkpoint
# ParityModel's tied weight: loading one of the two names rewrites the other's storage.
TIED = ("model.emb.weight", "model.head.weight")


def _step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:06d}")  # the name latest_checkpoint looks for


def _trained(steps: int) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """A sharded ParityModel after ``steps`` AdamW steps: the same on every call."""
    return sharded_adamw_run(make_model(), steps)


def _differences(model: nn.Module, optim: torch.optim.Optimizer, steps: int) -> List[str]:
    """The parameters and optimizer states (this rank's shards) that differ from ``_trained(steps)``."""
    reference, reference_optim = _trained(steps)
    pairs = list(zip_same(list(model.named_parameters()), list(reference.parameters()), what="parameters"))
    wrong = [name for (name, p), q in pairs if not torch.equal(p, q)]
    for (name, p), q in pairs:
        state, expected = optim.state[p], reference_optim.state[q]
        if state.keys() != expected.keys():
            wrong.append(f"optimizer state of {name}: {sorted(state)} vs {sorted(expected)}")
        wrong += [f"{key} of {name}" for key in state if not torch.equal(state[key], expected[key])]
    return wrong


def _load_error(path: str) -> str:
    """Resume a fresh model from ``path``; the error's message, or "" if it loaded."""
    model, optim = _trained(0)
    try:
        load_checkpoint(path, model, optim)
    except (RuntimeError, CheckpointException) as e:
        return str(e)
    return ""


# ---------------------------------------------------------------------------- rank functions
def _save(root: str, steps: int) -> None:
    model, optim = _trained(steps)
    save_checkpoint(_step_dir(root, steps), model, optim)


def _die_in_save(point: str) -> None:
    """From here on this process dies by SIGKILL inside DCP's FileSystemWriter at ``point``:
    ``before_data`` (before writing its data file), ``before_metadata`` (rank 0, every data file
    written, ``.metadata`` not yet). Process-local fault injection; DCP runs unchanged around it."""
    def die(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(FileSystemWriter, {"before_data": "write_data", "before_metadata": "finish"}[point], die)


def _save_killed(root: str, steps: int, victim: int, point: str) -> None:
    model, optim = _trained(steps)
    if dist.get_rank() == victim:
        _die_in_save(point)
    save_checkpoint(_step_dir(root, steps), model, optim)


def _check_after_killed_save(root_tmp: Tuple[str, str]) -> None:
    """The killed save of step 4 loads neither under its name (there is none) nor from its
    temporary directory (never published: no checksums), each error naming what is missing;
    step 2 still resumes exactly."""
    root, tmp = root_tmp
    killed = _step_dir(root, 4)
    for path, missing in ((killed, f"no checkpoint at {killed}"), (tmp, os.path.join(tmp, "checksums.json"))):
        message = _load_error(path)
        assert message, f"{path} loaded"
        assert missing in message, f"the error does not name {missing}:\n{message}"
    latest = latest_checkpoint(root)
    assert latest == (2, _step_dir(root, 2)), latest
    model, optim = _trained(0)
    load_checkpoint(latest[1], model, optim)
    wrong = _differences(model, optim, steps=2)
    assert not wrong, f"the published step-2 checkpoint changed: {wrong}"


def _check_after_killed_saves(killed: List[Tuple[str, str]]) -> None:
    """:func:`_check_after_killed_save` for each ``(root, tmp)``, in one process group."""
    run_subtests(_check_after_killed_save, {"root_tmp": killed})


def _record_loads(paths: List[str], out_dir: str) -> None:
    """For each path, write ``raised:<message>`` or ``loaded:<differences from step 2>`` to
    ``out_dir/<i>.rank<r>`` (the parent judges, so an expected failure is told apart from a bug)."""
    for i, path in enumerate(paths):
        model, optim = _trained(0)
        try:
            load_checkpoint(path, model, optim)
            outcome = "loaded:" + ", ".join(_differences(model, optim, steps=2))
        except (RuntimeError, CheckpointException) as e:
            outcome = f"raised:{e}"
        if outcome.startswith("raised:"):
            assert not _differences(model, optim, steps=0), "a refused load changed the model or optimizer"
        Path(out_dir, f"{i}.rank{dist.get_rank()}").write_text(outcome)


# ---------------------------------------------------------------------------- damage
def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip_tensor_byte(checkpoint: str, data_file: str) -> str:
    """Flip one bit in the middle of the raw bytes of the first untied model tensor (more than
    one element) stored in ``data_file``, found through ``.metadata``; returns its name."""
    with open(os.path.join(checkpoint, ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    path = os.path.join(checkpoint, data_file)
    raw = bytearray(Path(path).read_bytes())
    for index, info in metadata.storage_data.items():
        if info.relative_path != data_file or not index.fqn.startswith("model.") or index.fqn in TIED:
            continue
        item = bytes(raw[info.offset:info.offset + info.length])  # one torch.save archive
        data = torch.load(io.BytesIO(item), weights_only=True).contiguous().numpy().tobytes()
        at = item.find(data)
        if len(data) > 4 and at >= 0:
            raw[info.offset + at + len(data) // 2] ^= 0x40
            Path(path).write_bytes(bytes(raw))
            return f"{index.fqn} at offsets {tuple(index.offset)}"
    raise AssertionError(f"no untied model tensor with more than one element in {path}")


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A root holding one published checkpoint, ``step_000002``."""
    root = str(tmp_path_factory.mktemp("published"))
    run_distributed(_save, WORLD_SIZE, root, 2, timeout=TIMEOUT_S)
    assert os.listdir(root) == ["step_000002"], os.listdir(root)
    return root


class _Damaged(NamedTuple):
    """Per rank, ``_record_loads``'s outcome of loading each damaged copy of step 2."""

    truncated: Dict[int, str]  # DATA_FILE truncated to half
    flipped: Dict[int, str]  # one bit flipped inside a tensor's data in DATA_FILE
    flipped_where: str  # which tensor
    stray: Dict[int, str]  # an unlisted file beside the listed ones (STRAY_FILE)


@pytest.fixture(scope="module")
def damaged_loads(published: str, tmp_path_factory: pytest.TempPathFactory) -> _Damaged:
    work = tmp_path_factory.mktemp("damaged")
    truncated, flipped, stray = str(work / "truncated"), str(work / "flipped"), str(work / "stray")
    for copy in (truncated, flipped, stray):
        shutil.copytree(_step_dir(published, 2), copy)
    _truncate(os.path.join(truncated, DATA_FILE))
    where = _flip_tensor_byte(flipped, DATA_FILE)
    shutil.copy(os.path.join(stray, DATA_FILE), os.path.join(stray, STRAY_FILE))
    run_distributed(_record_loads, WORLD_SIZE, [truncated, flipped, stray], str(work), timeout=TIMEOUT_S)
    truncated_outcomes, flipped_outcomes, stray_outcomes = (
        {rank: (work / f"{i}.rank{rank}").read_text() for rank in range(WORLD_SIZE)} for i in range(3))
    return _Damaged(truncated_outcomes, flipped_outcomes, where, stray_outcomes)


# ---------------------------------------------------------------------------- tests
def test_killed_save_publishes_nothing(published: str, tmp_path: Path) -> None:
    """A rank SIGKILLed inside ``dcp.save`` (rank 1 before its data file; rank 0 with every data
    file written, before ``.metadata``), each in a copy of the published root: the save fails,
    ``step_000004`` does not exist, loading it or its temporary directory fails naming what is
    missing, and the previous checkpoint is untouched: ``latest_checkpoint`` picks it (not the
    older ``step_1`` beside it) and it resumes exactly (both roots checked in one process group)."""
    killed: List[Tuple[str, str]] = []
    for victim, point in ((1, "before_data"), (0, "before_metadata")):
        root = str(tmp_path / point)
        shutil.copytree(published, root)
        # An older checkpoint beside it, named without padding: the newest is step 2 by number
        # (the oldest, or the largest name as text, would be this one; its content is never read).
        shutil.copytree(_step_dir(published, 2), os.path.join(root, "step_1"))
        with pytest.raises(RankError, match="SIGKILL") as failure:
            run_distributed(_save_killed, WORLD_SIZE, root, 4, victim, point, timeout=TIMEOUT_S)
        assert failure.value.rank == victim, (point, str(failure.value))
        assert not os.path.exists(_step_dir(root, 4)), f"a killed save published {_step_dir(root, 4)}"
        leftovers = glob.glob(_step_dir(root, 4) + ".tmp-*")
        assert len(leftovers) == 1, (point, sorted(os.listdir(root)))
        expected_files = ["__0_0.distcp"] if point == "before_data" else ["__0_0.distcp", "__1_0.distcp"]
        assert sorted(os.listdir(leftovers[0])) == expected_files, f"the save was not killed where intended ({point})"
        killed.append((root, leftovers[0]))
    run_distributed(_check_after_killed_saves, WORLD_SIZE, killed, timeout=TIMEOUT_S)


def test_save_refuses_to_overwrite(published: str, tmp_path: Path) -> None:
    """Saving to a published checkpoint's name raises on every rank before writing anything
    (an in-place save killed midway is what loads as a mix of two checkpoints)."""
    root = str(tmp_path / "ckpt")
    shutil.copytree(published, root)
    before = {name: os.path.getmtime(os.path.join(_step_dir(root, 2), name)) for name in os.listdir(_step_dir(root, 2))}
    with pytest.raises(RankError, match="already exists; a published checkpoint is never written into"):
        run_distributed(_save, WORLD_SIZE, root, 2, timeout=TIMEOUT_S)
    after = {name: os.path.getmtime(os.path.join(_step_dir(root, 2), name)) for name in os.listdir(_step_dir(root, 2))}
    assert after == before and os.listdir(root) == ["step_000002"], (before, after, os.listdir(root))


def test_truncated_data_file_fails_to_load_naming_it(damaged_loads: _Damaged) -> None:
    """A data file truncated to half fails to load on every rank, naming the file, before the
    model or optimizer changes."""
    for rank, outcome in damaged_loads.truncated.items():
        assert outcome.startswith("raised:"), f"rank {rank}: the truncated checkpoint {outcome}"
        assert f"{DATA_FILE} is damaged" in outcome, f"rank {rank}: {outcome}"


def test_unlisted_file_fails_to_load_naming_it(damaged_loads: _Damaged) -> None:
    """A data file in the folder that ``checksums.json`` does not list (what a save by more ranks
    into a reused name, or a hand-copied file, leaves) fails to load on every rank, naming it,
    before the model or optimizer changes: the listing must be exactly the folder's files."""
    for rank, outcome in damaged_loads.stray.items():
        assert outcome.startswith("raised:"), f"rank {rank}: the checkpoint with a stray file {outcome}"
        assert f"{STRAY_FILE} is not part of the checkpoint" in outcome, f"rank {rank}: {outcome}"


def test_flipped_data_bit_fails_to_load_naming_it(damaged_loads: _Damaged) -> None:
    """One bit flipped inside a tensor's bytes (which DCP alone loads as a wrong value) fails to
    load on every rank, naming the file, before the model or optimizer changes."""
    where, outcomes = damaged_loads.flipped_where, damaged_loads.flipped
    for rank, outcome in outcomes.items():
        assert outcome.startswith("raised:"), f"rank {rank}: flipped a bit of {where}, yet {outcome}"
        assert f"{DATA_FILE} is damaged" in outcome, f"rank {rank}: {outcome}"


# ---------------------------------------------------------------------------- tampered files
class _Payload:
    """Unpickling this runs a shell command that creates the file ``sentinel``."""

    def __init__(self, sentinel: str) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.sentinel}",))


def _rewrite_checksums(checkpoint: str) -> None:
    """What an attacker who can write the directory does too: checksums offer no protection."""
    sums = {name: hashlib.sha256(Path(checkpoint, name).read_bytes()).hexdigest()
            for name in sorted(os.listdir(checkpoint)) if name != "checksums.json"}
    Path(checkpoint, "checksums.json").write_text(json.dumps(sums))


def _tamper_metadata(checkpoint: str, sentinel: str) -> None:
    with open(os.path.join(checkpoint, ".metadata"), "wb") as f:
        pickle.dump(_Payload(sentinel), f)
    _rewrite_checksums(checkpoint)


def _tamper_entry(checkpoint: str, sentinel: str) -> str:
    """Point the optimizer's first non-tensor entry at a malicious ``torch.save`` archive
    appended to its data file; returns that file's name."""
    with open(os.path.join(checkpoint, ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    index = next(i for i, md in metadata.state_dict_metadata.items()
                 if i.startswith("optim.param_groups") and type(md).__name__ == "BytesStorageMetadata")
    key = next(k for k in metadata.storage_data if k.fqn == index)
    info = metadata.storage_data[key]
    payload = io.BytesIO()
    torch.save(_Payload(sentinel), payload)
    path = os.path.join(checkpoint, info.relative_path)
    offset = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(payload.getvalue())
    metadata.storage_data[key] = type(info)(info.relative_path, offset, len(payload.getvalue()))
    with open(os.path.join(checkpoint, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    _rewrite_checksums(checkpoint)
    return str(info.relative_path)


def _load_tampered(paths: List[str], out: str) -> None:
    """For each path, write ``raised:<message>`` or ``loaded`` to ``out/<i>.rank<r>``."""
    for i, path in enumerate(paths):
        model, optim = _trained(0)
        try:
            load_checkpoint(path, model, optim)
            outcome = "loaded"
        except RuntimeError as e:
            outcome = f"raised:{e}"
        assert not _differences(model, optim, steps=0), f"a refused load of {path} changed the model or optimizer"
        Path(out, f"{i}.rank{dist.get_rank()}").write_text(outcome)


def test_tampered_checkpoint_runs_nothing(published: str, tmp_path: Path) -> None:
    """A ``.metadata`` that unpickles to ``os.system(...)``, or an optimizer entry that does
    (with checksums rewritten to match), each in its own copy: load_checkpoint raises on every
    rank naming the file, the command never runs, model and optimizer stay as they were. Plain
    ``dcp.load`` runs it."""
    checkpoints, sentinels, named = [], [], []
    for where in ("metadata", "entry"):
        checkpoint, sentinel = str(tmp_path / where), str(tmp_path / f"pwned-{where}")
        shutil.copytree(_step_dir(published, 2), checkpoint)
        if where == "metadata":
            _tamper_metadata(checkpoint, sentinel)
            named.append(os.path.join(checkpoint, ".metadata"))
        else:
            named.append(_tamper_entry(checkpoint, sentinel))
        checkpoints.append(checkpoint)
        sentinels.append(sentinel)
    run_distributed(_load_tampered, WORLD_SIZE, checkpoints, str(tmp_path), timeout=TIMEOUT_S)
    for i, (sentinel, name) in enumerate(zip_same(sentinels, named)):
        assert not os.path.exists(sentinel), f"loading {checkpoints[i]} ran the attacker's command"
        for rank in range(WORLD_SIZE):
            outcome = (tmp_path / f"{i}.rank{rank}").read_text()
            assert outcome.startswith("raised:") and name in outcome and "refused" in outcome, f"rank {rank}: {outcome}"
    # the positive control: DCP's defaults execute the same files (and may or may not fail after)
    run_distributed(_plain_dcp_loads, 1, checkpoints, timeout=TIMEOUT_S)
    missing = [sentinel for sentinel in sentinels if not os.path.exists(sentinel)]
    assert not missing, f"the tampered files were not dangerous to begin with: {missing}"


def _plain_dcp_loads(paths: List[str]) -> None:
    """``dcp.load`` with DCP's defaults of each path; an error after unpickling is expected."""
    for path in paths:
        model, optim = _trained(0)
        try:
            dcp.load({"model": get_model_state_dict(model, full=False),
                      "optim": get_optimizer_state_dict(model, optim, full=False)}, checkpoint_id=path)
        except (Exception, CheckpointException):  # (a BaseException) whatever follows the command is not the point
            pass
