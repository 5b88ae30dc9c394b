"""torch's own gradient clipping, torch's data-parallel wrappers and device moves on models this
library manages (API.md "Interoperability"; [Note: torch's clip_grad_norm_ on sharded
gradients] and [Note: Foreign wrappers] in ``_interop.py``).

Without these: ``torch.nn.utils.clip_grad_norm_`` (what every framework loop calls) saw each
rank's gradient slices only, so ranks clipped by different factors and their updates silently
stopped being one model's; ``DistributedDataParallel`` around a sharded model broadcast rank 0's
slices over rank 1's when their sizes happened to match; ``accelerate``'s ``.to("cpu:0")`` was
refused although the shards already live there.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Tuple

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


def _clip_entry(configs: List[str]) -> None:
    run_subtests(_clip_case, {"config": configs, "norm_type": [2.0, math.inf, 1.0], "foreach": [None, True],
                              "api": ["clip_grad_norm_"]})
    run_subtests(_clip_case, {"config": configs[:1], "norm_type": [2.0], "foreach": [None], "api": ["get_total_norm"]})


@pytest.mark.parametrize("world_size", [2, 4])
def test_torch_clip_grad_norm_uses_the_global_norm(world_size: int) -> None:
    """Every strategy, replicate and a mixed model; HYBRID_SHARD on a 2 x 2 mesh at W=4."""
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


def _wrappers() -> Dict[str, Callable[[nn.Module], Any]]:
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard as torch_fully_shard
    from torch.nn.parallel import DistributedDataParallel
    return {"DistributedDataParallel": DistributedDataParallel,
            "DistributedDataParallel(parent)": lambda m: DistributedDataParallel(nn.Sequential(m)),
            "FullyShardedDataParallel(parent)": lambda m: FullyShardedDataParallel(nn.Sequential(m)),
            "torch fully_shard(parent)": lambda m: torch_fully_shard(nn.Sequential(m))}


def _wrapper_case(wrapper: str, managed_by: str) -> None:
    """The wrapper raises at construction on every rank, naming the reason; every parameter's
    object, storage and value are as before, and training goes on as local training would."""
    model = _even_model() if managed_by == "fully_shard" else replicate(nn.Sequential(nn.Linear(4, 4)))
    before = [(n, p, p.untyped_storage().data_ptr(), p.detach().clone()) for n, p in model.named_parameters()]
    try:
        _wrappers()[wrapper](model)
    except RuntimeError as e:
        assert "cannot wrap a module managed by" in str(e) and managed_by in str(e), e
        assert "composable_shard.integrations.transformers" in str(e) and "Nothing was changed" in str(e), e
    else:
        raise AssertionError(f"{wrapper} around a module managed by {managed_by} must raise at construction")
    after = list(model.named_parameters())
    for (n, p, ptr, value), (n2, p2) in zip_same(before, after, what=wrapper):
        assert n == n2 and p is p2 and p2.untyped_storage().data_ptr() == ptr, (wrapper, n)
        assert torch.equal(p2, value), f"{wrapper}: {n} changed on rank {dist.get_rank()}"


def _wrapper_entry() -> None:
    run_subtests(_wrapper_case, {"wrapper": list(_wrappers()), "managed_by": ["fully_shard", "replicate"]})


def test_torch_data_parallel_wrappers_are_refused_at_construction() -> None:
    run_distributed(_wrapper_entry, 2, timeout=120)


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
