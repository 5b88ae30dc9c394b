"""CUDA checked on one GPU (issue 56, item 4): the library's CUDA paths -- its streams and
events, pinned offloaded shards, device-side mixed precision, state dicts of device shards -- run
for real, two ranks sharing ``cuda:0`` over gloo (gloo's CUDA ``all_gather_into_tensor``,
``reduce_scatter_tensor`` and ``all_reduce``), each rank on its own rows, against single-process
training on the combined batch. One more test runs one rank over NCCL and checks that a
steady-state step never makes the CPU wait for the GPU.

Without these the CUDA paths ran nowhere: the suite is CPU-only, where every stream and event
is a no-op, so a gather the compute stream does not wait for, a gradient copied to the host and
read before it landed, or a reduction in the wrong stream order passes every other test. The
first run of the one CUDA test the suite had failed (its targets stayed on the CPU).

Run it on a machine with a GPU (about 1-2 minutes):

    python -m pytest -m cuda tests/cuda

Without CUDA every test here is skipped. ``CS_CUDA_SUITE_DEVICE=cpu python -m pytest tests/cuda``
runs the same tests on the CPU over gloo (the dry run that proves their logic; the NCCL test is
skipped there, NCCL needs CUDA).

References: single-process training on the CPU in float32 (issue 56's GPU run agreed with it
within 1e-6; the checks allow 1e-5, with TF32 kept off); for bf16 compute, a local model doing
exactly the library's casts on the same device (a bf16 copy of the fp32 weights computes each
rank's rows, the bf16 gradients are averaged in float32): an independent reference with the
same roundings, where torch FSDP2 would add its own gloo-over-CUDA collectives to what is
checked. Collectives are counted in forward only: autograd runs a CUDA backward on its own
thread, which ``record_collectives`` (per thread) does not see; backward prefetch order stays
with the CPU tests (tests/distributed/test_fully_shard_runtime.py), its stream waits are checked
here by the numbers.
"""

from __future__ import annotations

import copy
import os
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import (BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy, checkpoint,
                              clip_grad_norm_, fully_shard, get_model_state_dict, get_optimizer_state_dict,
                              load_checkpoint, replicate, save_checkpoint, set_model_state_dict, unshard_params)
from composable_shard._runtime.collectives import CollectiveRecorder, record_collectives
from composable_shard._runtime.traversal import _get_fsdp_handles
from tests._harness import run_distributed, run_subtests
from tests._models import (Named, ParityModel, assert_grads_relative, assert_losses_close, assert_params_close,
                           batch, global_mean, local_rows, loss_fn, make_model, zip_same)
from tests.distributed.test_cpu_offload import _offload_subtest

DEVICE_ENV = "CS_CUDA_SUITE_DEVICE"


def _suite_device() -> torch.device:
    """``cuda`` (the default: ``cuda:0``) or ``cpu`` (the dry run of the same tests)."""
    name = os.environ.get(DEVICE_ENV, "cuda")
    if name not in ("cuda", "cpu"):
        raise ValueError(f"{DEVICE_ENV}={name!r}: expected 'cuda' (the default, cuda:0) or 'cpu' (a dry run on the CPU)")
    return torch.device("cuda", 0) if name == "cuda" else torch.device("cpu")


DEVICE = _suite_device()
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (torch.cuda.is_available() is False): run `python -m pytest -m cuda "
                              f"tests/cuda` on a GPU machine, or `{DEVICE_ENV}=cpu python -m pytest tests/cuda` for "
                              "the dry run on the CPU"),
]

STEPS = 3  # step 0 records the order; steps 1 and 2 prefetch from it
LR = 0.1  # plain SGD: a wrong gradient scale moves the parameters (Adam would hide it)
ATOL = 1e-5  # float32, GPU against CPU
S = ShardingStrategy
# Hand-counted at W = 2 from tests/_models.py (ParityModel, blocks then the root annotated):
# a block's 12 + 49 + 48 = 109 elements pad to 110, 55 per rank; the root holds the tied
# embedding/head (78) + scale (1) trainable, 40 per rank, and the frozen Linear (42), 21 per
# rank. float32: 4 bytes an element. Each is gathered once in every forward.
FORWARD_GATHERS_W2 = {("", 4 * 40), ("", 4 * 21), ("blocks.0", 4 * 55), ("blocks.1", 4 * 55)}


