"""State dicts own their tensors, and ``rank0_only`` gives other ranks nothing (issue 34,
items 1 and 2; API.md "State dicts own their tensors").

Without these: ``get_optimizer_state_dict`` returned each parameter's live ``step`` tensor
(and the live moments of parameters outside fully sharded modules), and
``set_optimizer_state_dict`` put the caller's tensors into the optimizer, so a run copied into
a second model and optimizer shared ``step`` with the original: both counted every step twice
and drifted. A sharded state dict returned views of the live shards; ``state_dict()`` under
``state_dict_type(FULL_STATE_DICT)`` returned the live buffers and the live parameters of
plain submodules and of ``replicate``; and with ``FullStateDictConfig(rank0_only=True)`` the
other ranks got the buffers instead of ``{}``.

Models: ``fully_shard`` on a submodule only, beside a plain submodule and buffers (float and
integer) on both; ``replicate`` on the whole model; ``fully_shard`` on the submodule and the
root (every parameter managed). W = 2.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from composable_shard import (FullStateDictConfig, ShardedSlice, StateDictType, fully_shard, get_model_state_dict,
                              get_optimizer_state_dict, replicate, set_model_state_dict, set_optimizer_state_dict,
                              state_dict_type)
from composable_shard._runtime.traversal import _get_fsdp_handles
from tests._harness import run_distributed, run_subtests

WORLD_SIZE = 2
ROWS_PER_RANK = 2
CONFIGS = ["submodule", "replicate", "submodule_and_root"]


class Net(nn.Module):
    """A body (fully sharded in two configs) holding an integer buffer, a plain head, and a
    float and an integer buffer on the root. Forward updates the buffers the same way on
    every rank and whatever the batch size (a counter, a decaying scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5))
        self.body.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.head = nn.Linear(5, 3)
        self.register_buffer("scale", torch.full((3,), 2.0))
        self.register_buffer("seen", torch.tensor([3, 4], dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.body.calls += 1
            self.scale.mul_(0.75)
            self.seen.add_(2)
        return self.head(self.body(x)) * self.scale


def _net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def _wrap(model: Net, config: str) -> Net:
    if config == "replicate":
        replicate(model)
    else:
        fully_shard(model.body)
        if config == "submodule_and_root":
            fully_shard(model)
    return model


def _batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD_SIZE * ROWS_PER_RANK, 6, generator=g), torch.randn(WORLD_SIZE * ROWS_PER_RANK, 3, generator=g)


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int, config: str = "") -> float:
    """One AdamW step of ``config`` on this rank's rows (``config=""``: one process, all rows);
    the global mean loss. The plain head of "submodule" is no data-parallel module: its
    gradients are averaged here, so every config trains as one process on the whole batch."""
    distributed = bool(config)
    x, y = _batch(step)
    if distributed:
        rank = dist.get_rank()
        x, y = x[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK], y[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]
    loss = F.mse_loss(model(x), y)
    loss.backward()
    if config == "submodule":
        for p in model.head.parameters():  # type: ignore[union-attr]  # a Net
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
    optim.step()
    optim.zero_grad()
    total = loss.detach().clone()
    if distributed:
        dist.all_reduce(total)
        total /= dist.get_world_size()
    return total.item()


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # a tensor learning rate (as schedulers driving a compiled step keep it): a hyper-parameter the state
    # dicts must copy too, not hand out (foreach=False: torch refuses a tensor lr with foreach and no capturable)
    return torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.05), weight_decay=0.01, foreach=False)


def _trained(config: str, steps: int) -> Tuple[Net, torch.optim.Optimizer, List[float]]:
    model = _wrap(_net(0), config)
    optim = _optimizer(model)
    return model, optim, [_step(model, optim, s, config) for s in range(steps)]


