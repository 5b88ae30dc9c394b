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
    _raises(lambda: model.scale.forward(x), "_Scale 'scale'", "has them sharded")  # a direct forward call too
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

    # Inside the owner's forward the module is called as any other (no guard: torch's fast path,
    # [Note: Calls while sharded]); a forward the user sets on it between steps is kept and used,
    # and calls while sharded still raise.
    guarded: List[bool] = []
    seen = model.scale.register_forward_pre_hook(lambda m, args: guarded.append("forward" in m.__dict__))
    model(mine)
    seen.remove()
    assert guarded == [False], guarded
    calls: List[int] = []
    model.scale.forward = lambda t: (calls.append(1), _Scale.forward(model.scale, t))[1]  # type: ignore[method-assign]
    users = model.scale.__dict__["forward"]
    with torch.no_grad():
        assert torch.allclose(model(mine), reference(mine)), "the user's forward computed something else"
    assert calls == [1] and model.scale.__dict__.get("forward") is users, "the user's forward was not kept"
    _raises(lambda: model.scale(x), "has them sharded")
    assert calls == [1], "the user's forward ran on sharded parameters"

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


# ---------------------------------------------------------------------------- parameters read, not called
class _Gain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.tensor([1.5, 0.5]))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.g


class _Reader(nn.Module):
    """``mode`` says how the forward uses ``gain``: ``"read"`` computes on ``gain.g`` without
    calling ``gain`` (the bug), ``"call"`` calls it, ``"describe"`` calls it and also reads only
    what describes ``gain.g`` (dtype, device, shape, requires_grad, ``x.to(g)``, ``g.new_zeros``),
    ``"decay"`` adds a sum over every parameter to the output inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 2)
        self.gain = _Gain()
        self.mode = "read"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        g = self.gain.g
        if self.mode == "read":
            return h * g
        if self.mode == "cast":  # as a mixed-precision forward casts a weight
            return h * g.to(h.dtype)
        if self.mode == "detached":
            return h * g.detach()
        out = self.gain(h)
        if self.mode == "describe":
            assert g.dtype == torch.float32 and g.device == h.device and g.requires_grad and g.dim() == 1
            assert g.is_floating_point() and g.numel() == g.shape[0] == g.size(0)
            out = out + h.to(g) * 0 + h.type_as(g) * 0 + g.new_zeros(2)
        if self.mode == "decay":
            out = out + sum((p ** 2).sum() for p in self.parameters())
        return out


def _reader(mode: str) -> Tuple[_Reader, _Reader]:
    torch.manual_seed(0)
    local = _Reader()
    torch.manual_seed(0)
    model = _Reader()
    fully_shard(model.l1)
    fully_shard(model.gain)
    fully_shard(model)
    model.mode = local.mode = mode
    return local, model


def _read_in_forward() -> None:
    """A parent's forward computing on a separately fully sharded child's parameter (on rank 1
    at W=2 its slice has one element and broadcast: a wrong loss, 1.758 against 1.283 in a
    user's trial), or on a cast or a detached view of it, raises on every rank in the first forward without grad
    and again in the first with grad, naming the parameter and its owner; the model is left as
    it was, its slots hold the original parameters again after each forward, and it trains as
    one process once the forward calls the child, with reads of what describes the parameter
    allowed in the first forwards of both kinds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = torch.randn(3 * world, 4, generator=torch.Generator().manual_seed(1))
    mine = rows.view(world, 3, 4)[rank]
    for mode in ("read", "cast", "detached"):
        local, model = _reader(mode)
        assert _slice_sizes(model.gain.g)[1] == 1 or world == 4, _slice_sizes(model.gain.g)  # the broadcasting slice
        before = _state(model)
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                _raises(lambda: model(mine), "parameter 'gain.g'", "fully_shard(gain)", "has it sharded",
                        "call that module instead")
            assert [n for n, _ in before] == [n for n, _ in _state(model)]
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(before, _state(model)))
            assert type(model.gain.g) is nn.Parameter and model.gain.g is dict(model.named_parameters())["gain.g"]
    local, model = _reader("describe")
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    local_optim = torch.optim.SGD(local.parameters(), lr=0.1)
    held = lambda: type(model.gain.g) is nn.Parameter and model.gain.g is optim.param_groups[0]["params"][2]  # noqa: E731
    with torch.no_grad():
        torch.testing.assert_close(model(mine), local(rows).view(world, 3, 2)[rank], atol=1e-6, rtol=1e-6)
    assert held()  # the original parameters are back as soon as a forward ends, not at the next reshard
    for _ in range(2):
        out = model(mine)
        assert held()
        out.square().mean().backward()
        local(rows).square().mean().backward()
        optim.step()
        local_optim.step()
        optim.zero_grad()
        local_optim.zero_grad()
        assert held()
    with unshard_params(model):
        for (name, p), (_, q) in zip(model.named_parameters(), local.named_parameters()):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6, msg=name)


