"""A rank killed mid-run under torchrun --max-restarts 1 resumes and ends where an uninterrupted run ends."""

import os
import socket
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "fault_train.py")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(out, *extra):
    # Static rendezvous: with --standalone (c10d) torch 2.13's restarted gloo workers
    # read the dead attempt's addresses from the reused agent store and cannot connect.
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           SCRIPT, "--out", out, *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.reliability("Rank 1 SIGKILLed mid-run under torchrun --max-restarts 1", "restart from the last checkpoint; final weights equal the uninterrupted run")
@pytest.mark.timeout(320)
def test_sigkill_rank1_restarts_from_checkpoint_and_matches(tmp_path):
    _torchrun(str(tmp_path / "clean"))
    killed = _torchrun(str(tmp_path / "killed"), "--kill-rank", "1", "--kill-at", "6")
    assert "(exitcode: -9)" in killed.stderr  # rank 1 really died, and the agent restarted it
    clean = torch.load(tmp_path / "clean" / "final.pt", weights_only=True)
    resumed = torch.load(tmp_path / "killed" / "final.pt", weights_only=True)
    for name in clean:
        assert torch.equal(clean[name], resumed[name]), name
