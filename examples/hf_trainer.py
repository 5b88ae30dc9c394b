"""Hugging Face ``Trainer`` on a model sharded by composable_shard: ``ShardedTrainer``.

A small ``LlamaForCausalLM`` (built from a config, no download) is sharded per decoder layer with
``transformer_auto_wrap_policy``, then trained by ``ShardedTrainer`` -- ``transformers.Trainer``
with what a sharded model needs (no DDP wrap, no device move, clipping by the global norm,
checkpoints with every rank's optimizer state) -- with gradient accumulation, clipping and
``save_steps`` checkpoints; ``save_model`` writes safetensors that ``from_pretrained`` loads.

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py
    python examples/hf_trainer.py --steps 10
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --resume runs/hf_trainer/checkpoint-20
    python examples/hf_trainer.py --lora          # PEFT LoRA adapters on the sharded model

A checkpoint resumes at any world size (save with 2 processes, resume with 1). With ``accelerate``
alone, ``ShardedAccelerator`` from the same module prepares a sharded model the same way. Needs
``transformers`` and ``accelerate`` (``pip install -e '.[hf]'``); without them the script says so
and exits 0. The text is ``train_gpt.py``'s (the standard library's source, one token per character).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import ALPHABET, CharData, init_distributed  # noqa: E402  # the sibling example

from composable_shard import fully_shard, get_model_state_dict, transformer_auto_wrap_policy  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="hf_trainer.py", description="Train a transformers LlamaForCausalLM, sharded per decoder layer, with "
                                          "composable_shard's ShardedTrainer; checkpoint, resume, save_model.")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-batch (default: %(default)s)")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=64, help="characters per sequence (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="clipping threshold (default: %(default)s)")
    parser.add_argument("--save-steps", type=int, default=20, help="checkpoint every N steps, 0: never "
                                                                   "(default: %(default)s)")
    parser.add_argument("--log-every", type=int, default=10, help="log every N steps (default: %(default)s)")
    parser.add_argument("--resume", default=None, help="a checkpoint-N directory to resume from")
    parser.add_argument("--lora", action="store_true", help="train PEFT LoRA adapters only (needs peft)")
    parser.add_argument("--out", default=os.path.join("runs", "hf_trainer"),
                        help="Trainer's output_dir; the final model goes to OUT/final (default: %(default)s)")
    parser.add_argument("--text-chars", type=int, default=500_000, help="characters of text (default: %(default)s)")
    return parser.parse_args(argv)


class Windows(torch.utils.data.Dataset):  # type: ignore[type-arg]  # generic only in newer torch stubs
    """Fixed random windows of the training text, as Trainer wants them: a dict per row (the
    model shifts the labels)."""

    def __init__(self, data: CharData, rows: int, seq: int) -> None:
        gen = torch.Generator().manual_seed(3)
        self.starts = torch.randint(0, len(data.train) - seq, (rows,), generator=gen).tolist()
        self.data, self.seq = data, seq

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        ids = self.data.train[self.starts[i]:self.starts[i] + self.seq].long()
        return {"input_ids": ids, "labels": ids.clone()}


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    try:
        import transformers
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        from composable_shard.integrations.transformers import ShardedTrainer, export_process_group_env
    except ImportError as e:
        print(f"hf_trainer.py: {e} (pip install -e '.[hf]'); nothing to run.")
        return {}
    transformers.utils.logging.disable_progress_bar()  # save/load progress bars would fill the output
    env = init_distributed()
    if "RANK" not in os.environ and env.world_size > 1:
        export_process_group_env()  # a group made without torchrun's environment (tests): let Trainer join it
    try:
        return _run(args, env, transformers, LlamaDecoderLayer, ShardedTrainer)
    finally:
        if env.owns_group:
            dist.destroy_process_group()


def _model(args: argparse.Namespace, env: Any, transformers: Any, layer_cls: type) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=len(ALPHABET), hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = transformers.LlamaForCausalLM(config)
    if args.lora:
        from peft import LoraConfig, get_peft_model  # adapters first, then shard: LoRA weights get sharded too
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    # Each decoder layer gets its own handle; the root keeps the embeddings, final norm and head.
    fully_shard(model, policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer_cls}),
                device_id=env.device if env.device.type == "cuda" else None)
    return model


def _run(args: argparse.Namespace, env: Any, transformers: Any, layer_cls: type, trainer_cls: type) -> Dict[str, Any]:
    model = _model(args, env, transformers, layer_cls)
    rows = args.steps * args.accumulate * args.batch * env.world_size  # one epoch of exactly --steps steps
    training_args = transformers.TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.accumulate,
        max_steps=args.steps, learning_rate=args.lr, max_grad_norm=args.max_grad_norm, warmup_steps=2,
        logging_steps=args.log_every, save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500, use_cpu=env.device.type == "cpu", report_to=[], disable_tqdm=True, seed=0)
    trainer = trainer_cls(model=model, args=training_args,
                          train_dataset=Windows(CharData(args.text_chars, seed=2), rows, args.seq))
    trainer.train(resume_from_checkpoint=args.resume)
    history: List[Dict[str, Any]] = [e for e in trainer.state.log_history if "loss" in e]
    final = os.path.join(args.out, "final")
    trainer.save_model(final)  # collective: every rank gathers, rank 0 writes
    full = get_model_state_dict(trainer.model, rank0_only=True, cpu_offload=True)  # collective; {} on other ranks
    result: Dict[str, Any] = {"losses": {e["step"]: e["loss"] for e in history},
                              "grad_norms": {e["step"]: e["grad_norm"] for e in history}}
    if env.rank == 0:
        result["reloaded_matches"] = _reloads(final, full, transformers, trainer.model.config, args.lora)
        print(f"saved {final}; from_pretrained gives the trained weights: {result['reloaded_matches']}", flush=True)
    dist.barrier()
    return result


def _reloads(path: str, full: Dict[str, torch.Tensor], transformers: Any, config: Any, lora: bool) -> bool:
    """Whether ``from_pretrained(path)`` (the adapter, with --lora) holds the trained tensors."""
    if lora:  # save_model wrote the adapter only; any base model of the same config takes it
        from peft import PeftModel
        loaded = PeftModel.from_pretrained(transformers.LlamaForCausalLM(config), path).state_dict()
        return all(torch.equal(loaded[name], value) for name, value in full.items() if "lora_" in name)
    loaded = transformers.LlamaForCausalLM.from_pretrained(path).state_dict()
    return sorted(loaded) == sorted(full) and all(torch.equal(loaded[name], full[name]) for name in full)


if __name__ == "__main__":
    main()