# ---------------------------------------------------------------------------- shared pieces
def _exact_float32() -> None:
    """float32 matmuls in float32, whatever the environment asks (TF32 is ~1e-3 off, the
    parity checks allow 1e-5). Called first in each rank, before its first matmul reads the
    cuBLAS override (some GPU images set it)."""
    os.environ.pop("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", None)
    torch.set_float32_matmul_precision("highest")


def _rows(step: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's inputs and targets of ``step`` on ``device`` (the logits land there)."""
    rank = dist.get_rank()
    inputs, targets = batch(step, dist.get_world_size())
    return local_rows(inputs, rank).to(device), local_rows(targets, rank).to(device)


def _full_grads(model: nn.Module) -> Named:
    """Every full gradient, on the CPU (parameters without one left out)."""
    with unshard_params(model, with_grads=True, writeback=False):
        return [(n, p.grad.detach().cpu().clone()) for n, p in model.named_parameters() if p.grad is not None]


def _full_params(model: nn.Module) -> Named:
    with unshard_params(model, writeback=False):
        return [(n, p.detach().cpu().clone()) for n, p in model.named_parameters()]


@dataclass(frozen=True)
class _Reference:
    """Single-process SGD on the combined batch, on the CPU: losses, the gradients of every
    backward (after clipping, if any), the total norms clipped by and the final parameters."""

    losses: List[float]
    grads: List[Named]
    norms: List[float]
    params: Named


def _reference(clip: Optional[float]) -> _Reference:
    model = make_model()
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    losses: List[float] = []
    grads: List[Named] = []
    norms: List[float] = []
    for step in range(STEPS):
        inputs, targets = batch(step, dist.get_world_size())
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            assert norms[-1] > 1.5 * clip, f"the reference's norm {norms[-1]} would not be clipped by {clip}"
        grads.append([(n, p.grad.detach().clone()) for n, p in model.named_parameters() if p.grad is not None])
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return _Reference(losses, grads, norms, [(n, p.detach().clone()) for n, p in model.named_parameters()])


def _check_state_after_backward(model: ParityModel, device: torch.device, what: str) -> None:
    """Where things are once backward returned: every parameter and gradient on ``device`` in
    float32, the frozen Linear without a gradient, every handle resharded with its unsharded
    storage freed (or aliasing its shard: a shard group of one rank) and no gather pending."""
    for name, p in model.named_parameters():
        assert p.device == device and p.dtype == torch.float32, f"{what} {name}: {p.dtype} on {p.device}"
        if p.grad is not None:
            assert p.grad.device == device and p.grad.dtype == torch.float32, \
                f"{what} {name}.grad: {p.grad.dtype} on {p.grad.device}"
    assert model.frozen.weight.grad is None, f"{what} the frozen Linear got a gradient"
    for handle in _get_fsdp_handles(model):
        assert not handle.is_unsharded and handle.unsharded_storage_freed(), \
            f"{what} handle {handle.fqn!r} still unsharded after backward"
        assert all(g.pending_unshard is None for g in handle.groups), f"{what} {handle.fqn!r}: a gather still pending"


def _train_and_compare(model: ParityModel, device: torch.device, expected: _Reference, what: str,
                       clip: Optional[float] = None,
                       on_forward: Callable[[int, CollectiveRecorder], None] = lambda step, rec: None) -> None:
    """SGD on this rank's rows: after every backward the (clipped) full gradients, the total
    norm and where everything is; every step's global loss; at the end the parameters: all
    against ``expected``. ``on_forward(step, recorder)`` sees the collectives and hooks of
    each forward."""
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        inputs, targets = _rows(step, device)
        with record_collectives() as rec:  # the forward runs on this thread (a CUDA backward does not)
            logits = model(inputs)
        on_forward(step, rec)
        assert logits.device == device, f"{what} logits on {logits.device}"
        loss = loss_fn(logits, targets)
        loss.backward()
        if clip is not None:
            total = clip_grad_norm_(model, clip)
            assert total.device == device, f"{what} total norm on {total.device}"
            assert abs(total.item() - expected.norms[step]) <= 1e-5 * expected.norms[step], \
                f"{what} step {step}: total norm {total.item()} != one process's {expected.norms[step]}"
        _check_state_after_backward(model, device, f"{what} step {step}")
        assert_params_close(_full_grads(model), expected.grads[step], atol=ATOL, what=f"{what} step {step} grads")
        optim.step()
        optim.zero_grad()
        losses.append(global_mean(loss))
    assert_losses_close(losses, expected.losses, atol=ATOL, what=what)
    assert_params_close(_full_params(model), expected.params, atol=ATOL, what=f"{what} trained")


# ---------------------------------------------------------------------------- strategies and prefetch
# name -> (strategy, (shard group, replicate group) ranks at W = 2 for the hybrid ones)
_STRATEGIES: Dict[str, Tuple[ShardingStrategy, Optional[Tuple[List[List[int]], List[List[int]]]]]] = {
    "FULL_SHARD": (S.FULL_SHARD, None),
    "SHARD_GRAD_OP": (S.SHARD_GRAD_OP, None),
    "NO_SHARD": (S.NO_SHARD, None),
    "HYBRID_SHARD shard 2 x replicate 1": (S.HYBRID_SHARD, ([[0, 1]], [[0], [1]])),
    "HYBRID_SHARD shard 1 x replicate 2": (S.HYBRID_SHARD, ([[0], [1]], [[0, 1]])),
}
_PREFETCH: Dict[str, Dict[str, Any]] = {
    "prefetch": {"forward_prefetch": True, "backward_prefetch": BackwardPrefetch.BACKWARD_PRE},
    "no prefetch": {"forward_prefetch": False, "backward_prefetch": None},
}


def _groups(shard: List[List[int]], across: List[List[int]]) -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
    shard_group, _ = dist.new_subgroups_by_enumeration(shard)
    replicate_group, _ = dist.new_subgroups_by_enumeration(across)
    return shard_group, replicate_group


def _forward_gathers_check(gathers: bool, prefetch: bool, what: str) -> Callable[[int, CollectiveRecorder], None]:
    """Each forward gathers every flat parameter once, with the bytes counted by hand
    (``FORWARD_GATHERS_W2``), or nothing where the shard group is one rank; with forward
    prefetch, from step 1 on (the order is recorded by step 0) each block's gather is issued
    before its own pre-forward (by the handle before it), without it only at that pre-forward."""
    def check(step: int, rec: CollectiveRecorder) -> None:
        seen = sorted((r.tag, r.nbytes) for r in rec.records if r.kind == "all_gather")
        if not gathers:
            assert not seen, f"{what} step {step}: a shard group of one rank gathered {seen}"
            return
        assert seen == sorted(FORWARD_GATHERS_W2), f"{what} step {step}: forward gathers {seen}, by hand " \
                                                   f"{sorted(FORWARD_GATHERS_W2)}"
        events = rec.events
        for i in (0, 1):
            gather = events.index(("collective", "all_gather", f"blocks.{i}"))
            enter = events.index(("trace", "pre_forward", f"blocks.{i}"))
            assert (gather < enter) == (prefetch and step > 0), \
                f"{what} step {step}: blocks.{i} gathered {'before' if gather < enter else 'after'} its pre_forward: {events}"

    return check


def _strategy_subtest(strategy: str, prefetch: str, device: torch.device, expected: _Reference) -> None:
    kind, pairs = _STRATEGIES[strategy]
    what = f"[{strategy}/{prefetch}]"
    kwargs: Dict[str, Any] = {"strategy": kind, "device_id": device, **_PREFETCH[prefetch]}
    if pairs is not None:
        kwargs["process_group"] = _groups(*pairs)
    model = make_model()  # built on the CPU: device_id moves it
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    gathers = kind in (S.FULL_SHARD, S.SHARD_GRAD_OP) or (pairs is not None and len(pairs[0][0]) == 2)
    _train_and_compare(model, device, expected, what,
                       on_forward=_forward_gathers_check(gathers, prefetch == "prefetch", what))


def _strategies(device_name: str) -> None:
    device = torch.device(device_name)
    _exact_float32()
    expected = _reference(clip=None)
    run_subtests(_strategy_subtest, {"strategy": list(_STRATEGIES), "prefetch": list(_PREFETCH)},
                 device=device, expected=expected)


def test_cuda_strategies_and_prefetch_match_local_training() -> None:
    """W = 2 on one device: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD and HYBRID_SHARD (shard 2 x
    replicate 1 and shard 1 x replicate 2), each with prefetch (forward, BACKWARD_PRE) and
    without: every backward's gradients, every loss and the SGD-trained parameters equal local
    training; after every backward parameters and gradients are float32 on the device, every
    handle resharded; forward gathers issued ahead with prefetch, not without, with the bytes
    counted by hand. Without it a prefetched gather the compute stream does not wait for (a
    race only a GPU has) or a wrong divisor for one group shape trains silently wrong."""
    run_distributed(_strategies, 2, str(DEVICE), timeout=240)


# ---------------------------------------------------------------------------- compositions and clipping
CLIP = 0.25  # below every step's total norm of the reference (checked there), so clipping scales


class _Calls:
    """Counts the forwards of a module (with ``checkpoint``: the forward and its recomputation)."""

    def __init__(self, module: nn.Module) -> None:
        self.count = 0
        module.register_forward_hook(self._seen)

    def _seen(self, module: nn.Module, args: Any, output: Any) -> None:
        self.count += 1


def _compose(model: ParityModel, recipe: str) -> None:
    if recipe == "checkpoint":
        for block in model.blocks:
            checkpoint(block)
            fully_shard(block)
        fully_shard(model)
    elif recipe == "replicate":
        replicate(model)
    elif recipe == "replicate block + fully_shard rest":
        replicate(model.blocks[0])
        fully_shard(model.blocks[1])
        fully_shard(model)
    elif recipe == "fully_shard blocks + replicate root":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model.scale)
        replicate(model)
    elif recipe == "NO_SHARD block + FULL_SHARD rest":
        fully_shard(model.blocks[0], strategy=S.NO_SHARD)
        fully_shard(model.blocks[1])
        fully_shard(model)
    else:
        raise ValueError(recipe)


