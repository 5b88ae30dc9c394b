"""torch left as it is, and torch's private names in one file, both read from the syntax tree.

* **No patching**: no module of the package assigns, augments or deletes an attribute of a torch
  module or class (``torch.x.y = ...``, ``nn.Module.f = ...``, ``setattr(c10d, ...)``, ``del
  torch.x.y``), nor writes into one of its containers (``torch.x.table[k] = ...``), through any
  import alias. A patch changes torch for every model and library in the process, for as long
  as it stays (issue 35, item 4).
* **Private torch names only in ``_base/torch_compat.py``** (its docstring says why each is needed and
  which torch versions were read; issue 35, item 8). Elsewhere, each of these is a finding:
  an import with a private component (``torch._C``, ``from torch.utils import _pytree``);
  ``X._name`` where ``X`` resolves to a torch module or class; ``obj._name`` (or
  ``getattr(obj, "_name")``) where ``_name`` is defined nowhere in the package outside
  ``_base/torch_compat.py`` (a private name that is not ours is someone else's, e.g. ``Module._buffers``
  or ``Tensor._base``); a method or class attribute that overrides a private name of
  ``nn.Module``, ``Tensor`` or ``Optimizer``, or of the torch class a class derives from (``def
  _apply``); and a dunder that is not Python's (data model, module attributes) nor torch's
  documented extension points ``__torch_function__``/``__torch_dispatch__``.

Without these tests a convenient ``module._buffers[...]`` or a patched torch function slips in
unnoticed, and nothing says which torch versions it was checked against. The checkers are run
on planted sources first: a checker that finds nothing would pass any package.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import types
from typing import Dict, Iterator, List, Optional, Set, Tuple

import torch
import torch.nn as nn

import composable_shard
from tests._source import parse_quietly

PACKAGE = pathlib.Path(composable_shard.__file__).parent
COMPAT = "_base/torch_compat.py"  # the one file allowed to use torch's private names
Finding = Tuple[int, str]  # (line, what)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not _is_dunder(name) and name != "_"


def _is_dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


# ---------------------------------------------------------------------------- names of torch things
def torch_aliases(tree: ast.AST) -> Dict[str, str]:
    """Local name -> dotted torch origin, from the imports anywhere in ``tree`` (``import
    torch.distributed as dist``, ``from torch import nn``, ``from torch.distributed import
    distributed_c10d as c10d``) and from plain assignments of such a name (``Base = nn.Module``)."""
    aliases: Dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    aliases[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):  # after the imports: an assignment may name an alias
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            origin = resolve(node.value, aliases)
            if origin is not None:
                aliases[node.targets[0].id] = origin
    return aliases


def resolve(node: ast.AST, aliases: Dict[str, str]) -> Optional[str]:
    """The dotted torch name ``node`` (a name or attribute chain) stands for, else None."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = resolve(node.value, aliases)
        return None if base is None else f"{base}.{node.attr}"
    return None


# ---------------------------------------------------------------------------- item 4: no patching
def _store_targets(node: ast.AST) -> Iterator[Tuple[ast.AST, str]]:
    """Each expression ``node`` assigns to or deletes, with the verb."""
    if isinstance(node, ast.Assign):
        targets, verb = list(node.targets), "assigns"
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets, verb = [node.target], "assigns"
    elif isinstance(node, ast.Delete):
        targets, verb = list(node.targets), "deletes"
    elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
        targets, verb = [node.target], "assigns"
    elif isinstance(node, ast.withitem) and node.optional_vars is not None:
        targets, verb = [node.optional_vars], "assigns"
    else:
        return
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets.extend(target.elts)
        elif isinstance(target, ast.Starred):
            targets.append(target.value)
        else:
            yield target, verb


def torch_patches(source: str) -> List[Finding]:
    """Every place the module ``source`` assigns, augments or deletes an attribute of a torch
    module or class, or an item of one of its attributes (through any alias), or passes one to
    ``setattr``/``delattr``/``__setattr__``/``__delattr__``."""
    tree = parse_quietly(source)
    aliases = torch_aliases(tree)
    found: List[Finding] = []
    for node in ast.walk(tree):
        for target, verb in _store_targets(node):
            if isinstance(target, (ast.Attribute, ast.Subscript)):
                owner = resolve(target.value, aliases)
                if owner is not None:
                    what = f".{target.attr}" if isinstance(target, ast.Attribute) else "[...]"
                    found.append((node.lineno, f"{verb} {owner}{what}"))  # type: ignore[attr-defined]  # a statement
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            owner = resolve(node.args[0], aliases)
            if name in ("setattr", "delattr", "__setattr__", "__delattr__") and owner is not None:
                found.append((node.lineno, f"{name}({owner}, ...)"))
    return sorted(set(found))


