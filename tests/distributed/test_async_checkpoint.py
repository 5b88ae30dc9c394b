"""Asynchronous checkpoints (issue 55, item 3): a save taken at step k holds the state of step k
while training goes on, and resumes exactly.

Under test: ``ShardedSlice`` as torch's async staging copies it (``new_empty``, see [Note: Staged
copies] in ``composable_shard/_state/sharded_slice.py``) and as ``multiprocessing`` sends it to
DCP's checkpoint process; ``save_checkpoint_async`` (see [Note: Async saves] in
``composable_shard/_state/async_checkpoint.py``). One spawn (W=2) runs every case; each test
judges what the ranks recorded. Each save is of a fully sharded ``ParityModel`` (per block,
``scale`` and the root) with AdamW, taken after ``K`` steps:

* ``dcp.async_save`` of torch's ``get_state_dict(model, optim)`` on its own gloo group with the
  thread checkpointer (torchtitan's ``async_mode="async"``), beside a synchronous ``dcp.save`` of
  the same state;
* the process checkpointer with the stager torchtitan's ``async_with_pinned_mem`` builds
  (``DefaultStager``: pinned and shared memory, staging in a thread). ``use_non_blocking_copy``
  is off: without an accelerator torch refuses it (and ignores ``use_pinned_memory``, warning);
* ``save_checkpoint_async``; then three that fail: the write on one rank, the publication
  (rank 0's rename), the staging copy on rank 1;
* without a save: two slices (one cut at row boundaries, one of a tensor-parallel piece) staged
  by torch's stager and sent through ``multiprocessing``'s pickler.

The write of each save cannot end before the test lets it: the model's extra state is a
:class:`_Gate`, which DCP pickles in the background (before it reads any tensor) and which waits
there for the test. So ``STEPS_DURING`` steps run while the write is pending, for certain. Without
these tests:

* torch's staging of our state dict raises (``aten.new_empty`` on a ShardedSlice: main before
  this change), or the checkpoint process receives plain per-rank tensors (or slices that lost
  their range, row cut or piece) and writes them under global names;
* a staging copy that aliases live state (a parameter, an ``exp_avg``, a ``step``, the extra
  state) lets the steps taken during the write leak into the checkpoint: the loaded state is
  compared with a step-``K`` snapshot, every tensor bitwise;
* a save that failed on one rank publishes a folder (``latest_checkpoint`` would resume from it),
  or ``result()`` returns, or ranks raise different errors; a rank whose staging failed leaves
  the others waiting in the writing thread's collectives;
* the writing thread's collectives run on the default group, where they pair with training's (a
  hang, or values exchanged between unrelated calls);
* ``staging_bytes`` reports another figure than the copy's bytes, worked out by hand below.
The resumed runs are compared with the run that went on during the save (bitwise), and with
single-process training on the combined batch and torch's FSDP2 trained as long (float32, atol
1e-5).
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import pickle
import threading
import time
import traceback
import warnings
from concurrent.futures import Future
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from composable_shard import ShardedSlice, fully_shard, latest_checkpoint, load_checkpoint
from composable_shard import AsyncSave, save_checkpoint_async
from tests._harness import run_distributed
from tests._models import ParityModel, batch, local_rows, loss_fn, reference_training

WORLD_SIZE = 2
TIMEOUT_S = 90.0
K = 2  # steps before the save
STEPS_DURING = 2  # steps while the write is held back
STEPS_AFTER = 2  # steps once the write is let go
LR = 1e-2
GATE_WAIT_S = 60.0
INJECTED = "injected: no space left on device"
INJECTED_STAGING = "injected: out of host memory"

# This rank's staging copy for save_checkpoint_async of the model below at W = 2, by hand.
# Flat shards, ceil(numel / 2) elements on rank 0: each Block handle 12 + 49 + 48 = 109 -> 55 | 54;
# the root's trainable handle emb.weight (13 x 6 = 78, head.weight tied to it, one copy) -> 39 | 39;
# its frozen handle frozen.weight + bias (36 + 6) -> 21 | 21; scale.gain (1) -> 1 | 0.
# Optimizer: exp_avg and exp_avg_sq of the trainable elements, a float32 step for each of the 14
# trainable parameters (emb, 6 per block, scale; frozen ones have no state). float32 = 4 bytes.
_PARAMS = {0: 55 + 55 + 39 + 21 + 1, 1: 54 + 54 + 39 + 21 + 0}
_TRAINABLE = {0: 55 + 55 + 39 + 1, 1: 54 + 54 + 39 + 0}
STAGING_BYTES = {r: 4 * _PARAMS[r] + 2 * 4 * _TRAINABLE[r] + 14 * 4 for r in range(WORLD_SIZE)}  # 1940 | 1904


# ---------------------------------------------------------------------------- model and steps
class _Gate:
    """A model's extra state, the number of steps taken, that holds back the write of a checkpoint.

    Staging deep-copies it: a new gate with the same ``step`` and ``released`` event. DCP pickles
    it in the writing thread (the process checkpointer: when sending it to its process), before
    any tensor, on one rank (DCP writes a value that every rank holds once): that waits until
    ``released`` is set, then, if ``fail``, notes it in ``failed`` and raises ``OSError``; else
    pickles ``torch.Size([step])`` (a tuple: a leaf for DCP, and plain data that loads with
    ``weights_only=True``)."""

    def __init__(self, step: int, fail: bool = False, copy_fails: bool = False) -> None:
        self.step = step
        self.fail = fail
        self.copy_fails = copy_fails  # staging it raises MemoryError
        self.failed: List[bool] = []  # shared with the copies
        self.released = threading.Event()
        self.released.set()

    def __deepcopy__(self, memo: Dict[int, Any]) -> "_Gate":
        if self.copy_fails:
            raise MemoryError(INJECTED_STAGING)
        copied = _Gate(self.step, self.fail)
        copied.released, copied.failed = self.released, self.failed
        return copied

    def __reduce__(self) -> Any:
        if not self.released.wait(GATE_WAIT_S):
            raise AssertionError("the test never released the write")
        if self.fail:
            self.failed.append(True)
            raise OSError(INJECTED)
        return torch.Size, ((self.step,),)

    def hold(self) -> None:
        """Hold back the next write (and each copy staged from now on) until :meth:`release`."""
        self.released = threading.Event()

    def release(self) -> None:
        self.released.set()


class _GatedModel(ParityModel):
    """``ParityModel`` whose extra state is a :class:`_Gate` counting the steps taken (while
    ``as_tensor``: the count as a tensor, which torch's full state dicts accept)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = _Gate(0)
        self.as_tensor = False
        self.loaded_step: Optional[int] = None

    def get_extra_state(self) -> Any:
        return torch.tensor([self.gate.step]) if self.as_tensor else self.gate

    def set_extra_state(self, state: Any) -> None:
        self.loaded_step = int(state[0])


Built = Tuple[_GatedModel, torch.optim.Optimizer]


def _built(seed: int, torch_fsdp2: bool = False) -> Built:
    """A fully sharded _GatedModel (each block, scale, the root) and its AdamW."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    shard: Callable[[nn.Module], Any] = torch_fully_shard if torch_fsdp2 else fully_shard
    torch.manual_seed(seed)
    model = _GatedModel()
    for block in model.blocks:
        shard(block)
    shard(model.scale)
    shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _train(built: Built, steps: range) -> None:
    model, optim = built
    rank = dist.get_rank()
    for step in steps:
        inputs, targets = batch(step, WORLD_SIZE)
        loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank)).backward()
        optim.step()
        optim.zero_grad()
        model.gate.step += 1


def _full(built: Built) -> Dict[str, torch.Tensor]:
    """Every parameter and optimizer state, full (collective), by name."""
    model, optim = built
    model.as_tensor = True
    try:
        msd, osd = cast(Tuple[Dict[str, Any], Any], get_state_dict(model, optim,
                                                                   options=StateDictOptions(full_state_dict=True)))
    finally:
        model.as_tensor = False
    out = {f"model.{k}": v.detach().clone() for k, v in msd.items() if k != "_extra_state"}
    for fqn, state in osd["state"].items():
        out.update({f"optim.{fqn}.{k}": v.detach().clone() for k, v in state.items()})
    return out


def _differences(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], atol: float = 0.0) -> List[str]:
    """Names whose tensors differ (bitwise unless ``atol``), and names on one side only."""
    out = sorted(set(actual) ^ set(expected))
    for name in sorted(set(actual) & set(expected)):
        a, e = actual[name].float(), expected[name].float()
        if a.shape != e.shape or not (torch.equal(a, e) if atol == 0 else torch.allclose(a, e, rtol=0, atol=atol)):
            out.append(name)
    return out


def _loaded_by_torch_api(path: str, seed: int) -> Built:
    """A fresh model (another init) loaded from ``path`` through torch's state-dict API."""
    fresh = _built(seed)
    msd, osd = get_state_dict(*fresh)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(*fresh, model_state_dict=msd, optim_state_dict=osd)
    return fresh


def _leaves(value: Any, name: str = "") -> Dict[str, torch.Tensor]:
    """The tensors of a nested state dict by dotted name (a ShardedSlice: its ``local``)."""
    if isinstance(value, dict):
        out: Dict[str, torch.Tensor] = {}
        for key, item in value.items():
            out.update(_leaves(item, f"{name}.{key}" if name else str(key)))
        return out
    if isinstance(value, ShardedSlice):
        return {name: value.local}
    return {name: value} if isinstance(value, torch.Tensor) else {}


def _passed_dict_differences(passed: Dict[str, Any], live: Built) -> List[str]:
    """Names where the state dict handed to dcp.async_save no longer shows the live state (a
    fresh get_state_dict's): torchtitan keeps one state dict (its ModelWrapper) and hands the
    same objects to every save, so staging must copy them, not move them onto the copy."""
    msd, osd = get_state_dict(*live)
    return _differences(_leaves(passed), _leaves({"model": msd, "optim": osd}))


def _judge(record: Dict[str, Any], live: Built, snapshot: Dict[str, torch.Tensor], resumed: Built) -> None:
    """What every save must give: the step-K state (tensors and extra state), and a resume that
    trains on exactly as the run that went on during the save."""
    record["snapshot_differences"] = _differences(_full(resumed), snapshot)
    record["loaded_step"] = resumed[0].loaded_step
    _train(resumed, range(K, K + STEPS_DURING + STEPS_AFTER))
    record["resume_differences"] = _differences(_full(resumed), _full(live))


# ---------------------------------------------------------------------------- the saves
def _start_process_save(path: str, record: Dict[str, Any]) -> Callable[[], None]:
    """torchtitan's async_with_pinned_mem, as far as a CPU machine allows: started first (the
    checkpoint process imports torch for seconds), finished last by the returned function."""
    live = _built(0)
    _train(live, range(K))
    snapshot = _full(live)
    msd, osd = get_state_dict(*live)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # use_pinned_memory without CUDA: ignored, says torch
        stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=True, use_async_staging=True,
                                              use_non_blocking_copy=False))
    group = dist.new_group(backend="gloo")
    children = set(multiprocessing.active_children())
    live[0].gate.hold()
    response = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path, process_group=group,
                              async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager)
    assert isinstance(response, AsyncSaveResponse), type(response)  # staging in a thread: two futures
    response.staging_completion.result()  # as torchtitan waits before the next optimizer step
    _train(live, range(K, K + STEPS_DURING))
    record["held_back"] = not response.upload_completion.done()
    live[0].gate.release()
    _train(live, range(K + STEPS_DURING, K + STEPS_DURING + STEPS_AFTER))

    def finish() -> None:
        response.upload_completion.result()
        record["passed_dict"] = _passed_dict_differences({"model": msd, "optim": osd}, live)
        stager.close()
        for process in set(multiprocessing.active_children()) - children:  # DCP's checkpoint process: ended now,
            process.terminate()  # not when this rank's pipe to it closes (it would print an EOFError then)
            process.join(5.0)
        _judge(record, live, snapshot, _loaded_by_torch_api(path, seed=7))

    return finish


