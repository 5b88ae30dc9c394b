"""``describe`` without a process group: the plan's figures follow the shard arithmetic, and the
``python -m composable_shard describe`` command prints the benchmark model's plan.

The runtime side (a real W=2 step against ``describe`` of the sharded model) is in
``tests/distributed/test_examples.py``. Without these, a planning change (ownership, grouping by
dtype and requires_grad, padding, the per-strategy all-gather count) would silently change the
figures a user sizes a job with.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from composable_shard import ModuleWrapPolicy, MixedPrecision, ShardingStrategy, describe
from composable_shard.__main__ import main as cli_main


class Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)  # 30 elements
        self.norm = nn.LayerNorm(5)  # 10 elements

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 5)  # 35 elements, frozen below
        self.blocks = nn.ModuleList([Blk(), Blk()])
        self.head = nn.Linear(5, 3)  # 18 elements
        self.emb.weight.requires_grad_(False)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_plan_follows_shard_arithmetic(world: int) -> None:
    """Per handle ceil(N/W) elements per rank and W*ceil(N/W)-N padding per flat group; the
    root's frozen group is all-gathered but never reduced and has no gradient or AdamW state;
    the root gathers once per step, every other handle twice; nothing at W=1."""
    d = describe(Net(), world_size=world, policy=ModuleWrapPolicy({Blk}))
    assert [(r.fqn, r.is_root, r.numel, r.dtype_groups) for r in d.rows] == [
        ("", True, 53, ("float32 (frozen)", "float32")), ("blocks.0", False, 40, ("float32",)),
        ("blocks.1", False, 40, ("float32",))]
    root, block = d.rows[0], d.rows[1]
    assert root.shard_numel == _ceil(35, world) + _ceil(18, world)
    assert root.padding == world * root.shard_numel - 53
    assert block.shard_numel == _ceil(40, world) and block.padding == world * _ceil(40, world) - 40
    assert d.param_bytes == 4 * (root.shard_numel + 2 * block.shard_numel)
    assert d.grad_bytes == 4 * (_ceil(18, world) + 2 * _ceil(40, world))
    steps = 4 * (2 + 4 + 4)  # AdamW's step tensor per trainable parameter
    assert d.adamw_bytes == 8 * (min(18, _ceil(18, world)) + 2 * min(40, _ceil(40, world))) + steps
    if world == 1:
        assert d.collective_count() == 0
        return
    assert block.collectives == {"all_gather": (2, 8 * _ceil(40, world)), "reduce_scatter": (1, 4 * world * _ceil(40, world))}
    assert root.collectives == {"all_gather": (2, 4 * (_ceil(35, world) + _ceil(18, world))),
                                "reduce_scatter": (1, 4 * world * _ceil(18, world))}
    assert d.flag_collectives == (1, 4 * (10 + 2))  # a used flag per trainable parameter, 2 for the step agreement


def test_strategies_mixed_precision_and_ignored() -> None:
    """SHARD_GRAD_OP gathers once per handle; NO_SHARD all-reduces whole gradients; bf16
    halves the all-gathers and reductions; ignored modules are listed as not managed."""
    net = Net()
    zero2 = describe(net, world_size=2, policy=ModuleWrapPolicy({Blk}), strategy=ShardingStrategy.SHARD_GRAD_OP)
    assert zero2.collective_count("all_gather") == 4 and zero2.collective_count("reduce_scatter") == 3
    no_shard = describe(net, world_size=2, policy=ModuleWrapPolicy({Blk}), strategy=ShardingStrategy.NO_SHARD)
    assert no_shard.collective_count("all_gather") == 0 and no_shard.param_bytes == 4 * (53 + 80)
    assert no_shard.collective_bytes("all_reduce") == 4 * (18 + 80) + 4 * (10 + 2)
    bf16 = describe(net, world_size=2, policy=ModuleWrapPolicy({Blk}), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    full = describe(net, world_size=2, policy=ModuleWrapPolicy({Blk}))
    for kind in ("all_gather", "reduce_scatter"):
        assert 2 * bf16.collective_bytes(kind) == full.collective_bytes(kind), kind
    assert bf16.param_bytes == full.param_bytes and bf16.rows[1].dtype_groups == ("float32->bfloat16",)
    ignored = describe(net, world_size=2, ignored_modules=[net.head])
    assert [(r.fqn, r.api, r.numel) for r in ignored.rows] == [("", "fully_shard", 115), ("(not managed)", "none", 18)]


def test_frozen_parameters_hold_no_gradient_or_adamw_state() -> None:
    """Sequential(Linear(8, 8), Linear(8, 8)) at W=2, the second Linear frozen and ignored (not
    managed, held in full: 72 elements, 288 B, no gradient, no AdamW state); the first managed
    by the root, 72 elements, 36 per rank: 144 B of parameters and of gradient, AdamW
    2 moments x 36 x 4 B + a 4 B step per parameter (2) = 296 B. Freezing its bias too (8
    elements, a frozen group of 4 per rank) leaves the weight's 32 per rank: gradient 128 B,
    AdamW 2 x 32 x 4 + 4 = 260 B, parameters still 144 B. Without it: AdamW state or gradients
    counted for frozen parameters (unmanaged, or a handle's frozen group) oversize the job."""
    for bias_frozen, grad, adamw in ((False, 144, 296), (True, 128, 260)):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        model[1].requires_grad_(False)
        model[0].bias.requires_grad_(not bias_frozen)
        d = describe(model, world_size=2, ignored_modules=[model[1]])
        root, unmanaged = d.rows
        assert (root.fqn, root.numel, root.shard_numel, root.param_bytes, root.grad_bytes, root.adamw_bytes) == \
            ("", 72, 36, 144, grad, adamw), (bias_frozen, root)
        assert (unmanaged.fqn, unmanaged.api, unmanaged.numel, unmanaged.param_bytes, unmanaged.grad_bytes,
                unmanaged.adamw_bytes, unmanaged.collectives) == ("(not managed)", "none", 72, 288, 0, 0, {}), unmanaged
        assert (d.param_bytes, d.grad_bytes, d.adamw_bytes) == (144 + 288, grad, adamw), (bias_frozen, d)


def test_describe_errors() -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        describe("model")  # type: ignore[arg-type]  # the wrong type on purpose
    with pytest.raises(ValueError, match="world_size"):
        describe(Net())
    with pytest.raises(ValueError, match="HYBRID_SHARD"):
        describe(Net(), world_size=4, strategy=ShardingStrategy.HYBRID_SHARD)
    plain = Net()
    with pytest.raises(ValueError, match="optimizers=... reads the state of a sharded model"):
        describe(plain, world_size=2, optimizers=[torch.optim.SGD(plain.parameters(), lr=0.1)])


def test_cli_plans_the_benchmark_model(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m composable_shard describe benchmarks.model:GPT --world 2``: the blocks are
    found from the model's nn.ModuleList; parameter and reduce-scatter bytes are the ones
    benchmarks/NOTES.md measured on the runtime (10,578,944 B of shards per rank; 21,157,888 B
    reduce-scattered per step), and the root is gathered once (9 all-gathers for 5 handles)."""
    assert cli_main(["describe", "benchmarks.model:GPT", "--world", "2"]) == 0
    out = capsys.readouterr().out
    assert "ModuleWrapPolicy({Block})" in out and "planned without a process group" in out, out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith(("<root>", "blocks."))]
    assert rows == ["<root>", "blocks.0", "blocks.1", "blocks.2", "blocks.3"], out
    assert "parameters 10,578,944 B" in out and "reduce_scatter x5 21,157,888 B" in out and "all_gather x9" in out, out
    with pytest.raises(SystemExit, match="no module of that class"):
        cli_main(["describe", "benchmarks.model:GPT", "--wrap", "Nope"])
    # --wrap '' (the help's "root only"): one handle, gathered once, reduced once
    assert cli_main(["describe", "benchmarks.model:GPT", "--world", "2", "--wrap", ""]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith(("<root>", "blocks."))]
    assert "policy=None" in out and rows == ["<root>"], out
    assert "parameters 10,578,944 B" in out and "reduce_scatter x1 " in out and "all_gather x1 " in out, out
    # a class named by --wrap (by its __name__) is what ModuleList items give by default
    assert cli_main(["describe", "benchmarks.model:GPT", "--world", "2", "--wrap", " Block,"]) == 0
    named = capsys.readouterr().out
    assert "ModuleWrapPolicy({Block})" in named and "all_gather x9" in named, named
