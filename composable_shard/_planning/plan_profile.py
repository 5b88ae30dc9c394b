"""What :func:`composable_shard.plan` knows about a model's step before choosing: the bytes each
block's forward saves for backward, its inputs and outputs, the most its backward holds above
what it started with, its forward FLOPs, and (when the model is materialized) its forward time.

[Note: Planning on fake tensors]
  The bytes come from one forward and backward of the model on *fake* tensors (torch's
  ``FakeTensorMode``: every tensor has its shape, dtype, device and storage size but no memory),
  on the parameters' dtypes as ``mixed_precision`` makes them. So planning needs no memory for
  the model or its activations (a Llama-3-70B-shaped model built on the meta device plans in a
  few hundred MB), and a model on the meta device is measured exactly like a materialized one.
  The kernels whose autograd formulas decide what is saved are the CPU ones when the model is on
  the meta device or the CPU, the model's device otherwise; attention on a GPU (flash or
  memory-efficient) saves the output and its log-sum-exp, as the CPU's flash kernel does.
  Recording, per block:
    saved        storages autograd saves while the block's forward runs (saved-tensor hooks),
                 each storage once, parameters excluded
    inputs       storages of its tensor inputs (what a checkpointed block keeps), each counted by
                 the first block that receives it ([Note: Shared inputs])
    outputs      storages of its tensor outputs: the gradient arriving at its backward has their size
    backward     what its backward held above what was alive when it began, at its highest
                 moment counting its parameters' gradients made by then, and those gradients
                 apart ([Note: Gradients in a backward]); a dispatch mode sees every storage
                 made and a finalizer every one freed; with the scratch copies a convolution's
                 backward makes of its input and its output's gradient, which no fake tensor
                 shows (``_conv_backward_workspace``)
    forward      the most its forward holds above what was alive when it began: a checkpointed
                 block's recomputation holds that beside the gradient arriving at it
    flops        forward FLOPs (``torch.utils.flop_counter``): the recomputation cost when
                 nothing is timed, at ``device_flops`` FLOP/s
  [Note: Identity on fake tensors] ``functional_call`` swaps a fake tensor in for every
  parameter and buffer during the pass, so nothing recorded during it is keyed by a real
  tensor's ``id()``: the head's parameters are recorded by name. A storage's identity is unique
  only while it lives, so the recorder holds every storage it keyed (block inputs, saved
  tensors; fake, so no memory) until the pass ends: a block input freed after its block (a bf16
  hidden state no kernel saved) would otherwise lend its identity to the next block's input,
  which then counted as already kept (an 8B Llama's layer 1 kept 16 KB instead of 33.5 MB).
  Storages that exist before the step (parameters, buffers, the batch, and a real parameter
  reached other than through its module's attribute, which ``functional_call`` cannot swap)
  are neither saved activations nor block inputs; a batch tensor given twice, or two views of
  one storage, become views of one fake storage.
  [Note: Gradients in a backward] A parameter's gradient is made in the backward that uses it
  and then kept by the runtime (beside the other gradients of its handle until they are
  concatenated into its unsharded gradient, in replicate's gradients, in the root's until the
  end of backward), which ``plan`` counts from its own terms. A backward's highest moment can
  come before most of its gradients exist (a loss's softmax backward before the head's weight
  gradient; a block's recomputed activations before its first layers' weight gradients), so each
  backward window is measured with its gradients kept from when they are made, and split at its
  highest moment into what else it held and the gradients made by then (a 16-block GPT's block:
  1 MB of its 3.2 MB).
  [Note: The head's gradients] The gradients of the parameters used after the blocks (the final
  norm's, the head's) are made in the head's backward and kept until the end of backward (the
  root reduces them there), so every block's backward holds them (``plan`` counts them by the
  parameters' names and compute dtype); the head's backward holds those made by its highest
  moment ([Note: Gradients in a backward]).
  [Note: Shared inputs] A Llama passes every decoder layer the same rotary tables and position
  ids. One storage is one allocation however many blocks keep it, so each counts in the input
  bytes of the first block receiving it only. Kept by a later checkpointed block while that first
  block is not checkpointed, a table that block saved is in its saved bytes; one nothing saves (the
  position ids) is its ``shared_bytes``, which the plan counts with a block that is not
  checkpointed (so also when no block keeps it: a few bytes too many, never too few).
  A model whose forward depends on its values (``.item()``, ``nonzero``, data-dependent shapes:
  routed mixtures of experts) cannot run on fake tensors; it is refused with the reason, never
  planned with activations counted as 0 bytes.

[Note: Measured times]
  On a materialized model (the default ``profile="auto"``) each block's forward is also timed
  on the real device, under ``no_grad`` (nothing is saved, so timing holds one block's
  temporaries, not the model's activations): a warm-up pass, then the fastest of
  ``TIMED_PASSES`` recorded ones. Real times
  price the recomputation on the hardware at hand, where a FLOP count cannot see memory-bound
  kernels; the bytes stay the fake pass's, so both sources give the same peaks.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from .._base import torch_compat as _torch_compat
from .._base.tree import convert, tensors_in
from ..api import MixedPrecision

__all__ = ["BlockProfile", "Profile", "profile_model", "agreed", "call_model", "default_loss", "compute_dtypes",
           "PROFILES", "DEFAULT_DEVICE_FLOPS"]

PROFILES = ("auto", "fake", "measured")
# FLOP/s of the device model when nothing is timed: about 40% of an H100 SXM's 989 TFLOP/s dense
# bf16 (what large training runs report achieving). Pass device_flops for another device.
DEFAULT_DEVICE_FLOPS = 400e12
TIMED_PASSES = 3  # recorded no_grad forwards after the warm-up ([Note: Measured times])


@dataclass(frozen=True)
class BlockProfile:
    """What one block's forward and backward showed on one rank's batch (bytes; [Note: Planning
    on fake tensors] in ``_planning/plan_profile.py``)."""

    fqn: str
    saved_bytes: int  # storages its forward saved for backward, each once, parameters excluded
    input_bytes: int  # storages of its tensor inputs not already an earlier block's input
    largest_saved: int  # the largest of the saved storages
    forward_seconds: float  # one forward of the block: what recomputing it costs
    output_bytes: int = 0  # storages of its tensor outputs (the gradient its backward receives)
    backward_extra: int = 0  # what its backward held above what was alive when it began, at its highest moment
    forward_flops: int = 0  # FLOPs of one forward
    forward_extra: int = 0  # the most its forward held above what was alive when it began (what recomputing it holds)
    shared_bytes: int = 0  # inputs it receives first, later blocks too, and nothing saves ([Note: Shared inputs])
    backward_grads: int = 0  # its parameters' gradients made by that moment ([Note: Gradients in a backward])

    def kept_bytes(self, checkpointed: bool) -> int:
        """What the block keeps from its forward to its backward: its inputs if checkpointed,
        else what it saved and the inputs it shares with later blocks ([Note: Shared inputs])."""
        return self.input_bytes if checkpointed else self.saved_bytes + self.shared_bytes


@dataclass(frozen=True)
class Profile:
    """The whole step: the blocks, and what lies before and after them."""

    blocks: Tuple[BlockProfile, ...]
    before_bytes: int  # saved outside every block before the first block's forward (embeddings)
    after_bytes: int  # saved outside every block after it (final norm, head, loss)
    after_params: frozenset  # names (FQNs) of the parameters of modules outside the blocks that ran after them (the head)
    batch_bytes: int  # the example batch's own storages: alive for the whole step
    head_forward_extra: int  # the most the forward after the blocks held above its start (its saved tensors included)
    head_backward_extra: int  # what the loss's and head's backward held above its start, at its highest moment
    source: str  # "fake" or "measured" (the forward seconds' origin)
    head_backward_grads: int = 0  # the head's gradients made by that moment ([Note: The head's gradients])


# ---------------------------------------------------------------------------- the model's call
def call_model(model: nn.Module, batch: Any) -> Any:
    """``model(batch)``, ``model(*batch)`` or ``model(**batch)``."""
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    if isinstance(batch, dict):
        return model(**batch)
    raise TypeError(f"plan: example_batch must be a tensor, tuple, list or dict, got {type(batch).__name__}")


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss`` when there is one, else the float sum of the (first) output tensor."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        output = output[0]
    if isinstance(output, torch.Tensor):
        return output.float().sum()
    raise TypeError(f"plan: cannot make a loss of a {type(output).__name__} output; pass loss_fn=...")


# ---------------------------------------------------------------------------- recording
class _Live:
    """Bytes of the storages alive, from every operator's outputs (a dispatch mode calls
    :meth:`made`) to the last tensor object on the storage (a finalizer calls :meth:`_gone`),
    kept as a log and replayed by :meth:`extras` without the storages that became parameters'
    gradients (the runtime counts those in its own buffers)."""

    def __init__(self) -> None:
        self.refs: Dict[int, int] = {}  # storage -> tensor objects on it
        self.serials: Dict[int, int] = {}  # storage -> its allocation's number
        self.log: List[Tuple[str, Any, int]] = []  # ("made"/"gone", serial, bytes), ("scratch", None, bytes), ("enter", window, 0)
        self.gradients: Set[int] = set()  # serials of parameters' gradients
        self.window = "before"
        self.existing: Set[int] = set()  # storages alive before the step: parameters, buffers, the batch

    def made(self, t: torch.Tensor) -> None:
        sid = _torch_compat.storage_id(t)
        if sid in self.existing:  # a view of a parameter, buffer or the batch: nothing new
            return
        if sid in self.refs:
            self.refs[sid] += 1
        else:
            self.refs[sid] = 1
            self.serials[sid] = len(self.log)
            self.log.append(("made", len(self.log), t.untyped_storage().nbytes()))
        weakref.finalize(t, self._gone, sid, t.untyped_storage().nbytes())

    def _gone(self, sid: int, nbytes: int) -> None:
        self.refs[sid] -= 1
        if not self.refs[sid]:
            del self.refs[sid]
            self.log.append(("gone", self.serials.pop(sid), nbytes))

    def gradient(self, t: torch.Tensor) -> None:
        """``t`` is a parameter's accumulated gradient."""
        serial = self.serials.get(_torch_compat.storage_id(t))
        if serial is not None:
            self.gradients.add(serial)

    def workspace(self, nbytes: int) -> None:
        """A kernel's own scratch memory beside what is alive now, released when it returns."""
        self.log.append(("scratch", None, nbytes))

    def enter(self, window: str) -> None:
        self.window = window
        self.log.append(("enter", window, 0))

    def extras(self) -> Dict[str, int]:
        """Per window, the most it held above what was alive when it began. A backward window
        (the head's, a block's) is taken at its highest moment counting the parameters' gradients
        made in it so far: what else it held then, and as ``"<window> gradients"`` those
        gradients ([Note: Gradients in a backward])."""
        total, window = 0, "before"
        start: Dict[str, int] = {window: 0}
        peak: Dict[str, int] = {window: 0}
        grads: Dict[str, int] = {window: 0}  # at each window's highest moment, the gradients made in it by then
        made = 0  # gradients made so far in the window running
        for kind, key, nbytes in self.log:
            if kind == "enter":
                window, made = key, 0
                start[window] = peak[window] = total
                grads[window] = 0
                continue
            if kind == "scratch":
                now = total + nbytes
            elif key not in self.gradients:
                total += nbytes if kind == "made" else -nbytes
                now = total
            elif kind == "made":
                made += nbytes  # and never gone: the runtime keeps it (its unsharded gradient, replicate's buckets)
                now = total
            else:
                continue
            if now + made > peak[window] + grads[window]:
                peak[window], grads[window] = now, made
        return dict({w: peak[w] - start[w] for w in peak}, **{f"{w} gradients": grads[w] for w in grads})


