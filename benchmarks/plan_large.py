"""``plan`` on Llama-3-8B- and 70B-shaped configs built on the meta device: seconds and process
memory of planning, and the plan, per world size (issue 44; table in benchmarks/NOTES.md).

    python benchmarks/plan_large.py 8b      # W = 8, 64, 512; one process per config for its peak memory
    python benchmarks/plan_large.py 70b

One rank's batch is 1 x 4096 tokens (meta), ``labels=input_ids``, ``MixedPrecision(param_dtype=bf16)``,
AdamW, an 80 GB budget per rank, the default ``device_flops``. Needs ``transformers``; no weights are
made or downloaded.
"""

from __future__ import annotations

import os
import resource
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from composable_shard import MixedPrecision, plan  # noqa: E402

SHAPES = {"8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8),
          "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8)}


def main(name: str) -> None:
    import transformers
    config = transformers.LlamaConfig(vocab_size=128256, max_position_embeddings=8192, use_cache=False,
                                      tie_word_embeddings=False, **SHAPES[name])
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.empty(1, 4096, dtype=torch.long, device="meta")
    print("| config | W | seconds | predicted GB | params GB/rank | activations GB | peak at | plan |")
    for world in (8, 64, 512):
        t0 = time.perf_counter()
        try:
            p = plan(model, {"input_ids": ids, "labels": ids}, memory_budget=80 * 10 ** 9, world_size=world,
                     mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
        except ValueError as exc:
            text = str(exc)
            print(f"| {name} | {world} | {time.perf_counter() - t0:.1f} | infeasible: "
                  f"{text[text.index('the smallest'):][:100]} |")
            continue
        kinds: dict = {}
        for c in p.choices[1:]:
            kind = c.strategy + ("+ckpt" if c.checkpoint else "")
            kinds[kind] = kinds.get(kind, 0) + 1
        print(f"| {name} | {world} | {time.perf_counter() - t0:.1f} | {p.predicted_peak / 1e9:.2f} | "
              f"{p.param_bytes / 1e9:.3f} | {p.components['activations'] / 1e9:.2f} | {p.peak_moment} | "
              f"{', '.join(f'{n}x {k}' for k, n in kinds.items())} |")
    print(f"peak process memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:.0f} MB")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "8b")
