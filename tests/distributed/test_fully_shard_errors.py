"""Every error API.md lists for fully_shard raises a clear message naming the module or
parameter, and leaves the model exactly as it was (class, registry, hooks, parameters).

Without these, a bad annotation could half-apply (some modules subclassed, some hooks
registered) and fail much later with an unrelated message, or hang.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import (CPUOffload, CustomPolicy, MixedPrecision, ModuleWrapPolicy, ShardingStrategy, checkpoint,
                              clip_grad_norm_, fully_shard, replicate, unshard_params)
from composable_shard._runtime.traversal import _get_fsdp_states
from composable_shard.contract import _get_registry
from tests._harness import run_distributed, run_subtests
from tests._models import zip_same


def _snapshot(model: nn.Module) -> List[Tuple[Any, ...]]:
    """Per module: name, class, registry, hook counts, and its parameters (name, object, shape,
    values; meta tensors have no values to compare)."""
    return [(name, type(m), dict(_get_registry(m) or {}).keys().__repr__(), len(m._forward_pre_hooks),
             len(m._forward_hooks), len(m._backward_hooks), len(m._backward_pre_hooks),
             [(n, id(p), p.shape, p.device, None if p.is_meta else p.detach().clone())
              for n, p in m.named_parameters(recurse=False)])
            for name, m in model.named_modules()]


def _assert_unchanged(before: List[Tuple[Any, ...]], model: nn.Module, *, values: bool = True) -> None:
    """Same modules, classes, registries and hooks; with ``values`` also the same parameter
    objects, shapes, devices and values."""
    after = _snapshot(model)
    assert len(before) == len(after), (len(before), len(after))
    for b, a in zip(before, after):
        assert b[:7] == a[:7], (b[:7], a[:7])
        if not values:
            continue
        assert len(b[7]) == len(a[7]), (b[0], [n for n, *_ in b[7]], [n for n, *_ in a[7]])
        for (n1, i1, s1, d1, t1), (n2, i2, s2, d2, t2) in zip(b[7], a[7]):
            assert (n1, i1, s1, d1) == (n2, i2, s2, d2), (b[0], n1, n2)
            assert (t1 is None) == (t2 is None) and (t1 is None or torch.equal(t1, t2)), (b[0], n1)


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
    _expect(lambda: fully_shard(model), ValueError, "dec.0.weight", "'enc.1.weight'", "lowest common ancestor",
            "'<root>'", "do not annotate 'enc' separately")
    _assert_unchanged(before, model)

    # Two siblings annotated separately: the second call raises, naming both FQNs.
    model = Tied()
    fully_shard(model.enc)
    before = _snapshot(model)
    _expect(lambda: fully_shard(model.dec), ValueError, "fully_shard(Sequential)",
            "'0.weight' of this Sequential", "'1.weight' of the FSDPSequential", "each name relative to its own module",
            "annotated separately", "lowest common ancestor")
    _assert_unchanged(before, model)

    # A child annotated after its parent (root before children): raises at the child's call.
    model = Tied()
    fully_shard(model)
    before = _snapshot(model)
    _expect(lambda: fully_shard(model.enc), ValueError, "'enc'", "'enc.0.weight'", "children before their parents",
            "do not annotate 'enc' separately")
    _assert_unchanged(before, model)
    # ... also when the child holds nothing the parent owns, once the parent ran forward.
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    fully_shard(model)
    model(torch.randn(2, 4)).sum().backward()
    before = _snapshot(model)
    _expect(lambda: fully_shard(model[1]), RuntimeError, "fully_shard(ReLU)", "children before their parents")
    _assert_unchanged(before, model)

    # Under a policy the same sharing is planned: the tied weight goes to the root's handle, once.
    model = Tied()
    fully_shard(model, policy=lambda module, recurse, nonwrapped_numel: recurse or isinstance(module, nn.Sequential))
    tied = model.enc[1].weight
    owners = [s.module for s in _get_fsdp_states(model) if s.handle is not None
              for g in s.handle.groups for p in g.orig_params if p is tied]
    assert owners == [model] and model.dec[0].weight is tied, owners

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

    # Inside a module the other API manages (a user's trial found both accepted): replicate on a
    # submodule of a fully sharded module (its weight a slice of the flat shard of the same shape on
    # both ranks: rank 0's slice was broadcast over rank 1's, silently), and fully_shard on a
    # submodule of a replicated one (left half converted). Both refused, naming the ancestor, the
    # model unchanged, and the model still trains afterwards.
    model = nn.Sequential(nn.Linear(1, 2, bias=False), nn.Tanh(), nn.Linear(2, 2, bias=False), nn.Tanh(),
                          nn.Linear(2, 1, bias=False))
    fully_shard(model)
    before = _snapshot(model)
    _expect(lambda: replicate(model[2]), RuntimeError, "replicate(Linear)", "'2' inside FSDPSequential",
            "fully_shard already manages", "before fully_shard of its ancestor")
    _assert_unchanged(before, model)
    model(torch.randn(2, 1)).sum().backward()
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    replicate(model)
    before = _snapshot(model)
    _expect(lambda: fully_shard(model[2]), RuntimeError, "fully_shard(Linear)", "'2' inside ReplicateSequential",
            "replicate already manages", "'weight'", "before replicate of its ancestor")
    _assert_unchanged(before, model)
    model(torch.randn(2, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    # ...but a submodule replicate was told to ignore is its own: fully_shard is accepted there, and
    # a step of the pair equals one process's on the combined batch
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    replicate(model, ignored_modules=[model[2]])
    fully_shard(model[2])
    inputs = torch.randn(2 * world_size, 4, generator=torch.Generator().manual_seed(4))
    model(inputs[2 * rank:2 * rank + 2]).pow(2).mean().backward()
    reference(inputs).pow(2).mean().backward()
    for optim in (torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(reference.parameters(), lr=0.5)):
        optim.step()
    with unshard_params(model[2]):
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")

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
    _assert_unchanged(before, model)
    fully_shard(model)  # and a correct call still works afterwards
    model(torch.randn(2, 4)).sum().backward()
    assert type(model).__name__ == "FSDPLinear" and all(p.grad is not None and p.grad.shape == p.shape
                                                         for p in model.parameters())


def _fully_shard_argument_errors() -> None:
    """Every keyword of fully_shard refuses a wrong type or value, naming the API, the argument,
    what it got and what it accepts; the model is left exactly as it was."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    before = _snapshot(model)
    cases: List[Tuple[Dict[str, Any], type, Tuple[str, ...]]] = [
        ({"process_group": "world"}, TypeError, ("fully_shard(Sequential)", "process_group", "str", "ProcessGroup")),
        ({"process_group": (dist.group.WORLD,)}, ValueError, ("process_group", "pair")),
        # no replicate group: the replicas would never be averaged
        ({"process_group": (dist.group.WORLD, None), "strategy": ShardingStrategy.HYBRID_SHARD}, ValueError,
         ("process_group", "pair")),
        ({"mesh": "cpu"}, TypeError, ("mesh", "DeviceMesh", "str")),
        ({"policy": nn.Linear}, TypeError, ("policy", "ModuleWrapPolicy({Linear})")),
        ({"policy": {nn.Linear}}, TypeError, ("policy", "set", "ModuleWrapPolicy")),
        ({"strategy": "FULL_SHARD"}, TypeError, ("strategy", "ShardingStrategy", "str")),
        ({"mixed_precision": {"param_dtype": torch.bfloat16}}, TypeError, ("mixed_precision", "dict", "MixedPrecision")),
        ({"mixed_precision": MixedPrecision(param_dtype="bf16")}, TypeError,  # type: ignore[arg-type]
         ("mixed_precision.param_dtype", "torch.dtype", "bf16")),
        ({"mixed_precision": MixedPrecision(reduce_dtype=torch.int32)}, ValueError, ("reduce_dtype", "floating")),
        # each of the three dtypes is checked both ways (a stranger's mutant dropped buffer_dtype's checks)
        ({"mixed_precision": MixedPrecision(param_dtype=torch.int8)}, ValueError, ("param_dtype", "floating")),
        ({"mixed_precision": MixedPrecision(reduce_dtype=32)}, TypeError,  # type: ignore[arg-type]
         ("mixed_precision.reduce_dtype", "torch.dtype", "int")),
        ({"mixed_precision": MixedPrecision(buffer_dtype="bf16")}, TypeError,  # type: ignore[arg-type]
         ("mixed_precision.buffer_dtype", "torch.dtype", "bf16")),
        ({"mixed_precision": MixedPrecision(buffer_dtype=torch.int64)}, ValueError, ("buffer_dtype", "floating")),
        ({"mixed_precision": MixedPrecision(cast_forward_inputs=1)}, TypeError,  # type: ignore[arg-type]
         ("cast_forward_inputs", "bool")),
        ({"cpu_offload": True}, TypeError, ("cpu_offload", "CPUOffload", "bool")),
        ({"cpu_offload": CPUOffload(offload_params="no")}, TypeError,  # type: ignore[arg-type]
         ("cpu_offload.offload_params", "bool")),
        ({"ignored_modules": model[0]}, TypeError, ("ignored_modules", "single Linear", "[module]")),
        ({"ignored_modules": [model[0], "1"]}, TypeError, ("ignored_modules", "str", "index 1")),
        ({"ignored_modules": 3}, TypeError, ("ignored_modules", "int")),
        ({"ignored_states": model[0].weight}, TypeError, ("ignored_states", "Parameter")),
        ({"ignored_states": [model[0].weight, model[2]]}, ValueError, ("ignored_states", "mix")),
        ({"ignored_states": ["0.weight"]}, TypeError, ("ignored_states", "str")),
        ({"device_id": "cpu"}, TypeError, ("device_id", "str", "torch.device('cpu')")),
        ({"device_id": True}, TypeError, ("device_id", "bool")),
        ({"device_id": -1}, ValueError, ("device_id", ">= 0")),
        ({"device_id": torch.device("meta")}, ValueError, ("device_id", "meta")),
        ({"param_init_fn": "reset"}, TypeError, ("param_init_fn", "callable", "str")),
        ({"sync_module_states": "yes"}, TypeError, ("sync_module_states", "bool", "'yes'")),
        ({"forward_prefetch": "yes"}, TypeError, ("forward_prefetch", "bool", "'yes'")),
        ({"backward_prefetch": "BACKWARD_PRE"}, TypeError, ("backward_prefetch", "BackwardPrefetch")),
        ({"limit_all_gathers": 1}, TypeError, ("limit_all_gathers", "bool", "int")),
        ({"limit_all_gathers": False}, ValueError, ("limit_all_gathers=False", "not supported", "at most two")),
        ({"mesh": None, "process_group": dist.group.WORLD, "strategy": ShardingStrategy.NO_SHARD,
          "policy": CustomPolicy(lambda m: {"strategy": "NO_SHARD"} if isinstance(m, nn.Linear) else False)},
         TypeError, ("policy's options for '0'", "strategy", "ShardingStrategy")),
    ]
    if not torch.cuda.is_available():
        cases.append(({"device_id": 0}, ValueError, ("device_id", "CUDA is not available")))
    for kwargs, exc, fragments in cases:
        _expect(lambda: fully_shard(model, **kwargs), exc, *fragments)
        _assert_unchanged(before, model)
    _expect(lambda: fully_shard([model[0], model[2]], policy=ModuleWrapPolicy({nn.Linear})), ValueError,
            "fully_shard([", "policy=None")  # a list of modules is one FSDP2-style group, without a policy
    _assert_unchanged(before, model)
    _expect(lambda: fully_shard([model, model[0]]), ValueError, "['Linear']", "inside other modules of the list")
    _assert_unchanged(before, model)
    _expect(lambda: ModuleWrapPolicy(nn.Linear), TypeError, "module_classes", "ModuleWrapPolicy({Linear})")  # type: ignore[arg-type]
    _expect(lambda: ModuleWrapPolicy({"Linear"}), TypeError, "module_classes", "'Linear'")  # type: ignore[arg-type]
    _expect(lambda: CustomPolicy(True), TypeError, "CustomPolicy", "lambda_fn", "callable")  # type: ignore[arg-type]


