"""Pure planning of flat buffers and per-rank ownership.

Nothing here touches a process group or a device: a layout is a function of the
parameters' sizes, dtypes, devices and trainability, the world size and the shard
mode, so every rank computes the same one and it can be tested (or planned for a
meta-device model) on a CPU.

[Note: layout]
For each (device, dtype) the trainable params are laid end to end in one flat
buffer. Rank ``r`` owns the contiguous range ``bounds[r]:bounds[r + 1]`` of each
buffer. A *piece* is the intersection of one param with one rank's range; the
owner of a piece alone keeps optimizer state for it and updates it.

- ``flat``: every range has the same length (the buffer is padded), so params may
  straddle ranks. Balance is perfect; valid for elementwise optimizers only.
- ``param``: ranges fall on param boundaries (params are grouped by owner inside
  the buffer), balanced greedily over the trainable params only.

[Note: chunked pieces]
In flat mode a piece longer than ``_MAX_PIECE_ELEMENTS`` is split into equal
chunks of at most that many elements (each but the last a multiple of the
alignment, so chunks start aligned wherever the piece does). Chunk boundaries
depend only on the piece, hence only on the layout: every rank, every rebuild and
every checkpoint sees the same pieces. Param mode keeps whole params (its optimizer
need not be elementwise).

Chunking is for CPU buffers only. Why: on CPU torch's AdamW runs its single-tensor
path and allocates temporaries as large as each tensor; above glibc's mmap
threshold every step maps and faults in fresh pages.

Measured (one process, AdamW over rank 0's range of the benchmarks'
``gpt2_embedding_heavy`` model at world size 2, one 16M-element slice of the
embedding, 7 steps, median): 102 ms as one piece, 85 ms in chunks of <= 4M
elements, 54 ms in chunks of <= 1M (rank 1, 27 pieces: 85 / 76 / 56 ms). On a GPU
(H200, ``benchmarks/gpu_local_update.py``, docs/benchmarks.md) foreach and fused
kernels process tensor lists in small blocks anyway, and 1M-element chunks only
cost: Llama-3.2-1B at N=2, fused fp32, 600 chunked pieces took 6.8 ms against
5.2 ms for its 49 whole-param pieces and 5.1 ms for one flat tensor.

[Note: bucket layout]
With ``buckets`` (the params of each DDP gradient bucket, in the bucket's order) every
bucket becomes one buffer whose slots sit at the bucket's own offsets (DDP's bucket
buffer is its params' grads concatenated, no padding), so a rank's range of the
buffer is the same range of the bucket and a reduce-scatter of the bucket leaves each
rank the averaged grads of exactly the elements it owns (Megatron-core's layout; see
docs/gradient_path.md). Params frozen now keep their place as holes (DDP still reduces
their zeros) and get no slot. ``flat`` splits the bucket into equal aligned ranges (the
buffer is padded past the bucket's end); ``param`` cuts it on param boundaries, each
bucket's cuts chosen to even out the ranks' running totals. Trainable params in no
bucket (frozen when DDP was built, so DDP never reduces them) go into extra buffers
planned as without buckets.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import torch

SHARD_MODES = ("flat", "param")

_ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)
# Third-party elementwise optimizers, matched by class name (no import needed).
_ELEMENTWISE_NAMES = frozenset({"Lion"})
# A class attribute by which an optimizer class declares itself elementwise (see is_elementwise).
ELEMENTWISE_FLAG = "hf_zero_elementwise"


def is_elementwise(optimizer_class: type) -> bool:
    """True when updating slices of a param separately equals updating the whole param
    (the condition for ``shard="flat"``): for the exact classes known to be elementwise
    (torch's SGD, Adam, AdamW, ...; a class named ``Lion``) and for a class that declares
    it in its own body, ``hf_zero_elementwise = True``. A subclass is not its base: it may
    add a per-tensor rule (a LARS-style trust ratio over SGD), so it must declare it itself."""
    if vars(optimizer_class).get(ELEMENTWISE_FLAG) is True:
        return True
    return optimizer_class in _ELEMENTWISE or optimizer_class.__name__ in _ELEMENTWISE_NAMES

# Each rank's range in flat mode starts on a multiple of this many bytes.
_ALIGN_BYTES = 64

# Longest flat-mode piece, in elements (see [Note: chunked pieces]). Read when a
# layout is planned, so tests may lower it for a process.
_MAX_PIECE_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class ParamSpec:
    """What the planner needs to know about one parameter."""

    numel: int
    dtype: torch.dtype
    device: str
    trainable: bool
    group: int = 0


@dataclass(frozen=True)
class Slot:
    """Where param ``index`` sits in its buffer."""

    index: int
    offset: int
    numel: int


@dataclass(frozen=True)
class Piece:
    """Elements ``start:stop`` of param ``index``, at ``offset`` in buffer ``buffer``."""

    index: int
    buffer: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class BufferPlan:
    device: str
    dtype: torch.dtype
    size: int
    slots: tuple[Slot, ...]
    bounds: tuple[int, ...]
    bucket: int | None = None  # the DDP bucket this buffer mirrors (its number in ``buckets``)

    @property
    def equal_ranges(self) -> bool:
        sizes = {b - a for a, b in zip(self.bounds, self.bounds[1:])}
        return len(sizes) == 1

    def range_of(self, rank: int) -> tuple[int, int]:
        return self.bounds[rank], self.bounds[rank + 1]


@dataclass(frozen=True)
class Layout:
    world_size: int
    shard: str
    buffers: tuple[BufferPlan, ...]
    max_piece: int = _MAX_PIECE_ELEMENTS  # flat mode, CPU buffers only; see [Note: chunked pieces]
    buckets: tuple[tuple[int, ...], ...] = ()  # as planned for; see [Note: bucket layout]

    def bucket_buffer(self, bucket: int) -> int | None:
        """The buffer mirroring bucket number ``bucket``; None when it has no trainable param."""
        for b, buf in enumerate(self.buffers):
            if buf.bucket == bucket:
                return b
        return None

    def pieces(self, rank: int) -> list[Piece]:
        """The pieces rank ``rank`` owns, buffer by buffer, in buffer order.

        In flat mode a param's range on a rank may come as several consecutive pieces.
        """
        out = []
        for b, buf in enumerate(self.buffers):
            lo, hi = buf.range_of(rank)
            align = max(1, _ALIGN_BYTES // buf.dtype.itemsize)
            for slot in buf.slots:
                start = max(lo - slot.offset, 0)
                stop = min(hi - slot.offset, slot.numel)
                if start >= stop:
                    continue
                step = stop - start
                if self.shard == "flat" and buf.device.startswith("cpu") and step > self.max_piece:
                    parts = -(-step // self.max_piece)
                    step = -(-step // parts)
                    step = min(-(-step // align) * align, self.max_piece)
                for a in range(start, stop, step):
                    out.append(Piece(slot.index, b, a, min(a + step, stop), slot.offset + a))
        return out

    def all_pieces(self) -> list[list[Piece]]:
        return [self.pieces(r) for r in range(self.world_size)]

    def slots(self) -> dict[int, tuple[int, Slot]]:
        """Param index -> (buffer number, slot) for every trainable param."""
        return {s.index: (b, s) for b, buf in enumerate(self.buffers) for s in buf.slots}

    def owned_elements(self) -> list[int]:
        """Trainable elements each rank owns (padding excluded)."""
        return [sum(p.numel for p in self.pieces(r)) for r in range(self.world_size)]

    def balance(self) -> float:
        """max/mean of :meth:`owned_elements`; 1.0 is perfect."""
        return max_over_mean(self.owned_elements())


def max_over_mean(loads: Sequence[int]) -> float:
    total = sum(loads)
    return 1.0 if total == 0 else max(loads) * len(loads) / total


def plan_layout(
    specs: Sequence[ParamSpec],
    *,
    world_size: int,
    shard: str,
    buckets: Sequence[Sequence[int]] | None = None,
) -> Layout:
    """Plan buffers and ownership for ``specs`` on ``world_size`` ranks.

    ``buckets``: param indices of each DDP gradient bucket, in the bucket's order (see
    [Note: bucket layout]); each bucket's params must share a device and dtype, and a
    param may be in one bucket at most.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if shard not in SHARD_MODES:
        raise ValueError(f"shard must be one of {SHARD_MODES}, got {shard!r}")
    buckets = tuple(tuple(int(i) for i in b) for b in (buckets or ()))
    _check_buckets(specs, buckets)
    in_bucket = {i for b in buckets for i in b}
    keys: dict[tuple[str, torch.dtype], list[int]] = {}
    for i, s in enumerate(specs):
        if s.trainable and s.numel > 0 and i not in in_bucket:
            keys.setdefault((s.device, s.dtype), []).append(i)
    loads = [0] * world_size
    planned = {}
    # Largest first, as LPT does: a big bucket placed last could only land on a loaded rank.
    for k in sorted(range(len(buckets)), key=lambda k: (-sum(specs[i].numel for i in buckets[k]), k)):
        planned[k] = _bucket_buffer(k, buckets[k], specs, world_size, shard, loads)
    buffers = [planned[k] for k in sorted(planned) if planned[k].slots]
    if shard == "flat":
        buffers += [_flat_buffer(dev, dt, idx, specs, world_size) for (dev, dt), idx in keys.items()]
    else:
        extra = [i for idx in keys.values() for i in idx]
        owner = _param_owners(specs, world_size) if not buckets else _lpt(extra, specs, world_size, loads)
        buffers += [_param_buffer(dev, dt, idx, specs, owner, world_size) for (dev, dt), idx in keys.items()]
    return Layout(world_size, shard, tuple(buffers), _MAX_PIECE_ELEMENTS, buckets)


