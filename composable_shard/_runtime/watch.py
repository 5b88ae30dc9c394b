"""What the user does to a fully sharded model between steps, seen through torch's global hooks.

* **Structure changes.** A handle owns fixed parameter objects registered at fixed slots
  (``module.<name>``). A parameter registered (or replaced) at a slot of a managed module
  afterwards, or a submodule holding parameters added under one, would silently be left out of
  training (never gathered, reduced or updated). torch's global parameter and module
  registration hooks report each such registration as it happens, so nothing is checked per
  step: the change is recorded on the owning state and the next forward raises naming the FQN
  (:func:`raise_on_model_change`). Registering the same object again, or wrapping a managed
  submodule in a container without parameters of its own (activation-checkpoint wrappers do
  that), is not a change.
* **Casts and moves.** ``model.half()``, ``model.to(torch.float64)``, ``model.cuda()`` give each
  parameter new storage (``nn.Module._apply`` swaps ``.data``, or the objects). A sharded
  original parameter would then no longer be a view of its flat shard: the forward would go on
  computing on the shards and the optimizer would update copies nothing reads, so training would
  silently do nothing. :func:`guard_apply` runs such a call on a fully sharded module and, if it
  cut any managed parameter loose, puts the module back as it was and raises; a call that leaves
  every parameter where it is (``model.to(<its own device>)``, ``model.float()`` on float32) is
  allowed. fully_shard's own initialization (``param_init_fn`` calling ``to_empty``) puts
  parameters back itself and is not checked (:func:`applying_during_init`). Both live in
  ``_setup/apply_guard.py``; a ``.data`` replaced by any other path is caught at the next forward
  (see [Note: Detached parameters] in ``_runtime/hooks.py``).
* **Optimizer steps.** Unsharded buffers kept across steps (``SHARD_GRAD_OP`` after a forward
  without backward, ``set_reshard_after_backward(False)``, a manual ``unshard()``) must not
  outlive an update of the shards they were gathered from. In-place edits bump the parameters'
  version counters, but fused optimizers do not, so each handle also counts, through torch's
  global optimizer step hook, the steps of the optimizers that hold one of its parameters
  (:class:`OptimizerSteps`); a kept buffer gathered before the handle's last counted step is
  gathered again. Another model's optimizer is not counted. In-place writes through ``param.data``
  (``p.data.copy_(...)``) are seen by neither; use ``unshard_params(writeback=True)`` or in-place
  ops on the parameter instead. (Assigning ``param.data = ...`` is caught at the next forward.)
* **Optimizer steps on some ranks only.** See [Note: Step agreement].
* **An optimizer built before fully_shard replaced tensor-parallel parameters.** fully_shard keeps
  every plain parameter object, but puts a new plain parameter in a ``DTensor`` parameter's place
  ([Note: Tensor-parallel pieces] in ``_runtime/flat_param.py``); an optimizer holding the old
  ``DTensor`` would step a tensor nothing reads, and, those never getting a gradient, silently
  skip them. Its first step raises instead, before anything changes (:func:`watch_replaced`).

[Note: Step agreement]  Every rank must step its optimizer as often as the others. Under
``fully_shard`` each rank updates a different slice of every parameter, so a step skipped on one
rank leaves that rank's slices behind: the model becomes one that no single process would have
computed, and nothing fails. ``torch.amp.GradScaler`` does exactly that (it skips the step when
*this rank's* gradient slices overflow; torch's ``ShardedGradScaler`` agrees on it across
ranks), and so does ``if torch.isfinite(loss): optimizer.step()`` on a per-rank loss. Under
``replicate`` the replicas drift apart the same way. So each synced backward's used-parameter
all-reduce (which both APIs already run) carries two more integers: ``d``, the number of steps
the optimizers holding this module's parameters took on this rank since the last check, and
``d * d``. Summed over ``n`` ranks, ``n * sum(d * d) == sum(d) ** 2`` exactly when every rank has
the same ``d``, so every rank sees the same verdict and raises the same error, with no extra
collective (:class:`StepCounter`). ``d`` is capped at 255 so the sums stay exact in int32.
The verdict is read one synced backward later, not in the step that issued it (reading it there
would stop the CPU until the GPU drained the backward: [Note: No host reads in a step] in
``_base/host_mirror.py``): the all-reduce's result is copied to pinned host memory behind it,
and the next synced backward reads that copy (done by then) before it issues its own agreement
(:class:`~composable_shard._runtime.agreement.StepVerdict`). So a step skipped on some ranks
raises at the end of the second synced backward after it, on every rank, with the model idle
and consistent as before; the error says which window it is about.
Optimizers that hold none of the module's parameters are not counted: a rank may train a model
of its own.

[Note: Hooks for as long as a model needs them]  torch's global hooks are installed when the
first state is tracked or the first :class:`OptimizerSteps` is made, and removed
(``RemovableHandle.remove``) when the last of them is garbage collected (``weakref.finalize``),
so a process whose sharded models are gone runs none of our code at each registration or step.
No counter is process-wide: a structure change is recorded on the owning state and flags its
root (``root.ctx.changes_to_check``: the per-step check is one attribute read), and step epochs
belong to each handle (:class:`OptimizerSteps`). torch calls the global hooks while iterating
over its dict of them, and a finalizer can run inside one of our hooks (any allocation may
collect the last model), so while one of our hooks runs (in any thread) the removal is skipped:
the hooks stay, find nothing tracked and return at once, and the next model keeps using them.
(A model freed on one thread while another thread is between two of torch's global hooks can
still change that dict under it; nothing outside torch can tell.)

[Note: Tracked modules]  Every module of a fully sharded module's subtree that is not ignored,
not managed by ``replicate`` and not inside a nested fully sharded module is tracked with the
parameters its slots held when the handle was built. A module registered later under a tracked
module is tracked too (if it brings no parameters), so parameters added to it later are caught.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Protocol, Sequence, Set, Tuple

import torch
import torch.nn as nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)
from torch.optim.optimizer import Optimizer, register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..contract import _get_registry
from .._base.host_mirror import HostMirror

__all__ = ["track", "owner_of", "raise_on_model_change", "OptimizerSteps", "StepCounter", "STEP_AGREEMENT_INTS", "watch_replaced",
           "check_before_optimizer_steps"]


class _Owner(Protocol):
    """What this file reads and sets on a fully sharded module's ``_FSDPState`` (not imported:
    ``module_state`` imports ``flat_param``, which imports this file)."""

    fqn: str
    model_change: Optional["ModelChange"]
    module: Optional[nn.Module]

    @property
    def ctx(self) -> Any: ...  # root only: RootContext, whose changes_to_check this file sets

    @property
    def root(self) -> Optional["_Owner"]: ...

    def describe(self) -> str: ...


class ModelChange(NamedTuple):
    """A structure change recorded on a state: ``what`` (``parameter``, ``submodule``) at
    ``relative`` (its FQN relative to the state's module), then ``rest``. Named in full (from the
    root) only when raised: a change made between fully_shard and the first forward is recorded
    before the root is known, so the state's own FQN is known only then."""

    what: str
    relative: str
    rest: str

    def message(self, state_fqn: str) -> str:
        full = ".".join(p for p in (state_fqn, self.relative) if p)
        return f"{self.what} {full!r} {self.rest}"


