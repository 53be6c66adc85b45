"""Multi-GPU iteration time and peak CUDA memory: hf_zero stage 1 and 2 against DDP + fused AdamW
(Trainer's default ``adamw_torch_fused``) and DeepSpeed ZeRO-2, over NCCL, one process per GPU.

    torchrun --standalone --nproc-per-node gpu -m benchmarks.gpu_bench --model gpt2 --dtype bfloat16

writes ``benchmarks/results/gpu_<model>_<dtype>_n<GPUs>.json`` (``--out``), which
``python -m benchmarks.render`` adds to docs/benchmarks.md.

=====================  ==============================================================================
``ddp_adamw_fused``    DDP (``gradient_as_bucket_view=True``) + ``torch.optim.AdamW(fused=True)``: the
                       baseline, 1.0
``hf_zero_stage1``     DDP + ``ZeroBucketOptimizer`` (fused AdamW), grads reduce-scattered into their
                       owners by its comm hook, as Trainer runs it
``hf_zero_stage2``     ``ZeroBucketOptimizer(stage=2)`` (fused AdamW), no DDP: ``bind_module``
``deepspeed_zero2``    DeepSpeed ZeRO stage 2 (``overlap_comm``, ``contiguous_gradients``) stepping
                       torch's fused AdamW; left out, with the reason, where ``deepspeed`` does not import
=====================  ==============================================================================

The model is a GPT-2 built from a config (``--model``, :data:`SIZES`; nothing is downloaded), in
float32 or bfloat16 (``--dtype``: the weights' dtype; hf_zero and DeepSpeed step fp32 masters of
bf16 weights, DDP + AdamW steps the bf16 weights), random tokens, ``--batch`` sequences of
``--seq`` tokens per GPU, grads clipped to ``--max-grad-norm`` (Trainer's default 1.0; 0: off).
Each of ``--rounds`` rounds runs every contender once, in a seeded shuffled order, each built
fresh on the GPU and freed after: ``--warmup`` untimed iterations, then ``--steps`` timed between
two CUDA events (after ``torch.cuda.synchronize()`` and a barrier); a contender's time is its
slowest rank's, its ratio is to the baseline in the same round. Peak memory is
``torch.cuda.max_memory_allocated()`` per rank over the contender's build and iterations (peak
stats reset, and nothing of another contender alive, before it is built), also as above what was
allocated then.

``--device cpu`` is a dry run on gloo (``torchrun --nproc-per-node 2 -m benchmarks.gpu_bench
--device cpu --model tiny``): the same path, timed with the host clock, no memory figures.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import random
import statistics
import sys
import time
from datetime import timedelta
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _common, e2e  # noqa: E402

BASELINE = "ddp_adamw_fused"
# name -> benchmarks.e2e's contender (None: DeepSpeed, built here)
CONTENDERS = {
    "ddp_adamw_fused": "ddp_adamw_fused",
    "hf_zero_stage1": "hf_zero_reduce_scatter",
    "hf_zero_stage2": "hf_zero_stage2",
    "deepspeed_zero2": None,
}
_GPT2 = dict(vocab_size=50257, n_positions=1024)
SIZES = {  # GPT2Config fields
    "tiny": dict(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=2),  # dry runs
    "gpt2": dict(_GPT2, n_embd=768, n_layer=12, n_head=12),  # 124M
    "gpt2-medium": dict(_GPT2, n_embd=1024, n_layer=24, n_head=16),  # 355M
    "gpt2-large": dict(_GPT2, n_embd=1280, n_layer=36, n_head=20),  # 774M
    "gpt2-xl": dict(_GPT2, n_embd=1600, n_layer=48, n_head=25),  # 1.56B
}


def deepspeed_missing() -> str | None:
    """Why DeepSpeed ZeRO-2 cannot run here (None: it can)."""
    try:
        import deepspeed  # noqa: F401
    except Exception as error:  # ImportError, or a broken install raising anything at import
        return f"deepspeed does not import ({type(error).__name__}: {error})"
    return None


def _deepspeed(template, device, cfg):
    import deepspeed
    import torch

    model = copy.deepcopy(template).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=e2e.LR, fused=True)
    config = {
        "train_micro_batch_size_per_gpu": cfg["batch"], "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg["max_grad_norm"],
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
        "zero_allow_untested_optimizer": True, "bf16": {"enabled": cfg["dtype"] == "bfloat16"},
        "steps_per_print": 2**30, "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def build(name: str, template, device, cfg):
    """A fresh contender on ``device``: (what holds its memory, one iteration on a batch, a wait for
    what is in flight)."""
    import torch

    if CONTENDERS[name] is None:
        engine = _deepspeed(template, device, cfg)

        def ds_iteration(batch):
            engine.backward(engine(input_ids=batch, labels=batch).loss)
            engine.step()

        return engine, ds_iteration, lambda: None
    model, opt = e2e.build_contender(CONTENDERS[name], template, visible_all_reduce=False, device=device)
    clip = cfg["max_grad_norm"]
    hf = hasattr(opt, "clip_grad_norm_")  # hf_zero clips through the optimizer (its sharded norm)

    def iteration(batch):
        model(input_ids=batch, labels=batch).loss.backward()
        if clip and hf:
            opt.clip_grad_norm_(clip)
        elif clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()

    return (model, opt), iteration, lambda: _common.drain_sync(opt)


def measure(name: str, template, batches, device, cfg) -> dict:
    """One contender's turn on this rank: ms per timed iteration, CUDA memory (None on the CPU)."""
    import torch
    import torch.distributed as dist

    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        start_bytes = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    held, iteration, drain = build(name, template, device, cfg)
    for i in range(cfg["warmup"]):
        iteration(batches[i % len(batches)])
    drain()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for i in range(cfg["steps"]):
        iteration(batches[i % len(batches)])
    if cuda:
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / cfg["steps"]
    else:
        ms = (time.perf_counter() - t0) * 1e3 / cfg["steps"]
    drain()
    out = {"ms": ms, "peak_bytes": None, "above_start_bytes": None}
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        out.update(peak_bytes=peak, above_start_bytes=peak - start_bytes,
                   peak_reserved_bytes=torch.cuda.max_memory_reserved())
    destroy = getattr(held, "destroy", None)  # a DeepSpeed engine's hooks and buffers
    if destroy is not None:
        destroy()
    del held, iteration, drain
    dist.barrier()
    return out


