"""Stage 2's bucket plan: which params share a reduce bucket, in what order, and where each
param's grad lies in its bucket and in this rank's shard. Pure (no process group, the same on every
rank); :class:`CurrentPlan` keeps the plan of the params as they are now."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._engine import grad_accumulator, will_run_each
from .._layout import Layout, plan_layout
from .carrier import Carrier, carrier_of

DEFAULT_BUCKET_CAP_MB = 25.0  # DDP's default
MAX_IN_FLIGHT = 2  # buckets being reduce-scattered at once (see the note)
GRAD_ACCUM_DTYPES = ("auto", "fp32", "param")  # [Note: what stage 2 accumulates in]
AUTO_GRAD_ACCUM_DTYPE = "param"


def buckets_in_flight(reduce_scatter_by: str) -> int:
    """How many buckets a reducer keeps being reduce-scattered at once on a comm that reduce-scatters
    ``reduce_scatter_by``: one where the reduce-scatters take turns with the receive scratch (point to point,
    all-to-all: [Note: reduce-scatter scratch] in _comm.py), :data:`MAX_IN_FLIGHT` with NCCL's own."""
    return MAX_IN_FLIGHT if reduce_scatter_by == "reduce_scatter" else 1


def accumulate_dtype(choice: str, stage: int) -> torch.dtype | None:
    """The reducer's ``accumulate_dtype`` for ``grad_accum_dtype=choice`` (float32, or None: the
    grads' own dtype); a clear ``ValueError`` for anything else, or for a choice under stage 1."""
    if not isinstance(choice, str) or choice not in GRAD_ACCUM_DTYPES:
        raise ValueError(f"grad_accum_dtype must be one of {GRAD_ACCUM_DTYPES}, got {choice!r}")
    if stage != 2 and choice != "auto":
        raise ValueError(f"grad_accum_dtype={choice!r} is a stage=2 option (stage 1 accumulates as DDP does, in "
                         "the grads' dtype): pass stage=2 or leave grad_accum_dtype='auto'")
    resolved = AUTO_GRAD_ACCUM_DTYPE if choice == "auto" else choice
    return torch.float32 if resolved == "fp32" else None


