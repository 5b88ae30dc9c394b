"""A torchtitan-style Llama (written here from its published architecture, no download): blocks
in an ``nn.ModuleDict`` keyed by layer id, RMSNorm, SwiGLU feed-forward, rotary embeddings
applied through complex multiplication with a ``freqs_cis`` buffer that the root owns
(non-persistent, complex64) and passes to every block as a forward argument.

What it adds over the Hugging Face decoders of ``test_hf_models.py``: a complex buffer next
to the flat parameters (never cast, never flattened), a tensor argument every block receives
from the root (cast by mixed precision only where it is floating point), and blocks reached
through ``ModuleDict.values()``. Every gradient is compared at every step, in fp32 against
single-process training on the global batch, in bf16 against torch FSDP2 with the same
``MixedPrecisionPolicy``; with and without per-block activation checkpointing.
"""

from __future__ import annotations

from typing import List

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from composable_shard import MixedPrecision, checkpoint, fully_shard
from tests._harness import assert_close_ranks, run_distributed, run_subtests
from tests._models import full_grads, zip_same

VOCAB, WIDTH, HEADS, LAYERS, SEQ, ROWS = 101, 32, 4, 3, 16, 2


def _freqs_cis(head_dim: int, positions: int, theta: float = 10000.0) -> torch.Tensor:
    """Rotary angles as unit complex numbers, shape (positions, head_dim / 2)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(positions).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def _rotate(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x (batch, seq, heads, head_dim) rotated pairwise by freqs_cis[:seq], in x's dtype."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = pairs * freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)
    return torch.view_as_real(rotated).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = WIDTH // HEADS
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, HEADS, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = _rotate(q, freqs_cis), _rotate(k, freqs_cis)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, WIDTH))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(WIDTH, 4 * WIDTH, bias=False)
        self.w2 = nn.Linear(4 * WIDTH, WIDTH, bias=False)
        self.w3 = nn.Linear(WIDTH, 4 * WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = Attention()
        self.feed_forward = FeedForward()
        self.attention_norm = nn.RMSNorm(WIDTH)
        self.ffn_norm = nn.RMSNorm(WIDTH)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, WIDTH)
        self.register_buffer("freqs_cis", _freqs_cis(WIDTH // HEADS, 2 * SEQ), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(LAYERS)})
        self.norm = nn.RMSNorm(WIDTH)
        self.output = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def _build() -> Transformer:
    torch.manual_seed(0)
    return Transformer()


def _tokens(step: int) -> torch.Tensor:
    """The global batch of ``step``: ROWS rows per rank, SEQ + 1 tokens (inputs and targets)."""
    g = torch.Generator().manual_seed(200 + step)
    return torch.randint(0, VOCAB, (ROWS * dist.get_world_size(), SEQ + 1), generator=g)


def _loss(model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(rows[:, :-1]).flatten(0, 1).float(), rows[:, 1:].flatten())


def _my_rows(tokens: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    return tokens[rank * ROWS:(rank + 1) * ROWS]


def _shard(model: Transformer, activation_checkpointing: bool, mp: MixedPrecision | None = None) -> Transformer:
    for layer in model.layers.values():
        if activation_checkpointing:
            checkpoint(layer)
        fully_shard(layer, mixed_precision=mp)
    fully_shard(model, mixed_precision=mp)
    return model


def _fp32_parity(activation_checkpointing: bool) -> None:
    """3 SGD steps; every gradient within 1e-5 of single-process training on the global
    batch (the mean of the per-rank losses) and equal on every rank; the complex buffer is
    untouched (complex64, the same values)."""
    world_size = dist.get_world_size()
    model, reference = _shard(_build(), activation_checkpointing), _build()
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for step in range(3):
        tokens = _tokens(step)
        _loss(model, _my_rows(tokens)).backward()
        rows = [tokens[r * ROWS:(r + 1) * ROWS] for r in range(world_size)]
        (sum(_loss(reference, r) for r in rows) / world_size).backward()  # type: ignore[operator]  # a tensor sum
        expected = [(n, p.grad) for n, p in reference.named_parameters() if p.grad is not None]
        for (name, a), (ename, e) in zip_same(full_grads(model), expected, what=f"step {step} gradients"):
            assert name == ename, (name, ename)
            diff = (a - e).abs().max().item()
            assert diff <= 1e-5, f"step {step} {name}: max |grad diff| {diff:.3g}"
            assert_close_ranks(a, f"step {step} {name}")
        for optim in optims:
            optim.step()
            optim.zero_grad()
    assert model.freqs_cis.dtype == torch.complex64 and torch.equal(model.freqs_cis, reference.freqs_cis)


def _bf16_against_fsdp2(activation_checkpointing: bool) -> None:
    """bf16 parameters, fp32 reduction: 3 SGD steps give torch FSDP2's losses (within 1e-5)
    and gradients (within 1e-5 of each one's largest element; a gradient off by 1.5x misses by
    about 5e4 times that)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model, reference = _shard(_build(), activation_checkpointing, mp), _build()
    torch_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in reference.layers.values():
        torch_fully_shard(layer, mp_policy=torch_mp)
    torch_fully_shard(reference, mp_policy=torch_mp)
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for step in range(3):
        rows = _my_rows(_tokens(step))
        losses = [_loss(m, rows) for m in (model, reference)]
        for loss in losses:
            loss.backward()
        assert abs(losses[0].item() - losses[1].item()) <= 1e-5, (step, [x.item() for x in losses])
        expected = [(n, p.grad.full_tensor()) for n, p in reference.named_parameters() if p.grad is not None]
        for (name, a), (_, e) in zip_same(full_grads(model), expected, what=f"step {step} gradients"):
            scale = e.abs().max().item()
            diff = (a - e).abs().max().item()
            assert diff <= 1e-5 * scale, f"step {step} {name}: max |grad diff| {diff:.3g} (scale {scale:.3g})"
        for optim in optims:
            optim.step()
            optim.zero_grad()


def _grid(precisions: List[str]) -> None:
    cases = {"fp32": _fp32_parity, "bf16": _bf16_against_fsdp2}
    run_subtests(lambda precision, activation_checkpointing: cases[precision](activation_checkpointing),
                 {"precision": precisions, "activation_checkpointing": [False, True]})


@pytest.mark.parametrize("world_size", [2, 4])
def test_torchtitan_style_llama(world_size: int) -> None:
    """fully_shard per block and at the root, with and without activation checkpointing: fp32
    gradients equal local training's (W=2, 4); bf16 gradients equal torch FSDP2's (W=2)."""
    run_distributed(_grid, world_size, ["fp32", "bf16"] if world_size == 2 else ["fp32"], timeout=180)
