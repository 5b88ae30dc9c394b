"""Small models and the single-process reference loop shared by distributed tests.

``ParityModel`` packs the cases that break naive sharding into one model: a tied
embedding/output weight, a frozen submodule, parameters whose numel is not divisible by 2 or 4
and a fully sharded module (``Scale``) with a single element (fewer elements than ranks).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 13
WIDTH = 6
SEQ = 5
BATCH_PER_RANK = 2


class Block(nn.Module):
    """LayerNorm -> Linear(6, 7) -> ReLU -> Linear(7, 6) with a residual (12 + 49 + 48 = 109 params)."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, width + 1)
        self.fc2 = nn.Linear(width + 1, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))


class Scale(nn.Module):
    """One learnable scalar: a handle of one element (smaller than any W > 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.tensor([1.25]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class ParityModel(nn.Module):
    """Embedding tied with the head, two Blocks, a frozen Linear, a Scale."""

    def __init__(self, num_blocks: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(num_blocks)])
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.scale = Scale()
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.scale(self.frozen(x))
        return self.head(x)


def make_model(seed: int = 0, num_blocks: int = 2) -> ParityModel:
    torch.manual_seed(seed)
    return ParityModel(num_blocks)


def batch(step: int, world_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step (inputs, targets): same on every rank, rank r uses rows
    ``[r * BATCH_PER_RANK, (r + 1) * BATCH_PER_RANK)``."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (world_size * BATCH_PER_RANK, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def local_rows(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


Named = List[Tuple[str, torch.Tensor]]


def make_optimizer(kind: str, params: Any, lr: float) -> torch.optim.Optimizer:
    """``"adamw"`` or ``"sgd"`` (plain: a wrong gradient scale moves the parameters, which
    Adam's normalisation would hide)."""
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    raise ValueError(f"unknown optimizer {kind!r}")


def reference_training(model: nn.Module, steps: int, world_size: int, lr: float = 1e-2, optimizer: str = "adamw",
                       grads: Optional[List[Named]] = None) -> List[float]:
    """Single-process training (AdamW unless ``optimizer="sgd"``) on the concatenated batch;
    returns the losses and leaves ``model`` trained. If ``grads`` is a list, the gradients of
    each step's backward are appended to it (what :func:`check_grads_each_step` compares with)."""
    optim = make_optimizer(optimizer, model.parameters(), lr)
    losses = []
    for step in range(steps):
        inputs, targets = batch(step, world_size)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        if grads is not None:
            grads.append([(n, p.grad.detach().clone()) for n, p in model.named_parameters() if p.grad is not None])
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def global_mean(loss: torch.Tensor) -> float:
    """The mean of ``loss`` over all ranks (one all-reduce)."""
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def distributed_training(model: nn.Module, steps: int, lr: float = 1e-2,
                         before_step: Callable[[int], None] = lambda step: None, optimizer: str = "adamw",
                         after_backward: Callable[[int], None] = lambda step: None) -> List[float]:
    """AdamW (or plain SGD) on each rank's rows; returns the global mean loss of each step.
    ``after_backward(step)`` runs between each backward and its optimizer step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    optim = make_optimizer(optimizer, model.parameters(), lr)
    losses = []
    for step in range(steps):
        before_step(step)
        inputs, targets = batch(step, world_size)
        loss = loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank))
        loss.backward()
        after_backward(step)
        optim.step()
        optim.zero_grad()
        losses.append(global_mean(loss))
    return losses


def sharded_adamw_run(model: nn.Module, steps: int, lr: float = 1e-2) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """``model`` (a ParityModel) with each block, ``scale`` and the root fully sharded, after
    ``steps`` AdamW steps at ``lr`` on each rank's rows: the same on every call."""
    from composable_shard import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model.scale)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        inputs, targets = batch(step, world_size)
        loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank)).backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def reference_grads(model: nn.Module, step: int, world_size: int) -> List[Tuple[str, torch.Tensor]]:
    """Gradients of one backward on the concatenated batch of ``step`` (no optimizer step)."""
    inputs, targets = batch(step, world_size)
    loss_fn(model(inputs), targets).backward()
    out = [(n, p.grad.detach().clone()) for n, p in model.named_parameters() if p.grad is not None]
    model.zero_grad()
    return out


