"""Lightning (``lightning.pytorch.Trainer`` and ``lightning.fabric.Fabric``) for models that
``fully_shard`` / ``replicate`` make data-parallel. Needs the ``[lightning]`` extra
(``pip install composable_shard[lightning]``).

:class:`ShardedStrategy` (Trainer) and :class:`ShardedFabricStrategy` (Fabric) apply nothing
themselves: annotate the model in ``LightningModule.configure_model`` (Trainer) or before
``fabric.setup`` (Fabric), as with Lightning's ``ModelParallelStrategy``. They launch and join
the process group as ``DDPStrategy`` does, turn gradient synchronization off between
accumulated micro-batches, and save and load with this library's crash-safe, verified
checkpoints (``save_checkpoint`` / ``load_checkpoint``), which resume at any world size.

Example (``torchrun --nproc-per-node 2 train.py``; ``examples/lightning_train.py`` runs one)::

    import lightning as L
    from composable_shard import fully_shard
    from composable_shard.integrations.lightning import ShardedStrategy

    class LitModel(L.LightningModule):
        def configure_model(self):                 # annotate here: children, then the parent
            for block in self.model.blocks:
                fully_shard(block)
            fully_shard(self.model)
        ...

    trainer = L.Trainer(strategy=ShardedStrategy(), accelerator="cpu", devices=2, max_steps=100,
                        gradient_clip_val=1.0, accumulate_grad_batches=2)
    trainer.fit(LitModel(), train_loader)                          # later: ckpt_path="ckpts/last.ckpt"

[Note: What Lightning's strategies do to a sharded model]  (Lightning 2.6 read)
  ``DDPStrategy``/``FSDPStrategy`` wrap the model in torch's DDP / FSDP: refused by the library
  ([Note: Foreign wrappers] in ``_runtime/interop.py``). ``ModelParallelStrategy`` (FSDP2's) trains a model
  this library sharded exactly (torch's ``clip_grad_norm_`` gives the global norm on sharded
  gradients), but synchronizes every accumulated micro-batch (Lightning turns gradient sync off
  only for DDP) and its checkpoints cannot be resumed: it saves through torch's state-dict API
  (exact for our models) but loads only into models with ``DTensor`` parameters, so it is refused
  at save and at load, naming these strategies ([Note: Lightning's ModelParallelStrategy]). These
  strategies replace:
  accumulate  ``block_backward_sync`` (Trainer) / ``no_backward_sync`` (Fabric):
              ``set_requires_gradient_sync(False)`` on every managed module, so gradients are
              reduced once per optimizer step, on the last micro-batch.
  checkpoint  a checkpoint is a directory written by ``save_checkpoint``: the model, every
              optimizer (in Lightning's order), and the rest of Lightning's checkpoint (epoch,
              loops, callbacks, LR schedulers: ``extra``, read back ``weights_only`` unless
              Lightning is told otherwise). An existing path (``last.ckpt``) is replaced only
              once the new checkpoint is complete. Resuming loads straight into the shards.
  state       ``lightning_module_state_dict`` / ``optimizer_state`` give views of this rank's
              shards (``ShardedSlice`` values), not gathered copies: callbacks see the keys.
  clip        unchanged: Lightning clips with torch's ``clip_grad_norm_``, which sees the global
              norm on sharded gradients ([Note: torch's clip_grad_norm_ on sharded gradients]).
  precision   ``"bf16-mixed"``/``"16-mixed"`` (autocast) work; ``"bf16-true"`` would cast the
              shards themselves and is refused: use ``fully_shard(mixed_precision=...)``.

[Note: Lightning's ModelParallelStrategy]  (Lightning 2.6 read; Trainer and Fabric, the unified
  ``lightning`` package and the standalone ``pytorch_lightning`` / ``lightning_fabric``)
  It trains a model this library sharded exactly, but its checkpoints of it cannot be resumed:
  its loader (``_load_checkpoint``) accepts only models with ``DTensor`` parameters, and Fabric's
  saver (``_save_checkpoint``) refuses the same way with a message that blames the caller. So its
  checkpoint calls raise, before anything is written or loaded, naming the strategies that work.
  :func:`check_caller` does it (in ``_lightning_checks.py``, which imports no Lightning, so a
  standalone ``pytorch_lightning`` install without the unified package loads it too), entered
  under the entry-point group ``composable_shard.caller_checks`` for the prefixes ``lightning``,
  ``pytorch_lightning`` and ``lightning_fabric`` ([Note: Caller checks] in ``_base/callers.py``),
  so it refuses also for a user who never imports this module. Where Lightning reaches the model:
    Trainer save   ``lightning_module_state_dict`` / ``optimizer_state`` call torch's
                   ``get_model_state_dict`` / ``get_optimizer_state_dict``: point ``"traverse"``
                   (torch walks the modules first), else ``"state_dict"``
    Trainer load   ``load_checkpoint`` -> ``_load_checkpoint`` looks for ``DTensor`` parameters
                   (``module.parameters()``): ``"traverse"``
    Fabric save    ``save_checkpoint`` -> ``_save_checkpoint``, the same look: ``"traverse"``
    Fabric load    ``load_checkpoint`` -> ``_load_checkpoint``: ``"traverse"``
  A function of those modules is known by its name alone (``_CHECKPOINT_CALLS``): Lightning's
  checkpoint methods and the module-level ``_save_checkpoint`` / ``_load_checkpoint``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import secrets
import shutil
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn

# Imported by name (as in integrations/transformers.py): mypy does not analyze Lightning for the
# few of its classes this module subclasses.
try:
    _pl: Any = importlib.import_module("lightning.pytorch")
    _pl_precision: Any = importlib.import_module("lightning.pytorch.plugins.precision")
    _fabric: Any = importlib.import_module("lightning.fabric")
    _fabric_precision: Any = importlib.import_module("lightning.fabric.plugins.precision")
except ImportError as e:
    raise ImportError("composable_shard.integrations.lightning needs Lightning: pip install composable_shard[lightning]"
                      ) from e

from .. import StateDictType, load_checkpoint, save_checkpoint, state_dict_type
from ._lightning_checks import check_caller
from ._shared import gradient_sync_off, managed_modules

__all__ = ["ShardedStrategy", "ShardedFabricStrategy", "check_caller"]

_DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's default process-group timeout


# ---------------------------------------------------------------------------- shared by both strategies
def _check_managed(module: nn.Module, api: str) -> None:
    """Refuse a model nothing manages: every rank would train its own copy, silently."""
    if not managed_modules(module):
        raise RuntimeError(
            f"{api}: no module of {type(module).__name__} is managed by composable_shard's fully_shard or replicate, "
            "so every rank would train its own model. Annotate it before training (Trainer: in "
            "LightningModule.configure_model; Fabric: before fabric.setup), e.g. fully_shard(block) for each block, "
            "then fully_shard(model).")


def _refuse_true_half(precision: Any, half_precision_cls: Any, api: str) -> None:
    if isinstance(precision, half_precision_cls):
        raise ValueError(
            f"{api}: precision={getattr(precision, 'precision', 'bf16-true')!r} casts the model's parameters, which "
            "under fully_shard are views of its shards. Keep the shards in float32 and compute in low precision with "
            "fully_shard(..., mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)), or use "
            "precision='bf16-mixed' (autocast).")


def _save_replacing(strategy: Any, path: Any, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                    extra: Dict[str, Any]) -> None:
    """``save_checkpoint`` to ``path``; an existing ``path`` (Lightning's ``last.ckpt``) is
    replaced only after the new checkpoint was published next to it. Collective."""
    path = os.path.abspath(strategy.broadcast(os.fspath(path)))
    if not strategy.broadcast(os.path.lexists(path)):  # rank 0's view of the shared filesystem
        save_checkpoint(path, model, list(optimizers), extra=extra)
        return
    token = strategy.broadcast(secrets.token_hex(6))
    fresh, old = f"{path}.new-{token}", f"{path}.old-{token}"
    save_checkpoint(fresh, model, list(optimizers), extra=extra)
    if strategy.is_global_zero:  # a crash in between leaves both, never a half-written one
        os.rename(path, old)
        os.rename(fresh, path)
        _remove(old)
    strategy.barrier()


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


# ---------------------------------------------------------------------------- Trainer
class ShardedStrategy(_pl.strategies.DDPStrategy):
    """A ``lightning.pytorch`` strategy for a ``LightningModule`` whose modules ``fully_shard``
    / ``replicate`` manage: per step, the losses single-process Lightning gives on the combined
    batch (``gradient_clip_val``, ``accumulate_grad_batches`` included); checkpoints by
    ``save_checkpoint``, resumed at any world size by ``trainer.fit(ckpt_path=...)``. It is
    Lightning's ``DDPStrategy`` (launch, process group, samplers, collectives) without the DDP
    wrap; see [Note: What Lightning's strategies do to a sharded model] in this module.

    Example::

        trainer = L.Trainer(strategy=ShardedStrategy(), accelerator="cpu", devices=2, gradient_clip_val=1.0)
        trainer.fit(model, loader)                 # model.configure_model() calls fully_shard
        trainer.save_checkpoint("ckpts/final.ckpt")   # a directory; trainer.fit(..., ckpt_path=...) resumes

    Args:
        process_group_backend: ``"gloo"``, ``"nccl"``, ... (default: the device's).
        timeout: the process group's timeout, when the strategy creates the group.
        start_method: how Lightning launches the processes it creates (``"popen"``: runs the
            script again; not used under ``torchrun``).
        accelerator, parallel_devices, cluster_environment, precision_plugin: as for
            Lightning's ``DDPStrategy`` (normally set by ``Trainer``).

    Raises:
        RuntimeError: at setup, if no module of the model is managed by the library.
        ValueError: at setup, for ``precision="bf16-true"``/``"16-true"``.
        TypeError: ``save_checkpoint(..., storage_options=...)`` (no CheckpointIO is used).
    """

    strategy_name = "composable_shard"

    def __init__(self, accelerator: Any = None, parallel_devices: Optional[List[torch.device]] = None,
                 cluster_environment: Any = None, precision_plugin: Any = None,
                 process_group_backend: Optional[str] = None, timeout: Optional[timedelta] = _DEFAULT_TIMEOUT,
                 start_method: str = "popen") -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=timeout, start_method=start_method)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Registers no name (``DDPStrategy``'s names stay DDP's)."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the shards, after ``configure_model`` made them."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """:meth:`load_checkpoint` restores the optimizers itself."""
        return False

    def setup(self, trainer: Any) -> None:
        """Check the model (annotated in ``configure_model``), then optimizers and precision:
        no DDP wrap, and no broadcast of rank 0's module states (they are each rank's shards)."""
        self.accelerator.setup(trainer)
        _refuse_true_half(self.precision_plugin, _pl_precision.HalfPrecision, "ShardedStrategy")
        _check_managed(self.model, "ShardedStrategy")
        self.model_to_device()
        if trainer.state.fn == _pl.trainer.states.TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self.barrier()

    def configure_ddp(self) -> None:
        """Nothing: the model is data-parallel already (a DDP wrap would be refused)."""

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Between accumulated micro-batches: no gradient communication."""
        with gradient_sync_off(self.model):
            yield

    # ---------------------------------------------------------------- checkpoints
    def lightning_module_state_dict(self) -> Dict[str, Any]:
        """The model's sharded state dict: views of this rank's shards (nothing gathered)."""
        with state_dict_type(self.lightning_module, StateDictType.SHARDED_STATE_DICT):
            return self.lightning_module.state_dict()  # type: ignore[no-any-return]  # a module's state dict

    def optimizer_state(self, optimizer: Any) -> Dict[str, Any]:
        """The optimizer's state dict (this rank's elements, as ``ShardedSlice`` views)."""
        return optimizer.state_dict()  # type: ignore[no-any-return]  # an optimizer's state dict

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write Lightning's ``checkpoint`` to the directory ``filepath`` with ``save_checkpoint``:
        the model and (unless ``weights_only``) every optimizer from the live shards, the rest
        of ``checkpoint`` as ``extra``. Every rank calls it (Trainer does)."""
        if storage_options is not None:
            raise TypeError("ShardedStrategy.save_checkpoint(..., storage_options=...) is not supported: checkpoints "
                            "are written by composable_shard.save_checkpoint, not by a CheckpointIO plugin.")
        extra = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        optimizers = self.optimizers if "optimizer_states" in checkpoint else []
        _save_replacing(self, filepath, self.lightning_module, optimizers, extra)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Load a :meth:`save_checkpoint` directory into the model (and, when fitting, the
        optimizers); returns the rest of Lightning's checkpoint, read with
        ``torch.load(weights_only=True)`` whatever ``weights_only`` says (allow your own
        classes with ``torch.serialization.add_safe_globals``)."""
        extra = load_checkpoint(self.broadcast(os.fspath(checkpoint_path)), self.lightning_module, list(self.optimizers))
        return dict(extra or {})

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: :meth:`load_checkpoint` loaded the model."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: :meth:`load_checkpoint` loaded the optimizers."""

    def remove_checkpoint(self, filepath: Any) -> None:
        """Rank 0 removes a checkpoint directory (``ModelCheckpoint``'s ``save_top_k``)."""
        if self.is_global_zero:
            _remove(os.fspath(filepath))


# ---------------------------------------------------------------------------- Fabric
class _NoSync:
    """``fabric.no_backward_sync(model)``: gradient communication off for the managed modules."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> Any:
        return gradient_sync_off(module) if enabled else contextlib.nullcontext()


class ShardedFabricStrategy(_fabric.strategies.DDPStrategy):
    """A ``lightning.fabric`` strategy for models that ``fully_shard`` / ``replicate`` manage
    (annotated before ``fabric.setup``): Fabric's ``DDPStrategy`` without the DDP wrap.
    ``fabric.no_backward_sync`` turns gradient communication off, ``fabric.clip_gradients``
    clips by the global norm, and ``fabric.save``/``fabric.load`` write and read
    ``save_checkpoint`` directories.

    Example::

        fabric = L.Fabric(strategy=ShardedFabricStrategy(), accelerator="cpu", devices=2)
        fabric.launch()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        model, optim = fabric.setup(model, torch.optim.AdamW(model.parameters()))
        fabric.save("ckpt/step_100", {"model": model, "optim": optim, "step": 100})
        remainder = fabric.load("ckpt/step_100", {"model": model, "optim": optim})

    ``fabric.save``'s ``state`` holds exactly one model this library manages, its optimizers
    (saved and loaded in the order of their keys), and anything else (plain values, or objects
    with ``state_dict``/``load_state_dict``), which travels as ``extra`` (read back with
    ``torch.load(weights_only=True)``).

    Args:
        process_group_backend, timeout, start_method: as for :class:`ShardedStrategy`.
        accelerator, parallel_devices, cluster_environment, precision: as for Fabric's
            ``DDPStrategy`` (normally set by ``Fabric``).

    Raises:
        RuntimeError: ``fabric.setup`` of a model no module of which the library manages.
        ValueError: ``precision="bf16-true"``/``"16-true"``; a ``state`` without exactly one
            managed model.
        KeyError: ``fabric.load(..., strict=True)`` asks for what the checkpoint does not hold.
        NotImplementedError: ``fabric.save(..., filter=...)``; ``fabric.load`` without the model.
    """

    def __init__(self, accelerator: Any = None, parallel_devices: Optional[List[torch.device]] = None,
                 cluster_environment: Any = None, precision: Any = None, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = _DEFAULT_TIMEOUT, start_method: str = "popen") -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision=precision,
                         process_group_backend=process_group_backend, timeout=timeout, start_method=start_method)
        self._backward_sync_control = _NoSync()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Registers no name (``DDPStrategy``'s names stay DDP's)."""

    def setup_environment(self) -> None:
        """Refuse "true" half precision here, at ``fabric.launch()``: ``fabric.setup`` casts the
        module (the precision's ``convert_module``) before :meth:`setup_module` sees it."""
        _refuse_true_half(self.precision, _fabric_precision.HalfPrecision, "ShardedFabricStrategy")
        super().setup_environment()

    def setup_module(self, module: nn.Module) -> nn.Module:
        """The module as it is (the library made it data-parallel in place); checked ("true" half
        precision was refused at launch, :meth:`setup_environment`)."""
        _check_managed(module, "ShardedFabricStrategy")
        return module

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: Any, state: Dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[Dict[str, Any]] = None) -> None:
        """``save_checkpoint`` of ``state``'s model and optimizers to the directory ``path``,
        everything else as ``extra``. Every rank calls it (``fabric.save`` does)."""
        if storage_options is not None:
            raise TypeError("ShardedFabricStrategy.save_checkpoint(..., storage_options=...) is not supported: "
                            "checkpoints are written by composable_shard.save_checkpoint.")
        if filter:
            raise NotImplementedError("fabric.save(..., filter=...) with ShardedFabricStrategy: the model and optimizers "
                                      "are saved whole by composable_shard.save_checkpoint; drop the filter.")
        model_key, model, optimizers, rest = _split_state(state)
        extra = {k: (v.state_dict() if _is_stateful(v) else v) for k, v in rest.items()}
        extra[_FABRIC_KEYS] = {"model": model_key, "optimizers": [k for k, _ in optimizers]}
        _save_replacing(self, path, model, [o for _, o in optimizers], extra)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Load a :meth:`save_checkpoint` directory into ``state``'s model and optimizers (and
        its other objects); returns what ``state`` did not ask for."""
        if isinstance(state, nn.Module):
            state = {"model": state}
        if not isinstance(state, dict) or not state:
            raise NotImplementedError("fabric.load with ShardedFabricStrategy needs the model to load into: "
                                      "fabric.load(path, {'model': model, 'optim': optim, ...}).")
        _, model, optimizers, rest = _split_state(state)
        extra = load_checkpoint(self.broadcast(os.fspath(path)), model, [o for _, o in optimizers]) or {}
        saved = extra.pop(_FABRIC_KEYS, {})
        if strict and saved and [k for k, _ in optimizers] != saved.get("optimizers"):
            raise KeyError(f"fabric.load: the checkpoint's optimizers are {saved.get('optimizers')}, the state's "
                           f"{[k for k, _ in optimizers]}; pass the same keys (or strict=False)")
        missing = [k for k in rest if k not in extra]
        if strict and missing:
            raise KeyError(f"fabric.load: the requested state contains {missing[0]!r}, which the checkpoint does not "
                           "hold; to load without it, pass strict=False")
        for key, obj in rest.items():
            if key not in extra:
                continue
            if _is_stateful(obj):
                obj.load_state_dict(extra.pop(key))
            else:
                state[key] = extra.pop(key)
        return extra


_FABRIC_KEYS = "composable_shard"  # in a Fabric checkpoint's extra: which keys held the model and the optimizers


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)) \
        and not isinstance(obj, type)


def _split_state(state: Mapping[str, Any]) -> Tuple[str, nn.Module, List[Tuple[str, torch.optim.Optimizer]], Dict[str, Any]]:
    """``(model key, model, [(key, optimizer)] in key order, everything else)`` of Fabric's
    unwrapped ``state``."""
    models = [k for k, v in state.items() if isinstance(v, nn.Module) and managed_modules(v)]
    if len(models) != 1:
        raise ValueError(f"ShardedFabricStrategy: the checkpoint state must hold exactly one model that composable_shard "
                         f"manages; found {models or 'none'}")
    optimizers = sorted(((k, v) for k, v in state.items() if isinstance(v, torch.optim.Optimizer)), key=lambda kv: kv[0])
    taken = {models[0]} | {k for k, _ in optimizers}
    return models[0], state[models[0]], optimizers, {k: v for k, v in state.items() if k not in taken}
