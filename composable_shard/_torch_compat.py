"""The only uses of private torch APIs in composable_shard, each with why and the torch
versions checked (2.6, 2.11, 2.13, unless an entry says otherwise).

* ``queue_backward_callback``: a callback that runs once when the current ``backward()``
  finishes is needed to wait for pending gradient reductions before ``backward()`` returns.
  No public API offers "end of this backward pass"; torch's own DDP and FSDP use the autograd
  engine's ``queue_callback`` for it (``torch.autograd.Variable._execution_engine``, present
  unchanged in 2.6 through 2.13).
* ``is_in_backward``: after a backward that raised, its end-of-backward callback never runs,
  and the next entry point (forward, ``unshard_params``) must tell that apart from being called
  from inside a backward that is still running. No public API says whether the autograd engine
  is executing on this thread; ``torch._C._current_graph_task_id()`` (-1 outside backward,
  present unchanged in 2.6 through 2.13, used by torch's own ``register_multi_grad_hook``) does.
* ``tensor_version``: the in-place version counter (``Tensor._version``) is the only way to
  notice that a parameter was edited in place; there is no public accessor (2.6 through 2.13).
* ``is_compiled_module``: activation checkpointing must recompute a ``module.compile()``-d
  module through its compiled call, since the compiled graph saves other tensors than eager
  ``forward``. ``nn.Module.compile`` keeps the compiled call in ``module._compiled_call_impl``
  (None otherwise; unchanged in 2.6 through 2.13); no public accessor says whether it is set.
* ``unwrap_compiled``: ``torch.compile(model)`` returns a wrapper module whose own
  ``named_parameters()`` and ``state_dict()`` prefix every name with ``_orig_mod.``; a
  checkpoint taken through it could not be loaded into the model without the wrapper (and back).
  torch's own ``torch.distributed.checkpoint.state_dict`` helpers drop that prefix, and so do
  ours: the state-dict and checkpoint entry points look through the wrapper. No public API
  exposes the wrapped module: the wrapper is ``torch._dynamo.eval_frame.OptimizedModule`` and
  holds it in ``_orig_mod`` (since torch 2.0; read in the 2.13 sources). Dynamo is not imported for
  this: a module can only be such a wrapper if dynamo has been imported already.
* ``has_grad_hooks``: under ``fully_shard`` the original parameters are not in the autograd
  graph (the forward computes on views of the unsharded flat buffer), so hooks registered on
  them with ``Tensor.register_hook`` or ``register_post_accumulate_grad_hook`` would never run,
  silently; the root refuses them at the next forward. No public API lists a tensor's hooks:
  they live in ``Tensor._backward_hooks`` and ``Tensor._post_accumulate_grad_hooks`` (``None``
  until one is registered, an empty dict once all are removed; the second since torch 2.1; read
  in the 2.13 sources).
* ``make_wrapper_tensor``: the sharded state dict's values report a parameter's global shape
  while holding only this rank's elements (``_sharded_tensor.ShardedSlice``). A tensor whose
  metadata differs from its storage can only be made with ``torch.Tensor._make_wrapper_subclass``
  (what ``DTensor`` is built on; same signature in 2.6 through 2.13).
* ``plain_torch_function``, ``as_plain``: a sharded ``.grad`` is a tensor subclass whose
  ``__torch_function__`` hands every operation but clipping's norms on to torch unchanged
  (``_interop.ShardedGrad``, [Note: torch's clip_grad_norm_ on sharded gradients]). Running
  an operation without re-entering the subclass and getting plain results is what
  ``torch._C.DisableTorchFunctionSubclass`` does (the context torch's own
  ``Tensor.__torch_function__`` and its "extending torch" documentation use; unchanged in 2.6
  through 2.13); there is no public name for it.
* ``FOREACH_NORM``: torch's ``clip_grad_norm_``/``get_total_norm`` take the norms of a
  device's gradients with ``torch._foreach_norm`` when asked for ``foreach`` (and per tensor with
  ``torch.linalg.vector_norm`` otherwise); ``_interop.ShardedGrad`` must recognise that call to
  combine the norms over ranks. It has no public name (unchanged in 2.6 through 2.13).
* ``object_collectives_without_numpy``: ``torch.distributed.checkpoint`` exchanges its plans and
  metadata with ``gather_object``/``broadcast_object_list``/``all_gather_object``, which decode
  what arrives with ``distributed_c10d._tensor_to_object`` through ``Tensor.numpy()``. The
  library needs torch alone (API.md), and without numpy every ``save_checkpoint`` and
  ``load_checkpoint`` failed (one rank crashed, the other waited). While DCP runs and numpy
  cannot be imported, that private function is replaced by one that reads the bytes with
  ``Tensor.tolist()``. Its signature ``(tensor, tensor_size, group)`` and the module-level
  ``_unpickler`` it uses are unchanged in 2.6 through 2.13; the object collectives look it up in
  the module's globals at each call, so the swap takes effect. With numpy present nothing is
  replaced.
"""

