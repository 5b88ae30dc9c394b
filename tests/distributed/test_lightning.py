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
save and load are refused before anything is written or read, naming the strategy to use, in the
unified and the standalone packages, for a user who never imported the integration.

Resuming is checked state by state: a checkpoint holds every kind of state Lightning users keep
(the model, two optimizers, an LR scheduler each, a Stateful object of the user's, plain values; for
Trainer also ``ModelCheckpoint``'s and a custom callback's state, the loops, epoch and global
step), and each is compared, exactly, with the uninterrupted run at the same point, before the
continued losses are (exactly). Losses alone miss a scheduler that comes back fresh: the LR it
set lives in the optimizer's ``param_groups``, so the next steps can agree for a while. The
collectives of every save and load are counted: a sharded save gathers nothing.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import os
import sys
import warnings
from collections import Counter
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import FSDPModule, fully_shard, replicate
from composable_shard._runtime.collectives import record_collectives
from tests._c10d_count import C10dCount
from tests._harness import run_distributed
from tests._models import SEQ, VOCAB, loss_fn, make_model, zip_same

L = pytest.importorskip("lightning", reason="the [lightning] extra (README's test command installs it)")

INTEGRATION = "composable_shard.integrations.lightning"  # imported by the ranks only where a test says so
CHECKS = "composable_shard.integrations._lightning_checks"  # what the entry point loads: the refusal, no Lightning
SAMPLES = 16         # one epoch: 4 micro-batches of 4 rows (2 per rank at W = 2), 2 optimizer steps
ROWS = 4             # rows of the combined batch
ACCUMULATE = 2
CLIP = 0.05          # below every step's gradient norm (checked), so clipping changes every update
LR = 0.5
ADAM_LR = 0.05
# The SGD optimizer's scheduler halves its LR when its count reaches a milestone (one count per
# optimizer step). Fabric saves after step 2 and Trainer after step 4 (epoch 0), both past the
# first milestone (so the LR saved differs from the initial one); a scheduler that comes back
# fresh reaches milestone 1 again one step after resuming, where the uninterrupted run does not.
# AdamW's multiplies its LR by ADAM_GAMMA every step, so its LR saved differs from the initial one.
MILESTONES = [1, 4]
ADAM_GAMMA = 0.9


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(77)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _quiet() -> None:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for module in ("lightning", "pytorch_lightning", "lightning_fabric"):
        warnings.filterwarnings("ignore", module=module)


def _join_as_lightning() -> None:
    """Tell Lightning the processes exist already (the harness made them and their group)."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size), RANK=str(rank))


class _ParityHooks:
    """The hooks of the parity module, for the unified package's ``LightningModule`` (:class:`LitParity`)
    and the standalone ``pytorch_lightning``'s: the parity model (tied embedding and head, a
    frozen linear, a one-element handle) under SGD with momentum (a wrong gradient scale or norm
    moves the parameters) and a step LR schedule (restored from checkpoints); ``layout`` is
    applied in ``configure_model``."""

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
        grads = [p.grad for p in self.parameters() if p.grad is not None]  # type: ignore[attr-defined]  # a LightningModule's
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)))  # torch's: global on sharded gradients

    def configure_optimizers(self) -> Any:
        optim = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR, momentum=0.9)  # type: ignore[attr-defined]  # a LightningModule's
        return [optim], [torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.8)]


class LitParity(_ParityHooks, L.LightningModule):
    """:class:`_ParityHooks` as a ``lightning.LightningModule``."""


def _trainer(strategy: Any, devices: int, epochs: int, lightning: Any = None) -> Any:
    lightning = lightning or L.pytorch
    return lightning.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=epochs,
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


# ---------------------------------------------------------------------------- every kind of state, exactly
class Tally:
    """A Stateful object of the user's (``state_dict`` / ``load_state_dict``): rows and batches seen.
    The same on every rank, as everything outside the model and optimizers must be: a checkpoint
    keeps rank 0's (Lightning's strategies save that part on rank 0, as the library's ``extra``)."""

    def __init__(self) -> None:
        self.rows = 0
        self.batches: List[int] = []

    def update(self, rows: int, batch: int) -> None:
        self.rows += rows
        self.batches.append(batch)

    def state_dict(self) -> Dict[str, Any]:
        return {"rows": self.rows, "batches": list(self.batches)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rows, self.batches = state["rows"], list(state["batches"])


def _two_optimizers(model: nn.Module) -> Tuple[torch.optim.Optimizer, torch.optim.Optimizer, List[Any]]:
    """SGD with momentum on the blocks, AdamW on the other trainable parameters (the root's
    handle), and a scheduler for each (see MILESTONES)."""
    blocks = {id(p) for p in model.blocks.parameters()}  # type: ignore[union-attr]  # a ParityModel
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in blocks]
    sgd = torch.optim.SGD(model.blocks.parameters(), lr=LR, momentum=0.9)  # type: ignore[union-attr]  # a ParityModel
    adamw = torch.optim.AdamW(rest, lr=ADAM_LR)
    return sgd, adamw, [torch.optim.lr_scheduler.MultiStepLR(sgd, milestones=MILESTONES, gamma=0.5),
                        torch.optim.lr_scheduler.ExponentialLR(adamw, gamma=ADAM_GAMMA)]


