"""A module whose parameters a fully sharded ancestor holds, called outside that ancestor's
forward and backward, raises a clear error on every rank instead of computing on its sharded
parameters.

Outside the owner's forward such a module's parameters are 1-D views of this rank's slice. A
2-D weight then fails inside torch with a shape error that names neither the module nor the
cause. Worse, a 1-D parameter whose slice on some rank is a single element broadcasts: that rank
computes a wrong result silently while the others fail (and later hang in a collective). The
models below are laid out so that this happens without the check (each test asserts the layout):
the root's ``scale.weight`` has one element on rank 1 at W=4 (which then returned ``x * 3``), and
block 0's has one element on rank 1 at W=2.
"""

from __future__ import annotations

from typing import Callable, List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import fully_shard, unshard_params
from tests._harness import run_distributed


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class _Net(nn.Module):
    """Flat parameter of the root: ``bias`` (2 elements), then ``scale.weight`` (3), then ``out``."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.tensor([0.5, -0.5]))
        self.scale = _Scale()
        self.out = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.scale(x)) + self.bias


def _make() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _raises(fn: Callable[[], object], *fragments: str) -> None:
    try:
        fn()
    except RuntimeError as e:
        for f in fragments:
            assert f in str(e), f"{f!r} not in message on rank {dist.get_rank()}: {e}"
    else:
        raise AssertionError(f"rank {dist.get_rank()}: expected a RuntimeError naming {fragments}")


def _slice_sizes(p: torch.Tensor) -> List[int]:
    """Every rank's number of elements of the sharded parameter ``p``."""
    sizes: List[int] = [0] * dist.get_world_size()
    dist.all_gather_object(sizes, p.numel())
    return sizes


def _state(model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def _called_while_sharded() -> None:
    model, reference = fully_shard(_make()), _make()
    x = torch.ones(4, 3)
    if dist.get_world_size() == 4:
        assert _slice_sizes(model.scale.weight) == [2, 1, 0, 0], _slice_sizes(model.scale.weight)
    before = _state(model)
    # Between steps, before any forward: every rank raises, naming the module and the owner.
    _raises(lambda: model.scale(x), "_Scale 'scale'", "fully_shard(<root>)", "has them sharded",
            "unshard_params(model), torch.no_grad()", "apply fully_shard to 'scale'")
    _raises(lambda: model.out(x), "Linear 'out'")
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(before, _state(model)))

    # A training step still gives local training's gradients (the failed calls built nothing).
    rows = torch.randn(2 * dist.get_world_size(), 3, generator=torch.Generator().manual_seed(1))
    mine = rows.view(dist.get_world_size(), 2, 3)[dist.get_rank()]
    model(mine).square().mean().backward()
    reference(rows).square().mean().backward()
    with unshard_params(model, with_grads=True):
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            assert p.grad is not None and torch.allclose(p.grad, q.grad, atol=1e-6), name  # type: ignore[arg-type]  # q.grad set by backward

    # After a forward with no backward to follow (no_grad frees the root at once): still sharded.
    with torch.no_grad():
        model(mine)
    _raises(lambda: model.scale(x), "has them sharded")

    # Inside unshard_params under no_grad the full parameters are used; with grad on it raises,
    # since the gradients would be dropped on exit.
    with unshard_params(model, writeback=False):
        with torch.no_grad():
            assert torch.equal(model.scale(x), x * torch.tensor([1.0, 2.0, 3.0]))
        _raises(lambda: model.scale(x), "grad enabled inside unshard_params", "torch.no_grad()")
    with unshard_params(model, writeback=False, rank0_only=True), torch.no_grad():
        if dist.get_rank() == 0:
            assert torch.equal(model.scale(x), x * torch.tensor([1.0, 2.0, 3.0]))
        else:
            _raises(lambda: model.scale(x), f"on rank {dist.get_rank()}", "rank0_only=True")


def _called_from_another_block() -> None:
    """A module registered in block 0 and also called, through a plain reference, from block
    1's forward, after block 0 resharded: raises naming block 0 as the owner."""
    torch.manual_seed(0)
    blocks = nn.Sequential(nn.Sequential(_Scale()), nn.Sequential(nn.Linear(3, 3)))
    borrowed = blocks[0][0]
    second = blocks[1]
    second.forward = lambda x: borrowed(second[0](x))  # type: ignore[method-assign]  # the pattern under test
    for block in blocks:
        fully_shard(block)
    fully_shard(blocks)
    assert _slice_sizes(borrowed.weight) == [2, 1], _slice_sizes(borrowed.weight)
    _raises(lambda: blocks(torch.ones(2, 3)), "_Scale '0.0'", "fully_shard(0)", "call '0' instead")


def test_module_called_while_its_owner_is_sharded_raises_on_every_rank() -> None:
    """W=1, 2, 4: a module of a fully sharded module called directly between steps, after a
    no-grad forward, or from another block's forward raises naming it and its owner (at W=2 and
    W=4 one rank would otherwise compute a wrong result silently); inside unshard_params under
    no_grad it computes on the full parameters; training is unaffected."""
    for world_size in (1, 2, 4):
        run_distributed(_called_while_sharded, world_size, timeout=120)
    run_distributed(_called_from_another_block, 2, timeout=120)