@dataclass
class _Tracked:
    state_ref: Callable[[], Optional[_Owner]]  # weak reference to the owning state
    name: str  # the module's FQN relative to the owning fully sharded module ("" for itself)
    slots: Dict[str, Any] = field(default_factory=dict)  # parameter name -> the object the handle owns


_tracked: "weakref.WeakKeyDictionary[nn.Module, _Tracked]" = weakref.WeakKeyDictionary()
_installed: List[Any] = []  # torch's global hook handles, while some state or OptimizerSteps lives
_users: "weakref.WeakSet[Any]" = weakref.WeakSet()  # those states and OptimizerSteps
_live_users = [0]  # how many of them are alive (counted by their finalizers, whatever order weakref callbacks run in)
_step_watches: "weakref.WeakSet[OptimizerSteps]" = weakref.WeakSet()  # alive with their handle or state
_in_hook = [0]  # our hooks running now, in any thread (see [Note: Hooks for as long as a model needs them])
_lock = threading.RLock()  # guards the counts and _installed (a finalizer may run while this thread holds it)


@contextlib.contextmanager
def _hook_running() -> Iterator[None]:
    """Around the body of each of our hooks: meanwhile a finalizer leaves the hooks in place."""
    with _lock:
        _in_hook[0] += 1
    try:
        yield
    finally:
        with _lock:
            _in_hook[0] -= 1


