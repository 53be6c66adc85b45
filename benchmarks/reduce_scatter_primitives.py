"""Time the gradient reduce-scatter and parameter sync primitives against an all-reduce (gloo, CPU).

    python -m benchmarks.reduce_scatter_primitives [--ranks 2] [--mb 4 32 120] [--rounds 9]

Each round times, in a shuffled order, an all-reduce of the buffer,
``hf_zero._comm.Comm.reduce_scatter_`` by each primitive (its local sum included) and
``Comm.sync_buffer`` by each primitive; prints the median per size and its ratio to the
all-reduce.
"""

import argparse
import os
import random
import socket
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_zero._comm import Comm


def _rank(rank, world_size, port, sizes_mb, rounds, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    comm = Comm()
    rows = []
    for mb in sizes_mb:
        n = mb * 2**20 // 4
        chunk = -(-n // world_size)
        bounds = [r * chunk for r in range(world_size + 1)]
        buf = torch.randn(n)

        def all_reduce():
            dist.all_reduce(buf)

        def by(how):
            def run():
                comm.use_strategy(replace(comm.strategy, reduce_scatter_by=how))
                comm.reduce_scatter_(buf, bounds).wait()

            return run

        def sync_by(how):
            def run():
                comm.use_strategy(replace(comm.strategy, sync_by=how))
                comm.sync_buffer(buf, bounds)

            return run

        fns = {
            "all_reduce": all_reduce,
            **{f"rs:{h}": by(h) for h in ("send_recv", "all_to_all", "reduce_scatter")},
            **{f"sync:{h}": sync_by(h) for h in ("send_recv", "broadcast")},
        }
        times = {k: [] for k in fns}
        order = list(fns)
        rng = random.Random(mb)
        for _ in range(rounds):
            rng.shuffle(order)
            for k in order:
                dist.barrier()
                t = time.perf_counter()
                fns[k]()
                dist.barrier()
                times[k].append(time.perf_counter() - t)
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        rows.append((mb, med))
    if rank == 0:
        for mb, med in rows:
            out.append(f"{world_size} ranks {mb:4d} MB  " + "  ".join(
                f"{k} {v * 1e3:7.1f} ms ({v / med['all_reduce']:.2f})" for k, v in med.items()))
        print("\n".join(out), flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mb", type=int, nargs="+", default=[4, 32, 120])
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(a.ranks, port, a.mb, a.rounds, []), nprocs=a.ranks)


if __name__ == "__main__":
    main()
