"""State of ``fully_shard`` and small helpers shared across the package (weak holders, FQN cleaning).

Every field of :class:`_FSDPState` is declared here, typed, with one comment each. Fields
marked *root only* are meaningful on the root state alone (the outermost fully sharded module
of a forward), which caches everything the runtime needs so no step traverses the module tree.
"""

from __future__ import annotations

import enum
import weakref
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy, StateDictType
from .flat_param import FlatParamHandle, HandleTrainingState, Reduction, _is_fsdp_flattened, _set_fsdp_flattened  # noqa: F401  # some re-exported
from .streams import Streams
from .watch import ModelChange, StepCounter, StepVerdict
from ..contract import _State

__all__ = [
    "TrainingState",
    "HandleTrainingState",
    "_FSDPState",
    "RootContext",
    "clean_tensor_name",
    "_is_fsdp_flattened",
    "_set_fsdp_flattened",
    "FSDP_API_NAME",
    "WeakGroup",
    "WeakHook",
]

FSDP_API_NAME = "fully_shard"  # registry key of fully_shard (see contract.py)


class WeakGroup:
    """A process-group attribute held by weak reference (see [Note: Process groups held weakly]).

    Reads ``None`` when set to ``None``; reading a group that has been destroyed raises a
    ``RuntimeError`` that says so, instead of running a collective on a dead group.

    [Note: Process groups held weakly]
      ``dist.destroy_process_group()`` unregisters its groups, and the C++ group (with gloo's
      worker threads) is destroyed only once nothing else refers to it. Were the library's
      states to hold their groups strongly, the groups would live on until the model is
      collected: at interpreter exit, while Python is being torn down. A gloo worker thread
      that still holds a finished collective's tensors (a barrier keeps weak references to the
      works in flight when it was issued, and a tensor the Python side let go of is then
      freed by that thread) must take the GIL to free them, and a thread that asks for the GIL
      during finalization is terminated: ``terminate called without an active exception``,
      the job exits with SIGABRT after training finished (measured: 3 of 30 runs of a
      two-rank job that ends with ``dist.barrier(); dist.destroy_process_group()``; torch's
      FSDP2 2 of 30). Every registered group is kept alive by ``torch.distributed`` itself
      until it is destroyed, so a weak reference loses nothing while the group is usable.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.slot = f"_{name}_ref"

    def __get__(self, obj: Any, objtype: Optional[type] = None) -> Any:
        if obj is None:
            return self
        ref = obj.__dict__.get(self.slot)
        if ref is None:
            return None
        group = ref()
        if group is None:
            where = obj.describe() if hasattr(obj, "describe") else type(obj).__name__
            raise RuntimeError(f"{where}: its {self.name} was destroyed (dist.destroy_process_group), so this "
                               "module cannot communicate any more. Destroy process groups only after the last "
                               "forward, backward, state_dict or checkpoint call on the model.")
        return group

    def __set__(self, obj: Any, group: Optional[dist.ProcessGroup]) -> None:
        obj.__dict__[self.slot] = None if group is None else weakref.ref(group)


class WeakHook:
    """A tensor hook that calls ``fn(*objects, *hook_args)`` and holds ``objects`` weakly (does
    nothing once one of them is gone).

    [Note: Hooks on tensors hold weakly]  A tensor keeps its hooks in C++, where Python's
    garbage collector does not look. A hook on a parameter (or an unsharded buffer) that held
    the library's state strongly would close a cycle the collector cannot see: module ->
    state -> parameter -> hook -> state. A deleted model would then never be freed (measured:
    10.6 MB left per fully sharded benchmark model at W=2, 42 MB per replicated one)."""

    def __init__(self, fn: Callable[..., Any], *objects: Any) -> None:
        self.fn = fn
        self.refs = tuple(weakref.ref(o) for o in objects)

    def __call__(self, *args: Any) -> Any:
        objects = []  # a plain loop, no comprehension: once per group and backward
        for ref in self.refs:
            o = ref()
            if o is None:
                return None
            objects.append(o)
        return self.fn(*objects, *args)


class TrainingState(enum.Enum):
    """What a fully sharded module's state is doing."""

    IDLE = enum.auto()
    FORWARD_BACKWARD = enum.auto()
    SUMMON_FULL_PARAMS = enum.auto()


