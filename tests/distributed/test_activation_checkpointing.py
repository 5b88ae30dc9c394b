"""Activation checkpointing, applied every way users apply it, composes with fully_shard and
replicate and gives the gradients of training without it (no ``transformers`` needed; the
``[hf]`` module runs the same on real decoders).

The ways: ``torch.utils.checkpoint`` around a managed block's ``__call__`` (what older
``transformers`` layers do: the block's own forward hooks run inside the checkpointed region and
again when backward recomputes it), around its ``forward`` (what ``transformers`` 5 does: hooks
stay outside), each non-reentrant and reentrant; torch's ``apply_activation_checkpointing``
before or after sharding, plain and with selective activation checkpointing (torchtitan's
wrapper: a policy that keeps matmul outputs, and one that keeps nothing); the library's
``checkpoint`` in either call order; a reentrant ``torch.utils.checkpoint`` around a part of each block
(``fc_in``), from the first step or switched on at the second: part of a block's gradient then
arrives in the checkpoint's nested backward, through the views the forward made and the backward
reuses ([Note: Kept views]).

Bugs these catch (each seen): a recomputation inside backward refused by the handle's state
machine ("expected IDLE, found BACKWARD_PRE"); views installed by the pre-backward hook with
grad mode off, so a non-reentrant recomputation saves fewer tensors than the forward (an
error) and a reentrant one computes no parameter gradient at all (silently wrong training);
a recomputation that frees the unsharded storage its recomputed tensors point into, or gathers
it a third time; a profiler range opened only in the recomputation, which selective
checkpointing counts against the forward's ("found RECOMPUTE in post_backward" and a refused
step).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from composable_shard import MixedPrecision, ShardingStrategy, checkpoint, fully_shard, replicate, unshard_params
from composable_shard._runtime.collectives import record_collectives
from composable_shard._runtime.traversal import _get_fsdp_handles
from tests._harness import run_distributed, run_subtests, world_sizes

WIDTH, VOCAB, SEQ, ROWS, STEPS = 8, 11, 5, 2, 2  # step 1: the order recorded, momentum, a later iteration


class BlockOutput(OrderedDict):
    """A ``ModelOutput``-like container: a mapping whose values are also attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as e:
            raise AttributeError(name) from e


class Conv1D(nn.Module):
    """GPT-2's projection: a weight stored (in, out) and used by ``addmm`` as is. (``nn.Linear``
    transposes its weight first, which hides a view that does not require grad.)"""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.3)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class Block(nn.Module):
    """A decoder-style block: hidden states positional; keyword-only a (cos, sin) tuple, an
    optional mask and a cache flag; returns a tuple with a ``None`` or a mapping.

    ``wrap`` says how ``torch.utils.checkpoint`` is applied by the block itself: ``None``,
    ``"call"`` (around ``__call__``) or ``"forward"``; ``reentrant`` picks the variant.
    ``part_from``: from that training forward on (counted from 0), a reentrant checkpoint around
    ``fc_in`` alone, so the block's parameters get part of their gradient in the checkpoint's
    nested backward and the rest in the outer one."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc_in = Conv1D(WIDTH, 2 * WIDTH + 1)
        self.fc_out = nn.Linear(2 * WIDTH + 1, WIDTH)
        self.wrap: Optional[str] = None
        self.reentrant = False
        self.returns = "tuple"
        self.part_from: Optional[int] = None
        self.training_forwards = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.wrap == "call" and self.training and torch.is_grad_enabled():
            return torch_checkpoint.checkpoint(functools.partial(super().__call__, **kwargs), *args,
                                               use_reentrant=self.reentrant)
        return super().__call__(*args, **kwargs)

    def forward(self, x: torch.Tensor, *, position: Tuple[torch.Tensor, torch.Tensor],
                mask: Optional[torch.Tensor] = None, use_cache: bool = False) -> Any:
        if self.part_from is not None and self.training and torch.is_grad_enabled():
            self.training_forwards += 1
        if self.wrap == "forward" and self.training and torch.is_grad_enabled():
            inner = functools.partial(self._forward, position=position, mask=mask, use_cache=use_cache)
            return torch_checkpoint.checkpoint(inner, x, use_reentrant=self.reentrant)
        return self._forward(x, position=position, mask=mask, use_cache=use_cache)

    def _forward(self, x: torch.Tensor, *, position: Tuple[torch.Tensor, torch.Tensor],
                 mask: Optional[torch.Tensor], use_cache: bool) -> Any:
        cos, sin = position
        h = self.ln(x)
        h = h * cos + h.roll(1, dims=-1) * sin
        h = self.fc_out(F.gelu(self._fc_in(h)))
        if mask is not None:
            h = h * mask
        out = x + h
        if self.returns == "mapping":
            return BlockOutput(hidden_states=out, cache=None if not use_cache else out.detach())
        return (out, None)


    def _fc_in(self, h: torch.Tensor) -> torch.Tensor:
        if self.part_from is not None and self.training and torch.is_grad_enabled() \
                and self.training_forwards > self.part_from:
            return torch_checkpoint.checkpoint(self.fc_in, h, use_reentrant=True)
        return self.fc_in(h)


class Decoder(nn.Module):
    """Embedding, three blocks (the first without a mask), final norm and head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        # torch.utils.checkpoint around all blocks ("nonreentrant"/"reentrant"): every block's
        # hooks run again in backward, before (or after) that block's own backward began
        self.checkpoint_stack: Optional[str] = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        angle = torch.arange(SEQ, dtype=x.dtype, device=x.device)[:, None] / 3.0
        position = (torch.cos(angle), torch.sin(angle))  # like rotary embeddings: no grad, a tuple
        mask = (torch.arange(SEQ, device=x.device) % 4 != 3).to(x.dtype)[:, None]

        def stack(x: torch.Tensor) -> torch.Tensor:
            for i, block in enumerate(self.blocks):
                out = block(x, position=position, mask=None if i == 0 else mask, use_cache=False)
                x = out[0] if isinstance(out, tuple) else out.hidden_states
            return x

        if self.checkpoint_stack is not None and self.training and torch.is_grad_enabled():
            x = torch_checkpoint.checkpoint(stack, x, use_reentrant=self.checkpoint_stack == "reentrant")
        else:
            x = stack(x)
        return self.head(self.norm(x))


