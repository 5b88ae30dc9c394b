"""torch's ``torch.distributed.checkpoint.state_dict`` API (what Lightning, Fabric, torchtitan and
DCP's recipes call), DCP's ``Stateful`` protocol and ``dcp.save({"optim": optim.state_dict()})``
on models this library manages, with torch's FSDP2 in the same scripts as the reference.

Without these: torch's functions saw each rank's 1-D slice of the optimizer state under the full
name; DCP kept one rank's slice per key, so a checkpoint held a partial optimizer state, and
where every rank's slices had equal shapes a resume silently loaded rank 0's AdamW moments into
every rank (a resumed run drifting from the uninterrupted one with nothing raised). A full state
dict (``full_state_dict=True``) must be gathered (torch gathers only DTensors), and a sharded
one must not materialise the full model on any rank.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict as torch_get_model,
                                                     get_state_dict as torch_get_state_dict,
                                                     set_model_state_dict as torch_set_model,
                                                     set_state_dict as torch_set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

from composable_shard import (ShardedSlice, fully_shard, get_model_state_dict, get_optimizer_state_dict,
                              unshard_params)
from tests._harness import run_distributed, run_subtests
from tests.distributed.test_state_dict import _assert_state_dicts_equal, _build, _resume_run, _save_run, _train

# ---------------------------------------------------------------------------- the equal-shapes swap
WIDTH = 8


def _equal_slices_model(seed: int) -> nn.Sequential:
    """Two bias-free 8x8 linears, each its own handle: at W = 2 every rank holds 32 elements of
    each, so a state dict keyed by name has the same shapes on both ranks (the case where DCP
    loaded rank 0's slices into rank 1 without an error)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH, bias=False), nn.Tanh(), nn.Linear(WIDTH, WIDTH, bias=False))


def _shard_equal(model: nn.Sequential, api: str) -> nn.Sequential:
    if api == "ours":
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
    else:
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        torch_fully_shard(model[0])
        torch_fully_shard(model[2])
        torch_fully_shard(model)
    return model


def _equal_steps(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> List[float]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(300 + step)
        x = torch.randn(4, WIDTH, generator=g)
        rows = 4 // world_size
        loss = model(x[rank * rows:(rank + 1) * rows]).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    return losses


def _full_of(model: nn.Module, api: str) -> Dict[str, torch.Tensor]:
    if api == "ours":
        with unshard_params(model, writeback=False):
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _resume_through_torch_api(path: str, api: str, saver: str) -> Tuple[List[float], List[float], Dict[str, torch.Tensor]]:
    """2 steps, save through torch's API (``saver``), 3 more steps (the uninterrupted run); a
    differently initialised model and a fresh optimizer load the checkpoint the same way and
    take the same 3 steps. Returns both runs' last 3 losses and the resumed parameters."""
    model = _shard_equal(_equal_slices_model(0), api)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    _equal_steps(model, optim, range(2))
    if saver == "get_state_dict":
        msd, osd = torch_get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    elif saver == "stateful":  # DCP's recipe: an app state calling torch's functions
        dcp.save({"app": _AppState(model, optim)}, checkpoint_id=path)
    else:  # the plain optimizer state dict, straight into DCP
        dcp.save({"model": torch_get_model(model), "optim": optim.state_dict()}, checkpoint_id=path)
    uninterrupted = _equal_steps(model, optim, range(2, 5))
    resumed_model = _shard_equal(_equal_slices_model(7), api)
    resumed_optim = torch.optim.AdamW(resumed_model.parameters(), lr=0.05)
    if saver == "get_state_dict":
        msd, osd = torch_get_state_dict(resumed_model, resumed_optim)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
        torch_set_state_dict(resumed_model, resumed_optim, model_state_dict=msd, optim_state_dict=osd)
    elif saver == "stateful":
        dcp.load({"app": _AppState(resumed_model, resumed_optim)}, checkpoint_id=path)
    else:
        _equal_steps(resumed_model, resumed_optim, range(7, 8))  # a fresh optimizer's state_dict() has no state to load into
        state = {"model": torch_get_model(resumed_model), "optim": resumed_optim.state_dict()}
        dcp.load(state, checkpoint_id=path)
        torch_set_model(resumed_model, state["model"])
        resumed_optim.load_state_dict(state["optim"])
    resumed = _equal_steps(resumed_model, resumed_optim, range(2, 5))
    return uninterrupted, resumed, _full_of(resumed_model, api)


class _AppState(Stateful):
    """torch's distributed-checkpoint recipe: the model and optimizer through torch's functions."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> Dict[str, Any]:
        msd, osd = torch_get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        torch_set_state_dict(self.model, self.optim, model_state_dict=state_dict["model"],
                             optim_state_dict=state_dict["optim"])


def _equal_shapes_swap(path: str) -> None:
    for saver in ("get_state_dict", "stateful", "optim.state_dict"):
        theirs = _resume_through_torch_api(f"{path}/fsdp2-{saver}", "fsdp2", saver) if saver != "optim.state_dict" else None
        mine = _resume_through_torch_api(f"{path}/ours-{saver}", "ours", saver)
        uninterrupted, resumed, params = mine
        # A swapped or partial optimizer state moves the resumed losses by ~1e-2 (measured 0.0088
        # on the model); float32 resumes to the last bit: atol 1e-6 leaves 4 orders.
        torch.testing.assert_close(resumed, uninterrupted, atol=1e-6, rtol=0, msg=lambda m: f"{saver}: {m}")
        if theirs is not None:  # FSDP2 on the same script: the same numbers
            torch.testing.assert_close(resumed, theirs[1], atol=1e-5, rtol=0, msg=lambda m: f"{saver} vs FSDP2: {m}")
            _assert_state_dicts_equal(params, theirs[2], f"{saver}: parameters vs FSDP2's", atol=1e-5)


def test_equal_shapes_resume_exactly(tmp_path: Any) -> None:
    """The swap of issue 42: saved and resumed through torch's get_state_dict/set_state_dict,
    DCP's Stateful recipe and ``dcp.save({"optim": optim.state_dict()})``, the resumed run
    takes the uninterrupted run's steps exactly, as FSDP2's does."""
    run_distributed(_equal_shapes_swap, 2, str(tmp_path))


# ---------------------------------------------------------------------------- full and sharded, other world sizes
def _options(full: bool, cpu_offload: bool, **extra: Any) -> StateDictOptions:
    return StateDictOptions(full_state_dict=full, cpu_offload=cpu_offload, **extra)


def _fsdp2_model(seed: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from tests._models import make_model

    model = make_model(seed)
    for block in model.blocks:
        torch_fully_shard(block)
    torch_fully_shard(model)
    return model


def _full_like_fsdp2() -> None:
    """torch's full state dicts of our model equal FSDP2's (an independent implementation)
    after the same training, for each layout; sharded ones are ShardedSlice views and never a
    full parameter; both load back into a fresh model exactly."""
    theirs = _fsdp2_model(0)
    their_optim = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1)
    _train(theirs, their_optim, range(2))

    def check(layout: str, full: bool, cpu_offload: bool) -> None:
        model = _build(layout, seed=0)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        _train(model, optim, range(2))
        options = _options(full, cpu_offload)
        msd, osd = torch_get_state_dict(model, optim, options=options)
        if not full:  # sharded: this rank's elements only, for every managed parameter and its moments
            held = sum(v.local.numel() for v in msd.values() if isinstance(v, ShardedSlice))
            total = sum(v.numel() for v in msd.values() if isinstance(v, ShardedSlice))
            assert total > 0 and (held < total) == (layout != "NO_SHARD"), (layout, held, total)
            for fqn, entries in osd["state"].items():  # each moment: the parameter's elements on this rank
                param = msd[fqn]
                moment = entries["exp_avg"]
                if isinstance(param, ShardedSlice):
                    assert isinstance(moment, ShardedSlice) and moment.shape == param.shape, (fqn, moment)
                    assert (moment.start, moment.end) == (param.start, param.end), (fqn, moment, param)
                else:
                    assert type(moment) is torch.Tensor and moment.shape == param.shape, (fqn, moment)
            msd = get_model_state_dict(model)  # compare values through our own gather
            osd_full = get_optimizer_state_dict(model, optim)
            expected_msd, expected_osd = torch_get_state_dict(theirs, their_optim, options=_options(True, False))
        else:
            osd_full = osd
            expected_msd, expected_osd = torch_get_state_dict(theirs, their_optim, options=options)
        if cpu_offload and full and dist.get_rank() != 0:
            assert msd == {} and osd == {}, (list(msd), list(osd))
            return
        _assert_state_dicts_equal(msd, expected_msd, f"{layout}: model", atol=1e-5)
        assert list(osd_full["state"]) == list(expected_osd["state"])
        for fqn, entries in expected_osd["state"].items():
            for name, value in entries.items():
                got = osd_full["state"][fqn][name]
                assert not isinstance(got, ShardedSlice) and got.shape == value.shape, (fqn, name, type(got))
                if cpu_offload:
                    assert got.device.type == "cpu"
                torch.testing.assert_close(got, value, atol=1e-5, rtol=0, msg=lambda m: f"{layout} {fqn}.{name}: {m}")

    run_subtests(check, {"layout": ["FULL_SHARD", "NO_SHARD", "replicated_block"], "full": [True, False],
                         "cpu_offload": [False, True]})


@pytest.mark.parametrize("world_size", [2])
def test_full_state_dicts_equal_fsdp2s(world_size: int) -> None:
    run_distributed(_full_like_fsdp2, world_size)


@pytest.mark.parametrize("how,world_size,layout", [
    ("torch:sharded", 4, "FULL_SHARD"), ("torch:sharded_offload", 1, "plain"), ("torch:flat", 2, "replicated_block"),
    ("torch:full", 4, "HYBRID_SHARD"), ("torch:full", 1, "FULL_SHARD")])
def test_resume_through_torch_api_at_another_world_size(tmp_path: Any, how: str, world_size: int, layout: str) -> None:
    """Saved at 2 ranks (FULL_SHARD) through torch's get_state_dict, sharded (DCP), flattened
    optimizer state, or full on rank 0; resumed through torch's set_state_dict (a full one
    broadcast from rank 0) at 4, 2 and 1 ranks into other layouts: the uninterrupted run's
    losses, parameters and optimizer state."""
    run_distributed(_save_run, 2, str(tmp_path), "FULL_SHARD", how)
    run_distributed(_resume_run, world_size, str(tmp_path), layout, how)


# ---------------------------------------------------------------------------- dicts held by rank 0 only
def _snapshot(model: nn.Module, optim: torch.optim.Optimizer) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Full model and optimizer state through our own gathers, on every rank."""
    return get_model_state_dict(model), get_optimizer_state_dict(model, optim)


def _assert_same_state(actual: Tuple[Dict[str, Any], Dict[str, Any]], expected: Tuple[Dict[str, Any], Dict[str, Any]],
                       what: str) -> None:
    _assert_state_dicts_equal(actual[0], expected[0], f"{what}: model")
    assert list(actual[1]["state"]) == list(expected[1]["state"]), what
    for fqn, entries in expected[1]["state"].items():
        for name, value in entries.items():
            got = actual[1]["state"][fqn][name]
            assert torch.equal(torch.as_tensor(got), torch.as_tensor(value)), f"{what}: optimizer {fqn}.{name}"


def _rank0_only_full_state_dicts(layout: str) -> None:
    """A full state dict that torch's ``get_state_dict(..., cpu_offload=True)`` put on rank 0
    only (``{}`` elsewhere): torch's ``set_state_dict`` loads the model on rank 0 only (and with
    ``broadcast_from_rank0`` too: an empty dict makes the call optimizer-only on the other ranks).
    Before the fix rank 0 loaded its slices alone and every rank returned: a half-loaded model,
    nothing raised; with broadcast_from_rank0 rank 0 hung. Now every rank raises before
    anything is loaded, the message names the calls that work, and they round-trip exactly."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict as torch_set_optim

    from composable_shard._runtime import collectives

    rank, world_size = dist.get_rank(), dist.get_world_size()
    trained = _build(layout, seed=0)
    trained_optim = torch.optim.AdamW(trained.parameters(), lr=1e-2, weight_decay=0.1)
    _train(trained, trained_optim, range(2))
    held = _options(True, True)
    msd, osd = torch_get_state_dict(trained, trained_optim, options=held)
    assert (msd == {} and osd == {}) == (rank != 0), (rank, len(msd), len(osd))
    want = _snapshot(trained, trained_optim)

    fresh = _build(layout, seed=1)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1)
    _train(fresh, fresh_optim, range(1))
    before = _snapshot(fresh, fresh_optim)
    skipping = ", ".join(str(r) for r in range(1, world_size))
    for broadcast in (False, True):
        with pytest.raises(RuntimeError) as raised:
            torch_set_state_dict(fresh, fresh_optim, model_state_dict=msd, optim_state_dict=osd,
                                 options=_options(True, True, broadcast_from_rank0=broadcast))
        message = str(raised.value)
        assert f"ranks [{skipping}] of the model's group skip the model, ranks [0] load it" in message, message
        assert "set_model_state_dict(model, msd, options=StateDictOptions(full_state_dict=True, " \
               "broadcast_from_rank0=True))" in message and "Nothing was loaded on any rank" in message, message
        _assert_same_state(_snapshot(fresh, fresh_optim), before, f"{layout}: after the refused load ({broadcast})")

    # torch's model-only call: the ranks given {} return at once, rank 0 waits for them, saying why
    collectives_warning_after = collectives.STUCK_WARNING_AFTER_S
    collectives.STUCK_WARNING_AFTER_S = 1.0
    try:
        if rank == 0:
            with pytest.warns(RuntimeWarning, match="torch skips the model on a rank whose model state dict is "
                                                    "empty") as warned, pytest.raises(RuntimeError) as raised:
                torch_set_model(fresh, msd, options=held)
            assert f"ranks [{skipping}] of the model's group skip the model" in str(raised.value), str(raised.value)
            assert "which ranks load the model" in str(warned[0].message), str(warned[0].message)
        else:
            torch_set_model(fresh, msd, options=held)  # torch returns: nothing to load here
            time.sleep(3.0)
            # what rank 0 waits for: the agreement torch's flow never reaches on a rank given {}
            collectives.exchange([0], None, tag="set_model_state_dict: which ranks load the model")
    finally:
        collectives.STUCK_WARNING_AFTER_S = collectives_warning_after
    _assert_same_state(_snapshot(fresh, fresh_optim), before, f"{layout}: after the model-only load")

    # the calls the message names: exact, and the next step too
    options = _options(True, True, broadcast_from_rank0=True)
    torch_set_model(fresh, msd, options=options)
    torch_set_optim(fresh, fresh_optim, osd, options=options)
    _assert_same_state(_snapshot(fresh, fresh_optim), want, f"{layout}: broadcast from rank 0")
    # every rank given the whole dicts: the agreement lets it through
    whole = _options(True, False)
    again = _build(layout, seed=2)
    again_optim = torch.optim.AdamW(again.parameters(), lr=1e-2, weight_decay=0.1)
    _train(again, again_optim, range(1))
    whole_msd, whole_osd = torch_get_state_dict(trained, trained_optim, options=whole)
    torch_set_state_dict(again, again_optim, model_state_dict=whole_msd, optim_state_dict=whole_osd, options=whole)
    _assert_same_state(_snapshot(again, again_optim), want, f"{layout}: whole dicts on every rank")
    for model, optim in ((trained, trained_optim), (fresh, fresh_optim), (again, again_optim)):
        _train(model, optim, range(2, 3))
    _assert_same_state(_snapshot(fresh, fresh_optim), _snapshot(trained, trained_optim), f"{layout}: next step")
    _assert_same_state(_snapshot(again, again_optim), _snapshot(trained, trained_optim), f"{layout}: next step")


@pytest.mark.parametrize("world_size,layout", [(2, "FULL_SHARD"), (4, "HYBRID_SHARD"), (2, "replicate")])
def test_state_dicts_held_by_rank0_load_everywhere_or_raise_everywhere(world_size: int, layout: str) -> None:
    run_distributed(_rank0_only_full_state_dicts, world_size, layout)


# ---------------------------------------------------------------------------- full dicts that leave keys out
def _full_state_dicts_leaving_keys_out(layout: str) -> None:
    """torch's full-state-dict load fills each key its dict lacks with the model's own parameter
    (``ignore_frozen_params=True``, as LoRA fine-tuning saves; ``strict=False`` with keys left
    out). Ours were views of this rank's elements, refused as a size mismatch on every rank:
    now each left-out parameter keeps its values, every other one is loaded, and the next step
    equals the trained model's (whose left-out values it is given first)."""
    trained = _build(layout, seed=0)
    fresh = _build(layout, seed=1)
    frozen = [name for name, _ in trained.named_parameters() if name.startswith("blocks.0.")]
    for model in (trained, fresh):
        for name, p in model.named_parameters():
            if name in frozen:
                p.requires_grad_(False)
    optims = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (trained, fresh)]
    _train(trained, optims[0], range(2))
    _train(fresh, optims[1], range(1))
    frozen = [name for name, p in trained.named_parameters() if not p.requires_grad]  # and the model's own frozen.*
    for options, left_out in ((_options(True, False, ignore_frozen_params=True), frozen),
                              (_options(True, False, strict=False), ["scale.gain", "blocks.1.fc1.weight"])):
        msd, osd = torch_get_state_dict(trained, optims[0], options=options)
        for key in left_out:
            msd.pop(key, None)
        assert not set(left_out) & set(msd) and set(left_out) < set(get_model_state_dict(fresh)), (list(msd), left_out)
        before = get_model_state_dict(fresh)
        torch_set_state_dict(fresh, optims[1], model_state_dict=msd, optim_state_dict=osd, options=options)
        after, want = get_model_state_dict(fresh), get_model_state_dict(trained)
        for key in after:
            expected = before[key] if key in left_out else want[key]
            assert torch.equal(after[key], expected), (options, key, "left out" if key in left_out else "loaded")
    with unshard_params(fresh), torch.no_grad():  # the same start everywhere, then the same step
        for name, p in fresh.named_parameters():
            p.copy_(want[name])
    for model, optim in zip((trained, fresh), optims):
        _train(model, optim, range(2, 3))
    _assert_state_dicts_equal(get_model_state_dict(fresh), get_model_state_dict(trained), f"{layout}: next step")


