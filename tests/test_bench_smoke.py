"""The benchmark suite's --smoke mode runs end to end and measures what it claims to."""

import json

import pytest

from benchmarks import run

pytestmark = pytest.mark.timeout(400)


def test_smoke_run_writes_results(tmp_path, capsys):
    assert run.main(["--smoke", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    md = (tmp_path / "benchmarks.md").read_text()
    assert "smoke run" in md and "### Targets" in md

    assert set(results["models"]) == set(run.SMOKE["models"])
    for name, m in results["models"].items():
        opts = m["optimizers"]
        assert set(opts) == set(run.SMOKE["optimizers"])
        for kind, o in opts.items():
            assert o["step_ms"] > 0 and o["timed_steps"] == run.SMOKE["steps"], (name, kind)
        unsharded = opts["unsharded"]["state_bytes_per_rank"][0]
        # AdamW state: two fp32 moments per element plus a 4-byte step per tensor.
        assert unsharded == 2 * 4 * m["params"] + 4 * m["tensors"]
        # Flat shards split the state evenly; the counted collectives are the real ones.
        assert max(opts["hf_zero_flat_bv"]["state_bytes_per_rank"]) <= 1.01 * unsharded / 2
        assert opts["unsharded"]["collectives_per_step"] == 0
        assert opts["torch_zero_bv"]["collectives_by_kind"]["broadcast"] == 2
        assert opts["torch_zero_nobv"]["collectives_by_kind"]["broadcast"] == m["tensors"]
        # one buffer: on gloo its range to the other rank, the other range from it
        assert opts["hf_zero_flat_bv"]["collectives_by_kind"]["isend"] == 1
        assert opts["hf_zero_flat_bv"]["collectives_by_kind"]["irecv"] == 1
        lim = opts["hf_zero_flat_bv"]["limits"]
        assert opts["hf_zero_flat_bv"]["bytes_per_step"] >= lim["buffer_bytes"]
        assert lim["local_over_flat"] > 0 and lim["sync_throughput_vs_raw"] > 0
        assert opts["hf_zero_flat_bv"]["rebuild"]["worst_over_step"] > 0
        assert opts["hf_zero_flat_bv"]["consolidate"]["time_over_torch"] > 0
    assert {t["target"] for t in results["targets"]} >= {"rebuild / one step", "consolidation time / torch's"}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "chart.png").read_bytes()[:4] == b"\x89PNG"


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
