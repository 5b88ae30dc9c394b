"""Unit tests for composable_shard._runtime.traversal: which fully_shard states and handles a
root finds in its tree, and in which order.

The root caches this list once at lazy init and every rank issues collectives in that order,
so a traversal that visits in BFS instead of DFS order, lists a shared state twice, enters a
``replicate``-managed subtree, or recurses (and dies on deep models) would silently change
collective order, double-reduce gradients or shard parameters another API owns. States are
attached by hand (no process group) and every expected order is written out by hand.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import pytest
import torch.nn as nn

from composable_shard._runtime.module_state import _FSDPState
from composable_shard._runtime.traversal import (
    _composable,
    _get_fsdp_handles,
    _get_fsdp_states,
)
from composable_shard.contract import _register_api


class Node(nn.Module):
    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


class _Handle:
    """Stand-in for a FlatParamHandle: traversal only passes it through."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"_Handle({self.name})"


def build() -> Dict[str, nn.Module]:
    """Tree (DFS ``.modules()`` order: root a a1 a1x a2 b b1; BFS: root a b a1 a2 b1 a1x):

        root
        ├─ a
        │  ├─ a1
        │  │  └─ a1x
        │  └─ a2
        └─ b
           └─ b1
    """
    a1x = nn.Linear(1, 1)
    a1 = Node(a1x=a1x)
    a2 = nn.Linear(1, 1)
    a = Node(a1=a1, a2=a2)
    b1 = nn.Linear(1, 1)
    b = Node(b1=b1)
    root = Node(a=a, b=b)
    return {"root": root, "a": a, "a1": a1, "a1x": a1x, "a2": a2, "b": b, "b1": b1}


def annotate(module: nn.Module, handle: Optional[object] = None) -> _FSDPState:
    state = _FSDPState()
    state.module = module
    state.handle = handle  # type: ignore[assignment]
    _register_api(module, "fully_shard", state)
    return state


def names_of(mods: Dict[str, nn.Module], found: List[nn.Module]) -> List[str]:
    by_id = {id(m): n for n, m in mods.items()}
    return [by_id[id(m)] for m in found]


def test_dfs_order_matches_modules_order() -> None:
    """Without it, states could be listed in BFS order and ranks' collective order would differ
    from the forward order the design promises."""
    mods = build()
    # Sanity: the tree really has different BFS and DFS orders.
    assert names_of(mods, list(mods["root"].modules())) == ["root", "a", "a1", "a1x", "a2", "b", "b1"]
    order = ["b1", "a2", "a1x", "root", "b", "a1"]  # annotate out of order on purpose
    states = {n: annotate(mods[n]) for n in order}
    assert _get_fsdp_states(mods["root"]) == [states[n] for n in ["root", "a1", "a1x", "a2", "b", "b1"]]
    # Starting from a subtree lists that subtree only.
    assert _get_fsdp_states(mods["a"]) == [states["a1"], states["a1x"], states["a2"]]


def test_no_states() -> None:
    """Without it, an unannotated tree might yield spurious states."""
    mods = build()
    assert _get_fsdp_states(mods["root"]) == []
    assert _get_fsdp_handles(mods["root"]) == []


def test_shared_state_listed_once_at_its_first_module() -> None:
    """Without it, a state shared by a list passed to one fully_shard call would be initialised
    and reduced twice."""
    mods = build()
    shared = _FSDPState()
    # Register b first: the state must still be listed where its first module in DFS order (a1) is.
    _register_api(mods["b"], "fully_shard", shared)
    _register_api(mods["a1"], "fully_shard", shared)
    other = annotate(mods["a2"])
    assert _get_fsdp_states(mods["root"]) == [shared, other]


def test_replicate_subtree_not_entered() -> None:
    """Without it, fully_shard would claim parameters inside a subtree replicate manages."""
    mods = build()
    s_root = annotate(mods["root"])
    annotate(mods["a1x"])  # inside the replicate subtree: must not be found
    s_b1 = annotate(mods["b1"])
    _register_api(mods["a1"], "replicate")
    assert not _composable(mods["a1"])
    assert _composable(mods["a"])
    assert _composable(mods["a1x"])  # itself composable; only reachable through a1
    assert _get_fsdp_states(mods["root"]) == [s_root, s_b1]