_PATCHES_PLANTED = {
    "assigns torch.distributed.distributed_c10d._tensor_to_object":
        "import torch\ntorch.distributed.distributed_c10d._tensor_to_object = f\n",
    "assigns torch.nn.Module.foo": "import torch.nn as nn\nnn.Module.foo = 1\n",
    "assigns torch.nn.Module.forward": "from torch import nn\ndef f():\n    nn.Module.forward = g\n",
    "assigns torch.distributed.distributed_c10d._unpickler":
        "from torch.distributed import distributed_c10d as c10d\nc10d._unpickler = u\n",
    "assigns torch.distributed.all_gather_single":
        "import torch.distributed as dist\ndist.all_gather_single = dist.all_gather_into_tensor\n",
    "setattr(torch.distributed.distributed_c10d, ...)":
        "import torch.distributed.distributed_c10d as c10d\nsetattr(c10d, '_tensor_to_object', f)\n",
    "delattr(torch.Tensor, ...)": "from torch import Tensor\ndelattr(Tensor, 'foo')\n",
    "__setattr__(torch.nn.Module, ...)": "import torch\ntype.__setattr__(torch.nn.Module, 'x', 1)\n",
    "deletes torch.nn.Module.foo": "import torch\ndel torch.nn.Module.foo\n",
    "assigns torch.Tensor.counter": "import torch\ntorch.Tensor.counter += 1\n",
    "assigns torch.nn.Linear.weight": "from torch.nn import Linear\nLinear.weight: int = 3\n",
    "assigns torch.nn.Module.a": "import torch\nx, (torch.nn.Module.a, y) = 1, (2, 3)\n",
    "assigns torch.nn.modules.module._global_forward_hooks[...]":
        "import torch\ntorch.nn.modules.module._global_forward_hooks[0] = h\n",
    "assigns torch.nn.Module.apply": "import torch.nn\nBase = torch.nn.Module\nBase.apply = f\n",
}
_PATCHES_CLEAN = [
    "import torch\nimport torch.nn as nn\nclass M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
    "        self.w = nn.Parameter(torch.ones(1))\n        self.w.data = torch.zeros(1)\n",
    "import torch\nm = torch.nn.Linear(2, 2)\nm.weight = None\nsetattr(m, 'bias', None)\nm.extra = 1\n",
    "import torch\nt = torch.ones(2)\nt.grad = None\nt[0] = 1\ndel t\n",
    "import torch\ntorch.manual_seed(0)\n# torch.nn.Module.foo = 1 in a comment\nx = 'torch.Tensor.y = 2'\n",
    "import torch.nn as nn\nclass Module:\n    pass\nModule.x = 1\n",  # our own class of the same name
]


def test_patch_checker_finds_planted_patches() -> None:
    """Each planted patch is found, with its target (else the package test could never fail),
    and writes to instances, local classes, comments and strings are not."""
    for expected, source in _PATCHES_PLANTED.items():
        assert [what for _, what in torch_patches(source)] == [expected], (source, torch_patches(source))
    for source in _PATCHES_CLEAN:
        assert torch_patches(source) == [], (source, torch_patches(source))


