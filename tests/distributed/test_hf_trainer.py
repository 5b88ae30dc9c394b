"""Hugging Face ``Trainer``, ``accelerate`` and PEFT with models sharded by this library
(``composable_shard.integrations.transformers``; the ``[hf]`` extra).

Without ``ShardedTrainer`` a user's ``Trainer`` run on a sharded model breaks or, worse, trains
silently differently: ``accelerate`` moves the model (refused), wraps it in DDP (whose start-up
broadcast overwrites rank 1's shards with rank 0's), clips each rank's shards by that rank's own
norm, lets rank 0 alone call ``save_pretrained`` (a collective: it hangs), and checkpoints rank 0's
optimizer shard only (the other ranks' moments are lost on resume). These tests compare, per logged
step, losses and ``grad_norm`` with single-process ``Trainer`` on the combined batch (gradient
accumulation and clipping on), resume from ``save_steps`` checkpoints at the same and at another
world size to the uninterrupted run's losses, and load ``save_model``'s safetensors with
``from_pretrained``. The accelerate test drives ``ShardedAccelerator`` by hand (no_sync, clipping)
against a local loop; PEFT LoRA trains sharded like single-process PEFT, with 1/W of the trainable
gradients per rank and the frozen base untouched.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import (fully_shard, get_model_state_dict, transformer_auto_wrap_policy,
                              unshard_params)
from composable_shard._runtime.collectives import record_collectives
from composable_shard._runtime.traversal import _get_fsdp_handles
from tests._harness import run_distributed, run_subtests
from tests._models import zip_same

transformers = pytest.importorskip("transformers", reason="the [hf] extra (README's test command installs it)")
pytest.importorskip("accelerate", reason="the [hf] extra")

VOCAB, SEQ, HIDDEN = 96, 16, 32
ROWS = 2          # per_device_train_batch_size at W = 2 (2 * ROWS at W = 1: the same combined batch)
ACCUMULATE = 2    # gradient_accumulation_steps
STEPS = 4         # optimizer steps; a checkpoint after step 2 (save_steps)
MAX_GRAD_NORM = 0.3  # below every step's norm (checked), so clipping changes every update
# ShardedAccelerator.clip_grad_norm_ step by step: (norm_type, max_norm), each max below that step's norm (checked)
CLIPS = ((2.0, MAX_GRAD_NORM), (math.inf, 0.02), (1.0, MAX_GRAD_NORM))
RTOL = 1e-5


# ---------------------------------------------------------------------------- model and data
def _config() -> Any:
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=SEQ, tie_word_embeddings=False,
                                    bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _build() -> nn.Module:
    transformers.utils.logging.disable_progress_bar()  # save_pretrained's progress bars
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(_config())


def _shard(model: nn.Module, how: str) -> nn.Module:
    layer_cls = type(model.model.layers[0])
    if how == "policy":
        fully_shard(model, policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer_cls}))
    else:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model


def _dataset() -> List[Dict[str, torch.Tensor]]:
    """Enough rows for STEPS optimizer steps of 2 * ROWS * ACCUMULATE rows (one epoch)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (2 * ROWS * ACCUMULATE * STEPS, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _args(output_dir: str, per_device: int, **overrides: Any) -> Any:
    kwargs: Dict[str, Any] = dict(
        output_dir=output_dir, per_device_train_batch_size=per_device, gradient_accumulation_steps=ACCUMULATE,
        max_steps=STEPS, learning_rate=2e-2, max_grad_norm=MAX_GRAD_NORM, logging_steps=1, save_strategy="steps",
        save_steps=2, use_cpu=True, report_to=[], dataloader_num_workers=0, seed=0, disable_tqdm=True)
    kwargs.update(overrides)
    return transformers.TrainingArguments(**kwargs)


def _logged(trainer: Any) -> Dict[int, Dict[str, float]]:
    """``{step: {"loss", "grad_norm"}}`` from the trainer's log history (one entry per step)."""
    return {e["step"]: {"loss": e["loss"], "grad_norm": e["grad_norm"]}
            for e in trainer.state.log_history if "loss" in e}


def _assert_close(actual: float, expected: float, what: str, rtol: float = RTOL) -> None:
    assert math.isfinite(actual) and abs(actual - expected) <= rtol * abs(expected), \
        f"{what}: {actual!r} vs single-process {expected!r} (rel {abs(actual - expected) / abs(expected):.2e})"


def _compare_logs(actual: Dict[int, Dict[str, float]], expected: Dict[int, Dict[str, float]], steps: List[int],
                  what: str) -> None:
    assert sorted(actual) == steps, f"{what}: logged steps {sorted(actual)}, expected {steps}"
    for step in steps:
        for key in ("loss", "grad_norm"):
            _assert_close(actual[step][key], expected[step][key], f"{what} step {step} {key}")


# ---------------------------------------------------------------------------- Trainer
def _reference_trainer(root: str) -> Dict[int, Dict[str, float]]:
    """Single process, plain Trainer, unsharded model, per-device batch 2 * ROWS: its log."""
    assert dist.get_world_size() == 1 and "RANK" not in os.environ
    trainer = transformers.Trainer(model=_build(), args=_args(os.path.join(root, "reference"), 2 * ROWS,
                                                              save_strategy="no"),
                                   train_dataset=_dataset())
    trainer.train()
    logged = _logged(trainer)
    assert all(v["grad_norm"] > 1.5 * MAX_GRAD_NORM for v in logged.values()), logged  # clipping is active
    return logged


def _read_logged(root: str, name: str) -> Dict[int, Dict[str, float]]:
    with open(os.path.join(root, name)) as f:
        return {int(k): v for k, v in json.load(f).items()}


def _sharded_trainer(root: str, output: str, per_device: int, how: str = "policy") -> Any:
    from composable_shard.integrations.transformers import ShardedTrainer
    return ShardedTrainer(model=_shard(_build(), how), args=_args(os.path.join(root, output), per_device),
                          train_dataset=_dataset())


def _trainer_at_two_ranks(root: str) -> None:
    """The uninterrupted log (w2.json, compared with the reference's by the W = 1 run that
    follows); resume from checkpoint-2 at W = 2 (bit for bit, the parameters after the last step
    too); save_model; ``load_best_model_at_end`` refused for a sharded model when the trainer is made."""
    from composable_shard.integrations.transformers import export_process_group_env
    export_process_group_env()
    from composable_shard.integrations.transformers import ShardedTrainer
    with pytest.raises(NotImplementedError, match="load_best_model_at_end is not supported for a sharded model"):
        ShardedTrainer(model=_shard(_build(), "policy"), train_dataset=_dataset(), eval_dataset=_dataset(),
                       args=_args(os.path.join(root, "best"), ROWS, load_best_model_at_end=True, eval_strategy="steps",
                                  eval_steps=2))
    trainer = _sharded_trainer(root, "w2", ROWS)
    trainer.train()
    uninterrupted = _logged(trainer)
    if dist.get_rank() == 0:
        with open(os.path.join(root, "w2.json"), "w") as f:
            json.dump({str(k): v for k, v in uninterrupted.items()}, f)

    checkpoint = os.path.join(root, "w2", "checkpoint-2")
    names = set(os.listdir(checkpoint))
    assert {"composable_shard", "model.safetensors", "scheduler.pt", "trainer_state.json", "rng_state_0.pth",
            "rng_state_1.pth"} <= names and "optimizer.pt" not in names, sorted(names)
    # Resumed in the same output_dir, as after an interruption: it saves checkpoint-4 again.
    resumed = _sharded_trainer(root, "w2", ROWS, how="manual")
    resumed.train(resume_from_checkpoint=checkpoint)
    again = _logged(resumed)  # steps 1-2 come from the checkpoint's trainer_state.json
    assert again[2] == uninterrupted[2] and sorted(again) == [1, 2, 3, 4], again
    for step in (3, 4):  # same world size, same batches, same model and optimizer state: exactly
        assert again[step] == uninterrupted[step], (step, again[step], uninterrupted[step])

    final = os.path.join(root, "final")
    trainer.save_model(final)
    full = get_model_state_dict(trainer.model, cpu_offload=True)  # collective, full on every rank
    # the last step's update too (the learning rate the restored schedule gave it: with the schedule
    # restarted at the resume, steps 3 and 4 log the same losses, and only the parameters differ)
    for name, value in get_model_state_dict(resumed.model, cpu_offload=True).items():
        assert torch.equal(value, full[name]), f"resumed at step 2, after step 4: {name}"
    loaded = transformers.LlamaForCausalLM.from_pretrained(final).state_dict()
    assert sorted(loaded) == sorted(full), (sorted(loaded), sorted(full))
    for name, value in full.items():
        assert torch.equal(loaded[name], value), name


def _reference_and_resume_at_one_rank(root: str) -> None:
    """One process (one spawn importing Trainer for both): the reference run, which the W = 2
    run's log must equal at every step; then the W = 2 checkpoint resumed by this process: the
    reference's losses from step 3 on (every rank's optimizer shards were saved, and load at
    another world size). Resuming reads the sharded directory only, not the full safetensors
    (which Trainer would read on every rank): without them it resumes all the same."""
    reference = _reference_trainer(root)
    _compare_logs(_read_logged(root, "w2.json"), reference, list(range(1, STEPS + 1)), "ShardedTrainer W=2")
    assert dist.get_world_size() == 1 and "RANK" not in os.environ
    checkpoint = os.path.join(root, "w2", "checkpoint-2")
    os.remove(os.path.join(checkpoint, "model.safetensors"))  # this checkpoint's last use
    trainer = _sharded_trainer(root, "w1_resumed", 2 * ROWS)
    trainer.train(resume_from_checkpoint=checkpoint)
    logged = {step: v for step, v in _logged(trainer).items() if step > 2}  # not the checkpoint's history
    _compare_logs(logged, reference, [3, 4], "ShardedTrainer resumed at W=1 from W=2")


def test_trainer_parity_resume_and_save_model() -> None:
    """ShardedTrainer at W = 2 (gradient accumulation 2, clipping at 0.3) logs the losses and
    grad norms of single-process Trainer at every step; its checkpoint resumes exactly at W = 2
    and to the single-process losses at W = 1; save_model writes what from_pretrained loads."""
    with tempfile.TemporaryDirectory(prefix="cs_hf_trainer_") as root:
        run_distributed(_trainer_at_two_ranks, 2, root, timeout=120)
        run_distributed(_reference_and_resume_at_one_rank, 1, root, timeout=120)


# ---------------------------------------------------------------------------- accelerate
def _rows(step: int, micro: int) -> torch.Tensor:
    """This rank's ROWS rows of micro-batch ``micro`` of ``step`` (the combined batch has W * ROWS)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    ids = torch.randint(1, VOCAB, (ROWS * dist.get_world_size(), SEQ), generator=g)
    rank = dist.get_rank()
    return ids[rank * ROWS:(rank + 1) * ROWS]


def _combined_loss(model: nn.Module, step: int, micro: int) -> torch.Tensor:
    """What every rank's local losses average to: the mean of the per-rank batch losses."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    ids = torch.randint(1, VOCAB, (ROWS * dist.get_world_size(), SEQ), generator=g)
    chunks = ids.split(ROWS)
    return sum(model(input_ids=c, labels=c).loss for c in chunks) / len(chunks)  # type: ignore[return-value]


def _kinds(recorder: Any) -> List[str]:
    return [r.kind for r in recorder.records]


def _refuses_naming_the_integration(what: str, call: Any) -> None:
    """``call(model)`` on a sharded model raises naming the integration, every shard unchanged."""
    model = _shard(_build(), "manual")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises((RuntimeError, TypeError, ValueError)) as info:
        call(model)
    message = str(info.value)
    assert "composable_shard.integrations.transformers" in message, f"{what}: {message}"
    for (name, p), q in zip_same(list(model.named_parameters()), before, what="parameters"):
        assert torch.equal(p, q), f"{what}: {name} changed"


def _plain_stacks_refuse(root: str) -> None:
    """accelerate's own prepare and plain Trainer must not train a sharded model silently
    differently: they raise before changing anything, and say where the working path is."""
    from accelerate import Accelerator
    rank, world_size = str(dist.get_rank()), str(dist.get_world_size())
    os.environ.update(RANK=rank, WORLD_SIZE=world_size, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world_size)  # as torchrun
    _refuses_naming_the_integration(
        "Accelerator.prepare",
        lambda model: Accelerator(cpu=True).prepare(model, torch.optim.SGD(model.parameters(), lr=0.1)))
    _refuses_naming_the_integration(
        "Trainer.train",
        lambda model: transformers.Trainer(model=model, args=_args(os.path.join(root, "plain"), ROWS),
                                           train_dataset=_dataset()).train())


def test_plain_accelerate_and_trainer_refuse_naming_the_integration() -> None:
    """Accelerator().prepare(model, optim) and plain Trainer(model).train() on a sharded model at
    W = 2 raise (they would move the model and wrap it in DDP, whose broadcast overwrites rank 1's
    shards, and clip by per-rank norms), naming the integration, with every shard unchanged."""
    with tempfile.TemporaryDirectory(prefix="cs_hf_plain_") as root:
        run_distributed(_plain_stacks_refuse, 2, root, timeout=60)


def _sharded_accelerator_trains() -> None:
    from composable_shard.integrations.transformers import ShardedAccelerator, export_process_group_env
    export_process_group_env()
    sharded, reference = _shard(_build(), "manual"), _build()
    accelerator = ShardedAccelerator(cpu=True)
    model, optim = accelerator.prepare(sharded, torch.optim.SGD(sharded.parameters(), lr=0.1, momentum=0.9))
    assert model is sharded, type(model)  # no DDP (or any) wrapper
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    handles = len(_get_fsdp_handles(model))
    for step in range(3):
        with accelerator.no_sync(model), record_collectives() as unsynced:
            accelerator.backward(model(input_ids=_rows(step, 0), labels=_rows(step, 0)).loss / ACCUMULATE)
        with record_collectives() as synced:
            accelerator.backward(model(input_ids=_rows(step, 1), labels=_rows(step, 1)).loss / ACCUMULATE)
        assert "reduce_scatter" not in _kinds(unsynced), _kinds(unsynced)  # accumulated locally
        assert _kinds(synced).count("reduce_scatter") == handles, _kinds(synced)  # the sum, once per handle
        for micro in range(ACCUMULATE):
            (_combined_loss(reference, step, micro) / ACCUMULATE).backward()
        norm_type, max_norm = CLIPS[step]  # Accelerator.clip_grad_norm_'s norm_type reaches the global norm
        norm = accelerator.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type=norm_type)
        assert float(ref_norm) > 1.5 * max_norm, (norm_type, float(ref_norm))  # clipping is active
        _assert_close(float(norm), float(ref_norm), f"step {step} grad norm ({norm_type})")  # type: ignore[arg-type]
        with unshard_params(model, with_grads=True):
            for (name, p), (_, q) in zip_same(list(model.named_parameters()), list(reference.named_parameters()),
                                              what="parameters"):
                diff = (p.grad - q.grad).abs().max().item()
                assert diff <= RTOL * q.grad.abs().max().item(), f"step {step} {name}: clipped grad off by {diff}"
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    with pytest.raises(ValueError, match="pass model.parameters"):
        accelerator.clip_grad_norm_(list(model.parameters())[:3], 1.0)
    _misuse_refused()


