"""Ranks that disagree raise on every rank, naming the modules and the ranks, instead of
hanging, aborting the process, or returning mixed-up data (see [Note: Agreement] in
``composable_shard/_runtime/agreement.py``).

Without the agreement, blocks of equal shapes run in a different order on two ranks all-gather
each other's parameters (wrong outputs, then a hang), and blocks of different sizes abort the
process inside gloo.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from datetime import timedelta
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import ShardingStrategy, clip_grad_norm_, fully_shard, get_model_state_dict, replicate, unshard_params
from composable_shard._runtime import collectives as _collectives
from tests._harness import run_distributed, run_subtests
from tests._models import zip_same


class _Wide(nn.Module):
    """6 -> 20 -> 6: a block with other shapes than ``_Narrow``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, hidden)
        self.fc2 = nn.Linear(hidden, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class _Routed(nn.Module):
    """Runs its blocks in ``self.order`` (data-dependent routing, as a mixture of experts does)."""

    def __init__(self, same_shapes: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Wide(7), _Wide(7 if same_shapes else 20)])
        self.head = nn.Linear(6, 2)
        self.order = [0, 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.order:
            x = self.blocks[i](x)
        return self.head(x)


def _routed(same_shapes: bool) -> _Routed:
    """Without forward prefetch, so a changed order shows at the first all-gather (with it, the
    gathers follow the first iteration's order and the difference shows at the reductions)."""
    torch.manual_seed(0)
    model = _Routed(same_shapes)
    for block in model.blocks:
        fully_shard(block, forward_prefetch=False)
    fully_shard(model, forward_prefetch=False)
    return model


def _expect_error(fn: Any, *fragments: str) -> str:
    try:
        fn()
    except RuntimeError as e:
        for fragment in fragments:
            assert fragment in str(e), f"{fragment!r} not in: {e}"
        return str(e)
    raise AssertionError("expected a RuntimeError on every rank")


def _step(model: nn.Module) -> None:
    torch.manual_seed(dist.get_rank())
    model(torch.randn(2, 6)).sum().backward()


# ---------------------------------------------------------------------------- first iteration
def _order_differs_in_first_iteration(same_shapes: bool) -> None:
    rank = dist.get_rank()
    model = _routed(same_shapes)
    model.order = [0, 1] if rank == 0 else [1, 0]
    _expect_error(lambda: _step(model), "rank 0: all-gather of the parameters of 'blocks.0'",
                  "rank 1: all-gather of the parameters of 'blocks.1'")
    # Nothing is left half-done: the same model trains once the ranks agree, like a fresh one.
    model.order = [0, 1]
    model.zero_grad()
    _step(model)
    fresh = _routed(same_shapes)
    _step(fresh)
    with unshard_params(model, with_grads=True), unshard_params(fresh, with_grads=True):
        for p, q in zip_same(list(model.parameters()), list(fresh.parameters()), what="parameters"):
            assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)


class _WithAux(nn.Module):
    """A body, a head, and an auxiliary head whose output some ranks leave out of the loss."""

    def __init__(self, aux_first: bool) -> None:
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)
        self.aux = nn.Linear(6, 2)
        self.aux_first = aux_first

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.tanh(self.body(x))
        if self.aux_first:
            aux = self.aux(h)
            return self.head(h), aux
        out = self.head(h)
        return out, self.aux(h)


def _aux_loss(model: nn.Module, x: torch.Tensor, aux_weight: float) -> torch.Tensor:
    out, aux = model(x)
    return (out ** 2).sum() + aux_weight * (aux ** 2).sum() if aux_weight else (out ** 2).sum()


