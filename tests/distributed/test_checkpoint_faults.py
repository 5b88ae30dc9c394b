"""Loads that cannot betray a job (issue 34 items 3 and 4): a load never reads outside the
checkpoint folder, and a load that fails on any rank, at any point, leaves model and optimizer
bit-identical on every rank, with the same error raised everywhere.

Under test: ``load_checkpoint``, ``SafeFileSystemReader``, ``set_model_state_dict`` and
``set_optimizer_state_dict`` (see [Note: Reading stays in the folder] in
``composable_shard/_state/checkpoint_files.py`` and [Note: All-or-nothing loads] in
``composable_shard/_state/load_transaction.py``). Without these tests:

* a ``.metadata`` whose storage entries point at ``../outside.bin``, an absolute path, or a
  symbolic link in the folder that resolves outside (``checksums.json`` rewritten to match, as
  an attacker who can write the folder does) makes the load open that file: the tests make the
  outside file a FIFO whose every open is counted by a writer thread in the test process, so an
  open is seen even when the bytes read are then refused;
* a load that fails midway (a data file truncated on one rank only, with its checksum recorded
  anew; a ``.metadata`` that only one rank cannot read; a failure on one rank after every write,
  at the final agreement) leaves parameters or optimizer state half overwritten on some rank,
  or raises different errors on different ranks (rank 0 did not know why rank 1 refused);
* ``set_model_state_dict`` / ``set_optimizer_state_dict`` with one bad entry on rank 1 only
  load everything on rank 0: the ranks then train different models.

Every comparison is bytewise over every tensor (parameters, buffers including an integer one,
each optimizer state including ``step``) and every ``param_groups`` value (``lr`` included).
One ``run_distributed`` call runs every case (``_results`` fixture); each test judges its cases
from what each rank recorded.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import threading
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint import CheckpointException

from composable_shard import (get_model_state_dict, get_optimizer_state_dict, load_checkpoint,
                              save_checkpoint, set_model_state_dict, set_optimizer_state_dict)
from tests._harness import run_distributed
from tests._models import make_model, sharded_adamw_run

WORLD_SIZE = 2
TIMEOUT_S = 120.0
DATA_FILE = "__1_0.distcp"  # rank 1's data file (DCP names them __<rank>_<n>.distcp)
SAVED_LR, TARGET_LR = 1e-2, 3e-3  # the checkpoint's and the loading optimizer's learning rates
HOOK_MESSAGE = "injected failure at the final agreement"


# ---------------------------------------------------------------------------- models and state
def _trained(steps: int, lr: float, counter: int) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """A sharded ParityModel with an int64 buffer ``seen`` (= ``counter`` + 0..3) after
    ``steps`` AdamW steps at ``lr``: the same on every call."""
    model = make_model()
    model.register_buffer("seen", torch.arange(4, dtype=torch.int64) + counter)
    return sharded_adamw_run(model, steps, lr)


def _saved() -> Tuple[nn.Module, torch.optim.Optimizer]:
    """What the checkpoint holds: 2 steps at SAVED_LR, ``seen`` 200..203."""
    return _trained(2, SAVED_LR, 200)


def _target() -> Tuple[nn.Module, torch.optim.Optimizer]:
    """What a failed load must leave untouched: 1 step at TARGET_LR, ``seen`` differing per rank."""
    return _trained(1, TARGET_LR, 100 + 10 * dist.get_rank())


def _raw(value: Any) -> Any:
    """A value as comparable plain data: a tensor by dtype, shape and every byte."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        return [str(value.dtype), list(value.shape), bytes(flat.view(torch.uint8).tolist()).hex()]
    return repr(value)


def _state(model: nn.Module, optim: torch.optim.Optimizer) -> Dict[str, Any]:
    """Every tensor of this rank's model and optimizer (local shards), and every param group value."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"parameter {n}": _raw(p) for n, p in model.named_parameters()}
    out.update({f"buffer {n}": _raw(b) for n, b in model.named_buffers()})
    for p, entry in optim.state.items():
        out.update({f"optimizer state {names[id(p)]}[{k!r}]": _raw(v) for k, v in entry.items()})
    for i, group in enumerate(optim.param_groups):
        out.update({f"param_groups[{i}][{k!r}]": [names[id(p)] for p in v] if k == "params" else _raw(v)
                    for k, v in group.items()})
    return out


def _differences(before: Dict[str, Any], after: Dict[str, Any]) -> List[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


# ---------------------------------------------------------------------------- cases (run in each rank)
class Case(NamedTuple):
    """One failing load: ``kind`` says which API and how it fails; ``paths``: each rank's checkpoint."""

    name: str
    kind: str  # "load", "load_hook", "set_model", "set_optim", "set_model_hook", "set_optim_hook"
    paths: Tuple[str, ...] = ()


