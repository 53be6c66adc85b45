"""``python -m benchmarks.memory``'s figures render from a result (plotting code runs in CI)."""

import struct
import zlib

import pytest

from benchmarks import memory

pytest.importorskip("matplotlib")


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100
    assert zlib.crc32(data[12:29]) == struct.unpack(">I", data[29:33])[0]  # the header chunk is intact
    assert data.endswith(b"IEND\xaeB`\x82")


def _synthetic():
    mem = {n: {"params": 1000, "peak_bytes_per_rank": [20_000, 21_000], "bytes_per_param": 21.0, "vs_adamw_torch": 1.0,
               "breakdown": memory.breakdown(n, 2)} for n in memory.MEMORY_ROWS}
    curve = [(s, 5.5 - 0.01 * s) for s in range(0, 200, 10)]
    prec = {n: {"eval_loss": [2.0], "moved_fraction": [0.5], "train_loss": [curve], "eval_vs_fp32": 1.0}
            for n in memory.PRECISION_ROWS}
    return {"config": memory.FULL, "memory": mem, "precision": prec}


def test_memory_figures_are_valid_pngs(tmp_path):
    written = memory.figures(_synthetic(), tmp_path)
    assert sorted(p.name for p in written) == ["memory_loss_curves.png", "memory_per_rank.png"]
    for path in written:
        _assert_png(path)


def test_breakdown_counts_what_issue_18_names():
    fp32 = memory.breakdown("adamw_torch", 2)
    assert fp32 == {"params": 4, "p.grad": 4, "DDP buckets": 4, "optimizer state": 8}
    zero = memory.breakdown("zero_bucket", 2)
    # grads held once (p.grad are views of DDP's buckets), scratch one bucket: neither per param
    assert zero == {"params": 4, "p.grad": 4, "optimizer state": 4}
    bf16 = memory.breakdown("zero_bucket_bf16", 8)
    assert bf16["params"] == 2 and bf16["fp32 masters"] == 0.5 and bf16["optimizer state"] == 1.0
