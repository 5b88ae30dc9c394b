"""``plan(...).apply(model)`` at W=2 (gloo): ``describe(model)`` afterwards reports exactly the
plan's parameter, gradient and optimizer bytes and bytes sent, on a toy model and a tiny Hugging
Face Llama, at a budget that replicates everything, at the smallest one, and between; the
applied model trains (one step); a sharded model is refused.

Without these, the plan could count one layout and apply another (a replicate block counted as
sharded, the root's handle counted with its blocks' parameters), and its budget would mean nothing.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import describe, fully_shard, plan
from tests._harness import run_distributed, run_subtests
from tests.unit.test_plan import BATCH, SEQ, VOCAB, _toy

transformers = pytest.importorskip("transformers")


def _llama() -> tuple:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    return model, {"input_ids": ids, "labels": ids}


def _smallest(model: nn.Module, batch: object) -> int:
    try:
        plan(model, batch, memory_budget=1)
    except ValueError as exc:
        return int(re.search(r"smallest peak is ([\d,]+) B", str(exc)).group(1).replace(",", ""))  # type: ignore[union-attr]
    raise AssertionError("a 1-byte budget must not fit")


def _applied_matches_describe(kind: str, where: str) -> None:
    model, batch = _llama() if kind == "llama" else _toy()
    smallest = _smallest(model, batch)
    budget = {"all_replicate": 10 ** 12, "smallest": smallest, "between": smallest * 3 // 2}[where]
    p = plan(model, batch, memory_budget=budget)
    assert p.predicted_peak <= budget
    if where == "all_replicate":
        assert all(c.api == "replicate" and not c.checkpoint for c in p.choices), p.choices
    checkpointed = any(c.checkpoint for c in p.choices)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p.apply(model)
    if kind == "llama":  # a checkpointed layer would fill the key/value cache again: the cache goes off
        assert model.config.use_cache is (not checkpointed), (checkpointed, model.config.use_cache)
        assert any("use_cache is set to False" in str(w.message) for w in caught) is checkpointed
    d = describe(model)
    assert (d.param_bytes, d.grad_bytes, d.adamw_bytes, d.collective_bytes()) == \
        (p.param_bytes, p.grad_bytes, p.components["optimizer"], p.bytes_sent), (str(d), str(p))
    assert p.components["parameters"] == d.param_bytes
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = model(**batch) if isinstance(batch, dict) else model(batch)
    loss = out.loss if hasattr(out, "loss") else out.float().sum()
    loss.backward()
    optim.step()
    assert torch.isfinite(loss.detach())
    with pytest.raises(ValueError, match="already carries fully_shard or replicate"):
        plan(model, batch, memory_budget=10 ** 12)


def _ranks_with_batches_of_other_lengths() -> None:
    """Rank 1's batch is twice as long: every rank plans for the longer one (the largest bytes
    any rank measured) and all choose the same plan; they chose apart before, and then hung in
    the first collective of handles they did not share."""
    model, _ = _llama()
    seq = 8 * (1 + dist.get_rank())
    ids = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(0))
    longest = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    alone = plan(model, {"input_ids": longest, "labels": longest}, memory_budget=10 ** 12, world_size=1)
    everyone = []
    for budget in (10 ** 12, alone.predicted_peak * 7 // 10):
        p = plan(model, {"input_ids": ids, "labels": ids}, memory_budget=budget)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, ([(c.fqn, c.api, c.strategy, c.checkpoint) for c in p.choices],
                                          [b.saved_bytes for b in p.profiles]))
        assert all(g == gathered[0] for g in gathered), gathered
        assert gathered[0][1] == [b.saved_bytes for b in alone.profiles], (gathered[0][1], alone.profiles)
        everyone.append(gathered[0][0])
    assert everyone[0] != everyone[1], everyone  # the second budget needs sharding: the ranks agree on a real choice


def _all() -> None:
    _ranks_with_batches_of_other_lengths()
    run_subtests(_applied_matches_describe, {"kind": ["toy", "llama"], "where": ["all_replicate", "smallest", "between"]})
    model, batch = _toy()
    fully_shard(model)
    with pytest.raises(ValueError, match="plan: FSDPToy already carries fully_shard or replicate"):
        plan(model, batch, memory_budget=10 ** 12)
    assert BATCH and SEQ and VOCAB


def test_plan_applied_agrees_with_describe() -> None:
    run_distributed(_all, 2, timeout=240)
