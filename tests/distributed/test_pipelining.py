"""torch's pipeline schedules over stages whose modules this library manages (issues 43 and 55),
through ``composable_shard.integrations.pipelining.PipelineStage``, at W = 4: 2 pipeline ranks x 2
data-parallel ranks (each stage's modules sharded or replicated over its dp pair), 4 micro-batches.

Each schedule's gradients after a step equal single-process training on the combined batch (the
mean loss over all rows, every parameter, 1e-5), and so do the parameters after two SGD steps;
per step and stage, the fully sharded modules reduce-scatter exactly once per handle (counted by
hand from the stage modules) and all-gather no more than torch FSDP2 on the same stages and
schedule (counted: ours by the library's recorder, FSDP2's by the c10d operators a dispatch mode
sees), and ``replicate`` all-reduces once per bucket per step. The zero-bubble schedules
(ScheduleZBVZeroBubble, ScheduleDualPipeV, ScheduleInterleavedZeroBubble: a weight pass apart from
each input pass, torch's autograd.grad on what the stage shows as its parameters) run over fully
sharded stages with FSDP2's default settings, with blocks kept unsharded from forward to backward
(there FSDP2 with torch's stage is exact too: gradients equal FSDP2's every step, collectives
exactly FSDP2's; with its default settings FSDP2 loses weight gradients under these schedules, so
only its all-gathers are compared), with each block checkpointed (the weight pass recomputes it
again; inside torch's checkpoint_wrapper with selective checkpointing, torchtitan's wrapper, the
recomputation runs fully_shard's forward hooks inside the weight pass), and with fully_shard
applied after the stages were built (torchtitan's order): a weight pass whose gradients missed
the step's one reduction, or that was reduced by itself, fails the gradients or the counts.
After each step every managed module is as a plain step leaves it: its ``reshard_after_backward``
as the user configured it (also NO_SHARD and the user's ``set_reshard_after_backward(False)``),
gradient sync on, unsharded storage freed where it reshards, and the stage modules hold the same
bytes as after a plain step (by hand too, for fully sharded stages): a stage that forgot what a
module was configured with would keep every block unsharded, silently losing ZeRO-3's memory
saving with every number still right. Zero-bubble schedules over replicated modules are refused
when built (our stage or torch's), and given as an action list at the first split backward:
torch's weight pass sets their gradients itself, past replicate's all-reduce. torch's own
``PipelineStage`` on a fully sharded module is refused at the first forward (fully_shard applied
before the stage was built or after), or, where that ran before, at the first backward (it would
finish the step through FSDP2 internals), before any gradient. Under ``MixedPrecision(param_dtype=
bfloat16, reduce_dtype=float32)``, ScheduleInterleavedZeroBubble's weight passes sum the micro-batches'
gradients in float32: its gradients equal ScheduleInterleaved1F1B's on the same stages. A weight pass whose
end refuses (a ``.grad`` replaced between unsynced backwards) leaves every module of the stage idle and
resharded, with nothing accumulated since the last sync, and raises the first module's error: the next step is
exact. A weight pass on a handle whose first group is frozen keeps the trainable group's gradient; one whose torch
weight step fails inside our stage leaves nothing of itself in the step's reduction.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple, cast

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from composable_shard import checkpoint
from composable_shard import (FSDPModule, MixedPrecision, ReplicateModule, ShardingStrategy, fully_shard, replicate,
                              unshard_params)
from composable_shard._runtime.collectives import record_collectives
from composable_shard._runtime.traversal import _get_fsdp_handles
from composable_shard.replicate import _state_of as _replicate_state
from tests._c10d_count import C10dCount
from tests._harness import run_distributed, run_subtests
from tests._models import Block, zip_same

WIDTH, ROWS_PER_DP, MICROBATCHES, STAGES_PER_RANK = 6, 8, 4, 2


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.out = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(x))


def _full_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), Block(), Head())


def _batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(2 * ROWS_PER_DP, WIDTH, generator=g), torch.randn(2 * ROWS_PER_DP, 3, generator=g)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))


_SHARDED_LIKE_FULLY_SHARD = ("fully_shard", "kept", "late", "checkpointed", "wrapped")  # each block and the stage module
_V_SCHEDULES = ("ZBV", "DualPipeV")  # "V" placement: pipeline rank r holds stages r and 3 - r


def _stage_indices(schedule: str, pp_rank: int) -> List[int]:
    """Stage indices on this pipeline rank: one stage per rank for the single-stage schedules,
    two for the others ("loop" placement: r and r + 2; "V" placement: r and 3 - r)."""
    if schedule in ("GPipe", "1F1B"):
        return [pp_rank]
    if schedule in _V_SCHEDULES:
        return [pp_rank, 3 - pp_rank]
    return [pp_rank + 2 * k for k in range(STAGES_PER_RANK)]


def _stage_modules(model: nn.Sequential, schedule: str) -> List[nn.Module]:
    """The full model split into 2 (single-stage schedules) or 4 stage modules."""
    if schedule in ("GPipe", "1F1B"):
        return [nn.Sequential(model[0], model[1]), nn.Sequential(model[2], model[3])]
    return [nn.Sequential(model[i]) for i in range(4)]


def _schedule(name: str, stages: List[Any]) -> Any:
    from torch.distributed import pipelining as pp

    if name in ("GPipe", "1F1B"):
        cls = pp.ScheduleGPipe if name == "GPipe" else pp.Schedule1F1B
        return cls(stages[0], MICROBATCHES, loss_fn=_loss)
    multi = {"Interleaved1F1B": pp.ScheduleInterleaved1F1B, "LoopedBFS": pp.ScheduleLoopedBFS,
             "InterleavedZeroBubble": pp.ScheduleInterleavedZeroBubble, "ZBV": pp.ScheduleZBVZeroBubble,
             "DualPipeV": pp.ScheduleDualPipeV}[name]
    return multi(stages, MICROBATCHES, loss_fn=_loss)


def _block_order(model: nn.Sequential) -> Dict[int, int]:
    """id of each Block of the full model -> its position (0..3; the last is the Head's)."""
    return {id(block): k for k, block in enumerate([model[0], model[1], model[2], model[3].block])}


def _recompute_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """A selective activation checkpointing policy that keeps nothing: one that keeps an op's output
    (torchtitan's keeps matmuls) fails under the zero-bubble schedules in torch itself, FSDP2 or ours
    ("Trying to backward an extra time"): the input pass's recomputation consumes what was kept and
    the weight pass recomputes again."""
    from torch.utils.checkpoint import CheckpointPolicy
    return CheckpointPolicy.PREFER_RECOMPUTE


_BF16_FP32 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _apply(module: nn.Module, how: str, dp_mesh: Any, order: Dict[int, int]) -> None:
    """``how`` over the dp pair: "fully_shard" (each block, then the stage module), "kept" (the
    same, each block with ``set_reshard_after_forward(False)``), "checkpointed" (the same, each
    block under our ``checkpoint``), "wrapped" (the same, each block inside torch's
    ``checkpoint_wrapper`` with a selective policy), "blocks" (each block only: the stage module
    stays plain, so the Head's output layer is no fully sharded module's), "replicate" (the stage module),
    or "configured": blocks at even positions NO_SHARD, at odd positions
    FULL_SHARD with the user's ``set_reshard_after_backward(False)``, the stage module replicated
    (each rank then holds both kinds of block under the single-stage schedules, one kind under
    the looped ones), or "bf16": as "fully_shard", computing in bfloat16 and reducing in float32."""
    if how == "replicate":
        replicate(module, process_group=dp_mesh.get_group())
        return
    if how == "blocks":  # the stage module left plain: the Head's output layer is managed by no data-parallel API
        for block in [m for m in module.modules() if isinstance(m, Block)]:
            fully_shard(block, mesh=dp_mesh)
        return
    if how == "wrapped":  # torch's checkpoint_wrapper: its recomputation runs fully_shard's forward hooks again
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, Block):
                    setattr(parent, name, checkpoint_wrapper(child, context_fn=functools.partial(
                        create_selective_checkpoint_contexts, _recompute_all)))
    mixed_precision = _BF16_FP32 if how == "bf16" else None
    for block in [m for m in module.modules() if isinstance(m, Block)]:
        if how == "checkpointed":
            checkpoint(block)
        if how == "configured" and order[id(block)] % 2 == 0:
            fully_shard(block, mesh=dp_mesh, strategy=ShardingStrategy.NO_SHARD)
            continue
        fully_shard(block, mesh=dp_mesh, mixed_precision=mixed_precision)
        if how == "configured":
            cast(FSDPModule, block).set_reshard_after_backward(False)
        if how == "kept":
            cast(FSDPModule, block).set_reshard_after_forward(False)
    if how == "configured":
        replicate(module, process_group=dp_mesh.get_group())
    else:
        fully_shard(module, mesh=dp_mesh, mixed_precision=mixed_precision)


