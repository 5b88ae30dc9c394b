"""The step: one parameter's life from a forward to the optimizer, and what the hooks need for it.

Modules (lowest first; each may import the ones above it in this list, not below):

- ``collectives.py``: every collective, asynchronous, counted for tests (``record_collectives``).
- ``streams.py``: CUDA streams and events (no ``record_stream``); nothing on the CPU.
- ``shard_math.py``: padding, chunks, each parameter's slice on each rank (pure arithmetic).
- ``watch.py``: changes to the model after ``fully_shard`` and optimizer steps (global torch hooks).
- ``interop.py``: the gradient seams with torch (sharded ``.grad`` in ``clip_grad_norm_``,
  foreign wrappers, pipelining and Lightning refusals).
- ``flat_param.py``: ``FlatParameter`` and ``FlatParamHandle``, which does every transition.
- ``module_state.py``: the per-module state a fully sharded module carries (``_FSDPState``:
  handle, groups, streams, the root's context).
- ``traversal.py``: the fully sharded modules under a root and the modules each one owns.
- ``agreement.py``: ranks agree before each collective; debug mode.
- ``mixed_precision.py``: compute-dtype casts of inputs and buffers; modules kept in full precision.
- ``hooks.py``: the forward and backward hooks, prefetch, and the end of backward.

The tensors of one fully sharded module's handle, per ``(dtype, requires_grad)`` group:

- **shard** (``group.flat_param``, a :class:`FlatParameter`): this rank's ``ceil(N / W)``
  elements of the group's flattened, padded parameters; the storage the optimizer steps.
- **unsharded buffer** (``padded_unsharded_flat``): all ``W * ceil(N / W)`` elements, written by
  the all-gather, computed on in forward and backward, freed after (FULL_SHARD).
- **views**: the original ``nn.Parameter`` objects. Idle, each is a 1-D view of its slice of the
  shard (possibly empty); in forward and backward, a full-shape view of the unsharded buffer.
- **gradient buffers**: the unsharded gradient (autograd writes the whole padded buffer, the
  reduce-scatter's input), this rank's reduced shard of it, and each parameter's ``.grad``, a
  view of that reduced shard; between unsynced backwards, the kept unreduced sum.

"State" means four things in this package; each has a name: per-module state
(``module_state._FSDPState``, the ``@contract`` registry's entry), a handle's
``training_state`` (``flat_param.HandleTrainingState``), state dicts (``_state/``) and optimizer
state (``_state/optim_state_dict.py``).

May import: ``_base`` and the package's vocabulary (``api``, ``contract``, ``wrap``).
"""
