"""``benchmarks/simulated.py``: one process plays one rank of ``W`` identical ranks (issue 56, item 2).

``benchmarks/overhead.py`` measures the runtime's CPU cost per module at W=8 on this backend (and
the GPU benchmark's W=8 runs on it): every all-gather and reduce-scatter of the library and of
torch's FSDP2 really runs, on data of the real sizes. What would silently break without these
tests: a collective that writes something other than what W identical ranks would produce (a
reduce-scatter that forgets the factor W or takes another rank's chunk, an all-gather that fills
one chunk, an all-reduce that keeps a SUM) raises nothing; the benchmark's steps would then train a
different model than the one their sanity line describes, with gradients off by a factor the
optimizer hides, and its figures would no longer be those of the W-rank code paths.

Every expected number is worked out by hand here, from the inputs and the rank; the training test
builds its reference (a local model on the parameters rank ``r``'s shards describe, tiled W times,
re-tiled after each step) from the shapes alone, without the library or the backend.
"""

from __future__ import annotations

import contextlib
import gc
import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks import simulated
from tests._models import zip_same

# torch 2.12 renamed these two (the old names warn); the backend implements both spellings
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@contextlib.contextmanager
def _simulated_world(world_size: int, rank: int) -> Iterator[simulated.SimulatedProcessGroup]:
    """The default process group: ``rank`` of ``world_size`` simulated ranks, destroyed afterwards."""
    assert not dist.is_initialized(), "a default process group is already initialized in this test process"
    simulated.register()
    dist.init_process_group(simulated.BACKEND_NAME, rank=rank, world_size=world_size, store=dist.HashStore())
    try:
        group = dist.group.WORLD
        assert isinstance(group, simulated.SimulatedProcessGroup), type(group)
        yield group
    finally:
        gc.collect()  # FSDP2 and the library hold the group until their models go
        dist.destroy_process_group()


def _tensor(values: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def test_collectives_write_what_identical_ranks_would() -> None:
    """Rank 2 of 4 (not rank 0, so that taking chunk 0 instead of this rank's chunk shows): every
    collective's output against numbers worked out by hand; the works are complete at once and their
    futures hold the output; point-to-point refuses; the group counts its collectives."""
    with _simulated_world(4, 2) as group:
        assert (dist.get_world_size(), dist.get_rank(), dist.get_backend()) == (4, 2, "simulated")
        calls = group.calls

        out = torch.full((12,), -1.0)
        work = ALL_GATHER_SINGLE(out, _tensor([1.0, 2.0, 3.0]), async_op=True)
        assert work is not None and work.is_completed() and work.wait()
        assert torch.equal(out, _tensor([1.0, 2.0, 3.0] * 4))
        assert torch.equal(work.get_future().value()[0], out)
        stacked = torch.full((4, 2), -1.0)
        ALL_GATHER_SINGLE(stacked, _tensor([5.0, -6.0]))
        assert torch.equal(stacked, _tensor([[5.0, -6.0]] * 4))

        # reduce_scatter_tensor: chunks of arange(8) are [0,1] [2,3] [4,5] [6,7]; rank 2 holds [4,5]
        for op, expected in ((dist.ReduceOp.SUM, [16.0, 20.0]), (dist.ReduceOp.AVG, [4.0, 5.0]),
                             (dist.ReduceOp.MAX, [4.0, 5.0]), (dist.ReduceOp.MIN, [4.0, 5.0])):
            chunk = torch.full((2,), -1.0)
            REDUCE_SCATTER_SINGLE(chunk, torch.arange(8.0), op=op)
            assert torch.equal(chunk, _tensor(expected)), (op, chunk)
        chunk = torch.full((2,), -1.0)
        dist.reduce_scatter(chunk, [_tensor([1.0, 1.0]), _tensor([2.0, 2.0]), _tensor([3.0, -3.0]), _tensor([4.0, 4.0])])
        assert torch.equal(chunk, _tensor([12.0, -12.0]))  # this rank's entry (index 2), 4 times

        for op, expected in ((dist.ReduceOp.SUM, [4.0, -8.0]), (dist.ReduceOp.AVG, [1.0, -2.0]),
                             (dist.ReduceOp.MAX, [1.0, -2.0]), (dist.ReduceOp.MIN, [1.0, -2.0]),
                             (dist.ReduceOp.PRODUCT, [1.0, 16.0])):
            t = _tensor([1.0, -2.0])
            dist.all_reduce(t, op=op)
            assert torch.equal(t, _tensor(expected)), (op, t)
        flags = torch.tensor([0, 1, 3], dtype=torch.int32)
        dist.all_reduce(flags)
        assert torch.equal(flags, torch.tensor([0, 4, 12], dtype=torch.int32))

        t = _tensor([7.0, 8.0])
        dist.broadcast(t, src=0)
        assert torch.equal(t, _tensor([7.0, 8.0]))
        outs = [torch.full((2,), -1.0) for _ in range(4)]
        dist.all_gather(outs, _tensor([7.0, 8.0]))
        assert all(torch.equal(o, _tensor([7.0, 8.0])) for o in outs)
        a2a = torch.full((8,), -1.0)
        dist.all_to_all_single(a2a, torch.arange(8.0))  # every peer sends rank 2 its chunk 2 = [4, 5]
        assert torch.equal(a2a, _tensor([4.0, 5.0] * 4))
        dist.barrier()
        assert group.calls - calls == 17  # 2 + 5 + 6 above, broadcast, all_gather, all_to_all, barrier

        with pytest.raises(NotImplementedError, match="point-to-point send"):
            dist.send(t, dst=0)
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (4,))
        assert mesh.get_group() is group and mesh.size() == 4 and mesh.get_local_rank() == 2


