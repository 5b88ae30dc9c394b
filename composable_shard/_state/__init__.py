"""State in dicts and on disk: model and optimizer state dicts, checkpoints, ``unshard_params``.

- ``sharded_slice.py``: ``ShardedSlice``, one rank's elements of a parameter in global
  coordinates (what sharded state dicts hold, and what DCP saves and reshards).
- ``load_transaction.py``: all-or-nothing loads (every rank checks, then every rank commits).
- ``unshard_params.py``: full parameters outside the step (``unshard_params``, full state dicts).
- ``model_state_dict.py``: model state dicts (full, sharded, local) and what torch's state-dict
  API sees.
- ``optim_state_dict.py``: optimizer state dicts keyed by parameter name.
- ``checkpoint_files.py``: ``save_checkpoint`` / ``load_checkpoint`` (DCP with checksums and an
  allow-list unpickler), ``latest_checkpoint``, ``export_safetensors``.
- ``async_checkpoint.py``: ``save_checkpoint_async`` (a staging copy, written and published by
  a background thread on its own process group).

May import: ``_base``, the vocabulary, ``_runtime`` and ``_setup``.
"""
