"""What ``describe`` and ``plan`` need besides the runtime: the per-rank figures of a model, and a
step measured on fake tensors.

- ``describe.py``: ``describe(model)``, exact per-rank bytes from the same planning code
  ``fully_shard`` uses (on a plain model too).
- ``plan_profile.py``: one forward and backward on fake tensors (saved, held and output bytes per
  block, FLOPs) and timed forwards; ``plan.py`` at the top searches with them.

May import: ``_base``, the vocabulary, ``_runtime`` and ``_setup``.
"""