def _use_hooks(user: Any) -> None:
    """Install torch's global hooks (if none are) for as long as ``user`` lives."""
    if user in _users:
        return
    with _lock:
        _live_users[0] += 1  # first: a finalizer run by an allocation below never sees none left
        if not _installed:
            _installed.extend([register_module_parameter_registration_hook(_on_parameter),
                               register_module_module_registration_hook(_on_module),
                               register_optimizer_step_post_hook(_on_optimizer_step),
                               register_optimizer_step_pre_hook(_before_optimizer_step)])
    _users.add(user)
    weakref.finalize(user, _release_hooks).atexit = False  # at exit nothing is left to spare


def _release_hooks() -> None:
    """A user died: remove the hooks if it was the last (not from inside one of them)."""
    with _lock:
        _live_users[0] -= 1
        if not _live_users[0] and not _in_hook[0]:
            while _installed:
                _installed.pop().remove()


def track(state: _Owner, modules: Iterable[tuple], params_by_slot: Dict[int, Dict[str, Any]]) -> None:
    """Track ``modules`` (``(name, module)`` pairs relative to ``state.module``) as owned by
    ``state``; ``params_by_slot[id(module)]`` holds the parameters its slots own. Modules
    already tracked (by a nested fully sharded module, annotated first) are left alone."""
    _use_hooks(state)
    ref = weakref.ref(state)
    for name, module in modules:
        if module not in _tracked:
            _tracked[module] = _Tracked(ref, name, dict(params_by_slot.get(id(module), {})))


def owner_of(module: nn.Module) -> Optional[Tuple[nn.Module, str]]:
    """The fully sharded module whose handle owns ``module`` (``module`` itself or an ancestor)
    and ``module``'s path in it, if a live one does."""
    tracked = _tracked.get(module)
    state = tracked.state_ref() if tracked is not None else None
    if tracked is None or state is None or state.module is None:
        return None
    return state.module, tracked.name


def _record(tracked: _Tracked, what: str, name: str, rest: str) -> None:
    state = tracked.state_ref()
    if state is None:
        return
    if state.model_change is None:
        state.model_change = ModelChange(what, ".".join(p for p in (tracked.name, name) if p), rest)
    if state.root is not None:  # before lazy init, the first forward checks anyway
        state.root.ctx.changes_to_check = True


def _on_parameter(module: nn.Module, name: str, param: Any) -> None:
    with _hook_running():
        tracked = _tracked.get(module)
        if tracked is None or tracked.slots.get(name) is param:
            return
        action = "removed" if param is None else ("replaced" if name in tracked.slots else "registered")
        _record(tracked, "parameter", name, f"was {action} after fully_shard")


def _on_module(module: nn.Module, name: str, submodule: Any) -> None:
    with _hook_running():
        tracked = _tracked.get(module)
        if tracked is None or not isinstance(submodule, nn.Module):
            return
        new_params = _untracked_params(submodule)
        if new_params:
            _record(tracked, "submodule", name, f"with parameters {new_params} was added after fully_shard")
            return
        for sub_name, sub in submodule.named_modules():
            if sub not in _tracked:
                _tracked[sub] = _Tracked(tracked.state_ref, ".".join(p for p in (tracked.name, name, sub_name) if p))


