"""Counting torch's own collectives (torch FSDP2's, the reference of collective-count tests) by
kind: a dispatch mode sees every ``c10d::`` operator issued while it is active. The library's own
collectives are counted by ``composable_shard._runtime.collectives.record_collectives``."""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["C10dCount"]


class C10dCount(TorchDispatchMode):
    """``counts[kind]``: all-gathers, reduce-scatters and all-reduces issued while active (gloo's
    operator names: ``_allgather_base_``, ``_reduce_scatter_base_``, ``allreduce_``, ...)."""

    KINDS = {"_allgather_base_": "all_gather", "allgather_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
             "reduce_scatter_": "reduce_scatter", "allreduce_": "all_reduce"}

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kind = self.KINDS.get(func.__name__.split(".")[0]) if func.namespace == "c10d" else None
        if kind is not None:
            self.counts[kind] += 1
        return func(*args, **(kwargs or {}))