def _build_stages(backend: str, schedule: str, how: str) -> Tuple[List[nn.Module], Any, List[nn.Module]]:
    """This rank's stage modules (sharded by ``backend`` over its dp pair; FSDP2: as "fully_shard",
    or as "kept"), the schedule, and the single-process reference split the same way."""
    from torch.distributed.pipelining import PipelineStage as TorchStage

    from composable_shard.integrations.pipelining import PipelineStage

    mesh = _mesh()
    pp_rank, dp_mesh = mesh["pp"].get_local_rank(), mesh["dp"]
    model, reference = _full_model(), _full_model()
    indices = _stage_indices(schedule, pp_rank)
    all_modules = _stage_modules(model, schedule)
    modules = [all_modules[i] for i in indices]
    for module in modules:
        if backend == "ours":
            if how != "late":
                _apply(module, how, dp_mesh, _block_order(model))
            continue
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        for block in [m for m in module.modules() if isinstance(m, Block)]:
            torch_fully_shard(block, mesh=dp_mesh, reshard_after_forward=how != "kept")
        torch_fully_shard(module, mesh=dp_mesh)
        for m in module.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                cast(Any, m).set_force_sum_reduction_for_comms(True)  # gloo has no AVG
    stage_cls = PipelineStage if backend == "ours" else TorchStage
    num_stages = 2 if schedule in ("GPipe", "1F1B") else 4
    stages = [stage_cls(m, i, num_stages, torch.device("cpu"), group=mesh["pp"].get_group())
              for m, i in zip(modules, indices)]
    if how == "late":  # torchtitan's order: the stages first, then fully_shard
        for module in modules:
            _apply(module, "fully_shard", dp_mesh, _block_order(model))
    return modules, _schedule(schedule, stages), _stage_modules(reference, schedule)


