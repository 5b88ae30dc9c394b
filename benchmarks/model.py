"""The standard CPU workload model of BENCHMARK.md: a small GPT-style decoder.

``GPT(blocks=4)`` is vocab 4096, width 256, 8 heads, MLP 256->1024->256 (GELU), learned
positions, untied head: 5,289,472 parameters at 4 blocks (about 21 MB fp32). Every block is a
:class:`Block`, so ``ModuleWrapPolicy({Block})`` or ``for b in model.blocks: fully_shard(b)``
gives one fully sharded module per block.

The causal mask is a plain cached tensor, not a buffer: DDP would otherwise broadcast it
every forward, and the data-parallel APIs under test would have a buffer to manage that
torch's do not.

Example::

    from benchmarks.model import GPT, make_batch
    model = GPT(blocks=4)
    tokens, targets = make_batch(batch=4, seq=128, vocab=4096, generator=torch.Generator().manual_seed(0))
    loss = model.loss(tokens, targets)
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Block", "GPT", "make_batch", "VOCAB", "WIDTH", "HEADS", "SEQ"]

VOCAB = 4096
WIDTH = 256
HEADS = 8
SEQ = 128


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, width: int = WIDTH, heads: int = HEADS, hidden: int = 4 * WIDTH) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + learned position embedding, ``blocks`` x :class:`Block`, final LayerNorm,
    untied linear head (no bias). ``forward(tokens)`` returns logits ``(B, T, vocab)``."""

    def __init__(self, blocks: int = 4, vocab: int = VOCAB, width: int = WIDTH, heads: int = HEADS,
                 max_seq: int = SEQ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, width)
        self.pos_emb = nn.Embedding(max_seq, width)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(blocks)])
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self._masks: Dict[Tuple[int, torch.device], torch.Tensor] = {}  # plain cache, not a buffer

    def _causal_mask(self, seq: int, device: torch.device) -> torch.Tensor:
        key = (seq, device)
        mask = self._masks.get(key)
        if mask is None:  # True above the diagonal = may not attend (nn.MultiheadAttention's bool convention)
            mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)
            self._masks[key] = mask
        return mask

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        pos = torch.arange(seq, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        mask = self._causal_mask(seq, tokens.device)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; ``targets`` is ``tokens`` shifted by one."""
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_batch(batch: int = 4, seq: int = SEQ, vocab: int = VOCAB,
               generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random token ids ``(batch, seq + 1)`` split into inputs ``[:, :-1]`` and next-token
    targets ``[:, 1:]``."""
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
