"""Optimizers that need whole matrices, for models whose parameters ``fully_shard`` split.

:class:`Muon` takes the same hyper-parameters, defaults and state layout as ``torch.optim.Muon``
(torch 2.13), but its parameters may be the 1-D slices that ``fully_shard`` leaves on each rank:
it keeps the momentum of this rank's elements only and brings each matrix's update together
only for the moment it is orthogonalized.

[Note: Muon on flat shards]  Per step, for each flat group (one per handle and ``(dtype,
requires_grad)``) that holds a Muon matrix with a gradient, with ``N`` = the group's padded
numel and ``W`` = its shard group's size:

1. momentum, elementwise on this rank's elements (``state[p]["momentum_buffer"]`` is shaped
   like ``p``, this rank's slice: at most ``ceil(N/W)`` elements per group, as AdamW's moments);
2. the update of this rank's elements is written, in bfloat16, into a zeroed buffer of the
   rank's chunk (``ceil(N/W)`` elements; other parameters of the group stay zero) and
   all-gathered, as a forward gathers the group's parameters, into ``N`` bfloat16 elements;
3. each rank orthogonalizes the matrices assigned to it (:func:`assign_matrices`: Newton-Schulz
   work, ``rows * cols * min(rows, cols)``, balanced across the ranks of the shard group, the
   same on every rank), writes them back into the gathered buffer and zeroes the rest of it;
4. one reduce-scatter (sum) of that buffer gives each rank its chunk of every orthogonalized
   matrix: exact, since every other rank contributed zeros for it;
5. weight decay and the update, elementwise on this rank's elements.

bfloat16 loses nothing: torch's Muon converts the update to bfloat16 before its first
Newton-Schulz operation and returns a bfloat16 result, so casting the slices before the
all-gather rounds each element exactly as torch rounds it, and a sum with zeros is exact. Per
group and step that is one all-gather of ``2 * ceil(N/W)`` bytes per rank and one reduce-scatter
of ``2 * N`` bytes per rank (what ``record_collectives`` counts), nothing else; a shard group
of one rank (``NO_SHARD``, one process, the replicas of ``HYBRID_SHARD`` among themselves:
their gradients are already equal) and full parameters (``replicate``, unmanaged modules)
communicate nothing. Peak memory beyond a plain step: ``2 * (N + ceil(N/W))`` bytes of one group
at a time, plus the owned matrices' Newton-Schulz temporaries.

Building the optimizer, ``add_param_group`` and a step after re-sharding are collective over
the model's ranks (the one process group of its ``fully_shard``/``replicate`` states, as a load
uses; none for a plain model): every check that can refuse (FQNs, original shapes,
hyper-parameters, torch's own) runs before one 48-byte exchange in which the ranks agree on the
outcome and on the plan (each param group's settings, each matrix's FQN, shape and group: what
the owners and the step's collectives follow from). A refusal on one rank raises on every rank,
naming it, and adds nothing; different plans raise on every rank ([Note: Agreed refusals] in
``_setup/data_parallel.py``), naming the first param group setting or matrix (FQN, shape, param
group) that differs, what each rank holds there and the ranks that differ: on that error path
only, the ranks gather their layouts once more to say so.

Compared with gathering each matrix to its owner and scattering the result back: that moves
about ``2N/W`` bytes per rank per group instead of about ``4N(W-1)/W`` (half as many at W = 2,
fewer still beyond) and buffers only the owned matrices, but needs an all-to-all with uneven
splits (or ``W`` point-to-point pairs), which ``_runtime/collectives.py`` does not have; the scheme
above uses the two collectives every step already runs (with gloo's point-to-point path and
the instrumentation), and costs what one bf16 forward all-gather and one gradient reduction of
the group cost. TODO(#37): an all-to-all gather-to-owner path for large W.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ._runtime import collectives as _collectives
from ._setup.data_parallel import agreed
from ._state.load_transaction import model_group
from ._runtime.shard_math import param_offsets
from ._state.model_state_dict import Managed, managed_params
from ._base.torch_compat import unwrap_compiled

__all__ = ["Muon", "assign_matrices", "orthogonalize"]

# torch.optim.Muon's defaults (torch 2.13), the published quintic Newton-Schulz coefficients.
DEFAULT_NS_COEFFICIENTS: Tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
DEFAULT_EPS = 1e-7
DEFAULT_NS_STEPS = 5
_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
# gloo pairs point-to-point messages by tag: the optimizer's exchanges get a tag of their own,
# outside the handles' (a handle's index + 1), so they never pair with a forward's or backward's
# collective (a step skipped on one rank then times out instead of mixing buffers). Within a step
# every rank issues them in the same (plan) order.
_MATCH = 1 << 23

def orthogonalize(matrix: torch.Tensor, ns_coefficients: Sequence[float], ns_steps: int, eps: float) -> torch.Tensor:
    """The approximate orthogonal factor of 2-D ``matrix`` by ``ns_steps`` quintic
    Newton-Schulz iterations in bfloat16, as ``torch.optim.Muon`` computes it (bfloat16 result).

    The matrix is scaled to Frobenius norm 1 (norm clamped at ``eps``), worked on with its
    short side first, and each iteration maps ``X`` to ``a X + (b G + c G G) X`` with ``G =
    X X^T``. The same fused operations as torch's, in the same order, so that a matrix gives
    the same bits here as there (the parity tests compare with ``torch.optim.Muon`` itself)."""
    a, b, c = (float(v) for v in ns_coefficients)
    tall = matrix.shape[0] > matrix.shape[1]
    x = matrix.to(torch.bfloat16, copy=True)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: Optional[str], shape: Sequence[int]) -> float:
    """The learning rate of an orthogonalized update of a ``rows x cols`` matrix:
    ``lr * sqrt(max(1, rows / cols))`` (``"original"``, the default) or ``lr * 0.2 *
    sqrt(max(rows, cols))`` (``"match_rms_adamw"``: updates of AdamW's RMS)."""
    rows, cols = int(shape[0]), int(shape[1])
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1.0, rows / cols))


