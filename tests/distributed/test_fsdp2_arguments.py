"""Each FSDP2 argument and step-changing ``FSDPModule`` method that ``fully_shard`` accepts, checked
for its effect against torch FSDP2 run in the same ranks ([Note: FSDP2 drop-in] in
``_setup/fsdp2_compat.py``).

An argument mapped wrongly is accepted, trains, and gives numbers within a few 1e-3 of the right
ones (a reduction in bf16 instead of fp32), or the same numbers (a strategy that keeps instead of
frees: only memory and communication change). So each case compares what the argument is for:
the dtype each collective runs in (our recorder's bytes per element; FSDP2's c10d operators'
tensors), every gradient bit for bit with FSDP2's under the same arguments (bit-identical today at
W = 2; a wrong reduce dtype moves them by up to 5e-3 of the largest), the dtype each fully sharded
module's forward receives, whether a module's parameters stay unsharded after forward (storage
bytes, against FSDP2's parameters being DTensors or not), and which modules are all-gathered or
reduced in which order (ours by tag, FSDP2's by the distinct shard sizes of the modules below).

W = 2 only: the 2-D meshes (1, 2) and (2, 1) put each mesh dimension alone at size 2. The root
keeps its parameters from forward to backward by default and frees them once
``reshard_after_forward=True`` is asked for it explicitly (the argument, or
``set_reshard_after_forward``), as torch 2.13's FSDP2 does.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from composable_shard import ShardingStrategy, fully_shard
from composable_shard._runtime.collectives import CollectiveRecorder, record_collectives
from tests._c10d_count import C10dCount
from tests._harness import run_distributed, run_subtests
from tests._models import full_grads, zip_same

WORLD = 2
WIDTHS = (5, 6, 7, 4)  # layer i maps WIDTHS[i] -> WIDTHS[i + 1]; the head maps WIDTHS[-1] -> OUT
OUT, ROWS = 3, 3
# Elements of each fully sharded module's own parameters (a Linear(i, o) has o * (i + 1)), worked
# out by hand: 6*6, 7*7, 4*8, and the root's head 3*5. Padded to a multiple of W=2: 36, 50, 32, 16.
NUMELS = {"layers.0": 36, "layers.1": 49, "layers.2": 32, "": 15}
LAYERS = ["layers.0", "layers.1", "layers.2"]
BYTES = {torch.float32: 4, torch.bfloat16: 2}


class Probe(nn.Module):
    """A Linear that records the dtype of the input its forward receives (after the fully
    sharded module's pre-forward hooks) and computes in its weight's dtype."""

    def __init__(self, fan_in: int, fan_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(fan_in, fan_out)
        self.seen: List[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        return torch.tanh(self.lin(x.to(self.lin.weight.dtype)))


class Net(nn.Module):
    """Three probes of distinct sizes and a head on the root; each probe gets an fp32 input
    from its parent, so that only its own input cast can make it low precision."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Probe(a, b) for a, b in zip(WIDTHS, WIDTHS[1:])])
        self.head = nn.Linear(WIDTHS[-1], OUT)
        self.seen: List[torch.dtype] = []
        self.fsdp2_names: Dict[int, str] = {}  # under FSDP2: shard numel -> FQN (see _fsdp2_names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        h = x
        for layer in self.layers:
            h = layer(h.float())
        return self.head(h.to(self.head.weight.dtype))


def _fsdp2() -> Any:
    import torch.distributed.fsdp as fsdp

    return fsdp


def _mesh(shape: Tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard") if len(shape) == 2 else ("shard",))


def _shard(fn: Callable[..., Any], mesh: Any = None, raf: Optional[bool] = None, root_raf: Optional[bool] = None,
           **config: Any) -> Any:
    """torchtitan's order: each layer (with ``reshard_after_forward=raf`` if given), then the
    root (with ``reshard_after_forward=root_raf`` if given); ``config`` for every call. FSDP2 gets
    sum reductions (gloo has no AVG). Typed ``Any``: the module's class is now ``FSDPNet``, with
    FSDP2's methods."""
    torch.manual_seed(0)
    model = Net()
    if "ignored_params" in config:
        config["ignored_params"] = {dict(model.named_parameters())[n] for n in config["ignored_params"]}
    for layer in model.layers:
        fn(layer, mesh=mesh, **config, **({} if raf is None else {"reshard_after_forward": raf}))
    fn(model, mesh=mesh, **config, **({} if root_raf is None else {"reshard_after_forward": root_raf}))
    if fn is not fully_shard:
        model.fsdp2_names = _fsdp2_names(model)
        for m in model.modules():
            if isinstance(m, _fsdp2().FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    return model


def _pair(**config: Any) -> Tuple[Any, Any]:
    return _shard(fully_shard, **config), _shard(_fsdp2().fully_shard, **config)


def _inputs(step: int = 0) -> torch.Tensor:
    return torch.randn(ROWS, WIDTHS[0], generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))


def _loss(model: nn.Module, step: int = 0) -> torch.Tensor:
    return model(_inputs(step)).float().pow(2).sum()


class C10dOps(C10dCount):
    """torch's collectives in issue order: ``(kind, numel of the shard, dtype)`` (the shard is
    the smaller tensor of a gather or reduce-scatter; an all-reduce's only tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[Tuple[str, int, torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kind = self.KINDS.get(func.__name__.split(".")[0]) if func.namespace == "c10d" else None
        if kind is not None:
            tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
                       if isinstance(t, torch.Tensor)]
            self.ops.append((kind, min(t.numel() for t in tensors), tensors[0].dtype))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _fsdp2_names(model: nn.Module) -> Dict[int, str]:
    """FSDP2's shard numel per fully sharded module -> its FQN: each sharded parameter's dim 0
    padded to a multiple of the shard dimension's size, by hand from the global shapes (distinct
    by construction of ``Net``; a parameter FSDP2 ignores is no DTensor). Read right after
    sharding, while every parameter is one."""
    from torch.distributed.tensor import DTensor

    fsdp_module = _fsdp2().FSDPModule
    names: Dict[int, str] = {}
    for fqn, m in model.named_modules():
        if isinstance(m, fsdp_module):
            inner = {id(p) for c in m.modules() if c is not m and isinstance(c, fsdp_module) for p in c.parameters()}
            mine = [p for p in m.parameters() if id(p) not in inner and isinstance(p, DTensor)]
            shards = mine[0].device_mesh.size(-1)
            numel = sum(-(-p.shape[0] // shards) * p[0].numel() for p in mine)
            assert numel not in names, (fqn, names)
            names[numel] = fqn
    return names


def _state(module: nn.Module) -> Any:
    """``fully_shard``'s state of ``module``, which has a handle (``Any``: the checks read its fields)."""
    state = fully_shard.state(module)
    assert state is not None and state.handle is not None, type(module).__name__
    return state


def _ours(recorder: CollectiveRecorder, kind: str) -> List[str]:
    return [r.tag for r in recorder.records if r.kind == kind and r.tag in NUMELS]


def _theirs(model: Net, mode: C10dOps, kind: str) -> List[str]:
    names = model.fsdp2_names
    return [names[numel] for k, numel, _ in mode.ops if k == kind and numel in names]


def _both(ours: Net, theirs: Net, run: Callable[[Net], Any]) -> Tuple[CollectiveRecorder, C10dOps]:
    with record_collectives() as recorder:
        run(ours)
    with C10dOps() as mode:
        run(theirs)
    return recorder, mode


def _same_order(ours: Net, theirs: Net, recorder: CollectiveRecorder, mode: C10dOps, kind: str,
                expected: List[str], what: str) -> None:
    """The modules of ``kind``'s collectives, in issue order for all-gathers (prefetching is an
    order), as a multiset for reductions (FSDP2 issues the root's when autograd reaches it)."""
    got = (_ours(recorder, kind), _theirs(theirs, mode, kind))
    if kind != "all_gather":
        got, expected = (sorted(got[0]), sorted(got[1])), sorted(expected)
    assert got == (expected, expected), f"{what}: {kind}s (ours, FSDP2) {got}, expected {expected} for both"


def _grads(ours: Net, theirs: Net, what: str) -> None:
    """Every gradient bit for bit FSDP2's (fp32, as FSDP2 casts them back)."""
    from torch.distributed.tensor import DTensor

    fsdp2 = [(n, p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for n, p in theirs.named_parameters() if p.grad is not None]
    for (name, a), (_, e) in zip_same(full_grads(ours), fsdp2, what=what):
        assert a.dtype == e.dtype == torch.float32, (what, name, a.dtype, e.dtype)
        assert torch.equal(a, e), (what, name, (a - e).abs().max().item())


# ---------------------------------------------------------------------------- mp_policy
# (param_dtype, reduce_dtype, cast_forward_inputs); the reduction runs in reduce_dtype, else in
# param_dtype, else fp32 (FSDP2's MixedPrecisionPolicy docs); the gathers in param_dtype.
POLICIES = {"bf16_fp32": (torch.bfloat16, torch.float32, True), "bf16": (torch.bfloat16, None, False),
            "fp32_reduce_bf16": (None, torch.bfloat16, True), "bf16_no_cast": (torch.bfloat16, torch.float32, False)}


def _mp_policy(policy: str) -> None:
    """Gathers in ``param_dtype`` and reductions in ``reduce_dtype`` (else ``param_dtype``):
    bytes per element of every all-gather and reduce-scatter (ours, against the handles' padded
    sizes by hand) and dtypes (FSDP2's); each module's forward input cast to ``param_dtype``
    exactly when ``cast_forward_inputs`` (and only then), as FSDP2's; output dtypes and every
    gradient bit for bit FSDP2's."""
    param_dtype, reduce_dtype, cast = POLICIES[policy]
    mp = _fsdp2().MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=cast)
    ours, theirs = _pair(mp_policy=mp)
    outputs: List[torch.dtype] = []

    def step(model: Net) -> None:
        out = model(_inputs())
        outputs.append(out.dtype)
        out.float().pow(2).sum().backward()

    recorder, mode = _both(ours, theirs, step)
    gathered = param_dtype or torch.float32
    reduced = reduce_dtype or param_dtype or torch.float32
    for r in recorder.records:
        if r.tag in NUMELS and r.kind in ("all_gather", "reduce_scatter"):
            padded = -(-NUMELS[r.tag] // WORLD) * WORLD
            elements = padded // WORLD if r.kind == "all_gather" else padded
            dtype = gathered if r.kind == "all_gather" else reduced
            assert r.nbytes == elements * BYTES[dtype], (policy, r.kind, r.tag, r.nbytes, elements, dtype)
    assert {d for k, _, d in mode.ops if k == "all_gather"} == {gathered}, (policy, mode.ops)
    assert {d for k, _, d in mode.ops if k == "reduce_scatter"} == {reduced}, (policy, mode.ops)
    assert sorted(_ours(recorder, "reduce_scatter")) == sorted(NUMELS), recorder.records
    inputs = (param_dtype if cast and param_dtype is not None else torch.float32)
    for model in (ours, theirs):
        seen = [model.seen] + [layer.seen for layer in model.layers]
        assert seen == [[inputs]] * 4, (policy, type(model).__name__, seen)
    assert outputs == [gathered] * 2, (policy, outputs)
    _grads(ours, theirs, policy)


class _WithNorm(nn.Module):
    """A block holding a BatchNorm, then a head on the root; records the dtype of the norm's
    weight in each of its forwards. The norm keeps no running statistics: float32 buffers beside
    bf16 weights fail in torch's CPU batch norm, under FSDP2 as under ours."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(WIDTHS[0], WIDTHS[1]), nn.BatchNorm1d(WIDTHS[1], track_running_stats=False), nn.Tanh())
        self.head = nn.Linear(WIDTHS[1], OUT)
        self.norm_dtypes: List[torch.dtype] = []
        self.block[1].register_forward_pre_hook(lambda m, _: self.norm_dtypes.append(m.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def _mp_policy_casts_norms() -> None:
    """FSDP2's ``MixedPrecisionPolicy`` casts every parameter of a fully sharded module, a
    BatchNorm's too (unlike FSDP1's ``MixedPrecision`` and ours, which keep norms in full
    precision by default): the norm computes in bf16 as under FSDP2, and over two steps the
    losses and gradients are bit for bit FSDP2's."""
    fsdp = _fsdp2()
    mp = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models: List[_WithNorm] = []
    for fn in (fully_shard, fsdp.fully_shard):
        torch.manual_seed(0)
        model = _WithNorm()
        fn(model.block, mp_policy=mp)
        fn(model, mp_policy=mp)
        for m in model.modules():
            if isinstance(m, fsdp.FSDPModule) and fn is not fully_shard:
                m.set_force_sum_reduction_for_comms(True)
        models.append(model)
    ours, theirs = models
    for step in range(2):
        losses = [_loss(model, step) for model in models]
        assert torch.equal(losses[0], losses[1]), (step, losses)
        for model in models:
            losses[model is theirs].backward()
        _grads(ours, theirs, f"mp_policy with a BatchNorm, step {step}")
        for model in models:
            model.zero_grad()
    assert ours.norm_dtypes == theirs.norm_dtypes == [torch.bfloat16] * 2, (ours.norm_dtypes, theirs.norm_dtypes)


def _refused() -> None:
    """FSDP2 arguments with no counterpart raise ``NotImplementedError`` naming them, and leave
    the module as it was: ``output_dtype`` (accepted and not applied, the output's dtype would
    change silently), ``dp_mesh_dims``."""
    fsdp = _fsdp2()
    for kwargs, name in [(dict(mp_policy=fsdp.MixedPrecisionPolicy(output_dtype=torch.float32)), "output_dtype"),
                         (dict(mp_policy=fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                   output_dtype=torch.bfloat16)), "output_dtype"),
                         (dict(dp_mesh_dims=object()), "dp_mesh_dims")]:
        model = Net()
        with pytest.raises(NotImplementedError, match=name):
            fully_shard(model.layers[0], **kwargs)
        assert type(model.layers[0]) is Probe and model.layers[0].lin.weight.shape == (WIDTHS[1], WIDTHS[0]), name


