"""torchao's float8 training (``torchao.float8.convert_to_float8_training``) under ``fully_shard``
(issue 57): how FSDP2 users get float8 matmuls.

* Converted with ``enable_fsdp_float8_all_gather=False``: the same numbers as torch's FSDP2 with
  torchao on the same script (per step the global loss, and after the steps every full parameter,
  float32: bitwise at W = 2, within 1e-5 at W = 4; float8 casts its inputs with per-rank dynamic scales, so the reference is FSDP2, not
  one process on the combined batch), with blocks, their norms and biases sharded and a head left
  unconverted; the full state dict loads into the plain, unconverted model, whose outputs are then
  the trained model's without float8.
* Converted with ``enable_fsdp_float8_all_gather=True`` (issue 57: FSDP2 all-gathers such weights
  already cast to float8; main failed at the first forward with a shape error naming nothing, then
  refused at ``fully_shard``): the same numbers as FSDP2 + torchao with float8 all-gather and
  ``precompute_float8_dynamic_scale_for_fsdp`` (float32, and bf16 compute with float32 reduction);
  every all-gather's bytes (one per float8 weight element, the norms and biases in their own dtype)
  and one amax all-reduce per module and gather; a module whose every parameter is a float8 weight
  (FSDP2 fails there on gloo) trains as FSDP2 without float8 all-gather; a checkpoint resumes
  exactly. What would silently break without these: a scale from this rank's slice instead of the
  whole weight (each rank casts differently), one weight's scale for another, the bytes kept after
  forward, the weights gathered in full precision, the weight's gradient dropped on the way back.
  At W = 4, tensor-parallel float8 weights (``DTensor`` s holding torchao's tensors) are refused at
  ``fully_shard``, naming the parameter, its module and the setting, the model unchanged.
* ``replicate`` (no all-gather): both conversions train with FSDP2's numbers.

torchao is a test requirement (the ``float8`` extra); without it the test fails saying so.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests._harness import run_distributed, run_subtests, world_sizes
from tests._models import zip_same

WIDTH, HIDDEN, OUT, ROWS, STEPS = 64, 128, 16, 8, 3


def _require_torchao() -> None:
    if importlib.util.find_spec("torchao") is None:
        pytest.fail("torchao is not installed: install the [float8] test extra (pip install -e '.[test,float8]')",
                    pytrace=False)


def _model() -> nn.Sequential:
    """Two blocks (a norm and two linears each, biases) and a head; every linear but the head's
    is converted to float8 (the head's 16 outputs are not a multiple of 16 in both dims)."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, WIDTH))
              for _ in range(2)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, OUT))


def _converted(fp8_all_gather: bool) -> nn.Sequential:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = _model()
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_all_gather),
                               module_filter_fn=lambda module, fqn: fqn != "2")
    return model


def _shard(model: nn.Sequential, fully_shard: Callable[..., Any], **kwargs: Any) -> nn.Sequential:
    for block in model[:2]:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _train(model: nn.Module, steps: int = STEPS, optim: Optional[torch.optim.Optimizer] = None,
           precompute: bool = False, seed: int = 100) -> List[float]:
    """AdamW steps on this rank's rows; the global mean loss of each step. ``precompute``:
    torchao's ``precompute_float8_dynamic_scale_for_fsdp`` after each optimizer step, as
    torchtitan does with float8 all-gather."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    optim = optim if optim is not None else torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(seed + dist.get_rank())
    losses = []
    for _ in range(steps):
        x = torch.randn(ROWS, WIDTH, generator=generator)
        loss = model(x).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        if precompute:
            precompute_float8_dynamic_scale_for_fsdp(model)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


def _full_params_fsdp2(model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    return [(n, p.full_tensor()) for n, p in model.named_parameters()]


def _tolerance() -> float:
    # W = 2: the same sums, bit for bit; W = 4: gloo's reductions add four ranks in another order
    return 0.0 if dist.get_world_size() == 2 else 1e-5


def _assert_same_params(ours: nn.Module, theirs: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    from composable_shard import unshard_params

    with unshard_params(ours):
        mine = [(n, p.detach().clone()) for n, p in ours.named_parameters()]
    for (name, got), (other, want) in zip_same(mine, _full_params_fsdp2(theirs), what="parameters"):
        assert name == other, (name, other)
        torch.testing.assert_close(got, want, rtol=0, atol=_tolerance(), msg=lambda m: f"{name}: {m}")
    return mine


def _weights_computed_on(model: nn.Module) -> List[Tuple[str, ...]]:
    """Filled as ``model`` runs: for each forward of a ``Float8Linear``, whether the weight it computes
    on is torchao's float8 weight (then its data's and its original dtype) or a plain one (its dtype)."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    seen: List[Tuple[str, ...]] = []

    def record(module: nn.Module, args: Any) -> None:
        w = module.weight
        if isinstance(w, Float8TrainingTensor):
            seen.append(("float8 weight", str(w._data.dtype), str(w._orig_dtype)))
        else:
            seen.append(("plain weight", str(w.dtype)))

    for m in model.modules():
        if isinstance(m, Float8Linear):
            m.register_forward_pre_hook(record)
    return seen


