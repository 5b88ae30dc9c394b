"""A model the library was applied to is freed like a plain one once the user drops it (see
[Note: Hooks on tensors hold weakly] in ``_runtime/module_state.py``): nothing of the library keeps it,
its parameters or its flat shards alive after training steps."""

from __future__ import annotations

import gc
import weakref
from typing import Any, List

import torch
import torch.distributed as dist

from composable_shard import ShardingStrategy, checkpoint, fully_shard, replicate
from tests._harness import run_distributed, run_subtests
from tests._models import batch, local_rows, loss_fn, make_model


def _train_and_drop(kind: str) -> List[Any]:
    """Build, apply ``kind``, train two steps; return weak references to what must be freed."""
    model = make_model()
    if kind == "replicate":
        replicate(model)
    else:
        strategy = ShardingStrategy.NO_SHARD if kind == "no_shard" else ShardingStrategy.FULL_SHARD
        for block in model.blocks:
            if kind == "checkpoint":
                checkpoint(block)
            fully_shard(block, strategy=strategy)
        if kind == "mixed":
            replicate(model.head)
        fully_shard(model, strategy=strategy)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for step in range(2):
        inputs, targets = batch(step, world_size)
        loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank)).backward()
        optim.step()
        optim.zero_grad()
    refs = [weakref.ref(model), weakref.ref(model.blocks[0])] + [weakref.ref(p) for p in model.parameters()]
    state = fully_shard.state(model) if kind != "replicate" else None
    if state is not None:
        refs += [weakref.ref(h.flat_param) for h in state._all_handles]
    return refs


def _freed_subtest(kind: str) -> None:
    refs = _train_and_drop(kind)
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"[{kind}] {len(alive)} of {len(refs)} objects still alive after del + gc.collect(): " \
                      f"{[type(o).__name__ for o in alive][:6]}"


def _freed() -> None:
    run_subtests(_freed_subtest, {"kind": ["full_shard", "no_shard", "checkpoint", "mixed", "replicate"]})


def test_dropped_models_are_freed() -> None:
    """fully_shard (FULL_SHARD, NO_SHARD, with checkpoint, with a replicated submodule) and
    replicate, W=2, two AdamW steps: after the model and optimizer go out of scope and one
    ``gc.collect()``, the model, its parameters and its flat shards are gone."""
    run_distributed(_freed, 2, timeout=120)