def _install_hook(api: str) -> bool:
    """From here on, ``api`` fails on rank 1 at its final agreement (the library's test hook,
    [Note: Fault hook]); False if this library has no such hook."""
    try:
        from composable_shard._state import load_transaction as _load_transaction
    except ImportError:
        return False

    def fail(called: str) -> None:
        if called == api and dist.get_rank() == 1:
            raise RuntimeError(HOOK_MESSAGE)

    _load_transaction.before_final_agreement = fail  # type: ignore[attr-defined]
    return True


def _remove_hook() -> None:
    try:
        from composable_shard._state import load_transaction as _load_transaction
    except ImportError:
        return
    _load_transaction.before_final_agreement = None  # type: ignore[attr-defined]


def _call(case: Case, model: nn.Module, optim: torch.optim.Optimizer, rank: int) -> None:
    """The failing call of ``case`` (a bad entry on rank 1 only for set_model / set_optim)."""
    if case.kind.startswith("load"):
        load_checkpoint(case.paths[rank], model, optim)
        return
    source, source_optim = _saved()
    if case.kind.startswith("set_model"):
        state = get_model_state_dict(source)
        if case.kind == "set_model" and rank == 1:
            state["blocks.0.fc1.weight"] = torch.zeros(3, 3)
        set_model_state_dict(model, state)
    else:
        osd = get_optimizer_state_dict(source, source_optim)
        if case.kind == "set_optim" and rank == 1:
            osd["state"]["blocks.0.fc2.weight"]["exp_avg"] = torch.zeros(2, 2)
        set_optimizer_state_dict(model, optim, osd)


def _one_case(case: Case) -> Dict[str, Any]:
    rank = dist.get_rank()
    model, optim = _target()
    before = _state(model, optim)
    record: Dict[str, Any] = {"error": "", "type": "", "hook": None}
    if case.kind.endswith("_hook"):
        api = {"load_hook": "load_checkpoint", "set_model_hook": "set_model_state_dict",
               "set_optim_hook": "set_optimizer_state_dict"}[case.kind]
        record["hook"] = _install_hook(api)
    try:
        _call(case, model, optim, rank)
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        record["error"], record["type"] = str(e), type(e).__name__
    finally:
        _remove_hook()
    record["changed"] = _differences(before, _state(model, optim))
    if case.kind == "load_hook":  # the positive control: the same load, unhooked, loads exactly
        load_checkpoint(case.paths[rank], model, optim)
        saved, saved_optim = _saved()
        record["reload_differences"] = _differences(_state(saved, saved_optim), _state(model, optim))
    return record


def _run_cases(cases: List[Case], out: str) -> None:
    for case in cases:
        record = _one_case(case)
        Path(out, f"{case.name}.rank{dist.get_rank()}.json").write_text(json.dumps(record))
        dist.barrier()


def _save(path: str) -> None:
    model, optim = _saved()
    save_checkpoint(path, model, optim)


