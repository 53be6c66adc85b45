"""hf_zero benchmarks: ``python -m benchmarks.e2e`` and ``python -m benchmarks.memory`` write one JSON per run;
``python -m benchmarks.render`` makes docs/benchmarks.md from the ones kept in benchmarks/results/."""
