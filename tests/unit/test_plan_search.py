"""The search of ``plan()`` is minimal: at every budget from the smallest feasible peak to
``replicate(model)``'s, on a toy, a toy whose block 1 is 10x the others, one with frozen layers
and a tiny Hugging Face Llama, no single block of the returned plan can move to a cheaper option
and still fit, and the plan's predicted peak is its assignment's simulated peak.

Without this, a search pass that forgets a block (an undo pass that never revisits block 0
sent 62,612 B per step where 58,292 B fit) passes every test that only checks the budget.
"""

from __future__ import annotations

import re
from typing import Any, List, Tuple

import pytest
import torch
import torch.nn as nn

from composable_shard import plan
from composable_shard._planning.plan_profile import profile_model
from composable_shard.api import ShardingStrategy
from composable_shard.plan import (DEFAULT_BANDWIDTH, DEFAULT_DEVICE_FLOPS, _choose, _find_blocks, _Option, _Search,
                                  _simulate)
from tests.unit.test_plan import BATCH, SEQ, VOCAB, WIDTH, Toy, ToyBlock

transformers = pytest.importorskip("transformers")


def _toy(kind: str) -> Tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = Toy(blocks=6)
    if kind == "uneven":  # block 1 holds 10x the parameters of the others
        wide = ToyBlock()
        wide.fc1, wide.fc2 = nn.Linear(WIDTH, 40 * WIDTH), nn.Linear(40 * WIDTH, WIDTH)
        model.blocks[1] = wide
    if kind == "frozen":
        for block in model.blocks[:3]:
            block.requires_grad_(False)
    return model, torch.randint(0, VOCAB, (BATCH, SEQ))


def _llama() -> Tuple[nn.Module, Any]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      use_cache=False)
    ids = torch.randint(0, 64, (2, 16))
    return transformers.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}


_MAKERS: dict = {"toy": lambda: _toy("plain"), "uneven": lambda: _toy("uneven"), "frozen": lambda: _toy("frozen"),
                 "llama": _llama}


def _assignment(p: Any) -> List[_Option]:
    return [_Option(c.api, ShardingStrategy[c.strategy] if c.api == "fully_shard" else None, c.checkpoint)
            for c in p.choices[1:]]


def _smallest(model: nn.Module, batch: Any) -> int:
    with pytest.raises(ValueError) as info:
        plan(model, batch, memory_budget=1, world_size=2, profile="fake")
    found = re.search(r"the smallest peak is ([\d,]+) B", str(info.value))
    assert found, str(info.value)
    return int(found.group(1).replace(",", ""))


def _check_minimal(budget: int, search: _Search) -> str:
    """The search's choice at ``budget`` is minimal (it is what plan() returns: the test checks that
    against plan() at one budget only, as each plan() call repeats the fake pass)."""
    assignment = _choose(search, budget)
    p = search.result(assignment, budget)
    assert p.predicted_peak <= budget
    if p.choices[0].api == "replicate":  # replicate(model): nothing costs less
        return "replicate(model)"
    current = _assignment(p)
    assert current == assignment and _simulate(search, current).total == p.predicted_peak
    for k in range(len(current)):
        for option in search.options:
            trial = current[:k] + [option] + current[k + 1:]
            if search.seconds(trial) < search.seconds(current):
                assert _simulate(search, trial).total > budget, (
                    f"budget {budget:,}: block {k} could move from {current[k]} to the cheaper {option} and fit "
                    f"({_simulate(search, trial).total:,} B)\n{p}")
    return ",".join(f"{o.api[0]}{o.strategy.name[0] if o.strategy else ''}{'c' if o.checkpoint else ''}" for o in current)


@pytest.mark.parametrize("name", sorted(_MAKERS))
def test_no_block_can_move_to_a_cheaper_option_and_still_fit(name: str) -> None:
    model, batch = _MAKERS[name]()
    blocks = _find_blocks(model, None)
    profile = profile_model(model, blocks, batch, None, None, "fake", DEFAULT_DEVICE_FLOPS)
    search = _Search(model, blocks, profile, 2, "adamw", None, DEFAULT_BANDWIDTH)
    smallest, whole = _smallest(model, batch), _simulate(search, None).total
    assert smallest < whole
    # 25 budgets (13 missed the one where the toy's undo pass must move block 0: 7/24 of the way)
    budgets = [smallest + (whole - smallest) * i // 24 for i in range(25)]
    plans = {_check_minimal(budget, search) for budget in budgets}
    assert len(plans) >= 4, plans  # the budgets span several plans, not one
    budget = budgets[12]  # plan() returns the search's choice: the same profile, options, peak and costs
    p, chosen = plan(model, batch, memory_budget=budget, world_size=2, profile="fake"), \
        search.result(_choose(search, budget), budget)
    assert (p.choices, p.predicted_peak, p.cost_seconds, p.bytes_sent, p.profiles) == \
        (chosen.choices, chosen.predicted_peak, chosen.cost_seconds, chosen.bytes_sent, profile.blocks), \
        (budget, str(p))
