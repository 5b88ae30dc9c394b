"""The package's modules import each other bottom-up: no circle among the imports that run,
and no import hidden inside a function to get around one (imports for type annotations only,
under ``if TYPE_CHECKING:``, do not run and may point anywhere)."""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Set

import composable_shard

PACKAGE = pathlib.Path(composable_shard.__file__).parent


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _runtime_imports(tree: ast.Module) -> Set[str]:
    """Package modules imported at module level, outside ``if TYPE_CHECKING:``."""
    found: Set[str] = set()
    for node in tree.body:
        if _is_type_checking_block(node):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.ImportFrom) and sub.level == 1:
                if sub.module:
                    found.add(sub.module.split(".")[0])
                else:
                    found.update(alias.name for alias in sub.names)
    return found


def _imports_inside_functions(tree: ast.Module) -> List[int]:
    lines: List[int] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom) and sub.level == 1:
                    lines.append(sub.lineno)
    return lines


def _graph() -> Dict[str, Set[str]]:
    return {f.stem: _runtime_imports(ast.parse(f.read_text())) for f in sorted(PACKAGE.glob("*.py"))}


def test_no_import_circle() -> None:
    graph = _graph()
    assert {"_runtime_utils", "_flat_param", "_common_utils", "_traversal_utils"} <= set(graph)
    assert "_common_utils" in graph["_flat_param"]  # the walk below sees real edges
    done: Set[str] = set()

    def visit(name: str, path: List[str]) -> None:
        if name in path:
            raise AssertionError(f"import circle: {' -> '.join(path[path.index(name):] + [name])}")
        if name in done:
            return
        for dep in sorted(graph.get(name, ())):
            visit(dep, path + [name])
        done.add(name)

    for name in graph:
        visit(name, [])


def test_no_package_import_inside_a_function() -> None:
    hidden = {f.name: _imports_inside_functions(ast.parse(f.read_text())) for f in sorted(PACKAGE.glob("*.py"))}
    assert {name: lines for name, lines in hidden.items() if lines} == {}