def _compose_subtest(case: Tuple[str, Optional[float]], device: torch.device,
                     references: Dict[Optional[float], _Reference]) -> None:
    recipe, clip = case
    what = f"[{recipe}{'' if clip is None else f' + clip_grad_norm_({clip})'}]"
    model = make_model().to(device)  # FSDP2's flow: on the device first, then the APIs
    calls = _Calls(model.blocks[0].get_submodule("fc1"))
    _compose(model, recipe)
    _train_and_compare(model, device, references[clip], what, clip=clip)
    # the forward of every step, and with checkpoint its recomputation in backward
    assert calls.count == STEPS * (2 if recipe == "checkpoint" else 1), f"{what} blocks.0.fc1 ran {calls.count} times"


_COMPOSITIONS: List[Tuple[str, Optional[float]]] = [  # (recipe, max norm to clip at, or None)
    ("checkpoint", None), ("replicate", None), ("replicate block + fully_shard rest", None),
    ("fully_shard blocks + replicate root", None), ("checkpoint", CLIP), ("replicate block + fully_shard rest", CLIP),
    ("NO_SHARD block + FULL_SHARD rest", CLIP)]


def _compositions(device_name: str) -> None:
    device = torch.device(device_name)
    _exact_float32()
    references = {None: _reference(clip=None), CLIP: _reference(clip=CLIP)}
    run_subtests(_compose_subtest, {"case": _COMPOSITIONS}, device=device, references=references)


