"""Unit tests for composable_shard._setup.subclass: the in-place ``FSDP<Orig>`` / ``Replicate<Orig>``
class swap.

Without these tests a module could lose ``isinstance`` with its original class (breaking user
code and wrap policies), get a fresh class per instance (breaking ``type(a) is type(b)`` checks
and leaking classes), have its ``__init__`` re-run (resetting weights), make containers build
broken copies when sliced, or become silently copyable/picklable while holding process groups
and sharded storage.
"""

from __future__ import annotations

import copy
import pickle
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

from composable_shard._setup.subclass import _NoCopyMixin, make_subclass


class MyMixin(_NoCopyMixin):
    _api_name = "myapi"

    def mixin_method(self) -> str:
        return "mixin"


class OtherMixin(_NoCopyMixin):
    _api_name = "otherapi"


class Counted(nn.Module):
    init_calls = 0

    def __init__(self, width: int = 3) -> None:
        super().__init__()
        type(self).init_calls += 1
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 4)


def test_class_name_bases_and_isinstance() -> None:
    """Without it, isinstance(m, nn.Linear) or isinstance(m, Mixin) would fail after the swap."""
    m = _linear()
    cls = make_subclass(m, "FSDP", MyMixin)
    assert type(m) is cls
    assert cls.__name__ == "FSDPLinear"
    # MyMixin's own base (_NoCopyMixin) sits between it and the original class in the MRO.
    assert type(m).__mro__[1:4] == (MyMixin, _NoCopyMixin, nn.Linear)
    assert cls.__bases__ == (MyMixin, nn.Linear)
    assert isinstance(m, nn.Linear)
    assert isinstance(m, MyMixin)
    assert isinstance(m, nn.Module)
    assert m.mixin_method() == "mixin"  # type: ignore[attr-defined]


def test_class_cache_reused_per_original_class() -> None:
    """Without it, each fully_shard call would mint a new class (type checks fail, classes leak)."""
    m1, m2 = nn.Linear(2, 2), nn.Linear(5, 1)
    c1 = make_subclass(m1, "FSDP", MyMixin)
    c2 = make_subclass(m2, "FSDP", MyMixin)
    assert c1 is c2
    assert type(m1) is type(m2)
    conv = nn.Conv1d(1, 1, 1)
    c3 = make_subclass(conv, "FSDP", MyMixin)
    assert c3 is not c1
    assert c3.__name__ == "FSDPConv1d"
    assert c3.__bases__ == (MyMixin, nn.Conv1d)
    # A different prefix/mixin gets its own class for the same original class.
    m3 = nn.Linear(2, 2)
    c4 = make_subclass(m3, "Replicate", OtherMixin)
    assert c4 is not c1
    assert c4.__name__ == "ReplicateLinear"


def _block_class(scale: float) -> type:
    """A class named ``Block`` whose forward scales by ``scale``: one per call, as two libraries'
    (or a notebook's redefined) classes of one name are."""
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * scale

        def factor(self) -> float:
            return scale

    return Block


def test_classes_of_one_name_get_a_class_each() -> None:
    """Two different classes both named ``Block`` (a model built from two libraries' blocks) keep
    their own forward and methods under each API. A cache keyed by the class's name would hand
    the second the first's dynamic class: it would run the other class's forward, silently."""
    first_cls, second_cls = _block_class(2.0), _block_class(3.0)
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    for prefix, mixin in (("FSDP", MyMixin), ("Replicate", OtherMixin)):
        first, second = first_cls(), second_cls()
        torch.manual_seed(0)
        first.lin.reset_parameters()
        torch.manual_seed(1)
        second.lin.reset_parameters()
        expected = [first(x), second(x)]
        made = [make_subclass(first, prefix, mixin), make_subclass(second, prefix, mixin)]
        assert made[0] is not made[1] and made[0].__name__ == made[1].__name__ == f"{prefix}Block", made
        assert made[0].__bases__ == (mixin, first_cls) and made[1].__bases__ == (mixin, second_cls), made
        assert isinstance(second, second_cls) and not isinstance(second, first_cls), type(second).__mro__
        assert (first.factor(), second.factor()) == (2.0, 3.0)  # type: ignore[operator]
        assert torch.equal(first(x), expected[0]) and torch.equal(second(x), expected[1]), prefix


def test_make_subclass_idempotent() -> None:
    """Without it, applying the swap twice would stack FSDPFSDPLinear levels."""
    m = nn.Linear(2, 2)
    c1 = make_subclass(m, "FSDP", MyMixin)
    c2 = make_subclass(m, "FSDP", MyMixin)
    assert c1 is c2
    assert type(m) is c1
    assert type(m).__name__ == "FSDPLinear"


def test_original_init_not_rerun() -> None:
    """Without it, the swap would re-initialise the module (fresh random weights, lost state)."""
    Counted.init_calls = 0
    m = Counted()
    assert Counted.init_calls == 1
    weight_before = m.lin.weight.detach().clone()
    lin_before = m.lin
    make_subclass(m, "FSDP", MyMixin)
    assert Counted.init_calls == 1
    assert m.lin is lin_before
    assert torch.equal(m.lin.weight, weight_before)


def test_forward_output_unchanged() -> None:
    """Without it, the mixin could shadow forward and change the model's output."""
    torch.manual_seed(0)
    m = Counted()
    x = torch.randn(2, 3)
    expected = m(x)
    make_subclass(m, "FSDP", MyMixin)
    assert torch.equal(m(x), expected)
    lin = _linear()
    expected_lin = lin(x)
    make_subclass(lin, "FSDP", MyMixin)
    assert torch.equal(lin(x), expected_lin)


