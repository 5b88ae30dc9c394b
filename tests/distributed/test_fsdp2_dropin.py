"""FSDP2's surface on ``fully_shard`` (issue 47): code written for torch's FSDP2 -- torchtitan's
``apply_fsdp`` and train loop, its chunked loss -- runs unchanged on this library's modules.

torch's stack finds FSDP2 modules with ``isinstance(m, torch.distributed.fsdp.FSDPModule)``; each
test calls FSDP2's methods the way that code does (found by that ``isinstance``), runs torch FSDP2
on the same model in the same ranks as the reference where it applies, and checks against
single-process training on the combined batch otherwise. Collective counts are compared per kind
(all-gathers, reduce-scatters) and step: ours from the library's recorder, FSDP2's from the c10d
operators a dispatch mode sees.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from composable_shard import FSDPModule, fully_shard, get_model_state_dict, unshard_params
from composable_shard._runtime.collectives import record_collectives
from tests._c10d_count import C10dCount
from tests._harness import run_distributed, run_subtests
from tests._models import Block, assert_params_close, full_grads, zip_same

VOCAB, WIDTH, ROWS, SEQ = 17, 6, 2, 5


class RotaryCache(nn.Module):
    """A buffer and no ``reset_parameters()``, as torchtitan's RoPE: a meta-built model with it
    cannot be initialized by fully_shard, so fully_shard defers (FSDP2's flow)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.arange(SEQ, dtype=torch.float32) / SEQ, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.cache[: h.shape[1]].view(1, -1, 1).to(h.dtype)


class Decoder(nn.Module):
    """Embedding, rotary cache, three blocks, norm, output: torchtitan's decoder in miniature."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, WIDTH)
        self.rope = RotaryCache()
        self.layers = nn.ModuleList([Block() for _ in range(3)])
        self.norm = nn.LayerNorm(WIDTH)
        self.output = nn.Linear(WIDTH, VOCAB, bias=False)
        self.output_in_loss = False

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.rope(self.tok_embeddings(tokens))
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.output_in_loss:  # torchtitan's decoder under its ChunkedLossWrapper
            return self.hidden(tokens)
        return self.output(self.hidden(tokens))

    def init_weights(self) -> None:
        """torchtitan style: every parameter drawn in place, whole (fan-in uses the 2-D shape)."""
        nn.init.normal_(self.tok_embeddings.weight, std=0.5)
        for layer in self.layers:
            for lin in (layer.fc1, layer.fc2):
                nn.init.kaiming_uniform_(lin.weight, a=5 ** 0.5)
                nn.init.uniform_(lin.bias, -0.1, 0.1)
            layer.ln.reset_parameters()
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.output.weight, std=0.3)
        self.rope.cache.copy_(torch.arange(SEQ, dtype=torch.float32) / SEQ)


class _NormedOutput(nn.Linear):
    """An output layer that applies the decoder's final norm itself, calling it (held in a list:
    the decoder owns it, it is no submodule of this layer) inside its own forward."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__(WIDTH, VOCAB, bias=False)
        self._norm = [norm]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return super().forward(self._norm[0](h))


class NormInOutput(Decoder):
    """The Decoder whose output layer applies its norm: ``norm`` runs inside ``output``'s forward."""

    def __init__(self) -> None:
        super().__init__()
        self.output = _NormedOutput(self.norm)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.rope(self.tok_embeddings(tokens))
        for layer in self.layers:
            h = layer(h)
        return h