def shard_dtype(accumulate_dtype: torch.dtype | None, bucket_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the shards of a bucket of ``bucket_dtype`` (:func:`accumulate_dtype`'s float32
    widens 16-bit ones only): [Note: what stage 2 accumulates in]."""
    return torch.float32 if accumulate_dtype == torch.float32 and bucket_dtype.itemsize < 4 else bucket_dtype


def plan_buckets(specs, cap_bytes: int, order=None) -> tuple[tuple[int, ...], ...]:
    """The trainable params' indices in ``order`` (every index once; default: last first), cut into
    buckets of at most ``cap_bytes`` (a larger param alone), each of one (device, dtype). Pure: the
    same on every rank."""
    buckets: list[list[int]] = []
    key, size = None, 0
    for i in reversed(range(len(specs))) if order is None else order:
        s = specs[i]
        if not s.trainable or s.numel == 0:
            continue
        nbytes = s.numel * s.dtype.itemsize
        if not buckets or (s.device, s.dtype) != key or size + nbytes > cap_bytes:
            buckets.append([])
            key, size = (s.device, s.dtype), 0
        buckets[-1].append(i)
        size += nbytes
    return tuple(tuple(b) for b in buckets)


def backward_order(table, module_ref) -> list[int]:
    """The optimizer's params, last first, in the bound module's registration order, as DDP orders
    its buckets: about the order a backward finishes them. Not the optimizer's order: Trainer's
    param groups (decay, then no-decay) would put every layer's biases and norms, down to the first
    layer's, in the first bucket, and every later bucket would wait for it until the end of the
    backward (a whole gradient alive at once: 16 of GPT-2 124M's 17 buckets). Params the module
    does not hold (or every param, before ``bind``) come last, last first."""
    module = module_ref() if module_ref is not None else None
    order = [] if module is None else list(dict.fromkeys(i for i in map(table.index, module.parameters()) if i is not None))
    order.reverse()
    placed = set(order)
    return order + [i for i in reversed(range(len(table.params))) if i not in placed]


@dataclass(frozen=True)
class Plan:
    """One layout as the reducer uses it; ``where[i]``: (buffer, offset, numel) of param i;
    per buffer (in bucket order): its reduced size, bounds, and this rank's range in it. The ``carrier``'s
    size and gaps are its own ([Note: the check rides a bucket] in carrier.py); ``where`` and ``owned`` are
    the bucket's as planned."""

    layout: Layout
    where: dict
    sizes: tuple[int, ...]
    owned: tuple[tuple[int, int], ...]
    gaps: tuple[tuple[tuple[int, int], ...], ...]  # per buffer: the ranges no slot covers (alignment)
    pieces: tuple = ()  # this rank's pieces of the layout (``Layout.pieces``)
    carrier: Carrier | None = None
    put: dict = field(default_factory=dict)  # ``where``, offsets in the bucket as reduced (-1: in the carrier's parts)

    def carries(self, b: int) -> bool:
        """Whether bucket ``b`` is the carrier."""
        return self.carrier is not None and self.carrier.bucket == b

    def bounds(self, b: int) -> tuple[int, ...]:
        """Bucket ``b``'s rank bounds as it is reduced."""
        return self.carrier.bounds if self.carries(b) else self.layout.buffers[b].bounds


def plan_of(layout: Layout, rank: int) -> Plan:
    where, sizes, owned, gaps = {}, [], [], []
    for b, buf in enumerate(layout.buffers):
        end = max(s.offset + s.numel for s in buf.slots)
        for s in buf.slots:
            where[s.index] = (b, s.offset, s.numel)
        sizes.append(end)
        owned.append((min(buf.bounds[rank], end), min(buf.bounds[rank + 1], end)))
        covered, at, holes = sorted((s.offset, s.offset + s.numel) for s in buf.slots), 0, []
        for a, z in covered:
            if a > at:
                holes.append((at, a))
            at = max(at, z)
        gaps.append(tuple(holes))
    carrier, put = carrier_of(layout.buffers, rank, layout.world_size), where
    if carrier is not None:
        sizes[carrier.bucket], gaps[carrier.bucket] = carrier.size, carrier.gaps
        put = {i: (b, -1 if len(parts) > 1 else parts[0][0], n) if (parts := carrier.parts.get(i)) else (b, o, n)
               for i, (b, o, n) in where.items()}
    return Plan(layout, where, tuple(sizes), tuple(owned), tuple(gaps), tuple(layout.pieces(rank)), carrier, put)


_DATA_PTR, _NUMEL = torch.Tensor.data_ptr, torch.Tensor.numel


class CurrentPlan:
    """The plan of the optimizer's params as they are now (``table``: a callable returning its ParamTable),
    made again only when their specs or the bucket cap changed, with each planned param's AccumulateGrad
    node (what tells which params a backward will reach)."""

    def __init__(self, table, shard: str, world_size: int, rank: int):
        self._table, self._shard, self._world_size, self._rank = table, shard, world_size, rank
        self.plan: Plan | None = None
        self.accumulators: dict = {}  # param index -> its AccumulateGrad node
        self._order: tuple = ((), (), ())  # the planned params in ``where``'s order, their nodes, the count per bucket
        self._key = None  # (the specs, the cap) the plan follows
        self._quick = None  # (a cheap key of the table's params, the key it gave)

    def forget(self) -> None:
        """Plan again at the next :meth:`current` (a bind or unbind changes the module's order)."""
        self._key, self.accumulators, self._order = None, {}, ((), (), ())

    def current(self, module_ref, cap_bytes: int) -> tuple[Plan, bool]:
        """(the plan now, whether it was made anew). A plan whose build raises leaves this as it was."""
        table = self._table()  # the quick key: what the specs follow, read without making a ParamSpec per param
        quick = (table, table.mask(), tuple(map(_DATA_PTR, table.params)), tuple(map(_NUMEL, table.params)), cap_bytes)
        if self._quick is not None and self._quick[1] is self._key and quick == self._quick[0]:
            return self.plan, False
        specs = table.specs()
        key, changed = (tuple(specs), cap_bytes), False
        if key != self._key:
            layout = plan_layout(specs, world_size=self._world_size, shard=self._shard,
                                 buckets=plan_buckets(specs, cap_bytes, backward_order(table, module_ref)))
            plan, params = plan_of(layout, self._rank), table.params
            accumulators = {i: grad_accumulator(params[i]) for i in plan.where}  # before anything changes
            self.plan, self._key, self.accumulators, changed = plan, key, accumulators, True
            counts = [0] * len(plan.sizes)
            for b, _, _ in plan.where.values():
                counts[b] += 1
            self._order = (tuple(plan.where), tuple(accumulators.values()), tuple(counts))
        self._quick = (quick, self._key)
        return self.plan, changed

    def reach(self) -> tuple[list[int], set[int], list[int]]:
        """What the running backward will reach of :attr:`plan` (as :meth:`current` last found it): per bucket,
        how many of its params; the params it will reach; those it will not. Only inside a backward pass."""
        order, nodes, counts = self._order
        reached = will_run_each(nodes)
        if all(reached):  # a steady backward: every planned param, nothing to count one by one
            return list(counts), set(order), []
        left, pending, unreached, where = [0] * len(counts), set(), [], self.plan.where
        for i, here in zip(order, reached):
            if here:
                left[where[i][0]] += 1
                pending.add(i)
            else:
                unreached.append(i)
        return left, pending, unreached

