"""Model and optimizer state dicts of sharded models: full (exactly a plain model's), sharded
(``ShardedSlice`` values that ``torch.distributed.checkpoint`` saves and loads), round trips,
resharding to other world sizes and strategies, strict loading, and what a save costs.

Without these: ``torch.save(model.state_dict())`` wrote each rank's 1-D flat shards under the
original names (a file that loads into nothing); a resumed run silently drifted from the
uninterrupted one (optimizer moments of the wrong parameter, a stale unsharded buffer after
loading); a checkpoint could not change world size; a bad key loaded half the model before
raising; a "sharded" save all-gathered every parameter.
"""

from __future__ import annotations

import copy
import io
import os
import weakref
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict as torch_get_state_dict,
                                                     set_model_state_dict as torch_set_model_state_dict,
                                                     set_optimizer_state_dict as torch_set_optimizer_state_dict,
                                                     set_state_dict as torch_set_state_dict)
from torch.overrides import TorchFunctionMode

from composable_shard import (FullStateDictConfig, MixedPrecision, ModuleWrapPolicy, ShardedSlice, ShardingStrategy,
                              StateDictType, fully_shard, get_model_state_dict, get_optimizer_state_dict, load_checkpoint,
                              replicate, save_checkpoint, set_model_state_dict, set_optimizer_state_dict, state_dict_type,
                              unshard_params)
from composable_shard._runtime.traversal import _get_fsdp_handles
from tests._harness import run_distributed, run_subtests
from tests._models import Block, Scale, distributed_training, global_mean, loss_fn, make_model, reference_training, zip_same

CONFIGS = ["manual", "policy", "submodules", "mixed_strategy", "frozen_block", "replicate_mixed", "bf16"]
# At 4 ranks every handle's shards are uneven (at 2 the root's tied 78 and frozen 42 elements
# split evenly) and the one-element scale is padding on three ranks: "manual" covers that shard
# arithmetic and "mixed_strategy" the kept (ZeRO-2) and unsharded (NO_SHARD) layouts. The other
# configs change which modules are wrapped or the compute dtype, not the arithmetic: W=2 runs them.
CONFIGS_AT_4 = ["manual", "mixed_strategy"]