def _build(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    return Decoder()


def _tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randint(0, VOCAB, (ROWS * dist.get_world_size(), SEQ + 1), generator=g)


def _mine(rows: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    return rows[rank * ROWS:(rank + 1) * ROWS]


def _loss(model: nn.Module, rows: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten(), reduction=reduction)


def _reference_grads(reference: nn.Module, step: int, reduction: str = "mean",
                     keep: bool = False) -> List[Tuple[str, torch.Tensor]]:
    """One process, the combined batch: the mean of the ranks' losses (``mean``), or the sum of
    their per-token sums (``sum``: what a divide factor of 1.0 reduces). ``keep``: leave the
    gradients in place for an optimizer step."""
    rows = _tokens(step)
    world = dist.get_world_size()
    losses = [_loss(reference, rows[r * ROWS:(r + 1) * ROWS], reduction) for r in range(world)]
    total = sum(losses) / (world if reduction == "mean" else 1)
    total.backward()  # type: ignore[union-attr]  # a tensor
    out = [(n, p.grad.detach().clone()) for n, p in reference.named_parameters() if p.grad is not None]
    if not keep:
        reference.zero_grad()
    return out


def _torch_fsdp2() -> Any:
    import torch.distributed.fsdp as fsdp

    return fsdp


def _our_counts(step: Callable[[], None]) -> Counter:
    with record_collectives() as recorder:
        step()
    return Counter(r.kind for r in recorder.records if r.kind in ("all_gather", "reduce_scatter"))


def _fsdp2_counts(step: Callable[[], None]) -> Counter:
    with C10dCount() as mode:
        step()
    return Counter({k: v for k, v in mode.counts.items() if k in ("all_gather", "reduce_scatter")})


def _shard_like_torchtitan(model: Decoder, fully_shard_fn: Callable[..., Any], **config: Any) -> Decoder:
    """torchtitan's ``apply_fsdp_to_decoder`` without weight tying: embeddings, the
    ``[norm, output]`` group kept after forward, each block, the root; then its
    ``disable_fsdp_gradient_division`` (found by ``isinstance`` against torch's class)."""
    fully_shard_fn(model.tok_embeddings, **config, reshard_after_forward=True)
    fully_shard_fn([model.norm, model.output], **config, reshard_after_forward=False)
    for layer in model.layers:
        fully_shard_fn(layer, **config, reshard_after_forward=True)
    fully_shard_fn(model, **config)
    for module in model.modules():
        if isinstance(module, _torch_fsdp2().FSDPModule):
            module.set_gradient_divide_factor(1.0)
    return model


def _force_sum(model: nn.Module) -> None:
    """FSDP2 on gloo: sums and a division (gloo has neither AVG nor PREMUL_SUM)."""
    for module in model.modules():
        if isinstance(module, _torch_fsdp2().FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


# ---------------------------------------------------------------------------- the class
def _surface() -> None:
    """Every attribute torch's FSDPModule defines is ours (none of FSDP2's code can run), and a
    fully sharded module is an instance of torch's class."""
    torch_module = _torch_fsdp2().FSDPModule
    names = [n for n in vars(torch_module) if not (n.startswith("__") and n.endswith("__")) and callable(getattr(torch_module, n))]
    assert len(names) > 20, names
    inherited = [n for n in names if getattr(FSDPModule, n) is getattr(torch_module, n)]
    assert inherited == [], f"torch FSDP2's own {inherited} would run on our modules"
    model = fully_shard(_build())
    assert isinstance(model, torch_module) and isinstance(model, Decoder)
    with pytest.raises(RuntimeError, match="composable_shard's fully_shard, not torch's FSDP2"):
        model._get_fsdp_state()
    for call, args in [("set_custom_all_gather", (None,)), ("set_custom_reduce_scatter", (None,)),
                       ("set_all_reduce_hook", (None,)), ("set_post_optim_event", (None,)),
                       ("set_unshard_in_backward", (False,)), ("set_symm_mem_for_comm", ()),
                       ("set_allocate_memory_from_process_group_for_comm", (True,))]:
        with pytest.raises(NotImplementedError, match=f"{call}.*torch FSDP2.*not supported"):
            getattr(model, call)(*args)
    with pytest.raises(NotImplementedError, match="reshard_after_forward=2"):
        fully_shard(_build().layers[0], reshard_after_forward=2)
    with pytest.raises(NotImplementedError, match="shard_placement_fn"):
        fully_shard(_build().layers[0], shard_placement_fn=lambda p: None)
    with pytest.raises(ValueError, match="either strategy= or FSDP2's reshard_after_forward="):
        from composable_shard import ShardingStrategy
        fully_shard(_build().layers[0], strategy=ShardingStrategy.SHARD_GRAD_OP, reshard_after_forward=True)
    with pytest.raises(ValueError, match="set_gradient_divide_factor: factor must be a positive"):
        model.set_gradient_divide_factor(0.0)
    one = _build()
    assert fully_shard([one.norm]) == [one.norm] and fully_shard.state(one.norm).module is one.norm  # as fully_shard(norm)


# ---------------------------------------------------------------------------- torchtitan's apply_fsdp
def _torchtitan_recipe() -> None:
    """torchtitan's calls, as it makes them, against FSDP2 in the same ranks: per-token-sum
    losses with the divide factor 1.0 give FSDP2's gradients (the sum over ranks, not the
    mean: a divide factor skipped halves them at W=2), which equal single-process gradients of
    the summed loss; all-gathers and reduce-scatters per step no more than FSDP2's."""
    fsdp = _torch_fsdp2()
    ours = _shard_like_torchtitan(_build(), fully_shard)
    theirs = _shard_like_torchtitan(_build(), fsdp.fully_shard)
    _force_sum(theirs)
    reference = _build()
    assert isinstance(ours.output, FSDPModule) and fully_shard.state(ours.output) is fully_shard.state(ours.norm)
    optims = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ours, theirs, reference)]
    for step in range(3):
        rows = _mine(_tokens(step))
        counts = [_our_counts(lambda: _loss(ours, rows, "sum").backward()),
                  _fsdp2_counts(lambda: _loss(theirs, rows, "sum").backward())]
        expected = _reference_grads(reference, step, "sum", keep=True)
        assert_params_close(full_grads(ours), expected, atol=2e-5, what=f"step {step} vs one process")
        fsdp2 = [(n, p.grad.full_tensor()) for n, p in theirs.named_parameters() if p.grad is not None]
        assert_params_close(full_grads(ours), fsdp2, atol=2e-5, what=f"step {step} vs FSDP2")
        if step > 0:  # the first iteration agrees on layouts and orders besides
            for kind in ("all_gather", "reduce_scatter"):
                assert counts[0][kind] <= counts[1][kind], f"step {step} {kind}s: ours {counts[0]}, FSDP2 {counts[1]}"
        for optim in optims:
            optim.step()
            optim.zero_grad()


def _chunked_loss() -> None:
    """torchtitan's ``ChunkedLossWrapper``: the output layer applied chunk by chunk after the
    decoder's forward, each chunk's backward right away with gradient sync off until the last
    and the layer kept unsharded across chunks (``set_reshard_after_forward/backward(False)``,
    ``unshard()``, then ``reshard()``), then the decoder's backward from the accumulated
    hidden-state gradient: gradients equal one process's; the output layer is gathered once."""
    model = _shard_like_torchtitan(_build(), fully_shard)
    model.output_in_loss = True
    reference = _build()
    head = model.output
    for step in range(2):
        rows = _mine(_tokens(step))
        with record_collectives() as recorder:
            hidden = model(rows[:, :-1])
            chunks = [c.detach().requires_grad_(True) for c in hidden.split(1, dim=1)]
            labels = rows[:, 1:].split(1, dim=1)
            head.set_reshard_after_forward(False)
            head.set_reshard_after_backward(False)
            head.set_requires_gradient_sync(False, recurse=False)
            head.unshard()
            grads = []
            for i, (chunk, label) in enumerate(zip(chunks, labels)):
                if i == len(chunks) - 1:
                    head.set_requires_gradient_sync(True, recurse=False)
                F.cross_entropy(head(chunk).flatten(0, 1), label.flatten(), reduction="sum").backward()
                grads.append(chunk.grad)
            head.set_reshard_after_forward(True)
            head.set_reshard_after_backward(True)
            head.set_requires_gradient_sync(True, recurse=False)
            head.reshard()
            hidden.backward(torch.cat(grads, dim=1))
        gathers = [r.tag for r in recorder.records if r.kind == "all_gather"]
        # by hand: forward tok_embeddings, 3 layers, [norm, output] (kept through the chunks); reshard();
        # the decoder's backward: [norm, output] again, 3 layers, tok_embeddings -- nothing for the chunks,
        # and no backward prefetch of layers.2 gathered for a chunk's backward that never reaches it, except
        # once, in the first chunk's backward of the first step, which teaches the source not to
        expected = ["tok_embeddings", "layers.0", "layers.1", "layers.2", "norm+output"] * 2 + ["layers.2"] * (step == 0)
        assert sorted(gathers) == sorted(expected), f"step {step}: {gathers}"
        expected = _reference_grads(reference, step, "sum")
        assert_params_close(full_grads(model), expected, atol=2e-5, what=f"chunked step {step}")
        model.zero_grad()


def _bf16_mp_policy() -> None:
    """``mp_policy=MixedPrecisionPolicy(bf16, fp32)`` (torchtitan's, ``cast_forward_inputs=False``)
    gives FSDP2's gradients under the same policy bit for bit (a reduction in bf16 instead of
    fp32 moves them by up to 5e-3 of the largest element; test_fsdp2_arguments.py checks every
    policy's dtypes)."""
    fsdp = _torch_fsdp2()
    config = dict(mp_policy=fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                        cast_forward_inputs=False))
    ours = _shard_like_torchtitan(_build(), fully_shard, **config)
    theirs = _shard_like_torchtitan(_build(), fsdp.fully_shard, **config)
    _force_sum(theirs)
    assert fully_shard.state(ours).mixed_precision.param_dtype is torch.bfloat16
    rows = _mine(_tokens(0))
    for model in (ours, theirs):
        _loss(model, rows, "sum").backward()
    fsdp2 = [(n, p.grad.full_tensor()) for n, p in theirs.named_parameters() if p.grad is not None]
    for (name, a), (_, e) in zip_same(full_grads(ours), fsdp2, what="bf16 gradients"):
        assert torch.equal(a, e), (name, (a - e).abs().max().item(), e.abs().max().item())


