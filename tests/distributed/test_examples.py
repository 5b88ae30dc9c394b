"""The examples cannot rot, and ``describe`` tells the truth.

One two-rank launch runs every example's ``main()`` with tiny settings (the process group the
harness made is reused) and checks what a user would look at: the loss falls; a run resumed from
a checkpoint continues with exactly the losses of the uninterrupted run (same batches, same
model and optimizer state); ``describe`` lists the fully sharded and replicated modules, and its
bytes equal the runtime's own: handle shard sizes, gradient shards, AdamW state, and the
collectives ``record_collectives`` counts in a training step, under FULL_SHARD, SHARD_GRAD_OP
and NO_SHARD, with and without bf16 mixed precision, with a frozen parameter, for compose.py's
model (a replicated head) and for the benchmark model as ``python -m composable_shard describe``
plans it. A second test runs ``train_gpt.py`` as a plain one-process script (its own free
port) and checks ``--help``.

Without these, an API change breaks the README's main command or the other examples unnoticed,
and ``describe``'s figures drift from what the runtime does.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib
import io
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from types import ModuleType
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import MixedPrecision, ModuleWrapPolicy, ShardingStrategy, describe, fully_shard, unshard_params
from composable_shard._runtime.collectives import record_collectives
from composable_shard._runtime.traversal import _get_fsdp_handles
from tests._harness import run_distributed

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
TEXT = ["--text-chars", "60000"]
GPT_TINY = ["--width", "32", "--blocks", "2", "--heads", "2", "--seq", "32", "--batch", "4", "--lr", "1e-2",
            "--log-every", "3", *TEXT]


def _example(name: str) -> ModuleType:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


def _assert_falls(losses: Dict[int, float], what: str, by: float) -> None:
    values = [losses[s] for s in sorted(losses)]
    assert values[-1] < values[0] - by, f"{what}: loss did not fall by {by}: {values}"


def _quiet(fn: Any, *args: Any) -> Any:
    """Run an example's main() with its prints captured (rank 0 prints tables and progress)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args)