def _shard(model: nn.Module, config: str) -> nn.Module:
    if config == "frozen_block":
        model.blocks[1].requires_grad_(False)
    if config in ("manual", "frozen_block"):
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model.scale)
        fully_shard(model)
    elif config == "policy":
        fully_shard(model, policy=ModuleWrapPolicy({Block, Scale}))
    elif config == "submodules":  # the root (tied embedding and head) stays plain
        for block in model.blocks:
            fully_shard(block)
    elif config == "mixed_strategy":
        fully_shard(model.blocks[0], strategy=ShardingStrategy.SHARD_GRAD_OP)
        fully_shard(model.blocks[1], strategy=ShardingStrategy.NO_SHARD)
        fully_shard(model)
    elif config == "replicate_mixed":
        replicate(model.blocks[1])
        fully_shard(model.blocks[0])
        fully_shard(model)
    elif config == "bf16":
        fully_shard(model, policy=ModuleWrapPolicy({Block}), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    else:
        raise ValueError(config)
    return model


def _plain(config: str, seed: int = 0) -> nn.Module:
    model = make_model(seed)
    if config == "frozen_block":
        model.blocks[1].requires_grad_(False)
    return model


def _full_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Full parameters through unshard_params: a path independent of the state dict hooks."""
    with unshard_params(model, writeback=False):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_state_dicts_equal(actual: Dict[str, Any], expected: Dict[str, Any], what: str, atol: float = 0.0) -> None:
    assert list(actual) == list(expected), f"{what}: keys {list(actual)} != {list(expected)}"
    for key, e in expected.items():
        a = actual[key]
        assert type(a) is torch.Tensor and a.dtype == e.dtype and a.shape == e.shape, \
            f"{what}: {key}: {type(a).__name__} {a.dtype} {tuple(a.shape)} != {e.dtype} {tuple(e.shape)}"
        if atol == 0.0:
            assert torch.equal(a, e), f"{what}: {key} differs (max {(a.float() - e.float()).abs().max()})"
        else:
            torch.testing.assert_close(a, e, atol=atol, rtol=0, msg=lambda m: f"{what}: {key}: {m}")


def _aliases(sd: Dict[str, torch.Tensor]) -> List[Tuple[str, str]]:
    """Pairs of keys whose values share storage (tied weights)."""
    keys = list(sd)
    return [(a, b) for i, a in enumerate(keys) for b in keys[i + 1:]
            if sd[a].untyped_storage().data_ptr() == sd[b].untyped_storage().data_ptr() and sd[a].numel()]


# ---------------------------------------------------------------------------- full state dicts
def _full_parity(config: str) -> None:
    """Outside any context, state_dict() is the plain model's, key for key, bit for bit, tied
    weights tied; it loads into a plain model, and a plain model's loads back, so that the
    next step matches the uninterrupted run exactly."""
    world_size = dist.get_world_size()
    plain, model = _plain(config), _shard(_plain(config), config)
    _assert_state_dicts_equal(model.state_dict(), plain.state_dict(), f"{config} at init")
    assert _aliases(model.state_dict()) == _aliases(plain.state_dict()) == [("emb.weight", "head.weight")]
    distributed_training(model, 2)
    reference_training(plain, 2, world_size)
    sd = model.state_dict()
    full = _full_params(model)
    full["head.weight"] = full["emb.weight"]  # tied: named_parameters() yields it once
    _assert_state_dicts_equal(sd, {k: full[k] for k in plain.state_dict()}, f"{config}: against unshard_params")
    if config not in ("bf16", "submodules"):  # bf16 compute is not fp32's; a plain root is not data-parallel
        _assert_state_dicts_equal(sd, plain.state_dict(), f"{config}: against single-process training", atol=1e-5)
    buffer = io.BytesIO()
    torch.save(sd, buffer)  # what a new user tries first
    buffer.seek(0)
    exported = _plain(config, seed=7)
    exported.load_state_dict(torch.load(buffer))
    _assert_state_dicts_equal(exported.state_dict(), sd, f"{config}: sharded -> plain")
    resumed = _shard(_plain(config, seed=3), config)
    result = resumed.load_state_dict(exported.state_dict())
    assert not result.missing_keys and not result.unexpected_keys, result
    _assert_state_dicts_equal(resumed.state_dict(), sd, f"{config}: plain -> sharded")
    half = {k: v.half() if v.is_floating_point() else v for k, v in exported.state_dict().items()}
    cast_in, plain_cast_in = _shard(_plain(config, seed=5), config), _plain(config, seed=5)
    for target in (cast_in, plain_cast_in):  # torch's load_state_dict casts a float16 checkpoint into float32
        target.load_state_dict(half)
    _assert_state_dicts_equal(cast_in.state_dict(), plain_cast_in.state_dict(), f"{config}: a float16 state dict")
    assert distributed_training(resumed, 1) == distributed_training(model, 1), f"{config}: the step after loading"
    _assert_state_dicts_equal(resumed.state_dict(), model.state_dict(), f"{config}: after the step")


def _full_options() -> None:
    """rank0_only: rank 0 gets the full dict, the others {} (having taken part); offload: CPU."""
    plain, model = make_model(), _shard(make_model(), "manual")
    sd = get_model_state_dict(model, rank0_only=True, cpu_offload=True)
    if dist.get_rank() == 0:
        _assert_state_dicts_equal(sd, plain.state_dict(), "rank0_only")
    else:
        assert sd == {}, list(sd)
    with state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
        sd = model.state_dict()
    managed = {n for n, _ in model.named_parameters()} | {"head.weight"}
    assert (set(sd) & managed) == (managed if dist.get_rank() == 0 else set()), sorted(sd)
    # The context is over: a plain call is the full state dict on every rank again (its config gone too).
    _assert_state_dicts_equal(model.state_dict(), plain.state_dict(), "state_dict() after a rank0_only context")
    with pytest.raises(TypeError, match="SHARDED_STATE_DICT takes a ShardedStateDictConfig"):
        with state_dict_type(model, StateDictType.SHARDED_STATE_DICT, FullStateDictConfig()):
            pass
    with pytest.raises(ValueError, match="rank0_only=True needs full=True"):
        get_model_state_dict(model, full=False, rank0_only=True)


# ---------------------------------------------------------------------------- sharded state dicts
def _collective_ops(fn: Callable[[], Any]) -> int:
    with torch.profiler.profile() as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("c10d::"))


def _sharded_is_local() -> None:
    """SHARDED_STATE_DICT: per parameter a ShardedSlice of the global shape over this rank's
    elements, a view of the flat shard; no collective (profiler), with a positive control."""
    model = _shard(make_model(), "manual")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    distributed_training(model, 1)
    optim.step()
    shard_storages = {fp.untyped_storage().data_ptr() for h in _get_fsdp_handles(model) for fp in h.flat_params}
    assert _collective_ops(lambda: get_model_state_dict(model, full=False)) == 0
    assert _collective_ops(lambda: get_optimizer_state_dict(model, optim, full=False)) == 0
    assert _collective_ops(lambda: get_model_state_dict(model)) > 0  # the counter sees gloo collectives
    with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = model.state_dict()
    held = 0
    for name, p in make_model().named_parameters():
        value = sd[name]
        assert isinstance(value, ShardedSlice) and value.shape == p.shape and value.dtype == p.dtype, (name, value)
        assert value.local.untyped_storage().data_ptr() in shard_storages, f"{name}: a copy, not a view of the shard"
        held += value.local.numel()
    total = sum(p.numel() for p in make_model().parameters())
    assert held <= total // dist.get_world_size() + 4 * dist.get_world_size(), (held, total)
    with pytest.raises(RuntimeError, match="holds only this rank's elements"):
        sd["blocks.0.fc1.weight"] + 1
    after = model.state_dict()  # the context is over: full tensors again
    for name, p in make_model().named_parameters():
        assert type(after[name]) is torch.Tensor and after[name].shape == p.shape, (name, type(after[name]))


def _large_tensors_cut_like_torch_chunk() -> None:
    """A tensor above UNCUT_NUMEL is described to DCP in boxes that each lie inside one part of
    torch.chunk(tensor, W) rows (the flat layout puts the whole embedding on rank 0 at W=2, so
    uncut, its one chunk, and each loader's read buffer, would be W times FSDP2's); model and
    optimizer state alike; smaller tensors are not cut."""
    from composable_shard._state.sharded_slice import UNCUT_NUMEL

    world_size = dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1024, 512), nn.Linear(512, 8))
    assert model[0].weight.numel() > UNCUT_NUMEL >= model[1].weight.numel()
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.arange(8)).sum().backward()
    optim.step()
    values = dict(get_model_state_dict(model, full=False))
    for fqn, state in get_optimizer_state_dict(model, optim, full=False)["state"].items():
        values.update({f"{fqn}.{k}": v for k, v in state.items() if isinstance(v, ShardedSlice)})
    rows_per_part = -(-1024 // world_size)
    for name, value in values.items():
        if value.shape == (1024, 512):
            for offsets, sizes, _ in value.boxes:
                part = offsets[0] // rows_per_part
                assert (offsets[0] + sizes[0] - 1) // rows_per_part == part, (name, offsets, sizes, rows_per_part)
        else:
            assert len(value.boxes) <= 3, (name, value.boxes)  # one contiguous range: at most 3 boxes
    assert sum(1 for name in values if values[name].shape == (1024, 512)) == 3  # weight, exp_avg, exp_avg_sq


# ---------------------------------------------------------------------------- DCP resume and resharding
GLOBAL_ROWS = 4  # the global batch, the same at every world size


def _global_batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, 13, (GLOBAL_ROWS, 6), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> List[float]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows = GLOBAL_ROWS // world_size
    losses = []
    for step in steps:
        inputs, targets = _global_batch(step)
        local = slice(rank * rows, (rank + 1) * rows)
        loss = loss_fn(model(inputs[local]), targets[local])
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(global_mean(loss))
    return losses


def _build(layout: str, seed: int) -> nn.Module:
    model = make_model(seed)
    if layout == "plain":
        return model
    if layout == "replicate":
        return replicate(model)
    if layout == "replicated_root":  # fully sharded blocks under a replicated root
        for block in model.blocks:
            fully_shard(block)
        return replicate(model)
    if layout == "replicated_block":  # a replicated block under a fully sharded root
        replicate(model.blocks[0])
        fully_shard(model.blocks[1])
        return fully_shard(model)
    strategy = ShardingStrategy[layout]
    kwargs: Dict[str, Any] = {"strategy": strategy}
    if strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["mesh"] = init_device_mesh("cpu", (2, dist.get_world_size() // 2))
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _checkpoint(model: nn.Module, optim: torch.optim.Optimizer) -> Dict[str, Any]:
    return {"model": get_model_state_dict(model, full=False), "optim": get_optimizer_state_dict(model, optim, full=False)}


# torch's torch.distributed.checkpoint.state_dict options for the "torch:*" APIs (see test_torch_state_dict_api.py)
TORCH_SAVES = {"torch:sharded": StateDictOptions(), "torch:sharded_offload": StateDictOptions(cpu_offload=True),
               "torch:flat": StateDictOptions(flatten_optimizer_state_dict=True)}


def _save_state(path: str, model: nn.Module, optim: torch.optim.Optimizer, api: str) -> None:
    """Save through ``api``: plain DCP of our state dicts, ``save_checkpoint``, torch's state-dict
    API with DCP (``TORCH_SAVES``), or torch's full state dict written by rank 0 (``torch:full``)."""
    if api == "dcp":
        dcp.save(_checkpoint(model, optim), checkpoint_id=f"{path}/ckpt")
    elif api == "library":
        save_checkpoint(f"{path}/ckpt", model, optim)
    elif api == "torch:full":  # as Lightning's single-file save does
        msd, osd = torch_get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            torch.save({"model": msd, "optim": osd}, f"{path}/full.pt")
    else:
        msd, osd = torch_get_state_dict(model, optim, options=TORCH_SAVES[api])
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{path}/ckpt")


def _load_state(path: str, model: nn.Module, optim: torch.optim.Optimizer, api: str) -> None:
    """Load what :func:`_save_state` saved through ``api`` (``torch:full``: broadcast from rank 0)."""
    if api == "dcp":
        state = _checkpoint(model, optim)
        dcp.load(state, checkpoint_id=f"{path}/ckpt")
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optim, state["optim"])
    elif api == "library":
        load_checkpoint(f"{path}/ckpt", model, optim)
    elif api == "torch:full":
        full = torch.load(f"{path}/full.pt") if dist.get_rank() == 0 else {"model": {}, "optim": {}}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        torch_set_model_state_dict(model, full["model"], options=options)
        torch_set_optimizer_state_dict(model, optim, full["optim"], options=options)
    else:
        msd, osd = torch_get_state_dict(model, optim, options=TORCH_SAVES[api])
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=f"{path}/ckpt")
        torch_set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=TORCH_SAVES[api])


