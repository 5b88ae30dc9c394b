"""Every place the package reads Python frames, listed from the syntax tree.

Reading another program's frames ties the package to that program's local variable names in one
version (FSDP1, FSDP2 and torch's composable APIs read none). The package reads them in one
function, ``_base/torch_compat.running_functions`` ([Note: Caller checks] in ``_base/callers.py``):
torch's wrappers, torch's state-dict options and the integrations' refusals all ask it. A frame
read anywhere else fails here, naming the file, line and function, so a new seam has to be argued
for and listed instead of slipping in.

What counts as a frame access: the frame attributes (``f_back``, ``f_locals``, ``f_globals``,
``f_code``, ``f_builtins``, ``f_lineno``, ``f_lasti``, ``f_trace``), a traceback's, generator's or
coroutine's frame (``tb_frame``, ``gi_frame``, ``cr_frame``, ``ag_frame``), and the functions that
return frames or stacks (``sys._getframe``, ``sys._current_frames``, ``inspect.currentframe``,
``inspect.stack``, ``inspect.trace``, ``inspect.getouterframes``, ``inspect.getinnerframes``,
``inspect.getframeinfo``, ``traceback.extract_stack``, ``traceback.walk_stack``,
``traceback.print_stack``, ``traceback.format_stack``), however imported or aliased.
"""

from __future__ import annotations

import ast
import pathlib
from typing import List, Set, Tuple

import composable_shard

PACKAGE = pathlib.Path(composable_shard.__file__).parent

# The one listed site: module path (relative to the package) and the function's qualified name.
ALLOWED = {("_base/torch_compat.py", "running_functions")}

FRAME_ATTRIBUTES = frozenset({"f_back", "f_locals", "f_globals", "f_code", "f_builtins", "f_lineno", "f_lasti",
                              "f_trace", "tb_frame", "gi_frame", "cr_frame", "ag_frame"})
FRAME_FUNCTIONS = {"sys": {"_getframe", "_current_frames"},
                   "inspect": {"currentframe", "stack", "trace", "getouterframes", "getinnerframes", "getframeinfo"},
                   "traceback": {"extract_stack", "walk_stack", "print_stack", "format_stack"}}


class _Finder(ast.NodeVisitor):
    """Frame accesses in one module: (line, qualified name of the enclosing function, what)."""

    def __init__(self) -> None:
        self.found: List[Tuple[int, str, str]] = []
        self.scope: List[str] = []
        self.module_aliases = {name: name for name in FRAME_FUNCTIONS}  # alias -> module (import sys as s)
        self.function_aliases: dict = {}  # alias -> "module.function" (from inspect import currentframe as cf)

    def _where(self) -> str:
        return ".".join(self.scope) or "<module>"

    def _scoped(self, node: ast.AST, name: str) -> None:
        self.scope.append(name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._scoped(node, node.name)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._scoped(node, node.name)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scoped(node, node.name)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.generic_visit(node)  # a lambda belongs to the function it is written in

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name in FRAME_FUNCTIONS:
                self.module_aliases[alias.asname or alias.name] = alias.name
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if node.module in FRAME_FUNCTIONS and alias.name in FRAME_FUNCTIONS[node.module]:
                self.function_aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                self.found.append((node.lineno, self._where(), f"from {node.module} import {alias.name}"))
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in FRAME_ATTRIBUTES:
            self.found.append((node.lineno, self._where(), f".{node.attr}"))
        if isinstance(node.value, ast.Name) and node.value.id in self.module_aliases:
            module = self.module_aliases[node.value.id]
            if node.attr in FRAME_FUNCTIONS[module]:
                self.found.append((node.lineno, self._where(), f"{module}.{node.attr}"))
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in self.function_aliases:
            self.found.append((node.lineno, self._where(), self.function_aliases[node.id]))

    def visit_Call(self, node: ast.Call) -> None:
        # getattr(frame, "f_locals"), getattr(sys, "_getframe"): the attribute named by a string
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and (
                    name.value in FRAME_ATTRIBUTES or any(name.value in f for f in FRAME_FUNCTIONS.values())):
                self.found.append((node.lineno, self._where(), f"getattr(..., {name.value!r})"))
        self.generic_visit(node)


def frame_accesses(source: str) -> List[Tuple[int, str, str]]:
    finder = _Finder()
    finder.visit(ast.parse(source))
    return finder.found


def test_the_package_reads_frames_in_one_listed_function() -> None:
    """Every frame access in the package lies in a listed function, and every listed function
    reads frames (a listed site that no longer reads any is a stale exemption)."""
    outside: List[str] = []
    sites: Set[Tuple[str, str]] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for line, function, what in frame_accesses(path.read_text()):
            sites.add((relative, function))
            if (relative, function) not in ALLOWED:
                outside.append(f"{relative}:{line} in {function}: {what}")
    assert not outside, ("frames read outside torch_compat.running_functions (use it, or list and argue a new "
                         "seam in this test and the torch_compat docstring):\n" + "\n".join(outside))
    assert sites == ALLOWED, f"listed sites that read no frame: {sorted(ALLOWED - sites)}"
    assert len(ALLOWED) <= 2


def test_the_finder_sees_every_form_of_frame_access() -> None:
    """Planted sources: each way of reaching a frame is found, in the function it is written in;
    code that only looks like it (an attribute named ``frame``, a local called ``stack``) is not."""
    planted = {
        "import sys\ndef f():\n    return sys._getframe(1)": "sys._getframe",
        "import sys as s\ndef f():\n    return s._getframe()": "sys._getframe",
        "import inspect\ndef f():\n    return inspect.currentframe()": "inspect.currentframe",
        "import inspect\ndef f():\n    return inspect.stack()": "inspect.stack",
        "from inspect import currentframe as cf\ndef f():\n    return cf()": "inspect.currentframe",
        "import traceback\ndef f():\n    return traceback.extract_stack()": "traceback.extract_stack",
        "def f(frame):\n    return frame.f_back": ".f_back",
        "def f(frame):\n    return frame.f_locals['self']": ".f_locals",
        "def f(g):\n    return g.gi_frame": ".gi_frame",
        "def f(e):\n    return e.__traceback__.tb_frame": ".tb_frame",
        "def f(frame):\n    return getattr(frame, 'f_globals')": "getattr(..., 'f_globals')",
        "class C:\n    def m(self, frame):\n        return (lambda: frame.f_code)()": ".f_code",
    }
    for source, what in planted.items():
        found = frame_accesses(source)
        assert any(w == what for _, _, w in found), (source, found)
        assert all(function in ("f", "C.m") or what.startswith("from ") for _, function, what in found), (source, found)
    innocent = "def f(self, stack, frame):\n    self.frame = frame\n    return stack.pop(), frame.shape, self.f_count"
    assert frame_accesses(innocent) == []
