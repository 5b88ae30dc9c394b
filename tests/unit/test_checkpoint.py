"""Unit tests of ``checkpoint``: single process, CPU."""

from __future__ import annotations

import contextlib
import copy
import gc
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
import torch
import torch.nn as nn

from composable_shard.checkpoint import _CheckpointState, checkpoint


class Block(nn.Module):
    """Transformer-ish MLP block with dropout; counts calls of its forward."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.3)
        self.forward_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_calls += 1
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


_Result = Tuple[torch.Tensor, Dict[str, Optional[torch.Tensor]]]


def _state(module: nn.Module) -> _CheckpointState:
    state = checkpoint.state(module)
    assert state is not None
    return state


def _make_pair() -> Tuple[Model, Model]:
    torch.manual_seed(0)
    ref = Model()
    return ref, copy.deepcopy(ref)


def _step(model: nn.Module, x: torch.Tensor, seed: int = 1) -> _Result:
    """Forward + backward with a fixed seed; returns output and all gradients (input's too)."""
    x = x.detach().requires_grad_(x.requires_grad)
    torch.manual_seed(seed)
    out = model(x)
    out.square().sum().backward()
    grads: Dict[str, Optional[torch.Tensor]] = {name: p.grad for name, p in model.named_parameters()}
    if x.requires_grad:
        grads["<input>"] = x.grad
    return out.detach(), grads


def _assert_same(a: _Result, b: _Result) -> None:
    """Outputs and every gradient bit-equal."""
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name, grad in a[1].items():
        other = b[1][name]
        assert grad is not None and other is not None and torch.equal(grad, other), name


@contextlib.contextmanager
def _count_saved(counts: List[int]) -> Iterator[None]:
    """Outer saved-tensor hooks: count every tensor packed while active (identity pack)."""
    counts.append(0)

    def pack(t: torch.Tensor) -> torch.Tensor:
        counts[-1] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def test_gradients_bit_equal_with_dropout() -> None:
    """Without a restored RNG state or exact recomputation, dropout masks or values differ. After
    the backward the global RNG is where training without checkpoint leaves it (each recomputation
    replays its forward's RNG state, then puts the generator back), so the draws after it and the
    next step's dropout masks are the same too."""
    ref, model = _make_pair()
    for layer in model.layers:
        checkpoint(layer)
    x = torch.randn(4, 8, requires_grad=True)
    _assert_same(_step(ref, x), _step(model, x))
    draws = []
    for m in (ref, model):
        torch.manual_seed(1)
        m(x).square().sum().backward()
        draws.append(torch.rand(6))
    assert torch.equal(draws[0], draws[1]), draws


def test_without_preserve_rng_state_dropout_differs() -> None:
    """Proves the test above is sensitive: recomputing with a moved RNG changes gradients."""
    ref, model = _make_pair()
    for layer in model.layers:
        checkpoint(layer, preserve_rng_state=False)
    x = torch.randn(4, 8, requires_grad=True)
    ref_out, ref_grads = _step(ref, x)
    out, grads = _step(model, x)
    assert torch.equal(ref_out, out)
    ref_grad, grad = ref_grads["layers.0.fc1.weight"], grads["layers.0.fc1.weight"]
    assert ref_grad is not None and grad is not None and not torch.equal(ref_grad, grad)


def test_forward_runs_twice_per_step() -> None:
    _, model = _make_pair()
    checkpoint(model.layers[0])
    _step(model, torch.randn(4, 8))
    assert [layer.forward_calls for layer in model.layers] == [2, 1]


def test_saves_fewer_activations_nested_in_outer_hooks() -> None:
    """Tensors saved inside checkpointed blocks must not reach the outer hooks (nor memory);
    gradients stay exact when the outer hooks stay active around the forward."""
    ref, model = _make_pair()
    for layer in model.layers:
        checkpoint(layer)
    x = torch.randn(4, 8, requires_grad=True)
    counts: List[int] = []
    with _count_saved(counts):
        ref_result = _step(ref, x)
    with _count_saved(counts):
        result = _step(model, x)
    with _count_saved(counts):  # what the head and the loss alone save
        model.head(torch.randn(4, 8, requires_grad=True)).square().sum()
    without, with_checkpoint, head_only = counts
    assert with_checkpoint < without
    assert with_checkpoint == head_only
    _assert_same(ref_result, result)


class KwargsModule(nn.Module):
    """Keyword input, input without grad, nested outputs with non-tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor, mask: torch.Tensor) -> Tuple[Any, Dict[str, Any]]:
        h = torch.tanh(self.fc(x)) * scale
        return (h.exp(), None), {"masked": (h * mask).sigmoid(), "label": "ok", "count": 3}


def test_kwargs_nested_outputs_and_inputs_without_grad() -> None:
    torch.manual_seed(0)
    ref = KwargsModule()
    model = checkpoint(copy.deepcopy(ref))
    x = torch.randn(3, 6)  # no grad
    mask = torch.randint(0, 2, (3, 6)).float()  # no grad
    results: List[_Result] = []
    for module in (ref, model):
        scale = torch.full((6,), 0.5, requires_grad=True)
        (a, none), d = module(x, scale=scale, mask=mask)
        assert none is None and d["label"] == "ok" and d["count"] == 3
        (a.sum() + d["masked"].square().sum()).backward()
        results.append((a.detach(), {"scale": scale.grad, **{n: p.grad for n, p in module.named_parameters()}}))
    _assert_same(results[0], results[1])


class TwiceModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.block(x))


def test_module_called_twice_in_one_forward() -> None:
    """Each call has its own frame: sharing one would recompute the wrong call."""
    torch.manual_seed(0)
    ref = TwiceModel()
    model = copy.deepcopy(ref)
    checkpoint(model.block)
    x = torch.randn(4, 8, requires_grad=True)
    _assert_same(_step(ref, x), _step(model, x))
    assert model.block.forward_calls == 4


def test_nested_checkpoint_parent_and_children() -> None:
    ref, model = _make_pair()
    for layer in model.layers:
        checkpoint(layer)
    checkpoint(model)
    x = torch.randn(4, 8, requires_grad=True)
    _assert_same(_step(ref, x), _step(model, x))


def test_no_grad_forward_just_runs() -> None:
    ref, model = _make_pair()
    for layer in model.layers:
        checkpoint(layer)
    ref.eval(), model.eval()
    layer, original_forward, seen = model.layers[0], model.layers[0].forward, []

    def forward(x: torch.Tensor) -> torch.Tensor:
        seen.extend(_state(layer).frames)
        return original_forward(x)

    layer.forward = forward  # instance-level spy
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert torch.equal(ref(x), model(x))
    assert seen == [None]  # the call was not checkpointed
    assert all(_state(layer).frames == [] for layer in model.layers)


def test_enable_hook_false_disables_recomputation() -> None:
    ref, model = _make_pair()
    checkpoint(model.layers[0])
    _state(model.layers[0]).enable_hook = False
    x = torch.randn(4, 8, requires_grad=True)
    counts: List[int] = []
    with _count_saved(counts):
        ref_result = _step(ref, x)
    with _count_saved(counts):
        result = _step(model, x)
    assert model.layers[0].forward_calls == 1
    assert counts[0] == counts[1]
    _assert_same(ref_result, result)


def test_use_reentrant_raises_and_leaves_module_unmodified() -> None:
    block = Block()
    pre, post = len(block._forward_pre_hooks), len(block._forward_hooks)
    with pytest.raises(NotImplementedError, match="non-reentrant"):
        checkpoint(block, use_reentrant=True)
    assert checkpoint.state(block) is None
    assert (len(block._forward_pre_hooks), len(block._forward_hooks)) == (pre, post)
    checkpoint(block)  # can still be applied properly afterwards
    assert isinstance(checkpoint.state(block), _CheckpointState)


def test_fqns_and_class_unchanged_and_applying_twice_raises() -> None:
    _, model = _make_pair()
    keys, names = list(model.state_dict()), [n for n, _ in model.named_modules()]
    for layer in model.layers:
        assert checkpoint(layer) is layer
        assert type(layer) is Block
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_modules()] == names
    with pytest.raises(RuntimeError, match="checkpoint"):
        checkpoint(model.layers[0])


@pytest.mark.parametrize("outer_first", [True, False])
def test_hook_order_with_outer_hooks(outer_first: bool) -> None:
    """Mimics fully_shard (pre prepended, post appended): it must run outside checkpoint in
    either order, checkpoint must record the inputs the outer pre-hook produced, and
    recomputation must not re-run the module's hooks."""
    torch.manual_seed(0)
    ref, block = Block(), Block()
    block.load_state_dict(ref.state_dict())
    events: List[Tuple[str, int]] = []

    def depth(module: nn.Module) -> int:
        state = checkpoint.state(module)
        return -1 if state is None else len(state.frames)

    def outer_pre(module: nn.Module, args: Tuple[Any, ...]) -> Tuple[Any, ...]:
        events.append(("outer_pre", depth(module)))
        return (args[0] * 2.0,)  # like fully_shard casting inputs

    def outer_post(module: nn.Module, args: Tuple[Any, ...], output: Any) -> None:
        events.append(("outer_post", depth(module)))

    def register_outer() -> None:
        block.register_forward_pre_hook(outer_pre, prepend=True)
        block.register_forward_hook(outer_post)

    if outer_first:
        register_outer()
    checkpoint(block)
    if not outer_first:
        register_outer()
    original_forward = block.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        events.append(("forward", depth(block)))
        return original_forward(x)

    block.forward = forward  # type: ignore[method-assign]  # instance-level spy
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)
    out = block(x)
    assert events == [("outer_pre", 0), ("forward", 1), ("outer_post", 0)]
    out.square().sum().backward()
    assert events[3:] == [("forward", 0)]  # recomputation only, no hooks
    ref_x = x.detach().requires_grad_()
    torch.manual_seed(1)
    ref_out = ref(ref_x * 2.0)
    ref_out.square().sum().backward()
    grads = {"x": x.grad, "fc1.weight": block.fc1.weight.grad}
    _assert_same((out.detach(), grads), (ref_out.detach(), {"x": ref_x.grad, "fc1.weight": ref.fc1.weight.grad}))