def _build(returns: str = "tuple") -> Decoder:
    torch.manual_seed(0)
    model = Decoder()
    for block in model.blocks:
        block.returns = returns
    return model


def _batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    tokens = torch.randint(0, VOCAB, (ROWS * dist.get_world_size(), SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


# ---------------------------------------------------------------------------- how it is applied
def _set_block_wrap(model: Decoder, wrap: str, reentrant: bool) -> None:
    for block in model.blocks:
        block.wrap, block.reentrant = wrap, reentrant


def _set_part(model: Decoder, first_forward: int) -> None:
    for block in model.blocks:
        block.part_from = first_forward


def _is_block(module: nn.Module) -> bool:
    return isinstance(module, Block)


_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """torchtitan's selective policy in small: matmul outputs kept, the rest recomputed."""
    return CheckpointPolicy.MUST_SAVE if op in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_nothing(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective(policy: Callable[..., CheckpointPolicy]) -> Callable[[nn.Module], nn.Module]:
    """torch's ``checkpoint_wrapper`` with selective activation checkpointing (torchtitan's
    wrapper): fully_shard's forward hooks run inside the region and again in the recomputation,
    which counts the profiler ranges they open."""
    return functools.partial(checkpoint_wrapper,
                             context_fn=functools.partial(create_selective_checkpoint_contexts, policy))


# name -> (before sharding, after sharding); both receive the model
_WAYS: Dict[str, Tuple[Callable[[Decoder], None], Callable[[Decoder], None]]] = {
    "call_nonreentrant": (lambda m: _set_block_wrap(m, "call", False), lambda m: None),
    "call_reentrant": (lambda m: None, lambda m: _set_block_wrap(m, "call", True)),
    "forward_nonreentrant": (lambda m: None, lambda m: _set_block_wrap(m, "forward", False)),
    "forward_reentrant": (lambda m: _set_block_wrap(m, "forward", True), lambda m: None),
    "stack_nonreentrant": (lambda m: setattr(m, "checkpoint_stack", "nonreentrant"), lambda m: None),
    "stack_reentrant": (lambda m: None, lambda m: setattr(m, "checkpoint_stack", "reentrant")),
    # a reentrant checkpoint around a part of a block, no hook of ours inside, from the first step
    # on or switched on for the second: the kept forward views meet a nested backward
    "part_reentrant": (lambda m: None, lambda m: _set_part(m, 0)),
    "part_late_reentrant": (lambda m: _set_part(m, 1), lambda m: None),
    "apply_ac_before": (lambda m: apply_activation_checkpointing(m, check_fn=_is_block), lambda m: None),
    "apply_ac_after": (lambda m: None, lambda m: apply_activation_checkpointing(m, check_fn=_is_block)),
    "selective_before": (lambda m: apply_activation_checkpointing(
        m, checkpoint_wrapper_fn=_selective(_keep_matmuls), check_fn=_is_block), lambda m: None),
    "selective_after": (lambda m: None, lambda m: apply_activation_checkpointing(
        m, checkpoint_wrapper_fn=_selective(_keep_nothing), check_fn=_is_block)),
    "library_first": (lambda m: [checkpoint(b) for b in m.blocks] and None, lambda m: None),
    "library_after": (lambda m: None, lambda m: [checkpoint(b) for b in m.blocks] and None),
}


def _distribute(model: Decoder, api: str, strategy: ShardingStrategy, mp: Optional[MixedPrecision]) -> None:
    """Per-block fully_shard (or replicate) and a root fully_shard."""
    kwargs: Dict[str, Any] = {"strategy": strategy}
    if mp is not None:
        kwargs["mixed_precision"] = mp
    for block in model.blocks:  # after apply_activation_checkpointing: the wrapper
        if api == "replicate":
            replicate(block)
        else:
            fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def _make(way: str, api: str, strategy: ShardingStrategy, mp: Optional[MixedPrecision], returns: str) -> Decoder:
    before, after = _WAYS[way] if way != "none" else (lambda m: None, lambda m: None)
    model = _build(returns)
    before(model)
    _distribute(model, api, strategy, mp)
    after(model)
    return model


# ---------------------------------------------------------------------------- checks
def _full_grads(model: nn.Module) -> List[Optional[torch.Tensor]]:
    with unshard_params(model, with_grads=True):
        return [None if p.grad is None else p.grad.detach().float().clone() for p in model.parameters()]


def _full_params(model: nn.Module) -> List[torch.Tensor]:
    with unshard_params(model):
        return [p.detach().clone() for p in model.parameters()]


def _compare(actual: List[Optional[torch.Tensor]], expected: List[Optional[torch.Tensor]], atol: float,
             what: str) -> None:
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert (a is None) == (e is None), f"{what} parameter #{i}: grad None here {a is None}, expected {e is None}"
        if a is not None and e is not None:
            diff = (a - e).abs().max().item()
            assert diff <= atol, f"{what} parameter #{i}: max abs diff {diff} > {atol}"


def _gathers_per_handle(model: nn.Module, records: Any) -> Dict[str, int]:
    tags = [r.tag for r in records if r.kind == "all_gather"]
    return {h.fqn: tags.count(h.fqn) for h in _get_fsdp_handles(model) if h.fqn}


def _subtest(way: str, api: str, strategy: ShardingStrategy, mixed: bool, returns: str = "tuple") -> None:
    """Two SGD steps (the first iteration, which records the handle order, and a later one on
    updated parameters with momentum): every gradient (after each backward) and the final
    parameters equal the reference's: single-process training on the global batch (float32),
    or the same distributed model without checkpointing (bfloat16). A FULL_SHARD block is
    gathered exactly twice per step, recomputation or not."""
    if returns == "mapping" and way.endswith("_reentrant") and not way.startswith("stack"):
        raise AssertionError("a reentrant checkpoint differentiates tuple outputs only")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
    what = f"[{way}/{api}/{strategy.name}/{'bf16' if mixed else 'fp32'}/{returns}]"
    model = _make(way, api, strategy, mp, returns)
    reference = _make("none", api, strategy, mp, returns) if mixed else _build(returns)
    optims = [torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9) for m in (model, reference)]
    atol = 1e-6 if mixed else 1e-5  # bf16: the same computation twice, only summation order may differ
    for step in range(STEPS):
        inputs, targets = _batch(step)
        rows = slice(rank * ROWS, (rank + 1) * ROWS)
        with record_collectives() as rec:
            _loss(model, inputs[rows], targets[rows]).backward()
        if mixed:
            _loss(reference, inputs[rows], targets[rows]).backward()
            expected = _full_grads(reference)
        else:
            _loss(reference, inputs, targets).backward()  # mean over the global batch
            expected = [None if p.grad is None else p.grad.clone() for p in reference.parameters()]
        _compare(_full_grads(model), expected, atol, f"{what} step {step} grads")
        if api == "fully_shard" and strategy is ShardingStrategy.FULL_SHARD and world_size > 1:
            gathers = _gathers_per_handle(model, rec.records)
            assert set(gathers.values()) == {2}, f"{what} all-gathers per block: {gathers}"
        for optim in optims:
            optim.step()
            optim.zero_grad()
    actual_params = _full_params(model)
    expected_params = _full_params(reference) if mixed else [p.detach() for p in reference.parameters()]
    _compare(actual_params, expected_params, 1e-5, f"{what} parameters")  # type: ignore[arg-type]


# At W = 2, beside FULL_SHARD in float32, each way runs under one of the other (strategy, bf16)
# pairs, in turn, so that every pair meets two different ways: the way decides what is
# recomputed and when, the pair how the parameters are gathered and cast for it.
_OTHER_PAIRS = [(ShardingStrategy.SHARD_GRAD_OP, False), (ShardingStrategy.NO_SHARD, False),
                (ShardingStrategy.FULL_SHARD, True), (ShardingStrategy.SHARD_GRAD_OP, True),
                (ShardingStrategy.NO_SHARD, True)]


def _way_under_another_pair(index: int) -> None:
    way = list(_WAYS)[index]
    strategy, mixed = _OTHER_PAIRS[index % len(_OTHER_PAIRS)]
    _subtest(way, "fully_shard", strategy, mixed)


# At W = 4 one way of each pair above (a reentrant and a non-reentrant one, applied before and
# after sharding): what four ranks change is how a block is sharded, not what is recomputed.
_AT_FOUR = ["call_nonreentrant", "forward_reentrant", "stack_nonreentrant", "apply_ac_after", "selective_before",
            "library_after"]


def _under_profiler(way: str) -> None:
    """``_subtest`` (FULL_SHARD, float32) while torch's profiler records: the library's transitions
    open profiler ranges then, and a range opened only by the recomputation would be counted by
    selective checkpointing against the forward's (a refused step)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        _subtest(way, "fully_shard", ShardingStrategy.FULL_SHARD, False)


def _all_ways(full: bool) -> None:
    ways = _AT_FOUR if dist.get_world_size() == 4 else list(_WAYS)
    run_subtests(_subtest, {"way": ways, "api": ["fully_shard"], "strategy": [ShardingStrategy.FULL_SHARD],
                            "mixed": [False]})
    if full:
        # the part_ ways check the kept views' nested-backward rule, which only fully_shard FULL_SHARD
        # (the first grid) and one other pair exercise differently: not under every pair and replicate
        run_subtests(_way_under_another_pair, {"index": [i for i, w in enumerate(_WAYS) if w != "part_late_reentrant"]})
        plain = [w for w in _WAYS if not w.startswith(("selective", "part_"))]  # selective: as the plain wrapper under replicate
        run_subtests(_subtest, {"way": plain, "api": ["replicate"], "strategy": [ShardingStrategy.FULL_SHARD],
                                "mixed": [False]})
        non_reentrant = [w for w in plain if not w.endswith("_reentrant") or w.startswith("stack")]
        run_subtests(_subtest, {"way": non_reentrant, "api": ["fully_shard"],
                                "strategy": [ShardingStrategy.FULL_SHARD], "mixed": [False], "returns": ["mapping"]})
    if dist.get_world_size() < 4:  # the ranges a transition opens do not depend on W
        run_subtests(_under_profiler, {"way": ["selective_before", "selective_after"]})


@pytest.mark.parametrize("world_size", world_sizes())
def test_every_way_of_checkpointing_matches_training_without(world_size: int) -> None:
    """Each way of applying activation checkpointing x fully_shard FULL_SHARD (W=1 and 2; at W=4
    one of each pair, ``_AT_FOUR``), the selective ways also under torch's profiler (W=1, 2);
    at W=2 also each way under one more of SHARD_GRAD_OP, NO_SHARD and bf16 (``_OTHER_PAIRS``,
    every pair on two ways), replicate, and mapping outputs: gradients at every step and final
    parameters equal training without checkpointing."""
    run_distributed(_all_ways, world_size, world_size == 2, timeout=300)