def _save_run(path: str, layout: str, api: str) -> None:
    """2 steps (AdamW, two param groups with different hyper-parameters), a save through ``api``
    (see :func:`_save_state`), 3 more steps; rank 0 records
    the last 3 losses and the final full model and optimizer state."""
    model = _build(layout, seed=0)
    optim = torch.optim.AdamW(_two_groups(model, lr=3e-2, weight_decay=0.01, betas=(0.8, 0.95)), lr=1e-2,
                              weight_decay=0.1)
    _train(model, optim, range(2))
    _save_state(path, model, optim, api)
    losses = _train(model, optim, range(2, 5))
    final = {"losses": losses, "model": get_model_state_dict(model, rank0_only=True),
             "optim": get_optimizer_state_dict(model, optim, rank0_only=True)}
    if dist.get_rank() == 0:
        torch.save(final, f"{path}/uninterrupted.pt")


def _two_groups(model: nn.Module, **rest: Any) -> List[Dict[str, Any]]:
    """Two param groups: the blocks' parameters, and the others with the hyper-parameters
    ``rest`` (a load that gave every group the first's, or dropped them, trains differently)."""
    blocks = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
    return [{"params": blocks}, {"params": [p for n, p in model.named_parameters() if not n.startswith("blocks.")], **rest}]


def _resume_run(path: str, layout: str, api: str) -> None:
    """A differently initialised model and a fresh optimizer (other hyper-parameters in each of
    its two param groups) load the checkpoint: each group's saved hyper-parameters; then the
    same 3 steps give the uninterrupted run's losses, parameters and optimizer state."""
    model = _build(layout, seed=5)
    optim = torch.optim.AdamW(_two_groups(model), lr=0.5, weight_decay=0.0)  # hyper-parameters come from the checkpoint
    _load_state(path, model, optim, api)
    loaded = [(g["lr"], g["weight_decay"], tuple(g["betas"])) for g in optim.param_groups]  # torch:full: a list
    assert loaded == [(1e-2, 0.1, (0.9, 0.999)), (3e-2, 0.01, (0.8, 0.95))], f"{layout}: param groups {loaded}"
    losses = _train(model, optim, range(2, 5))
    expected = torch.load(f"{path}/uninterrupted.pt")
    torch.testing.assert_close(losses, expected["losses"], atol=1e-5, rtol=0)
    _assert_state_dicts_equal(get_model_state_dict(model), expected["model"], f"{layout}: model", atol=1e-5)
    osd = get_optimizer_state_dict(model, optim)
    assert list(osd["state"]) == list(expected["optim"]["state"])
    for fqn, entries in expected["optim"]["state"].items():
        for name, value in entries.items():
            torch.testing.assert_close(osd["state"][fqn][name], value, atol=1e-5, rtol=0,
                                       msg=lambda m: f"{layout}: optimizer {fqn}.{name}: {m}")


# ---------------------------------------------------------------------------- several optimizers, extra state
def _two_optimizers(model: nn.Module) -> Tuple[torch.optim.Optimizer, torch.optim.Optimizer, Any]:
    """AdamW on the blocks, SGD with momentum (and a step-decay schedule) on the rest."""
    blocks, rest = (group["params"] for group in _two_groups(model))
    adamw = torch.optim.AdamW(blocks, lr=1e-2, weight_decay=0.1)
    sgd = torch.optim.SGD([p for p in rest if p.requires_grad], lr=0.05, momentum=0.9)
    return adamw, sgd, torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)


def _train_two(model: nn.Module, optims: Tuple[Any, ...], steps: range) -> List[float]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows = GLOBAL_ROWS // world_size
    losses = []
    for step in steps:
        inputs, targets = _global_batch(step)
        loss = loss_fn(model(inputs[rank * rows:(rank + 1) * rows]), targets[rank * rows:(rank + 1) * rows])
        loss.backward()
        optims[0].step()
        optims[1].step()
        optims[2].step()
        optims[0].zero_grad()
        optims[1].zero_grad()
        losses.append(global_mean(loss))
    return losses


def _save_two(path: str) -> None:
    model = _build("FULL_SHARD", seed=0)
    optims = _two_optimizers(model)
    _train_two(model, optims, range(2))
    save_checkpoint(f"{path}/ckpt", model, [optims[0], optims[1]], extra={"step": 2, "sched": optims[2].state_dict()})
    with pytest.raises(RuntimeError, match="could not write extra"):  # refused on every rank, nothing published
        save_checkpoint(f"{path}/bad", model, optims[0], extra={"fn": lambda: 0})
    assert not os.path.exists(f"{path}/bad")
    losses = _train_two(model, optims, range(2, 5))
    final = get_model_state_dict(model, rank0_only=True)
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "model": final}, f"{path}/uninterrupted.pt")