def _other_api_argument_errors() -> None:
    """replicate, checkpoint, FSDPModule's switches and clip_grad_norm_ refuse bad arguments."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    before = _snapshot(model)
    for kwargs, exc, fragments in [
        ({"process_group": "world"}, TypeError, ("replicate(Sequential)", "process_group", "ProcessGroup", "str")),
        ({"device_id": "cpu"}, TypeError, ("replicate(Sequential)", "device_id", "torch.device")),
        ({"ignored_modules": model[0]}, TypeError, ("replicate(Sequential)", "ignored_modules", "[module]")),
        ({"ignored_modules": [1]}, TypeError, ("ignored_modules", "int")),
        ({"bucket_cap_mb": "25"}, TypeError, ("bucket_cap_mb", "number", "str")),
        ({"bucket_cap_mb": 0}, ValueError, ("bucket_cap_mb", "positive")),
        ({"bucket_cap_mb": True}, TypeError, ("bucket_cap_mb", "number", "bool")),  # not 1 MB
        ({"bucket_cap_mb": float("inf")}, ValueError, ("bucket_cap_mb", "positive", "inf")),
        ({"mixed_precision": {"reduce_dtype": torch.float16}}, TypeError, ("replicate(Sequential)", "MixedPrecision")),
    ]:
        _expect(lambda: replicate(model, **kwargs), exc, *fragments)
        _assert_unchanged(before, model)
    _expect(lambda: checkpoint(model, preserve_rng_state="yes"), TypeError,  # type: ignore[arg-type]
            "checkpoint(Sequential)", "preserve_rng_state", "bool")
    _expect(lambda: checkpoint(model, use_reentrant="no"), TypeError, "use_reentrant", "bool")  # type: ignore[arg-type]
    _assert_unchanged(before, model)

    fully_shard(model)
    model(torch.randn(2, 4)).sum().backward()
    state = fully_shard.state(model)
    before = _snapshot(model)
    _expect(lambda: model.set_requires_gradient_sync("no"), TypeError,  # type: ignore[operator]
            "set_requires_gradient_sync", "requires_gradient_sync", "bool", "'no'")
    _expect(lambda: model.set_requires_gradient_sync(False, recurse=0), TypeError, "recurse", "bool")  # type: ignore[operator]
    _expect(lambda: model.set_reshard_after_backward(1), TypeError,  # type: ignore[operator]
            "set_reshard_after_backward", "reshard_after_backward", "bool")
    assert state.sync_gradients and state.reshard_after_backward
    grads = [p.grad.clone() for p in model.parameters()]
    for args, exc, fragments in [
        (("1.0",), TypeError, ("clip_grad_norm_", "max_norm", "number", "str")),
        ((1.0, "fro"), TypeError, ("clip_grad_norm_", "norm_type", "number", "str")),
        ((-1.0,), ValueError, ("max_norm", ">= 0")),
        ((True,), TypeError, ("clip_grad_norm_", "max_norm", "number", "bool")),  # not 1.0
        ((1.0, float("nan")), ValueError, ("clip_grad_norm_", "norm_type", "NaN")),  # 0, -inf, -1: as torch's
        ((float("nan"),), ValueError, ("max_norm", "NaN")),
    ]:
        _expect(lambda: clip_grad_norm_(model, *args), exc, *fragments)
        _expect(lambda: model.clip_grad_norm_(*args), exc, *fragments)  # type: ignore[operator]
    assert all(torch.equal(g, p.grad) for g, p in zip_same(grads, list(model.parameters())))
    _assert_unchanged(before, model)
    # max_norm=0 is torch's too: every gradient zeroed, the norm before clipping returned
    expected = clip_grad_norm_(model, 1e9)  # the global norm, nothing clipped
    norm = clip_grad_norm_(model, 0.0)
    assert float(norm) > 0 and math.isclose(float(norm), float(expected), rel_tol=1e-5), (float(norm), float(expected))
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def _non_member_group() -> None:
    """A process group this rank is not in raises ValueError saying so (not 'world_size must be
    >= 1, got -1' from deep inside)."""
    group = dist.new_group([0])  # every rank must call new_group
    if dist.get_rank() != 0:
        model = nn.Sequential(nn.Linear(4, 4))
        before = _snapshot(model)
        for kwargs in ({"process_group": group},
                       {"process_group": (group, dist.group.WORLD), "strategy": ShardingStrategy.HYBRID_SHARD}):
            _expect(lambda: fully_shard(model, **kwargs), ValueError, "fully_shard(Sequential)", "process_group",
                    f"global rank {dist.get_rank()}", "not a member")
            _assert_unchanged(before, model)
        _expect(lambda: replicate(model, process_group=group), ValueError, "replicate(Sequential)", "not a member")
        _assert_unchanged(before, model)


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(3))


