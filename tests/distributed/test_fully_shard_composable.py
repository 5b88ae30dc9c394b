"""fully_shard behaves like torch's composable ``fully_shard`` where its users rely on it:
meta-device init through a replacing ``param_init_fn`` (per fully sharded module, children
first), tied weights under a policy (owned by the lowest common fully sharded ancestor), and
handle ``_fqns`` prefixed from the owning module on every annotation path.

Without these, a meta-built model trains a different model on every rank (handles built from
replaced-away parameters, gradients never reduced), a tied embedding cannot be sharded with a
policy, and tools that build ``owner prefix + fqn`` get wrong names for policy handles.
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import (CustomPolicy, ModuleWrapPolicy, ShardingStrategy, always_wrap_policy, fully_shard,
                              lambda_auto_wrap_policy, size_based_auto_wrap_policy, transformer_auto_wrap_policy,
                              unshard_params)
from composable_shard._runtime.module_state import _FSDPState
from composable_shard._runtime.traversal import _get_fsdp_handles, _get_fsdp_states
from tests._harness import assert_close_ranks, run_distributed, run_subtests
from tests._models import (VOCAB, WIDTH, Block, ParityModel, Scale, assert_losses_close, assert_params_close,
                           batch, local_backward, local_rows, loss_fn, zip_same)

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


def _full_params(model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    with unshard_params(model):
        return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def _full_grads(model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    with unshard_params(model, with_grads=True):
        return [(n, p.grad.detach().clone()) for n, p in model.named_parameters() if p.grad is not None]


def _owner_of(model: nn.Module, param: nn.Parameter) -> List[nn.Module]:
    """Modules whose handle holds ``param`` (each original parameter should be in exactly one)."""
    return [s.module for s in _get_fsdp_states(model) if s.handle is not None  # type: ignore[misc]
            for g in s.handle.groups for p in g.orig_params if p is param]


# ---------------------------------------------------------------------------- param_init_fn
def _replacing_init_fn(names: Dict[int, str], calls: List[str], materializing: List[str]) -> Callable[[nn.Module], None]:
    """The pattern torch documents: replace every parameter still on meta by a new CPU
    ``nn.Parameter`` and initialize it. Seeds itself from the module it is called with, so
    values depend on which module materializes which parameter (call order and count)."""
    def fn(module: nn.Module) -> None:
        calls.append(names[id(module)])
        replaced: Dict[int, nn.Parameter] = {}  # keeps tied parameters tied
        todo = [(sub, name, p) for sub in module.modules() for name, p in list(sub.named_parameters(recurse=False))
                if p.is_meta]
        if not todo:
            return
        materializing.append(names[id(module)])
        torch.manual_seed(zlib.crc32(names[id(module)].encode()))
        for sub, name, p in todo:
            if id(p) not in replaced:
                new = nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
                with torch.no_grad():
                    new.uniform_(-0.5, 0.5)
                replaced[id(p)] = new
            setattr(sub, name, replaced[id(p)])

    return fn


def _meta_model() -> Tuple[ParityModel, Dict[int, str]]:
    with torch.device("meta"):
        model = ParityModel()
    return model, {id(m): n for n, m in model.named_modules()}


def _torch_fsdp1_init() -> Tuple[List[Tuple[str, torch.Tensor]], List[str]]:
    """Full parameters of torch FSDP1 built from a meta model with the same function, and the
    modules its calls materialized (torch calls it on every submodule not yet wrapped, BFS;
    only the first call of each fully sharded module finds meta parameters)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

    meta, names = _meta_model()
    calls: List[str] = []
    materializing: List[str] = []
    torch_model = FSDP(meta, auto_wrap_policy=TorchModuleWrapPolicy({Block}), use_orig_params=True,
                       param_init_fn=_replacing_init_fn(names, calls, materializing), device_id=torch.device("cpu"))
    with FSDP.summon_full_params(torch_model):
        full = [(n.replace("_fsdp_wrapped_module.", ""), p.detach().clone()) for n, p in torch_model.named_parameters()]
    return full, materializing


def _param_init_fn_subtest() -> None:
    world_size = dist.get_world_size()
    expected, torch_materializing = _torch_fsdp1_init()
    model, names = _meta_model()
    calls: List[str] = []
    materializing: List[str] = []
    fully_shard(model, policy=ModuleWrapPolicy({Block}), param_init_fn=_replacing_init_fn(names, calls, materializing))
    # As torch FSDP1: on every module of each fully sharded module's subtree, breadth-first,
    # nested ones first; the first call of each (this function reaches the whole subtree)
    # materializes it, so the values are torch's.
    assert calls == ["blocks.0", "blocks.0.ln", "blocks.0.fc1", "blocks.0.fc2", "blocks.1", "blocks.1.ln",
                     "blocks.1.fc1", "blocks.1.fc2", "", "emb", "blocks", "frozen", "scale", "head"], calls
    assert materializing == torch_materializing == ["blocks.0", "blocks.1", ""], (materializing, torch_materializing)
    # Every handle is built from the replacing parameters: flat parameters of ceil(N/W) elements.
    handles = _get_fsdp_handles(model)
    assert [h.module for h in handles] == [model, model.blocks[0], model.blocks[1]], handles
    for handle in handles:
        assert handle.groups, f"{handle} has no flat parameter"
        for group in handle.groups:
            numel = group.flat_param._unpadded_unsharded_size.numel()
            assert group.flat_param.numel() == math.ceil(numel / world_size), (handle, numel)
    block_numel = sum(p.numel() for p in Block().parameters())
    assert sum(g.flat_param._unpadded_unsharded_size.numel() for g in handles[1].groups) == block_numel
    total = sum(g.flat_param._unpadded_unsharded_size.numel() for h in handles for g in h.groups)
    assert total == sum(p.numel() for p in ParityModel().parameters())
    assert model.head.weight is model.emb.weight
    initial = _full_params(model)
    assert_params_close(initial, expected, atol=0.0, what="[param_init_fn vs torch FSDP1]")
    _train_against_local(model, dict(initial))


