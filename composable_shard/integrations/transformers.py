"""Hugging Face ``transformers.Trainer`` and ``accelerate`` for a model sharded by composable_shard.

``ShardedTrainer`` is ``transformers.Trainer`` for a model that ``fully_shard`` / ``replicate``
already made data-parallel: the same arguments, datasets, callbacks and checkpoints, with the
losses and ``grad_norm`` single-process ``Trainer`` gives on the combined batch.
``ShardedAccelerator`` is the ``accelerate.Accelerator`` it uses, for loops written with
``accelerate`` directly. Needs the ``[hf]`` extra (``pip install composable_shard[hf]``).

Example (``torchrun --nproc-per-node 2 train.py``; ``examples/hf_trainer.py`` runs one)::

    import functools
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from composable_shard import fully_shard, transformer_auto_wrap_policy
    from composable_shard.integrations.transformers import ShardedTrainer

    args = TrainingArguments("out", per_device_train_batch_size=8, gradient_accumulation_steps=4,
                             max_grad_norm=1.0, save_steps=100, use_cpu=True)   # joins torchrun's group
    model = LlamaForCausalLM(LlamaConfig(...))
    fully_shard(model, policy=functools.partial(transformer_auto_wrap_policy,
                                                transformer_layer_cls={LlamaDecoderLayer}))
    trainer = ShardedTrainer(model=model, args=args, train_dataset=dataset)
    trainer.train()                      # later: trainer.train(resume_from_checkpoint=True), any world size
    trainer.save_model("final")          # LlamaForCausalLM.from_pretrained("final") loads it

[Note: What Trainer does to a sharded model]
  Plain ``Trainer`` (transformers 5.24, accelerate 1.15 read) assumes it owns the parallelism.
  Each step below is harmless for a plain model and wrong for a sharded one; ShardedTrainer
  replaces exactly these, and leaves every other part of ``Trainer`` as it is:
  move          ``model.to(args.device)`` (``cpu:0``, ``cuda:<local rank>``). The shards already
                live where ``fully_shard`` put them: skipped (a model on another device raises).
  prepare       ``accelerator.prepare(model, optim)`` wraps the model in DDP, whose start-up
                broadcast overwrites every rank's shards with rank 0's and whose all-reduce
                would average gradients the library already reduced: prepared without the wrap
                (accelerate's autocast and ``torch.compile`` still apply).
  clip          ``torch.nn.utils.clip_grad_norm_(model.parameters())`` sees this rank's shards
                only, so each rank would scale by its own norm: the library's ``clip_grad_norm_``
                (one all-reduce for the global norm).
  accumulate    ``accelerator.no_sync(model)`` exists only for DDP: ``set_requires_gradient_sync
                (False)`` on every managed module instead, so gradients are reduced once per
                optimizer step, on the last micro-batch.
  save_model    rank 0 alone calls ``save_pretrained``, whose ``state_dict()`` is a collective:
                every rank gathers the full state dict (to rank 0, on the CPU), rank 0 writes.
  optimizer     ``torch.save(optimizer.state_dict())`` on rank 0 keeps rank 0's shard of the
                moments only: ``save_checkpoint`` of model and optimizer into
                ``checkpoint-N/composable_shard/`` (every rank's shards, loadable at any world
                size), and resuming loads both from there. The scheduler, RNG states and
                ``trainer_state.json`` are saved and restored as ``Trainer`` does.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
from typing import Any, Iterable, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

# [Note: Hugging Face modules typed as Any] Imported by name, so that mypy does not analyze
# transformers and accelerate (thousands of files: +20 s of CPU for the suite's type-check
# test on a cold cache) for the few of their methods this module overrides.
try:
    accelerate: Any = importlib.import_module("accelerate")
    transformers: Any = importlib.import_module("transformers")
except ImportError as e:
    raise ImportError(
        "composable_shard.integrations.transformers needs Hugging Face transformers and accelerate: "
        "pip install composable_shard[hf]") from e

from .. import clip_grad_norm_, get_model_state_dict, load_checkpoint, save_checkpoint
from ._shared import gradient_sync_off, managed_modules

__all__ = ["ShardedTrainer", "ShardedAccelerator", "export_process_group_env"]

SHARDED_CHECKPOINT_DIR = "composable_shard"
"""Where in a Trainer checkpoint (``checkpoint-N/``) the sharded model and optimizer go."""
_SCHEDULER_NAME = "scheduler.pt"  # Trainer's own file name for the LR scheduler's state
_ENV_RANKS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# accelerate's own sharding engines: a model sharded by this library must not get a second one.
_FOREIGN_ENGINES = ("DEEPSPEED", "FSDP", "MEGATRON_LM")


def _is_managed(model: nn.Module) -> bool:
    """True if ``fully_shard`` or ``replicate`` manages ``model`` or a submodule of it."""
    return bool(managed_modules(model))


def export_process_group_env() -> None:
    """Describe the initialized default process group in the environment, as ``torchrun``
    does (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), so that
    ``TrainingArguments`` and ``accelerate`` join it instead of running as one process.

    Only needed when the group was made without torchrun's environment (a notebook, a test
    harness); call it before creating ``TrainingArguments``. Variables already set are kept
    (they must agree with the group); ``LOCAL_*`` default to the group's (one node).

    Example::

        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        export_process_group_env()
        args = TrainingArguments("out", use_cpu=True)

    Raises:
        RuntimeError: no process group is initialized.
        ValueError: ``RANK`` or ``WORLD_SIZE`` is set to another value than the group's.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("export_process_group_env: no process group is initialized; call "
                           "torch.distributed.init_process_group first (torchrun sets the environment itself)")
    values = dict(zip(_ENV_RANKS, (dist.get_rank(), dist.get_world_size(), dist.get_rank(), dist.get_world_size())))
    for name in ("RANK", "WORLD_SIZE"):
        found = os.environ.get(name)
        if found is not None and found != str(values[name]):
            raise ValueError(f"export_process_group_env: {name}={found} in the environment, but the process group "
                             f"says {values[name]}; unset it or make the group from it")
    for name in _ENV_RANKS:
        os.environ.setdefault(name, str(values[name]))


