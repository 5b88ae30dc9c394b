"""Two independently sharded models in one process are independent (issue 35, item 3).

Each model's runtime state belongs to it: what one model (or its optimizer) does never changes
what the other computes, gathers or returns. Before this held, any optimizer's step in the
process counted as a step of every sharded model (their kept unsharded buffers were gathered
again), state-dict calls shared one module-level session (a state-dict call made inside another
model's lost its gathered buffer: tied weights came back as two tensors, groups were gathered
twice), and torch's global hooks stayed installed after every model was gone.

Every expected figure is worked out here, by hand or from the same model trained alone in the
same process (same seeds, same batches: bitwise equal on CPU); nothing is read from the code
under test except ``_runtime/watch``'s own list of installed hooks in the last test.
"""

from __future__ import annotations

import gc
import threading
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import (ShardingStrategy, fully_shard, get_model_state_dict, get_optimizer_state_dict,
                              unshard_params)
from composable_shard._runtime.collectives import record_collectives
from tests._harness import run_distributed, run_subtests
from tests._models import batch, local_rows, loss_fn, make_model, zip_same

_A_BLOCKS, _B_BLOCKS = 2, 3  # different shapes (and seeds): nothing lines up by accident
# All-gathers of one full unshard of a sharded ParityModel (blocks, scale, root each fully
# sharded): one per block (its parameters are all trainable fp32: one flat group), one for the
# scale, two for the root (the trainable tied embedding/head and the frozen Linear are two flat
# groups: (dtype, requires_grad) differ).
_B_GATHERS = _B_BLOCKS + 1 + 2


def _shard(model: nn.Module, keep: str) -> nn.Module:
    """``keep``: how the model keeps unsharded buffers between uses ("" : it does not)."""
    strategy = ShardingStrategy.SHARD_GRAD_OP if keep == "shard_grad_op" else ShardingStrategy.FULL_SHARD
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, strategy=strategy)
    fully_shard(model.scale, strategy=strategy)  # type: ignore[arg-type]
    fully_shard(model, strategy=strategy)
    if keep == "after_backward":
        model.set_reshard_after_backward(False)  # type: ignore[operator]
    return model


class _Trainee:
    """One model, its AdamW and its gradient accumulation; each op records its all-gathers."""

    def __init__(self, seed: int, blocks: int, keep: str) -> None:
        self.model = _shard(make_model(seed, blocks), keep)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.micro = 0  # micro-batches seen (each its own batch)
        self.loss: Any = None
        self.losses: List[float] = []
        self.gathers: List[Tuple[str, int]] = []  # (op, all-gathers issued by it)

    def run(self, op: str) -> None:
        with record_collectives() as rec:
            if op == "fwd":
                rank, world_size = dist.get_rank(), dist.get_world_size()
                inputs, targets = batch(self.micro, world_size)
                self.loss = loss_fn(self.model(local_rows(inputs, rank)), local_rows(targets, rank))
                self.micro += 1
            elif op == "bwd":
                self.loss.backward()
                self.losses.append(self.loss.item())
                self.loss = None
            else:
                self.optim.step()
                self.optim.zero_grad()
        self.gathers.append((op, rec.count("all_gather")))

    def params(self) -> List[Tuple[str, torch.Tensor]]:
        with unshard_params(self.model):
            return [(n, p.detach().clone()) for n, p in self.model.named_parameters()]


def _assert_same_run(actual: _Trainee, alone: _Trainee, what: str) -> None:
    """Bitwise the same losses and parameters, and the same all-gathers op by op."""
    assert actual.losses == alone.losses, f"{what}: losses {actual.losses} != alone {alone.losses}"
    for (name, a), (name_e, e) in zip_same(actual.params(), alone.params(), what=what):
        assert name == name_e and torch.equal(a, e), f"{what}: {name} differs from the model trained alone"
    assert actual.gathers == alone.gathers, f"{what}: all-gathers per op {actual.gathers}, trained alone {alone.gathers}"


# ---------------------------------------------------------------------------- (a) interleaved training
# Per model: fwd/bwd pairs (gradients accumulate) and steps. A steps between B's micro-batches,
# and one forward/backward pair of each model is nested in the other's.
_SCHEDULE = [("A", "fwd"), ("A", "bwd"), ("A", "step"), ("B", "fwd"), ("B", "bwd"), ("B", "step"),
             ("A", "fwd"), ("B", "fwd"), ("B", "bwd"), ("A", "bwd"), ("A", "step"),
             ("B", "fwd"), ("B", "bwd"), ("B", "step"),
             ("B", "fwd"), ("A", "fwd"), ("A", "bwd"), ("B", "bwd"), ("A", "step"), ("B", "fwd"), ("B", "bwd"),
             ("B", "step"), ("A", "fwd"), ("B", "fwd"), ("A", "bwd"), ("B", "bwd")]


def _trainees(keep: str) -> Dict[str, _Trainee]:
    return {"A": _Trainee(0, _A_BLOCKS, keep), "B": _Trainee(1, _B_BLOCKS, keep)}