def _step(schedule: Any, step: int) -> None:
    """One pipeline step on this dp rank's rows: the first stage's rank feeds the inputs, the last
    stage's rank the targets."""
    mesh = _mesh()
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    x, y = _batch(step)
    rows = slice(dp_rank * ROWS_PER_DP, (dp_rank + 1) * ROWS_PER_DP)
    if pp_rank == 0:
        schedule.step(x[rows], target=y[rows])  # rank 0 holds stage 0 and (looped) stage 2
    else:
        schedule.step(target=y[rows])


def _full_grads(module: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    if any(hasattr(m, "_fsdp_state") for m in module.modules()):
        with unshard_params(module, with_grads=True, writeback=False):
            return [(n, cast(torch.Tensor, p.grad).clone()) for n, p in module.named_parameters()]
    return [(n, cast(torch.Tensor, p.grad).clone()) for n, p in module.named_parameters()]


# (module name, kind, reshard_after_backward or None, gradient sync, unsharded storage freed or None,
#  module slots hold unsharded views or None) of each managed module of this rank's stages
_ModuleState = Tuple[str, str, Optional[bool], bool, Optional[bool], Optional[bool]]


def _module_states(modules: List[nn.Module]) -> List[_ModuleState]:
    found: List[_ModuleState] = []
    for index, module in enumerate(modules):
        for name, m in module.named_modules():
            where = f"stage module {index} '{name}'"
            if isinstance(m, FSDPModule):
                state = m._fsdp_state()
                handle = state.handle
                found.append((where, "fully_shard", state.reshard_after_backward, state.sync_gradients,
                               None if handle is None else handle.unsharded_storage_freed(),
                               None if handle is None else handle.is_unsharded))
            elif isinstance(m, ReplicateModule):
                found.append((where, "replicate", None, _replicate_state(m).sync_gradients, None, None))
    return found


def _held_bytes(modules: List[nn.Module]) -> int:
    """Bytes of the distinct storages the stage modules hold: parameters, gradients and every
    handle's flat buffers (shard, unsharded buffer, accumulated and reduced gradients)."""
    storages: Dict[int, int] = {}

    def add(tensor: Optional[torch.Tensor]) -> None:
        if tensor is not None and tensor.untyped_storage().nbytes() > 0:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()

    for module in modules:
        for p in module.parameters():
            add(p)
            add(p.grad)
        for handle in _get_fsdp_handles(module):
            for group in handle.groups:
                for tensor in (group.flat_param, group.padded_unsharded_flat, group.unreduced_grad, group.sharded_grad):
                    add(tensor)
    return sum(storages.values())


def _after_plain_step(schedule_name: str, how: str) -> Tuple[List[_ModuleState], int]:
    """Module states and held bytes after one plain (not pipelined) forward and backward of a
    second copy of this rank's stage modules, managed the same way."""
    mesh = _mesh()
    model = _full_model()
    all_modules = _stage_modules(model, schedule_name)
    modules = [all_modules[i] for i in _stage_indices(schedule_name, mesh["pp"].get_local_rank())]
    for module in modules:
        _apply(module, how, mesh["dp"], _block_order(model))
    for module in modules:
        module(torch.randn(ROWS_PER_DP, WIDTH, generator=torch.Generator().manual_seed(7))).sum().backward()
    return _module_states(modules), _held_bytes(modules)


def _assert_as_after_plain_step(modules: List[nn.Module], unsharded: List[nn.Module],
                                plain: Tuple[List[_ModuleState], int], schedule_name: str, how: str, step: int) -> None:
    """After a pipelined step every managed module is as a plain step leaves it: flags as the user
    configured them (worked out from ``_apply``: reshard after backward unless NO_SHARD or
    ``set_reshard_after_backward(False)``; gradient sync on), unsharded storage freed where the
    module reshards, and the same bytes held as after a plain step (``unsharded``: the same stage
    modules unmanaged, for their shapes)."""
    what = f"{schedule_name}/{how} after step {step}"
    states = _module_states(modules)
    for where, kind, reshard, sync, freed, is_unsharded in states:
        assert sync, f"{what}: {where} ({kind}) left with gradient sync off"
        if kind == "fully_shard":
            assert reshard is (how != "configured"), \
                f"{what}: {where} reshard_after_backward={reshard}, configured {how != 'configured'}"
        if kind == "fully_shard" and how in _SHARDED_LIKE_FULLY_SHARD and freed is not None:
            assert freed and not is_unsharded, f"{what}: {where} kept its unsharded parameters (ZeRO-3 saves nothing)"
    plain_states, plain_bytes = plain
    for got, want in zip_same(states, plain_states, what=f"{what}: managed modules"):
        assert got == want, f"{what}: {got} after the pipelined step, {want} after a plain step"
    held = _held_bytes(modules)
    assert held == plain_bytes, f"{what}: the stage modules hold {held} bytes, {plain_bytes} after a plain step"
    if how in _SHARDED_LIKE_FULLY_SHARD:  # by hand: shard of every handle's parameters and of its gradient, float32, W = 2
        expected = 2 * 4 * sum(-(-numel // 2) for numel in _owned_numels(unsharded))
        assert held == expected, f"{what}: the stage modules hold {held} bytes, {expected} by hand"


def _owned_numels(modules: List[nn.Module]) -> List[int]:
    """Elements each fully sharded module owns under "fully_shard": each block's, and the stage
    module's own (the Head's output layer), from the shapes."""
    numels: List[int] = []
    for module in modules:
        blocks = [sum(p.numel() for p in m.parameters()) for m in module.modules() if isinstance(m, Block)]
        rest = sum(p.numel() for p in module.parameters()) - sum(blocks)
        numels += blocks + ([rest] if rest else [])
    return numels


def _fsdp2_grads(modules: List[nn.Module]) -> List[List[Tuple[str, torch.Tensor]]]:
    return [[(n, cast(Any, p.grad).full_tensor()) for n, p in m.named_parameters()] for m in modules]


def _parity(schedule_name: str, how: str) -> None:
    """Gradients of every parameter equal one process's after each of two SGD steps (and, under
    "kept", torch FSDP2's with torch's stage, set up the same); after each step the modules are as
    a plain step leaves them (``_assert_as_after_plain_step``); per step, fully sharded stages
    reduce-scatter once per handle (counted by hand from the stage modules) and all-gather no more
    than FSDP2 on the same stages and schedule (under "kept": both exactly FSDP2's)."""
    modules, schedule, reference_stages = _build_stages("ours", schedule_name, how)
    indices = _stage_indices(schedule_name, _mesh()["pp"].get_local_rank())
    reference = nn.Sequential(*reference_stages)
    optims = [torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.1),
              torch.optim.SGD(reference.parameters(), lr=0.1)]
    fsdp2: Optional[Tuple[List[nn.Module], Any]] = None
    if how == "kept":  # FSDP2 keeps its blocks' parameters from forward to backward: exact under every schedule
        fsdp2_modules, fsdp2_schedule, _ = _build_stages("fsdp2", schedule_name, how)
        fsdp2 = fsdp2_modules, fsdp2_schedule
        optims.append(torch.optim.SGD([p for m in fsdp2_modules for p in m.parameters()], lr=0.1))
    counts: List[Counter] = []
    fsdp2_counts: Counter = Counter()
    plain = _after_plain_step(schedule_name, how)
    for step in range(2):
        with record_collectives() as recorder:
            _step(schedule, step)
        counts.append(Counter(r.kind for r in recorder.records))
        if how == "blocks":  # what a user does for parameters no data-parallel API manages: average them by hand
            _average_unmanaged_grads(modules, schedule_name, step)
        _assert_as_after_plain_step(modules, [reference_stages[i] for i in indices], plain, schedule_name, how, step)
        x, y = _batch(step)
        _loss(reference(x), y).backward()
        ours = [_full_grads(module) for module in modules]
        expected = [[(n, cast(torch.Tensor, p.grad)) for n, p in reference_stages[i].named_parameters()] for i in indices]
        comparisons = [("one process", expected)]
        if fsdp2 is not None:
            with C10dCount() as mode:
                _step(fsdp2[1], step)
            fsdp2_counts = mode.counts
            comparisons.append(("FSDP2", _fsdp2_grads(fsdp2[0])))
        for against, wanted in comparisons:
            for index, got_grads, want_grads in zip_same(indices, ours, wanted, what="stage modules"):
                for (name, got), (_, want) in zip_same(got_grads, want_grads, what=f"stage {index} gradients"):
                    diff = (got - want).abs().max().item()
                    assert diff <= 1e-5, \
                        f"{schedule_name}/{how} step {step} stage {index} {name}: |grad - {against}'s| {diff:.3g}"
        for optim in optims:
            optim.step()
            optim.zero_grad()
    if how == "replicate":
        # per stage module and step, none per micro-batch: its one (small) bucket, and replicate's agreement on
        # the optimizer steps (describe counts both: buckets + 1)
        assert counts[1]["all_reduce"] == 2 * len(modules), (schedule_name, counts[1])
        return
    if how == "configured":
        return
    handles = len(_owned_numels([reference_stages[i] for i in indices]))  # by hand: each block, each Head's output
    if how == "blocks":  # each block only
        handles = sum(1 for i in indices for m in reference_stages[i].modules() if isinstance(m, Block))
    assert counts[1]["reduce_scatter"] == handles, f"{schedule_name}/{how}: {counts[1]}, {handles} handles"
    if how == "kept":
        for kind in ("all_gather", "reduce_scatter"):
            assert counts[1][kind] == fsdp2_counts[kind], f"{schedule_name} {kind}s: ours {counts[1]}, FSDP2 {fsdp2_counts}"
    else:
        fsdp2_counts = _fsdp2_counts(schedule_name)
        assert counts[1]["all_gather"] <= fsdp2_counts["all_gather"], \
            f"{schedule_name} all-gathers per step: ours {counts[1]}, FSDP2 {fsdp2_counts}"
    # ours adds one small all-reduce per stage root and step: which parameters got a gradient somewhere
    assert counts[1]["all_reduce"] <= len(modules), (schedule_name, counts[1])


def _average_unmanaged_grads(modules: List[nn.Module], schedule_name: str, step: int) -> None:
    """Average over the dp pair the gradients of the parameters no fully sharded module owns (the
    Head's output layer under "blocks"); each must have one: a zero-bubble weight pass computes
    them as torch's stage does for a plain module."""
    owned = {id(p) for module in modules for m in module.modules() if isinstance(m, FSDPModule) for p in m.parameters()}
    dp_group = _mesh()["dp"].get_group()  # on every rank (a mesh makes its groups collectively)
    for index, module in enumerate(modules):
        for name, p in module.named_parameters():
            if id(p) not in owned:
                assert p.grad is not None, f"{schedule_name}/blocks step {step} stage module {index} {name}: no gradient"
                dist.all_reduce(p.grad, group=dp_group)
                p.grad.div_(2)


def _fsdp2_counts(schedule_name: str) -> Counter:
    _, schedule, _ = _build_stages("fsdp2", schedule_name, "fully_shard")
    _step(schedule, 0)
    with C10dCount() as mode:
        _step(schedule, 1)
    return mode.counts


def _refusals() -> None:
    """Zero-bubble schedules over replicated modules are refused when built, naming the schedule
    and the module, with our stage (replicated stage modules) and with torch's (plain stage modules
    holding replicated blocks), before the stages change; one given as an action list at its first
    split backward, before any gradient; torch's own stage over a fully sharded root at its first
    forward, and, where that forward ran before, at its first backward (``set_is_last_backward``)
    before any gradient, naming ours."""
    from torch.distributed import pipelining as pp

    from composable_shard.integrations.pipelining import PipelineStage

    mesh = _mesh()
    pp_rank, dp_group, pp_group = mesh["pp"].get_local_rank(), mesh["dp"].get_group(), mesh["pp"].get_group()
    v_indices = (pp_rank, 3 - pp_rank)  # V placement: ranks hold 0,3 and 1,2
    model = _full_model()
    modules = [nn.Sequential(model[i]) for i in v_indices]
    for module in modules:
        replicate(module, process_group=dp_group)
    stages: List[Any] = [PipelineStage(m, i, 4, torch.device("cpu"), group=pp_group)
                         for m, i in zip_same(modules, v_indices)]
    for cls in (pp.ScheduleZBVZeroBubble, pp.ScheduleDualPipeV):
        with pytest.raises(NotImplementedError, match=f"{cls.__name__} splits each backward.*ReplicateSequential"):
            cls(stages, MICROBATCHES, loss_fn=_loss)
        for stage in stages:  # refused before the schedule set its V mapping on the stages
            assert stage.stage_index_to_group_rank == {i: i % 2 for i in range(4)}, stage.stage_index_to_group_rank
    fresh = _full_model()
    loop = [nn.Sequential(fresh[i]) for i in (pp_rank, pp_rank + 2)]
    for module in loop:
        replicate(module, process_group=dp_group)
    looped: List[Any] = [PipelineStage(m, i, 4, torch.device("cpu"), group=pp_group)
                         for m, i in zip_same(loop, (pp_rank, pp_rank + 2))]
    with pytest.raises(NotImplementedError, match="ScheduleInterleavedZeroBubble splits each backward"):
        pp.ScheduleInterleavedZeroBubble(looped, MICROBATCHES, loss_fn=_loss)
    plain_model = _full_model()
    plain_modules = [nn.Sequential(plain_model[i]) for i in v_indices]  # plain stage modules, replicated blocks
    for block in [m for module in plain_modules for m in module.modules() if isinstance(m, Block)]:
        replicate(block, process_group=dp_group)
    torch_stages: List[Any] = [pp.PipelineStage(m, i, 4, torch.device("cpu"), group=pp_group)
                               for m, i in zip_same(plain_modules, v_indices)]
    with pytest.raises(NotImplementedError, match="ScheduleZBVZeroBubble splits each backward.*ReplicateBlock"):
        pp.ScheduleZBVZeroBubble(torch_stages, MICROBATCHES, loss_fn=_loss)
    solo_group = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]  # one-rank pipelines
    _split_backward_refused_first(solo_group)
    _torch_stage_refused(solo_group)
    _failed_stage_weight_pass_leaves_nothing(solo_group)


def _untouched(module: nn.Module, shards: List[torch.Tensor], what: str) -> None:
    """No gradient anywhere in ``module`` and its shards equal ``shards``."""
    groups = [g for h in _get_fsdp_handles(module) for g in h.groups]
    assert groups and shards, f"{what}: no fully sharded handle found"
    assert all(p.grad is None for p in module.parameters()), f"{what}: a gradient was written"
    assert all(g.unreduced_grad is None and g.sharded_grad is None for g in groups), f"{what}: a gradient accumulated"
    for got, want in zip_same([g.flat_param.detach() for g in groups], shards, what=f"{what}: shards"):
        assert torch.equal(got, want), f"{what}: a shard changed"


def _split_backward_refused_first(solo_group: Any) -> None:
    """ZBV's action list run by torch's generic runtime over our two stages (one rank each), the
    second replicated: its first 'input' backward raises before computing anything."""
    from torch.distributed import pipelining as pp

    from composable_shard.integrations.pipelining import PipelineStage

    cpu = torch.device("cpu")
    stand_ins: List[Any] = [pp.PipelineStage(nn.Linear(WIDTH, WIDTH), i, 2, cpu, group=solo_group) for i in (0, 1)]
    actions = pp.ScheduleZBVZeroBubble(stand_ins, MICROBATCHES, loss_fn=_loss).pipeline_order
    model = _full_model()
    modules = [nn.Sequential(model[0]), nn.Sequential(model[1], nn.Linear(WIDTH, 3))]
    fully_shard(modules[0], mesh=_mesh()["dp"])
    replicate(modules[1], process_group=_mesh()["dp"].get_group())
    before = [p.detach().clone() for p in modules[1].parameters()]
    runtime = pp.schedules._PipelineScheduleRuntime(
        [PipelineStage(m, i, 2, cpu, group=solo_group) for i, m in enumerate(modules)], MICROBATCHES, loss_fn=_loss)
    runtime._prepare_schedule_with_comms(actions)
    x, y = _batch(0)
    with pytest.raises(NotImplementedError, match="'input' backward pass.*ReplicateSequential"):
        runtime.step(x, target=y)
    assert all(p.grad is None for m in modules for p in m.parameters()), "split backward refused: a gradient was written"
    for got, want in zip_same([p.detach() for p in modules[1].parameters()], before, what="replicated parameters"):
        assert torch.equal(got, want), "split backward refused: a parameter changed"


_TORCH_STAGE_REFUSED = "pipelining.*composable_shard.integrations.pipelining.PipelineStage"


def _torch_stage_refused(solo_group: Any) -> None:
    """torch's stage over our fully sharded root, or over a plain module holding a fully sharded
    block (sharded before the stage was built or after): refused at the first forward, before any
    collective; over a root whose first forward a plain step had run, at the first micro-batch's
    backward; each before any gradient. Our stage over a plain module whose block is sharded
    after the stage was built (torchtitan's order): let through, the block's gradients one
    process's on the same rows (every dp rank feeds them)."""
    from torch.distributed import pipelining as pp

    from composable_shard.integrations.pipelining import PipelineStage

    x, _ = _batch(0)
    y = torch.zeros_like(x)  # the stage ends with a block: WIDTH outputs
    for case in ("root", "block", "root after a plain step", "block sharded after the stage", "ours, block after"):
        solo = nn.Sequential(_full_model()[0])
        stage_cls = PipelineStage if case.startswith("ours") else pp.PipelineStage
        late = case.endswith("after the stage") or case.startswith("ours")
        stage = stage_cls(solo, 0, 1, torch.device("cpu"), group=solo_group) if late else None
        fully_shard(solo if case.startswith("root") else solo[0], mesh=_mesh()["dp"])
        if case == "root after a plain step":
            solo(x).sum().backward()
            for p in solo.parameters():
                p.grad = None
        gpipe = pp.ScheduleGPipe(stage or pp.PipelineStage(solo, 0, 1, torch.device("cpu"), group=solo_group),
                                 MICROBATCHES, loss_fn=_loss)
        if case.startswith("ours"):
            reference = _full_model()[0]
            _loss(reference(x), y).backward()
            gpipe.step(x, target=y)
            for (name, got), want in zip_same(_full_grads(solo), list(reference.parameters()), what="block gradients"):
                assert (got - cast(torch.Tensor, want.grad)).abs().max().item() <= 1e-5, f"our stage, block sharded after it: {name}"
            continue
        shards = [g.flat_param.detach().clone() for h in _get_fsdp_handles(solo) for g in h.groups]
        with record_collectives() as recorder, pytest.raises(RuntimeError, match=_TORCH_STAGE_REFUSED):
            gpipe.step(x, target=y)
        if case != "root after a plain step":
            assert not recorder.records, f"torch's stage over the {case}: {len(recorder.records)} collectives first"
        _untouched(solo, shards, f"torch's stage over the {case}")


def _bf16_weight_passes() -> None:
    """Under ``MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32)`` the zero-bubble
    schedule's weight passes add up the micro-batches' bfloat16 weight gradients in float32, as
    the backward of any other schedule does (and as torch's FSDP2 does for unsynced backwards):
    a step of ScheduleInterleavedZeroBubble gives the gradients a step of ScheduleInterleaved1F1B
    gives on the same stages and rows (each micro-batch's bfloat16 gradient is the same under
    both; the float32 sums of four of them differ at most by the order they were added in),
    and both are within bfloat16's precision of one float32 process on the combined batch
    (measured: bit for bit the same as Interleaved1F1B's, within 2.4e-2 of the largest element
    of the float32 process's). Summed in bfloat16 (each addition rounding to 2^-9 relative,
    the gradients' views bfloat16 between the passes) they were off from Interleaved1F1B's by
    up to 3.6e-3 of the largest element, 360 times the tolerance."""
    grads: Dict[str, List[List[Tuple[str, torch.Tensor]]]] = {}
    for schedule_name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        modules, schedule, reference_stages = _build_stages("ours", schedule_name, "bf16")
        _step(schedule, 0)
        grads[schedule_name] = [_full_grads(module) for module in modules]
    indices = _stage_indices("InterleavedZeroBubble", _mesh()["pp"].get_local_rank())
    x, y = _batch(0)
    _loss(nn.Sequential(*reference_stages)(x), y).backward()
    one_process = [[(n, cast(torch.Tensor, p.grad)) for n, p in reference_stages[i].named_parameters()] for i in indices]
    for against, wanted, tol in (("Interleaved1F1B's", grads["Interleaved1F1B"], 1e-5),
                                 ("one float32 process's", one_process, 1e-1)):
        for index, got_grads, want_grads in zip_same(indices, grads["InterleavedZeroBubble"], wanted, what="stage modules"):
            for (name, got), (_, want) in zip_same(got_grads, want_grads, what=f"stage {index} gradients"):
                assert got.dtype == torch.float32, f"bf16/fp32 stage {index} {name}: a {got.dtype} gradient"
                diff = (got - want).abs().max().item() / want.abs().max().item()
                assert diff <= tol, f"bf16/fp32 InterleavedZeroBubble stage {index} {name}: |grad - {against}| " \
                                    f"{diff:.3g} of its largest element"


def _failed_weight_pass_leaves_nothing() -> None:
    """A weight pass that raised ([Note: Weight passes] in ``_runtime/hooks.py``, what the stage
    does when torch's weight step fails) leaves nothing of what it had added to the unsharded
    buffers' ``.grad``: the synced step after it gives exactly one process's gradients on the
    combined batch. Kept, the pass's partial gradient was added to the next backward's."""
    from composable_shard._runtime.hooks import begin_weight_pass, end_weight_pass

    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model, reference = nn.Sequential(Block(), Block()), nn.Sequential(Block(), Block())
    reference.load_state_dict(model.state_dict())
    fully_shard(model)
    x = torch.randn(world_size * 2, 4, WIDTH)
    model(x[:2]).sum().backward()  # lazy init; then a fresh step
    model.zero_grad(set_to_none=True)
    sharded = cast(FSDPModule, model)
    sharded.set_requires_gradient_sync(False)
    begin_weight_pass(sharded._fsdp_state())
    for group in _get_fsdp_handles(model)[0].groups:  # what torch's weight step adds before it fails
        group.padded_unsharded_flat.grad = torch.ones_like(group.padded_unsharded_flat)
    end_weight_pass(sharded._fsdp_state(), completed=False)
    sharded.set_requires_gradient_sync(True)
    model(x[rank * 2:(rank + 1) * 2]).pow(2).mean().backward()
    (sum(reference(x[r * 2:(r + 1) * 2]).pow(2).mean() for r in range(world_size)) / world_size).backward()  # type: ignore[union-attr]
    for (name, got), (_, want) in zip_same(_full_grads(model), _full_grads(reference), what="gradients"):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=lambda m: f"after a failed weight pass, {name}: {m}")


