"""Gradient clipping on every mix the library allows: the library's ``clip_grad_norm_`` and
torch's (plain and under torch function modes) against torch's clip on one process holding the
whole model ([Note: torch's clip_grad_norm_ on sharded gradients] in ``_runtime/interop.py``).

Without these: the library's clip summed every handle's contribution and all-reduced that sum
over every distinct process group, so a model mixing groups or strategies got a wrong global norm
(7.66 for HYBRID blocks + a FULL root, 6.22 for a NO_SHARD block + a FULL root, against one
process's 4.85); torch's clip under ``torch.set_default_device`` or ``with torch.device(...)``
(a mode's frame between torch's clipping and the check) returned each rank's own norm and each
rank scaled its slices by its own factor; a ``-inf`` norm combined with MAX instead of MIN
would have gone unnoticed (the tests had norms 2, 1 and inf only, on whole models only).

Tolerances, measured in float32 (W = 2 and 4, every configuration, part and clip below, 1100
clips): against the single-process model trained on the combined batch the total norm is off by
at most 1.1e-7 relative (2.4e-7 absolute; the -inf norm, a minimum of about 2e-4, by 2.9e-11)
and every gradient by 2.4e-7 (one float32 rounding of the largest, scale.gain's, about 3). The
checks allow ``rel 1e-5 + abs 1e-6`` on the total and 1e-6 on the gradients. The wrong
combinations seeded in tools/mutants.py miss by far more: -inf combined with MAX gives 1.8e-3
against 1.6e-4 (1700x the allowance); a NO_SHARD block counted once per rank at W = 2 gives
5.66 against 4.99 for the 2-norm (+13%); HYBRID shards combined over the replicate group at
W = 4 gives 3.14 against 3.46 (-9%). With ``param_dtype=bfloat16`` the gradients differ from
float32 training by ~7e-3, which no norm check could tell apart from a wrong combination, so
those configurations compare with torch's clip on one process holding the very gradients the
ranks computed (gathered with ``unshard_params``; measured: identical, 0 difference, for
float32 and for bfloat16 gradients) with the float32 allowance, or for bfloat16 gradients one
bfloat16 rounding (2 ** -7 ~ 7.8e-3 relative: a factor 1.5 still misses by 64x), and check
those gradients against float32 training to 5% of the largest element.
"""

from __future__ import annotations

import copy
import inspect
import math
import pickle
import types
from typing import Any, Callable, Dict, Iterator, List, Set, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from composable_shard import (CPUOffload, MixedPrecision, ShardingStrategy, clip_grad_norm_, fully_shard,
                              replicate)
from composable_shard._runtime.collectives import record_collectives
from tests._harness import run_distributed, run_subtests
from tests._models import (Named, assert_grads_relative, assert_params_close, batch, full_grads, local_rows,
                           loss_fn, make_model, zip_same)

NUM_BLOCKS = 3
NORM_TYPES = [2.0, 1.0, math.inf, -math.inf, 0.0]
CLIPS = ["clip_grad_norm_", "torch", "torch set_default_device", "torch with torch.device", "torch user mode"]
TOTAL_REL, TOTAL_ABS, GRAD_ATOL = 1e-5, 1e-6, 1e-6  # float32 (module docstring)
LOW_PRECISION_RTOL = 2 ** -7  # bfloat16 gradients: two roundings of 2 ** -8 (module docstring)

S = ShardingStrategy
# configuration -> (world sizes, the sizes of the shard groups the clip of the whole model and
# the clip of ``model.blocks`` combine over: one all-reduce each; worked out from the
# annotations in _build: every group of more than one rank holding a sharded parameter with a
# gradient, counted once per group object; a block left unannotated is in the root's handle)
CONFIGS: Dict[str, Tuple[Tuple[int, ...], Callable[[int], Dict[str, List[int]]]]] = {
    "FULL + NO_SHARD": ((2, 4), lambda w: {"model": [w], "blocks": [w]}),
    "FULL + SHARD_GRAD_OP": ((2,), lambda w: {"model": [w], "blocks": [w]}),
    "FULL + two groups": ((2,), lambda w: {"model": [w, w], "blocks": [w]}),
    "FULL + HYBRID_SHARD": ((4,), lambda w: {"model": [2, w], "blocks": [2]}),
    "FULL + _HYBRID_SHARD_ZERO2": ((4,), lambda w: {"model": [2, w], "blocks": [2]}),
    "replicate(head) + FULL": ((2,), lambda w: {"model": [w], "blocks": [w]}),
    "every strategy": ((2, 4), lambda w: {"model": [2, w] if w == 4 else [w, w], "blocks": [2, w] if w == 4 else [w, w]}),
    "bf16 + NO_SHARD": ((2,), lambda w: {"model": [w], "blocks": [w]}),
    "bf16 low-precision grads + NO_SHARD": ((2, 4), lambda w: {"model": [w], "blocks": [w]}),
    "CPU offload + NO_SHARD": ((2,), lambda w: {"model": [w], "blocks": [w]}),
}
# What is clipped: the whole model (its inf norm is the one-element scale.gain's: whole on one
# rank), or only model.blocks, whose largest gradient elements are spread over the ranks' slices
# (summing the ranks' maxima would show), some of them in the root's handle.
PARTS = {"model": CLIPS, "blocks": ["clip_grad_norm_", "torch"]}
OTHER_NORM_TYPES = [3.0, 0.5, -1.0]  # any real order torch takes: on "every strategy" only, with both clips


