"""What fully_shard does before the first forward: meta-device materialization
(``reset_parameters`` and ``param_init_fn``), ``sync_module_states``, ``device_id``, ignored
modules and states, and the class/FQN guarantees of in-place application.

Without these, a model built on the meta device would train from garbage, ranks initialized
differently would silently diverge, and ignored parameters would be sharded anyway.
"""

from __future__ import annotations

from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import FSDPModule, ModuleWrapPolicy, fully_shard, unshard_params
from composable_shard._runtime.traversal import _get_fsdp_handles
from tests._harness import run_distributed, run_subtests
from tests._models import Block, ParityModel, make_model, zip_same


def _meta_init(how: str) -> None:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = ParityModel()
    assert model.emb.weight.is_meta
    if how == "reset_parameters":
        model.scale.reset_parameters = lambda: model.scale.gain.data.fill_(1.25)  # type: ignore[assignment,method-assign]
        fully_shard(model, policy=ModuleWrapPolicy({Block}))
        with unshard_params(model):
            for name, p in model.named_parameters():
                assert not p.is_meta and torch.isfinite(p).all(), name
            assert torch.equal(model.blocks[0].ln.weight, torch.ones(6))  # LayerNorm.reset_parameters ran
            assert model.scale.gain.item() == 1.25
    else:
        index = {id(p): i for i, p in enumerate(model.parameters())}

        def init(module: nn.Module) -> None:  # per module, as torch FSDP1 calls it
            own = {name: index[id(p)] for name, p in module.named_parameters(recurse=False)}
            module.to_empty(device="cpu", recurse=False)
            with torch.no_grad():
                for name, p in module.named_parameters(recurse=False):
                    p.fill_(0.01 * (own[name] + 1))

        fully_shard(model, param_init_fn=init)
        with unshard_params(model):
            for i, p in enumerate(model.parameters()):
                assert torch.all(p == 0.01 * (i + 1)), i
    model(torch.randint(0, 13, (2, 5))).sum().backward()


def _sync_module_states(hybrid: bool = False) -> None:
    """Every rank starts from rank 0's parameters and buffers; ``hybrid``: on a 2 x 2 mesh
    (HYBRID_SHARD), where they travel over both groups (replicate, then shard)."""
    rank = dist.get_rank()
    torch.manual_seed(rank)  # different weights on every rank
    model = ParityModel()
    model.register_buffer("steps", torch.tensor([float(rank)]))
    torch.manual_seed(0)
    rank0 = ParityModel()
    kwargs: Dict[str, Any] = {}
    if hybrid:
        from torch.distributed.device_mesh import init_device_mesh

        from composable_shard import ShardingStrategy

        kwargs = {"strategy": ShardingStrategy.HYBRID_SHARD, "mesh": init_device_mesh("cpu", (2, 2))}
    fully_shard(model, sync_module_states=True, **kwargs)
    assert model.steps.item() == 0.0
    with unshard_params(model):
        for (name, p), (_, q) in zip_same(list(model.named_parameters()), list(rank0.named_parameters())):
            assert torch.equal(p, q), name


def _ignored(kind: str) -> None:
    world_size = dist.get_world_size()
    model = make_model()
    full_frozen = model.frozen.weight.detach().clone()
    if kind == "modules":
        fully_shard(model, ignored_modules=[model.frozen])
    elif kind == "modules, a generator":  # any iterable, as FSDP1's ignored_modules: read once
        fully_shard(model, ignored_modules=(m for m in [model.frozen]))
    elif kind == "states":
        fully_shard(model, ignored_states=[model.frozen.weight, model.frozen.bias])
    elif kind == "states, a module":  # FSDP1's ignored_states takes modules as well as parameters
        fully_shard(model, ignored_states=[model.frozen])
    else:  # model.frozen.parameters(): a generator, which its check must not use up
        fully_shard(model, ignored_states=model.frozen.parameters())
    assert model.frozen.weight.shape == (6, 6) and torch.equal(model.frozen.weight, full_frozen)
    handle = _get_fsdp_handles(model)[0]
    fqns = [f for fp in handle.flat_params for f in fp._fqns]
    assert "frozen.weight" not in fqns and "frozen.bias" not in fqns, fqns
    assert sum(fp._unpadded_unsharded_size.numel() for fp in handle.flat_params) == \
        sum(p.numel() for p in make_model().parameters()) - 42
    _ = world_size


def _in_place() -> None:
    model = make_model()
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict().keys())
    same = fully_shard(model, policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    assert same is model
    assert type(model).__name__ == "FSDPParityModel" and isinstance(model, (FSDPModule, ParityModel))
    assert type(model.blocks[0]).__name__ == "FSDPBlock" and type(model.blocks[0]).__bases__[1] is Block
    assert type(model.blocks[1]) is type(model.blocks[0])  # one cached class per original class
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict().keys()) == keys
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())
    try:
        import copy

        copy.deepcopy(model)
    except RuntimeError as e:
        assert "state_dict" in str(e)
    else:
        raise AssertionError("deepcopy of a fully sharded module must raise")


def _all() -> None:
    run_subtests(_meta_init, {"how": ["reset_parameters", "param_init_fn"]})
    _sync_module_states()
    dist.barrier()
    run_subtests(_ignored, {"kind": ["modules", "modules, a generator", "states", "states, a module", "states, a generator"]})
    _in_place()


def test_init_options() -> None:
    """Meta materialization both ways, sync_module_states from rank 0 (params and buffers),
    ignored modules/states left whole and out of the handle, device_id, in-place class swap
    with unchanged FQNs, and deepcopy raising towards state_dict."""
    run_distributed(_all, 2, timeout=120)


def _hybrid_groups_made_once() -> None:
    """HYBRID_SHARD without process groups, annotated per block (4 blocks and the root): the
    node's shard and replicate groups are made once and shared by all five states. Before, each
    fully_shard call made its own pair (20 new process groups at W=4 on 2-rank nodes, each a
    communicator of its own on NCCL) instead of 4."""
    import os

    from composable_shard import ShardingStrategy
    from composable_shard._runtime.traversal import _get_fsdp_states

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # two "nodes" of two ranks
    before = dist.get_pg_count()
    model = make_model(num_blocks=4)
    for block in model.blocks:
        fully_shard(block, strategy=ShardingStrategy.HYBRID_SHARD)
    fully_shard(model, strategy=ShardingStrategy.HYBRID_SHARD)
    # new_subgroups_by_enumeration makes every subgroup on every rank: 2 node groups + 2 across.
    assert dist.get_pg_count() - before == 4, dist.get_pg_count() - before
    states = _get_fsdp_states(model)
    assert len(states) == 5 and len({(id(s.process_group), id(s.replicate_group)) for s in states}) == 1, states
    shard, across = states[0].process_group, states[0].replicate_group
    rank = dist.get_rank()
    assert dist.get_process_group_ranks(shard) == [rank // 2 * 2, rank // 2 * 2 + 1], dist.get_process_group_ranks(shard)
    assert dist.get_process_group_ranks(across) == [rank % 2, rank % 2 + 2], dist.get_process_group_ranks(across)


def _at_four() -> None:
    _hybrid_groups_made_once()
    _sync_module_states(hybrid=True)


def test_hybrid_groups_are_made_once_per_layout() -> None:
    """Also: sync_module_states on a 2 x 2 mesh reaches every rank (a broadcast over one of the
    two groups left the other pair with its own initialization)."""
    run_distributed(_at_four, 4, timeout=60)