def _refused_weight_pass_leaves_the_module_usable() -> None:
    """A weight pass whose end refuses (a ``.grad`` the user replaced between unsynced backwards:
    [Note: A tensor of the user's in place of an unsynced sum] in ``_runtime/flat_param.py``; here in
    two modules of the stage) raises the first module's error on every rank, leaves every handle of
    the stage idle and resharded
    (the refused one and the others the same pass ran on), and drops what was accumulated since
    the last synced backward, as the refusal says: the next forward runs, and a synced step gives
    exactly one process's gradients on its batch. Left in backward, the next forward raised an
    illegal transition on the refused handle."""
    from composable_shard._runtime.hooks import begin_weight_pass, end_weight_passes
    from composable_shard._runtime.flat_param import HandleTrainingState

    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model, reference = nn.Sequential(Block(), Block()), nn.Sequential(Block(), Block())
    reference.load_state_dict(model.state_dict())
    fully_shard(model[0])
    fully_shard(model[1])
    x = torch.randn(world_size * 2, 4, WIDTH)
    model(x[:2]).sum().backward()  # lazy init; then a fresh step
    model.zero_grad(set_to_none=True)
    modules = [cast(FSDPModule, model[0]), cast(FSDPModule, model[1])]
    for m in modules:
        m.set_requires_gradient_sync(False)
    model(x[:2]).sum().backward()  # an unsynced backward: .grad shows this rank's sums
    for replaced in (model[0].fc1.weight, model[1].fc2.weight):  # type: ignore[union-attr]
        replaced.grad = torch.zeros_like(replaced)  # this rank's slice: it cannot hold the sum
    for m in modules:
        begin_weight_pass(m._fsdp_state())
    for handle in _get_fsdp_handles(model):  # what torch's weight step adds
        for group in handle.groups:
            group.padded_unsharded_flat.grad = torch.ones_like(group.padded_unsharded_flat)
    try:
        end_weight_passes([m._fsdp_state() for m in modules], completed=True)  # as the stage ends them
    except RuntimeError as e:  # both modules refuse; the first one's error is raised
        assert "fc1.weight" in str(e) and "fc2.weight" not in str(e) and "replaced" in str(e), e
    else:
        raise AssertionError("the .grad replaced between unsynced backwards must be refused")
    for handle in _get_fsdp_handles(model):
        assert handle.training_state is HandleTrainingState.IDLE and not handle.is_unsharded, handle
        assert all(g.unreduced_grad is None for g in handle.groups), f"{handle}: the unsynced sum was kept"
    for m in modules:
        m.set_requires_gradient_sync(True)
    model.zero_grad(set_to_none=True)
    model(x[rank * 2:(rank + 1) * 2]).pow(2).mean().backward()
    (sum(reference(x[r * 2:(r + 1) * 2]).pow(2).mean() for r in range(world_size)) / world_size).backward()  # type: ignore[union-attr]
    for (name, got), (_, want) in zip_same(_full_grads(model), _full_grads(reference), what="gradients"):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=lambda m: f"after a refused weight pass, {name}: {m}")