def _model() -> nn.Sequential:
    """Two fully sharded blocks and a root holding the head: handles of 35, 30 and 6 elements."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(6, 5), nn.Tanh()), nn.Sequential(nn.Linear(5, 5), nn.Tanh()),
                         nn.Linear(5, 1))


def _handles(model: nn.Sequential) -> List[List[nn.Parameter]]:
    """The parameters of each fully sharded module, in registration order: block 0, block 1, root."""
    return [list(model[0].parameters()), list(model[1].parameters()), list(model[2].parameters())]


def _tile_flat(params: List[nn.Parameter], world_size: int, rank: int) -> List[torch.Tensor]:
    """Ours: one flat concatenation per module, ceil(N/W) elements per rank; the all-gather tiles
    rank ``rank``'s chunk (chosen below so that it holds no padding)."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    chunk = math.ceil(flat.numel() / world_size)
    assert (rank + 1) * chunk <= flat.numel(), "the chosen rank's chunk must hold no padding"
    tiled = flat[rank * chunk:(rank + 1) * chunk].repeat(world_size)[: flat.numel()]
    return list(torch.split(tiled, [p.numel() for p in params]))


def _tile_rows(params: List[nn.Parameter], world_size: int, rank: int) -> List[torch.Tensor]:
    """FSDP2: each tensor sharded on dim 0, ceil(rows/W) rows per rank; rank 0's rows tiled."""
    assert rank == 0
    out = []
    for p in params:
        rows = math.ceil(p.shape[0] / world_size)
        out.append(p.detach()[:rows].repeat(world_size, *[1] * (p.dim() - 1))[: p.shape[0]])
    return out


def _tiled_reference_losses(tile: Callable[[List[nn.Parameter], int, int], List[torch.Tensor]], world_size: int,
                            rank: int, batches: List[Tuple[torch.Tensor, torch.Tensor]], lr: float,
                            grad_scale: Any = 1.0) -> List[float]:
    """Local SGD on the parameters the simulated rank computes on: before each step every module's
    parameters are replaced by its shards tiled (the all-gather), and the step's update of this
    rank's shard is the one of the local gradient (W identical contributions, averaged; times
    ``grad_scale`` for a divide factor other than W: a number, or one per step)."""
    ref = _model()
    losses = []
    scales = grad_scale if isinstance(grad_scale, list) else [grad_scale] * len(batches)
    for (x, y), scale in zip(batches, scales):
        with torch.no_grad():
            for params in _handles(ref):
                for p, value in zip_same(params, tile(params, world_size, rank)):
                    p.copy_(value.view_as(p))
        loss = nn.functional.mse_loss(ref(x), y)
        loss.backward()
        with torch.no_grad():
            for p in ref.parameters():
                assert p.grad is not None
                p.sub_(lr * scale * p.grad)
                p.grad = None
        losses.append(float(loss.detach()))
    return losses


