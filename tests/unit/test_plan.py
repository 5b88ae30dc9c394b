"""``plan()`` without a process group (``world_size=2``): the chosen annotation at the edges of
the budget, the infeasible error, bad input, and a model left exactly as it was by the fake
forward/backward and the timed forward.

Without these, a planner that checkpoints when nothing needs it, that silently returns a plan
over budget, or that leaves the measurement's gradients, buffers or RNG draws in the model
(a training run that then differs from one never planned) would pass unnoticed.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Tuple

import pytest
import torch
import torch.nn as nn

from composable_shard import MemoryPlan, plan

WIDTH, SEQ, BATCH, VOCAB = 16, 8, 4, 32


class ToyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(torch.relu(self.fc1(self.ln(x)))))


class Toy(nn.Module):
    """Embedding, blocks in a ModuleList, a head; a buffer its forward updates (like running stats)."""

    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([ToyBlock() for _ in range(blocks)])
        self.head = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _toy() -> tuple:
    torch.manual_seed(0)
    return Toy(), torch.randint(0, VOCAB, (BATCH, SEQ))


def _smallest_peak(model: nn.Module, batch: torch.Tensor) -> int:
    with pytest.raises(ValueError) as info:
        plan(model, batch, memory_budget=1, world_size=2)
    found = re.search(r"the smallest peak is ([\d,]+) B", str(info.value))
    assert found, str(info.value)
    return int(found.group(1).replace(",", ""))


def test_budget_above_the_unsharded_peak_replicates_everything() -> None:
    """A budget any replica fits in: replicate(model), no checkpointing, nothing sharded."""
    model, batch = _toy()
    p = plan(model, batch, memory_budget=10 ** 12, world_size=2)
    assert isinstance(p, MemoryPlan)
    assert [c.api for c in p.choices] == ["replicate"] * 5, p.choices
    assert not any(c.checkpoint for c in p.choices), p.choices
    assert p.choices[0].fqn == "" and [c.fqn for c in p.choices[1:]] == [f"blocks.{k}" for k in range(4)]
    assert p.predicted_peak == sum(p.components.values()) <= 10 ** 12
    assert p.components["parameters"] == 4 * sum(q.numel() for q in model.parameters())  # fp32 replicas


def test_twelve_blocks_each_get_a_choice() -> None:
    """Blocks whose names are prefixes of others' (``blocks.1`` of ``blocks.10`` and ``blocks.11``)
    are twelve blocks, each with its own choice: a finder that took ``blocks.10`` for a part of
    ``blocks.1`` would leave the last two in the root's handle, planned and sharded with it."""
    torch.manual_seed(0)
    model, batch = Toy(blocks=12), torch.randint(0, VOCAB, (BATCH, SEQ))
    p = plan(model, batch, memory_budget=10 ** 12, world_size=2)
    assert [c.fqn for c in p.choices] == [""] + [f"blocks.{k}" for k in range(12)], [c.fqn for c in p.choices]


class _WithTaps(Toy):
    """The Toy with a longer ModuleList of small probes beside its blocks (heads read off each
    block's output): the blocks hold the most parameters, the probes are the most modules."""

    def __init__(self) -> None:
        super().__init__(blocks=3)
        self.taps = nn.ModuleList([nn.Linear(WIDTH, 1) for _ in range(6)])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        taps = []
        for k, block in enumerate(self.blocks):
            x = block(x)
            taps.append(self.taps[k](x))
        return self.head(x) + torch.cat(taps, -1).sum(-1, keepdim=True)


def test_default_blocks_come_from_the_list_holding_the_most_parameters() -> None:
    """Without ``block_types`` the blocks are the instances of the ModuleList holding the most
    parameters (the transformer's layers), not the list with the most entries."""
    torch.manual_seed(0)
    model, batch = _WithTaps(), torch.randint(0, VOCAB, (BATCH, SEQ))
    p = plan(model, batch, memory_budget=10 ** 12, world_size=2, profile="fake")
    assert [c.fqn for c in p.choices] == ["", "blocks.0", "blocks.1", "blocks.2"], [c.fqn for c in p.choices]


