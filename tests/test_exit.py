"""No hang or crash at exit: 20 consecutive short runs at 2 and at 4 ranks of a script that
just ends, and 5 of one that ends cleanly, each rank a fresh interpreter that exits for
real, on the gradient path with the overlapped parameter sync still in flight when
training ends (tests/scripts/exit_run.py).

``destroy``: the script waits for the sync and destroys the process group, as
Accelerate's ``end_training()`` does. ``plain``: it just ends, as most scripts and
Trainer do; the optimizer is freed with the sync still in flight. Before hf_zero kept
its gloo work objects ([Note: no Python on communication threads] in hf_zero/_works.py),
``plain`` aborted 7 runs of 10 at 2 ranks here, and ``destroy`` aborted now and then on
a loaded machine: a gloo thread freed a work object while Python was finalizing.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "exit_run.py"
ROOT = str(Path(__file__).resolve().parent.parent)
RUNS = {"plain": 20, "destroy": 5}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(world_size: int, end: str) -> list[tuple[int | str, str]]:
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), "--end", end], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=90)
            out.append((p.returncode, stdout + stderr[-4000:]))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            p.communicate()
            out.append(("hung", ""))
    return out


@pytest.mark.reliability("Exit: {world_size} ranks, consecutive short runs (20 'plain', 5 'destroy') with the overlapped "
                         "sync in flight when training ends, the script ending '{end}'", "every rank exits 0, none hangs")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("end", ["plain", "destroy"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_no_hang_or_crash_at_exit_in_consecutive_runs(world_size, end):
    for i in range(RUNS[end]):
        results = _run(world_size, end)
        for rank, (code, text) in enumerate(results):
            assert code == 0 and f"rank {rank} done" in text, f"run {i}, rank {rank}: exit {code}\n{text}"


def test_kept_gloo_works_are_let_go_only_a_sweep_after_one_found_them_completed(monkeypatch):
    import gc
    import weakref

    from hf_zero import _works

    class Work:
        done = False

        def is_completed(self):
            return self.done

    monkeypatch.setattr(_works, "_SWEEP_S", 0.0)  # every add() sweeps
    kept = _works._KeptWorks()
    a, b, c = Work(), Work(), Work()
    alive = [weakref.ref(w) for w in (a, b, c)]
    kept.add([a])
    a.done = True
    kept.add([b])  # this sweep finds a completed: still kept
    del a, b
    gc.collect()
    assert alive[0]() is not None and alive[1]() is not None
    kept.add([c])  # the next sweep lets a go; b, still running, stays
    gc.collect()
    assert alive[0]() is None and alive[1]() is not None and alive[2]() is not None