def _thread_save(root: str, record: Dict[str, Any]) -> None:
    """torchtitan's async_mode="async"; the synchronous dcp.save of the same state beside it;
    the resumed run against torch's FSDP2 trained as long, uninterrupted."""
    live = _built(0)
    _train(live, range(K))
    snapshot = _full(live)
    msd, osd = get_state_dict(*live)
    sync_path, async_path = f"{root}/sync", f"{root}/async"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=sync_path)
    group = dist.new_group(backend="gloo")
    live[0].gate.hold()
    future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=async_path, process_group=group,
                            async_checkpointer_type=AsyncCheckpointerType.THREAD)
    assert isinstance(future, Future), type(future)
    _train(live, range(K, K + STEPS_DURING))
    record["held_back"] = not future.done()
    live[0].gate.release()
    _train(live, range(K + STEPS_DURING, K + STEPS_DURING + STEPS_AFTER))
    future.result()
    record["passed_dict"] = _passed_dict_differences({"model": msd, "optim": osd}, live)
    dist.destroy_process_group(group)
    record["same_as_sync"] = _same_checkpoint(sync_path, async_path)
    resumed = _loaded_by_torch_api(async_path, seed=7)
    _judge(record, live, snapshot, resumed)
    fsdp2 = _built(0, torch_fsdp2=True)
    _train(fsdp2, range(K + STEPS_DURING + STEPS_AFTER))
    record["vs_fsdp2"] = _differences(_full(resumed), _full(fsdp2), atol=1e-5)


