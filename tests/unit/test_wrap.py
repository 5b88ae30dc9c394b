"""Unit tests for composable_shard.wrap: which modules each policy selects.

Every expected selection is written out by hand from the model below, so a traversal that
visits modules in the wrong order, counts a parameter twice, forgets to subtract what a child
claimed or descends into an ignored subtree fails here instead of silently producing a
different set of fully sharded modules (and so different memory and communication).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import pytest
import torch
import torch.nn as nn

from composable_shard.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    _as_policy,
    _Policy,
    always_wrap_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)


class Sub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.leaf1 = nn.Linear(4, 4)


class Block(nn.Module):
    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


class Net(nn.Module):
    """Module tree (parameter numel of each subtree in brackets):

        ""                   Net                 [144]
        ├─ blockA            Block               [31]  own param `scale` [3]
        │  ├─ blockA.sub1    Sub                 [20]
        │  │  └─ .leaf1      Linear(4, 4)        [20]
        │  └─ blockA.leaf2   LayerNorm(4)        [8]
        ├─ blockB            Block               [10]
        │  └─ blockB.leaf3   Linear(4, 2)        [10]
        ├─ attn              MultiheadAttention  [80]  own params [60]
        │  └─ attn.out_proj  Linear subclass     [20]
        └─ layers            ModuleList          [23]
           ├─ layers.0       Linear(4, 3)        [15]
           └─ layers.1       Linear(3, 2)        [8]

    Pre-order (DFS): "", blockA, blockA.sub1, blockA.sub1.leaf1, blockA.leaf2, blockB, ...
    while BFS would give "", blockA, blockB, attn, layers, blockA.sub1, ...
    """

    def __init__(self) -> None:
        super().__init__()
        self.blockA = Block(sub1=Sub(), leaf2=nn.LayerNorm(4))
        self.blockA.scale = nn.Parameter(torch.ones(3))
        self.blockB = Block(leaf3=nn.Linear(4, 2))
        self.attn = nn.MultiheadAttention(4, 1)
        self.layers = nn.ModuleList([nn.Linear(4, 3), nn.Linear(3, 2)])


ALL_NAMES = {
    "",
    "blockA",
    "blockA.sub1",
    "blockA.sub1.leaf1",
    "blockA.leaf2",
    "blockB",
    "blockB.leaf3",
    "attn",
    "attn.out_proj",
    "layers",
    "layers.0",
    "layers.1",
}
ROOT_KWARGS: dict[str, Any] = {"strategy": "FULL_SHARD", "limit_all_gathers": True}


def _modules(model: nn.Module, names: Iterable[str]) -> set[nn.Module]:
    return {model.get_submodule(name) for name in names}


def _names(model: nn.Module, modules: Iterable[nn.Module]) -> set[str]:
    fqn_of = {module: fqn for fqn, module in model.named_modules()}
    return {fqn_of[module] for module in modules}


def _selected(
    model: nn.Module, policy: Any, ignored: Iterable[str] = ()
) -> dict[nn.Module, dict[str, Any]]:
    return _as_policy(policy)._run_policy(model, _modules(model, ignored), dict(ROOT_KWARGS))


def _selected_names(model: nn.Module, policy: Any, ignored: Iterable[str] = ()) -> set[str]:
    targets = _selected(model, policy, ignored)
    for kwargs in targets.values():
        assert kwargs == ROOT_KWARGS
    return _names(model, targets)


def test_model_numels_match_the_documented_tree() -> None:
    """The hand-written expectations below rely on these sizes."""
    model = Net()
    numels = {
        fqn: sum(p.numel() for p in module.parameters())
        for fqn, module in model.named_modules()
    }
    assert numels == {
        "": 144,
        "blockA": 31,
        "blockA.sub1": 20,
        "blockA.sub1.leaf1": 20,
        "blockA.leaf2": 8,
        "blockB": 10,
        "blockB.leaf3": 10,
        "attn": 80,
        "attn.out_proj": 20,
        "layers": 23,
        "layers.0": 15,
        "layers.1": 8,
    }
    assert isinstance(model.attn.out_proj, nn.Linear)


# --------------------------------------------------------------------------- _Policy classes


def test_module_wrap_policy_selects_instances_including_subclasses() -> None:
    model = Net()
    assert _selected_names(model, ModuleWrapPolicy({Block, nn.LayerNorm})) == {
        "blockA",
        "blockB",
        "blockA.leaf2",
    }
    # out_proj is a Linear subclass: isinstance, not exact type.
    assert _selected_names(model, ModuleWrapPolicy([nn.Linear])) == {
        "blockA.sub1.leaf1",
        "blockB.leaf3",
        "attn.out_proj",
        "layers.0",
        "layers.1",
    }
    assert _selected_names(model, ModuleWrapPolicy({Net})) == {""}


def test_module_wrap_policy_skips_ignored_subtrees() -> None:
    model = Net()
    policy = ModuleWrapPolicy({Block, nn.Linear})
    assert _selected_names(model, policy, ignored=["blockA"]) == {
        "blockB",
        "blockB.leaf3",
        "attn.out_proj",
        "layers.0",
        "layers.1",
    }


def test_module_wrap_policy_kwargs_are_independent_copies() -> None:
    model = Net()
    root_kwargs = dict(ROOT_KWARGS)
    targets = ModuleWrapPolicy({Block})._run_policy(model, set(), root_kwargs)
    assert set(targets) == {model.blockA, model.blockB}
    targets[model.blockA]["strategy"] = "NO_SHARD"
    assert targets[model.blockB] == ROOT_KWARGS
    assert root_kwargs == ROOT_KWARGS


def test_custom_policy_true_false_and_overrides() -> None:
    model = Net()

    def lambda_fn(module: nn.Module) -> bool | dict[str, Any]:
        if module is model.blockA:
            return {"strategy": "SHARD_GRAD_OP"}
        if module is model.blockB.leaf3:
            return True
        if module is model.layers:
            return {}  # an empty dict selects nothing, as in torch
        return False

    root_kwargs = dict(ROOT_KWARGS)
    targets = CustomPolicy(lambda_fn)._run_policy(model, set(), root_kwargs)
    assert _names(model, targets) == {"blockA", "blockB.leaf3"}
    assert targets[model.blockA] == {"strategy": "SHARD_GRAD_OP", "limit_all_gathers": True}
    leaf3 = model.get_submodule("blockB.leaf3")
    assert targets[leaf3] == ROOT_KWARGS
    assert targets[leaf3] is not root_kwargs
    assert root_kwargs == ROOT_KWARGS


def test_custom_policy_never_asks_about_ignored_modules() -> None:
    model = Net()
    asked: list[nn.Module] = []

    def lambda_fn(module: nn.Module) -> bool:
        asked.append(module)
        return True

    targets = CustomPolicy(lambda_fn)._run_policy(model, {model.blockA, model.attn}, {})
    expected = {"", "blockB", "blockB.leaf3", "layers", "layers.0", "layers.1"}
    assert _names(model, asked) == expected
    assert len(asked) == len(expected)
    assert _names(model, targets) == expected


@pytest.mark.parametrize("bad_result", [1, "yes", None, [True]])
def test_custom_policy_bad_return_type_names_the_module(bad_result: Any) -> None:
    model = Net()

    def lambda_fn(module: nn.Module) -> Any:
        return bad_result if module is model.blockA.sub1 else False

    with pytest.raises(ValueError) as info:
        CustomPolicy(lambda_fn)._run_policy(model, set(), {})
    message = str(info.value)
    assert "'blockA.sub1'" in message
    assert "Sub" in message
    assert type(bad_result).__name__ in message


# --------------------------------------------------------------------------- function policies


def test_always_wrap_policy_selects_every_module() -> None:
    model = Net()
    assert _selected_names(model, always_wrap_policy) == ALL_NAMES


def test_always_wrap_policy_with_ignored_modules() -> None:
    model = Net()
    assert _selected_names(model, always_wrap_policy, ignored=["blockA", "attn"]) == {
        "",
        "blockB",
        "blockB.leaf3",
        "layers",
        "layers.0",
        "layers.1",
    }


def test_lambda_auto_wrap_policy() -> None:
    model = Net()
    policy = functools.partial(
        lambda_auto_wrap_policy,
        lambda_fn=lambda m: isinstance(m, nn.LayerNorm) or m is model.blockB,
    )
    assert _selected_names(model, policy) == {"blockA.leaf2", "blockB"}


def test_transformer_auto_wrap_policy() -> None:
    model = Net()
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    assert _selected_names(model, policy) == {"blockA", "blockB"}
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear})
    assert _selected_names(model, policy) == {
        "blockA.sub1.leaf1",
        "blockB.leaf3",
        "attn.out_proj",
        "layers.0",
        "layers.1",
    }


def test_size_based_selects_by_unclaimed_numel() -> None:
    """min 10: leaf1 (20) is claimed first, so sub1's remainder is 0 and it is skipped;
    blockA's remainder is 3 + 8 = 11; layers.1 (8) stays with layers, whose remainder 8 is
    too small; attn is a force leaf; the root keeps 144 - 31 - 10 - 15 = 88."""
    model = Net()
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=10)
    assert _selected_names(model, policy) == {
        "",
        "blockA",
        "blockA.sub1.leaf1",
        "blockB.leaf3",
        "layers.0",
    }


def test_size_based_min_20() -> None:
    model = Net()
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=20)
    assert _selected_names(model, policy) == {"", "blockA.sub1.leaf1"}


def test_size_based_default_threshold_selects_nothing() -> None:
    assert _selected_names(Net(), size_based_auto_wrap_policy) == set()


def test_size_based_force_leaf_modules() -> None:
    """Default: MultiheadAttention is not descended into, and so neither it nor out_proj is
    selected. Without force leaves out_proj (20) and then attn's remainder (60) are."""
    model = Net()
    policy = functools.partial(
        size_based_auto_wrap_policy, min_num_params=20, force_leaf_modules=set()
    )
    assert _selected_names(model, policy) == {
        "",
        "blockA.sub1.leaf1",
        "attn",
        "attn.out_proj",
    }