def _interleaved_training(keep: str) -> None:
    """Both models trained interleaved give exactly what each gives trained alone: losses,
    parameters, and the all-gathers of every op (a model keeping its buffers gathers nothing
    because the other model stepped)."""
    together = _trainees(keep)
    for name, op in _SCHEDULE:
        together[name].run(op)
    for name in ("A", "B"):
        alone = _trainees(keep)[name]
        for other, op in _SCHEDULE:
            if other == name:
                alone.run(op)
        _assert_same_run(together[name], alone, f"[{keep or 'reshard'}] model {name}")


def test_two_models_trained_interleaved_give_what_each_gives_alone() -> None:
    run_distributed(_entry, 2, "interleaved")


# ---------------------------------------------------------------------------- (b) state dict mid-step
def _state_dicts(model: nn.Module, optim: torch.optim.Optimizer) -> Dict[str, Any]:
    return {"full": get_model_state_dict(model), "sharded": get_model_state_dict(model, full=False),
            "optim": get_optimizer_state_dict(model, optim), "plain": _copied(model.state_dict())}


def _copied(sd: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def _assert_same_tree(actual: Any, expected: Any, what: str) -> None:
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and list(actual) == list(expected), f"{what}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            _assert_same_tree(actual[key], expected[key], f"{what}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), what
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_same_tree(a, e, f"{what}[{i}]")
    elif hasattr(expected, "local") and hasattr(expected, "start"):  # a ShardedSlice
        assert (actual.start, tuple(actual.shape)) == (expected.start, tuple(expected.shape)), what
        assert torch.equal(actual.local, expected.local), what
    elif isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), f"{what}: values differ"
    else:
        assert actual == expected, f"{what}: {actual!r} != {expected!r}"


def _state_dict_mid_step(keep: str) -> None:
    """B (gradient accumulation over 2 micro-batches) is mid-step: after a forward, before its
    backward, and between its micro-batches. A's state dicts (model full/sharded/plain, and its
    optimizer's, whose state is created by a zero-lr step at the first call) are then what they
    are with B idle, and B's step (losses, parameters, all-gathers per op) is B's alone."""
    a, b, b_alone = _Trainee(0, _A_BLOCKS, keep), _Trainee(1, _B_BLOCKS, keep), _Trainee(1, _B_BLOCKS, keep)
    for op in ("fwd", "bwd", "step"):
        a.run(op)
    expected = _state_dicts(a.model, torch.optim.AdamW(a.model.parameters(), lr=1e-2))  # B idle
    ops = ("fwd", "bwd", "fwd", "bwd", "step", "fwd", "bwd")
    for op in ops:
        b_alone.run(op)
    calls = 0
    for op in ops:
        b.run(op)
        if op == "fwd" or (op == "bwd" and calls == 1):  # after each forward, and between micro-batches
            fresh = torch.optim.AdamW(a.model.parameters(), lr=1e-2)  # its state created by this call
            _assert_same_tree(_state_dicts(a.model, fresh), expected, f"[{keep or 'reshard'}] A's state dicts")
            calls += 1
    assert calls == 4, calls
    _assert_same_run(b, b_alone, f"[{keep or 'reshard'}] model B")


def test_state_dict_of_one_model_while_the_other_is_mid_step() -> None:
    run_distributed(_entry, 2, "mid_step")


class _Saver(nn.Module):
    """Saves another model's state dict with its own (an EMA or teacher model sharded on its
    own, say): ``take`` runs inside this module's ``state_dict()``."""

    def __init__(self) -> None:
        super().__init__()
        self.take: Callable[[], Any] = lambda: None

    def get_extra_state(self) -> Any:
        return self.take()

    def set_extra_state(self, state: Any) -> None:
        pass


def _in_a_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        out: List[Any] = []
        thread = threading.Thread(target=lambda: out.append(fn()))
        thread.start()
        thread.join()
        assert len(out) == 1, "the thread raised (see its traceback above)"
        return out[0]
    return run