def _weight_pass_keeps_every_groups_gradient() -> None:
    """A handle of several groups (a block whose norm is frozen: a frozen group, then a trainable
    one) whose first group got no gradient in the weight pass: the end of the pass still takes the
    trainable group's gradient as an unsynced one (kept for the step's one reduction) and leaves the
    frozen group's parameters without one."""
    from composable_shard._runtime.hooks import begin_weight_pass, end_weight_passes

    torch.manual_seed(0)
    model = Block()
    model.ln.requires_grad_(False)
    fully_shard(model)
    model(torch.randn(2, 4, WIDTH)).sum().backward()  # lazy init
    model.zero_grad(set_to_none=True)
    sharded = cast(FSDPModule, model)
    sharded.set_requires_gradient_sync(False)
    handle = _get_fsdp_handles(model)[0]
    assert [g.requires_grad for g in handle.groups] == [False, True], [g.requires_grad for g in handle.groups]
    begin_weight_pass(sharded._fsdp_state())
    trainable = handle.groups[1]
    added = torch.randn(trainable.padded_unsharded_flat.shape)
    trainable.padded_unsharded_flat.grad = added.clone()  # what torch's weight step adds
    end_weight_passes([sharded._fsdp_state()], completed=True)
    assert trainable.padded_unsharded_flat.grad is None, "the weight pass's gradient was left on the buffer"
    assert trainable.unreduced_grad is not None and torch.equal(trainable.unreduced_grad, added), \
        "the trainable group's weight-pass gradient was not kept for the step's reduction"
    assert all(p.grad is None for p in model.ln.parameters()), "the frozen norm got a gradient"
    sharded.set_requires_gradient_sync(True)
    sharded.reduce_accumulated_gradients()


