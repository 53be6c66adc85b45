"""The layout check carried by a reduce bucket: stage 2's steady backward makes no collective of its own for it.

[Note: the check rides a bucket]
Stage 2's layout check ([Note: the check at a backward] in _params.py) needs two bits from every rank as a
backward starts: whether this rank changed (its trainable set or shapes, a load, ``refresh_trainable()``), and
whether its presence flags are partial (a grad this backward will not bring, or a reentrant region that may not
bring it). A steady rank changes nothing, so it need not wait for the answer, only hear it before the step. So
the bits ride the first reduce bucket of the plan that has more than one grad (the *carrier*; a one-grad bucket
may be reduced in the grad's own storage, which has no room): each rank's range of that bucket ends with
:data:`HEADER` more elements, and every rank writes its two bits into every rank's header. The reduce-scatter
leaves each rank the sum of every rank's bits (the mean, for a bucket divided after the sum), and the step reads
it from host memory (:class:`Heard`): on the CPU a ``ctypes`` read, nothing waits; on an accelerator the copy is
queued after the bucket's reduction and the step's start waits for that (the first bucket of the backward).

Element ``x`` of rank ``r``'s range moves to ``x + HEADER * r``: the ranges keep their order and stay equal
where they were equal (NCCL's reduce-scatter needs that), and a grad that straddles two ranks is copied in two
parts (at most N - 1 per bucket). The shard of the carrier holds the header after this rank's elements; what
the step, clipping and unscaling see stops before it.

A rank that changed cannot wait for its backward's carrier: it would send buckets the others do not expect.
It reduce-scatters the last agreed plan's buckets up to the carrier at once, zeros and its bits (:func:`probe`):
they pair with the steady ranks' first reductions. If every rank changed, every rank is there, and the check
runs as a blocking all-reduce as before; otherwise this rank mirrors the agreed plan from the bucket after the
carrier, and every rank raises the same error at the step (the steady ranks hear the change in their header).
The check keeps its all-reduce where no bucket carries it: the first backward, one rank, a plan of one-grad
buckets, several reducers over one module (their reductions run at the end of the backward, interleaved).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from .._comm import Comm, early_divisor
from .._heard import HEADER, Heard, counts
from .._layout import BufferPlan


@dataclass(frozen=True)
class Carrier:
    """The carrier's geometry on this rank: ``bucket``, its ``size`` and rank ``bounds`` with the headers;
    ``gaps``: what no grad covers (headers and padding included), zeroed as the bucket is taken; ``parts[i]``:
    ((bucket offset, offset in the grad, numel), ...) of param i; ``heads``: each rank's header;
    ``shard``: this rank's range with its header."""

    bucket: int
    size: int
    bounds: tuple[int, ...]
    gaps: tuple[tuple[int, int], ...]
    parts: dict
    heads: tuple[int, ...]
    shard: int


def carrier_of(buffers: tuple[BufferPlan, ...], rank: int, world_size: int) -> Carrier | None:
    """The carrier of a plan's ``buffers`` (None where none can carry: one rank, or no bucket with two grads)."""
    if world_size == 1:
        return None
    k = next((b for b, buf in enumerate(buffers) if len(buf.slots) > 1), None)
    if k is None:
        return None
    bounds = buffers[k].bounds
    inner = bounds[1:-1]
    parts, covered = {}, []
    for s in buffers[k].slots:
        pieces, at = [], s.offset
        while at < s.offset + s.numel:
            r = bisect.bisect_right(inner, at)  # the rank whose range holds ``at``
            end = min(s.offset + s.numel, bounds[r + 1])
            pieces.append((at + HEADER * r, at - s.offset, end - at))
            covered.append((at + HEADER * r, end + HEADER * r))
            at = end
        parts[s.index] = tuple(pieces)
    size = bounds[-1] + HEADER * world_size
    gaps, at = [], 0
    for a, z in sorted(covered) + [(size, size)]:
        if a > at:
            gaps.append((at, a))
        at = max(at, z)
    moved = tuple(b + HEADER * r for r, b in enumerate(bounds))
    return Carrier(k, size, moved, tuple(gaps), parts, tuple(b - HEADER for b in moved[1:]),
                   moved[rank + 1] - moved[rank])


def write_flags(bucket: torch.Tensor, b: int, carrier: Carrier | None, flags: tuple[int, int]) -> None:
    """This rank's bits into every rank's header of ``bucket`` (number ``b``; zeroed as it was taken), where it
    is the carrier."""
    if carrier is None or carrier.bucket != b or not any(flags):
        return
    for at in carrier.heads:
        for j, v in enumerate(flags):
            if v:
                bucket[at + j].fill_(v)


@dataclass(frozen=True)
class Probed:
    """What a changed rank heard from its :func:`probe`: how many ranks changed, of ``world_size``."""

    changed: int
    world_size: int

    @property
    def same(self) -> bool:
        return self.changed == 0

    anyone = False

    @property
    def everyone(self) -> bool:
        return self.changed == self.world_size

    extra = True

    def wait(self) -> None:
        pass

    def settle(self) -> None:
        pass


def probe(comm: Comm, plan) -> Probed:
    """A rank that changed, as its backward starts: reduce-scatter ``plan``'s buckets up to its carrier (the last
    agreed plan's), zeros and this rank's bits; they pair with the steady ranks' first reductions. Collective;
    read at once (a change is a cold path)."""
    c = plan.carrier
    for b in range(c.bucket + 1):
        spec = plan.layout.buffers[b]
        carried = b == c.bucket
        buf = torch.zeros(c.size if carried else plan.sizes[b], dtype=spec.dtype, device=torch.device(spec.device))
        write_flags(buf, b, c, (1, 1))
        comm.reduce_scatter_(buf, c.bounds if carried else spec.bounds,
                             divided=early_divisor(spec.dtype, comm.world_size) > 1).wait()
    end = c.bounds[comm.rank + 1]
    changed, _ = counts(buf[end - HEADER : end].float().tolist(), buf.dtype, comm.world_size)
    return Probed(changed, comm.world_size)


class Carrying:
    """A reducer's side of the carried check: what its carriers' reductions left (:attr:`heard`), and, for one
    backward, the plan last agreed whose buckets a :meth:`probe` reduces."""

    def __init__(self, comm: Comm):
        self.heard = Heard(comm)
        self._comm, self._plan = comm, None

    def over(self, plan) -> "Carrying":
        """This backward's check is carried by ``plan``'s carrier (the plan last agreed)."""
        self._plan = plan
        return self

    def probe(self) -> Probed:
        """See :func:`probe`."""
        return probe(self._comm, self._plan)