def _parity_with_fsdp2(fp8_all_gather: bool, bf16: bool = False) -> None:
    """Losses at every step and the full parameters after the steps equal FSDP2 + torchao's with the
    same conversion (with float8 all-gather, both call ``precompute_float8_dynamic_scale_for_fsdp``
    after each step: a no-op for ours, see [Note: float8 all-gather]; ``bf16``: bfloat16 compute,
    float32 reduction, where the float8 weights' original dtype is bfloat16); the state dict loads
    into the unconverted model."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from composable_shard import MixedPrecision, fully_shard, get_model_state_dict
    from torchao.float8.float8_linear import Float8Linear

    ours_mp = {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
    their_mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
    ours = _shard(_converted(fp8_all_gather), fully_shard, **ours_mp)
    assert sum(isinstance(m, Float8Linear) for m in ours.modules()) == 4, ours  # the float8 path really runs
    theirs = _shard(_converted(fp8_all_gather), torch_fully_shard, **their_mp)
    weights = {name: _weights_computed_on(model) for name, model in (("ours", ours), ("FSDP2", theirs))}
    losses = _train(ours, precompute=fp8_all_gather)
    reference = _train(theirs, precompute=fp8_all_gather)
    # each Float8Linear computed on what FSDP2's does: torchao's float8 weight (float8 data, its original
    # dtype the compute dtype: a bf16 forward's weight gradient is bf16) with float8 all-gather, else a plain one
    assert weights["ours"] == weights["FSDP2"] and len(weights["ours"]) == 4 * STEPS, weights
    torch.testing.assert_close(losses, reference, rtol=_tolerance(), atol=0, msg=lambda m: f"losses: {m}")
    mine = _assert_same_params(ours, theirs)
    for (name, p), (_, initial) in zip_same(mine, list(_model().named_parameters())):  # every parameter trained
        assert (p - initial.detach()).abs().max() > 1e-3, name  # AdamW's steps are ~lr = 1e-2; its decay alone 1e-4
    # the checkpoint of a converted model is a plain model's: its state dict loads into the
    # unconverted model, which then computes what the trained model computes without float8
    plain = _model()
    plain.load_state_dict(get_model_state_dict(ours))
    for (name, p), (_, want) in zip_same(list(plain.named_parameters()), mine, what="plain model's parameters"):
        assert torch.equal(p.detach(), want), name


def _fp8_bytes() -> None:
    """With float8 all-gather, every all-gather of a block's two float8 weights (2 x 64 x 128
    elements) moves one byte per element, 16384 / W bytes per rank, and its norm and biases
    (64 + 64 + 128 + 64 = 320 elements) their 4 bytes each in an all-gather of their own, 4 x 320 / W;
    the scales are agreed in one all-reduce per gather of the two weights' amaxes (8 bytes), not
    one per weight; FULL_SHARD gathers each block twice per step; the head (unconverted, the
    root's) 4 x (64 x 16 + 16) / W. The same step without float8 all-gather moves 4 bytes per
    weight element and no amax. ``describe()`` counts the same bytes and collectives."""
    from composable_shard import ModuleWrapPolicy, describe, fully_shard
    from composable_shard._runtime.collectives import record_collectives

    world_size = dist.get_world_size()
    expected_fp8 = {"0": [16384 // world_size, 4 * 320 // world_size] * 2,
                    "1": [16384 // world_size, 4 * 320 // world_size] * 2, "": [4 * (64 * 16 + 16) // world_size]}
    for fp8_all_gather in (True, False):
        model = _shard(_converted(fp8_all_gather), fully_shard)
        _train(model, steps=1)  # the first step records the order (and agrees on it)
        with record_collectives() as rec:
            _train(model, steps=1)
        gathers = {tag: sorted(r.nbytes for r in rec.records if r.kind == "all_gather" and r.tag == tag)
                   for tag in ("0", "1", "")}
        amaxes = [(r.tag, r.nbytes) for r in rec.records if r.kind == "all_reduce" and r.tag.startswith("float8")]
        if fp8_all_gather and world_size == 1:  # the float8 bytes are still gathered (a cast), nothing else
            assert gathers == {"0": [16384] * 2, "1": [16384] * 2, "": []}, gathers
            assert amaxes == [], amaxes
        elif fp8_all_gather:
            assert gathers == {t: sorted(v) for t, v in expected_fp8.items()}, gathers
            assert sorted(amaxes) == [("float8_amax:0", 8)] * 2 + [("float8_amax:1", 8)] * 2, amaxes
        elif world_size == 1:  # the shards are the parameters: nothing to gather
            assert gathers == {"0": [], "1": [], "": []}, gathers
        else:
            block = [4 * (16384 + 320) // world_size] * 2
            assert gathers == {"0": block, "1": block, "": expected_fp8[""]}, gathers
            assert amaxes == [], amaxes
        # describe() counts that step (float8 bytes, the amaxes' all-reduces beside the used flags'), read
        # from the runtime's handles and planned from the converted model alone
        planned = describe(_converted(fp8_all_gather), world_size=world_size, policy=ModuleWrapPolicy({nn.Sequential}))
        for how, d in (("built", describe(model)), ("planned", planned)):
            for kind in ("all_gather", "all_reduce"):
                recorded = [r.nbytes for r in rec.records if r.kind == kind]
                assert (d.collective_count(kind), d.collective_bytes(kind)) == (len(recorded), sum(recorded)), (
                    how, kind, fp8_all_gather, d.collective_count(kind), d.collective_bytes(kind), recorded)


def _every_parameter_float8() -> None:
    """A fully sharded module whose every parameter is a float8 weight (linears without bias; FSDP2
    fails here on gloo, "Invalid scalar type", as its float8 buffer has no other dtype): ours
    gathers their bytes (``uint8``), one byte per element, and trains with the numbers of FSDP2
    without float8 all-gather (the same weight cast with the same scale, gathered the other way)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from composable_shard import fully_shard
    from composable_shard._runtime.collectives import record_collectives

    def build(fp8_all_gather: bool) -> nn.Sequential:
        torch.manual_seed(1)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, HIDDEN, bias=False), nn.ReLU(),
                                              nn.Linear(HIDDEN, WIDTH, bias=False)) for _ in range(2)])
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_all_gather))
        shard = fully_shard if fp8_all_gather else torch_fully_shard
        for block in model:
            shard(block)
        shard(model)  # a root with no parameter of its own
        return model

    ours, theirs = build(True), build(False)
    with record_collectives() as rec:
        losses = _train(ours, steps=1)
    assert [r.nbytes for r in rec.records if r.kind == "all_gather"] == [16384 // dist.get_world_size()] * 4, rec.records
    losses += _train(ours, steps=STEPS - 1, seed=200)
    reference = _train(theirs, steps=1) + _train(theirs, steps=STEPS - 1, seed=200)
    torch.testing.assert_close(losses, reference, rtol=_tolerance(), atol=0, msg=lambda m: f"losses: {m}")
    _assert_same_params(ours, theirs)


def _resume_with_fp8_all_gather() -> None:
    """A checkpoint of a model trained with float8 all-gather, loaded into a freshly converted and
    sharded one, resumes exactly: the next steps' losses and parameters equal the uninterrupted run's."""
    import shutil
    import tempfile

    from composable_shard import fully_shard, load_checkpoint, save_checkpoint, unshard_params

    model = _shard(_converted(True), fully_shard)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, steps=2, optim=optim)
    paths = [tempfile.mkdtemp(prefix="cs_fp8_") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(paths, src=0)
    path = paths[0] + "/step2"
    try:
        save_checkpoint(path, model, optim)
        resumed = _shard(_converted(True), fully_shard)
        resumed_optim = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
        load_checkpoint(path, resumed, resumed_optim)
    finally:
        dist.barrier()  # every rank has read it
        if dist.get_rank() == 0:
            shutil.rmtree(paths[0])
    expected = _train(model, steps=2, optim=optim, seed=300)
    got = _train(resumed, steps=2, optim=resumed_optim, seed=300)
    assert got == expected, (got, expected)
    with unshard_params(model), unshard_params(resumed):
        for (name, a), (_, b) in zip_same(list(model.named_parameters()), list(resumed.named_parameters())):
            assert torch.equal(a, b), name


def _tp_fp8_all_gather_refused() -> None:
    """2-D: float8 weights that are tensor-parallel DTensors holding torchao's tensors are refused at
    ``fully_shard`` naming the parameter, its module and the setting; the model is unchanged."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from composable_shard import FSDPModule, fully_shard

    model = _converted(True)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model[0], mesh["tp"], {"1": ColwiseParallel(), "3": RowwiseParallel()})
    params = [(n, p) for n, p in model.named_parameters()]
    with pytest.raises(NotImplementedError, match=r"'1\.weight' of '1' \(Float8Linear\).*enable_fsdp_float8_all_gather"):
        fully_shard(model[0], mesh=mesh["dp"])
    assert not isinstance(model[0], FSDPModule)
    assert all(p is q for (_, p), (_, q) in zip_same(params, list(model.named_parameters())))


def _replicate_with_fsdp2s_numbers() -> None:
    """``replicate`` all-reduces gradients and gathers nothing: both conversions train, with
    FSDP2's numbers (the float8 all-gather setting changes no number, and FSDP2 is run without it)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from composable_shard import replicate

    reference = _train(_shard(_converted(False), torch_fully_shard))
    tolerance = 0.0 if dist.get_world_size() == 2 else 1e-5
    for fp8_all_gather in (False, True):
        model = _converted(fp8_all_gather)
        replicate(model)
        torch.testing.assert_close(_train(model), reference, rtol=tolerance, atol=0,
                                   msg=lambda m: f"replicate, enable_fsdp_float8_all_gather={fp8_all_gather}: {m}")


_CASES: Dict[str, Callable[[], None]] = {
    "parity with FSDP2": lambda: _parity_with_fsdp2(False),
    "float8 all-gather: parity with FSDP2's": lambda: _parity_with_fsdp2(True),
    "float8 all-gather, bf16: parity with FSDP2's": lambda: _parity_with_fsdp2(True, bf16=True),
    "float8 all-gather: bytes": _fp8_bytes,
    "float8 all-gather: every parameter float8": _every_parameter_float8,
    "float8 all-gather: resume": _resume_with_fp8_all_gather,
    "replicate": _replicate_with_fsdp2s_numbers}


def _cases() -> List[str]:
    if dist.get_world_size() == 1:  # one rank: the float8 weights are still cast and gathered, the rest aliases its shard
        return ["float8 all-gather: parity with FSDP2's", "float8 all-gather: bytes"]
    if dist.get_world_size() == 4:  # what four ranks change: the sums' order, the shard sizes, 2-D meshes
        return [c for c in _CASES if c not in ("float8 all-gather: resume", "float8 all-gather, bf16: parity with FSDP2's")
                ] + ["tensor-parallel float8 all-gather refused"]
    return list(_CASES)


def _case(case: str) -> None:
    _CASES.get(case, _tp_fp8_all_gather_refused)()


def _all_cases() -> None:
    run_subtests(_case, {"case": _cases()})


@pytest.mark.parametrize("world_size", world_sizes())
def test_torchao_float8_under_fully_shard(world_size: int) -> None:
    """See the module docstring; one spawn for both cases."""
    _require_torchao()
    run_distributed(_all_cases, world_size, timeout=240)
