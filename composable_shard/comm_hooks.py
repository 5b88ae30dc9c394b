"""Communication hooks for :func:`~composable_shard.replicate.replicate`.

A hook has torch DDP's signature, ``hook(state, bucket) -> torch.futures.Future[Tensor]``, and
is installed with ``module.register_comm_hook(state, hook)``. ``replicate`` calls it once per
bucket, during backward, as soon as the bucket is full and every earlier bucket was launched;
the tensor the future resolves to is written back as the bucket's *averaged* gradient. A hook
therefore divides by the world size itself (the default path does it for hooks-less modules).

Every hook here issues its collective through ``_runtime/collectives`` (so tests see it) and returns
the work's own future, so the reduction overlaps the rest of backward: nothing here blocks.

Example::

    from composable_shard.comm_hooks import fp16_compress_hook
    replicate(model)
    model.register_comm_hook(None, fp16_compress_hook)   # state: the process group or None
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ._runtime import collectives as _collectives

__all__ = ["GradBucket", "CommHook", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"]


class GradBucket:
    """The gradients of one bucket, as a comm hook sees them (torch's ``GradBucket`` API).

    ``buffer()`` is the flat gradient buffer (in the reduce dtype), not yet averaged;
    ``gradients()`` are per-parameter views of it, in ``parameters()`` order.
    """

    def __init__(self, index: int, buffer: torch.Tensor, parameters: List[nn.Parameter], gradients: List[torch.Tensor],
                 is_last: bool) -> None:
        self._index: int = index  # launch position of the bucket; the same on every rank
        self._buffer: torch.Tensor = buffer  # flat gradients; replaced by set_buffer
        self._parameters: List[nn.Parameter] = parameters  # parameters of the bucket, slot order
        self._gradients: List[torch.Tensor] = gradients  # views of the original buffer, per parameter
        self._is_last: bool = is_last  # the last bucket launched in a backward

    def index(self) -> int:
        """Position of the bucket in launch order (0 is launched first)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat gradient buffer of the bucket (sum of local micro-batches, not averaged)."""
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the tensor ``buffer()`` returns (for hooks that chain transformations).

        What is written back is always the tensor the hook's future resolves to."""
        self._buffer = buffer

    def parameters(self) -> List[nn.Parameter]:
        """Parameters whose gradients the bucket holds, in buffer order."""
        return list(self._parameters)

    def gradients(self) -> List[torch.Tensor]:
        """Per-parameter views (parameter shapes) of the bucket's original buffer."""
        return list(self._gradients)

    def is_last(self) -> bool:
        """True for the bucket launched last in a backward (the one holding the first layers)."""
        return self._is_last


_TensorFuture = torch.futures.Future[torch.Tensor]
CommHook = Callable[[Any, GradBucket], _TensorFuture]


def allreduce_hook(process_group: Optional[dist.ProcessGroup], bucket: GradBucket) -> _TensorFuture:
    """Average the bucket over ``process_group`` (``None``: the default group) with one
    all-reduce, in the buffer's dtype. Same result as registering no hook."""
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(process_group))
    pending = _collectives.all_reduce(buffer, process_group, tag=f"replicate::allreduce_hook::bucket{bucket.index()}")
    return _future_of(pending, lambda reduced: reduced)


def fp16_compress_hook(process_group: Optional[dist.ProcessGroup], bucket: GradBucket) -> _TensorFuture:
    """Divide by the world size, cast to float16, all-reduce, cast back into the bucket's
    buffer (torch's ``default_hooks.fp16_compress_hook``): half the bytes on the wire."""
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group: Optional[dist.ProcessGroup], bucket: GradBucket) -> _TensorFuture:
    """As :func:`fp16_compress_hook` with bfloat16 (wider range, fewer mantissa bits)."""
    return _compress_hook(torch.bfloat16, process_group, bucket)


def _compress_hook(dtype: torch.dtype, process_group: Optional[dist.ProcessGroup], bucket: GradBucket) -> _TensorFuture:
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(dist.get_world_size(process_group))
    tag = f"replicate::{dtype}_compress_hook::bucket{bucket.index()}".replace("torch.", "")
    pending = _collectives.all_reduce(compressed, process_group, tag=tag)
    # Decompressed in place into the bucket's buffer, so no full-precision temporary is allocated.
    return _future_of(pending, lambda reduced: buffer.copy_(reduced))


def _future_of(pending: _collectives.Pending, then: Callable[[torch.Tensor], torch.Tensor]) -> _TensorFuture:
    """A future resolving to ``then(pending.output)`` once the collective finished.

    Uses the work's own future (gloo and NCCL works have one) so nothing blocks here and the
    callback runs when the collective completes; a world of one resolves at once."""
    if pending.work is None:
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(then(pending.output))
        return done
    output = pending.output

    def on_done(fut: torch.futures.Future[Any]) -> torch.Tensor:
        fut.value()  # re-raises a failed collective
        return then(output)

    return pending.work.get_future().then(on_done)