class _Recorder:
    """Forward hooks and a pack hook attributing saved storages to the block running, and the
    windows of :class:`_Live` moved at each block's forward and backward."""

    def __init__(self, blocks: List[Tuple[str, nn.Module]], live: _Live, flops: FlopCounterMode) -> None:
        self.blocks, self.live, self.flops = blocks, live, flops
        self.running: List[int] = []  # indices of the blocks whose forward is running
        self.started = False  # a block's forward has begun
        self.owner: Dict[int, int] = {}  # storage -> block index, -1 before, -2 after the blocks
        self.nbytes: Dict[int, int] = {}
        self.inputs: List[Set[int]] = [set() for _ in blocks]
        self.outputs: List[int] = [0] * len(blocks)
        self.flop_start: List[int] = [0] * len(blocks)
        self.forward_flops: List[int] = [0] * len(blocks)
        self.after_params: Set[str] = set()  # names of the parameters of modules outside the blocks run after them
        self.hooks: List[Any] = []  # the multi-grad hooks marking each block's backward
        self.held: Dict[int, Any] = {}  # storage -> the storage itself, alive until the pass ends ([Note: Identity on fake tensors])

    def _key(self, t: torch.Tensor) -> int:
        key = _torch_compat.storage_id(t)
        self.held.setdefault(key, t.untyped_storage())
        return key

    def pre(self, index: int, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        self.running.append(index)
        self.started = True
        for t in tensors_in((args, kwargs), None):
            if _torch_compat.storage_id(t) in self.live.existing:  # the batch, a parameter: no new memory
                continue
            key = self._key(t)
            self.inputs[index].add(key)
            self.nbytes.setdefault(key, t.untyped_storage().nbytes())
        self.flop_start[index] = self.flops.get_total_flops()
        self.live.enter(f"forward {index}")

    def outside(self, names: List[str]) -> None:
        """A module outside the blocks, with parameters ``names``, is called."""
        if self.started and not self.running:
            self.after_params.update(names)

    def post(self, index: int, output: Any) -> None:
        self.forward_flops[index] += self.flops.get_total_flops() - self.flop_start[index]
        self.running.pop()
        outs = [t for t in tensors_in(output, None) if t.requires_grad]
        self.outputs[index] = sum({_torch_compat.storage_id(t): t.untyped_storage().nbytes() for t in outs}.values())
        if outs:
            self.hooks.append(torch.autograd.graph.register_multi_grad_hook(
                outs, lambda grads, i=index: self.live.enter(f"backward {i}"), mode="any"))
        if not self.running:
            self.live.enter("after")

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _torch_compat.storage_id(t)
        if key not in self.live.existing and key not in self.owner:
            self._key(t)
            self.owner[key] = self.running[0] if self.running else (-2 if self.started else -1)
            self.nbytes[key] = t.untyped_storage().nbytes()
        return t


_ARANGE = (torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step)


class _Tracker(_torch_compat.TorchDispatchMode):
    """Hands every operator's tensor outputs to :class:`_Live`.

    [Note: Positions stay real] ``arange`` and what is computed from it alone (positions, their
    differences) run on real tensors: their values depend on no data, and models read them
    (Hugging Face decides from the position ids whether the batch packs several sequences, and
    when it cannot read them, as on fake tensors, it builds and saves an explicit causal mask,
    10% of a Llama-3-8B layer's activations, that eager training never makes). They are a few
    integers per token; everything that meets a fake tensor becomes fake."""

    def __init__(self, live: _Live) -> None:
        super().__init__()
        self.live = live

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = tensors_in((args, kwargs), None)
        if (func in _ARANGE or inputs) and not any(_torch_compat.is_fake(t) for t in inputs):
            with _torch_compat.without_fake_mode():
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        for t in tensors_in(out, None):
            self.live.made(t)
        if func is torch.ops.aten.convolution_backward.default:
            self.live.workspace(_conv_backward_workspace(args))
        return out


def _conv_backward_workspace(args: Tuple[Any, ...]) -> int:
    """A convolution's backward copies its output's gradient and its input into the layouts its
    kernels take (oneDNN on the CPU: measured 2 feature maps above its outputs under the counting
    allocator; cuDNN's workspaces are of that order); a fake tensor cannot see them."""
    grad_output, input_ = args[0], args[1]
    return int(grad_output.numel() * grad_output.element_size() + input_.numel() * input_.element_size())



# ---------------------------------------------------------------------------- profile
def profile_model(model: nn.Module, blocks: List[Tuple[str, nn.Module]], batch: Any,
                  loss_fn: Optional[Callable[[Any], torch.Tensor]], mixed_precision: Optional[MixedPrecision],
                  source: str, device_flops: float) -> Profile:
    """The step's :class:`Profile`: bytes from the fake pass, seconds from the real device
    (``source="measured"``) or from FLOPs at ``device_flops`` (``"fake"``)."""
    fake = _fake_pass(model, blocks, batch, loss_fn, mixed_precision)
    if source == "measured":
        seconds = _time_blocks(model, blocks, batch)
    else:
        seconds = [b.forward_flops / device_flops for b in fake.blocks]
    return dataclasses.replace(fake, source=source, blocks=tuple(
        dataclasses.replace(b, forward_seconds=s) for b, s in zip(fake.blocks, seconds)))


def _fake_device(model: nn.Module, batch: Any) -> torch.device:
    for t in (*model.parameters(), *model.buffers(), *tensors_in(batch, None)):
        if not t.is_meta:
            return t.device
    return torch.device("cpu")


def compute_dtypes(model: nn.Module, mp: Optional[MixedPrecision]) -> Dict[int, torch.dtype]:
    """The dtype each parameter and buffer of ``model`` (by ``id()`` of the real tensor) computes
    in under ``mp`` (full precision in the modules ``mp`` keeps there, batch norms by default);
    the ones absent compute in their own dtype."""
    out: Dict[int, torch.dtype] = {}
    if mp is None or (mp.param_dtype is None and mp.buffer_dtype is None):
        return out
    ignored = tuple(getattr(mp, "_module_classes_to_ignore", ()) or ())
    for module in model.modules():
        if ignored and isinstance(module, ignored):
            continue
        for p in module.parameters(recurse=False):
            if mp.param_dtype is not None and p.is_floating_point():
                out[id(p)] = mp.param_dtype
        for b in module.buffers(recurse=False):
            if mp.buffer_dtype is not None and b.is_floating_point():
                out[id(b)] = mp.buffer_dtype
    return out


class _FakeBatch:
    """Fake copies of the batch's tensors that share storage where the real ones do: one tensor
    given twice (``input_ids`` and ``labels``) or two views of one storage are views of one fake
    storage, so the batch's bytes count it once ([Note: Identity on fake tensors])."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.storages: Dict[int, torch.Tensor] = {}  # real storage -> a fake uint8 tensor of its size

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        key = _torch_compat.storage_id(t)  # the batch's storages live through the pass: no identity reused
        if key not in self.storages:
            self.storages[key] = torch.empty(t.untyped_storage().nbytes(), dtype=torch.uint8, device=self.device)
        made = torch.empty(0, dtype=t.dtype, device=self.device).set_(
            self.storages[key].untyped_storage(), t.storage_offset(), t.shape, t.stride())
        return made.requires_grad_(t.requires_grad) if made.is_floating_point() else made


def _fake_pass(model: nn.Module, blocks: List[Tuple[str, nn.Module]], batch: Any,
               loss_fn: Optional[Callable[[Any], torch.Tensor]], mp: Optional[MixedPrecision]) -> Profile:
    device = _fake_device(model, batch)
    dtypes = compute_dtypes(model, mp)
    mode = _torch_compat.fake_tensor_mode()
    live = _Live()
    flops = FlopCounterMode(display=False)
    with mode:
        def fake(t: torch.Tensor) -> torch.Tensor:
            made = torch.empty_strided(t.shape, t.stride(), dtype=dtypes.get(id(t), t.dtype), device=device)
            return made.requires_grad_(t.requires_grad) if made.is_floating_point() else made

        state: Dict[str, torch.Tensor] = {}
        leaves: List[torch.Tensor] = []
        for name, p in model.named_parameters():
            state[name] = fake(p)
            if p.requires_grad:
                leaves.append(state[name])
        for name, b in model.named_buffers():
            state[name] = fake(b).detach()
        fake_batch = convert(batch, _FakeBatch(device))
    # the real tensors too: one reached other than through its module's attribute stays real in the pass
    real = [t for t in (*model.parameters(), *model.buffers()) if not t.is_meta]
    live.existing = {_torch_compat.storage_id(t) for t in (*state.values(), *real, *tensors_in(fake_batch, None))}
    recorder = _Recorder(blocks, live, flops)
    handles = []
    for index, (_, block) in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(
            lambda m, a, k, i=index: recorder.pre(i, a, k), with_kwargs=True))
        handles.append(block.register_forward_hook(lambda m, a, o, i=index: recorder.post(i, o)))
    inside = {id(m) for _, block in blocks for m in block.modules()}
    for prefix, m in model.named_modules():
        names = [f"{prefix}.{n}" if prefix else n for n, _ in m.named_parameters(recurse=False)]
        if id(m) not in inside and names:
            handles.append(m.register_forward_pre_hook(lambda mod, a, names=names: recorder.outside(names)))

    def taken(p: torch.Tensor) -> None:  # a parameter's gradient is the runtime's to count, and then gone
        assert p.grad is not None
        live.gradient(p.grad)
        p.grad = None

    grads = [(p, p.grad) for p in model.parameters() if p.requires_grad]  # a real parameter used in the pass
    for leaf in leaves + [p for p, _ in grads]:                           # gets a fake gradient: put back
        handles.append(leaf.register_post_accumulate_grad_hook(taken))
    attributes = _snapshot_attributes(model)
    try:
        with mode, flops, _Tracker(live), torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
            output = _functional_call(model, state, fake_batch)
            loss = (loss_fn or default_loss)(output)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError("plan: loss_fn(output) must return a scalar tensor")
            del output
            live.enter("head backward")
            if loss.requires_grad:
                loss.backward()
            del loss
    except TypeError:
        raise
    except Exception as exc:
        raise ValueError(
            f"plan: the activations of {type(model).__name__} cannot be measured on fake tensors (shapes without "
            f"memory, [Note: Planning on fake tensors]): {type(exc).__name__}: {str(exc).splitlines()[0][:300]}. "
            "A forward whose work depends on tensor values (.item(), nonzero, routed experts) cannot be planned; "
            "annotate such a model by hand, with describe() for the sharded bytes") from exc
    finally:
        for h in handles + recorder.hooks:
            h.remove()
        for p, grad in grads:
            p.grad = grad
        _drop_fake_attributes(model, attributes)
        recorder.held.clear()
    return _summarize(recorder, live.extras(), fake_batch)


_MODULE_SLOTS = frozenset({"_parameters", "_buffers", "_modules"})


def _snapshot_attributes(model: nn.Module) -> Dict[Tuple[int, str], Tuple[Any, Any]]:
    """Each module's plain attributes (a dict or list also by a shallow copy of its items)."""
    out: Dict[Tuple[int, str], Tuple[Any, Any]] = {}
    for module in model.modules():
        for name, value in vars(module).items():
            if name not in _MODULE_SLOTS:
                out[(id(module), name)] = (value, copy.copy(value) if isinstance(value, (dict, list)) else None)
    return out


def _holds_fake(value: Any, depth: int = 3) -> bool:
    if isinstance(value, torch.Tensor):
        return _torch_compat.is_fake(value)
    if depth and isinstance(value, dict):
        return any(_holds_fake(v, depth - 1) for v in value.values())
    if depth and isinstance(value, (list, tuple)):
        return any(_holds_fake(v, depth - 1) for v in value)
    return False


def _drop_fake_attributes(model: nn.Module, before: Dict[Tuple[int, str], Tuple[Any, Any]]) -> None:
    """Put back every plain attribute the fake pass left holding a fake tensor: a model that
    caches what its forward builds (a causal mask in a dict) would otherwise keep a tensor
    without data and compute with it in training."""
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if name in _MODULE_SLOTS or not _holds_fake(value):
                continue
            if (id(module), name) not in before:
                delattr(module, name)
                continue
            old, items = before[(id(module), name)]
            if isinstance(old, dict) and items is not None:
                old.clear()
                old.update(items)
            elif isinstance(old, list) and items is not None:
                old[:] = items
            object.__setattr__(module, name, old)


def _functional_call(model: nn.Module, state: Dict[str, torch.Tensor], batch: Any) -> Any:
    """``model(batch)`` with its parameters and buffers replaced by ``state`` for the call."""
    if isinstance(batch, torch.Tensor):
        args: Tuple[Any, ...] = (batch,)
        kwargs: Dict[str, Any] = {}
    elif isinstance(batch, (tuple, list)):
        args, kwargs = tuple(batch), {}
    elif isinstance(batch, dict):
        args, kwargs = (), dict(batch)
    else:
        raise TypeError(f"plan: example_batch must be a tensor, tuple, list or dict, got {type(batch).__name__}")
    return torch.func.functional_call(model, state, args, kwargs, tie_weights=True, strict=False)


def _summarize(recorder: _Recorder, extras: Dict[str, int], batch: Any) -> Profile:
    saved: List[List[int]] = [[] for _ in recorder.blocks]
    before: List[int] = []
    after: List[int] = []
    for key, owner in recorder.owner.items():
        (before if owner == -1 else after if owner == -2 else saved[owner]).append(recorder.nbytes[key])
    seen: Set[int] = set()
    profiles = []
    for index, (fqn, _) in enumerate(recorder.blocks):
        fresh = recorder.inputs[index] - seen
        seen |= recorder.inputs[index]
        shared = [k for k in fresh if k not in recorder.owner and any(k in later for later in recorder.inputs[index + 1:])]
        profiles.append(BlockProfile(fqn, sum(saved[index]), sum(recorder.nbytes[k] for k in fresh),
                                     max(saved[index], default=0), 0.0, recorder.outputs[index],
                                     extras.get(f"backward {index}", 0), recorder.forward_flops[index],
                                     extras.get(f"forward {index}", 0), sum(recorder.nbytes[k] for k in shared),
                                     extras.get(f"backward {index} gradients", 0)))
    batch_bytes = sum({_torch_compat.storage_id(t): t.untyped_storage().nbytes()
                       for t in tensors_in(batch, None)}.values())
    return Profile(tuple(profiles), sum(before), sum(after), frozenset(recorder.after_params), batch_bytes,
                   extras.get("after", 0), extras.get("head backward", 0), "fake",
                   extras.get("head backward gradients", 0))


# ---------------------------------------------------------------------------- timing
def _time_blocks(model: nn.Module, blocks: List[Tuple[str, nn.Module]], batch: Any) -> List[float]:
    """Each block's forward seconds on the real device ([Note: Measured times]); the model's
    buffers and the RNG are left as they were."""
    seconds = [0.0] * len(blocks)
    t0 = [0.0] * len(blocks)
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})

    def wait() -> None:  # a GPU runs kernels after they are launched: time what ran, not what was queued
        for index in devices:
            torch.cuda.synchronize(index)

    def pre(index: int) -> None:
        wait()
        t0[index] = time.perf_counter()

    def post(index: int) -> None:
        wait()
        seconds[index] += time.perf_counter() - t0[index]

    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    handles = []
    for index, (_, block) in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(lambda m, a, i=index: pre(i)))
        handles.append(block.register_forward_hook(lambda m, a, o, i=index: post(i)))
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            call_model(model, batch)  # warm-up: one-time costs (allocations, lazily built caches)
            best = [math.inf] * len(blocks)
            for _ in range(TIMED_PASSES):  # the fastest of a few: a busy machine only ever adds time
                seconds[:] = [0.0] * len(blocks)
                call_model(model, batch)
                best = [min(b, t) for b, t in zip(best, seconds)]
            seconds[:] = best
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    return seconds


