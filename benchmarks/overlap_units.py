"""The overlapped sync per block against the whole-sync wait: benchmarks.e2e's DDP-loop rounds only.

``python -m benchmarks.overlap_units [ROUNDS]`` (default 6; writes bench_out/overlap_units.json)

Two gloo ranks train GPT-2 29.5M (benchmarks.e2e's FULL model, batches and bursts) with plain
DDP + AdamW, hf_zero's blocking reduce-scatter path, the overlapped sync waiting per GPT-2
block (``overlap_units=["GPT2Block"]``, e2e's ``hf_zero_rs_overlap``) and the overlapped
sync without units (the first forward waits for the whole sync). Prints each contender's
median iteration time and its ratio to the blocking contender within each round.
"""
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import e2e  # noqa: E402
from tests._dist import run_ranks  # noqa: E402

NAMES = ["ddp_adamw", "hf_zero_reduce_scatter", "hf_zero_rs_overlap", "overlap_whole"]


def rank_fn(rank, world_size, cfg):
    import torch
    torch.set_num_threads(1)
    e2e.CONTENDERS["overlap_whole"] = ("hf_zero", "reduce_scatter", True)
    real = e2e.build_contender

    def build(name, template, *, visible_all_reduce):
        if name != "overlap_whole":
            return real(name, template, visible_all_reduce=visible_all_reduce)
        import copy
        from torch.nn.parallel import DistributedDataParallel as DDP
        from hf_zero import ZeroBucketOptimizer
        model = copy.deepcopy(template); model.train()
        opt = ZeroBucketOptimizer(list(model.named_parameters()), torch.optim.AdamW, lr=e2e.LR,
                                  grad_reduce="reduce_scatter", overlap_param_sync=True)
        ddp = DDP(model, gradient_as_bucket_view=True)
        opt.bind_ddp(ddp)  # no units: the root waits for the whole sync
        return ddp, opt

    template = e2e.template_model(cfg["model"])
    data = {b: e2e.make_batches(cfg, rank, b) for b in cfg["batches"]}
    live = {n: build(n, template, visible_all_reduce=False) for n in NAMES}
    for n, (ddp, opt) in live.items():
        for i in range(cfg["warmup"]):
            e2e.run_iteration(ddp, opt, data[cfg["batches"][0]][i % 4])
        e2e.drain_sync(opt)
    out = {b: {n: [] for n in NAMES} for b in cfg["batches"]}
    for r in range(cfg["rounds"]):
        for b in cfg["batches"]:
            for n in random.Random(f"{r}-{b}").sample(NAMES, len(NAMES)):
                ddp, opt = live[n]
                out[b][n].append(e2e._burst(ddp, opt, data[b], cfg["burst"]))
    return out


if __name__ == "__main__":
    cfg = dict(e2e.FULL)
    cfg["rounds"] = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    t0 = time.monotonic(); load0 = os.getloadavg()[0]
    ranks = run_ranks(rank_fn, 2, cfg, timeout=3000)
    res = {"load_start": load0, "load_end": os.getloadavg()[0], "wall_s": time.monotonic() - t0, "rounds": cfg["rounds"], "raw": {}}
    for b in cfg["batches"]:
        slow = {n: [max(a, c) for a, c in zip(ranks[0][b][n], ranks[1][b][n])] for n in NAMES}
        res["raw"][b] = slow
        for n in NAMES:
            ratios = [x / y for x, y in zip(slow[n], slow["hf_zero_reduce_scatter"])]
            print(f"batch {b} {n}: median {statistics.median(slow[n])*1e3:.0f} ms/iter; "
                  f"ratio to blocking rs: median {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]")
    print(json.dumps({k: v for k, v in res.items() if k != "raw"}))
    out = ROOT / "bench_out"
    out.mkdir(exist_ok=True)
    (out / "overlap_units.json").write_text(json.dumps(res, indent=1))