def _output_used_on_some_ranks(aux_first: bool, sync: bool, hybrid: bool = False, eval_first: bool = False) -> None:
    """An auxiliary output in rank 0's loss only (the aux head running before or after the head,
    so its reduction is first or in the middle of rank 0's): every rank raises at the first
    reduction they disagree on, naming it, in the first iteration (it waited for the process
    group's timeout). The message's remedy (the output times 0 on the others) then trains as one
    process on the combined batch. With gradient sync off the same holds: the agreement carries
    the flag. ``hybrid`` (4 ranks, a 2 x 2 mesh): ranks 2 and 3 agree within their shard group,
    and raise too (they waited for ranks 0 and 1 in the replicate group): see [Note: Agreement on
    a 2-D mesh]. ``eval_first``: a forward without grad before the first training step (still
    the first iteration: the checks hold until a backward ends)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _WithAux(aux_first)
    local = copy.deepcopy(model)
    kwargs: Dict[str, Any] = {"forward_prefetch": False}
    if hybrid:
        from torch.distributed.device_mesh import init_device_mesh
        kwargs.update(mesh=init_device_mesh("cpu", (2, 2)), strategy=ShardingStrategy.HYBRID_SHARD)
    for name in ("body", "head", "aux"):
        fully_shard(getattr(model, name), **kwargs)
    fully_shard(model, **kwargs)
    model.set_requires_gradient_sync(sync)
    xs = [torch.randn(3, 6, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    if eval_first:
        with torch.no_grad():
            model(xs[rank])
    # aux's backward comes second on rank 0 (after head's) where aux ran first, else first, where
    # its backward all-gather is what the others do not do
    mine, theirs = (("gradient of 'aux'", "gradient of 'body'") if aux_first else
                    ("all-gather of the parameters of 'aux'", "all-gather of the parameters of 'head'"))
    if hybrid:  # each rank names what it saw: its shard group's, its replicate group's, or only that one differed
        seen = {0: [f"rank 0: {mine}", f"rank 1: {theirs}"], 1: [f"rank 0: {mine}", f"rank 1: {theirs}"],
                2: [f"rank 0: {mine}", f"rank 2: {theirs}"], 3: [f"rank 3: {theirs}", "ranks of another group"]}[rank]
    else:
        seen = [f"rank 0: {mine}", f"rank {world - 1}: {theirs}"]
    message = _expect_error(lambda: _aux_loss(model, xs[rank], 1.0 if rank == 0 else 0.0).backward(),
                            *seen, "reaches the loss on every rank", "multiplied by 0")
    assert ("keeping it unreduced" in message) is (aux_first and not sync), message
    model.zero_grad()
    out, aux = model(xs[rank])
    ((out ** 2).sum() + (1.0 if rank == 0 else 0.0) * (aux ** 2).sum()).backward()
    if not sync:
        model.set_requires_gradient_sync(True)
        out, aux = model(xs[rank])
        ((out ** 2).sum() + (1.0 if rank == 0 else 0.0) * (aux ** 2).sum()).backward()
    passes = 1 if sync else 2
    for _ in range(passes):
        sum(_aux_loss(local, xs[r], 1.0 if r == 0 else 0.0) for r in range(world)).div(world).backward()
    with unshard_params(model, with_grads=True):
        for (name, p), q in zip_same(list(model.named_parameters()), list(local.parameters()), what="parameters"):
            assert p.grad is not None and q.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=name)


# ---------------------------------------------------------------------------- later iterations
def _order_changes_later() -> None:
    model = _routed(True)
    _step(model)
    model.order = [1, 0]  # on every rank: allowed, but prefetch follows the old order
    with pytest.warns(UserWarning, match="forward order changed after the first iteration"):
        _step(model)


def _debug_mode(case: str) -> None:
    os.environ["COMPOSABLE_SHARD_DEBUG"] = "1"  # read at lazy init
    try:
        rank = dist.get_rank()
        model = _routed(True)
        _step(model)
        model.zero_grad()
        if case == "order":
            model.order = [0, 1] if rank == 0 else [1, 0]
            _expect_error(lambda: _step(model), "rank 0: all-gather of the parameters of 'blocks.0'",
                          "rank 1: all-gather of the parameters of 'blocks.1'")
        elif case == "no_sync on one rank":
            model.set_requires_gradient_sync(rank != 0)
            _expect_error(lambda: _step(model), "rank 0: gradient of", "keeping it unreduced",
                          "rank 1: gradient of", "reduction")
        else:  # a backward that raises on rank 0 only
            def explode(grad: torch.Tensor) -> torch.Tensor:
                raise ValueError("user error in backward")

            if rank == 0:
                out = model(torch.randn(2, 6))
                out.register_hook(explode)
                try:
                    out.sum().backward()
                except (ValueError, RuntimeError):
                    pass
                model.zero_grad()
                _expect_error(lambda: model(torch.randn(2, 6)), "rank 0: recovering from a backward that raised")
            else:
                _expect_error(lambda: _step(model), "rank 0: recovering from a backward that raised")
    finally:
        del os.environ["COMPOSABLE_SHARD_DEBUG"]


def _later() -> None:
    _order_changes_later()
    dist.barrier()
    run_subtests(_debug_mode, {"case": ["order", "no_sync on one rank", "failed backward on one rank"]})


# ---------------------------------------------------------------------------- what only times out
def _routed_with_short_timeout(forward_prefetch: bool = False) -> _Routed:
    """``_Routed(True)`` sharded on a process group whose collectives time out after 3 s."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=3))
    torch.manual_seed(0)
    model = _Routed(True)
    for block in model.blocks:
        fully_shard(block, process_group=group, forward_prefetch=forward_prefetch)
    fully_shard(model, process_group=group, forward_prefetch=forward_prefetch)
    return model