class FlakyModule(nn.Module):
    """Saves a different number of tensors when ``extra`` changes between forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h.exp().exp() if self.extra else h.exp()


def test_recompute_mismatch_raises_clear_error() -> None:
    module = checkpoint(FlakyModule())
    out = module(torch.randn(2, 4))
    module.extra = True
    with pytest.raises(RuntimeError, match=r"checkpoint\(FlakyModule\).*saved"):
        out.sum().backward()


def test_recomputed_tensors_released_and_retain_graph() -> None:
    """Every recomputed tensor is popped once autograd took it; a retained graph recomputes."""
    block = checkpoint(Block()).eval()
    frames: List[Any] = []
    original_forward = block.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        frames.extend(_state(block).frames[-1:])  # empty when recomputing
        return original_forward(x)

    block.forward = forward  # instance-level spy
    out = block(torch.randn(4, 8, requires_grad=True))
    frame = frames[0]
    out.sum().backward(retain_graph=True)
    assert frame.recomputed == {} and len(frame.saved_metas) > 0
    first = block.fc1.weight.grad.clone()
    out.sum().backward()
    assert frame.recomputed == {} and block.forward_calls == 3
    assert torch.equal(block.fc1.weight.grad, 2 * first)


class _Stashing(nn.Module):
    """Keeps a tensor of each forward call in ``cache`` (as a Hugging Face layer's key/value cache
    does): the one of the recomputation has a grad_fn in the recomputation's graph."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 8)
        self.cache: List[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc1(x)
        self.cache.append(hidden * 2)
        return self.fc2(torch.nn.functional.gelu(hidden))


def test_recomputed_tensors_not_kept_alive_by_a_tensor_stashed_in_recomputation() -> None:
    """A tensor the recomputed forward leaves behind (a cache entry) holds the recomputation's
    graph; that graph must not keep the block's recomputed activations alive after its backward
    (it did, through the recomputation's own unpack hook: one layer's activations per cached
    layer, 67.6 MB against torch's 40.7 MB on a 4-layer Llama with its key/value cache on)."""
    block = checkpoint(_Stashing())
    out = block(torch.randn(4, 8, requires_grad=True))
    pointers: List[int] = []
    original = torch.nn.functional.gelu

    def spy(t: torch.Tensor) -> torch.Tensor:
        pointers.append(t.data_ptr())  # gelu saves its input: in the recomputation, a recomputed activation
        return original(t)

    torch.nn.functional.gelu = spy  # type: ignore[assignment]
    try:
        out.sum().backward()
    finally:
        torch.nn.functional.gelu = original  # type: ignore[assignment]
    del out
    gc.collect()
    assert len(pointers) == 1 and len(block.cache) == 2 and block.cache[1].grad_fn is not None
    alive = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.data_ptr() == pointers[0]]
    assert not alive, "a recomputed activation outlived its backward (held through the stashed tensor's graph)"


