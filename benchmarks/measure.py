"""Measuring tools used inside each rank of the step suite: memory, state bytes, timings."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def rss_mib() -> float:
    return _status_kib("VmRSS") / 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    return _status_kib("VmHWM") / 1024


def state_bytes(optimizer) -> int:
    """Bytes of the optimizer-state tensors this rank holds (hf_zero, torch ZeRO or plain)."""
    inner = getattr(optimizer, "_inner", None)
    if inner is None and hasattr(optimizer, "optim"):
        inner = optimizer.optim  # torch ZeroRedundancyOptimizer
    if inner is None and not hasattr(optimizer, "_inner"):
        inner = optimizer
    if inner is None:
        return 0
    seen, total = set(), 0
    for st in inner.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and (v.data_ptr(), v.numel()) not in seen:
                seen.add((v.data_ptr(), v.numel()))
                total += v.numel() * v.element_size()
    return total


def time_calls(fn, *, warmup: int, steps: int, before=None) -> list[float]:
    """Seconds per call of ``fn`` on this rank, after ``warmup`` untimed calls; ranks start each call together."""
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    out = []
    for _ in range(steps):
        if before is not None:
            before()
        barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def per_step_max(per_rank: list[list[float]]) -> list[float]:
    """A step lasts as long as its slowest rank."""
    return [max(ts) for ts in zip(*per_rank)]