def _untracked_params(submodule: nn.Module) -> List[str]:
    """Parameters of ``submodule``'s subtree held by modules no handle owns and no
    ``replicate`` manages (a replicated block moved under a checkpoint wrapper still trains)."""
    found: List[str] = []
    seen: Set[int] = set()
    stack = [("", submodule)]
    while stack:
        sub_name, sub = stack.pop()
        if id(sub) in seen or "replicate" in (_get_registry(sub) or {}):
            continue
        seen.add(id(sub))
        if sub not in _tracked:
            found.extend(f"{sub_name}.{n}" if sub_name else n for n, p in sub.named_parameters(recurse=False)
                         if p is not None)
        stack.extend((f"{sub_name}.{n}" if sub_name else n, c) for n, c in reversed(list(sub.named_children())))
    return found


# checks run before every optimizer step in the process (while the hooks are installed); each
# must return at once for an optimizer it has nothing to say about
_before_step_checks: List[Callable[[Optimizer], None]] = []


def check_before_optimizer_steps(check: Callable[[Optimizer], None]) -> None:
    """Run ``check(optimizer)`` before every optimizer step while any fully sharded module
    lives (after the refusal of [Note: Optimizers that need whole tensors]); it may raise to
    stop the step. Registered once per process, by the module that defines it."""
    if check not in _before_step_checks:
        _before_step_checks.append(check)


def _before_optimizer_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    _refuse_whole_tensor_optimizer(optimizer)
    _warn_unaveraged_gradients(optimizer)
    for check in _before_step_checks:
        check(optimizer)


# [Note: Gradients no data-parallel API averages]  fully_shard on the blocks but not on the model
# (or replicate on some submodules only) leaves the other parameters (an embedding, the output
# head) plain: their gradients are each rank's own, no API averages them, and every rank's
# optimizer steps its own copy apart from the others' (a user's trial: the ranks' output heads
# 1e-2 apart after three steps, with nothing said; FSDP2 is as silent). At an optimizer's first
# step (and again after its groups grow), if it steps parameters of a data-parallel module of
# more than one rank beside trainable parameters with a gradient that no such module manages
# (not ignored by it, not DTensors), a warning names them and says what to do. Not an error: a
# parameter meant to differ per rank, or averaged by the user's own code, may exist. Local: no
# collective (a first step taken on some ranks only must not meet a check the others skip). One
# size comparison per step after the first.
_unaveraged_checked: "weakref.WeakKeyDictionary[Optimizer, Tuple[int, int]]" = weakref.WeakKeyDictionary()


def _warn_unaveraged_gradients(optimizer: Optimizer) -> None:
    groups = optimizer.param_groups
    size = (len(groups), sum(len(g["params"]) for g in groups))
    if _unaveraged_checked.get(optimizer) == size:
        return
    _unaveraged_checked[optimizer] = size
    stepped = [p for g in groups for p in g["params"]]
    ids = {id(p) for p in stepped}
    watches = list(_step_watches)
    counters = [w for w in watches if isinstance(w, StepCounter) and w.dp_world_size > 1 and not w.param_ids.isdisjoint(ids)]
    if not counters:
        return
    managed = set().union(*(w.param_ids for w in watches), *(c.ignored_ids for c in counters))
    loose = [p for p in stepped if id(p) not in managed and p.requires_grad and p.grad is not None and not _is_dtensor(p)]
    if not loose:
        return
    names = {id(p): n for g in groups for p, n in zip(g["params"], g.get("param_names") or [])}  # torch.optim given named_parameters()
    shown = ", ".join(repr(names[id(p)]) if id(p) in names else f"shape {tuple(p.shape)}" for p in loose[:4])
    warnings.warn(
        f"{type(optimizer).__name__}.step() steps {len(loose)} parameter(s) that neither fully_shard nor replicate "
        f"manages ({shown}{', ...' if len(loose) > 4 else ''}) beside fully sharded or replicated ones: nothing "
        "averages their gradients across ranks, so each rank trains its own copy and the ranks drift apart. Apply "
        "fully_shard (or replicate) to the root module too (fully_shard(model) after the blocks), or list parameters "
        "meant to differ per rank in its ignored_params / ignored_modules (if your own code averages their gradients, "
        "this warning can be filtered).", UserWarning, stacklevel=4)