def _failed_stage_weight_pass_leaves_nothing(solo_group: Any) -> None:
    """Our stage (one rank of the pipeline) over a fully sharded module: a micro-batch's backward
    (kept unsynced), then a weight step that fails after adding part of its gradient (torch's
    ``backward_maybe_with_nosync`` made to fail that way for this call): the error comes through,
    and nothing of the failed pass reaches the step's one reduction: after ``perform_reduce_grad``
    the gradients equal one process's on the micro-batch alone."""
    from torch.distributed import pipelining as pp

    from composable_shard.integrations import pipelining as ours

    torch.manual_seed(0)
    model, reference = nn.Sequential(Block(), Block()), nn.Sequential(Block(), Block())
    reference.load_state_dict(model.state_dict())
    fully_shard(model, mesh=_mesh()["dp"])
    dp_rank, dp_size = _mesh()["dp"].get_local_rank(), _mesh()["dp"].size()
    x = torch.randn(dp_size * 2, 4, WIDTH)
    model(x[:2]).sum().backward()  # lazy init; then a fresh step
    model.zero_grad(set_to_none=True)
    stage = ours.PipelineStage(model, 0, 1, torch.device("cpu"), group=solo_group)
    cast(FSDPModule, model).set_requires_gradient_sync(False)  # as the stage has it between micro-batches
    model(x[dp_rank * 2:(dp_rank + 1) * 2]).pow(2).mean().backward()  # the micro-batch before, kept

    def fails_after_adding(self: Any, backward_type: str, bwd_kwargs: Dict[str, Any], last_backward: bool = False) -> Any:
        for handle in _get_fsdp_handles(model):
            for group in handle.groups:
                group.padded_unsharded_flat.grad = torch.ones_like(group.padded_unsharded_flat)
        raise RuntimeError("weight step failed")

    original = pp.PipelineStage.backward_maybe_with_nosync
    setattr(pp.PipelineStage, "backward_maybe_with_nosync", fails_after_adding)
    try:
        with pytest.raises(RuntimeError, match="weight step failed"):
            stage.backward_maybe_with_nosync("weight", {})
    finally:
        setattr(pp.PipelineStage, "backward_maybe_with_nosync", original)
    stage.perform_reduce_grad(1)  # the step's one reduction: the micro-batch before, only
    (sum(reference(x[r * 2:(r + 1) * 2]).pow(2).mean() for r in range(dp_size)) / dp_size).backward()  # type: ignore[union-attr]
    for (name, got), (_, want) in zip_same(_full_grads(model), _full_grads(reference), what="gradients"):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=lambda m: f"after a failed stage weight pass, {name}: {m}")


