"""Meta-device materialization: torch FSDP1's ``param_init_fn`` idiom, refusals agreed across
ranks, and already initialized tensors left alone.

``fully_shard`` initializes meta tensors with ``reset_parameters()`` (per module with meta
tensors of its own) or with ``param_init_fn(m)`` (as torch FSDP1: on every module of each fully
sharded module's subtree, breadth-first, nested fully sharded modules first). The idiom of
llama-recipes and accelerate (rank 0 real, the others on meta, ``to_empty(recurse=False)``,
``sync_module_states=True``) must train as rank 0's model would (d), and a refusal on one rank
must raise on every rank instead of leaving the others in a collective (e).

A parent's init often reaches its whole subtree (Hugging Face style
``reset_parameters``, ``module.to_empty(...)`` followed by re-initializing every submodule).
With hand annotation (``fully_shard`` each block, then the root) the blocks are already
sharded when the root's init runs: their parameters are 1-D views into flat shards. Without
the guard tested here that init silently zeroes or re-draws them, or (``to_empty``) cuts them
loose from their flat shards so the optimizer updates storage the forward never reads.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import FSDPModule, ModuleWrapPolicy, ShardingStrategy, fully_shard, replicate, unshard_params
from composable_shard._runtime.collectives import record_collectives
from tests._harness import outcomes_through_files, run_distributed, run_subtests
from tests._models import (VOCAB, WIDTH, Block, ParityModel, assert_losses_close, assert_params_close, batch,
                           distributed_training, local_rows, loss_fn, make_model, reference_training, zip_same)

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
    """A ``param_init_fn`` (called per module): ``to_empty`` the whole subtree (no
    ``recurse=False``: it reaches the sharded blocks from the root and from ``blocks``), then
    the module's own ``reset_parameters()`` if it has one: the root's reaches every submodule
    with 1-D-safe inits (no error, silent damage)."""
    module.to_empty(device="cpu")
    if callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()


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
        if module is model:
            module.blocks[0].fc1.extra = nn.Parameter(torch.zeros(1))

    try:
        fully_shard(model, param_init_fn=init_and_add)
        model(batch(0, dist.get_world_size())[0])
    except RuntimeError as e:
        assert "fc1.extra" in str(e), e
    else:
        raise AssertionError("a parameter added to a sharded block should raise")


_MATERIALIZATIONS: Dict[str, Callable[[], None]] = {
    "(a) policy": _policy_reset_parameters, "(b) parent reset": _parent_reset_reinits_children,
    "(c) to_empty_model_init": lambda: _whole_subtree_param_init_fn("to_empty_model_init"),
    "(c) replace": lambda: _whole_subtree_param_init_fn("replace"), "(c) raising": _raising_param_init_fn,
    "(c) added parameter": _added_param_still_reported}


class _Stack(nn.Module):
    """Embedding, two Blocks, a head: every module with parameters has ``reset_parameters()``,
    so fully_shard initializes them at the call."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(WIDTH, VOCAB)


def _seeded_meta_stack() -> _Stack:
    torch.manual_seed(11)
    with torch.device("meta"):
        return _Stack()


def _model_init(model: nn.Module) -> None:
    """A model's own init after ``to_empty`` (torchtitan's ``init_weights``): draws for every layer."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.trunc_normal_(m.weight, std=0.2)
        if isinstance(m, (nn.Linear, nn.LayerNorm)):
            nn.init.normal_(m.bias, std=0.05)
        if isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)


def _shard_stack(model: _Stack, annotation: str) -> None:
    """fully_shard by hand (blocks, then the root) or by a policy."""
    if annotation == "manual":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        fully_shard(model, policy=ModuleWrapPolicy({Block}))


def _reset_order(model: _Stack, annotation: str) -> List[nn.Module]:
    """The modules whose reset_parameters() fully_shard runs, in its order: each call's in
    ``.modules()`` order, the blocks' calls first by hand, one call under the policy."""
    order = list(model.modules())
    if annotation == "manual":
        order = [m for b in model.blocks for m in b.modules()] + [model.emb, model.head]
    return [m for m in order if list(m.parameters(recurse=False))]