def _member_inside_member() -> None:
    """torchtitan's ``[norm, output]`` group where the output layer calls the norm inside its own
    forward: the group's post-forward runs once, after the outer member's forward (as FSDP2's group
    hooks run it after the last member's), the inner member only casting its inputs; forward and
    backward run and, for two steps, the gradients equal one process's on the combined batch.
    Running the full post-forward at the inner member's end left the handle idle mid-forward, and
    the outer one's post-forward raised an illegal transition."""
    model, reference = _build_norm_in_output(), _build_norm_in_output()
    fully_shard([model.norm, model.output])
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    for step in range(2):
        _loss(model, _mine(_tokens(step))).backward()
        assert_params_close(full_grads(model), _reference_grads(reference, step), atol=1e-5,
                            what=f"norm called inside output, step {step}")
        model.zero_grad()


def _build_norm_in_output() -> NormInOutput:
    torch.manual_seed(0)
    return NormInOutput()


# ---------------------------------------------------------------------------- the methods
def _reshard_after_forward() -> None:
    """``reshard_after_forward=False`` and ``set_reshard_after_forward(False)`` keep a block's
    parameters from forward to backward: no all-gather in its backward, as in FSDP2."""
    for how in ("argument", "method"):
        model = _build()
        for layer in model.layers:
            fully_shard(layer, reshard_after_forward=how == "method")
        fully_shard(model)
        if how == "method":
            for layer in model.layers:
                layer.set_reshard_after_forward(False)
        rows = _mine(_tokens(0))
        _loss(model, rows).backward()
        with record_collectives() as recorder:
            _loss(model, rows).backward()
        gathers = [r.tag for r in recorder.records if r.kind == "all_gather"]
        assert sorted(gathers) == sorted(["", "layers.0", "layers.1", "layers.2"]), (how, gathers)