def test_context_fn_entered_in_forward_and_recomputation() -> None:
    entered: List[str] = []

    @contextlib.contextmanager
    def tag(name: str) -> Iterator[None]:
        entered.append(name)
        yield

    block = checkpoint(Block(), context_fn=lambda: (tag("forward"), tag("recompute")))
    out = block(torch.randn(4, 8, requires_grad=True))
    assert entered == ["forward"]
    out.sum().backward()
    assert entered == ["forward", "recompute"]


def test_exception_in_forward_pops_saved_tensor_hooks() -> None:
    """Without always_call the pack hook would stay pushed and swallow later activations."""
    module = checkpoint(KwargsModule())
    with pytest.raises(TypeError):
        module(torch.randn(2, 6))  # missing keyword inputs
    assert _state(module).frames == []
    counts: List[int] = []
    with _count_saved(counts):
        torch.randn(3, requires_grad=True).exp()
    assert counts == [1]


def test_autocast_state_replayed_in_recomputation() -> None:
    ref, model = _make_pair()
    for layer in model.layers:
        checkpoint(layer)
    x = torch.randn(4, 8, requires_grad=True)
    results: List[_Result] = []
    for m in (ref, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.manual_seed(1)
            out = m(x)
        out.float().square().sum().backward()
        results.append((out.detach(), {n: p.grad for n, p in m.named_parameters()}))
    _assert_same(results[0], results[1])
