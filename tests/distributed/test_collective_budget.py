"""The communication and memory budget of one training step, as exact figures (issue 13).

For FULL_SHARD, SHARD_GRAD_OP and NO_SHARD (``fully_shard`` per block, then the root) and for
``replicate``, on a small model at W=2 (one process launch for all four), one steady-state step
(the third: lazy init, order recording and replicate's bucket rebuild are behind it) must:

- issue exactly the collectives BENCHMARK.md and API.md prescribe, counted per kind and per
  handle with their bytes (``record_collectives``): FULL_SHARD 2 all-gathers of a shard per
  block handle and 1 for the root's (kept unsharded from its forward to its backward: the root
  rule), 1 reduce-scatter of the padded unsharded gradient per handle; SHARD_GRAD_OP 1 all-gather
  per handle; NO_SHARD no all-gather and 1 all-reduce of the gradient per handle; replicate 1
  all-reduce of every gradient byte (one bucket: the model is far below any bucket cap); every
  API 1 small all-reduce agreeing on which parameters got a gradient (one int32 each);
- put exactly as many collective calls on the wire (``c10d`` ops seen by a dispatch mode) as
  those collectives take, each kind's count calibrated here on the library's own collective
  functions: a collective issued outside the instrumentation fails too;
- hold exactly the bytes per rank the design says, measured on every tensor alive in the
  process (a ``gc`` census of unique storages, so a buffer kept anywhere counts): at the step's
  start parameters (ceil(N/W) elements per handle when sharded) + AdamW's two moments of this
  rank's elements + the last agreement's result (its step verdict is read at the next synced
  backward) (+ replicate's gradient bucket); after backward that + the gradients (the
  shard, when sharded; replicate's gradients are views into its bucket);
- copy at most the bytes the design needs beyond the same step of the unwrapped model
  (``copy_``/``cat``/``clone``/... kernels seen by the dispatch mode, floating dtypes): per
  all-gather one shard (this rank's own chunk into the gathered buffer), per gradient
  reduction the flat gradient assembled from the per-parameter gradients and nothing around
  the collective (API.md: reduce-scatters read straight from the unsharded gradient buffer);
  replicate none. A ceiling, not an equality: removing a copy passes, adding one fails.

Every expected figure is computed in this file from the parameter shapes of an unwrapped copy
of the model and the module structure; nothing is read from the code under test. Figures
measured by ``benchmarks/run.py`` on the benchmark model rest on the same rules. Other tests
count collectives for one purpose each (test_fully_shard_runtime: FULL_SHARD per flat parameter
next to prefetch order; test_replicate: bucket bytes; test_activation_checkpointing: gathers
under recomputation); this one is the budget of a whole step for every strategy, in one launch.
"""

from __future__ import annotations

import gc
import math
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from composable_shard import ShardingStrategy, fully_shard, replicate
from composable_shard._runtime import collectives as _collectives
from composable_shard._runtime.collectives import record_collectives
from tests._harness import run_distributed, run_subtests

WORLD_SIZE = 2
F32 = 4
INT32 = 4
APIS = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "replicate"]
# Kernels that copy tensor data (the dispatch mode counts their floating-point output bytes).
COPY_OPS = {"copy_", "clone", "_to_copy", "cat", "stack", "index_copy_", "narrow_copy", "split_with_sizes_copy",
            "slice_scatter", "select_scatter", "as_strided_scatter", "_copy_from", "_copy_from_and_resize",
            "lift_fresh_copy", "unsafe_split_with_sizes_copy"}