def _resume_two(path: str) -> None:
    model = _build("FULL_SHARD", seed=5)
    optims = _two_optimizers(model)
    before = get_model_state_dict(model)
    with pytest.raises(ValueError, match="holds the state of 2 optimizer"):  # one of two: refused, nothing loaded
        load_checkpoint(f"{path}/ckpt", model, optims[0])
    _assert_state_dicts_equal(get_model_state_dict(model), before, "after a refused load")
    extra = load_checkpoint(f"{path}/ckpt", model, [optims[0], optims[1]])
    assert extra is not None and extra["step"] == 2, extra
    optims[2].load_state_dict(extra["sched"])
    assert optims[1].param_groups[0]["lr"] == 0.05 * 0.5 ** 2 and optims[1].state, optims[1].param_groups[0]
    expected = torch.load(f"{path}/uninterrupted.pt")
    torch.testing.assert_close(_train_two(model, optims, range(2, 5)), expected["losses"], atol=1e-5, rtol=0)
    _assert_state_dicts_equal(get_model_state_dict(model), expected["model"], "resumed model", atol=1e-5)


# Every checkpoint the resumes read: name -> (world size, layout, api), saved by _save_run
# ("two_optimizers": _save_two) into <tmp>/<name>, one process group per world size.
SAVES = {"FULL_SHARD@2/dcp": (2, "FULL_SHARD", "dcp"), "replicated_root@2/dcp": (2, "replicated_root", "dcp"),
         "replicated_block@2/library": (2, "replicated_block", "library"),
         "replicate@2/library": (2, "replicate", "library"), "two_optimizers@2": (2, "FULL_SHARD", "library"),
         "FULL_SHARD@4/library": (4, "FULL_SHARD", "library")}
# Per world size, each resume: (checkpoint, layout it resumes into). The api is the save's.
RESUMES = {
    1: [("FULL_SHARD@4/library", "plain"), ("replicate@2/library", "plain")],
    2: [("FULL_SHARD@2/dcp", "FULL_SHARD"), ("FULL_SHARD@4/library", "SHARD_GRAD_OP"),
        ("FULL_SHARD@4/library", "NO_SHARD"), ("replicated_root@2/dcp", "replicated_root"),
        ("FULL_SHARD@2/dcp", "replicated_block")],
    4: [("FULL_SHARD@4/library", "HYBRID_SHARD"), ("replicated_block@2/library", "FULL_SHARD"),
        ("two_optimizers@2", "FULL_SHARD")],
}


def _save_one(save: str, path: str) -> None:
    directory = os.path.join(path, save.replace("/", "-"))
    os.makedirs(directory, exist_ok=True)
    _, layout, api = SAVES[save]
    if save == "two_optimizers@2":
        _save_two(directory)
    else:
        _save_run(directory, layout, api)


def _save_all(path: str) -> None:
    """Every checkpoint of SAVES made at this world size."""
    saves = [name for name, (world_size, _, _) in SAVES.items() if world_size == dist.get_world_size()]
    run_subtests(_save_one, {"save": saves}, path=path)


def _resume_one(resume: Tuple[str, str], path: str) -> None:
    save, layout = resume
    directory = os.path.join(path, save.replace("/", "-"))
    if save == "two_optimizers@2":
        _resume_two(directory)
    else:
        _resume_run(directory, layout, SAVES[save][2])


def _resume_all(path: str) -> None:
    run_subtests(_resume_one, {"resume": RESUMES[dist.get_world_size()]}, path=path)


def test_resume_equals_the_uninterrupted_run(tmp_path: Any) -> None:
    """A differently initialised model and a fresh optimizer resume each checkpoint of SAVES
    (one process group per world size saves them all, another per world size resumes,
    RESUMES) and train on: losses, parameters and optimizer state equal the uninterrupted
    run's. Covered: plain dcp.save/dcp.load of our sharded state dicts, in place; FULL_SHARD
    saved at 4 ranks by save_checkpoint, resumed by load_checkpoint (verified, safe) at 4
    (hybrid 2x2), 2 (ZeRO-2, no-shard) and 1 (plain); fully_shard and replicate mixed on one
    model (and replicate alone) saved at 2, resumed in the same composition, at another world
    size into another one, or into a plain model; a model with two optimizers (AdamW on the
    blocks, SGD with momentum and an LR schedule on the rest) and ``extra`` state (the step,
    the scheduler) saved at 2, resumed at 4 (one of the two optimizers alone is refused,
    nothing loaded; an ``extra`` that cannot be written is refused on every rank, nothing
    published). Without it a checkpoint could not change world size or composition, a second
    optimizer's moments (e.g. Muon with AdamW) had no checkpoint at all, and a loop's own
    state lived outside the checked, atomic directory."""
    run_distributed(_save_all, 2, str(tmp_path), timeout=300)
    run_distributed(_save_all, 4, str(tmp_path), timeout=300)
    for world_size in (2, 4, 1):
        run_distributed(_resume_all, world_size, str(tmp_path), timeout=300)


class _Opaque:
    """Not among the types ``torch.load(weights_only=True)`` rebuilds."""

    def __init__(self, value: int) -> None:
        self.value = value


def _extra_weights_only(path: str) -> None:
    """``extra`` is unpickled with ``weights_only=True``: a class torch does not rebuild raises,
    naming the file and the class, unless the caller allows it (``safe_globals``). An empty
    ``extra`` loads as ``{}``, a checkpoint saved without one as ``None``."""
    model = _build("FULL_SHARD", seed=0)
    save_checkpoint(f"{path}/ckpt", model, extra={"opaque": _Opaque(3)})
    with pytest.raises(RuntimeError, match=r"extra\.pt: refused to unpickle it with weights_only=True \(.*_Opaque"):
        load_checkpoint(f"{path}/ckpt", model)
    with torch.serialization.safe_globals([_Opaque]):  # the user vouches for the class
        assert load_checkpoint(f"{path}/ckpt", model)["opaque"].value == 3  # type: ignore[index]
    save_checkpoint(f"{path}/empty", model, extra={})  # an empty extra comes back empty; none comes back as None
    assert load_checkpoint(f"{path}/empty", model) == {}
    save_checkpoint(f"{path}/none", model)
    assert load_checkpoint(f"{path}/none", model) is None