def _cases(schedules: List[str], zero_bubble: Dict[str, List[str]], refusals: bool) -> None:
    run_subtests(_parity, {"schedule_name": schedules, "how": ["fully_shard", "replicate", "configured"]})
    for schedule_name, hows in zero_bubble.items():
        run_subtests(_parity, {"schedule_name": [schedule_name], "how": hows})
    if "InterleavedZeroBubble" in zero_bubble:
        _bf16_weight_passes()
    if refusals:
        _refusals()
        _failed_weight_pass_leaves_nothing()
        _refused_weight_pass_leaves_the_module_usable()
        _weight_pass_keeps_every_groups_gradient()


# Zero-bubble schedules (a weight pass apart from each input pass) over fully sharded stage modules: FSDP2's
# default settings, "kept" (compared with FSDP2 set the same: exact there), blocks checkpointed (ours, and torch's
# checkpoint_wrapper with selective checkpointing, as torchtitan wraps blocks: its recomputation inside a weight
# pass runs fully_shard's hooks), fully_shard applied after the stages were built (torchtitan's order), and blocks
# alone fully sharded (the stage module plain: its own parameters get their gradients from the weight pass).
_ZERO_BUBBLE = [{"ZBV": ["fully_shard", "kept", "checkpointed", "wrapped", "late", "blocks"], "DualPipeV": ["fully_shard", "kept"]},
                {"InterleavedZeroBubble": ["fully_shard", "kept"]}]


@pytest.mark.parametrize("schedules,zero_bubble", [(["GPipe", "1F1B"], _ZERO_BUBBLE[0]),
                                                   (["Interleaved1F1B", "LoopedBFS"], _ZERO_BUBBLE[1])])
def test_schedules_match_one_process_and_fsdp2s_collectives(schedules: List[str], zero_bubble: Dict[str, List[str]]) -> None:
    """See the module docstring; fully sharded stages (per block and the stage root) and
    replicated ones under every schedule torch ships; the refusals with the first group."""
    run_distributed(_cases, 4, schedules, zero_bubble, schedules[0] == "GPipe", timeout=300)
