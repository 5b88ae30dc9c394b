"""What every integration needs of a model the library manages, through the public API only:
which of its modules ``fully_shard`` / ``replicate`` manage, and gradient synchronization off
between accumulated micro-batches (a framework's ``no_sync``)."""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Sequence

import torch.nn as nn

from .. import FSDPModule, ReplicateModule

__all__ = ["managed_modules", "gradient_sync_off"]


def managed_modules(module: nn.Module) -> List[nn.Module]:
    """The modules of ``module``'s tree that ``fully_shard`` or ``replicate`` manages."""
    return [m for m in module.modules() if isinstance(m, (FSDPModule, ReplicateModule))]


@contextlib.contextmanager
def gradient_sync_off(module: nn.Module) -> Iterator[None]:
    """No gradient communication in the body's backwards: every managed module of ``module``
    accumulates this rank's gradients; the next backward outside reduces their sum once."""
    managed = managed_modules(module)
    _set_gradient_sync(managed, False)
    try:
        yield
    finally:
        _set_gradient_sync(managed, True)


def _set_gradient_sync(modules: Sequence[nn.Module], flag: bool) -> None:
    for m in modules:
        if isinstance(m, FSDPModule):
            m.set_requires_gradient_sync(flag, recurse=False)
        elif isinstance(m, ReplicateModule):
            m.set_requires_gradient_sync(flag)