def _timeout_names_the_collective() -> None:
    rank = dist.get_rank()
    _collectives.STUCK_WARNING_AFTER_S = 0.5  # the group times out after 3 s
    model = _routed_with_short_timeout()
    _step(model)
    model.set_requires_gradient_sync(rank != 0)  # rank 0 skips the reductions rank 1 waits for
    if rank == 1:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            message = _expect_error(lambda: _step(model), "reduce_scatter of", "did not complete",
                                    "COMPOSABLE_SHARD_DEBUG=1")
        assert any(name in message for name in ("'blocks.0'", "'blocks.1'", "'<root>'")), message
        stuck = [str(w.message) for w in caught if "rank 1 has waited" in str(w.message)]
        assert len(stuck) == 1 and "reduce_scatter of" in stuck[0] and "COMPOSABLE_SHARD_DEBUG=1" in stuck[0], stuck
    else:
        _step(model)
    dist.barrier()  # on the default group: rank 0 waits here until rank 1 has seen its error


def _order_diverges_later(forward_prefetch: bool) -> None:
    rank = dist.get_rank()
    model = _routed_with_short_timeout(forward_prefetch)
    _step(model)  # the first iteration: ranks agree on the order
    model.zero_grad()
    model.order = [0, 1] if rank == 0 else [1, 0]
    # With forward prefetch the gathers follow the recorded order until a block's prefetch finds
    # its successor already run (rank 1 gathers blocks.1 a second time): the collective that
    # times out depends on the rank, but it is named, and no block computes on another's shards.
    expected = "of 'blocks." if forward_prefetch else f"the all_gather of 'blocks.{rank}' did not complete on rank {rank}"
    with pytest.warns(UserWarning, match="forward order changed") if rank == 1 else contextlib.nullcontext():
        _expect_error(lambda: _step(model), expected, "did not complete", "COMPOSABLE_SHARD_DEBUG=1")
    dist.barrier()


def _orders_diverging_later() -> None:
    run_subtests(_order_diverges_later, {"forward_prefetch": [False, True]})


def _called_on_rank_0_only(call: str) -> None:
    rank = dist.get_rank()
    _collectives.STUCK_WARNING_AFTER_S = 0.5  # the group times out after 3 s
    model = _routed_with_short_timeout()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model)
    optim.step()

    def enter_unshard_params() -> None:
        with unshard_params(model):
            pass

    fn, api, instead = {
        "state_dict": (model.state_dict, "Taking a full state dict", "is_main_process=rank == 0"),
        "get_model_state_dict": (lambda: get_model_state_dict(model), "Taking a full state dict",
                                 "get_model_state_dict(model, rank0_only=True)"),
        "unshard_params": (enter_unshard_params, "`unshard_params` is collective", "rank0_only=True"),
        "clip_grad_norm_": (lambda: clip_grad_norm_(model, 1.0), "`clip_grad_norm_` is collective", "on every rank"),
    }[call]
    if rank == 0:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _expect_error(fn, "did not complete on rank 0", api, "on one rank only", instead)
        stuck = [str(w.message) for w in caught if "rank 0 has waited" in str(w.message)]
        assert stuck and api in stuck[0] and instead in stuck[0], [str(w.message) for w in caught]
    dist.barrier()  # on the default group: rank 1 waits here until rank 0 has seen its error


_TIMEOUTS: Dict[str, Callable[[], None]] = {
    "sync off on one rank": _timeout_names_the_collective, "order diverging later": _orders_diverging_later,
    "collective call made on one rank": lambda: run_subtests(_called_on_rank_0_only, {
        "call": ["state_dict", "get_model_state_dict", "unshard_params", "clip_grad_norm_"]})}


