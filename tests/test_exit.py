"""No hang or crash at exit: 20 consecutive short runs at 2 and at 4 ranks, each rank a
fresh interpreter that exits for real, on the gradient path with the overlapped
parameter sync still in flight when the script ends (tests/scripts/exit_run.py).

The script ends by destroying the process group, as scripts should (Accelerate's
``end_training()`` does). Without that, torch 2.13's gloo process group itself aborts at
interpreter exit now and then ("terminate called without an active exception"), with
plain AdamW as with hf_zero: docs/gradient_path.md.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "exit_run.py"
ROOT = str(Path(__file__).resolve().parent.parent)
RUNS = 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(world_size: int) -> list[tuple[int | str, str]]:
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), "--end", "destroy"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=90)
            out.append((p.returncode, stdout + stderr[-500:]))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            p.communicate()
            out.append(("hung", ""))
    return out


@pytest.mark.reliability("Exit: {world_size} ranks, 20 consecutive short runs ending with the overlapped sync in flight",
                         "every rank exits 0, none hangs")
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("world_size", [2, 4])
def test_no_hang_or_crash_at_exit_in_consecutive_runs(world_size):
    for i in range(RUNS):
        results = _run(world_size)
        for rank, (code, text) in enumerate(results):
            assert code == 0 and f"rank {rank} done" in text, f"run {i}, rank {rank}: exit {code}\n{text}"
