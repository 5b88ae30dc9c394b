"""Refusals that depend on whose code reaches a managed module, with the knowledge of that code
kept where it belongs.

[Note: Caller checks]
  A few refusals depend on who is calling: a framework's own strategy saving a model this library
  sharded, torch's own pipelining stage driving a fully sharded module. The package knows such
  code by name only, reads who is calling through one function (``torch_compat.running_functions``,
  the package's only reader of Python frames), and keeps each framework's names in its
  integration (``integrations/``), never in the runtime.

  An integration offers a check under the entry-point group ``composable_shard.caller_checks``
  (``pyproject.toml``): the entry's name is the module-name prefix of the code it knows (a
  package, ``lightning``, or a module under one, ``torch.distributed.pipelining``), its value the
  check, ``check(subject, point, functions)``. When a managed module (or an optimizer of one, the
  subject) reaches one of the ``POINTS`` below, :func:`check_callers` looks at the functions
  running on this thread; for each prefix with at least one of them, it loads that entry
  (importing the integration, whose framework is then imported already: its code is running)
  and calls the check with the subject, the point and those functions, innermost first. A check
  raises to refuse, before anything was changed.
  Nothing is imported and no check runs while none of a prefix's code is running, and the stack
  is walked only while the module a prefix names has been imported at all.

  The checks do not depend on the user importing the integration: a user of Lightning's own
  ``ModelParallelStrategy`` never imports ``composable_shard.integrations.lightning`` and is
  refused all the same. They need the package's metadata, which any install (``pip install``,
  ``pip install -e``) writes; ``test_caller_checks_are_registered`` checks it.

  POINTS
    "traverse"           the module's tree is walked (``named_modules``/``named_children`` of a
                         managed module: how every wrapper and checkpoint loader finds parameters)
    "state_dict"         torch's ``torch.distributed.checkpoint.state_dict`` API asks a managed
                         module, or an optimizer of one, for its state or loads it
    "first_forward"      a fully sharded root's first forward (lazy initialization)
    "set_is_last_backward"  FSDP2's ``set_is_last_backward`` was called on a fully sharded module
"""

from __future__ import annotations

import functools
import sys
from importlib import metadata
from typing import Any, Callable, Dict, List, Sequence, Tuple

from .torch_compat import RunningFunction, running_functions

__all__ = ["ENTRY_POINT_GROUP", "POINTS", "CallerCheck", "check_callers", "registered_prefixes"]

ENTRY_POINT_GROUP = "composable_shard.caller_checks"
POINTS = ("traverse", "state_dict", "first_forward", "set_is_last_backward")
CallerCheck = Callable[[Any, str, Sequence[RunningFunction]], None]


@functools.lru_cache(maxsize=None)
def _entries() -> Tuple[Tuple[str, Any], ...]:
    """(prefix, entry point) of every registered check, longest prefix first (read once)."""
    found = metadata.entry_points()
    group = found.select(group=ENTRY_POINT_GROUP) if hasattr(found, "select") else found.get(ENTRY_POINT_GROUP, ())  # type: ignore[attr-defined]  # Python 3.9's dict
    return tuple(sorted(((e.name, e) for e in group), key=lambda item: -len(item[0])))


def registered_prefixes() -> Tuple[str, ...]:
    """The module-name prefixes that have a registered check."""
    return tuple(prefix for prefix, _ in _entries())


@functools.lru_cache(maxsize=None)
def _load(prefix: str) -> CallerCheck:
    entry = dict(_entries())[prefix]
    return entry.load()  # type: ignore[no-any-return]  # a CallerCheck by the group's contract


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def check_callers(subject: Any, point: str) -> None:
    """Run the registered check of every prefix whose code is running on this thread (see
    [Note: Caller checks]); a check raises to refuse ``point`` on ``subject``."""
    entries = _entries()
    if not any(prefix in sys.modules for prefix, _ in entries):
        return  # none of their code was ever imported: none can be running
    seen: Dict[str, List[RunningFunction]] = {}
    for function in running_functions():
        for prefix, _ in entries:
            if _matches(function.module, prefix):
                seen.setdefault(prefix, []).append(function)
                break
    for prefix, functions in seen.items():
        _load(prefix)(subject, point, functions)
