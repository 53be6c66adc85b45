"""What every rank runs: optimizer steps, rebuilds, consolidation and the efficiency limits.

Gradients are fixed random tensors, the same on every rank (as after DDP's
all-reduce), so the optimizer step alone is measured. Every optimizer gets fresh
params with the same initial values.
"""

from __future__ import annotations

import gc
import random
import time

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from hf_zero import ZeroBucketOptimizer

from ._common import CollectiveCounter
from .measure import barrier, peak_rss_mib, reset_peak_rss, rss_mib, state_bytes, time_calls

LR = 1e-4


# Each: (family, shard, parameters_as_bucket_view). family "plain" = the
# unsharded optimizer plain DDP runs.
OPTIMIZERS = {
    "unsharded": ("plain", None, None),
    "hf_zero_flat_bv": ("hf_zero", "flat", True),
    "hf_zero_flat_nobv": ("hf_zero", "flat", False),
    "hf_zero_param_bv": ("hf_zero", "param", True),
    "hf_zero_param_nobv": ("hf_zero", "param", False),
    "torch_zero_bv": ("torch_zero", None, True),
    "torch_zero_nobv": ("torch_zero", None, False),
}
CONSOLIDATE = ("hf_zero_flat_bv", "hf_zero_param_bv", "torch_zero_bv")


