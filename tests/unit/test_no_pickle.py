"""Nothing in ``composable_shard/`` unpickles what another rank or a file supplies (issue 19,
item 4): no ``*_object`` collective (``torch.distributed``'s unpickle what peers send), no
``pickle.load``/``loads``/``Unpickler``, no ``torch.load`` without ``weights_only=True``, no
other unpickler (``dill``, ``cloudpickle``, ``joblib``, ``marshal.load``).

The check reads each file's syntax tree (issue 34, item 5), so a docstring or comment that
names ``torch.load`` never counts, and a call always does, however the name was imported
(``import pickle as p``, ``from pickle import loads``) or reached (``x._unpickler(f).load()``:
any callable whose name contains "unpickl", and any class deriving from such a class).
References count too (``fn = pickle.loads``): what is passed around is called somewhere.
The exemptions are listed in ``_EXEMPT`` by file, function and kind; each must still match,
so none outlives the code it was written for. It also fails on a call added to a path no test
exercises.
"""

from __future__ import annotations

import ast
import pathlib
import re
from typing import Dict, List, NamedTuple, Optional, Set

import pytest

import composable_shard
from tests._source import parse_quietly

PACKAGE = pathlib.Path(composable_shard.__file__).parent

_PICKLE_MODULES = {"pickle", "_pickle", "cPickle"}
_PICKLE_LOADERS = {"load", "loads", "Unpickler"}  # of a pickle module
_TORCH_LOADERS = {"torch.load", "torch.serialization.load"}
_OTHER_UNPICKLERS = {"dill", "cloudpickle", "joblib", "shelve"}  # modules whose loading unpickles
_OBJECT_COLLECTIVE = re.compile(r"\w+_object(_list)?")  # all_gather_object, broadcast_object_list, ...

# [Note: Unpickling exemptions] Each entry is (file, qualified scope, kind); nothing else in the
# package may unpickle. Kept narrow on purpose: a new unpickling call anywhere else, even in
# the same file, fails the test.
_EXEMPT = {
    # The allow-list ``.metadata`` reader: a ``pickle.Unpickler`` whose ``find_class`` resolves
    # only DCP's metadata classes, sizes, dtypes and paths (refusals tested in test_checkpoint_crash).
    ("_state/checkpoint_files.py", "_MetadataUnpickler", "unpickler"),
    ("_state/checkpoint_files.py", "SafeFileSystemReader.read_metadata", "unpickler"),
}


class Finding(NamedTuple):
    line: int
    scope: str  # qualified name of the enclosing class/function ("" at module level)
    kind: str  # "unpickler", "pickle.load", "torch.load", "object collective", "another unpickler"
    code: str


