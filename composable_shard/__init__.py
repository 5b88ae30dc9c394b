"""composable_shard: in-place composable data parallelism for PyTorch."""
