"""``plan()`` measures activations on fake tensors (no memory): the bytes it records equal those a
real forward saves, on a transformer, a Hugging Face Llama, a convolution net with batch norm, a
model with frozen layers and in bf16; a model built on the meta device plans exactly as the
materialized one; the measured and the fake source choose alike; a forward that depends on
values is refused; and Llama-3-8B- and 70B-shaped configs plan on this machine in seconds and a
few hundred MB, with parameter bytes per rank exact from the config and activations within 10% of
a real small-scale run scaled by its shapes.

Without these, a fake pass that missed what some kernel saves, a dtype it did not apply, or a
meta model it measured as 0 bytes would return plans that run out of memory at step one.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import os
import subprocess
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from composable_shard import MixedPrecision, plan
from composable_shard._planning.plan_profile import call_model, default_loss, profile_model
from composable_shard.api import ShardingStrategy
from composable_shard.plan import (DEFAULT_BANDWIDTH, _backward_phases, _find_blocks, _moments, _Option, _Search,
                                  _simulate, _step_terms)
from tests._models import zip_same
from tests.unit.test_plan import BATCH, SEQ, VOCAB, Toy

transformers = pytest.importorskip("transformers")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _real_saved(model: nn.Module, blocks: List[Tuple[str, nn.Module]], batch: Any,
                loss_fn: Optional[Callable[[Any], torch.Tensor]]) -> List[int]:
    """Per block, the bytes of the storages a real forward saves for backward (parameters and
    buffers excluded; a storage belongs to the block that saved it first), by data pointer: the
    test's own count, independent of the library's."""
    params = {p.untyped_storage().data_ptr() for p in (*model.parameters(), *model.buffers())}
    running: List[int] = []
    owner: Dict[int, Tuple[int, int]] = {}
    handles = []

    def enter(index: int) -> None:
        running.append(index)

    def leave() -> None:
        running.pop()

    for index, (_, block) in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(lambda m, a, i=index: enter(i)))
        handles.append(block.register_forward_hook(lambda m, a, o: leave()))

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in params and key not in owner:
            owner[key] = (running[0] if running else -1, t.untyped_storage().nbytes())
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            (loss_fn or default_loss)(call_model(model, batch))
    finally:
        for h in handles:
            h.remove()
    return [sum(n for i, n in owner.values() if i == k) for k in range(len(blocks))]


def _gpt() -> Tuple[nn.Module, Any, Callable[[Any], torch.Tensor]]:
    from benchmarks.model import GPT, make_batch
    torch.manual_seed(0)
    tokens, targets = make_batch(2, 128, 4096, torch.Generator().manual_seed(1))
    return GPT(blocks=2), tokens, lambda logits: F.cross_entropy(logits.reshape(-1, 4096), targets.reshape(-1))


def _convnet() -> Tuple[nn.Module, Any, Callable[[Any], torch.Tensor]]:
    from benchmarks.plan import ConvNet
    torch.manual_seed(0)
    images, labels = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    return ConvNet(channels=16, blocks=3), images, lambda logits: F.cross_entropy(logits, labels)


def _llama(frozen: bool = False, tied: bool = False) -> Tuple[nn.Module, Any, None]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      use_cache=False, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(config)
    if frozen:
        model.model.layers[0].requires_grad_(False)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}, None


def _toy() -> Tuple[nn.Module, Any, None]:
    torch.manual_seed(0)
    return Toy(), torch.randint(0, VOCAB, (BATCH, SEQ)), None


_MODELS = {"toy": _toy, "gpt": _gpt, "convnet": _convnet, "llama": _llama, "llama_frozen": lambda: _llama(True),
           "llama_tied": lambda: _llama(tied=True)}


@pytest.mark.parametrize("name", sorted(_MODELS))
def test_fake_saved_bytes_equal_a_real_forward(name: str) -> None:
    """Per block, the saved bytes of the fake pass are those a real forward saves (tied input and
    output embeddings included: one fake tensor for both names)."""
    model, batch, loss_fn = _MODELS[name]()
    blocks = _find_blocks(model, None)
    fake = [b.saved_bytes for b in profile_model(model, blocks, batch, loss_fn, None, "fake", 1e12).blocks]
    real = _real_saved(model, blocks, batch, loss_fn)
    assert all(r > 0 for r in real), real
    assert fake == real, (fake, real)


@pytest.mark.parametrize("name", ["toy", "gpt"])
def test_mixed_precision_activations_are_in_the_compute_dtype(name: str) -> None:
    """``MixedPrecision(param_dtype=bf16)``: the fake pass computes in bf16 and records what a
    real bf16 forward saves (half the float32 bytes, where the old measured pass counted float32)."""
    model, batch, loss_fn = _MODELS[name]()
    blocks = _find_blocks(model, None)
    mp = MixedPrecision(param_dtype=torch.bfloat16)
    fake = [b.saved_bytes for b in profile_model(model, blocks, batch, loss_fn, mp, "fake", 1e12).blocks]
    full = [b.saved_bytes for b in profile_model(model, blocks, batch, loss_fn, None, "fake", 1e12).blocks]
    real = _real_saved(model.to(torch.bfloat16), blocks, batch, loss_fn)
    assert fake == real and all(f < 0.55 * g for f, g in zip(fake, full)), (fake, real, full)


def test_a_model_caching_what_its_forward_builds_keeps_no_fake_tensor() -> None:
    """benchmarks/model.py's GPT caches its causal mask in a plain dict at its first forward;
    after planning on fake tensors the cache is as it was (it held a fake mask, which training
    then used), and a cache filled before planning keeps its real tensor."""
    model, batch, _ = _gpt()
    plan(model, batch, memory_budget=10 ** 12, world_size=2, profile="fake")
    assert model._masks == {}, model._masks
    model(batch)
    mask = next(iter(model._masks.values()))
    plan(model, batch, memory_budget=10 ** 12, world_size=2, profile="fake")
    assert list(model._masks.values()) == [mask] and not any(isinstance(v, torch.Tensor) and
                                                             type(v).__name__ == "FakeTensor" for v in vars(model).values())


class _CachesPerLength(nn.Module):
    """Caches a causal mask per sequence length in a dict (as mask caches do), a pair of tables per
    length in a dict of tuples (as rotary caches do: cos and sin), and keeps every mask it
    applied in a list."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.masks: Dict[int, torch.Tensor] = {}
        self.tables: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.applied: List[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        if n not in self.masks:
            self.masks[n] = torch.ones(n, n).tril()
            angles = torch.arange(n, dtype=torch.float32)[:, None] * torch.ones(8)
            self.tables[n] = (angles.cos(), angles.sin())
        self.applied.append(self.masks[n])
        cos, sin = self.tables[n]
        for block in self.blocks:
            x = torch.tanh(self.masks[n] @ block(x * cos + sin))
        return x.sum()


def test_caches_filled_before_planning_keep_their_entries_and_nothing_fake() -> None:
    """A model whose dict and list attributes (one a dict of tuples) hold real tensors from an earlier
    forward at one sequence length, planned on a batch of another: the fake pass adds fake entries to each, and
    afterwards both hold exactly what they held (the same tensor objects): nothing fake for
    training to compute with, and no real entry dropped with the fake ones."""
    torch.manual_seed(0)
    model = _CachesPerLength()
    model(torch.randn(2, 4, 8))
    masks, tables, applied = dict(model.masks), dict(model.tables), list(model.applied)
    plan(model, torch.randn(2, 6, 8), memory_budget=10 ** 12, world_size=2, profile="fake")
    assert list(model.masks) == [4] and model.masks[4] is masks[4], model.masks
    assert list(model.tables) == [4] and model.tables[4] is tables[4], model.tables
    assert len(model.applied) == 1 and model.applied[0] is applied[0], model.applied
    model(torch.randn(2, 6, 8))  # trains on: the length planned for gets a real mask now
    assert not any(type(t).__name__ == "FakeTensor"
                   for t in [*model.masks.values(), *model.applied, *(t for pair in model.tables.values() for t in pair)])


def test_meta_model_plans_exactly_as_the_materialized_one() -> None:
    """The same GPT built on the meta device and materialized, with a meta and a real batch:
    the same peaks, choices and profiles at every budget (the meta model was refused before, and
    before that planned with every activation at 0 bytes)."""
    from benchmarks.model import GPT
    model, batch, _ = _gpt()
    with torch.device("meta"):
        meta = GPT(blocks=2)
    meta_batch = batch.to("meta")
    smallest = plan(model, batch, memory_budget=10 ** 12, world_size=2, profile="fake")
    for budget in (10 ** 12, 60 * 10 ** 6, 40 * 10 ** 6):
        real = plan(model, batch, memory_budget=budget, world_size=4, profile="fake")
        fake = plan(meta, meta_batch, memory_budget=budget, world_size=4)  # profile="auto": fake on meta
        assert fake.profile_source == "fake" and real.profile_source == "fake"
        assert (fake.predicted_peak, fake.choices, fake.components, fake.profiles) == \
            (real.predicted_peak, real.choices, real.components, real.profiles)
    assert smallest.profiles[0].saved_bytes > 1_000_000


def test_measured_and_fake_sources_choose_alike() -> None:
    """Issue 44, item 3: at the smallest budget and halfway to the unsharded peak, the plan from timed
    forwards and the plan from counted FLOPs (at the FLOP rate the timed pass showed, so both
    price recomputation alike) choose the same annotation, or one within 2% of its predicted
    peak, or one as cheap at the timed costs (equal blocks time apart by noise); both fit, and
    the bytes of both sources are the same."""
    for make in (_gpt, _llama):
        model, batch, loss_fn = make()
        measured = plan(model, batch, memory_budget=10 ** 12, world_size=2, loss_fn=loss_fn, profile="measured")
        blocks = _find_blocks(model, None)
        profile = profile_model(model, blocks, batch, loss_fn, None, "fake", 1e12)
        measured_profile = dataclasses.replace(profile, blocks=measured.profiles)
        rate = sum(b.forward_flops for b in measured.profiles) / sum(b.forward_seconds for b in measured.profiles)
        # the smallest peak (the infeasible message's, from the same bytes) and from there halfway to
        # replicate(model)'s peak: at that peak both sources replicate the model once their bytes
        # agree, which the check of the bytes below shows at both budgets
        smallest = _simulate(_Search(model, blocks, profile, 2, "adamw", None, DEFAULT_BANDWIDTH),
                             [_Option("fully_shard", ShardingStrategy.FULL_SHARD, True)] * len(blocks)).total
        for f in (0.0, 0.5):
            budget = smallest + int(f * (measured.predicted_peak - smallest))
            m = plan(model, batch, memory_budget=budget, world_size=2, loss_fn=loss_fn, profile="measured")
            k = plan(model, batch, memory_budget=budget, world_size=2, loss_fn=loss_fn, profile="fake",
                     device_flops=rate)
            assert m.predicted_peak <= budget and k.predicted_peak <= budget
            assert [b.saved_bytes for b in m.profiles] == [b.saved_bytes for b in k.profiles]
            if m.choices != k.choices and abs(k.predicted_peak / m.predicted_peak - 1) > 0.02:
                # Equal blocks' timed forwards differ by noise, so the timed search may checkpoint
                # another of them: the fake plan must then cost, at the measured times, what the
                # timed plan costs (within 5%), and neither can be the other's cheaper alternative.
                timed = _Search(model, blocks, dataclasses.replace(
                    profile, blocks=measured_profile.blocks), 2, "adamw", None, DEFAULT_BANDWIDTH)
                cost_k, cost_m = timed.seconds(_options(k)), timed.seconds(_options(m))
                assert cost_k <= 1.05 * cost_m, (cost_k, cost_m, str(m), str(k))


def _options(p: Any) -> List[_Option]:
    return [_Option(c.api, ShardingStrategy[c.strategy] if c.api == "fully_shard" else None, c.checkpoint)
            for c in p.choices[1:]]


class _Routed(nn.Module):
    """A block whose work depends on its values (as routed experts' does)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        picked = x[x.sum(-1) > 0]  # data-dependent shape
        return x + self.fc(x) * picked.numel()


class _RoutedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Routed(), _Routed()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_profile_errors_name_the_reason() -> None:
    model, batch, _ = _toy()
    with pytest.raises(ValueError, match="profile must be one of"):
        plan(model, batch, memory_budget=10 ** 9, world_size=2, profile="guess")
    with pytest.raises(ValueError, match="device_flops must be a positive"):
        plan(model, batch, memory_budget=10 ** 9, world_size=2, device_flops=0)
    with torch.device("meta"):
        meta = Toy()
    with pytest.raises(ValueError, match=r"profile='measured' times each block's forward on the real device, but "
                                         r"parameters and buffers such as \['emb.weight'"):
        plan(meta, batch, memory_budget=10 ** 9, world_size=2, profile="measured")
    with pytest.raises(ValueError, match=r"plan: the activations of _RoutedNet cannot be measured on fake tensors"):
        plan(_RoutedNet(), torch.randn(4, 8), memory_budget=10 ** 9, world_size=2)


_BIG = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8),
}
_SCRIPT = r"""
import json, resource, sys, time
import torch, transformers
from composable_shard import MixedPrecision, plan
shape, worlds = json.loads(sys.argv[1]), json.loads(sys.argv[2])
config = transformers.LlamaConfig(vocab_size=128256, max_position_embeddings=8192, use_cache=False,
                                  tie_word_embeddings=False, **shape)
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(config)
ids = torch.empty(1, 4096, dtype=torch.long, device="meta")
out = []
for world in worlds:
    t0 = time.perf_counter()
    p = plan(model, {"input_ids": ids, "labels": ids}, memory_budget=80 * 10 ** 9, world_size=world,
             mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    out.append({"world": world, "seconds": time.perf_counter() - t0, "param_bytes": p.param_bytes,
                "predicted": p.predicted_peak, "saved": [b.saved_bytes for b in p.profiles],
                "choices": [[c.api, c.strategy] for c in p.choices]})
print(json.dumps({"plans": out, "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def _small_scale_saved(shape: Dict[str, int], width: int, seq: int) -> float:
    """A real bf16 forward of the same architecture at ``width`` (same head size, the same
    ratios of heads to key/value heads and of MLP to width) and ``seq`` tokens: one middle
    layer's saved bytes, scaled to the full shape (activations grow with tokens x width)."""
    ratio = width / shape["hidden_size"]
    heads = int(shape["num_attention_heads"] * ratio)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=width, intermediate_size=int(shape["intermediate_size"] * ratio),
        num_hidden_layers=3, num_attention_heads=heads,
        num_key_value_heads=heads * shape["num_key_value_heads"] // shape["num_attention_heads"],
        max_position_embeddings=seq, use_cache=False)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(0, 256, (1, seq))
    saved = _real_saved(model, _find_blocks(model, None), {"input_ids": ids, "labels": ids}, None)
    return saved[1] * (4096 / seq) / ratio


def _param_bytes(shape: Dict[str, int], vocab: int, world: int, choices: List[List[str]]) -> int:
    """Per rank, a Llama's float32 parameter bytes from its config, as planned: 1/W of each fully
    sharded module (the root: embedding, head and final norm; each layer) rounded up."""
    h, kv = shape["hidden_size"], shape["num_key_value_heads"] * (shape["hidden_size"] // shape["num_attention_heads"])
    layer = 2 * h * h + 2 * h * kv + 3 * h * shape["intermediate_size"] + 2 * h
    numel = [2 * vocab * h + h] + [layer] * shape["num_hidden_layers"]
    return sum(4 * (-(-n // world) if api == "fully_shard" else n) for n, (api, _) in zip_same(numel, choices))


# The 70B shape runs the same code (24 s more of the suite): benchmarks/plan_large.py plans it at
# W = 8, 64 and 512 (benchmarks/NOTES.md). W = 512 is planned here on a small Llama (the 8B at
# W = 512 repeated the 8 s fake pass), whose shapes 512 does not divide, so the rounding shows.
@pytest.mark.parametrize("name, worlds", [("8b", [8])])
def test_large_config_plans_on_fake_tensors_in_seconds(name: str, worlds: List[int]) -> None:
    """A Llama-3-8B-shaped config on the meta device, 4096 tokens per rank, bf16 compute, an
    80 GB budget: under 2 minutes per plan and 4 GiB of process memory on this machine; the
    parameter bytes per rank are the config's, sharded as planned (float32 masters, 1/W of each
    fully sharded module rounded up), at W = 8 and, on a small Llama on the meta device, at
    W = 512; each layer's saved activations are within 10% of a real small-scale run scaled by
    its shapes."""
    shape = _BIG[name]
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(shape), json.dumps(worlds)], cwd=_ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["maxrss_kb"] * 1024 < 4 * 2 ** 30, result["maxrss_kb"]
    expected_saved = _small_scale_saved(shape, 1024 if name == "70b" else 512, 256)
    assert [p["world"] for p in result["plans"]] == worlds, result["plans"]
    for p in result["plans"]:
        assert p["seconds"] < 120, p["seconds"]
        expected = _param_bytes(shape, 128256, p["world"], p["choices"])
        assert p["param_bytes"] == expected, (p["param_bytes"], expected, p["choices"][:3])
        assert p["predicted"] <= 80 * 10 ** 9
        assert all(abs(s / expected_saved - 1) <= 0.10 for s in p["saved"][1:]), (p["saved"][:3], expected_saved)
    small = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    config = transformers.LlamaConfig(vocab_size=128, max_position_embeddings=64, use_cache=False,
                                      tie_word_embeddings=False, **small)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.empty(1, 64, dtype=torch.long, device="meta")
    wide = plan(model, {"input_ids": ids, "labels": ids}, memory_budget=80 * 10 ** 9, world_size=512,
                mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    choices = [[c.api, c.strategy] for c in wide.choices]
    assert {api for api, _ in choices} == {"fully_shard"}, choices  # bf16 compute rules replicate out
    expected = _param_bytes(small, 128, 512, choices)
    exact = 4 * sum(q.numel() for q in model.parameters()) / 512  # what no rounding would give
    assert wide.param_bytes == expected > exact, (wide.param_bytes, expected, exact)


def test_cli_plans_a_model_on_the_meta_device(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m composable_shard plan MODULE:FACTORY --world W --budget SIZE --batch ...``
    prints plan()'s table for a model it builds on the meta device, no process group: the same
    plan as plan() on the materialized model with profile="fake"; bad arguments exit naming them."""
    from benchmarks.model import GPT
    from composable_shard.__main__ import main as cli_main
    assert cli_main(["plan", "benchmarks.model:GPT", "--world", "4", "--budget", "60MB", "--batch", "2x128:int64"]) == 0
    out = capsys.readouterr().out
    torch.manual_seed(0)
    expected = plan(GPT(), torch.zeros(2, 128, dtype=torch.long), memory_budget=60 * 10 ** 6, world_size=4,
                    profile="fake")
    assert str(expected) in out, (out, str(expected))
    assert "counted FLOPs at the device model" in out and "world size 4, budget 60,000,000 B" in out
    assert cli_main(["plan", "benchmarks.model:GPT", "--world", "4", "--budget", "1KB", "--batch", "2x128:int64"]) == 1
    assert "no plan fits GPT in memory_budget=1,000 B" in capsys.readouterr().err
    for bad, message in ((["--budget", "lots"], "--budget 'lots'"), (["--batch", "2x:int64"], "--batch '2x:int64'"),
                         (["--batch", "ids=2x8", "--batch", "2x8"], "not a mix"),
                         (["--block", "Nope"], "--block Nope: no module of that class")):
        args = ["plan", "benchmarks.model:GPT", "--world", "4", "--budget", "60MB", "--batch", "2x128:int64"]
        if bad[0] == "--batch":
            args = args[:-2]
        with pytest.raises(SystemExit, match=re.escape(message)):
            cli_main(args + bad)


def test_cli_reads_sizes_in_any_case_and_batches_as_float32_unless_told() -> None:
    """``--budget`` takes decimal and binary units in any case (``75GiB``, ``512mib``, ``80GB``,
    ``1.5kb``) and bare bytes; a ``--batch`` tensor without ``:DTYPE`` is float32 (features), with
    one the dtype it names."""
    from composable_shard.__main__ import _batch, _size
    sizes = [_size(t) for t in ("75GiB", "512mib", "80GB", "1.5kb", "80000000000")]
    assert sizes == [75 * 2 ** 30, 512 * 2 ** 20, 80 * 10 ** 9, 1500, 80 * 10 ** 9], sizes
    features = _batch(["2x3"])
    assert (features.dtype, tuple(features.shape), features.device.type) == (torch.float32, (2, 3), "meta"), features
    named = _batch(["input_ids=1x8:int64", "mask=1x8:bool"])
    assert {k: v.dtype for k, v in named.items()} == {"input_ids": torch.int64, "mask": torch.bool}, named


class _Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(512, 512), nn.Linear(512, 512)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_blocks_backward_leaves_parameter_gradients_to_the_plan() -> None:
    """A block's measured backward holds what its activations' gradients need, not its
    parameters' gradients: the plan counts those where the runtime holds them (an unsharded
    gradient buffer, replicate's gradients), and counting them twice over-predicted a GPT whose
    block 1 is 10x the others by 10%. Two 512x512 linears on 2 rows: each weight's gradient is
    1 MB, each activation gradient 4 KB. Views of the parameters (a weight's transpose) are no
    new memory either."""
    model, x = _Wide(), torch.randn(2, 512)
    profile = profile_model(model, _find_blocks(model, [nn.Linear]), x, None, None, "fake", 1e12)
    assert [b.output_bytes for b in profile.blocks] == [2 * 512 * 4] * 2
    assert all(b.backward_extra <= 2 * 2 * 512 * 4 for b in profile.blocks), profile.blocks
    assert profile.blocks[1].backward_extra > 0  # the gradient of its input (block 0's input needs none)
    # the forward makes its output; the weight's transposed view is no new storage
    assert [b.forward_extra for b in profile.blocks] == [2 * 512 * 4] * 2, profile.blocks


def _real_backward_figures(model: nn.Module, batch: Any) -> Tuple[List[int], List[int], List[int]]:
    """A real forward and backward of a Llama: per layer, the bytes of the parameters' gradients
    alive when its backward begins (the head's and the later layers'), the bytes of the
    gradient arriving at its output, and its parameters' gradient elements."""
    layers = list(model.get_submodule("model.layers").children())
    alive: List[int] = [0] * len(layers)
    arriving: List[int] = [0] * len(layers)

    def begins(index: int) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, grads: Any) -> None:
            alive[index] = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
            arriving[index] = sum(g.numel() * g.element_size() for g in grads if g is not None)
        return hook

    handles = [layer.register_full_backward_pre_hook(begins(index)) for index, layer in enumerate(layers)]
    try:
        call_model(model, batch).loss.backward()
    finally:
        for h in handles:
            h.remove()
    return alive, arriving, [sum(p.numel() for p in layer.parameters()) for layer in layers]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_gradient_and_arriving_gradients_are_a_real_backwards(dtype: torch.dtype) -> None:
    """The head's gradients (the final norm's and ``lm_head``'s, alive from the head's backward
    until the root reduces them at the end of backward) are counted once, in the compute dtype,
    in every phase of the blocks' backward: at W = 2 with every block FULL_SHARD, each phase of
    layer k's backward communicates exactly the bytes a real backward (in ``dtype``: the model
    cast, or ``MixedPrecision(param_dtype=bf16)`` for the plan) holds in gradients when its last
    layer's backward begins, plus, at its highest moment, layer k+1's unsharded gradient (numel
    padded to 2, in the compute dtype; its reduction in flight) and k's own gradients made by
    then, and at the concatenation all of k's gradients beside k's padded unsharded gradient; beside
    the sharded float32 gradients of the layers after k ("backward of layer k" is the higher); "start of
    backward" at most those head gradients (the ones made by the head backward's highest moment,
    measured under the counting allocator in ``tests/distributed/test_plan_peak.py``) and no
    other gradient; each layer's output bytes are the gradient arriving there; each layer's
    input bytes are its hidden state, and the first layer's also the rotary tables and position
    ids every layer receives (counted once: a checkpointed layer keeps one storage of them, not one
    each; in bf16 the hidden state no kernel saves is freed after its layer, and the next layer's
    input must not be taken for it). Before, the head's parameters were recorded by ``id()``
    while ``functional_call`` had fake tensors in their place: the term was 0 (1.05 GB on a
    Llama-3-8B)."""
    model, batch, _ = _llama()
    mp = MixedPrecision(param_dtype=dtype) if dtype != torch.float32 else None
    blocks = _find_blocks(model, None)
    search = _Search(model, blocks, profile_model(model, blocks, batch, None, mp, "fake", 1e12), 2, "adamw", mp,
                     DEFAULT_BANDWIDTH)
    alive, arriving, numels = _real_backward_figures(copy.deepcopy(model).to(dtype), batch)
    head = alive[-1]
    assert head == (128 * 64 + 64) * dtype.itemsize, head  # lm_head 128 x 64 and the final norm's 64: nothing else
    hidden = 2 * 32 * 64 * dtype.itemsize  # 2 rows x 32 tokens x width 64
    shared = 2 * 32 * 16 * dtype.itemsize + 32 * 8  # cos and sin (32 tokens x head size 16), int64 position ids
    assert [b.input_bytes for b in search.profile.blocks] == [hidden + shared, hidden, hidden], search.profile.blocks
    # of what the first layer receives first, only the position ids reach later layers unsaved ([Note: Shared
    # inputs]); a layer's own hidden state, saved by no kernel in bf16, is not shared with the layers after it
    assert [b.shared_bytes for b in search.profile.blocks] == [32 * 8, 0, 0], search.profile.blocks
    assert [b.output_bytes for b in search.profile.blocks] == arriving == [hidden] * 3
    moments = {m.name: m.parts for m in _moments(search, [_Option("fully_shard", ShardingStrategy.FULL_SHARD, False)] * 3)}
    start = moments["start of backward"]
    assert start["gradients"] == 0 and start["communication"] <= head, start
    unsharded = [-(-n // 2) * 2 * dtype.itemsize for n in numels]
    for checkpointed in (False, True):
        options = [_Option("fully_shard", ShardingStrategy.FULL_SHARD, checkpointed)] * 3
        step = _step_terms(search, options)
        kept = [b.kept_bytes(checkpointed) for b in search.profile.blocks]
        moments = {m.name: m.parts for m in _moments(search, options)}
        for k, (fqn, _) in enumerate(blocks):
            what = (fqn, "checkpointed" if checkpointed else "not checkpointed")
            later = sum(-(-n // 2) * 4 for n in numels[k + 1:])
            made = search.profile.blocks[k].backward_grads  # its own gradients made by its backward's highest moment
            assert 0 <= made <= numels[k] * dtype.itemsize, (what, made)
            phases = _backward_phases(search, step, k, kept, [0] * 3, search.profile.before_bytes
                                      + search.profile.batch_bytes, 1.0)
            assert len(phases) == (3 if checkpointed else 2), (what, phases)  # + the recomputation
            highest, concatenation = phases[0], phases[-1]
            # its backward's highest moment: k+1's unsharded gradient in flight unless k recomputed first (its
            # pre-backward released it); then all of its own gradients (unpadded) beside the padded buffer
            # they are concatenated into
            in_flight = 0 if checkpointed else sum(unsharded[k + 1:k + 2])
            assert highest.parts["communication"] == head + made + in_flight, (what, highest, head)
            assert concatenation.parts["communication"] == head + numels[k] * dtype.itemsize + unsharded[k], \
                (what, concatenation, head)
            assert all(phase.parts["communication"] == head + in_flight for phase in phases[1:-1]), (what, phases)
            assert all(phase.parts["gradients"] == later for phase in phases), (what, phases, later)
            chosen = {key: value for key, value in moments[f"backward of {fqn}"].items() if key != "other"}
            assert chosen == max(phases, key=lambda m: m.total).parts, (what, chosen)  # "other": the headroom


class _HeldWeight(nn.Module):
    """A block that reaches its weight through a list it holds, not through its attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64, bias=False)
        self.held = [self.fc.weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.linear(torch.relu(x), self.held[0])


class _HeldNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_HeldWeight(), _HeldWeight()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](x))


def test_a_parameter_reached_around_functional_call_is_no_activation_and_keeps_its_gradient() -> None:
    """``functional_call`` swaps fake tensors in for a module's parameters, not for a reference
    the model keeps elsewhere: that weight stays real in the fake pass. It is a parameter, not an
    activation (each block saves only its ReLU's 16 x 64 float32 output, which the linear layer
    saves too), and the fake gradient autograd gives it is not left on the model (it was: a
    FakeTensor ``.grad`` that the next optimizer step read)."""
    model = _HeldNet()
    model.get_parameter("blocks.1.fc.weight").grad = torch.full((64, 64), 0.5)
    grads = [p.grad for p in model.parameters()]
    profile = profile_model(model, _find_blocks(model, None), torch.randn(16, 64), None, None, "fake", 1e12)
    assert [b.saved_bytes for b in profile.blocks] == [16 * 64 * 4] * 2, profile.blocks
    assert all(p.grad is g for p, g in zip_same(list(model.parameters()), grads)), [type(p.grad) for p in model.parameters()]
    assert grads[0] is None and grads[1] is not None and torch.equal(grads[1], torch.full((64, 64), 0.5))