def _check_device(model: nn.Module, device: torch.device, api: str) -> None:
    """Raise if ``model``'s parameters live on another kind of device than ``device`` (a
    sharded model cannot be moved: ``fully_shard(device_id=...)`` places it)."""
    wanted = torch.device(device)
    for name, param in model.named_parameters():
        same_index = wanted.type == "cpu" or wanted.index is None or param.device.index == wanted.index
        if param.device.type != wanted.type or not same_index:
            raise ValueError(f"{api}: the model's parameter {name!r} lives on {param.device}, the training device is "
                             f"{wanted}; a model sharded by composable_shard is not moved after fully_shard: pass "
                             "device_id= to fully_shard to place it (or train on the device it lives on)")


class ShardedAccelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` that prepares a model sharded by composable_shard without a
    DDP wrap or a device move, clips by the global norm over all shards, and makes ``no_sync``
    skip gradient communication. Models not managed by the library are prepared as usual.

    Example::

        accelerator = ShardedAccelerator(cpu=True)
        model, optim = accelerator.prepare(model, optim)     # model: fully_shard already applied
        with accelerator.no_sync(model):
            accelerator.backward(model(**micro_batch).loss / 2)
        accelerator.backward(model(**last_batch).loss / 2)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)  # global norm, as single-process training
        optim.step(); optim.zero_grad()
    """

    # [Note: ShardedAccelerator has no state of its own] No __init__ and no attributes beyond
    # Accelerator's: ShardedTrainer turns the Accelerator that Trainer builds into one by
    # setting its class, which is sound only while this class adds methods and nothing else.

    def prepare_model(self, model: nn.Module, device_placement: Optional[bool] = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """As ``Accelerator.prepare_model``; a sharded model keeps its place and gets no DDP
        wrap (``evaluation_mode=True`` underneath: autocast and compilation only)."""
        if not _is_managed(model):
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        engine = str(self.distributed_type).rsplit(".", 1)[-1]
        if engine in _FOREIGN_ENGINES:
            raise ValueError(f"ShardedAccelerator.prepare_model: accelerate is configured for {engine}, which would "
                             f"shard or wrap {type(model).__name__} again; it is sharded by composable_shard already: "
                             "launch without accelerate's FSDP/DeepSpeed/Megatron settings")
        _check_device(model, self.device, "ShardedAccelerator.prepare_model")
        return super().prepare_model(model, device_placement=False, evaluation_mode=True)

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2) -> Optional[torch.Tensor]:
        """As ``Accelerator.clip_grad_norm_``; for the parameters of a sharded model the norm is
        the global one over all shards and ranks (``composable_shard.clip_grad_norm_``)."""
        params = list(parameters)
        ids = {id(p) for p in params}
        for model in self._models:
            if not _is_managed(model):
                continue
            own = {id(p) for p in model.parameters()}
            if ids == own:
                self.unscale_gradients()
                return clip_grad_norm_(model, max_norm, norm_type)
            if ids & own:
                raise ValueError(
                    f"ShardedAccelerator.clip_grad_norm_: got {len(ids & own)} of the {len(own)} parameters of the "
                    f"sharded {type(model).__name__} (and {len(ids - own)} others): each rank holds only its shards of "
                    "them, so only the whole model's norm is computed across ranks; pass model.parameters()")
        return super().clip_grad_norm_(params, max_norm, norm_type=norm_type)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """As ``Accelerator.no_sync``; for a sharded model the backwards inside accumulate
        unreduced gradients, and the next backward outside reduces their sum once."""
        if not _is_managed(model):
            with super().no_sync(model):
                yield
            return
        with gradient_sync_off(model):
            yield


def _unwrap_optimizer(optim: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer``."""
    return getattr(optim, "optimizer", optim)


class ShardedTrainer(transformers.Trainer):
    """``transformers.Trainer`` for a model sharded by composable_shard (``fully_shard``,
    ``replicate``, or both), built before the trainer. Per step it gives the losses and
    ``grad_norm`` single-process ``Trainer`` gives on the combined batch (every rank's
    ``per_device_train_batch_size`` samples), with gradient accumulation and clipping.

    Checkpoints (``save_steps``) hold, besides Trainer's files, ``composable_shard/``: the model
    and every rank's optimizer state, sharded (``save_checkpoint``). ``train(resume_from_checkpoint=...)``
    resumes from it at any world size with the losses of an uninterrupted run. ``save_model(dir)``
    writes full safetensors that ``from_pretrained(dir)`` loads. What it changes and why:
    [Note: What Trainer does to a sharded model] in this module.

    The process group is the one ``TrainingArguments`` joined (torchrun's environment); for a
    group made another way, call :func:`export_process_group_env` before ``TrainingArguments``.
    A model no library API manages trains exactly as with ``Trainer``.

    Example::

        fully_shard(model, policy=ModuleWrapPolicy({LlamaDecoderLayer}))
        trainer = ShardedTrainer(model=model, args=TrainingArguments("out", save_steps=100), train_dataset=data)
        trainer.train()
        trainer.save_model("final")

    Raises:
        RuntimeError: ``TrainingArguments`` describe another world size than the process group's.
        NotImplementedError: ``load_best_model_at_end`` with a sharded model.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if self.args.world_size != world_size:
            raise RuntimeError(
                f"ShardedTrainer: TrainingArguments describe {self.args.world_size} process(es), the process group has "
                f"{world_size} ranks. Launch with torchrun, or call composable_shard.integrations.transformers."
                "export_process_group_env() before creating TrainingArguments, so that every rank joins the group "
                "(otherwise each rank would train and save as if it were alone)")
        if self.args.load_best_model_at_end and self._sharded_model() is not None:
            raise NotImplementedError("ShardedTrainer: load_best_model_at_end is not supported for a sharded model yet; "
                                      "load the best checkpoint's composable_shard/ directory with "
                                      "composable_shard.load_checkpoint after training")

    # ---------------------------------------------------------------- placement, DDP, clipping
    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's accelerator, made a :class:`ShardedAccelerator` (see its note)."""
        super().create_accelerator_and_postprocess()
        if type(self.accelerator) is accelerate.Accelerator:
            self.accelerator.__class__ = ShardedAccelerator
        elif not isinstance(self.accelerator, ShardedAccelerator):
            raise TypeError(f"ShardedTrainer: the accelerator is a {type(self.accelerator).__name__}; "
                            "ShardedTrainer needs accelerate.Accelerator or ShardedAccelerator")

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        if not _is_managed(model):
            super()._move_model_to_device(model, device)
            return
        _check_device(model, device, "ShardedTrainer")

    # ---------------------------------------------------------------- saving
    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """As ``Trainer.save_model``, collective for a sharded model: call it on every rank.
        Writes full tensors (``save_pretrained``), which ``from_pretrained(output_dir)`` loads."""
        model = self._sharded_model()
        if model is None:
            super().save_model(output_dir, _internal_call)
            return
        output_dir = self.args.output_dir if output_dir is None else output_dir
        # Gathered on every rank, written by the ranks Trainer lets write (rank 0, or each
        # node's first with save_on_each_node, which then needs the full dict too).
        state_dict = get_model_state_dict(model, rank0_only=not self.args.save_on_each_node, cpu_offload=True)
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)
        self.accelerator.wait_for_everyone()  # the files exist for every rank once this returns
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        model = self._sharded_model()
        if model is None:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        optim, scheduler = self._optimizer_and_scheduler()
        path = os.path.join(output_dir, SHARDED_CHECKPOINT_DIR)
        # [Note: Trainer overwrites checkpoints] save_checkpoint never writes into a published
        # checkpoint, but Trainer saves to checkpoint-<step> again when a run is repeated or
        # resumed in the same output_dir, overwriting its other files: the stale sharded
        # directory goes first (rank 0, before the collective save).
        if self.args.process_index == 0 and os.path.isdir(path):
            shutil.rmtree(path)
        self.accelerator.wait_for_everyone()
        save_checkpoint(path, model, optim)
        if self.args.should_save:
            torch.save(scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_NAME))

    # ---------------------------------------------------------------- resuming
    def _sharded_model(self) -> Optional[nn.Module]:
        """``self.model`` if a library API manages it, else None (Trainer's own code runs)."""
        model = self.model
        return model if model is not None and _is_managed(model) else None

    def _optimizer_and_scheduler(self) -> Tuple[torch.optim.Optimizer, Any]:
        """The torch optimizer (inside accelerate's wrapper) and the LR scheduler."""
        if self.optimizer is None or self.lr_scheduler is None:
            raise RuntimeError("ShardedTrainer: the optimizer and LR scheduler are created in train(); "
                               "checkpoints are saved and loaded from there")
        return _unwrap_optimizer(self.optimizer), self.lr_scheduler

    def _load_sharded(self, checkpoint: str, model: nn.Module, optim: Optional[torch.optim.Optimizer]) -> None:
        """``load_checkpoint`` of ``checkpoint``'s sharded directory: into the shards directly,
        at any world size; every rank raises together if it is missing or damaged."""
        try:
            load_checkpoint(os.path.join(checkpoint, SHARDED_CHECKPOINT_DIR), model, optim)
        except RuntimeError as e:
            raise RuntimeError(
                f"ShardedTrainer: cannot resume from {checkpoint}: {e}. A ShardedTrainer checkpoint holds the model and "
                f"every rank's optimizer state in {SHARDED_CHECKPOINT_DIR}/ (not written with save_only_model=True). "
                "To start from full weights instead, load them before fully_shard (from_pretrained) and train "
                "without resume_from_checkpoint") from e

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[nn.Module] = None) -> None:
        sharded = self._sharded_model()
        if sharded is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        self._load_sharded(resume_from_checkpoint, sharded, None)  # not the full safetensors on every rank

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        model = self._sharded_model()
        if checkpoint is None or model is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        optim, scheduler = self._optimizer_and_scheduler()
        # load_checkpoint reads the model with the optimizer: the same values
        # _load_from_checkpoint loaded before the optimizer existed.
        self._load_sharded(checkpoint, model, optim)
        scheduler.load_state_dict(torch.load(os.path.join(checkpoint, _SCHEDULER_NAME), weights_only=True))