def model_tensors(spec: dict) -> list[tuple[str, torch.Tensor]]:
    """The named params (tied weights once) of a GPT-2 built from ``spec``, seeded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    last = spec["vocab_size"] - 1
    model = GPT2LMHeadModel(GPT2Config(**{"bos_token_id": last, "eos_token_id": last, **spec}))
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def make_optimizer(kind: str, named: list[tuple[str, torch.nn.Parameter]]):
    family, shard, bv = OPTIMIZERS[kind]
    params = [p for _, p in named]
    if family == "plain":
        return torch.optim.AdamW(params, lr=LR)
    if family == "hf_zero":
        return ZeroBucketOptimizer(named, torch.optim.AdamW, shard=shard, parameters_as_bucket_view=bv, lr=LR)
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, parameters_as_bucket_view=bv, lr=LR)


def _fresh(init):
    return [(n, torch.nn.Parameter(t.clone())) for n, t in init]


def _set_grads(named, grads):
    def set_grads():
        for (_, p), g in zip(named, grads):
            p.grad = g if p.requires_grad else None

    return set_grads


def bench_rank(rank: int, world_size: int, cfg: dict) -> dict:
    """Run every section on this rank; returns raw per-rank measurements."""
    counter = CollectiveCounter()
    out = {"rank": rank, "models": {}}
    try:
        for model_name, spec in cfg["models"].items():
            out["models"][model_name] = _bench_model(spec, cfg, counter, rank, world_size)
            gc.collect()
        out["sync_limits"] = _sync_limits(cfg)
    finally:
        counter.uninstall()
    return out


def _bench_model(spec, cfg, counter, rank, world_size) -> dict:
    """Build every optimizer, then time their steps interleaved (same load for all)."""
    init = model_tensors(spec)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(t.shape, generator=g) * 1e-3 for _, t in init]
    kinds = list(cfg["optimizers"])
    res = {
        "params": sum(t.numel() for _, t in init),
        "tensors": len(init),
        "largest_tensor": max(t.numel() for _, t in init),
        "optimizers": {k: {"step_s": []} for k in kinds},
    }
    live = {}
    # Built one at a time so each one's memory (fresh params, state, buffers and
    # the transients of its warm-up steps) is its own peak over the start.
    for kind in kinds:
        gc.collect()
        base = rss_mib()
        reset_peak_rss()
        named = _fresh(init)
        opt = make_optimizer(kind, named)
        set_grads = _set_grads(named, grads)
        for _ in range(cfg["warmup"]):
            set_grads()
            opt.step()
        r = res["optimizers"][kind]
        r["peak_rss_mib"] = peak_rss_mib()
        r["peak_rss_over_start_mib"] = peak_rss_mib() - base
        r["state_bytes"] = state_bytes(opt)
        live[kind] = (opt, named, set_grads)
    # Interleaved: each round steps every optimizer once, in a shuffled order (seeded by
    # the round, so every rank agrees) so no optimizer always follows the same other one.
    for i in range(cfg["steps"]):
        for kind in random.Random(i).sample(kinds, len(kinds)):
            opt, _, set_grads = live[kind]
            set_grads()
            barrier()
            with counter.recording():
                t0 = time.perf_counter()
                opt.step()
                dt = time.perf_counter() - t0
            r = res["optimizers"][kind]
            r["step_s"].append(dt)
            c = counter.summary()
            r.setdefault("collectives_per_step", c["collectives"])
            r.setdefault("by_kind_per_step", c["by_kind"])
            r.setdefault("bytes_per_step", c["payload_bytes"])
    for kind in kinds:
        opt, named, set_grads = live[kind]
        if kind.startswith("hf_zero"):
            res["optimizers"][kind]["limits"] = _local_limits(opt, set_grads, cfg)
    res["flat_full_s"] = _flat_full(res["params"], cfg)
    if world_size > 1:
        consolidated = [k for k in CONSOLIDATE if k in live]
        for _ in range(cfg["consolidate_reps"]):
            for kind in consolidated:
                res["optimizers"][kind].setdefault("consolidate", []).append(_consolidate(live[kind][0], rank))
    for kind in kinds:
        opt, named, set_grads = live[kind]
        if kind.startswith("hf_zero") and kind.endswith("_bv"):
            res["optimizers"][kind]["rebuild"] = _rebuild(opt, named, set_grads, spec, cfg)
    live.clear()
    return res


def _local_limits(opt, set_grads, cfg) -> dict:
    """hf_zero's local update and sync, each alone, vs the same work done the simplest way.

    Local update: the same AdamW on one flat tensor of this rank's element count.
    Sync: each rank's range of each buffer sent to every other rank (gloo's fastest raw
    transfer, docs/gradient_path.md), on hf_zero's own buffers and on fresh ones of the same
    size. All are timed in turn, in a shuffled order, round after round.
    """
    n = sum(lp.piece.numel for lp in opt._pieces)
    flat = torch.nn.Parameter(torch.zeros(n))
    flat.grad = torch.randn(n) * 1e-3
    ref = torch.optim.AdamW([flat], lr=LR)
    fresh = [torch.empty_like(b) for b in opt._buffers]
    bounds = [plan.bounds for plan in opt._layout.buffers]

    def raw_sync():  # the same collectives on hf_zero's own buffers: what its code adds
        for buf, bs in zip(opt._buffers, bounds):
            _raw_send_recv(buf, bs)

    def raw_sync_fresh():  # on freshly allocated buffers of the same sizes
        for buf, bs in zip(fresh, bounds):
            _raw_send_recv(buf, bs)

    def local():
        set_grads()
        opt._local_step({})

    calls = {"local_s": local, "flat_local_s": ref.step, "sync_s": opt._sync, "raw_sync_s": raw_sync,
             "raw_sync_fresh_s": raw_sync_fresh,
             # the per-step checks: requires_grad mask, view integrity and the 24-byte agreement all-reduce
             "checks_s": opt.ensure_partition}
    out = {k: [] for k in calls}
    names = list(calls)
    for i in range(cfg["steps"] + 1):
        for k in random.Random(i).sample(names, len(names)):  # shuffled, as for steps
            fn = calls[k]
            barrier()
            t0 = time.perf_counter()
            fn()
            if i:  # the first round warms up
                out[k].append(time.perf_counter() - t0)
    out["owned_elements"] = n
    out["buffer_bytes"] = sum(b.numel() * b.element_size() for b in opt._buffers)
    return out


def _flat_full(n: int, cfg) -> list[float]:
    """AdamW over one flat tensor of the whole model's element count (an unsharded baseline
    that suffers the CPU temporaries effect; see docs/benchmarks.md)."""
    gc.collect()
    flat = torch.nn.Parameter(torch.zeros(n))
    flat.grad = torch.randn(n) * 1e-3
    ref = torch.optim.AdamW([flat], lr=LR)
    return time_calls(ref.step, warmup=1, steps=cfg["steps"])


def _raw_broadcasts(buf, bounds) -> None:
    """One broadcast per rank of its range (docs/architecture.md, field facts)."""
    works = [dist.broadcast(buf[a:b], src=r, async_op=True) for r, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a]
    for w in works:
        w.wait()


def _raw_send_recv(buf, bounds) -> None:
    """Each rank's range sent to every other rank, point to point, in place: what hf_zero's
    sync does on gloo, the fastest raw transfer measured there (docs/gradient_path.md)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    works = [dist.irecv(buf[a:b], src=r) for r, (a, b) in enumerate(zip(bounds, bounds[1:])) if r != rank and b > a]
    lo, hi = bounds[rank], bounds[rank + 1]
    if hi > lo:
        works += [dist.isend(buf[lo:hi], dst=r) for r in range(world) if r != rank]
    for w in works:
        w.wait()