def _misuse_refused() -> None:
    """TrainingArguments made without the group's environment would let every rank train and
    save as if alone: ShardedTrainer refuses them; an environment contradicting the group too."""
    from composable_shard.integrations.transformers import ShardedTrainer, export_process_group_env
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        del os.environ[name]
    with tempfile.TemporaryDirectory() as out:
        with pytest.raises(RuntimeError, match="export_process_group_env"):
            ShardedTrainer(model=_shard(_build(), "manual"), args=_args(out, ROWS), train_dataset=_dataset())
    os.environ["RANK"] = str(1 - dist.get_rank())
    with pytest.raises(ValueError, match="RANK="):
        export_process_group_env()


def test_sharded_accelerator_trains_like_one_process() -> None:
    """ShardedAccelerator at W = 2: prepare leaves the sharded model unwrapped, no_sync defers the
    reduce-scatters to the last micro-batch, clip_grad_norm_ gives the global norm, and every
    clipped gradient equals single-process training's on the combined batch (SGD, so a wrong
    clipping scale would show). ShardedTrainer refuses TrainingArguments that did not join the
    group."""
    run_distributed(_sharded_accelerator_trains, 2, timeout=60)


# ---------------------------------------------------------------------------- PEFT LoRA
def _lora(model: nn.Module) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(1)  # LoRA weights, random (not B = 0) so that every adapter has a gradient at once
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0, init_lora_weights=False))