# ---------------------------------------------------------------------------- storage overlap
def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) state dict; a ShardedSlice counts by its local elements."""
    if isinstance(obj, ShardedSlice):
        yield obj.local
    elif isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def _live(model: nn.Module, optim: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    """Every live tensor of model and optimizer: parameters, buffers, flat shards, optimizer
    state (``step`` included) and tensor hyper-parameters."""
    live = {f"param {n}": p for n, p in model.named_parameters()}
    live.update({f"buffer {n}": b for n, b in model.named_buffers()})
    live.update({f"flat shard {i}.{j}": fp for i, h in enumerate(_get_fsdp_handles(model)) for j, fp in enumerate(h.flat_params)})
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in optim.state.items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                live[f"optim state {names[id(p)]}.{k}"] = v
    for i, group in enumerate(optim.param_groups):
        for k, v in group.items():
            for j, t in enumerate(_tensors(v) if k != "params" else []):
                live[f"param_groups[{i}].{k}[{j}]"] = t
    return live


def _span(t: torch.Tensor) -> Tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _overlaps(returned: Any, live: Dict[str, torch.Tensor]) -> List[str]:
    """``returned`` tensors whose storage overlaps a live tensor's storage."""
    spans = {name: _span(t) for name, t in live.items() if t.untyped_storage().nbytes()}
    found = []
    for i, t in enumerate(_tensors(returned)):
        lo, hi = _span(t)
        if hi > lo:
            found += [f"returned tensor #{i} {tuple(t.shape)} {t.dtype} shares memory with {name}"
                      for name, (a, b) in spans.items() if lo < b and a < hi]
    return found


def _all_state_dicts(model: nn.Module, optim: torch.optim.Optimizer) -> Dict[str, Any]:
    """What every public getter returns on this rank (rank0_only ones: rank 0's, the others' are {})."""
    out: Dict[str, Any] = {
        "get_model_state_dict()": get_model_state_dict(model),
        "get_model_state_dict(full=False)": get_model_state_dict(model, full=False),
        "get_model_state_dict(rank0_only=True)": get_model_state_dict(model, rank0_only=True),
        "get_optimizer_state_dict()": get_optimizer_state_dict(model, optim),
        "get_optimizer_state_dict(full=False)": get_optimizer_state_dict(model, optim, full=False),
        "get_optimizer_state_dict(full=False, cpu_offload=True)": get_optimizer_state_dict(model, optim, full=False,
                                                                                           cpu_offload=True),
        "get_model_state_dict(full=False, cpu_offload=True)": get_model_state_dict(model, full=False, cpu_offload=True),
        "get_optimizer_state_dict(rank0_only=True)": get_optimizer_state_dict(model, optim, rank0_only=True),
    }
    with state_dict_type(model, StateDictType.FULL_STATE_DICT):
        out["state_dict() under FULL_STATE_DICT"] = model.state_dict()
    with state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
        out["state_dict() under FULL_STATE_DICT, rank0_only"] = model.state_dict()
    return out


def _no_shared_storage(config: str) -> None:
    """Nothing any getter returns shares storage with a live parameter, buffer, flat shard or
    optimizer state tensor, and a deep copy of it shares storage with neither; a tied-weights
    positive control shows the check sees sharing."""
    model, optim, _ = _trained(config, 2)
    live = _live(model, optim)
    assert any("optim state" in n and n.endswith(".step") for n in live), sorted(live)
    assert any(n.startswith("param_groups[0].lr") for n in live), sorted(live)
    positive = _overlaps({"a": model.head.weight.detach(), "b": optim.state[model.head.weight]["step"]}, live)
    assert len(positive) >= 2, positive  # the check sees a live view and a live step
    for what, returned in _all_state_dicts(model, optim).items():
        if "rank0_only" in what and dist.get_rank() != 0:
            continue  # test_rank0_only_gives_other_ranks_nothing
        assert list(_tensors(returned)), f"{config}: {what} returned no tensor"
        found = _overlaps(returned, live)
        assert not found, f"{config}: {what}:\n" + "\n".join(found)
        # a deep copy (a snapshot kept while training goes on) shares memory with neither
        copied = _overlaps(copy.deepcopy(returned), {**live, **{f"returned #{i}": t for i, t in enumerate(_tensors(returned))}})
        assert not copied, f"{config}: copy.deepcopy of {what}:\n" + "\n".join(copied)