def test_adam_and_adamw_keep_two_states_per_element_and_sgd_none() -> None:
    """``optimizer="adam"`` keeps what ``"adamw"`` keeps (two fp32 states per element of this
    rank's parameters); ``"sgd"`` (no momentum) keeps nothing. A planner counting nothing for Adam
    would predict a peak two parameter-sizes too small, and pass budgets the real step exceeds."""
    model, batch = _toy()
    plans = {name: plan(model, batch, memory_budget=10 ** 12, world_size=2, optimizer=name)
             for name in ("adamw", "adam", "sgd")}
    params = plans["adamw"].components["parameters"]
    assert plans["adam"].components["optimizer"] == plans["adamw"].components["optimizer"] >= 2 * params, \
        {k: v.components for k, v in plans.items()}
    assert plans["sgd"].components["optimizer"] == 0, plans["sgd"].components
    assert plans["adam"].predicted_peak == plans["adamw"].predicted_peak > plans["sgd"].predicted_peak, \
        {k: v.predicted_peak for k, v in plans.items()}


def test_smallest_budget_shards_every_block_fully_and_checkpoints() -> None:
    """At the smallest achievable peak every block is fully sharded, the first (whose backward
    holds every other block's kept activations) FULL_SHARD with checkpoint, at least half of them
    checkpointed; the predicted peak is within the budget; more budget never costs more."""
    model, batch = _toy()
    smallest = _smallest_peak(model, batch)
    p = plan(model, batch, memory_budget=smallest, world_size=2)
    blocks = [c for c in p.choices if c.fqn]
    assert all(c.api == "fully_shard" for c in blocks), p.choices
    assert blocks[0].strategy == "FULL_SHARD" and blocks[0].checkpoint, p.choices
    assert sum(c.checkpoint for c in blocks) >= len(blocks) // 2, p.choices
    assert p.choices[0].api == "fully_shard" and p.predicted_peak <= smallest
    roomier = plan(model, batch, memory_budget=smallest * 2, world_size=2)
    assert roomier.predicted_peak <= smallest * 2
    assert roomier.cost_seconds <= p.cost_seconds


def test_infeasible_budget_names_the_smallest_peak_and_what_it_takes() -> None:
    model, batch = _toy()
    with pytest.raises(ValueError, match=r"no plan fits Toy in memory_budget=1,000 B per rank at 2 ranks: the smallest "
                                         r"peak is [\d,]+ B .*(ranks|batch)"):
        plan(model, batch, memory_budget=1000, world_size=2)


def test_one_row_batch_fraction_rounds_down_to_what_fits() -> None:
    """A batch of one row cannot lose rows: one byte below the smallest peak the message says a
    fraction of the activations below 100% (it said "100%", which does not fit), rounded down."""
    model, batch = _toy()
    smallest = _smallest_peak(model, batch[:1])
    with pytest.raises(ValueError) as info:
        plan(model, batch[:1], memory_budget=smallest - 1, world_size=2)
    percent = re.search(r"activations at most ([\d.]+)% of the example's fit \(its batch has one row", str(info.value))
    assert percent is not None and 90.0 <= float(percent.group(1)) < 100.0, str(info.value)


def _rows_case(name: str) -> Tuple[nn.Module, torch.Tensor, Callable[[torch.Tensor], Callable[[Any], torch.Tensor]]]:
    """A residual conv net (4 rows of 3 x 32 x 32) or a GPT (4 rows of 32 tokens), and a loss of a
    batch's targets (a ``loss_fn`` holding them, as a training loop writes it: it cannot run on
    fewer rows)."""
    import torch.nn.functional as F
    from benchmarks.model import GPT
    from benchmarks.plan import ConvNet
    torch.manual_seed(0)
    if name == "convnet":
        return ConvNet(channels=16, blocks=3), torch.randn(4, 3, 32, 32), \
            lambda x: (lambda logits, y=torch.zeros(x.shape[0], dtype=torch.long): F.cross_entropy(logits, y))
    return GPT(blocks=2, vocab=512, width=64, heads=4, max_seq=32), torch.randint(0, 512, (4, 32)), \
        lambda x: (lambda logits, y=x: F.cross_entropy(logits.reshape(-1, 512), y.reshape(-1)))


