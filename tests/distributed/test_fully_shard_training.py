"""fully_shard trains exactly like single-process training on the combined batch, and like
torch's own FullyShardedDataParallel(use_orig_params=True), for every strategy, with manual
per-layer annotation and with a policy.

Without these, a wrong shard offset, a missing division by the world size, a tied weight
reduced twice, or a frozen parameter updated would silently change training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import ModuleWrapPolicy, ShardingStrategy, fully_shard, unshard_params
from tests._harness import run_distributed, run_subtests
from tests._models import (Block, Named, Scale, assert_losses_close, assert_params_close, batch,
                           check_grads_each_step, distributed_training, full_grads, global_mean, local_rows, loss_fn,
                           make_model, reference_training, zip_same)

STEPS = 3  # step 0 (nothing recorded yet), step 1 (the first after an optimizer step, forward order known), step 2 (the same again)


@dataclass(frozen=True)
class _Reference:
    """Single-process training of ``make_model()`` on the combined batch: the losses, the
    gradients of every backward and the final parameters. The same for every subtest of a
    spawn with that optimizer, so computed once per spawn (``_parity``)."""

    losses: List[float]
    grads: List[Named]
    params: Named


def _reference(optimizer: str, lr: float) -> _Reference:
    model = make_model()
    grads: List[Named] = []
    losses = reference_training(model, STEPS, dist.get_world_size(), lr=lr, optimizer=optimizer, grads=grads)
    return _Reference(losses, grads, [(n, p.detach().clone()) for n, p in model.named_parameters()])


def _groups_kwargs(strategy: ShardingStrategy) -> Dict[str, Any]:
    """HYBRID needs a 2-D mesh: (replicate, shard) = (W/2, 2) where W allows, else (1, W)."""
    if strategy not in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        return {}
    from torch.distributed.device_mesh import init_device_mesh

    world_size = dist.get_world_size()
    shard = 2 if world_size % 2 == 0 and world_size > 2 else world_size
    mesh = init_device_mesh("cpu", (world_size // shard, shard))
    return {"mesh": mesh}


def _apply(model: nn.Module, annotation: str, strategy: ShardingStrategy, **extra: Any) -> None:
    kwargs = {"strategy": strategy, **_groups_kwargs(strategy), **extra}
    if annotation == "manual":
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, **kwargs)
        fully_shard(model.scale, **kwargs)  # type: ignore[arg-type]
        fully_shard(model, **kwargs)
    else:
        fully_shard(model, policy=ModuleWrapPolicy({Block, Scale}), **kwargs)


def _full_params(model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    with unshard_params(model):
        return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def _parity_subtest(case: Tuple[ShardingStrategy, str, bool], adamw: _Reference) -> None:
    """AdamW steps; Adam hides a wrong gradient scale, so the gradients of every backward are
    compared with local training's too."""
    strategy, annotation, forward_prefetch = case
    model = make_model()
    _apply(model, annotation, strategy, forward_prefetch=forward_prefetch)
    assert type(model).__name__ == "FSDPParityModel" and isinstance(model.blocks[0], Block)
    what = f"[{strategy.name}/{annotation}/forward_prefetch={forward_prefetch}]"
    losses = distributed_training(model, STEPS, after_backward=check_grads_each_step(model, adamw.grads, what))
    assert_losses_close(losses, adamw.losses, what=what)
    assert_params_close(_full_params(model), adamw.params, what=what)
    frozen = model.frozen.weight
    assert frozen.grad is None and not frozen.requires_grad


def _torch_fsdp1_subtest(strategy: ShardingStrategy, sgd: _Reference) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

    kwargs: Dict[str, Any] = {}
    if strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        mesh = _groups_kwargs(strategy)["mesh"]
        kwargs["device_mesh"] = mesh
    # Plain SGD (lr 0.1): a wrong gradient scale moves the parameters, where Adam would hide it;
    # our gradients are also compared with local training's after every backward.
    torch_model = FSDP(make_model(), auto_wrap_policy=TorchModuleWrapPolicy({Block, Scale}), use_orig_params=True,
                       device_id=torch.device("cpu"), sharding_strategy=TorchStrategy[strategy.name], **kwargs)
    torch_losses = distributed_training(torch_model, STEPS, lr=0.1, optimizer="sgd")
    model = make_model()
    _apply(model, "policy", strategy, **({"mesh": kwargs["device_mesh"]} if "device_mesh" in kwargs else {}))
    what = f"[{strategy.name} vs torch FSDP]"
    losses = distributed_training(model, STEPS, lr=0.1, optimizer="sgd",
                                  after_backward=check_grads_each_step(model, sgd.grads, what))
    assert_losses_close(losses, torch_losses, what=what)
    with FSDP.summon_full_params(torch_model):
        expected = [(n.replace("_fsdp_wrapped_module.", ""), p.detach().clone()) for n, p in torch_model.named_parameters()]
    assert_params_close(_full_params(model), expected, what=f"[{strategy.name} vs torch FSDP]")


