"""Multi-GPU end to end over NCCL: exactness and iteration time of hf_zero's gradient paths.

For a machine with several GPUs (not run yet: the GPU lent so far had one). One
process per GPU, launched by torchrun::

    torchrun --nproc-per-node 8 -m benchmarks.gpu_nccl_e2e --out gpu_out        # one node
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $MASTER:29500 \\
        -m benchmarks.gpu_nccl_e2e --out gpu_out                                 # two nodes

A GPT-2 (``--layers``, ``--width``; 124M-like by default) trains ``--steps`` steps of
forward + backward + step under DDP, bf16 autocast, in four ways from the same weights
and data: plain DDP + torch AdamW (fused), and ZeroBucketOptimizer with DDP's all-reduce,
with the reduce-scatter gradient path, and with it plus the overlapped parameter sync.
Each hf_zero run must end within ``--tol`` (relative, of the distance moved) of plain
DDP's parameters; rank 0 writes ``nccl_e2e.json`` with the errors and, per contender, the
median iteration time over paired interleaved rounds and its ratio to plain DDP.
``--backend gloo --device cpu`` is a CPU dry run (``torchrun --nproc-per-node 2``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hf_zero import ZeroBucketOptimizer  # noqa: E402

CONTENDERS = {
    "ddp_adamw": None,
    "hf_zero_all_reduce": {"grad_reduce": "all_reduce"},
    "hf_zero_reduce_scatter": {"grad_reduce": "reduce_scatter"},
    "hf_zero_reduce_scatter_overlap": {"grad_reduce": "reduce_scatter", "overlap_param_sync": True},
}


def build(kind, args, device):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=args.width, n_layer=args.layers, n_head=args.width // 64, vocab_size=args.vocab,
                        n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).to(device)
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    fused = {"fused": True} if device.type == "cuda" else {}
    if CONTENDERS[kind] is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
    else:
        opt = ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, **fused, **CONTENDERS[kind])
        opt.bind_ddp(ddp)
    return model, ddp, opt


def step(ddp, opt, batch, device):
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = ddp(input_ids=batch, labels=batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def batch_for(step_index, args, device):
    g = torch.Generator().manual_seed(1000 + step_index * 97 + dist.get_rank())
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_nccl_e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_out")
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="steps of the exactness check")
    parser.add_argument("--rounds", type=int, default=10, help="paired timing rounds")
    parser.add_argument("--tol", type=float, default=2e-2)
    args = parser.parse_args(argv)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    # Exactness: every contender from the same weights on the same data.
    finals, initial = {}, None
    for kind in CONTENDERS:
        model, ddp, opt = build(kind, args, device)
        if initial is None:
            initial = [p.detach().float().cpu().clone() for p in model.parameters()]
        for s in range(args.steps):
            step(ddp, opt, batch_for(s, args, device), device)
        if isinstance(opt, ZeroBucketOptimizer):
            opt.wait_param_sync()
        finals[kind] = [p.detach().float().cpu().clone() for p in model.parameters()]
        del model, ddp, opt
    want = finals["ddp_adamw"]
    errors = {}
    for kind, got in finals.items():
        moved = max((w - i).abs().max().item() for w, i in zip(want, initial))
        errors[kind] = max((g - w).abs().max().item() for g, w in zip(got, want)) / max(moved, 1e-30)

    # Timing: all contenders built once, then paired rounds in a rotating order.
    built = {kind: build(kind, args, device) for kind in CONTENDERS}
    times: dict[str, list[float]] = {kind: [] for kind in CONTENDERS}
    order = list(CONTENDERS)
    for r in range(args.rounds + 2):
        order = order[1:] + order[:1]
        for kind in order:
            model, ddp, opt = built[kind]
            batch = batch_for(r, args, device)
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            step(ddp, opt, batch, device)
            sync()
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank
            if r >= 2:  # warm-up rounds: DDP rebuilds its buckets, hf_zero plans its layout
                times[kind].append(elapsed.item())
    base = statistics.median(times["ddp_adamw"])
    report = {
        "world_size": world, "backend": args.backend, "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": {"layers": args.layers, "width": args.width, "vocab": args.vocab, "seq": args.seq, "batch": args.batch},
        "max_rel_param_err_vs_ddp": errors, "tolerance": args.tol,
        "median_iteration_s": {k: statistics.median(v) for k, v in times.items()},
        "ratio_to_ddp": {k: statistics.median(v) / base for k, v in times.items()},
    }
    passed = all(e <= args.tol for e in errors.values())
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "nccl_e2e.json"), "w") as f:
            json.dump(report, f, indent=1)
        for kind in CONTENDERS:
            print(f"{kind:32s} err {errors[kind]:.2e}  iteration x{report['ratio_to_ddp'][kind]:.3f} of DDP")
        print("PASS" if passed else "FAIL")
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
