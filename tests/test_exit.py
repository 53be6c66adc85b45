"""No hang or crash at exit, each rank a fresh interpreter that exits for real, on the
gradient path with the overlapped parameter sync still in flight when training ends
(tests/scripts/exit_run.py). No run here counts an abort, a hang or a non-zero exit as
success.

``destroy``: the script waits for the sync and destroys the process group, as
Accelerate's ``end_training()`` does: every rank exits 0, every run. ``plain``: it just
ends, as most scripts and Trainer do; the optimizer is freed with the sync in flight. A
plain ending can abort in gloo's own teardown with any optimizer (docs/gradient_path.md,
"Exit"), so hf_zero's plain runs are counted against plain DDP + AdamW runs of the same
test: hf_zero's abort count must be no higher, and nothing else may go wrong in either.
Before hf_zero kept its gloo work objects ([Note: no Python on communication threads] in
hf_zero/_works.py), ``plain`` aborted 7 runs of 10 at 2 ranks here.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "exit_run.py"
ROOT = str(Path(__file__).resolve().parent.parent)
ABORT = re.compile(r"terminate called without an active exception")
RUN_TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(world_size: int, *args: str) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def _run(world_size: int, *args: str) -> list[tuple[int | str, str]]:
    """(exit code or "hung", output) per rank; a run past RUN_TIMEOUT_S is killed."""
    procs = _start(world_size, *args)
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=RUN_TIMEOUT_S)
            out.append((p.returncode, stdout + stderr[-4000:]))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            p.communicate()
            out.append(("hung", ""))
    return out


def _clean(results) -> bool:
    return all(code == 0 and f"rank {rank} done" in text for rank, (code, text) in enumerate(results))


# How an exit abort ends: SIGABRT, or SIGSEGV when the abort's own crash report (faulthandler
# dumping the other threads) faults too; seen once in plain DDP + AdamW, the control, on 2026-12-04:
# "terminate called without an active exception / Fatal Python error: Aborted / ... Fatal Python
# error: Segmentation fault", exit -11. Either way gloo's abort message comes first.
_ABORT_SIGNALS = (-signal.SIGABRT, -signal.SIGSEGV)


def _aborted(results) -> bool:
    """Every rank did its work, and those that failed aborted at exit (gloo's abort message, then
    SIGABRT, or SIGSEGV in the abort's crash report)."""
    return all(f"rank {rank} done" in text and (code == 0 or (code in _ABORT_SIGNALS and ABORT.search(text)))
               for rank, (code, text) in enumerate(results)) and not _clean(results)


@pytest.mark.reliability("Exit: {world_size} ranks, consecutive short runs ending with the process group destroyed, the "
                         "overlapped sync in flight when training ends", "every rank exits 0 in every run")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size, runs", [(2, 6), (4, 3)])
def test_destroyed_process_group_exits_0_every_time(world_size, runs):
    for i in range(runs):
        results = _run(world_size, "--end", "destroy")
        assert _clean(results), f"run {i}: {[(code, text[-2000:]) for code, text in results]}"


@pytest.mark.reliability("Exit: 2 ranks, scripts that just end (no destroy), hf_zero with the sync in flight against "
                         "plain DDP + AdamW, alternated", "hf_zero aborts no more often than the control; no hang or other failure")
@pytest.mark.timeout(400)
def test_plain_ending_aborts_no_more_often_than_plain_ddp_adamw():
    runs = 6
    aborts = {"zero": 0, "adamw": 0}
    for i in range(runs):
        for optimizer in aborts:
            results = _run(2, "--end", "plain", "--optimizer", optimizer)
            if _aborted(results):
                aborts[optimizer] += 1
            else:
                assert _clean(results), f"{optimizer} run {i}: {[(c, t[-2000:]) for c, t in results]}"
    print(f"plain ending, aborted runs of {runs}: {aborts}")
    assert aborts["zero"] <= aborts["adamw"], aborts


@pytest.mark.reliability("Exit with a dead peer: rank 1 SIGKILLed or SIGSTOPped as its last parameter sync starts, rank 0 "
                         "ends with that sync pending and the optimizer alive", "rank 0 exits 0 within seconds (the at-exit drain gives up)")
@pytest.mark.timeout(200)
@pytest.mark.parametrize("how", ["killed", "stuck"])
def test_at_exit_drain_does_not_wait_for_a_dead_peer(how):
    from hf_zero import _overlap

    procs = _start(2, "--end", "plain", "--die-rank", "1", *(["--stuck"] if how == "stuck" else []))
    try:
        stdout, stderr = procs[0].communicate(timeout=RUN_TIMEOUT_S)
        exited = time.time()
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert procs[0].returncode == 0, stdout + stderr[-4000:]
    done_at = float(re.search(r"rank 0 done at ([0-9.]+)", stdout).group(1))
    # the drain gives each pending collective _EXIT_WAIT_S; a killed peer is noticed at once
    assert exited - done_at < _overlap._EXIT_WAIT_S + 10, exited - done_at
    assert procs[1].returncode == -signal.SIGKILL  # rank 1 died (or, stopped, was killed here)


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
