"""torch's own gradient clipping, torch's data-parallel wrappers and device moves on models this
library manages (API.md "Interoperability"; [Note: torch's clip_grad_norm_ on sharded
gradients] and [Note: Foreign wrappers] in ``_runtime/interop.py``).

Without these: ``torch.nn.utils.clip_grad_norm_`` (what every framework loop calls) saw each
rank's gradient slices only, so ranks clipped by different factors and their updates silently
stopped being one model's; ``DistributedDataParallel`` around a sharded model broadcast rank 0's
slices over rank 1's when their sizes happened to match, and so did torch's composable
``replicate`` at its first forward (its ``@contract`` traversal matched no listed frame); a
refused FSDP2 ``fully_shard`` left torch's registry in the module; ``accelerate``'s
``.to("cpu:0")`` was refused although the shards already live there.
"""

from __future__ import annotations

import importlib
import inspect
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import ShardingStrategy, fully_shard, replicate, unshard_params
from tests._harness import run_distributed, run_subtests
from tests._models import (Named, assert_params_close, batch, full_grads, local_rows, loss_fn, make_model,
                           zip_same)

MAX_NORM = 0.3  # below every step's gradient norm: each step is really clipped
STEPS = 3


def _build(config: str) -> nn.Module:
    """The parity model (tied embedding and head, a frozen layer, a one-element handle) under
    ``config``: a ``fully_shard`` strategy, ``replicate``, or both on different blocks."""
    model = make_model()
    if config == "replicate":
        return replicate(model)
    if config == "mixed":
        replicate(model.blocks[0])
        fully_shard(model.blocks[1])
        return fully_shard(model)
    kwargs: Dict[str, Any] = {"strategy": ShardingStrategy[config]}
    if "HYBRID" in config:
        from torch.distributed.device_mesh import init_device_mesh
        kwargs["mesh"] = init_device_mesh("cpu", (2, 2))
    for block in model.blocks:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def _torch_clip(parameters: Any, norm_type: float, foreach: Any, api: str) -> torch.Tensor:
    if api == "clip_grad_norm_":
        return torch.nn.utils.clip_grad_norm_(parameters, MAX_NORM, norm_type, foreach=foreach)
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
    torch.nn.utils.clip_grads_with_norm_(parameters, MAX_NORM, total, foreach=foreach)
    return total


def _reference(norm_type: float, world_size: int) -> Tuple[List[float], List[Named]]:
    """Single-process SGD on the combined batch, clipped by torch's clip_grad_norm_: each
    step's total norm and clipped gradients."""
    model = make_model()
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    norms, grads = [], []
    for step in range(STEPS):
        inputs, targets = batch(step, world_size)
        loss_fn(model(inputs), targets).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)))
        grads.append([(n, p.grad.detach().clone()) for n, p in model.named_parameters() if p.grad is not None])
        optim.step()
        optim.zero_grad()
    return norms, grads