def test_cuda_checkpoint_replicate_mixed_apis_and_clip_match_local_training() -> None:
    """W = 2 on one device: the library's ``checkpoint`` on fully sharded blocks (the forward
    recomputed in backward), ``replicate`` alone, ``replicate`` on a block with ``fully_shard``
    on the rest, fully sharded blocks under a replicated root; the library's ``clip_grad_norm_``
    (at a max norm below every step's total) on checkpointed blocks, on replicate + fully_shard
    and on NO_SHARD + FULL_SHARD: the total norm of every step equals one process's (torch's
    clip on the whole model), and every clipped gradient, loss and trained parameter equals
    local training's. Without it a norm summed over the wrong group, a gradient reduced by two
    APIs or by none, or a recomputation on freed parameters goes unnoticed on the GPU."""
    run_distributed(_compositions, 2, str(DEVICE), timeout=240)


# ---------------------------------------------------------------------------- CPU offload and bf16
BF16_RTOL = 1e-2  # of max |grad| per tensor: a gradient off by 1.5x misses by 50x


def _bf16_reference(device: torch.device) -> Tuple[List[Named], Named]:
    """The library's casts done by hand on ``device``: fp32 master weights; for each rank's
    rows a bf16 copy of them computes forward and backward; the bf16 gradients are averaged in
    float32; SGD on the fp32 weights. Returns the gradients of every step and the final weights."""
    world_size = dist.get_world_size()
    master = make_model().to(device)
    optim = torch.optim.SGD(master.parameters(), lr=LR)
    grads: List[Named] = []
    for step in range(STEPS):
        inputs, targets = batch(step, world_size)
        summed: Dict[str, torch.Tensor] = {}
        for rank in range(world_size):
            low = copy.deepcopy(master).to(torch.bfloat16)  # deepcopy keeps the tied weight tied
            loss_fn(low(local_rows(inputs, rank).to(device)), local_rows(targets, rank).to(device)).backward()
            for name, p in low.named_parameters():
                if p.grad is not None:
                    summed[name] = summed.get(name, torch.zeros_like(p, dtype=torch.float32)) + p.grad.float()
        for name, p in master.named_parameters():
            p.grad = summed[name] / world_size if name in summed else None
        grads.append([(n, p.grad.detach().cpu().clone()) for n, p in master.named_parameters() if p.grad is not None])
        optim.step()
        optim.zero_grad()
    return grads, [(n, p.detach().cpu().clone()) for n, p in master.named_parameters()]


