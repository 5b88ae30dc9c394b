"""Train a small character-level GPT on real text with composable_shard, save, resume, sample.

The text is the Python standard library's own source code (found through ``sysconfig`` on every
machine, nothing to download). Every transformer block is activation-checkpointed and fully
sharded, then the root; AdamW, gradient clipping over all shards, a warm-up + cosine learning
rate, bf16 mixed precision when CUDA is there. Rank 0 prints what sharding did
(``composable_shard.describe``), a progress line every ``--log-every`` steps, the loss curve
(``loss.csv``, and ``loss.png`` when matplotlib is installed) and a generated sample at the end.
Progress lines show the loss averaged over the steps since the previous line.
Sharded checkpoints go to ``OUT/ckpt/step_<N>`` every ``--ckpt-every`` steps; ``--resume``
continues from the newest one with exactly the losses an uninterrupted run gives (the batch of
step ``s`` on rank ``r`` depends on ``(seed, s, r)`` only).

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py     # 2 processes (gloo on CPU)
    python examples/train_gpt.py                                        # 1 process, any free port
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --resume   # after an interruption

Other examples import :class:`GPT`, :class:`CharData` and :func:`init_distributed` from here.
"""

from __future__ import annotations

import argparse
import csv
import glob
import math
import os
import re
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from composable_shard import (MixedPrecision, checkpoint, clip_grad_norm_, describe, fully_shard, latest_checkpoint,
                              load_checkpoint, save_checkpoint, unshard_params)

# Newline plus printable ASCII: a fixed alphabet, so checkpoints fit whatever Python made the text.
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
_STEP_DIR = re.compile(r"step_(\d+)")


# ---------------------------------------------------------------------------- data
class CharData:
    """Characters of the standard library's ``*.py`` files (sorted by name), as token ids.

    The last 5% are held out for evaluation. :meth:`batch` is a pure function of
    ``(step, rank)``: a resumed run sees exactly the batches an uninterrupted one would.
    """

    def __init__(self, max_chars: int, seed: int) -> None:
        text = self.load_text(max_chars)
        index = {ch: i for i, ch in enumerate(ALPHABET)}
        ids = torch.tensor([index[ch] for ch in text if ch in index], dtype=torch.uint8)
        split = int(len(ids) * 0.95)
        self.train, self.val = ids[:split], ids[split:]
        self.seed = seed

    @staticmethod
    def load_text(max_chars: int) -> str:
        """Up to ``max_chars`` characters of standard-library source, tabs as four spaces."""
        files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
        parts: List[str] = []
        total = 0
        for path in files:
            with open(path, encoding="utf-8", errors="replace") as f:
                parts.append(f.read().replace("\t", "    "))
            total += len(parts[-1])
            if total >= max_chars:
                break
        if not parts:
            raise RuntimeError(f"no *.py files under {sysconfig.get_paths()['stdlib']!r}: nothing to train on")
        return "".join(parts)[:max_chars]

    def batch(self, step: int, rank: int, rows: int, seq: int, split: str = "train") -> Tuple[torch.Tensor, torch.Tensor]:
        """``rows`` random windows: inputs ``(rows, seq)`` and next-character targets."""
        ids = self.train if split == "train" else self.val
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 4099 + rank + (7 if split == "val" else 0))
        starts = torch.randint(0, len(ids) - seq - 1, (rows,), generator=gen)
        windows = torch.stack([ids[s:s + seq + 1] for s in starts.tolist()]).long()
        return windows[:, :-1], windows[:, 1:]

    def unigram_entropy(self) -> float:
        """Entropy (nats) of the character frequencies: the loss of a model that ignores context."""
        counts = torch.bincount(self.train.long(), minlength=len(ALPHABET)).double()
        p = counts[counts > 0] / counts.sum()
        return float(-(p * p.log()).sum())


def decode(ids: Sequence[int]) -> str:
    return "".join(ALPHABET[i] for i in ids)