# ---------------------------------------------------------------------------- offload_policy, ignored_params
def _offload_policy(offload: bool) -> None:
    """``CPUOffloadPolicy`` is ``CPUOffload(offload_params=True)`` on every fully sharded module
    (shards and gradients kept on the CPU, the host-buffer path of [Note: CPU offload]),
    ``OffloadPolicy()`` none; gradients bit for bit FSDP2's under the same policy."""
    fsdp = _fsdp2()
    policy = fsdp.CPUOffloadPolicy(pin_memory=False) if offload else fsdp.OffloadPolicy()
    ours, theirs = _pair(offload_policy=policy)
    for m in [ours, *ours.layers]:
        state = _state(m)
        assert state.cpu_offload.offload_params is offload and state.handle.offload_params is offload, m
        assert state.handle.shard_device == torch.device("cpu"), m
    _both(ours, theirs, lambda model: _loss(model).backward())
    _grads(ours, theirs, f"offload={offload}")


def _ignored_params() -> None:
    """``ignored_params``: the parameter keeps its shape, is in no flat parameter and no
    collective (layers.1 reduces its bias only: 7 elements, padded to 8), and its gradient is
    this rank's own (unreduced), as FSDP2's: every gradient bit for bit FSDP2's."""
    ours, theirs = _pair(ignored_params={"layers.1.lin.weight"})
    kept = ours.layers[1].lin.weight
    assert kept.shape == (WIDTHS[2], WIDTHS[1]) and all(kept is not p for g in _state(ours.layers[1]).handle.groups
                                                        for p in g.orig_params)
    recorder, _ = _both(ours, theirs, lambda model: _loss(model).backward())
    assert [r.nbytes for r in recorder.records if r.kind == "reduce_scatter" and r.tag == "layers.1"] == [8 * 4]
    _grads(ours, theirs, "ignored_params")
    local = kept.grad.clone()  # this rank's own: the ranks' inputs differ, so their gradients do
    others = [torch.empty_like(local) for _ in range(WORLD)]
    dist.all_gather(others, local)
    assert not torch.equal(others[0], others[1]), "the ignored parameter's gradient was reduced"