def _nested_state_dicts(where: str) -> None:
    """A's full state dict taken inside B's (from a module of B between B's tied embedding and
    head entries; on this thread or another): both are what each gives alone, tied entries
    one tensor, each group gathered once."""
    a = _shard(make_model(0, _A_BLOCKS), "")
    b_model = make_model(1, _B_BLOCKS)
    b_model.emb.saver = _Saver()  # saved inside emb's state_dict(), before emb's and head's entries are rewritten
    b = _shard(b_model, "")
    with record_collectives() as rec:
        a_alone = get_model_state_dict(a)
    a_gathers = rec.count("all_gather")
    with record_collectives() as rec:
        b_alone = get_model_state_dict(b)
    b_gathers = rec.count("all_gather")
    assert a_gathers == 1 + _A_BLOCKS + 2 and b_gathers == _B_GATHERS, (a_gathers, b_gathers)  # see _B_GATHERS
    take = (lambda: get_model_state_dict(a)) if where == "same thread" else _in_a_thread(lambda: get_model_state_dict(a))
    b_model.emb.saver.take = take
    with record_collectives() as rec:
        b_sd = get_model_state_dict(b)
    nested = b_sd.pop("emb.saver._extra_state")
    assert b_alone.pop("emb.saver._extra_state") is None
    what = f"[{where}]"
    _assert_same_tree(b_sd, b_alone, f"{what} B's state dict around A's")
    _assert_same_tree(nested, a_alone, f"{what} A's state dict inside B's")
    for sd, name in ((b_sd, "B"), (nested, "A")):
        assert sd["head.weight"] is sd["emb.weight"], f"{what} {name}'s tied emb/head weights came back as two tensors"
    expected = b_gathers + (a_gathers if where == "same thread" else 0)  # the thread's are its own
    assert rec.count("all_gather") == expected, f"{what} {rec.count('all_gather')} all-gathers, expected {expected}"


def test_state_dict_calls_nested_across_models_and_threads() -> None:
    run_distributed(_entry, 2, "nested")


# ---------------------------------------------------------------------------- (c) no gathers for another's step
def _step_of_other_model(keep: str) -> None:
    """B keeps its unsharded buffers; A's optimizer.step() and B's next forward issue no
    all-gather at all, and B's own step makes B gather every flat group again."""
    a, b = _Trainee(0, _A_BLOCKS, keep), _Trainee(1, _B_BLOCKS, keep)
    for op in ("fwd", "bwd", "step"):
        a.run(op)
        b.run(op)
    a.run("fwd")
    a.run("bwd")
    b.run("fwd")  # gathers everything (B stepped since its last gather)
    if keep == "after_backward":
        b.run("bwd")  # buffers kept after backward
    with record_collectives() as rec:
        a.optim.step()
        a.optim.zero_grad()
        b.run("fwd")  # SHARD_GRAD_OP: the forward before it (grad on, no backward) kept them
    assert rec.count("all_gather") == 0, f"[{keep}] A's optimizer step made B gather {rec.count('all_gather')} times"
    if keep == "after_backward":
        b.run("bwd")  # kept again
    b.run("step")  # B's own optimizer (SHARD_GRAD_OP: no gradients, but a step all the same)
    b.run("fwd")
    assert b.gathers[-1] == ("fwd", _B_GATHERS), f"[{keep}] after B's own step B gathered {b.gathers[-1]}"


def test_optimizer_step_of_one_model_makes_the_other_gather_nothing() -> None:
    run_distributed(_entry, 2, "other_step")


# ---------------------------------------------------------------------------- (d) global hooks
def _global_hooks_follow_the_models() -> None:
    """torch's global hooks are installed while a model needs them and removed (RemovableHandle)
    once every model and optimizer is garbage: none of ours stays in the process; a new model
    installs them again, and they work (a parameter registered after fully_shard is caught)."""
    from composable_shard._runtime import watch as _watch

    assert _watch._installed == [], "hooks installed before any model"
    trainees = _trainees("after_backward")
    for name, op in _SCHEDULE[:6]:
        trainees[name].run(op)
    get_optimizer_state_dict(trainees["A"].model, trainees["A"].optim)
    assert len(_watch._installed) == 4, _watch._installed  # parameter and module registration, optimizer step (post, pre)
    del trainees
    gc.collect()
    assert _watch._installed == [], f"{len(_watch._installed)} global hook(s) still installed after both models died"
    model = _shard(make_model(2, 1), "")
    assert len(_watch._installed) == 4, "a new model did not install the hooks again"
    model.blocks[0].fc1.extra = nn.Parameter(torch.zeros(1))
    try:
        model(batch(0, dist.get_world_size())[0])
    except RuntimeError as e:
        assert "fully_shard(blocks.0): parameter 'blocks.0.fc1.extra' was registered after fully_shard" in str(e), e
    else:
        raise AssertionError("a parameter registered after fully_shard went unnoticed with the hooks reinstalled")
    del model
    gc.collect()
    assert _watch._installed == [], "the hooks outlived the second model"


def test_global_hooks_are_removed_with_the_last_model() -> None:
    run_distributed(_entry, 2, "hooks")


# ---------------------------------------------------------------------------- entry
_GRIDS: Dict[str, Callable[[], None]] = {
    "interleaved": lambda: run_subtests(_interleaved_training, {"keep": ["", "after_backward", "shard_grad_op"]}),
    "mid_step": lambda: run_subtests(_state_dict_mid_step, {"keep": ["after_backward", "shard_grad_op"]}),
    "nested": lambda: run_subtests(_nested_state_dicts, {"where": ["same thread", "other thread"]}),
    "other_step": lambda: run_subtests(_step_of_other_model, {"keep": ["after_backward", "shard_grad_op"]}),
    "hooks": _global_hooks_follow_the_models,
}


def _entry(name: str) -> None:
    _GRIDS[name]()