def test_replicate_module_with_fsdp_state_not_listed() -> None:
    """Without it, a module managed by both replicate and fully_shard would be listed."""
    mods = build()
    annotate(mods["b"])
    _register_api(mods["b"], "replicate")
    s_a2 = annotate(mods["a2"])
    assert _get_fsdp_states(mods["root"]) == [s_a2]


def test_composable_for_other_apis() -> None:
    """Without it, checkpoint (which composes with fully_shard) would hide subtrees."""
    m = nn.Linear(1, 1)
    assert _composable(m)
    _register_api(m, "checkpoint")
    assert _composable(m)
    _register_api(m, "fully_shard")
    assert _composable(m)
    _register_api(m, "replicate")
    assert not _composable(m)


def test_shared_submodule_visited_once() -> None:
    """Without it, a module registered under two parents would have its state listed twice."""
    shared = nn.Linear(1, 1)
    p = Node(s=shared)
    q = Node(s=shared, t=nn.Linear(1, 1))
    root = Node(p=p, q=q)
    s_shared = annotate(shared)
    s_t = annotate(q.t)
    s_q = annotate(q)
    # DFS: root p p.s q (q.s already seen) q.t
    assert _get_fsdp_states(root) == [s_shared, s_q, s_t]


def test_handles_skip_states_without_handle() -> None:
    """Without it, modules that own no parameters would contribute a None handle and the root
    would crash (or issue a collective for nothing)."""
    mods = build()
    h_root, h_a1x, h_b1 = _Handle("root"), _Handle("a1x"), _Handle("b1")
    annotate(mods["root"], h_root)
    annotate(mods["a1"], None)
    annotate(mods["a1x"], h_a1x)
    annotate(mods["b"], None)
    annotate(mods["b1"], h_b1)
    handles = _get_fsdp_handles(mods["root"])
    assert handles == [h_root, h_a1x, h_b1]
    assert all(h is e for h, e in zip(handles, [h_root, h_a1x, h_b1]))


def test_deep_model_no_recursion_error() -> None:
    """Without it, a recursive traversal would crash on deep models (RecursionError)."""
    depth = 3000
    innermost = nn.Linear(1, 1)
    chain: List[nn.Module] = [innermost]
    module: nn.Module = innermost
    for _ in range(depth):
        module = nn.Sequential(module)
        chain.append(module)
    root = module
    s_root = annotate(root)
    s_mid = annotate(chain[depth // 2])
    h = _Handle("leaf")
    s_leaf = annotate(innermost, h)
    assert _get_fsdp_states(root) == [s_root, s_mid, s_leaf]
    assert _get_fsdp_handles(root) == [h]
    assert _composable(root)


@pytest.mark.parametrize("start", ["root", "b"])
def test_start_module_itself_included(start: str) -> None:
    """Without it, the root's own state would be missed (the root is the first state)."""
    mods = build()
    s = annotate(mods[start])
    assert _get_fsdp_states(mods[start])[0] is s


class _CountingNode(nn.Module):
    """Counts how often its children are listed (``children()`` goes through ``named_children``)."""

    def __init__(self) -> None:
        super().__init__()
        self.listings = 0

    def named_children(self):  # type: ignore[no-untyped-def]  # same signature as nn.Module's
        self.listings += 1
        return super().named_children()


def test_shared_module_subtree_entered_once() -> None:
    """Without it, a module shared by two parents is expanded once per path: a chain of such
    diamonds makes the traversal exponential (2**depth visits) and init hangs."""
    depth = 12  # small enough that an exponential traversal fails the counts instead of hanging
    joins: List[_CountingNode] = [_CountingNode() for _ in range(depth + 1)]
    sides: List[_CountingNode] = []
    for top, bottom in zip(joins, joins[1:]):
        left, right = _CountingNode(), _CountingNode()
        left.add_module("down", bottom)
        right.add_module("down", bottom)  # same object under a second parent
        top.add_module("left", left)
        top.add_module("right", right)
        sides += [left, right]
    leaf_state = annotate(joins[-1])
    assert _get_fsdp_states(joins[0]) == [leaf_state]
    assert [n.listings for n in joins] == [1] * (depth + 1)
    assert [n.listings for n in sides] == [1] * (2 * depth)