def _norms_with_clips(part: str, shift: int) -> List[Tuple[float, str]]:
    """Each norm type of NORM_TYPES once, each with one clip of ``part``: the k-th norm type with
    clip ``k + shift``. Every configuration at a W gets its own shift (its place in
    ``_configs(W)``), so each sees every norm type and every clip, and the configurations at W = 2
    (8) and at W = 4 (5) together take every (norm type, clip) pair of each part: what the norm
    type changes (how the ranks' norms combine) and what the clip changes (which of torch's
    functions computes the norms, under which mode) each meet every configuration and each
    other, without the full product per configuration."""
    clips = PARTS[part]
    return [(norm_type, clips[(k + shift) % len(clips)]) for k, norm_type in enumerate(NORM_TYPES)]


def _configs(world_size: int) -> List[str]:
    return [c for c, (sizes, _) in CONFIGS.items() if world_size in sizes]


class _PassingMode(TorchFunctionMode):
    """A user's torch function mode (a profiler, a logger) that passes every call on through a
    helper of its own, so its frames lie between torch's clipping code and the tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return self._call(func, args, kwargs or {})

    def _call(self, func: Any, args: Any, kwargs: Any) -> Any:
        return func(*args, **kwargs)


def _build(config: str, groups: Dict[str, Any]) -> nn.Module:
    """The parity model (tied embedding and head, a frozen layer, a one-element handle) with
    three blocks under ``config``; ``groups``: the process groups made once per rank."""
    model = make_model(num_blocks=NUM_BLOCKS)
    blocks = model.blocks
    if config == "FULL + NO_SHARD":
        fully_shard(blocks[0], strategy=S.NO_SHARD)
    elif config == "FULL + SHARD_GRAD_OP":
        for block in blocks:
            fully_shard(block, strategy=S.SHARD_GRAD_OP)
    elif config == "FULL + two groups":  # the blocks on a second group object of the same ranks
        for block in blocks:
            fully_shard(block, process_group=groups["second"])
    elif config in ("FULL + HYBRID_SHARD", "FULL + _HYBRID_SHARD_ZERO2"):
        for block in blocks:
            fully_shard(block, strategy=ShardingStrategy[config.split(" + ")[1]], mesh=groups["mesh"])
    elif config == "replicate(head) + FULL":
        replicate(model.head)  # the head's weight is the embedding's: whole on every rank
        for block in blocks:
            fully_shard(block)
    elif config == "every strategy":
        if "mesh" in groups:
            fully_shard(blocks[0], strategy=S.HYBRID_SHARD, mesh=groups["mesh"])
        else:
            fully_shard(blocks[0], process_group=groups["second"])
        fully_shard(blocks[1], strategy=S.SHARD_GRAD_OP)
        replicate(blocks[2])
        fully_shard(model.scale, strategy=S.NO_SHARD)
    else:
        kwargs = _precision_and_offload(config)
        fully_shard(blocks[0], strategy=S.NO_SHARD, **kwargs)
        fully_shard(blocks[1], **kwargs)
        fully_shard(blocks[2], **kwargs)
        return fully_shard(model, **kwargs)
    return fully_shard(model)


def _precision_and_offload(config: str) -> Dict[str, Any]:
    if config == "bf16 + NO_SHARD":
        return {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)}
    if config == "bf16 low-precision grads + NO_SHARD":
        return {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True)}
    if config == "CPU offload + NO_SHARD":
        return {"cpu_offload": CPUOffload(offload_params=True)}
    raise ValueError(f"unknown configuration {config!r}")


def _part(model: nn.Module, part: str) -> nn.Module:
    return model if part == "model" else model.blocks  # type: ignore[return-value]  # a ModuleList


def _torch_clip(clip: str, parameters: List[nn.Parameter], max_norm: float, norm_type: float) -> torch.Tensor:
    """torch's clip_grad_norm_ as ``clip`` names it: plain, or under a torch function mode."""
    if clip == "torch":
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)
    if clip == "torch set_default_device":
        torch.set_default_device("cpu")
        try:
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)
        finally:
            torch.set_default_device(None)
    if clip == "torch with torch.device":  # one norm per gradient (torch.linalg.vector_norm)
        with torch.device("cpu"):
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, foreach=False)
    mode = _PassingMode()
    with torch.device("cpu"), mode:  # two modes, the user's inside torch's
        total = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)
    assert mode.calls > 0, "the user's mode never saw torch's clipping"
    return total