def _peft_case(how: str, root: str) -> None:
    world_size, rank = dist.get_world_size(), dist.get_rank()
    model, reference = _lora(_build()), _lora(_build())
    layers = list(reference.base_model.model.model.layers)
    # Expected bytes, from the unsharded reference's shapes: each layer's handle holds its own
    # trainable (LoRA) parameters; the root's handle has none (embeddings, norm, head are frozen).
    expected_grad_bytes = sum(math.ceil(sum(p.numel() for p in layer.parameters() if p.requires_grad) / world_size) * 4
                              for layer in layers)
    frozen_before = {n: p.detach().clone() for n, p in reference.named_parameters() if not p.requires_grad}
    if how == "policy":
        fully_shard(model, policy=functools.partial(transformer_auto_wrap_policy,
                                                    transformer_layer_cls={type(layers[0])}))
    else:
        for layer in model.base_model.model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.SGD(trainable, lr=0.5, momentum=0.9)
    ref_optim = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    for step in range(3):
        model(input_ids=_rows(step, 0), labels=_rows(step, 0)).loss.backward()
        _combined_loss(reference, step, 0).backward()
        grad_bytes = sum(g.sharded_grad.numel() * g.sharded_grad.element_size() for h in _get_fsdp_handles(model)
                         for g in h.groups if g.sharded_grad is not None)
        assert grad_bytes == expected_grad_bytes, (grad_bytes, expected_grad_bytes)
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        with unshard_params(model, with_grads=True):
            for (name, p), (_, q) in zip_same(list(model.named_parameters()), list(reference.named_parameters()),
                                              what="parameters"):
                assert (p.grad is None) == (q.grad is None), name
                if q.grad is not None:
                    diff = (p.grad - q.grad).abs().max().item()
                    assert diff <= 1e-6 * max(1.0, q.grad.abs().max().item()), f"[{how}] step {step} {name}: {diff}"
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    full = get_model_state_dict(model, cpu_offload=True)  # collective
    adapters = {n: v for n, v in full.items() if "lora_" in n}
    assert len(adapters) == 4 * len(layers), sorted(adapters)  # A and B of q_proj and v_proj per layer
    for name, p in reference.named_parameters():
        diff = (full[name] - p.detach()).abs().max().item()
        assert diff <= 1e-6, f"[{how}] {name} after training: {diff}"
        if name in frozen_before:
            assert torch.equal(full[name], frozen_before[name]), f"[{how}] frozen {name} changed"
    out = os.path.join(root, how)
    model.save_pretrained(out, is_main_process=rank == 0)  # state_dict() inside: every rank calls it
    if rank == 0:
        from peft import PeftModel
        reloaded = PeftModel.from_pretrained(_build(), out).state_dict()
        for name, value in adapters.items():
            assert torch.equal(reloaded[name], value), f"[{how}] adapter {name} reloaded differently"


