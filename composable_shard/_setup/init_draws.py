"""The random numbers ``fully_shard``'s own initialization draws, given back when the model is
initialized again after ``to_empty``.

[Note: Initial weights and the global RNG]
  Two flows build a model on the meta device, and a ``fully_shard`` call cannot tell which one
  it is in, because they differ only in what the user does afterwards:
    FSDP1's   ``fully_shard`` materializes the meta tensors and runs ``reset_parameters()`` of
              each module that has meta tensors of its own, at the call ([Note: Meta
              materialization] in ``fully_shard_init.py``). The model is ready; the draws advance
              the global RNG as building the model off meta would have, so the data drawn next
              is the unsharded script's.
    FSDP2's   ``fully_shard``, then ``model.to_empty(device=...)`` and the model's own init
              (torchtitan's ``init_weights``). An unsharded model built the same way draws its
              weights in that init, from the RNG as it was before ``fully_shard``.
  So the call initializes as FSDP1 does and records the generators' states before and after
  its draws (the CPU generator and the compute device's). Consecutive calls extend one record
  when each starts where the previous one ended. ``to_empty`` on a fully sharded module whose
  tree holds every module those draws initialized puts the generators back to the state before
  the first of them if they still hold the state after the last one (nothing else drew since):
  the model's own init then draws exactly the numbers the unsharded flow draws, and the next
  draw after it is the unsharded flow's too. The cost is the first initialization, made for
  nothing on this flow (calls whose model has meta tensors with no ``reset_parameters()`` skip
  it: they defer, and draw nothing). When something else drew in between, the states cannot be
  given back without changing that other draw: ``to_empty`` warns, naming the modules, and the
  init after it draws from where the RNG is.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.nn as nn

__all__ = ["drawing", "give_back_draws"]

_States = Tuple[Tuple[str, torch.Tensor], ...]  # (generator, its state) per generator the init may draw from


def _states(device: torch.device) -> _States:
    """The CPU generator's state and, for an accelerator, ``device``'s generator's."""
    out: List[Tuple[str, torch.Tensor]] = [("cpu", torch.random.get_rng_state())]
    if device.type == "cuda" and torch.cuda.is_initialized():
        out.append((str(device), torch.cuda.get_rng_state(device)))
    return tuple(out)


def _same(a: _States, b: _States) -> bool:
    return len(a) == len(b) and all(n == m and torch.equal(s, t) for (n, s), (m, t) in zip(a, b))


def _restore(states: _States) -> None:
    for name, state in states:
        if name == "cpu":
            torch.random.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, torch.device(name))


@dataclass
class _Draws:
    """Consecutive initializations at ``fully_shard`` calls that drew random numbers."""

    before: _States  # the generators before the first of them
    after: _States  # the generators after the last of them
    modules: "weakref.WeakSet[nn.Module]" = field(default_factory=weakref.WeakSet)  # whose reset_parameters ran
    names: List[str] = field(default_factory=list)  # for the warning


_record: Optional[_Draws] = None


class drawing:
    """Context of one call's ``reset_parameters()`` calls on ``device``; :meth:`ran` tells it
    which module each call initialized. Records the draws (see [Note: Initial weights and the
    global RNG])."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.modules: List[Tuple[str, nn.Module]] = []
        self.before: _States = ()

    def ran(self, name: str, module: nn.Module) -> None:
        self.modules.append((name, module))

    def __enter__(self) -> "drawing":
        self.before = _states(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        global _record
        after = _states(self.device)
        if exc[0] is not None or not self.modules or _same(self.before, after):
            return
        if _record is None or not _same(_record.after, self.before):
            _record = _Draws(self.before, after)
        _record.after = after
        for name, module in self.modules:
            _record.modules.add(module)
            _record.names.append(f"{name or '<root>'} ({type(module).__name__})")


def give_back_draws(root: nn.Module) -> None:
    """Before ``root.to_empty(...)`` (a fully sharded module): give back the draws of
    ``fully_shard``'s initializations of modules in ``root``'s tree if nothing drew since, else
    warn (see [Note: Initial weights and the global RNG])."""
    global _record
    record = _record
    if record is None:
        return
    inside = {id(m) for m in root.modules()}
    mine = [m for m in record.modules if id(m) in inside]
    if not mine:
        return
    _record = None
    if len(mine) == len(record.modules) and _same(record.after, _states(_device(record))):
        _restore(record.before)
        return
    warnings.warn(
        f"{type(root).__name__}.to_empty(): fully_shard initialized {record.names[:3]}"
        f"{' and others' if len(record.names) > 3 else ''} with reset_parameters() when it was called, drawing from "
        "the global random number generator, and other random numbers were drawn since (or those modules are not all "
        "in this model), so the generator cannot be put back: the model's own initialization after to_empty draws "
        "other numbers than an unsharded model built the same way. Call to_empty right after fully_shard (or seed "
        "before your initialization) for the unsharded model's weights.", UserWarning, stacklevel=3)


def _device(record: _Draws) -> torch.device:
    names = [n for n, _ in record.after if n != "cpu"]
    return torch.device(names[0]) if names else torch.device("cpu")