def _same_checkpoint(a: str, b: str) -> List[str]:
    """How two DCP checkpoints differ: metadata entries, storage layout, this rank's data file."""
    meta_a, meta_b = FileSystemReader(a).read_metadata(), FileSystemReader(b).read_metadata()
    out = [f"metadata of {k}" for k in sorted(set(meta_a.state_dict_metadata) | set(meta_b.state_dict_metadata))
           if meta_a.state_dict_metadata.get(k) != meta_b.state_dict_metadata.get(k)]
    if meta_a.storage_data != meta_b.storage_data:
        out.append("storage_data")
    data = f"__{dist.get_rank()}_0.distcp"
    if Path(a, data).read_bytes() != Path(b, data).read_bytes():
        out.append(data)
    return out


def _our_save(root: str, record: Dict[str, Any]) -> Built:
    """save_checkpoint_async at step K (extra: a dict changed after the call), loaded with
    load_checkpoint. Returns the run that went on."""
    live = _built(0)
    _train(live, range(K))
    snapshot = _full(live)
    path = f"{root}/step_{K}"
    meta = {"step": K}
    live[0].gate.hold()
    pending = save_checkpoint_async(path, *live, extra=meta)
    _train(live, range(K, K + STEPS_DURING))
    meta["step"] += STEPS_DURING
    record["held_back"] = not pending.done() and not os.path.exists(path)
    record["timed_out"] = _result_times_out(pending, live[0].gate)
    live[0].gate.release()
    record["own_group"] = _thread_keeps_off_the_default_group(pending)
    _train(live, range(K + STEPS_DURING, K + STEPS_DURING + STEPS_AFTER))
    pending.result()
    record["staging_bytes"] = pending.staging_bytes
    record["published"] = sorted(os.listdir(path))
    resumed = _built(7)
    record["extra"] = load_checkpoint(path, *resumed)
    _judge(record, live, snapshot, resumed)
    return live


