"""What every benchmark script shares: the run's environment record, the generated
section of a markdown file, and wrapping ``torch.distributed``'s collectives."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# torch.distributed functions that move data between ranks. Wrapping the module
# attributes catches hf_zero's and torch ZeRO's calls alike (both call ``dist.X``).
COLLECTIVES = (
    "broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single", "all_to_all", "reduce", "gather",
    "scatter", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "send", "recv", "isend", "irecv",
)


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
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "git": commit,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "load_start": load,
        "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        **extra,
    }


def replace_section(doc: Path, begin: str, end: str, md: str) -> None:
    """Replace the text between the ``begin`` and ``end`` lines of ``doc`` with ``md``
    (the markers are appended when absent, the file created when missing)."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if begin not in text or end not in text:
        text = text.rstrip("\n") + "\n\n" + begin + "\n" + end + "\n"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(head + begin + "\n" + md + end + tail)


class WrappedCollectives:
    """Replaces ``torch.distributed``'s collectives in this process by ``self._wrap(name, fn)``
    until :meth:`uninstall`; subclasses record what they need while ``active``."""

    def __init__(self):
        self.active = False
        self._saved = {}

    def install(self) -> None:
        import torch.distributed as dist

        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None and name not in self._saved:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(name, fn))

    def uninstall(self) -> None:
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved = {}

    def _wrap(self, name, fn):
        raise NotImplementedError