# ---------------------------------------------------------------------------- damage (in the test process)
class Tripwire:
    """A FIFO that records every open for reading: a thread keeps opening it for writing (which
    blocks until a reader opens it), counts, writes a line that is no checkpoint data, closes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.opened = 0
        self.stopping = False
        os.mkfifo(path)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            fd = os.open(self.path, os.O_WRONLY)  # returns once a reader opened the FIFO
            if self.stopping:
                os.close(fd)
                return
            self.opened += 1
            try:
                os.write(fd, b"not checkpoint data\n")
            except BrokenPipeError:
                pass
            os.close(fd)

    def close(self) -> int:
        """Stop the thread; how many times the FIFO was opened for reading before."""
        self.stopping = True
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)  # lets the thread's open return
        self.thread.join(timeout=10)
        os.close(fd)
        return self.opened


def _rewrite_checksums(checkpoint: str, unread: Tuple[str, ...] = ()) -> None:
    """What an attacker who can write the folder does too (files in ``unread`` get a made-up sum:
    reading them here would trip the wire)."""
    sums = {name: "0" * 64 if name in unread else hashlib.sha256(Path(checkpoint, name).read_bytes()).hexdigest()
            for name in sorted(os.listdir(checkpoint)) if name != "checksums.json"}
    Path(checkpoint, "checksums.json").write_text(json.dumps(sums))


def _redirect_entries(checkpoint: str, new_path: str) -> List[str]:
    """Point every storage entry of DATA_FILE at ``new_path``; returns their FQNs."""
    with open(os.path.join(checkpoint, ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    moved = []
    for index, info in metadata.storage_data.items():
        if info.relative_path == DATA_FILE:
            info.relative_path = new_path
            moved.append(index.fqn)
    assert moved, f"no entry is stored in {DATA_FILE}"
    with open(os.path.join(checkpoint, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    return moved


def _escape(work: Path, pristine: str, how: str) -> Tuple[str, str, List[str], Tripwire]:
    """A copy of the checkpoint whose DATA_FILE entries point outside it (``how``); returns
    (checkpoint, the path as written in .metadata, the moved FQNs, the tripwire outside)."""
    checkpoint = str(work / f"escape_{how}" / "ckpt")
    shutil.copytree(pristine, checkpoint)
    outside = str(work / f"escape_{how}" / "outside.bin")
    if how == "sibling":  # beside the checkpoint, in a folder whose name begins with the checkpoint's ("ckpt_old")
        os.makedirs(checkpoint + "_old")
        outside = os.path.join(checkpoint + "_old", "outside.bin")
    tripwire = Tripwire(outside)
    if how == "dotdot":
        written = "../outside.bin"
    elif how == "absolute":
        written = outside
    else:  # symlink, sibling: a link in the folder that resolves outside it
        written = "link.distcp"
        os.symlink(outside, os.path.join(checkpoint, written))
    moved = _redirect_entries(checkpoint, written)
    _rewrite_checksums(checkpoint, unread=("link.distcp",) if how in ("symlink", "sibling") else ())
    return checkpoint, written, moved, tripwire


def _damaged_copy(work: Path, pristine: str, name: str, damage: str) -> str:
    """A copy for rank 1 only: ``.metadata`` garbled, or DATA_FILE truncated to half; checksums recorded anew."""
    copy = str(work / name)
    shutil.copytree(pristine, copy)
    if damage == "metadata":
        Path(copy, ".metadata").write_bytes(b"\x80\x04not a pickle")
    else:
        target = os.path.join(copy, DATA_FILE)
        with open(target, "r+b") as f:
            f.truncate(os.path.getsize(target) // 2)
    _rewrite_checksums(copy)
    return copy


# ---------------------------------------------------------------------------- fixture
ESCAPES = ["dotdot", "absolute", "symlink", "sibling"]  # how a copied checkpoint's entries point outside it (_escape)


class Results(NamedTuple):
    records: Dict[str, Dict[int, Dict[str, Any]]]  # case -> rank -> what _one_case recorded
    escapes: Dict[str, Tuple[str, List[str], int]]  # how -> (path written, moved FQNs, FIFO opens)
    paths: Dict[str, Tuple[str, ...]]  # case -> each rank's checkpoint


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    work = tmp_path_factory.mktemp("faults")
    pristine = str(work / "pristine")
    run_distributed(_save, WORLD_SIZE, pristine, timeout=TIMEOUT_S)
    cases: List[Case] = []
    escapes: Dict[str, Tuple[str, List[str], Tripwire]] = {}
    for how in ESCAPES:
        checkpoint, written, moved, tripwire = _escape(work, pristine, how)
        escapes[how] = (written, moved, tripwire)
        cases.append(Case(f"escape_{how}", "load", (checkpoint,) * WORLD_SIZE))
    cases += [
        Case("metadata_rank1", "load", (pristine, _damaged_copy(work, pristine, "rank1_metadata", "metadata"))),
        Case("truncated_rank1", "load", (pristine, _damaged_copy(work, pristine, "rank1_truncated", "truncate"))),
        Case("final_agreement", "load_hook", (pristine,) * WORLD_SIZE),
        Case("set_model_rank1", "set_model"),
        Case("set_optim_rank1", "set_optim"),
        Case("set_model_final", "set_model_hook"),
        Case("set_optim_final", "set_optim_hook"),
    ]
    out = work / "outcomes"
    out.mkdir()
    try:
        run_distributed(_run_cases, WORLD_SIZE, cases, str(out), timeout=TIMEOUT_S)
    finally:
        opens = {how: tripwire.close() for how, (_, _, tripwire) in escapes.items()}
    records = {c.name: {r: json.loads((out / f"{c.name}.rank{r}.json").read_text()) for r in range(WORLD_SIZE)}
               for c in cases}
    return Results(records, {how: (w, m, opens[how]) for how, (w, m, _) in escapes.items()},
                   {c.name: c.paths for c in cases})


def _same_error_everywhere(records: Dict[int, Dict[str, Any]], kind: str = "RuntimeError") -> str:
    """Every rank raised and, first, changed nothing; then: the same type and message. Returns the message."""
    for rank, record in records.items():
        assert record["error"], f"rank {rank} raised nothing (the load went through there): {record}"
    for rank, record in records.items():
        assert not record["changed"], f"rank {rank}: the failed load changed {record['changed']}: {record['error']}"
    messages = {record["error"] for record in records.values()}
    types = {record["type"] for record in records.values()}
    assert len(messages) == 1, f"the ranks raised different errors: {json.dumps(records, indent=1)}"
    assert types == {kind}, types
    return messages.pop()


# ---------------------------------------------------------------------------- tests
@pytest.mark.parametrize("how", ESCAPES)
def test_storage_path_outside_the_folder_is_refused_unread(results: Results, how: str) -> None:
    """A ``.metadata`` whose entries point at ``../outside.bin``, at an absolute path, or at a
    symbolic link in the folder that resolves outside (also into a sibling folder whose name
    begins with the checkpoint folder's: ``ckpt_old`` beside ``ckpt``; checksums rewritten): every rank raises
    the same error naming an entry and the path, the outside file (a FIFO) is never opened, and
    model and optimizer are unchanged."""
    written, moved, opens = results.escapes[how]
    records = results.records[f"escape_{how}"]
    message = _same_error_everywhere(records)
    assert opens == 0, f"the load opened the file outside the checkpoint folder {opens} time(s): {message}"
    assert repr(written) in message, f"the error does not name the path {written!r}: {message}"
    assert any(repr(fqn) in message for fqn in moved), f"the error names none of the entries {moved}: {message}"
    # Refused for its own reason, not by a later check (the FIFO target is no regular file either).
    reason = {"dotdot": "has a '..' component", "absolute": "is an absolute path",
              "symlink": "outside the checkpoint folder", "sibling": "outside the checkpoint folder"}[how]
    assert reason in message, f"[{how}] refused, but not because the path {reason}: {message}"


@pytest.mark.parametrize("case,named", [
    ("metadata_rank1", "rank 1: {path1}/.metadata"),
    ("truncated_rank1", f"{{path1}}/{DATA_FILE}: reading the entry"),
    ("final_agreement", f"rank 1: {HOOK_MESSAGE}"),
])
def test_failed_load_leaves_every_rank_bit_identical(results: Results, case: str, named: str) -> None:
    """``load_checkpoint`` failing at each stage on rank 1 only: its ``.metadata`` unreadable
    (before any collective), its data file truncated midway (inside DCP's read, checksums
    recorded anew), or a failure after every write (the final agreement, through the library's
    test hook). Every rank raises the same error, naming what failed; every tensor and param
    group value of model and optimizer is bytewise as before on every rank. After the injected
    final failure, the same load without it loads the checkpoint exactly (positive control)."""
    records = results.records[case]
    message = _same_error_everywhere(records)
    expected = named.format(path1=results.paths[case][1])
    assert expected in message, f"the error does not say {expected!r}: {message}"
    if case == "final_agreement":
        for rank, record in records.items():
            assert record["hook"], "the library has no final-agreement test hook"
            assert not record["reload_differences"], f"rank {rank}: {record['reload_differences']}"


@pytest.mark.parametrize("case,kind,named", [
    ("set_model_rank1", "RuntimeError", "rank 1: error(s) in loading state_dict"),
    ("set_optim_rank1", "ValueError", "rank 1: size mismatch for state['blocks.0.fc2.weight']['exp_avg']"),
    ("set_model_final", "RuntimeError", f"rank 1: {HOOK_MESSAGE}"),
    ("set_optim_final", "RuntimeError", f"rank 1: {HOOK_MESSAGE}"),
])
def test_set_state_dict_failing_on_one_rank_changes_nothing(results: Results, case: str, kind: str,
                                                             named: str) -> None:
    """``set_model_state_dict`` / ``set_optimizer_state_dict`` with one entry of the wrong shape
    on rank 1 only, or failing on rank 1 after every write: every rank raises the same error
    (same type), and model and optimizer are bytewise unchanged on every rank, rank 0 included
    (which had nothing wrong and wrote everything)."""
    records = results.records[case]
    message = _same_error_everywhere(records, kind)
    assert named in message, f"the error does not say {named!r}: {message}"
