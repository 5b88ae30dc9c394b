"""The refusal of Lightning's ``ModelParallelStrategy`` checkpoints of models this library
manages: [Note: Lightning's ModelParallelStrategy] in ``integrations/lightning.py``. Kept apart from
that module because it imports no Lightning: the library loads it by entry point while code of any
of Lightning's packages runs (the unified ``lightning``, or the standalone ``pytorch_lightning`` /
``lightning_fabric`` without it).
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["check_caller"]

_MODEL_PARALLEL_MODULES = frozenset({"lightning.pytorch.strategies.model_parallel",
                                     "lightning.fabric.strategies.model_parallel",
                                     "pytorch_lightning.strategies.model_parallel",
                                     "lightning_fabric.strategies.model_parallel"})
_CHECKPOINT_CALLS = frozenset({"save_checkpoint", "load_checkpoint", "_save_checkpoint", "_load_checkpoint",
                               "lightning_module_state_dict", "optimizer_state"})
_CHECKED_POINTS = frozenset({"traverse", "state_dict"})  # where a checkpoint call first reaches the model


def check_caller(subject: Any, point: str, functions: Sequence[Any]) -> None:
    """Refuse a checkpoint call of Lightning's ``ModelParallelStrategy`` (Trainer or Fabric) that
    reached a module this library manages, or an optimizer of one, before anything is saved or
    loaded: its checkpoints of such a model could not be resumed. See [Note: Lightning's
    ModelParallelStrategy]; the library calls it (entry point ``composable_shard.caller_checks``,
    [Note: Caller checks] in ``composable_shard/_base/callers.py``), a user never needs to.

    Example::

        check_caller(model, "traverse", [])          # nothing of Lightning's running: returns

    Args:
        subject: the managed module or the optimizer that was reached.
        point: where it was reached: ``"traverse"`` or ``"state_dict"`` are checked, other
            points return.
        functions: the running functions of Lightning's packages, innermost first, each with
            ``module`` (its module's name) and ``name`` (the function's).

    Raises:
        RuntimeError: a checkpoint function of ``ModelParallelStrategy`` is among ``functions``.
    """
    if point not in _CHECKED_POINTS:
        return
    for function in functions:
        if function.module in _MODEL_PARALLEL_MODULES and function.name in _CHECKPOINT_CALLS:
            raise RuntimeError(
                "Lightning's ModelParallelStrategy cannot checkpoint a model sharded by composable_shard: its loader "
                "accepts only models with DTensor (FSDP2) parameters, so its checkpoint could not be resumed. Use "
                "strategy=composable_shard.integrations.lightning.ShardedStrategy() with Trainer (or "
                "ShardedFabricStrategy() with Fabric): it trains the same way and saves checkpoints that resume at "
                "any world size. Nothing was saved or loaded.")
