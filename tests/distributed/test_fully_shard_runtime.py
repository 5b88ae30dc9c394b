"""fully_shard's runtime: per-rank storage, freeing, prefetch order, mixed dtypes and frozen
parameters, cross-rank checks, recovery from a failed forward, and the FSDPModule methods.

Each figure checked here (elements per rank, collective counts, issue order) is counted by
``_runtime/collectives``' own instrumentation; nothing in torch.distributed is mocked.
"""

from __future__ import annotations

import collections
import math
import warnings
from typing import Any, Callable, Dict, List, Tuple, cast

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import BackwardPrefetch, FSDPModule, ShardingStrategy, clip_grad_norm_, fully_shard, unshard_params
from composable_shard._runtime.collectives import record_collectives
from composable_shard._runtime.traversal import _get_fsdp_handles
from tests._harness import run_distributed, run_subtests
from tests._models import (WIDTH, Block, Named, assert_grads_relative, assert_params_close, batch, full_grads, local_backward,
                           local_rows, loss_fn, make_model, zip_same)

_ALL_STRATEGIES = [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD,
                   ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2]
_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
# Flat parameters of each handle of make_model() under _annotate, counted by hand from
# tests/_models.py: (numel, trainable). Root: the tied embedding/head (13 x 6) and the frozen
# Linear(6, 6); a block: LayerNorm(6) 12 + Linear(6, 7) 49 + Linear(7, 6) 48; scale: 1.
_BLOCK_NUMEL = 2 * WIDTH + (WIDTH * (WIDTH + 1) + WIDTH + 1) + ((WIDTH + 1) * WIDTH + WIDTH)
_HAND_GROUPS: Dict[str, List[Tuple[int, bool]]] = {
    "": [(13 * WIDTH, True), (WIDTH * WIDTH + WIDTH, False)],
    "blocks.0": [(_BLOCK_NUMEL, True)], "blocks.1": [(_BLOCK_NUMEL, True)], "scale": [(1, True)]}


def _chunk(numel: int, world_size: int) -> int:
    """Elements per rank: ceil(numel / world_size)."""
    return -(-numel // world_size)


def _rank_numel(numel: int, world_size: int, rank: int) -> int:
    """Elements of the unpadded flat range that rank ``rank`` holds (the rest is padding)."""
    chunk = _chunk(numel, world_size)
    return max(0, min(numel, (rank + 1) * chunk) - rank * chunk)


def _annotate(model: nn.Module, **kwargs: object) -> None:
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, **kwargs)
    fully_shard(model.scale, **kwargs)  # type: ignore[arg-type]
    fully_shard(model, **kwargs)


