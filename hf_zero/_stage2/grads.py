"""The grads the step, clipping and a GradScaler read: this rank's averaged shards.

:meth:`Reducer.sharded` hands the step and clipping this rank's averaged
grads (:class:`ShardedGrads`). A param no rank got a grad for since the last step has
none (DDP's ``find_unused_parameters`` leaves it None too; the optimizer skips it):
one small all-reduce after a backward agrees on that, folded into clipping's norm or a
GradScaler's inf check where there is one ([Note: agreeing on presence]). The step
consumes the shards (as ``zero_grad`` would).

[Note: a forward without its backward] A rank whose loss does
not come from the bound module's outputs runs none of the reducer in its backward, while
the other ranks' backwards wait for its reduce-scatters (DDP hangs the same way), and so
does a rank that skips the model altogether before stepping. Each rank records whether a
backward armed since the last step (and whether a forward ran, for the message):
clipping, ``unscale_`` or the step raise on a rank where none armed, naming the cause, so
that rank fails at once (and a launcher stops the rest) instead of every rank waiting for
the collective timeout. It costs a flag per forward and backward, no collective; it also
refuses, on every rank alike, a step with no backward since the last one, which DDP
allows as a no-op.

:meth:`Reducer.unscale_` unscales the shards and agrees on inf/NaN over
every rank's shard (one MAX all-reduce), for a GradScaler routed to it
([Note: GradScaler over sharded grads] in integrations/amp.py). When the scaler then
skips the step, the next backward drops the unscaled shards first, as a step would.
"""

from __future__ import annotations

from typing import Callable

import torch

from .._comm import Comm
from .._layout import Piece
from .plan import Plan


class SinceStep:
    """This rank's record since the last step: which params had a grad here (``touched``) and the set
    agreed over ranks (``agreed``, None until agreed: [Note: agreeing on presence]); whether a forward
    of the bound module whose backward should sync ran (``forwarded``), and whether a backward armed."""

    def __init__(self, agreed: frozenset | None = None):
        self.touched: set[int] = set()
        self.agreed = agreed
        self.forwarded = self.armed = False
        self.dropped: set[int] = set()  # params whose grad this rank dropped since the last backward's check

    def check_answered(self) -> None:
        """[Note: a forward without its backward] Raise if no backward went through the bound module's
        outputs since the last step: other ranks' backwards may be waiting for this rank's reduce-scatters."""
        if not self.armed:
            raise RuntimeError(
                ("hf_zero stage 2: the bound model ran a forward on this rank since the last step, but no backward "
                 "went through its outputs: the loss here does not come from the model's outputs (or its backward "
                 "was skipped)" if self.forwarded else
                 "hf_zero stage 2: no backward through the bound model's outputs on this rank since the last step "
                 "(or zero_grad())") +
                ", while other ranks' backwards may wait for this rank's gradients. Compute every rank's loss "
                "from the bound model's outputs and call backward on it before clipping or the step"
            )

    def flags(self, count: int, dtype: torch.dtype, device, plan: Plan) -> torch.Tensor:
        """This rank's 0/1 flag per param (``count`` of them): an all-reduce's SUM or MAX of them is
        positive exactly where some rank had a grad. Where every param of ``plan`` had one here (a steady
        step), a copy of flags made once, on the device: nothing is copied from the host."""
        if self.full(plan):
            return self._full(count, dtype, device, plan).clone()
        return _flags_of(sorted(self.touched), count, dtype, device)

    def coming(self, coming: set[int], count: int, device, plan: Plan) -> torch.Tensor:
        """The int64 presence flags this rank will have once a backward whose grads ``coming`` arrive ends (what
        its check carries: [Note: the check at a backward] in _params.py). A steady backward's (every param of
        ``plan``) are made once, on the device."""
        self.dropped = set()
        if len(coming) == len(plan.where):
            return self._full(count, torch.int64, device, plan)
        return _flags_of(sorted(self.touched | coming), count, torch.int64, device)

    def _full(self, count: int, dtype: torch.dtype, device, plan: Plan) -> torch.Tensor:
        key = (id(plan), count, dtype, str(device))
        made = _FULL.get(key)
        if made is None:
            if any(kept is not plan for kept, _ in _FULL.values()):
                _FULL.clear()  # made for another plan
            made = _FULL[key] = (plan, _flags_of(sorted(plan.where), count, dtype, device))
        return made[1]

    def full(self, plan: Plan) -> bool:
        """Whether every param of ``plan`` had a grad on this rank (then some rank had each, no rank any
        other: the ranks agreed on the layout)."""
        return len(self.touched) == len(plan.where)

    def settle(self, reduced: torch.Tensor | None, plan: Plan) -> None:
        """Agree from ``reduced`` (the flags' all-reduce), read on the host only where this rank missed
        a grad: otherwise every param of ``plan`` had one (:meth:`full`), with no read."""
        if self.full(plan):
            self.agreed = frozenset(self.touched)
        else:
            self.agreed = frozenset((reduced > 0).nonzero().flatten().tolist()) - self.dropped

    def drop(self, i: int) -> None:
        """Param ``i`` has no grad since the step (on this rank; agreed ones too)."""
        self.touched.discard(i)
        self.dropped.add(i)
        if self.agreed is not None:
            self.agreed = self.agreed - {i}