# ---------------------------------------------------------------------------- strict loading
def _snapshot(model: nn.Module, optim: torch.optim.Optimizer) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    return get_model_state_dict(model), copy.deepcopy(get_optimizer_state_dict(model, optim))


def _strict() -> None:
    """A state dict that does not fit raises, naming the keys, before anything is written; a
    non-persistent buffer (a rotary cache) is neither in the state dict nor expected in one."""
    model = make_model()
    model.blocks[0].register_buffer("cache", torch.arange(4.0), persistent=False)
    model = _shard(model, "manual")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optim, range(1))
    good = make_model(seed=9).state_dict()
    before = _snapshot(model, optim)
    assert sorted(before[0]) == sorted(good), sorted(set(before[0]) ^ set(good))
    for load in (lambda s: set_model_state_dict(model, s), model.load_state_dict):
        load(before[0])  # strict: its own state dict fits
    bad_inputs = {
        "unexpected": ({**good, "bogus.weight": torch.zeros(1)}, "bogus.weight"),
        "missing": ({k: v for k, v in good.items() if k != "blocks.1.fc1.bias"}, "blocks.1.fc1.bias"),
        "shape": ({**good, "blocks.1.fc2.weight": torch.zeros(3, 3)}, "blocks.1.fc2.weight"),
    }
    for what, (sd, key) in bad_inputs.items():
        for load in (lambda s: set_model_state_dict(model, s), model.load_state_dict):
            with pytest.raises(RuntimeError, match=key.replace(".", r"\.")) as info:
                load(sd)
            assert "nothing was loaded" in str(info.value), info.value
            _assert_state_dicts_equal(get_model_state_dict(model), before[0], f"after a refused load ({what})")
    pickled = io.BytesIO()  # each rank's sharded state dict through torch.save: its slices, told what to use instead
    torch.save(get_model_state_dict(model, full=False), pickled)
    pickled.seek(0)
    with pytest.raises(RuntimeError, match="is one rank's slice: a sharded state dict") as info:
        set_model_state_dict(model, torch.load(pickled))
    assert "nothing was loaded" in str(info.value) and "dcp.save" in str(info.value), info.value
    _assert_state_dicts_equal(get_model_state_dict(model), before[0], "after a refused load (pickled slices)")
    with pytest.raises(RuntimeError, match="dtype mismatch for blocks.0.ln.weight"):
        set_model_state_dict(model, {**good, "blocks.0.ln.weight": good["blocks.0.ln.weight"].double()})
    _assert_state_dicts_equal(get_model_state_dict(model), before[0], "after a refused load (dtype)")
    partial = {k: v for k, v in good.items() if k != "blocks.1.fc1.bias"}
    for load in (lambda s: set_model_state_dict(model, s, strict=False), lambda s: model.load_state_dict(s, strict=False)):
        set_model_state_dict(model, before[0])  # the trained state again
        result = load({**partial, "bogus.weight": torch.zeros(1)})
        assert list(result.missing_keys) == ["blocks.1.fc1.bias"] and list(result.unexpected_keys) == ["bogus.weight"], \
            result
        after = get_model_state_dict(model)
        for key in good:
            assert torch.equal(after[key], before[0][key] if key == "blocks.1.fc1.bias" else good[key]), key
    # the optimizer: a state of the wrong shape is refused before the optimizer changes
    osd = copy.deepcopy(before[1])
    osd["state"]["blocks.0.fc2.weight"]["exp_avg"] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="blocks.0.fc2.weight"):
        set_optimizer_state_dict(model, optim, osd)
    osd = get_optimizer_state_dict(model, optim)
    for fqn, entries in before[1]["state"].items():
        for name, value in entries.items():
            assert torch.equal(torch.as_tensor(osd["state"][fqn][name]), torch.as_tensor(value)), (fqn, name)
    with pytest.raises(RuntimeError, match="get_model_state_dict"):
        copy.deepcopy(model)
    # nn.Module's own load on a model whose root is plain (one block sharded): a value of the wrong shape
    # for a sharded parameter is an error even with strict=False, as torch's size mismatch is
    partly = make_model()
    fully_shard(partly.blocks[0])
    wrong = {**partly.state_dict(), "blocks.0.fc1.weight": torch.zeros(3, 3)}
    with pytest.raises(RuntimeError, match=r"blocks\.0\.fc1\.weight"):
        partly.load_state_dict(wrong, strict=False)


def _loaded_state_is_a_copy() -> None:
    """``set_optimizer_state_dict`` gives the optimizer copies, never the caller's tensors
    (torch's loader keeps what it is given): a full and a sharded state dict, each loaded into
    two fresh optimizers that then take 1 and 2 steps. Each optimizer's state is its own (steps
    counted 1 and 2 on from the saved count) and the state dict keeps the saved values, also
    when the optimizer it was taken from steps on (no view of its state either); an aliased
    ``step`` made both optimizers count every step of both, and changed the state dict."""
    model = _shard(make_model(), "manual")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optim, range(1))
    for full in (True, False):
        osd = get_optimizer_state_dict(model, optim, full=full)
        saved = copy.deepcopy(osd)
        fresh = [torch.optim.AdamW(model.parameters(), lr=1e-2) for _ in range(2)]
        for other in fresh:
            set_optimizer_state_dict(model, other, osd)
        for steps, other in zip_same([1, 2], fresh):
            for step in range(steps):
                _train(model, other, range(10 + step, 11 + step))
        _train(model, optim, range(12, 13))  # and the optimizer it was taken from steps on
        for fqn, entries in saved["state"].items():
            for name, value in entries.items():
                now, value = (v.local if isinstance(v, ShardedSlice) else torch.as_tensor(v)
                              for v in (osd["state"][fqn][name], value))
                assert torch.equal(now, value), \
                    f"full={full}: the state dict's {fqn}.{name} changed when the optimizers loaded from it stepped"
        for steps, other in zip_same([1, 2], fresh):
            counted = {float(s["step"]) for s in other.state.values()}
            assert counted == {float(v["step"]) + steps for v in saved["state"].values()}, (full, steps, counted)


