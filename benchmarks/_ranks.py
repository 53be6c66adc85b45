"""Run a function on N gloo processes on this machine and collect what each returns."""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from multiprocessing import get_context

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(results, rank, world_size, port, timeout, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:
        results.put((rank, "err", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo processes (one
    thread each); the per-rank results, by rank. Raises on the first failure or when
    ``timeout`` seconds pass (all processes are killed either way)."""
    ctx = get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    os.environ["OMP_NUM_THREADS"] = "1"
    procs = [ctx.Process(target=_rank, args=(results, r, world_size, port, timeout, fn, args), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out, deadline = {}, time.monotonic() + timeout
    try:
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"benchmark ranks did not finish within {timeout} s") from None
            if status != "ok":
                raise RuntimeError(f"benchmark rank {rank} failed:\n{value}")
            out[rank] = value
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
