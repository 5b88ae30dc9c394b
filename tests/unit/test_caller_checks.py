"""The caller checks ([Note: Caller checks] in ``composable_shard/_base/callers.py``): the entry
points the package's metadata registers, and how :func:`check_callers` finds the code they know.

Without these: an install whose metadata lost the entry points would silently drop every refusal
an integration makes (Lightning's ModelParallelStrategy writing checkpoints it cannot resume,
torch's own pipelining stage leaving gradients unreduced); a prefix matched as a plain string
prefix would run Lightning's check inside ``lightning_utilities`` or a user's ``lightningx``; a
check that imported Lightning would break every standalone ``pytorch_lightning`` install.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any, Callable, Dict, List, Tuple

import pytest

from composable_shard._base import callers
from composable_shard._base.callers import check_callers, registered_prefixes

EXPECTED = {"lightning": "composable_shard.integrations._lightning_checks",
            "pytorch_lightning": "composable_shard.integrations._lightning_checks",
            "lightning_fabric": "composable_shard.integrations._lightning_checks",
            "torch.distributed.pipelining": "composable_shard.integrations.pipelining"}


def test_caller_checks_are_registered() -> None:
    """Every expected prefix is registered, each entry loads to a ``check_caller`` of an
    integration module, and nothing else is registered."""
    assert set(registered_prefixes()) == set(EXPECTED), registered_prefixes()
    for prefix, module in EXPECTED.items():
        check = callers._load(prefix)
        assert callable(check) and check.__name__ == "check_caller" and check.__module__ == module, (prefix, check)


def _run_as(module: str, body: Callable[[], Any]) -> Any:
    """Call ``body`` from a function whose code belongs to the module named ``module`` (its
    globals' ``__name__``): what a running function's module is, as the frames say it."""
    namespace: Dict[str, Any] = {"__name__": module, "body": body}
    exec(compile("def save_checkpoint():\n    return body()\n", f"<{module}>", "exec"), namespace)
    return namespace["save_checkpoint"]()


@pytest.mark.parametrize("module, refused", [
    ("lightning.pytorch.strategies.model_parallel", True),
    ("lightning.fabric.strategies.model_parallel", True),
    ("pytorch_lightning.strategies.model_parallel", True),
    ("lightning_fabric.strategies.model_parallel", True),
    ("lightning.pytorch.strategies.ddp", False),  # Lightning's, but not ModelParallelStrategy's
    ("lightningx.strategies.model_parallel", False),  # not under a registered prefix
    ("my_code", False),
])
def test_check_callers_runs_the_check_of_the_running_code(module: str, refused: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A function named like Lightning's checkpoint call, running in ``module``, reaching
    ``check_callers``: refused exactly when ``module`` is ModelParallelStrategy's (under one of
    the registered prefixes, matched by dotted name, not by string prefix). The prefixes' modules
    count as imported (the walk is skipped otherwise)."""
    for prefix in EXPECTED:
        monkeypatch.setitem(sys.modules, prefix, sys.modules.get(prefix) or type(sys)(prefix))
    seen: List[Tuple[str, ...]] = []

    def reach() -> None:
        check_callers(object(), "traverse")
        seen.append(("passed",))

    if refused:
        with pytest.raises(RuntimeError, match="ModelParallelStrategy cannot checkpoint"):
            _run_as(module, reach)
    else:
        _run_as(module, reach)
        assert seen == [("passed",)]
    _run_as(module, lambda: check_callers(object(), "first_forward"))  # a point the Lightning check leaves alone


def test_the_lightning_check_loads_without_lightning() -> None:
    """A standalone ``pytorch_lightning`` install has no ``lightning`` package: the check its
    entry point loads must import none (in a fresh interpreter where importing Lightning fails),
    and still refuse."""
    script = textwrap.dedent("""
        import sys
        for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
            sys.modules[name] = None  # importing it raises ImportError
        from composable_shard._base import callers
        check = callers._load("pytorch_lightning")
        class F:
            module, name, qualname = "pytorch_lightning.strategies.model_parallel", "save_checkpoint", "save_checkpoint"
        try:
            check(object(), "state_dict", [F()])
        except RuntimeError as e:
            print("refused:", "ShardedStrategy" in str(e))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "refused: True", (result.stdout, result.stderr)
