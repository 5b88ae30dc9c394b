"""The package's modules import each other bottom-up: no circle among their imports, those for
type annotations only (under ``if TYPE_CHECKING:``) included, since a type that needs a circle to
be named is a layering the code hides rather than fixes; and no import hidden inside a function
to get around one."""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Set

import composable_shard

PACKAGE = pathlib.Path(composable_shard.__file__).parent


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


_PACKAGE_NAME = "composable_shard"


def _package_modules(node: ast.AST) -> List[str]:
    """The package's top-level modules an import statement names, relative (``from . import
    x``, ``from .x import y``) or absolute (``import composable_shard.x``, ``from
    composable_shard import x``, ``from composable_shard.x import y``); [] for other imports."""
    if isinstance(node, ast.ImportFrom):
        if node.level == 1 or (node.level == 0 and node.module is not None
                               and node.module.split(".")[0] == _PACKAGE_NAME):
            inner = (node.module or "").split(".")[0 if node.level == 1 else 1:]
            if inner and inner[0]:
                return [inner[0]]
            return [alias.name for alias in node.names]
    if isinstance(node, ast.Import):
        parts = [alias.name.split(".") for alias in node.names]
        return [p[1] for p in parts if p[0] == _PACKAGE_NAME and len(p) > 1]
    return []


def _runtime_imports(tree: ast.Module) -> Set[str]:
    """Package modules imported at module level, outside ``if TYPE_CHECKING:``."""
    found: Set[str] = set()
    for node in tree.body:
        if _is_type_checking_block(node):
            continue
        for sub in ast.walk(node):
            found.update(_package_modules(sub))
    return found


def _module_level_imports(tree: ast.Module) -> Set[str]:
    """Package modules imported at module level, ``if TYPE_CHECKING:`` blocks included."""
    return {name for node in tree.body for sub in ast.walk(node) for name in _package_modules(sub)}


def _imports_inside_functions(tree: ast.Module) -> List[int]:
    lines: List[int] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if _package_modules(sub):
                    lines.append(sub.lineno)
    return lines


def test_the_checks_see_every_form_of_package_import() -> None:
    """Planted sources: each form of importing a package module is an edge (and, inside a
    function, a hidden import); imports of other packages are not."""
    forms = {"from . import _a": {"_a"}, "from ._a import f": {"_a"}, "from ._a.sub import f": {"_a"},
             "import composable_shard._a": {"_a"}, "import composable_shard._a as m": {"_a"},
             "from composable_shard import _a": {"_a"}, "from composable_shard._a import f": {"_a"},
             "import torch.distributed": set(), "from torch import nn": set(), "import composable_shard": set()}
    for source, expected in forms.items():
        assert _runtime_imports(ast.parse(source)) == expected, source
        hidden = _imports_inside_functions(ast.parse(f"def f():\n    {source}\n"))
        assert hidden == ([2] if expected else []), source
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from composable_shard._a import A\n"
    assert _runtime_imports(ast.parse(typed)) == set()
    assert _module_level_imports(ast.parse(typed)) == {"_a"}  # a circle through it is still a circle


def _graph() -> Dict[str, Set[str]]:
    return {f.stem: _module_level_imports(ast.parse(f.read_text())) for f in sorted(PACKAGE.glob("*.py"))}


def test_no_import_circle() -> None:
    graph = _graph()
    assert {"_runtime_utils", "_flat_param", "_common_utils", "_traversal_utils"} <= set(graph)
    assert "_flat_param" in graph["_common_utils"]  # the walk below sees real edges
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


# The tiers of the layout issue 45 moves the package into (folders, lowest first): each module may
# import only from its own tier or lower ones. Today's flat package already keeps this order, so the
# moves are renames; an import that breaks it (the step reaching into setup, setup into state) fails
# here before it makes the layout impossible.
TIERS: Dict[str, int] = {
    **dict.fromkeys(["_torch_compat", "_tree_utils"], 0),  # base: torch seams and containers
    **dict.fromkeys(["api", "contract", "wrap"], 1),  # the vocabulary every folder uses
    **dict.fromkeys(["_collectives", "_streams", "_shard_math", "_watch", "_interop", "_flat_param", "_common_utils",
                     "_traversal_utils", "_divergence", "_runtime_utils", "_mixed_precision"], 2),  # the step
    **dict.fromkeys(["_init_utils", "_validation", "_data_parallel", "_subclass", "_fsdp2_compat", "_apply_guard"], 3),
    **dict.fromkeys(["_sharded_tensor", "_load_transaction", "_unshard_params", "_state_dict", "_optim_state_dict",
                     "_checkpoint_io"], 4),  # state in dicts and on disk
    **dict.fromkeys(["_describe", "_plan_profile"], 5),  # what describe and plan need
    **dict.fromkeys(["__init__", "__main__", "fully_shard", "replicate", "checkpoint", "comm_hooks", "optim", "plan"], 6),
}


def test_every_module_imports_only_its_tier_or_lower() -> None:
    graph = _graph()
    assert set(graph) == set(TIERS), (set(graph) ^ set(TIERS))  # a new module gets a tier
    upward = sorted(f"{name} (tier {TIERS[name]}) imports {dep} (tier {TIERS[dep]})"
                    for name, deps in graph.items() for dep in deps if TIERS[dep] > TIERS[name])
    assert upward == [], upward
