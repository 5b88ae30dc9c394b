"""``fully_shard`` over tensor-parallel (``DTensor``) modules at W = 4 on a 2 (data-parallel) x 2
(tensor-parallel) mesh (and at W = 8 with two tensor-parallel dimensions): each handle flattens the local pieces and shards them over the
data-parallel group; the modules compute on ``DTensor`` views with their placements. Every number
is compared with one process on the combined batch and with torch's FSDP2 + TP in the same script.
Before (main until issue 46): ``fully_shard`` refused ``DTensor`` parameters (and before that
failed inside torch with "aten.cat.default got mixed torch.Tensor and DTensor").

- Column-/row-wise blocks next to plain norms and a plain head, AdamW, a step accumulated over
  two micro-batches without sync, clipping (ours and torch's: the norm over dp x tp, each element
  once): losses, norms, full parameters and full optimizer state equal one process and FSDP2.
  Each rank holds ceil(local N / 2) elements per handle, and its reduce-scatters carry the
  pieces, not the global tensors.
- Sharded state dicts describe each rank's elements as boxes in global coordinates (a
  data-parallel slice of a row-wise piece is not one range): each box's values are the full
  tensor's at those coordinates. Checkpoints round-trip, load at dp 4 x tp 1, at dp 1 x tp 4 and
  into a plain model on every rank, and back from dp 4 into dp 2 x tp 2, optimizer state included
  (the next step is the same); through torch's state-dict API and ``dcp``, ours load into FSDP2 +
  TP and FSDP2 + TP's into ours.
- torchtitan's sequence-parallel plan with loss parallel, under MixedPrecision (bf16 compute,
  fp32 reduce) and in fp32: equal to FSDP2 + TP under the same settings (and fp32 to one process);
  HYBRID_SHARD on a 2-D dp mesh, a checkpointed block, a frozen tensor-parallel layer beside
  uneven pieces (12 and 11 of 23), and a Hugging Face Llama parallelized with its config's
  ``base_model_tp_plan``: equal to one process.
- ``unshard_params`` shows each tensor-parallel parameter as FSDP2's ``unshard()`` does (a
  ``DTensor`` parameter with the same placements, mesh and local piece), beside ``replicate``'s
  own ``DTensor``s; a no_grad forward inside it equals one process.
- Two tp mesh dimensions (dp 2 x tp (2 x 2), 8 ranks): pieces split twice along one tensor
  dimension (even and uneven), along two, and by one of the two; training, the sharded state
  dict's boxes (worked out by hand, each element once per replica), loads of a full and of a
  dcp-read sharded state dict, and ``unshard_params`` (DTensors with their placements, global
  norms, an edit written back, writeback=False, rank0_only, with_grads) equal one process.
- Refusals (a Partial placement, a piece that is not its placements' split, a group sharing ranks
  with the tp mesh) are ``test_tensor_parallel.py``'s.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               loss_parallel, parallelize_module)

from composable_shard import (MixedPrecision, clip_grad_norm_, describe, fully_shard, get_model_state_dict, replicate,
                              get_optimizer_state_dict, load_checkpoint, save_checkpoint, set_model_state_dict,
                              unshard_params)
from composable_shard._runtime import collectives as _collectives
from composable_shard._runtime.traversal import _get_fsdp_states
from composable_shard._state import load_transaction
from composable_shard._state.sharded_slice import ShardedSlice
from tests._harness import run_distributed
from tests._models import zip_same
from tests.distributed.test_tensor_parallel import _assert_full_equal  # keys, plain tensors, 1e-5

DP, TP = 2, 2
ROWS_PER_RANK = 6  # 12 rows: whole rows for dp 1, 2 and 4
MAX_NORM = 0.5


class _Block(nn.Module):
    """Registered so that the handle's flat order is up (pieces of 96 + 12), down (96 + 8), norm
    (8 + 8): 228 elements, 114 per data-parallel rank, so the row-wise ``down.weight`` piece
    (8 x 12 of 8 x 24) is split in the middle of its first row."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 24)
        self.down = nn.Linear(24, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(2)])
        self.head = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _plain_net(uneven_frozen: bool = False) -> _Net:
    """``uneven_frozen``: the second block's hidden width 23 (tensor-parallel pieces of 12 and 11
    rows/columns), the first block's ``up`` frozen."""
    torch.manual_seed(0)
    model = _Net()
    if uneven_frozen:
        model.blocks[1].up, model.blocks[1].down = nn.Linear(8, 23), nn.Linear(23, 8)
        model.blocks[0].up.requires_grad_(False)
    return model


def _tp_net(tp_mesh: DeviceMesh, uneven_frozen: bool = False) -> _Net:
    model = _plain_net(uneven_frozen)
    for i, block in enumerate(model.blocks):
        if uneven_frozen and i == 1:  # TP's own hooks infer an even split between the two: replicate in between
            plan = {"up": ColwiseParallel(output_layouts=Replicate()), "down": RowwiseParallel(input_layouts=Replicate())}
        else:
            plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        parallelize_module(block, tp_mesh, plan)
    return model


def _batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(DP * ROWS_PER_RANK, 8, generator=generator), torch.randn(DP * ROWS_PER_RANK, 6, generator=generator)


def _train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int, dp_rank: int, dp_size: int,
                clip: Callable[[nn.Module], torch.Tensor], micro: bool = False) -> Tuple[float, float]:
    """One step on this data-parallel rank's rows of the combined batch; ``micro``: two
    micro-batches, the first without gradient sync. Returns (the batch's mean loss, the norm
    before clipping)."""
    x, y = _batch(step)
    rows = DP * ROWS_PER_RANK // dp_size
    x, y = x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows]
    if micro:
        model.set_requires_gradient_sync(False)
        (nn.functional.mse_loss(model(x[:1]), y[:1]) / rows).backward()
        model.set_requires_gradient_sync(True)
        loss = nn.functional.mse_loss(model(x[1:]), y[1:]) * (rows - 1) / rows
        loss.backward()
        loss = loss.detach()  # not the batch's mean: the step is compared by its norm and parameters
    else:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
    norm = clip(model)
    optim.step()
    optim.zero_grad()
    mean = loss.detach().clone()
    if dp_size > 1:
        dist.all_reduce(mean)  # every rank of a tensor-parallel group holds the same loss
        mean /= dist.get_world_size()
    return mean.item(), norm.item()


def _reference_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> Tuple[float, float]:
    x, y = _batch(step)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optim.step()
    optim.zero_grad()
    return loss.item(), norm.item()


def _ours_clip(model: nn.Module) -> torch.Tensor:
    return clip_grad_norm_(model, MAX_NORM)