def _clip_case(config: str, norm_type: float, foreach: Any, api: str) -> None:
    """torch's clip_grad_norm_ (or get_total_norm + clip_grads_with_norm_) on every rank after a
    synced backward: the total norm is the single-process one on every rank, and so is every
    clipped gradient; plain SGD, so a wrong clip factor moves the parameters."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    expected_norms, expected_grads = _reference(norm_type, world_size)
    model = _build(config)
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    what = f"[{config}, norm {norm_type}, foreach={foreach}, {api}, W={world_size}]"
    for step in range(STEPS):
        inputs, targets = batch(step, world_size)
        loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank)).backward()
        total = _torch_clip(list(model.parameters()), norm_type, foreach, api)
        assert not isinstance(total, torch.Tensor) or type(total) is torch.Tensor, f"{what} {type(total)}"
        assert math.isclose(float(total), expected_norms[step], rel_tol=1e-5), \
            f"{what} step {step}: total norm {float(total)} on rank {rank}, single-process {expected_norms[step]}"
        assert_params_close(full_grads(model), expected_grads[step], atol=1e-6, what=f"{what} step {step} clipped grads")
        optim.step()
        optim.zero_grad()


def _clip_cases(configs: List[str]) -> List[Tuple[str, float, Optional[bool]]]:
    """Every config under every norm type, foreach alternating (None, True) through them, so that
    each (norm type, foreach) pair meets several configs: foreach picks torch's kernel for the
    per-gradient norms, the config how the gradients are sharded, independently."""
    pairs = [(config, norm_type) for config in configs for norm_type in (2.0, math.inf, 1.0)]
    return [(config, norm_type, (None, True)[i % 2]) for i, (config, norm_type) in enumerate(pairs)]


def _clip_one(case: Tuple[str, float, Optional[bool]]) -> None:
    config, norm_type, foreach = case
    _clip_case(config=config, norm_type=norm_type, foreach=foreach, api="clip_grad_norm_")


def _clip_entry(configs: List[str]) -> None:
    run_subtests(_clip_one, {"case": _clip_cases(configs)})
    run_subtests(_clip_case, {"config": configs[:1], "norm_type": [2.0], "foreach": [None], "api": ["get_total_norm"]})


@pytest.mark.parametrize("world_size", [2, 4])
def test_torch_clip_grad_norm_uses_the_global_norm(world_size: int) -> None:
    """Every strategy, replicate and a mixed model, each under the 2-, inf- and 1-norm (with and
    without foreach, ``_clip_cases``); HYBRID_SHARD on a 2 x 2 mesh at W=4."""
    configs = ["FULL_SHARD", "SHARD_GRAD_OP", "mixed", "replicate", "NO_SHARD"]
    if world_size == 4:
        configs = ["FULL_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "mixed"]
    run_distributed(_clip_entry, world_size, configs, timeout=240)


def _logging_norm_is_local() -> None:
    """A norm taken outside torch's clipping (a user logging ``p.grad.norm()`` on rank 0 only)
    is this rank's and issues no collective: it must not wait for the other ranks."""
    model = _build("FULL_SHARD")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    inputs, targets = batch(0, world_size)
    loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank)).backward()
    grad = model.blocks[0].fc1.weight.grad
    assert grad is not None
    if rank == 0:
        plain = grad.detach().clone().as_subclass(torch.Tensor)
        assert torch.equal(grad.norm(), plain.norm()) and torch.equal(torch.linalg.vector_norm(grad), plain.norm())
        assert type(grad * 2) is torch.Tensor and type(grad.norm()) is torch.Tensor
    dist.barrier()


def test_norms_outside_torch_clipping_stay_local() -> None:
    run_distributed(_logging_norm_is_local, 2, timeout=60)


# ------------------------------------------------------------------------------- wrappers

