"""Setup: what runs once, when ``fully_shard(...)`` or ``replicate(...)`` is applied.

- ``validation.py``: argument checks that raise, naming the module or parameter, before anything
  changes.
- ``data_parallel.py``: what ``fully_shard`` and ``replicate`` share (devices, groups, ignored
  parameters, the broadcast of rank 0's values).
- ``subclass.py``: the ``FSDP<Orig>`` / ``Replicate<Orig>`` classes that add user methods.
- ``apply_guard.py``: ``.to()``, ``.half()`` and other casts on managed modules, guarded.
- ``fsdp2_compat.py``: torch FSDP2's arguments and ``FSDPModule`` methods, implemented,
  accepted or refused.
- ``fully_shard_init.py``: plan ``fully_shard(...)`` (targets, parameters per handle), agree on it
  across ranks, then apply it (build handles).

May import: ``_base``, the vocabulary (``api``, ``contract``, ``wrap``) and ``_runtime``.
"""