def _state_of_an_optimizer_that_never_stepped() -> None:
    """A state dict taken of an optimizer that has not stepped yet (a checkpoint at step 0, as
    torchtitan's first save) holds its state with ``step`` 0, full and sharded, and leaves the
    optimizer as it was: AdamW then trains exactly as one never asked (a step count left at 1
    would skip a step of the bias correction), and a fresh AdamW loaded from it too."""
    def build() -> Tuple[nn.Module, torch.optim.Optimizer]:  # two param groups, the second with its own lr
        model = _shard(make_model(), "manual")
        params = list(model.parameters())
        return model, torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 2e-2}], lr=1e-2,
                                        weight_decay=0.1)

    untouched, untouched_optim = build()
    expected = _train(untouched, untouched_optim, range(2))
    for full in (True, False):
        model, optim = build()
        osd = get_optimizer_state_dict(model, optim, full=full)
        steps = {float(entries["step"]) for entries in osd["state"].values()}
        assert osd["state"] and steps == {0.0}, (full, steps)
        loaded_model, loaded = build()
        set_optimizer_state_dict(loaded_model, loaded, osd)
        for what, m in (("asked", model), ("loaded", loaded_model)):  # no .grad left by making the state (a zero
            grads = [n for n, p in m.named_parameters() if p.grad is not None]  # one: a parameter the next
            assert grads == [], (full, what, grads)  # backward does not reach would be stepped)
        for what, (m, o) in (("asked", (model, optim)), ("loaded", (loaded_model, loaded))):
            assert [g["lr"] for g in o.param_groups] == [1e-2, 2e-2], (full, what, o.param_groups)
            losses = _train(m, o, range(2))
            assert losses == expected, (full, what, losses, expected)
            _assert_state_dicts_equal(get_model_state_dict(m), get_model_state_dict(untouched), f"full={full}, {what}")
    # asked between a backward and the first step, some parameters without a gradient (unused, or set to None):
    # the gradients are left exactly as they are (no state is made from them)
    model, optim = build()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    inputs, targets = _global_batch(0)
    loss_fn(model(inputs[rank::world_size]), targets[rank::world_size]).backward()
    first = next(p for p in model.parameters() if p.grad is not None)
    first.grad = None
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    get_optimizer_state_dict(model, optim)
    after = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert list(after) == list(grads) and all(torch.equal(after[n], grads[n]) for n in grads), sorted(after)


# ---------------------------------------------------------------------------- memory
class _StorageTracker(TorchFunctionMode):
    """Bytes of tensor storages created (by torch functions called from Python) and still
    alive; ``peak`` is the maximum over the tracked region."""

    def __init__(self) -> None:
        super().__init__()
        self.live: Dict[int, int] = {}
        self.current = self.peak = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if type(t) is torch.Tensor and t.untyped_storage().nbytes():
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.live and not any(lo <= key < hi for lo, hi in self.preexisting):
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    preexisting: List[Tuple[int, int]] = []  # [start, end) addresses of storages alive before: not new memory


def _peak_bytes(fn: Callable[[], Any], model: nn.Module) -> int:
    tracker = _StorageTracker()
    tracker.preexisting = [(p.untyped_storage().data_ptr(), p.untyped_storage().data_ptr() + p.untyped_storage().nbytes())
                           for p in model.parameters()]
    with tracker:
        result = fn()
    del result
    return tracker.peak


def _memory(path: str) -> None:
    """New storages during a sharded save and load stay far below the rank's sharded size (a
    quarter of it here): DCP writes the flat shards' memory and reads into it without copying
    the rank's state. What is left is DCP's pickled plans, 2.6-20 kB, varying with when gloo's
    worker thread lets go of their buffers. Before [Note: Boxes DCP handles without copies],
    DCP copied every box that was a view of a larger storage: the whole shard on rank 1.
    A rank0_only full save allocates at most one handle's full size on the other ranks (one
    reused buffer: gloo's worker thread may let go of a finished all-gather's output a moment
    late; a fresh buffer per handle measured twice that once in CI), and the output plus a
    handle's full size (two, for that reason) on rank 0. Measured (W=2, six Linear(128, 128)
    handles of 66048 B, model 396288 B, shard 198144 B): save 11637 / 5440 B, load 9670 /
    2624 B, full rank0_only 462336 / 66048 B on ranks 0 / 1."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(6)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    handle_bytes = 4 * (128 * 128 + 128)  # one Linear(128, 128) per handle (even: no padding at W=2)
    model_bytes = sum(p.numel() * 4 for p in nn.Sequential(*[nn.Linear(128, 128) for _ in range(6)]).parameters())
    sharded_bytes = sum(v.local.numel() * 4 for v in get_model_state_dict(model, full=False).values())

    def views() -> Dict[str, Any]:  # the zero-copy form DCP reads and writes in place (get_* returns copies)
        with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            return model.state_dict()

    sharded_save = _peak_bytes(lambda: dcp.save(views(), checkpoint_id=path), model)
    state = views()
    sharded_load = _peak_bytes(lambda: dcp.load(state, checkpoint_id=path), model)
    full_rank0 = _peak_bytes(lambda: get_model_state_dict(model, rank0_only=True), model)
    print(f"rank {dist.get_rank()}: handle {handle_bytes} B, model {model_bytes} B, shard {sharded_bytes} B; peaks: "
          f"sharded save {sharded_save}, sharded load {sharded_load}, rank0_only full {full_rank0}")
    assert sharded_save <= sharded_bytes // 4, (sharded_save, sharded_bytes, handle_bytes)
    assert sharded_load <= sharded_bytes // 4, (sharded_load, sharded_bytes, handle_bytes)
    # plus, once under load (2 test workers), the step agreement's exchange frames (this rank's 64 B and everyone's
    # 64 B each): gloo's worker thread let go of them only after the first handle's buffer was made
    frames = 64 * (1 + dist.get_world_size())
    if dist.get_rank() != 0:
        assert full_rank0 <= handle_bytes + frames, (full_rank0, handle_bytes)
    else:
        assert model_bytes <= full_rank0 <= model_bytes + 2 * handle_bytes, (full_rank0, model_bytes, handle_bytes)


# ---------------------------------------------------------------------------- interoperability
def _torch_fsdp2_interop(path: str) -> None:
    """The checkpoint is plain DCP: torch's FSDP2 loads ours, and ours loads FSDP2's."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict as torch_get, set_model_state_dict as torch_set
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    ours = _shard(make_model(seed=0), "manual")
    theirs = make_model(seed=4)
    for block in theirs.blocks:
        torch_fully_shard(block)
    torch_fully_shard(theirs)
    expected = get_model_state_dict(ours)
    dcp.save(get_model_state_dict(ours, full=False), checkpoint_id=f"{path}/ours")
    state = torch_get(theirs)
    dcp.load(state, checkpoint_id=f"{path}/ours")
    torch_set(theirs, state)
    loaded = {k: v.full_tensor() for k, v in torch_get(theirs).items()}
    _assert_state_dicts_equal(loaded, expected, "FSDP2 loading ours")
    with torch.no_grad():
        for p in theirs.parameters():
            p.mul_(2.0)
    expected = {k: v.full_tensor() for k, v in torch_get(theirs).items()}
    dcp.save(torch_get(theirs), checkpoint_id=f"{path}/theirs")
    state = get_model_state_dict(ours, full=False)
    dcp.load(state, checkpoint_id=f"{path}/theirs")
    set_model_state_dict(ours, state)
    _assert_state_dicts_equal(get_model_state_dict(ours), expected, "ours loading FSDP2's")


