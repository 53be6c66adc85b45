"""GPU check: hf_zero's CUDA paths against DDP + torch's AdamW, and no host sync in a steady step.

Part 1, numerics. Two ranks share one GPU over gloo with CUDA tensors (NCCL refuses two ranks on
one device), each training on its half of the global batch. The reference is torch's AdamW in one
process on the whole batch (float64 cases: 1e-12 relative), or, where rounding differs between two
half batches and one whole batch (fp32 and bf16 cases; Adam turns that noise into full-size updates
of near-zero grads), DDP + the same torch optimizer on the same two ranks, which computes the same
per-rank gradients (1e-6), stepping fp32 copies of bf16 params as hf_zero's masters do. Cases:
stage 1 (foreach and fused AdamW, flat and param shards, freeze/unfreeze, bf16 autocast and bf16
params, grads reduce-scattered into their owners by a DDP comm hook, clipping through the
optimizer's sharded norm, the parameter sync overlapped with the next forward) and stage 2 (fp32,
float64, bf16 params with fp32 masters, bf16 autocast, accumulation reducing every micro-batch or
under ``model.no_sync()``, clipping, freeze/unfreeze, the overlapped sync); then the consolidated
state dict. Errors are relative: params by how far training moved them (max |got - want| / max
|want - initial|), state by its magnitude (max |got - want| / max |want|).

Part 2, host syncs. Every case again, with its steps from ``STEADY`` on (after the first step,
DDP's bucket rebuild, the reduce-scatter's start and the last trainability change) run under
``torch.cuda.set_sync_debug_mode("error")``: a read of a CUDA tensor's value on the host
(``.item()``, ``bool(t)``, a blocking copy to the CPU, a stream or device synchronize) raises,
and the case fails, saying where. A control, DDP + fused AdamW, runs the same way and must pass.
With two or more GPUs, two NCCL ranks on ``cuda:0`` and ``cuda:1``; with one, one NCCL rank,
where hf_zero leaves out its cross-rank collectives (the layout agreement, the reduce-scatter):
only two GPUs check those. Part 1 cannot run in this mode: gloo's CUDA collectives synchronize
the host themselves.

Run (one or more GPUs, about a minute after start-up)::

    python -m benchmarks.gpu_check --out gpu_out        # -> gpu_out/gpu_check.json; exit 1 on a failure

``--device cpu`` is a dry run of both parts on gloo (part 2 without the sync-debug mode, which
needs CUDA); ``--cases`` picks cases by name or pattern.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import inspect
import json
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
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

from benchmarks import _common  # noqa: E402
from hf_zero import ZeroBucketOptimizer  # noqa: E402

WORLD = 2
BATCH = 8  # per rank
STEPS = 6  # part 1
# part 2: steps STEADY .. SYNC_STEPS - 1 under the sync-debug mode, after DDP has timed its first 10
# iterations with CUDA events (its runtime logging)
SYNC_STEPS, STEADY = 13, 11
RELATIVE_TO_DDP = 1e-6  # a case's tolerance against DDP on the same ranks
TIMEOUT_S = 600
SYNC_ERROR = "synchronizing CUDA operation"  # what torch raises in the sync-debug mode


@dataclass
class Case:
    dtype: torch.dtype = torch.float64
    kernel: str = "fused"  # AdamW(fused=True) or AdamW(foreach=True), hf_zero's inner optimizer alike
    zero: dict = field(default_factory=dict)  # ZeroBucketOptimizer options (stage, shard, grad_reduce, ...)
    autocast: torch.dtype | None = None
    freeze: bool = False  # see freeze_at
    clip: float | None = None  # max grad norm: the optimizer's clip_grad_norm_, torch's in the references
    accumulate: int = 1  # micro-batches per step
    no_sync: bool = False  # all but the last micro-batch under no_sync()
    tol: float | None = 1e-12  # None: against DDP on the same ranks, RELATIVE_TO_DDP

    @property
    def stage(self) -> int:
        return self.zero.get("stage", 1)


F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
RS = {"grad_reduce": "reduce_scatter"}
OVERLAP = {"overlap_param_sync": True}
S2 = {"stage": 2}
CASES = {
    "f64_foreach_flat": Case(kernel="foreach", zero={"shard": "flat"}),
    "f64_fused_flat": Case(zero={"shard": "flat"}),
    "f64_fused_param": Case(zero={"shard": "param"}),
    "f64_fused_freeze_unfreeze": Case(freeze=True),
    "f32_bf16_autocast_fused": Case(F32, autocast=BF16, tol=None),
    "bf16_params_foreach": Case(BF16, kernel="foreach", tol=None),
    "f64_fused_reduce_scatter_flat_clip": Case(zero={**RS, "shard": "flat"}, clip=0.5),
    "f64_fused_reduce_scatter_param_overlap": Case(zero={**RS, **OVERLAP, "shard": "param"}),
    "f64_fused_reduce_scatter_freeze_unfreeze": Case(zero=RS, freeze=True),
    "f32_bf16_autocast_reduce_scatter_overlap": Case(F32, zero={**RS, **OVERLAP}, autocast=BF16, tol=None),
    "stage2_f64_fused": Case(zero=S2),
    "stage2_f64_accumulate_clip": Case(zero=S2, accumulate=2, clip=0.5),
    "stage2_f64_no_sync_clip": Case(zero=S2, accumulate=2, no_sync=True, clip=0.5),
    "stage2_f64_param_overlap": Case(zero={**S2, **OVERLAP, "shard": "param"}),
    "stage2_f64_freeze_unfreeze": Case(zero=S2, freeze=True),
    "stage2_f32_fused": Case(F32, zero=S2, tol=None),
    "stage2_f32_no_sync": Case(F32, zero=S2, accumulate=2, no_sync=True, tol=None),
    "stage2_bf16_masters": Case(BF16, zero=S2, tol=None),
    "stage2_bf16_masters_foreach_overlap": Case(BF16, kernel="foreach", zero={**S2, **OVERLAP}, tol=None),
    "stage2_f32_bf16_autocast_overlap": Case(F32, zero={**S2, **OVERLAP}, autocast=BF16, tol=None),
}
CONTROL = "control: DDP + AdamW(fused)"  # part 2 only: torch alone, which must make no host sync
CONTROL_CASE = Case(F32, tol=None)


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


def micro_batches(step, rank, case: Case, device) -> list:
    """The step's batch: whole in one process (rank None), else this rank's half in ``case.accumulate`` parts."""
    ids, target = batch(step, BATCH * WORLD, device)
    if rank is None:
        return [(ids, target)]
    ids, target = ids[rank * BATCH:(rank + 1) * BATCH], target[rank * BATCH:(rank + 1) * BATCH]
    return list(zip(ids.chunk(case.accumulate), target.chunk(case.accumulate)))


def freeze_at(model, step):
    """Freeze ``body`` for steps 2-3, unfreeze at step 4 (the same on every rank and the reference)."""
    if step in (2, 4):
        for p in model.body.parameters():
            p.requires_grad_(step == 4)


class MasterAdamW:
    """The reference for 16-bit params with fp32 masters: torch's AdamW steps an fp32 copy of each
    param on its grad cast to fp32, and the param takes the copy rounded (``Tensor.copy_``)."""

    def __init__(self, params, **hyper):
        self.params = list(params)
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.inner = torch.optim.AdamW(self.masters, **hyper)

    @torch.no_grad()
    def step(self):
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def state_dict(self):
        state = self.inner.state_dict()
        for i, s in state["state"].items():
            s["master_param"] = self.masters[i].detach()
        return state


@contextlib.contextmanager
def sync_debug(on: bool):
    """``torch.cuda.set_sync_debug_mode("error")`` inside, when ``on`` (CUDA only)."""
    if not on:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def train(case: Case, device, rank=None, *, reference=False, steps=STEPS, watch_from=None):
    """Train ``case``: in one process on the whole batch (``rank`` None: torch), DDP + torch's AdamW on
    this rank's half (``reference``), or hf_zero. ``watch_from``: the steps from it on run under the
    sync-debug mode (CUDA) and nothing is returned. Returns (params, state on rank 0, initial params)."""
    torch.manual_seed(0)
    model = Net(case.dtype).to(device)
    initial = [p.detach().double().cpu().clone() for p in model.parameters()]
    hyper = {"lr": 1e-2, "weight_decay": 0.01, case.kernel: True}
    data = [micro_batches(step, rank, case, device) for step in range(steps)]  # before any step is watched
    hf = rank is not None and not reference
    if not hf:
        net = model if rank is None else nn.parallel.DistributedDataParallel(model, find_unused_parameters=case.freeze)
        opt = MasterAdamW(model.parameters(), **hyper) if case.dtype.itemsize < 4 else \
            torch.optim.AdamW(model.parameters(), **hyper)
    elif case.stage == 2:  # no DDP: the model is what the loop calls
        net = model
        opt = ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW, **case.zero, **hyper)
        opt.bind_module(model)
    else:
        net = nn.parallel.DistributedDataParallel(model, find_unused_parameters=case.freeze,
                                                  gradient_as_bucket_view=True)
        opt = ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW, **case.zero, **hyper)
        opt.bind_ddp(net)
    for step in range(steps):
        if case.freeze:
            freeze_at(model, step)
        with sync_debug(watch_from is not None and step >= watch_from and device.type == "cuda"):
            micro = data[step]
            for m, (ids, target) in enumerate(micro):
                with net.no_sync() if case.no_sync and m + 1 < len(micro) else contextlib.nullcontext():
                    with torch.autocast(device.type, dtype=case.autocast or BF16, enabled=case.autocast is not None):
                        loss = net(ids, target) / len(micro)
                    loss.backward()
            if case.clip is not None:
                if hf:
                    opt.clip_grad_norm_(case.clip)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
    if hf:
        opt.wait_param_sync()
    if watch_from is not None:
        return None
    if hf:
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


# -- processes ---------------------------------------------------------------------------------------
def worker(rank, nprocs, port, backend, device_name, out_dir, parts):
    """One rank running ``parts`` ({"numerics" or "syncs": case names}) over ``backend``; results go to a file."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = timedelta(seconds=120)
    device = torch.device(device_name)
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=nprocs, timeout=timeout, device_id=device)
    else:
        dist.init_process_group(backend, rank=rank, world_size=nprocs, timeout=timeout)
    results = {part: {} for part in parts}
    for part, names in parts.items():
        for name in names:
            try:
                if part == "numerics":
                    case = CASES[name]
                    value = train(case, device, rank)
                    ref = train(case, device, rank, reference=True) if case.tol is None else None
                    results[part][name] = {"ok": True, "value": value, "reference": ref}
                else:
                    case = CONTROL_CASE if name == CONTROL else CASES[name]
                    train(case, device, rank, reference=name == CONTROL, steps=SYNC_STEPS, watch_from=STEADY)
                    results[part][name] = {"ok": True}
            except Exception as error:
                results[part][name] = {"ok": False, "host_sync": SYNC_ERROR in str(error),
                                       "error": traceback.format_exc()}
            if nprocs > 1:
                dist.barrier()
    torch.save(results, os.path.join(out_dir, f"{backend}_rank{rank}.pt"))
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(backend, device_name, out_dir, parts, nprocs=WORLD, timeout=TIMEOUT_S) -> list[dict]:
    """Run ``parts`` (see :func:`worker`) on ``nprocs`` fresh processes; their results by rank."""
    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=worker, args=(r, nprocs, port, backend, device_name, out_dir, parts))
             for r in range(nprocs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    failed = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
    if hung or failed:
        raise RuntimeError(f"{backend}: ranks {hung} still running after {timeout} s, exit codes {failed}")
    return [torch.load(os.path.join(out_dir, f"{backend}_rank{r}.pt"), weights_only=False) for r in range(nprocs)]


# -- verdicts ----------------------------------------------------------------------------------------
def compare(name, ranks, device) -> dict:
    """Part 1's verdict on case ``name`` from every rank's results."""
    errors = [r[name]["error"] for r in ranks if not r[name]["ok"]]
    if errors:
        return {"passed": False, "error": errors[0]}
    case = CASES[name]
    want_params, want_state, initial = ranks[0][name]["reference"] if case.tol is None else train(case, device)
    tol = RELATIVE_TO_DDP if case.tol is None else case.tol
    got = [r[name]["value"] for r in ranks]
    replicas = all(torch.equal(a, b) for a, b in zip(got[0][0], got[1][0]))
    param_err = max(rel_err(g, w, (w - i).abs().max()) for g, w, i in zip(got[0][0], want_params, initial))
    state_err = max((rel_err(got[0][1][i][k], v) for i, s in want_state.items() for k, v in s.items()
                     if torch.is_tensor(v) and v.dim() > 0), default=0.0)
    same_keys = set(got[0][1]) == set(want_state)
    return {"passed": replicas and same_keys and param_err <= tol and state_err <= tol,
            "reference": "torch, one process" if case.tol is not None else "DDP, same ranks",
            "replicas_identical": replicas, "max_rel_param_err": param_err, "max_rel_state_err": state_err,
            "state_keys_match": same_keys, "tolerance": tol}


def sync_verdict(name, ranks, watched: bool) -> dict:
    """Part 2's verdict on ``name``: whether its steady steps ran, under the sync-debug mode if ``watched``."""
    bad = [r[name] for r in ranks if not r[name]["ok"]]
    if not bad:
        return {"passed": True, "sync_debug": watched}
    return {"passed": False, "sync_debug": watched, "host_sync": bad[0]["host_sync"], "error": bad[0]["error"]}


def _where(tb: str) -> str:
    """The innermost frame of hf_zero's (else the last frame) of a traceback, and its last line."""
    lines = tb.strip().splitlines()
    frames = [line.strip() for line in lines if line.strip().startswith("File ")]
    package = f'File "{Path(inspect.getfile(ZeroBucketOptimizer)).parent}{os.sep}'
    ours = [f for f in frames if f.startswith(package)]
    return f"at {(ours or frames or ['?'])[-1]}: {lines[-1] if lines else ''}"


def sync_group(device: torch.device) -> tuple[str, int]:
    """Part 2's backend and world size: NCCL on ``WORLD`` GPUs, or on the one there is; gloo on the CPU."""
    if device.type != "cuda":
        return "gloo", WORLD
    return "nccl", min(WORLD, torch.cuda.device_count())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_out")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run)")
    parser.add_argument("--cases", nargs="+", default=["*"], metavar="PATTERN",
                        help=f"cases by name or fnmatch pattern (default: all): {', '.join(CASES)}")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    names = [n for n in CASES if any(fnmatch.fnmatchcase(n, p) for p in args.cases)]
    if not names:
        parser.error(f"no case matches {args.cases}")
    os.makedirs(args.out, exist_ok=True)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    group, world = sync_group(device)
    env = _common.environment(" ".join(["python -m benchmarks.gpu_check", *argv]),
                              device=torch.cuda.get_device_name(0) if cuda else "cpu",
                              gpus=torch.cuda.device_count() if cuda else 0, cuda=torch.version.cuda)
    print({k: env[k] for k in ("device", "gpus", "torch", "git")}, flush=True)
    parts = {"numerics": names, "syncs": [CONTROL, *names]}
    if group == "gloo":  # both parts in the same processes
        numerics = syncs = launch("gloo", args.device, args.out, parts)
    else:
        numerics = launch("gloo", args.device, args.out, {"numerics": names})
        try:
            syncs = launch(group, args.device, args.out, {"syncs": parts["syncs"]}, nprocs=world)
        except RuntimeError as error:  # a rank hung or died (e.g. ranks failing apart): part 1 still reports
            lost = {"ok": False, "host_sync": False, "error": f"part 2 did not finish: {error}"}
            syncs = [{"syncs": {n: lost for n in parts["syncs"]}}]
    numerics, syncs = [r["numerics"] for r in numerics], [r["syncs"] for r in syncs]
    report = {"env": env, "part2": {"backend": group, "world_size": world}, "sync_debug": cuda,
              "control": sync_verdict(CONTROL, syncs, cuda), "cases": {}}
    failed = 0
    for name in names:
        row = compare(name, numerics, device)
        row["host_syncs"] = sync_verdict(name, syncs, cuda)
        row["passed"] = row["passed"] and row["host_syncs"]["passed"]
        failed += not row["passed"]
        report["cases"][name] = row
        where = _where(row["host_syncs"].get("error", ""))
        print(f"{name:42s} {'PASS' if row['passed'] else 'FAIL'} "
              + (row.get("error") or f"param {row['max_rel_param_err']:.2e} state {row['max_rel_state_err']:.2e} "
                 f"replicas {row['replicas_identical']}")
              + ("" if row["host_syncs"]["passed"] else
                 f"; steady steps: {'host sync' if row['host_syncs']['host_sync'] else 'error'} {where}"),
              flush=True)
    control = report["control"]
    if not control["passed"]:
        print("the control (DDP + fused AdamW) failed in its steady steps, so part 2 says nothing: "
              + _where(control["error"]))
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"{len(names) - failed} passed, {failed} failed; steady steps {'under' if cuda else 'without'} "
          f"the sync-debug mode on {group} x{world}" + ("" if control["passed"] else "; the control failed"))
    return 1 if failed or not control["passed"] else 0


if __name__ == "__main__":
    sys.exit(main())