@pytest.mark.parametrize("name", ["convnet", "gpt"])
def test_infeasible_budget_names_the_most_rows_that_fit(name: str) -> None:
    """Below the smallest peak the message names the most batch rows per rank that fit: planning
    the example's first r rows at that budget succeeds and r + 1 rows do not fit; with a
    ``loss_fn`` that holds the example's targets (it cannot run on fewer rows) the same r, said to
    be an estimate; below what the parameters, gradients and optimizer state hold alone, that no
    batch fits. Before, half a residual conv net's smallest peak got only "more ranks do not fit"
    and a percentage of the batch."""
    model, x, loss_of = _rows_case(name)
    with pytest.raises(ValueError) as info:
        plan(model, x, memory_budget=1, world_size=2, profile="fake")
    smallest = int(re.search(r"the smallest peak is ([\d,]+) B", str(info.value)).group(1).replace(",", ""))  # type: ignore[union-attr]
    budget = smallest * (5 if name == "convnet" else 9) // 10
    with pytest.raises(ValueError) as info:
        plan(model, x, memory_budget=budget, world_size=2, profile="fake")
    found = re.search(r"At 2 ranks, a per-rank batch of at most (\d) of the example's 4 rows fits \(measured on \d rows?: "
                      r"smallest peak ([\d,]+) B\); or raise memory_budget\.$", str(info.value))
    assert found, str(info.value)
    rows = int(found.group(1))
    assert 1 <= rows < 4, str(info.value)
    fits = plan(model, x[:rows], memory_budget=budget, world_size=2, profile="fake")
    assert fits.predicted_peak <= budget and int(found.group(2).replace(",", "")) <= budget, str(info.value)
    if rows + 1 < 4:  # 4 rows are the example's, which did not fit
        with pytest.raises(ValueError, match="no plan fits"):
            plan(model, x[:rows + 1], memory_budget=budget, world_size=2, profile="fake")
    with pytest.raises(ValueError, match=rf"a per-rank batch of at most {rows} of the example's 4 rows fits by an "
                                         r"estimate \(the activations scaled with the rows: loss_fn could not run"):
        plan(model, x, memory_budget=budget, world_size=2, profile="fake", loss_fn=loss_of(x))
    alone = sum(p.numel() for p in model.parameters()) * (4 + 4 + 8) // 2  # W = 2: shards, their gradients, AdamW
    with pytest.raises(ValueError, match=r"No batch fits at 2 ranks: without activations \(parameters, gradients, "
                                         r"optimizer state and the unsharded and communication buffers alone\) the peak "
                                         r"is [\d,]+ B; raise memory_budget\.$"):
        plan(model, x, memory_budget=alone - 1, world_size=2, profile="fake")


def test_frozen_parameters_under_replicate_are_counted() -> None:
    """Frozen blocks under ``replicate`` are held whole on every rank although replicate does not
    manage them: the plan's parameter bytes count them (before, replicating a frozen block looked
    free and the measured peak went over the budget by the frozen bytes) and equal describe's."""
    model, batch = _toy()
    for block in model.blocks[:2]:
        block.requires_grad_(False)
    total = sum(q.numel() * q.element_size() for q in model.parameters())
    p = plan(model, batch, memory_budget=10 ** 12, world_size=2)
    assert {c.api for c in p.choices} == {"replicate"}, p.choices  # replicate(model) fits any budget this large
    assert p.components["parameters"] == total == p.param_bytes, (p.components, total, p.param_bytes)


def test_meta_device_model_or_batch_is_measured_not_counted_as_zero() -> None:
    """Meta tensors have no storage: measured on them, every activation was 0 bytes (a Llama-8B
    shaped plan predicted 32 KB of activations and fit anywhere), then they were refused. Now
    the fake pass measures a meta model or batch as the materialized one."""
    real, batch = _toy()
    with torch.device("meta"):
        meta = Toy()
    expected = plan(real, batch, memory_budget=10 ** 12, world_size=2).profiles
    assert all(b.saved_bytes > BATCH * SEQ * WIDTH * 4 for b in expected), expected
    for model, example in ((meta, batch), (real, batch.to("meta")), (meta, batch.to("meta"))):
        p = plan(model, example, memory_budget=10 ** 12, world_size=2)
        assert [(b.saved_bytes, b.input_bytes) for b in p.profiles] == [(b.saved_bytes, b.input_bytes) for b in expected]
        assert p.profile_source == "fake"