def test_full_state_dicts_leaving_keys_out_load_the_rest() -> None:
    run_distributed(_full_state_dicts_leaving_keys_out, 2, "FULL_SHARD")


# ---------------------------------------------------------------------------- an optimizer grown after its first step
def _optimizer_grown_after_its_first_step() -> None:
    """An optimizer built on the blocks only, then given the other parameters with
    ``add_param_group`` after its first step (fused AdamW: no version counter tells an in-place
    update): its later steps must count for the root's handle too (the root's kept unsharded
    buffer gathered again, the step agreement, torch's state-dict API linking it). 3 steps equal
    one process's on the combined batch, and torch's full optimizer state dict holds the root's
    parameters' state whole, equal to the one process's."""
    from tests.distributed.test_state_dict import _global_batch
    from tests._models import loss_fn, make_model

    model, reference = _build("FULL_SHARD", seed=0), make_model(0)
    optims = []
    for m in (model, reference):
        optims.append(torch.optim.AdamW([p for n, p in m.named_parameters() if n.startswith("blocks.")], lr=1e-2,
                                        fused=True))
    _train(model, optims[0], range(1))
    for step in range(3):
        if step == 1:
            for m, optim in zip((model, reference), optims):
                optim.add_param_group({"params": [p for n, p in m.named_parameters()
                                                  if not n.startswith("blocks.") and p.requires_grad]})
        if step:
            _train(model, optims[0], range(step, step + 1))
        inputs, targets = _global_batch(step)
        loss_fn(reference(inputs), targets).backward()
        optims[1].step()
        optims[1].zero_grad()
    full = get_model_state_dict(model)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
    _, osd = torch_get_state_dict(model, optims[0], options=_options(True, False))
    theirs = {n: optims[1].state[p] for n, p in reference.named_parameters() if p in optims[1].state}
    assert set(osd["state"]) == set(theirs) and "emb.weight" in theirs, (sorted(osd["state"]), sorted(theirs))
    for name, entries in theirs.items():
        for key, value in entries.items():
            torch.testing.assert_close(osd["state"][name][key], value, atol=1e-5, rtol=0,
                                       msg=lambda m: f"optimizer {name}.{key}: {m}")


def _plain_copy_loaded_on_rank0() -> None:
    """A plain copy of the model (an eval copy) loaded with set_model_state_dict and
    set_optimizer_state_dict on rank 0 alone: a plain module's load is local, no rank waits."""
    from composable_shard import set_model_state_dict, set_optimizer_state_dict
    from tests._models import make_model

    model = _build("FULL_SHARD", seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optim, range(1))
    msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, optim)
    if dist.get_rank() == 0:
        plain = make_model(1)
        plain_optim = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        set_model_state_dict(plain, msd)
        set_optimizer_state_dict(plain, plain_optim, osd)
        _assert_state_dicts_equal(dict(plain.state_dict()), msd, "plain copy")
    dist.barrier()


def _grown_and_plain() -> None:
    _optimizer_grown_after_its_first_step()
    _plain_copy_loaded_on_rank0()


def test_an_optimizer_grown_after_its_first_step_and_a_plain_copy_on_rank0() -> None:
    run_distributed(_grown_and_plain, 2)