def _timeout_case(case: str) -> None:
    _TIMEOUTS[case]()


def test_unagreed_divergence_times_out_naming_the_collective() -> None:
    """What no agreement catches, without debug mode, times out on a 3 s process group naming
    the collective; at 2 ranks, in one process group (each failure names its case):

    sync off on one rank: gradient sync switched off on one rank leaves a reduce-scatter
    unmatched: once it has waited ``STUCK_WARNING_AFTER_S`` a warning (one) names the collective
    and points to COMPOSABLE_SHARD_DEBUG, and its wait fails after the process group's timeout
    with a message naming the collective and the handle, and pointing there too.

    order diverging later: blocks of equal shapes run in a different order on one rank after
    the first iteration: each gather waits for the peers' gather of the same handle (the handle
    rides in gloo's point-to-point tag), so every rank fails after the process group's timeout
    naming its handle. Before, rank 0's gather of 'blocks.0' paired with rank 1's of 'blocks.1':
    both ranks finished the step on parameters assembled from two different blocks, silently.

    collective call made on one rank: ``if rank == 0: model.state_dict()`` (what
    ``save_pretrained`` does) and the other calls that gather or reduce across ranks, made on
    rank 0 alone: a warning names the call as collective and says what to do instead once it
    has waited ``STUCK_WARNING_AFTER_S``, and the process group's timeout raises saying the
    same. Before, the error blamed the training step (ranks running different handles) and
    nothing was said until the timeout. ``get_optimizer_state_dict`` gives the same advice; it
    starts with an exchange on the default group, whose timeout is too long to wait for here."""
    run_distributed(run_subtests, 2, _timeout_case, {"case": list(_TIMEOUTS)}, timeout=180)


# ---------------------------------------------------------------------------- optimizer steps
def _stepped_model(api: str) -> nn.Module:
    torch.manual_seed(0)
    model = _Routed(same_shapes=False)
    if api == "replicate":
        return replicate(model)
    kwargs: Any = {"strategy": ShardingStrategy.NO_SHARD} if api == "no_shard" else {}  # one-rank shard groups
    if api == "hybrid":  # 2 x 2: the agreement is summed over the shard group, then across replicas
        from torch.distributed.device_mesh import init_device_mesh
        kwargs = {"mesh": init_device_mesh("cpu", (2, 2)), "strategy": ShardingStrategy.HYBRID_SHARD}
    for block in model.blocks:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def _steps_on_some_ranks(api: str, cause: str) -> None:
    rank = dist.get_rank()
    model = _stepped_model(api)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(0)
    own = nn.Linear(3, 3)  # a model of rank 0's own, stepped on rank 0 alone: not counted
    own_optim = torch.optim.SGD(own.parameters(), lr=0.1)
    scaler = None
    if cause == "stepped_before_first_forward":  # a step before the step counter exists (made at the first
        optim.step()  # forward): which optimizers hold which watches must be worked out again after it
    if cause in ("grad_scaler", "sharded_grad_scaler"):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        scaler = torch.amp.GradScaler("cpu") if cause == "grad_scaler" else ShardedGradScaler("cpu")
    for step in range(2):  # both ranks step in step 0
        torch.manual_seed(rank)
        loss = model(torch.randn(2, 6)).sum()
        (loss if scaler is None else scaler.scale(loss)).backward()
        if rank == 0:
            own(torch.randn(2, 3)).sum().backward()
            own_optim.step()
        if scaler is None:
            if step == 0:  # every rank steps twice in the first window (two optimizers over one model, as
                optim.step()  # Muon's and AdamW's): equal counts, so nothing is raised for it
            if cause in ("rank_condition", "stepped_before_first_forward") and step == 1 and rank == 1:
                continue  # `if torch.isfinite(loss): optim.step()` with a loss that is inf on rank 1
            if cause == "extra_step" and step == 1 and rank == 0:
                optim.step()  # one step too many on rank 0 (a per-rank accumulation count): 2 against 1
            optim.step()
        else:
            # an overflow that lands in rank 1's slice of the gradients only
            grads = [p.grad for p in model.parameters() if p.grad is not None and p.grad.numel() > 0]
            if step == 1 and rank == 1:
                grads[0].view(-1)[0] = float("inf")
            scaler.step(optim)
            scaler.update()
        optim.zero_grad()
    # The next synced backward carries the steps of the window that ends there; its verdict is read
    # at the one after (no host read in the step that issued it): nothing is raised before.
    _step(model)
    if cause == "sharded_grad_scaler":  # every rank skipped step 1 together: nothing to report
        _step(model)
        return
    world = dist.get_world_size()  # rank 1 stepped once less, or rank 0 once more, than the others
    mine, total = ((2 if rank == 0 else 1), world + 1) if cause == "extra_step" else ((0 if rank == 1 else 1), world - 1)
    fragments = [f"stepped {mine} time(s)", "between the two synchronized backwards before this one",
                 f"{total / world:g} times on average over the {world} ranks",
                 "must call optimizer.step() together"]
    fragments.append("The replicas now differ" if api == "replicate" else "ShardedGradScaler")
    _expect_error(lambda: _step(model), *fragments)
    # The error came after the backward finished: once the ranks step together, training goes on.
    optim.zero_grad()
    _step(model)
    optim.step()
    optim.zero_grad()
    _step(model)


