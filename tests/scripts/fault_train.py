"""A small training run that checkpoints, for fault tests under torchrun.

Trains a float64 MLP with a freeze/unfreeze schedule, saving model + consolidated
optimizer state every ``--ckpt-every`` steps (atomically) and resuming from the
last checkpoint when one exists. ``--kill-rank R --kill-at S`` makes rank R SIGKILL
itself after step S on the first attempt only (TORCHELASTIC_RESTART_COUNT == 0).
"""

import argparse
import faulthandler
import os
import signal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hf_zero


def schedule(model, step):
    """Freeze the first layer for steps 3-5 and the last one from step 8 on."""
    model[0].weight.requires_grad_(not 3 <= step < 6)
    model[0].bias.requires_grad_(not 3 <= step < 6)
    model[2].weight.requires_grad_(step < 8)


def init_process_group():
    """Join the group with a key space of this restart attempt's own.

    torchrun's restarted workers share the agent's TCPStore with the dead attempt;
    on torch 2.13 gloo then sometimes reads the dead workers' addresses and fails
    with "connectFullMesh ... Connection refused" (seen with static and c10d
    rendezvous). A per-attempt PrefixStore avoids the stale keys.
    """
    env = os.environ
    world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=not agent_store and rank == 0)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt_{attempt}", store), rank=rank, world_size=world)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ckpt-every", type=int, default=4)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-at", type=int, default=-1)
    args = ap.parse_args()
    faulthandler.dump_traceback_later(100, exit=True)  # a hang becomes a traceback, not a stuck test
    torch.set_num_threads(1)
    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
    opt = hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    ckpt = os.path.join(args.out, "ckpt.pt")
    start = 0
    if os.path.exists(ckpt):
        saved = torch.load(ckpt, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        start = saved["step"]
    schedule(model, start)
    ddp = DDP(model, find_unused_parameters=True)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for step in range(start, args.steps):
        schedule(model, step)
        g = torch.Generator().manual_seed(step * 100 + rank)
        x, y = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64)
        ((ddp(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % args.ckpt_every == 0:
            opt.consolidate_state_dict(to=0)
            if rank == 0:
                tmp = ckpt + ".tmp"
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1}, tmp)
                os.replace(tmp, ckpt)
            dist.barrier()
        if first_attempt and rank == args.kill_rank and step + 1 == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(args.out, "final.pt"))
    dist.destroy_process_group()
    # A restarted gloo worker sometimes hangs in C++ teardown at interpreter exit
    # (torch 2.13, after its peer exited); everything is saved, so leave at once.
    os._exit(0)


if __name__ == "__main__":
    main()