class RootContext:
    """What only the root keeps, for its whole tree (set at lazy init): the states and handles it
    caches so no step traverses the module tree, the handle orders of the first iteration, the
    reductions in flight, and the per-iteration flags."""

    def __init__(self, states: List["_FSDPState"], handles: List[FlatParamHandle]) -> None:
        self.all_states: List["_FSDPState"] = states  # every state of the tree, DFS order
        self.handles: List[FlatParamHandle] = handles  # every handle of the tree, DFS order
        self.exec_order: List[FlatParamHandle] = []  # pre-forward order, recorded in iteration 1
        self.post_forward_order: List[FlatParamHandle] = []  # post-forward order (reversed: backward)
        self.exec_order_recorded: bool = False  # True once the first iteration finished
        self.exec_index: int = 0  # position in exec_order during the current forward
        self.forward_seen: Set[int] = set()  # id() of the handles whose forward ran in this iteration
        self.warned_order_change: bool = False  # one warning per root when the order changes
        self.final_callback_queued: bool = False  # a backward started (its end-of-backward callback is queued)
        self.forward_in_progress: bool = False  # between the root's pre-forward and post-forward
        self.pending_reductions: List[Reduction] = []  # reductions issued, not yet finished (a few at most)
        self.check_order: bool = True  # agree across ranks before each all-gather and reduction (first iteration)
        self.debug_checks: bool = False  # COMPOSABLE_SHARD_DEBUG: agree before every collective, every step
        self.changes_to_check: bool = True  # a tracked module changed since the last check (_runtime/watch.py); the first forward checks
        self.step_counter: Optional[StepCounter] = None  # the optimizer steps on every handle's parameters
        # grad modes (enabled or not) whose first forward ran with sharded reads refused
        # ([Note: Sharded parameters read in forward] in _base/sharded_reads.py); guarding: one runs now
        self.reads_guarded_in: Set[bool] = set()
        self.guarding_reads: bool = False
        # per process-group pair: the last end-of-backward agreement's step verdict, read at the next one
        self.step_verdicts: Dict[Tuple[int, int], StepVerdict] = {}


