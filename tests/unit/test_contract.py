"""Unit tests for composable_shard.contract: the registry behind every composable API.

``@contract`` is what lets ``fully_shard``, ``replicate`` and ``checkpoint`` attach state in
place and find each other. Without these tests a state could leak into ``state_dict()`` or
``named_modules()`` (breaking checkpoints), an API could be applied twice (double hooks,
double reductions), an API could silently change FQNs, or a failed call could leave a
half-registered module behind. All expected names are written by hand from the model below.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, List

import pytest
import torch
import torch.nn as nn

from composable_shard.contract import _get_module_state, _get_registry, _register_api, _State, contract

_STATE_KEY = "__composable_shard_state__"
_REGISTRY_KEY = "__composable_shard_registry__"


class _AState(_State):
    def __init__(self) -> None:
        self.calls = 0


class _BState(_State):
    def __init__(self) -> None:
        self.tag = "b"


@contract(state_cls=_AState)
def api_a(module: Any) -> Any:
    return module


@contract(state_cls=_BState)
def api_b(module: Any) -> Any:
    return module


class Sub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)


class A(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sub = Sub()
        self.register_buffer("buf", torch.zeros(2))


class Model(nn.Module):
    """Tree:

        ""        Model
        ├─ a      A          buffer buf
        │  └─ a.sub   Sub
        │     └─ a.sub.lin  Linear(2, 2)   weight, bias
        └─ b      Linear(2, 1)           weight, bias
    """

    def __init__(self) -> None:
        super().__init__()
        self.a = A()
        self.b = nn.Linear(2, 1)


# --------------------------------------------------------------------------- attach / retrieve


def test_state_attached_and_retrieved() -> None:
    """Without it, fn.state(module) could return nothing or a fresh object each call."""
    model = Model()
    assert api_a.state(model) is None
    out = api_a(model)
    assert out is model
    state = api_a.state(model)
    assert isinstance(state, _AState)
    assert api_a.state(model) is state
    # Only the module it was applied to carries it.
    assert api_a.state(model.a) is None
    assert api_a.state(model.b) is None


def test_state_is_in_module_dict() -> None:
    """Without it, the state might be stored somewhere a copy/GC of the module loses it."""
    model = Model()
    api_a(model)
    state = api_a.state(model)
    assert _STATE_KEY in model.__dict__
    assert state in model.__dict__[_STATE_KEY].values()
    assert _REGISTRY_KEY in model.__dict__


def test_state_invisible_to_named_modules_state_dict_repr() -> None:
    """Without it, checkpoints would gain keys and module traversals see a foreign object."""
    model = Model()
    names_before = [n for n, _ in model.named_modules()]
    keys_before = list(model.state_dict().keys())
    repr_before = repr(model)
    api_a(model)
    api_b(model.a)
    assert [n for n, _ in model.named_modules()] == ["", "a", "a.sub", "a.sub.lin", "b"]
    assert [n for n, _ in model.named_modules()] == names_before
    assert list(model.state_dict().keys()) == ["a.buf", "a.sub.lin.weight", "a.sub.lin.bias", "b.weight", "b.bias"]
    assert list(model.state_dict().keys()) == keys_before
    assert repr(model) == repr_before
    assert "State" not in repr(model)
    assert list(model._modules) == ["a", "b"]
    assert [n for n, _ in model.named_parameters()] == ["a.sub.lin.weight", "a.sub.lin.bias", "b.weight", "b.bias"]


# --------------------------------------------------------------------------- registry


def test_registry_none_before_any_api() -> None:
    """Without it, callers asking "is this module managed?" would get a truthy empty value."""
    assert _get_registry(nn.Linear(1, 1)) is None


def test_registry_ordered_two_apis() -> None:
    """Without it, composition checks (what manages this module, in which order) break."""
    model = Model()
    api_b(model)
    api_a(model)
    registry = _get_registry(model)
    assert registry is not None
    assert isinstance(registry, OrderedDict)
    assert list(registry.keys()) == ["api_b", "api_a"]
    assert isinstance(api_a.state(model), _AState)
    assert isinstance(api_b.state(model), _BState)
    assert api_a.state(model) is not api_b.state(model)
    assert _get_registry(model.a) is None


def test_two_apis_with_default_state_cls_on_one_module() -> None:
    """Without it, two composable APIs that both use the default ``_State`` cannot be applied to
    the same module (the second raises), and each one's ``.state`` returns the other's state."""

    @contract()
    def first(module: Any) -> Any:
        return module

    @contract()
    def second(module: Any) -> Any:
        return module

    m = nn.Linear(2, 2)
    first(m)
    second(m)  # a different API: must be allowed
    registry = _get_registry(m)
    assert registry is not None
    assert list(registry.keys()) == ["first", "second"]
    s1, s2 = first.state(m), second.state(m)
    assert s1 is not None and s2 is not None
    assert s1 is not s2


def test_state_not_returned_for_unapplied_api() -> None:
    """Without it, ``api.state(m)`` reports another API's state for a module the API was never
    applied to, so "is m managed by api?" checks answer yes wrongly."""

    @contract()
    def plain(module: Any) -> Any:
        return module

    m = nn.Linear(2, 2)
    api_a(m)
    assert plain.state(m) is None


def test_same_api_twice_raises_naming_api() -> None:
    """Without it, applying an API twice would register duplicate hooks/state silently."""
    model = Model()
    api_a(model)
    state = api_a.state(model)
    with pytest.raises(RuntimeError, match="api_a"):
        api_a(model)
    # The first application is untouched.
    assert api_a.state(model) is state
    assert list(_get_registry(model).keys()) == ["api_a"]  # type: ignore[union-attr]


def test_same_api_twice_via_list_raises() -> None:
    """Without it, passing a module again inside a list would bypass the double-apply check."""
    model = Model()
    api_a(model.a)
    with pytest.raises(RuntimeError, match="api_a"):
        api_a([model.a, model.b])


# --------------------------------------------------------------------------- FQN checks


def test_renaming_parameter_raises() -> None:
    """Without it, an API that renames a parameter would break every checkpoint silently."""

    @contract()
    def rename_param(module: nn.Module) -> nn.Module:
        lin = module.a.sub.lin
        w = lin._parameters.pop("weight")
        lin.register_parameter("w", w)
        return module

    model = Model()
    with pytest.raises(RuntimeError) as excinfo:
        rename_param(model)
    msg = str(excinfo.value)
    assert "rename_param" in msg
    assert "a.sub.lin.weight" in msg
    assert "a.sub.lin.w" in msg


def test_adding_buffer_raises() -> None:
    """Without it, an API that adds a buffer would change state_dict keys silently."""

    @contract()
    def add_buffer(module: nn.Module) -> nn.Module:
        module.b.register_buffer("extra", torch.ones(1))
        return module

    model = Model()
    with pytest.raises(RuntimeError) as excinfo:
        add_buffer(model)
    msg = str(excinfo.value)
    assert "b.extra" in msg
    assert "buffers" in msg


def test_removing_submodule_raises() -> None:
    """Without it, an API that drops or wraps a submodule would change FQNs silently."""

    @contract()
    def remove_sub(module: nn.Module) -> nn.Module:
        del module.a.sub
        return module

    model = Model()
    with pytest.raises(RuntimeError) as excinfo:
        remove_sub(model)
    msg = str(excinfo.value)
    assert "a.sub" in msg
    assert "a.sub.lin" in msg


def test_reordering_parameters_raises() -> None:
    """Without it, an API that keeps names but changes their order would reorder flat params
    (and optimizer state) silently."""

    @contract()
    def reorder(module: nn.Module) -> nn.Module:
        lin = module.b
        w = lin._parameters.pop("weight")
        lin._parameters["weight"] = w  # now bias, weight
        return module

    model = Model()
    with pytest.raises(RuntimeError) as excinfo:
        reorder(model)
    msg = str(excinfo.value)
    assert "order" in msg
    assert "b.weight" in msg and "b.bias" in msg


def test_fqn_preserving_api_passes() -> None:
    """Without it, the FQN check could reject APIs that only mutate data in place."""

    @contract()
    def touch(module: nn.Module) -> nn.Module:
        with torch.no_grad():
            module.b.weight.zero_()
        return module

    model = Model()
    assert touch(model) is model
    assert touch.state(model) is not None


# --------------------------------------------------------------------------- list input


def test_list_input_attaches_one_shared_state_to_roots_only() -> None:
    """Without it, fully_shard([...]) would create one handle per listed module (or nest them)."""
    model = Model()
    out = api_a([model.a, model.a.sub, model.b])
    assert out == [model.a, model.a.sub, model.b]
    state_a = api_a.state(model.a)
    state_b = api_a.state(model.b)
    assert isinstance(state_a, _AState)
    assert state_a is state_b
    assert api_a.state(model.a.sub) is None
    assert _get_registry(model.a.sub) is None
    assert api_a.state(model) is None
    assert list(_get_registry(model.a).keys()) == ["api_a"]  # type: ignore[union-attr]
    assert list(_get_registry(model.b).keys()) == ["api_a"]  # type: ignore[union-attr]


def test_list_input_with_state_mutation_seen_by_all_roots() -> None:
    """Without it, the shared state could be copied per root so updates diverge."""
    model = Model()
    seen: List[Any] = []

    @contract(state_cls=_AState)
    def counting(modules: Any) -> Any:
        st = counting.state(modules[0])
        st.calls += 1
        seen.append(st)
        return modules

    counting([model.b, model.a])
    assert counting.state(model.a).calls == 1  # type: ignore[union-attr]
    assert counting.state(model.b) is seen[0]


# --------------------------------------------------------------------------- rollback & errors


def test_exception_in_api_rolls_back() -> None:
    """Without it, a failed call leaves a half-registered module that then refuses a retry."""

    @contract(state_cls=_AState)
    def failing(module: Any) -> Any:
        raise ValueError("boom")

    model = Model()
    with pytest.raises(ValueError, match="boom"):
        failing(model)
    assert failing.state(model) is None
    assert _get_registry(model) is None
    assert _STATE_KEY not in model.__dict__


def test_exception_rolls_back_only_failing_api() -> None:
    """Without it, rollback of one API could wipe state another API attached earlier."""

    @contract(state_cls=_AState)
    def failing(module: Any) -> Any:
        raise ValueError("boom")

    model = Model()
    api_b(model)
    state_b = api_b.state(model)
    with pytest.raises(ValueError):
        failing([model, model.a])
    assert failing.state(model) is None
    assert api_b.state(model) is state_b
    assert list(_get_registry(model).keys()) == ["api_b"]  # type: ignore[union-attr]
    assert _get_registry(model.a) is None


def test_retry_after_failure_succeeds() -> None:
    """Without it, a transient failure would permanently block applying the API."""
    calls = {"n": 0}

    @contract(state_cls=_AState)
    def flaky(module: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("first call fails")
        return module

    m = nn.Linear(1, 1)
    with pytest.raises(RuntimeError, match="first call fails"):
        flaky(m)
    flaky(m)
    assert isinstance(flaky.state(m), _AState)


def test_contract_rejects_non_state_class() -> None:
    """Without it, a bad state_cls would fail later with a confusing error on first use."""
    with pytest.raises(TypeError):
        contract(state_cls=int)  # type: ignore[type-var]
    with pytest.raises(TypeError):
        contract(state_cls=_AState())  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [1, "model", None, [], [nn.Linear(1, 1), 3], torch.zeros(2)])
def test_non_module_input_raises_type_error(bad: Any) -> None:
    """Without it, passing a tensor or a name would fail deep inside the API."""
    with pytest.raises(TypeError):
        api_a(bad)


def test_register_api_helper() -> None:
    """Without it, APIs that manage extra modules (wrap policies) cannot mark them."""
    m = nn.Linear(1, 1)
    st = _AState()
    _register_api(m, "fully_shard", st)
    _register_api(m, "checkpoint")
    assert list(_get_registry(m).keys()) == ["fully_shard", "checkpoint"]  # type: ignore[union-attr]
    assert _get_module_state(m, _AState) is st  # found by class for internal lookups
    assert api_a.state(m) is None  # fn.state is keyed by the API's own name
    assert api_b.state(m) is None


def test_contract_preserves_function_metadata() -> None:
    """Without it, the registry key (the API's name) and docs would be those of a wrapper."""

    @contract()
    def documented(module: Any) -> Any:
        """Doc line."""
        return module

    assert documented.__name__ == "documented"
    assert documented.__doc__ == "Doc line."
