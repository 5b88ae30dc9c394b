"""Meta-device materialization leaves already initialized tensors alone.

``fully_shard`` initializes meta tensors with ``reset_parameters()`` (per module with meta
tensors of its own) or with ``param_init_fn(module)`` (per fully sharded module, children
first). A parent's init often reaches its whole subtree (Hugging Face style
``reset_parameters``, ``module.to_empty(...)`` followed by re-initializing every submodule).
With hand annotation (``fully_shard`` each block, then the root) the blocks are already
sharded when the root's init runs: their parameters are 1-D views into flat shards. Without
the guard tested here that init silently zeroes or re-draws them, or (``to_empty``) cuts them
loose from their flat shards so the optimizer updates storage the forward never reads.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import ModuleWrapPolicy, fully_shard, unshard_params
from tests._harness import run_distributed, run_subtests
from tests._models import (VOCAB, WIDTH, Block, ParityModel, assert_losses_close, assert_params_close, batch,
                           distributed_training, local_rows, loss_fn, make_model)

Named = List[Tuple[str, torch.Tensor]]


class ReInitAll(nn.Module):
    """A parent whose ``reset_parameters()`` re-initializes every Linear, Embedding and
    LayerNorm of its subtree (the children's too, as Hugging Face's ``post_init`` does) besides
    its own ``gain``. Each block ties ``fc2.bias`` to ``ln.weight``: one parameter registered
    twice inside a sharded child (``to_empty`` from meta unties it: torch registers a new
    Parameter per name; ``reset_parameters`` and ``_replace_all_init`` keep the tie)."""

    def __init__(self, num_blocks: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(num_blocks)])
        for block in self.blocks:
            block.fc2.bias = block.ln.weight
        self.gain = nn.Parameter(torch.empty(WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gain, mean=1.0, std=0.1)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.3)
            if isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
            if isinstance(m, (nn.Linear, nn.LayerNorm)):
                nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.emb(tokens))
        for block in self.blocks:
            x = block(x)
        return self.head(x * self.gain)


def _to_empty_reset_all(module: nn.Module) -> None:
    """A ``param_init_fn``: ``to_empty`` the whole subtree, then every submodule's
    ``reset_parameters()``. Called on the root after the blocks were sharded it raises:
    ``nn.Linear``'s kaiming init cannot run on a block's sharded (1-D) weight."""
    module.to_empty(device="cpu")
    for sub in module.modules():
        if callable(getattr(sub, "reset_parameters", None)):
            sub.reset_parameters()


def _to_empty_model_init(module: nn.Module) -> None:
    """A ``param_init_fn``: ``to_empty`` the whole subtree, then the model's own init if it has
    one (it reaches every submodule with 1-D-safe inits: no error, silent damage), else each
    submodule's ``reset_parameters()``."""
    module.to_empty(device="cpu")
    subs = [module] if isinstance(module, ReInitAll) else list(module.modules())
    for sub in subs:
        if callable(getattr(sub, "reset_parameters", None)):
            sub.reset_parameters()


def _replace_all_init(module: nn.Module) -> None:
    """A ``param_init_fn`` that registers a new ``nn.Parameter`` for every parameter under
    ``module`` (tied ones stay tied)."""
    new: Dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            if id(p) not in new:
                new[id(p)] = nn.Parameter(torch.randn(p.shape), requires_grad=p.requires_grad)
            setattr(sub, name, new[id(p)])


_INIT_FNS: Dict[str, Callable[[nn.Module], None]] = {
    "to_empty_model_init": _to_empty_model_init, "replace": _replace_all_init, "to_empty_reset_all": _to_empty_reset_all}


def _full_params(model: nn.Module) -> Named:
    with unshard_params(model):
        return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def _full_grads(model: nn.Module) -> Named:
    with unshard_params(model, with_grads=True):
        return [(n, p.grad.detach().clone()) for n, p in model.named_parameters() if p.grad is not None]


def _assert_equal(actual: Named, expected: Named, what: str) -> None:
    assert_params_close(actual, expected, atol=0.0, what=what)
    for (name, a), (_, e) in zip(actual, expected):
        assert torch.equal(a, e), f"{what} {name} differs"


def _reference_from(initial: Named, model: ReInitAll) -> ReInitAll:
    """A plain CPU model holding ``initial`` (the unsharded values of ``model``), tied where
    ``model`` is."""
    reference = ReInitAll()
    for block, ref_block in zip(model.blocks, reference.blocks):
        if block.fc2.bias is not block.ln.weight:
            ref_block.fc2.bias = nn.Parameter(torch.empty(WIDTH))
    values = dict(initial)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(values[name])
    return reference