def assign_matrices(shapes: Sequence[Sequence[int]], world_size: int, loads: Optional[List[int]] = None) -> List[int]:
    """The rank that orthogonalizes each matrix: largest Newton-Schulz cost first (``rows *
    cols * min(rows, cols)``, ties by position), each to the least loaded rank (ties: the
    lowest). ``loads`` (per rank, updated in place) carries the work of earlier groups over.
    Deterministic: every rank computes the same assignment from the shapes alone."""
    loads = [0] * world_size if loads is None else loads
    costs = [int(s[0]) * int(s[1]) * min(int(s[0]), int(s[1])) for s in shapes]
    owners = [0] * len(shapes)
    for index in sorted(range(len(shapes)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += costs[index]
    return owners


@dataclass(frozen=True)
class _Matrix:
    """One Muon parameter: where its elements live on this rank."""

    param: nn.Parameter  # what the user passed: a 1-D slice view (sharded) or the parameter itself
    fqn: str
    shape: torch.Size  # the original 2-D shape
    local_shape: torch.Size  # ``param``'s shape when planned (a change means the model was re-sharded)
    flat_start: int = 0  # sharded: first element in the group's unsharded flat
    shard_start: int = 0  # sharded: first element of this rank's part inside its chunk
    owner: int = 0  # sharded: the shard-group rank that orthogonalizes it


@dataclass
class _ShardedGroup:
    """A flat group holding Muon matrices, with its shard group of more than one rank."""

    where: Managed  # any member's location: the owning state (process group, ranks) and the flat group
    matrices: List[_Matrix]

    @property
    def chunk_numel(self) -> int:
        return int(self.where.group.flat_param.numel())


@dataclass
class _Plan:
    """What a step does: sharded groups in model order, then whole matrices."""

    sharded: List[_ShardedGroup]
    whole: List[_Matrix]  # one rank holds all of it (a shard group of one rank, replicate, unmanaged)

    @property
    def matrices(self) -> List[_Matrix]:
        """Every matrix in plan order: the sharded groups', then the whole ones."""
        return [m for g in self.sharded for m in g.matrices] + self.whole

    def is_current(self) -> bool:
        """False if some parameter changed shape since planning (``fully_shard`` applied after
        the optimizer was built)."""
        return all(m.param.shape == m.local_shape for m in self.matrices)


class Muon(torch.optim.Optimizer):
    """``torch.optim.Muon`` for a model whose 2-D parameters ``fully_shard`` may have split across
    ranks (see [Note: Muon on flat shards]): momentum for this rank's elements only, each matrix
    orthogonalized whole on one rank of its shard group, the numbers of torch's Muon on the full
    matrices. Works as well for ``replicate``'d and plain modules (no communication in the step).
    Build it on every rank of the model: construction is collective (the ranks agree on the plan,
    or all raise).

    Example::

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        matrices = [n for n, p in model.layers.named_parameters(prefix="layers") if n.endswith("proj.weight")]
        muon = composable_shard.optim.Muon(model, matrices, lr=0.02)
        adamw = torch.optim.AdamW([p for n, p in model.named_parameters() if n not in matrices], lr=3e-4)
        loss_fn(model(inputs), targets).backward()
        muon.step()
        adamw.step()

    Args:
        model: the model the parameters belong to (sharded any way, or not).
        params: its parameters (as ``model.parameters()`` shows them, sharded or not) or their
            FQNs, or param groups (dicts with ``"params"``) of either; each must be 2-D in its
            original shape.
        lr: learning rate.
        weight_decay: decoupled weight decay (``p *= 1 - lr * weight_decay``).
        momentum: momentum factor.
        nesterov: Nesterov momentum.
        ns_coefficients: the quintic Newton-Schulz coefficients ``(a, b, c)``.
        eps: the lowest norm a matrix is divided by before the iterations.
        ns_steps: Newton-Schulz iterations (fewer than 100).
        adjust_lr_fn: ``None``/``"original"`` or ``"match_rms_adamw"`` (see :func:`adjusted_lr`).
    """

    def __init__(self, model: nn.Module, params: Iterable[Any], lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: Tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS, eps: float = DEFAULT_EPS,
                 ns_steps: int = DEFAULT_NS_STEPS, adjust_lr_fn: Optional[str] = None) -> None:
        if not isinstance(model, nn.Module):  # raised alone: without a model there are no ranks to agree with
            raise TypeError(f"Muon: model must be the nn.Module the parameters belong to, got {type(model).__name__}")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        self._model: nn.Module = unwrap_compiled(model)  # names as users and checkpoints know them
        self._constructed: bool = False  # True once torch's constructor added the initial groups
        # agreed now (collective), not in the first step; made again if the model is re-sharded
        self._plan: _Plan = self._agreed(f"Muon({type(self._model).__name__})", "Muon", "muon::init",
                                         lambda: self._construct(params, defaults))
        self._constructed = True

    def _construct(self, params: Iterable[Any], defaults: Dict[str, Any]) -> _Plan:
        """Every check of ``__init__`` and torch's constructor (no collective); the plan."""
        _check_settings(defaults, "Muon")
        if isinstance(params, (torch.Tensor, str)):
            raise TypeError("Muon: params must be an iterable of parameters, FQNs or param groups, "
                            f"got a single {type(params).__name__}")
        super().__init__(params, defaults)
        return _make_plan(self._model, self._params())

    def _agreed(self, api: str, applied: str, tag: str, prepare: Callable[[], _Plan]) -> _Plan:
        """``prepare()`` (every check that can refuse, no collective), then one agreement over the
        model's ranks (see [Note: Agreed refusals] in ``_setup/data_parallel.py``): a refusal on any rank
        raises on every rank, naming it, and so do plans or hyper-parameters that differ (the
        step's collectives would pair other matrices): every rank then raises naming the first
        setting or matrix that differs and the ranks that hold another (:func:`_plans_differ`).
        A plain model has no ranks to agree with."""
        collective, group = model_group(self._model)
        planned: List[_Plan] = []  # this rank's plan, once prepare() returned

        def prepare_here() -> _Plan:
            planned.append(prepare())
            return planned[-1]

        def layout(plan: _Plan) -> List[List[Any]]:
            return _layout(plan, self.param_groups, list(self.defaults))

        try:
            return agreed(api, [group] if collective else None, prepare_here, layout, applied=applied,
                          what=_PLANS_DIFFER, tag=tag, digest_first=True)
        except RuntimeError as e:
            # Every rank of the group raises this one when no rank refused and the layouts differ
            # (a refusal raises naming the refusing rank instead), so all of them gather here.
            if not planned or not str(e).startswith(f"{api}: {_PLANS_DIFFER}"):
                raise
            raise RuntimeError(_plans_differ(api, applied, layout(planned[0]), group, tag)) from None

    def _params(self) -> List[nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]

    # ------------------------------------------------------------------ param groups
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """torch's ``add_param_group``, with parameters given as parameters of the model or FQNs,
        each checked to be 2-D in its original shape before anything changes. Collective once the
        optimizer is built (the ranks agree on the new plan, or all raise and none adds the group):
        call it on every rank."""
        if not self._constructed:  # torch's constructor adding the first groups: inside __init__'s agreement
            self._add_group(param_group)
            return
        count, plan = len(self.param_groups), self._plan
        try:
            self._plan = self._agreed("Muon.add_param_group", "add_param_group", "muon::add_param_group",
                                      lambda: self._add_group(param_group))
        except Exception:
            del self.param_groups[count:]  # refused on some rank: added on none
            self._plan = plan
            raise

    def _add_group(self, param_group: Dict[str, Any]) -> _Plan:
        """Check ``param_group``, add it (torch's own checks refuse before adding) and plan: no collective."""
        if not isinstance(param_group, dict):
            raise TypeError(f"Muon: a param group must be a dict, got {type(param_group).__name__}")
        group = dict(param_group)
        raw = group.get("params")
        raw_list = [raw] if isinstance(raw, (torch.Tensor, str)) else list(raw or [])
        group["params"] = self._resolve(raw_list)
        _check_settings({**self.defaults, **group}, "Muon: param group")
        super().add_param_group(group)
        return _make_plan(self._model, self._params())

    def _resolve(self, raw: List[Any]) -> List[nn.Parameter]:
        """The model's parameters for ``raw`` (parameters or FQNs), each checked to be a 2-D matrix
        in its original shape; raises naming the first that is not."""
        by_name = dict(self._model.named_parameters(remove_duplicate=False))
        names = {id(p): n for n, p in self._model.named_parameters()}
        shapes = {id(where.group.orig_params[where.param_index]): where.shape for where in _managed(self._model).values()}
        resolved: List[nn.Parameter] = []
        for item in raw:
            if isinstance(item, str):
                if item not in by_name:
                    raise ValueError(f"Muon: {type(self._model).__name__} has no parameter {item!r}; pass names from "
                                     "model.named_parameters().")
                item = by_name[item]
            if not isinstance(item, torch.Tensor) or id(item) not in names:
                shape = tuple(item.shape) if isinstance(item, torch.Tensor) else type(item).__name__
                raise ValueError(f"Muon: a parameter ({shape}) is not a parameter of {type(self._model).__name__}; "
                                 "pass the model the parameters belong to.")
            shape = shapes.get(id(item), item.shape)
            if len(shape) != 2:
                raise ValueError(f"Muon: parameter {names[id(item)]!r} has shape {tuple(shape)}; Muon orthogonalizes "
                                 "2-D matrices only. Optimize it with another optimizer (AdamW, as torch's Muon "
                                 "advises for biases, norms and embeddings).")
            resolved.append(item)  # type: ignore[arg-type]  # a registered parameter (checked above)
        return resolved

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Any = None) -> Optional[float]:  # type: ignore[override]  # torch's overloads
        """One Muon step on every parameter with a gradient (see [Note: Muon on flat shards]).
        Collective over each shard group that holds a matrix: every rank steps together."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = self._current_plan()
        _check_grads(plan)
        settings = {id(p): group for group in self.param_groups for p in group["params"]}
        for sharded in plan.sharded:
            self._step_sharded(sharded, settings)
        for matrix in plan.whole:
            if matrix.param.grad is not None:
                self._step_whole(matrix, settings[id(matrix.param)])
        return loss

    def _current_plan(self) -> _Plan:
        if not self._plan.is_current():  # re-sharded since: every rank re-plans here, in its step
            self._plan = self._agreed("Muon.step", "the step", "muon::replan",
                                      lambda: _make_plan(self._model, self._params()))
        return self._plan

    def _step_whole(self, matrix: _Matrix, settings: Dict[str, Any]) -> None:
        """A matrix this rank holds whole: torch's Muon step on it, no communication."""
        update = self._momentum_update(matrix, settings)
        ortho = orthogonalize(update.reshape(matrix.shape), settings["ns_coefficients"], settings["ns_steps"],
                              settings["eps"])
        _apply_update(matrix, ortho.reshape(matrix.param.shape), settings)

    def _step_sharded(self, sharded: _ShardedGroup, settings: Dict[int, Dict[str, Any]]) -> None:
        """Steps 1-5 of [Note: Muon on flat shards] for one flat group."""
        matrices = [m for m in sharded.matrices if m.param.grad is not None]  # the same on every rank
        if not matrices:
            return
        state, handle = sharded.where.state, sharded.where.state.handle
        device = handle.compute_device if handle is not None else matrices[0].param.device
        chunk = torch.zeros(sharded.chunk_numel, dtype=torch.bfloat16, device=device)
        for m in matrices:
            update = self._momentum_update(m, settings[id(m.param)])
            chunk[m.shard_start:m.shard_start + update.numel()].copy_(update.reshape(-1))
        gathered = torch.empty(sharded.chunk_numel * state.world_size, dtype=torch.bfloat16, device=device)
        tag = f"muon:{handle.fqn if handle is not None else ''}"
        _collectives.all_gather_into(gathered, chunk, state.process_group, tag=tag, match=_MATCH).wait()
        _orthogonalize_owned(gathered, matrices, state.rank, settings)
        _collectives.reduce_scatter_into(chunk, gathered, state.process_group, tag=tag, match=_MATCH).wait()
        del gathered
        for m in matrices:
            numel = m.param.numel()
            piece = chunk[m.shard_start:m.shard_start + numel].to(m.param.device)
            _apply_update(m, piece.view(m.param.shape), settings[id(m.param)])

    def _momentum_update(self, matrix: _Matrix, settings: Dict[str, Any]) -> torch.Tensor:
        """Update the momentum of this rank's elements of ``matrix``; return the update to
        orthogonalize (its Nesterov form if asked), shaped like the parameter."""
        p = matrix.param
        grad = p.grad
        if grad is None:
            raise AssertionError(f"[rank {_rank()}] Muon: {matrix.fqn!r} has no gradient")
        state = self.state[p]
        buffer = state.get("momentum_buffer")
        if buffer is None:
            buffer = torch.zeros_like(grad, memory_format=torch.preserve_format)
            state["momentum_buffer"] = buffer
        momentum = float(settings["momentum"])
        buffer.lerp_(grad, 1 - momentum)
        return grad.lerp(buffer, momentum) if settings["nesterov"] else buffer


def _check_grads(plan: _Plan) -> None:
    """Before anything changes: every gradient is shaped like its parameter (this rank's slice)."""
    for m in plan.matrices:
        grad = m.param.grad
        if grad is not None and grad.shape != m.param.shape:
            raise RuntimeError(f"Muon.step: the gradient of {m.fqn!r} has shape {tuple(grad.shape)}, the parameter "
                               f"{tuple(m.param.shape)}: it is this rank's unsynced gradient "
                               "(set_requires_gradient_sync(False)). Run the last backward of the accumulation with "
                               "gradient sync on before step().")


def _orthogonalize_owned(gathered: torch.Tensor, matrices: List[_Matrix], rank: int,
                         settings: Dict[int, Dict[str, Any]]) -> None:
    """Replace each matrix this rank owns by its orthogonalized form, in ``gathered``, and zero
    every other element (other ranks' matrices, other parameters, padding)."""
    owned = sorted((m for m in matrices if m.owner == rank), key=lambda m: m.flat_start)
    end = 0
    for m in owned:
        gathered[end:m.flat_start].zero_()
        numel = m.shape.numel()
        piece = gathered[m.flat_start:m.flat_start + numel]
        s = settings[id(m.param)]
        piece.copy_(orthogonalize(piece.view(m.shape), s["ns_coefficients"], s["ns_steps"], s["eps"]).reshape(-1))
        end = m.flat_start + numel
    gathered[end:].zero_()


def _apply_update(matrix: _Matrix, ortho: torch.Tensor, settings: Dict[str, Any]) -> None:
    """Decoupled weight decay, then the orthogonalized update at the shape-adjusted rate."""
    lr = float(settings["lr"])
    p = matrix.param
    p.mul_(1 - lr * float(settings["weight_decay"]))
    p.add_(ortho, alpha=-adjusted_lr(lr, settings["adjust_lr_fn"], matrix.shape))


def _check_settings(settings: Dict[str, Any], where: str) -> None:
    """ValueError/TypeError naming the first hyper-parameter torch's Muon would refuse (and the
    Newton-Schulz ones, which torch checks only at the first step)."""
    lr = settings["lr"]
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"{where}: a tensor lr must have one element, got shape {tuple(lr.shape)}")
    for name in ("lr", "momentum", "weight_decay"):
        if not float(settings[name]) >= 0.0:
            raise ValueError(f"{where}: {name} must be >= 0, got {settings[name]!r}")
    if settings["adjust_lr_fn"] not in _ADJUST_LR_FNS:
        raise ValueError(f"{where}: adjust_lr_fn must be one of {list(_ADJUST_LR_FNS)}, got {settings['adjust_lr_fn']!r}")
    steps = settings["ns_steps"]
    if not isinstance(steps, int) or isinstance(steps, bool) or not 0 <= steps < 100:
        raise ValueError(f"{where}: ns_steps must be an int in [0, 100), got {steps!r}")
    coefficients = settings["ns_coefficients"]
    if not isinstance(coefficients, (tuple, list)) or len(coefficients) != 3:
        raise ValueError(f"{where}: ns_coefficients must be three floats (a, b, c), got {coefficients!r}")


