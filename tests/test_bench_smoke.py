"""The memory benchmark's --smoke mode runs end to end and measures what it claims to."""

import json

import pytest

pytestmark = pytest.mark.timeout(400)


def test_memory_smoke_run(tmp_path):
    """``python -m benchmarks.memory --smoke``: every row runs under Trainer on 2 ranks, peaks are
    real high-water marks, precision rows report a finite eval loss and the fraction moved."""
    import math

    from benchmarks import memory

    doc = tmp_path / "doc.md"
    doc.write_text("# B\n\n" + memory.BEGIN + "\nold\n" + memory.END + "\n\ntail\n")
    assert memory.main(["--smoke", "--out", str(tmp_path / "out"), "--docs", str(doc)]) == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(res["memory"]) == set(memory.MEMORY_ROWS) and set(res["precision"]) == set(memory.PRECISION_ROWS)
    for name, m in res["memory"].items():
        assert len(m["peak_bytes_per_rank"]) == 2 and min(m["peak_bytes_per_rank"]) > 50 * 2**20, name
        assert m["bytes_per_param"] > sum(m["breakdown"].values()), name  # the interpreter alone is more, tiny model
    assert res["memory"]["adamw_torch"]["vs_adamw_torch"] == 1.0
    for name, r in res["precision"].items():
        assert all(math.isfinite(x) and 0 < x < 10 for x in r["eval_loss"]), name
        assert all(0 < x <= 1 for x in r["moved_fraction"]), name
    text = doc.read_text()
    assert "old" not in text and text.endswith("\n\ntail\n") and "Smoke run" in text