def _rebuild(opt, named, set_grads, spec, cfg) -> dict:
    """refresh_trainable() after freezing the first half of the blocks, then after unfreezing them."""
    half = spec["n_layer"] // 2
    frozen = [p for n, p in named if any(n.startswith(f"transformer.h.{i}.") for i in range(half))]
    seconds = {False: [], True: []}  # by the trainability set: freezing, then unfreezing
    for _ in range(cfg["rebuild_reps"]):
        for trainable in (False, True):
            for p in frozen:
                p.requires_grad_(trainable)
            barrier()
            t0 = time.perf_counter()
            opt.refresh_trainable()
            seconds[trainable].append(time.perf_counter() - t0)
            set_grads()
            opt.step()
    return {"freeze_s": seconds[False], "unfreeze_s": seconds[True]}


def _consolidate(opt, rank) -> dict:
    """consolidate_state_dict(to=0) on all ranks plus state_dict() on rank 0: seconds, peak MiB over start."""
    gc.collect()
    base = rss_mib()
    reset_peak_rss()
    barrier()
    t0 = time.perf_counter()
    opt.consolidate_state_dict(to=0)
    sd = opt.state_dict() if rank == 0 else None
    seconds = time.perf_counter() - t0
    peak = peak_rss_mib() - base
    del sd
    if hasattr(opt, "_all_state_dicts"):  # torch keeps the gathered copy until the next consolidation
        opt._all_state_dicts = []
    return {"s": seconds, "peak_over_start_mib": peak}


def _sync_limits(cfg) -> dict:
    """Raw collectives on one buffer of the step benchmark's size, for reference (docs/architecture.md, field facts)."""
    n = cfg["raw_buffer_elements"]
    ws = dist.get_world_size()
    buf = torch.zeros(n - n % ws)
    chunk = buf.numel() // ws
    bounds = [r * chunk for r in range(ws + 1)]
    steps = cfg["steps"]
    part = buf[dist.get_rank() * chunk : (dist.get_rank() + 1) * chunk].clone()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    return {
        "elements": buf.numel(),
        "broadcast_per_rank_s": time_calls(lambda: _raw_broadcasts(buf, bounds), warmup=1, steps=steps),
        "send_recv_s": time_calls(lambda: _raw_send_recv(buf, bounds), warmup=1, steps=steps),
        "all_gather_s": time_calls(lambda: gather(buf, part), warmup=1, steps=steps),
        "all_reduce_s": time_calls(lambda: dist.all_reduce(buf), warmup=1, steps=steps),
    }

