"""Test seams: stand-ins that make a race CPU gloo hides visible.

:func:`delay_param_receives` makes the parameter sync's received data visible only when
its wait runs, as a compute stream sees NCCL's work on another stream: the sync receives
into a private copy of the buffer, and the wait copies it into the buffer. Until then
the buffer holds this rank's own fresh range and the other ranks' ranges from before
the step.
"""

from __future__ import annotations


class _Delayed:
    def __init__(self, pending, private, buffer):
        self._pending, self._private, self._buffer = pending, private, buffer

    def wait(self):
        result = self._pending.wait() if self._pending is not None else None
        private, self._private = self._private, None
        if private is not None:
            self._buffer.copy_(private)
        return result

    @property
    def done(self) -> bool:
        return self._private is None

    def holds(self, param) -> bool:
        """Whether ``param`` (a bucket view) lies in this sync's buffer."""
        return param.untyped_storage().data_ptr() == self._buffer.untyped_storage().data_ptr()


def delay_param_receives(comm) -> list:
    """Wrap ``comm.sync_buffer`` (async calls only) on this instance; returns the list of
    delayed syncs started so far (for assertions)."""
    real = comm.sync_buffer
    started: list = []

    def delayed(buffer, bounds, *, async_op=False):
        if not async_op:
            return real(buffer, bounds)
        private = buffer.clone()
        pending = real(private, bounds, async_op=True)
        out = _Delayed(pending, private, buffer)
        started.append(out)
        return out

    comm.sync_buffer = delayed
    return started
