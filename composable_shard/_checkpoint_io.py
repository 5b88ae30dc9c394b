"""The documented path of the safe DCP reader and planner (README, "What is safe to load"):
``from composable_shard._checkpoint_io import SafeFileSystemReader, SafeLoadPlanner``. They live in
``_state/checkpoint_files.py``."""

from ._state.checkpoint_files import SafeFileSystemReader, SafeLoadPlanner

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner"]
