"""Traversal of the fully sharded modules of a tree.

One left-to-right depth-first traversal in ``.modules()`` order, iterative with an explicit
stack, that never enters a subtree managed by an API ``fully_shard`` cannot compose with
(``replicate``). States shared by several modules (a list passed to one ``fully_shard`` call)
are listed once. No runtime imports: this runs at init and lazy init only, never per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Set, Tuple

import torch.nn as nn

from .module_state import _FSDPState
from ..contract import _get_module_state, _get_registry

if TYPE_CHECKING:
    from .flat_param import FlatParamHandle

__all__ = ["_composable", "owned_modules", "_get_fsdp_states", "_get_fsdp_handles"]

# APIs whose subtrees fully_shard leaves alone (their parameters are theirs to manage).
_NON_COMPOSABLE_APIS = frozenset({"replicate"})


def _composable(module: nn.Module) -> bool:
    """False if ``module`` is managed by an API that ``fully_shard`` cannot compose with."""
    registry = _get_registry(module)
    if registry is None:
        return True
    return not any(api in _NON_COMPOSABLE_APIS for api in registry)


def _get_fsdp_states(module: nn.Module) -> List[_FSDPState]:
    """Every ``fully_shard`` state in the tree of ``module``, DFS order, each once."""
    states: List[_FSDPState] = []
    seen_states: Set[int] = set()
    seen_modules: Set[int] = set()
    stack: List[nn.Module] = [module]
    while stack:
        current = stack.pop()
        if id(current) in seen_modules:
            continue
        seen_modules.add(id(current))
        if current is not module and not _composable(current):
            continue  # the start module is searched even if replicate manages it (unshard_params)
        state = _get_module_state(current, _FSDPState)
        if state is not None and id(state) not in seen_states:
            seen_states.add(id(state))
            states.append(state)
        stack.extend(reversed(list(current.children())))
    return states


def _get_fsdp_handles(module: nn.Module) -> List["FlatParamHandle"]:
    """Every handle in the tree of ``module``, DFS order (states without a handle skipped)."""
    return [s.handle for s in _get_fsdp_states(module) if s.handle is not None]


def owned_modules(state: _FSDPState, module: nn.Module) -> List[Tuple[str, nn.Module]]:
    """Modules of ``module``'s subtree that this state's handle (not a nested one, not
    ``replicate``, not an ignored module) is responsible for."""
    owned: List[Tuple[str, nn.Module]] = []
    stack: List[Tuple[str, nn.Module]] = [("", module)]
    while stack:
        name, m = stack.pop()
        if m is not module and (not _composable(m) or m in state.ignored_modules):
            continue
        owned.append((name, m))
        stack.extend((f"{name}.{n}" if name else n, c) for n, c in m.named_children())
    return owned