def _rng_of_both_flows() -> None:
    """(f) Initial weights and the global RNG (issue 55). fully_shard on a meta-device model
    whose modules all have reset_parameters() initializes them at the call (FSDP1's flow), which
    draws from the global RNG; on FSDP2's flow (then ``to_empty`` and the model's own init) those
    draws made the init draw other numbers than an unsharded model's (torchtitan: step-1 loss
    8.1196 against 8.0596). Per annotation (by hand, blocks then root; a policy), against one
    process from the same seed: FSDP2's flow gives the unsharded model's weights and the same
    next draw; FSDP1's flow gives reset_parameters' weights and the same next draw as one
    process running those reset_parameters (its draws are made, as an unsharded model's
    constructor makes them); a draw between fully_shard and ``to_empty`` cannot be given back:
    a warning names the module."""
    for annotation in ("manual", "policy"):
        for flow in ("fsdp2", "fsdp1", "drawn in between"):
            what = f"{annotation} annotation, {flow}"
            reference = _seeded_meta_stack()  # one process: seed, build on meta, to_empty, init, draw
            reference.to_empty(device="cpu")
            if flow == "fsdp1":
                for m in _reset_order(reference, annotation):
                    m.reset_parameters()
            else:
                _model_init(reference)
            reference_draw = torch.rand(3)
            model = _seeded_meta_stack()
            _shard_stack(model, annotation)
            if flow == "drawn in between":
                torch.rand(1)
                with pytest.warns(UserWarning, match=r"fully_shard initialized .*with reset_parameters\(\) when it"):
                    model.to_empty(device="cpu")
                continue
            if flow == "fsdp2":
                model.to_empty(device="cpu")
                _model_init(model)
            draw = torch.rand(3)
            assert torch.equal(draw, reference_draw), (what, draw, reference_draw)
            _assert_equal(_full_params(model), list(reference.named_parameters()), what)


_MATERIALIZATIONS["(f) the RNG of both flows"] = _rng_of_both_flows


def _two_models_one_after_the_other() -> None:
    """(f2) Two models through FSDP2's flow in turn (a model and its EMA copy, an actor and a critic),
    each initialized after ``to_empty`` by the same ``reset_parameters()`` calls fully_shard made: the
    RNG then stands exactly where fully_shard's draws left it, so the second model's fully_shard starts
    there. Each model gets the unsharded flow's weights, with no warning, and the next draw is the
    unsharded script's (a record of the first model's draws kept past its ``to_empty`` would take the
    second's draws for a continuation of the first's: a warning and other weights)."""
    def init(model: _Stack) -> None:
        for m in _reset_order(model, "manual"):
            m.reset_parameters()

    references = []
    torch.manual_seed(11)
    for _ in range(2):
        with torch.device("meta"):
            reference = _Stack()
        reference.to_empty(device="cpu")
        init(reference)
        references.append(reference)
    reference_draw = torch.rand(3)
    torch.manual_seed(11)
    models = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "cannot be put back" warning
        for _ in range(2):
            with torch.device("meta"):
                model = _Stack()
            _shard_stack(model, "manual")
            model.to_empty(device="cpu")
            init(model)
            models.append(model)
    assert torch.equal(torch.rand(3), reference_draw)
    for k, (model, reference) in enumerate(zip_same(models, references)):
        _assert_equal(_full_params(model), list(reference.named_parameters()), f"model {k}")


_MATERIALIZATIONS["(f2) two models one after the other"] = _two_models_one_after_the_other


