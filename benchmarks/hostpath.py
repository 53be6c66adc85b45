"""Host time per iteration with tiny compute: what the Python side of a step costs, hf_zero against DDP.

``python -m benchmarks.hostpath [--smoke] [--out FILE] [--docs FILE]``: two gloo processes (one thread each) train
models of ``L`` blocks of ``Linear(H, H) + LayerNorm(H)`` (4 tensors a block) on a batch of 4, side by side:

==========  ==========================================================================
``ddp``     DDP (``gradient_as_bucket_view=True``) + ``torch.optim.AdamW(fused=True)`` (the baseline, 1.0)
``stage1``  DDP + hf_zero stage 1, its comm hook reduce-scattering each bucket, fused AdamW inside
``stage2``  hf_zero stage 2 (``bind_module``, no DDP), fused AdamW inside
==========  ==========================================================================

With so little arithmetic the iteration time is mostly the host's: Python, launches, collectives' latency. Rounds
are paired and interleaved (every contender once per round, in a seeded shuffled order, the ratio to ``ddp`` taken
within the round); a contender's turn is a burst whose first iteration is untimed, timed per iteration, its median
taken (on a shared machine another process taking a core for a while moves a mean, not the median). The same harness counts, over steady steps, the host reads of tensor values
(:class:`HostReadCounter`) and the collectives (``benchmarks._common.CollectiveCounter``): the counts are recorded
with the times, and tests/test_hostpath.py asserts them. ``--profile`` adds each contender's cProfile top functions
(rank 0). The JSON goes to ``--out`` (default benchmarks/results/hostpath_n2.json); ``python -m benchmarks.render``
renders it into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _common  # noqa: E402
from benchmarks._common import CollectiveCounter, drain_sync  # noqa: E402
from tests._dist import run_ranks  # noqa: E402

CONTENDERS = ("ddp", "stage1", "stage2")
BASELINE = "ddp"
# (blocks, width): 4 tensors a block
SHAPES = {"48": (12, 64), "192": (48, 64), "384": (96, 64), "48-H512": (12, 512)}
STEADY = range(4, 9)  # the steps whose reads and collectives are counted
BATCH = 4
LR = 1e-3
# The Tensor methods that copy a value to the host: on an accelerator each waits for all queued work.
READS = ("item", "__bool__", "__int__", "__float__", "tolist", "numpy")


@dataclass(frozen=True)
class Options:
    """How a loop trains: micro-batches per step (all but the last under ``no_sync()``), clipping to a max norm,
    the model's dtype (bf16: hf_zero steps through fp32 masters), the overlapped parameter sync (stage 1 and 2),
    a ``BatchNorm1d`` last (its buffers are broadcast from rank 0 each step), stage 1's non-finite agreement (as
    with a GradScaler)."""

    accumulation: int = 1
    clip: float | None = None
    dtype: str = "float32"
    overlap: bool = False
    norm: bool = False
    grad_scaler: bool = False


class HostReadCounter(_common.CallCounter):
    """Wraps the ``torch.Tensor`` methods in :data:`READS` in this process (until :meth:`uninstall`); inside
    :meth:`recording`, ``calls`` holds (method, where) per call, ``where`` the first caller outside torch."""

    def __init__(self):
        import torch

        super().__init__(torch.Tensor, READS)

    def _wrap(self, name, fn):
        def counted(t, *args, **kwargs):
            if self._active:
                self._active = False  # a read inside a read (numpy() -> __array__) counts once
                try:
                    self.calls.append((name, _caller()))
                finally:
                    self._active = True
            return fn(t, *args, **kwargs)

        counted.__name__ = name
        return counted


def _caller() -> str:
    """file:line of the innermost frame outside this module (torch's own frames included: they are reads too)."""
    f = sys._getframe(2)
    return f"{os.path.relpath(f.f_code.co_filename, ROOT) if str(ROOT) in f.f_code.co_filename else f.f_code.co_filename}" \
           f":{f.f_lineno} ({f.f_code.co_name})"


def build_model(shape: str, dtype: str = "float32", norm: bool = False):
    import torch

    blocks, width = SHAPES[shape]
    torch.manual_seed(0)
    layers = []
    for _ in range(blocks):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width)]
    if norm:
        layers.append(torch.nn.BatchNorm1d(width))
    return torch.nn.Sequential(*layers).to(getattr(torch, dtype))


