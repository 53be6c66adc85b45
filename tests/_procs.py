"""Commands run as a user starts them, under a hard deadline, with nothing left behind.

Each command runs in a session of its own with its output in a file (a full pipe would stall
it); every descendant seen is killed at the end, orphans included (launchers start their
workers in sessions of their own, out of reach of a kill of the launcher's process group).
A run whose outputs are complete but which is still alive ``EXIT_GRACE_S`` later is killed
and reported as hung at exit (``Result.rc`` None): what the caller then accepts is its own
call (tests/test_autoload.py, tests/test_run_clm.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

EXIT_GRACE_S = 30.0


def processes() -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, start time)} of every process (Linux /proc)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                table[int(entry)] = (int(fields[1]), fields[19])
    return table


def descendants(pid: int) -> set[tuple[int, str]]:
    """(pid, start time) of the live descendants of ``pid``."""
    table, found, frontier = processes(), set(), {pid}
    while frontier:
        frontier = {child for child, (parent, _) in table.items() if parent in frontier}
        found |= {(child, table[child][1]) for child in frontier}
    return found


@dataclass
class Run:
    proc: subprocess.Popen
    log: IO[str]  # stdout and stderr
    outputs_complete: Callable[[str], bool] | None  # given the output so far; None: judge by exit code
    seen: set[tuple[int, str]] = field(default_factory=set)  # descendants seen so far

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def kill(self) -> None:
        """SIGKILL the process, its process group and every descendant seen (orphans included)."""
        self.seen |= descendants(self.proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        table = processes()
        for pid, started in self.seen:
            if table.get(pid, (None, None))[1] == started:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.proc.wait()


@dataclass
class Result:
    rc: int | None  # None: killed while hanging at exit, EXIT_GRACE_S after its outputs were complete
    out: str
    outputs_complete: bool


def start(cmd: list[str], cwd: Path, env: dict[str, str], outputs_complete: Callable[[str], bool] | None = None) -> Run:
    """Start ``cmd`` in a session of its own, output to a temporary file."""
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    return Run(proc, log, outputs_complete)


def wait_all(runs: dict[str, Run], timeout: float) -> dict[str, Result]:
    """Results once every run has ended (one deadline for all: past it the test fails); a run whose
    outputs are complete but which is still alive EXIT_GRACE_S later is killed (rc None). In the end
    every process started is killed, also on failure."""
    deadline = time.monotonic() + timeout
    complete_since: dict[str, float] = {}
    results: dict[str, Result] = {}
    try:
        while len(results) < len(runs):
            for name, run in runs.items():
                if name in results:
                    continue
                run.seen |= descendants(run.proc.pid)
                if run.proc.poll() is not None:
                    complete = run.outputs_complete(run.output()) if run.outputs_complete else True
                    results[name] = Result(run.proc.returncode, run.output(), complete)
                elif run.outputs_complete and run.outputs_complete(run.output()):
                    if time.monotonic() - complete_since.setdefault(name, time.monotonic()) > EXIT_GRACE_S:
                        run.kill()
                        results[name] = Result(None, run.output(), True)
            if len(results) < len(runs) and time.monotonic() > deadline:
                late = {name: run.output()[-3000:] for name, run in runs.items() if name not in results}
                pytest.fail(f"not finished in {timeout} s: {sorted(late)}; output tails:\n{late}")
            time.sleep(0.2)
        return results
    finally:
        for run in runs.values():
            run.kill()
            run.log.close()