# ---------------------------------------------------------------------------- model
class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP, both residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, seq, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(rows, seq, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(rows, seq, width))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token and learned position embeddings, ``blocks`` x :class:`Block`, final LayerNorm,
    linear head. ``forward(ids)`` returns logits ``(rows, seq, vocab)``."""

    def __init__(self, vocab: int = len(ALPHABET), width: int = 128, blocks: int = 4, heads: int = 4,
                 max_seq: int = 128) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(max_seq, width)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(blocks)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def loss_of(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).to(logits.device))


@torch.no_grad()
def generate(model: nn.Module, prompt: str, chars: int, max_seq: int, temperature: float,
             device: torch.device, seed: int) -> str:
    """Sample ``chars`` characters after ``prompt`` (run it where the full parameters are visible)."""
    gen = torch.Generator().manual_seed(seed)
    ids = [ALPHABET.index(ch) for ch in prompt if ch in ALPHABET] or [0]
    for _ in range(chars):
        context = torch.tensor([ids[-max_seq:]], device=device)
        logits = model(context)[0, -1].float().cpu() / temperature
        ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)))
    return decode(ids)


# ---------------------------------------------------------------------------- processes
@dataclass
class Dist:
    """This process's place in the job."""

    rank: int
    world_size: int
    device: torch.device
    owns_group: bool  # True: this script created the process group and destroys it at the end


def init_distributed() -> Dist:
    """Join the job torchrun describes (``RANK``/``WORLD_SIZE`` in the environment), or start a
    one-process job on a free port; reuse a process group that already exists (tests)."""
    cuda = torch.cuda.is_available()
    owns = not dist.is_initialized()
    if owns and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo")
    elif owns:
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)  # port 0: the OS picks a free one
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return Dist(dist.get_rank(), dist.get_world_size(), device, owns)