def test_planning_leaves_parameters_grads_buffers_and_rng_untouched() -> None:
    """The measured forward/backward draws dropout masks and bumps the buffer: both undone."""
    model, batch = _toy()
    for q in model.parameters():
        q.grad = torch.full_like(q, 0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [q.grad for q in model.parameters()]
    rng = torch.get_rng_state()
    plan(model, batch, memory_budget=10 ** 12, world_size=2)
    assert torch.equal(torch.get_rng_state(), rng)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), [k for k in before if not torch.equal(before[k], after[k])]
    assert all(q.grad is g and bool((g == 0.5).all()) for q, g in zip(model.parameters(), grads))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_measured_inputs_are_the_block_activations() -> None:
    """Each block's input (what a checkpointed block keeps) is one (B, T, W) float tensor."""
    model, batch = _toy()
    p = plan(model, batch, memory_budget=10 ** 12, world_size=2)
    assert [b.input_bytes for b in p.profiles] == [BATCH * SEQ * WIDTH * 4] * 4
    assert all(b.saved_bytes > b.input_bytes and b.forward_seconds > 0 for b in p.profiles)


@pytest.mark.parametrize("kwargs, message", [
    ({"memory_budget": 0}, "memory_budget must be a positive int"),
    ({"memory_budget": -5}, "memory_budget must be a positive int"),
    ({"memory_budget": 1.5e9}, "memory_budget must be a positive int"),
    ({"memory_budget": 10 ** 9, "optimizer": "lion"}, "unknown optimizer 'lion'"),
    ({"memory_budget": 10 ** 9, "block_types": [nn.Conv2d]}, "no module of Toy is a Conv2d"),
    ({"memory_budget": 10 ** 9, "world_size": 0}, "world_size must be an int >= 1"),
])
def test_bad_input_raises_and_leaves_the_model_unchanged(kwargs: dict, message: str) -> None:
    model, batch = _toy()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=re.escape(message)):
        plan(model, batch, **{"world_size": 2, **kwargs})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(q.grad is None for q in model.parameters())


def test_rows_named_for_a_llama_are_measured_not_scaled() -> None:
    """A Llama's rotary tables and position ids are per token, not per row: scaled with the rows,
    one row of two looks to fit a budget just above the scaled peak when it does not. The rows
    the message names are measured: planning them at that budget fits (or none is named)."""
    transformers = pytest.importorskip("transformers")
    from composable_shard._planning.plan_profile import DEFAULT_DEVICE_FLOPS, profile_model
    from composable_shard.plan import DEFAULT_BANDWIDTH, _find_blocks, _Option, _Search, _simulate
    from composable_shard.api import ShardingStrategy
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=64,
                                      use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 64))
    blocks = _find_blocks(model, None)
    search = _Search(model, blocks, profile_model(model, blocks, {"input_ids": ids, "labels": ids}, None, None, "fake",
                                                  DEFAULT_DEVICE_FLOPS), 2, "adamw", None, DEFAULT_BANDWIDTH)
    budget = _simulate(search, [_Option("fully_shard", ShardingStrategy.FULL_SHARD, True)] * 2, 0.5).total
    with pytest.raises(ValueError) as info:
        plan(model, {"input_ids": ids, "labels": ids}, memory_budget=budget, world_size=2, profile="fake")
    found = re.search(r"a per-rank batch of at most (\d) of the example's 2 rows fits", str(info.value))
    if found:
        rows = int(found.group(1))
        fits = plan(model, {"input_ids": ids[:rows], "labels": ids[:rows]}, memory_budget=budget, world_size=2,
                    profile="fake")
        assert fits.predicted_peak <= budget
    else:
        assert "not even one of the example's 2 rows per rank fits (measured on one row" in str(info.value), str(info.value)
