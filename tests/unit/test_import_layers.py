"""The package's modules import each other bottom-up, and its folders say so.

- No circle among the modules' imports, those for type annotations only (under
  ``if TYPE_CHECKING:``) included, since a type that needs a circle to be named is a layering the
  code hides rather than fixes; and no import hidden inside a function to get around one.
- Folders by concern, lowest first (see each folder's ``__init__`` docstring): ``_base`` <
  the vocabulary at the root (``api``, ``contract``, ``wrap``) < ``_runtime`` (the step) <
  ``_setup`` (apply time) < ``_state`` (dicts and disk) < ``_planning`` < the public surface at
  the root < ``integrations``. A module imports only from its own tier or lower ones, so no folder
  imports a higher one and no two folders import each other.
- A folder's ``__init__`` holds a docstring only: re-exports there would be imports the table
  below does not see. No folder holds more than 12 modules.
"""

from __future__ import annotations

import ast
import pathlib
import re
from typing import Dict, List, Optional, Set

import composable_shard

PACKAGE = pathlib.Path(composable_shard.__file__).parent
_PACKAGE_NAME = "composable_shard"

# Folder -> tier; root modules are listed one by one, so a new one has to say where it belongs.
FOLDER_TIERS: Dict[str, int] = {"_base": 0, "_runtime": 2, "_setup": 3, "_state": 4, "_planning": 5,
                                "integrations": 7}
ROOT_TIERS: Dict[str, int] = {
    **dict.fromkeys(["api", "contract", "wrap"], 1),  # the vocabulary every folder uses
    **dict.fromkeys(["__init__", "__main__", "fully_shard", "replicate", "checkpoint", "comm_hooks", "optim", "plan",
                     "_checkpoint_io"], 6),  # the public surface (and the documented path of the safe DCP reader)
}
MAX_MODULES_PER_FOLDER = 12