# ---------------------------------------------------------------------------- storage
def _storage() -> None:
    world_size = dist.get_world_size()
    model = make_model()
    expected_numels = {  # per handle, per (dtype, requires_grad) group, by hand from the model
        "blocks.0": [12 + 49 + 48], "blocks.1": [12 + 49 + 48], "scale": [1],
        "": [13 * 6, 6 * 6 + 6],  # root: tied emb/head once (trainable) + frozen Linear
    }
    _annotate(model)
    handles = _get_fsdp_handles(model)
    local_backward(model, 0)  # lazy init names handles by their FQN under the root
    assert [h.fqn for h in handles] == ["", "blocks.0", "blocks.1", "scale"], [h.fqn for h in handles]
    root = fully_shard.state(model)  # the root's cache, under API.md's names ("Root")
    cached_states, cached_handles = root._all_fsdp_states, root._all_handles
    assert [s.fqn for s in cached_states] == ["", "blocks.0", "blocks.1", "scale"]
    assert [h.fqn for h in cached_handles] == ["", "blocks.0", "blocks.1", "scale"]
    assert all(s is fully_shard.state(m) for s, m in zip_same(cached_states, [model, *model.blocks, model.scale]))
    model.zero_grad()
    for h in handles:
        numels = [fp._unpadded_unsharded_size.numel() for fp in h.flat_params]
        assert numels == expected_numels[h.fqn], (h.fqn, numels)
        for fp, numel in zip_same(h.flat_params, numels):
            assert fp.numel() == math.ceil(numel / world_size), (h.fqn, fp.numel())
    # What the original parameters (views of this rank's shard) hold: this rank's part of each
    # flat range, worked out from the hand counts, not from the shards themselves.
    rank = dist.get_rank()
    mine = {fqn: [_rank_numel(n, world_size, rank) for n in numels] for fqn, numels in expected_numels.items()}
    assert sum(p.numel() for p in model.parameters()) == sum(sum(v) for v in mine.values())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    local_backward(model, 0)
    optim.step()
    assert root._all_fsdp_states is cached_states and root._all_handles is cached_handles, "rebuilt after lazy init"
    for h in handles:
        assert h.unsharded_storage_freed(), f"{h.fqn}: unsharded storage alive after a FULL_SHARD step"
        for g in h.groups:
            if world_size > 1:
                assert g.padded_unsharded_flat.untyped_storage().size() == 0
    state_numel = sum(t.numel() for s in optim.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    trainable_mine = sum(v[0] for v in mine.values())  # the first group of each handle is the trainable one
    assert state_numel == 2 * trainable_mine, (state_numel, trainable_mine)  # exp_avg + exp_avg_sq, my slice only
    if world_size > 1:
        assert 2 * trainable_mine < 2 * sum(p.numel() for p in make_model().parameters() if p.requires_grad)
    run_subtests(_strategy_memory, {"strategy": _ALL_STRATEGIES})
    if world_size == 4:
        _subgroup_process_group()


def _subgroup_process_group() -> None:
    """fully_shard(process_group=G) shards over G only: with G one of {0, 1}, {2, 3}, each
    rank holds ceil(N/2) elements per flat parameter, not ceil(N/4)."""
    pair, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    model = make_model()
    _annotate(model, process_group=pair)
    local_backward(model, 0)
    rank = dist.get_rank()
    assert dist.get_process_group_ranks(fully_shard.state(model).process_group) == [rank - rank % 2, rank - rank % 2 + 1]
    numels = {h.fqn: [fp.numel() for fp in h.flat_params] for h in _get_fsdp_handles(model)}
    assert numels == {fqn: [_chunk(n, 2) for n, _ in groups] for fqn, groups in _HAND_GROUPS.items()}, numels


def _strategy_setup(strategy: ShardingStrategy) -> Tuple[Dict[str, Any], int, int]:
    """fully_shard kwargs, shard group size, replicate group size. Hybrid: a (replicate, shard)
    mesh of (W/2, 2) where W allows, else (1, W)."""
    world_size = dist.get_world_size()
    if strategy in _HYBRID:
        from torch.distributed.device_mesh import init_device_mesh

        shard = 2 if world_size % 2 == 0 and world_size > 2 else world_size
        mesh = init_device_mesh("cpu", (world_size // shard, shard))
        return {"strategy": strategy, "mesh": mesh}, shard, world_size // shard
    if strategy is ShardingStrategy.NO_SHARD:
        return {"strategy": strategy}, 1, world_size
    return {"strategy": strategy}, world_size, 1


def _unsharded_nbytes(model: nn.Module) -> Dict[str, List[int]]:
    """Per handle, per flat parameter: bytes of unsharded storage held apart from the shard
    (0 if freed; -1 if the unsharded buffer is the shard itself)."""
    out: Dict[str, List[int]] = {}
    for h in _get_fsdp_handles(model):
        sizes = []
        for g in h.groups:
            storage = g.padded_unsharded_flat.untyped_storage()
            aliases = storage.nbytes() > 0 and storage.data_ptr() == g.flat_param.untyped_storage().data_ptr()
            sizes.append(-1 if aliases else storage.nbytes())
        out[h.fqn] = sizes
    return out


def _strategy_memory(strategy: ShardingStrategy) -> None:
    """Which handles hold unsharded parameters between forward and backward and after
    backward, and what each step all-gathers and reduces, per strategy, against figures worked
    out by hand: FULL_SHARD/HYBRID_SHARD free every handle but the root after forward and gather
    it again for backward; SHARD_GRAD_OP/_HYBRID_SHARD_ZERO2 keep every handle from forward to
    backward; everything is freed after backward; a shard group of one rank (NO_SHARD, W=1)
    computes on the shard itself and gathers nothing. Without it a strategy could silently
    behave as another (numbers unchanged, memory or traffic not)."""
    kwargs, shard, replicas = _strategy_setup(strategy)
    keeps_after_forward = strategy in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_model()
    _annotate(model, **kwargs)
    what = f"[{strategy.name}, shard group {shard}, replicas {replicas}]"
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    freed = {fqn: [0] * len(groups) for fqn, groups in _HAND_GROUPS.items()}
    alias = {fqn: [-1] * len(groups) for fqn, groups in _HAND_GROUPS.items()}
    for step in range(2):
        inputs, targets = batch(step, world_size)
        with record_collectives() as forward:
            loss = loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank))
        between = _unsharded_nbytes(model)
        with record_collectives() as backward:
            loss.backward()
        after = _unsharded_nbytes(model)
        optim.step()
        optim.zero_grad()
        where = f"{what} step {step}"
        if shard == 1:
            assert between == alias and after == alias, (where, between, after)
            assert forward.count("all_gather") == backward.count("all_gather") == 0, where
        else:
            held = {fqn: [4 * _chunk(n, shard) * shard if fqn == "" or keeps_after_forward else 0 for n, _ in groups]
                    for fqn, groups in _HAND_GROUPS.items()}
            assert between == held, f"{where}: unsharded bytes between forward and backward {between}, expected {held}"
            assert after == freed, f"{where}: unsharded bytes after backward {after}, expected {freed}"
        gathers_forward = collections.Counter((r.tag, r.nbytes) for r in forward.records if r.kind == "all_gather")
        gathers_backward = collections.Counter((r.tag, r.nbytes) for r in backward.records if r.kind == "all_gather")
        expected_forward = collections.Counter(
            {(fqn, 4 * _chunk(n, shard)): 1 for fqn, groups in _HAND_GROUPS.items() for n, _ in groups} if shard > 1 else {})
        expected_backward = collections.Counter(
            {(fqn, 4 * _chunk(n, shard)): 1 for fqn, groups in _HAND_GROUPS.items() for n, _ in groups
             if fqn != "" and not keeps_after_forward} if shard > 1 else {})
        assert gathers_forward == expected_forward, f"{where}: forward all-gathers {gathers_forward}, expected {expected_forward}"
        assert gathers_backward == expected_backward, f"{where}: backward all-gathers {gathers_backward}, expected {expected_backward}"
        reductions = collections.Counter((r.kind, r.tag, r.nbytes) for r in backward.records
                                         if r.kind in ("reduce_scatter", "all_reduce") and r.tag != "used_params")
        expected_reductions: collections.Counter = collections.Counter()
        for fqn, groups in _HAND_GROUPS.items():
            for n, trainable in groups:
                if trainable and shard > 1:
                    expected_reductions[("reduce_scatter", fqn, 4 * _chunk(n, shard) * shard)] += 1
                if trainable and replicas > 1:
                    expected_reductions[("all_reduce", fqn, 4 * _chunk(n, shard))] += 1
        assert reductions == expected_reductions, f"{where}: reductions {reductions}, expected {expected_reductions}"
    # A forward no backward follows (evaluation under no_grad) frees what it gathered on its way, in
    # every strategy and the root too: nothing will need the unsharded parameters before the next
    # forward gathers them again.
    with torch.no_grad(), record_collectives() as evaluation:
        model(local_rows(batch(2, world_size)[0], rank))
    after_evaluation = _unsharded_nbytes(model)
    assert after_evaluation == (alias if shard == 1 else freed), \
        f"{what}: unsharded bytes after a forward under no_grad {after_evaluation}, expected none kept"
    assert evaluation.count("all_gather") == (sum(len(g) for g in _HAND_GROUPS.values()) if shard > 1 else 0), what
    if strategy in _HYBRID:  # a (replicate, shard) mesh over arange(W): my shard group is my row
        row = rank // shard
        state = fully_shard.state(model)
        assert dist.get_process_group_ranks(state.process_group) == list(range(row * shard, (row + 1) * shard)), what
        assert state.replicate_group is None or \
            dist.get_process_group_ranks(state.replicate_group) == list(range(rank % shard, world_size, shard)), what
    shard_numels = {h.fqn: [fp.numel() for fp in h.flat_params] for h in _get_fsdp_handles(model)}
    expected_numels = {fqn: [_chunk(n, shard) for n, _ in groups] for fqn, groups in _HAND_GROUPS.items()}
    assert shard_numels == expected_numels, f"{what}: shard numels {shard_numels}, expected {expected_numels}"


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_storage_per_rank_and_freeing(world_size: int) -> None:
    """Each handle stores ceil(N/W) elements per group; unsharded storage is freed after a
    FULL_SHARD step; optimizer state is sized by this rank's part of the hand-counted flat
    ranges. Per strategy: which handles hold unsharded storage between forward and backward and
    after backward, and the all-gathers and reductions of each step (counts and bytes)."""
    run_distributed(_storage, world_size, timeout=120)


# ---------------------------------------------------------------------------- prefetch order
def _prefetch_order(strategy: ShardingStrategy, forward_prefetch: bool, backward_prefetch: object) -> None:
    """Issue order of the second step's all-gathers relative to the hooks, and every collective
    of the step counted against figures worked out by hand (W=2)."""
    kwargs: Dict[str, Any] = {"strategy": strategy, "forward_prefetch": forward_prefetch,
                              "backward_prefetch": backward_prefetch}
    if strategy in _HYBRID:
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["mesh"] = init_device_mesh("cpu", (1, dist.get_world_size()))
    keeps_after_forward = strategy in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2)
    model = make_model(num_blocks=3)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    from composable_shard._runtime.collectives import trace

    for i, block in enumerate(model.blocks):  # appended after fully_shard's prepended pre-hook
        block.register_forward_pre_hook(lambda m, a, i=i: trace("compute", f"blocks.{i}"))
    local_backward(model, 0)  # iteration 1 records the order
    model.zero_grad()
    with record_collectives() as rec:
        local_backward(model, 1)
    events = rec.events
    what = f"[{strategy.name}/forward_prefetch={forward_prefetch}/{backward_prefetch}]"

    def at(kind: str, name: str, tag: str) -> int:
        return events.index((kind, name, tag))

    for i in range(2):  # blocks.i and blocks.i+1
        gather_next = at("collective", "all_gather", f"blocks.{i + 1}")
        if forward_prefetch:  # by blocks.i, the handle just before it (not earlier: two ahead would be one too many)
            assert at("trace", "pre_forward", f"blocks.{i}") < gather_next < at("trace", "compute", f"blocks.{i}"), \
                (what, events)
        else:
            assert gather_next > at("trace", "post_forward", f"blocks.{i}"), (what, events)
    first_backward = at("trace", "pre_backward", "")
    if keeps_after_forward:  # nothing to gather in backward
        assert not [e for e in events[first_backward:] if e[1] == "all_gather"], (what, events)
    for i in ((2, 1) if not keeps_after_forward else ()):  # backward runs blocks.2, blocks.1, blocks.0
        start = at("trace", "pre_backward", f"blocks.{i}")
        end = at("trace", "post_backward", f"blocks.{i}")
        next_start = at("trace", "pre_backward", f"blocks.{i - 1}")
        gathers = [k for k, e in enumerate(events) if e == ("collective", "all_gather", f"blocks.{i - 1}") and k > start]
        assert len(gathers) == 1, (what, events)
        if backward_prefetch is BackwardPrefetch.BACKWARD_PRE:  # before blocks.i computes its gradients
            assert start < gathers[0] < end, (f"{what} prefetch not issued during blocks.{i}'s backward", events)
        elif backward_prefetch is BackwardPrefetch.BACKWARD_POST:  # once blocks.i's gradients are reduced
            assert end < gathers[0] < next_start, (f"{what} prefetch not issued after blocks.{i}'s backward", events)
        else:  # only when blocks.(i-1)'s own backward starts
            assert gathers[0] > next_start, (what, events)
    # Counted by hand (W=2): the root owns the tied emb/head (78) + scale (1) trainable and the
    # frozen Linear (42): 40 and 21 elements per rank; a block 109: 55 per rank. The root's
    # flat parameters are gathered once per step (kept from its forward to its backward), a
    # block's twice (once if its strategy keeps it from forward to backward); one reduce-scatter
    # per trainable flat parameter of padded size; the frozen one is never reduced.
    per_block = 1 if keeps_after_forward else 2
    expected_gathers = collections.Counter({("", 4 * 40): 1, ("", 4 * 21): 1})
    expected_reduces = collections.Counter({("", 4 * 80): 1})
    for i in range(3):
        expected_gathers[(f"blocks.{i}", 4 * 55)] = per_block
        expected_reduces[(f"blocks.{i}", 4 * 110)] = 1
    gathers_seen = collections.Counter((r.tag, r.nbytes) for r in rec.records if r.kind == "all_gather")
    reduces_seen = collections.Counter((r.tag, r.nbytes) for r in rec.records if r.kind == "reduce_scatter")
    assert gathers_seen == expected_gathers, (what, gathers_seen, expected_gathers)
    assert reduces_seen == expected_reduces, (what, reduces_seen, expected_reduces)
    # Plus one small all-reduce agreeing on which parameters got a gradient on some rank: one
    # int32 per trainable original parameter (3 blocks x 6, scale 1, tied emb/head 1), and two
    # agreeing on the optimizer steps.
    used = [r for r in rec.records if r.kind == "all_reduce"]
    assert [(r.tag, r.nbytes) for r in used] == [("used_params", 4 * (3 * 6 + 1 + 1 + 2))], (what, used)
    assert {r.kind for r in rec.records} == {"all_gather", "reduce_scatter", "all_reduce"}, (what, rec.records)