def test_size_based_exclude_wrap_modules() -> None:
    """layers (ModuleList) has a remainder of 23 >= 20 but is excluded by default."""
    model = Net()
    policy = functools.partial(
        size_based_auto_wrap_policy, min_num_params=20, exclude_wrap_modules=set()
    )
    assert _selected_names(model, policy) == {"", "blockA.sub1.leaf1", "layers"}


def test_size_based_defaults_are_torchs() -> None:
    assert size_based_auto_wrap_policy.FORCE_LEAF_MODULES == {  # type: ignore[attr-defined]  # function attribute
        nn.MultiheadAttention
    }
    assert size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES == {  # type: ignore[attr-defined]  # function attribute
        nn.ModuleList,
        nn.ModuleDict,
    }


def test_ignored_params_do_not_count_toward_parent_numel() -> None:
    """min 70: the root (144) qualifies; with attn (80) ignored it holds 64 and does not."""
    model = Net()
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=70)
    assert _selected_names(model, policy) == {""}
    assert _selected_names(model, policy, ignored=["attn"]) == set()
    # min 11: blockA's remainder is 11 with leaf2 counted; ignoring leaf2 leaves 3.
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=11)
    assert "blockA" in _selected_names(model, policy)
    assert "blockA" not in _selected_names(model, policy, ignored=["blockA.leaf2"])


