"""Where an iteration's time goes: forward, backward and step, per contender of
``benchmarks.e2e`` (same model, same DDP setup), on 2 gloo processes.

``python -m benchmarks.e2e_phases [--smoke] [--batch 1] [--iterations 12]``

Every iteration starts after a barrier (nothing in flight), and each phase is timed on
its own; the medians over the iterations after the first 4 are printed per rank, in ms.
With the overlapped sync the barrier also waits for the sync launched by the step, so
that contender's phases leave the sync out: its cost shows in ``benchmarks.e2e``'s
iteration ratios, not here. A diagnostic: ``benchmarks.e2e`` holds the measurements.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import e2e  # noqa: E402
from benchmarks._ranks import run_ranks  # noqa: E402

PHASES = ("forward", "backward", "step", "total")
WARMUP = 4


def phases_rank(rank: int, world_size: int, cfg: dict, batch: int, iterations: int) -> dict:
    import torch.distributed as dist

    template = e2e._template(cfg["model"])
    out = {}
    for name in e2e.CONTENDERS:
        ddp, opt = e2e._build(name, template, visible_all_reduce=False)
        data = e2e._batches(cfg, rank, batch)
        times = {p: [] for p in PHASES}
        for it in range(iterations):
            dist.barrier()
            t0 = time.perf_counter()
            loss = ddp(input_ids=data[it % len(data)], labels=data[it % len(data)]).loss
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t3 = time.perf_counter()
            if it >= min(WARMUP, iterations - 1):
                for p, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                    times[p].append(dt * 1e3)
        e2e._drain(opt)
        out[name] = {p: statistics.median(v) for p, v in times.items()}
        del ddp, opt
    return out


def markdown(per_rank: list[dict], batch: int) -> str:
    lines = [f"Batch {batch}, ms, median per rank (rank 0 / rank 1):", "",
             "| contender | " + " | ".join(PHASES) + " |", "|---|" + "---|" * len(PHASES)]
    for name in per_rank[0]:
        cells = [" / ".join(f"{r[name][p]:.1f}" for r in per_rank) for p in PHASES]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.e2e_phases", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, 2 iterations: seconds, for CI")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--json", default=None, help="also write the medians to this file")
    args = parser.parse_args(argv)
    cfg = e2e.SMOKE if args.smoke else e2e.FULL
    iterations = 2 if args.smoke else args.iterations
    per_rank = run_ranks(phases_rank, e2e.WORLD_SIZE, cfg, args.batch, iterations, timeout=cfg["timeout_s"])
    if args.json:
        Path(args.json).write_text(json.dumps(per_rank, indent=2))
    print(markdown(per_rank, args.batch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
