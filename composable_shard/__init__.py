"""composable_shard: in-place composable data parallelism for PyTorch.

``fully_shard`` (ZeRO-3 with flat parameters), ``replicate`` (DDP) and ``checkpoint``
(activation recomputation) apply to modules in place and mix freely on different submodules.
``describe(model)`` shows what they do (or would do) to a model, per rank; so does
``python -m composable_shard describe MODULE:FACTORY --world W``.

Layout (private by folder: a folder named with a leading ``_`` is private, its files carry no
prefix of their own), lowest first; each folder imports only from the ones before it:
``_base/`` (torch seams, containers) < ``api``, ``contract``, ``wrap`` (the vocabulary) <
``_runtime/`` (the step) < ``_setup/`` (apply time) < ``_state/`` (state dicts, checkpoints) <
``_planning/`` (``describe``, ``plan``'s measurements) < the public modules here <
``integrations/``. Each folder's ``__init__`` docstring says what lives there.
"""

from importlib import metadata as _metadata

from .api import (
    BackwardPrefetch,
    CPUOffload,
    FullStateDictConfig,
    MixedPrecision,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from .contract import contract
from .checkpoint import checkpoint
from .fully_shard import FSDPModule, clip_grad_norm_, fully_shard
from .replicate import ReplicateModule, replicate
from ._state.unshard_params import unshard_params
from ._state.model_state_dict import get_model_state_dict, set_model_state_dict, state_dict_type
from ._state.optim_state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from ._state.sharded_slice import ShardedSlice
from ._state.checkpoint_files import export_safetensors, latest_checkpoint, load_checkpoint, save_checkpoint
from ._state.async_checkpoint import AsyncSave, save_checkpoint_async
from ._planning.describe import describe
from .plan import MemoryPlan, plan
from . import optim  # noqa: F401  (composable_shard.optim.Muon: optimizers that need whole matrices)
from .wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)

__all__ = [
    "contract", "fully_shard", "replicate", "checkpoint", "FSDPModule", "ReplicateModule",
    "ShardingStrategy", "BackwardPrefetch", "MixedPrecision", "CPUOffload",
    "StateDictType", "FullStateDictConfig", "ShardedStateDictConfig",
    "ModuleWrapPolicy", "CustomPolicy", "always_wrap_policy", "lambda_auto_wrap_policy",
    "transformer_auto_wrap_policy", "size_based_auto_wrap_policy", "enable_wrap", "wrap",
    "unshard_params", "state_dict_type", "clip_grad_norm_",
    "get_model_state_dict", "set_model_state_dict", "get_optimizer_state_dict", "set_optimizer_state_dict",
    "ShardedSlice", "save_checkpoint", "save_checkpoint_async", "AsyncSave", "load_checkpoint", "latest_checkpoint", "export_safetensors",
    "describe", "plan", "MemoryPlan",
]

try:
    __version__: str = _metadata.version("composable_shard")
    """The installed distribution's version (``pyproject.toml``)."""
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0.1.0"
