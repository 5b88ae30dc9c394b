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
* ``tensor_version``, ``versions_sum``: the in-place version counter (``Tensor._version``) is the only way to
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
* ``float8_weight_parts``, ``float8_bytes`` (torchao's, not torch's, private attributes; torchao
  0.18.0 read): float8 all-gather ([Note: float8 all-gather] in ``_base/float8.py``) needs a
  float8 training weight's plain tensor, float8 dtype and matmul configuration
  (``WeightWithDynamicFloat8CastTensor._tensor``, ``._dtype``, ``._linear_mm_config``) and a
  ``Float8TrainingTensor``'s bytes (``._data``): torchao exposes them only to FSDP2, through
  ``fsdp_pre_all_gather``, which casts a whole parameter and reduces its amax in a collective of
  its own per weight.
* ``make_wrapper_tensor``: the sharded state dict's values report a parameter's global shape
  while holding only this rank's elements (``sharded_slice.ShardedSlice``). A tensor whose
  metadata differs from its storage can only be made with ``torch.Tensor._make_wrapper_subclass``
  (what ``DTensor`` is built on; same signature in 2.6 through 2.13).
* ``plain_torch_function``, ``as_plain``: a sharded ``.grad`` is a tensor subclass whose
  ``__torch_function__`` hands every operation but clipping's norms on to torch unchanged
  (``interop.ShardedGrad``, [Note: torch's clip_grad_norm_ on sharded gradients]). Running
  an operation without re-entering the subclass and getting plain results is what
  ``torch._C.DisableTorchFunctionSubclass`` does (the context torch's own
  ``Tensor.__torch_function__`` and its "extending torch" documentation use; unchanged in 2.6
  through 2.13); there is no public name for it. ``PLAIN_TORCH_FUNCTION_IMPL``
  (``torch._C._disabled_torch_function_impl``, same arguments as ``__torch_function__``) does the
  same in C, for the per-operation fallback (unchanged in 2.6 through 2.13).
* ``FOREACH_NORM``: torch's ``clip_grad_norm_``/``get_total_norm`` take the norms of a
  device's gradients with ``torch._foreach_norm`` when asked for ``foreach`` (and per tensor with
  ``torch.linalg.vector_norm`` otherwise); ``interop.ShardedGrad`` must recognise that call to
  combine the norms over ranks. It has no public name (unchanged in 2.6 through 2.13).
* ``BATCH_NORM``: ``MixedPrecision``'s default keeps batch norms in full precision, as torch's
  own ``MixedPrecision`` does. Their common base (``BatchNorm1d/2d/3d``, the lazy ones,
  ``SyncBatchNorm``) is ``torch.nn.modules.batchnorm._BatchNorm``; no public class covers
  exactly those (``nn.modules.batchnorm._NormBase`` takes the instance norms too). Read in 2.13.
* ``tensor_slots``: the state-dict checks and the all-or-nothing load walk a module's own
  parameter and buffer slots as ``Module.state_dict`` does (``Module._save_to_state_dict`` reads
  ``_parameters``, ``_buffers`` and ``_non_persistent_buffers_set``), empty slots included, and
  a failed load puts objects back into the slots themselves. ``named_parameters``/``named_buffers``
  skip empty slots, do not say which buffers a state dict leaves out, and may be overridden by a
  model. Names and meaning read in the 2.13 sources.
* ``profiler_enabled``: the runtime's transitions open profiler ranges (``cs::pre_forward``, ...)
  for ``torch.profiler`` traces, but ``torch.profiler.record_function`` costs about 25 µs per range
  even when no profiler runs (it always calls its ``profiler::_record_function_enter_new`` and
  exit ops), a fifth of the runtime's CPU time per module on small modules. The ranges are opened
  only while a profiler (kineto, legacy, NVTX) is enabled on this thread:
  ``torch.autograd._profiler_enabled()`` says so (what torch's own RPC code asks; present unchanged
  in 2.6 through 2.13); no public API does.
* ``is_view_of``: a new reduced gradient is added in place into the sharded gradient only if
  every original parameter's ``.grad`` is still the view of it the library gave out (else each
  ``.grad`` is added separately). ``Tensor._base`` (the tensor a view was taken of, None for a
  non-view) has no public accessor; read in 2.13.