_ONE_PROCESS: Dict[torch.dtype, nn.Module] = {}  # per rank: the one-process models, built once per dtype


def _clipped_copy(grads: Named, part: str, norm_type: float, max_norm: float,
                  dtype: torch.dtype) -> Tuple[float, torch.dtype, Named]:
    """torch's clip_grad_norm_ on one process: a copy of the model in ``dtype`` holding
    ``grads`` (copies: every gradient is set afresh, clipping changes only them), ``part`` of
    it clipped; returns the total norm, its dtype and every gradient."""
    if dtype not in _ONE_PROCESS:
        _ONE_PROCESS[dtype] = make_model(num_blocks=NUM_BLOCKS).to(dtype)
    model = _ONE_PROCESS[dtype]
    by_name = dict(grads)
    for name, p in model.named_parameters():
        p.grad = by_name[name].to(dtype, copy=True) if name in by_name else None
    total = torch.nn.utils.clip_grad_norm_(_part(model, part).parameters(), max_norm, norm_type)
    return float(total), total.dtype, [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]


def _clip_case(norm_type: float, clip: str, part: str, model: nn.Module, config: str,
               saved: List[Tuple[torch.Tensor, torch.Tensor]], expected_grads: Named, low_precision: bool) -> None:
    """One clip of the gradients of one backward (restored in place first): the total norm on
    every rank is one process's, so are the clipped gradients, and the clip issued one
    all-reduce per shard group, over groups of the expected sizes."""
    world_size = dist.get_world_size()
    what = f"[{config}, {part}, norm {norm_type}, {clip}, W={world_size}, rank {dist.get_rank()}]"
    dtype = torch.bfloat16 if low_precision else torch.float32
    unclipped_total, _, _ = _clipped_copy(expected_grads, part, norm_type, math.inf, dtype)
    max_norm = unclipped_total / 4  # every norm type is really clipped (the -inf norm is about 2e-4)
    expected_total, expected_dtype, expected = _clipped_copy(expected_grads, part, norm_type, max_norm, dtype)
    for grad, value in saved:
        grad.copy_(value)
    with record_collectives() as recorder:
        if clip == "clip_grad_norm_":
            total = clip_grad_norm_(_part(model, part), max_norm, norm_type)
        else:
            total = _torch_clip(clip, list(_part(model, part).parameters()), max_norm, norm_type)
    group_sizes = CONFIGS[config][1](world_size)[part]
    reduced = sorted(r.group_size for r in recorder.records if r.tag == "clip_grad_norm")
    assert reduced == sorted(group_sizes), f"{what} clip all-reduces over groups of sizes {reduced}, expected {group_sizes}"
    assert type(total) is torch.Tensor and total.dtype == expected_dtype, f"{what} {type(total)} {total.dtype}"
    if low_precision:
        assert abs(float(total) - expected_total) <= LOW_PRECISION_RTOL * abs(expected_total), \
            f"{what} total norm {float(total)}, one process {expected_total}"
        assert_grads_relative(full_grads(model), expected, LOW_PRECISION_RTOL, what=f"{what} clipped grads")
        return
    assert math.isclose(float(total), expected_total, rel_tol=TOTAL_REL, abs_tol=TOTAL_ABS), \
        f"{what} total norm {float(total)}, one process {expected_total}"
    assert_params_close(full_grads(model), expected, atol=GRAD_ATOL, what=f"{what} clipped grads")


def _assert_low_precision_grads(actual: Named, expected: Named, what: str) -> None:
    """bfloat16-computed gradients are float32 training's up to bfloat16 rounding: off by at most
    5% of the largest gradient element of the model (measured 0.7%; per tensor, a small one like
    a LayerNorm weight's is off by up to 19% of its own largest element)."""
    names = [n for n, _ in actual]
    assert names == [n for n, _ in expected], f"{what}: {names}"
    diff = max(float((a.float() - e.float()).abs().max()) for (_, a), (_, e) in zip_same(actual, expected))
    scale = max(float(e.float().abs().max()) for _, e in expected)
    assert diff <= 0.05 * scale, f"{what}: bfloat16 gradients off by {diff}, more than 5% of the largest {scale}"