def _prefetch_chosen() -> None:
    """``set_modules_to_forward_prefetch`` issues the chosen blocks' gathers at the start of the
    block's forward (before the next block's forward hook runs); gradients are unchanged."""
    model, reference = _build(), _build()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.layers[0].set_modules_to_forward_prefetch([model.layers[1], model.layers[2]])
    model.layers[2].set_modules_to_backward_prefetch([model.layers[0]])
    for step in range(2):
        with record_collectives() as recorder:
            _loss(model, _mine(_tokens(step))).backward()
        events = [e for e in recorder.events if e[0] == "trace" and e[1] in ("pre_forward", "prefetch", "pre_backward")]
        first = events.index(("trace", "pre_forward", "layers.0"))
        assert events[first + 1:first + 3] == [("trace", "prefetch", "layers.1"), ("trace", "prefetch", "layers.2")], \
            events
        back = events.index(("trace", "pre_backward", "layers.2"))
        assert events[back + 1] == ("trace", "prefetch", "layers.0"), events
        assert_params_close(full_grads(model), _reference_grads(reference, step), what=f"prefetch step {step}")
        model.zero_grad()


def _unshard_async() -> None:
    """``unshard(async_op=True)`` returns a handle whose ``wait()`` lands the gathers; the
    forward then gathers nothing for that module and computes the same output."""
    model, reference = _build(), _build()
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=False)
    fully_shard(model)
    rows = _mine(_tokens(0))
    _loss(model, rows).backward()  # lazy init
    model.zero_grad()
    handle = model.layers[1].unshard(async_op=True)
    assert handle is not None
    handle.wait()
    assert model.layers[1].fc1.weight.dim() == 1  # still this rank's slice between steps
    with record_collectives() as recorder:
        out = model(rows[:, :-1])
    assert "layers.1" not in [r.tag for r in recorder.records if r.kind == "all_gather"]
    torch.testing.assert_close(out, reference(rows[:, :-1]), atol=1e-5, rtol=0)
    model.layers[1].reshard()


