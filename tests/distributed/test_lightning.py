"""Lightning's ``Trainer`` and ``Fabric`` on models sharded by this library
(``composable_shard.integrations.lightning``; the ``[lightning]`` extra).

Without ``ShardedStrategy``: ``DDPStrategy`` is refused (its DDP wrap would overwrite rank 1's
shards); ``ModelParallelStrategy`` trains exactly but reduces every accumulated micro-batch, and
``trainer.save_checkpoint`` wrote a silently incomplete optimizer state (one rank's slice per
key) that its own loader then refused at resume ("Could not find a distributed model"). These
tests compare per-micro-batch losses and per-step gradient norms with single-process Lightning
on the combined batch (``gradient_clip_val`` active at every step, ``accumulate_grad_batches=2``),
count the reductions (one per optimizer step), resume from ``trainer.save_checkpoint`` at the same
and at another world size to the uninterrupted losses, and check that ``ModelParallelStrategy``'s
save is refused before anything is written, naming the strategy to use.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import FSDPModule, fully_shard, replicate
from composable_shard._runtime.collectives import record_collectives
from tests._harness import run_distributed
from tests._models import SEQ, VOCAB, loss_fn, make_model

L = pytest.importorskip("lightning", reason="the [lightning] extra (README's test command installs it)")

SAMPLES = 16         # one epoch: 4 micro-batches of 4 rows (2 per rank at W = 2), 2 optimizer steps
ROWS = 4             # rows of the combined batch
ACCUMULATE = 2
CLIP = 0.05          # below every step's gradient norm (checked), so clipping changes every update
LR = 0.5


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(77)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _quiet() -> None:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")


def _join_as_lightning() -> None:
    """Tell Lightning the processes exist already (the harness made them and their group)."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size), RANK=str(rank))


