"""GPU correctness check: hf_zero's CUDA paths against the single-process optimizer.

Two ranks share one GPU over gloo with CUDA tensors (NCCL refuses two ranks on one
device), each training a DDP-wrapped model on its half of the global batch; the
reference is the same torch optimizer in one process on the whole batch. Cases
cover foreach and fused AdamW, flat and param shard modes, float64 (tight: 1e-12
relative), bf16 autocast and bf16 params, a freeze/unfreeze cycle, the
consolidated state dict, and the gradient path (grads reduce-scattered into their
owners by a DDP comm hook, clipping through the optimizer's sharded norm, the
parameter sync overlapped with the next forward). In bf16, rounding differs between two half batches and one
whole batch (and Adam turns that noise into full-size updates of near-zero grads),
so those cases are compared with plain DDP + the same torch optimizer on the same
two ranks, which computes the same per-rank gradients.

Errors are relative: params by how far training moved them (max |got - want| /
max |want - initial|), state by its magnitude (max |got - want| / max |want|).

Run (one GPU, well under a minute after start-up)::

    python -m benchmarks.gpu_check --out gpu_out        # -> gpu_out/gpu_check.json; exit 1 on a failure

``--device cpu`` is a dry run of the same checks.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hf_zero import ZeroBucketOptimizer  # noqa: E402

WORLD = 2
BATCH = 8  # per rank
STEPS = 6

# name -> (param dtype, autocast dtype or None, optimizer options, shard, freeze schedule, tolerance);
# tolerance None: compared with plain DDP on the same ranks (bf16), to 1e-6 of the distance moved.
# Options starting with "zero_" go to ZeroBucketOptimizer (the gradient path), the rest to AdamW;
# "clip" clips the grad norm (the optimizer's sharded norm; torch's in the reference).
RS = {"zero_grad_reduce": "reduce_scatter"}
CASES = {
    "f64_foreach_flat": (torch.float64, None, {"foreach": True}, "flat", False, 1e-12),
    "f64_fused_flat": (torch.float64, None, {"fused": True}, "flat", False, 1e-12),
    "f64_fused_param": (torch.float64, None, {"fused": True}, "param", False, 1e-12),
    "f64_fused_freeze_unfreeze": (torch.float64, None, {"fused": True}, "flat", True, 1e-12),
    "f32_bf16_autocast_fused": (torch.float32, torch.bfloat16, {"fused": True}, "flat", False, None),
    "bf16_params_foreach": (torch.bfloat16, None, {"foreach": True}, "flat", False, None),
    "f64_fused_reduce_scatter_flat_clip": (torch.float64, None, {"fused": True, "clip": 0.5, **RS}, "flat", False, 1e-12),
    "f64_fused_reduce_scatter_param_overlap": (
        torch.float64, None, {"fused": True, **RS, "zero_overlap_param_sync": True}, "param", False, 1e-12),
    "f64_fused_reduce_scatter_freeze_unfreeze": (torch.float64, None, {"fused": True, **RS}, "flat", True, 1e-12),
    "f32_bf16_autocast_reduce_scatter_overlap": (
        torch.float32, torch.bfloat16, {"fused": True, **RS, "zero_overlap_param_sync": True}, "flat", False, None),
}


class Net(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.embed = nn.Embedding(97, 64)
        self.body = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.head = nn.Linear(64, 97)
        self.to(dtype)

    def forward(self, ids, target):
        h = self.embed(ids).mean(1)
        return F.cross_entropy(self.head(h + self.body(h)).float(), target)


def batch(step, n, device):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 97, (n, 5), generator=g).to(device), torch.randint(0, 97, (n,), generator=g).to(device)


def freeze_at(model, step):
    """Freeze ``body`` for steps 2-3, unfreeze at step 4 (the same on every rank and the reference)."""
    if step in (2, 4):
        for p in model.body.parameters():
            p.requires_grad_(step == 4)


def train(case, device, rank=None, plain=False):
    dtype, autocast, opts, shard, freeze, _ = CASES[case]
    clip = opts.get("clip")
    zero_opts = {k.removeprefix("zero_"): v for k, v in opts.items() if k.startswith("zero_")}
    opts = {k: v for k, v in opts.items() if k != "clip" and not k.startswith("zero_")}
    torch.manual_seed(0)
    model = Net(dtype).to(device)
    initial = [p.detach().double().cpu().clone() for p in model.parameters()]
    lr = dict(lr=1e-2, weight_decay=0.01)
    net = model if rank is None else nn.parallel.DistributedDataParallel(model, find_unused_parameters=freeze)
    if rank is None or plain:
        opt = torch.optim.AdamW(model.parameters(), **lr, **opts)
    else:
        opt = ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW, shard=shard, **zero_opts, **lr, **opts)
        opt.bind_ddp(net)
    for step in range(STEPS):
        if freeze:
            freeze_at(model, step)
        ids, target = batch(step, BATCH * WORLD, device)
        if rank is not None:
            ids, target = ids[rank * BATCH:(rank + 1) * BATCH], target[rank * BATCH:(rank + 1) * BATCH]
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            loss = net(ids, target)
        loss.backward()
        if clip is not None:
            if isinstance(opt, ZeroBucketOptimizer):
                opt.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if rank is not None and not plain:
        opt.wait_param_sync()
        opt.consolidate_state_dict(to=0)
    state = opt.state_dict() if rank in (None, 0) else None
    params = [p.detach().double().cpu().clone() for p in model.parameters()]
    if state is not None:
        state = {i: {k: v.detach().double().cpu() if torch.is_tensor(v) else v for k, v in s.items()}
                 for i, s in state["state"].items()}
    return params, state, initial


def rel_err(got, want, scale=None):
    scale = want.abs().max() if scale is None else scale
    return ((got - want).abs().max() / scale.clamp_min(1e-30)).item()


def worker(rank, port, device_name, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    device = torch.device(device_name)
    results = {}
    for case in CASES:
        try:
            value = train(case, device, rank)
            plain = train(case, device, rank, plain=True) if CASES[case][-1] is None else None
            results[case] = {"ok": True, "value": value, "plain": plain}
        except Exception:
            results[case] = {"ok": False, "error": traceback.format_exc()}
        dist.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_out")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    device = torch.device(args.device)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"}
    print(env, flush=True)
    mp.spawn(worker, args=(free_port(), args.device, args.out), nprocs=WORLD, join=True)
    ranks = [torch.load(os.path.join(args.out, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    report, failed = {"env": env, "cases": {}}, 0
    for case, (*_, tol) in CASES.items():
        row = {}
        errors = [r[case]["error"] for r in ranks if not r[case]["ok"]]
        if errors:
            row = {"passed": False, "error": errors[0]}
        else:
            want_params, want_state, initial = ranks[0][case]["plain"] if tol is None else train(case, device)
            tol = 1e-6 if tol is None else tol
            got = [r[case]["value"] for r in ranks]
            replicas = all(torch.equal(a, b) for a, b in zip(got[0][0], got[1][0]))
            param_err = max(rel_err(g, w, (w - i).abs().max()) for g, w, i in zip(got[0][0], want_params, initial))
            state_err = max(
                (rel_err(got[0][1][i][k], v) for i, s in want_state.items() for k, v in s.items()
                 if torch.is_tensor(v) and v.dim() > 0),
                default=0.0,
            )
            same_keys = set(got[0][1]) == set(want_state)
            row = {"passed": replicas and same_keys and param_err <= tol and state_err <= tol,
                   "replicas_identical": replicas, "max_rel_param_err": param_err,
                   "max_rel_state_err": state_err, "state_keys_match": same_keys, "tolerance": tol}
        failed += not row["passed"]
        report["cases"][case] = row
        print(f"{case:28s} {'PASS' if row['passed'] else 'FAIL'} "
              + (row.get("error") or f"param {row['max_rel_param_err']:.2e} state {row['max_rel_state_err']:.2e} "
                 f"replicas {row['replicas_identical']}"), flush=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"{len(CASES) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
