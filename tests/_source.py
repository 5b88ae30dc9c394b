"""Reading the package's source as a syntax tree, for the tests that check code, not text."""

from __future__ import annotations

import ast
import warnings


def parse_quietly(source: str) -> ast.Module:
    """``ast.parse(source)`` without the warnings compiling it may print (an invalid escape in
    a docstring is not what a syntax-tree check is about)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return ast.parse(source)