def _skip_before_a_state_dict(way: str) -> None:
    """A step skipped on rank 1 after the last synced backward but one: no synced backward reads
    that window's verdict, so taking the state dict (``get_model_state_dict``, ``state_dict()``,
    ``unshard_params``) reads it and raises on every rank, before gathering anything."""
    rank = dist.get_rank()
    model = _stepped_model("fully_shard")
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model)
    if rank == 0:
        optim.step()
    optim.zero_grad()
    _step(model)  # its agreement carries the skipped step; nothing read yet
    take: Dict[str, Callable[[], Any]] = {"get_model_state_dict": lambda: get_model_state_dict(model),
                                          "state_dict": model.state_dict,
                                          "unshard_params": lambda: unshard_params(model).__enter__()}
    _expect_error(take[way], "stepped 0 time(s)" if rank == 1 else "stepped 1 time(s)",
                  "must call optimizer.step() together")
    get_model_state_dict(model)  # read once: the state dict is taken now


def _skip_then_read_or_saved(api: str, way: str) -> None:
    """A step taken on rank 0 only after the last synced backward (``torch.amp.GradScaler``
    skipping it on rank 1): no backward has carried it yet, and a user's trial read the model with
    ``get_model_state_dict`` and wrote it with ``save_checkpoint``, without an error. Every call
    that reads or saves the model across ranks now raises on every rank first, writing nothing;
    a sharded state dict (no collective) is taken as it is."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from composable_shard import get_optimizer_state_dict, save_checkpoint, save_checkpoint_async

    rank = dist.get_rank()
    model = _stepped_model(api)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model)
    if rank == 0:
        optim.step()
    optim.zero_grad()
    where = [os.path.join(os.environ.get("TMPDIR", "/tmp"), f"cs_skip_{os.getpid()}") if rank == 0 else ""]
    dist.broadcast_object_list(where, src=0)
    path = os.path.join(where[0], "step_1")
    calls: Dict[str, Callable[[], Any]] = {
        "get_model_state_dict": lambda: get_model_state_dict(model),
        "state_dict": model.state_dict,
        "unshard_params": lambda: unshard_params(model).__enter__(),
        "get_optimizer_state_dict": lambda: get_optimizer_state_dict(model, optim),
        "torch get_state_dict": lambda: get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True)),
        "save_checkpoint": lambda: save_checkpoint(path, model, optim),
        "save_checkpoint_async": lambda: save_checkpoint_async(path, model, optim).result(),
    }
    _expect_error(calls[way], "since the last synchronized backward", "stepped [1, 0] time(s) on ranks 0..1",
                  "Nothing was saved or read")
    assert not os.path.exists(path), path
    get_model_state_dict(model, full=False)  # sharded: no collective, no check
    _step(model)  # the check consumed nothing: this backward carries the skipped step, the next one raises
    _expect_error(lambda: _step(model), "must call optimizer.step() together")


def _skip_one_of_two_optimizers(way: str) -> None:
    """Two fully sharded blocks, each its own root and optimizer, stepped once each on rank 0 and
    the second skipped on rank 1: every rank's largest step count is 1, and the read still
    raises on every rank (the ranks' counts differ per module)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(_Wide(7), _Wide(20))
    for block in model:
        fully_shard(block)
    optims = [torch.optim.SGD(block.parameters(), lr=0.1) for block in model]
    _step(model)
    for i, optim in enumerate(optims):
        if rank == 0 or i == 0:
            optim.step()
        optim.zero_grad()
    take: Dict[str, Callable[[], Any]] = {"get_model_state_dict": lambda: get_model_state_dict(model),
                                          "unshard_params": lambda: unshard_params(model).__enter__()}
    _expect_error(take[way], "since the last synchronized backward", "Nothing was saved or read")


# ---------------------------------------------------------------------------- gradients nothing averages
class _Net(nn.Module):
    """An embedding-like input layer and an output head around two blocks: what users leave on
    the root when they shard the blocks only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(5, 6)
        self.blocks = nn.ModuleList([_Wide(8), _Wide(8)])
        self.out = nn.Linear(6, 3)
        self.unused = nn.Parameter(torch.zeros(2))  # trainable, never in the forward: no gradient, never apart

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _unaveraged(setup: str) -> None:
    """fully_shard (or replicate) on the blocks only: the root's parameters get each rank's own
    gradient and the ranks' copies drift apart (checked: the output heads differ after the
    steps). The first step warns once, naming them ([Note: Gradients no data-parallel API
    averages] in _runtime/watch.py), at the user's line, and never again; nothing is said when
    the root is managed too (``root``), when its parameters are ignored on purpose (``ignored``:
    they drift, as asked) or frozen (``frozen_root``), nor of a trainable parameter that gets no
    gradient (``_Net.unused``); at 4 ranks also on a 2 x 2 hybrid mesh."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _Net()
    loose = ["inp.weight", "inp.bias", "out.weight", "out.bias"]
    if setup == "replicated_blocks":
        for block in model.blocks:
            replicate(block)
    else:
        kwargs: Dict[str, Any] = {}
        if setup == "hybrid_blocks":
            from torch.distributed.device_mesh import init_device_mesh

            kwargs = {"strategy": ShardingStrategy.HYBRID_SHARD, "mesh": init_device_mesh("cpu", (2, world_size // 2))}
        for block in model.blocks:
            fully_shard(block, **kwargs)
        if setup == "root":
            fully_shard(model)
        elif setup == "ignored":
            fully_shard(model, ignored_params={p for m in (model.inp, model.out) for p in m.parameters()})
        elif setup == "frozen_root":
            for name in loose:
                model.get_parameter(name).requires_grad_(False)
    optim = torch.optim.SGD(model.named_parameters(), lr=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step * 10 + rank))
            model(x).pow(2).mean().backward()
            optim.step()
            optim.zero_grad()
    said = [w for w in caught if "neither fully_shard nor replicate manages" in str(w.message)]
    head = get_model_state_dict(model)["out.weight"]  # the full head (sharded when the root is)
    heads = [torch.zeros_like(head) for _ in range(world_size)]
    dist.all_gather(heads, head)
    apart = any(not torch.equal(heads[0], h) for h in heads)
    if setup in ("blocks", "replicated_blocks", "hybrid_blocks"):
        assert apart, "the premise: nothing averages the head's gradients"
        assert len(said) == 1, [str(w.message) for w in caught]
        message = str(said[0].message)
        assert f"steps {len(loose)} parameter(s)" in message and all(repr(n) in message for n in loose), message
        assert "fully_shard(model) after the blocks" in message and said[0].filename == __file__, (message, said[0].filename)
    else:
        assert not said, [str(w.message) for w in said]
        assert apart == (setup == "ignored"), setup


# ---------------------------------------------------------------------------- entry
_AGREED: Dict[str, Callable[[], None]] = {
    "different handle order in the first iteration": lambda: run_subtests(
        _order_differs_in_first_iteration, {"same_shapes": [True, False]}),
    "debug mode checks every iteration": _later,
    "an output in the loss on some ranks only": lambda: (run_subtests(
        _output_used_on_some_ranks, {"aux_first": [True, False], "sync": [True, False]}),
        _output_used_on_some_ranks(aux_first=True, sync=True, eval_first=True)),
    "optimizer stepped on some ranks": lambda: run_subtests(_steps_on_some_ranks, {
        "api": ["fully_shard", "replicate"],
        "cause": ["rank_condition", "grad_scaler", "sharded_grad_scaler", "extra_step", "stepped_before_first_forward"]}),
    "optimizer stepped on some ranks before a state dict": lambda: run_subtests(_skip_before_a_state_dict, {
        "way": ["get_model_state_dict", "state_dict", "unshard_params"]}),
    "optimizer stepped on some ranks after the last backward": lambda: (run_subtests(_skip_then_read_or_saved, {
        "api": ["fully_shard"], "way": ["get_model_state_dict", "state_dict", "unshard_params", "get_optimizer_state_dict",
                                        "torch get_state_dict", "save_checkpoint", "save_checkpoint_async"]}),
        run_subtests(_skip_then_read_or_saved, {"api": ["replicate", "no_shard"], "way": ["save_checkpoint"]}),
        run_subtests(_skip_one_of_two_optimizers, {"way": ["get_model_state_dict", "unshard_params"]})),
    "gradients nothing averages": lambda: run_subtests(_unaveraged, {
        "setup": ["blocks", "replicated_blocks", "root", "ignored", "frozen_root"]}),
}
_AGREED_AT_4: Dict[str, Callable[[], None]] = {  # more than two ranks agreeing; a real hybrid mesh
    "different handle order in the first iteration": _AGREED["different handle order in the first iteration"],
    "optimizer stepped on some ranks": lambda: run_subtests(_steps_on_some_ranks, {
        "api": ["hybrid"], "cause": ["rank_condition"]}),
    "an output in the loss on some ranks only": lambda: run_subtests(
        _output_used_on_some_ranks, {"aux_first": [True, False], "sync": [True], "hybrid": [False, True]}),
    "gradients nothing averages": lambda: run_subtests(_unaveraged, {"setup": ["blocks", "hybrid_blocks", "root"]}),
}


def _agreed_case(case: str) -> None:
    (_AGREED_AT_4 if dist.get_world_size() == 4 else _AGREED)[case]()


@pytest.mark.parametrize("world_size", [2, 4])
def test_disagreement_raises_on_every_rank(world_size: int) -> None:
    """What the agreement catches raises on every rank, in one process group per world size
    (each failure names its case):

    different handle order in the first iteration (2 and 4 ranks): blocks run in a different
    order on rank 0 (same shapes: used to return wrong outputs and hang; different shapes: used
    to abort in gloo): every rank raises naming both blocks and the ranks, and the model trains
    normally afterwards.

    an output in the loss on some ranks only (2 and 4 ranks): an auxiliary head's output in rank
    0's loss alone left its reduction unmatched, and every rank waited for the process group's
    timeout; the first iteration now agrees before each reduction, so every rank raises naming
    the two gradients and the remedy, which then trains as one process. On a 2 x 2 hybrid mesh the
    ranks of the other shard group, which agree among themselves, raise too.

    debug mode checks every iteration (2 ranks): after the first iteration an order change
    warns once (no communication); with COMPOSABLE_SHARD_DEBUG=1 a divergent order, gradient
    sync switched off on one rank, or a backward that raised on one rank raises on every rank
    instead of hanging.

    optimizer stepped on some ranks: an optimizer step skipped on one rank
    (``torch.amp.GradScaler`` seeing an overflow in that rank's gradient slices; a per-rank
    condition) used to leave that rank's slices behind (or, under replicate, the replicas
    apart) silently: the second synced backward after it now raises on every rank saying why and
    what to use instead, from the used-parameter all-reduce (no extra collective), whose verdict is
    read one synced backward later (no host read in the step that issued it), and not before. torch's
    ``ShardedGradScaler`` (skipping on every rank) and an optimizer of a rank's own model are
    not reported (2 ranks); nor is a step taken before the first forward, and the skipped one after it
    is. At 4 ranks on a 2 x 2 mesh: the agreement sums over both groups.

    optimizer stepped on some ranks before a state dict (2 ranks): the verdict no later backward
    read is read when the state dict is taken, and raises there.

    optimizer stepped on some ranks after the last backward (2 ranks): the steps no backward
    carried yet are exchanged by every call that reads or saves the model across ranks, which
    raises on every rank before anything is read or written (also under NO_SHARD, whose shard
    groups have one rank, and with two roots' optimizers whose largest counts agree).

    gradients nothing averages (2 and 4 ranks): the root left plain under fully sharded or
    replicated blocks trained apart on each rank without a word; the first step warns (see
    ``_unaveraged``)."""
    cases = _AGREED_AT_4 if world_size == 4 else _AGREED
    run_distributed(run_subtests, world_size, _agreed_case, {"case": list(cases)}, timeout=150)


_ = List  # typing re-export guard for older interpreters