class Net(nn.Module):
    """emb -> 2 blocks -> head. Block handles hold 199 elements (odd: padded to 200 at W=2), the
    root's (emb + head) 75 (padded to 76)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(5, 8)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 7), nn.ReLU(), nn.Linear(7, 8)) for _ in range(2)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _handle_numels() -> Dict[str, int]:
    """Elements per fully sharded module (handle), by FQN, from an unwrapped model's shapes:
    each block owns its subtree, the root what no block owns."""
    model = Net()
    numels = {f"blocks.{i}": sum(p.numel() for p in b.parameters()) for i, b in enumerate(model.blocks)}
    numels[""] = sum(p.numel() for p in model.parameters()) - sum(numels.values())
    return numels


def _rank_elements(numel: int, world_size: int, rank: int) -> int:
    """Real (unpadded) elements of a handle of ``numel`` that ``rank`` owns: chunk ``rank`` of
    the flat parameter padded to a multiple of ``world_size``."""
    chunk = math.ceil(numel / world_size)
    return max(0, min(chunk, numel - rank * chunk))


def _expected(api: str, rank: int, world_size: int) -> Dict[str, Any]:
    """Every figure of one steady-state step, from the shapes alone."""
    numels = _handle_numels()
    total = sum(numels.values())
    trainable_params = len(list(Net().parameters()))
    # one int32 per trainable original parameter, and two for the optimizer steps ([Note: Step agreement])
    used_params = [INT32 * (trainable_params + 2)]
    # its result, kept until the next synced backward reads the step verdict (on the CPU the all-reduced
    # tensor itself; [Note: No host reads in a step] in _base/host_mirror.py)
    verdict_bytes = INT32 * (trainable_params + 2)
    chunk = {fqn: math.ceil(n / world_size) for fqn, n in numels.items()}  # elements per rank
    if api == "replicate":
        return {
            "records": {"all_reduce": sorted([F32 * total] + used_params)},
            "per_handle": None,
            "param_bytes": F32 * total, "grad_bytes": F32 * total,
            "optim_bytes": 2 * F32 * total,
            "kept_bytes": F32 * total + verdict_bytes,  # the gradient bucket, alive between steps (as DDP's)
            "copy_bytes": 0,
        }
    if api == "NO_SHARD":
        gathers = {fqn: 0 for fqn in numels}
        reductions = {"all_reduce": sorted([F32 * n for n in numels.values()] + used_params)}
        param_bytes = F32 * total
        mine = total
        copy_bytes = F32 * total  # each handle's flat gradient assembled from its parameters' gradients
    else:
        per_step = 2 if api == "FULL_SHARD" else 1
        gathers = {fqn: (1 if fqn == "" else per_step) for fqn in numels}  # the root rule
        reductions = {"reduce_scatter": sorted(F32 * chunk[f] * world_size for f in numels),
                      "all_reduce": sorted(used_params)}
        param_bytes = F32 * sum(chunk.values())
        mine = sum(_rank_elements(n, world_size, rank) for n in numels.values())
        copy_bytes = (sum(gathers[f] * F32 * chunk[f] for f in numels)  # own chunk into the gathered buffer
                      + sum(F32 * chunk[f] * world_size for f in numels))  # flat (padded) gradient
    records = dict(reductions)
    gather_bytes = sorted(F32 * chunk[f] for f in numels for _ in range(gathers[f]))
    if gather_bytes:
        records["all_gather"] = gather_bytes
    return {
        "records": records,
        "per_handle": {"all_gather": {f: n for f, n in gathers.items() if n},
                       "reduce_scatter" if api != "NO_SHARD" else "all_reduce": {f: 1 for f in numels}},
        "param_bytes": param_bytes, "grad_bytes": param_bytes,
        "optim_bytes": 2 * F32 * mine, "kept_bytes": verdict_bytes, "copy_bytes": copy_bytes,
    }


# ---------------------------------------------------------------------------- measuring
class _Census(TorchDispatchMode):
    """Counts ``c10d`` ops (collectives and point-to-point calls on the wire, by name) and
    the bytes written by data-copying kernels of floating dtype, on this thread (CPU
    autograd runs backward on the calling thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.wire: Dict[str, int] = {}
        self.copy_bytes = 0
        self.copies: List[Tuple[str, Tuple[int, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.namespace == "c10d":
            if name != "barrier":
                self.wire[name] = self.wire.get(name, 0) + 1
        elif name in COPY_OPS:
            written = args[0] if name.endswith("_") else out
            if isinstance(written, torch.Tensor) and written.dtype.is_floating_point:
                self.copy_bytes += written.numel() * written.element_size()
                self.copies.append((name, tuple(written.shape)))
        return out


def _live_storages() -> Dict[int, int]:
    """``{storage pointer: bytes}`` of every tensor (of one or more dimensions) alive in this
    process that Python can reach."""
    gc.collect()
    live: Dict[int, int] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.dim() > 0:
            storage = obj.untyped_storage()
            if storage.nbytes():
                live[storage.data_ptr()] = storage.nbytes()
    return live


def _new_bytes(before: Dict[int, int]) -> int:
    return sum(n for ptr, n in _live_storages().items() if before.get(ptr) != n)


def _settled_new_bytes(before: Dict[int, int], expected: int) -> int:
    """``_new_bytes``, given gloo's worker threads up to 0.5 s to drop the tensors of finished
    collectives (see test_fully_shard_memory's ``_settled_live_bytes``); a buffer the library
    itself keeps does not go away by waiting."""
    got = _new_bytes(before)
    deadline = time.monotonic() + 0.5
    while got != expected and time.monotonic() < deadline:
        time.sleep(0.005)
        got = _new_bytes(before)
    return got


def _storage_bytes(tensors: List[Optional[torch.Tensor]]) -> int:
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(n for n in seen.values() if n)


def _wire_calls_per_collective() -> Dict[str, int]:
    """How many ``c10d`` calls one collective of each kind of the library takes on this
    backend and world size (its implementation may use collectives or point-to-point calls)."""
    world_size = dist.get_world_size()
    calls = {}
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        with _Census() as census:
            if kind == "all_gather":
                _collectives.all_gather_into(torch.empty(4 * world_size), torch.ones(4), None).wait()
            elif kind == "reduce_scatter":
                _collectives.reduce_scatter_into(torch.empty(4), torch.ones(4 * world_size), None).wait()
            else:
                _collectives.all_reduce(torch.ones(4), None).wait()
        calls[kind] = sum(census.wire.values())
    return calls


def _build(api: str) -> nn.Module:
    torch.manual_seed(0)
    model = Net()
    if api == "replicate":
        replicate(model)
    elif api != "local":
        strategy = ShardingStrategy[api]
        for block in model.blocks:
            fully_shard(block, strategy=strategy)
        fully_shard(model, strategy=strategy)
    return model


def _step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, after_backward: Any = None) -> None:
    model(x).square().mean().backward()
    if after_backward is not None:
        after_backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _measure(api: str, x: torch.Tensor, start_bytes: int = 0, after_backward_bytes: int = 0) -> Dict[str, Any]:
    """Build, two warm-up steps, then the measured step (the expected byte figures only bound
    how long the census waits for gloo to let go of finished collectives)."""
    before = _live_storages()
    model = _build(api)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        _step(model, optim, x)
    got: Dict[str, Any] = {"start_bytes": _settled_new_bytes(before, start_bytes)}

    def after_backward() -> None:
        got["param_bytes"] = _storage_bytes([p for p in model.parameters()])
        got["grad_bytes"] = _storage_bytes([p.grad for p in model.parameters()])
        got["after_backward_bytes"] = _settled_new_bytes(before, after_backward_bytes)

    with record_collectives() as rec, _Census() as census:
        _step(model, optim, x, after_backward)
    got["optim_bytes"] = sum(t.numel() * t.element_size() for s in optim.state.values() for t in s.values()
                             if isinstance(t, torch.Tensor) and t.dim() > 0)
    got["records"] = {}
    for r in rec.records:
        got["records"].setdefault(r.kind, []).append(r.nbytes)
    got["records"] = {k: sorted(v) for k, v in got["records"].items()}
    got["per_handle"] = {}
    for r in rec.records:
        got["per_handle"].setdefault(r.kind, {}).setdefault(r.tag, 0)
        got["per_handle"][r.kind][r.tag] += 1
    got["wire"], got["copy_bytes"], got["copies"] = census.wire, census.copy_bytes, census.copies
    return got  # the model and optimizer go with this frame (the next census collects first)


# ---------------------------------------------------------------------------- the checks
def _check(api: str, x: torch.Tensor, local_copy_bytes: int, wire_calls: Dict[str, int]) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    want = _expected(api, rank, world_size)
    start = want["param_bytes"] + want["optim_bytes"] + want["kept_bytes"]
    after = start + (0 if api == "replicate" else want["grad_bytes"])  # replicate's grads are bucket views
    got = _measure(api, x, start, after)
    where = f"[{api}, rank {rank}/{world_size}]"
    if want["per_handle"] is not None:  # first, so that a miss names the handle ("" is the root)
        for kind, per_handle in want["per_handle"].items():
            handles = got["per_handle"].get(kind, {})
            if kind == "all_reduce":  # NO_SHARD's reductions; the used-parameter all-reduce is no handle's
                handles = {tag: n for tag, n in handles.items() if tag in per_handle}
            assert handles == per_handle, f"{where} {kind}s per handle (FQN: count): got {handles}, expected {per_handle}"
    assert got["records"] == want["records"], (
        f"{where} collectives of one step (kind: sorted bytes per call): got {got['records']}, "
        f"expected {want['records']}")
    calls = sum(got["wire"].values())
    expected_calls = sum(wire_calls[kind] * len(sizes) for kind, sizes in want["records"].items())
    assert calls == expected_calls, (
        f"{where} {calls} c10d calls on the wire ({got['wire']}), expected {expected_calls} for the recorded "
        f"collectives {dict((k, len(v)) for k, v in want['records'].items())} at {wire_calls} calls each: "
        "a collective issued outside composable_shard._runtime.collectives?")
    for what in ("param_bytes", "grad_bytes", "optim_bytes"):
        assert got[what] == want[what], f"{where} {what} per rank: got {got[what]:,}, expected {want[what]:,}"
    assert got["start_bytes"] == start, (
        f"{where} tensor bytes alive at the step's start: got {got['start_bytes']:,}, expected {start:,} = "
        f"parameters {want['param_bytes']:,} + AdamW {want['optim_bytes']:,} + kept {want['kept_bytes']:,}")
    assert got["after_backward_bytes"] == after, (
        f"{where} tensor bytes alive after backward: got {got['after_backward_bytes']:,}, expected {after:,} "
        f"(the step's start + gradients)")
    budget = local_copy_bytes + want["copy_bytes"]
    assert got["copy_bytes"] <= budget, (
        f"{where} {got['copy_bytes']:,} B copied in one step, more than the {budget:,} B budget "
        f"(unwrapped model {local_copy_bytes:,} + design {want['copy_bytes']:,}): {got['copies']}")


def _rank_budget() -> None:
    assert dist.get_world_size() == WORLD_SIZE
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(dist.get_rank()))
    gc.collect()
    gc.freeze()  # what exists now is out of every census and every collection: censuses take milliseconds
    try:
        wire_calls = _wire_calls_per_collective()
        total = F32 * sum(_handle_numels().values())
        local = _measure("local", x, 3 * total, 4 * total)  # parameters + AdamW (+ gradients)
        assert local["wire"] == {} and local["records"] == {}, local
        # The census itself, on the unwrapped model: exactly parameters + AdamW state (+ gradients).
        assert (local["start_bytes"], local["after_backward_bytes"]) == (3 * total, 4 * total), local
        run_subtests(_check, {"api": APIS}, x=x, local_copy_bytes=local["copy_bytes"], wire_calls=wire_calls)
    finally:
        gc.unfreeze()


def test_collectives_bytes_and_copies_of_one_step() -> None:
    """Exact collective counts and bytes per kind and handle (root: 1 all-gather), c10d calls on
    the wire, bytes alive per rank, and a ceiling on copied bytes, for FULL_SHARD,
    SHARD_GRAD_OP, NO_SHARD and replicate at W=2. Without it, an extra all-gather (say, the root
    resharded after forward), a collective issued around the instrumentation, a buffer kept
    between steps or an added copy around a collective would pass every other test."""
    run_distributed(_rank_budget, WORLD_SIZE, timeout=60)
