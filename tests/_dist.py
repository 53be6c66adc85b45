"""Spawn-based multi-process harness for gloo tests (CPU only, hard deadline)."""
from __future__ import annotations

import os
import pickle
import socket
import time
import traceback
from datetime import timedelta
from multiprocessing import connection, get_context

import torch
import torch.distributed as dist

_GRACE_S = 1.0  # after the first failure, how long to collect other ranks' errors


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(conn, rank, world_size, port, timeout, env, fn, args, kwargs):
    os.environ.clear()  # a forkserver child starts with the server's environment: take the caller's
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        # Plain pickle (not ForkingPickler): tensors travel by value, not by shared memory.
        ok, result = True, pickle.dumps(("ok", fn(rank, world_size, *args, **kwargs)))
    except BaseException:
        ok, result = False, pickle.dumps(("err", traceback.format_exc()))
    try:
        conn.send_bytes(result)
        if ok and dist.is_initialized():
            # Rank 0 hosts the store every group (subgroups too) is built through, and a forked
            # rank exits at once: stay until every rank is done with it (the harness kills a rank
            # still waiting here once another has failed).
            dist.barrier()
    except Exception:
        pass
    finally:
        conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()


# Imported once by the forkserver that starts the ranks (seconds per rank otherwise).
_PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.trainer", "accelerate", "hf_zero",
            "tests.models"]


def _context(fresh: bool):
    if fresh:
        return get_context("spawn")
    ctx = get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_ranks(fn, world_size, *args, timeout=60.0, fresh=False, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo processes.

    Each rank is a process forked from a server that imported torch, transformers and
    hf_zero once (``forkserver``; ``fresh=True``: a new interpreter, ``spawn``, for what
    must start clean, e.g. memory high-water marks or variables read at process start), with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE set,
    ``OMP_NUM_THREADS=1`` and an initialised default gloo process group (its collective
    timeout is ``timeout`` too). ``fn`` must be a module-level (picklable) function; its
    return value must be picklable (tensors come back by value).

    Returns the per-rank return values, ordered by rank. ``timeout`` is a hard deadline for
    the whole run, spawn included: on expiry every child is SIGKILLed and ``TimeoutError``
    names the ranks that had not finished. If any rank raises (or dies), the other ranks get
    ~1 s to report, then are killed, and ``RuntimeError`` carries each failing rank's
    traceback. To check that *every* rank raises the same error, catch it inside ``fn`` and
    return the message instead.
    """
    ctx = _context(fresh)
    port, deadline = _free_port(), time.monotonic() + timeout
    procs, conns = [], []
    results, errors, pending = {}, {}, set(range(world_size))
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited at exec, before the child imports torch
    try:
        try:
            for rank in range(world_size):
                recv, send = ctx.Pipe(duplex=False)
                conns.append(recv)
                p = ctx.Process(target=_worker, name=f"rank{rank}", daemon=True,
                                args=(send, rank, world_size, port, timeout, dict(os.environ), fn, args, kwargs))
                p.start()  # raises here if fn/args cannot be pickled
                procs.append(p)
                send.close()
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        while pending:
            if errors:
                deadline = min(deadline, time.monotonic() + _GRACE_S)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            waitables = {conns[r]: r for r in pending}
            waitables.update({procs[r].sentinel: r for r in pending})
            for ready in connection.wait(list(waitables), timeout=left):
                r = waitables[ready]
                if r not in pending:
                    continue
                try:
                    if conns[r].poll():
                        status, value = pickle.loads(conns[r].recv_bytes())
                    elif procs[r].exitcode is None:
                        continue
                    else:
                        raise EOFError
                except EOFError:
                    procs[r].join(timeout=1.0)
                    status, value = "err", f"died without a result (exit code {procs[r].exitcode})"
                (results if status == "ok" else errors)[r] = value
                pending.discard(r)
        if errors:
            msg = "\n".join(f"--- rank {r} failed ---\n{tb}" for r, tb in errors.items())
            if pending:
                msg += f"\n(ranks {sorted(pending)} had not finished; killed)"
            raise RuntimeError(f"{len(errors)} of {world_size} ranks failed "
                               f"(first failure first):\n{msg}")
        if pending:
            raise TimeoutError(f"run_ranks: ranks {sorted(pending)} of {world_size} had not "
                               f"finished after {timeout} s; all ranks killed")
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:  # ranks that all succeeded get 5 s to exit; anything left is killed
            p.join(timeout=5.0 if not (errors or pending) else 0)
            if p.is_alive():
                p.kill()
            p.join()
        for c in conns:
            c.close()


_TABLES: dict = {}


def run_case(train, cases: dict, name: str, world_size: int, *, timeout: float) -> list:
    """Per rank, ``train(rank, world_size, cases[name])``. Every case of ``cases`` runs in one
    spawn per ``train`` and world size (a spawn costs seconds; the table holds many cases),
    kept for the other cases' tests."""
    key = (train, world_size)
    if key not in _TABLES:
        _TABLES[key] = run_ranks(_run_table, world_size, train, cases, timeout=timeout)
    return [per_case[name] for per_case in _TABLES[key]]


def _run_table(rank, world_size, train, cases):
    return {name: train(rank, world_size, case) for name, case in cases.items()}