def _dotted(path: pathlib.Path, root: pathlib.Path = PACKAGE) -> str:
    """``composable_shard/_runtime/hooks.py`` -> ``composable_shard._runtime.hooks``; a folder's
    ``__init__.py`` is the folder's own name."""
    parts = [_PACKAGE_NAME, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _all_modules() -> Dict[str, pathlib.Path]:
    return {_dotted(f): f for f in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _package_targets(node: ast.AST, importer: str, is_package: bool, known: Set[str]) -> List[str]:
    """The package's modules an import statement in module ``importer`` names: relative (``from
    . import x``, ``from ..x.y import z``) or absolute (``import composable_shard.x.y``, ``from
    composable_shard.x import y``). ``from P import name`` names the submodule ``P.name`` when
    one exists, else ``P`` itself. [] for other imports."""
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = importer.split(".") if is_package else importer.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            source = ".".join(base + (node.module.split(".") if node.module else []))
        elif node.module is not None and node.module.split(".")[0] == _PACKAGE_NAME:
            source = node.module
        else:
            return []
        targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source for alias in node.names]
        return sorted(set(targets))
    if isinstance(node, ast.Import):
        return sorted({alias.name for alias in node.names
                       if alias.name.split(".")[0] == _PACKAGE_NAME and alias.name != _PACKAGE_NAME})
    return []


def _imports(path: pathlib.Path, known: Set[str], type_checking: bool = True, root: pathlib.Path = PACKAGE) -> Set[str]:
    """Package modules imported at module level; ``if TYPE_CHECKING:`` blocks included unless
    ``type_checking`` is False."""
    name, tree = _dotted(path, root), ast.parse(path.read_text())
    found: Set[str] = set()
    for node in tree.body:
        if _is_type_checking_block(node) and not type_checking:
            continue
        for sub in ast.walk(node):
            found.update(_package_targets(sub, name, path.name == "__init__.py", known))
    return found - {name}


def _imports_inside_functions(path: pathlib.Path, known: Set[str], root: pathlib.Path = PACKAGE) -> List[int]:
    name, tree = _dotted(path, root), ast.parse(path.read_text())
    return [sub.lineno for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for sub in ast.walk(node) if _package_targets(sub, name, path.name == "__init__.py", known)]


def _graph() -> Dict[str, Set[str]]:
    modules = _all_modules()
    return {name: _imports(path, set(modules)) for name, path in modules.items()}


def _tier(module: str) -> Optional[int]:
    parts = module.split(".")[1:]
    if not parts:
        return ROOT_TIERS["__init__"]
    if len(parts) == 1 and (PACKAGE / f"{parts[0]}.py").exists():
        return ROOT_TIERS.get(parts[0])
    return FOLDER_TIERS.get(parts[0])


def _folder(module: str) -> str:
    parts = module.split(".")[1:]
    return parts[0] if parts and (PACKAGE / parts[0]).is_dir() else "(root)"


def _circle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    done: Set[str] = set()

    def visit(name: str, path: List[str]) -> Optional[List[str]]:
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        for dep in sorted(graph.get(name, ())):
            found = visit(dep, path + [name])
            if found:
                return found
        done.add(name)
        return None

    for name in sorted(graph):
        found = visit(name, [])
        if found:
            return found
    return None


def test_the_checks_see_every_form_of_package_import(tmp_path: pathlib.Path) -> None:
    """Planted sources, read as if they were ``composable_shard/_runtime/hooks.py``: each form of
    importing a package module is an edge to the right module (and, inside a function, a hidden
    import); imports of other packages are not."""
    known = {"composable_shard", "composable_shard.api", "composable_shard._runtime",
             "composable_shard._runtime.flat_param", "composable_shard._runtime.hooks", "composable_shard._base",
             "composable_shard._base.tree"}
    flat, tree, api = "composable_shard._runtime.flat_param", "composable_shard._base.tree", "composable_shard.api"
    forms = {"from . import flat_param": {flat}, "from . import flat_param as _f": {flat},
             "from .flat_param import F": {flat}, "from .._base.tree import t": {tree},
             "from .._base import tree as _tree": {tree}, "from ..api import M": {api}, "from .. import api": {api},
             "from .. import fully_shard": {"composable_shard"}, "import composable_shard._base.tree as t": {tree},
             "from composable_shard._runtime import flat_param": {flat}, "from composable_shard.api import M": {api},
             "import torch.distributed": set(), "from torch import nn": set(), "import composable_shard": set()}
    root = tmp_path / "composable_shard"
    (root / "_runtime").mkdir(parents=True)
    planted = root / "_runtime" / "hooks.py"
    for source, expected in forms.items():
        planted.write_text(source + "\n")
        assert _imports(planted, known, root=root) == expected, source
        planted.write_text(f"def f():\n    {source}\n")
        assert _imports_inside_functions(planted, known, root=root) == ([2] if expected else []), source
    planted.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .flat_param import F\n")
    assert _imports(planted, known, type_checking=False, root=root) == set()
    assert _imports(planted, known, root=root) == {flat}  # a circle through it is still a circle


def test_no_import_circle() -> None:
    graph = _graph()
    hooks, flat, state = ("composable_shard._runtime.hooks", "composable_shard._runtime.flat_param",
                          "composable_shard._runtime.module_state")
    assert {hooks, flat, state} <= set(graph)
    assert flat in graph[state] and state in graph[hooks]  # the walk below sees real edges
    assert _circle(graph) is None, " -> ".join(_circle(graph) or [])
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_package_import_inside_a_function() -> None:
    modules = _all_modules()
    hidden = {name: _imports_inside_functions(path, set(modules)) for name, path in modules.items()}
    assert {name: lines for name, lines in hidden.items() if lines} == {}


def test_every_module_imports_only_its_tier_or_lower() -> None:
    graph = _graph()
    untiered = sorted(name for name in graph if _tier(name) is None)
    assert untiered == [], f"give these a tier (FOLDER_TIERS or ROOT_TIERS): {untiered}"
    upward = sorted(f"{name} (tier {_tier(name)}) imports {dep} (tier {_tier(dep)})"
                    for name, deps in graph.items() for dep in deps if _tier(dep) > _tier(name))  # type: ignore[operator]
    assert upward == [], upward
    folders: Dict[str, Set[str]] = {}
    for name, deps in graph.items():
        folders.setdefault(_folder(name), set()).update(_folder(d) for d in deps if _folder(d) != _folder(name))
    folders.pop("(root)")  # the root holds two tiers (vocabulary below the folders, surface above)
    for deps in folders.values():
        deps.discard("(root)")
    assert _circle(folders) is None, " -> ".join(_circle(folders) or [])


def test_folders_are_small_and_their_inits_import_nothing() -> None:
    modules = _all_modules()
    sizes: Dict[str, int] = {}
    for name in modules:
        sizes[_folder(name)] = sizes.get(_folder(name), 0) + 1
    assert set(sizes) == set(FOLDER_TIERS) | {"(root)"}
    assert {f: n for f, n in sizes.items() if n > MAX_MODULES_PER_FOLDER} == {}
    for folder in set(FOLDER_TIERS) - {"integrations"}:
        init = PACKAGE / folder / "__init__.py"
        tree = ast.parse(init.read_text())
        assert ast.get_docstring(tree), f"{folder}/__init__.py: say what lives here and what it may import"
        assert len(tree.body) == 1, f"{folder}/__init__.py holds a docstring only (it re-exports nothing)"


def test_the_runtime_folder_lists_its_modules_lowest_first() -> None:
    """``_runtime/__init__``'s docstring lists the step's modules so that each imports only ones
    listed before it: the reading order of the folder is its import order."""
    doc = ast.get_docstring(ast.parse((PACKAGE / "_runtime" / "__init__.py").read_text())) or ""
    listed = [f"composable_shard._runtime.{m}" for m in re.findall(r"^- ``(\w+)\.py``", doc, flags=re.M)]
    graph = _graph()
    assert sorted(listed) == sorted(n for n in graph if _folder(n) == "_runtime" and n != "composable_shard._runtime")
    later = {name: set(listed[i:]) for i, name in enumerate(listed)}
    wrong = sorted(f"{name} imports {dep}, listed after it" for name in listed for dep in graph[name] & later[name])
    assert wrong == [], wrong