def _examples_on_two_ranks(root: str) -> None:
    rank = dist.get_rank()
    train_gpt = _example("train_gpt")
    # An uninterrupted run saving step_000003 and step_000006, then a run resumed from step_000003.
    first = os.path.join(root, "first")
    full = _quiet(train_gpt.main, GPT_TINY + ["--steps", "6", "--ckpt-every", "3", "--sample-chars", "20", "--out", first])
    resumed = _quiet(train_gpt.main, GPT_TINY + ["--steps", "6", "--ckpt-every", "3", "--sample-chars", "0",
                                                 "--out", os.path.join(root, "second"),
                                                 "--resume", os.path.join(first, "ckpt", "step_000003")])
    _assert_falls(full["losses"], "train_gpt", 0.5)
    assert resumed["start"] == 3 and sorted(resumed["losses"]) == [3, 4, 5], resumed
    for step in (3, 4, 5):  # bit for bit: same batches, model and AdamW state restored exactly
        assert resumed["losses"][step] == full["losses"][step], (step, resumed["losses"], full["losses"])
    assert resumed["val_loss"] == full["val_loss"]
    if rank == 0:
        with open(os.path.join(first, "loss.csv")) as f:
            assert [int(r["step"]) for r in csv.DictReader(f)] == list(range(6))
        assert len(full["sample"]) == 4 + 20 and full["sample"].startswith("def ")
        assert sorted(os.listdir(os.path.join(first, "ckpt"))) == ["step_000003", "step_000006"]

    compose = _example("compose")
    tiny = ["--steps", "5", "--width", "32", "--blocks", "2", "--seq", "32", "--batch", "4", "--lr", "1e-2", *TEXT]
    _assert_falls(_quiet(compose.main, tiny)["losses"], "compose", 0.3)
    _check_describe_composed(compose, compose.parse_args(tiny))
    _check_describe_grid(train_gpt)
    _check_describe_benchmark_model()

    if importlib.util.find_spec("transformers") is not None:
        hf = _example("hf_transformers")
        out = os.path.join(root, "hf")
        result = _quiet(hf.main, ["--steps", "5", "--hidden", "32", "--layers", "1", "--seq", "32", "--batch", "4",
                                  "--lr", "1e-2", "--new-tokens", "8", "--out", out, *TEXT])
        _assert_falls(result["losses"], "hf_transformers", 0.3)
        if rank == 0:
            assert result["reloaded_matches"] is True and len(result["generated"]) == 12, result
            assert {"config.json", "model.safetensors"} <= set(os.listdir(out)), os.listdir(out)

        hf_trainer = _example("hf_trainer")  # ShardedTrainer: accumulation, clipping, save_model
        out = os.path.join(root, "hf_trainer")
        result = _quiet(hf_trainer.main, ["--steps", "5", "--hidden", "32", "--layers", "1", "--seq", "32",
                                          "--batch", "2", "--lr", "1e-2", "--log-every", "1", "--save-steps", "0",
                                          "--out", out, *TEXT])
        _assert_falls(result["losses"], "hf_trainer", 0.1)
        assert sorted(result["grad_norms"]) == [1, 2, 3, 4, 5], result
        if rank == 0:
            assert result["reloaded_matches"] is True, result
            assert {"config.json", "model.safetensors"} <= set(os.listdir(os.path.join(out, "final")))

    if importlib.util.find_spec("lightning") is not None:  # last: it tells Lightning about the harness's ranks
        os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(dist.get_world_size()), NODE_RANK="0")
        lightning_train = _example("lightning_train")  # ShardedStrategy: Trainer, ModelCheckpoint, resume
        out = os.path.join(root, "lightning")
        tiny = ["--steps-per-epoch", "3", "--width", "32", "--blocks", "2", "--seq", "32", "--batch", "4", "--lr", "1e-2",
                "--out", out, *TEXT]
        first = _quiet(lightning_train.main, tiny + ["--epochs", "2"])
        _assert_falls(dict(enumerate(first["losses"])), "lightning_train", 0.3)
        resumed = _quiet(lightning_train.main, tiny + ["--epochs", "3", "--resume"])
        assert len(resumed["losses"]) == len(first["losses"]) // 2, (resumed["losses"], first["losses"])  # one epoch more
        if rank == 0:
            assert {"checksums.json", "extra.pt"} <= set(os.listdir(os.path.join(out, "last.ckpt")))


def _runtime_bytes(model: nn.Module) -> Dict[str, int]:
    """Parameter and gradient bytes this rank holds: flat shards, replicated parameters, and
    any other parameter (by the parameters themselves, not describe's arithmetic)."""
    handles = _get_fsdp_handles(model)
    flat = {id(p) for h in handles for g in h.groups for p in g.orig_params}
    others = [p for p in model.parameters() if id(p) not in flat]
    params = sum(g.flat_param.numel() * g.flat_param.element_size() for h in handles for g in h.groups)
    grads = sum(g.sharded_grad.numel() * g.sharded_grad.element_size() for h in handles for g in h.groups
                if g.sharded_grad is not None)
    return {"params": params + sum(p.numel() * p.element_size() for p in others),
            "grads": grads + sum(p.grad.numel() * p.grad.element_size() for p in others if p.grad is not None)}


def _adamw_bytes(optim: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in optim.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))


def _check_against_runtime(model: nn.Module, optim: torch.optim.Optimizer, step: Any, what: str) -> None:
    """describe(model) against the runtime: one step to settle (lazy init, agreement, bucket
    rebuild), then a recorded step."""
    described = describe(model)
    step()
    with record_collectives() as rec:
        step(lambda: _expect(_runtime_bytes(model)["grads"], described.grad_bytes, what, "gradient bytes"))
    _expect(_runtime_bytes(model)["params"], described.param_bytes, what, "parameter bytes")
    if dist.get_rank() == 0:
        _expect(_adamw_bytes(optim), described.adamw_bytes, what, "AdamW bytes on rank 0")
    kinds = {r.kind for r in rec.records}
    assert kinds <= {"all_gather", "reduce_scatter", "all_reduce"}, (what, kinds)  # a steady-state step
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        _expect((rec.count(kind), rec.nbytes(kind)), (described.collective_count(kind), described.collective_bytes(kind)),
                what, kind)


