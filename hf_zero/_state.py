"""Optimizer state in pieces: splitting, merging and moving it between ranks.

[Note: piece state]
A rank holds optimizer state as *holdings*: ``(start, stop, shape, state)`` for a
range of elements of one param, where ``shape`` is the shape of the tensor the
local optimizer stepped (the param's own shape for a whole-param piece, ``(n,)``
for a flat piece). A state value is

- *elementwise* when it is a tensor of exactly that shape (Adam's moments,
  momentum buffers): it is sliced and concatenated by element;
- a *scalar* when it is a 0-dim tensor or a plain value (``step``): every piece of
  a param carries the same one;
- a *blob* otherwise (Adafactor's factored rows/columns): it only moves whole,
  with a whole-param piece.

Canonical (PyTorch ``state_dict``) state is the holding ``(0, numel, param.shape)``.
Moving state is one metadata exchange plus one ``all_to_all`` per state dtype,
each element sent once, straight from its holder to its new holder.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple

import torch

from ._comm import Comm


@dataclass
class Holding:
    start: int
    stop: int
    shape: tuple[int, ...]
    state: dict[str, Any]


Holdings = dict[int, list[Holding]]  # param index -> holdings, sorted by start


class Kind(enum.Enum):
    """How a state value splits across pieces (see [Note: piece state])."""

    ELEMENTWISE = "elementwise"  # a tensor of the stepped tensor's shape: sliced by element
    SCALAR = "scalar"  # a 0-dim tensor: every piece carries the same one
    BLOB = "whole"  # a tensor of another shape: moves only whole, with a whole-param piece
    PLAIN = "plain"  # not a tensor: every piece carries the same one


def kind_of(value: Any, shape) -> Kind:
    """The kind of state ``value`` of a tensor stepped as ``shape``."""
    if not isinstance(value, torch.Tensor):
        return Kind.PLAIN
    if value.dim() == 0:
        return Kind.SCALAR
    return Kind.ELEMENTWISE if tuple(value.shape) == tuple(shape) else Kind.BLOB


def unsplittable(key: str, label: str, shape, param_shape=None) -> ValueError:
    """The error for state that cannot be split across ranks."""
    theirs = "the param's" if param_shape is None else f"the param's {tuple(param_shape)}"
    return ValueError(
        f"hf_zero: state {key!r} of param {label} has shape {tuple(shape)}, not {theirs}: it cannot be "
        "split across ranks (use shard='param')"
    )


class _Meta(NamedTuple):
    """A state value as metadata: a tensor's dtype (and a blob's shape), or a scalar's value."""

    kind: Kind
    dtype: str | None = None
    shape: tuple[int, ...] | None = None  # blobs
    value: Any = None  # scalars and plain values
    on_cpu: bool = False  # scalars


def _meta(value: Any, shape) -> _Meta:
    kind = kind_of(value, shape)
    if kind is Kind.PLAIN:
        return _Meta(kind, value=value)
    if kind is Kind.SCALAR:
        return _Meta(kind, str(value.dtype), value=value.item(), on_cpu=value.device.type == "cpu")
    return _Meta(kind, str(value.dtype), tuple(value.shape) if kind is Kind.BLOB else None)