# ---------------------------------------------------------------------------- optimizer.state_dict() of one rank
def _equal_slices(seed: int) -> nn.Module:
    """Two bias-free 8x8 linears, each its own handle: every rank holds the same count of each
    one's elements at W = 2 and 4 (one rank's slices load into another without a size error)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 8, bias=False))
    fully_shard(model[0])
    fully_shard(model[2])
    return fully_shard(model)


def _steps_of(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> List[float]:
    """:func:`_train`, or for :func:`_equal_slices` the same loop over its inputs."""
    if not isinstance(model, nn.Sequential):
        return _train(model, optim, steps)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(300 + step))
        rows = 8 // world_size
        loss = model(x[rank * rows:(rank + 1) * rows]).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(global_mean(loss))
    return losses


def _optimizer_state(optim: torch.optim.Optimizer) -> List[Dict[str, torch.Tensor]]:
    return [{k: torch.as_tensor(v).clone() for k, v in optim.state.get(p, {}).items()}
            for group in optim.param_groups for p in group["params"]]


def _assert_sliced_state_untouched(optim: torch.optim.Optimizer, loaded: Dict[str, Any], saved: Dict[str, Any],
                                   what: str) -> None:
    """Every tensor of an ``optimizer.state_dict()`` ``loaded`` into ``optim`` earlier that the
    load cut this rank's slice from (its shape is not the parameter's here) equals the same file
    ``saved`` read again; at least one was. (One whose shape is the parameter's, as a whole
    parameter this rank holds entirely, is taken as it is: torch's loader keeps the caller's
    tensor, and so does the library's, so training updates it in the caller's dict.)"""
    params = [p for group in optim.param_groups for p in group["params"]]
    assert sorted(loaded["state"]) == sorted(saved["state"]), what
    sliced = 0
    for key, entries in saved["state"].items():
        for name, value in entries.items():
            if value.dim() == 0 or tuple(value.shape) == tuple(params[key].shape):
                continue
            sliced += 1
            assert torch.equal(loaded["state"][key][name], value), \
                f"{what}: state[{key!r}][{name!r}] of the dict passed to optimizer.load_state_dict changed"
    assert sliced, f"{what}: no state was cut to this rank's slice"


def _train_whole(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> List[float]:
    """:func:`_train` on the whole global batch, in this process alone."""
    losses = []
    for step in steps:
        inputs, targets = _global_batch(step)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _one_ranks_optimizer_file(layout: str, when: str, path: str) -> None:
    """Each rank saves ``torch.save(optim.state_dict())`` to a file of its own (DDP's habit, the
    files Hugging Face's Trainer and Lightning write on rank 0). Loaded on the rank that saved
    it, into a fresh model and optimizer (``when="fresh"``, before its first step) or one that
    has stepped (its state-dict hooks installed), the run resumes exactly. Rank 0's file loaded
    on every rank, for a real shard: every rank raises, naming the ranks given other elements
    than theirs (under HYBRID_SHARD, rank 2 holds rank 0's), at the load (a stepped optimizer:
    nothing loaded) or at the first step (a fresh one: nothing stepped, again at a retry), and
    the parameters stay as they were; so does rank 0's file loaded into a one-rank model (W=2
    saved, W=1 loaded). Before, every rank trained on with rank 0's moments (silently, where
    the slices have equal shapes). State whose every value is a whole parameter loads on any
    rank: NO_SHARD's, a one-rank model's (flat) and a plain model's (W=1 saved, W loaded); the
    steps after leave the one-rank and the plain model's state dicts as they were loaded where
    the load cut this rank's slice (a copy, not a view of the caller's tensor that the optimizer
    would update in place: the dict passed in changing as training goes on, two optimizers
    loaded from one dict sharing moments)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    directory = os.path.join(path, f"{layout}-{when}")
    os.makedirs(directory, exist_ok=True)
    alone = [dist.new_group([r]) for r in range(world_size)][rank]  # every rank creates every group

    def build(seed: int, where: str = "sharded") -> Tuple[nn.Module, torch.optim.Optimizer]:
        if where == "plain":
            model = make_model(seed)
        elif where == "alone":  # fully sharded over this rank alone: flat, whole parameters
            model = make_model(seed)
            for block in model.blocks:
                fully_shard(block, process_group=alone)
            fully_shard(model, process_group=alone)
        else:
            model = _equal_slices(seed) if layout == "equal_slices" else _build(layout, seed)
        # the trainable parameters only (make_model's frozen Linear is in the root's handle)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05, weight_decay=0.1)

    def file(name: str) -> str:
        return os.path.join(directory, f"{name}.pt")

    model, optim = build(0)
    _steps_of(model, optim, range(2))
    saved_model = get_model_state_dict(model)
    torch.save(optim.state_dict(), file(f"optim-{rank}"))
    if layout == "FULL_SHARD":
        for where in ("plain", "alone"):
            one, one_optim = build(0, where)
            _train_whole(one, one_optim, range(2))
            if rank == 0:
                torch.save(one_optim.state_dict(), file(where))
    dist.barrier()
    uninterrupted = _steps_of(model, optim, range(2, 5))

    def resumed(where: str = "sharded") -> Tuple[nn.Module, torch.optim.Optimizer]:
        model, optim = build(7, where)
        if when == "stepped":
            (_train_whole if where == "alone" else _steps_of)(model, optim, range(9, 10))
        set_model_state_dict(model, saved_model)
        return model, optim

    def load(optim: torch.optim.Optimizer, name: str) -> None:
        optim.load_state_dict(torch.load(file(name)))

    sources = [f"optim-{rank}"] + (["plain", "alone"] if layout == "FULL_SHARD" else []) + (
        ["optim-0"] if layout == "NO_SHARD" else [])
    for source in sources:
        model, optim = resumed()
        loaded = torch.load(file(source))
        optim.load_state_dict(loaded)
        torch.testing.assert_close(_steps_of(model, optim, range(2, 5)), uninterrupted, atol=1e-5 if source in ("plain", "alone")
                                   else 1e-6, rtol=0, msg=lambda m: f"{layout}/{when}, {source}: {m}")
        steps = {float(entries["step"]) for entries in loaded["state"].values()}
        assert steps == {2.0}, f"{source}: the loaded state dict's step counted the resumed steps: {steps}"
        if source in ("plain", "alone"):  # whole parameters: each rank's slice of them is the optimizer's own copy
            _assert_sliced_state_untouched(optim, loaded, torch.load(file(source)), f"{layout}/{when}, {source} after 3 steps")
    if layout == "FULL_SHARD":  # the library's FQN-keyed loader given torch's layout: told which loader takes it
        model, optim = resumed()
        state = _optimizer_state(optim)
        with pytest.raises(ValueError, match=r"not by FQN: it is torch's optimizer.state_dict\(\) layout"):
            set_optimizer_state_dict(model, optim, torch.load(file("plain")))
        after = _optimizer_state(optim)
        assert all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(after, state))
    if layout == "NO_SHARD":
        return
    wrong = [r for r in range(1, world_size) if layout != "HYBRID_SHARD" or r % 2]  # HSDP (2, 2): rank 2 holds rank 0's
    given = "rank {} of {} was given the slices saved by rank 0 of {}"
    refusals = [("sharded", "; ".join(given.format(r, world_size, world_size) for r in wrong), rank in wrong)]
    if layout == "FULL_SHARD":
        refusals.append(("alone", given.format(rank, world_size, world_size), True))
    for where, expected, named_here in refusals:
        model, optim = resumed(where)
        params, state = get_model_state_dict(model), _optimizer_state(optim)
        if when == "stepped":
            with pytest.raises(RuntimeError, match=expected) as raised:
                load(optim, "optim-0")
            assert "Nothing was loaded on any rank" in str(raised.value), raised.value
            after = _optimizer_state(optim)
            assert len(after) == len(state) and all(
                a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(after, state))
        else:
            load(optim, "optim-0")
            for _ in range(2):  # refused at the first step, and again at a retry
                with pytest.raises(RuntimeError, match=expected) as raised:
                    (_train_whole if where == "alone" else _steps_of)(model, optim, range(2, 3))
                assert "Nothing was stepped" in str(raised.value), raised.value
                optim.zero_grad()
        assert (f"On this rank (rank {rank} of {world_size}): '" in str(raised.value)) == named_here, raised.value
        _assert_state_dicts_equal(get_model_state_dict(model), params, f"{layout}/{when}/{where}: after the refusal")