_FULL: dict = {}  # (its plan's id, count, dtype, device) -> (the plan, the flags of its every param): the last plan's


def _flags_of(touched: list[int], count: int, dtype: torch.dtype, device) -> torch.Tensor:
    flags = torch.zeros(count, dtype=dtype, device=device)
    if touched:
        flags[touched] = 1
    return flags


class ShardedGrads:
    """This rank's averaged grads since the last step, per piece of :attr:`layout`: :meth:`held`,
    the 1-D slice of the shard holding its elements (exact zeros where no rank had a grad), and,
    once :meth:`agree` settled which params some rank had a grad for, ``self(piece)``: that
    slice, or None where no rank had one (the step skips those, as torch's optimizers skip a
    param whose grad DDP left None).

    [Note: agreeing on presence]
    Which params had a grad on some rank is one small all-reduce of a flag per param. A step
    that clips needs the norm's all-reduce anyway, and the norm reads :meth:`held` (the zeros
    of params no rank had a grad for add nothing to it, nor does scaling them change them:
    every rank's bucket slot of a grad that never came is zeroed before it is reduced): so
    the flags ride in the norm's all-reduce (:meth:`all_reduce_along`), as they do in a
    GradScaler's inf check, and the step finds them agreed. Otherwise they ride the step's
    layout check ([Note: the layout check] in _params.py; :meth:`agree` with ``reduced``); where a
    reduce bucket carries the check, it carries one bit of them instead, whether some rank's were
    partial ([Note: the check rides a bucket] in carrier.py): where none was, the answer is every
    param of the plan; else the step agrees with an all-reduce of its own. A rank
    that had a grad for every param of the plan knows the answer (all of them) and reads nothing
    on the host; only a rank that missed one reads the reduced flags."""

    def __init__(self, plan: Plan, shards: list, since: SinceStep, comm: Comm, count: int):
        self.layout, self.device = plan.layout, comm.device
        self.pieces: list[Piece] = list(plan.pieces)
        self._plan, self._shards, self._since, self._comm, self._count = plan, shards, since, comm, count

    def held(self, piece: Piece) -> torch.Tensor | None:
        shard = self._shards[piece.buffer] if self._shards else None
        if shard is None:
            return None
        start = piece.offset - self._plan.owned[piece.buffer][0]
        return shard[start : start + piece.numel]

    def span(self, pieces, params: frozenset) -> torch.Tensor | bool | None:
        """One 1-D slice of the shard for ``pieces``, back to back in one buffer (a run's: [Note: runs] in
        _runs.py), where some rank had a grad for each of their ``params`` (their indices); None where for none;
        False where for some only."""
        agreed = self._since.agreed
        if agreed is None:
            raise RuntimeError("hf_zero: ShardedGrads read before the ranks agreed on which params have grads")
        if not params <= agreed:
            return None if params.isdisjoint(agreed) else False
        first, last = pieces[0], pieces[-1]
        head = self.held(first)
        if head is None:
            return None
        return head.as_strided((last.offset + last.numel - first.offset,), (1,))

    def __call__(self, piece: Piece) -> torch.Tensor | None:
        if self._since.agreed is None:
            raise RuntimeError("hf_zero: ShardedGrads read before the ranks agreed on which params have grads")
        return self.held(piece) if piece.index in self._since.agreed else None

    def has(self, i: int) -> bool:
        """Whether some rank had a grad for param ``i`` since the step (once agreed)."""
        if self._since.agreed is None:
            raise RuntimeError("hf_zero: ShardedGrads read before the ranks agreed on which params have grads")
        return i in self._since.agreed

    def all_reduce_along(self, scalar: torch.Tensor, *, op: str, what: str) -> torch.Tensor:
        """``scalar`` (0-dim) all-reduced with ``op`` ("sum" or "max"), with the presence flags riding
        along until they are agreed (either op marks presence). Collective (one small all-reduce)."""
        if self._since.agreed is not None:
            return self._comm.all_reduce_(scalar, op=op, what=what)
        flags = self._since.flags(self._count, scalar.dtype, self._comm.device, self._plan)
        both = self._comm.all_reduce_(torch.cat([scalar.reshape(1), flags]), op=op, what=what)
        self._since.settle(both[1:], self._plan)
        return both[0]

    def presence_flags(self) -> torch.Tensor | None:
        """This rank's presence flags (int64) for another all-reduce (MAX) to carry, or None where agreed already:
        the step's layout check carries them ([Note: the layout check] in _params.py)."""
        if self._since.agreed is not None:
            return None
        return self._since.flags(self._count, torch.int64, self._comm.device, self._plan)

    def agree(self, reduced=None) -> "ShardedGrads":
        """Agree on which params have grads, unless done already. Collective (one small all-reduce, or none);
        ``reduced``: a callable giving :meth:`presence_flags` MAX-reduced over ranks, carried by another all-reduce."""
        if self._since.agreed is None:
            if reduced is not None:
                self._since.settle(None if self._since.full(self._plan) else reduced(), self._plan)
                return self
            flags = self._since.flags(self._count, torch.float32, self._comm.device, self._plan)
            self._since.settle(self._comm.all_reduce_(flags, op="max", what="agreeing on which params have gradients"),
                               self._plan)
        return self

