"""fully_shard, replicate and checkpoint mixed on one model train exactly like single-process
training: (a) per-layer checkpoint + fully_shard and a root fully_shard, (b) a root replicate
over fully_shard layers, (c) a root fully_shard with a replicate submodule, (d) all three, (e)
checkpointed blocks under a root replicate (DDP with activation checkpointing), (f) checkpointed
blocks under a root fully_shard alone (a checkpointed block is no fully sharded one: its
parameters are the root's to gather and reduce).

Without these, a parameter reduced by two APIs (double averaging), by none (ranks drift), or
unsharded twice around a recomputation would go unnoticed: each API alone would still pass.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import checkpoint, fully_shard, replicate, unshard_params
from composable_shard._runtime.collectives import record_collectives
from composable_shard._runtime.traversal import _get_fsdp_handles
from tests._harness import run_distributed, run_subtests
from tests._models import (Named, assert_losses_close, assert_params_close, check_grads_each_step, distributed_training,
                           make_model, reference_training, zip_same)

STEPS = 4


class DropBlock(nn.Module):
    """A block with dropout, so recomputation must replay the RNG to stay exact."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 9)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(9, 6)
        self.forward_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_calls += 1
        return x + self.fc2(self.drop(torch.relu(self.fc1(x))))


def _compose_a(model: nn.Module) -> None:
    for block in model.blocks:
        checkpoint(block)
        fully_shard(block)
    fully_shard(model)


def _compose_a_reversed(model: nn.Module) -> None:
    for block in model.blocks:
        fully_shard(block)
        checkpoint(block)
    fully_shard(model)


def _compose_b(model: nn.Module) -> None:
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model.scale)
    replicate(model)


def _compose_c(model: nn.Module) -> None:
    replicate(model.scale)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def _compose_d(model: nn.Module) -> None:
    for block in model.blocks:
        checkpoint(block)
        fully_shard(block)
    replicate(model.scale)
    fully_shard(model)


def _compose_e(model: nn.Module) -> None:
    """DDP with activation checkpointing: the blocks checkpointed, the whole model replicated."""
    for block in model.blocks:
        checkpoint(block)
    replicate(model)


def _compose_f(model: nn.Module) -> None:
    """The blocks checkpointed, one fully_shard on the root: the blocks' parameters are the root's."""
    for block in model.blocks:
        checkpoint(block)
    fully_shard(model)


_RECIPES: Dict[str, Callable[[nn.Module], None]] = {
    "a": _compose_a, "a_reversed": _compose_a_reversed, "b": _compose_b, "c": _compose_c, "d": _compose_d,
    "e": _compose_e, "f": _compose_f}


def _full_named(model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    with unshard_params(model):
        return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def _compose_subtest(recipe: str) -> None:
    """AdamW steps (losses, final parameters) with the gradients of every backward compared
    too: Adam would hide a parameter averaged twice or not at all."""
    world_size = dist.get_world_size()
    reference = make_model()
    expected_grads: List[Named] = []
    expected_losses = reference_training(reference, STEPS, world_size, grads=expected_grads)
    model = make_model()
    _RECIPES[recipe](model)
    losses = distributed_training(model, STEPS, after_backward=check_grads_each_step(model, expected_grads, f"[{recipe}]"))
    assert_losses_close(losses, expected_losses, what=f"[{recipe}]")
    assert_params_close(_full_named(model), list(reference.named_parameters()), what=f"[{recipe}]")


def _checkpoint_with_fully_shard(order: str) -> None:
    """Same module: recomputation runs with unsharded parameters, the forward runs twice, the
    handle is all-gathered exactly twice per step (not again for recomputation), and gradients
    with dropout are identical to the same model without checkpoint."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    plain = nn.Sequential(DropBlock(), DropBlock())
    torch.manual_seed(0)
    ckpt = nn.Sequential(DropBlock(), DropBlock())
    for block in ckpt:
        if order == "checkpoint_first":
            checkpoint(block)
            fully_shard(block)
        else:
            fully_shard(block)
            checkpoint(block)
    fully_shard(ckpt)
    for block in plain:
        fully_shard(block)
    fully_shard(plain)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    for model in (plain, ckpt):
        torch.manual_seed(100 + rank)
        with record_collectives() as rec:
            model(x).pow(2).mean().backward()
        gathers = [r.tag for r in rec.records if r.kind == "all_gather"]
        assert sorted(h.fqn for h in _get_fsdp_handles(model) if h.fqn) == ["0", "1"]
        for fqn in ("0", "1"):  # gathered in forward and again in backward, not for the recomputation
            assert gathers.count(fqn) == (2 if dist.get_world_size() > 1 else 0), (order, fqn, gathers)
    assert [b.forward_calls for b in ckpt] == [2, 2], [b.forward_calls for b in ckpt]
    assert [b.forward_calls for b in plain] == [1, 1]
    with unshard_params(plain, with_grads=True):
        expected = [p.grad.clone() for p in plain.parameters()]
    with unshard_params(ckpt, with_grads=True):
        actual = [p.grad.clone() for p in ckpt.parameters()]
    for e, a in zip_same(expected, actual, what="gradients with and without checkpoint"):
        assert torch.equal(e, a), (e - a).abs().max()


def _errors() -> None:
    model = make_model()
    fully_shard(model.blocks[0])
    try:
        replicate(model.blocks[0])
    except RuntimeError as e:
        assert "fully_shard" in str(e)
    else:
        raise AssertionError("replicate on a fully_shard module must raise")
    replicate(model.scale)
    try:
        fully_shard(model.scale)
    except RuntimeError as e:
        assert "replicate" in str(e)
    else:
        raise AssertionError("fully_shard on a replicate module must raise")
    try:
        checkpoint(model.blocks[1], use_reentrant=True)
    except NotImplementedError:
        pass
    else:
        raise AssertionError("use_reentrant=True must raise NotImplementedError")


def _all() -> None:
    run_subtests(_compose_subtest, {"recipe": list(_RECIPES)})
    run_subtests(_checkpoint_with_fully_shard, {"order": ["checkpoint_first", "fully_shard_first"]})
    _errors()


@pytest.mark.parametrize("world_size", [2, 4])
def test_composition_matrix(world_size: int) -> None:
    """(a) checkpoint+fully_shard per layer (both call orders) + root fully_shard, (b) root
    replicate over fully_shard layers, (c) root fully_shard with a replicate submodule, (d) all
    three: losses, final parameters and every backward's gradients equal single-process
    training; checkpoint
    with fully_shard on one module recomputes without re-gathering; error cases raise."""
    run_distributed(_all, world_size, timeout=240)