def test_returned_state_dicts_share_no_storage_with_live_state() -> None:
    run_distributed(run_subtests, WORLD_SIZE, _no_shared_storage, {"config": CONFIGS}, timeout=120)


# ---------------------------------------------------------------------------- a copied run (the scenario)
def _copy_run(config: str, form: str) -> None:
    """Train 2 steps, copy model and optimizer into a second, differently initialised pair
    through get_*/set_*, then: the copy holds none of the caller's tensors; stepping only the
    copy leaves the original bit-identical (``step`` included); both then take the same 2
    steps, interleaved, with identical losses, equal to a single-process run's."""
    full = form == "full"
    original, optim, first = _trained(config, 2)
    twin = _wrap(_net(7), config)
    twin_optim = _optimizer(twin)
    twin_optim.param_groups[0]["lr"] = 0.5  # loaded from the state dict below
    sd = get_model_state_dict(original, full=full)
    osd = get_optimizer_state_dict(original, optim, full=full)
    set_model_state_dict(twin, sd)
    set_optimizer_state_dict(twin, twin_optim, osd)
    assert twin_optim.param_groups[0]["lr"] == 0.05
    given = _overlaps({"model": sd, "optim": osd}, _live(twin, twin_optim))
    assert not given, f"{config}/{form}: the loaded copy holds the caller's tensors:\n" + "\n".join(given)

    before = _full_state(original, optim)
    scratch = copy.deepcopy(get_optimizer_state_dict(twin, twin_optim))  # the twin, back after one step
    scratch_model = get_model_state_dict(twin)
    _step(twin, twin_optim, 2, config)
    _assert_same(_full_state(original, optim), before, f"{config}/{form}: the original after stepping only the copy")
    set_model_state_dict(twin, scratch_model)
    set_optimizer_state_dict(twin, twin_optim, scratch)

    losses, twin_losses = [], []
    for s in (2, 3):
        losses.append(_step(original, optim, s, config))
        twin_losses.append(_step(twin, twin_optim, s, config))
    assert twin_losses == losses, f"{config}/{form}: the copy {twin_losses} vs the original {losses}"
    expected = _reference_losses(4)
    torch.testing.assert_close(first + losses, expected, atol=1e-5, rtol=0,
                               msg=lambda m: f"{config}/{form}: against single-process training: {m}")
    _assert_same(_full_state(twin, twin_optim), _full_state(original, optim), f"{config}/{form}: copy vs original")


def _reference_losses(steps: int) -> List[float]:
    model = _net(0)
    optim = _optimizer(model)
    return [_step(model, optim, s) for s in range(steps)]


def _full_state(model: nn.Module, optim: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    """Model and optimizer values, flattened and copied (compared bit for bit)."""
    out = {f"model {k}": v.clone() for k, v in get_model_state_dict(model).items()}
    for fqn, state in get_optimizer_state_dict(model, optim)["state"].items():
        out.update({f"optim {fqn}.{k}": torch.as_tensor(v).clone() for k, v in state.items()})
    return out


def _assert_same(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], what: str) -> None:
    assert list(actual) == list(expected), f"{what}: {list(actual)} != {list(expected)}"
    for key, e in expected.items():
        a = actual[key]
        assert a.dtype == e.dtype and torch.equal(a, e), f"{what}: {key}: {a} != {e}"


def test_copied_run_trains_independently() -> None:
    run_distributed(run_subtests, WORLD_SIZE, _copy_run, {"config": CONFIGS, "form": ["full", "sharded"]}, timeout=180)