def _not_bf16(grads: Named) -> float:
    """The fraction of gradient elements no bfloat16 can hold. The mean over two ranks of bf16
    gradients, summed in float32, needs up to 9 significant bits; a sum rounded in bf16 (a
    reduction in bf16) has 8, so none of its elements would count."""
    total = sum(g.numel() for _, g in grads)
    wide = sum(int((g.to(torch.bfloat16).float() != g).sum()) for _, g in grads)
    return wide / total


def _bf16(device: torch.device) -> None:
    """``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)``, FULL_SHARD: modules compute in
    bf16; the gradients of every backward match the by-hand casts within BF16_RTOL and hold
    float32 sums (the reduction was not in bf16); shards, gradients and parameters stay fp32."""
    expected_grads, expected_params = _bf16_reference(device)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = make_model()
    for block in model.blocks:
        fully_shard(block, mixed_precision=mp, device_id=device)
    fully_shard(model, mixed_precision=mp, device_id=device)
    seen: List[torch.dtype] = []
    model.blocks[1].get_submodule("fc2").register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        inputs, targets = _rows(step, device)
        logits = model(inputs)
        assert logits.dtype == torch.bfloat16 and seen[-1] == torch.bfloat16, \
            f"[bf16] step {step}: logits {logits.dtype}, blocks.1.fc2 computed in {seen[-1]}"
        loss_fn(logits, targets).backward()
        _check_state_after_backward(model, device, f"[bf16] step {step}")
        grads = _full_grads(model)
        assert_grads_relative(grads, expected_grads[step], rtol=BF16_RTOL, what=f"[bf16] step {step}")
        wide = _not_bf16(grads)
        assert wide > 0.25, f"[bf16] step {step}: only {wide:.1%} of the gradient elements are wider than bf16: " \
                            "the reduction ran in bf16, not in reduce_dtype=float32"
        optim.step()
        optim.zero_grad()
    assert_params_close(_full_params(model), expected_params, atol=LR * STEPS * BF16_RTOL, what="[bf16] trained")


def _offload_and_bf16(device_name: str) -> None:
    _exact_float32()
    device = torch.device(device_name)
    run_subtests(_offload_subtest, {"strategy": [S.FULL_SHARD, S.SHARD_GRAD_OP, S.NO_SHARD]}, device=device)
    _bf16(device)