def _shard_blocks(init: str) -> Tuple[ReInitAll, Dict[str, Named], Dict[str, List[Tuple[int, int]]]]:
    """Build a ``ReInitAll`` on meta and fully_shard each block (``init``: "reset_parameters"
    or a key of ``_INIT_FNS``). Returns the model, each block's full values right after its
    own fully_shard, and its parameters' ``(id, data_ptr)`` (the sharded views) then."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = ReInitAll()
    after_own: Dict[str, Named] = {}
    views: Dict[str, List[Tuple[int, int]]] = {}
    for i, block in enumerate(model.blocks):
        fully_shard(block, param_init_fn=_INIT_FNS.get(init))
        after_own[f"blocks.{i}"] = _full_params(block)
        views[f"blocks.{i}"] = [(id(p), p.data_ptr()) for p in block.parameters()]
    return model, after_own, views


def _hand_annotate(init: str) -> Tuple[ReInitAll, Dict[str, Named], Dict[str, List[Tuple[int, int]]]]:
    """:func:`_shard_blocks`, then fully_shard the root the same way."""
    model, after_own, views = _shard_blocks(init)
    fully_shard(model, param_init_fn=_INIT_FNS.get(init))
    return model, after_own, views


def _assert_views_kept(model: ReInitAll, views: Dict[str, List[Tuple[int, int]]]) -> None:
    """The blocks' parameters are the objects their fully_shard left, still viewing the same
    storage (their flat shards), tied ones still tied. Reads no values: unshard_params re-points
    the parameters at their shards on exit, which would hide a view cut loose by ``to_empty``."""
    for i, block in enumerate(model.blocks):
        name = f"blocks.{i}"
        assert [(id(p), p.data_ptr()) for p in block.parameters()] == views[name], \
            f"{name}: parameters replaced or cut loose from their flat shard by the root's init"


def _assert_blocks_untouched(model: ReInitAll, after_own: Dict[str, Named],
                             views: Dict[str, List[Tuple[int, int]]]) -> None:
    """Same objects and views as after the block's own fully_shard, and the same full values."""
    _assert_views_kept(model, views)
    for i, block in enumerate(model.blocks):
        name = f"blocks.{i}"
        _assert_equal(_full_params(block), after_own[name], f"[{name} after the root's fully_shard]")


def _train_against_reference(model: nn.Module, reference: nn.Module, steps: int, sgd: bool, grads: bool) -> None:
    """``steps`` steps on this rank's rows equal local steps on the global batch: losses, the
    gradients after each backward if ``grads`` (read with unshard_params, which re-points
    parameters at their shards), and the parameters at the end (atol 1e-5)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()

    def make(params: object) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1) if sgd else torch.optim.AdamW(params, lr=1e-2)  # type: ignore[arg-type]

    optim, ref_optim = make(model.parameters()), make(reference.parameters())
    for step in range(steps):
        inputs, targets = batch(step, world_size)
        ref_loss = loss_fn(reference(inputs), targets)
        ref_loss.backward()
        loss = loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank))
        loss.backward()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        assert_losses_close([global_loss.item() / world_size], [ref_loss.item()], what=f"[step {step}]")
        if grads:
            expected = [(n, p.grad) for n, p in reference.named_parameters() if p.grad is not None]
            assert_params_close(_full_grads(model), expected, what=f"[step {step} grads]")  # type: ignore[arg-type]
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    assert_params_close(_full_params(model), list(reference.named_parameters()), what=f"[after {steps} steps]")


# ---------------------------------------------------------------------------- (a) one call, policy
def _policy_reset_parameters() -> None:
    cpu_model = make_model(seed=0)
    with torch.device("meta"):
        meta_model = ParityModel()
    meta_model.scale.reset_parameters = lambda: meta_model.scale.gain.data.fill_(1.25)  # type: ignore[assignment,method-assign]
    torch.manual_seed(0)  # the same draws, in the same order, as building on CPU
    fully_shard(meta_model, policy=ModuleWrapPolicy({Block}))
    fully_shard(cpu_model, policy=ModuleWrapPolicy({Block}))
    _assert_equal(_full_params(meta_model), _full_params(cpu_model), "[meta-built vs CPU-built]")
    losses = distributed_training(meta_model, 3)
    assert_losses_close(losses, distributed_training(cpu_model, 3), atol=1e-6, what="[meta-built vs CPU-built]")
    assert_params_close(_full_params(meta_model), _full_params(cpu_model), atol=1e-6, what="[trained]")


# ---------------------------------------------------------------------------- (b) parent re-inits its children
def _parent_reset_reinits_children() -> None:
    model, after_own, views = _hand_annotate("reset_parameters")
    _assert_blocks_untouched(model, after_own, views)
    assert all(block.fc2.bias is block.ln.weight for block in model.blocks)
    initial = _full_params(model)
    for name, value in initial:
        if not name.startswith("blocks."):
            assert not value.is_meta and torch.isfinite(value).all() and value.abs().sum() > 0, name
    _train_against_reference(model, _reference_from(initial, model), steps=1, sgd=False, grads=True)


# ---------------------------------------------------------------------------- (c) whole-subtree param_init_fn
def _whole_subtree_param_init_fn(init: str) -> None:
    model, after_own, views = _hand_annotate(init)
    _assert_views_kept(model, views)
    assert init != "replace" or all(block.fc2.bias is block.ln.weight for block in model.blocks)
    # The blocks' values as their own fully_shard left them, the root's own as its call made
    # them. Nothing unshards the blocks before the end (see _assert_views_kept), so losses
    # equal to the reference's show that their shards kept those values and that the
    # optimizer steps the shards (their parameters still view them).
    with unshard_params(model, recurse=False):
        initial = [(n, p.detach().clone()) for n, p in model.named_parameters() if not n.startswith("blocks.")]
    assert all(torch.isfinite(v).all() for _, v in initial)
    initial += [(f"{block}.{n}", v) for block, values in after_own.items() for n, v in values]
    _train_against_reference(model, _reference_from(initial, model), steps=2, sgd=True, grads=False)


@pytest.mark.parametrize("world_size", [2, 4])
def test_policy_meta_equals_cpu(world_size: int) -> None:
    """(a) One call with a policy, reset_parameters fallback: a model built on meta with the
    same seed equals the CPU-built one bit for bit after fully_shard, and trains the same (3
    steps). Guards the working path: materialization in ``.modules()`` order, each module's
    draws once, tied weights initialized once."""
    run_distributed(_policy_reset_parameters, world_size, timeout=60)


@pytest.mark.parametrize("world_size", [2, 4])
def test_parent_reset_keeps_sharded_children(world_size: int) -> None:
    """(b) Hand annotation with a parent whose reset_parameters() re-initializes its children:
    the root's fully_shard leaves the blocks' sharded parameters as their own fully_shard left
    them (it used to re-draw weights and zero biases in the flat shards), initializes the
    root's own parameters, and one step matches a plain model with the same initial values."""
    run_distributed(_parent_reset_reinits_children, world_size, timeout=60)


