"""Load run: many steps, a trainability change every few steps, sharded checkpoints.

Each rank trains its half of the global batch through DDP with ZeroBucketOptimizer;
rank 0 also steps a plain torch AdamW on the whole global batch, in lockstep, and
the two must stay equal. Resident memory is read at every checkpoint, so growth
across rebuilds shows. Full run (about a minute here):

    torchrun --nproc-per-node 2 tests/scripts/soak.py --steps 500 --change-every 50 --ckpt-every 100

CI runs a shortened form through tests/test_soak.py.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hf_zero

_LAYERS = 6
_WIDTH = 64


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(_LAYERS):
        layers += [torch.nn.Linear(_WIDTH, _WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(_WIDTH, 4)).double()


def _set_trainable(model: torch.nn.Sequential, phase: int) -> None:
    """Phase k freezes a different contiguous block of layers (none in phase 0)."""
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    frozen = set() if phase % 4 == 0 else set(range(phase % len(linears), phase % len(linears) + 1 + phase % 3))
    for k, m in enumerate(linears):
        for p in m.parameters():
            p.requires_grad_(k not in frozen)


def _batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    n = 4 * world_size
    return torch.randn(n, _WIDTH, generator=g, dtype=torch.float64), torch.randn(n, 4, generator=g, dtype=torch.float64)


def run(rank: int, world_size: int, *, steps: int, change_every: int, ckpt_every: int, out: str) -> dict:
    """Train ``steps`` steps; return max deviation from the reference and RSS per checkpoint."""
    model = _model()
    opt = hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
    ddp = DDP(model, find_unused_parameters=True)
    reference = _model() if rank == 0 else None
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01) if rank == 0 else None
    rss, deviation = {}, 0.0
    for step in range(steps):
        phase = step // change_every
        _set_trainable(model, phase)
        x, y = _batch(step, world_size)
        mine = slice(4 * rank, 4 * (rank + 1))
        torch.nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
        if reference is not None:
            _set_trainable(reference, phase)
            torch.nn.functional.mse_loss(reference(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        if (step + 1) % ckpt_every == 0:
            opt.save_sharded(os.path.join(out, "ckpt"))
            rss[step + 1] = round(_rss_mib(), 1)
            if reference is not None:
                deviation = max(
                    deviation,
                    max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters())),
                )
    return {"rank": rank, "deviation": deviation, "rss_mib": rss, "rebuilds": opt.rebuilds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--change-every", type=int, default=50)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "hf_zero_soak"),
                    help="checkpoint directory shared by the ranks")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = run(dist.get_rank(), dist.get_world_size(), steps=args.steps,
                 change_every=args.change_every, ckpt_every=args.ckpt_every, out=args.out)
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
