"""Measuring tools used inside each rank: collective counts, peak memory, timings."""

from __future__ import annotations

import statistics
import threading
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ._common import WrappedCollectives

class CollectiveCounter(WrappedCollectives):
    """Counts outermost collective calls and the bytes of the tensors they move.

    A collective built from others (``all_gather_object``) counts once; its bytes
    are those of the tensor collectives inside it. Bytes are the payload one call
    names (the broadcast tensor, the gathered output), not wire traffic.
    """

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}
        self.bytes = 0
        self._local = threading.local()

    def reset(self) -> None:
        self.calls, self.bytes = {}, 0

    @contextmanager
    def counting(self):
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def summary(self, steps: int) -> dict:
        n = max(steps, 1)
        return {
            "collectives_per_step": sum(self.calls.values()) / n,
            "by_kind_per_step": {k: v / n for k, v in sorted(self.calls.items())},
            "bytes_per_step": self.bytes / n,
        }

    def _wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if self.active:
                if depth == 0:
                    self.calls[name] = self.calls.get(name, 0) + 1
                self.bytes += _payload(name, args, kwargs)
            self._local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = depth

        wrapper.__wrapped__ = fn
        return wrapper


def _payload(name, args, kwargs) -> int:
    if name.endswith("_object") or name.endswith("_object_list"):
        return 0  # counted through the tensor collectives inside
    first = args[0] if args else next(iter(kwargs.values()), None)
    if name in ("all_gather", "gather", "all_to_all") and isinstance(first, (list, tuple)):
        return sum(t.numel() * t.element_size() for t in first if isinstance(t, torch.Tensor))
    if isinstance(first, torch.Tensor):
        return first.numel() * first.element_size()
    tensor = kwargs.get("tensor") or kwargs.get("output_tensor") or kwargs.get("output")
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


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