def _sgd_losses(model: nn.Module, optim: torch.optim.Optimizer, batches: List[Tuple[torch.Tensor, torch.Tensor]],
                step_last: bool = False) -> List[float]:
    """Each batch's loss; an SGD step after each but the last (after the last too if ``step_last``:
    a run split in parts)."""
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = nn.functional.mse_loss(model(x), y)
        losses.append(float(loss.detach()))
        if step_last or i < len(batches) - 1:
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
    return losses


@pytest.mark.parametrize("api,world_size,rank,factor", [("fully_shard", 8, 0, None), ("fully_shard", 3, 1, None),
                                                       ("fully_shard", 4, 1, 2.0), ("torch_fsdp2", 8, 0, None),
                                                       ("minimal", 8, 0, None), ("minimal", 3, 1, None)])
def test_training_equals_local_training_on_the_tiled_shards(api: str, world_size: int, rank: int,
                                                           factor: Optional[float]) -> None:
    """Ours (flat shards; at W=8 rank 0, and at W=3 rank 1, where the handles pad and the chunk is
    not the first) and torch's FSDP2 (dim-0 shards) train 4 SGD steps on the simulated group; every
    step's loss equals the tiled local reference's, and so do the parameters after the last step
    (a fifth forward). A reduce-scatter off by W, or taking the wrong chunk, changes the second
    step's loss; an all-gather that does not tile changes the first.

    Ours averages in the collective on a backend that can (``ReduceOp.AVG``, as FSDP2 does on NCCL;
    this backend is one): each reduce-scatter asks for AVG and nothing divides afterwards. With
    ``set_gradient_divide_factor(2.0)`` at W=4 it sums and divides by 2 (twice the mean gradient).

    ``minimal`` (``benchmarks/minimal_zero3.py``, the overhead benchmark's floor) has ours' layout and
    must train the same model: a floor that skipped work (a gather, the backward's re-gather, a
    reduce-scatter) would be cheaper than any real runtime could be."""
    lr = 0.1
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 6, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(5)]
    tile = _tile_rows if api == "torch_fsdp2" else _tile_flat
    expected = _tiled_reference_losses(tile, world_size, rank, batches, lr,
                                       grad_scale=1.0 if factor is None else world_size / factor)
    with _simulated_world(world_size, rank) as group:
        model = _model()
        if api == "fully_shard":
            from composable_shard import fully_shard
            for block in (model[0], model[1]):
                fully_shard(block)
            fully_shard(model)
            if factor is not None:
                for module in (model[0], model[1], model):
                    module.set_gradient_divide_factor(factor)  # type: ignore[operator]  # FSDPModule's method
        elif api == "torch_fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard as torch_fully_shard
            mesh = init_device_mesh("cpu", (world_size,))
            for block in (model[0], model[1]):
                torch_fully_shard(block, mesh=mesh)
            torch_fully_shard(model, mesh=mesh)
        params = list(model.parameters())
        if api == "minimal":
            from benchmarks.minimal_zero3 import apply_minimal
            params = apply_minimal([model[0], model[1], model], group)
            assert len(params) == 3 and not list(model.parameters()), "every parameter moved into the three shards"
        optim = torch.optim.SGD(params, lr=lr)
        losses = _sgd_losses(model, optim, batches)
        if api == "fully_shard":
            scatters = [op for kind, op in group.reduce_ops if kind == "reduce_scatter"]
            assert scatters == ["SUM" if factor is not None else "AVG"] * 3 * (len(batches) - 1), group.reduce_ops
        del model, optim
    # the reference takes a fifth step too; its loss is the fifth forward's
    for step, (got, want) in enumerate(zip_same(losses, expected)):
        assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-6), (api, world_size, rank, step, losses, expected)
    assert len({round(v, 4) for v in losses}) == len(losses), f"the losses must move: {losses}"


def _first_backward_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """This rank's gradient elements after one backward, in parameter order (each ``.grad`` is
    this rank's slice of its parameter, flattened)."""
    nn.functional.mse_loss(model(x), y).backward()
    return torch.cat([p.grad.detach().float().reshape(-1) for p in model.parameters() if p.grad is not None])