def _raising_param_init_fn() -> None:
    """The root's param_init_fn raises after ``to_empty`` swapped the blocks' ``.data``: the
    error reaches the caller and the blocks are as their own fully_shard left them."""
    model, after_own, views = _shard_blocks("to_empty_reset_all")
    try:
        fully_shard(model, param_init_fn=_to_empty_reset_all)
    except ValueError as e:
        assert "fan in and fan out" in str(e).lower(), e
    else:
        raise AssertionError("kaiming init on a sharded 1-D weight should have raised")
    _assert_blocks_untouched(model, after_own, views)


def _added_param_still_reported() -> None:
    """Putting back replaced parameters does not hide a real change: a parameter the root's
    param_init_fn adds to a sharded block still raises, naming it (at fully_shard, where the
    call's FQNs are compared, or at the next forward)."""
    model, _, _ = _shard_blocks("replace")

    def init_and_add(module: nn.Module) -> None:
        _replace_all_init(module)
        module.blocks[0].fc1.extra = nn.Parameter(torch.zeros(1))

    try:
        fully_shard(model, param_init_fn=init_and_add)
        model(batch(0, dist.get_world_size())[0])
    except RuntimeError as e:
        assert "fc1.extra" in str(e), e
    else:
        raise AssertionError("a parameter added to a sharded block should raise")


def _whole_subtree_param_init_fns() -> None:
    run_subtests(_whole_subtree_param_init_fn, {"init": ["to_empty_model_init", "replace"]})
    _raising_param_init_fn()
    _added_param_still_reported()


@pytest.mark.parametrize("world_size", [2, 4])
def test_whole_subtree_param_init_fn_keeps_sharded_children(world_size: int) -> None:
    """(c) Hand annotation with a param_init_fn that reaches the whole subtree (``to_empty``
    then re-initialize everything, or register new Parameters everywhere): after the root's
    call the blocks' parameters are the same objects, still views of their flat shards (same
    data_ptr), with the same values, and 2 SGD steps match a plain model with the same
    initial values (a block cut loose from its flat shard by ``to_empty`` would not train,
    silently: its optimizer updates storage the forward never reads). A function that raises
    leaves the blocks as they were; one that adds a parameter to a block is still reported."""
    run_distributed(_whole_subtree_param_init_fns, world_size, timeout=60)
