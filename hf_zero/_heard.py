"""A layout check's bits carried by a reduce bucket, as the bucket's reduction left them: read from host memory,
with no tensor read ([Note: the check rides a bucket] in _stage2/carrier.py; stage 1's in _scatter_hook.py).

Every rank writes its bits into every rank's :data:`HEADER` (a few elements at the end of each rank's range of the
bucket), so the reduce-scatter leaves each rank the sum over ranks: how many ranks set each bit (the mean, for a
bucket divided after the sum)."""

from __future__ import annotations

import ctypes

import torch

from ._comm import Comm, early_divisor

HEADER = 2  # elements at the end of each rank's range of a carrier: [changed, partial]


def counts(values, dtype: torch.dtype, world_size: int) -> tuple[int, ...]:
    """How many ranks set each bit, from a header reduced in ``dtype``: bits are written whole, and buckets of
    dtypes that are divided before the sum are divided where their grads are written, not their headers; others
    are divided after the sum (a mean)."""
    scale = 1 if early_divisor(dtype, world_size) > 1 else world_size
    return tuple(round(v * scale) for v in values)


class Heard:
    """A carrier's header as this rank's last reduction of it left it, read with no tensor read (an
    :class:`~hf_zero._comm.Agreement`'s reading side: ``same``, ``anyone``, ``everyone``, ``extra``; and
    :attr:`changed`, how many ranks changed)."""

    def __init__(self, comm: Comm):
        self._comm = comm
        self._host = None  # float32 (pinned on an accelerator), with a ctypes view
        self._event, self._dtype = None, torch.float32

    def capture(self, header: torch.Tensor, reduced_in: torch.dtype) -> None:
        """``header``: the reduced header (its reduction waited for, on the current stream) of a bucket of
        dtype ``reduced_in``."""
        if self._host is None:
            self._host = torch.zeros(HEADER, dtype=torch.float32, pin_memory=header.device.type == "cuda")
            self._view = (ctypes.c_float * HEADER).from_address(self._host.data_ptr())
        self._dtype = reduced_in
        if header.device.type == "cpu":
            self._host.copy_(header)
        else:
            self._host.copy_(header.float(), non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def _read(self) -> tuple[int, ...]:
        if self._host is None:
            return (0,) * HEADER
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return counts(self._view, self._dtype, self._comm.world_size)

    @property
    def changed(self) -> int:
        """How many ranks changed."""
        return self._read()[0]

    @property
    def same(self) -> bool:
        """No rank changed."""
        return self.changed == 0

    anyone = False
    everyone = False

    @property
    def extra(self) -> bool:
        """Some rank's presence flags were partial."""
        return self._read()[1] > 0

    def wait(self) -> None:
        pass

    def settle(self) -> None:
        pass