def build(name: str, shape: str, opts: Options):
    """(the callable the loop runs forward through, the optimizer, the clipping function) of contender ``name``
    (or ``accelerate/stage1``, ``accelerate/stage2``: the hf_zero optimizer prepared by Accelerate, clipped by
    ``accelerator.clip_grad_norm_``); the model is fresh."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zero import ZeroBucketOptimizer

    model = build_model(shape, opts.dtype, opts.norm)
    if name.startswith("accelerate/"):
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        opt = ZeroBucketOptimizer(list(model.named_parameters()), torch.optim.AdamW, lr=LR, fused=True,
                                  stage=int(name[-1]), overlap_param_sync=opts.overlap)
        net, opt = accelerator.prepare(model, opt)
        return net, opt, lambda: accelerator.clip_grad_norm_(net.parameters(), opts.clip)
    if name == "stage2":
        opt = ZeroBucketOptimizer(list(model.named_parameters()), torch.optim.AdamW, lr=LR, fused=True, stage=2,
                                  overlap_param_sync=opts.overlap)
        opt.bind_module(model)
        return model, opt, lambda: opt.clip_grad_norm_(opts.clip)
    ddp = DDP(model, gradient_as_bucket_view=True)
    if name == "ddp":
        return ddp, torch.optim.AdamW(model.parameters(), lr=LR, fused=True), \
            lambda: torch.nn.utils.clip_grad_norm_(ddp.parameters(), opts.clip)
    opt = ZeroBucketOptimizer(list(model.named_parameters()), torch.optim.AdamW, lr=LR, fused=True,
                              grad_reduce="reduce_scatter", overlap_param_sync=opts.overlap)
    opt.bind_ddp(ddp, grad_scaler=opts.grad_scaler)  # no GradScaler in these loops: nothing skips a step
    return ddp, opt, lambda: opt.clip_grad_norm_(opts.clip)


def batches(shape: str, dtype: str, rank: int, n: int = 4):
    import torch

    width = SHAPES[shape][1]
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(BATCH, width, generator=g).to(getattr(torch, dtype)),
             torch.randn(BATCH, width, generator=g).to(getattr(torch, dtype))) for _ in range(n)]


def iteration(built, data, k: int, opts: Options) -> None:
    """One optimizer step of ``opts.accumulation`` micro-batches from ``data`` (from ``k`` on); ``built``: what
    :func:`build` returned."""
    import torch

    net, opt, clip = built
    for m in range(opts.accumulation):
        x, y = data[(k + m) % len(data)]
        last = m + 1 == opts.accumulation
        with contextlib.nullcontext() if last else net.no_sync():
            torch.nn.functional.mse_loss(net(x), y).backward()
    if opts.clip is not None:
        clip()
    opt.step()
    opt.zero_grad()


def counted_rank(rank: int, world_size: int, cases: dict) -> dict:
    """For each case (name -> (contender, shape, Options)): per steady step (:data:`STEADY`) the host reads, with
    where each came from, and the collectives; and the params after the last step."""
    import torch

    reads, collectives = HostReadCounter(), CollectiveCounter()
    out = {}
    try:
        for case, (name, shape, opts) in cases.items():
            torch.manual_seed(0)
            built = build(name, shape, opts)
            net, opt, _ = built
            data = batches(shape, opts.dtype, rank)
            per_step = []
            for k in range(STEADY.stop):
                if k in STEADY:
                    with reads.recording(), collectives.recording():
                        iteration(built, data, k, opts)
                    per_step.append({"reads": list(reads.calls), "collectives": [c[0] for c in collectives.calls]})
                else:
                    iteration(built, data, k, opts)
            opt = getattr(opt, "optimizer", opt)  # Accelerate's wrapper
            drain_sync(opt)
            module = getattr(net, "module", net)
            layout = getattr(getattr(opt, "gradient_path", None), "layout", None)
            out[case] = {"steps": per_step, "params": [p.detach().clone() for p in module.parameters()],
                         "buffers": None if layout is None else len(layout.buffers)}
            if hasattr(opt, "unbind"):
                opt.unbind()
    finally:
        reads.uninstall()
        collectives.uninstall()
    return out


def timed_rank(rank: int, world_size: int, cfg: dict) -> dict:
    """Every contender on every shape: ms per iteration per round (paired rounds), and rank 0's profiles."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    opts = Options(**cfg["options"])
    out = {}
    for shape in cfg["shapes"]:
        built = {name: build(name, shape, opts) for name in CONTENDERS}
        data = batches(shape, opts.dtype, rank)
        rounds: dict[str, list[float]] = {name: [] for name in CONTENDERS}
        cpu_rounds: dict[str, list[float]] = {name: [] for name in CONTENDERS}  # the main thread's CPU time
        order = list(CONTENDERS)
        shuffle = random.Random(cfg["seed"])
        for _ in range(cfg["rounds"]):
            shuffle.shuffle(order)  # the same order on every rank
            for name in order:
                opt = built[name][1]
                iteration(built[name], data, 0, opts)  # untimed: the last contender's wake-up
                dist.barrier()
                times, cpu = [], []
                for k in range(cfg["iterations"]):
                    start, start_cpu = time.perf_counter(), time.thread_time()
                    iteration(built[name], data, k, opts)
                    times.append((time.perf_counter() - start) * 1e3)
                    cpu.append((time.thread_time() - start_cpu) * 1e3)
                drain_sync(opt)
                # the median iteration: another process taking the core for a while moves a mean, not it
                rounds[name].append(statistics.median(times))
                cpu_rounds[name].append(statistics.median(cpu))
        profiles = {}
        if cfg["profile"]:
            for name in CONTENDERS:
                opt = built[name][1]
                prof = cProfile.Profile()
                prof.enable()
                for k in range(cfg["iterations"]):
                    iteration(built[name], data, k, opts)
                drain_sync(opt)
                prof.disable()
                profiles[name] = _top(prof, cfg["iterations"]) if rank == 0 else []
        out[shape] = {"ms": rounds, "cpu_ms": cpu_rounds, "profiles": profiles}
        del built
    return out