def test_ignored_root_selects_nothing() -> None:
    assert _selected_names(Net(), always_wrap_policy, ignored=[""]) == set()


def _recording(
    model: nn.Module, inner: Callable[..., bool], calls: list[tuple[str, bool, int]]
) -> Callable[..., bool]:
    fqn_of = {module: fqn for fqn, module in model.named_modules()}

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        calls.append((fqn_of[module], recurse, nonwrapped_numel))
        return inner(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel)

    return policy


def test_numel_passed_is_post_order_and_subtracts_claimed_children() -> None:
    model = Net()
    calls: list[tuple[str, bool, int]] = []
    inner = functools.partial(size_based_auto_wrap_policy, min_num_params=10)
    _selected(model, _recording(model, inner, calls))
    assert calls == [
        ("", True, 144),
        ("blockA", True, 31),
        ("blockA.sub1", True, 20),
        ("blockA.sub1.leaf1", True, 20),
        ("blockA.sub1.leaf1", False, 20),
        ("blockA.sub1", False, 0),
        ("blockA.leaf2", True, 8),
        ("blockA", False, 11),
        ("blockB", True, 10),
        ("blockB.leaf3", True, 10),
        ("blockB.leaf3", False, 10),
        ("blockB", False, 0),
        ("attn", True, 80),
        ("layers", True, 23),
        ("layers.0", True, 15),
        ("layers.0", False, 15),
        ("layers.1", True, 8),
        ("layers", False, 8),
        ("", False, 88),
    ]


