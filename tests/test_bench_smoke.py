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
    doc.write_text("# B\n\n" + memory.BEGIN + "\nthe section before the run\n" + memory.END + "\n\ntail\n")
    assert memory.main(["--smoke", "--out", str(tmp_path / "out"), "--docs", str(doc)]) == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    # Trainer rows with optim_args "stage=2" are skipped, with the reason, until Trainer takes stage 2
    assert set(res["skipped"]) == ({"zero_bucket_stage2", "zero_bucket_stage2_bf16"} if memory.trainer_stage2_missing()
                                   else set())
    assert set(res["memory"]) == set(memory.MEMORY_ROWS) - set(res["skipped"]) | set(memory.RAW_ROWS)
    assert set(res["precision"]) == set(memory.PRECISION_ROWS)
    for name, m in res["memory"].items():
        assert len(m["peak_bytes_per_rank"]) == 2 and min(m["peak_bytes_per_rank"]) > 50 * 2**20, name
        assert m["bytes_per_param"] > sum(m["breakdown"].values()), name  # the interpreter alone is more, tiny model
    assert res["memory"]["adamw_torch"]["vs_adamw_torch"] == 1.0
    assert res["memory"]["raw_ddp_adamw"]["vs_adamw_torch"] == 1.0
    for name in memory.RAW_ROWS:  # every phase's peak measured; same-dtype raw loops log the same losses
        m = res["memory"][name]
        steps = res["config"]["steps"]
        assert all(min(p.values()) > 50 * 2**20 for p in m["steady_phase_peaks_per_rank"]), name
        assert len(m["losses"]) == steps * m["accumulation"], name
    for dtype in ("float32", "bfloat16"):
        runs = [m["losses"] for n, m in res["memory"].items() if n in memory.RAW_ROWS and memory.RAW_ROWS[n][0] == dtype
                and m["accumulation"] == 1]
        assert all(abs(a - b) < 1e-2 * abs(b) for ls in runs for a, b in zip(ls, runs[0])), dtype
    checks = res["stage2"]
    trainer_stage2 = {n for n, r in memory.MEMORY_ROWS.items() if "stage=2" in (r[2] or "")} - set(res["skipped"])
    assert set(checks) == {n for n, r in memory.RAW_ROWS.items() if r[1] == "stage2"} | trainer_stage2
    assert checks["raw_stage2"]["vs"] == "raw_stage1" and checks["raw_stage2"]["peak_bucket_bytes"] > 0
    for name, r in res["precision"].items():
        assert all(math.isfinite(x) and 0 < x < 10 for x in r["eval_loss"]), name
        assert all(0 < x <= 1 for x in r["moved_fraction"]), name
    text = doc.read_text()
    assert "the section before the run" not in text and text.endswith("\n\ntail\n") and "Smoke run" in text
    assert "Issue 30's bounds" in text
    assert all(f"`{name}`: skipped. Trainer stage 2 is not available" in text for name in res["skipped"])


def test_hostpath_smoke_run(tmp_path):
    """``python -m benchmarks.hostpath --smoke``: every contender timed in paired rounds against DDP, the steady
    steps' host reads (none) and collectives counted, the JSON renders."""
    from benchmarks import hostpath, render

    out = tmp_path / "hostpath.json"
    assert hostpath.main(["--smoke", "--profile", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    (shape,) = res["config"]["shapes"]
    rows = res["shapes"][shape]["rows"]
    assert set(rows) == set(hostpath.CONTENDERS)
    for name, r in rows.items():
        assert len(r["ms_rounds"]) == res["config"]["rounds"] and all(0 < ms < 10_000 for ms in r["ms_rounds"]), name
        # the main thread's CPU time: some of the wall time, never more (a little slack for the clocks' grain)
        assert all(0 < cpu <= ms * 1.05 + 0.1 for cpu, ms in zip(r["cpu_ms_rounds"], r["ms_rounds"])), name
    assert rows["ddp"]["cpu_ratio_median"] == 1.0
    assert rows["ddp"]["ratio_median"] == 1.0
    assert {n: c["reads"] for n, c in res["counts"].items()} == dict.fromkeys(hostpath.CONTENDERS, 0)
    # a send and a receive for the reduce-scatter and the sync (the layout check rides a reduce bucket)
    assert res["counts"]["stage1"]["collectives"] >= 4 and res["counts"]["stage2"]["collectives"] >= 4
    profiles = res["shapes"][shape]["profiles"]
    assert any(r["function"].startswith("hf_zero/") for r in profiles["stage2"])
    original = render.load
    try:
        render.load = lambda stem: res if stem.startswith("hostpath_") else original(stem)
        text = "\n".join(render.host_time())
    finally:
        render.load = original
    assert "| 48 tensors, H=64 |" in text and "host reads | 0 | 0 | 0 |" in text
    assert "Host CPU time per iteration" in text
    assert "The same with the model in bf16" in text and "hf_zero stage 2 0." in text