def _prefetch_grid() -> None:
    run_subtests(_prefetch_order, {"strategy": [ShardingStrategy.FULL_SHARD], "forward_prefetch": [True, False],
                                   "backward_prefetch": [BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST,
                                                         None]})
    # Forward prefetch under the other strategies that gather (NO_SHARD gathers nothing).
    run_subtests(_prefetch_order, {"strategy": [ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.HYBRID_SHARD,
                                                ShardingStrategy._HYBRID_SHARD_ZERO2],
                                   "forward_prefetch": [True], "backward_prefetch": [BackwardPrefetch.BACKWARD_PRE]})


def _gathers_in_flight() -> None:
    """At every block's compute and at the start of every block's backward, at most two blocks
    hold gathered (unsharded) storage: the current one and the one prefetched; and two do at
    some point, so prefetch is on and the bound is what is checked."""
    model = make_model(num_blocks=4)
    for block in model.blocks:
        fully_shard(block)  # forward_prefetch=True, BACKWARD_PRE, limit_all_gathers=True: the defaults
    fully_shard(model)
    handles = [_get_fsdp_handles(block)[0] for block in model.blocks]
    seen: List[Tuple[str, int]] = []

    def count(where: str) -> None:
        seen.append((where, sum(not h.unsharded_storage_freed() for h in handles)))

    def on_output(module: nn.Module, args: Any, output: torch.Tensor, i: int = 0) -> None:
        if output.requires_grad:  # runs after fully_shard's pre-backward hook on the same output
            output.register_hook(lambda grad, i=i: count(f"backward blocks.{i}"))

    for i, block in enumerate(model.blocks):  # both run after fully_shard's own hooks
        block.register_forward_pre_hook(lambda m, a, i=i: count(f"compute blocks.{i}"))
        block.register_forward_hook(lambda m, a, o, i=i: on_output(m, a, o, i))
    for step in range(2):  # the first iteration records the order; the second prefetches by it
        seen.clear()
        local_backward(model, step)
        model.zero_grad()
    assert max(n for _, n in seen) == 2, seen
    assert [n for w, n in seen if w.startswith("compute")][:3] == [2, 2, 2], seen  # blocks.3 has none to prefetch
    assert sum(w.startswith("backward") for w, _ in seen) == 4, seen