def _torch_clip(model: nn.Module) -> torch.Tensor:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _fsdp2_clip(model: nn.Module) -> torch.Tensor:
    """FSDP2 + TP's clipping as torchtitan does it: torch's ``clip_grad_norm_`` refuses gradients on
    two meshes (dp for plain parameters, dp x tp for the pieces), so the norm is taken per mesh."""
    by_mesh: Dict[Any, List[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh, []).append(p.grad)
    squares = [torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).full_tensor() ** 2
               for grads in by_mesh.values()]
    total = torch.stack(squares).sum().sqrt()
    coef = min(1.0, MAX_NORM / (total.item() + 1e-6))
    for grads in by_mesh.values():
        for g in grads:
            g.mul_(coef)
    return total


def _full_optim_state(model: nn.Module, optim: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    state = get_optimizer_state_dict(model, optim)["state"]
    return {f"{fqn}.{name}": v for fqn, entry in state.items() for name, v in entry.items() if name != "step"}


def _reference_optim_state(model: nn.Module, optim: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {f"{names[id(p)]}.{name}": v for p, entry in optim.state.items() for name, v in entry.items() if name != "step"}


def _fully_shard_tp(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, uneven_frozen: bool = False, **kwargs: Any) -> _Net:
    model = _tp_net(tp_mesh, uneven_frozen)
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, **kwargs)
    fully_shard(model, mesh=dp_mesh, **kwargs)
    return model


def _fsdp2_tp(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> _Net:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference only

    model = _tp_net(tp_mesh)
    for block in model.blocks:
        torch_fully_shard(block, mesh=dp_mesh)
    torch_fully_shard(model, mesh=dp_mesh)
    return model


def _check_boxes(sharded: Dict[str, Any], full: Dict[str, torch.Tensor]) -> int:
    """Each ShardedSlice box's values are the full tensor's at its global coordinates; returns
    how many boxes were checked."""
    count = 0
    for key, value in sharded.items():
        assert isinstance(value, ShardedSlice), (key, type(value))
        assert value.shape == full[key].shape, (key, value.shape, full[key].shape)
        for offsets, sizes, flat in value.boxes:
            index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
            mine = value.local[flat - value.start:flat - value.start + math.prod(sizes)]
            torch.testing.assert_close(mine, full[key][index].reshape(-1), atol=0, rtol=0,
                                       msg=lambda m: f"{key} box {offsets} {sizes}: {m}")
            count += 1
    return count


def _unshard_params_against_fsdp2(model: _Net, fsdp2: _Net, reference: _Net) -> None:
    """Inside unshard_params each parameter is what FSDP2's unshard() shows: a tensor-parallel one a
    DTensor parameter with the same placements, mesh and local piece, a plain one the full tensor;
    a no_grad forward inside the context (evaluation, generate()) computes what one process does.
    (Before: a plain tensor of this rank's piece, so p.norm() or an EMA saw one tp rank's piece and
    the forward raised "mixed torch.Tensor and DTensor".)"""
    fsdp2_modules = [*fsdp2.blocks, fsdp2]
    for module in fsdp2_modules:
        module.unshard()  # type: ignore[operator]  # an FSDPModule method
    with unshard_params(model, writeback=False):
        for (name, ours), (their_name, theirs) in zip_same(list(model.named_parameters()), list(fsdp2.named_parameters()),
                                                          what="parameters inside unshard_params / FSDP2 unshard()"):
            assert name == their_name and type(ours) is type(theirs), (name, their_name, type(ours), type(theirs))
            if isinstance(theirs, DTensor):
                assert (ours.placements, ours.device_mesh, ours.shape) == (theirs.placements, theirs.device_mesh, theirs.shape)
                ours, theirs = ours.to_local(), theirs.to_local()
            torch.testing.assert_close(ours.detach(), theirs.detach(), atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
        x = _batch(0)[0]
        with torch.no_grad():
            torch.testing.assert_close(model(x), reference(x), atol=1e-5, rtol=0)
    for module in fsdp2_modules:
        module.reshard()  # type: ignore[operator]
    assert all(type(p) is nn.Parameter and p.dim() == 1 for p in model.parameters())  # plain 1-D slices again


def _train_and_checkpoint(directory: str) -> None:
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    model = _fully_shard_tp(mesh["dp"], mesh["tp"])
    fsdp2 = _fsdp2_tp(mesh["dp"], mesh["tp"])
    reference = _plain_net()

    # bytes per rank: each handle holds ceil(local N / dp) elements of the pieces
    tp_params = dict(_tp_net(mesh["tp"]).named_parameters())
    tp_local = {n: (p.to_local() if isinstance(p, DTensor) else p).numel() for n, p in tp_params.items()}
    tp_sharded = {n for n, p in tp_params.items() if isinstance(p, DTensor) and p.placements[0].is_shard()}
    handles = {"blocks.0.": model.blocks[0], "blocks.1.": model.blocks[1], "head.": model}
    for prefix, module in handles.items():
        local_n = sum(v for n, v in tp_local.items() if n.startswith(prefix))
        fp = next(s.handle for s in _get_fsdp_states(model) if s.module is module).flat_param
        assert fp.numel() == -(-local_n // DP), (prefix, fp.numel(), local_n)
    assert all(type(p) is nn.Parameter and p.dim() == 1 for p in model.parameters())  # idle: plain 1-D slices
    described = describe(model)
    assert [r.shard_numel for r in described.rows] == [-(-sum(v for n, v in tp_local.items() if n.startswith(p)) // DP)
                                                       for p in ("head.", "blocks.0.", "blocks.1.")], described.rows
    tp_rank = mesh["tp"].get_local_rank()
    assert (f"blocks.1.down.weight: (8, 24), Shard(dim=1) on ('tp',) -> this rank's piece (8, 12) at (0, {12 * tp_rank})"
            in described.tensor_parallel and len(described.tensor_parallel) == 8), described.tensor_parallel

    optims = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model, fsdp2, reference)]
    for step in range(4):
        clip = _ours_clip if step % 2 == 0 else _torch_clip
        with _collectives.record_collectives() as rec:
            ours = _train_step(model, optims[0], step, dp_rank, DP, clip, micro=step == 1)
        theirs = _train_step(fsdp2, optims[1], step, dp_rank, DP, _fsdp2_clip, micro=step == 1)
        single = _reference_step(reference, optims[2], step)
        assert single[1] > MAX_NORM, single  # the clipping changed the step
        assert abs(ours[1] - single[1]) <= 1e-5 and abs(ours[1] - theirs[1]) <= 1e-5, (step, ours, theirs, single)
        if step != 1:
            assert abs(ours[0] - single[0]) <= 1e-5 and abs(ours[0] - theirs[0]) <= 1e-5, (step, ours, theirs, single)
        scattered = sum(r.nbytes for r in rec.records if r.kind == "reduce_scatter")
        assert scattered == 4 * sum(-(-sum(v for n, v in tp_local.items() if n.startswith(p)) // DP) * DP
                                    for p in handles), (step, scattered)  # the pieces, padded, fp32
    full = get_model_state_dict(model)
    _assert_full_equal(full, reference.state_dict(), "parameters after 4 steps")
    on_rank0 = get_model_state_dict(model, rank0_only=True)  # the other ranks still join their pieces for rank 0
    _assert_full_equal(on_rank0, full if dist.get_rank() == 0 else {}, "rank0_only")
    _assert_full_equal(full, {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in fsdp2.state_dict().items()},
                        "parameters against FSDP2 + TP")
    _unshard_params_against_fsdp2(model, fsdp2, reference)
    _assert_full_equal(_full_optim_state(model, optims[0]), _reference_optim_state(reference, optims[2]),
                        "AdamW state after 4 steps")

    sharded = get_model_state_dict(model, full=False)
    boxes = _check_boxes(sharded, full)
    down = sharded["blocks.0.down.weight"]  # (8, 24) row-wise: this rank's piece is columns [12 tp, 12 tp + 12),
    # its flattened elements [0, 6) on dp rank 0, [6, 96) on dp rank 1
    expected = ([((0, 12 * tp_rank), (1, 6))] if dp_rank == 0 else
                [((0, 12 * tp_rank + 6), (1, 6)), ((1, 12 * tp_rank), (7, 12))])
    assert [(b[0], b[1]) for b in down.boxes] == expected, down.boxes
    assert boxes > 0
    # a slice of another rank's piece (the other tp rank's columns) is refused in memory, naming the key
    other = ShardedSlice(down.local, down.start, down.shape, down.world_size,
                         ((0, 12 * (1 - tp_rank)), tuple(down.piece[1])))  # type: ignore[index]  # a piece
    try:
        set_model_state_dict(model, {**sharded, "blocks.0.down.weight": other})
    except RuntimeError as error:  # torch's loader gathers the hooks' errors
        assert "blocks.0.down.weight: the ShardedSlice holds a range of the tensor-parallel piece" in str(error), error
    else:
        raise AssertionError("a slice of another tensor-parallel piece was loaded as this rank's")
    _assert_full_equal(get_model_state_dict(model), full, "after the refused load")
    covered: List[Dict[str, int]] = [{}] * dist.get_world_size()  # every element on exactly one rank's boxes
    dist.all_gather_object(covered, {k: sum(math.prod(b[1]) for b in v.boxes) for k, v in sharded.items()})
    copies = {k: 1 if k in tp_sharded else TP for k in full}  # a tensor replicated over tp: once per tp rank
    assert {k: sum(c[k] for c in covered) for k in sharded} == {k: v.numel() * copies[k] for k, v in full.items()}, covered

    # checkpoints: round trip, then dp 4 x tp 1, dp 1 x tp 4, a plain model, and back
    path = os.path.join(directory, "dp2_tp2")
    save_checkpoint(path, model, optims[0])
    if dist.get_rank() == 0:  # for the single-process load in the test's own process
        torch.save(full, os.path.join(directory, "dp2_tp2_full.pt"))
    _train_step(model, optims[0], 4, dp_rank, DP, _ours_clip)
    load_checkpoint(path, model, optims[0])
    _assert_full_equal(get_model_state_dict(model), full, "after load_checkpoint")
    step5 = _train_step(model, optims[0], 4, dp_rank, DP, _ours_clip)
    single5 = _reference_step(reference, optims[2], 4)
    assert all(abs(a - b) <= 1e-5 for a, b in zip(step5, single5)), (step5, single5)  # the moments came back too
    after5 = get_model_state_dict(model)

    def fail(api: str) -> None:  # a load failing on one rank after writing: every shard and moment restored
        if dist.get_rank() == 3:
            raise RuntimeError("injected failure")

    moments = _full_optim_state(model, optims[0])
    load_transaction.before_final_agreement = fail
    try:
        load_checkpoint(path, model, optims[0])
    except RuntimeError as error:
        assert "injected failure" in str(error), error
    else:
        raise AssertionError("the injected failure did not raise")
    finally:
        load_transaction.before_final_agreement = None
    _assert_full_equal(get_model_state_dict(model), after5, "after a failed load")
    _assert_full_equal(_full_optim_state(model, optims[0]), moments, "AdamW state after a failed load")

    wide = init_device_mesh("cpu", (DP * TP,), mesh_dim_names=("dp",))
    dp4 = _plain_net()
    fully_shard(dp4, mesh=wide)
    dp4_optim = torch.optim.AdamW(dp4.parameters(), lr=0.01)
    load_checkpoint(path, dp4, dp4_optim)
    _assert_full_equal(get_model_state_dict(dp4), full, "loaded at dp 4 x tp 1")
    assert abs(_train_step(dp4, dp4_optim, 4, dist.get_rank(), DP * TP, _ours_clip)[1] - step5[1]) <= 1e-5
    _assert_full_equal(get_model_state_dict(dp4), after5, "dp 4 x tp 1: the step after the load")

    narrow = init_device_mesh("cpu", (1, DP * TP), mesh_dim_names=("dp", "tp"))
    tp4 = _fully_shard_tp(narrow["dp"], narrow["tp"])
    tp4_optim = torch.optim.AdamW(tp4.parameters(), lr=0.01)
    load_checkpoint(path, tp4, tp4_optim)
    _assert_full_equal(get_model_state_dict(tp4), full, "loaded at dp 1 x tp 4")
    _train_step(tp4, tp4_optim, 4, 0, 1, _ours_clip)
    _assert_full_equal(get_model_state_dict(tp4), after5, "dp 1 x tp 4: the step after the load")

    plain = _plain_net()
    plain_optim = torch.optim.AdamW(plain.parameters(), lr=0.01)
    load_checkpoint(path, plain, plain_optim)
    _assert_full_equal(plain.state_dict(), full, "loaded into a plain model")

    back = os.path.join(directory, "dp4")
    save_checkpoint(back, dp4, dp4_optim)
    load_checkpoint(back, model, optims[0])
    _assert_full_equal(get_model_state_dict(model), after5, "dp 4 back into dp 2 x tp 2")
    mine, theirs = _train_step(model, optims[0], 5, dp_rank, DP, _ours_clip), _reference_step(reference, optims[2], 5)
    assert all(abs(a - b) <= 1e-5 for a, b in zip(mine, theirs)), (mine, theirs)
    _assert_full_equal(get_model_state_dict(model), reference.state_dict(), "the step after loading back")

    # torch's state-dict API and dcp: ours -> FSDP2 + TP, and FSDP2 + TP's -> ours
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict as torch_set

    ours_now = get_model_state_dict(model)
    dcp.save({"model": get_state_dict(model, optims[0])[0]}, checkpoint_id=os.path.join(directory, "torch_api_ours"))
    into_fsdp2 = get_state_dict(fsdp2, optims[1])[0]
    dcp.load({"model": into_fsdp2}, checkpoint_id=os.path.join(directory, "torch_api_ours"))
    torch_set(fsdp2, into_fsdp2)
    fsdp2_full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in fsdp2.state_dict().items()}
    _assert_full_equal(fsdp2_full, ours_now, "ours into FSDP2 + TP through torch's API")
    _train_step(fsdp2, optims[1], 7, dp_rank, DP, _fsdp2_clip)  # FSDP2 + TP moves on; its checkpoint comes back
    fsdp2_full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in fsdp2.state_dict().items()}
    dcp.save({"model": get_state_dict(fsdp2, optims[1])[0]}, checkpoint_id=os.path.join(directory, "torch_api_fsdp2"))
    into_ours = get_state_dict(model, optims[0])[0]
    dcp.load({"model": into_ours}, checkpoint_id=os.path.join(directory, "torch_api_fsdp2"))
    torch_set(model, into_ours)
    _assert_full_equal(get_model_state_dict(model), fsdp2_full, "FSDP2 + TP's into ours through torch's API")

    set_model_state_dict(model, _plain_net().state_dict())  # a plain model's full state dict loads in
    _assert_full_equal(get_model_state_dict(model), _plain_net().state_dict(), "after set_model_state_dict")


def test_fully_shard_over_tensor_parallel_blocks_trains_and_checkpoints_exactly(tmp_path: Any) -> None:
    run_distributed(_train_and_checkpoint, DP * TP, str(tmp_path), timeout=240)
    plain = _plain_net()  # this process: no process group, one plain model
    with warnings.catch_warnings():  # DCP's note that it loads in one process: what is meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_checkpoint(str(tmp_path / "dp2_tp2"), plain)
    _assert_full_equal(plain.state_dict(), torch.load(str(tmp_path / "dp2_tp2_full.pt")), "one process, no group")


class _FeedForwardBlock(nn.Module):
    """torchtitan's block layout: a norm, then a feed-forward submodule (``ffn.0`` up, ``ffn.2`` down)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.ffn = nn.Sequential(nn.Linear(8, 24), nn.ReLU(), nn.Linear(24, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(self.norm(x))


def _feed_forward_net() -> _Net:
    torch.manual_seed(0)
    model = _Net()
    model.blocks = nn.ModuleList([_FeedForwardBlock() for _ in range(2)])
    return model


def _sequence_parallel_net(mesh: DeviceMesh, how: str, mixed: bool) -> _Net:
    """torchtitan's plan on the blocks: the norms ``SequenceParallel`` (their gradients are Partial
    sums over tp), ``PrepareModuleInput`` gathering the feed-forward's input from the sequence shards,
    its up column-wise and down row-wise back to the shards; the head column-wise from the shards to
    class shards for loss parallel; ``how``: fully sharded by us or FSDP2."""
    model = _feed_forward_net()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {
            "norm": SequenceParallel(),
            "ffn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "ffn.0": ColwiseParallel(), "ffn.2": RowwiseParallel(output_layouts=Shard(1))})
    parallelize_module(model.head, mesh["tp"], ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                                               use_local_output=False))
    if how == "ours":
        policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"], mixed_precision=policy)
        fully_shard(model, mesh=mesh["dp"], mixed_precision=policy)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard as torch_fully_shard  # the reference only

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
        for block in model.blocks:
            torch_fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
        torch_fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    return model


def _sequence_parallel_batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(200 + step)
    return torch.randn(DP * 2, 4, 8, generator=generator), torch.randint(0, 6, (DP * 2, 4), generator=generator)


def _sequence_parallel_and_loss_parallel() -> None:
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    reference = _feed_forward_net()
    reference_optim = torch.optim.AdamW(reference.parameters(), lr=0.01)
    runs: Dict[Tuple[str, bool], List[Tuple[float, float]]] = {}
    finals: Dict[Tuple[str, bool], Dict[str, torch.Tensor]] = {}
    for mixed in (False, True):
        for how in ("ours", "fsdp2"):
            model = _sequence_parallel_net(mesh, how, mixed)
            optim = torch.optim.AdamW(model.parameters(), lr=0.01)
            history = runs[(how, mixed)] = []
            for step in range(3):
                x, y = _sequence_parallel_batch(step)
                rows, cols = slice(dp_rank * 2, dp_rank * 2 + 2), slice(tp_rank * 2, tp_rank * 2 + 2)
                with loss_parallel():  # class-sharded logits: cross-entropy without gathering them
                    logits = model(x[rows, cols])
                    assert isinstance(logits, DTensor) and logits.placements == (Shard(2),), logits
                    loss = nn.functional.cross_entropy(logits.flatten(0, 1), y[rows].flatten())
                    loss.backward()
                norm = _ours_clip(model) if how == "ours" else _fsdp2_clip(model)
                optim.step()
                optim.zero_grad()
                mean = loss.full_tensor() if isinstance(loss, DTensor) else loss
                mean = mean.detach().float().clone()
                dist.all_reduce(mean)
                history.append((mean.item() / dist.get_world_size(), float(norm)))
            finals[(how, mixed)] = {k: (v.full_tensor() if isinstance(v, DTensor) else v).float()
                                    for k, v in (get_model_state_dict(model) if how == "ours" else model.state_dict()).items()}
    for step in range(3):
        x, y = _sequence_parallel_batch(step)
        loss = nn.functional.cross_entropy(reference(x).flatten(0, 1), y.flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        reference_optim.step()
        reference_optim.zero_grad()
        assert norm.item() > MAX_NORM
        for how in ("ours", "fsdp2"):
            got = runs[(how, False)][step]
            assert abs(got[0] - loss.item()) <= 1e-5 and abs(got[1] - norm.item()) <= 1e-5, (how, step, got, loss, norm)
    _assert_full_equal(finals[("ours", False)], reference.state_dict(), "sequence/loss parallel, fp32")
    # bf16 compute, fp32 reduction: the same numbers as FSDP2 + TP under the same policy
    assert all(abs(a - b) <= 1e-5 for ours, theirs in zip(runs[("ours", True)], runs[("fsdp2", True)])
               for a, b in zip(ours, theirs)), (runs[("ours", True)], runs[("fsdp2", True)])
    _assert_full_equal(finals[("ours", True)], finals[("fsdp2", True)], "sequence/loss parallel, bf16 against FSDP2")
    assert any((finals[("ours", True)][k] - finals[("ours", False)][k]).abs().max() > 1e-4 for k in finals[("ours", True)])


def _hf_llama() -> None:
    """A tiny Hugging Face Llama parallelized with its config's ``base_model_tp_plan`` (q/k/v, gate
    and up column-wise, o and down row-wise), each decoder layer and the root fully sharded over dp
    (SGD, 3 steps; one process on the combined batch)."""
    import transformers

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(transformers.LlamaForCausalLM(config))
    model, reference = models
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    assert set(config.base_model_tp_plan.values()) <= set(styles), config.base_model_tp_plan
    parallelize_module(model.model, mesh["tp"], {k: styles[v]() for k, v in config.base_model_tp_plan.items()})
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        ids = torch.randint(0, 64, (DP * 2, 12), generator=torch.Generator().manual_seed(300 + step))
        mine = ids[dp_rank * 2:dp_rank * 2 + 2]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        norm = _ours_clip(model)
        optim.step()
        optim.zero_grad()
        reference_loss = reference(input_ids=ids, labels=ids).loss
        reference_loss.backward()
        reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        reference_optim.step()
        reference_optim.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # equal rows per rank and per row: the mean of the means
        assert abs(mean.item() / dist.get_world_size() - reference_loss.item()) <= 1e-5, (step, mean, reference_loss)
        assert abs(norm.item() - reference_norm.item()) <= 1e-5, (step, norm, reference_norm)
    _assert_full_equal(get_model_state_dict(model), reference.state_dict(), "Llama: after 3 steps")


def _hybrid_and_checkpointed() -> None:
    """The pieces under HYBRID_SHARD on a (replicate 2, shard 1) dp mesh beside a tp mesh of 2 (a
    3-D mesh); with a checkpointed fully sharded block beside a replicated one; and with a
    frozen tensor-parallel layer and uneven pieces (12 and 11 of 23): 3 clipped AdamW steps equal
    one process."""
    from composable_shard import ShardingStrategy, checkpoint

    for how in ("hybrid", "checkpointed", "uneven_frozen"):  # "checkpointed" mixes all three APIs
        if how == "hybrid":
            mesh = init_device_mesh("cpu", (DP, 1, TP), mesh_dim_names=("rep", "shard", "tp"))
            model = _fully_shard_tp(mesh["rep", "shard"], mesh["tp"], strategy=ShardingStrategy.HYBRID_SHARD)
            dp_rank = mesh["rep"].get_local_rank()
        elif how == "checkpointed":
            mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
            model = _tp_net(mesh["tp"])
            checkpoint(model.blocks[0])
            fully_shard(model.blocks[0], mesh=mesh["dp"])
            replicate(model.blocks[1], process_group=mesh["dp"].get_group())  # its DTensors stay DTensors
            fully_shard(model, mesh=mesh["dp"])
            dp_rank = mesh["dp"].get_local_rank()
        else:
            mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
            model = _fully_shard_tp(mesh["dp"], mesh["tp"], uneven_frozen=True)
            dp_rank = mesh["dp"].get_local_rank()
            up = [p for n, p in model.named_parameters() if n.startswith("blocks.0.up.")]
            assert len(up) == 2 and not any(p.requires_grad for p in up)
        reference = _plain_net(how == "uneven_frozen")
        optim, reference_optim = (torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model, reference))
        for step in range(3):
            ours, single = _train_step(model, optim, step, dp_rank, DP, _ours_clip), _reference_step(reference, reference_optim, step)
            assert all(abs(a - b) <= 1e-5 for a, b in zip(ours, single)), (how, step, ours, single)
        _assert_full_equal(get_model_state_dict(model), reference.state_dict(), how)
        if how == "checkpointed":  # replicate's parameters stay DTensors; fully_shard's show DTensors here too
            with unshard_params(model, writeback=False):
                refs = dict(reference.named_parameters())
                for name, p in model.named_parameters():
                    layer = name.split(".")[-2] + "." + name.split(".")[-1]
                    placements = {"up.weight": (Shard(0),), "up.bias": (Shard(0),), "down.weight": (Shard(1),),
                                  "down.bias": (Replicate(),)}.get(layer)
                    whole: torch.Tensor = p
                    if placements is None:  # the norms and the head: plain tensors
                        assert type(p) is nn.Parameter and p.shape == refs[name].shape, (name, type(p), p.shape)
                    else:
                        assert isinstance(p, DTensor) and p.placements == placements, (name, type(p))
                        whole = p.full_tensor()
                    torch.testing.assert_close(whole.detach(), refs[name].detach(), atol=1e-5, rtol=0)
            assert [isinstance(p, DTensor) for p in model.blocks[1].parameters()] == [True] * 4 + [False] * 2
            assert all(type(p) is nn.Parameter and p.dim() == 1 for p in model.blocks[0].parameters())
        if how == "uneven_frozen":  # the frozen layer never moved, and got no gradient
            _assert_full_equal({k: v for k, v in get_model_state_dict(model).items() if k.startswith("blocks.0.up.")},
                                {k: v for k, v in _plain_net().state_dict().items() if k.startswith("blocks.0.up.")},
                                "frozen")
            assert all(p.grad is None for n, p in model.named_parameters() if n.startswith("blocks.0.up."))


# ---------------------------------------------------------------------------- from the meta device (issue 55)
class _Rope(nn.Module):
    """A RoPE-like cache: a non-persistent buffer of a module with no ``reset_parameters()``,
    written by the model's own init (torchtitan's ``RoPE.cache``)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.full((8,), 5.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.cache


class _MetaBlock(_Block):
    """``_Block`` plus, unless ``plain``, a parameter of its own (no ``reset_parameters``: the
    call defers, FSDP2's flow) and a ``_Rope``."""

    def __init__(self, plain: bool) -> None:
        super().__init__()
        self.gain = None if plain else nn.Parameter(torch.ones(8))
        self.rope = nn.Identity() if plain else _Rope()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down(torch.relu(self.up(self.norm(self.rope(x)))))
        return x + (out if self.gain is None else out * self.gain)


class _MetaNet(_Net):
    def __init__(self, plain: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_MetaBlock(plain) for _ in range(2)])

    def init_weights(self) -> None:
        """The model's own init (torchtitan's ``init_weights`` after ``to_empty``): fan-based
        ``reset_parameters`` of the layers, a normal draw for the gains, the caches."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.LayerNorm)):
                m.reset_parameters()
            if isinstance(m, _MetaBlock) and m.gain is not None:
                nn.init.normal_(m.gain, mean=1.0, std=0.5)
            if isinstance(m, _Rope):
                m.cache = torch.arange(8.0) / 8


def _meta_net(plain: bool, tp_mesh: Optional[DeviceMesh]) -> _MetaNet:
    """Seed 3, built on the meta device; column/row-wise blocks on ``tp_mesh`` if given."""
    torch.manual_seed(3)
    with torch.device("meta"):
        model = _MetaNet(plain)
    if tp_mesh is not None:
        for block in model.blocks:
            parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def _unsharded_flow(plain: bool, flow: str) -> Tuple[_MetaNet, torch.Tensor]:
    """What one process gets from the same seed: built on meta, then ``to_empty`` and the init of
    ``flow`` ("fsdp2": the model's ``init_weights``; "fsdp1": each module's ``reset_parameters``,
    what fully_shard runs at the call); returns the model and the global RNG's next draw."""
    model = _meta_net(plain, None)
    model.to_empty(device="cpu")
    if flow == "fsdp2":
        model.init_weights()
    else:
        for m in model.modules():
            if callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()
    return model, torch.rand(4)