def bench_rank(rank: int, world_size: int, cfg: dict) -> dict:
    """Every round on this rank (process group up, ``cfg["device"]`` this rank's device)."""
    import torch

    device = torch.device(cfg["device"])
    template = e2e.template_model(cfg["model"], cfg["dtype"])
    batches = [b.to(device) for b in e2e.make_batches(cfg, rank, cfg["batch"])]
    names = [n for n in CONTENDERS if n not in cfg["skipped"]]
    rounds = {n: [] for n in names}
    for r in range(cfg["rounds"]):
        for name in random.Random(f"gpu-{r}").sample(names, len(names)):  # the same order on every rank
            rounds[name].append(measure(name, template, batches, device, cfg))
    return {"params": sum(p.numel() for p in template.parameters()),
            "tensors": sum(1 for _ in template.parameters()), "rounds": rounds}


def _median(xs):
    return statistics.median(xs) if xs else None


def analyse(ranks: list[dict], cfg: dict, env: dict) -> dict:
    """Per contender: the slowest rank's ms per round, its ratio to the baseline's in the same round,
    and per rank the largest peak over rounds."""
    per = {n: [max(turns) for turns in zip(*([t["ms"] for t in r["rounds"][n]] for r in ranks))]
           for n in ranks[0]["rounds"]}
    rows = {}
    for n, ms in per.items():
        ratios = [a / b for a, b in zip(ms, per[BASELINE])]
        row = {"iteration_ms": ms, "iteration_ms_median": _median(ms),
               "vs_baseline": {"median": _median(ratios), "min": min(ratios), "max": max(ratios), "ratios": ratios}}
        for key in ("peak_bytes", "above_start_bytes", "peak_reserved_bytes"):
            values = [[t.get(key) for t in r["rounds"][n]] for r in ranks]
            row[f"{key}_per_rank"] = None if any(v is None for vs in values for v in vs) else [max(vs) for vs in values]
        rows[n] = row
    base = rows[BASELINE]["above_start_bytes_per_rank"]
    for row in rows.values():
        mine = row["above_start_bytes_per_rank"]
        row["memory_vs_baseline"] = None if base is None else max(mine) / max(base)
    return {"env": env, "config": cfg, "model": {k: ranks[0][k] for k in ("params", "tensors")},
            "contenders": rows, "skipped": cfg["skipped"]}


