"""Side-by-side benchmarks of composable_shard against torch's own APIs (see BENCHMARK.md)."""