def _expect(actual: Any, expected: Any, what: str, figure: str) -> None:
    assert actual == expected, f"{what}: {figure}: the runtime has {actual}, describe says {expected}"


def _stepper(model: nn.Module, optim: torch.optim.Optimizer, vocab: int, seq: int) -> Any:
    def step(after_backward: Any = None) -> None:
        gen = torch.Generator().manual_seed(dist.get_rank())
        ids = torch.randint(0, vocab, (2, seq), generator=gen)
        nn.functional.cross_entropy(model(ids).reshape(-1, vocab), ids.reshape(-1)).backward()
        if after_backward is not None:
            after_backward()
        optim.step()
        optim.zero_grad()
    return step


def _check_describe_composed(compose: ModuleType, args: argparse.Namespace) -> None:
    """compose.py's model: fully sharded blocks and root, a replicated head, in DFS order."""
    model, optim = compose.build(args, compose.init_distributed())
    described = describe(model)
    rows = [(r.fqn, r.api, r.strategy, r.is_root) for r in described.rows]
    assert rows == [("", "fully_shard", "FULL_SHARD", True), ("blocks.0", "fully_shard", "FULL_SHARD", False),
                    ("blocks.1", "fully_shard", "FULL_SHARD", False), ("head", "replicate", "replicate", False)], rows
    with unshard_params(model, writeback=False):
        assert sum(r.numel for r in described.rows) == sum(p.numel() for p in model.parameters())
    text = str(described)
    assert all(name in text for name in ("<root>", "blocks.0", "blocks.1", "head", "reduce_scatter x3")), text
    _check_against_runtime(model, optim, _stepper(model, optim, 96, 16), "compose.py")


def _check_describe_grid(train_gpt: ModuleType) -> None:
    """The plan (a meta-device model, no process group involved) equals the runtime's
    description of the same model sharded by hand, and both equal the runtime's counters."""
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
        for mp in (None, MixedPrecision(param_dtype=torch.bfloat16)):
            what = f"{strategy.name}, mixed_precision={mp is not None}"
            with torch.device("meta"):
                planned = describe(_tiny_gpt(train_gpt), world_size=2, policy=ModuleWrapPolicy({train_gpt.Block}),
                                   strategy=strategy, mixed_precision=mp)
            torch.manual_seed(0)
            model = _tiny_gpt(train_gpt)
            for block in model.blocks:
                fully_shard(block, strategy=strategy, mixed_precision=mp)
            fully_shard(model, strategy=strategy, mixed_precision=mp)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
            described = describe(model)
            assert planned.planned and not described.planned
            assert planned.rows == described.rows, (what, planned.rows, described.rows)
            assert planned.flag_collectives == described.flag_collectives, what
            _check_against_runtime(model, optim, _stepper(model, optim, 96, 8), what)


def _check_describe_benchmark_model() -> None:
    """The benchmark model (2 blocks here, to stay quick) as ``python -m composable_shard
    describe benchmarks.model:GPT --world 2`` plans it, against the runtime."""
    from benchmarks.model import GPT, Block

    with torch.device("meta"):
        planned = describe(GPT(blocks=2), world_size=2, policy=ModuleWrapPolicy({Block}))
    torch.manual_seed(0)
    model = GPT(blocks=2)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert planned.rows == describe(model).rows
    _check_against_runtime(model, optim, _stepper(model, optim, 4096, 16), "benchmarks.model.GPT")


def _tiny_gpt(train_gpt: ModuleType) -> Any:
    """A model whose handles do not divide by 2 (padding) and whose root has a frozen group."""
    model = train_gpt.GPT(96, width=6, blocks=2, heads=2, max_seq=9)
    model.pos.weight.requires_grad_(False)
    return model


