"""Every error API.md lists for fully_shard raises a clear message naming the module or
parameter, and leaves the model exactly as it was (class, registry, hooks, parameters).

Without these, a bad annotation could half-apply (some modules subclassed, some hooks
registered) and fail much later with an unrelated message, or hang.
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import torch
import torch.nn as nn

from composable_shard import MixedPrecision, ShardingStrategy, fully_shard, replicate
from composable_shard.contract import _get_registry
from tests._harness import run_distributed


def _snapshot(model: nn.Module) -> List[Tuple[Any, ...]]:
    return [(name, type(m), dict(_get_registry(m) or {}).keys().__repr__(), len(m._forward_pre_hooks),
             len(m._forward_hooks), [(n, id(p), p.shape, p.detach().clone()) for n, p in m.named_parameters(recurse=False)])
            for name, m in model.named_modules()]


def _assert_unchanged(before: List[Tuple[Any, ...]], model: nn.Module) -> None:
    after = _snapshot(model)
    assert len(before) == len(after)
    for b, a in zip(before, after):
        assert b[:5] == a[:5], (b[:5], a[:5])
        for (n1, i1, s1, t1), (n2, i2, s2, t2) in zip(b[5], a[5]):
            assert (n1, i1, s1) == (n2, i2, s2) and torch.equal(t1, t2), n1


def _expect(fn: Callable[[], Any], exc: type, *fragments: str) -> None:
    try:
        fn()
    except exc as e:
        for f in fragments:
            assert f in str(e), f"{f!r} not in message: {e}"
    else:
        raise AssertionError(f"expected {exc.__name__}")


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.dec = nn.Sequential(nn.Linear(4, 4))
        self.dec[0].weight = self.enc[1].weight


def _errors() -> None:
    # Shared parameter across two handles: names the parameter and the common ancestor.
    model = Tied()
    fully_shard(model.enc)
    before = _snapshot(model)
    _expect(lambda: fully_shard(model), ValueError, "dec.0.weight", "lowest common ancestor", "'<root>'")
    _assert_unchanged(before, model)

    model = Tied()
    before = _snapshot(model)
    _expect(lambda: fully_shard(model, policy=lambda module, recurse, nonwrapped_numel: recurse or isinstance(module, nn.Sequential)),
            ValueError, "shared by", "'<root>'")
    _assert_unchanged(before, model)

    # Already managed by replicate.
    model = nn.Sequential(nn.Linear(4, 4))
    replicate(model)
    before = _snapshot(model)
    _expect(lambda: fully_shard(model), RuntimeError, "replicate")
    _assert_unchanged(before, model)

    # replicate on a fully_shard-managed module.
    model = nn.Sequential(nn.Linear(4, 4))
    fully_shard(model)
    before = _snapshot(model)
    _expect(lambda: replicate(model), RuntimeError, "fully_shard")
    _assert_unchanged(before, model)

    # Applied twice.
    _expect(lambda: fully_shard(model), RuntimeError, "fully_shard")
    _assert_unchanged(before, model)

    # Nesting a FlatParameter.
    inner = nn.Linear(4, 4)
    fully_shard(inner)
    flat = fully_shard.state(inner).handle.flat_param
    outer = nn.Sequential(nn.Linear(2, 2))
    outer.register_parameter("stolen", flat)
    before = _snapshot(outer)
    _expect(lambda: fully_shard(outer), ValueError, "stolen", "FlatParameter")
    _assert_unchanged(before, outer)

    # Bad arguments.
    model = nn.Linear(4, 4)
    before = _snapshot(model)
    _expect(lambda: fully_shard(model, strategy="FULL_SHARD"), TypeError, "ShardingStrategy")
    _expect(lambda: fully_shard(model, strategy=ShardingStrategy.HYBRID_SHARD), ValueError, "hybrid")
    _expect(lambda: fully_shard(model, ignored_states=[model.weight, model]), ValueError, "ignored_states")
    _expect(lambda: fully_shard(model, mixed_precision=MixedPrecision(buffer_dtype=torch.bfloat16)),
            NotImplementedError, "buffer_dtype")
    _expect(lambda: fully_shard(model, mixed_precision=MixedPrecision(keep_low_precision_grads=True)),
            NotImplementedError, "keep_low_precision_grads")
    _assert_unchanged(before, model)
    fully_shard(model)  # and a correct call still works afterwards
    model(torch.randn(2, 4)).sum().backward()


def test_errors_are_clear_and_leave_the_model_unchanged() -> None:
    """Shared parameter across handles, replicate/fully_shard on each other's modules, applying
    twice, a nested FlatParameter and bad arguments raise naming what to fix; nothing changes."""
    run_distributed(_errors, 2, timeout=90)