* ``DCPTensorHooks``: ``torch.distributed.checkpoint`` saves and loads a tensor subclass that
  defines ``__create_write_items__``, ``__create_chunk_list__`` and ``__get_tensor_shard__``
  (the protocol ``DTensor`` implements; ``torch.distributed._checkpointable``). DCP finds them
  with ``hasattr`` (``planner_helpers._create_write_items``/``_create_chunk_list``,
  ``utils._get_tensor_shard``); the protocol is not documented as public. Read in 2.13.
* ``DCP_METADATA_GLOBALS``: the globals DCP pickles into a checkpoint's ``.metadata`` (what the
  allow-list unpickler of ``_state/checkpoint_files`` may resolve), private ones among them
  (``_MEM_FORMAT_ENCODING``, ``filesystem._StorageInfo``, ``torch.serialization._get_layout``).
  Listed from the 2.13 sources and checked by saving and loading there; a torch that pickles
  another one makes ``load_checkpoint`` refuse it, naming the global.
* ``torch_state_dict_request``: torch's ``torch.distributed.checkpoint.state_dict`` functions
  (``get_state_dict``, ``get_model_state_dict``, ``get_optimizer_state_dict``, their ``set_*``
  counterparts; what Lightning, Fabric, torchtitan and DCP's recipes call) ask a model and its
  optimizers for their state with plain ``module.state_dict()`` / ``optimizer.state_dict()``
  calls, and decide from the types they get back (``DTensor`` for FSDP2) whether a value is
  sharded. Our sharded values are ``ShardedSlice`` s, which DCP saves and loads but torch's
  full-state-dict path would pass through ungathered, so the library's state-dict hooks must
  know whether such a call asked for full or sharded tensors (see [Note: torch's state-dict
  API] in ``_state/optim_state_dict.py``). torch passes that nowhere but in the options of the call:
  its private workers (``_get_model_state_dict``, ``_get_optim_state_dict``,
  ``_load_model_state_dict``, ``_load_optim_state_dict``) hold them in a local named ``info``
  (a ``_StateDictInfo``, subclass of the public ``StateDictOptions``), the public functions in
  their ``options`` argument (``None``: the defaults). They are read from the innermost function of
  that module running on this thread (``running_functions``). Read in 2.13. A function of that
  module with neither is reported as ``UNKNOWN_REQUEST`` and refused by the callers, so a torch
  that moves this code fails loudly (the state-dict API tests fail) instead of handing it
  per-rank slices.
* ``torch_state_dict_load``: torch's ``set_state_dict`` and ``set_model_state_dict`` skip the
  model on a rank whose model state dict is empty (unless ``broadcast_from_rank0``), and
  ``set_state_dict`` then treats the call as optimizer-only on that rank; what
  ``get_state_dict(..., StateDictOptions(full_state_dict=True, cpu_offload=True))`` returns on
  ranks other than 0 is exactly such a dict. Which ranks load the model is known only to each
  rank's call: read from the private workers' locals ``info`` (``handle_model``,
  ``broadcast_from_rank0``) and ``model``, and the public function's argument
  ``model_state_dict`` (see [Note: torch's loads on every rank] in
  ``_state/model_state_dict.py``). Read in 2.13; ``test_torch_state_dict_api.py`` fails when it moves.
* ``TO_COPY``: ``ShardedSlice`` (a wrapper tensor of a parameter's global shape over this rank's
  elements) must follow a ``.to(device/dtype)`` (torch's state-dict API moves every value of a
  state dict with ``cpu_offload``): the operator a wrapper subclass's ``__torch_dispatch__``
  receives for it is ``aten._to_copy`` (``Tensor.to`` decomposes into it), which has no public
  name. Read in 2.13.
* ``running_functions``: the package's only reader of Python frames (``sys._getframe``, a frame's
  ``f_back``/``f_code``/``f_globals``/``f_locals``; ``tests/unit/test_frame_access.py`` fails on
  any other). Some refusals depend on whose code reaches a managed module, and torch says that
  nowhere else: its data-parallel wrappers walking our modules (``_runtime/interop``, [Note:
  Foreign wrappers]: matched by module and function name; torch's ``@contract`` wrapper's locals
  ``func``, ``modules``, ``module``, ``state``, ``registry_item``, ``default_all_state`` and
  ``default_registry`` read only to refuse and undo its entries), the options of torch's
  state-dict call (``torch_state_dict_request`` above), and the integrations' checks ([Note:
  Caller checks] in ``_base/callers.py``: names only). Each yields names lazily and reads a local
  only when asked; a frame's locals are read of torch's frames only (on CPython 3.11 reading
  ``f_locals`` snapshots them onto the frame, which would keep a caller's deleted model alive).
  ``co_qualname`` is read where Python has it (3.11+). Read in 2.13; the tests of each fail when
  torch's code moves (``test_interop.py``, ``test_torch_state_dict_api.py``).
* ``GuardedApplyHook``: ``nn.Module._apply(fn, recurse=True)`` is the one method behind
  ``.to()``, ``.half()``, ``.cuda()``, ``.float()``, ``.to_empty()``, ...; overriding it is the
  only way to see every cast and move of a sharded or replicated module (``_setup/apply_guard``).
  Signature read in 2.13.
* ``FSDP2_MODULE_MARKER``: torch's FSDP2 ``FSDPModule`` class (public, exported by torch's FSDP package),
  as an extra base of our ``FSDPModule`` and for nothing else. torch's and its ecosystem's code
  decide by ``isinstance(m, FSDPModule)`` whether to call FSDP2's methods on a module
  (torchtitan's ``set_gradient_divide_factor(1.0)`` before dividing by the token count itself,
  its chunked loss's ``set_reshard_after_forward``/``unshard``, ``torch.distributed.pipelining``'s
  gradient-sync switches): on a plain module they silently skip them, and torchtitan's gradients
  are then off by the world size. With the marker those calls reach our methods. None of FSDP2's
  code runs: our class overrides every attribute torch's class defines (implemented, or raising
  with our equivalent; ``test_fsdp2_surface.py`` checks each name), and ``_get_fsdp_state`` raises.
  This is the one import of torch's FSDP package by the library, for its class object only
  (read in 2.6 and 2.13, where the class has no ``__slots__`` and
  its methods only; ``()`` where the package cannot be imported).