def _from_meta() -> None:
    """2-D from the meta device, dp 2 x tp 2 (torchtitan's flow: build on meta, parallelize_module,
    fully_shard each block and the root, to_empty, the model's own init). Without it fully_shard
    refused the tensor-parallel parameters of a block that has a parameter of its own or a meta
    buffer (a RoPE cache), and with every module having reset_parameters it initialized each
    rank's piece as if it were the whole tensor (every tp rank the same draws, fans of the piece),
    and it drew from the global RNG, so the init after to_empty drew other numbers. Checked:
    the full parameters (tensor-parallel ones whole) and the next draw of the global RNG equal
    one process's from the same seed, for both flows (FSDP1's: fully_shard initializes with
    reset_parameters; FSDP2's: to_empty + init_weights) and with the call deferring (a block's own
    parameter) or not; the cache is the init's; then 3 clipped AdamW steps from those weights
    equal one process and FSDP2 + TP given the same weights."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference only

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    for plain, flow in ((False, "fsdp2"), (True, "fsdp2"), (True, "fsdp1")):
        what = f"{'plain' if plain else 'own parameter + rope'} blocks, {flow} flow"
        reference, reference_draw = _unsharded_flow(plain, flow)
        model = _meta_net(plain, mesh["tp"])
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        if flow == "fsdp2":
            model.to_empty(device="cpu")
            model.init_weights()
        draw = torch.rand(4)
        assert torch.equal(draw, reference_draw), (what, "the global RNG's next draw", draw, reference_draw)
        _assert_full_equal(get_model_state_dict(model), reference.state_dict(), what)
        if not plain:
            assert torch.equal(model.blocks[1].rope.cache, reference.blocks[1].rope.cache), what
        if flow == "fsdp1":
            continue  # trained below from the other flows' weights
        fsdp2 = _meta_net(plain, mesh["tp"])
        for block in fsdp2.blocks:
            torch_fully_shard(block, mesh=mesh["dp"])
        torch_fully_shard(fsdp2, mesh=mesh["dp"])
        fsdp2.to_empty(device="cpu")
        fsdp2.init_weights()  # on a CPU mesh every tp rank's piece gets the same draws: then the same weights
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        from torch.distributed.checkpoint.state_dict import set_model_state_dict as torch_set_model_state_dict

        torch_set_model_state_dict(fsdp2, reference.state_dict(), options=StateDictOptions(full_state_dict=True))
        optims = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model, fsdp2, reference)]
        for step in range(3):
            ours = _train_step(model, optims[0], step, dp_rank, DP, _ours_clip)
            theirs = _train_step(fsdp2, optims[1], step, dp_rank, DP, _fsdp2_clip)
            single = _reference_step(reference, optims[2], step)
            for name, figures in (("FSDP2 + TP", theirs), ("one process", single)):
                assert all(abs(a - b) <= 1e-5 for a, b in zip(ours, figures)), (what, step, name, ours, figures)
        _assert_full_equal(get_model_state_dict(model), reference.state_dict(), what + ", trained")


def _sequence_parallel_and_llama() -> None:
    _sequence_parallel_and_loss_parallel()
    _from_meta()
    _hybrid_and_checkpointed()
    _hf_llama()


def test_fully_shard_over_sequence_loss_parallel_and_a_llama_plan_equals_fsdp2_and_one_process() -> None:
    run_distributed(_sequence_parallel_and_llama, DP * TP, timeout=240)


# ---------------------------------------------------------------------------- two tp mesh dimensions
# dp 2 x tp (2 x 2) = 8 ranks; parameters distributed by hand (parallelize_module's styles take a 1-D
# mesh): two tp dimensions splitting one tensor dimension (Shard(0), Shard(0)), splitting two
# (Shard(0), Shard(1)), and one of them only ((Replicate(), Shard(0)), (Shard(0), Replicate())).
PLACEMENTS_2D = {"block.up.weight": (Shard(0), Shard(0)), "block.up.bias": (Shard(0), Shard(0)),
                 "block.down.weight": (Shard(0), Shard(1)), "block.down.bias": (Replicate(), Shard(0)),
                 "head.weight": (Shard(0), Shard(0)), "head.bias": (Shard(0), Replicate())}
# how many ranks of the 8 hold each element of each tensor: the tp ranks of a dimension that does
# not shard it (a plain parameter: all 4), never the dp ranks
COPIES_2D = {"block.norm.weight": 4, "block.norm.bias": 4, "block.up.weight": 1, "block.up.bias": 1,
             "block.down.weight": 1, "block.down.bias": 2, "head.weight": 1, "head.bias": 2}
ROWS_2D = 3  # rows of the batch per dp rank


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class _WholeLinear(nn.Linear):
    """Computes on the whole weight and bias (``full_tensor()`` of a ``DTensor`` on any mesh, the
    tensor itself otherwise); full_tensor's backward gives each piece its rows of the gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, _whole(self.weight), _whole(self.bias))