def test_examples_on_two_ranks() -> None:
    root = tempfile.mkdtemp(prefix="cs_examples_")
    try:
        run_distributed(_examples_on_two_ranks, 2, root, timeout=120)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _pipeline_example() -> None:
    pipeline = _example("pipeline_train")
    for schedule in ("1f1b", "gpipe"):
        result = _quiet(pipeline.main, ["--schedule", schedule, "--steps", "6", "--width", "32", "--blocks", "2",
                                        "--heads", "2", "--seq", "32", "--batch", "4", "--lr", "1e-2", *TEXT])
        if dist.get_rank() >= 2:  # the last stage's ranks compute the loss
            _assert_falls(result["losses"], f"pipeline_train {schedule}", 0.3)
        else:
            assert result["losses"] == {}, result


def test_pipeline_example_on_four_ranks() -> None:
    """``examples/pipeline_train.py``: 2 fully sharded stages x 2 data-parallel ranks, 1F1B and
    GPipe; the loss falls (parity with one process is tests/distributed/test_pipelining.py's)."""
    run_distributed(_pipeline_example, 4, timeout=120)


def _two_d_example(root: str) -> None:
    from composable_shard import load_checkpoint

    two_d = _example("train_2d")
    path = os.path.join(root, "two_d")
    result = _quiet(two_d.main, ["--steps", "6", "--width", "32", "--blocks", "2", "--heads", "2", "--seq", "32",
                                 "--batch", "4", "--lr", "1e-2", "--out", path, *TEXT])
    _assert_falls(result["losses"], "train_2d", 0.3)
    model = result["model"]
    pieces = describe(model).tensor_parallel  # fc column-wise, out row-wise: half of each matrix per tp rank
    assert any(line.startswith("blocks.1.fc.weight: (128, 32), Shard(dim=0) on ('tp',) -> this rank's piece (64, 32)")
               for line in pieces) and len(pieces) == 2 * 4, pieces  # fc and out, weight and bias, per block
    plain = _example("train_gpt").GPT(len(_example("train_gpt").ALPHABET), 32, 2, 2, max_seq=32)
    load_checkpoint(path, plain)  # the dp 2 x tp 2 checkpoint, into one process's model on every rank
    ids = torch.randint(0, len(_example("train_gpt").ALPHABET), (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), plain(ids), atol=1e-5, rtol=0)


def test_two_d_example_on_four_ranks() -> None:
    """``examples/train_2d.py``: the GPT's MLPs tensor-parallel over 2 ranks inside each of 2
    data-parallel ranks, fully sharded over dp; the loss falls, ``describe`` shows the pieces, and its checkpoint loads into a plain GPT that computes the same logits (parity with one
    process is tests/distributed/test_fully_shard_tensor_parallel.py's)."""
    root = tempfile.mkdtemp(prefix="cs_two_d_")
    try:
        run_distributed(_two_d_example, 4, root, timeout=120)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_train_gpt_as_a_plain_script(capsys: pytest.CaptureFixture[str]) -> None:
    """``python examples/train_gpt.py`` (no torchrun) picks its own port and runs; ``--help``
    is argparse's, with the defaults filled in."""
    with pytest.raises(SystemExit) as exit_info:
        _example("train_gpt").parse_args(["--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    assert usage.startswith("usage: train_gpt.py") and "%(" not in usage and "(default: 300)" in usage, usage
    out = tempfile.mkdtemp(prefix="cs_train_gpt_")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    try:
        result = subprocess.run([sys.executable, str(EXAMPLES / "train_gpt.py"), *GPT_TINY, "--steps", "3",
                                 "--sample-chars", "10", "--out", out], capture_output=True, text=True, timeout=120,
                                env={**env, "OMP_NUM_THREADS": "1"})
    finally:
        shutil.rmtree(out, ignore_errors=True)
    assert result.returncode == 0, result.stdout + result.stderr
    lines: List[str] = result.stdout.splitlines()
    progress = [line for line in lines if line.startswith("step ")]
    assert len(progress) == 2 and all("tokens/s" in line and "params/rank" in line for line in progress), result.stdout
    assert "world size 1" in result.stdout and "---- sample ----" in result.stdout, result.stdout
