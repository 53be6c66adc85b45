"""Run the benchmark suite: ``python -m benchmarks.run [--smoke] [--out bench_out]``.

World size 2 on gloo CPU processes (spawned), the same models, grads and
optimizer settings for every contender. Writes ``results.json``,
``benchmarks.md`` and ``chart.png`` (when matplotlib is installed) to ``--out``;
a full run also rewrites the generated part of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _common, report  # noqa: E402
from benchmarks.suite import OPTIMIZERS, bench_rank  # noqa: E402
from tests._dist import run_ranks  # noqa: E402

FULL = {
    "models": {
        # GPT-2 blocks at width 512, small vocabulary: 29.5M params, no dominant tensor.
        "gpt2_30m": dict(vocab_size=8192, n_positions=256, n_embd=512, n_layer=8, n_head=8),
        # GPT-2's vocabulary at width 512, 2 blocks: 32.2M params, 80% in the embedding.
        "gpt2_embedding_heavy": dict(vocab_size=50257, n_positions=256, n_embd=512, n_layer=2, n_head=8),
    },
    "optimizers": list(OPTIMIZERS),
    "warmup": 2,
    "steps": 8,
    "rebuild_reps": 2,
    "consolidate_reps": 2,
    "raw_buffer_elements": 30_000_000,
    "timeout_s": 1500,
}
SMOKE = {
    "models": {
        "gpt2_tiny": dict(vocab_size=512, n_positions=32, n_embd=32, n_layer=2, n_head=2),
        "tiny_embedding_heavy": dict(vocab_size=4096, n_positions=32, n_embd=32, n_layer=2, n_head=2),
    },
    "optimizers": list(OPTIMIZERS),
    "warmup": 1,
    "steps": 2,
    "rebuild_reps": 1,
    "consolidate_reps": 1,
    "raw_buffer_elements": 100_000,
    "timeout_s": 120,
}
WORLD_SIZE = 2


def environment(argv) -> dict:
    return _common.environment(" ".join(["python -m benchmarks.run", *argv]),
                               backend="gloo", world_size=WORLD_SIZE, threads_per_rank=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny models, 2 timed steps: seconds, for CI")
    parser.add_argument("--out", default="bench_out", help="output folder (default: bench_out)")
    parser.add_argument("--docs", default=None,
                        help="markdown file whose generated section is rewritten "
                             "(default: docs/benchmarks.md for a full run, none for --smoke)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    cfg = dict(SMOKE if args.smoke else FULL)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    env = environment(argv)
    env["smoke"] = args.smoke
    ranks = run_ranks(bench_rank, WORLD_SIZE, cfg, timeout=cfg["timeout_s"])
    results = report.analyse(ranks, cfg, env)
    results["targets"] = report.targets(results)

    (out / "results.json").write_text(json.dumps(results, indent=2))
    md = report.markdown(results)
    (out / "benchmarks.md").write_text(md)
    chart = report.chart(results, out / "chart.png")
    docs = args.docs if args.docs is not None else (None if args.smoke else str(ROOT / "docs" / "benchmarks.md"))
    if docs:
        report.write_docs(Path(docs), md, chart_name="benchmarks.png" if chart else None, chart=chart)
    print(md)
    print(f"\nwrote {out / 'results.json'}, {out / 'benchmarks.md'}" + (f", {chart}" if chart else "")
          + (f"; updated {docs}" if docs else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