def _result_times_out(pending: AsyncSave, gate: "_Gate") -> bool:
    """``result(timeout=...)`` while the write is held back raises TimeoutError. One that waited
    for the whole write instead returns once a timer lets the write go (no hang): False."""
    releaser = threading.Timer(3.0, gate.release)
    releaser.start()
    try:
        pending.result(timeout=0.05)
    except TimeoutError:
        return True
    finally:
        releaser.cancel()
    return False


def _group_still_usable(group: dist.ProcessGroup) -> bool:
    """A collective on ``group`` works (it was not destroyed under its owner)."""
    try:
        flag = torch.ones(1)
        dist.all_reduce(flag, group=group)
        return flag.item() == WORLD_SIZE
    except (RuntimeError, ValueError):
        return False


def _thread_keeps_off_the_default_group(pending: AsyncSave) -> bool:
    """Called as the write is let go: rank 0 enters a collective on the default group at once,
    rank 1 only once its save has ended. A collective of the writing thread on the default
    group (its agreement, its verdict) would pair with rank 0's instead of rank 1's thread's:
    rank 1's save would never end (a hang, the harness's timeout). True if the ranks' values met."""
    if dist.get_rank() == 1:
        deadline = time.monotonic() + GATE_WAIT_S
        while not pending.done() and time.monotonic() < deadline:
            time.sleep(0.005)
    flag = torch.ones(1)
    dist.all_reduce(flag)
    return flag.item() == WORLD_SIZE