def _train_against_local(model: nn.Module, initial: Dict[str, torch.Tensor]) -> None:
    """3 AdamW steps equal local training on the global batch from the same initial values;
    gradients are identical on every rank and equal the local ones after each backward."""
    world_size = dist.get_world_size()
    reference = ParityModel()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(initial[name])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(3):
        inputs, targets = batch(step, world_size)
        loss_fn(reference(inputs), targets).backward()
        local_backward(model, step)
        grads = _full_grads(model)
        assert_close_ranks(torch.cat([g.reshape(-1) for _, g in grads]), f"gradients after backward {step}")
        expected = [(n, p.grad) for n, p in reference.named_parameters() if p.grad is not None]
        assert_params_close(grads, expected, what=f"[param_init_fn step {step} grads]")  # type: ignore[arg-type]
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    assert_params_close(_full_params(model), list(reference.named_parameters()), what="[param_init_fn trained]")


def _reset_parameters_subtest() -> None:
    """Without param_init_fn: each module with meta tensors of its own runs reset_parameters()
    once, in .modules() order; a module without any (the root here, whose reset_parameters
    would re-initialize everything) is not called; tied parameters stay tied."""
    model, names = _meta_model()
    calls: List[str] = []
    for module in model.modules():
        original = getattr(module, "reset_parameters", lambda: None)
        module.reset_parameters = functools.partial(_recording_reset, calls, names[id(module)], original)  # type: ignore[method-assign,assignment]
    model.scale.reset_parameters = functools.partial(_recording_reset, calls, "scale",  # type: ignore[method-assign,assignment]
                                                     lambda: model.scale.gain.data.fill_(1.25))
    fully_shard(model, policy=ModuleWrapPolicy({Block}))
    expected = [n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False)) and n != "head"]
    assert calls == expected, (calls, expected)
    assert model.head.weight is model.emb.weight and not model.frozen.weight.requires_grad
    with unshard_params(model):
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert model.scale.gain.item() == 1.25 and torch.equal(model.blocks[0].ln.weight, torch.ones(WIDTH))


def _recording_reset(calls: List[str], name: str, original: Callable[[], Any]) -> None:
    calls.append(name)
    original()


