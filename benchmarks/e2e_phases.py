"""Where an iteration's time goes: forward, backward and step, per contender of
``benchmarks.e2e`` (same model, same DDP setup), on 2 gloo processes.

``python -m benchmarks.e2e_phases [--smoke] [--batch 1] [--iterations 12]``

Each iteration is timed as ``benchmarks.e2e`` times a burst of 2: after a barrier (nothing
in flight) one untimed iteration, then the timed one, then the overlapped sync it launched
is waited for, untimed. So the overlapped contender's forward holds its wait for the
previous step's sync, as in a long run. Contenders take turns in an order shuffled per
iteration. Per phase it records the wall time and the CPU time of the thread that runs
the iteration (``time.thread_time``: forward, backward and the optimizer step run on it
on CPU), and for the whole iteration also the CPU time of the process (every thread:
gloo's own threads do the transfers and DDP's sums). CPU times count the work a rank does
itself, so they move much less than wall times on a shared machine. Medians over the
iterations after the first 4, per rank, in ms. A diagnostic: ``benchmarks.e2e`` holds the
measurements.
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
CPU = ("forward_cpu", "backward_cpu", "step_cpu", "total_cpu", "process_cpu")
WARMUP = 4


def phases_rank(rank: int, world_size: int, cfg: dict, batch: int, iterations: int) -> dict:
    import random

    import torch.distributed as dist

    template = e2e.template_model(cfg["model"])
    live = {name: e2e.build_contender(name, template, visible_all_reduce=False) for name in e2e.CONTENDERS}
    data = e2e.make_batches(cfg, rank, batch)
    times = {name: {p: [] for p in PHASES + CPU} for name in live}
    for it in range(iterations):
        for name in random.Random(it).sample(list(live), len(live)):  # the same order on every rank
            ddp, opt = live[name]
            dist.barrier()
            e2e.run_iteration(ddp, opt, data[0])
            inputs = data[1 + it % (len(data) - 1)]
            process_start = time.process_time()
            marks = [_clocks()]  # (wall, thread CPU) at the start and at each phase's end
            loss = ddp(input_ids=inputs, labels=inputs).loss
            marks.append(_clocks())
            loss.backward()
            marks.append(_clocks())
            opt.step()
            opt.zero_grad()
            marks.append(_clocks())
            process_cpu = time.process_time() - process_start
            e2e.drain_sync(opt)
            if it < min(WARMUP, iterations - 1):
                continue
            record = times[name]
            spans = list(zip(marks, marks[1:])) + [(marks[0], marks[-1])]  # forward, backward, step, total
            for wall, cpu, (start, end) in zip(PHASES, CPU, spans):
                record[wall].append(1e3 * (end[0] - start[0]))
                record[cpu].append(1e3 * (end[1] - start[1]))
            record["process_cpu"].append(1e3 * process_cpu)
    return {name: {p: statistics.median(v) for p, v in t.items()} for name, t in times.items()}


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


def markdown(per_rank: list[dict], batch: int) -> str:
    lines = [f"Batch {batch}, ms, median per rank (rank 0 / rank 1); wall time, then the CPU time of the "
             "iteration's thread, and of the whole process:", "",
             "| contender | " + " | ".join(PHASES) + " | " + " | ".join(c.replace("_", " ") for c in CPU) + " |",
             "|---|" + "---|" * (len(PHASES) + len(CPU))]
    for name in per_rank[0]:
        cells = [" / ".join(f"{r[name][p]:.1f}" for r in per_rank) for p in PHASES + CPU]
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