def _package_files() -> List[pathlib.Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert PACKAGE / COMPAT in files and PACKAGE / "integrations" / "transformers.py" in files, files
    return files


def test_package_patches_no_torch_attribute() -> None:
    """No module of the package (subpackages included) assigns, augments or deletes an
    attribute of a torch module or class."""
    found = [f"{path.relative_to(PACKAGE)}:{line}: {what}" for path in _package_files()
             for line, what in torch_patches(path.read_text())]
    assert not found, "torch patched:\n" + "\n".join(found)


# ---------------------------------------------------------------------------- item 8: private names
def _private_attributes(*classes: type) -> Set[str]:
    return {name for cls in classes for name in dir(cls) if _is_private(name)}


def _private_of_instances() -> Set[str]:
    """Private names of the torch objects every module deals with: a module, a tensor, an
    optimizer (instances: ``Module._parameters`` is set in ``__init__``, not on the class)."""
    weight = nn.Parameter(torch.ones(1))
    objects = (nn.Linear(1, 1), weight, torch.ones(1).view(1), torch.optim.SGD([weight], lr=0.1))
    return {name for obj in objects for name in dir(obj) if _is_private(name)}


# Overriding or reading one of these is a private torch use wherever it is written, and a
# package attribute of the same name does not make it ours.
TORCH_PRIVATE = _private_of_instances()
# Python's documented namedtuple API, underscored only to keep clear of field names.
PYTHON_PUBLIC = {"_fields", "_field_defaults", "_make", "_asdict", "_replace"}
# [Note: Private names of other libraries] The Hugging Face integration subclasses
# ``accelerate.Accelerator`` and ``transformers.Trainer`` and uses two private names of theirs
# that it does not define: (file, name) -> what it is. Listed one by one, each must still match;
# they are not torch's, so they need no place in _base/torch_compat.py, but a new one must be seen.
OTHER_LIBRARIES = {
    ("integrations/transformers.py", "_models"): "Accelerator._models, the models prepare() was given",
    ("integrations/transformers.py", "_save"): "Trainer._save, its writer of a model's files",
}


def _python_dunders() -> Set[str]:
    """Dunders of Python's data model and of its modules, classes, functions and exceptions."""
    kinds = (object, type, int, float, complex, bool, str, bytes, list, tuple, dict, set, frozenset, slice,
             range, memoryview, property, staticmethod, classmethod, BaseException, types.FunctionType,
             types.MethodType, types.ModuleType, types.GeneratorType, types.CoroutineType, types.TracebackType)
    named = {n for kind in kinds for n in dir(kind) if _is_dunder(n)}
    return named | set(
        "__init__ __new__ __del__ __enter__ __exit__ __aenter__ __aexit__ __get__ __set__ __delete__ "
        "__set_name__ __init_subclass__ __class_getitem__ __mro_entries__ __instancecheck__ __subclasscheck__ "
        "__missing__ __length_hint__ __fspath__ __index__ __call__ __await__ __aiter__ __anext__ __iter__ "
        "__next__ __reversed__ __contains__ __getattr__ __slots__ __weakref__ __all__ __file__ __path__ "
        "__package__ __spec__ __loader__ __builtins__ __annotations__ __wrapped__ __copy__ __deepcopy__ "
        "__getstate__ __setstate__ __getnewargs__ __getnewargs_ex__ __version__ __match_args__ __post_init__ "
        "__future__ __main__ __debug__ __signature__ __mro__ __bases__ __orig_bases__ __abstractmethods__ "
        "__buffer__ __release_buffer__ __bytes__ __round__ __trunc__ __floor__ __ceil__".split())


ALLOWED_DUNDERS = _python_dunders() | {"__torch_function__", "__torch_dispatch__"}  # torch's documented extension points


def our_private_names(sources: List[str]) -> Set[str]:
    """The private names the package defines: ``def _x``, ``class _X``, ``obj._x = ...``,
    ``self._x: T``, a class- or module-level ``_x = ...``; never one of :data:`TORCH_PRIVATE`,
    nor a method or class attribute that overrides a torch class's own (see :func:`_overrides`)."""
    ours: Set[str] = set()
    for source in sources:
        tree = parse_quietly(source)
        aliases = torch_aliases(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                ours.add(node.name)
            for target, _ in _store_targets(node):
                if isinstance(target, ast.Attribute):
                    ours.add(target.attr)
                elif isinstance(target, ast.Name):
                    ours.add(target.id)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            ours -= {name for _, name in _overrides(cls, aliases)}
    return {name for name in ours if _is_private(name)} - TORCH_PRIVATE


def _class_body_names(cls: ast.ClassDef) -> Iterator[Tuple[int, str]]:
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.lineno, node.name
        for target, _ in _store_targets(node):
            if isinstance(target, ast.Name):
                yield node.lineno, target.id


def _overrides(cls: ast.ClassDef, aliases: Dict[str, str]) -> Iterator[Tuple[int, str]]:
    """Methods and class attributes of ``cls`` that override a private name of torch's: one
    of :data:`TORCH_PRIVATE`, or one of a torch class ``cls`` derives from."""
    inherited = set(TORCH_PRIVATE)
    for base in cls.bases:
        origin = resolve(base, aliases)
        if origin is not None:
            inherited |= _private_attributes(_torch_object(origin))
    for line, name in _class_body_names(cls):
        if name in inherited:
            yield line, name


def _torch_object(dotted: str) -> type:
    obj: object = torch
    parts = dotted.split(".")
    for i, part in enumerate(parts[1:], 1):
        if not hasattr(obj, part):  # a subpackage nobody imported yet (torch.distributed.pipelining)
            importlib.import_module(".".join(parts[:i + 1]))
        obj = getattr(obj, part)
    return obj if isinstance(obj, type) else type(obj)


def _attribute_uses(node: ast.AST) -> Iterator[Tuple[ast.AST, str]]:
    """``(owner expression, name)`` for ``owner.name`` and ``getattr/hasattr/setattr/delattr(owner, "name")``."""
    if isinstance(node, ast.Attribute):
        yield node.value, node.attr
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2
          and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
          and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
        yield node.args[0], node.args[1].value


def _dunder_uses(node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield node.name
    for _, name in _attribute_uses(node):
        yield name


def _own_fields(tree: ast.AST) -> Set[int]:
    """``id()`` of each ``self._x`` inside a class without bases that assigns ``self._x`` itself:
    a plain class's own field, even where torch's classes have one of the same name (a plain
    class is no module, tensor or optimizer; a mixin of one has bases, and is not exempt)."""
    exempt: Set[int] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and not n.bases):
        selfs = [n for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                 and n.value.id == "self"]
        assigned = {n.attr for n in selfs if isinstance(n.ctx, ast.Store)}
        exempt |= {id(n) for n in selfs if n.attr in assigned}
    return exempt


def private_torch_uses(source: str, ours: Set[str]) -> List[Finding]:
    """The private torch uses of the module ``source`` (see the module docstring); ``ours``:
    the private names the package defines (:func:`our_private_names`)."""
    tree = parse_quietly(source)
    aliases = torch_aliases(tree)
    own_fields = _own_fields(tree)
    found: List[Finding] = []
    for node in ast.walk(tree):
        found += [(node.lineno, f"imports {name}") for name in _private_imports(node)]  # type: ignore[attr-defined]
        for owner_node, name in _attribute_uses(node):
            owner = resolve(owner_node, aliases)
            if _is_private(name) and (owner is not None or (name not in ours | PYTHON_PUBLIC
                                                            and id(node) not in own_fields)):
                found.append((node.lineno, f"uses {owner or '<object>'}.{name}"))  # type: ignore[attr-defined]
        if isinstance(node, ast.ClassDef):
            found += [(line, f"overrides {node.name}.{name}") for line, name in _overrides(node, aliases)]
        found += [(getattr(node, "lineno", 0), f"non-standard dunder {name}") for name in _dunder_uses(node)
                  if _is_dunder(name) and name not in ALLOWED_DUNDERS]
    return sorted(set(found))


def _private_imports(node: ast.AST) -> List[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "torch"
                and any(_is_private(c) for c in a.name.split("."))]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
        return [f"{node.module}.{a.name}" for a in node.names
                if any(_is_private(c) for c in f"{node.module}.{a.name}".split("."))]
    return []


_PRIVATE_PLANTED = {
    "imports torch._C": "import torch._C\n",
    "imports torch.utils._pytree.tree_map": "from torch.utils._pytree import tree_map\n",
    "imports torch.utils._pytree": "from torch.utils import _pytree as pt\n",
    "uses torch._foreach_norm": "import torch\nf = torch._foreach_norm\n",
    "uses torch.nn.modules.batchnorm._BatchNorm": "import torch.nn as nn\nB = (nn.modules.batchnorm._BatchNorm,)\n",
    "uses torch.distributed.distributed_c10d._unpickler":
        "from torch.distributed import distributed_c10d as c10d\nu = c10d._unpickler\n",
    "uses torch.Tensor._make_wrapper_subclass": "from torch import Tensor\nt = Tensor._make_wrapper_subclass(c, s)\n",
    "uses <object>._buffers": "def f(module):\n    return module._buffers\n",
    "uses <object>._non_persistent_buffers_set":
        "def f(m, name):\n    return name in getattr(m, '_non_persistent_buffers_set')\n",
    "uses <object>._base": "def f(g, old):\n    return g._base is old\n",
    "uses <object>._parameters":  # an attribute of our own of the same name does not make nn.Module's ours
        "class Bucket:\n    def __init__(self):\n        self._parameters = []\n"
        "def f(module):\n    return module._parameters\n",
    "overrides M._apply": "class M:\n    def _apply(self, fn, recurse=True):\n        return fn\n",
    "overrides R._version": "import torch\nclass R(torch.Tensor):\n    _version = 0\n",
    "overrides P._load_from_state_dict":
        "from torch.nn import Linear\nclass P(Linear):\n    def _load_from_state_dict(self, *a):\n        pass\n",
    "non-standard dunder __create_write_items__":
        "class S:\n    def __create_write_items__(self, fqn, obj):\n        return []\n",
    "non-standard dunder __get_tensor_shard__": "def f(x, i):\n    return x.__get_tensor_shard__(i)\n",
}
_PRIVATE_CLEAN = [
    '"""Uses torch._C._current_graph_task_id() and module._buffers in prose only."""\n# torch._C in a comment\n',
    "import torch\nimport torch.nn as nn\nx = torch.distributed.is_available()\nB = nn.BatchNorm2d\n",
    "class State:\n    _registry = {}\n    def _own(self):\n        self._count = 1\n        return self._count\n"
    "def f(s):\n    return s._own(), s._registry, s._count, State._registry\n",
    "import torch\nclass G(torch.Tensor):\n    @classmethod\n    def __torch_function__(cls, func, types, args=(), "
    "kwargs=None):\n        return super().__torch_function__(func, types, args, kwargs)\n"
    "    def __repr__(self):\n        return 'G'\n",
    "__all__ = ['f']\ndef f(obj):\n    return obj.__class__.__name__, obj.__dict__, f.__wrapped__\n",
    "from ._flat_param import _private_helper\nimport torch\nprint(torch.__version__)\n",
]


def test_private_checker_finds_planted_uses() -> None:
    """Each planted private torch use is found, as what it is (else the package test could
    never fail); prose, public torch names, our own private names and Python's dunders are not."""
    for expected, source in _PRIVATE_PLANTED.items():
        uses = [what for _, what in private_torch_uses(source, our_private_names([source]))]
        assert uses == [expected], (source, uses)
    for source in _PRIVATE_CLEAN:
        assert private_torch_uses(source, our_private_names([source])) == [], source


def test_private_torch_names_only_in_torch_compat() -> None:
    """Outside ``_base/torch_compat.py`` no module of the package uses a private torch name; inside it
    there are some (else the file and this exemption have no reason to exist)."""
    files = {path: path.read_text() for path in _package_files()}
    ours = our_private_names([text for path, text in files.items() if path != PACKAGE / COMPAT])
    found, other = [], set()
    for path, text in files.items():
        for line, what in private_torch_uses(text, ours) if path != PACKAGE / COMPAT else []:
            key = (path.relative_to(PACKAGE).as_posix(), what.rsplit(".", 1)[-1])
            if what.startswith("uses <object>.") and key in OTHER_LIBRARIES:
                other.add(key)
            else:
                found.append(f"{key[0]}:{line}: {what}")
    assert not found, "private torch names outside _base/torch_compat.py:\n" + "\n".join(found)
    assert other == set(OTHER_LIBRARIES), f"gone (drop them): {sorted(set(OTHER_LIBRARIES) - other)}"
    assert private_torch_uses(files[PACKAGE / COMPAT], ours), "_base/torch_compat.py uses nothing private: drop it"


def test_torch_compat_is_a_leaf() -> None:
    """``_base/torch_compat.py`` imports nothing from the package (any module may import it)."""
    tree = parse_quietly((PACKAGE / COMPAT).read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.level or n.module == "composable_shard")]
    imports += [n for n in ast.walk(tree) if isinstance(n, ast.Import)
                and any(a.name.split(".")[0] == "composable_shard" for a in n.names)]
    assert not imports, [ast.unparse(n) for n in imports]