def _hybrid_with_group_pair(sgd: _Reference) -> None:
    """HYBRID_SHARD from an explicit (shard group, replicate group) pair: shard over {0,1} and
    {2,3}, replicate over {0,2} and {1,3}."""
    shard, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    replicate, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    model = make_model()
    fully_shard(model, policy=ModuleWrapPolicy({Block, Scale}), strategy=ShardingStrategy.HYBRID_SHARD,
                process_group=(shard, replicate))
    assert fully_shard.state(model).world_size == 2 and fully_shard.state(model).dp_world_size == 4
    losses = distributed_training(model, STEPS, lr=0.1, optimizer="sgd",
                                  after_backward=check_grads_each_step(model, sgd.grads, "[hybrid pair]"))
    assert_losses_close(losses, sgd.losses, what="[hybrid pair]")
    assert_params_close(_full_params(model), sgd.params, what="[hybrid pair]")


def _custom_policy_override_subtest(root: ShardingStrategy, override: ShardingStrategy, adamw: _Reference) -> None:
    """A CustomPolicy returning ``{"strategy": override}`` for blocks.0 gives that block's
    handle the override and the rest the call's strategy: the same model, step by step, as
    annotating by hand (losses and parameters bit for bit), and local training's numbers."""
    from composable_shard import CustomPolicy

    by_policy, by_hand = make_model(), make_model()
    special = by_policy.blocks[0]
    fully_shard(by_policy, strategy=root, policy=CustomPolicy(
        lambda m: {"strategy": override} if m is special else isinstance(m, (Block, Scale))))
    fully_shard(by_hand.blocks[0], strategy=override)
    fully_shard(by_hand.blocks[1], strategy=root)
    fully_shard(by_hand.scale, strategy=root)
    fully_shard(by_hand, strategy=root)
    assert [fully_shard.state(m).strategy for m in (by_policy.blocks[0], by_policy.blocks[1], by_policy)] == \
        [override, root, root]
    what = f"[{root.name} root, {override.name} blocks.0]"
    rank, world_size = dist.get_rank(), dist.get_world_size()
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (by_policy, by_hand)]
    for step in range(STEPS):
        inputs, targets = batch(step, world_size)
        losses = []
        for model, optim in zip_same((by_policy, by_hand), optims):
            loss = loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank))
            loss.backward()
            if model is by_policy:  # Adam hides a wrong gradient scale: compare the gradients too
                assert_params_close(full_grads(model), adamw.grads[step], what=f"{what} step {step} grads")
            optim.step()
            optim.zero_grad()
            losses.append(global_mean(loss))
        assert losses[0] == losses[1], f"{what} step {step}: loss {losses[0]} by policy, {losses[1]} by hand"
        assert abs(losses[0] - adamw.losses[step]) <= 1e-5, f"{what} step {step}: {losses[0]} vs local {adamw.losses[step]}"
        assert_params_close(_full_params(by_policy), _full_params(by_hand), atol=0.0, what=f"{what} step {step}")
    assert_params_close(_full_params(by_policy), adamw.params, what=f"{what} vs local")


def _cpu_offload_subtest(adamw: _Reference) -> None:
    """CPUOffload(offload_params=True) with a CPU compute device is accepted and trains like
    local training (shards, gradients and optimizer state all live on the CPU)."""
    from composable_shard import CPUOffload

    model = make_model()
    _apply(model, "policy", ShardingStrategy.FULL_SHARD, cpu_offload=CPUOffload(offload_params=True))
    assert fully_shard.state(model).cpu_offload.offload_params
    assert_losses_close(distributed_training(model, STEPS), adamw.losses, what="[cpu_offload]")
    assert_params_close(_full_params(model), adamw.params, what="[cpu_offload]")