def _managed(model: nn.Module) -> Dict[str, Managed]:
    """Every sharded parameter of ``model`` by FQN (first registration of tied ones)."""
    found: Dict[str, Managed] = {}
    seen = set()
    for path, module in model.named_modules():
        for name, where in managed_params(module).items():
            key = (id(where.group), where.param_index)
            if key not in seen:
                seen.add(key)
                found[f"{path}.{name}" if path else name] = where
    return found


def _make_plan(model: nn.Module, params: List[nn.Parameter]) -> _Plan:
    """Group the Muon parameters by flat group (model order) and assign owners; local (the ranks
    agree on :func:`_layout` of it in :meth:`Muon._agreed`)."""
    wanted = {id(p) for p in params}
    names = {id(p): n for n, p in model.named_parameters()}
    sharded: Dict[int, _ShardedGroup] = {}
    whole_ids = set(wanted)
    loads: Dict[int, List[int]] = {}
    whole: List[_Matrix] = []
    for fqn, where in _managed(model).items():
        p = where.group.orig_params[where.param_index]
        if id(p) not in wanted:
            continue
        whole_ids.discard(id(p))
        if where.state.world_size == 1:
            whole.append(_Matrix(p, fqn, where.shape, p.shape))
            continue
        entry = sharded.get(id(where.group))
        if entry is None:
            entry = sharded[id(where.group)] = _ShardedGroup(where, [])
        offset = param_offsets(where.group.flat_param._numels)[where.param_index]
        s = where.group.flat_param._shard_slices[where.param_index]
        entry.matrices.append(_Matrix(p, fqn, where.shape, p.shape, offset, s.shard_start))
    for g in sharded.values():
        owners = assign_matrices([m.shape for m in g.matrices], g.where.state.world_size,
                                 loads.setdefault(g.where.state.world_size, [0] * g.where.state.world_size))
        g.matrices = [_Matrix(m.param, m.fqn, m.shape, m.local_shape, m.flat_start, m.shard_start, owner)
                      for m, owner in zip(g.matrices, owners)]
    for p in params:
        if id(p) in whole_ids:
            whole.append(_Matrix(p, names.get(id(p), "?"), p.shape, p.shape))
    return _Plan(list(sharded.values()), whole)


