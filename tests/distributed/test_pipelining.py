"""torch's pipeline schedules over stages whose modules this library manages (issue 43), through
``composable_shard.integrations.pipelining.PipelineStage``, at W = 4: 2 pipeline ranks x 2
data-parallel ranks (each stage's modules sharded or replicated over its dp pair), 4 micro-batches.

Each schedule's gradients after a step equal single-process training on the combined batch (the
mean loss over all rows, every parameter, 1e-5), and so do the parameters after two SGD steps;
per step and stage, the fully sharded modules' all-gathers and reduce-scatters are no more than
torch FSDP2's on the same stages and schedule (counted: ours by the library's recorder, FSDP2's
by the c10d operators a dispatch mode sees), and ``replicate`` all-reduces once per bucket per
step. Schedules that split backward into input and weight passes are refused when built: their
weight pass asks the 1-D shard views for gradients. torch's own ``PipelineStage`` on a fully
sharded stage is refused at the first forward (it would finish the step through FSDP2 internals).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from composable_shard import fully_shard, replicate, unshard_params
from composable_shard._runtime.collectives import record_collectives
from tests._c10d_count import C10dCount
from tests._harness import run_distributed, run_subtests
from tests._models import Block

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


def _stage_indices(schedule: str, pp_rank: int) -> List[int]:
    """Stage indices on this pipeline rank: one stage per rank for the single-stage schedules,
    two ("loop" placement: r and r + 2) for the others."""
    return [pp_rank] if schedule in ("GPipe", "1F1B") else [pp_rank + 2 * k for k in range(STAGES_PER_RANK)]


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
    cls = {"Interleaved1F1B": pp.ScheduleInterleaved1F1B, "LoopedBFS": pp.ScheduleLoopedBFS}[name]
    return cls(stages, MICROBATCHES, loss_fn=_loss)


def _build_stages(backend: str, schedule: str, how: str) -> Tuple[List[nn.Module], Any, List[nn.Module]]:
    """This rank's stage modules (sharded by ``backend`` over its dp pair), the schedule, and the
    single-process reference split the same way."""
    from torch.distributed.pipelining import PipelineStage as TorchStage

    from composable_shard.integrations.pipelining import PipelineStage

    mesh = _mesh()
    pp_rank, dp_mesh = mesh["pp"].get_local_rank(), mesh["dp"]
    model, reference = _full_model(), _full_model()
    indices = _stage_indices(schedule, pp_rank)
    all_modules = _stage_modules(model, schedule)
    modules = [all_modules[i] for i in indices]
    for module in modules:
        if backend == "ours" and how == "replicate":
            replicate(module, process_group=dp_mesh.get_group())
            continue
        blocks = [m for m in module.modules() if isinstance(m, Block)]
        for block in blocks:
            if backend == "ours":
                fully_shard(block, mesh=dp_mesh)
            else:
                from torch.distributed.fsdp import fully_shard as torch_fully_shard
                torch_fully_shard(block, mesh=dp_mesh)
        if backend == "ours":
            fully_shard(module, mesh=dp_mesh)
        else:
            from torch.distributed.fsdp import fully_shard as torch_fully_shard
            torch_fully_shard(module, mesh=dp_mesh)
            for m in module.modules():
                if hasattr(m, "set_force_sum_reduction_for_comms"):
                    m.set_force_sum_reduction_for_comms(True)  # gloo has no AVG
    stage_cls = PipelineStage if backend == "ours" else TorchStage
    num_stages = 2 if schedule in ("GPipe", "1F1B") else 4
    stages = [stage_cls(m, i, num_stages, torch.device("cpu"), group=mesh["pp"].get_group())
              for m, i in zip(modules, indices)]
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
            return [(n, p.grad.clone()) for n, p in module.named_parameters()]
    return [(n, p.grad.clone()) for n, p in module.named_parameters()]


def _parity(schedule_name: str, how: str) -> None:
    """Gradients of every parameter equal one process's after each of two SGD steps; our
    collectives per step no more than FSDP2's on the same stages (fully sharded stages)."""
    modules, schedule, reference_stages = _build_stages("ours", schedule_name, how)
    indices = _stage_indices(schedule_name, _mesh()["pp"].get_local_rank())
    reference = nn.Sequential(*reference_stages)
    optims = [torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.1),
              torch.optim.SGD(reference.parameters(), lr=0.1)]
    counts: List[Counter] = []
    for step in range(2):
        with record_collectives() as recorder:
            _step(schedule, step)
        counts.append(Counter(r.kind for r in recorder.records))
        x, y = _batch(step)
        _loss(reference(x), y).backward()
        for module, index in zip(modules, indices):
            expected = [(n, p.grad) for n, p in reference_stages[index].named_parameters()]
            for (name, got), (_, want) in zip(_full_grads(module), expected):
                diff = (got - want).abs().max().item()
                assert diff <= 1e-5, f"{schedule_name}/{how} step {step} stage {index} {name}: |grad diff| {diff:.3g}"
        for optim in optims:
            optim.step()
            optim.zero_grad()
    if how == "replicate":
        # per stage module and step, none per micro-batch: its one (small) bucket, and replicate's agreement on
        # the optimizer steps (describe counts both: buckets + 1)
        assert counts[1]["all_reduce"] == 2 * len(modules), (schedule_name, counts[1])
        return
    fsdp2 = _fsdp2_counts(schedule_name)
    for kind in ("all_gather", "reduce_scatter"):
        assert counts[1][kind] <= fsdp2[kind], f"{schedule_name} {kind}s per step: ours {counts[1]}, FSDP2 {fsdp2}"
    # ours adds one small all-reduce per stage root and step: which parameters got a gradient somewhere
    assert counts[1]["all_reduce"] <= len(modules), (schedule_name, counts[1])


