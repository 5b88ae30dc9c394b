"""Streams of the runtime. CUDA: all-gathers and reduce-scatters each on their own stream,
ordered with events, never with ``record_stream``: every buffer is allocated and freed on the
compute stream, and the compute stream waits for a collective's event before it frees (or
reads) what the collective used. CPU/gloo: every method is a no-op; gloo's async works give
the overlap and ``Work.wait()`` the ordering.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

__all__ = ["Streams"]

_NO_STREAM = contextlib.nullcontext()  # reusable: what run_on returns off CUDA


class Streams:
    """The all-gather and reduce-scatter streams of one tree of fully sharded modules."""

    def __init__(self, device: torch.device) -> None:
        self.is_cuda: bool = device.type == "cuda"  # False: every method is a no-op
        self.all_gather: Optional[Any] = torch.cuda.Stream(device) if self.is_cuda else None  # all-gathers
        self.reduce_scatter: Optional[Any] = torch.cuda.Stream(device) if self.is_cuda else None  # reductions

    def run_on(self, stream: Optional[Any]) -> "contextlib.AbstractContextManager[Any]":
        """Context issuing on ``stream`` after everything the compute stream queued so far."""
        if stream is None:
            return _NO_STREAM
        stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(stream)

    @staticmethod
    def record(stream: Optional[Any]) -> Optional[Any]:
        """An event marking what ``stream`` has queued so far (None on CPU)."""
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    @staticmethod
    def record_current(device: torch.device) -> Optional[Any]:
        """An event marking what the current stream of ``device`` has queued (None off CUDA)."""
        return Streams.record(torch.cuda.current_stream(device)) if device.type == "cuda" else None

    @staticmethod
    def wait(event: Optional[Any]) -> None:
        """Make the compute stream wait for ``event`` (no CPU sync; no-op on CPU)."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