class _MetaModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.inner = _NoReset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.inner.w


def _meta_errors() -> None:
    """Meta parameters nothing can initialize: without param_init_fn fully_shard shards the model
    uninitialized (FSDP2's flow) and its forward raises, naming to_empty, until ``to_empty``;
    with a param_init_fn that leaves some on meta it raises naming them, and the model gets no
    fully_shard state, hook or class change; sync_module_states on such a model raises; ``to_empty``
    onto another device than the shards' raises naming both."""
    with torch.device("meta"):
        deferred = _MetaModel()
    _expect(lambda: fully_shard(deferred, sync_module_states=True), ValueError, "sync_module_states", "meta",
            "'inner.w' (_NoReset)", "to_empty")
    fully_shard(deferred)
    assert not deferred.inner.w.is_meta  # sharded, uninitialized storage
    _expect(lambda: deferred(torch.ones(2, 4)), RuntimeError, "meta device", "not initialized", "to_empty")
    _expect(lambda: deferred.to_empty(device="meta"), ValueError, "to_empty(device='meta')",  # not where its shards are
            "shards on cpu", "pass that device")
    deferred.to_empty(device="cpu")
    with torch.no_grad():
        deferred.lin.reset_parameters()
        deferred.inner.w.fill_(0.5)
    assert deferred.lin.weight.shape == (3, 4)  # whole while the init writes it
    with torch.no_grad():
        out = deferred(torch.ones(2, 4))
    assert out.shape == (2, 3) and deferred.inner.w.shape == (0 if dist.get_rank() == 0 else 3,)  # [0, 9) and [9, 18) of 18
    with unshard_params(deferred):
        assert torch.equal(deferred.inner.w, torch.full((3,), 0.5))

    with torch.device("meta"):
        model = _MetaModel()
    before = _snapshot(model)

    def only_linears(module: nn.Module) -> None:
        for sub in module.modules():
            if isinstance(sub, nn.Linear):
                sub.to_empty(device="cpu", recurse=False)
                sub.reset_parameters()

    _expect(lambda: fully_shard(model, param_init_fn=only_linears), ValueError, "['inner.w']", "still on the meta",
            "param_init_fn", "not applied")
    _assert_unchanged(before, model, values=False)  # the user's function materialized lin; nothing else changed
    assert fully_shard.state(model) is None and _get_registry(model) is None and model.inner.w.is_meta
    fully_shard(model, param_init_fn=lambda m: m.to_empty(device="cpu"))  # a complete function works
    assert not model.inner.w.is_meta