def _float64_subtest(strategy: ShardingStrategy) -> None:
    """A float64 model (cast before fully_shard) trains as a local float64 one: gloo has no
    averaging reduction, so float64 sums are divided after the reduction as float32 ones are (a
    sum W times the mean moves plain SGD W times too far). 3 SGD steps: every backward's
    gradients, the losses and the final parameters."""
    world_size = dist.get_world_size()
    reference = make_model().double()
    grads: List[Named] = []
    expected = reference_training(reference, STEPS, world_size, lr=0.1, optimizer="sgd", grads=grads)
    model = make_model().double()
    _apply(model, "policy", strategy)
    what = f"[float64/{strategy.name}]"
    losses = distributed_training(model, STEPS, lr=0.1, optimizer="sgd",
                                  after_backward=check_grads_each_step(model, grads, what))
    assert_losses_close(losses, expected, what=what)
    assert_params_close(_full_params(model), list(reference.named_parameters()), what=what)
    assert all(p.dtype == torch.float64 for p in model.parameters())


def _penalized_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A WGAN-GP-style loss: the error plus the squared gradient of the outputs by the inputs
    (a graph of the gradient: ``create_graph=True``)."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    (slope,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return nn.functional.mse_loss(out, y) + 0.3 * slope.pow(2).sum(1).mean()