_BLOCK_BYTES = ("saved_bytes", "input_bytes", "largest_saved", "output_bytes", "backward_extra", "forward_flops",
                "forward_extra", "shared_bytes", "backward_grads")
_STEP_BYTES = ("before_bytes", "after_bytes", "batch_bytes", "head_forward_extra", "head_backward_extra",
               "head_backward_grads")


def agreed(profile: Profile) -> Profile:
    """The profile every rank of the process group plans with, if there is one: each byte
    figure the largest any rank measured, and rank 0's forward times.

    [Note: Ranks choose alike] Ranks that chose differently would apply different handles and
    hang in their first collective. Their times differ, and so do their bytes when their batches
    do (sequences of other lengths per rank), so every rank plans for the largest batch any rank
    showed, with rank 0's times: one all-reduce and one broadcast of a few numbers per block
    (tensors, not object collectives: no pickle, tests/unit/test_no_pickle.py)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return profile
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    count = torch.tensor([len(profile.blocks), -len(profile.blocks)], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    if count[0].item() != -count[1].item():
        raise ValueError(f"plan: the ranks found {-count[1].item()} to {count[0].item()} blocks; plan the same model "
                         "(and block_types) on every rank")
    numbers = [getattr(profile, f) for f in _STEP_BYTES] + [getattr(b, f) for b in profile.blocks for f in _BLOCK_BYTES]
    most = torch.tensor(numbers, dtype=torch.int64, device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    seconds = torch.tensor([b.forward_seconds for b in profile.blocks], dtype=torch.float64, device=device)
    dist.broadcast(seconds, src=0)
    values = most.tolist()
    step = dict(zip(_STEP_BYTES, values[:len(_STEP_BYTES)]))
    per_block = [values[len(_STEP_BYTES) + k * len(_BLOCK_BYTES):][:len(_BLOCK_BYTES)] for k in range(len(profile.blocks))]
    return dataclasses.replace(profile, **step, blocks=tuple(
        dataclasses.replace(b, forward_seconds=float(t), **dict(zip(_BLOCK_BYTES, v)))
        for b, t, v in zip(profile.blocks, seconds.tolist(), per_block)))
