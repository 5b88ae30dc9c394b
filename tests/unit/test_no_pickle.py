"""Nothing in ``composable_shard/`` unpickles what another rank or a file supplies (issue 19,
item 4): no ``*_object`` collective (``torch.distributed``'s unpickle what peers send), no
``pickle.load``/``loads``, no ``torch.load`` without ``weights_only=True``. The one unpickler
allowed is the allow-list ``.metadata`` reader of ``_checkpoint_io.py``, a ``pickle.Unpickler``
subclass whose ``find_class`` refuses everything not listed (tested in test_checkpoint_crash).

A grep, so it also fails on a call added to a path no test exercises."""

from __future__ import annotations

import pathlib
import re
from typing import List, Tuple

import composable_shard

PACKAGE = pathlib.Path(composable_shard.__file__).parent

_FORBIDDEN = [
    (re.compile(r"\b\w+_object(_list)?\s*\("), "an *_object collective"),
    (re.compile(r"\bpickle\.loads?\s*\("), "pickle.load/loads"),
    (re.compile(r"\bdill\b|\bcloudpickle\b|\bmarshal\.loads?\b"), "another unpickler"),
]
_TORCH_LOAD = re.compile(r"\btorch\.load\s*\(([^)]*)\)")


def _code_lines() -> List[Tuple[str, int, str]]:
    """(file, line number, code without comments and docstring text)."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        in_doc = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            stripped = line.strip()
            quotes = stripped.count('"""')
            if in_doc or stripped.startswith('"""') or stripped.startswith('r"""'):
                if quotes == 1 or (in_doc and quotes == 0):
                    in_doc = not in_doc if quotes == 1 else in_doc
                continue
            code = line.split("#", 1)[0]
            code = re.sub(r"``[^`]*``", "", code)  # reST literals inside strings
            out.append((path.name, number, code))
    return out


def test_package_has_no_unpickling_call() -> None:
    found = []
    for name, number, code in _code_lines():
        for pattern, what in _FORBIDDEN:
            if pattern.search(code):
                found.append(f"{name}:{number}: {what}: {code.strip()}")
        for call in _TORCH_LOAD.finditer(code):
            if "weights_only=True" not in call.group(1):
                found.append(f"{name}:{number}: torch.load without weights_only=True: {code.strip()}")
    assert not found, "\n".join(found)


def test_the_grep_sees_what_it_forbids() -> None:
    """The patterns match the calls they name (else the test above could never fail)."""
    samples = {"dist.all_gather_object(out, obj)": 0, "dist.broadcast_object_list(x)": 0,
               "pickle.loads(data)": 1, "pickle.load(f)": 1}
    for code, index in samples.items():
        assert _FORBIDDEN[index][0].search(code), code
    assert _TORCH_LOAD.search("torch.load(f)") and "weights_only=True" not in _TORCH_LOAD.search("torch.load(f)").group(1)
    assert "weights_only=True" in _TORCH_LOAD.search("torch.load(value, weights_only=True)").group(1)