def _is_dtensor(p: Any) -> bool:
    from torch.distributed.tensor import DTensor  # deferred: slow to import, needed at a first step only

    return isinstance(p, DTensor)


# optimizer -> (its groups_size, _watches_made, weak references to the watches that count its steps):
# worked out at its first step and again when its groups or the set of watches change, so that a
# step costs one increment per watch holding it (there are two per fully sharded module).
_holders: "weakref.WeakKeyDictionary[Any, Tuple[Tuple[int, int], int, List[Any]]]" = weakref.WeakKeyDictionary()
_watches_made = [0]  # OptimizerSteps created so far in this process


def _on_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    with _hook_running():
        size = groups_size(optimizer)
        known = _holders.get(optimizer)
        fresh = known is None or known[0] != size or known[1] != _watches_made[0]
        if fresh:
            known = (size, _watches_made[0], [weakref.ref(w) for w in list(_step_watches) if w.holds(optimizer)])
            _holders[optimizer] = known
        for ref in known[2]:  # type: ignore[index]  # set above when None
            watch = ref()
            if watch is not None:
                watch.epoch += 1
                if fresh or watch.every_step:
                    watch.stepped(optimizer)


def groups_size(optimizer: Optimizer) -> Tuple[int, int]:
    """``(parameter groups, parameters in them)`` of ``optimizer``: changes when a group or a
    parameter is added or removed."""
    groups = optimizer.param_groups
    return (len(groups), sum([len(g["params"]) for g in groups]))


# [Note: Optimizers that need whole tensors]  An optimizer whose update of an element depends on
# other elements computes something else on fully_shard's parameters than on a plain model's:
# * torch.optim.LBFGS takes dot products and norms over all its parameters' elements: on a rank's
#   slices (a real shard) each rank steps differently from one process (a user's trial: off by
#   0.48 after one step). On whole parameters (NO_SHARD, one-rank groups, replicate) the elements
#   are the same, in another order, and it is exact if its closure returns the loss averaged
#   over ranks.
# * torch.optim.Adafactor keeps row and column statistics of each matrix and scales its step by
#   the parameter's norm: any parameter fully_shard flattened (every strategy keeps 1-D views of
#   its flat buffer between steps) is stepped as a vector (off by 3.6e-3 after one step, even under
#   NO_SHARD; a ZeroDivisionError on a rank holding no element).
# Their first step on such a parameter raises before anything is stepped, naming the parameter
# (composable_shard.optim.Muon is the whole-matrix optimizer made for flat shards). Checked once
# per optimizer until its groups change size; other optimizers cost one isinstance per step.
class _WholeTensorOptimizer(NamedTuple):
    why: str
    needs_shape: bool  # True: refused on every flattened parameter; False: only on a real shard
    remedy: str


def _whole_tensor_optimizers() -> Dict[type, _WholeTensorOptimizer]:
    found: Dict[type, _WholeTensorOptimizer] = {}
    for name, rule in (("LBFGS", _WholeTensorOptimizer(
                            "takes dot products and norms over all its parameters' elements", False,
                            "Use it on whole parameters (replicate, or fully_shard with strategy="
                            "ShardingStrategy.NO_SHARD) with a closure that returns the loss averaged over ranks, "
                            "or an element-wise optimizer (SGD, Adam, AdamW, ...).")),
                       ("Adafactor", _WholeTensorOptimizer(
                            "keeps row and column statistics of each matrix and scales its step by the parameter's "
                            "norm", True,
                            "Use it under replicate (parameters keep their shapes), or an element-wise optimizer "
                            "(Adam, AdamW, ...)."))):
        cls = getattr(torch.optim, name, None)
        if isinstance(cls, type):
            found[cls] = rule
    return found


_WHOLE_TENSOR_OPTIMIZERS = _whole_tensor_optimizers()
_WHOLE_TENSOR_CLASSES = tuple(_WHOLE_TENSOR_OPTIMIZERS)
_whole_checked: "weakref.WeakKeyDictionary[Optimizer, Tuple[int, int]]" = weakref.WeakKeyDictionary()