def _decay_inside_and_after() -> None:
    """A sum over every parameter inside the forward (each sharded one a slice) is refused, and
    the message says where it belongs; after the forward the same sum over the slices gives one
    process's gradients exactly (each element's gradient lands on the rank that owns it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = torch.randn(3 * world, 4, generator=torch.Generator().manual_seed(2))
    mine = rows.view(world, 3, 4)[rank]
    local, model = _reader("decay")
    _raises(lambda: model(mine), "was used in a computation", "belongs after the forward")
    model.mode = local.mode = "call"
    decay = lambda m: 0.05 * sum((p ** 2).sum() for p in m.parameters())  # noqa: E731
    (model(mine).square().mean() + decay(model)).backward()
    (local(rows).square().mean() + decay(local)).backward()
    with unshard_params(model, with_grads=True):
        for (name, p), (_, q) in zip(model.named_parameters(), local.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-6, msg=name)


def _hook_after_fully_shard(hook_first: bool) -> None:
    """A forward hook adding a penalty on a fully sharded block's weight: registered after
    fully_shard it ran after the block resharded and saw this rank's slice (gradients 5.5e-2
    off in a user's trial), and now raises naming the weight and the remedy; registered
    before, it sees the full weight and training equals one process's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = torch.randn(3 * world, 4, generator=torch.Generator().manual_seed(3))
    mine = rows.view(world, 3, 4)[rank]

    def penalty(module: nn.Module, args: object, out: torch.Tensor) -> torch.Tensor:
        return out + 0.05 * module.weight.pow(2).sum()

    torch.manual_seed(0)
    local = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    local[0].register_forward_hook(penalty)
    if hook_first:
        model[0].register_forward_hook(penalty)
    fully_shard(model[0])
    fully_shard(model)
    if not hook_first:
        model[0].register_forward_hook(penalty)
        _raises(lambda: model(mine), "parameter '0.weight'", "fully_shard(0)", "register the hook before fully_shard")
        return
    model(mine).square().mean().backward()
    local(rows).square().mean().backward()
    with unshard_params(model, with_grads=True):
        for (name, p), (_, q) in zip(model.named_parameters(), local.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-6, msg=name)


def _reads_at_2() -> None:
    _read_in_forward()
    _decay_inside_and_after()
    _hook_after_fully_shard(hook_first=False)
    _hook_after_fully_shard(hook_first=True)


def test_sharded_parameter_read_in_forward_raises_on_every_rank() -> None:
    """W=2 and W=4: a sharded parameter computed on in the model's forward outside its own
    module's forward (a parent reading a child's parameter, a forward hook registered after
    fully_shard, a weight-decay sum inside the forward) raises on every rank in the first
    forwards, naming it; reading only its dtype, device or shape does not; the right ways train
    as one process."""
    run_distributed(_reads_at_2, 2, timeout=120)
    run_distributed(_read_in_forward, 4, timeout=120)