class _SparseModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.EmbeddingBag(10, 4, sparse=True), nn.Linear(4, 4))
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(ids) + self.emb(ids).sum(1))


def _sparse_gradients() -> None:
    """Embeddings with sparse=True (sparse gradients, which neither a flat parameter nor
    replicate's dense buckets can reduce) raise at fully_shard / replicate naming the module
    and the fix, model unchanged; before, the first backward failed inside autograd ("reshape
    is not implemented for sparse tensors", "Cannot access data pointer of Tensor that doesn't
    have storage"). Left out with ignored_modules, or frozen, they are fine."""
    torch.manual_seed(0)
    model = _SparseModel()
    before = _snapshot(model)
    _expect(lambda: fully_shard(model.body), ValueError, "fully_shard(Sequential): '0' (EmbeddingBag) has sparse=True",
            "sparse=False", "ignored_modules")
    _assert_unchanged(before, model)
    _expect(lambda: fully_shard(model), ValueError, "'body.0' (EmbeddingBag) has sparse=True")
    _assert_unchanged(before, model)
    _expect(lambda: replicate(model), ValueError, "replicate(_SparseModel): 'body.0' (EmbeddingBag) has sparse=True",
            "dense gradients only")
    _assert_unchanged(before, model)
    ids = torch.randint(0, 10, (3, 5), generator=torch.Generator().manual_seed(dist.get_rank()))
    for api in (fully_shard, replicate):  # left out: not managed, their gradients stay local and sparse
        kept = _SparseModel()
        api(kept, ignored_modules=[kept.body[0], kept.emb])  # type: ignore[operator]  # both take ignored_modules
        kept(ids).sum().backward()
        assert kept.emb.weight.grad is not None and kept.emb.weight.grad.is_sparse, api
        frozen = _SparseModel()  # frozen: no gradient at all
        frozen.body[0].requires_grad_(False)
        frozen.emb.requires_grad_(False)
        api(frozen)  # type: ignore[operator]
        frozen(ids).sum().backward()
        assert frozen.emb.weight.grad is None, api


