"""Lightning ``Trainer`` on a model sharded by composable_shard: ``ShardedStrategy``.

``train_gpt.py``'s character-level GPT inside a ``LightningModule`` whose ``configure_model``
shards it (every block, then the root), trained by ``lightning.Trainer`` with
``ShardedStrategy``: gradient clipping and accumulation as single-process Lightning computes
them, a ``ModelCheckpoint`` writing ``last.ckpt`` (a ``save_checkpoint`` directory: every rank's
shards and optimizer state, plus Lightning's loops and schedulers), and ``--resume`` continuing
from it at any world size.

    torchrun --standalone --nproc-per-node 2 examples/lightning_train.py
    python examples/lightning_train.py --devices 2          # Lightning starts the second process
    torchrun --standalone --nproc-per-node 2 examples/lightning_train.py --epochs 4 --resume
    python examples/lightning_train.py --epochs 4 --resume  # the same checkpoint, one process

Needs Lightning (``pip install -e '.[lightning]'``); without it the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import ALPHABET, GPT, CharData, loss_of  # noqa: E402  # the sibling example

from composable_shard import FSDPModule, fully_shard  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="lightning_train.py", description="Train train_gpt.py's GPT with lightning.Trainer and composable_shard's "
                                               "ShardedStrategy; checkpoint every epoch, resume.")
    parser.add_argument("--epochs", type=int, default=2, help="epochs (default: %(default)s)")
    parser.add_argument("--steps-per-epoch", type=int, default=20, help="optimizer steps per epoch (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per micro-batch (default: %(default)s)")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=64, help="characters per sequence (default: %(default)s)")
    parser.add_argument("--width", type=int, default=64, help="model width (default: %(default)s)")
    parser.add_argument("--blocks", type=int, default=2, help="transformer blocks (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient_clip_val (default: %(default)s)")
    parser.add_argument("--devices", type=int, default=None,
                        help="processes; default: torchrun's WORLD_SIZE, or 1 (Lightning launches the others)")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/last.ckpt")
    parser.add_argument("--out", default=os.path.join("runs", "lightning_train"),
                        help="where ModelCheckpoint writes last.ckpt (default: %(default)s)")
    parser.add_argument("--text-chars", type=int, default=500_000, help="characters of text (default: %(default)s)")
    return parser.parse_args(argv)


class Windows(torch.utils.data.Dataset):  # type: ignore[type-arg]  # generic only in newer torch stubs
    """Fixed random windows of the text: ``(inputs, next-character targets)``."""

    def __init__(self, data: CharData, rows: int, seq: int) -> None:
        gen = torch.Generator().manual_seed(3)
        self.starts = torch.randint(0, len(data.train) - seq - 1, (rows,), generator=gen).tolist()
        self.data, self.seq = data, seq

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> Any:
        window = self.data.train[self.starts[i]:self.starts[i] + self.seq + 1].long()
        return window[:-1], window[1:]


def make_module(args: argparse.Namespace) -> Any:
    import lightning as L

    class LitGPT(L.LightningModule):
        """The GPT, sharded in ``configure_model``: every block, then the root."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)  # the same initial weights on every rank
            self.model = GPT(len(ALPHABET), width=args.width, blocks=args.blocks, heads=4, max_seq=args.seq)
            self.losses: List[float] = []

        def configure_model(self) -> None:
            if isinstance(self.model, FSDPModule):  # Lightning may call it again (fit, then validate)
                return
            for block in self.model.blocks:
                fully_shard(block)
            fully_shard(self.model)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = loss_of(self.model, *batch)
            self.losses.append(loss.item())
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> Any:
            optim = torch.optim.AdamW(self.parameters(), lr=args.lr, weight_decay=0.1)
            return [optim], [torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.7)]

    return LitGPT()


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    try:
        import lightning as L

        from composable_shard.integrations.lightning import ShardedStrategy
    except ImportError as e:
        print(f"lightning_train.py: {e} (pip install -e '.[lightning]'); nothing to run.")
        return {}
    # a process group that exists already (a notebook, a test harness) decides; else torchrun's
    # WORLD_SIZE, else one process (or --devices: Lightning starts the others)
    devices = args.devices or (dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1")))
    rows = args.steps_per_epoch * args.accumulate * args.batch * devices
    loader = torch.utils.data.DataLoader(Windows(CharData(args.text_chars, seed=2), rows, args.seq),
                                         batch_size=args.batch)  # Lightning adds a DistributedSampler
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=args.out, save_last=True, save_top_k=0)
    trainer = L.Trainer(strategy=ShardedStrategy(), accelerator="cpu", devices=devices, max_epochs=args.epochs,
                        gradient_clip_val=args.clip, accumulate_grad_batches=args.accumulate, callbacks=[checkpoints],
                        logger=False, enable_model_summary=False, enable_progress_bar=False)
    module = make_module(args)
    last = os.path.join(args.out, "last.ckpt")
    trainer.fit(module, loader, ckpt_path=last if args.resume else None)
    losses = module.losses
    if trainer.is_global_zero:
        print(f"world size {dist.get_world_size()}: {len(losses)} micro-batches, loss {losses[0]:.4f} -> "
              f"{losses[-1]:.4f} (rank 0's batches); checkpoint {last}", flush=True)
    return {"losses": losses, "checkpoint": last}


if __name__ == "__main__":
    main()
