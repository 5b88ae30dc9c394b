"""No host read of a device value in a steady-state training step (issue 56, item 1).

On a GPU, a library frame that reads a device tensor's value on the host (``item``, ``tolist``,
``bool``/``int``/``float``/``index`` of a tensor, ``.cpu()``, ``.numpy()``) or makes a tensor from
Python values (``torch.tensor``: from pageable memory onto the device) stops the CPU until the GPU
has drained everything queued before it: at the end of backward, the whole backward, every step.
The GPU then idles while the CPU launches the optimizer step ([Note: No host reads in a step] in
``composable_shard/_base/host_mirror.py``). These calls are counted here on the CPU, where the
code path is the GPU's, by wrapping them for the measured steps (a ``TorchFunctionMode`` would miss
the end-of-backward callback, which autograd runs outside any mode): every call whose caller is a
module of the library counts, except ``_base/host_mirror.py``, whose reads are of pinned host
memory an asynchronous copy filled a step earlier and whose ``torch.tensor`` is host staging
copied without waiting.

A step is forward, loss, backward, the library's ``clip_grad_norm_``, ``optimizer.step()`` and
``zero_grad()``, after two warm-up steps, at W = 2 over gloo, for fully_shard (default prefetch,
no prefetch, ``checkpoint``, ``CPUOffload``, mixed precision, SHARD_GRAD_OP), ``replicate``, and the
two mixed. The library's end-of-backward agreement read its all-reduce's result in the step (2
reads, and its ``torch.tensor``), and clipping made an index tensor from Python values (1): each
configuration would fail naming the frame. The step agreement it read there is now read a synced
backward later: ``test_fully_shard_divergence.py`` checks that the error still comes, on every rank.

The same counter counts every call of ``Work.is_completed`` from a library frame (``host_mirror``
included): polling a work keeps the GIL while it takes the work's lock, which gloo's worker holds
while it finishes a work issued under torch's profiler inside a checkpointed forward, and then
needs the GIL: a hang ([Note: Never poll a work] in ``_runtime/collectives.py``; the runtime's
waits polled first, once per wait, in every configuration here).

Beside it, the other per-step cost that needs no device: the runtime's profiler ranges are opened
only while a profiler records (each costs tens of microseconds otherwise), and then all of them.

The counter itself is checked first (code run with a library module's name reads a value: counted
by site; other code and ``host_mirror`` not), so a counter that sees nothing cannot pass.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import (BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy, checkpoint,
                              clip_grad_norm_, fully_shard, replicate)
from tests._harness import run_distributed, run_subtests
from tests._models import batch, local_rows, loss_fn, make_model

_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
_LIBRARY = "composable_shard"
_EXEMPT = "composable_shard._base.host_mirror"
WARMUP, MEASURED = 2, 2

Site = Tuple[str, str, str, int]  # (call, module, function, line)


@contextlib.contextmanager
def _counting_host_reads() -> Iterator[Counter]:
    """Every listed read (and ``torch.tensor``) whose immediate caller is a library module other
    than ``host_mirror``, by site, while the context is open."""
    counts: Counter = Counter()

    def wrap(name: str, original: Callable[..., Any], exempt: str = _EXEMPT) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            if module.startswith(_LIBRARY) and module != exempt:
                counts[(name, module, caller.f_code.co_name, caller.f_lineno)] += 1
            return original(*args, **kwargs)
        return counted

    originals = {name: getattr(torch.Tensor, name) for name in _READS}
    original_tensor = torch.tensor
    original_poll = dist.Work.is_completed
    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, wrap(name, original))
        torch.tensor = wrap("torch.tensor", original_tensor)  # type: ignore[assignment]
        # host_mirror included: polling a work is never safe
        dist.Work.is_completed = wrap("Work.is_completed", original_poll, exempt="")  # type: ignore[method-assign]
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        torch.tensor = original_tensor  # type: ignore[assignment]
        dist.Work.is_completed = original_poll  # type: ignore[method-assign]


def _fully_shard_blocks(model: nn.Module, **kwargs: Any) -> None:
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def _checkpointed(model: nn.Module) -> None:
    for block in model.blocks:
        checkpoint(block)
    _fully_shard_blocks(model)


def _replicate_scale(model: nn.Module) -> None:
    replicate(model.scale)
    _fully_shard_blocks(model)


def _fully_shard_under_replicate(model: nn.Module) -> None:
    for block in model.blocks:
        fully_shard(block)
    replicate(model)


_CONFIGS: Dict[str, Callable[[nn.Module], None]] = {
    "fully_shard": _fully_shard_blocks,
    "no_prefetch": lambda m: _fully_shard_blocks(m, forward_prefetch=False, backward_prefetch=None),
    "checkpoint": _checkpointed,
    "cpu_offload": lambda m: _fully_shard_blocks(m, cpu_offload=CPUOffload(offload_params=True)),
    "mixed_precision": lambda m: _fully_shard_blocks(
        m, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
    "shard_grad_op": lambda m: _fully_shard_blocks(m, strategy=ShardingStrategy.SHARD_GRAD_OP,
                                                   backward_prefetch=BackwardPrefetch.BACKWARD_POST),
    "replicate": lambda m: replicate(m) and None,
    "replicate_part": _replicate_scale,
    "fully_shard_under_replicate": _fully_shard_under_replicate,
}


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    inputs, targets = batch(step, world_size)
    loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank)).backward()
    clip_grad_norm_(model, 1.0)
    optim.step()
    optim.zero_grad()


def _no_host_read_in_a_step(config: str) -> None:
    model = make_model()
    _CONFIGS[config](model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(WARMUP):
        _step(model, optim, step)
    with _counting_host_reads() as counts:
        for step in range(WARMUP, WARMUP + MEASURED):
            _step(model, optim, step)
    sites = "\n  ".join(f"{n} x {call} in {module}.{function}, line {line}"
                        for (call, module, function, line), n in sorted(counts.items()))
    assert not counts, f"[{config}] host reads of device values (or polls of a work) by library frames in {MEASURED} steady-state steps:\n  {sites}"


def _the_counter_counts() -> None:
    """A read made by code of a library module inside the context is counted once, by site; one
    of other code or of ``host_mirror`` is not; the wrappers are gone afterwards."""
    values = torch.arange(3)
    with _counting_host_reads() as counts:
        for module in ("composable_shard._runtime.hooks", "tests.elsewhere", _EXEMPT):
            work = dist.all_reduce(torch.ones(1), async_op=True)
            exec("values.tolist(); bool(values[0]); torch.tensor([1]); work.is_completed(); work.wait()",
                 {"__name__": module, "values": values, "torch": torch, "work": work})
    assert sorted((call, module) for call, module, _, _ in counts) == [
        ("Work.is_completed", "composable_shard._base.host_mirror"),
        ("Work.is_completed", "composable_shard._runtime.hooks"),
        ("__bool__", "composable_shard._runtime.hooks"), ("tolist", "composable_shard._runtime.hooks"),
        ("torch.tensor", "composable_shard._runtime.hooks")], counts
    assert all(getattr(torch.Tensor, name).__name__ != "counted" for name in _READS)
    assert torch.tensor.__name__ != "counted" and dist.Work.is_completed.__name__ != "counted"


def _ranges_only_under_a_profiler() -> None:
    """The runtime's profiler ranges (one ``record_function`` per transition, tens of
    microseconds each even with no profiler running) are opened in a step only while a profiler
    records: under ``torch.profiler.profile`` every transition's range is in the trace, once per
    handle and step; without one, no range is opened."""
    model = make_model()
    _fully_shard_blocks(model)
    optim = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(WARMUP):
        _step(model, optim, step)
    opened: List[str] = []
    original = torch.profiler.record_function.__enter__

    def counted(self: Any) -> Any:
        opened.append(self.name)
        return original(self)

    torch.profiler.record_function.__enter__ = counted  # type: ignore[method-assign]
    try:
        _step(model, optim, WARMUP)
        assert [n for n in opened if n.startswith("cs::")] == [], opened
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _step(model, optim, WARMUP + 1)
    finally:
        torch.profiler.record_function.__enter__ = original  # type: ignore[method-assign]
    names = Counter(e.name for e in prof.events() if e.name.startswith("cs::"))
    handles = len(model.blocks) + 1
    assert names == {"cs::pre_forward": handles, "cs::post_forward": handles, "cs::pre_backward": handles,
                     "cs::post_backward": handles, "cs::finalize_backward": 1}, names


def _all() -> None:
    _the_counter_counts()
    _ranges_only_under_a_profiler()
    run_subtests(_no_host_read_in_a_step, {"config": list(_CONFIGS)})


def test_no_host_read_of_a_device_value_in_a_steady_state_step() -> None:
    """W = 2, every configuration of the module docstring, one process group."""
    run_distributed(_all, 2, timeout=240)