def peak_memory_mb(device: torch.device) -> float:
    """Peak GPU memory allocated by torch, or on CPU this process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource
    except ImportError:  # not on Windows
        return float("nan")
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024 if sys.platform != "darwin" else kib / 2**20


# ---------------------------------------------------------------------------- training
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="train_gpt.py",
        description="Train a character-level GPT on the Python standard library's source with\n"
                    "composable_shard (per-block checkpoint + fully_shard, root fully_shard), save\n"
                    "sharded checkpoints, resume, and print a generated sample.",
        epilog="examples:\n"
               "  torchrun --standalone --nproc-per-node 2 examples/train_gpt.py     # 2 processes\n"
               "  python examples/train_gpt.py --steps 50                            # 1 process\n"
               "  torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --resume\n"
               "      # after an interruption: the same arguments plus --resume continue exactly\n"
               "  torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --steps 600 --resume\n"
               "      # train further (the learning-rate schedule stretches to the new --steps)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--steps", type=int, default=300, help="optimizer steps in total (default: %(default)s)")
    add("--batch", type=int, default=16, help="sequences per rank per step (default: %(default)s)")
    add("--seq", type=int, default=64, help="characters per sequence (default: %(default)s)")
    add("--width", type=int, default=96, help="model width (default: %(default)s)")
    add("--blocks", type=int, default=3, help="transformer blocks (default: %(default)s)")
    add("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
    add("--lr", type=float, default=4e-3, help="peak learning rate (default: %(default)s)")
    add("--clip", type=float, default=1.0, help="gradient norm clipping (default: %(default)s)")
    add("--text-chars", type=int, default=2_000_000, help="characters of text to load (default: %(default)s)")
    add("--seed", type=int, default=0, help="initial weights and batch order (default: %(default)s)")
    add("--log-every", type=int, default=25, help="progress line interval in steps (default: %(default)s)")
    add("--ckpt-every", type=int, default=100, help="checkpoint interval in steps; 0: only at the end "
                                                    "(default: %(default)s)")
    add("--out", default=os.path.join("runs", "train_gpt"),
        help="directory for checkpoints and the loss curve (default: %(default)s)")
    add("--resume", nargs="?", const="latest", default=None, metavar="PATH",
        help="continue from the newest checkpoint in OUT/ckpt, or from PATH (a step_<N> directory); "
             "without it a run starts fresh and replaces OUT's checkpoints")
    add("--sample-chars", type=int, default=300, help="characters to generate at the end; 0: none "
                                                      "(default: %(default)s)")
    return parser.parse_args(argv)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over the first 10% of the steps, then cosine decay to 10% of the peak."""
    warmup = max(1, args.steps // 10)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def build(args: argparse.Namespace, env: Dist) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """The model on every rank from the same seed, sharded: each block checkpointed and fully
    sharded, then the root (embeddings, final norm, head); AdamW built afterwards."""
    torch.manual_seed(args.seed)
    model = GPT(len(ALPHABET), args.width, args.blocks, args.heads, args.seq).to(env.device)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if env.device.type == "cuda" else None
    for block in model.blocks:
        checkpoint(block)  # recompute its activations in backward
        fully_shard(block, mixed_precision=mp)  # one flat parameter per block, 1/W of it per rank
    fully_shard(model, mixed_precision=mp)  # the rest, and the root
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    return model, optim


def _start(args: argparse.Namespace, env: Dist, model: nn.Module, optim: torch.optim.Optimizer,
           ckpt_dir: str) -> int:
    """Load the checkpoint ``--resume`` names and return its step, or start fresh (step 0)."""
    if args.resume is None:
        if env.rank == 0:
            _remove_checkpoints_after(ckpt_dir, -1)
        dist.barrier()
        return 0
    if args.resume == "latest":
        found = latest_checkpoint(ckpt_dir)
        if found is None:
            if env.rank == 0:
                print(f"no checkpoint in {ckpt_dir}: starting from step 0", flush=True)
            return 0
        step, path = found
    else:
        path = args.resume
        match = _STEP_DIR.fullmatch(os.path.basename(os.path.normpath(path)))
        if match is None:
            raise SystemExit(f"--resume {path}: expected a step_<N> directory written by this script")
        step = int(match.group(1))
    load_checkpoint(path, model, optim)  # verified, resharded to this world size
    if env.rank == 0:
        print(f"resumed from {path} at step {step}", flush=True)
        _remove_checkpoints_after(ckpt_dir, step)  # a later one would be written again
    dist.barrier()
    return step


def _remove_checkpoints_after(ckpt_dir: str, step: int) -> None:
    """Delete ``step_<N>`` checkpoints (and unfinished saves) with ``N > step``: this run
    writes those steps again, and ``save_checkpoint`` never writes into an existing one."""
    if not os.path.isdir(ckpt_dir):
        return
    old = [n for n in os.listdir(ckpt_dir) if (m := _STEP_DIR.match(n)) and int(m.group(1)) > step
           and (m.end() == len(n) or n[m.end():].startswith(".tmp-"))]
    for name in old:
        shutil.rmtree(os.path.join(ckpt_dir, name))
    if old and step < 0:
        print(f"starting fresh: removed {len(old)} checkpoint(s) of an earlier run from {ckpt_dir} "
              "(pass --resume to continue one instead)", flush=True)
    elif old:
        print(f"resuming at step {step}: removed {len(old)} later checkpoint(s) from {ckpt_dir} "
              "(this run writes them again)", flush=True)


def _prepare_out(out: str) -> None:
    """Create ``out`` (rank 0); a new ``runs/`` directory ignores itself in git."""
    os.makedirs(out, exist_ok=True)
    top = os.path.normpath(out).split(os.sep)[0]
    marker = os.path.join(top, ".gitignore")
    if top == "runs" and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write("*\n")


def train(args: argparse.Namespace, env: Dist) -> Dict[str, object]:
    """Run the whole job on this rank; returns what the tests check (every rank gets the same
    ``losses``: ``{step: global mean loss}`` for the steps this run trained)."""
    torch.manual_seed(args.seed)
    data = CharData(args.text_chars, args.seed)
    model, optim = build(args, env)
    ckpt_dir = os.path.join(args.out, "ckpt")
    if env.rank == 0:
        _prepare_out(args.out)
        print(f"world size {env.world_size} on {env.device}; {len(data.train):,} training characters of "
              f"standard-library source; unigram entropy {data.unigram_entropy():.3f} nats")
        print(describe(model), flush=True)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # this rank's shards
    start = _start(args, env, model, optim, ckpt_dir)
    losses: Dict[int, float] = {}
    pending: List[Tuple[int, torch.Tensor]] = []
    tokens_per_step = args.batch * args.seq * env.world_size
    clock, trained_s = time.perf_counter(), 0.0
    for step in range(start, args.steps):
        for group in optim.param_groups:
            group["lr"] = lr_at(step, args)
        inputs, targets = data.batch(step, env.rank, args.batch, args.seq)
        loss = loss_of(model, inputs.to(env.device), targets)
        loss.backward()
        clip_grad_norm_(model, args.clip)  # the norm over every shard on every rank
        optim.step()
        optim.zero_grad()
        pending.append((step, loss.detach().float()))
        done = step + 1
        if done % args.log_every == 0 or done == args.steps or done == start + 1:
            trained_s += time.perf_counter() - clock
            means = torch.stack([t for _, t in pending])
            dist.all_reduce(means)  # one small collective per progress line
            losses.update((s, float(v) / env.world_size) for (s, _), v in zip(pending, means))
            if env.rank == 0:
                rate = len(pending) * tokens_per_step / max(trained_s, 1e-9)
                mean = sum(losses[s] for s, _ in pending) / len(pending)
                print(f"step {done:5d}/{args.steps}  loss {mean:.4f}  {rate:8,.0f} tokens/s  "
                      f"params/rank {param_bytes / 1e6:.2f} MB  peak mem {peak_memory_mb(env.device):,.0f} MB",
                      flush=True)
            pending, trained_s = [], 0.0
            clock = time.perf_counter()
        if (args.ckpt_every and done % args.ckpt_every == 0) or done == args.steps:
            path = os.path.join(ckpt_dir, f"step_{done:06d}")
            save_checkpoint(path, model, optim)  # sharded DCP: every rank writes its own shards
            if env.rank == 0:
                print(f"saved {path}", flush=True)
            clock = time.perf_counter()
    result: Dict[str, object] = {"losses": losses, "start": start, "param_bytes": param_bytes}
    result["val_loss"] = _evaluate(model, data, args, env)
    if env.rank == 0:
        if losses:
            _write_curve(args.out, losses, start)
        print(f"held-out loss {result['val_loss']:.4f} (unigram entropy {data.unigram_entropy():.3f})", flush=True)
    if args.sample_chars > 0:
        with unshard_params(model, rank0_only=True, writeback=False):  # full parameters on rank 0 only
            if env.rank == 0:
                text = generate(model, "def ", args.sample_chars, args.seq, 0.8, env.device, args.seed)
                print("---- sample ----\n" + text + "\n----------------", flush=True)
                result["sample"] = text
    return result


@torch.no_grad()
def _evaluate(model: nn.Module, data: CharData, args: argparse.Namespace, env: Dist, batches: int = 4) -> float:
    """Mean loss on held-out text over every rank (a forward without backward is fine)."""
    total = torch.zeros((), device=env.device)
    for i in range(batches):
        inputs, targets = data.batch(i, env.rank, args.batch, args.seq, split="val")
        total += loss_of(model, inputs.to(env.device), targets).float()
    dist.all_reduce(total)
    return float(total) / (batches * env.world_size)


def _write_curve(out: str, losses: Dict[int, float], start: int) -> None:
    """``OUT/loss.csv`` (earlier rows of a resumed run kept) and ``OUT/loss.png`` if matplotlib
    is installed."""
    path = os.path.join(out, "loss.csv")
    rows: Dict[int, float] = {}
    if start > 0 and os.path.exists(path):
        with open(path) as f:
            rows.update((int(r["step"]), float(r["loss"])) for r in csv.DictReader(f) if int(r["step"]) < start)
    rows.update(losses)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "loss"])
        writer.writerows(sorted(rows.items()))
    written = [path]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        pass
    else:
        steps = sorted(rows)
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(steps, [rows[s] for s in steps])
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (nats/char)")
        fig.savefig(os.path.join(out, "loss.png"), dpi=100)
        written.append(os.path.join(out, "loss.png"))
    print("loss curve: " + ", ".join(written) + ("" if len(written) > 1 else " (pip install matplotlib for a PNG)"),
          flush=True)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    args = parse_args(argv)
    env = init_distributed()
    try:
        result = train(args, env)
        dist.barrier()  # every rank done with every collective before any rank tears the group down
    finally:
        if env.owns_group:
            dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