def test_cuda_cpu_offload_and_bf16_match_local_training() -> None:
    """W = 2 on one device. ``CPUOffload(offload_params=True)`` with compute on the device
    (tests/distributed/test_cpu_offload.py's subtests: pinned CPU shards, gradients copied back
    without waiting and landed at the end of backward, the optimizer on the CPU) under
    FULL_SHARD, SHARD_GRAD_OP and NO_SHARD. bf16 compute with fp32 reduction against the same
    casts done by hand. Without it a gradient read on the host before its copy landed, or a
    reduction in bf16, trains silently differently on a GPU only."""
    run_distributed(_offload_and_bf16, 2, str(DEVICE), timeout=240)


# ---------------------------------------------------------------------------- state dicts and checkpoints
def _layout(model: ParityModel, layout: str, device: torch.device) -> ParityModel:
    if layout == "FULL_SHARD":
        for block in model.blocks:
            fully_shard(block, device_id=device)
        fully_shard(model, device_id=device)
    elif layout == "replicate block + fully_shard rest":
        model.to(device)
        replicate(model.blocks[0])
        fully_shard(model.blocks[1])
        fully_shard(model)
    elif layout == "CPUOffload":
        for block in model.blocks:
            fully_shard(block, device_id=device, cpu_offload=CPUOffload(offload_params=True))
        fully_shard(model, device_id=device, cpu_offload=CPUOffload(offload_params=True))
    else:
        raise ValueError(layout)
    return model


def _adamw_steps(model: nn.Module, optim: torch.optim.Optimizer, steps: range, device: torch.device) -> Tuple[List[float], List[Named]]:
    losses, grads = [], []
    for step in steps:
        inputs, targets = _rows(step, device)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        grads.append(_full_grads(model))
        optim.step()
        optim.zero_grad()
        losses.append(global_mean(loss))
    return losses, grads


def _cpu_state(state: Dict[str, Any]) -> Named:
    """A full state dict's entries, copied to the CPU."""
    return [(k, v.detach().cpu().clone()) for k, v in state.items()]


def _state_dict_subtest(layout: str, device: torch.device, path: str) -> None:
    """Full and sharded model state dicts after two AdamW steps, loaded into differently
    initialized models; then ``save_checkpoint`` at step 2 and ``load_checkpoint`` into a fresh
    model and optimizer (its learning rate changed before the save, as a schedule would): the
    resumed steps 2-4 equal the run that went on."""
    world_size = dist.get_world_size()
    what = f"[{layout}]"
    reference = make_model()
    optim_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(2):
        inputs, targets = batch(step, world_size)
        loss_fn(reference(inputs), targets).backward()
        optim_ref.step()
        optim_ref.zero_grad()
    live = _layout(make_model(), layout, device)
    optim = torch.optim.AdamW(live.parameters(), lr=1e-2)
    _adamw_steps(live, optim, range(2), device)

    full = get_model_state_dict(live)
    assert list(full) == list(reference.state_dict()), f"{what} full state dict keys {list(full)}"
    assert_params_close(_cpu_state(full), [(k, v) for k, v in reference.state_dict().items()], atol=ATOL,
                        what=f"{what} full state dict")
    sharded = get_model_state_dict(live, full=False)
    for source, seed in ((full, 7), (sharded, 9)):
        other = _layout(make_model(seed), layout, device)
        set_model_state_dict(other, source)
        assert_params_close(_cpu_state(get_model_state_dict(other)), _cpu_state(full), atol=0.0,
                            what=f"{what} loaded from the {'full' if source is full else 'sharded'} state dict")

    for group in optim.param_groups:  # as a schedule would: the resumed optimizer must take it from the checkpoint
        group["lr"] = 5e-3
    directory = os.path.join(path, layout.replace(" ", "_").replace("+", "and"))
    save_checkpoint(directory, live, optim, extra={"step": 2})
    went_on = _adamw_steps(live, optim, range(2, 5), device)
    resumed = _layout(make_model(seed=5), layout, device)
    optim_resumed = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    extra = load_checkpoint(directory, resumed, optim_resumed)
    assert extra == {"step": 2}, f"{what} extra {extra}"
    assert [g["lr"] for g in optim_resumed.param_groups] == [5e-3], f"{what} resumed lr {optim_resumed.param_groups}"
    again = _adamw_steps(resumed, optim_resumed, range(2, 5), device)
    assert_losses_close(again[0], went_on[0], atol=ATOL, what=f"{what} resumed")
    for step, (a, e) in enumerate(zip_same(again[1], went_on[1], what=f"{what} resumed steps")):
        assert_params_close(a, e, atol=ATOL, what=f"{what} resumed step {2 + step} grads")
    assert_params_close(_full_params(resumed), _full_params(live), atol=ATOL, what=f"{what} resumed, trained")
    moments = [get_optimizer_state_dict(m, o)["state"] for m, o in ((resumed, optim_resumed), (live, optim))]
    assert sorted(moments[0]) == sorted(moments[1]) and moments[0], f"{what} optimizer state keys differ"
    for fqn in moments[1]:
        for key in ("exp_avg", "exp_avg_sq"):
            assert_params_close([(fqn, moments[0][fqn][key].cpu())], [(fqn, moments[1][fqn][key].cpu())], atol=ATOL,
                                what=f"{what} resumed {key}")


