"""A short DDP run on the gradient path, for the exit test (tests/test_exit.py).

Started once per rank with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set: six
steps with grad_reduce="reduce_scatter" and the overlapped parameter sync, so the
last step's sync is still in flight when training ends. ``--end`` says how the
script ends: ``destroy`` as the integrations end training (wait for the sync, as
Trainer's train end and Accelerate's ``end_training()`` do with hf_zero, then destroy
the process group, as ``end_training()`` does), or ``plain`` (fall off the end, as most
scripts do: the optimizer is freed with its sync in flight; see docs/gradient_path.md).
"""

import argparse
import faulthandler
import os
import signal
import sys
import time

faulthandler.enable(all_threads=True)  # an abort at exit shows where every thread was

# The core alone: importing transformers and accelerate would take most of each run.
sys.modules.setdefault("transformers", None)
sys.modules.setdefault("accelerate", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from hf_zero import ZeroBucketOptimizer  # noqa: E402


_KEPT_ALIVE = []


def _die_at_the_parameter_sync(sig) -> None:
    """Send ``sig`` to this process as it starts sending its part of the next parameter
    sync (on gloo CPU tensors hf_zero sends it with ``isend``; other setups broadcast)."""
    def dying(send):
        def call(*args, **kwargs):
            if send is not dist.broadcast or kwargs.get("async_op"):
                os.kill(os.getpid(), sig)
            return send(*args, **kwargs)

        return call

    dist.isend, dist.broadcast = dying(dist.isend), dying(dist.broadcast)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--end", choices=["destroy", "plain"], default="destroy")
    ap.add_argument("--optimizer", choices=["zero", "zero-no-overlap", "adamw"], default="zero")
    ap.add_argument("--die-rank", type=int, default=None,
                    help="this rank SIGKILLs itself as its last step starts the parameter sync; the others then "
                         "end plainly, with that sync pending")
    ap.add_argument("--stuck", action="store_true", help="with --die-rank: SIGSTOP instead (alive but silent)")
    end = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ddp = DDP(model, bucket_cap_mb=0.001)
    if end.optimizer.startswith("zero"):
        opt = ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                                  grad_reduce="reduce_scatter", overlap_param_sync=end.optimizer == "zero")
        opt.bind_ddp(ddp)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * world, 16, generator=g), torch.randn(4 * world, 4, generator=g)
        torch.nn.functional.mse_loss(ddp(x[rank::world]), y[rank::world]).backward()
        if step == 5 and rank == end.die_rank:
            _die_at_the_parameter_sync(signal.SIGSTOP if end.stuck else signal.SIGKILL)
        opt.step()
        opt.zero_grad()
    if end.die_rank is not None:
        _KEPT_ALIVE.append(opt)  # alive at exit: hf_zero's at-exit drain meets the sync waiting for the dead peer
        print(f"rank {rank} done at {time.time()}", flush=True)
        return
    if end.end == "destroy":
        if end.optimizer.startswith("zero"):
            opt.wait_param_sync()
        dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