class LitParity(L.LightningModule):
    """The parity model (tied embedding and head, a frozen linear, a one-element handle) under
    SGD with momentum (a wrong gradient scale or norm moves the parameters) and a step LR
    schedule (restored from checkpoints); ``layout`` is applied in ``configure_model``."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        self.model = make_model(0)
        self.layout = layout
        self.losses: List[float] = []
        self.norms: List[float] = []

    def configure_model(self) -> None:
        if self.layout == "plain" or isinstance(self.model, FSDPModule):
            return
        if self.layout == "replicate_block":
            replicate(self.model.blocks[1])
            fully_shard(self.model.blocks[0])
        else:
            for block in self.model.blocks:
                fully_shard(block)
        fully_shard(self.model)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = loss_fn(self.model(inputs), targets)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)))  # torch's: global on sharded gradients

    def configure_optimizers(self) -> Any:
        optim = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR, momentum=0.9)
        return [optim], [torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.8)]


def _trainer(strategy: Any, devices: int, epochs: int) -> Any:
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=epochs,
                     gradient_clip_val=CLIP, accumulate_grad_batches=ACCUMULATE, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, use_distributed_sampler=False)


def _loader(world_size: int) -> torch.utils.data.DataLoader:
    """Rank r reads rows r, r + W, ... of each combined batch, in order (Lightning's own
    distributed sampler shuffles a training set; the reference must see the same rows)."""
    rank = dist.get_rank() if world_size > 1 else 0
    sampler = torch.utils.data.DistributedSampler(_data(), num_replicas=world_size, rank=rank, shuffle=False)
    return torch.utils.data.DataLoader(_data(), batch_size=ROWS // world_size, sampler=sampler)


def _reference() -> Dict[str, List[float]]:
    """Single-process Lightning on the combined batch: per micro-batch losses, per step norms."""
    _quiet()
    module = LitParity("plain")
    _trainer("auto", 1, 2).fit(module, _loader(1))
    return {"losses": module.losses, "norms": module.norms}


def _mean_over_ranks(values: List[float]) -> List[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def _check(name: str, actual: List[float], expected: List[float]) -> None:
    # float32 end to end: the sharded and the local step differ by summation order only (measured
    # < 2e-7 here); a wrong clip norm, a lost momentum buffer or a rank's own gradient moves a
    # loss by > 1e-3 within the 2 steps that follow
    torch.testing.assert_close(actual, expected, atol=2e-6, rtol=0, msg=lambda m: f"{name}: {m}")


def _trainer_runs(path: str, reference: Dict[str, List[float]]) -> None:
    """At W = 2: ShardedStrategy against single-process Lightning, reductions counted, a
    checkpoint after epoch 1 resumed to the uninterrupted losses; ModelParallelStrategy
    trains exactly and its save is refused."""
    from composable_shard.integrations.lightning import ShardedStrategy

    _quiet()
    _join_as_lightning()
    world_size = dist.get_world_size()
    for layout in ("blocks", "replicate_block"):
        module = LitParity(layout)
        with record_collectives() as recorded:
            _trainer(ShardedStrategy(), world_size, 2).fit(module, _loader(world_size))
        _check(f"{layout}: losses", _mean_over_ranks(module.losses), reference["losses"])
        _check(f"{layout}: gradient norms", module.norms, reference["norms"])
        assert all(n > 2 * CLIP for n in reference["norms"]), reference["norms"]  # clipping is active
        steps = len(reference["norms"])
        # one reduction per optimizer step, none for the accumulated micro-batch: a reduce-scatter
        # per trainable flat group (blocks, root), an all-reduce per bucket of the replicated block
        trainable_groups = 3 if layout == "blocks" else 2
        assert recorded.count("reduce_scatter") == trainable_groups * steps, (layout, recorded.count("reduce_scatter"))
        buckets = sum(1 for r in recorded.records if r.kind == "all_reduce" and "bucket" in r.tag)
        assert buckets == (0 if layout == "blocks" else steps), (layout, buckets)
    # save after epoch 1, resume a fresh module from it for epoch 2
    first = LitParity("blocks")
    trainer = _trainer(ShardedStrategy(), world_size, 1)
    trainer.fit(first, _loader(world_size))
    trainer.save_checkpoint(f"{path}/epoch1.ckpt")
    trainer.save_checkpoint(f"{path}/epoch1.ckpt")  # replaces it (ModelCheckpoint's last.ckpt does that)
    resumed = LitParity("blocks")
    _trainer(ShardedStrategy(), world_size, 2).fit(resumed, _loader(world_size), ckpt_path=f"{path}/epoch1.ckpt")
    half = len(reference["losses"]) // 2
    _check("resumed at W=2", _mean_over_ranks(resumed.losses), reference["losses"][half:])
    assert resumed.trainer.lr_scheduler_configs[0].scheduler.last_epoch == 2  # one per epoch, restored at 1
    # torch's FSDP2 strategy on our model: trains exactly, its checkpoint is refused at save
    mp_module = LitParity("blocks")
    mp_trainer = _trainer(L.pytorch.strategies.ModelParallelStrategy(data_parallel_size=world_size,
                                                                      tensor_parallel_size=1), world_size, 1)
    mp_trainer.fit(mp_module, _loader(world_size))
    _check("ModelParallelStrategy", _mean_over_ranks(mp_module.losses), reference["losses"][:half])
    with pytest.raises(RuntimeError, match="ModelParallelStrategy cannot checkpoint.*ShardedStrategy"):
        mp_trainer.save_checkpoint(f"{path}/model_parallel.ckpt")
    assert not os.path.exists(f"{path}/model_parallel.ckpt")


def _resume_alone(path: str, reference: Dict[str, List[float]]) -> None:
    from composable_shard.integrations.lightning import ShardedStrategy

    _quiet()
    _join_as_lightning()
    resumed = LitParity("blocks")
    _trainer(ShardedStrategy(), 1, 2).fit(resumed, _loader(1), ckpt_path=f"{path}/epoch1.ckpt")
    _check("resumed at W=1", resumed.losses, reference["losses"][len(reference["losses"]) // 2:])


def test_trainer_matches_single_process_lightning_and_resumes(tmp_path: Any) -> None:
    reference = _reference()
    run_distributed(_trainer_runs, 2, str(tmp_path), reference, timeout=300)
    run_distributed(_resume_alone, 1, str(tmp_path), reference, timeout=300)


# ---------------------------------------------------------------------------- Fabric
def _local_steps(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> List[float]:
    """One process, the combined batch: what Fabric's loop below computes."""
    data, losses = _data(), []
    for step in steps:
        for micro in range(ACCUMULATE):
            first = (step * ACCUMULATE + micro) % (SAMPLES // ROWS) * ROWS  # epochs over the same data
            rows = slice(first, first + ROWS)
            loss = loss_fn(model(data.tensors[0][rows]), data.tensors[1][rows])
            (loss / ACCUMULATE).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optim.step()
        optim.zero_grad()
    return losses


def _fabric_steps(fabric: Any, model: Any, optim: Any, steps: range) -> List[float]:
    data, losses = _data(), []
    rank, world_size = fabric.global_rank, fabric.world_size
    rows = ROWS // world_size
    for step in steps:
        for micro in range(ACCUMULATE):
            first = (step * ACCUMULATE + micro) % (SAMPLES // ROWS) * ROWS + rank * rows
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATE - 1):
                loss = loss_fn(model(data.tensors[0][first:first + rows]), data.tensors[1][first:first + rows])
                fabric.backward(loss / ACCUMULATE)
            losses.append(loss.item())
        fabric.clip_gradients(model, optim, max_norm=CLIP)
        optim.step()
        optim.zero_grad()
    return losses


def _fabric_model(fabric: Any) -> Any:
    model = make_model(0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    return fabric.setup(model, optim)


def _fabric_runs(path: str) -> None:
    from composable_shard.integrations.lightning import ShardedFabricStrategy

    _quiet()
    _join_as_lightning()
    world_size = dist.get_world_size()
    local = make_model(0)
    local_optim = torch.optim.SGD([p for p in local.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    expected = _local_steps(local, local_optim, range(4))
    fabric = L.Fabric(strategy=ShardedFabricStrategy(), accelerator="cpu", devices=world_size)
    fabric.launch()
    model, optim = _fabric_model(fabric)
    with record_collectives() as recorded:
        losses = _fabric_steps(fabric, model, optim, range(2))
    assert recorded.count("reduce_scatter") == 3 * 2, recorded.count("reduce_scatter")  # once per step and group
    fabric.save(f"{path}/fabric", {"model": model, "optim": optim, "step": 2, "note": "after two steps"})
    losses += _fabric_steps(fabric, model, optim, range(2, 4))
    _check("Fabric", _mean_over_ranks(losses), expected)
    resumed, resumed_optim = _fabric_model(fabric)
    state: Dict[str, Any] = {"model": resumed, "optim": resumed_optim, "step": 0}
    remainder = fabric.load(f"{path}/fabric", state)
    assert state["step"] == 2 and remainder == {"note": "after two steps"}, (state["step"], remainder)
    _check("Fabric resumed", _mean_over_ranks(_fabric_steps(fabric, resumed, resumed_optim, range(2, 4))), expected[4:])


def _fabric_model_parallel(path: str) -> None:
    """Fabric's ModelParallelStrategy with our fully_shard as its parallelize_fn: it trains, and
    ``fabric.save`` raises on every rank before anything is written, naming our strategy (its own
    check would have said the state holds no distributed model)."""
    _quiet()
    _join_as_lightning()

    def shard(model: nn.Module, mesh: Any) -> nn.Module:
        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)

    world_size = dist.get_world_size()
    fabric = L.Fabric(strategy=L.fabric.strategies.ModelParallelStrategy(shard, data_parallel_size=world_size,
                                                                         tensor_parallel_size=1),
                      accelerator="cpu", devices=world_size)
    fabric.launch()
    model = fabric.setup_module(make_model(0))
    optim = fabric.setup_optimizers(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR))
    losses = _fabric_steps(fabric, model, optim, range(1))
    assert len(losses) == ACCUMULATE
    for load in (False, True):
        with pytest.raises(RuntimeError, match="ModelParallelStrategy cannot checkpoint.*ShardedFabricStrategy"):
            if load:
                fabric.load(f"{path}/mp", {"model": model, "optim": optim})
            else:
                fabric.save(f"{path}/mp", {"model": model, "optim": optim})
    assert not os.path.exists(f"{path}/mp")


def test_fabric_model_parallel_strategy_is_refused_at_save(tmp_path: Any) -> None:
    run_distributed(_fabric_model_parallel, 2, str(tmp_path), timeout=240)


def test_fabric_matches_a_local_loop_and_resumes(tmp_path: Any) -> None:
    run_distributed(_fabric_runs, 2, str(tmp_path), timeout=240)