def _state_dicts(device_name: str, path: str) -> None:
    _exact_float32()
    run_subtests(_state_dict_subtest, {"layout": ["FULL_SHARD", "replicate block + fully_shard rest", "CPUOffload"]},
                 device=torch.device(device_name), path=path)


def test_cuda_state_dicts_and_checkpoint_round_trip(tmp_path: Any) -> None:
    """W = 2 on one device, FULL_SHARD, replicate + fully_shard and CPUOffload: the full state
    dict after two AdamW steps equals local training's (keys of a plain model); full and
    sharded state dicts load into models initialized otherwise, exactly; a ``save_checkpoint``
    at step 2 loaded by ``load_checkpoint`` into a fresh model and optimizer resumes as the run
    that went on (losses, every gradient, parameters, AdamW moments within 1e-5; the learning
    rate and ``extra`` saved with it).
    Without it device shards written or read on the wrong device, or a resume that drifts, go
    unnoticed on a GPU."""
    run_distributed(_state_dicts, 2, str(DEVICE), str(tmp_path), timeout=240)


# ---------------------------------------------------------------------------- no CPU-GPU sync (NCCL)
WARMUP, MEASURED = 2, 2
SYNC_CLIP = 0.5  # below every step's total norm at W = 1 (checked in _sync_reference), so clipping scales


def _sync_model(config: str, device: torch.device) -> ParityModel:
    model = make_model().to(device)
    if config in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "no prefetch", "checkpoint", "bf16"):
        kwargs: Dict[str, Any] = {}
        if config in ("SHARD_GRAD_OP", "NO_SHARD"):
            kwargs["strategy"] = ShardingStrategy[config]
        if config == "no prefetch":
            kwargs.update(_PREFETCH["no prefetch"])
        if config == "bf16":
            kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            if config == "checkpoint":
                checkpoint(block)
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    elif config == "replicate":
        replicate(model)
    elif config == "replicate block + fully_shard rest":
        replicate(model.blocks[0])
        fully_shard(model.blocks[1])
        fully_shard(model)
    else:
        raise ValueError(config)
    return model


def _sync_optimizer(params: Any) -> torch.optim.Optimizer:
    """SGD with momentum: optimizer state as in real training, and numerics linear in the
    gradients (Adam would turn a 1e-7 difference of a near-zero gradient into a step of ``lr``)."""
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _sync_reference() -> Tuple[List[Named], Named]:
    """Local training doing the steps of ``_no_sync_subtest`` (W = 1: the rank's rows are the
    batch), on the CPU: the clipped gradients of every step and the final parameters."""
    model = make_model()
    optim = _sync_optimizer(model.parameters())
    grads: List[Named] = []
    for index in range(WARMUP + MEASURED):
        inputs, targets = batch(index, 1)
        loss_fn(model(inputs), targets).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), SYNC_CLIP))
        assert norm > 1.5 * SYNC_CLIP, f"the reference's norm {norm} would not be clipped by {SYNC_CLIP}"
        grads.append([(n, p.grad.detach().clone()) for n, p in model.named_parameters() if p.grad is not None])
        optim.step()
        optim.zero_grad()
    return grads, [(n, p.detach().clone()) for n, p in model.named_parameters()]