def _our_failed_save(root: str, record: Dict[str, Any], live: Built) -> None:
    """save_checkpoint_async whose write raises on one rank only (the one that writes the gate),
    on a process group of the caller's (torchtitan's way), which stays the caller's afterwards."""
    model = live[0]
    model.gate = _Gate(model.gate.step, fail=True)
    model.gate.hold()
    path = f"{root}/step_{K + 4}"
    group = dist.new_group(backend="gloo")
    pending = save_checkpoint_async(path, *live, process_group=group)
    model.gate.release()
    record["own_group"] = _thread_keeps_off_the_default_group(pending)
    try:
        pending.result()
        record["raised"] = ""
    except RuntimeError as e:
        record["raised"] = str(e)
    record["user_group_usable"] = _group_still_usable(group)
    if record["user_group_usable"]:
        dist.destroy_process_group(group)
    record["failed_here"] = bool(model.gate.failed)
    record["path_exists"] = os.path.exists(path)
    found = latest_checkpoint(root)
    record["latest"] = None if found is None else [found[0], os.path.basename(found[1])]


def _our_unstageable_save(root: str, record: Dict[str, Any], live: Built) -> None:
    """save_checkpoint_async whose staging copy fails on rank 1 only: every rank raises at the
    call, nothing was started (no directory; the ranks' next collectives pair up)."""
    model = live[0]
    model.gate = _Gate(model.gate.step, copy_fails=dist.get_rank() == 1)
    path = f"{root}/step_{K + 8}"
    try:
        save_checkpoint_async(path, *live)
        record["raised"] = ""
    except RuntimeError as e:
        record["raised"] = str(e)
    model.gate = _Gate(model.gate.step)
    record["written"] = sorted(name for name in os.listdir(root) if name.startswith(f"step_{K + 8}"))
    record["losses_agree"] = _losses_agree(live)


def _losses_agree(live: Built) -> bool:
    """One more step on every rank, its loss all-gathered: the ranks' collectives still pair up."""
    model, optim = live
    rank = dist.get_rank()
    inputs, targets = batch(100, WORLD_SIZE)
    loss = loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank))
    loss.backward()
    optim.step()
    optim.zero_grad()
    losses = [torch.zeros(()) for _ in range(WORLD_SIZE)]
    dist.all_gather(losses, loss.detach())
    return bool(torch.equal(losses[rank], loss.detach()))