class Tied(nn.Module):
    """a.weight is b.weight (16 elements); c has 4: 20 distinct elements in total."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight
        self.c = nn.Linear(4, 1, bias=False)


def test_shared_parameters_counted_once() -> None:
    model = Tied()
    calls: list[tuple[str, bool, int]] = []
    inner = functools.partial(size_based_auto_wrap_policy, min_num_params=16)
    targets = _selected(model, _recording(model, inner, calls))
    assert _names(model, targets) == {"a", "b"}
    # The root sees the tied weight once (20, not 36) and, once claimed, none of it (4).
    assert calls[0] == ("", True, 20)
    assert calls[-1] == ("", False, 4)


def test_shared_module_visited_once() -> None:
    model = nn.Module()
    shared = nn.Linear(2, 2)
    model.p1 = Block(s=shared)
    model.p2 = Block(s=shared)
    calls: list[tuple[str, bool, int]] = []
    targets = _selected(model, _recording(model, always_wrap_policy, calls))
    assert _names(model, targets) == {"", "p1", "p2", "p1.s"}
    assert [call for call in calls if call[0] == "p1.s"] == [
        ("p1.s", True, 6),
        ("p1.s", False, 6),
    ]
    assert ("p2", False, 0) in calls  # p2's only parameters were claimed by the shared child


def test_as_policy_accepts_policies_and_functions_only() -> None:
    policy = ModuleWrapPolicy({Block})
    assert _as_policy(policy) is policy
    assert isinstance(_as_policy(always_wrap_policy), _Policy)
    with pytest.raises(TypeError, match="int"):
        _as_policy(42)  # type: ignore[arg-type]  # the wrong type is the point


def test_module_wrap_policy_as_function_policy_matches() -> None:
    model = Net()
    policy = ModuleWrapPolicy({Block, nn.LayerNorm})
    assert _selected_names(model, functools.partial(policy)) == {
        "blockA",
        "blockB",
        "blockA.leaf2",
    }


# --------------------------------------------------------------------- parity with torch FSDP


def _torch_selected_names(model: nn.Module, policy: Any, ignored: Iterable[str]) -> set[str]:
    """Modules torch's own ``_recursive_wrap`` would wrap, via a recording no-op wrapper."""
    from torch.distributed.fsdp.wrap import _recursive_wrap

    ignored_modules = {m for module in _modules(model, ignored) for m in module.modules()}
    wrapped: list[nn.Module] = []

    def record(module: nn.Module, **kwargs: Any) -> nn.Module:
        wrapped.append(module)
        return module

    _recursive_wrap(
        module=model,
        auto_wrap_policy=policy,
        wrapper_cls=record,
        ignored_modules=ignored_modules,
        ignored_params={p for m in ignored_modules for p in m.parameters()},
        only_wrap_children=False,
    )
    return _names(model, wrapped)