from __future__ import annotations

import contextlib
import io
import sys
from typing import Any, Callable, Iterator

import torch
import torch.distributed.distributed_c10d as _c10d

__all__ = ["queue_backward_callback", "set_module_tensor", "is_in_backward", "tensor_version", "make_wrapper_tensor",
           "is_compiled_module", "object_collectives_without_numpy", "plain_torch_function", "as_plain", "FOREACH_NORM"]


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once, after the backward pass now executing has finished (on the
    thread that drives it). Must be called from inside a backward hook."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]  # private engine API, see module docstring


def set_module_tensor(module: "torch.nn.Module", name: str, tensor: "torch.Tensor") -> None:
    """Make ``module.<name>`` return ``tensor`` while keeping the parameter's slot (and so
    the order of ``named_parameters()``) unchanged.

    ``fully_shard`` swaps a module's registered parameter for a plain tensor view of the
    unsharded flat buffer during forward/backward (so autograd routes gradients into one flat
    gradient) and back to the original ``nn.Parameter`` afterwards. ``register_parameter``
    rejects plain tensors and ``del`` + re-register would move the name to the end of
    ``_parameters``, so the slot in ``Module._parameters`` (a private dict whose lookup by
    ``Module.__getattr__`` is unchanged in 2.6 through 2.13) is written directly.
    """
    module._parameters[name] = tensor  # type: ignore[assignment]  # plain tensor on purpose, see docstring


def is_in_backward() -> bool:
    """True while the autograd engine is running a backward on this thread."""
    return int(torch._C._current_graph_task_id()) != -1


def tensor_version(tensor: "torch.Tensor") -> int:
    """The in-place version counter of ``tensor`` (bumped by every in-place op on it)."""
    return int(tensor._version)


def make_wrapper_tensor(cls: Any, shape: "torch.Size", dtype: "torch.dtype", device: "torch.device") -> Any:
    """A tensor of subclass ``cls`` with the given metadata and no storage of its own."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)


def is_compiled_module(module: "torch.nn.Module") -> bool:
    """True if ``module.compile()`` was called: calling the module runs the compiled graph."""
    return getattr(module, "_compiled_call_impl", None) is not None


def has_grad_hooks(tensor: "torch.Tensor") -> bool:
    """True if a gradient hook or a post-accumulate-grad hook is registered on ``tensor``."""
    return bool(tensor._backward_hooks) or bool(tensor._post_accumulate_grad_hooks)  # private, see module docstring


def unwrap_compiled(module: "torch.nn.Module") -> "torch.nn.Module":
    """The module that ``torch.compile(module)`` wrapped (the names users and checkpoints know),
    else ``module`` itself."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    while wrapper is not None and isinstance(module, wrapper):
        module = module._orig_mod  # type: ignore[assignment]  # private, see module docstring
    return module


def _numpy_importable() -> bool:
    try:
        import numpy  # noqa: F401  # only asks whether it can be imported
    except ImportError:
        return False
    return True


def _tensor_to_object_from_bytes(tensor: "torch.Tensor", tensor_size: Any, group: Any) -> Any:
    data = bytes(tensor.cpu()[: int(tensor_size)].tolist())
    return _c10d._unpickler(io.BytesIO(data)).load()  # type: ignore[attr-defined]  # private, see module docstring


@contextlib.contextmanager
def object_collectives_without_numpy() -> Iterator[None]:
    """While active, torch's object collectives decode without numpy if numpy is missing."""
    if _numpy_importable():
        yield
        return
    original = _c10d._tensor_to_object  # type: ignore[attr-defined]  # private, see module docstring
    _c10d._tensor_to_object = _tensor_to_object_from_bytes  # type: ignore[attr-defined]  # same signature
    try:
        yield
    finally:
        _c10d._tensor_to_object = original  # type: ignore[attr-defined]  # restored


FOREACH_NORM = torch._foreach_norm  # private, see module docstring


def plain_torch_function(func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """Run ``func`` as on plain tensors: no tensor subclass's ``__torch_function__`` runs inside,
    and new results are plain tensors (what ``_interop.ShardedGrad`` hands every operation on
    a gradient to)."""
    with torch._C.DisableTorchFunctionSubclass():  # private, see module docstring
        return func(*args, **kwargs)


def as_plain(tensor: "torch.Tensor") -> "torch.Tensor":
    """``tensor`` (maybe of a subclass) as a plain tensor sharing its storage, without running
    the subclass's ``__torch_function__``."""
    return plain_torch_function(torch.Tensor.as_subclass, (tensor, torch.Tensor), {})  # type: ignore[no-any-return]