def test_parameters_and_state_dict_unchanged() -> None:
    """Without it, the class swap could alter FQNs or drop parameters from the state dict."""
    m = Counted()
    params = list(m.named_parameters())
    make_subclass(m, "FSDP", MyMixin)
    assert [n for n, _ in m.named_parameters()] == ["lin.weight", "lin.bias"]
    assert len(params) == 2 and all(p is q for (_, p), (_, q) in zip(m.named_parameters(), params))
    assert list(m.state_dict().keys()) == ["lin.weight", "lin.bias"]


def test_indexing_containers_returns_dynamic_class() -> None:
    """Without it, model.layers[0] would not be recognised as a managed module."""
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    ml = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    for m in (seq[0], seq[2], ml[0], ml[1]):
        make_subclass(m, "FSDP", MyMixin)
    assert type(seq[0]).__name__ == "FSDPLinear"
    assert type(seq[2]).__name__ == "FSDPLinear"
    assert type(seq[1]) is nn.ReLU
    assert type(seq[-1]).__name__ == "FSDPLinear"
    assert type(ml[0]).__name__ == "FSDPLinear"
    assert type(ml[1]) is type(seq[0])
    assert isinstance(seq[0], MyMixin)
    assert [type(m).__name__ for m in ml] == ["FSDPLinear", "FSDPLinear"]


def test_slicing_subclassed_sequential_builds_original_class() -> None:
    """Without it, seq[0:2] on an FSDPSequential would build a managed-looking module with no
    state (or fail in the mixin)."""
    seq = nn.Sequential(OrderedDict([("x", nn.Linear(2, 2)), ("y", nn.ReLU()), ("z", nn.Linear(2, 2))]))
    make_subclass(seq, "FSDP", MyMixin)
    assert type(seq).__name__ == "FSDPSequential"
    part = seq[0:2]
    assert type(part) is nn.Sequential
    assert list(part._modules.keys()) == ["x", "y"]
    assert part.x is seq.x
    ml = nn.ModuleList([nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1)])
    make_subclass(ml, "FSDP", MyMixin)
    sub = ml[1:]
    assert type(sub) is nn.ModuleList
    assert len(sub) == 2


def test_constructing_dynamic_class_builds_original() -> None:
    """Without it, type(m)(...) (as containers and copies do) would build a stateless FSDP module."""
    m = nn.Linear(2, 2)
    cls = make_subclass(m, "FSDP", MyMixin)
    new = cls(3, 4)
    assert type(new) is nn.Linear
    assert new.weight.shape == (4, 3)
    assert new.in_features == 3 and new.out_features == 4
    Counted.init_calls = 0
    c = Counted(5)
    ccls = make_subclass(c, "FSDP", MyMixin)
    assert Counted.init_calls == 1
    built = ccls(width=2)
    assert type(built) is Counted
    assert Counted.init_calls == 2  # the original __init__ ran exactly once for the new object
    assert built.lin.in_features == 2


def test_a_users_subclass_of_the_dynamic_class_constructs_itself() -> None:
    """A class the user derives from the dynamic one (``class Mine(type(model))``, as a framework
    patching a sharded model's class does) constructs an instance of itself, running its own
    ``__init__`` (only the dynamic class itself builds the original)."""
    m = nn.Linear(2, 2)
    cls = make_subclass(m, "FSDP", MyMixin)

    class Mine(cls):  # type: ignore[misc, valid-type]  # a class made at run time
        def __init__(self, *args: object) -> None:
            super().__init__(*args)
            self.mine = True

    built = Mine(3, 4)
    assert type(built) is Mine and isinstance(built, cls) and isinstance(built, nn.Linear)
    assert built.mine and built.weight.shape == (4, 3)


def test_second_api_stacks_on_the_first() -> None:
    """Without it, a module managed by two APIs would lose one API's behaviour (its class
    replaced instead of extended)."""
    m = nn.Linear(2, 2)
    first = make_subclass(m, "Replicate", OtherMixin)
    second = make_subclass(m, "FSDP", MyMixin)
    assert isinstance(m, MyMixin) and isinstance(m, OtherMixin) and isinstance(m, nn.Linear)
    assert second.__name__ == "FSDPReplicateLinear" and second.__bases__ == (MyMixin, first)
    assert first.__bases__ == (OtherMixin, nn.Linear)


def test_deepcopy_raises_pointing_to_state_dict() -> None:
    """Without it, deepcopy would duplicate process groups and sharded storage silently."""
    m = nn.Linear(2, 2)
    make_subclass(m, "FSDP", MyMixin)
    with pytest.raises(RuntimeError) as excinfo:
        copy.deepcopy(m)
    msg = str(excinfo.value)
    assert "state_dict" in msg
    assert "myapi" in msg


def test_pickle_raises_pointing_to_state_dict() -> None:
    """Without it, torch.save(model) would pickle a managed module's internals silently."""
    m = nn.Linear(2, 2)
    make_subclass(m, "FSDP", MyMixin)
    with pytest.raises(RuntimeError) as excinfo:
        pickle.dumps(m)
    msg = str(excinfo.value)
    assert "state_dict" in msg
    assert "myapi" in msg


def test_deepcopy_of_parent_with_managed_child_raises() -> None:
    """Without it, copying an unmanaged parent would duplicate a managed child silently."""
    parent = nn.Sequential(nn.Linear(2, 2))
    make_subclass(parent[0], "FSDP", MyMixin)
    with pytest.raises(RuntimeError, match="state_dict"):
        copy.deepcopy(parent)