@pytest.mark.parametrize(
    "policy",
    [
        always_wrap_policy,
        functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, Sub)),
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block, nn.Linear}),
        *[
            functools.partial(size_based_auto_wrap_policy, min_num_params=n)
            for n in (1, 8, 10, 11, 15, 20, 23, 31, 70, 144, 145)
        ],
        *[
            functools.partial(
                size_based_auto_wrap_policy,
                min_num_params=n,
                force_leaf_modules=set(),
                exclude_wrap_modules=set(),
            )
            for n in (1, 8, 10, 11, 15, 20, 23, 31, 70, 144, 145)
        ],
    ],
)
@pytest.mark.parametrize("ignored", [(), ("blockA.sub1",), ("attn", "layers.0")])
def test_function_policies_match_torch(policy: Any, ignored: tuple[str, ...]) -> None:
    model = Net()
    assert _selected_names(model, policy, ignored) == _torch_selected_names(
        model, policy, ignored
    )


# --------------------------------------------------------------------------- enable_wrap / wrap


class _RecordingWrapper:
    def __init__(self) -> None:
        self.calls: list[tuple[nn.Module, dict[str, Any]]] = []

    def __call__(self, module: nn.Module, **kwargs: Any) -> nn.Module:
        self.calls.append((module, kwargs))
        return module


def test_wrap_outside_enable_wrap_returns_module_unchanged() -> None:
    layer = nn.Linear(2, 2)
    assert wrap(layer, strategy="NO_SHARD") is layer


def test_wrap_inside_enable_wrap_merges_overrides() -> None:
    wrapper = _RecordingWrapper()
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    with enable_wrap(wrapper_cls=wrapper, strategy="FULL_SHARD", limit_all_gathers=True):
        assert wrap(first) is first
        assert wrap(second, strategy="SHARD_GRAD_OP", mesh="m") is second
    assert wrapper.calls == [
        (first, {"strategy": "FULL_SHARD", "limit_all_gathers": True}),
        (second, {"strategy": "SHARD_GRAD_OP", "limit_all_gathers": True, "mesh": "m"}),
    ]
    after = nn.Linear(2, 2)
    assert wrap(after) is after
    assert len(wrapper.calls) == 2


def test_wrap_returns_what_the_wrapper_returns() -> None:
    replacement = nn.Identity()
    with enable_wrap(wrapper_cls=lambda module, **kwargs: replacement):
        assert wrap(nn.Linear(2, 2)) is replacement


def test_nested_enable_wrap_raises_and_outer_block_survives() -> None:
    outer = _RecordingWrapper()
    layer = nn.Linear(2, 2)
    with enable_wrap(wrapper_cls=outer, strategy="FULL_SHARD"):
        with pytest.raises(RuntimeError, match="nested"):
            with enable_wrap(wrapper_cls=_RecordingWrapper()):
                pass
        wrap(layer)
    assert outer.calls == [(layer, {"strategy": "FULL_SHARD"})]
    assert wrap(layer) is layer
    assert len(outer.calls) == 1


def test_enable_wrap_is_reset_after_an_exception() -> None:
    wrapper = _RecordingWrapper()
    with pytest.raises(KeyError):
        with enable_wrap(wrapper_cls=wrapper):
            raise KeyError("boom")
    layer = nn.Linear(2, 2)
    assert wrap(layer) is layer
    assert wrapper.calls == []
    with enable_wrap(wrapper_cls=wrapper):  # a new block may start
        wrap(layer)
    assert len(wrapper.calls) == 1