def _gradient_penalty_subtest(strategy: ShardingStrategy) -> None:
    """A gradient penalty reaches a fully sharded module: with a real shard (FULL_SHARD,
    SHARD_GRAD_OP, HYBRID) the first backward (``autograd.grad`` or ``backward`` with
    ``create_graph=True``) raises naming the module and what to use (it failed later in torch's
    "setStorage ... storage of size 0", naming nothing), and the next plain steps equal local
    training; with NO_SHARD (the named remedy) 3 penalized SGD steps equal local training
    (gradients of each backward, final parameters)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()

    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))

    reference, model = make(), make()
    kwargs = {"strategy": strategy, **_groups_kwargs(strategy)}
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    optim, reference_optim = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    generator = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(4 * world_size, 5, generator=generator), torch.randn(4 * world_size, 3, generator=generator)
    mine = slice(4 * rank, 4 * (rank + 1))
    refused = strategy is not ShardingStrategy.NO_SHARD
    if refused:
        for how in ("grad", "backward"):
            with pytest.raises(RuntimeError, match=r"fully_shard\(.*\): a backward with create_graph=True .* Apply "
                                                   r"replicate, or fully_shard with strategy=ShardingStrategy.NO_SHARD"):
                if how == "grad":
                    _penalized_loss(model, inputs[mine], targets[mine]).backward()
                else:
                    nn.functional.mse_loss(model(inputs[mine]), targets[mine]).backward(create_graph=True)
            optim.zero_grad()
    for step in range(3):
        if refused:
            loss = nn.functional.mse_loss(model(inputs[mine]), targets[mine])
            expected = nn.functional.mse_loss(reference(inputs), targets)
        else:
            loss, expected = _penalized_loss(model, inputs[mine], targets[mine]), _penalized_loss(reference, inputs, targets)
        loss.backward()
        expected.backward()
        with unshard_params(model, with_grads=True):
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=0,
                                           msg=lambda m: f"[penalty/{strategy.name}] step {step} {name}.grad: {m}")
        for o in (optim, reference_optim):
            o.step()
            o.zero_grad()
    assert_params_close(_full_params(model), list(reference.named_parameters()), what=f"[penalty/{strategy.name}]")


def _whole_tensor_optimizers_subtest() -> None:
    """torch's LBFGS (dot products over all elements) and Adafactor (row/column statistics, the
    parameter's norm) on fully_shard's flat views: silently different steps before (LBFGS off by
    0.48 after one step). Now the first step raises naming the parameter, with nothing stepped:
    LBFGS on a real shard, Adafactor on any flattened parameter (NO_SHARD too). The remedies
    they name are exact against one process: LBFGS under NO_SHARD with the loss averaged over
    ranks, Adafactor under replicate."""
    from composable_shard import replicate

    rank, world_size = dist.get_rank(), dist.get_world_size()

    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))

    generator = torch.Generator().manual_seed(2)
    inputs, targets = torch.randn(4 * world_size, 6, generator=generator), torch.randn(4 * world_size, 2, generator=generator)
    mine = slice(4 * rank, 4 * (rank + 1))
    for kind, strategy in (("LBFGS", ShardingStrategy.FULL_SHARD), ("Adafactor", ShardingStrategy.FULL_SHARD),
                           ("Adafactor", ShardingStrategy.NO_SHARD)):
        model = make()
        fully_shard(model[0], strategy=strategy)
        fully_shard(model, strategy=strategy)
        optim = getattr(torch.optim, kind)(model.parameters(), lr=0.5)
        before = _full_params(model)
        nn.functional.mse_loss(model(inputs[mine]), targets[mine]).backward()
        with pytest.raises(RuntimeError, match=rf"{kind}.step\(\): it steps '0.weight', of which fully_shard gives each "
                                               rf"rank a (slice|flat view \(shape \(48,\), not \(8, 6\)\)); .* Nothing was stepped"):
            optim.step((lambda: torch.zeros(())) if kind == "LBFGS" else None)
        assert_params_close(_full_params(model), before, what=f"[{kind}/{strategy.name}: unchanged]", atol=0.0)

    def averaged(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Any:
        def closure() -> torch.Tensor:
            optim.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            total = loss.detach().clone()
            if x is not inputs:
                dist.all_reduce(total)
                total /= world_size
            return total
        return closure

    for kind in ("LBFGS", "Adafactor"):
        reference, model = make(), make()
        if kind == "LBFGS":
            fully_shard(model[0], strategy=ShardingStrategy.NO_SHARD)
            fully_shard(model, strategy=ShardingStrategy.NO_SHARD)
        else:
            replicate(model)
        optims = [getattr(torch.optim, kind)(m.parameters(), lr=0.5) for m in (reference, model)]
        for _ in range(3):
            optims[0].step(averaged(reference, optims[0], inputs, targets))
            optims[1].step(averaged(model, optims[1], inputs[mine], targets[mine]))
        got = _full_params(model) if kind == "LBFGS" else [(n, p.detach().clone()) for n, p in model.named_parameters()]
        assert_params_close(got, list(reference.named_parameters()), what=f"[{kind}: remedy]")


def _cases(strategies: List[ShardingStrategy]) -> List[Tuple[ShardingStrategy, str, bool]]:
    """Each strategy under both annotations and both forward-prefetch settings, paired so that
    every (annotation, forward_prefetch) pair occurs across the strategies: the annotation only
    decides which modules become units (the same ones both ways, checked bit for bit by the
    custom-policy subtest), so its product with the other two adds no behaviour."""
    return [case for i, strategy in enumerate(strategies)
            for case in ((strategy, "manual", i % 2 == 0), (strategy, "policy", i % 2 == 1))]


def _parity(strategies: List[ShardingStrategy]) -> None:
    world_size = dist.get_world_size()
    adamw, sgd = _reference("adamw", 1e-2), _reference("sgd", 0.1)
    run_subtests(_parity_subtest, {"case": _cases(strategies)}, adamw=adamw)
    if world_size > 1:
        run_subtests(_torch_fsdp1_subtest, {"strategy": strategies}, sgd=sgd)
    if world_size == 4:
        _hybrid_with_group_pair(sgd)
        _float64_subtest(ShardingStrategy.HYBRID_SHARD)
        _gradient_penalty_subtest(ShardingStrategy.HYBRID_SHARD)
    if world_size == 2:  # what a policy assigns and where the shards live: nothing more ranks would add
        run_subtests(_custom_policy_override_subtest, {"root": [ShardingStrategy.FULL_SHARD], "override": [
            ShardingStrategy.NO_SHARD, ShardingStrategy.SHARD_GRAD_OP]}, adamw=adamw)
        run_subtests(_custom_policy_override_subtest, {"root": [ShardingStrategy.NO_SHARD],
                                                       "override": [ShardingStrategy.FULL_SHARD]}, adamw=adamw)
        _cpu_offload_subtest(adamw)
        _float64_subtest(ShardingStrategy.FULL_SHARD)
        _whole_tensor_optimizers_subtest()
        run_subtests(_gradient_penalty_subtest, {"strategy": [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP,
                                                              ShardingStrategy.NO_SHARD]})


_ALL = [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD,
        ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2]
# W = 4: the hybrid strategies on a real 2 x 2 mesh, and FULL_SHARD's padding of 3 (W = 2 pads by
# at most 1). SHARD_GRAD_OP shards as FULL_SHARD does and NO_SHARD not at all: W = 1 and 2 show them.
_AT_4 = [ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_parity_with_local_and_torch_fsdp(world_size: int) -> None:
    """Every strategy under manual annotation and a policy, with forward prefetch off and on
    (paired, see ``_cases``): 3 AdamW steps equal local training (losses, the gradients of every
    backward and the final full parameters, atol 1e-5); 3 plain-SGD steps equal torch FSDP1
    (losses, final parameters) with every backward's gradients equal to local training's (a
    wrong gradient scale fails both). W = 4 runs FULL_SHARD and the hybrid strategies (on a
    2 x 2 mesh, and from an explicit group pair); W = 2 also a CustomPolicy's per-module
    strategies and CPU offload."""
    run_distributed(_parity, world_size, _ALL if world_size < 4 else _AT_4, timeout=240)