# ---------------------------------------------------------------------------- rank0_only
def _rank0_only(config: str) -> None:
    """FULL_STATE_DICT with rank0_only, through state_dict_type + state_dict() and through
    get_model_state_dict / get_optimizer_state_dict: rank 1 gets exactly {} (no buffer), rank
    0 every entry with the exact values of a plain model run the same way."""
    model = _wrap(_net(0), config)
    optim = _optimizer(model)
    reference = _net(0)
    reference_optim = _optimizer(reference)
    for s in range(2):
        _step(model, optim, s, config)
        _step(reference, reference_optim, s)
    with state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
        from_context = model.state_dict()
    results = {"state_dict_type + state_dict()": from_context,
               "get_model_state_dict": get_model_state_dict(model, rank0_only=True),
               "get_model_state_dict(cpu_offload)": get_model_state_dict(model, rank0_only=True, cpu_offload=True)}
    osd = get_optimizer_state_dict(model, optim, rank0_only=True)
    if dist.get_rank() != 0:
        for what, sd in results.items():
            assert len(sd) == 0 and sd == {}, f"{config}: {what} on rank {dist.get_rank()}: {list(sd)}"
        assert osd == {}, f"{config}: get_optimizer_state_dict on rank {dist.get_rank()}: {list(osd)}"
        return
    expected = reference.state_dict()
    for what, sd in results.items():
        assert list(sd) == list(expected), f"{config}: {what}: {list(sd)}"
        for key, e in expected.items():
            a = sd[key]
            assert type(a) is torch.Tensor and a.dtype == e.dtype and a.shape == e.shape, (what, key, a)
            if e.is_floating_point() and "scale" not in key:  # trained: distributed vs one process
                torch.testing.assert_close(a, e, atol=1e-5, rtol=0)
            else:  # buffers: exact (the integer ones and the scale, the same arithmetic everywhere)
                assert torch.equal(a, e), (what, key, a, e)
    names = {id(p): n for n, p in reference.named_parameters()}
    ref_state = {names[id(p)]: s for p, s in reference_optim.state.items()}
    assert sorted(osd["state"]) == sorted(ref_state), sorted(osd["state"])
    for fqn, state in ref_state.items():
        assert sorted(osd["state"][fqn]) == sorted(state), (fqn, sorted(osd["state"][fqn]))
        assert torch.equal(osd["state"][fqn]["step"], state["step"]), (fqn, osd["state"][fqn]["step"], state["step"])
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(osd["state"][fqn][k], state[k], atol=1e-5, rtol=0)


def test_rank0_only_gives_other_ranks_nothing() -> None:
    run_distributed(run_subtests, WORLD_SIZE, _rank0_only, {"config": CONFIGS}, timeout=120)


# ---------------------------------------------------------------------------- names and orders
def _names_and_orders() -> None:
    """Loads that match by name, not by position or by object:

    * a module registered under two names (``model.alias = model.body``, as a weight-tied block or an
      EMA alias is): ``state_dict()`` holds both names' keys, and a strict load of what it returned is
      accepted (a check that enumerated each module once would refuse the alias's keys as unexpected);
    * an optimizer whose group lists the parameters in another order than the one that saved (a
      resumed script building it from ``reversed`` or a dict): each parameter gets its own moments,
      step and all, not its neighbour's."""
    model = _wrap(_net(0), "submodule_and_root")
    model.alias = model.body  # the same module under a second name
    optim = _optimizer(model)
    for step in range(2):
        _step(model, optim, step, "submodule_and_root")
    full = model.state_dict()
    assert {k for k in full if k.startswith("alias.")} == {k.replace("body.", "alias.", 1) for k in full
                                                          if k.startswith("body.")}, sorted(full)
    set_model_state_dict(model, full)  # strict
    assert torch.equal(model.state_dict()["alias.0.weight"], full["body.0.weight"])

    saved = get_optimizer_state_dict(model, optim)
    params = list(model.parameters())
    reordered = torch.optim.AdamW(list(reversed(params)), lr=torch.tensor(0.05), weight_decay=0.01, foreach=False)
    set_optimizer_state_dict(model, reordered, saved)
    names = {id(p): n for n, p in model.named_parameters()}
    for p in params:
        mine, theirs = reordered.state[p], optim.state[p]
        assert sorted(mine) == sorted(theirs), (names[id(p)], sorted(mine), sorted(theirs))
        for key in theirs:
            assert torch.equal(torch.as_tensor(mine[key]), torch.as_tensor(theirs[key])), (names[id(p)], key)


def test_loads_match_by_name_not_by_position() -> None:
    run_distributed(_names_and_orders, WORLD_SIZE, timeout=120)