def _top(prof: cProfile.Profile, iterations: int, n: int = 25) -> list[dict]:
    """The ``n`` functions with the most own time, per iteration (microseconds)."""
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, func), (_, calls, own, total, _) in stats.stats.items():
        where = os.path.relpath(file, ROOT) if str(ROOT) in file else file.split("site-packages/")[-1]
        rows.append({"function": f"{where}:{line}({func})", "calls": calls / iterations,
                     "own_us": own * 1e6 / iterations, "total_us": total * 1e6 / iterations})
    rows.sort(key=lambda r: -r["own_us"])
    return rows[:n]


def analyse(per_rank: list[dict], cfg: dict) -> dict:
    """Per shape and contender: the median over rounds of the slower rank's ms per iteration, and the paired ratios
    to the baseline (median, min, max)."""
    table = {}
    for shape in cfg["shapes"]:
        rows = {}
        for key, prefix in (("ms", ""), ("cpu_ms", "cpu_")):
            slowest = {name: [max(r[shape][key][name][i] for r in per_rank) for i in range(cfg["rounds"])]
                       for name in CONTENDERS}
            for name in CONTENDERS:
                ratios = [a / b for a, b in zip(slowest[name], slowest[BASELINE])]
                rows.setdefault(name, {}).update({
                    f"{prefix}ms_median": statistics.median(slowest[name]), f"{prefix}ms_rounds": slowest[name],
                    f"{prefix}ratio_median": statistics.median(ratios), f"{prefix}ratio_min": min(ratios),
                    f"{prefix}ratio_max": max(ratios)})
        table[shape] = {"rows": rows, "profiles": per_rank[0][shape]["profiles"]}
    return table


def counts(shape: str, opts: Options, world_size: int = 2) -> dict:
    """Host reads and collectives per steady step of each contender (the most over ranks and steps)."""
    per_rank = run_ranks(counted_rank, world_size, {name: (name, shape, opts) for name in CONTENDERS}, timeout=300)
    return {name: {"reads": max(len(s["reads"]) for r in per_rank for s in r[name]["steps"]),
                   "collectives": max(len(s["collectives"]) for r in per_rank for s in r[name]["steps"]),
                   "where": sorted({w for r in per_rank for s in r[name]["steps"] for _, w in s["reads"]})}
            for name in CONTENDERS}


TARGETS = {"stage1": {"48": 1.30, "384": 1.15}, "stage2": {"48": 1.50, "384": 1.30}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one shape, 2 rounds of 3 iterations (a dry run)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the model's dtype (bfloat16: hf_zero steps through fp32 masters, DDP's AdamW the bf16 params)")
    parser.add_argument("--out", default=None,
                        help="default: benchmarks/results/hostpath_n2.json (float32), hostpath_bf16_n2.json (bfloat16)")
    args = parser.parse_args(argv)
    out = args.out or str(ROOT / "benchmarks" / "results" / f"hostpath{'_bf16' if args.dtype == 'bfloat16' else ''}_n2.json")
    options = Options(dtype=args.dtype)
    cfg = {"world_size": 2, "rounds": args.rounds, "iterations": args.iterations, "seed": 0, "batch": BATCH,
           "shapes": args.shapes.split(","), "options": asdict(options), "profile": args.profile,
           "model": "blocks of Linear(H, H) + LayerNorm(H), 4 tensors a block", "steady_steps": list(STEADY)}
    if args.smoke:
        cfg.update(rounds=2, iterations=3, shapes=["48"])
    per_rank = run_ranks(timed_rank, cfg["world_size"], cfg, timeout=3000)
    res = {"env": _common.environment("python -m benchmarks.hostpath " + " ".join(argv or sys.argv[1:])),
           "config": cfg, "shapes": analyse(per_rank, cfg),
           "counts": counts(cfg["shapes"][0], options), "targets": TARGETS}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=1) + "\n")
    for shape, t in res["shapes"].items():
        print(shape, {n: f"{r['ms_median']:.2f} ms ({r['ratio_median']:.2f}x), host CPU {r['cpu_ms_median']:.2f} ms "
                         f"({r['cpu_ratio_median']:.2f}x)" for n, r in t["rows"].items()})
    print("counts", {n: (c["reads"], c["collectives"]) for n, c in res["counts"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
