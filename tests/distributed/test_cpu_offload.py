"""``CPUOffload(offload_params=True)``: shards, gradients and optimizer state on the CPU.

On a CPU-only machine the compute device is the CPU too, so nothing moves between devices,
but the offload path still runs: every reduced gradient shard goes to a separate host buffer
and is accumulated into ``.grad`` only when the end of backward has waited for it (see [Note:
CPU offload] in ``_runtime/flat_param.py``). These tests check that path against local training,
gradient by gradient; with a CUDA device the same test runs the asynchronous copies (pinned
shards, one GPU)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

from composable_shard import (CPUOffload, MixedPrecision, ShardingStrategy, fully_shard, get_model_state_dict,
                              unshard_params)
from tests._harness import run_distributed, run_subtests
from tests._models import (Named, assert_params_close, batch, clone, local_rows, loss_fn, make_model,
                           make_optimizer, reference_training)

STEPS = 3
LR = 0.1  # plain SGD: a wrong gradient scale moves the parameters


def _shard(model: torch.nn.Module, strategy: ShardingStrategy, device: torch.device, **extra: Any) -> None:
    offload = CPUOffload(offload_params=True)
    kwargs: Dict[str, Any] = {"strategy": strategy, "cpu_offload": offload, **extra}
    if device.type == "cuda":
        kwargs["device_id"] = device
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def _full_params(model: torch.nn.Module) -> Named:
    with unshard_params(model, writeback=False):
        return [(n, p.detach().cpu().clone()) for n, p in model.named_parameters()]


def _full_grads(model: torch.nn.Module) -> Named:
    """Full gradients, copied to the CPU (where the reference trained): ``unshard_params``
    gathers them on the compute device."""
    with unshard_params(model, with_grads=True, writeback=False):
        return [(n, p.grad.detach().cpu().clone()) for n, p in model.named_parameters() if p.grad is not None]


def _rows(step: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's inputs and targets of ``step`` on ``device``, where the model computes (its
    logits land there, so the targets must too)."""
    rank = dist.get_rank()
    inputs, targets = batch(step, dist.get_world_size())
    return local_rows(inputs, rank).to(device), local_rows(targets, rank).to(device)


def _train(model: torch.nn.Module, device: torch.device, after_backward: Callable[[int], None]) -> None:
    """STEPS of plain SGD on this rank's rows, computed on ``device``; the optimizer steps the
    offloaded shards on the CPU."""
    optim = make_optimizer("sgd", model.parameters(), LR)
    for step in range(STEPS):
        inputs, targets = _rows(step, device)
        loss_fn(model(inputs), targets).backward()
        after_backward(step)
        optim.step()
        optim.zero_grad()


def _offload_subtest(strategy: ShardingStrategy, device: torch.device) -> None:
    world_size = dist.get_world_size()
    reference = make_model()
    model = clone(reference)
    expected: List[Named] = []
    reference_training(reference, STEPS, world_size, lr=LR, optimizer="sgd", grads=expected)
    _shard(model, strategy, device)
    for p in model.parameters():  # shards live on the CPU whatever the compute device
        assert p.device.type == "cpu", f"[{strategy.name}] parameter on {p.device}"
        assert p.is_pinned() == (device.type == "cuda"), f"[{strategy.name}] pinned {p.is_pinned()}"

    def after_backward(step: int) -> None:
        for name, p in model.named_parameters():
            assert p.grad is None or p.grad.device.type == "cpu", f"[{strategy.name}] {name}.grad on {p.grad.device}"
        root = fully_shard.state(model)
        for h in root._all_handles:
            assert all(g.landing_grad is None for g in h.groups), f"[{strategy.name}] a gradient copy not landed"
        assert_params_close(_full_grads(model), expected[step], what=f"[{strategy.name} offload] step {step} grads")

    _train(model, device, after_backward)
    handles = fully_shard.state(model)._all_handles
    assert len(handles) == len(model.blocks) + 1 and all(h.offload_params for h in handles)
    assert_params_close(_full_params(model), list(reference.named_parameters()), what=f"[{strategy.name} offload]")

    # A second backward without zero_grad adds to the gradient that landed from the first,
    # as local training does (the landed host copy is accumulated, never assigned).
    twice = clone(reference)
    for _ in range(2):
        inputs, targets = batch(STEPS, world_size)
        loss_fn(twice(inputs), targets).backward()
        rows, row_targets = _rows(STEPS, device)
        loss_fn(model(rows), row_targets).backward()
    assert_params_close(_full_grads(model), [(n, p.grad) for n, p in twice.named_parameters() if p.grad is not None],
                        what=f"[{strategy.name} offload] two backwards")
    full = get_model_state_dict(model)
    assert_params_close([(n, full[n].cpu()) for n, _ in reference.named_parameters()], _full_params(model),
                        atol=0.0, what=f"[{strategy.name} offload] state dict")


def _offload_low_precision(device: torch.device) -> None:
    """Offloaded shards computing and reducing in bf16: each ``.grad`` lands in the parameters'
    float32 (as without offload), close to local training's."""
    world_size = dist.get_world_size()
    reference = make_model()
    model = clone(reference)
    _shard(model, ShardingStrategy.FULL_SHARD, device, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    inputs, targets = batch(0, world_size)
    loss_fn(reference(inputs), targets).backward()
    rows, row_targets = _rows(0, device)
    loss_fn(model(rows), row_targets).backward()
    dtypes = {n: p.grad.dtype for n, p in model.named_parameters() if p.grad is not None}
    assert dtypes and set(dtypes.values()) == {torch.float32}, dtypes
    assert_params_close(_full_grads(model), [(n, p.grad) for n, p in reference.named_parameters() if p.grad is not None],
                        atol=5e-2, what="offload, bf16 compute and reduction")


def _offload(device_type: str) -> None:
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    run_subtests(_offload_subtest, {"strategy": [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP,
                                                 ShardingStrategy.NO_SHARD]}, device=device)
    _offload_low_precision(device)


@pytest.mark.parametrize("world_size", [1, 2])
def test_cpu_offload_matches_local_training(world_size: int) -> None:
    """FULL_SHARD, SHARD_GRAD_OP, NO_SHARD with offloaded shards: every backward's gradients,
    the SGD-trained parameters, accumulation over two backwards and the full state dict equal
    local training; parameters and gradients stay on the CPU."""
    run_distributed(_offload, world_size, "cpu", timeout=180)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA offload path needs a GPU (run on a GPU machine)")
def test_cpu_offload_cuda_compute_device() -> None:
    """One GPU, compute on cuda:0: pinned CPU shards copied to the GPU for each all-gather, reduced
    gradients copied back without waiting, the optimizer on the CPU; inputs and targets on the
    GPU with the logits, the reference and every comparison on the CPU; equal to local training.
    (W=1: the library issues no collective, so the harness's gloo group is enough; tests/cuda
    runs the same subtests at W=2.)"""
    run_distributed(_offload, 1, "cuda", timeout=300)
