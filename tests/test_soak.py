"""Shortened load run: frequent trainability changes and checkpoints stay equal to plain AdamW."""

import pytest

from tests._dist import run_ranks
from tests.scripts.soak import run


@pytest.mark.reliability("Load: 120 steps, trainability change every 10, sharded checkpoint every 40 (full: tests/scripts/soak.py, 500/50/100)", "equal to plain AdamW (< 1e-12), RSS flat")
@pytest.mark.timeout(120)
def test_many_rebuilds_and_checkpoints_stay_exact(tmp_path):
    results = run_ranks(run, 2, steps=120, change_every=10, ckpt_every=40, out=str(tmp_path), timeout=100)
    assert results[0]["deviation"] < 1e-12, results[0]
    assert results[0]["rebuilds"] >= 10
    for r in results:
        rss = r["rss_mib"]
        assert sorted(rss) == [40, 80, 120]
        assert rss[120] - rss[40] < 64, rss  # no per-rebuild growth worth a buffer
