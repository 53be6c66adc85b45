"""The GPU check and the GPU benchmark run end to end on the CPU (gloo, 2 processes, a tiny model):
the same code paths a GPU run takes, less the sync-debug mode and the CUDA memory figures."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

from benchmarks import gpu_bench, gpu_check, render
from tests._procs import start, wait_all

ROOT = render.ROOT


@pytest.mark.timeout(300)
def test_gpu_check_dry_run_compares_stage_2_and_runs_the_steady_steps(tmp_path):
    """``python -m benchmarks.gpu_check --device cpu`` on stage 2's kinds of case (fp32, bf16 masters,
    accumulation reducing every micro-batch and under no_sync(), clipping) and the bf16-params stage-1
    case: each matches torch within its tolerance, with identical replicas, and its steady steps
    (part 2) run, as do the DDP control's. (All cases: ``python -m benchmarks.gpu_check --device cpu``.)"""
    picked = ["stage2_f32_fused", "stage2_bf16_masters", "stage2_f64_accumulate_clip", "stage2_f64_no_sync_clip",
              "bf16_params_foreach"]
    assert all(gpu_check.CASES[n].stage == 2 for n in picked[:4])
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--cases", *picked]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(report["cases"]) == set(picked)
    assert report["part2"] == {"backend": "gloo", "world_size": 2} and report["sync_debug"] is False
    assert report["control"] == {"passed": True, "sync_debug": False}
    for name, row in report["cases"].items():
        assert row["passed"] and row["replicas_identical"] and row["state_keys_match"], (name, row)
        assert row["max_rel_param_err"] <= row["tolerance"] and row["max_rel_state_err"] <= row["tolerance"], name
        assert row["tolerance"] == (1e-12 if gpu_check.CASES[name].tol else gpu_check.RELATIVE_TO_DDP), name
        assert row["host_syncs"] == {"passed": True, "sync_debug": False}, name


def test_gpu_check_verdict_fails_a_result_off_by_its_tolerance():
    """The verdict is not blind: a float64 result equal to torch's passes, the same moved by 1e-9 of
    its distance travelled fails, and a case whose ranks differ fails."""
    name = "f64_fused_flat"
    cpu = torch.device("cpu")
    params, state, initial = gpu_check.train(gpu_check.CASES[name], cpu)
    ranks = [{name: {"ok": True, "value": (params, state, initial), "reference": None}} for _ in range(2)]
    assert gpu_check.compare(name, ranks, cpu)["passed"]
    moved = [p.clone() for p in params]
    moved[0].view(-1)[0] += 1e-9 * (params[0] - initial[0]).abs().max()
    off = [{name: {"ok": True, "value": (moved, state, initial), "reference": None}} for _ in range(2)]
    verdict = gpu_check.compare(name, off, cpu)
    assert not verdict["passed"] and verdict["replicas_identical"] and verdict["max_rel_param_err"] > 1e-12
    apart = [ranks[0], off[1]]
    assert not gpu_check.compare(name, apart, cpu)["replicas_identical"]


