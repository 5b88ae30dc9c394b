"""Unit tests for composable_shard._common_utils: FQN helpers and the flattened-tensor mark.

These helpers decide the names state dicts and optimizer state dicts are keyed by and which
modules an API treats as roots. Without these tests a checkpoint from a wrapper-based API
could no longer be matched to our names, a tied parameter could get a non-canonical name
(two optimizer-state entries for one tensor), or a module registered twice could be visited
twice. Expected names are written by hand from the small models below.
"""

from __future__ import annotations

from typing import List, Tuple

import pytest
import torch
import torch.nn as nn

from composable_shard._common_utils import (
    _apply_to_modules,
    _get_param_to_fqns,
    _get_root_modules,
    _is_fsdp_flattened,
    _set_fsdp_flattened,
    clean_tensor_name,
)


class Node(nn.Module):
    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


def build() -> Node:
    """Tree (pre-order): "" a a.a1 a.a1.x a.a2 b b.b1"""
    return Node(
        a=Node(a1=Node(x=nn.Linear(1, 1)), a2=nn.Linear(1, 1)),
        b=Node(b1=nn.Linear(1, 1)),
    )


# --------------------------------------------------------------------------- clean_tensor_name


@pytest.mark.parametrize(
    "name, expected",
    [
        ("_fsdp_wrapped_module.layer.weight", "layer.weight"),
        ("_checkpoint_wrapped_module.layer.weight", "layer.weight"),
        ("layers.0._fsdp_wrapped_module.weight", "layers.0.weight"),
        ("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.w", "layers.0.w"),
        ("a.b.weight", "a.b.weight"),
        ("weight", "weight"),
        ("", ""),
    ],
)
def test_clean_tensor_name(name: str, expected: str) -> None:
    """Without it, names from wrapper-based FSDP/checkpoint state dicts would not match ours."""
    assert clean_tensor_name(name) == expected


# --------------------------------------------------------------------------- _get_root_modules


def test_get_root_modules() -> None:
    """Without it, fully_shard([parent, child]) would treat the child as a separate root."""
    m = build()
    a, a1, x, b = m.a, m.a.a1, m.a.a1.x, m.b
    assert _get_root_modules([a, a1, b]) == [a, b]
    assert _get_root_modules([x, a]) == [a]
    assert _get_root_modules([b, a1]) == [b, a1]
    assert _get_root_modules([a1, a1, b]) == [a1, b]
    assert _get_root_modules([m, b, x]) == [m]
    assert _get_root_modules([]) == []
    assert _get_root_modules(iter([a2 := m.a.a2, b])) == [a2, b]


# --------------------------------------------------------------------------- _apply_to_modules


def test_apply_to_modules_preorder_with_prefixes() -> None:
    """Without it, visitors building FQNs (state dict, ignored params) would get wrong prefixes
    or a BFS order."""
    m = build()
    visited: List[Tuple[nn.Module, str]] = []
    _apply_to_modules(m, lambda mod, prefix: visited.append((mod, prefix)))
    assert [p for _, p in visited] == ["", "a.", "a.a1.", "a.a1.x.", "a.a2.", "b.", "b.b1."]
    assert [mod for mod, _ in visited] == [m, m.a, m.a.a1, m.a.a1.x, m.a.a2, m.b, m.b.b1]
    assert [mod for mod, _ in visited] == list(m.modules())


def test_apply_to_modules_shared_module_once() -> None:
    """Without it, a module registered under two names would be visited (and processed) twice."""
    shared = nn.Linear(1, 1)
    m = Node(p=Node(s=shared), q=Node(s=shared, t=nn.Linear(1, 1)))
    visited: List[Tuple[nn.Module, str]] = []
    _apply_to_modules(m, lambda mod, prefix: visited.append((mod, prefix)))
    assert [p for _, p in visited] == ["", "p.", "p.s.", "q.", "q.t."]
    assert sum(1 for mod, _ in visited if mod is shared) == 1


def test_apply_to_modules_deep_chain() -> None:
    """Without it, a recursive implementation would crash on deep models."""
    module: nn.Module = nn.Linear(1, 1)
    for _ in range(2000):
        module = nn.Sequential(module)
    count = [0]
    last = [""]

    def visit(mod: nn.Module, prefix: str) -> None:
        count[0] += 1
        last[0] = prefix

    _apply_to_modules(module, visit)
    assert count[0] == 2001
    assert last[0] == "0." * 2000


# --------------------------------------------------------------------------- _get_param_to_fqns


def test_param_to_fqns_tied() -> None:
    """Without it, a tied parameter would get one name only (or a non-canonical first name), so
    optimizer state / state dict keys would differ from torch's."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(4, 2)
            self.mid = nn.Linear(2, 2)
            self.head = nn.Linear(2, 4, bias=False)
            self.head.weight = self.emb.weight

    m = Tied()
    mapping = _get_param_to_fqns(m)
    assert len(mapping) == 3
    assert mapping[m.emb.weight] == ["emb.weight", "head.weight"]
    assert mapping[m.mid.weight] == ["mid.weight"]
    assert mapping[m.mid.bias] == ["mid.bias"]
    assert list(mapping.values())[0][0] == "emb.weight"
    assert [fqns[0] for fqns in mapping.values()] == ["emb.weight", "mid.weight", "mid.bias"]


def test_param_to_fqns_shared_module() -> None:
    """Without it, parameters of a module registered twice would lose their second FQN."""
    shared = nn.Linear(1, 1)
    m = Node(p=shared, q=shared)
    mapping = _get_param_to_fqns(m)
    assert mapping[shared.weight] == ["p.weight", "q.weight"]
    assert mapping[shared.bias] == ["p.bias", "q.bias"]


# --------------------------------------------------------------------------- flattened mark


def test_fsdp_flattened_mark() -> None:
    """Without it, nesting a flat parameter inside another could not be detected."""
    t = torch.zeros(3)
    p = nn.Parameter(torch.zeros(2))
    assert not _is_fsdp_flattened(t)
    assert not _is_fsdp_flattened(p)
    _set_fsdp_flattened(p)
    assert _is_fsdp_flattened(p)
    assert not _is_fsdp_flattened(t)
