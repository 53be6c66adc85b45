"""Tests of the multi-process harness itself (tests/_dist.py)."""
import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_ranks


def _all_reduce(rank, world_size):
    t = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
    dist.all_reduce(t)
    return t, os.environ["OMP_NUM_THREADS"], torch.get_num_threads()


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 blocks: the harness must not wait for it
    return "rank 0 should have been killed or failed"


def _hang(rank, world_size, pid_dir):
    (pid_dir / f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank == 0:
        dist.barrier()  # rank 1 never joins
    time.sleep(3600)


@pytest.mark.timeout(120)
def test_all_reduce_two_ranks():
    results = run_ranks(_all_reduce, 2)
    assert len(results) == 2
    for t, omp, nthreads in results:
        assert torch.equal(t, torch.tensor([3.0, 30.0]))
        assert omp == "1" and nthreads == 1


@pytest.mark.timeout(120)
def test_rank_error_is_reported_quickly():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="boom on rank 1") as info:
        run_ranks(_raise_on_rank1, 2, timeout=60)
    assert "ValueError" in str(info.value) and "rank 1" in str(info.value)
    assert time.monotonic() - start < 30  # well before the 60 s deadline


@pytest.mark.reliability("A rank that never joins a collective (test harness)", "TimeoutError within the deadline; children killed")
@pytest.mark.timeout(60)
def test_hang_times_out_and_kills_children(tmp_path):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\]"):
        run_ranks(_hang, 2, tmp_path, timeout=5)
    assert time.monotonic() - start < 10
    assert not multiprocessing.active_children()
    pid_files = list(tmp_path.glob("rank*.pid"))  # absent if a rank was killed during import
    for pid in (int(f.read_text()) for f in pid_files):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