@pytest.mark.timeout(300)
def test_gpu_bench_dry_run_under_torchrun(tmp_path, monkeypatch):
    """``torchrun --nproc-per-node 2 -m benchmarks.gpu_bench --device cpu``: every contender but DeepSpeed
    (CUDA only) is timed in each round, against the baseline of the same round; the JSON renders into
    the GPU table, and the renderer refuses it as a published GPU result."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "benchmarks.gpu_bench", "--device", "cpu", "--model", "tiny", "--dtype", "float32", "--seq", "16",
           "--batch", "2", "--warmup", "2", "--steps", "2", "--rounds", "2", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    (result,) = wait_all({"bench": start(cmd, ROOT, env)}, timeout=240).values()
    assert result.rc == 0, result.out[-4000:]
    path = out / "gpu_tiny_float32_n2.json"
    res = json.loads(path.read_text())
    assert res["config"]["dry_run"] and res["config"]["world_size"] == 2
    assert res["skipped"] == {"deepspeed_zero2": "CUDA only"}
    assert set(res["contenders"]) == set(gpu_bench.CONTENDERS) - {"deepspeed_zero2"}
    assert res["model"]["params"] == sum(p.numel() for p in gpu_bench.e2e.template_model(
        gpu_bench.SIZES["tiny"]).parameters())
    for name, row in res["contenders"].items():
        assert len(row["iteration_ms"]) == 2 and all(0 < ms < 60_000 for ms in row["iteration_ms"]), name
        ratios = [a / b for a, b in zip(row["iteration_ms"], res["contenders"]["ddp_adamw_fused"]["iteration_ms"])]
        assert all(math.isclose(r, x) for r, x in zip(ratios, row["vs_baseline"]["ratios"])), name
        assert row["peak_bytes_per_rank"] is None and row["memory_vs_baseline"] is None, name  # CUDA only
    table = "\n".join(render.gpu_table([res]))
    for name, row in res["contenders"].items():
        assert f"| {render._GPU_NAMES[name]} | {row['iteration_ms_median']:.1f} |" in table
    assert "| DeepSpeed ZeRO-2 | skipped: CUDA only |" in table
    real_load = render.load
    monkeypatch.setattr(render, "load",
                        lambda stem: json.loads(path.read_text()) if stem == path.stem else real_load(stem))
    monkeypatch.setitem(render.RESULTS, "gpu", (path.stem,))
    with pytest.raises(ValueError, match="CPU dry run"):
        render.gpu()
    # the same JSON as a GPU run would write it (device named, CUDA memory per rank): a table, and the
    # page's opening no longer says that nothing comes from a GPU
    res["config"]["dry_run"] = False
    res["env"].update(gpu="a GPU", gpus=2, cuda="12.8", nccl="2.27.3")
    for row in res["contenders"].values():
        row.update(peak_bytes_per_rank=[3 * render.MIB, 5 * render.MIB],
                   above_start_bytes_per_rank=[2 * render.MIB, 4 * render.MIB], memory_vs_baseline=1.0)
    path.write_text(json.dumps(res))
    page = render.page()
    assert "| hf_zero stage 2 | " in page and "| 5 (4) | 1.000 |" in page and "2 x a GPU, CUDA 12.8" in page
    assert "none has been measured on a GPU yet" not in page and "GPU runs (NCCL) are in" in page


def test_gpu_check_names_where_a_steady_step_synced():
    """A steady step that raised torch's sync-debug error fails the case as a host sync, naming the
    innermost hf_zero frame; any other error fails it as an error."""
    package = os.path.dirname(gpu_check.inspect.getfile(gpu_check.ZeroBucketOptimizer))
    tb = (f'Traceback (most recent call last):\n  File "{ROOT}/benchmarks/gpu_check.py", line 9, in train\n'
          f'  File "{package}/_comm.py", line 415, in agree\n    return int(t[0])\n'
          f'  File "{ROOT}/.venv/lib/torch/_tensor.py", line 1, in __int__\n'
          "RuntimeError: called a synchronizing CUDA operation")
    ranks = [{"c": {"ok": False, "host_sync": gpu_check.SYNC_ERROR in tb, "error": tb}}, {"c": {"ok": True}}]
    verdict = gpu_check.sync_verdict("c", ranks, watched=True)
    assert verdict["passed"] is False and verdict["host_sync"] is True
    assert gpu_check._where(tb) == (f'at File "{package}/_comm.py", line 415, in agree: '
                                    "RuntimeError: called a synchronizing CUDA operation")
    assert gpu_check.sync_verdict("c", [{"c": {"ok": True}}] * 2, watched=True) == {"passed": True, "sync_debug": True}


def test_gpu_section_says_the_figures_are_cpu_until_a_gpu_run_is_published(monkeypatch):
    monkeypatch.setitem(render.RESULTS, "gpu", ())
    text = "\n".join(render.gpu())
    assert "Not measured yet: every figure above comes from CPUs with gloo" in text
    assert "python -m benchmarks.gpu_check" in text and "-m benchmarks.gpu_bench" in text
    assert "none has been measured on a GPU yet" in render.gpu_status()