def _even_model() -> nn.Module:
    """Two bias-free Linear(4, 4) layers, each fully sharded: at W=2 every rank holds 8 of each
    weight's 16 elements, so rank 0's slices have the same shapes as rank 1's and DDP's start-up
    shape check passes: before, its broadcast then overwrote rank 1's slices with rank 0's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    fully_shard(model[0])
    fully_shard(model[1])
    return fully_shard(model)


def _wrappers() -> Dict[str, Tuple[Callable[[nn.Module], nn.Module], Callable[[nn.Module], Any]]]:
    """name -> (the module the wrapper is applied to, made from the managed one; the wrapper):
    one or more per entry of ``interop._FOREIGN`` (see :func:`_foreign_table_keys`)."""
    from torch.distributed._composable.replicate import replicate as torch_replicate
    from torch.distributed._composable.replicate_with_fsdp import replicate as replicate_with_fsdp
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard as torch_fully_shard
    from torch.nn.parallel import DistributedDataParallel

    def itself(m: nn.Module) -> nn.Module:
        return m

    def parent(m: nn.Module) -> nn.Module:
        return nn.Sequential(m)

    return {"DistributedDataParallel": (itself, DistributedDataParallel),
            "DistributedDataParallel(parent)": (parent, DistributedDataParallel),
            "FullyShardedDataParallel(parent)": (parent, FullyShardedDataParallel),
            "torch fully_shard": (itself, torch_fully_shard),
            "torch fully_shard(parent)": (parent, torch_fully_shard),
            "torch replicate": (itself, torch_replicate),
            "torch replicate(parent)": (parent, torch_replicate),
            "replicate_with_fsdp": (itself, replicate_with_fsdp),
            "replicate_with_fsdp(parent)": (parent, replicate_with_fsdp)}


def _foreign_table_keys() -> Dict[Tuple[str, str], str]:
    """The (module's last component, function name) of each torch wrapper entry point the
    guard must know, read from the installed torch: exactly ``interop._FOREIGN``'s keys, so a
    torch that moved one, or an entry for an API torch no longer has, fails here. Values: the
    wrapper case (or test) that exercises the entry."""
    replicate_module = importlib.import_module("torch.distributed._composable.replicate")  # the package re-exports the function
    from torch.distributed._composable.replicate_with_fsdp import replicate as replicate_with_fsdp
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard as torch_fully_shard
    from torch.nn.parallel import DistributedDataParallel

    def key(function: Any) -> Tuple[str, str]:
        function = inspect.unwrap(function)
        return (function.__module__.rsplit(".", 1)[-1], function.__code__.co_name)

    return {key(DistributedDataParallel.__init__): "DistributedDataParallel",
            key(FullyShardedDataParallel.__init__): "FullyShardedDataParallel(parent)",
            key(torch_fully_shard): "torch fully_shard",
            key(replicate_module.replicate): "torch replicate",
            key(replicate_module._ReplicateState.init): "test_torch_replicate_applied_before_fully_shard_is_refused_at_its_first_forward",
            key(replicate_with_fsdp): "replicate_with_fsdp"}


def test_every_foreign_wrapper_entry_is_torchs_and_tested() -> None:
    """Every entry of the guard's table names a function of the installed torch, each such
    function has an entry, and each has a test: a table entry that matches nothing (FSDP1's
    composable fully_shard, gone from torch) looks like protection and is none."""
    from composable_shard._runtime.interop import _FOREIGN
    keys = _foreign_table_keys()
    assert set(keys) == set(_FOREIGN), (sorted(keys), sorted(_FOREIGN))
    for entry, case in keys.items():
        assert case in _wrappers() or case in globals(), (entry, case)


def _dict_keys(modules: List[nn.Module]) -> List[List[str]]:
    return [sorted(m.__dict__) for m in modules]


def _raised_everywhere(raised: bool) -> None:
    """Every rank raised (all-reduced, so a rank that did not makes every rank fail)."""
    flag = torch.tensor([int(raised)])
    dist.all_reduce(flag)
    assert int(flag) == dist.get_world_size(), f"only {int(flag)} of {dist.get_world_size()} ranks raised"


def _assert_refused(error: Optional[RuntimeError], wrapper: str, managed_by: str) -> None:
    if error is None:
        raise AssertionError(f"{wrapper} around a module managed by {managed_by} must raise on rank {dist.get_rank()}")
    message = str(error)
    assert "cannot wrap a module managed by" in message and managed_by in message, message
    assert "composable_shard.integrations.transformers" in message and "Nothing was changed" in message, message


def _wrapper_case(wrapper: str, managed_by: str) -> None:
    """The wrapper raises when applied, on every rank, naming the reason; every parameter's
    object, storage and value are as before, no module's ``__dict__`` gained or lost a key
    (torch's @contract puts its registry and state in before it traverses), and training goes
    on as local training would."""
    model = _even_model() if managed_by == "fully_shard" else replicate(nn.Sequential(nn.Linear(4, 4)))
    make_target, wrap = _wrappers()[wrapper]
    target = make_target(model)
    modules = list(target.modules())
    keys = _dict_keys(modules)
    before = [(n, p, p.untyped_storage().data_ptr(), p.detach().clone()) for n, p in model.named_parameters()]
    error: Optional[RuntimeError] = None
    try:
        wrap(target)
    except RuntimeError as e:
        error = e
    _raised_everywhere(error is not None)
    _assert_refused(error, wrapper, managed_by)
    assert _dict_keys(modules) == keys, f"{wrapper}: module __dict__ keys changed on rank {dist.get_rank()}"
    after = list(model.named_parameters())
    for (n, p, ptr, value), (n2, p2) in zip_same(before, after, what=wrapper):
        assert n == n2 and p is p2 and p2.untyped_storage().data_ptr() == ptr, (wrapper, n)
        assert torch.equal(p2, value), f"{wrapper}: {n} changed on rank {dist.get_rank()}"


def _wrapper_entry() -> None:
    run_subtests(_wrapper_case, {"wrapper": list(_wrappers()), "managed_by": ["fully_shard", "replicate"]})


def test_torch_data_parallel_wrappers_are_refused_at_construction() -> None:
    """DDP, FSDP1, FSDP2's fully_shard, torch's composable replicate and replicate_with_fsdp,
    on the managed module and on a plain parent of it. Before, torch's replicate passed (its
    @contract wrapper traversed the module before any listed frame was on the stack) and set
    up DDP at the first forward, whose broadcast overwrote rank 1's shards with rank 0's."""
    run_distributed(_wrapper_entry, 2, timeout=120)


def _replicate_then_fully_shard(where: str) -> None:
    """torch's composable replicate applied first (to the root, or to a plain parent of the
    model), our fully_shard afterwards: the first forward, where torch's replicate would build
    its DDP and broadcast rank 0's shards, raises on every rank; parameters and every
    module's ``__dict__`` keys are as they were before that forward."""
    from torch.distributed._composable.replicate import replicate as torch_replicate
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    top = torch_replicate(model if where == "root" else nn.Sequential(model))
    fully_shard(model[0])
    fully_shard(model[1])
    fully_shard(model)
    modules = list(top.modules())
    keys = _dict_keys(modules)
    before = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    error: Optional[RuntimeError] = None
    try:
        top(torch.ones(2, 4))
    except RuntimeError as e:
        error = e
    _raised_everywhere(error is not None)
    _assert_refused(error, "torch's composable replicate", "fully_shard")
    assert _dict_keys(modules) == keys, f"module __dict__ keys changed on rank {dist.get_rank()}"
    for (n, value), (n2, p) in zip_same(before, list(model.named_parameters())):
        assert n == n2 and torch.equal(p, value), f"{n} changed on rank {dist.get_rank()}"