class _Transfer(NamedTuple):
    """Elements ``lo:hi`` of state ``key`` of param ``index``, from rank ``src`` to rank
    ``dst``, into the target that starts at element ``target_start`` (a blob: whole)."""

    src: int
    dst: int
    index: int
    key: str
    lo: int
    hi: int
    dtype: str
    blob_shape: tuple[int, ...] | None
    target_start: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo if self.blob_shape is None else math.prod(self.blob_shape)


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` or ``"torch.float32"`` -> ``torch.float32``; anything else is an error."""
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"hf_zero: unknown dtype {name!r}")
    return dt


def describe(held: Holdings) -> dict:
    """Picklable metadata of ``held``: ranges and per-key kinds (scalars by value)."""
    return {
        i: [(h.start, h.stop, {k: _meta(v, h.shape) for k, v in h.state.items()}) for h in hs]
        for i, hs in held.items()
    }


def redistribute(
    comm: Comm,
    held: Holdings,
    targets: Mapping[int, list[tuple[int, int, int]]] | Callable[[set[int]], Mapping],
    *,
    numels: Mapping[int, int],
    device_of: Callable[[int], torch.device],
    names: Callable[[int], str] = str,
    piece_shape: Callable[[int, int, int], tuple[int, ...]] | None = None,
    reuse_own: bool = False,
) -> Holdings:
    """Move state so each target ``(rank, start, stop)`` of param ``i`` holds its elements.

    Collective. ``held`` is left untouched. ``targets`` may be a function of the set
    of param indices that have state on any rank. Returns this rank's new holdings:
    elementwise tensors on ``device_of(i)`` shaped ``piece_shape(i, start, stop)``
    (default 1-D), blobs in their shape, scalars rebuilt from metadata. Params with
    no state anywhere get no holding.

    Pass the shape the receiver steps the piece as: a 1-D holding shape is ambiguous
    with a blob of that shape (Adafactor's column factor of a ``(1, n)`` param).

    ``reuse_own=True``: where one of this rank's own holdings is exactly a target of
    this rank, the result shares its tensors (viewed) instead of copying them, so the
    caller must accept that they alias ``held`` (see [Note: reused holdings]).
    """
    moves = plan_moves(comm, held, targets, numels=numels, names=names)
    return move(comm, moves, held, device_of=device_of, piece_shape=piece_shape, reuse_own=reuse_own)


class Moves(NamedTuple):
    """What :func:`move` sends, receives and builds: checked, nothing moved yet."""

    transfers: list  # of _Transfer, in one global order
    plan: dict  # (index, dst, start) -> [(src, lo, hi, kinds)]


def plan_moves(
    comm: Comm,
    held: Holdings,
    targets: Mapping[int, list[tuple[int, int, int]]] | Callable[[set[int]], Mapping],
    *,
    numels: Mapping[int, int],
    names: Callable[[int], str] = str,
) -> Moves:
    """The first half of :func:`redistribute`: one metadata exchange (collective) and every
    check; raises (the same on every rank) before any state changes hands."""
    metas = comm.all_gather_object(describe(held))
    sources: dict[int, list[tuple[int, int, int, dict]]] = {}
    for src, meta in enumerate(metas):
        for i, hs in meta.items():
            for start, stop, kinds in hs:
                sources.setdefault(i, []).append((start, stop, src, kinds))
    if callable(targets):
        targets = targets(set(sources))
    transfers: list[_Transfer] = []  # in one global order
    plan: dict[tuple[int, int, int], list] = {}  # (index, dst, start) -> [(src, lo, hi, kinds)]
    for i in sorted(targets):
        if i not in sources:
            continue
        srcs = sorted(sources[i])
        for dst, ts, te in targets[i]:
            parts = [(src, max(ts, ss), min(te, se), kinds) for ss, se, src, kinds in srcs if ss < te and se > ts]
            covered = sum(hi - lo for _, lo, hi, _ in parts)
            if covered != te - ts:
                raise RuntimeError(
                    f"hf_zero: optimizer state of param {names(i)} covers {covered} of the "
                    f"{te - ts} elements {ts}:{te} it must provide"
                )
            plan[(i, dst, ts)] = parts
            whole = ts == 0 and te == numels[i]
            for src, lo, hi, kinds in parts:
                for key in sorted(kinds):
                    meta = kinds[key]
                    if meta.kind is Kind.ELEMENTWISE:
                        transfers.append(_Transfer(src, dst, i, key, lo, hi, meta.dtype, None, ts))
                    elif meta.kind is Kind.BLOB:
                        if not (whole and lo == 0 and hi == numels[i]):
                            raise unsplittable(key, names(i), meta.shape)
                        transfers.append(_Transfer(src, dst, i, key, lo, hi, meta.dtype, meta.shape, ts))
    return Moves(transfers, plan)


def move(
    comm: Comm,
    moves: Moves,
    held: Holdings,
    *,
    device_of: Callable[[int], torch.device],
    piece_shape: Callable[[int, int, int], tuple[int, ...]] | None = None,
    reuse_own: bool = False,
    release: bool = False,
) -> Holdings:
    """The second half of :func:`redistribute` (collective): move the state as ``moves`` says.

    ``release=True``: ``held`` is given up as it goes (see [Note: moving without a spike]):
    each holding's state is emptied after the last round that reads it, so the caller must
    hold no other reference to its tensors and must not use ``held`` afterwards."""
    transfers, plan = moves
    # This rank's new state: each elementwise tensor allocated at its first write and
    # received elements copied straight in, so a receiver needs its new state once plus
    # one round (see [Note: rounds]).
    me = comm.rank
    out: Holdings = {}
    dest: dict[tuple[int, int], dict[str, Any]] = {}
    unallocated: dict[tuple[int, int, str], tuple] = {}  # (index, start, key) -> (shape, dtype, device)
    reused: set[tuple[int, int]] = set()
    for (i, dst, ts), parts in plan.items():
        if dst != me:
            continue
        device = device_of(i)
        te = ts + sum(hi - lo for _, lo, hi, _ in parts)
        shape = tuple(piece_shape(i, ts, te)) if piece_shape else (te - ts,)
        mine_only = len(parts) == 1 and parts[0][0] == me
        own = _own_views(held.get(i, ()), ts, te, shape, device) if reuse_own and mine_only else None
        if own is not None:
            reused.add((i, ts))
        state: dict[str, Any] = {}
        for key, meta in parts[0][3].items():
            if own is not None and key in own:
                state[key] = own[key]
            elif meta.kind is Kind.ELEMENTWISE:
                state[key] = None
                unallocated[(i, ts, key)] = (shape, dtype_from_name(meta.dtype), device)
            elif meta.kind is Kind.SCALAR:
                state[key] = torch.tensor(meta.value, dtype=dtype_from_name(meta.dtype),
                                          device="cpu" if meta.on_cpu else device)
            elif meta.kind is Kind.PLAIN:
                state[key] = meta.value
            else:
                state[key] = None  # a blob, set on receipt (keeps the keys' order)
        dest[(i, ts)] = state
        out.setdefault(i, []).append(Holding(ts, te, shape, state))

    def put(t: _Transfer, flat: torch.Tensor) -> None:
        state = dest[(t.index, t.target_start)]
        if state[t.key] is None and t.blob_shape is None:
            shape, dtype, device = unallocated.pop((t.index, t.target_start, t.key))
            state[t.key] = torch.empty(shape, dtype=dtype, device=device)
        _put(state, t, flat, device_of(t.index))

    # Every rank must compute the same rounds: reused targets are skipped where they
    # would be copied, never dropped from ``transfers``.
    schedule = []
    for dtype_name in sorted({t.dtype for t in transfers}):
        dtype = dtype_from_name(dtype_name)
        group = [t for t in transfers if t.dtype == dtype_name]
        schedule += [(dtype, batch) for batch in _rounds(group, max(1, _ROUND_BYTES // dtype.itemsize))]
    last_read: dict[int, tuple[Holding, int]] = {}  # id(holding) -> (holding, the last round reading it)
    if release:
        for k, (_, batch) in enumerate(schedule):
            for t in batch:
                if t.src == me and (t.dst != me or (t.index, t.target_start) not in reused):
                    h = _holding(held[t.index], t)
                    last_read[id(h)] = (h, k)
    for k, (dtype, batch) in enumerate(schedule):
        send: list[list[torch.Tensor]] = [[] for _ in range(comm.world_size)]
        recv_sizes = [0] * comm.world_size
        for t in batch:
            if t.src == t.dst == me:  # stays here: no staging
                if (t.index, t.target_start) in reused:
                    continue
                put(t, _segment(held[t.index], t))
            elif t.src == me:
                send[t.dst].append(_segment(held[t.index], t).to(comm.device))
            elif t.dst == me:
                recv_sizes[t.src] += t.numel
        packed = [torch.cat(s) if s else torch.empty(0, dtype=dtype, device=comm.device) for s in send]
        del send
        chunks = comm.all_to_all(packed, recv_sizes, dtype=dtype, device=comm.device)
        del packed
        cursor = [0] * comm.world_size
        for t in batch:
            if t.dst != me or t.src == me:
                continue
            received = chunks[t.src][cursor[t.src] : cursor[t.src] + t.numel]
            put(t, received)
            cursor[t.src] += t.numel
        del chunks
        if release:
            comm.release_completed_works()  # the round's staging goes now, not a second later
        for h, last in list(last_read.values()):
            if last == k:
                h.state.clear()
                del last_read[id(h)]
    for (i, ts, key), (shape, dtype, device) in unallocated.items():  # no element sent: as before, unset
        dest[(i, ts)][key] = torch.empty(shape, dtype=dtype, device=device)
    return out


# [Note: moving without a spike]
# A rebuild gives its old holdings up to :func:`move` (``release=True``): a target's
# tensor is allocated at its first write and a holding emptied after the last round
# that reads it. Transfers run in param order, so beyond the state it keeps a rank
# holds about one round and one param's state at a time, not its old and new state at
# once. With ``reuse_own`` as well, a target that is exactly one of its own holdings
# (a param whose piece did not change) takes that holding's tensors and costs nothing.


# [Note: reused holdings]
# Gathering whole params onto a rank that already holds some of them whole
# (param mode, or a small param inside one flat piece) needs no new memory for
# those: with reuse_own the gathered state is a view of the holding. The caller
# (consolidate_state_dict) then returns tensors that share memory with the live
# optimizer state, as torch.optim.Optimizer.state_dict() and torch's
# ZeroRedundancyOptimizer (for its own partition) do: valid until the next step,
# which is when consolidated state is invalidated anyway. A rebuild reuses too, but
# only with ``release`` (its old holdings are given up: nothing else pins them).
def _own_views(holdings, ts: int, te: int, shape: tuple, device) -> dict[str, torch.Tensor] | None:
    """The tensors of the holding that is exactly ``ts:te``, viewed as ``shape``, when all are on ``device``."""
    for h in holdings:
        if h.start == ts and h.stop == te:
            out = {}
            for key, value in h.state.items():
                kind = kind_of(value, h.shape)
                if kind in (Kind.SCALAR, Kind.PLAIN):
                    continue  # rebuilt from metadata as usual
                if value.device != torch.device(device):
                    return None
                if kind is Kind.ELEMENTWISE:
                    if not value.is_contiguous():
                        return None
                    value = value.view(shape)
                out[key] = value
            return out
    return None


def _put(state: dict, t: _Transfer, flat: torch.Tensor, device) -> None:
    if t.blob_shape is None:
        at = t.lo - t.target_start
        state[t.key].view(-1)[at : at + flat.numel()].copy_(flat)
    else:
        state[t.key] = flat.view(t.blob_shape).to(device, copy=True)


# [Note: rounds]
# State moves in rounds of at most _ROUND_BYTES per dtype (summed over all ranks'
# transfers; a larger blob travels alone), so no rank ever stages more than a round
# beyond the state it keeps: consolidating to one rank costs it the full state once,
# the senders a round each. Every rank computes the same rounds from the same list.
_ROUND_BYTES = 16 << 20


def _rounds(transfers: list[_Transfer], budget: int) -> list[list[_Transfer]]:
    """Split elementwise transfers to at most ``budget`` elements and group them into rounds
    of at most ``budget`` staged (cross-rank) elements."""
    rounds: list[list[_Transfer]] = [[]]
    size = 0
    for t in transfers:
        pieces = [t] if t.blob_shape is not None else [
            t._replace(lo=a, hi=min(a + budget, t.hi)) for a in range(t.lo, t.hi, budget)
        ]
        for p in pieces:
            n = 0 if p.src == p.dst else p.numel  # local: no staging
            if size + n > budget and rounds[-1]:
                rounds.append([])
                size = 0
            rounds[-1].append(p)
            size += n
    return [r for r in rounds if r]


def _holding(holdings: list[Holding], t: _Transfer) -> Holding:
    for h in holdings:
        if h.start <= t.lo and t.hi <= h.stop:
            return h
    raise AssertionError(f"no holding covers {t.lo}:{t.hi}")


def _segment(holdings: list[Holding], t: _Transfer) -> torch.Tensor:
    h = _holding(holdings, t)
    value = h.state[t.key].reshape(-1)
    return value if t.blob_shape is not None else value[t.lo - h.start : t.hi - h.start]


def split_canonical(state: Mapping[str, Any], param_shape, start: int, stop: int, piece_shape,
                    label: str = "?") -> dict:
    """The piece ``start:stop`` (stepped as a tensor of ``piece_shape``) of the whole-param
    state of param ``label``."""
    whole = start == 0 and stop == math.prod(param_shape)
    out = {}
    for key, value in state.items():
        kind = kind_of(value, param_shape)
        if kind is Kind.ELEMENTWISE:
            out[key] = value.reshape(-1)[start:stop].reshape(piece_shape)
        elif kind is Kind.BLOB and not whole:
            raise unsplittable(key, label, value.shape, param_shape)
        else:
            out[key] = value
    return out


def shape_as(holding: Holding, shape) -> dict:
    """The holding's state with elementwise tensors viewed as ``shape``."""
    return {
        k: v.view(shape) if kind_of(v, holding.shape) is Kind.ELEMENTWISE else v
        for k, v in holding.state.items()
    }