def local_backward(model: nn.Module, step: int) -> None:
    """One backward on this rank's rows of ``step``'s batch (gradients left in place)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    inputs, targets = batch(step, world_size)
    loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank)).backward()


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def zip_same(*sequences: Sequence[Any], what: str = "") -> Iterator[Tuple[Any, ...]]:
    """``zip`` that first checks the lengths agree: a plain ``zip`` stops at the shorter list,
    so a parameter (or step) lost on one side would pass every check made on the pairs."""
    lengths = [len(s) for s in sequences]
    if len(set(lengths)) > 1:
        raise AssertionError(f"{what} lengths differ: {lengths}")
    return zip(*sequences)


def full_grads(model: nn.Module) -> Named:
    """Every parameter's full gradient (names in ``named_parameters()`` order; parameters
    without a gradient on any rank left out), read with ``unshard_params(with_grads=True,
    writeback=False)``: nothing is written back, so kept unsharded buffers stay as they were."""
    from composable_shard import unshard_params

    with unshard_params(model, with_grads=True, writeback=False):
        return [(n, p.grad.detach().clone()) for n, p in model.named_parameters() if p.grad is not None]


def check_grads_each_step(model: nn.Module, expected: List[Named], what: str = "",
                          atol: float = 1e-5) -> Callable[[int], None]:
    """An ``after_backward`` for :func:`distributed_training`: the full gradients after step
    ``step``'s backward equal ``expected[step]`` (from :func:`reference_training`)."""
    def check(step: int) -> None:
        assert_params_close(full_grads(model), expected[step], atol=atol, what=f"{what} step {step} grads")

    return check


def assert_grads_relative(actual: Named, expected: Named, rtol: float, what: str = "") -> None:
    """Per tensor, ``max |a - e| <= rtol * max |e|``: for low-precision gradients, whose error
    scales with their size. A gradient off by a factor ``k`` misses by ``|k - 1| * max |e|``,
    i.e. ``|k - 1| / rtol`` times the tolerance."""
    if [n for n, _ in actual] != [n for n, _ in expected]:
        raise AssertionError(f"{what} gradient names differ: {[n for n, _ in actual]} vs {[n for n, _ in expected]}")
    for (name, a), (_, e) in zip(actual, expected):
        if a.shape != e.shape:
            raise AssertionError(f"{what} {name}: grad shape {tuple(a.shape)} != {tuple(e.shape)}")
        scale = e.detach().float().abs().max().item() if e.numel() else 0.0
        diff = (a.detach().float() - e.detach().float()).abs().max().item() if a.numel() else 0.0
        if diff > rtol * scale:
            raise AssertionError(f"{what} {name}: max abs grad diff {diff} > {rtol} * max |grad| {scale}")


def assert_losses_close(actual: List[float], expected: List[float], atol: float = 1e-5, what: str = "") -> None:
    for step, (a, e) in enumerate(zip_same(actual, expected, what=f"{what} losses")):
        if abs(a - e) > atol:
            raise AssertionError(f"{what} step {step}: loss {a!r} != reference {e!r} (atol {atol})")


def assert_params_close(named_actual: List[Tuple[str, torch.Tensor]], named_expected: List[Tuple[str, torch.Tensor]],
                        atol: float = 1e-5, what: str = "") -> None:
    names_a = [n for n, _ in named_actual]
    names_e = [n for n, _ in named_expected]
    if names_a != names_e:
        raise AssertionError(f"{what} parameter names differ: {names_a} vs {names_e}")
    for (name, a), (_, e) in zip(named_actual, named_expected):
        if a.shape != e.shape:
            raise AssertionError(f"{what} {name}: shape {tuple(a.shape)} != {tuple(e.shape)}")
        diff = (a.detach().float() - e.detach().float()).abs().max().item() if a.numel() else 0.0
        if diff > atol:
            raise AssertionError(f"{what} {name}: max abs diff {diff} > {atol}")


class BackwardFailure(Exception):
    """The error :func:`arm_backward_failure` raises inside backward."""


def arm_backward_failure(module: nn.Module) -> List[bool]:
    """While the returned flag's ``[0]`` is True, the gradient reaching ``module``'s output (the
    first element of a tuple output) raises :class:`BackwardFailure`: by then backward has
    already reduced every handle after ``module`` in forward order."""
    armed = [True]

    def raise_in_backward(grad: torch.Tensor) -> torch.Tensor:
        raise BackwardFailure("user error in backward")

    def register(m: nn.Module, args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if armed[0] and hidden.requires_grad:
            hidden.register_hook(raise_in_backward)

    module.register_forward_hook(register)
    return armed


def expect_backward_failure(step: Callable[[], Any]) -> None:
    """Run ``step`` (forward and backward) and check that its backward raised the armed error."""
    try:
        step()
    except (BackwardFailure, RuntimeError) as e:
        assert "user error in backward" in str(e), e
    else:
        raise AssertionError("backward should have raised")