def _different_models_on_ranks() -> None:
    """Rank 1 builds a wider second layer, then one of another dtype: the first forward raises on
    every rank, naming the parameter and both shapes (or this rank's dtype), before any all-gather could mismatch (the layouts are compared
    as JSON sent between ranks: nothing a peer sends is unpickled)."""
    torch.manual_seed(0)
    width = 5 if dist.get_rank() == 1 else 4
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, width))
    fully_shard(model[1])
    fully_shard(model)
    _expect(lambda: model(torch.randn(2, 3)), RuntimeError, "built different handles", "'weight'",
            f"[{width}, 4] here")
    # The same shapes, another dtype on rank 1 (a cast on one rank only): the buffers would differ in bytes.
    dtype = torch.float64 if dist.get_rank() == 1 else torch.float32
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4).to(dtype))
    fully_shard(model[1])
    fully_shard(model)
    _expect(lambda: model(torch.randn(2, 3)), RuntimeError, "built different handles", str(dtype))


def _case(name: str) -> None:
    {"different_models": _different_models_on_ranks, "composition": _errors, "fully_shard_arguments": _fully_shard_argument_errors,
     "other_api_arguments": _other_api_argument_errors, "non_member_group": _non_member_group,
     "meta": _meta_errors, "sparse_gradients": _sparse_gradients}[name]()


def _all() -> None:
    run_subtests(_case, {"name": ["different_models", "composition", "fully_shard_arguments", "other_api_arguments", "non_member_group",
                                  "meta", "sparse_gradients"]})


def test_errors_are_clear_and_leave_the_model_unchanged() -> None:
    """Shared parameters across manually annotated handles (siblings, child after parent, child
    before parent), replicate/fully_shard on each other's modules, applying twice, a nested
    FlatParameter, bad arguments of every public function, a process group this rank is not in,
    uninitializable meta parameters and embeddings with sparse gradients raise naming what to
    fix; nothing changes."""
    run_distributed(_all, 2, timeout=120)