class _GainedStack(nn.Module):
    """Embedding, two Blocks, a head, and a ``gain`` on the root, which has no
    ``reset_parameters()``: fully_shard defers the init (FSDP2's flow, as torchtitan's RoPE
    cache makes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.gain = nn.Parameter(torch.ones(WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x * self.gain)


def _frozen_parameters_in_fsdp2_flow() -> None:
    """(g) Parameters frozen on the meta device (fine-tuning: a block's weight, the root's gain)
    stay frozen through FSDP2's flow (fully_shard, ``to_empty``, the model's own init): the same
    ``requires_grad`` on every parameter as one process, no gradient for the frozen ones, and 3
    AdamW steps equal one process's on the combined batch (a frozen parameter trained by mistake
    would move under AdamW's weight decay alone)."""
    frozen = ("blocks.0.fc1.weight", "gain")

    def build() -> _GainedStack:
        torch.manual_seed(5)
        with torch.device("meta"):
            model = _GainedStack()
        for name in frozen:
            model.get_parameter(name).requires_grad_(False)
        return model

    reference = build()
    reference.to_empty(device="cpu")
    _model_init(reference)
    with torch.no_grad():
        reference.gain.fill_(1.5)
    model = build()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    _model_init(model)
    with torch.no_grad():
        model.gain.fill_(1.5)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    assert flags == {n: p.requires_grad for n, p in reference.named_parameters()}, flags
    assert sorted(n for n, f in flags.items() if not f) == sorted(frozen), flags
    expected = reference_training(reference, 3, dist.get_world_size())
    losses = distributed_training(model, 3)
    assert_losses_close(losses, expected)
    assert all(model.get_parameter(n).grad is None for n in frozen)
    assert_params_close(_full_params(model), list(reference.named_parameters()), what="(g) frozen in FSDP2's flow")


_MATERIALIZATIONS["(g) frozen parameters, FSDP2's flow"] = _frozen_parameters_in_fsdp2_flow


def _fsdp1_calls_with_a_whole_subtree_init() -> None:
    """One fully_shard call with a param_init_fn that ``to_empty``s its whole subtree and then
    runs its module's own ``reset_parameters()``: as torch's FSDP1, it is called on every module
    breadth-first (the list made before the first call), so each child's call, after its parent's
    ``to_empty`` left it uninitialized memory, gives it its own init. The values equal a plain
    model's going through the same calls (same seed) exactly; before being kept, a child's init
    could be undone as "already materialized" by the parent's call."""
    def build() -> nn.Module:
        torch.manual_seed(5)
        with torch.device("meta"):
            return nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH),
                                 nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)), nn.Linear(WIDTH, 3))

    reference = build()
    queue, order = [reference], []
    while queue:  # breadth-first, every module (torch's FSDP1 list)
        module = queue.pop(0)
        order.append(module)
        queue.extend(module.children())
    for module in order:
        _to_empty_model_init(module)
    model = fully_shard(build(), param_init_fn=_to_empty_model_init)
    with unshard_params(model):
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected = dict(reference.named_parameters())
    assert sorted(got) == sorted(expected), sorted(got)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


_MATERIALIZATIONS["(c) whole-subtree init, one call"] = _fsdp1_calls_with_a_whole_subtree_init


def _materialization(case: str) -> None:
    _MATERIALIZATIONS[case]()


def test_meta_materialization_equals_cpu_and_keeps_sharded_children() -> None:
    """At 2 ranks, in one process group (each failure names its case); nothing here depends on
    the world size beyond the shard arithmetic, which 2 ranks make uneven already.

    (a) One call with a policy, reset_parameters fallback: a model built on meta with the
    same seed equals the CPU-built one bit for bit after fully_shard, and trains the same (3
    steps). Guards the working path: materialization in ``.modules()`` order, each module's
    draws once, tied weights initialized once.

    (b) Hand annotation with a parent whose reset_parameters() re-initializes its children:
    the root's fully_shard leaves the blocks' sharded parameters as their own fully_shard left
    them (it used to re-draw weights and zero biases in the flat shards), initializes the
    root's own parameters, and one step matches a plain model with the same initial values.

    (c) Hand annotation with a param_init_fn that reaches the whole subtree (``to_empty``
    then re-initialize everything, or register new Parameters everywhere): after the root's
    call the blocks' parameters are the same objects, still views of their flat shards (same
    data_ptr), with the same values, and 2 SGD steps match a plain model with the same
    initial values (a block cut loose from its flat shard by ``to_empty`` would not train,
    silently: its optimizer updates storage the forward never reads). A function that raises
    leaves the blocks as they were; one that adds a parameter to a block is still reported."""
    run_distributed(run_subtests, 2, _materialization, {"case": list(_MATERIALIZATIONS)}, timeout=120)