def _fsdp2_counts(schedule_name: str) -> Counter:
    _, schedule, _ = _build_stages("fsdp2", schedule_name, "fully_shard")
    _step(schedule, 0)
    with C10dCount() as mode:
        _step(schedule, 1)
    return mode.counts


def _refusals() -> None:
    """Zero-bubble schedules are refused when built over fully sharded stages; torch's own stage
    on a fully sharded module is refused at its first forward, naming ours."""
    from torch.distributed import pipelining as pp

    from composable_shard.integrations.pipelining import PipelineStage

    mesh = _mesh()
    pp_rank, dp_mesh = mesh["pp"].get_local_rank(), mesh["dp"]
    model = _full_model()
    modules = [nn.Sequential(model[i]) for i in ((pp_rank, 3 - pp_rank))]  # V placement: ranks hold 0,3 and 1,2
    for module in modules:
        fully_shard(module, mesh=dp_mesh)
    stages = [PipelineStage(m, i, 4, torch.device("cpu"), group=mesh["pp"].get_group())
              for m, i in zip(modules, (pp_rank, 3 - pp_rank))]
    for cls in (pp.ScheduleZBVZeroBubble, pp.ScheduleDualPipeV):
        with pytest.raises(NotImplementedError, match=f"{cls.__name__} splits each backward.*Schedule1F1B"):
            cls(stages, MICROBATCHES, loss_fn=_loss)
    fresh = _full_model()
    loop = [nn.Sequential(fresh[i]) for i in (pp_rank, pp_rank + 2)]
    for module in loop:
        fully_shard(module, mesh=dp_mesh)
    with pytest.raises(NotImplementedError, match="ScheduleInterleavedZeroBubble splits each backward"):
        pp.ScheduleInterleavedZeroBubble([PipelineStage(m, i, 4, torch.device("cpu"), group=mesh["pp"].get_group())
                                          for m, i in zip(loop, (pp_rank, pp_rank + 2))], MICROBATCHES, loss_fn=_loss)
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # a one-stage pipeline per rank
    solo = nn.Sequential(_full_model()[0])
    fully_shard(solo, mesh=dp_mesh)
    gpipe = pp.ScheduleGPipe(pp.PipelineStage(solo, 0, 1, torch.device("cpu"), group=groups[dist.get_rank()]),
                             MICROBATCHES, loss_fn=_loss)
    x, y = _batch(0)
    with pytest.raises(RuntimeError, match="pipelining.*composable_shard.integrations.pipelining.PipelineStage"):
        gpipe.step(x, target=y)


def _cases(schedules: List[str], refusals: bool) -> None:
    run_subtests(_parity, {"schedule_name": schedules, "how": ["fully_shard", "replicate"]})
    if refusals:
        _refusals()


@pytest.mark.parametrize("schedules", [["GPipe", "1F1B"], ["Interleaved1F1B", "LoopedBFS"]])
def test_schedules_match_one_process_and_fsdp2s_collectives(schedules: List[str]) -> None:
    """See the module docstring; fully sharded stages (per block and the stage root) and
    replicated ones; the refusals with the first group."""
    run_distributed(_cases, 4, schedules, schedules[0] == "GPipe", timeout=300)
