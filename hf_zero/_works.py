"""How long hf_zero keeps the work objects of its collectives, and waiting on them.

[Note: no Python on communication threads]
A gloo worker thread that drops the last reference to a work object frees its
tensors, and freeing a tensor Python knows takes the GIL; so does running a
``Future.then`` callback. While the interpreter is finalizing, a thread taking the GIL
is ended and C++ aborts the process ("terminate called without an active exception";
seen with ``gdb`` in ``ProcessGroupGloo::runLoop`` freeing an ``AsyncBroadcastWork``,
cf. pytorch/pytorch#179291). So nothing of hf_zero runs on a backend's threads (results
are finished by whoever waits, :class:`Pending`), and on gloo the work objects of
hf_zero's collectives are kept from their start (:func:`keep`), waited for or not: a
worker thread never holds the last reference at exit. The early releases:
:func:`let_go_completed` inside a rebuild, mid-run, where a worker thread that frees a work
takes the GIL as any thread may; :func:`let_go_settled` at the end of a run, after giving the
worker threads a moment to let go first.
"""

from __future__ import annotations

import ctypes
import time
from datetime import timedelta
from typing import Any, Callable


class named:
    """``with named(op, rank):`` says which hf_zero operation a failed or timed-out collective belonged to (a
    class rather than a generator: it is entered several times a step, and costs a fifth as much)."""

    __slots__ = ("_op", "_rank")

    def __init__(self, op: str, rank: int):
        self._op, self._rank = op, rank

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if kind is not None and issubclass(kind, RuntimeError):
            raise RuntimeError(f"hf_zero: collective for {self._op} failed on rank {self._rank}: {error}") from error
        return False


class Pending:
    """Collectives in flight. :meth:`wait` waits, runs ``finish`` (on the calling thread)
    the first time and returns its result; later calls return the same result at once."""

    def __init__(self, works: list, what: str, rank: int, finish: Callable[[], Any] | None = None):
        self._works, self._what, self._rank, self._finish = works, what, rank, finish
        self._result: Any = None

    def wait(self, timeout_s: float | None = None) -> Any:
        works, self._works = self._works, []
        finish, self._finish = self._finish, None
        with named(self._what, self._rank):
            for w in works:
                w.wait() if timeout_s is None else w.wait(timedelta(seconds=timeout_s))
        if finish is not None:
            self._result = finish()
        return self._result

    @property
    def done(self) -> bool:
        return not self._works and self._finish is None


class _KeptWorks:
    """The work objects of hf_zero's gloo collectives, kept from their start until a sweep
    at least ``_SWEEP_S`` seconds after one first found them completed: a worker thread
    lets go of a work a moment after completing it (see the module note), whether or
    not anybody waited. Never freed itself, so whatever it holds at interpreter exit (every
    collective still running and every one completed in the last second or two) stays
    held through finalization. Sweeps run when collectives start, on the caller's thread."""

    def __init__(self):
        self._running: list = []
        self._completed: list = []  # found completed at the last sweep; let go at the next
        self._swept = time.monotonic()

    def add(self, works: list) -> None:
        self._running.extend(works)
        now = time.monotonic()
        if now - self._swept >= _SWEEP_S:
            running, completed = [], []
            for w in self._running:
                (completed if w.is_completed() else running).append(w)
            self._running, self._completed = running, completed  # the previous sweep's completed go
            self._swept = now

    def held_completed(self) -> int:
        """How many works held here have completed (the tensors they reference are still alive)."""
        return len(self._completed) + sum(1 for w in self._running if w.is_completed())

    def let_go_completed(self) -> None:
        """Let go now of every completed work (and so of its tensors), not at a later sweep."""
        self._running = [w for w in self._running if not w.is_completed()]
        self._completed = []


_SWEEP_S = 1.0
_KEPT = _KeptWorks()
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_KEPT))  # immortal: see _KeptWorks


def keep(works: list) -> None:
    """Hold ``works`` past their completion (gloo: see the module note)."""
    _KEPT.add(works)


def let_go_completed() -> None:
    """Stop holding the completed works, so the tensors they reference can be freed: for a
    rebuild, which must not keep the old buffers and staging alive (never called at exit,
    where a worker thread must not be left the last reference)."""
    _KEPT.let_go_completed()


def let_go_settled() -> None:
    """:func:`let_go_completed` at the end of a run (an unbind, an optimizer collected), which may come right
    before the interpreter exits: first the backends' threads get ``_SETTLE_S`` to let go of the works they
    just completed (see the module note), so that this thread frees them, not a worker at exit."""
    if _KEPT.held_completed():
        time.sleep(_SETTLE_S)
        _KEPT.let_go_completed()


_SETTLE_S = 0.05


def held_completed() -> int:
    """How many completed works are still held (and so their tensors): what :func:`let_go_completed` would free."""
    return _KEPT.held_completed()