def _our_unpublishable_save(root: str, record: Dict[str, Any], live: Built) -> None:
    """save_checkpoint_async whose publication fails on rank 0: while the write is held back a
    non-empty directory appears at ``path``, so the rename onto it fails (ENOTEMPTY)."""
    model = live[0]
    model.gate = _Gate(model.gate.step)
    model.gate.hold()
    path = f"{root}/step_{K + 6}"
    pending = save_checkpoint_async(path, *live)
    if dist.get_rank() == 0:
        os.makedirs(path)
        Path(path, "someone_elses.txt").write_text("not a checkpoint")
    dist.barrier()
    model.gate.release()
    try:
        pending.result()
        record["raised"] = ""
    except RuntimeError as e:
        record["raised"] = str(e)
    record["listing"] = sorted(os.listdir(path))


def _slices_staged_and_sent(record: Dict[str, Any]) -> None:
    """Two slices over one flat shard, one cut at row boundaries (``world_size``; a tensor of more
    than UNCUT_NUMEL elements), one of a tensor-parallel piece, staged by torch's stager as
    torchtitan configures it and then sent through ``multiprocessing``'s pickler (in this rank,
    a disposable process): what comes back must be the same slices (the same DCP write items),
    over copies (the live shard changes afterwards), the stager's copy one for both."""
    flat = torch.randn(300_000)
    live = {"cut": ShardedSlice(flat[50:200_050], 123, (1024, 512), world_size=4),
            "piece": ShardedSlice(flat[200_050:200_300], 7, (1024, 1024), world_size=2, piece=((0, 512), (1024, 512)))}
    values = {name: value.local.clone() for name, value in live.items()}
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=False,
                                          use_non_blocking_copy=False))
    staged = stager.stage(live)
    assert isinstance(staged, dict), type(staged)  # staged on this thread: the copy itself, not a future
    sent = pickle.loads(ForkingPickler.dumps(staged))
    flat.add_(1.0)  # training goes on
    problems = []
    for how, copies in (("staged", staged), ("sent", sent)):
        for name, value in live.items():
            copied = copies[name]
            if not isinstance(copied, ShardedSlice):
                problems.append(f"{how} {name}: a {type(copied).__name__}")
                continue
            if [copied.start, copied.world_size, copied.piece, copied.boxes, tuple(copied.shape)] != \
                    [value.start, value.world_size, value.piece, value.boxes, tuple(value.shape)]:
                problems.append(f"{how} {name}: another slice {copied!r}, not {value!r}")
            if copied.dcp_write_items(name) != value.dcp_write_items(name):
                problems.append(f"{how} {name}: other write items")
            if not torch.equal(copied.local, values[name]):
                problems.append(f"{how} {name}: not the elements at the call")
    if staged["cut"].local.untyped_storage().data_ptr() != staged["piece"].local.untyped_storage().data_ptr():
        problems.append("the stager copied the shard once per slice")
    stager.close()
    record["problems"] = problems


def _all_saves(root: str, out: str) -> None:
    records: Dict[str, Dict[str, Any]] = collections.defaultdict(dict)

    def guarded(name: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (Exception, CheckpointException):  # DCP's is a BaseException
            records[name]["error"] = traceback.format_exc()
            return None

    finish_process = guarded("dcp_process", lambda: _start_process_save(f"{root}/process", records["dcp_process"]))
    guarded("slices", lambda: _slices_staged_and_sent(records["slices"]))
    guarded("dcp_thread", lambda: _thread_save(f"{root}/thread", records["dcp_thread"]))
    live = guarded("ours", lambda: _our_save(f"{root}/ours", records["ours"]))
    if live is not None:
        records["ours"]["vs_reference"] = _vs_reference(live)  # before the saves below train on
        guarded("ours_failed", lambda: _our_failed_save(f"{root}/ours", records["ours_failed"], live))
        guarded("ours_unpublishable", lambda: _our_unpublishable_save(f"{root}/ours", records["ours_unpublishable"],
                                                                      live))
        guarded("ours_unstageable", lambda: _our_unstageable_save(f"{root}/ours", records["ours_unstageable"], live))
    if finish_process is not None:
        guarded("dcp_process", finish_process)
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(records))


