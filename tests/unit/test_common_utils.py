"""Unit tests for composable_shard._runtime.module_state (FQN cleaning, the flattened-tensor mark) and
contract._root_modules (which modules of a list an API treats as roots).

Without these tests a checkpoint from a wrapper-based API could no longer be matched to our
names, or a child passed with its parent would become a separate root. Expected names are
written by hand from the small models below.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn

from composable_shard._runtime.module_state import _is_fsdp_flattened, _set_fsdp_flattened, clean_tensor_name
from composable_shard.contract import _root_modules


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


# --------------------------------------------------------------------------- contract._root_modules


def test_root_modules() -> None:
    """Without it, fully_shard([parent, child]) would treat the child as a separate root."""
    m = build()
    a, a1, x, b = m.a, m.a.a1, m.a.a1.x, m.b
    assert _root_modules([a, a1, b]) == [a, b]
    assert _root_modules([x, a]) == [a]
    assert _root_modules([b, a1]) == [b, a1]
    assert _root_modules([a1, a1, b]) == [a1, b]
    assert _root_modules([m, b, x]) == [m]
    assert _root_modules([]) == []
    assert _root_modules([a2 := m.a.a2, b]) == [a2, b]


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
