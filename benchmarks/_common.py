"""What every benchmark shares: the run's environment record, the generated section of a
markdown file, and the collective counter with its wire-byte model (the byte test's too)."""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import platform
import subprocess
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def environment(command: str, **extra) -> dict:
    """Where and when a run happened: date, command, checkout, CPU, load, versions; plus ``extra``."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": command, "git": commit, "cpu": cpu, "cpu_count": os.cpu_count(), "load_start": load,
            "python": platform.python_version(), "torch": version("torch"), "transformers": version("transformers"),
            **extra}


def drain_sync(opt) -> None:
    """Wait for an overlapped parameter sync still in flight (hf_zero's optimizers; others have none)."""
    wait = getattr(opt, "wait_param_sync", None)
    if wait is not None:
        wait()


def replace_section(doc: Path, begin: str, end: str, md: str) -> None:
    """Replace the text between the ``begin`` and ``end`` lines of ``doc`` with ``md``
    (the markers are appended when absent, the file created when missing)."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if begin not in text or end not in text:
        text = text.rstrip("\n") + "\n\n" + begin + "\n" + end + "\n"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(head + begin + "\n" + md + end + tail)


# torch.distributed functions that move data between ranks. Wrapping the module attributes
# catches hf_zero's and torch ZeRO's calls alike (both call ``dist.X``).
COLLECTIVES = (
    "broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
    "all_to_all", "all_to_all_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "reduce", "gather", "scatter", "gather_object", "scatter_object_list", "broadcast_object_list",
    "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "_broadcast_coalesced",
)
_ARG = {"all_gather_into_tensor": (1, "input_tensor"), "all_gather_single": (1, "input_tensor"),
        "all_to_all_single": (1, "input"), "reduce_scatter_tensor": (1, "input"), "reduce_scatter_single": (1, "input")}


def wire_bytes(name: str, args: tuple, kwargs: dict) -> tuple[int, float]:
    """(payload, wire) of one collective call on this rank: the bytes of the tensor it contributes,
    and the bytes it sends in the standard algorithms: ring all-reduce 2B(N-1)/N, reduce-scatter,
    all-gather and pipelined broadcast B(N-1)/N (B: the whole tensor), all-to-all and sends exactly
    what goes to other ranks, receives 0. Wire -1 where no model applies (object collectives)."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if name == "_broadcast_coalesced":  # (group, tensors, buffer size, src): a pipelined broadcast of them all
        nbytes = sum(t.nbytes for t in args[1])
        return nbytes, nbytes * (world - 1) / world
    i, key = _ARG.get(name, (0, "tensor"))
    t = args[i] if len(args) > i else kwargs.get(key)
    if not isinstance(t, torch.Tensor):
        return 0, 0 if name in ("barrier", "monitored_barrier") else -1
    if name == "all_to_all_single":
        splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
        sent = t.nbytes * (world - 1) // world if not splits else \
            sum(n for r, n in enumerate(splits) if r != rank) * t.element_size()
        return t.nbytes, sent
    if name == "all_reduce":
        return t.nbytes, 2 * t.nbytes * (world - 1) / world
    if name in ("all_gather_into_tensor", "all_gather_single"):
        return t.nbytes, t.nbytes * (world - 1)
    if name in ("broadcast", "reduce_scatter_tensor", "reduce_scatter_single"):
        return t.nbytes, t.nbytes * (world - 1) / world
    if name in ("isend", "send"):
        return t.nbytes, t.nbytes
    if name in ("irecv", "recv"):
        return t.nbytes, 0
    return t.nbytes, -1


class CallCounter:
    """Wraps the functions ``names`` of ``owner`` (a module or a class) in this process, from construction until
    :meth:`uninstall`; inside :meth:`recording`, ``calls`` holds what :meth:`_wrap`'s wrapper records per call."""

    def __init__(self, owner, names):
        self._owner = owner
        self.calls: list[tuple] = []
        self._active, self._saved = False, {}
        for name in names:
            fn = getattr(owner, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(owner, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        raise NotImplementedError

    @contextlib.contextmanager
    def recording(self):
        self.calls, self._active = [], True
        try:
            yield self
        finally:
            self._active = False

    def uninstall(self) -> None:
        for name, fn in self._saved.items():
            setattr(self._owner, name, fn)
        self._saved = {}


class CollectiveCounter(CallCounter):
    """Wraps ``torch.distributed``'s collectives in this process (from construction until
    :meth:`uninstall`); inside :meth:`recording`, ``calls`` holds (name, payload, wire bytes) per
    call (see :func:`wire_bytes`). Used by tests/test_collectives.py and the benchmarks."""

    def __init__(self):
        import torch.distributed as dist

        super().__init__(dist, COLLECTIVES)

    def _wrap(self, name, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self._active:
                self.calls.append((name, *wire_bytes(name, args, kwargs)))
            return fn(*args, **kwargs)

        return counted

    def summary(self) -> dict:
        """Counts by kind, payload and wire bytes of the last recording (wire None if any is unknown)."""
        by_kind: dict[str, int] = {}
        for name, _, _ in self.calls:
            by_kind[name] = by_kind.get(name, 0) + 1
        return {"collectives": len(self.calls), "by_kind": dict(sorted(by_kind.items())),
                "payload_bytes": sum(p for _, p, _ in self.calls),
                "wire_bytes": sum(w for _, _, w in self.calls) if all(w >= 0 for _, _, w in self.calls) else None}