def _one_ranks_optimizer_files(path: str) -> None:
    layouts = ["FULL_SHARD", "HYBRID_SHARD"] if dist.get_world_size() == 4 else ["FULL_SHARD", "equal_slices", "NO_SHARD"]
    run_subtests(_one_ranks_optimizer_file, {"layout": layouts, "when": ["fresh", "stepped"]}, path=path)


def _load_checkpoint_missing_state(path: str) -> None:
    """``load_checkpoint`` into a model with a parameter the checkpoint lacks (a layer added
    since) raises on every rank, naming it, and loads nothing: a partial load would leave it at
    its fresh values and train on silently."""
    model = _build("FULL_SHARD", seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optim, range(1))
    save_checkpoint(f"{path}/ckpt", model, optim)
    grown = make_model(seed=3)
    grown.extra = nn.Linear(4, 2)
    for block in grown.blocks:
        fully_shard(block)
    fully_shard(grown)
    before = get_model_state_dict(grown)
    with pytest.raises(BaseException, match=r"extra\.weight") as raised:  # DCP's CheckpointException is a BaseException
        load_checkpoint(f"{path}/ckpt", grown)  # the model only (an optimizer's groups would be refused first)
    assert not isinstance(raised.value, (KeyboardInterrupt, SystemExit)), raised.value
    _assert_state_dicts_equal(get_model_state_dict(grown), before, "after a refused load_checkpoint")


# ---------------------------------------------------------------------------- entry
_CHECKS: Dict[str, Callable[[str], None]] = {  # check -> fn(a directory of its own)
    "memory": _memory, "full_options": lambda path: _full_options(), "sharded_is_local": lambda path: _sharded_is_local(),
    "large_tensors_in_chunk_sized_boxes": lambda path: _large_tensors_cut_like_torch_chunk(),
    "strict_loading": lambda path: _strict(), "loaded_state_is_a_copy": lambda path: _loaded_state_is_a_copy(),
    "state_of_an_optimizer_that_never_stepped": lambda path: _state_of_an_optimizer_that_never_stepped(),
    "extra_read_weights_only": _extra_weights_only,
    "interoperate_with_torch_fsdp2": _torch_fsdp2_interop, "optimizer_state_dict_of_one_rank": _one_ranks_optimizer_files,
    "load_checkpoint_refuses_missing_state": _load_checkpoint_missing_state}
_CHECKS_AT_4 = ["full_options", "sharded_is_local", "large_tensors_in_chunk_sized_boxes", "interoperate_with_torch_fsdp2",
                "optimizer_state_dict_of_one_rank"]


def _one_check(check: str, path: str) -> None:
    directory = os.path.join(path, check)
    os.makedirs(directory, exist_ok=True)
    _CHECKS[check](directory)


def _state_dicts(path: str) -> None:
    four = dist.get_world_size() == 4
    run_subtests(_one_check, {"check": _CHECKS_AT_4 if four else list(_CHECKS)}, path=path)
    run_subtests(_full_parity, {"config": CONFIGS_AT_4 if four else CONFIGS})


@pytest.mark.parametrize("world_size", [2, 4])
def test_state_dicts(tmp_path: Any, world_size: int) -> None:
    """Every state-dict check of this file but the resumes, in one process group per world
    size (each failure names its check or config): the full state dict is the plain model's
    (``_full_parity``, every config at 2 ranks, CONFIGS_AT_4 at 4) and its options
    (``_full_options``); the sharded one is local and cut like torch.chunk
    (``_sharded_is_local``, ``_large_tensors_cut_like_torch_chunk``); checkpoints interoperate
    with torch's FSDP2 both ways (``_torch_fsdp2_interop``); and at 2 ranks only (nothing in
    them depends on the world size beyond the shard arithmetic above): strict loading changes
    nothing on error (``_strict``), a loaded optimizer state is a copy
    (``_loaded_state_is_a_copy``), ``extra`` is read weights_only (``_extra_weights_only``),
    and what a save and a load allocate (``_memory``, measured first, in a fresh process)."""
    run_distributed(_state_dicts, world_size, str(tmp_path), timeout=300)
