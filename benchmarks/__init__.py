"""hf_zero benchmarks: ``python -m benchmarks.e2e`` and ``python -m benchmarks.memory`` (docs/benchmarks.md)."""
