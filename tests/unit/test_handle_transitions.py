"""A handle's training state changes only through ``FlatParamHandle.enter`` and the one table of
allowed transitions (``flat_param.TRANSITIONS``); an illegal change raises naming both states."""

from __future__ import annotations

import ast
import itertools
import pathlib

import pytest
import torch
import torch.nn as nn

import composable_shard
from composable_shard._runtime.flat_param import TRANSITIONS, FlatParamHandle, HandleTrainingState

PACKAGE = pathlib.Path(composable_shard.__file__).parent


def _handle() -> FlatParamHandle:
    module = nn.Linear(3, 2)
    return FlatParamHandle(list(module.parameters()), module, "lin", rank=0, world_size=1,
                           compute_device=torch.device("cpu"))


_S = HandleTrainingState
# The step's lifecycle, written out from [Note: Life of a parameter] and [Note: Recomputation in
# backward] (not read from the code under test): what may follow each state.
_ALLOWED = {
    (_S.IDLE, _S.FORWARD), (_S.FORWARD, _S.IDLE),  # a forward, or one that raised
    (_S.IDLE, _S.BACKWARD_PRE), (_S.BACKWARD_PRE, _S.BACKWARD_POST),  # a backward
    (_S.BACKWARD_PRE, _S.IDLE), (_S.BACKWARD_POST, _S.IDLE),  # its end (or the recovery from a raise)
    (_S.IDLE, _S.SUMMON_FULL_PARAMS), (_S.SUMMON_FULL_PARAMS, _S.IDLE),  # unshard_params
    # a recomputation inside a backward starts from where the handle is and returns there
    (_S.IDLE, _S.RECOMPUTE), (_S.BACKWARD_PRE, _S.RECOMPUTE), (_S.BACKWARD_POST, _S.RECOMPUTE),
    (_S.RECOMPUTE, _S.IDLE), (_S.RECOMPUTE, _S.BACKWARD_PRE), (_S.RECOMPUTE, _S.BACKWARD_POST),
}


def test_the_table_is_the_lifecycle() -> None:
    assert set(TRANSITIONS) == set(HandleTrainingState)
    table = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
    assert table == _ALLOWED, f"allowed beyond the lifecycle: {table - _ALLOWED}; missing: {_ALLOWED - table}"


@pytest.mark.parametrize("start,to", list(itertools.product(HandleTrainingState, HandleTrainingState)))
def test_enter_follows_the_lifecycle(start: HandleTrainingState, to: HandleTrainingState) -> None:
    handle = _handle()
    handle.training_state = start  # the fixture's starting point (the check below is on enter)
    if to is start or (start, to) in _ALLOWED:
        handle.enter(to, "test")
        assert handle.training_state is to
    else:
        with pytest.raises(RuntimeError, match=f"illegal transition {start.name} -> {to.name} in test"):
            handle.enter(to, "test")
        assert handle.training_state is start


def test_expect_is_checked_too() -> None:
    handle = _handle()
    handle.enter(HandleTrainingState.FORWARD, "pre_forward")
    with pytest.raises(RuntimeError, match="FORWARD -> IDLE in post_forward \\(expected BACKWARD_PRE\\)"):
        handle.enter(HandleTrainingState.IDLE, "post_forward", expect=(HandleTrainingState.BACKWARD_PRE,))


def _assignments_of_training_state(source: str) -> list:
    """Lines assigning ``<x>.training_state`` where ``<x>`` names a handle (``handle``, ``h``,
    ``target``, ``self``, ``*.handle``), outside ``FlatParamHandle.enter`` and ``__init__``."""
    found = []
    tree = ast.parse(source)
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)] + [tree]:
        for node in ast.walk(cls):
            if isinstance(node, ast.FunctionDef) and node.name in ("enter", "__init__") and cls is not tree:
                for sub in ast.walk(node):
                    sub._cs_exempt = True  # type: ignore[attr-defined]
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) or getattr(node, "_cs_exempt", False):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr == "training_state":
                base = t.value
                name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
                if name in ("handle", "h", "target", "self"):
                    found.append(node.lineno)
    return found


def test_checker_finds_a_planted_assignment() -> None:
    planted = ("def f(handle, s):\n    handle.training_state = 1\n    s.handle.training_state = 2\n"
               "    s.training_state = 3\n"
               "class FlatParamHandle:\n    def enter(self, to):\n        self.training_state = to\n")
    assert _assignments_of_training_state(planted) == [2, 3]


def test_no_handle_state_is_assigned_outside_enter() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        lines = _assignments_of_training_state(text)
        if path.relative_to(PACKAGE).as_posix() == "_runtime/flat_param.py":  # __init__ sets the first state; enter every later one
            lines = [n for n in lines if "self.training_state: HandleTrainingState" not in text.splitlines()[n - 1]]
        if lines:
            offenders[str(path.relative_to(PACKAGE))] = lines
    assert not offenders, f"handle states assigned outside FlatParamHandle.enter: {offenders}"