# ---------------------------------------------------------------------------- (d) the FSDP1 meta-device idiom
# Rank 0 builds the real model, the other ranks build it on meta, and fully_shard materializes
# with torch FSDP1's per-module param_init_fn (``to_empty(recurse=False)``) and broadcasts rank
# 0's values (sync_module_states). Before the per-module calls, ranks != 0 raised (param_init_fn
# was called once per fully sharded module, so ``to_empty(recurse=False)`` left the submodules
# on meta) while rank 0 went on into the broadcast.
LLAMA_VOCAB, LLAMA_SEQ, LLAMA_ROWS = 37, 8, 2
_CPU = torch.device("cpu")


def _to_empty(module: nn.Module) -> None:
    """The idiom's ``param_init_fn`` (llama-recipes, accelerate)."""
    module.to_empty(device=_CPU, recurse=False)


class _BufferedParity(ParityModel):
    """``ParityModel`` (embedding tied with the head, a frozen Linear, a one-element handle)
    with a non-persistent buffer in the forward, like rotary ``inv_freq``: ``to_empty`` leaves
    it uninitialized on ranks != 0 and only ``sync_module_states`` makes it rank 0's."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mix", torch.linspace(0.5, 1.5, WIDTH), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) * self.mix.sum()


def _llama() -> nn.Module:
    # Imported here, not at the top: every rank of every process group of this file imports the
    # file, and transformers takes a second of CPU per rank; only the llama idiom needs it. It is
    # the [hf] extra, which the README's test command installs.
    import transformers

    config = transformers.LlamaConfig(vocab_size=LLAMA_VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=LLAMA_SEQ,
                                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config)


def _build(kind: str, meta: bool) -> nn.Module:
    """Rank 0's model (seed 0) or the same built on meta."""
    torch.manual_seed(0)
    with torch.device("meta") if meta else contextlib.nullcontext():
        return _llama() if kind == "llama" else _BufferedParity()


def _layers(model: nn.Module) -> List[nn.Module]:
    if isinstance(model, ParityModel):
        return list(model.blocks)
    llama: Any = model  # a LlamaForCausalLM of _llama(), whose module this file does not import at the top
    return list(llama.model.layers)


def _shard(model: nn.Module, annotation: str, **kwargs: object) -> None:
    if annotation == "policy":
        fully_shard(model, policy=ModuleWrapPolicy({type(_layers(model)[0])}), **kwargs)  # type: ignore[arg-type]
        return
    for layer in _layers(model):
        fully_shard(layer, **kwargs)  # type: ignore[arg-type]
    fully_shard(model, **kwargs)  # type: ignore[arg-type]


def _llama_loss(model: nn.Module, step: int, rows: slice) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, LLAMA_VOCAB, (LLAMA_ROWS * dist.get_world_size(), LLAMA_SEQ), generator=g)[rows]
    return model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]


def _train_llama(model: nn.Module, reference: nn.Module, steps: int) -> Tuple[List[float], List[float]]:
    """AdamW on each rank's rows against the reference on the whole batch; both losses per step."""
    rank = dist.get_rank()
    optim, ref_optim = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses, ref_losses = [], []
    for step in range(steps):
        loss = _llama_loss(model, step, slice(rank * LLAMA_ROWS, (rank + 1) * LLAMA_ROWS))
        loss.backward()
        ref_loss = _llama_loss(reference, step, slice(None))
        ref_loss.backward()
        for o in (optim, ref_optim):
            o.step()
            o.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
        ref_losses.append(ref_loss.item())
    return losses, ref_losses