* ``ALL_GATHER_SINGLE``, ``REDUCE_SCATTER_SINGLE``: not private, but the one version switch:
  torch 2.13 names the single-tensor collectives ``all_gather_single``/``reduce_scatter_single``
  and deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor`` (a ``FutureWarning``);
  older versions have only the old names. The library calls the groups directly (below); these
  are torch's functions for the tests to compare with.
* ``all_gather_work``, ``reduce_scatter_work``: the runtime's all-gathers and reduce-scatters
  on a given process group call the group's own method (``ProcessGroup.all_gather_single`` /
  ``reduce_scatter_single`` in 2.12 and 2.13, ``_allgather_base``/``_reduce_scatter_base``
  before) with a prebuilt options object (``AllgatherOptions``, ``ReduceScatterOptions``: no
  public name), which is what ``torch.distributed``'s functions end in. Those functions first
  check their arguments for things the runtime's own buffers never are (a tensor subclass with
  ``__torch_function__``, a rank outside the group, a coalescing context, a non-tensor), and wrap
  the call in an exception logger: about 1.5 us of Python per collective, three collectives per
  fully sharded module and step (issue 56). Complex tensors are viewed as real, as torch's
  all-gather does (for a reduce-scatter's sum or average the same numbers, and NCCL has no complex
  type). Read in the 2.6 and 2.13 sources; tested on gloo against torch's functions
  (``tests/distributed/test_exchanges.py``) and on the simulated backend.
