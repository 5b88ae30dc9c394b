"""``tools/mutants.py``'s table still applies to the code: each mutant's original text occurs exactly
once in its file, and its replacement differs. A row whose line was rewritten reports STALE when run
and tests nothing; four had drifted so before this check."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def _mutants_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("composable_shard_tools_mutants", REPO / "tools" / "mutants.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


def test_every_mutant_applies_once() -> None:
    mutants = _mutants_module().MUTANTS
    stale = []
    for mutant in mutants:
        path = REPO / mutant.file
        count = path.read_text().count(mutant.original) if path.is_file() else -1
        if count != 1 or mutant.original == mutant.replacement:
            stale.append(f"{mutant.name}: {mutant.file} holds its original {count} time(s)")
    names = [m.name for m in mutants]
    assert len(set(names)) == len(names), "duplicate mutant names"
    assert not stale, "mutant rows that no longer apply (update the row with the line it mutates):\n  " + \
        "\n  ".join(stale)