class _FSDPState(_State):
    """Per fully-sharded-module state of ``fully_shard``. Every field is declared here."""

    process_group = WeakGroup()  # shard group (None: a group of one rank)
    replicate_group = WeakGroup()  # HYBRID: group across replicas (None: none)

    def __init__(self) -> None:
        # -- configuration (set once by fully_shard) --
        self.module: Optional[nn.Module] = None  # the fully sharded module this state belongs to (a ModuleGroup for a list)
        self.awaiting_init: bool = False  # sharded on the meta device: uninitialized until to_empty (FSDP2's flow)
        self.members: Optional[List[nn.Module]] = None  # fully_shard([...]): the listed modules, one handle for all
        self.group_pending: Set[int] = set()  # members: id() of those whose forward has not run in this round
        self.group_depth: int = 0  # members: forwards of members running (one inside another counts once)
        self.fqn: str = ""  # its FQN relative to the module fully_shard was called on
        self.process_group = None  # shard group, held weakly (see WeakGroup)
        self.replicate_group = None  # HYBRID: group across replicas, held weakly
        self.rank: int = 0  # rank within the shard group
        self.world_size: int = 1  # shard group size
        self.dp_world_size: int = 1  # data-parallel world (shard x replicate): gradient divisor
        self.strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
        self.mixed_precision: Optional[MixedPrecision] = None
        self.cpu_offload: CPUOffload = CPUOffload()
        self.backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE
        self.forward_prefetch: bool = True
        self.limit_all_gathers: bool = True
        self.compute_device: torch.device = torch.device("cpu")  # where forward runs
        self.ignored_params: Set[nn.Parameter] = set()  # never flattened nor reduced
        self.ignored_modules: Set[nn.Module] = set()  # subtrees (with their roots) left alone
        self.handle: Optional["FlatParamHandle"] = None  # None if the module owns no parameters
        # -- per-module switches (FSDPModule methods) --
        self.sync_gradients: bool = True  # False: accumulate unsharded grads, no communication
        self.reshard_after_backward: bool = True  # False: keep parameters unsharded after backward
        self.reshard_after_forward: bool = True  # False: keep them from forward to backward (set from the strategy)
        self.root_reshards_after_forward: bool = False  # the root frees them too: FSDP2's reshard_after_forward
        # asked for explicitly (fully_shard's argument or set_reshard_after_forward), as FSDP2 does (see frees_after_forward)
        self.gradient_divide_factor: Optional[float] = None  # None: divide reduced gradients by dp_world_size
        self.forward_prefetch_states: Optional[List["_FSDPState"]] = None  # explicit forward prefetch (None: next in order)
        self.backward_prefetch_states: Optional[List["_FSDPState"]] = None  # explicit backward prefetch (None: previous)
        self.is_last_backward: bool = True  # FSDP2's hint; every backward here finishes its reductions
        self.state_dict_type: StateDictType = StateDictType.FULL_STATE_DICT  # set by state_dict_type(...)
        self.state_dict_config: Any = None  # its Full/ShardedStateDictConfig (None: the type's defaults)
        # -- runtime --
        self.training_state: TrainingState = TrainingState.IDLE
        self.is_root: Optional[bool] = None  # None until lazy init decides
        self.root: Optional["_FSDPState"] = None  # the root state of the last forward (set at lazy init)
        # -- root only --
        self._ctx: Optional[RootContext] = None  # root only: what the root keeps for its whole tree
        # -- any state --
        self.model_change: Optional[ModelChange] = None  # a structure change made after fully_shard (raised at forward)
        self.streams: Optional["Streams"] = None  # CUDA streams shared by the tree (no-ops on CPU)
        self.optimizer_state_dict_watch: Any = None  # links optimizers to this handle ([Note: torch's state-dict API])

    @property
    def _all_fsdp_states(self) -> List["_FSDPState"]:
        """Root only: every state of the tree, DFS order ([] on any other state)."""
        return self._ctx.all_states if self._ctx is not None else []

    @property
    def _all_handles(self) -> List[FlatParamHandle]:
        """Root only: every handle of the tree, DFS order ([] on any other state)."""
        return self._ctx.handles if self._ctx is not None else []

    @property
    def ctx(self) -> RootContext:
        """This root's context (raises on a state that is not a root, or before lazy init)."""
        if self._ctx is None:
            raise AssertionError(f"[rank {self.rank}] {self.describe()} is not a root (or before lazy init)")
        return self._ctx

    @property
    def gradient_divisor(self) -> float:
        """What reduced gradients are divided by: the data-parallel world size (an average),
        or what ``set_gradient_divide_factor`` set (1.0: a sum)."""
        return float(self.dp_world_size) if self.gradient_divide_factor is None else self.gradient_divide_factor

    # Convenience for error messages.
    def describe(self) -> str:
        return f"fully_shard({self.fqn or '<root>'})"


def clean_tensor_name(name: str) -> str:
    """Strip wrapper prefixes from an FQN. composable_shard adds none, but checkpoints from
    wrapper-based APIs carry ``_fsdp_wrapped_module.`` / ``_checkpoint_wrapped_module.`` /
    ``_orig_mod.`` (torch.compile) prefixes; removing them lets such names be compared with
    ours. A plain ``module.`` prefix is kept: it may be a user's own submodule name."""
    for prefix in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(prefix, "")
    return name