# ---------------------------------------------------------------------------- reshard_after_forward
MESHES = {"1d": (WORLD,), "hsdp_1x2": (1, WORLD), "hsdp_2x1": (WORLD, 1)}


def _reshard_after_forward(mesh: str, raf: Optional[bool]) -> None:
    """``reshard_after_forward`` on a 1-D mesh and on 2-D (replicate, shard) meshes: the
    strategy (True or None: FULL_SHARD / HYBRID_SHARD, False: SHARD_GRAD_OP /
    _HYBRID_SHARD_ZERO2); after forward a layer's unsharded storage is kept (its padded bytes)
    exactly when False and the shard dimension has more than one rank, as FSDP2's parameters
    stay unsharded; backward all-gathers the layers again (2, 1, 0) exactly when they were
    freed, as FSDP2's; the shard dimension is the mesh's last (a shard of ceil(N/shard) elements,
    reduce-scattered over it, all-reduced over the first); gradients bit for bit FSDP2's."""
    from torch.distributed.tensor import DTensor

    replicas, shards = (1, *MESHES[mesh])[-2:]
    ours, theirs = (_shard(fn, mesh=_mesh(MESHES[mesh]), raf=raf) for fn in (fully_shard, _fsdp2().fully_shard))
    hybrid = len(MESHES[mesh]) == 2
    strategy = {(False, True): ShardingStrategy.FULL_SHARD, (False, False): ShardingStrategy.SHARD_GRAD_OP,
                (True, True): ShardingStrategy.HYBRID_SHARD, (True, False): ShardingStrategy._HYBRID_SHARD_ZERO2}
    for name, layer in zip_same(LAYERS, list(ours.layers)):
        state = _state(layer)
        assert state.strategy is strategy[hybrid, raf is not False], (mesh, raf, name, state.strategy)
        assert state.world_size == shards and state.dp_world_size == WORLD, (mesh, name, state.world_size)
        assert state.handle.flat_param.numel() == -(-NUMELS[name] // shards), (mesh, name)
    losses = [_loss(ours), _loss(theirs)]
    kept = raf is False and shards > 1
    for name, mine, other in zip_same(LAYERS, list(ours.layers), list(theirs.layers)):
        groups = _state(mine).handle.groups
        nbytes = sum(g.padded_unsharded_flat.untyped_storage().nbytes() for g in groups if not g.aliases_shard)
        assert nbytes == (-(-NUMELS[name] // shards) * shards * 4 if kept else 0), (mesh, raf, name, nbytes)
        if shards > 1:
            assert isinstance(other.lin.weight, DTensor) is not kept, (mesh, raf, name, "FSDP2")
    with record_collectives() as recorder:
        losses[0].backward()
    with C10dOps() as mode:
        losses[1].backward()
    expected = [] if raf is False or shards == 1 else LAYERS[::-1]
    _same_order(ours, theirs, recorder, mode, "all_gather", expected, f"{mesh} raf={raf} backward")
    reductions = [(r.kind, r.group_size) for r in recorder.records
                  if r.tag in NUMELS and r.kind in ("reduce_scatter", "all_reduce")]
    by_hand = [("reduce_scatter", shards)] * (shards > 1) + [("all_reduce", replicas)] * (replicas > 1)
    assert reductions == by_hand * len(NUMELS), (mesh, reductions)
    _grads(ours, theirs, f"{mesh} raf={raf}")


# ---------------------------------------------------------------------------- the methods
def _step_methods() -> None:
    """The FSDPModule methods that change the step, called the same way on ours and FSDP2's:
    the modules gathered and reduced, in order, equal FSDP2's (and what the call asks, worked
    out by hand), and every gradient bit for bit FSDP2's.
      set_reshard_after_forward(False) on a layer keeps it to its backward (recurse=False on
        the root leaves the layers alone; recurse=True reaches them); True frees it again;
      set_reshard_after_backward(False) keeps a layer to the next forward; reshard() frees it;
      unshard() gathers a layer before forward, which then gathers the others only;
      set_requires_gradient_sync(False, recurse=False) on a layer skips its reduction only,
        and the next synced backward reduces the sum of both;
      set_modules_to_backward_prefetch / set_modules_to_forward_prefetch reorder the gathers."""
    ours, theirs = _pair()
    pairs = dict(zip_same(["", *LAYERS], list(zip_same([ours, *ours.layers], [theirs, *theirs.layers]))))

    def call(method: str, fqn: str, *args: Any, **kwargs: Any) -> None:
        for module in pairs[fqn]:
            getattr(module, method)(*args, **kwargs)

    def check(what: str, forward: List[str], backward: List[str], reduced: List[str], step: int = 0) -> None:
        losses: List[torch.Tensor] = []
        recorder, mode = _both(ours, theirs, lambda model: losses.append(_loss(model, step)))
        _same_order(ours, theirs, recorder, mode, "all_gather", forward, f"{what} forward")
        recorder, mode = _both(ours, theirs, lambda model: losses[model is theirs].backward())
        _same_order(ours, theirs, recorder, mode, "all_gather", backward, f"{what} backward")
        _same_order(ours, theirs, recorder, mode, "reduce_scatter", reduced, f"{what} reductions")

    everything, back = ["", *LAYERS], LAYERS[::-1]
    check("defaults", everything, back, everything)
    call("set_reshard_after_forward", "layers.2", False)
    check("layers.2 kept", everything, ["layers.1", "layers.0"], everything)
    call("set_reshard_after_forward", "", False, recurse=False)  # the root only: the layers as they were
    check("root only", everything, ["layers.1", "layers.0"], everything)
    call("set_reshard_after_forward", "", False)
    check("all kept", everything, [], everything)
    call("set_reshard_after_forward", "", True, recurse=False)  # asked for explicitly: the root frees too
    check("root freed", everything, [""], everything)
    call("set_reshard_after_forward", "", False, recurse=False)
    call("set_reshard_after_forward", "layers.1", True)
    check("layers.1 freed", everything, ["layers.1"], everything)
    for fqn in LAYERS:
        call("set_reshard_after_forward", fqn, True)
    call("set_reshard_after_backward", "layers.1", False)
    check("layers.1 kept after backward", everything, back, everything)
    check("next forward", ["", "layers.0", "layers.2"], back, everything, step=1)
    call("set_reshard_after_backward", "layers.1", True)
    call("reshard", "layers.1")
    call("unshard", "layers.2")
    check("layers.2 unsharded", everything[:-1], back, everything, step=2)
    call("set_requires_gradient_sync", "layers.1", False, recurse=False)
    check("layers.1 unsynced", everything, back, ["", "layers.0", "layers.2"], step=3)
    call("set_requires_gradient_sync", "layers.1", True, recurse=False)
    for model in (ours, theirs):  # each its own modules
        model.set_modules_to_forward_prefetch([model.layers[1]])
        model.layers[2].set_modules_to_backward_prefetch([model.layers[0]])
    check("prefetch", ["", "layers.1", "layers.0", "layers.2"], ["layers.2", "layers.0", "layers.1"], everything,
          step=4)
    _grads(ours, theirs, "methods: the sum of steps 3 and 4 for layers.1")


def _divide_factor() -> None:
    """``set_gradient_divide_factor`` changes the module it is called on only, as FSDP2's (not
    recursive: torch 2.13's sets its own state's groups): 1.0 on the root sums the head's
    gradient (exactly twice the average at W=2) and leaves the layers averaged; 4.0 on
    layers.0 halves its average, 8.0 on layers.1 through ``set_reduce_scatter_divide_factor``
    (FSDP2's deprecated name, warning as FSDP2's does) quarters it. Gradients bit for bit
    FSDP2's."""
    ours, theirs = _pair()
    for model in (ours, theirs):
        _loss(model).backward()
    averaged = dict(full_grads(ours))
    _grads(ours, theirs, "averaged")
    for model in (ours, theirs):
        model.zero_grad()
        model.set_gradient_divide_factor(1.0)
        model.layers[0].set_gradient_divide_factor(4.0)
        with pytest.warns(DeprecationWarning, match="set_gradient_divide_factor"):
            model.layers[1].set_reduce_scatter_divide_factor(8.0)
        _loss(model).backward()
    scale = {"head": 2.0, "layers.0": 0.5, "layers.1": 0.25, "layers.2": 1.0}
    for name, grad in full_grads(ours):
        factor = next(v for k, v in scale.items() if name.startswith(k))
        assert torch.equal(grad, averaged[name] * factor), (name, factor)
    _grads(ours, theirs, "divide factors")


def _root_reshard_after_forward(root_raf: Optional[bool]) -> None:
    """The root's ``reshard_after_forward``: left to its default (None) the root keeps its
    parameters from forward to backward (FSDP2's heuristic: its backward comes first); passed as
    True explicitly it frees them after forward and backward gathers it again first, as FSDP2's;
    False keeps them. The root's storage after forward, the backward's all-gathers in order, and
    every gradient bit for bit FSDP2's."""
    ours, theirs = (_shard(fn, root_raf=root_raf) for fn in (fully_shard, _fsdp2().fully_shard))
    losses: List[torch.Tensor] = []
    recorder, mode = _both(ours, theirs, lambda model: losses.append(_loss(model)))
    groups = _state(ours).handle.groups
    kept = sum(g.padded_unsharded_flat.untyped_storage().nbytes() for g in groups if not g.aliases_shard)
    assert kept == (0 if root_raf else -(-NUMELS[""] // WORLD) * WORLD * 4), (root_raf, kept)
    recorder, mode = _both(ours, theirs, lambda model: losses[model is theirs].backward())
    _same_order(ours, theirs, recorder, mode, "all_gather", ([""] if root_raf else []) + LAYERS[::-1],
                f"root raf={root_raf} backward")
    _grads(ours, theirs, f"root raf={root_raf}")


CASES: Dict[str, Callable[..., None]] = {
    "root_reshard_after_forward": lambda: run_subtests(_root_reshard_after_forward, {"root_raf": [None, True, False]}),
    "mp_policy": lambda: run_subtests(_mp_policy, {"policy": list(POLICIES)}),
    "mp_policy_casts_norms": _mp_policy_casts_norms,
    "refused": _refused,
    "offload_policy": lambda: run_subtests(_offload_policy, {"offload": [True, False]}),
    "ignored_params": _ignored_params,
    "reshard_after_forward": lambda: run_subtests(lambda mesh_raf: _reshard_after_forward(*mesh_raf), {"mesh_raf": [
        ("1d", True), ("1d", False), ("hsdp_1x2", True), ("hsdp_1x2", False), ("hsdp_1x2", None), ("hsdp_2x1", True),
        ("hsdp_2x1", False)]}),  # None (FSDP2's default) where it maps to a strategy fully_shard does not default to
    "step_methods": _step_methods,
    "divide_factor": _divide_factor,
}


def _cases(names: Sequence[str]) -> None:
    run_subtests(lambda case: CASES[case](), {"case": list(names)})


def test_fsdp2_arguments_have_fsdp2s_effect() -> None:
    """W = 2, one spawn: every case above against torch FSDP2 in the same ranks. Without it an
    FSDP2 argument or method mapped wrongly (reduce dtype, input casts, HSDP's strategy or
    dimensions, offload, ignored parameters, a method reaching too many modules or none) is
    accepted and trains on, with gradients a few 1e-3 off or other memory and communication."""
    run_distributed(_cases, WORLD, list(CASES), timeout=120)
