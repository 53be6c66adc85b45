"""hf_zero benchmarks: ``python -m benchmarks.run`` (see README, "Benchmarks")."""
