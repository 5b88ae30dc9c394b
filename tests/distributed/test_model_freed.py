"""A model the library was applied to is freed like a plain one once the user drops it (see
[Note: Hooks on tensors hold weakly] in ``_runtime/module_state.py``): nothing of the library keeps it,
its parameters or its flat shards alive after training steps."""

from __future__ import annotations

import gc
import weakref
from typing import Any, List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

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


def _kept_buffers_model() -> Tuple[nn.Module, torch.optim.Optimizer]:
    """SHARD_GRAD_OP (unsharded buffers kept from a grad-mode forward to its backward) with a
    fused AdamW (which moves no version counter: only the library's optimizer-step hook tells
    that the shards changed), trained one step."""
    model = make_model()
    for block in model.blocks:
        fully_shard(block, strategy=ShardingStrategy.SHARD_GRAD_OP)
    fully_shard(model, strategy=ShardingStrategy.SHARD_GRAD_OP)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    _step(model, optim, 0)
    return model, optim


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    inputs, targets = batch(step, world_size)
    loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank)).backward()
    optim.step()
    optim.zero_grad()


def _survivor_still_followed(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    """The models dropped and collected beside it took nothing of what a living model needs: a
    forward with grad on and no backward keeps its unsharded buffers, a fused step then updates
    the shards, and the next forward computes on the updated values (the same output as a
    forward that gathers from scratch). Had a dropped model's last reference removed torch's
    global hooks that the survivor still needs, the step would go unnoticed and that forward
    would compute on the parameters from before it."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    inputs, targets = (local_rows(t, rank) for t in batch(1, world_size))
    loss_fn(model(inputs), targets).backward()
    model(inputs).sum()  # grad on, no backward: the buffers are kept
    optim.step()  # fused: the shards change, no version counter moves
    optim.zero_grad()
    with torch.no_grad():
        after_step = model(inputs)
        from_scratch = model(inputs)  # the forward before freed every buffer: gathered anew
    assert torch.equal(after_step, from_scratch), \
        f"a forward after a fused step computed on stale parameters: {(after_step - from_scratch).abs().max().item()}"


def _freed() -> None:
    survivor, optim = _kept_buffers_model()
    run_subtests(_freed_subtest, {"kind": ["full_shard", "no_shard", "checkpoint", "mixed", "replicate"]})
    _survivor_still_followed(survivor, optim)


def test_dropped_models_are_freed() -> None:
    """fully_shard (FULL_SHARD, NO_SHARD, with checkpoint, with a replicated submodule) and
    replicate, W=2, two AdamW steps: after the model and optimizer go out of scope and one
    ``gc.collect()``, the model, its parameters and its flat shards are gone; a model that lived
    through all of it still has its optimizer steps followed (``_survivor_still_followed``)."""
    run_distributed(_freed, 2, timeout=120)