# ---------------------------------------------------------------------------- tied weights
class Core(nn.Module):
    """Embedding -> Linear/ReLU/Linear -> output projection tied with the embedding (with a
    bias, so the projection keeps parameters of its own when the weight moves up)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.Sequential(nn.Linear(WIDTH, WIDTH + 1), nn.ReLU(), nn.Linear(WIDTH + 1, WIDTH))
        self.output_proj = nn.Linear(WIDTH, VOCAB)
        self.output_proj.weight = self.embed_tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output_proj(self.layers(self.embed_tokens(tokens)))


class TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.core = Core()
        self.temperature = nn.Parameter(torch.tensor([0.75]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.core(tokens) * self.temperature


def _tied_policies() -> Dict[str, Tuple[Any, str]]:
    """name -> (policy, FQN of the module whose handle must own the tied weight)."""
    return {
        "siblings_root": (ModuleWrapPolicy({nn.Linear, nn.Embedding, nn.Sequential}), ""),
        "parent_child_root": (ModuleWrapPolicy({nn.Embedding, TiedModel}), ""),
        "siblings_core_fn": (functools.partial(lambda_auto_wrap_policy,
                                               lambda_fn=lambda m: isinstance(m, (nn.Linear, nn.Embedding, Core))), "core"),
        "parent_child_core_custom": (CustomPolicy(lambda m: isinstance(m, (nn.Embedding, Core))), "core"),
    }


def _strategy_kwargs(strategy: ShardingStrategy, mesh: Any) -> Dict[str, Any]:
    return {"strategy": strategy, **({"mesh": mesh} if strategy in _HYBRID else {})}


def _tied_subtest(policy_name: str, strategy: ShardingStrategy, mesh: Any) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world_size = dist.get_rank(), dist.get_world_size()
    policy, owner_fqn = _tied_policies()[policy_name]
    torch.manual_seed(0)
    reference = TiedModel()
    torch.manual_seed(0)
    ddp = DDP(TiedModel())
    torch.manual_seed(0)
    model = TiedModel()
    fully_shard(model, policy=policy, **_strategy_kwargs(strategy, mesh))
    tied = model.core.embed_tokens.weight
    assert model.core.output_proj.weight is tied
    owners = _owner_of(model, tied)
    assert owners == [model.get_submodule(owner_fqn)], (owners, owner_fqn)  # flattened once, at the LCA
    optims = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (reference, ddp, model)]
    for step in range(4):
        inputs, targets = batch(step, world_size)
        ref_loss = loss_fn(reference(inputs), targets)
        ref_loss.backward()
        ddp_loss = loss_fn(ddp(local_rows(inputs, rank)), local_rows(targets, rank))
        ddp_loss.backward()
        loss = loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank))
        loss.backward()
        losses = torch.stack([ddp_loss.detach(), loss.detach()])
        dist.all_reduce(losses)
        what = f"[{policy_name}/{strategy.name} step {step}]"
        assert_losses_close([losses[1].item() / world_size], [losses[0].item() / world_size], what=what + " vs DDP")
        assert_losses_close([losses[1].item() / world_size], [ref_loss.item()], what=what + " vs local")
        # Adam hides a wrong gradient scale: compare the gradients themselves.
        ddp_grads = [(n, p.grad) for n, p in ddp.module.named_parameters() if p.grad is not None]
        assert_params_close(_full_grads(model), ddp_grads, what=what + " grads vs DDP")  # type: ignore[arg-type]
        for optim in optims:
            optim.step()
            optim.zero_grad(set_to_none=step % 2 == 0)
    assert_params_close(_full_params(model), list(reference.named_parameters()), what=f"[{policy_name}/{strategy.name}]")


def _tied(mesh: Any) -> None:
    strategies = [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD,
                  ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2]
    run_subtests(_tied_subtest, {"policy_name": list(_tied_policies()), "strategy": strategies}, mesh=mesh)


# ---------------------------------------------------------------------------- handle FQNs
def _fqn_paths() -> Dict[str, Callable[[ParityModel], None]]:
    def manual(model: ParityModel) -> None:
        for block in model.blocks:
            fully_shard(block.fc1)
            fully_shard(block)
        fully_shard(model.scale)
        fully_shard(model, ignored_modules=[model.frozen])

    return {
        "manual": manual,
        "module_wrap": lambda m: fully_shard(m, policy=ModuleWrapPolicy({Block, nn.Linear}), ignored_modules=[m.frozen]),
        "custom": lambda m: fully_shard(m, policy=CustomPolicy(lambda sub: isinstance(sub, (Block, Scale)))),
        "transformer_fn": lambda m: fully_shard(m, policy=functools.partial(transformer_auto_wrap_policy,
                                                                            transformer_layer_cls={Block})),
        "size_fn": lambda m: fully_shard(m, policy=functools.partial(size_based_auto_wrap_policy, min_num_params=40)),
        "always_fn": lambda m: fully_shard(m, policy=always_wrap_policy),
    }


def _fqn_subtest(path: str) -> None:
    """Rebuild every original parameter's FQN as owner FQN + '.' + fqn from the handles."""
    torch.manual_seed(0)
    model = ParityModel()
    _fqn_paths()[path](model)
    owner_names = {id(m): n for n, m in model.named_modules()}
    registered = dict(model.named_parameters(remove_duplicate=False))
    ignored = set()
    rebuilt: List[str] = []
    for state in _get_fsdp_states(model):
        ignored |= {id(p) for p in state.ignored_params}
        if state.handle is None:
            continue
        prefix = owner_names[id(state.module)]
        for group in state.handle.groups:
            for fqn, p in zip_same(group.flat_param._fqns, group.orig_params, what="_fqns and original parameters"):
                full = f"{prefix}.{fqn}" if prefix else fqn
                assert registered.get(full) is p, (path, prefix, fqn)
                rebuilt.append(full)
    expected = [n for n, p in model.named_parameters() if id(p) not in ignored]
    assert sorted(rebuilt) == sorted(expected), (path, sorted(rebuilt), sorted(expected))
    assert isinstance(fully_shard.state(model), _FSDPState)


# ---------------------------------------------------------------------------- entry points
def _all() -> None:
    world_size = dist.get_world_size()
    run_subtests(_fqn_subtest, {"path": list(_fqn_paths())})
    _param_init_fn_subtest()
    dist.barrier()
    _reset_parameters_subtest()
    dist.barrier()
    from torch.distributed.device_mesh import init_device_mesh

    shard = 2 if world_size % 2 == 0 and world_size > 2 else world_size
    _tied(init_device_mesh("cpu", (world_size // shard, shard)))


@pytest.mark.parametrize("world_size", [2, 4])
def test_composable_fully_shard_behaviours(world_size: int) -> None:
    """Handle FQNs on every annotation path; meta init with a replacing param_init_fn equals
    torch FSDP1 and trains like local training; tied weights under four policies x every
    strategy train with DDP's losses and gradients."""
    run_distributed(_all, world_size, timeout=240)