def _tiled_reference_grads(world_size: int, rank: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The same elements of the tiled local model's gradient (every handle's chunk ``rank``)."""
    ref = _model()
    with torch.no_grad():
        for params in _handles(ref):
            for p, value in zip_same(params, _tile_flat(params, world_size, rank)):
                p.copy_(value.view_as(p))
    nn.functional.mse_loss(ref(x), y).backward()
    out = []
    for params in _handles(ref):
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]  # all used
        chunk = math.ceil(flat.numel() / world_size)
        out.append(flat[rank * chunk:(rank + 1) * chunk])
    return torch.cat(out)


@pytest.mark.parametrize("case", ["factor_switched", "hybrid", "bf16_reduce"])
def test_averaging_collectives_against_the_tiled_model(case: str) -> None:
    """The averaging path's neighbours, on a backend that averages (``ReduceOp.AVG``):

    * ``factor_switched`` (W=4, rank 1): ``set_gradient_divide_factor(2.0)`` after two steps: the
      next steps sum and divide by 2 (the decision is not kept from the first backward), then the
      reduce-scatters ask for AVG twice, SUM twice per module.
    * ``hybrid`` (W=8, rank 0, a 2 x 4 mesh, HYBRID_SHARD): the reduce-scatter over the shard group
      and the all-reduce over the replicas both average; losses equal the model tiled over 4.
    * ``bf16_reduce`` (W=4, rank 1, ``param_dtype=reduce_dtype=bfloat16``): averaged once, not also
      divided before the collective; the first gradient within bfloat16's error of the tiled
      model's (a factor W off would be 75% off)."""
    from composable_shard import MixedPrecision, ShardingStrategy, fully_shard

    lr = 0.1
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 6, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(5)]
    world_size, rank = (8, 0) if case == "hybrid" else (4, 1)
    with _simulated_world(world_size, rank) as group:
        model = _model()
        kwargs: Dict[str, Any] = {}
        shard_group = replica_group = group
        if case == "hybrid":
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
            shard_group, replica_group = mesh["shard"].get_group(), mesh["replicate"].get_group()
            kwargs = {"mesh": mesh, "strategy": ShardingStrategy.HYBRID_SHARD}
        if case == "bf16_reduce":
            kwargs = {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)}
        for module in (model[0], model[1], model):
            fully_shard(module, **kwargs)
        if case == "bf16_reduce":
            x, y = batches[0]
            got, want = _first_backward_grads(model, x, y), _tiled_reference_grads(4, 1, x, y)
            error = float((got - want).abs().max() / want.abs().max())
            assert error < 0.05, (error, got, want)
            assert {op for kind, op in group.reduce_ops if kind == "reduce_scatter"} == {"AVG"}, group.reduce_ops
            return
        optim = torch.optim.SGD(model.parameters(), lr=lr)
        switch = 2 if case == "factor_switched" else None
        losses = _sgd_losses(model, optim, batches[:switch], step_last=True) if switch else _sgd_losses(model, optim, batches)
        if switch:
            for module in (model[0], model[1], model):
                module.set_gradient_divide_factor(2.0)  # type: ignore[operator]  # FSDPModule's method
            losses += _sgd_losses(model, optim, batches[switch:])
        scatters = [op for kind, op in shard_group.reduce_ops if kind == "reduce_scatter"]
        if case == "factor_switched":
            expected = _tiled_reference_losses(_tile_flat, 4, 1, batches, lr, grad_scale=[1.0, 1.0, 2.0, 2.0, 2.0])
            assert scatters == ["AVG"] * 6 + ["SUM"] * 6, group.reduce_ops
        else:
            expected = _tiled_reference_losses(_tile_flat, 4, 0, batches, lr)
            replicas = [op for kind, op in replica_group.reduce_ops if kind == "all_reduce"]  # and the agreement's SUMs
            assert scatters == ["AVG"] * 12 and replicas.count("AVG") == 12, (shard_group.reduce_ops, replicas)
        del model, optim
    for step, (got_loss, want_loss) in enumerate(zip_same(losses, expected)):
        assert math.isclose(got_loss, want_loss, rel_tol=1e-5, abs_tol=1e-6), (case, step, losses, expected)