def _no_sync_subtest(config: str, device: torch.device) -> None:
    """Two warm-up steps (lazy init, the recorded order, the optimizer's state; the first one's
    gradients checked), then MEASURED steps -- forward, backward, the library's clip_grad_norm_,
    the optimizer, zero_grad -- under ``torch.cuda.set_sync_debug_mode("error")``; then the
    trained parameters against local training doing the same (float32 configurations; bf16
    is checked by the W = 2 test)."""
    what = f"[{config}]"
    model = _sync_model(config, device)
    optim = _sync_optimizer(model.parameters())
    batches = [_rows(index, device) for index in range(WARMUP + MEASURED)]  # on the device before the steps
    expected_grads, expected_params = _sync_reference()

    def step(index: int) -> None:
        inputs, targets = batches[index]
        loss_fn(model(inputs), targets).backward()
        clip_grad_norm_(model, SYNC_CLIP)
        if index == 0 and config != "bf16":  # reads gradients on the host: never in a measured step
            assert_params_close(_full_grads(model), expected_grads[0], atol=ATOL, what=f"{what} step 0 grads")
        optim.step()
        optim.zero_grad()

    for index in range(WARMUP):
        step(index)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        for index in range(WARMUP, WARMUP + MEASURED):
            try:
                step(index)
            except RuntimeError as e:
                raise AssertionError(f"{what} steady-state step {index} made the CPU wait for the GPU at "
                                     f"{_library_site(e)}: {e}") from e
        if device.type == "cuda":  # the mode was armed: a host read of a device value raises
            with pytest.raises(RuntimeError, match="synchroniz"):
                torch.ones((), device=device).item()
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    if config != "bf16":
        assert_params_close(_full_params(model), expected_params, atol=ATOL, what=f"{what} trained")


_SYNC_CONFIGS = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "no prefetch", "checkpoint", "bf16", "replicate",
                 "replicate block + fully_shard rest"]


def _library_site(error: BaseException) -> str:
    """The innermost library frame of ``error``'s traceback (where it synchronized)."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f"{os.sep}composable_shard{os.sep}" in f.filename]
    return f"{frames[-1].filename.split(os.sep + 'composable_shard' + os.sep)[-1]}:{frames[-1].lineno} " \
           f"({frames[-1].name})" if frames else "a frame outside composable_shard"


def _no_sync(device_name: str) -> None:
    """Every configuration, each failure collected (one GPU run should say every place that
    synchronizes, not only the first), then one error listing them."""
    _exact_float32()
    failures = []
    for config in _SYNC_CONFIGS:
        try:
            _no_sync_subtest(config, torch.device(device_name))
        except AssertionError as e:
            failures.append(str(e).splitlines()[0])
    if failures:
        raise AssertionError(f"{len(failures)} of {len(_SYNC_CONFIGS)} configurations failed:\n" + "\n".join(failures))


@pytest.mark.skipif(DEVICE.type != "cuda", reason=f"NCCL and torch.cuda.set_sync_debug_mode need CUDA "
                                                   f"({DEVICE_ENV}=cpu dry run)")
def test_nccl_steady_state_step_never_waits_for_the_gpu() -> None:
    """One rank over NCCL on ``cuda:0``: after two warm-up steps, a training step (forward,
    backward, ``clip_grad_norm_``, SGD with momentum, ``zero_grad``) of FULL_SHARD, SHARD_GRAD_OP,
    NO_SHARD, no prefetch, ``checkpoint``, bf16, ``replicate`` and replicate + fully_shard
    raises nothing under ``torch.cuda.set_sync_debug_mode("error")``: no library call reads a
    device value on the host (``.item()``, ``.tolist()``, ``torch.tensor(...)`` onto the device,
    a blocking copy), so the CPU runs ahead of the GPU (issue 56, item 1). The mode is checked
    to be armed (a deliberate ``.item()`` raises), and the steps trained as local training.
    ``CPUOffload`` is left out: its CPU optimizer must wait for the gradients' copy to the host."""
    run_distributed(_no_sync, 1, str(DEVICE), backend="nccl", timeout=180)