def _vs_reference(live: Built) -> List[str]:
    """The run that went on during the save against single-process training on the combined batch."""
    torch.manual_seed(0)
    reference = _GatedModel()
    reference_training(reference, K + STEPS_DURING + STEPS_AFTER, WORLD_SIZE, lr=LR)
    params = {f"model.{k}": v for k, v in reference.state_dict().items() if k != "_extra_state"}
    ours = {k: v for k, v in _full(live).items() if k.startswith("model.")}
    return _differences(ours, params, atol=1e-5)


# ---------------------------------------------------------------------------- fixture and tests
Records = Dict[str, Dict[int, Dict[str, Any]]]  # save -> rank -> what it recorded


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Records:
    work = tmp_path_factory.mktemp("async_ckpt")
    out = work / "outcomes"
    out.mkdir()
    run_distributed(_all_saves, WORLD_SIZE, str(work), str(out), timeout=TIMEOUT_S)
    by_rank = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)}
    return {name: {r: by_rank[r].get(name, {}) for r in range(WORLD_SIZE)}
            for name in ("slices", "dcp_thread", "dcp_process", "ours", "ours_failed", "ours_unpublishable",
                         "ours_unstageable")}


def _no_error(records: Records, name: str) -> None:
    for rank, record in records[name].items():
        assert not record.get("error"), f"{name} raised on rank {rank}:\n{record['error']}"


def test_slices_keep_their_boxes_when_staged_and_sent_to_a_process(records: Records) -> None:
    """torch's stager (``new_empty`` + a copy of each attribute) and the process checkpointer's
    pickler give back the same ShardedSlice (range, row cut, tensor-parallel piece: the same
    DCP write items) over a copy of the elements at the call. The saves below use a model too
    small for row cuts and no tensor parallelism: a cut or piece lost on the way would save
    other boxes unnoticed there."""
    _no_error(records, "slices")
    for rank, record in records["slices"].items():
        assert record["problems"] == [], f"rank {rank}: {record['problems']}"


@pytest.mark.parametrize("name", ["dcp_thread", "dcp_process", "ours"])
def test_save_holds_the_state_of_its_step_and_resumes_exactly(records: Records, name: str) -> None:
    """The write was still held back after the steps taken during it; the checkpoint loads as
    the step-K snapshot (every parameter and optimizer tensor, bitwise; the extra state's step
    count K), and the resumed run equals the one that went on, bitwise. For dcp.async_save, the
    state dict handed to it still shows the live state afterwards (torchtitan saves the same
    dict again at the next interval)."""
    _no_error(records, name)
    for rank, record in records[name].items():
        assert record["held_back"] is True, f"{name}, rank {rank}: the write ended before the steps taken during it"
        assert record["snapshot_differences"] == [], f"{name}, rank {rank}: not the step-{K} state"
        assert record["loaded_step"] == K, f"{name}, rank {rank}: extra state {record['loaded_step']}"
        assert record["resume_differences"] == [], f"{name}, rank {rank}: the resumed run departs"
        if name != "ours":
            assert record["passed_dict"] == [], f"{name}, rank {rank}: the state dict saved no longer tracks the " \
                f"model: {record['passed_dict']}"


def test_async_save_writes_what_a_sync_save_writes_and_resumes_as_fsdp2(records: Records) -> None:
    """dcp.async_save of our state dict writes the synchronous save's metadata and data files
    byte for byte (so it loads anywhere the synchronous one does), and the resumed run's
    parameters and optimizer states equal torch's FSDP2 trained as long (atol 1e-5)."""
    _no_error(records, "dcp_thread")
    for rank, record in records["dcp_thread"].items():
        assert record["same_as_sync"] == [], f"rank {rank}: {record['same_as_sync']}"
        assert record["vs_fsdp2"] == [], f"rank {rank}: resumed unlike FSDP2: {record['vs_fsdp2']}"