def _idiom(kind: str, annotation: str) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _build(kind, meta=rank != 0)
    reference = _build(kind, meta=False)  # rank 0's model, trained on the whole batch in one process
    assert next(model.parameters()).is_meta == (rank != 0)
    _shard(model, annotation, sync_module_states=True, param_init_fn=_to_empty)
    what = f"[{kind}/{annotation}/W={world_size}/rank {rank}]"
    if kind == "llama":
        assert model.lm_head.weight is model.model.embed_tokens.weight, f"{what} tie lost"
    else:
        assert model.head.weight is model.emb.weight, f"{what} tie lost"
    # Exactly rank 0's values, non-persistent buffers (rotary inv_freq, mix) included.
    _assert_equal(_full_params(model), list(reference.named_parameters()), f"{what} parameters")
    _assert_equal(list(model.named_buffers()), list(reference.named_buffers()), f"{what} buffers")
    if kind == "llama":
        losses, ref_losses = _train_llama(model, reference, 3)
    else:
        losses, ref_losses = distributed_training(model, 3), reference_training(reference, 3, world_size)
    assert_losses_close(losses, ref_losses, atol=1e-5, what=what)
    assert_params_close(_full_params(model), list(reference.named_parameters()), atol=1e-5, what=f"{what} trained")


def _calls_recorded(model: nn.Module, calls: List[str]) -> Callable[[nn.Module], None]:
    names = {id(m): n or "<root>" for n, m in model.named_modules()}

    def init(module: nn.Module) -> None:
        calls.append(names[id(module)])
        _to_empty(module)

    return init


def _torch_fsdp1_calls(annotation: str) -> List[str]:
    """The modules torch FSDP1 calls param_init_fn on for ``_BufferedParity`` on meta."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

    model, calls = _build("parity", meta=True), []  # type: ignore[var-annotated]
    kwargs = dict(param_init_fn=_calls_recorded(model, calls), device_id=_CPU, use_orig_params=True)
    if annotation == "policy":
        FSDP(model, auto_wrap_policy=TorchModuleWrapPolicy({Block}), **kwargs)
    else:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = FSDP(block, **kwargs)  # type: ignore[arg-type]
        FSDP(model, **kwargs)
    return calls


def _same_calls_as_torch_fsdp1(annotation: str) -> None:
    """param_init_fn is called on the modules torch FSDP1 calls it on, in its order: each
    fully sharded module's subtree breadth-first, nested ones first, no call on a rank
    without meta tensors."""
    expected = _torch_fsdp1_calls(annotation)
    model, calls = _build("parity", meta=True), []  # type: ignore[var-annotated]
    _shard(model, annotation, param_init_fn=_calls_recorded(model, calls))
    assert calls == expected, (calls, expected)
    real, real_calls = _build("parity", meta=False), []  # type: ignore[var-annotated]
    _shard(real, annotation, param_init_fn=_calls_recorded(real, real_calls))
    assert real_calls == [], real_calls


def _idioms() -> None:
    if dist.get_world_size() == 4:  # what 4 ranks add: rank 0's values broadcast to three ranks on meta
        run_subtests(_idiom, {"kind": ["parity"], "annotation": ["policy", "manual"]})
        return
    run_subtests(_same_calls_as_torch_fsdp1, {"annotation": ["policy", "manual"]})  # which calls: rank-local
    run_subtests(_idiom, {"kind": ["llama", "parity"], "annotation": ["policy", "manual"]})


@pytest.mark.parametrize("world_size", [2, 4])
def test_meta_idiom_trains_as_rank0(world_size: int) -> None:
    """(d) The llama-recipes/accelerate idiom: rank 0 real, the others on meta, fully_shard with
    ``sync_module_states=True, param_init_fn=lambda m: m.to_empty(device=cpu, recurse=False)``,
    by policy and by hand, on a tiny random Hugging Face Llama (tied embedding, rotary
    ``inv_freq`` buffers) and on ParityModel with a non-persistent buffer: right after
    fully_shard every parameter and buffer equals rank 0's model bit for bit, ties are kept,
    and 3 AdamW steps give the losses and parameters of rank 0's model trained in one process
    on the combined batch. param_init_fn is called on exactly the modules torch FSDP1 calls it
    on, in its order (it used to be called once per fully sharded module, so ranks != 0 raised
    with meta tensors left). At 4 ranks ParityModel alone: the Llama adds Hugging Face's
    modules (rotary buffers, tied embedding), not ranks, and 2 ranks run it."""
    run_distributed(_idioms, world_size, timeout=120)


# ---------------------------------------------------------------------------- (e) refusals agreed across ranks
REFUSER = 1
DEADLINE_S = 45.0  # a rank that has not returned from fully_shard by then waits in a collective
# What each rank's fully_shard may take to raise: milliseconds on an idle machine (a few small
# collectives), seconds with more ranks than cores under load; gloo's timeout is 210 s here.
SECONDS = 30.0


def _outcomes(directory: str, outcome: Dict[str, Any]) -> List[Dict[str, Any]]:
    return outcomes_through_files(directory, outcome, DEADLINE_S, "fully_shard")


def _refusing_setup(case: str) -> Tuple[nn.Module, Dict[str, object]]:
    """The model and fully_shard arguments of this rank; only rank REFUSER's refuse."""
    refuser = dist.get_rank() == REFUSER
    model = _build("parity", meta=dist.get_rank() != 0)
    kwargs: Dict[str, object] = dict(sync_module_states=True, param_init_fn=_to_empty)

    def raising(module: nn.Module) -> None:
        _to_empty(module)
        if module is model.blocks[1].fc1:
            raise KeyError("param_init_fn failed on blocks.1.fc1 (rank 1)")

    def leaving_meta(module: nn.Module) -> None:
        if module is not model.scale:
            _to_empty(module)

    if case == "init_raises" and refuser:
        kwargs["param_init_fn"] = raising
    elif case == "meta_left" and refuser:
        kwargs["param_init_fn"] = leaving_meta
    elif case == "different_model" and refuser:
        model.blocks.append(Block().to_empty(device=_CPU))
    elif case == "plan_refuses_without_sync":
        model = _build("parity", meta=False)
        kwargs = {}
        model.emb.sparse = refuser  # a sparse gradient cannot be sharded: refused while planning
    return model, kwargs