* ``fake_tensor_mode``, ``is_fake``, ``without_fake_mode``, ``TorchDispatchMode``, ``storage_id``: ``plan`` runs a model's forward and
  backward on fake tensors (shapes and storage sizes, no memory) to measure its activations
  without holding them ([Note: Planning on fake tensors] in ``_planning/plan_profile.py``). torch's fake
  tensors are ``torch._subclasses.fake_tensor.FakeTensorMode`` and a mode that sees every
  operator's outputs subclasses ``torch.utils._python_dispatch.TorchDispatchMode``; neither has a
  public name (``torch.utils.flop_counter`` is built on the second); nor do ``FakeTensor`` (the
  class) and ``unset_fake_temporarily`` (run operators for real inside the mode, for positions
  computed from ``arange``: see ``plan_profile._Tracker``). Views share a storage, and a
  fake or meta storage's ``data_ptr`` is 0 for all of them, so a storage is told apart by its
  ``UntypedStorage._cdata`` (the address of its storage object). Read in 2.13.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, Callable, Dict, Iterable, Iterator, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["queue_backward_callback", "set_module_tensor", "is_in_backward", "current_graph_task",
           "float8_weight_parts", "float8_bytes", "tensor_version", "versions_sum", "make_wrapper_tensor",
           "is_compiled_module", "plain_torch_function", "as_plain", "FOREACH_NORM", "BATCH_NORM", "tensor_slots",
           "is_view_of", "DCPTensorHooks", "DCP_METADATA_GLOBALS", "GuardedApplyHook", "ALL_GATHER_SINGLE",
           "REDUCE_SCATTER_SINGLE", "PLAIN_TORCH_FUNCTION_IMPL", "all_gather_work", "reduce_scatter_work", "FSDP2_MODULE_MARKER", "TORCH_FSDP_PACKAGE", "torch_state_dict_request", "TorchLoad", "torch_state_dict_load", "UNKNOWN_REQUEST", "RunningFunction", "running_functions", "TORCH_STATE_DICT_MODULE", "TO_COPY", "fake_tensor_mode", "is_fake", "without_fake_mode", "TorchDispatchMode", "storage_id", "profiler_enabled"]


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


def set_module_tensors(slots: "Sequence[Any]", tensors: "Iterable[torch.Tensor]") -> None:
    """:func:`set_module_tensor` for each slot (anything with ``.module`` and ``.param_name``)
    and tensor, in one call (the runtime swaps every parameter of a module four times a step)."""
    for slot, tensor in zip(slots, tensors):
        slot.module._parameters[slot.param_name] = tensor


def is_in_backward() -> bool:
    """True while the autograd engine is running a backward on this thread."""
    return int(torch._C._current_graph_task_id()) != -1


def current_graph_task() -> int:
    """The id of the autograd graph task running on this thread (-1 outside backward): a
    reentrant backward started inside another runs under an id of its own."""
    return int(torch._C._current_graph_task_id())


def tensor_version(tensor: "torch.Tensor") -> int:
    """The in-place version counter of ``tensor`` (bumped by every in-place op on it)."""
    return int(tensor._version)


def versions_sum(tensors: "Iterable[torch.Tensor]") -> int:
    """The sum of the in-place version counters of ``tensors``: it changes when any of them is
    edited in place (one pass, no call per tensor: it runs twice per module and step)."""
    return sum([t._version for t in tensors])


def float8_weight_parts(weight: Any) -> Tuple["torch.Tensor", "torch.dtype", Any]:
    """torchao's float8 training weight's ``(plain tensor, float8 dtype, linear_mm_config)``."""
    return weight._tensor, weight._dtype, weight._linear_mm_config


def float8_bytes(tensor: Any) -> "torch.Tensor":
    """A torchao ``Float8TrainingTensor``'s float8 data."""
    return tensor._data  # type: ignore[no-any-return]


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


FOREACH_NORM = torch._foreach_norm  # private, see module docstring