def test_save_checkpoint_async_reports_its_staging_copy_and_publishes(records: Records) -> None:
    """``staging_bytes`` is the copy's size worked out by hand (parameters' shards once, AdamW's
    two moments and steps); ``result(timeout=...)`` raises TimeoutError while the write is held
    back; the published folder is save_checkpoint's (data, metadata,
    extra, checksums), ``extra`` is the dict as it was at the call, and the run that went on
    equals single-process training on the combined batch."""
    _no_error(records, "ours")
    for rank, record in records["ours"].items():
        assert record["staging_bytes"] == STAGING_BYTES[rank], f"rank {rank}"
        assert record["own_group"] is True, f"rank {rank}"
        assert record["timed_out"] is True, f"rank {rank}: result(timeout=0.05) did not raise while the write was held"
        assert record["published"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "checksums.json", "extra.pt"]
        assert record["extra"] == {"step": K}, f"rank {rank}: {record['extra']}"
        assert record["vs_reference"] == [], f"rank {rank}: {record['vs_reference']}"


def test_failed_background_write_publishes_nothing_and_raises_everywhere(records: Records) -> None:
    """A write that fails on rank 1 only: every rank's ``result()`` raises the same error,
    naming rank 1 and the cause; the folder does not exist, ``latest_checkpoint`` still
    finds the previous checkpoint, and the caller's process group the save wrote on is left
    to the caller."""
    _no_error(records, "ours_failed")
    failing = [rank for rank, record in records["ours_failed"].items() if record["failed_here"]]
    assert len(failing) == 1, f"the injected failure ran on ranks {failing}, not on one"
    messages = {record["raised"] for record in records["ours_failed"].values()}
    assert len(messages) == 1, f"the ranks raised different errors (or none): {messages}"
    message = messages.pop()
    assert message.startswith("save_checkpoint_async: writing ") and f"failed on rank {failing[0]} (OSError: {INJECTED})" \
        in message and message.endswith("nothing was published"), message
    for rank, record in records["ours_failed"].items():
        assert record["own_group"] is True, f"rank {rank}"
        assert record["user_group_usable"] is True, f"rank {rank}: result() destroyed the caller's process group"
        assert record["path_exists"] is False, f"rank {rank}: the failed save was published"
        assert record["latest"] == [K, f"step_{K}"], f"rank {rank}: {record['latest']}"


def test_failed_publication_raises_on_every_rank(records: Records) -> None:
    """Rank 0's rename fails (a directory appeared at ``path`` during the write): its verdict
    reaches every rank, each ``result()`` raising the same error, and the directory holds only
    what was there."""
    _no_error(records, "ours_unpublishable")
    messages = {record["raised"] for record in records["ours_unpublishable"].values()}
    assert len(messages) == 1, f"the ranks raised different errors (or none): {messages}"
    message = messages.pop()
    assert message.startswith("save_checkpoint_async: could not publish ") and "Directory not empty" in message, message
    for rank, record in records["ours_unpublishable"].items():
        assert record["listing"] == ["someone_elses.txt"], f"rank {rank}: {record['listing']}"


def test_failed_staging_raises_on_every_rank_at_the_call(records: Records) -> None:
    """The staging copy fails on rank 1 only (out of host memory): every rank raises the same
    error at the call, naming rank 1, before anything was written or any thread started; the
    ranks then go on training together."""
    _no_error(records, "ours_unstageable")
    messages = {record["raised"] for record in records["ours_unstageable"].values()}
    assert messages == {f"save_checkpoint_async: rank 1: {INJECTED_STAGING}"}, messages
    for rank, record in records["ours_unstageable"].items():
        assert record["written"] == [], f"rank {rank}: {record['written']}"
        assert record["losses_agree"] is True, f"rank {rank}"