def _refuse_whole_tensor_optimizer(optimizer: Optimizer) -> None:
    if not isinstance(optimizer, _WHOLE_TENSOR_CLASSES):
        return
    groups = optimizer.param_groups
    size = (len(groups), sum(len(g["params"]) for g in groups))
    if _whole_checked.get(optimizer) == size:
        return
    rule = next(r for c, r in _WHOLE_TENSOR_OPTIMIZERS.items() if isinstance(optimizer, c))
    stepped = {id(p): p for g in groups for p in g["params"]}
    states = {id(s): s for s in (t.state_ref() for t in list(_tracked.values())) if s is not None}
    for state in states.values():
        handle = getattr(state, "handle", None)
        if handle is None:
            continue
        for group in handle.groups:
            sharded = not group.aliases_shard and getattr(state, "world_size", 1) > 1
            for p, fqn, shape in zip(group.orig_params, group.flat_param._fqns, group.flat_param._shapes):
                if p is None or stepped.get(id(p)) is not p:
                    continue
                now = tuple(stepped[id(p)].shape)
                if not (sharded or (rule.needs_shape and now != tuple(shape))):
                    continue
                name = ".".join(part for part in (state.fqn, fqn) if part)
                kind = "a slice" if sharded else f"a flat view (shape {now}, not {tuple(shape)})"
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step(): it steps {name!r}, of which fully_shard gives each rank "
                    f"{kind}; {type(optimizer).__name__} {rule.why}, so its step would differ from one process's, "
                    f"silently. {rule.remedy} Nothing was stepped.")
    _whole_checked[optimizer] = size


# id(replaced DTensor parameter) -> (weak reference to it, its name); checked by every optimizer step from the
# first replacement on (an optimizer's check is cached until its groups change size)
_replaced: Dict[int, Tuple["weakref.ReferenceType[Any]", str]] = {}
_replaced_hook: List[Any] = []
_checked: "weakref.WeakKeyDictionary[Optimizer, Tuple[int, int]]" = weakref.WeakKeyDictionary()


def watch_replaced(param: Any, name: str) -> None:
    """``param`` (a tensor-parallel parameter fully_shard replaced, named ``name``) must not be
    stepped by an optimizer: its step raises (see the module docstring)."""
    key = id(param)

    def forget(_: Any) -> None:
        _replaced.pop(key, None)

    _replaced[key] = (weakref.ref(param, forget), name)
    _checked.clear()
    if not _replaced_hook:
        _replaced_hook.append(register_optimizer_step_pre_hook(_refuse_replaced))


def _refuse_replaced(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    groups = optimizer.param_groups
    size = (len(groups), sum(len(g["params"]) for g in groups))
    if _checked.get(optimizer) == size:
        return
    for group in groups:
        for p in group["params"]:
            entry = _replaced.get(id(p))
            if entry is not None and entry[0]() is p:
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step(): it holds the tensor-parallel parameter {entry[1]!r} that "
                    "fully_shard replaced by a plain parameter (this rank's slice of its local piece); the step would "
                    "update a tensor nothing reads. Build the optimizer after fully_shard, as with FSDP2: "
                    "torch.optim.AdamW(model.parameters(), ...). Nothing was stepped.")
    _checked[optimizer] = size


_MAX_STEPS_AGREED = 255  # d * d summed over ranks stays exact in int32 up to 33,000 ranks
STEP_AGREEMENT_INTS = 2  # what StepCounter.take() adds to a used-flags all-reduce: d and d * d


class OptimizerSteps:
    """The steps of the optimizers that hold one of ``params``, as a monotonic ``epoch`` (a
    handle's kept unsharded buffers are gathered again after one). An optimizer counts if one
    of its parameter groups holds one of ``params``; which optimizers do is worked out again
    when an optimizer's groups change size or a new watch is made.

    Example::

        steps = OptimizerSteps(model.parameters())
        optim.step()
        assert steps.epoch == 1
    """

    every_step: bool = True  # False: :meth:`stepped` is only needed at the first step after a change

    def __init__(self, params: Iterable[Any]) -> None:
        self.param_ids: Set[int] = {id(p) for p in params}
        self.epoch: int = 0  # steps counted so far
        _use_hooks(self)
        _step_watches.add(self)
        _watches_made[0] += 1

    def holds(self, optimizer: Optimizer) -> bool:
        """Whether one of ``optimizer``'s parameter groups holds one of our parameters."""
        return any(id(p) in self.param_ids for g in optimizer.param_groups for p in g["params"])

    def stepped(self, optimizer: Optimizer) -> None:
        """Called once per counted step of ``optimizer`` (after ``epoch`` was bumped); only at
        the first step after a change of its groups or of the watches if not ``every_step``."""