def _config_case(config: str, reference_grads: Named, groups: Dict[str, Any]) -> None:
    """One backward on the configuration, then every norm type and clip on its gradients."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _build(config, groups)
    inputs, targets = batch(0, world_size)
    loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank)).backward()
    saved = [(p.grad, p.grad.detach().clone()) for p in model.parameters() if p.grad is not None]
    gathered = full_grads(model)
    if config.startswith("bf16"):  # compare with one process holding these gradients
        _assert_low_precision_grads(gathered, reference_grads, what=config)
        expected_grads = gathered
    else:
        assert_params_close(gathered, reference_grads, atol=GRAD_ATOL, what=f"{config} gradients")
        expected_grads = reference_grads
    low_precision = "low-precision grads" in config
    assert all((g.dtype == torch.bfloat16) == low_precision for _, g in saved), config
    shift = _configs(world_size).index(config)
    for part, clips in PARTS.items():
        cases = _norms_with_clips(part, shift)
        if config == "every strategy" and part == "blocks":
            cases += [(norm_type, clip) for norm_type in OTHER_NORM_TYPES for clip in clips]
        run_subtests(_paired_clip_case, {"norm_and_clip": cases}, part=part, model=model, config=config,
                     saved=saved, expected_grads=expected_grads, low_precision=low_precision)


def _paired_clip_case(norm_and_clip: Tuple[float, str], **kwargs: Any) -> None:
    _clip_case(*norm_and_clip, **kwargs)


def _clip_entry() -> None:
    world_size = dist.get_world_size()
    reference = make_model(num_blocks=NUM_BLOCKS)
    inputs, targets = batch(0, world_size)
    loss_fn(reference(inputs), targets).backward()
    reference_grads = [(n, p.grad.detach().clone()) for n, p in reference.named_parameters() if p.grad is not None]
    groups: Dict[str, Any] = {"second": dist.new_group(list(range(world_size)))}
    if world_size == 4:
        from torch.distributed.device_mesh import init_device_mesh
        groups["mesh"] = init_device_mesh("cpu", (2, 2))
    run_subtests(_config_case, {"config": _configs(world_size)}, reference_grads=reference_grads, groups=groups)


def test_clip_grad_norm_is_one_process_on_every_mix_2() -> None:
    """W = 2: NO_SHARD, SHARD_GRAD_OP, a second group, replicate(head), every strategy in one
    model, bf16 (also with low-precision gradients) and CPU offload, each with a FULL root; norms
    2, 1, inf, -inf, 0 (and 3, 0.5, -1 once); the library's clip and torch's, plain, under
    set_default_device, in a ``with torch.device`` (one norm per gradient) and under a user's
    mode; of the whole model and of ``model.blocks`` only. Each configuration takes every norm
    type and every clip, paired (``_norms_with_clips``); all configurations together every pair."""
    run_distributed(_clip_entry, 2, timeout=180)


def test_clip_grad_norm_is_one_process_on_every_mix_4() -> None:
    """W = 4: HYBRID_SHARD and _HYBRID_SHARD_ZERO2 blocks on a 2 x 2 mesh (shard groups of two
    ranks, replicated across the other two), NO_SHARD, every strategy, bf16 gradients."""
    run_distributed(_clip_entry, 4, timeout=240)


# ------------------------------------------------------------------- norms outside clipping
def _norms_outside_clipping() -> None:
    """Norms of sharded gradients that torch's total-norm recipe does not combine stay this rank's
    and issue no collective, under modes too: rank 0 alone takes them with a mode active, uses
    them in arithmetic, stacks and sums them, pickles and copies one, and inside a generator of
    parameters that torch's clip_grad_norm_ consumes; only the vector norm of the stacked norms
    (torch's recipe, every rank) combines, with one all-reduce. Without this a logging
    ``p.grad.norm()`` on rank 0 would wait for ranks that never take it (a hang), or a norm used
    for anything else would silently be another rank's number."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_model(num_blocks=NUM_BLOCKS)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    inputs, targets = batch(0, world_size)
    loss_fn(model(local_rows(inputs, rank)), local_rows(targets, rank)).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    plain = [g.detach().clone().as_subclass(torch.Tensor) for g in grads]
    logged: List[torch.Tensor] = []

    def parameters_logged() -> Iterator[nn.Parameter]:
        for p in model.parameters():
            if rank == 0 and p.grad is not None:
                logged.append(torch.linalg.vector_norm(p.grad))
            yield p

    with record_collectives() as recorder:
        if rank == 0:
            with torch.device("cpu"):
                under_device = [torch.linalg.vector_norm(g) for g in grads]
            with _PassingMode():
                under_user_mode = [torch.linalg.vector_norm(g, 1.0) for g in grads]
            assert all(torch.equal(a, torch.linalg.vector_norm(b)) for a, b in zip_same(under_device, plain))
            assert all(torch.equal(a, torch.linalg.vector_norm(b, 1.0)) for a, b in zip_same(under_user_mode, plain))
            used = [under_device[0] * 2, under_device[0].item(), torch.stack(under_device).sum(),
                    torch.stack(under_device).max(), torch.stack(under_device).norm()]
            expected = torch.stack([torch.linalg.vector_norm(b) for b in plain])
            assert type(used[0]) is torch.Tensor and torch.equal(used[0], expected[0] * 2)
            assert used[1] == expected[0].item()
            assert torch.equal(used[2], expected.sum()) and torch.equal(used[3], expected.max())
            assert torch.equal(used[4], expected.norm()) and type(used[4]) is torch.Tensor
            for copied in (copy.deepcopy(under_device[1]), pickle.loads(pickle.dumps(under_device[1]))):
                assert type(copied) is torch.Tensor and torch.equal(copied, expected[1])
        # every rank: a norm of one logged norm, and of a 2-element slice of a stack, are not torch's total
        one = torch.linalg.vector_norm(grads[0])
        assert torch.equal(torch.linalg.vector_norm(one), torch.linalg.vector_norm(plain[0]).abs())
        pair = torch.stack([torch.linalg.vector_norm(g) for g in grads[:2]])
        assert torch.equal(torch.linalg.vector_norm(pair[:2] * 1), torch.stack([b.norm() for b in plain[:2]]).norm())
        before = len(recorder.records)
        total = torch.nn.utils.clip_grad_norm_(parameters_logged(), 1e9)  # every rank: collective
    assert before == 0, f"norms outside clipping issued {before} collectives"
    if rank == 0:
        assert all(torch.equal(a, torch.linalg.vector_norm(b)) for a, b in zip_same(logged, plain))
    assert len(recorder.records) - before == 1 and type(total) is torch.Tensor
    # The 0-"norm" (torch's recipe: the order-0 vector norm of the per-parameter norms) counts the
    # parameters whose gradient is not zero on some rank: one zeroed on every rank is not counted
    # (every other gradient of this model is nonzero; the frozen layer's is None), by both clips.
    with_grads = [p for p in model.parameters() if p.grad is not None]
    with torch.no_grad():
        zeroed = with_grads[1].grad
        assert zeroed is not None
        zeroed.zero_()
    for name, clip in (("clip_grad_norm_", lambda: clip_grad_norm_(model, 1e9, 0.0)),
                       ("torch", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, 0.0))):
        counted = clip().item()
        assert counted == len(with_grads) - 1, f"{name}: the 0-norm counted {counted}, {len(with_grads) - 1} by hand"