def _replicate_first_entry() -> None:
    run_subtests(_replicate_then_fully_shard, {"where": ["root", "parent"]})


def test_torch_replicate_applied_before_fully_shard_is_refused_at_its_first_forward() -> None:
    run_distributed(_replicate_first_entry, 2, timeout=60)


def test_moves_to_the_shards_own_device_are_no_ops() -> None:
    run_distributed(_train_after_moves, 2, timeout=60)


def _train_after_moves() -> None:
    """``.to("cpu:0")``, ``.to(torch.device("cpu", 0))``, ``.to("cpu")`` and ``.cpu()`` on the
    model and on a plain parent are no-ops: every parameter keeps its object and storage (the
    views of the flat shards), and training afterwards equals local training. A move that does
    change something (a dtype) is still refused."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, reference = make_model(), make_model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    parent = nn.Sequential(model)
    slots = [(n, p, p.untyped_storage().data_ptr()) for n, p in model.named_parameters()]
    optim, ref_optim = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(reference.parameters(), lr=0.5)
    moves = [lambda: model.to("cpu:0"), lambda: parent.to(torch.device("cpu", 0)), lambda: model.to("cpu"),
             lambda: model.cpu()]
    for step, move in enumerate(moves):
        inputs, targets = batch(step, world_size)
        loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank)).backward()
        loss_fn(reference(inputs), targets).backward()
        assert move() is not None
        assert [(n, p, p.untyped_storage().data_ptr()) for n, p in model.named_parameters()] == slots, step
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    with pytest.raises(RuntimeError, match="new storage"):
        model.to("cpu:0", torch.float64)
    with unshard_params(model):
        assert_params_close(list(model.named_parameters()), list(reference.named_parameters()), what="after moves")
