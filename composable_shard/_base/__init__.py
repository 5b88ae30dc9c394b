"""The base: what every other folder builds on, and which imports nothing of the package.

- ``torch_compat.py``: every private torch name the package touches, one place, with the torch
  versions checked (``tests/unit/test_api_surface.py`` refuses a private torch name anywhere else).
- ``tree.py``: tensors in nested containers (outputs, batches, state dicts), and the local piece
  of a ``DTensor``.
- ``pieces.py``: where a tensor-parallel (``DTensor``) parameter's local piece lies in its global
  tensor, and the ``DTensor`` views, joins and slices the runtime and state dicts make of it.
- ``float8.py``: torchao's float8 weights gathered as float8 bytes, their scales and the float8
  tensors the module computes on ([Note: float8 all-gather]).
- ``host_mirror.py``: small integers to the device and device values back to the host without
  stopping the CPU (pinned copies, events): [Note: No host reads in a step].
- ``sharded_reads.py``: the stand-ins a sharded parameter's slot holds during the first forwards,
  which refuse computation ([Note: Sharded parameters read in forward]).

May import: torch and the standard library only.
"""