def plain_torch_function(func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """Run ``func`` as on plain tensors: no tensor subclass's ``__torch_function__`` runs inside,
    and new results are plain tensors (what ``interop.ShardedGrad`` hands every operation on
    a gradient to)."""
    with torch._C.DisableTorchFunctionSubclass():  # private, see module docstring
        return func(*args, **kwargs)


# ``plain_torch_function`` with the ``(func, types, args, kwargs)`` of ``__torch_function__``, in C:
# torch's own ``_disabled_torch_function_impl`` sets the same state around the call (private, see
# module docstring). A ``ShardedGrad`` hands every operation but clipping's norms to it (optimizers'
# ``add_`` of each gradient, every step): a Python frame and a context manager less per operation.
PLAIN_TORCH_FUNCTION_IMPL: Callable[..., Any] = torch._C._disabled_torch_function_impl


def as_plain(tensor: "torch.Tensor") -> "torch.Tensor":
    """``tensor`` (maybe of a subclass) as a plain tensor sharing its storage, without running
    the subclass's ``__torch_function__``."""
    return plain_torch_function(torch.Tensor.as_subclass, (tensor, torch.Tensor), {})  # type: ignore[no-any-return]


BATCH_NORM = nn.modules.batchnorm._BatchNorm  # private, see module docstring


def tensor_slots(module: nn.Module) -> Iterator[Tuple[Dict[str, Any], str, Optional[torch.Tensor], bool]]:
    """``(slots, name, value, saved)`` for each parameter slot, then each buffer slot, of
    ``module`` itself, empty ones included: ``slots`` is the dict holding it (writing
    ``slots[name]`` puts an object back), ``saved`` whether ``module.state_dict()`` holds it."""
    for name, param in module._parameters.items():  # private, see module docstring
        yield module._parameters, name, param, param is not None
    for name, buf in module._buffers.items():
        yield module._buffers, name, buf, buf is not None and name not in module._non_persistent_buffers_set


def is_view_of(tensor: torch.Tensor, base: torch.Tensor) -> bool:
    """True if ``tensor`` is a view taken of ``base``."""
    return tensor._base is base  # private, see module docstring


class DCPTensorHooks:
    """Mixin of a tensor subclass that ``torch.distributed.checkpoint`` saves and loads: DCP's
    hooks, handed to the class's ``dcp_write_items(fqn)``, ``dcp_chunk_list()`` and
    ``dcp_tensor_shard(index)``."""

    def __create_write_items__(self, fqn: str, obj: Any) -> Any:
        return self.dcp_write_items(fqn)  # type: ignore[attr-defined]  # defined by the subclass

    def __create_chunk_list__(self) -> Any:
        return self.dcp_chunk_list()  # type: ignore[attr-defined]  # defined by the subclass

    def __get_tensor_shard__(self, index: Any) -> Any:
        return self.dcp_tensor_shard(index)  # type: ignore[attr-defined]  # defined by the subclass


_DCP_METADATA_CLASSES = {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                         "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING"}
DCP_METADATA_GLOBALS: Dict[str, set] = {  # module -> names; see module docstring
    "torch.distributed.checkpoint.metadata": _DCP_METADATA_CLASSES,
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size", "device"} | {n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)},
    "torch.serialization": {"_get_layout"},  # a layout by its name ("torch.strided")
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class GuardedApplyHook:
    """Mixin of a module class: every ``nn.Module._apply`` call (``.to()``, ``.half()``, ...)
    runs as ``self._cs_guarded_apply(apply, fn)``, ``apply()`` being the call itself and ``fn``
    what it applies to each tensor."""

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        # nn.Module's, next in the module class's MRO -- past torch FSDP2's FSDPModule when it is a base
        # (FSDP2_MODULE_MARKER): its _apply needs FSDP2's state, which our modules do not have.
        after: type = FSDP2_MODULE_MARKER[0] if FSDP2_MODULE_MARKER and isinstance(self, FSDP2_MODULE_MARKER[0]) \
            else GuardedApplyHook
        parent_apply = super(after, self)._apply  # type: ignore[misc,arg-type]  # nn.Module's
        return self._cs_guarded_apply(lambda: parent_apply(fn, recurse), fn)

    def _cs_guarded_apply(self, apply: Callable[[], Any], fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        """Run ``apply()`` (``nn.Module._apply`` on this module) and return its result."""
        return apply()


TO_COPY = torch.ops.aten._to_copy.default  # private, see module docstring

TORCH_STATE_DICT_MODULE = "torch.distributed.checkpoint.state_dict"
UNKNOWN_REQUEST = object()  # a frame of torch's state-dict module whose options could not be read


class RunningFunction(NamedTuple):
    """One Python function running on this thread (a frame of its stack), as
    :func:`running_functions` reports it. Use it while the call that asked is running; never
    keep it (``local`` holds the frame)."""

    module: str  # ``__name__`` of the module whose code it runs
    name: str  # the function's name
    qualname: str  # with its class (``Schedule1F1B.__init__``) where Python says so (3.11+), else ``name``
    local: Callable[[str], Any]  # one of its local variables by name (None if unset); reads it only when called


def running_functions() -> Iterator[RunningFunction]:
    """The Python functions running on this thread, innermost first, starting with the caller's
    caller (the function that called the one asking). The package's only reader of Python frames
    (``tests/unit/test_frame_access.py`` fails on any other): see [Note: Caller checks] in
    ``_base/callers.py`` and the module docstring (``running_functions``)."""
    frame: Optional[FrameType] = sys._getframe(2)  # past this generator and the function that asked
    try:
        while frame is not None:
            code = frame.f_code
            yield RunningFunction(frame.f_globals.get("__name__", ""), code.co_name,
                                  getattr(code, "co_qualname", code.co_name),
                                  lambda name, seen=frame: seen.f_locals.get(name))  # type: ignore[misc]  # bound now
            frame = frame.f_back
    finally:
        del frame  # a suspended walk must not keep the stack's frames alive


def torch_state_dict_request() -> Any:
    """The options (a ``StateDictOptions``) of the torch ``torch.distributed.checkpoint.state_dict``
    call this thread is running inside, ``None`` if it runs inside none, or ``UNKNOWN_REQUEST``
    if it does but its options could not be read (see the module docstring)."""
    dsd = sys.modules.get(TORCH_STATE_DICT_MODULE)
    options_cls = getattr(dsd, "StateDictOptions", None)
    if options_cls is None:  # never imported: none of its functions can be running
        return None
    found_module = False
    for function in running_functions():
        if function.module != TORCH_STATE_DICT_MODULE:
            continue
        found_module = True
        info, options = function.local("info"), function.local("options")
        if isinstance(info, options_cls):
            return info
        if options is None and function.name in _OPTIONS_ARGUMENT_FUNCTIONS or isinstance(options, options_cls):
            return options if options is not None else options_cls()
    return UNKNOWN_REQUEST if found_module else None


class TorchLoad(NamedTuple):
    """A load by torch's ``torch.distributed.checkpoint.state_dict`` running on this thread, as
    :func:`torch_state_dict_load` reads it. Use it during that call only (it holds the call's
    model and options)."""

    api: str  # the public function called (``set_state_dict``, ...), else the private worker's name
    info: Any  # the call's options (torch's ``_StateDictInfo``, a ``StateDictOptions``)
    model: Any  # the model it loads (or whose optimizers it loads)
    loads_model: bool  # whether the call loads the model on this rank (see the module docstring)


def torch_state_dict_load() -> Optional[TorchLoad]:
    """The torch state-dict load (``set_state_dict``, ``set_model_state_dict``,
    ``set_optimizer_state_dict``) this thread runs inside, or ``None`` (see the module docstring,
    ``torch_state_dict_load``)."""
    if TORCH_STATE_DICT_MODULE not in sys.modules:  # never imported: none of its functions can be running
        return None
    worker: Optional[RunningFunction] = None
    for function in running_functions():
        if function.module != TORCH_STATE_DICT_MODULE:
            continue
        if worker is None and function.name in ("_load_model_state_dict", "_load_optim_state_dict"):
            worker = function
        elif worker is not None and function.name in _OPTIONS_ARGUMENT_FUNCTIONS:
            info, model = worker.local("info"), worker.local("model")
            given = function.local("model_state_dict")  # None in set_optimizer_state_dict
            loads = bool(getattr(info, "handle_model", False)) and (
                bool(given) or bool(getattr(info, "broadcast_from_rank0", False)))
            return TorchLoad(function.name, info, model, loads)
    if worker is None:
        return None
    info = worker.local("info")
    return TorchLoad(worker.name, info, worker.local("model"),
                     worker.name == "_load_model_state_dict" and bool(getattr(info, "handle_model", False)))


# torch's public state-dict functions whose ``options`` argument, when None, means the defaults
_OPTIONS_ARGUMENT_FUNCTIONS = frozenset({"get_state_dict", "get_model_state_dict", "get_optimizer_state_dict",
                                         "set_state_dict", "set_model_state_dict", "set_optimizer_state_dict"})


# See module docstring: torch 2.13's names, else the older ones.
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _collective_options(options_class: Any, **values: Any) -> Any:
    """One options object for every call of a collective (the call only reads it)."""
    options = options_class()
    if hasattr(options, "asyncOp"):  # torch >= 2.8: the work is waited by the caller
        options.asyncOp = True
    for name, value in values.items():
        setattr(options, name, value)
    return options


_GATHER_OPTIONS = _collective_options(dist.distributed_c10d.AllgatherOptions)
_SCATTER_OPTIONS = tuple(_collective_options(dist.distributed_c10d.ReduceScatterOptions, reduceOp=op)
                         for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG))  # indexed by ``average``
_GATHER_METHOD = "all_gather_single" if hasattr(dist.ProcessGroup, "all_gather_single") else "_allgather_base"
_SCATTER_METHOD = "reduce_scatter_single" if hasattr(dist.ProcessGroup, "reduce_scatter_single") else "_reduce_scatter_base"


def all_gather_work(output: "torch.Tensor", input: "torch.Tensor", group: Optional["dist.ProcessGroup"]) -> Any:
    """``dist.all_gather_single(output, input, group=group, async_op=True)`` for the runtime's own
    buffers on a group this rank belongs to (``None``: the default group), straight to the group
    (see module docstring)."""
    if group is None:
        group = dist.group.WORLD
    if input.is_complex():
        output, input = torch.view_as_real(output), torch.view_as_real(input)
    return getattr(group, _GATHER_METHOD)(output, input, _GATHER_OPTIONS)


def reduce_scatter_work(output: "torch.Tensor", input: "torch.Tensor", average: bool,
                        group: Optional["dist.ProcessGroup"]) -> Any:
    """``dist.reduce_scatter_single(output, input, op=AVG if average else SUM, group=group,
    async_op=True)`` for the runtime's own buffers (``None``: the default group), straight to the
    group (see module docstring)."""
    if group is None:
        group = dist.group.WORLD
    if input.is_complex():
        output, input = torch.view_as_real(output), torch.view_as_real(input)
    return getattr(group, _SCATTER_METHOD)(output, input, _SCATTER_OPTIONS[average])


TORCH_FSDP_PACKAGE = "torch.distributed.fsdp"  # FSDP2's arguments (MixedPrecisionPolicy, ...) are recognised by module name


def _fsdp2_module_marker() -> Tuple[type, ...]:
    """torch's FSDP2 ``FSDPModule`` class as a one-element tuple of bases, ``()`` without it
    (see the module docstring)."""
    if not dist.is_available():
        return ()
    try:
        from torch.distributed.fsdp import FSDPModule  # the class object only: see the module docstring
    except ImportError:
        return ()
    return (FSDPModule,)


FSDP2_MODULE_MARKER: Tuple[type, ...] = _fsdp2_module_marker()


# ---------------------------------------------------------------------------- planning on fake tensors
# plan() measures activations on fake tensors ([Note: Planning on fake tensors] in _planning/plan_profile.py):
# FakeTensorMode, the dispatch-mode base class and a storage's identity have no public names.


def fake_tensor_mode() -> Any:
    """A new ``FakeTensorMode`` taking real tensors as constants (imported when first needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # private, see module docstring
    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor."""
    from torch._subclasses.fake_tensor import FakeTensor  # private, see module docstring
    return isinstance(tensor, FakeTensor)


def without_fake_mode() -> Any:
    """A context in which operators run on real tensors although a ``FakeTensorMode`` is active."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily  # private, see module docstring
    return unset_fake_temporarily()

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402  # private, see module docstring


def storage_id(tensor: torch.Tensor) -> int:
    """An identity of ``tensor``'s storage, shared by its views, unique while the storage lives
    (a fake or meta tensor's ``data_ptr`` is 0 for every storage)."""
    return int(tensor.untyped_storage()._cdata)


# True while a profiler records on this thread (private, see module docstring); the C function
# itself, not a Python function around it: it is asked several times per module and step.
profiler_enabled: Callable[[], bool] = torch.autograd._profiler_enabled