def _check_buckets(specs: Sequence[ParamSpec], buckets: tuple[tuple[int, ...], ...]) -> None:
    seen: set[int] = set()
    for k, bucket in enumerate(buckets):
        for i in bucket:
            if not 0 <= i < len(specs):
                raise ValueError(f"buckets[{k}] names param {i}, but there are {len(specs)} params")
            if i in seen:
                raise ValueError(f"buckets: param {i} is in more than one bucket (or twice in buckets[{k}])")
            seen.add(i)
        kinds = {(specs[i].device, specs[i].dtype) for i in bucket}
        if len(kinds) > 1:
            raise ValueError(f"buckets[{k}] mixes devices/dtypes {sorted(map(str, kinds))}: a DDP bucket has one")


def _bucket_buffer(k, bucket, specs, world_size, shard, loads) -> BufferPlan:
    """One DDP bucket's buffer; ``loads`` (elements per rank so far) is updated.

    The ranges depend only on the bucket and the world size, not on which of its params
    are trainable now: grads reduced into them stay valid across a trainability change."""
    first = specs[bucket[0]]
    slots, ends, offset = [], [0], 0
    for i in bucket:
        if specs[i].trainable and specs[i].numel > 0:
            slots.append(Slot(i, offset, specs[i].numel))
        offset += specs[i].numel
        ends.append(offset)
    if shard == "flat":
        align = max(1, _ALIGN_BYTES // first.dtype.itemsize)
        chunk = -(-(-(-offset // world_size)) // align) * align
        bounds = tuple(r * chunk for r in range(world_size + 1))
        size = chunk * world_size
    else:
        bounds = _cuts(ends, loads)
        size = offset
    for r in range(world_size):
        loads[r] += max(0, min(bounds[r + 1], offset) - min(bounds[r], offset))
    return BufferPlan(first.device, first.dtype, size, tuple(slots), bounds, k)


def _cuts(ends: list[int], loads: list[int]) -> tuple[int, ...]:
    """Rank bounds among the param boundaries ``ends`` giving each rank about what evens out ``loads``."""
    world_size, size = len(loads), ends[-1]
    target = (sum(loads) + size) / world_size
    want = [max(0.0, target - load) for load in loads]
    scale = size / sum(want) if sum(want) else 0.0
    bounds, wanted, c = [0], 0.0, 0
    for r in range(world_size - 1):
        wanted += want[r] * scale
        while c + 1 < len(ends) and abs(ends[c + 1] - wanted) <= abs(ends[c] - wanted):
            c += 1
        bounds.append(ends[c])
    bounds.append(size)
    return tuple(bounds)


def _flat_buffer(device, dtype, indices, specs, world_size) -> BufferPlan:
    slots, offset = [], 0
    for i in indices:
        slots.append(Slot(i, offset, specs[i].numel))
        offset += specs[i].numel
    align = max(1, _ALIGN_BYTES // dtype.itemsize)
    chunk = -(-offset // world_size)
    chunk = -(-chunk // align) * align
    bounds = tuple(r * chunk for r in range(world_size + 1))
    return BufferPlan(device, dtype, chunk * world_size, tuple(slots), bounds)


def _param_buffer(device, dtype, indices, specs, owner, world_size) -> BufferPlan:
    slots, bounds, offset = [], [0], 0
    for r in range(world_size):
        for i in indices:
            if owner[i] == r:
                slots.append(Slot(i, offset, specs[i].numel))
                offset += specs[i].numel
        bounds.append(offset)
    return BufferPlan(device, dtype, offset, tuple(slots), tuple(bounds))


def _param_owners(specs: Sequence[ParamSpec], world_size: int) -> dict[int, int]:
    """Whole-param owners: the better of LPT over trainable params and torch's greedy."""
    trainable = [i for i, s in enumerate(specs) if s.trainable and s.numel > 0]
    candidates = [_lpt(trainable, specs, world_size), torch_zero_owners(specs, world_size)]

    def worst(owner):
        loads = [0] * world_size
        for i in trainable:
            loads[owner[i]] += specs[i].numel
        return max(loads) if loads else 0

    return min(candidates, key=worst)


def _lpt(indices, specs, world_size, loads=None) -> dict[int, int]:
    heap = [(load, r) for r, load in enumerate(loads or [0] * world_size)]
    heapq.heapify(heap)
    owner = {}
    for i in sorted(indices, key=lambda i: (-specs[i].numel, i)):
        load, r = heapq.heappop(heap)
        owner[i] = r
        heapq.heappush(heap, (load + specs[i].numel, r))
    return owner


def torch_zero_owners(specs, world_size) -> dict[int, int]:
    """torch's ZeroRedundancyOptimizer partition: per group, largest first, frozen params counted."""
    sizes = [0] * world_size
    owner = {}
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(specs):
        groups.setdefault(s.group, []).append(i)
    for indices in groups.values():
        for i in sorted(indices, key=lambda i: -specs[i].numel):
            r = sizes.index(min(sizes))
            owner[i] = r
            sizes[r] += specs[i].numel
    return owner


def torch_zero_loads(specs: Sequence[ParamSpec], *, world_size: int) -> list[int]:
    """Trainable elements per rank under torch's ZeroRedundancyOptimizer partition."""
    owner = torch_zero_owners(specs, world_size)
    loads = [0] * world_size
    for i, s in enumerate(specs):
        if s.trainable:
            loads[owner[i]] += s.numel
    return loads