class Shards:
    """This rank's averaged grads since the last step: per buffer of the plan they follow (:attr:`plan`), its
    owned range (None until a reduction writes it), which buffers were written, and the record
    (:class:`SinceStep`)."""

    def __init__(self):
        self.plan: Plan | None = None
        self.tensors: list = []
        self.carried: torch.Tensor | None = None  # the carrier's shard with its header
        self.written: set[int] = set()
        self.since = SinceStep()

    def follow(self, plan: Plan) -> None:
        """Reductions of ``plan`` come: shards of an older plan are dropped."""
        if self.plan is not plan:
            self.tensors, self.plan, self.carried = [None] * len(plan.sizes), plan, None

    def shard(self, b: int, dtype: torch.dtype, device) -> torch.Tensor:
        """What buffer ``b``'s reduction writes: its shard, allocated (not zeroed) at its first use since the
        step; the carrier's with its header after it ([Note: the check rides a bucket] in carrier.py)."""
        carried = self.plan.carries(b)
        if self.tensors[b] is None:
            lo, hi = self.plan.owned[b]
            if carried:
                self.carried = torch.empty(self.plan.carrier.shard, dtype=dtype, device=device)
                self.tensors[b] = self.carried[: hi - lo]
            else:
                self.tensors[b] = torch.empty(hi - lo, dtype=dtype, device=device)
        return self.carried if carried else self.tensors[b]

    def written_tensors(self) -> list:
        """The shards written since the step, in buffer order (the same buffers on every rank)."""
        return [self.tensors[b] for b in sorted(self.written)] if self.plan is not None else []

    def nbytes(self) -> int:
        return sum(s.untyped_storage().nbytes() for s in self.tensors if s is not None)

    def zero(self, i: int) -> None:
        """Zero param ``i``'s elements in this rank's shards."""
        plan = self.plan
        if plan is not None and i in plan.where:
            b, offset, numel = plan.where[i]
            lo, hi = plan.owned[b]
            a, z = max(offset, lo), min(offset + numel, hi)
            if a < z and self.tensors[b] is not None:
                self.tensors[b][a - lo : z - lo].zero_()

    def read(self, current: Callable[[], Plan], comm: Comm, count: int) -> ShardedGrads:
        """The grads for the step (``current()``: the reducer's plan now, asked for only when nothing was reduced)."""
        if self.plan is None or not self.written:  # the same on every rank: nothing to agree on
            return ShardedGrads(current(), [], SinceStep(frozenset()), comm, count)
        return ShardedGrads(self.plan, self.tensors, self.since, comm, count)

    def clear(self) -> None:
        """The step consumed them (or ``zero_grad``): let them go."""
        self.written.clear()
        self.tensors, self.carried = [None] * len(self.tensors), None
        self.since = SinceStep()


def unscale(grads: ShardedGrads, shards: list, inv_scale: torch.Tensor, found_inf: torch.Tensor, *,
            allow_fp16: bool) -> None:
    """The body of :meth:`Reducer.unscale_` over the ``shards`` written since the step."""
    if not allow_fp16 and any(s.dtype == torch.float16 for s in shards):
        raise ValueError("Attempting to unscale FP16 gradients.")  # torch's GradScaler.unscale_, word for word
    local = _unscaled_non_finite(shards, inv_scale, grads.device)
    # the step's agreement rides along: [Note: agreeing on presence]
    local = grads.all_reduce_along(local, op="max", what="agreeing on non-finite gradients (GradScaler)")
    found_inf.copy_(torch.maximum(found_inf, local.to(found_inf.device)))


def _unscaled_non_finite(shards: list, inv_scale: torch.Tensor, device) -> torch.Tensor:
    """Multiply each shard by ``inv_scale``; 1.0 (float32, on ``device``) if any held an inf or NaN before."""
    flags = []
    for shard in shards:
        if shard.numel():  # checked before unscaling, as torch's kernel does
            flags.append(torch.isfinite(shard).all().logical_not().to(device))
            shard.mul_(inv_scale.to(shard.device))
    return torch.stack(flags).any().float() if flags else torch.zeros((), dtype=torch.float32, device=device)