class StepCounter(OptimizerSteps):
    """The optimizer steps taken on one module's parameters, agreed across ranks once per synced
    backward ([Note: Step agreement]). ``dp_world_size``: the ranks averaging their gradients;
    ``ignored``: parameters its API was told to leave alone (see [Note: Gradients no
    data-parallel API averages])."""

    def __init__(self, params: Iterable[Any], dp_world_size: int = 1, ignored: Iterable[Any] = ()) -> None:
        self.pending: int = 0  # steps since the last take(); counted as they happen, so an
        # optimizer freed at different times on different ranks changes nothing
        self.dp_world_size = dp_world_size
        self.ignored_ids: Set[int] = {id(p) for p in ignored}
        super().__init__(params)

    def stepped(self, optimizer: Optimizer) -> None:
        self.pending += 1

    def take(self) -> List[int]:
        """``[d, d * d]`` for the used-parameter all-reduce: ``d`` steps since the last call."""
        d = min(self.pending, _MAX_STEPS_AGREED)
        self.pending = 0
        return [d, d * d]

    @staticmethod
    def disagreement(mine: Sequence[int], summed: Sequence[int], num_ranks: int, api: str, consequence: str) -> Optional[str]:
        """The error message if the ranks' ``d`` (``mine`` from :meth:`take`, ``summed`` over
        ``num_ranks`` ranks) differ, else ``None``. ``consequence``: what a skipped step did."""
        total, squares = summed
        if num_ranks * squares == total * total:
            return None
        return (f"{api}: the optimizer(s) holding this model's parameters stepped {mine[0]} time(s) on this rank "
                f"between the two synchronized backwards before this one, but {total / num_ranks:g} times on average "
                f"over the "
                f"{num_ranks} ranks. {consequence} Every rank must call optimizer.step() together; a step guarded "
                "by a per-rank condition (`if torch.isfinite(loss):` on this rank's loss) must agree on the "
                "condition first (all_reduce it).")


class StepVerdict:
    """The step part of one end-of-backward agreement, on its way to the host: read at the next
    agreement of the same groups (or before a state dict is taken), never in the step that
    issued it ([Note: Step agreement] in ``_runtime/watch.py``, [Note: No host reads in a step]
    in ``_base/host_mirror.py``)."""

    def __init__(self, mirror: HostMirror, steps: Sequence[int], num_ranks: int, api: str, consequence: str) -> None:
        self._mirror, self._steps, self._num_ranks = mirror, list(steps), num_ranks
        self._api, self._consequence = api, consequence

    def settle(self) -> None:
        """Let go of the agreement's tensor once its values are in (CPU; see :meth:`HostMirror.settle`)."""
        self._mirror.settle()

    def disagreement(self) -> Optional[str]:
        """The error message if the ranks took different numbers of optimizer steps in the window
        this agreement covered, else ``None``."""
        return StepCounter.disagreement(self._steps, self._mirror.values(), self._num_ranks, self._api,
                                         self._consequence)


def raise_on_model_change(states: Iterable[_Owner]) -> None:
    """Raise ``RuntimeError`` naming the first recorded structure change among ``states``."""
    for s in states:
        if s.model_change is not None:
            raise RuntimeError(
                f"{s.describe()}: {s.model_change.message(s.fqn)}. A handle owns the parameters that were "
                "registered when fully_shard ran, so this change would be silently left out of training. Make such changes "
                "before fully_shard (build the model, then shard it), or rebuild and reshard the model."
            )

