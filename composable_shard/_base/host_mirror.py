"""Small values between the host and the compute device without stopping the CPU.

[Note: No host reads in a step]  On a GPU, reading a device tensor's value on the host (``item``,
``tolist``, ``bool(t)``, ``.cpu()``) or making a device tensor from Python values with
``torch.tensor(values, device=cuda)`` (a copy from pageable memory) waits until the GPU has
finished everything queued before it. The CPU then stops launching work, and the GPU idles until
the CPU catches up: at the end of backward that costs the whole backward's drain, every step.
So nothing in a steady-state training step of ``fully_shard`` or ``replicate`` does either. The
few integers the runtime sends with a collective go through this module:

* :func:`to_device` puts Python integers into a host tensor, pinned when the device is an
  accelerator, and copies it with ``non_blocking=True``: the copy is queued on the current
  stream like any kernel (torch's pinned-memory allocator keeps the host block alive until it ran).
* :class:`HostMirror` brings a device tensor's values back: it queues a ``non_blocking`` copy
  into pinned host memory behind the collective that produced them and records an event; the
  values are read later (:meth:`HostMirror.values`), by which time the copy has long finished
  (the end-of-backward agreement reads them one synced backward later: [Note: Step agreement]
  in ``_runtime/watch.py``, its ``StepVerdict``). On the CPU the "device" tensor is host memory
  already: the mirror is the tensor itself, read once its collective is done; ``fully_shard`` lets
  it go at the end of the next forward (:meth:`HostMirror.settle`: held through the loss and the
  backward it would add its bytes to every step's peak, which torch's FSDP2, holding none, does not
  have).

A read through a mirror is a read of host memory the copy has filled, not of a device tensor:
tests that count host reads of device values in a step (``test_host_reads.py``) leave this
module's frames out, and count every other library frame.
"""

from __future__ import annotations

from typing import List, Optional, Protocol, Sequence

import torch

__all__ = ["to_device", "HostMirror", "Waitable"]


class Waitable(Protocol):
    """An issued collective (the runtime's ``collectives.Pending``): ``wait()`` blocks (CPU) or
    orders the current stream (accelerators). Nothing polls it ([Note: Never poll a work] in
    ``_runtime/collectives.py``)."""

    def wait(self) -> torch.Tensor: ...


def to_device(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a 1-D ``dtype`` tensor on ``device``, copied without waiting (pinned
    staging on an accelerator; on the CPU the host tensor itself)."""
    host = torch.tensor(list(values), dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class HostMirror:
    """The values ``source`` will hold once ``pending`` (the collective writing it) has finished,
    readable later on the host without stopping the CPU at the read."""

    def __init__(self, source: torch.Tensor, pending: Waitable) -> None:
        self._pending: Optional[Waitable] = pending
        self._event: Optional[torch.Event] = None
        self._values: Optional[List[int]] = None  # read already
        self._host: Optional[torch.Tensor]
        if source.device.type == "cpu":
            self._host = source  # host memory: ready when the collective is (gloo finishes it in its thread)
            return
        pending.wait()  # orders the current stream after the collective; the host does not wait
        self._pending = None
        self._host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        self._host.copy_(source, non_blocking=True)
        self._event = torch.Event(device=source.device)
        self._event.record()

    def values(self) -> List[int]:
        """The values, waiting for the copy (or, on the CPU, the collective) if it has not finished."""
        if self._values is not None:
            return self._values
        if self._event is not None:
            self._event.synchronize()
        elif self._pending is not None:
            self._pending.wait()
            self._pending = None
        assert self._host is not None  # dropped only once read
        self._values = self._host.tolist()
        self._host = None
        return self._values

    def settle(self) -> None:
        """On the CPU: read the values now and let the tensor go (its collective, issued a step
        earlier, has long finished: the wait returns at once). A device's mirror is pinned host
        memory, not the device's, and its values are read only when asked (reading them is what
        would wait for the device)."""
        if self._event is None and self._host is not None:
            self.values()