def _raw_optimizer(optim: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Fabric's wrapper (``.optimizer``), or ``optim`` itself."""
    inner = getattr(optim, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optim


def _copied(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _optimizer_state(optim: Any) -> Dict[str, Any]:
    """This rank's optimizer state, read from torch's own fields (not through ``state_dict``, which
    the library's hooks serve): each group's settings (LR included), each parameter's state in
    group order (momentum buffers, Adam's moments and step)."""
    optim = _raw_optimizer(optim)
    return {"param_groups": [{k: _copied(v) for k, v in group.items() if k != "params"} for group in optim.param_groups],
            "state": [{k: _copied(v) for k, v in optim.state[p].items()} if p in optim.state else {}
                      for group in optim.param_groups for p in group["params"]]}


def _model_state(model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """This rank's shard of every parameter (views of it, copied), by name."""
    return [(name, p.detach().clone()) for name, p in model.named_parameters()]


def _assert_same(where: str, actual: Any, expected: Any) -> None:
    """``actual`` equals ``expected`` exactly: tensors bitwise (dtype and shape too), containers
    key by key and item by item, anything else by ``==`` and type."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype and actual.shape == expected.shape \
            and torch.equal(actual, expected), f"{where}: {actual!r} != {expected!r}"
    elif isinstance(expected, Mapping):
        assert isinstance(actual, Mapping) and set(actual) == set(expected), \
            f"{where}: keys {sorted(map(str, actual))} != {sorted(map(str, expected))}"
        for key in expected:
            _assert_same(f"{where}[{key!r}]", actual[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), f"{where}: {type(actual).__name__} != {type(expected).__name__}"
        for index, (a, e) in enumerate(zip_same(actual, expected, what=where)):
            _assert_same(f"{where}[{index}]", a, e)
    else:
        assert type(actual) is type(expected) and actual == expected, f"{where}: {actual!r} != {expected!r}"


# ---------------------------------------------------------------------------- counting a save or a load
class _C10dCalls(C10dCount):
    """Besides C10dCount's kinds: every ``c10d`` operator by name (broadcasts and barriers too)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            self.calls[func.__name__.split(".")[0]] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


@contextlib.contextmanager
def _counting() -> Iterator[Dict[str, Counter]]:
    """Once the body is done: ``{"ours": the library's collectives by kind, "c10d": torch's c10d
    operators by name}`` issued by this thread in the body."""
    counts: Dict[str, Counter] = {}
    with record_collectives() as ours, _C10dCalls() as calls:
        yield counts
    counts["ours"] = Counter(record.kind for record in ours.records)
    counts["c10d"] = calls.calls


# What a save and a load cost at W = 2, worked out from the code they run (torch 2.13's
# distributed_c10d and checkpoint/utils.py, Lightning 2.6, this library), as c10d operators:
#   torch's object collectives  broadcast_object_list: the size, then the bytes; gather_object:
#                               all-gather of sizes, gather of bytes; scatter_object_list: broadcast
#                               of the largest size, scatter of bytes, scatter of sizes;
#                               all_gather_object: all-gather of sizes, then of bytes
#   dcp.save                    reduce_scatter("plan") = gather + scatter of objects, then
#                               all_reduce("write") = gather + broadcast of objects
#   dcp.load                    reduce_scatter("plan"), then all_gather("read") of objects
#   save_checkpoint (ours)      the steps since the last synced backward: one exchange (an all-gather,
#                               _allgather_base_); from_rank of rank 0's (empty) error: its size only; of
#                               the temporary path: size and bytes; of the (empty) publishing error: its
#                               size only; 4 broadcasts. Nothing gathered: it saves views of the shards,
#                               and so does Lightning's dump (lightning_module_state_dict,
#                               optimizer_state). A gathered model would add 4 all-gathers (2
#                               blocks, the root's trainable and frozen handles).
#   load_checkpoint (ours)      a transaction of 3 steps and its final agreement: 4 exchanges,
#                               each one all-gather of a flag (_allgather_base_)
#   strategy.broadcast          broadcast_object_list. A save broadcasts the path and whether it
#                               exists; replacing one also a token, then a barrier. A load
#                               broadcasts the path.
#   Trainer.save_checkpoint, fabric.save and fabric.load end with a barrier.
_BROADCAST_OBJECT = Counter({"broadcast_": 2})
_GATHER_OBJECT = Counter({"allgather_": 1, "gather_": 1})
_SCATTER_OBJECT = Counter({"broadcast_": 1, "scatter_": 2})
_ALL_GATHER_OBJECT = Counter({"allgather_": 2})
_DCP_SAVE = _GATHER_OBJECT + _SCATTER_OBJECT + _GATHER_OBJECT + _BROADCAST_OBJECT
_DCP_LOAD = _GATHER_OBJECT + _SCATTER_OBJECT + _ALL_GATHER_OBJECT
_BARRIER = Counter({"barrier": 1})
SAVE_OURS = Counter({"exchange": 1, "broadcast": 4})
LOAD_OURS = Counter({"exchange": 4})
SAVE_C10D = _BROADCAST_OBJECT + _BROADCAST_OBJECT + Counter({"_allgather_base_": 1, "broadcast_": 4}) + _DCP_SAVE + _BARRIER
REPLACING_SAVE_C10D = SAVE_C10D + _BROADCAST_OBJECT + _BARRIER
LOAD_C10D = _BROADCAST_OBJECT + Counter({"_allgather_base_": 4}) + _DCP_LOAD  # + fabric.load's barrier


def _assert_costs(what: str, counts: Dict[str, Counter], ours: Counter, c10d: Counter) -> None:
    assert counts["ours"] == ours and counts["c10d"] == c10d, \
        f"{what}: ours {dict(counts['ours'])} (expected {dict(ours)}), c10d {dict(counts['c10d'])} (expected {dict(c10d)})"


# ---------------------------------------------------------------------------- Trainer
def _model_parallel_refused(path: str, reference: Dict[str, List[float]]) -> None:
    """Lightning's ModelParallelStrategy, unified and standalone package, by a user who never
    imported the integration: it trains exactly; its save and its load raise before anything is
    written or read, naming ShardedStrategy (the entry point brings the refusal in)."""
    assert INTEGRATION not in sys.modules and CHECKS not in sys.modules, "the integration was imported before any Lightning code ran"
    world_size = dist.get_world_size()
    half = len(reference["losses"]) // 2
    standalone = importlib.import_module("pytorch_lightning")
    standalone_parity = type("StandaloneLitParity", (_ParityHooks, standalone.LightningModule), {})
    for name, lightning, module_cls in (("lightning", L.pytorch, LitParity),
                                        ("pytorch_lightning", standalone, standalone_parity)):
        def strategy() -> Any:
            return lightning.strategies.ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)

        module = module_cls("blocks")
        trainer = _trainer(strategy(), world_size, 1, lightning)
        trainer.fit(module, _loader(world_size))
        _check(f"{name}: ModelParallelStrategy", _mean_over_ranks(module.losses), reference["losses"][:half])
        with pytest.raises(RuntimeError, match="ModelParallelStrategy cannot checkpoint.*ShardedStrategy"):
            trainer.save_checkpoint(f"{path}/{name}_model_parallel.ckpt")
        assert not os.path.exists(f"{path}/{name}_model_parallel.ckpt"), name
        fresh = module_cls("blocks")
        with pytest.raises(RuntimeError, match="ModelParallelStrategy cannot checkpoint.*ShardedStrategy"):
            _trainer(strategy(), world_size, 1, lightning).fit(fresh, _loader(world_size), ckpt_path=f"{path}/any.ckpt")
        assert fresh.losses == [], name  # refused before training
    assert CHECKS in sys.modules and INTEGRATION not in sys.modules  # loaded by the entry point, for the refusal


class BatchCounter(L.Callback):
    """A callback with state of its own (Lightning saves ``state_dict`` under its ``state_key``)."""

    def __init__(self) -> None:
        self.batches = 0
        self.epochs_ended: List[int] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batches += 1

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self.epochs_ended.append(trainer.current_epoch)

    def state_dict(self) -> Dict[str, Any]:
        return {"batches": self.batches, "epochs_ended": list(self.epochs_ended)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.batches, self.epochs_ended = state_dict["batches"], list(state_dict["epochs_ended"])


class LitKeeper(L.LightningModule):
    """Every kind of state a Lightning user keeps: the model, two optimizers (manual optimization:
    Lightning steps several only so), their LR schedulers, a Stateful object of the user's and a
    plain value (both through ``on_save_checkpoint`` / ``on_load_checkpoint``)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model = make_model(0)
        self.tally = Tally()
        self.note = "fresh"
        self.losses: List[float] = []

    def configure_model(self) -> None:
        if isinstance(self.model, FSDPModule):
            return
        for block in self.model.blocks:
            fully_shard(block)
        fully_shard(self.model)

    def configure_optimizers(self) -> Any:
        sgd, adamw, schedulers = _two_optimizers(self.model)
        return [sgd, adamw], schedulers

    def training_step(self, batch: Any, batch_idx: int) -> None:
        inputs, targets = batch
        loss = loss_fn(self.model(inputs), targets)
        self.manual_backward(loss)
        optimizers = self.optimizers()
        for optim in optimizers:
            optim.step()
        for optim in optimizers:
            optim.zero_grad()
        for scheduler in self.lr_schedulers():
            scheduler.step()
        self.tally.update(len(inputs), batch_idx)
        self.note = f"{self.tally.rows} rows"
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)  # what ModelCheckpoint watches
        self.losses.append(loss.item())

    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        checkpoint["tally"] = self.tally.state_dict()
        checkpoint["note"] = self.note

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        self.tally.load_state_dict(checkpoint["tally"])
        self.note = checkpoint["note"]


# Lightning's own ModelCheckpoint.load_state_dict (2.6) does not restore ``current_score`` (the
# last score seen): a resumed run has None until its next save, whatever the strategy.
_NOT_RESTORED_BY_LIGHTNING = {"ModelCheckpoint": ("current_score",)}


def _trainer_state(trainer: Any, module: LitKeeper) -> Dict[str, Any]:
    """Everything a resumed Trainer must have back, on this rank."""
    callbacks = {}
    for callback in trainer.callbacks:
        state = callback.state_dict()
        if state:
            skipped = _NOT_RESTORED_BY_LIGHTNING.get(type(callback).__name__, ())
            callbacks[callback.state_key] = {k: _copied(v) for k, v in state.items() if k not in skipped}
    return {"model": _model_state(module.model),
            "optimizers": [_optimizer_state(optim) for optim in trainer.optimizers],
            "schedulers": [_copied(config.scheduler.state_dict()) for config in trainer.lr_scheduler_configs],
            "tally": module.tally.state_dict(), "note": module.note, "callbacks": callbacks,
            "epoch": trainer.current_epoch, "global_step": trainer.global_step,
            "loops": _copied(trainer.fit_loop.state_dict())}


class Snapshot(L.Callback):
    """Takes :func:`_trainer_state` when epoch ``epoch`` starts (the point a checkpoint saved at
    the end of the epoch before resumes at)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.taken: Optional[Dict[str, Any]] = None

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        if trainer.current_epoch == self.epoch:
            self.taken = _trainer_state(trainer, module)


def _keeper_trainer(strategy: Any, world_size: int, path: str, callbacks: List[Any]) -> Any:
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=f"{path}/keeper", filename="{epoch}",
                                                      monitor="train_loss", mode="min", save_top_k=-1)
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_epochs=2, logger=False,
                     callbacks=[*callbacks, checkpoints], enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, use_distributed_sampler=False)


def _trainer_keeps_every_state(path: str, counted_strategy: Any) -> None:
    """Two epochs uninterrupted; then a fresh Trainer resumed from ModelCheckpoint's epoch-0
    checkpoint has, when epoch 1 starts, exactly the uninterrupted run's model, optimizers,
    scheduler, user state, callbacks' state, loops, epoch and global step, and continues to
    exactly its losses. Counts the collectives of a save and of the resume's load."""
    world_size = dist.get_world_size()
    uninterrupted, snapshot = LitKeeper(), Snapshot(epoch=1)
    trainer = _keeper_trainer(counted_strategy(), world_size, path, [BatchCounter(), snapshot])
    trainer.fit(uninterrupted, _loader(world_size))
    with _counting() as save:
        trainer.save_checkpoint(f"{path}/keeper_final.ckpt")
    resumed, resumed_snapshot = LitKeeper(), Snapshot(epoch=1)
    resumed_trainer = _keeper_trainer(counted_strategy(), world_size, path, [BatchCounter(), resumed_snapshot])
    resumed_trainer.fit(resumed, _loader(world_size), ckpt_path=f"{path}/keeper/epoch=0.ckpt")
    assert snapshot.taken is not None and resumed_snapshot.taken is not None
    # the resume point: 4 steps, both milestones passed (the LR saved is not the initial one)
    assert snapshot.taken["schedulers"][0]["last_epoch"] == 4 and snapshot.taken["epoch"] == 1, snapshot.taken
    lrs = [optim["param_groups"][0]["lr"] for optim in snapshot.taken["optimizers"]]
    assert lrs[0] == LR / 4 and lrs[1] < ADAM_LR, lrs
    callbacks = snapshot.taken["callbacks"]  # both callbacks hold state worth restoring
    assert [state["batches"] for key, state in callbacks.items() if key == "BatchCounter"] == [4] \
        and any(state.get("best_k_models") for state in callbacks.values()), callbacks
    _assert_same("Trainer resumed", resumed_snapshot.taken, snapshot.taken)
    assert resumed.losses == uninterrupted.losses[len(uninterrupted.losses) // 2:], (resumed.losses, uninterrupted.losses)
    _assert_costs("trainer.save_checkpoint", save, SAVE_OURS, SAVE_C10D)
    assert len(resumed_trainer.strategy.loads) == 1, resumed_trainer.strategy.loads
    _assert_costs("Trainer's resume (load_checkpoint)", resumed_trainer.strategy.loads[0], LOAD_OURS, LOAD_C10D)


def _counted_sharded_strategy() -> Any:
    """ShardedStrategy, recording what each ``load_checkpoint`` (a resume's reading) costs."""
    from composable_shard.integrations.lightning import ShardedStrategy

    class CountedShardedStrategy(ShardedStrategy):  # type: ignore[misc, valid-type]  # Lightning's class, untyped
        def __init__(self) -> None:
            super().__init__()
            self.loads: List[Dict[str, Counter]] = []

        def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
            with _counting() as counts:
                extra = super().load_checkpoint(checkpoint_path, weights_only)
            self.loads.append(counts)
            return extra  # type: ignore[no-any-return]  # ShardedStrategy's

    return CountedShardedStrategy


def _trainer_runs(path: str, reference: Dict[str, List[float]]) -> None:
    """At W = 2: ModelParallelStrategy refused (before anything imports the integration);
    ShardedStrategy against single-process Lightning, reductions counted, a checkpoint after
    epoch 1 resumed to the uninterrupted losses; every kind of state kept exactly."""
    _quiet()
    _join_as_lightning()
    _model_parallel_refused(path, reference)
    from composable_shard.integrations.lightning import ShardedStrategy

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
    with _counting() as fresh_save:
        trainer.save_checkpoint(f"{path}/epoch1.ckpt")
    with _counting() as replacing_save:
        trainer.save_checkpoint(f"{path}/epoch1.ckpt")  # replaces it (ModelCheckpoint's last.ckpt does that)
    _assert_costs("trainer.save_checkpoint", fresh_save, SAVE_OURS, SAVE_C10D)
    _assert_costs("trainer.save_checkpoint replacing a checkpoint", replacing_save, SAVE_OURS, REPLACING_SAVE_C10D)
    resumed = LitParity("blocks")
    _trainer(ShardedStrategy(), world_size, 2).fit(resumed, _loader(world_size), ckpt_path=f"{path}/epoch1.ckpt")
    half = len(reference["losses"]) // 2
    _check("resumed at W=2", _mean_over_ranks(resumed.losses), reference["losses"][half:])
    assert resumed.trainer.lr_scheduler_configs[0].scheduler.last_epoch == 2  # one per epoch, restored at 1
    _trainer_keeps_every_state(path, _counted_sharded_strategy())
    # "true" half precision casts the parameters, which are views of the shards: refused at setup, on every
    # rank, before a step, the shards left float32 (MixedPrecision or "bf16-mixed" is the way); "16-true" is
    # the same plugin class (Fabric's case below takes it)
    for precision in ("bf16-true",):
        module = LitParity("blocks")
        trainer = L.pytorch.Trainer(strategy=ShardedStrategy(), accelerator="cpu", devices=world_size, max_epochs=1,
                                    precision=precision, logger=False, enable_checkpointing=False,
                                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                    use_distributed_sampler=False)
        with pytest.raises(ValueError, match="casts the model's parameters"):
            trainer.fit(module, _loader(world_size))
        assert module.losses == [], precision
        assert {p.dtype for p in module.parameters()} == {torch.float32}, precision


def _resume_alone(path: str, reference: Dict[str, List[float]]) -> None:
    from composable_shard.integrations.lightning import ShardedStrategy

    _quiet()
    _join_as_lightning()
    resumed = LitParity("blocks")
    _trainer(ShardedStrategy(), 1, 2).fit(resumed, _loader(1), ckpt_path=f"{path}/epoch1.ckpt")
    _check("resumed at W=1", resumed.losses, reference["losses"][len(reference["losses"]) // 2:])
    # Replacing a checkpoint (ModelCheckpoint's last.ckpt) with one rank: that rank does it too.
    before = torch.load(os.path.join(path, "epoch1.ckpt", "extra.pt"), weights_only=False)["global_step"]
    resumed.trainer.save_checkpoint(f"{path}/epoch1.ckpt")
    after = torch.load(os.path.join(path, "epoch1.ckpt", "extra.pt"), weights_only=False)["global_step"]
    assert before < after == resumed.trainer.global_step, (before, after, resumed.trainer.global_step)
    assert [n for n in os.listdir(path) if n.startswith("epoch1.ckpt.")] == [], os.listdir(path)  # nothing beside it


def test_trainer_matches_single_process_lightning_and_resumes(tmp_path: Any) -> None:
    """Without it: a strategy that reduces every micro-batch, clips by a rank's own norm, loses
    any one kind of state at resume (an optimizer's moments, the scheduler's count or the LR it
    set, a callback's state, the loops), gathers the whole model at every checkpoint, or lets
    Lightning's ModelParallelStrategy save a checkpoint it cannot load, all pass unnoticed."""
    reference = _reference()
    run_distributed(_trainer_runs, 2, str(tmp_path), reference, timeout=300)
    run_distributed(_resume_alone, 1, str(tmp_path), reference, timeout=300)


# ---------------------------------------------------------------------------- Fabric
def _local_steps(model: nn.Module, steps: range) -> List[float]:
    """One process, the combined batch: what Fabric's loop below computes (fresh optimizers and
    schedulers, the same as :class:`_FabricRun`'s)."""
    sgd, adamw, schedulers = _two_optimizers(model)
    data, losses = _data(), []
    for step in steps:
        for micro in range(ACCUMULATE):
            first = (step * ACCUMULATE + micro) % (SAMPLES // ROWS) * ROWS  # epochs over the same data
            rows = slice(first, first + ROWS)
            loss = loss_fn(model(data.tensors[0][rows]), data.tensors[1][rows])
            (loss / ACCUMULATE).backward()
            losses.append(loss.item())
        for optim in (sgd, adamw):  # Fabric clips each optimizer's parameters by their own norm
            torch.nn.utils.clip_grad_norm_([p for group in optim.param_groups for p in group["params"]], CLIP)
        for optim in (sgd, adamw):
            optim.step()
            optim.zero_grad()
        for scheduler in schedulers:
            scheduler.step()
    return losses


class _FabricRun:
    """One Fabric training run's objects: the model, its two optimizers, their schedulers, the
    user's Tally (set up through ``fabric.setup``), and a plain module the user keeps beside the
    model (updated every step, the same on every rank: an EMA-like module that Fabric's checkpoint
    holds as one more stateful object, not a second model)."""

    def __init__(self, fabric: Any) -> None:
        model = make_model(0)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        sgd, adamw, (self.sgd_schedule, self.adamw_schedule) = _two_optimizers(model)
        self.model, self.sgd, self.adamw = fabric.setup(model, sgd, adamw)
        self.tally = Tally()
        self.ema = nn.Linear(2, 2)
        with torch.no_grad():
            self.ema.weight.zero_()
            self.ema.bias.zero_()
        self.fabric = fabric

    def steps(self, steps: range) -> List[float]:
        fabric, data, losses = self.fabric, _data(), []
        rank, world_size = fabric.global_rank, fabric.world_size
        rows = ROWS // world_size
        for step in steps:
            for micro in range(ACCUMULATE):
                first = (step * ACCUMULATE + micro) % (SAMPLES // ROWS) * ROWS + rank * rows
                with fabric.no_backward_sync(self.model, enabled=micro < ACCUMULATE - 1):
                    loss = loss_fn(self.model(data.tensors[0][first:first + rows]), data.tensors[1][first:first + rows])
                    fabric.backward(loss / ACCUMULATE)
                losses.append(loss.item())
                self.tally.update(rows, step * ACCUMULATE + micro)
            for optim in (self.sgd, self.adamw):  # each optimizer's parameters, by their norm
                fabric.clip_gradients(self.model, optim, max_norm=CLIP)
            for optim in (self.sgd, self.adamw):
                optim.step()
                optim.zero_grad()
            self.sgd_schedule.step()
            self.adamw_schedule.step()
            with torch.no_grad():
                self.ema.weight.add_(step + 1.0)  # the same on every rank, as the model is
                self.ema.bias.add_(1.0)
        return losses

    def checkpoint_state(self, **values: Any) -> Dict[str, Any]:
        """What ``fabric.save`` / ``fabric.load`` get: the objects, and ``values`` (plain)."""
        return {"model": self.model, "sgd": self.sgd, "adamw": self.adamw, "sgd_schedule": self.sgd_schedule,
                "adamw_schedule": self.adamw_schedule, "tally": self.tally, "ema": self.ema, **values}

    def state(self) -> Dict[str, Any]:
        """Everything a resumed run must have back, on this rank."""
        return {"model": _model_state(self.model), "sgd": _optimizer_state(self.sgd),
                "adamw": _optimizer_state(self.adamw), "sgd_schedule": _copied(self.sgd_schedule.state_dict()),
                "adamw_schedule": _copied(self.adamw_schedule.state_dict()), "tally": self.tally.state_dict(),
                "ema": _copied(self.ema.state_dict())}


def _fabric_runs(path: str) -> None:
    """At W = 2: Fabric's loop against a local one (two optimizers and schedulers, accumulation,
    clipping), reductions counted; a checkpoint of every kind of state after step 2, loaded into
    fresh objects, equals the uninterrupted run's state there exactly and continues to exactly
    its losses; the save's and the load's collectives counted; then the same checkpoint loaded
    with and without ``strict`` (``_loads_by_strictness``)."""
    from composable_shard.integrations.lightning import ShardedFabricStrategy

    _quiet()
    _join_as_lightning()
    world_size = dist.get_world_size()
    expected = _local_steps(make_model(0), range(4))
    fabric = L.Fabric(strategy=ShardedFabricStrategy(), accelerator="cpu", devices=world_size)
    fabric.launch()
    run = _FabricRun(fabric)
    with record_collectives() as recorded:
        losses = run.steps(range(2))
    assert recorded.count("reduce_scatter") == 3 * 2, recorded.count("reduce_scatter")  # once per step and group
    with _counting() as save:
        fabric.save(f"{path}/fabric", run.checkpoint_state(step=2, note="after two steps"))
    saved = run.state()
    assert saved["sgd_schedule"]["last_epoch"] == 2 and saved["sgd"]["param_groups"][0]["lr"] == LR / 2, saved
    assert saved["adamw"]["param_groups"][0]["lr"] < ADAM_LR, saved["adamw"]
    losses += run.steps(range(2, 4))
    _check("Fabric", _mean_over_ranks(losses), expected)
    resumed = _FabricRun(fabric)
    state = resumed.checkpoint_state(step=0)
    with _counting() as load:
        remainder = fabric.load(f"{path}/fabric", state)
    assert state["step"] == 2 and remainder == {"note": "after two steps"}, (state["step"], remainder)
    _assert_same("Fabric resumed", resumed.state(), saved)
    resumed_losses = resumed.steps(range(2, 4))
    assert resumed_losses == losses[4:], (resumed_losses, losses[4:])  # same ranks, same state: bitwise
    _assert_costs("fabric.save", save, SAVE_OURS, SAVE_C10D)
    _assert_costs("fabric.load", load, LOAD_OURS, LOAD_C10D + _BARRIER)
    _loads_by_strictness(fabric, f"{path}/fabric", saved)
    # "true" half precision casts the parameters, views of the shards: refused at launch, with what to use instead
    # (fabric.setup casts before the strategy sees the module)
    for precision in ("16-true",):  # the Trainer's case above takes "bf16-true"
        half = L.Fabric(strategy=ShardedFabricStrategy(), accelerator="cpu", devices=world_size, precision=precision)
        with pytest.raises(ValueError, match=r"casts the model's parameters.*MixedPrecision\(param_dtype"):
            half.launch()


def _loads_by_strictness(fabric: Any, path: str, saved: Dict[str, Any]) -> None:
    """The checkpoint of ``_fabric_runs`` (``step=2, note=...``; ``saved``: the run's state then)
    loaded with ``strict=False`` into fresh objects by a state that also asks for ``best_loss``,
    which the checkpoint lacks (listed before ``step``: the keys after it load too), and holds
    the optimizers under other keys (in the same order): the model, both optimizers, the
    schedulers, the tally and ``step`` equal ``saved``, ``best_loss`` keeps its value and what
    the state did not ask for comes back (as Lightning's FSDPStrategy returns the checkpoint's
    unrequested metadata). With ``strict=True`` each of the two raises KeyError naming it."""
    run = _FabricRun(fabric)
    objects = run.checkpoint_state()
    renamed = {"model": objects["model"], "adam": objects["adamw"], "momentum": objects["sgd"],
               **{key: objects[key] for key in ("sgd_schedule", "adamw_schedule", "tally", "ema")}}
    lenient = {**renamed, "best_loss": 9.0, "step": 0}
    remainder = fabric.load(path, lenient, strict=False)
    assert (lenient["step"], lenient["best_loss"], remainder) == (2, 9.0, {"note": "after two steps"}), \
        (lenient["step"], lenient["best_loss"], remainder)
    _assert_same("Fabric loaded with strict=False", run.state(), saved)
    for state, named in ((run.checkpoint_state(best_loss=9.0, step=0), "'best_loss'"),
                         ({**renamed, "step": 0}, r"optimizers are \['adamw', 'sgd'\].*\['adam', 'momentum'\]")):
        with pytest.raises(KeyError, match=named):
            fabric.load(path, state, strict=True)


def _fabric_model_parallel(path: str) -> None:
    """Fabric's ModelParallelStrategy (unified and standalone package) with our fully_shard as its
    parallelize_fn, by a user who never imported the integration: it trains, and ``fabric.save``
    and ``fabric.load`` raise on every rank before anything is written, naming our strategy (its
    own check would have said the state holds no distributed model)."""
    assert INTEGRATION not in sys.modules and CHECKS not in sys.modules, "the integration was imported before any Lightning code ran"
    _quiet()
    _join_as_lightning()

    def shard(model: nn.Module, mesh: Any) -> nn.Module:
        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)

    world_size = dist.get_world_size()
    for name, lightning in (("lightning", L.fabric), ("lightning_fabric", importlib.import_module("lightning_fabric"))):
        fabric = lightning.Fabric(strategy=lightning.strategies.ModelParallelStrategy(shard, data_parallel_size=world_size,
                                                                                      tensor_parallel_size=1),
                                  accelerator="cpu", devices=world_size)
        fabric.launch()
        model = fabric.setup_module(make_model(0))
        optim = fabric.setup_optimizers(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR))
        data = _data()
        for micro in range(ACCUMULATE):
            loss = loss_fn(model(data.tensors[0][micro:micro + 1]), data.tensors[1][micro:micro + 1])
            fabric.backward(loss)
        optim.step()
        for load in (False, True):
            with pytest.raises(RuntimeError, match="ModelParallelStrategy cannot checkpoint.*ShardedFabricStrategy"):
                if load:
                    fabric.load(f"{path}/{name}_mp", {"model": model, "optim": optim})
                else:
                    fabric.save(f"{path}/{name}_mp", {"model": model, "optim": optim})
        assert not os.path.exists(f"{path}/{name}_mp"), name
    assert CHECKS in sys.modules and INTEGRATION not in sys.modules  # loaded by the entry point, for the refusal


def test_fabric_model_parallel_strategy_is_refused_at_save(tmp_path: Any) -> None:
    """Without it: Fabric's ModelParallelStrategy (either package) saving or loading our model
    fails with Lightning's message that blames the caller ("no distributed model") instead of
    naming the strategy that works, and a refusal that fires only once the user imported the
    integration goes unnoticed (the users it is for never import it)."""
    run_distributed(_fabric_model_parallel, 2, str(tmp_path), timeout=240)


def test_fabric_matches_a_local_loop_and_resumes(tmp_path: Any) -> None:
    """Without it: ``fabric.load`` handing back a scheduler or a Stateful object unrestored, a
    second optimizer's state or an optimizer's LR not restored, or a save that gathers the model,
    all pass (losses alone agree for steps after such a resume); and ``strict=False`` refusing a
    requested key the checkpoint lacks or optimizers under other keys, or ``strict=True``
    accepting either, go unnoticed."""
    run_distributed(_fabric_runs, 2, str(tmp_path), timeout=240)