class _Checker(ast.NodeVisitor):
    """Collects the unpickling uses of one module (see the module docstring)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.aliases: Dict[str, str] = {}  # local name -> dotted origin, from imports
        self.unpickler_classes: Set[str] = set()  # classes of this module deriving from an unpickler
        self.scope: List[str] = []
        self.findings: List[Finding] = []
        self.called: Set[int] = set()  # id() of expressions already judged as a call's function

    # ------------------------------------------------------------------ names
    def _dotted(self, node: ast.AST) -> Optional[str]:
        """``a.b.c`` with ``a`` replaced by what it was imported as; None for other expressions."""
        parts: List[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return ".".join(["<expr>"] + parts[::-1]) if parts else None
        root = self.aliases.get(node.id, node.id)
        return ".".join([root] + parts[::-1])

    def _judge(self, dotted: Optional[str]) -> Optional[str]:
        """The kind of unpickling ``dotted`` names, if any."""
        if dotted is None:
            return None
        parts = dotted.split(".")
        last = parts[-1]
        if "unpickl" in last.lower() or last in self.unpickler_classes:
            return "unpickler"
        if len(parts) >= 2 and parts[-2] in _PICKLE_MODULES and last in _PICKLE_LOADERS:
            return "pickle.load"
        if dotted in _TORCH_LOADERS:
            return "torch.load"
        if parts[0] in _OTHER_UNPICKLERS or (parts[0] == "marshal" and last in ("load", "loads")):
            return "another unpickler"
        if _OBJECT_COLLECTIVE.fullmatch(last):
            return "object collective"
        return None

    def _report(self, node: ast.AST, kind: str) -> None:
        code = ast.get_source_segment(self.source, node) or ""
        self.findings.append(Finding(getattr(node, "lineno", 0), ".".join(self.scope), kind, code.splitlines()[0]))

    # ------------------------------------------------------------------ imports
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                self.aliases.setdefault(alias.name.split(".")[0], alias.name.split(".")[0])
            if alias.name.split(".")[0] in _OTHER_UNPICKLERS:
                self._report(node, "another unpickler")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        for alias in node.names:
            self.aliases[alias.asname or alias.name] = f"{module}.{alias.name}" if module else alias.name
        if module.split(".")[0] in _OTHER_UNPICKLERS:
            self._report(node, "another unpickler")

    # ------------------------------------------------------------------ scopes
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        if any(self._judge(self._dotted(base)) == "unpickler" for base in node.bases):
            self.unpickler_classes.add(node.name)  # its instances unpickle: calling it counts below
        self.generic_visit(node)  # bases included: deriving from an unpickler is a use of it
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    # ------------------------------------------------------------------ uses
    def visit_Call(self, node: ast.Call) -> None:
        dotted = self._dotted(node.func)
        kind = self._judge(dotted)
        if kind == "torch.load" and any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and
                                        k.value.value is True for k in node.keywords):
            kind = None  # torch.load(..., weights_only=True): tensors and plain data only
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2:
            target, name = self._dotted(node.args[0]), node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and target is not None:
                kind = kind or self._judge(f"{target}.{name.value}")
        if kind is not None:
            self._report(node, kind)
        self.called.add(id(node.func))
        self.generic_visit(node)

    def _reference(self, node: ast.expr) -> None:
        if id(node) in self.called:  # judged as a call above
            return
        kind = self._judge(self._dotted(node))
        if kind is not None and kind != "object collective":  # ``fn = pickle.loads``: called elsewhere
            self._report(node, kind)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if id(node) in self.called:
            self.generic_visit(node)
            return
        before = len(self.findings)
        self._reference(node)
        if len(self.findings) == before:  # ``pickle.loads.__call__``: judged at its innermost name
            self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in self.aliases and node.id != self.aliases[node.id].split(".")[0]:
            self._reference(node)  # a from-imported loader (``from pickle import loads``), used as a value


def unpickling_uses(source: str) -> List[Finding]:
    """Every unpickling use in the module ``source`` (see the module docstring)."""
    checker = _Checker(source)
    checker.visit(parse_quietly(source))
    return checker.findings


def test_package_has_no_unpickling_call() -> None:
    found, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        for finding in unpickling_uses(path.read_text()):
            key = (name, finding.scope, finding.kind)
            if key in _EXEMPT:
                used.add(key)
            else:
                found.append(f"{name}:{finding.line} in {finding.scope or '<module>'}: {finding.kind}: {finding.code}")
    assert not found, "\n".join(found)
    assert used == _EXEMPT, f"exemptions that match nothing any more (remove them): {sorted(_EXEMPT - used)}"


# ---------------------------------------------------------------------------- self-tests
_VIOLATIONS = {
    "import pickle\npickle.loads(data)\n": "pickle.load",
    "import pickle\nobj = pickle.load(f)\n": "pickle.load",
    "import pickle as p\nobj = p.loads(data)\n": "pickle.load",
    "from pickle import loads\nobj = loads(data)\n": "pickle.load",
    "from pickle import loads as decode\nobj = decode(data)\n": "pickle.load",
    "from pickle import loads\nhandlers = {'pickle': loads}\n": "pickle.load",
    "import pickle\nobj = pickle.Unpickler(f).load()\n": "unpickler",
    "from pickle import Unpickler\nobj = Unpickler(f).load()\n": "unpickler",
    "import pickle\nclass Reader(pickle.Unpickler):\n    pass\ndef f(b):\n    return Reader(b).load()\n": "unpickler",
    "import torch.distributed.distributed_c10d as c\nobj = c._unpickler(buf).load()\n": "unpickler",
    "import torch\nobj = torch.load(f)\n": "torch.load",
    "import torch\nobj = torch.load(f, weights_only=False)\n": "torch.load",
    "import torch as t\nobj = t.load(f, map_location='cpu')\n": "torch.load",
    "from torch import load\nobj = load(f)\n": "torch.load",
    "import torch\nloader = torch.load\n": "torch.load",
    "import pickle\nfn = getattr(pickle, 'loads')\n": "pickle.load",
    "import torch.distributed as dist\ndist.all_gather_object(out, obj)\n": "object collective",
    "import torch.distributed as dist\ndist.broadcast_object_list(objs, src=0)\n": "object collective",
    "import dill\n": "another unpickler",
    "import marshal\ncode = marshal.loads(blob)\n": "another unpickler",
}

_HARMLESS = [
    '"""Reads it with ``torch.load(weights_only=True)``, never pickle.loads(data) or _unpickler(f).load()."""\n',
    "def f():\n    \"\"\"DCP's reader calls pickle.load; torch.load(f) is not used here.\"\"\"\n    return 1\n",
    "# torch.load(f) and pickle.loads(x) are forbidden\nx = 1\n",
    "import torch\nobj = torch.load(f, weights_only=True)\n",
    "import pickle\nblob = pickle.dumps(obj)\n",
    "import json\nobj = json.load(f)\n",
    "import torch.distributed.checkpoint as dcp\ndcp.load(state, checkpoint_id=path)\n",
    "raise ValueError('do not call torch.load(f) or pickle.loads(x) on untrusted files')\n",
]


@pytest.mark.parametrize("source", list(_VIOLATIONS), ids=range(len(_VIOLATIONS)))
def test_checker_finds_a_planted_violation(source: str) -> None:
    """Each planted use is found, with its kind (else the package test could never fail)."""
    kinds = [f.kind for f in unpickling_uses(source)]
    assert _VIOLATIONS[source] in kinds, (source, kinds)


@pytest.mark.parametrize("source", _HARMLESS, ids=range(len(_HARMLESS)))
def test_checker_ignores_text_and_safe_calls(source: str) -> None:
    """A docstring, comment or message naming a loader, and the safe calls, never count."""
    assert unpickling_uses(source) == [], source


def test_exemption_is_by_function() -> None:
    """An exempt function's name in another scope, or another kind there, is not exempt."""
    source = ("import pickle\nclass SafeFileSystemReader:\n    def read_metadata(self, f):\n"
              "        return pickle.loads(f.read())\n    def other(self, f):\n        return pickle.Unpickler(f).load()\n")
    keys = {("_state/checkpoint_files.py", f.scope, f.kind) for f in unpickling_uses(source)}
    assert keys == {("_state/checkpoint_files.py", "SafeFileSystemReader.read_metadata", "pickle.load"),
                    ("_state/checkpoint_files.py", "SafeFileSystemReader.other", "unpickler")}, keys
    assert not keys & _EXEMPT