class Skipping(nn.Module):
    """Three blocks; ``skip`` names one the forward leaves out (data-dependent control flow)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block(), Block()])
        self.skip = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i != self.skip:
                x = block(x)
        return x


def _skipped_block_released() -> None:
    """Forward prefetch gathers blocks.1 (the first iteration's order) while blocks.0 computes;
    the forward then skips it. By the end of that forward its storage is freed, and every
    gradient equals the unsharded model's on the same batch."""
    torch.manual_seed(0)
    local = Skipping()
    model = Skipping()
    model.load_state_dict(local.state_dict())
    for block in model.blocks:
        fully_shard(block, forward_prefetch=True)
    fully_shard(model, forward_prefetch=True)
    handles = [_get_fsdp_handles(block)[0] for block in model.blocks]
    held_after_forward: List[List[bool]] = []
    model.register_forward_hook(lambda m, a, o: held_after_forward.append(
        [not h.unsharded_storage_freed() for h in handles]))  # runs after fully_shard's post-forward
    x = torch.randn(4, WIDTH)  # the same batch on every rank: the unsharded model is the reference
    for step, skip in enumerate((-1, 1)):
        model.skip = local.skip = skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # step 2 changes the order: warned about, tested elsewhere
            model(x).pow(2).sum().backward()
        local(x).pow(2).sum().backward()
        assert held_after_forward[step] == [False, False, False], (step, held_after_forward)
        got = dict(full_grads(model))
        assert "blocks.1.fc1.weight" not in got or step == 0
        for name, p in local.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(got[name], p.grad, atol=1e-5, rtol=1e-5, msg=f"{name} at step {step}")
        model.zero_grad()
        local.zero_grad()


# ---------------------------------------------------------------------------- a module called twice
class Reused(nn.Module):
    """blocks.0 runs twice per forward (before and after blocks.1): weights shared across two
    places of the network, the pattern of ALBERT-style layer sharing or a looped block."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks[0](self.blocks[1](self.blocks[0](x))))


def _called_twice(strategy: ShardingStrategy, forward_prefetch: bool) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = Reused()
    torch.manual_seed(0)
    model = Reused()
    for block in model.blocks:
        fully_shard(block, strategy=strategy, forward_prefetch=forward_prefetch)
    fully_shard(model, strategy=strategy, forward_prefetch=forward_prefetch)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(world_size * 2, WIDTH, generator=torch.Generator().manual_seed(step))
        reference(x).pow(2).mean().backward()
        expected: Named = [(n, p.grad.detach().clone()) for n, p in reference.named_parameters()]
        opt_ref.step()
        opt_ref.zero_grad()
        with warnings.catch_warnings(record=True) as caught, record_collectives() as rec:
            warnings.simplefilter("always")
            model(x[rank * 2:(rank + 1) * 2]).pow(2).mean().backward()
        # The same order every step: no "forward order changed" warning (it used to fire from
        # step 2 on, counting blocks.0's second call as a change).
        assert not [w for w in caught if "order" in str(w.message)], [str(w.message) for w in caught]
        # Forward prefetch fires at a handle's first call only: blocks.0's second call used to
        # prefetch blocks.1, whose forward had already run, gathering it again in the forward
        # and holding it unsharded until its backward.
        forward = rec.events[:rec.events.index(("trace", "post_forward", ""))]
        gathers = collections.Counter(tag for kind, name, tag in forward if name == "all_gather")
        expected_gathers = {  # FULL_SHARD frees blocks.0 after its first call; SHARD_GRAD_OP keeps it
            ShardingStrategy.FULL_SHARD: {"": 1, "blocks.0": 2, "blocks.1": 1},
            ShardingStrategy.SHARD_GRAD_OP: {"": 1, "blocks.0": 1, "blocks.1": 1},
            ShardingStrategy.NO_SHARD: {}}[strategy]
        assert gathers == collections.Counter(expected_gathers), (step, gathers, expected_gathers)
        if forward_prefetch and step > 0 and strategy is not ShardingStrategy.NO_SHARD:  # it prefetches, at the first call
            first_done = forward.index(("trace", "post_forward", "blocks.0"))
            assert ("collective", "all_gather", "blocks.1") in forward[:first_done], (step, forward)
        # Both calls' gradients reach blocks.0, reduced once, averaged over ranks.
        assert_params_close(full_grads(model), expected, what=f"step {step} grads")
        opt.step()
        opt.zero_grad()


def _views_kept_for_backward(strategy: ShardingStrategy) -> None:
    """[Note: Kept views]: at every step a block's backward computes on the very view objects its
    forward made (no split made again; FULL_SHARD frees and gathers the storage in between), the
    root's too (kept storage), and the end of backward drops them; gradients equal local training."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, reference = make_model(), make_model()
    for block in model.blocks:
        fully_shard(block, strategy=strategy)
    fully_shard(model, strategy=strategy)
    seen: List[Tuple[str, str, torch.Tensor]] = []

    def watch(name: str, module: nn.Module) -> None:
        def forward_hook(m: nn.Module, args: Any, out: torch.Tensor) -> None:
            seen.append((name, "forward", m.weight))
            out.register_hook(lambda grad: seen.append((name, "backward", m.weight)) and None)  # type: ignore[func-returns-value]
        module.register_forward_hook(forward_hook)

    watch("blocks.0", model.blocks[0].fc1)
    watch("blocks.1", model.blocks[1].fc2)
    watch("", model.frozen)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        seen.clear()
        local_backward(model, step)
        inputs, targets = batch(step, world_size)
        loss_fn(reference(inputs), targets).backward()
        assert_params_close(full_grads(model), [(n, p.grad) for n, p in reference.named_parameters() if p.grad is not None],
                            1e-5, f"{strategy.name} step {step} grads")
        for name in ("blocks.0", "blocks.1", ""):
            forward = [w for n, when, w in seen if n == name and when == "forward"]
            backward = [w for n, when, w in seen if n == name and when == "backward"]
            assert len(forward) == 1 and not isinstance(forward[0], nn.Parameter), (name, seen)
            assert len(backward) == 1 and backward[0] is forward[0], f"{strategy.name} {name!r}: new views in backward"
        for handle in _get_fsdp_handles(model):
            assert all(g.kept_views is None for g in handle.groups), f"{handle.fqn!r} kept its views after backward"
        for o in (optim, ref_optim):
            o.step()
            o.zero_grad()


_PREFETCH_CASES: Dict[str, Callable[[], None]] = {"issue order": _prefetch_grid, "at most two gathered": _gathers_in_flight,
                   "views kept for backward": lambda: run_subtests(_views_kept_for_backward, {
                       "strategy": [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP]}),
                   "skipped block released": _skipped_block_released,
                   "module called twice": lambda: run_subtests(_called_twice, {
                       "strategy": [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD],
                       "forward_prefetch": [False, True]})}


def _prefetch_case(case: str) -> None:
    _PREFETCH_CASES[case]()


def test_prefetch_order_limit_and_release() -> None:
    """At 2 ranks, in one process group (each failure names its case):

    issue order: forward_prefetch: handle i+1's all-gather is issued before handle i's forward
    compute (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, _HYBRID_SHARD_ZERO2); without it, only
    after handle i's forward. BACKWARD_PRE: handle i-1's all-gather is issued during handle i's
    backward; BACKWARD_POST: after handle i's post-backward and before handle i-1's backward
    starts; None: only when handle i-1's backward starts. Every all-gather and reduce-scatter of
    the step counted with its bytes against hand-worked figures (a block kept from forward to
    backward is gathered once).

    at most two gathered: limit_all_gathers (always on): no more than two blocks' all-gathers
    in flight, in forward and in backward, with forward and backward prefetch on.

    skipped block released: [Note: Prefetched but not run]: a block that forward prefetch
    gathered and the forward skipped does not hold its unsharded parameters through the
    backward.

    views kept for backward: [Note: Kept views] (FULL_SHARD, SHARD_GRAD_OP): a block's and the root's
    backward computes on the view objects their forward made, none are left after the backward,
    gradients equal local training at each of two steps.

    module called twice: a fully sharded block called twice in each forward (FULL_SHARD,
    SHARD_GRAD_OP, NO_SHARD, with and without forward prefetch): gradients equal local training
    at every step, no order-change warning, and forward prefetch fetches blocks.1 at blocks.0's
    first call, never again at its second (blocks.1's forward has run by then)."""
    run_distributed(run_subtests, 2, _prefetch_case, {"case": list(_PREFETCH_CASES)}, timeout=240)


# ---------------------------------------------------------------------------- mixed dtypes / frozen
class MixedBlock(nn.Module):
    """fp32 Linear, a bf16 gain, and a frozen fp32 bias vector in one fully sharded module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.gain = nn.Parameter(torch.full((6,), 0.75, dtype=torch.bfloat16))
        self.offset = nn.Parameter(torch.linspace(-1, 1, 6), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.gain.float() + self.offset


def _mixed_dtypes() -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = nn.Sequential(MixedBlock(), nn.Linear(6, 3))
    torch.manual_seed(0)
    model = nn.Sequential(MixedBlock(), nn.Linear(6, 3))
    fully_shard(model[0])
    fully_shard(model)
    handle = _get_fsdp_handles(model[0])[0]
    # Groups in first-seen .named_modules() order: MixedBlock's own gain, offset, then fc.
    assert [(fp.dtype, fp.requires_grad) for fp in handle.flat_params] == [
        (torch.bfloat16, True), (torch.float32, False), (torch.float32, True)]
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(world_size * 2, 6, generator=g)
        reference(x).pow(2).mean().backward()
        expected: Named = [(n, p.grad.detach().clone()) for n, p in reference.named_parameters() if p.grad is not None]
        opt_ref.step()
        opt_ref.zero_grad()
        with record_collectives() as rec:
            model(x[rank * 2:(rank + 1) * 2]).pow(2).mean().backward()
        assert model[0].offset.grad is None
        tags = [r.tag for r in rec.records if r.kind == "reduce_scatter"]
        assert tags.count("0") == 2, tags  # fp32 and bf16 groups; the frozen group is never reduced
        # Every gradient, not only the SGD result: fp32 ones exactly; the bf16 gain's (computed and
        # reduced in bf16 on other row splits) within 2% of its largest element, which a gradient
        # off by 1.5x misses by 25x.
        grads = full_grads(model)
        assert [n for n, _ in grads] == [n for n, _ in expected], (grads, expected)
        low = [i for i, (_, e) in enumerate(expected) if e.dtype == torch.bfloat16]
        assert [expected[i][0] for i in low] == ["0.gain"], expected
        assert_grads_relative([grads[i] for i in low], [expected[i] for i in low], rtol=0.02, what=f"step {step}")
        assert_params_close([g for i, g in enumerate(grads) if i not in low],
                            [e for i, e in enumerate(expected) if i not in low], what=f"step {step} grads")
        opt.step()
        opt.zero_grad()
    with unshard_params(model):
        for (name, p), (_, q) in zip_same(list(model.named_parameters()), list(reference.named_parameters())):
            atol = 2 ** -6 if p.dtype == torch.bfloat16 else 1e-5  # bf16: 2 ulps at |p| in [0.5, 1)
            assert p.dtype == q.dtype and torch.allclose(p.float(), q.float(), atol=atol), (name, (p.float() - q.float()).abs().max())
    assert handle.groups[1].padded_unsharded_flat.grad is None


def test_mixed_dtypes_and_frozen_in_one_module() -> None:
    """fp32 + bf16 + frozen parameters in one fully sharded module: three flat parameters,
    parity with local training, and the frozen group is never reduced and has no .grad. At 2
    ranks: grouping by dtype is rank-local and the shard arithmetic is dtype-blind (uneven
    shards at 4 ranks: test_storage_per_rank_and_freeing)."""
    run_distributed(_mixed_dtypes, 2, timeout=120)


# ---------------------------------------------------------------------------- cross-rank mismatch
def _mismatch() -> None:
    torch.manual_seed(0)
    width = 6 if dist.get_rank() == 0 else 7
    model = nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2))
    fully_shard(model)
    model(torch.randn(2, 4))


def test_ranks_disagreeing_on_shapes_fail_at_lazy_init() -> None:
    """A rank that built a different model raises at lazy init naming the parameter instead of
    hanging in a mismatched all-gather."""
    with pytest.raises(AssertionError, match=r"parameter '0.weight' \[6, 4\] here vs '0.weight' \[7, 4\] there"):
        run_distributed(_mismatch, 2, timeout=60)


# ---------------------------------------------------------------------------- failed forward
class Flaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if self.fail:
            raise ValueError("user error in forward")
        return y


def _flaky_models() -> Tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    """(reference, fully sharded model, global batch, this rank's rows), same init."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = nn.Sequential(Flaky(), nn.Linear(6, 2))
    torch.manual_seed(0)
    model = nn.Sequential(Flaky(), nn.Linear(6, 2))
    fully_shard(model[0])
    fully_shard(model)
    x = torch.randn(world_size * 2, 6)
    return reference, model, x, x[rank * 2:(rank + 1) * 2]


def _check_next_step_matches(reference: nn.Module, model: nn.Module, x: torch.Tensor, local_x: torch.Tensor,
                             what: str) -> None:
    model(local_x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    with unshard_params(model, with_grads=True):
        grads = [(n, p.grad.clone()) for n, p in model.named_parameters()]
    assert_params_close(grads, [(n, p.grad) for n, p in reference.named_parameters()], what=what)
    assert all(h.unsharded_storage_freed() for h in _get_fsdp_handles(model))


def _exception_in_forward() -> None:
    reference, model, x, local_x = _flaky_models()
    model[0].fail = True
    try:
        model(local_x)
    except ValueError:
        pass
    else:
        raise AssertionError("forward should have raised")
    model[0].fail = False
    _check_next_step_matches(reference, model, x, local_x, "after failed forward")


def _exception_in_backward() -> None:
    reference, model, x, local_x = _flaky_models()

    def explode(grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("user error in backward")

    out = model(local_x)
    out.register_hook(explode)  # raises after the root's pre-backward queued the end-of-backward step
    try:
        out.pow(2).mean().backward()
    except (ValueError, RuntimeError) as e:
        assert "user error in backward" in str(e), e
    else:
        raise AssertionError("backward should have raised")
    model.zero_grad()
    _check_next_step_matches(reference, model, x, local_x, "after failed backward")


def _exceptions() -> None:
    _exception_in_forward()
    dist.barrier()
    _exception_in_backward()


def test_exception_in_forward_or_backward_leaves_model_usable() -> None:
    """A forward that raises leaves handles mid-forward, a backward that raises leaves its
    end-of-backward step unrun; the next step recovers and its gradients equal local training."""
    run_distributed(_exceptions, 2, timeout=60)


# ---------------------------------------------------------------------------- FSDPModule methods
def _no_sync_accumulation(how: str) -> None:
    """Unsynced micro-batches through ``set_requires_gradient_sync(False)`` or FSDP1's ``with
    model.no_sync():``, which puts back each module's own setting (a child set off before it
    stays off after it; the others sync again)."""
    world_size = dist.get_world_size()
    reference = make_model()
    expected = [(n, g) for n, g in _accumulated_reference(reference, world_size)]
    model = make_model()
    _annotate(model)
    with record_collectives() as rec:
        if how == "no_sync":
            model.blocks[1].set_requires_gradient_sync(False, recurse=False)
            with model.no_sync():
                for step in range(3):
                    local_backward(model, step)
        else:
            model.set_requires_gradient_sync(False)
            for step in range(3):
                local_backward(model, step)
    # Parameters are still all-gathered (FULL_SHARD); no gradient is communicated.
    reductions = [r for r in rec.records if r.kind in ("reduce_scatter", "all_reduce")]
    assert not reductions, f"gradients communicated during unsynced micro-batches: {reductions}"
    if how == "no_sync":  # the flags it found: blocks.1 off, the others on
        assert [m._fsdp_state().sync_gradients for m in (model, model.blocks[0], model.blocks[1], model.scale)] == [
            True, True, False, True]
    model.set_requires_gradient_sync(True)
    local_backward(model, 3)
    with unshard_params(model, with_grads=True):
        grads = [(n, p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None]
    assert_params_close(grads, expected, what="no_sync accumulation")
    model.set_requires_gradient_sync(False, recurse=False)  # the root only: its children still sync
    with record_collectives() as rec:
        local_backward(model, 4)
    reduced = sorted(r.tag for r in rec.records if r.kind == "reduce_scatter")
    assert reduced == ["blocks.0", "blocks.1", "scale"], reduced


def _unsynced_grads_visible(strategy: ShardingStrategy, user_action: str) -> None:
    """Between unsynced backwards each parameter's .grad is this rank's full-shape local
    gradient sum (a view of the kept unreduced gradient, as torch FSDP with use_orig_params
    gives), equal to a local model's after the same micro-batches on this rank's rows; a
    frozen parameter keeps None. What the user does to those views counts, as it would locally:
    scaled in place, zero_grad() mid-accumulation, or a tensor assigned in place of the sum
    (taken where parameters are whole: NO_SHARD; refused on a real shard, see
    ``_replaced_sum_refused``). The synced backward then gives sharded views again, equal to the
    local sum over all ranks' rows."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local, everyone = make_model(), make_model()
    model = make_model()
    _annotate(model, strategy=strategy, **_hybrid_mesh(strategy))
    model.set_requires_gradient_sync(False)
    for step in range(3):
        inputs, targets = batch(step, world_size)
        loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank)).backward()
        loss_fn(local(local_rows(inputs, rank)), local_rows(targets, rank)).backward()
        for r in range(world_size):  # what the synced reduction must give: every rank's rows, averaged
            (loss_fn(everyone(local_rows(inputs, r)), local_rows(targets, r)) / world_size).backward()
        for (name, p), (_, q) in zip_same(list(model.named_parameters()), list(local.named_parameters())):
            assert (p.grad is None) == (q.grad is None), f"[{strategy.name}] step {step} {name}: grad {p.grad is None}"
            if q.grad is not None:
                assert p.grad.shape == q.shape, f"[{strategy.name}] {name}: .grad shape {tuple(p.grad.shape)}"
                torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0, msg=f"[{strategy.name}] step {step} {name}")
        if step == 0 and user_action == "none":
            with pytest.raises(RuntimeError, match="already is this rank's full-shape accumulated local gradient"):
                with unshard_params(model, with_grads=True):
                    pass
            with pytest.raises(RuntimeError, match="clip_grad_norm_ between backwards without gradient sync"):
                clip_grad_norm_(model, 1.0)
        if step == 1 and user_action == "scale":
            for m in (model, local):
                for p in m.parameters():
                    if p.grad is not None:
                        p.grad.mul_(0.5)
            for r_p in everyone.parameters():  # each rank scaled its own part of the sum
                if r_p.grad is not None:
                    r_p.grad.mul_(0.5)
        if step == 1 and user_action == "zero_grad":
            for m in (model, local, everyone):
                m.zero_grad()
        if step == 1 and user_action == "assign":  # a tensor of the user's in place of each sum
            if strategy is not ShardingStrategy.NO_SHARD:  # a slice cannot hold the sum: refused, on every rank
                for q in (model.blocks[1].parameters() if strategy is ShardingStrategy.FULL_SHARD  # later handles
                          else model.parameters()):
                    if q.grad is not None:
                        q.grad = torch.full_like(q, 0.25)
                _replaced_sum_refused(model, strategy)
                return
            for m in (model, local, everyone):  # everyone: every rank's sum replaced alike, so their average is it
                for q in m.parameters():
                    if q.grad is not None:
                        q.grad = torch.full_like(q, 0.25)
    model.set_requires_gradient_sync(True)
    inputs, targets = batch(3, world_size)
    loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank)).backward()
    for r in range(world_size):
        (loss_fn(everyone(local_rows(inputs, r)), local_rows(targets, r)) / world_size).backward()
    for p in model.parameters():
        assert p.grad is None or p.grad.shape == p.shape, "synced .grad is not the sharded view"
    with unshard_params(model, with_grads=True):
        grads = [(n, p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None]
    expected = [(n, p.grad) for n, p in everyone.named_parameters() if p.grad is not None]
    assert_params_close(grads, expected, what=f"[{strategy.name}/{user_action}] synced after unsynced")


def _replaced_sum_refused(model: nn.Module, strategy: ShardingStrategy) -> None:
    """The backward after ``.grad`` was replaced by a tensor of the parameter's (sharded) shape
    between unsynced backwards raises on every rank, naming a parameter and what to do, also on
    a rank that holds a replaced 1-D parameter whole (where the tensor happens to have the full
    shape: taking it there would leave that rank in the reduction the others never reach); so
    does ``reduce_accumulated_gradients()`` (FULL_SHARD, blocks.1's sums replaced: the handles before
    it in order have their reductions issued by then; what a pipelining schedule calls). The
    next synced step then gives exactly the average of its own rows' gradients (the unsynced sums
    dropped, nothing left in flight: a reduction issued before the refused group and finished at
    the next backward would add itself to that step's gradients)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    inputs, targets = batch(2, world_size)
    refused = r"was replaced by a tensor of your own between backwards with gradient sync off.*\.grad to None"
    if strategy is ShardingStrategy.FULL_SHARD:
        with pytest.raises(RuntimeError, match=refused):
            cast(FSDPModule, model).reduce_accumulated_gradients()
    else:
        with pytest.raises(RuntimeError, match=refused):
            loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank)).backward()
    model.zero_grad(set_to_none=True)
    model.set_requires_gradient_sync(True)
    fresh = make_model()  # no optimizer stepped: the same parameters
    inputs, targets = batch(3, world_size)
    loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank)).backward()
    for r in range(world_size):
        (loss_fn(fresh(local_rows(inputs, r)), local_rows(targets, r)) / world_size).backward()
    with unshard_params(model, with_grads=True):
        grads = [(n, p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None]
    expected = [(n, p.grad) for n, p in fresh.named_parameters() if p.grad is not None]
    assert_params_close(grads, expected, what=f"[{strategy.name}] the synced step after a refused replacement")


def _earlier_grads_through_unsynced(action: str) -> None:
    """A synced backward left its gradients (no zero_grad), then two unsynced backwards, then a
    synced one. ``kept``: the earlier gradients are added at the end, as locally. ``zero_grad``:
    a ``zero_grad()`` after the first unsynced backward drops them and that backward's part for
    good. Each against every rank's rows, averaged."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    everyone, model = make_model(), make_model()
    _annotate(model)
    for step in range(4):  # synced, unsynced, unsynced, synced
        model.set_requires_gradient_sync(step in (0, 3))
        inputs, targets = batch(step, world_size)
        loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank)).backward()
        for r in range(world_size):
            (loss_fn(everyone(local_rows(inputs, r)), local_rows(targets, r)) / world_size).backward()
        if step == 1 and action == "zero_grad":
            model.zero_grad()
            everyone.zero_grad()
    with unshard_params(model, with_grads=True):
        grads = [(n, p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None]
    expected = [(n, p.grad) for n, p in everyone.named_parameters() if p.grad is not None]
    assert_params_close(grads, expected, what=f"earlier gradients through unsynced backwards ({action})")


def _hybrid_mesh(strategy: ShardingStrategy) -> dict:
    if strategy is not ShardingStrategy.HYBRID_SHARD:
        return {}
    from torch.distributed.device_mesh import init_device_mesh

    world_size = dist.get_world_size()
    return {"mesh": init_device_mesh("cpu", (world_size // 2, 2))}


def _clip_refused_in_every_handle_with_a_frozen_group() -> None:
    """``clip_grad_norm_`` between unsynced backwards is refused also when every handle holds a
    frozen parameter (each block's ``fc2.bias``, the scale's gain, the root's frozen Linear): one
    parameter of a handle showing its local sum is enough for a norm of each rank's own sums.
    Refused only where every parameter showed one, such a model was clipped by a norm no single
    process computes, silently."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_model()
    for frozen in (model.blocks[0].fc2.bias, model.blocks[1].fc2.bias, model.scale.gain):
        frozen.requires_grad_(False)
    _annotate(model)
    cast(FSDPModule, model).set_requires_gradient_sync(False)
    inputs, targets = batch(0, world_size)
    loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank)).backward()
    with pytest.raises(RuntimeError, match="clip_grad_norm_ between backwards without gradient sync"):
        clip_grad_norm_(model, 1.0)


def _unsynced_grid() -> None:
    strategies = [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD]
    if dist.get_world_size() == 4:  # what 4 ranks add: a real (2 x 2) hybrid mesh; 2 ranks run the others
        strategies = [ShardingStrategy.HYBRID_SHARD]
    run_subtests(_unsynced_grads_visible, {"strategy": strategies,
                                           "user_action": ["none", "scale", "zero_grad", "assign"]})
    if dist.get_world_size() == 2:
        run_subtests(_earlier_grads_through_unsynced, {"action": ["kept", "zero_grad"]})
        _clip_refused_in_every_handle_with_a_frozen_group()


@pytest.mark.parametrize("world_size", [2, 4])
def test_unsynced_grads_are_full_local_sums(world_size: int) -> None:
    """See ``_unsynced_grads_visible``: FULL_SHARD, SHARD_GRAD_OP and NO_SHARD at 2 ranks,
    HYBRID_SHARD on a 2 x 2 mesh at 4."""
    run_distributed(_unsynced_grid, world_size, timeout=240)


def _accumulated_reference(model: nn.Module, world_size: int, steps: int = 4) -> List[Tuple[str, torch.Tensor]]:
    for step in range(steps):
        inputs, targets = batch(step, world_size)
        loss_fn(model(inputs), targets).backward()
    return [(n, p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None]


def _methods() -> None:
    model = make_model()
    _annotate(model)
    block = model.blocks[0]
    handle = _get_fsdp_handles(block)[0]
    with record_collectives() as first:
        block.unshard()
    with record_collectives() as second:
        block.unshard()  # idempotent
    assert not handle.needs_unshard()
    assert first.count("all_gather") == (1 if dist.get_world_size() > 1 else 0) and second.count() == 0
    block.reshard()
    block.reshard()
    assert handle.unsharded_storage_freed() or dist.get_world_size() == 1
    model.set_reshard_after_backward(False)
    local_backward(model, 0)
    if dist.get_world_size() > 1:
        assert not handle.unsharded_storage_freed(), "reshard_after_backward=False must keep parameters unsharded"
    with unshard_params(model, writeback=True):
        pass
    assert handle.unsharded_storage_freed(), "a written-back shard must not leave a stale unsharded buffer"
    model.set_reshard_after_backward(True)
    model.zero_grad()
    handle.unshard()  # the handle-level API: full-shape views installed in the module
    assert block.fc1.weight.shape == (7, 6) and not handle.needs_unshard()
    handle.reshard()
    assert block.fc1.weight.dim() == 1 and (handle.unsharded_storage_freed() or dist.get_world_size() == 1)
    model.set_reshard_after_backward(False, recurse=False)  # the root only
    local_backward(model, 1)
    if dist.get_world_size() > 1:
        kept = {h.fqn: not h.unsharded_storage_freed() for h in _get_fsdp_handles(model)}
        assert kept == {"": True, "blocks.0": False, "blocks.1": False, "scale": False}, kept
    model.reshard()
    for m in model.blocks:
        m.reshard()
    assert all(h.unsharded_storage_freed() for h in _get_fsdp_handles(model))


class _DataSGD(torch.optim.Optimizer):
    """SGD written as older optimizers are, on ``p.data``: its updates leave the parameters'
    version counters unchanged, so only the optimizer's step itself says the shards moved."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


def _keep_after_backward_then_step(strategy: ShardingStrategy, optimizer: str) -> None:
    """set_reshard_after_backward(False): every handle keeps its unsharded parameters after
    backward, so the next forward gathers nothing while no optimizer step happened (a second
    micro-batch), and gathers again after one, computing on the updated shards: the gradients
    of every backward and the SGD steps equal local training's. Without the check on the
    parameters, an ignored flag or a kept buffer not refreshed after the step would pass. The
    optimizer holds the whole model (every handle's parameters and others'): torch's SGD, and
    one that updates ``p.data`` (no version counter moves: each handle must count the steps of
    an optimizer that holds any of its parameters, not only one that holds nothing else)."""
    world_size = dist.get_world_size()
    reference = make_model()
    model = make_model()
    _annotate(model, strategy=strategy)
    model.set_reshard_after_backward(False)
    make = torch.optim.SGD if optimizer == "sgd" else _DataSGD
    optim = make(model.parameters(), lr=0.5)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.5)
    flat_params = 5  # root: trainable + frozen; blocks.0, blocks.1, scale: one each
    for step in range(3):
        for micro in range(2):
            data_step = step + 10 * micro
            inputs, targets = batch(data_step, world_size)
            loss_fn(reference(inputs), targets).backward()
            with record_collectives() as forward:
                loss = loss_fn(model(local_rows(inputs, dist.get_rank())), local_rows(targets, dist.get_rank()))
            loss.backward()
            what = f"[{strategy.name} step {step} micro-batch {micro}]"
            expected_gathers = 0 if world_size == 1 or micro == 1 else flat_params  # kept, and not stale before a step
            assert forward.count("all_gather") == expected_gathers, (what, forward.records)
            if world_size > 1:
                kept = _unsharded_nbytes(model)
                assert all(n > 0 for sizes in kept.values() for n in sizes), f"{what}: freed after backward: {kept}"
            expected = [(n, p.grad) for n, p in reference.named_parameters() if p.grad is not None]
            assert_params_close(full_grads(model), expected, what=what)
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    model.set_reshard_after_backward(True)
    local_backward(model, 3)
    assert all(h.unsharded_storage_freed() for h in _get_fsdp_handles(model)), "set_reshard_after_backward(True)"
    assert_params_close(_full_params(model), list(reference.named_parameters()), what=f"[{strategy.name}] params")


def _full_params(model: nn.Module) -> Named:
    with unshard_params(model, writeback=False):
        return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def _synced_accumulation() -> None:
    """Two synced backwards without zero_grad add up, like plain autograd."""
    world_size = dist.get_world_size()
    expected = _accumulated_reference(make_model(), world_size, steps=2)
    model = make_model()
    _annotate(model)
    local_backward(model, 0)
    local_backward(model, 1)
    with unshard_params(model, with_grads=True):
        grads = [(n, p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None]
    assert_params_close(grads, expected, what="synced accumulation")


def _methods_grid() -> None:
    run_subtests(_no_sync_accumulation, {"how": ["flag", "no_sync"]})
    _synced_accumulation()
    dist.barrier()
    _methods()
    run_subtests(_keep_after_backward_then_step, {"strategy": [ShardingStrategy.FULL_SHARD,
                                                               ShardingStrategy.SHARD_GRAD_OP],
                                                  "optimizer": ["sgd", "data"]})


@pytest.mark.parametrize("world_size", [2])
def test_no_sync_and_manual_unshard(world_size: int) -> None:
    """set_requires_gradient_sync(False) for 3 micro-batches issues no collective and the next
    synced backward reduces the sum (equal to local accumulation); recurse=False leaves the
    children syncing; unshard()/reshard() are idempotent; set_reshard_after_backward(False)
    keeps parameters unsharded after backward, saves the next forward's all-gathers, and after
    an SGD step gathers again: steps equal local training's. At 2 ranks: every figure here is
    per handle and the same at 4 (uneven shards already at 2: a block's 109 elements)."""
    run_distributed(_methods_grid, world_size, timeout=120)




# ---------------------------------------------------------------------------- clip_grad_norm_
def _clip_grad_norm(norm_type: float) -> None:
    world_size = dist.get_world_size()
    reference = make_model()
    inputs, targets = batch(0, world_size)
    loss_fn(reference(inputs), targets).backward()
    expected_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05, norm_type=norm_type)
    model = make_model()
    _annotate(model)
    local_backward(model, 0)
    total = model.clip_grad_norm_(0.05, norm_type=norm_type)
    assert torch.allclose(total, expected_total, atol=1e-6), (total, expected_total)
    with unshard_params(model, with_grads=True):
        grads = [(n, p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None]
    assert_params_close(grads, [(n, p.grad) for n, p in reference.named_parameters() if p.grad is not None],
                        atol=1e-6, what=f"clipped grads (norm {norm_type})")


def _clip_grid() -> None:
    run_subtests(_clip_grad_norm, {"norm_type": [2.0, 1.0, float("inf")]})


@pytest.mark.parametrize("world_size", [1, 2])
def test_clip_grad_norm_over_all_shards(world_size: int) -> None:
    """The total norm (2, 1, inf) over every shard on every rank equals the unsharded model's,
    and the clipped gradients equal torch.nn.utils.clip_grad_norm_ on local training. At 1 and
    2 ranks: test_clip_grad_norm.py::test_clip_grad_norm_is_one_process_on_every_mix_4 clips at
    4 ranks (norms 2, 1, inf, -inf, 0, every mix of APIs)."""
    run_distributed(_clip_grid, world_size, timeout=120)