def _hsdp_all_reduce_refused() -> None:
    """``set_requires_all_reduce(False)`` (HSDP accumulation) is refused on a module with
    replicas, naming our equivalent; True is accepted."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    model = fully_shard(_build(), mesh=mesh)
    model.set_requires_all_reduce(True)
    with pytest.raises(NotImplementedError, match="set_requires_all_reduce.*set_requires_gradient_sync"):
        model.set_requires_all_reduce(False)


# ---------------------------------------------------------------------------- meta, to_empty, init
def _meta_to_empty_init() -> None:
    """FSDP2's documented init: build on meta, shard (the rotary cache has no reset_parameters,
    so nothing is initialized), forward refused until ``to_empty``; then ``to_empty`` and the
    model's ``init_weights()`` give the parameters and buffers the unsharded model gets from
    the same seed, and training equals it."""
    with torch.device("meta"):
        model = Decoder()
    _shard_like_torchtitan(model, fully_shard)
    rows = _mine(_tokens(0))
    with pytest.raises(RuntimeError, match="to_empty"):
        model(rows[:, :-1])
    model.to_empty(device="cpu")
    torch.manual_seed(7)
    with torch.no_grad():
        model.init_weights()
    reference = _build()
    torch.manual_seed(7)
    with torch.no_grad():
        reference.init_weights()
    expected = {k: v for k, v in reference.state_dict().items()}
    got = get_model_state_dict(model)
    assert list(got) == list(expected)
    for name, value in got.items():
        assert torch.equal(value, expected[name]), name
    assert torch.equal(model.rope.cache, reference.rope.cache)
    optims = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, reference)]
    for step in range(2):
        _loss(model, _mine(_tokens(step)), "sum").backward()
        assert_params_close(full_grads(model), _reference_grads(reference, step, "sum", keep=True), atol=2e-5,
                            what=f"meta step {step}")
        for optim in optims:
            optim.step()
            optim.zero_grad()
    with unshard_params(model):
        assert_params_close(list(model.named_parameters()), list(reference.named_parameters()), atol=2e-5,
                            what="after training")


def _pipelining_refused() -> None:
    """torch's own pipeline stage over modules fully_shard manages raises at the first forward,
    naming ours (one stage per rank here: each rank's pipeline is its own)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    mine = groups[dist.get_rank()]
    for sharded in ("root", "blocks"):
        model = _build()
        for layer in model.layers:
            fully_shard(layer, process_group=mine)
        if sharded == "root":
            fully_shard(model, process_group=mine)
        stage = PipelineStage(model, 0, 1, torch.device("cpu"), group=mine)
        schedule = ScheduleGPipe(stage, 2, loss_fn=lambda out, target: F.cross_entropy(out.flatten(0, 1),
                                                                                        target.flatten()))
        rows = _mine(_tokens(0))
        with pytest.raises(RuntimeError, match="pipelining.*composable_shard.integrations.pipelining.PipelineStage"):
            schedule.step(rows[:, :-1], target=rows[:, 1:])


def _cases(names: List[str]) -> None:
    cases: Dict[str, Callable[[], None]] = {
        "surface": _surface, "torchtitan_recipe": _torchtitan_recipe, "chunked_loss": _chunked_loss,
        "bf16": _bf16_mp_policy, "reshard_after_forward": _reshard_after_forward, "prefetch": _prefetch_chosen,
        "unshard_async": _unshard_async, "hsdp": _hsdp_all_reduce_refused, "meta": _meta_to_empty_init,
        "pipelining": _pipelining_refused, "member_inside_member": _member_inside_member}
    run_subtests(lambda case: cases[case](), {"case": names})


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp2_dropin(world_size: int) -> None:
    """torchtitan's FSDP2 calls on our fully_shard give FSDP2's and one process's numbers."""
    names = ["surface", "torchtitan_recipe", "chunked_loss", "bf16", "reshard_after_forward", "prefetch",
             "unshard_async", "hsdp", "meta", "pipelining", "member_inside_member"]
    if world_size == 4:
        names = ["torchtitan_recipe", "chunked_loss", "meta"]
    run_distributed(_cases, world_size, names, timeout=240)