def result_name(cfg: dict) -> str:
    """The JSON's file name (its stem is what benchmarks/render.py reads from benchmarks/results/)."""
    return f"gpu_{cfg['model_name']}_{cfg['dtype']}_n{cfg['world_size']}.json"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m benchmarks.gpu_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(SIZES), default="gpt2",
                        help="GPT-2 size (default gpt2: 124M); each process holds two host copies while building "
                             "one (gpt2-xl in float32 on 8 GPUs: about 100 GB of host memory)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="the weights' dtype")
    parser.add_argument("--batch", type=int, default=8, help="sequences per GPU (default 8)")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence (default 512)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="clipping (Trainer's default 1.0; 0: off)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations per turn (default 5)")
    parser.add_argument("--steps", type=int, default=20, help="timed iterations per turn (default 20)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running every contender (default 3)")
    parser.add_argument("--contenders", nargs="+", choices=list(CONTENDERS), default=list(CONTENDERS),
                        help=f"which to run ({BASELINE}, the baseline, always)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run on gloo")
    parser.add_argument("--out", default=None,
                        help="output folder (default benchmarks/results; a dry run: bench_out/gpu)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if min(args.warmup, args.steps - 1, args.rounds - 1, args.batch - 1) < 0:
        parser.error("--steps, --rounds and --batch must be at least 1, --warmup at least 0")

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # a run without torchrun: one process
    os.environ.setdefault("MASTER_PORT", "29511")
    timeout = timedelta(minutes=10)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("no CUDA device: run with --device cpu for a dry run")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    skipped = {n: "not asked for (--contenders)" for n in CONTENDERS if n not in {BASELINE, *args.contenders}}
    if "deepspeed_zero2" not in skipped:
        why = "CUDA only" if args.device != "cuda" else deepspeed_missing()
        if why:
            skipped["deepspeed_zero2"] = why
    cfg = {"model_name": args.model, "model": SIZES[args.model], "dtype": args.dtype, "batch": args.batch,
           "seq": args.seq, "max_grad_norm": args.max_grad_norm, "warmup": args.warmup, "steps": args.steps,
           "rounds": args.rounds, "world_size": world, "device": str(device), "dry_run": args.device != "cuda",
           "skipped": skipped}
    try:
        mine = bench_rank(rank, world, cfg)
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
        if rank == 0:
            cuda = args.device == "cuda"
            env = _common.environment(
                " ".join([f"torchrun --nproc-per-node {world} -m benchmarks.gpu_bench", *argv]),
                gpu=torch.cuda.get_device_name(device) if cuda else None, gpus=world if cuda else 0,
                cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                deepspeed=None if "deepspeed_zero2" in skipped else version("deepspeed"))
            res = analyse(ranks, cfg, env)
            out = Path(args.out or (_common.ROOT / "benchmarks" / "results" if cuda else "bench_out/gpu"))
            out.mkdir(parents=True, exist_ok=True)
            path = out / result_name(cfg)
            path.write_text(json.dumps(res, indent=2))
            for n, row in res["contenders"].items():
                mem = row["peak_bytes_per_rank"]
                print(f"{n:18s} {row['iteration_ms_median']:9.2f} ms  x{row['vs_baseline']['median']:.3f}  "
                      + ("" if mem is None else f"peak {max(mem) / 2**20:.0f} MiB (x{row['memory_vs_baseline']:.3f})"))
            for n, why in skipped.items():
                print(f"{n:18s} skipped: {why}")
            print(f"wrote {path}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
