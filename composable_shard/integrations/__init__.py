"""Integrations with training frameworks, each an optional module with its own extra.

- :mod:`composable_shard.integrations.transformers`: Hugging Face ``Trainer`` and
  ``accelerate`` for a model sharded by this library (``pip install composable_shard[hf]``).
- :mod:`composable_shard.integrations.lightning`: Lightning's ``Trainer`` and ``Fabric``
  (``ShardedStrategy``, ``ShardedFabricStrategy``; ``pip install composable_shard[lightning]``).
- :mod:`composable_shard.integrations.pipelining`: torch's pipeline schedules over stages whose
  modules this library manages (``PipelineStage``; needs only torch).
- ``_shared``: what both need of a managed model (managed modules, gradient sync off).

Nothing here is imported by ``import composable_shard``: the core package depends on torch
only, and importing an integration without its extra raises ``ImportError`` naming the extra.
"""