class _Block2D(nn.Module):
    """Flat order: norm (6 + 6), up (pieces of 4 x 6 + 4), down (3 x 8 + 3): 67 elements on every tp
    rank, 34 per dp rank, so dp rank 0 ends inside row 3 of the up.weight piece (4 of its 6 columns)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.up = _WholeLinear(6, 16)
        self.down = _WholeLinear(16, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _Net2D(nn.Module):
    """The head (7 x 6, 7): uneven pieces, rows (2, 2, 2, 1) of head.weight on tp (0, 0), (0, 1),
    (1, 0), (1, 1) (torch.chunk of 7 into 4 + 3, then of 4 into 2 + 2 and of 3 into 2 + 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = _Block2D()
        self.head = _WholeLinear(6, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def _plain_net_2d() -> _Net2D:
    torch.manual_seed(0)
    return _Net2D()


def _tp_net_2d(tp_mesh: DeviceMesh) -> _Net2D:
    model = _plain_net_2d()
    modules = dict(model.named_modules())
    for fqn, placements in PLACEMENTS_2D.items():
        owner, _, name = fqn.rpartition(".")
        whole = getattr(modules[owner], name).detach()
        setattr(modules[owner], name, nn.Parameter(DTensor.from_local(_chunk_2d(whole, tp_mesh, placements).clone(), tp_mesh,
                                                                      placements, shape=whole.shape, stride=whole.stride())))
    return model


def _chunk_2d(whole: torch.Tensor, tp_mesh: DeviceMesh, placements: Tuple[Any, ...]) -> torch.Tensor:
    """This rank's piece of ``whole`` as DTensor documents it: torch.chunk by each mesh dimension
    that shards it, in mesh-dimension order (no communication: distribute_tensor scatters)."""
    local, coordinate = whole, tp_mesh.get_coordinate()
    assert coordinate is not None  # every rank is in the mesh
    for i, placement in enumerate(placements):
        if isinstance(placement, Shard):
            local = torch.chunk(local, tp_mesh.size(i), dim=placement.dim)[coordinate[i]]
    return local


def _batch_2d(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(400 + step)
    return torch.randn(DP * ROWS_2D, 6, generator=generator), torch.randn(DP * ROWS_2D, 7, generator=generator)


def _step_2d(model: nn.Module, optim: torch.optim.Optimizer, step: int, dp_rank: Optional[int],
             dp_group: Any = None) -> Tuple[float, float]:
    """One clipped SGD step on dp rank ``dp_rank``'s rows of the batch (``None``: one process on all
    of it); returns (the batch's mean loss, the norm before clipping)."""
    x, y = _batch_2d(step)
    if dp_rank is not None:
        x, y = x[dp_rank * ROWS_2D:(dp_rank + 1) * ROWS_2D], y[dp_rank * ROWS_2D:(dp_rank + 1) * ROWS_2D]
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    norm = (clip_grad_norm_(model, MAX_NORM) if dp_rank is not None
            else torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    optim.step()
    optim.zero_grad()
    mean = loss.detach().clone()
    if dp_rank is not None:
        dist.all_reduce(mean, group=dp_group)
        mean /= DP
    return mean.item(), norm.item()


_Boxes = Dict[str, List[Tuple[Tuple[int, ...], Tuple[int, ...]]]]


def _expected_boxes_2d(dp_rank: int, c0: int, c1: int) -> _Boxes:
    """This rank's boxes of each tensor, worked out by hand. up.weight (16 x 6): rows 8 c0 + 4 c1
    .. + 4 (tp0 halves the rows, tp1 halves tp0's half); its piece is flat elements [12, 36) of the
    block's 67, dp rank 0 holding [0, 34): rows 0-2 and 4 columns of row 3 of the piece. down.weight
    (6 x 16): rows 3 c0 .. + 3, columns 8 c1 .. + 8. down.bias (6): 3 c1 .. + 3 (tp1 only). head
    (one handle: weight piece, then bias piece; ceil(total / 2) per dp rank): see _Net2D."""
    r = 8 * c0 + 4 * c1
    block: _Boxes = ({"block.norm.weight": [((0,), (6,))], "block.norm.bias": [((0,), (6,))],
              "block.up.weight": [((r, 0), (3, 6)), ((r + 3, 0), (1, 4))], "block.up.bias": [],
              "block.down.weight": [], "block.down.bias": []} if dp_rank == 0 else
             {"block.norm.weight": [], "block.norm.bias": [], "block.up.weight": [((r + 3, 4), (1, 2))],
              "block.up.bias": [((r,), (4,))], "block.down.weight": [((3 * c0, 8 * c1), (3, 8))],
              "block.down.bias": [((3 * c1,), (3,))]})
    head_row, bias = 2 * (2 * c0 + c1), (4 * c0, 4 - c0)  # head.bias: rows 0-3 on c0 = 0, 4-6 on c0 = 1
    head: _Boxes
    if (c0, c1) != (1, 1):  # 2 rows (12) + 4 or 3 of bias: 8 per dp rank, the bias on dp rank 1
        head = ({"head.weight": [((head_row, 0), (1, 6)), ((head_row + 1, 0), (1, 2))], "head.bias": []}
                if dp_rank == 0 else {"head.weight": [((head_row + 1, 2), (1, 4))], "head.bias": [((bias[0],), (bias[1],))]})
    else:  # row 6 alone (6) + 3 of bias = 9: 5 per dp rank
        head = ({"head.weight": [((6, 0), (1, 5))], "head.bias": []} if dp_rank == 0 else
                {"head.weight": [((6, 5), (1, 1))], "head.bias": [((4,), (3,))]})
    return {**block, **head}


def _two_tp_dimensions(directory: str) -> None:
    """See test_fully_shard_over_two_tensor_parallel_mesh_dimensions."""
    import torch.distributed.checkpoint as dcp

    mesh = init_device_mesh("cpu", (DP, 2, 2), mesh_dim_names=("dp", "tp0", "tp1"))
    tp_mesh, dp_group, dp_rank = mesh["tp0", "tp1"], mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    c0, c1 = mesh["tp0"].get_local_rank(), mesh["tp1"].get_local_rank()
    model = _tp_net_2d(tp_mesh)
    fully_shard(model.block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    reference = _plain_net_2d()
    optim, reference_optim = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    head_numel = 9 if (c0, c1) == (1, 1) else 16 - c0
    assert [g.flat_param.numel() for s in _get_fsdp_states(model) if s.handle for g in s.handle.groups] == \
        [-(-head_numel // DP), -(-67 // DP)], "each handle: ceil(local pieces / dp) elements"
    assert (f"block.up.weight: (16, 6), Shard(dim=0), Shard(dim=0) on ('tp0', 'tp1') -> this rank's piece (4, 6) "
            f"at ({8 * c0 + 4 * c1}, 0)") in describe(model).tensor_parallel, describe(model).tensor_parallel

    def step_both(step: int) -> None:
        ours, single = _step_2d(model, optim, step, dp_rank, dp_group), _step_2d(reference, reference_optim, step, None)
        assert single[1] > MAX_NORM and all(abs(a - b) <= 1e-5 for a, b in zip(ours, single)), (step, ours, single)

    for step in range(2):
        step_both(step)
    full = get_model_state_dict(model)
    _assert_full_equal(full, reference.state_dict(), "two tp dimensions: after 2 steps")

    sharded = get_model_state_dict(model, full=False)
    assert {k: [b[:2] for b in v.boxes] for k, v in sharded.items()} == _expected_boxes_2d(dp_rank, c0, c1), sharded
    _check_boxes(sharded, full)  # each box holds the full tensor's values at its coordinates
    everyone: List[Dict[str, List[Any]]] = [{}] * dist.get_world_size()
    dist.all_gather_object(everyone, {k: [b[:2] for b in v.boxes] for k, v in sharded.items()})
    for key, value in full.items():  # every element on exactly COPIES_2D[key] ranks' boxes
        count = torch.zeros(value.shape, dtype=torch.int64)
        for boxes in everyone:
            for offsets, sizes in boxes[key]:
                count[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] += 1
        assert bool((count == COPIES_2D[key]).all()), (key, count)

    # a full state dict loads: this rank's piece taken out of it (the model moved on alone first)
    saved = {k: v.clone() for k, v in reference.state_dict().items()}
    _step_2d(model, optim, 2, dp_rank, dp_group)
    set_model_state_dict(model, saved)
    _assert_full_equal(get_model_state_dict(model), saved, "two tp dimensions: after loading a full state dict")
    step_both(2)
    # a sharded one: its boxes read from a checkpoint of the one-process model's (global coordinates)
    path = os.path.join(directory, "two_tp_dims")
    dcp.save(reference.state_dict(), checkpoint_id=path)
    saved = {k: v.clone() for k, v in reference.state_dict().items()}
    _step_2d(model, optim, 3, dp_rank, dp_group)
    sharded = get_model_state_dict(model, full=False)
    dcp.load(sharded, checkpoint_id=path)
    set_model_state_dict(model, sharded)
    _assert_full_equal(get_model_state_dict(model), saved, "two tp dimensions: after loading a sharded state dict")
    step_both(3)
    _assert_full_equal(get_model_state_dict(model), reference.state_dict(), "two tp dimensions: the step after")
    _unshard_params_2d(model, reference, optim, reference_optim, tp_mesh, dp_rank, dp_group)


def _assert_idle_as_before(model: nn.Module, before: List[Tuple[str, nn.Parameter, torch.Tensor]], what: str,
                           values: bool = True) -> None:
    """After unshard_params: the same parameter objects in the slots, each a plain 1-D slice of the
    shard (``values``: the elements it held before), and every handle's gathered storage freed."""
    after = list(model.named_parameters())
    for (name, p, shard), (name_after, q) in zip_same(before, after, what=what):
        assert name == name_after and q is p and type(q) is nn.Parameter and q.dim() == 1, (what, name, type(q), q.shape)
        assert not values or torch.equal(q.detach(), shard), (what, name)
    assert all(h.unsharded_storage_freed() for s in _get_fsdp_states(model) for h in [s.handle] if h is not None), what


def _unshard_params_2d(model: nn.Module, reference: nn.Module, optim: torch.optim.Optimizer,
                       reference_optim: torch.optim.Optimizer, tp_mesh: DeviceMesh, dp_rank: int, dp_group: Any) -> None:
    """unshard_params over the two-tp-dimension model: each tensor-parallel parameter is a DTensor
    parameter with its placements and mesh (as in forward): full_tensor() is the one-process
    weight, p.norm() its global norm, a no_grad forward the one-process output; an EMA-like edit
    (lerp_ of the DTensor) is written back and the next step equals one process edited the same
    way; writeback=False discards, rank0_only shows DTensors on dp rank 0 only, with_grads shows
    DTensor gradients equal to one process's. After each context the parameters are as before."""
    refs = dict(reference.named_parameters())
    x = _batch_2d(9)[0]
    for options in ({"writeback": False}, {"writeback": False, "offload_to_cpu": True},
                    {"writeback": False, "rank0_only": True}):
        before = [(n, p, p.detach().clone()) for n, p in model.named_parameters()]
        shown = dp_rank == 0 or not options.get("rank0_only")
        with unshard_params(model, **options):
            for name, p in model.named_parameters():
                if not shown:  # rank0_only: the other dp ranks keep their plain slices
                    assert type(p) is nn.Parameter and p.dim() == 1, (options, name, type(p), p.shape)
                elif name in PLACEMENTS_2D:
                    assert isinstance(p, DTensor) and isinstance(p, nn.Parameter), (options, name, type(p))
                    assert p.placements == PLACEMENTS_2D[name] and p.device_mesh == tp_mesh, (options, name, p.placements)
                    assert p.shape == refs[name].shape and p.requires_grad, (options, name, p.shape)
                    torch.testing.assert_close(p.full_tensor(), refs[name].detach(), atol=1e-5, rtol=0)
                    norm = p.norm()  # a DTensor op: the norm over every tp rank's piece
                    assert isinstance(norm, DTensor), (name, type(norm))
                    assert abs(norm.full_tensor().item() - refs[name].norm().item()) <= 1e-5, (name, norm, refs[name].norm())
                else:
                    assert type(p) is nn.Parameter and p.shape == refs[name].shape, (options, name, type(p), p.shape)
                    torch.testing.assert_close(p.detach(), refs[name].detach(), atol=1e-5, rtol=0)
            if shown:
                with torch.no_grad():
                    torch.testing.assert_close(model(x), reference(x), atol=1e-5, rtol=0)
                    for p in model.parameters():
                        p.mul_(0.0)  # discarded: writeback=False
        _assert_idle_as_before(model, before, f"after unshard_params({options})")

    # an EMA-like edit of every parameter, written back: the next forward of every rank sees it
    before = [(n, p, p.detach().clone()) for n, p in model.named_parameters()]
    with unshard_params(model), torch.no_grad():
        for p in model.parameters():
            p.lerp_(torch.full_like(p, 0.5), 0.25)  # a DTensor op on the tensor-parallel ones
    with torch.no_grad():
        for p in reference.parameters():
            p.lerp_(torch.full_like(p, 0.5), 0.25)
    _assert_idle_as_before(model, before, "after the written-back edit", values=False)
    _assert_full_equal(get_model_state_dict(model), reference.state_dict(), "after the written-back edit")
    ours, single = _step_2d(model, optim, 10, dp_rank, dp_group), _step_2d(reference, reference_optim, 10, None)
    assert all(abs(a - b) <= 1e-5 for a, b in zip(ours, single)), ("the step after the edit", ours, single)

    # with_grads: the reduced gradients, as DTensors with the parameters' placements
    x, y = _batch_2d(11)
    nn.functional.mse_loss(model(x[dp_rank * ROWS_2D:(dp_rank + 1) * ROWS_2D]), y[dp_rank * ROWS_2D:(dp_rank + 1) * ROWS_2D]).backward()
    nn.functional.mse_loss(reference(x), y).backward()
    before = [(n, p, p.detach().clone()) for n, p in model.named_parameters()]
    grads = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
    with unshard_params(model, with_grads=True, writeback=False):
        for name, p in model.named_parameters():
            grad = p.grad
            if name in PLACEMENTS_2D:
                assert isinstance(grad, DTensor) and grad.placements == PLACEMENTS_2D[name], (name, type(grad))
                grad = grad.full_tensor()
            torch.testing.assert_close(grad, refs[name].grad, atol=1e-5, rtol=0)
    _assert_idle_as_before(model, before, "after unshard_params(with_grads=True)")
    for g, p in zip_same(grads, list(model.parameters())):
        assert g is not None and p.grad is not None and torch.equal(p.grad, g)  # this rank's gradient slices back
    optim.zero_grad()
    reference_optim.zero_grad()


def test_fully_shard_over_two_tensor_parallel_mesh_dimensions(tmp_path: Any) -> None:
    """dp 2 x tp (2 x 2), 8 ranks: parameters split twice along one dimension ((Shard(0), Shard(0)),
    even and uneven), along two, and along one tp dimension of the two, fully sharded over dp,
    beside plain ones. Training (clipped SGD) equals one process; the sharded state dict's boxes
    are the ones worked out by hand, hold the full tensor's values, and cover every element once
    per tp replica; a full state dict and a sharded one (read by dcp from a one-process
    checkpoint) load, and the next step equals one process. Without it: a piece's offset taken
    from the last tp dimension alone (or from the wrong one, or the two in the other order) went
    unseen by every test (each used one tp dimension), while a full load wrote each rank's piece
    from the wrong rows, and checkpoints overlapped and left rows out."""
    run_distributed(_two_tp_dimensions, 8, str(tmp_path), timeout=180)
