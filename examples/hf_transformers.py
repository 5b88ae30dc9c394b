"""A Hugging Face ``transformers`` causal LM, sharded with ``transformer_auto_wrap_policy``:
built from a config (no download), trained a few steps, ``generate()`` on full parameters,
exported with ``save_pretrained`` and loaded back with ``from_pretrained``.

    torchrun --standalone --nproc-per-node 2 examples/hf_transformers.py
    python examples/hf_transformers.py --steps 10

Needs ``transformers`` (``pip install -e '.[hf]'``); without it the script says so and exits 0.
The text is ``train_gpt.py``'s (the standard library's source, one token per character).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import ALPHABET, CharData, decode, init_distributed  # noqa: E402  # the sibling example

from composable_shard import (fully_shard, get_model_state_dict, transformer_auto_wrap_policy,  # noqa: E402
                              unshard_params)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="hf_transformers.py", description="Shard a transformers LlamaForCausalLM (built from a config) with "
                                               "transformer_auto_wrap_policy, train, generate, save_pretrained.")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=64, help="characters per sequence (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate (default: %(default)s)")
    parser.add_argument("--log-every", type=int, default=10, help="print every N steps (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=40, help="characters generate() adds (default: %(default)s)")
    parser.add_argument("--out", default=os.path.join("runs", "hf_transformers"),
                        help="directory save_pretrained writes to (default: %(default)s)")
    parser.add_argument("--text-chars", type=int, default=500_000, help="characters of text (default: %(default)s)")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    try:
        import transformers
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    except ImportError:
        print("hf_transformers.py: transformers is not installed (pip install -e '.[hf]'); nothing to run.")
        return {}
    transformers.utils.logging.disable_progress_bar()  # save/load progress bars would fill the output
    env = init_distributed()
    try:
        return _run(args, env, transformers, LlamaDecoderLayer)
    finally:
        if env.owns_group:
            dist.destroy_process_group()


def _run(args: argparse.Namespace, env: Any, transformers: Any, layer_cls: type) -> Dict[str, Any]:
    config = transformers.LlamaConfig(
        vocab_size=len(ALPHABET), hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max(args.seq, 4 + args.new_tokens), tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = transformers.LlamaForCausalLM(config).to(env.device)
    # Each decoder layer gets its own handle; the root keeps the embeddings, final norm and head.
    fully_shard(model, policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer_cls}))
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = CharData(args.text_chars, seed=2)
    losses: Dict[int, float] = {}
    for step in range(args.steps):
        inputs, _ = data.batch(step, env.rank, args.batch, args.seq)
        loss = model(input_ids=inputs.to(env.device), labels=inputs.to(env.device)).loss  # HF shifts the labels
        loss.backward()
        optim.step()
        optim.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses[step] = float(mean) / env.world_size
        if env.rank == 0 and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
            print(f"step {step + 1:4d}/{args.steps}  loss {losses[step]:.4f}", flush=True)

    prompt = torch.tensor([[ALPHABET.index(c) for c in "def "]], device=env.device)
    with unshard_params(model, writeback=False):  # full parameters on every rank, no communication in forward
        generated = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)[0].tolist()
    full = get_model_state_dict(model, rank0_only=True, cpu_offload=True)  # collective; {} on other ranks
    result: Dict[str, Any] = {"losses": losses, "generated": decode(generated)}
    if env.rank == 0:
        print(f"generate(): {decode(generated)!r}")
        model.save_pretrained(args.out, state_dict=full)  # full tensors, original names: a plain HF checkpoint
        loaded = transformers.LlamaForCausalLM.from_pretrained(args.out).to(env.device)
        again = loaded.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)[0].tolist()
        result["reloaded_matches"] = again == generated
        print(f"saved {args.out}; from_pretrained(...).generate() gives the same text: {again == generated}", flush=True)
    dist.barrier()
    return result


if __name__ == "__main__":
    main()