def test_norms_outside_torch_clipping_stay_local_under_modes() -> None:
    run_distributed(_norms_outside_clipping, 2, timeout=60)


# ----------------------------------------------------------------------- torch's total norm
def _names_used(code: types.CodeType) -> Set[str]:
    """Every global and attribute name ``code`` and the code nested in it (comprehensions) use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_used(const)
    return names


def test_torch_total_norm_is_the_norm_of_stacked_norms() -> None:
    """Sharded gradients combine their norms when torch's recipe takes the vector norm of the
    stacked per-gradient norms (``torch.linalg.vector_norm`` or ``torch._foreach_norm`` per
    gradient, then ``torch.stack`` and ``vector_norm``), the one place ``clip_grad_norm_`` and
    ``get_total_norm`` compute the total. A torch that computed it another way (a sum of squares,
    ``torch.norm``) would make its clip silently per-rank again (the distributed tests above would
    fail too; this says why)."""
    total_norm = inspect.unwrap(torch.nn.utils.get_total_norm)
    assert {"vector_norm", "_foreach_norm", "stack"} <= _names_used(total_norm.__code__), _names_used(total_norm.__code__)
    clip = inspect.unwrap(torch.nn.utils.clip_grad_norm_)
    assert total_norm.__name__ in _names_used(clip.__code__), "clip_grad_norm_ no longer calls get_total_norm"