_PLANS_DIFFER = "ranks would step other matrices or hyper-parameters"


def _layout(plan: _Plan, param_groups: List[Dict[str, Any]], settings: List[str]) -> List[List[Any]]:
    """What every rank of the model must hold the same, one entry each (plain data, for a
    digest and for :func:`_plans_differ`): the number of param groups, each group's
    ``settings``, then each matrix of the plan (FQN, shape, param group) in plan order. The
    owners follow from it (:func:`assign_matrices`), and so do the step's collectives."""
    group_of = {id(p): i for i, g in enumerate(param_groups) for p in g["params"]}
    return [["groups", len(param_groups)]] + \
        [["setting", i, k, _plain(g[k])] for i, g in enumerate(param_groups) for k in settings] + \
        [["matrix", m.fqn if m.fqn != "?" else None, list(m.shape), group_of[id(m.param)]] for m in plan.matrices]


def _plans_differ(api: str, applied: str, mine: List[List[Any]], group: Optional[dist.ProcessGroup],
                  tag: str) -> str:
    """The message every rank of ``group`` raises when their layouts (:func:`_layout`) differ:
    the first entry that differs, what each rank holds there and the ranks that differ from the
    group's first rank. Collective (one gather of the layouts): call it on every rank of
    ``group``, as the failed agreement is raised on every rank."""
    everyone = _collectives.all_gather_json(mine, group, tag=f"{tag}::difference")
    ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(len(everyone))]

    def entry(layout: List[Any], k: int) -> Any:
        return layout[k] if k < len(layout) else None

    k = next((k for k in range(max(len(layout) for layout in everyone))
              if any(entry(layout, k) != entry(everyone[0], k) for layout in everyone)), None)
    if k is None:  # the digests differed but the layouts do not: nothing to name (not expected)
        return f"{api}: {_PLANS_DIFFER}, which would hang or mix up data; none applied {applied}."
    holders: Dict[str, List[int]] = {}
    for rank, layout in zip(ranks, everyone):
        holders.setdefault(_describe_entry(layout, k), []).append(rank)
    differing = [rank for rank, layout in zip(ranks, everyone) if entry(layout, k) != entry(everyone[0], k)]
    subject = {"groups": "the number of param groups", "setting": "a param group setting",
               "matrix": "the matrices"}[next(e for e in (entry(layout, k) for layout in everyone) if e is not None)[0]]
    held = "; ".join(f"{what} on {_ranks_phrase(rs)}" for what, rs in holders.items())
    verb = "differs" if len(differing) == 1 else "differ"
    return (f"{api}: {_PLANS_DIFFER}, which would hang or mix up data; none applied {applied}. The first "
            f"difference is in {subject}: {held} ({_ranks_phrase(differing)} {verb} from rank {ranks[0]}). Give Muon "
            "the same parameters, in the same param groups with the same settings, on every rank.")


def _describe_entry(layout: List[Any], k: int) -> str:
    """Entry ``k`` of a :func:`_layout` (JSON-decoded: tuples are lists) as text; a matrix by
    its FQN, or by its place in the plan if it has none."""
    if k >= len(layout):
        return "nothing"
    kind, *value = layout[k]
    if kind == "groups":
        return f"{value[0]} param group{'s' if value[0] != 1 else ''}"
    if kind == "setting":
        return f"param group {value[0]}'s {value[1]}={value[2]}"
    fqn, shape, group_index = value
    index = k - sum(1 for e in layout if e[0] != "matrix")
    what = repr(fqn) if fqn is not None else f"matrix {index} of the plan"
    return f"{what} {tuple(shape)} in param group {group_index}"


def _ranks_phrase(ranks: List[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _plain(value: Any) -> str:
    """A setting as text (a tensor lr by its value)."""
    return repr(value.item() if isinstance(value, torch.Tensor) else value)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