_EXPECTED = {  # case -> (exception type on every rank, what every message says)
    "init_raises": ("KeyError", "param_init_fn failed on blocks.1.fc1 (rank 1)"),
    "meta_left": ("ValueError", "['scale.gain'] are still on the meta device"),
    "different_model": ("RuntimeError", "ranks disagree on what sync_module_states broadcasts from rank 0"),
    "plan_refuses_without_sync": ("ValueError", "sparse=True"),
}


def _one_rank_refuses(case: str, directory: str, annotation: str) -> None:
    """Rank REFUSER alone refuses and catches its error, carrying on: every rank raises the
    same error, naming the refusing rank, within seconds, and none applied fully_shard."""
    rank = dist.get_rank()
    model, kwargs = _refusing_setup(case)
    dist.barrier()  # the clock starts when every rank is about to call fully_shard
    start = time.monotonic()
    try:
        _shard(model, annotation, **kwargs)
        outcome: Dict[str, object] = {"error": None, "message": "", "seconds": time.monotonic() - start}
    except Exception as e:
        outcome = {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    outcomes = _outcomes(os.path.join(directory, f"{case}-{annotation}"), outcome)
    kind, text = _EXPECTED[case]
    for r, o in enumerate(outcomes):
        assert o["error"] == kind and text in str(o["message"]), (case, r, o)
        assert float(o["seconds"]) < SECONDS, (case, r, o)  # gloo's timeout: 210 s
        refused_here = r == REFUSER or case == "different_model"
        assert refused_here or f"rank {REFUSER} refused" in str(o["message"]), (case, r, o)
    assert fully_shard.state(model) is None and not isinstance(model, FSDPModule), (case, rank)
    check = torch.ones(1)
    dist.all_reduce(check)  # every rank is out of fully_shard and in step
    assert check.item() == dist.get_world_size()


def _init_collectives() -> None:
    """Each fully_shard call issues one exchange of six int64 values (in a 64-byte frame: [Note:
    Exchanges name themselves] in collectives.py) in its group before anything else, and with
    sync_module_states nothing but that and the broadcasts."""
    for annotation, calls in (("policy", 1), ("manual", 3)):
        with record_collectives() as rec:
            _shard(_build("parity", meta=dist.get_rank() != 0), annotation, sync_module_states=True,
                   param_init_fn=_to_empty)
        kinds = [(r.kind, r.nbytes, r.tag) for r in rec.records if r.kind != "broadcast"]
        assert kinds == [("exchange", 64, "fully_shard::init")] * calls, (annotation, kinds)
        assert rec.events[0][1] == "exchange" and {r.tag for r in rec.records if r.kind == "broadcast"} == \
            {"sync_module_states"}, (annotation, rec.events)


def _hybrid_refuses(directory: str) -> None:
    """HYBRID_SHARD on a 2x2 mesh: the agreement runs in the shard group, then the replicate
    group (two exchanges), and reaches every rank; rank 3 alone refuses."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    rank = dist.get_rank()
    model = _build("parity", meta=False)
    model.emb.sparse = rank == 3
    dist.barrier()
    start = time.monotonic()
    with record_collectives() as rec:
        try:
            fully_shard(model, mesh=mesh, strategy=ShardingStrategy.HYBRID_SHARD)
            outcome: Dict[str, object] = {"error": None, "message": "", "seconds": time.monotonic() - start}
        except ValueError as e:
            outcome = {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    assert [r.kind for r in rec.records][:2] == ["exchange", "exchange"], rec.records
    for r, o in enumerate(_outcomes(os.path.join(directory, "hybrid"), outcome)):
        assert o["error"] == "ValueError" and "sparse=True" in str(o["message"]), (r, o)
        assert r == 3 or "rank 3 refused" in str(o["message"]), (r, o)
        assert float(o["seconds"]) < SECONDS, (r, o)
    healthy = _build("parity", meta=False)
    with record_collectives() as rec:
        fully_shard(healthy, mesh=mesh, strategy=ShardingStrategy.HYBRID_SHARD)
    assert [(r.kind, r.nbytes) for r in rec.records] == [("exchange", 64)] * 2, rec.records


def _replicate_refuses(directory: str) -> None:
    """replicate shares the problem (its first collective, the state check, waited for a rank
    that refused alone); its refusal now travels in that same gather (no extra collective)."""
    model = make_model()
    model.emb.sparse = dist.get_rank() == REFUSER
    dist.barrier()
    start = time.monotonic()
    with record_collectives() as rec:
        try:
            replicate(model)
            outcome: Dict[str, object] = {"error": None, "message": "", "seconds": time.monotonic() - start}
        except ValueError as e:
            outcome = {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    assert [r.kind for r in rec.records] == ["all_gather_json"], rec.records
    for r, o in enumerate(_outcomes(os.path.join(directory, "replicate"), outcome)):
        assert o["error"] == "ValueError" and "sparse=True" in str(o["message"]), (r, o)
        assert r == REFUSER or f"rank {REFUSER} refused" in str(o["message"]), (r, o)
        assert float(o["seconds"]) < SECONDS, (r, o)


def _refusals(directory: str) -> None:
    run_subtests(_one_rank_refuses, {"case": list(_EXPECTED), "annotation": ["policy", "manual"]},
                 directory=directory)
    _replicate_refuses(directory)
    _init_collectives()
    if dist.get_world_size() == 4:
        _hybrid_refuses(directory)


@pytest.mark.parametrize("world_size", [2, 4])
def test_one_rank_refusing_raises_on_every_rank(world_size: int, tmp_path: Path) -> None:
    """(e) A refusal on one rank only -- its param_init_fn raises, leaves a meta tensor, its
    model differs (with sync_module_states), or planning refuses (a sparse embedding, no
    collective in fully_shard at all) -- and that rank catches its error and carries on: every
    rank raises the same error type with the refusing rank's message, naming it, in under 30 s
    (outcomes exchanged through files, so no collective frees a waiting rank; the process
    group's timeout is 210 s), no rank applied fully_shard, and the group is usable
    afterwards. By hand and by policy; HYBRID_SHARD on a 2x2 mesh at W=4; replicate (a sparse
    embedding on one rank). The agreement costs one 48-byte exchange per fully_shard call (two
    for hybrid), nothing more for replicate. Before, the other ranks went on
    into the broadcast (or into training) and waited forever."""
    run_distributed(_refusals, world_size, str(tmp_path), timeout=150)