def _peft_on_two_ranks(root: str) -> None:
    run_subtests(_peft_case, {"how": ["policy", "manual"]}, root=root)


def test_peft_lora_sharded_like_single_process() -> None:
    """PEFT LoRA on a sharded Llama (policy and per-layer annotation) at W = 2: gradients equal
    single-process PEFT's every step, each rank stores ceil(trainable / W) gradient elements per
    handle (none for the frozen base), the frozen base is untouched, and save_pretrained's adapter
    reloads equal to the trained one."""
    pytest.importorskip("peft", reason="the [hf] extra")
    with tempfile.TemporaryDirectory(prefix="cs_hf_peft_") as root:
        run_distributed(_peft_on_two_ranks, 2, root, timeout=90)


# ---------------------------------------------------------------------------- the extra
def test_integration_needs_the_hf_extra_and_core_never_imports_it() -> None:
    """``import composable_shard`` imports neither the integration nor transformers/accelerate;
    importing the integration without transformers raises ImportError naming the extra."""
    script = (
        "import sys\n"
        "import composable_shard\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'accelerate', 'peft')\n"
        "                or m.startswith('composable_shard.integrations'))\n"
        "assert not loaded, loaded\n"
        "sys.modules['transformers'] = None  # as if the extra were not installed\n"
        "try:\n"
        "    import composable_shard.integrations.transformers\n"
        "except ImportError as e:\n"
        "    print('IMPORT-ERROR:', e)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert result.returncode == 0, result.stderr
    assert "IMPORT-ERROR:" in result.stdout and "pip install composable_shard[hf]" in result.stdout, result.stdout
