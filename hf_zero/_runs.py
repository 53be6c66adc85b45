"""Runs: adjacent flat pieces of one param group that the local optimizer steps as one tensor.

[Note: runs]
An elementwise optimizer (the condition for flat pieces) updates each element from its own
grad and state, the group's hyperparameters and per-tensor scalars (Adam's ``step``) alone.
What its step costs the host is mostly per tensor: torch's walk over the params with a
grad, each tensor's state, the kernels' per-tensor setup, and hf_zero's own handing of each
piece its grad. Over a rank's pieces of a model with many small params that is several
times the arithmetic. So adjacent pieces of one buffer, in one param group, with the same
per-tensor scalars (or no state yet) are one tensor to the local optimizer: a *run*, a view
of the buffer spanning them, whose state is one tensor per key, each piece's state a slice
of it. The same elements get the same update, bit for bit (tests/test_runs.py): a piece is
followed by another only if it fills whole 64-byte vector registers, since CPU kernels step
a tensor's last partial register another way (torch's fused AdamW rounds it differently).

- A run is formed when a partition is built, in buffers laid out as a reduce bucket (DDP's
  with the reduce-scatter and ``gradient_as_bucket_view``, stage 2's), where each step's
  grads lie in the buffer's order, up to ``_MAX_RUN_ELEMENTS`` elements. The
  pieces' held state (moved or loaded) is copied into the run's, one key at a time, each
  piece's dropped as it goes: a rebuild holds one run's key more at most.
- Pieces with fp32 masters (16-bit params, [Note: master weights] in _masters.py) form runs
  too: the run's tensor is one fp32 master for its pieces (each piece's master a slice of
  it), its :attr:`Run.view` the span of their 16-bit pieces. Its grad is the span of the
  16-bit grads upcast in one copy, and the step rounds it into :attr:`Run.view` in one copy
  (:meth:`Run.write_back`); adjacency is the 16-bit pieces', the vector registers the fp32
  masters'.
- Each step gives a run one grad: the span of its pieces' grads, which lie back to back in
  one storage (DDP's buckets with ``gradient_as_bucket_view``, stage 2's shards).
- A step where they do not (grads of their own), or where some pieces of a run have a grad
  and others none (torch's optimizers skip a param without a grad), splits the run for good:
  its pieces become the optimizer's params again, their state slices of the run's (scalars
  copied, one each), as before the run.
- The partition's :meth:`holdings` (checkpoints, moves, stats) see each piece's own slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ._state import Kind, kind_of

# The longest run, in elements: the longest flat piece's ([Note: chunked pieces] in _layout.py: on the CPU
# torch's single-tensor AdamW allocates temporaries as large as its tensor); a rebuild copies a run's
# state one key at a time.
_MAX_RUN_ELEMENTS = 1 << 20
# A piece is followed by another in a run only if it fills whole vector registers (64 bytes: AVX-512's,
# a multiple of narrower ones): an element that ends a tensor alone ends it in the run too.
_LANES_BYTES = 64


@dataclass(eq=False)
class Run:
    """Pieces ``members`` (positions in the partition's pieces) stepped as ``tensor``; member k is
    ``tensor[starts[k]:starts[k + 1]]``. For pieces with masters, ``masters`` are theirs (each one's tensor
    its slice of ``tensor``) and ``view`` the span of their 16-bit pieces, which ``tensor`` is rounded into
    after a step; else empty and None."""

    tensor: torch.Tensor
    members: tuple[int, ...]
    starts: tuple[int, ...]
    masters: tuple = ()
    view: torch.Tensor | None = None

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype of the grads its pieces' params take (16-bit for masters)."""
        return (self.tensor if self.view is None else self.view).dtype

    def write_back(self) -> None:
        """Round the stepped masters into their 16-bit pieces, in one copy (as :meth:`Master.write_back` does
        for one)."""
        self.view.copy_(self.tensor)
        for m in self.masters:
            m.stepped = True


def plan_runs(tensors: Sequence[torch.Tensor], groups: Sequence[int], states: Sequence[dict],
              eligible: Sequence[bool], places: Sequence[torch.Tensor] | None = None) -> list[tuple[int, ...]]:
    """The runs (two pieces or more) of consecutive pieces: 1-D ``tensors`` back to back in one storage,
    one group, one dtype, all ``eligible``, with no state or the same keys and scalars (compared on the
    host: a rebuild is a cold path), at most ``_MAX_RUN_ELEMENTS`` elements. ``places``: where they lie
    back to back instead, where ``tensors`` are masters (the 16-bit pieces, one dtype too)."""
    places = tensors if places is None else places
    runs, current, size = [], [], 0
    for k, t in enumerate(tensors):
        if current:
            last = current[-1]
            prev = tensors[last]
            if not (eligible[k] and groups[k] == groups[last] and t.dtype == prev.dtype and t.dim() == 1
                    and places[k].dtype == places[last].dtype and t.is_contiguous()
                    and may_follow(prev.numel() * prev.element_size(), size, t.numel())
                    and _follows(places[last], places[k])
                    and _same_scalars(states[current[0]], states[k], tensors[current[0]].shape, t.shape)):
                if len(current) > 1:
                    runs.append(tuple(current))
                current, size = [], 0
        if not current:
            if not (eligible[k] and t.dim() == 1 and t.is_contiguous() and places[k].is_contiguous()):
                continue
        current.append(k)
        size += t.numel()
    if len(current) > 1:
        runs.append(tuple(current))
    return runs


def may_follow(prev_bytes: int, run_elements: int, numel: int) -> bool:
    """Whether a piece of ``numel`` elements may follow one of ``prev_bytes`` bytes at the end of a run of
    ``run_elements`` (back to back, in one group and dtype: the caller's to check)."""
    return prev_bytes % _LANES_BYTES == 0 and run_elements + numel <= _MAX_RUN_ELEMENTS


def _follows(prev: torch.Tensor, t: torch.Tensor) -> bool:
    return (t.is_contiguous() and t.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
            and t.data_ptr() == prev.data_ptr() + prev.numel() * prev.element_size())


def _same_scalars(first: dict, other: dict, first_shape, shape) -> bool:
    if first.keys() != other.keys():
        return False
    for key, a in first.items():
        b = other[key]
        kind = kind_of(a, first_shape)
        if kind is not kind_of(b, shape) or kind is Kind.BLOB:
            return False
        if kind is Kind.SCALAR and not (a.dtype == b.dtype and a.device == b.device and a.item() == b.item()):
            return False
        if kind is Kind.PLAIN and a != b:
            return False
        if kind is Kind.ELEMENTWISE and (a.dtype != b.dtype or a.device != b.device):
            return False
    return True


def make_run(tensors: Sequence[torch.Tensor], members: tuple[int, ...], states: list[dict],
             masters: Sequence | None = None) -> tuple[Run, dict]:
    """The run of ``members`` and its state, from the members' ``states`` (emptied as they are read, so
    that each piece's state is freed once copied where nothing else holds it). ``masters``: each piece's
    :class:`~hf_zero._masters.Master`, where ``tensors`` are theirs: the run's tensor is then the masters in
    one tensor, and each member's master becomes its slice of it."""
    first = tensors[members[0]]
    starts = [0]
    for k in members:
        starts.append(starts[-1] + tensors[k].numel())
    if masters is None:
        run = Run(first.as_strided((starts[-1],), (1,)), members, tuple(starts))
    else:
        own = tuple(masters[k] for k in members)
        run = Run(_joined([m.tensor for m in own]), members, tuple(starts), own,
                  own[0].view.as_strided((starts[-1],), (1,)))
        for m, a, b in zip(own, starts, starts[1:]):
            m.tensor = run.tensor[a:b]
    merged: dict[str, Any] = {}
    for key in list(states[members[0]]):
        values = [states[k].pop(key) for k in members]
        kind = kind_of(values[0], first.shape)
        if kind is Kind.ELEMENTWISE:
            merged[key] = _joined(values)
        elif kind is Kind.SCALAR:
            merged[key] = values[0].clone()
        else:
            merged[key] = values[0]
        del values
    return run, merged


def _joined(values: list[torch.Tensor]) -> torch.Tensor:
    """``values`` as one 1-D tensor: their span where they lie back to back in one storage, else a copy."""
    span = _span(values)
    return torch.cat(values) if span is None else span


def _span(values: list[torch.Tensor]) -> torch.Tensor | None:
    """``values`` as one tensor without a copy, where they lie back to back in one storage."""
    for prev, t in zip(values, values[1:]):
        if not _follows(prev, t):
            return None
    return values[0].as_strided((sum(v.numel() for v in values),), (1,))


def member_state(run: Run, state: dict, k: int) -> dict:
    """Member ``k``'s state: slices of the run's elementwise state, its own copy of each scalar."""
    a, b = run.starts[k], run.starts[k + 1]
    out = {}
    for key, v in state.items():
        kind = kind_of(v, run.tensor.shape)
        out[key] = v[a:b] if kind is Kind.ELEMENTWISE else v.clone() if kind is Kind.SCALAR else v
    return out


def run_grad(run: Run, grads: list, pieces: Sequence) -> torch.Tensor | None | bool:
    """The run's grad from its members' params' ``grads`` (each whole, as in ``p.grad``; member k's elements
    are ``pieces[k].start:pieces[k].stop`` of it): None when none has one; the span of them where they lie
    back to back in one storage; else False (the run must split)."""
    first = grads[0]
    missing = any(g is None for g in grads)  # not ``None in grads``: that compares tensors with ==
    if first is None or missing:
        return None if all(g is None for g in grads) else False
    if first.dtype != run.grad_dtype:
        return False
    size = first.element_size()
    ptrs = list(map(torch.Tensor.data_ptr, grads))
    base = ptrs[0] + pieces[0].start * size
    if [p + pc.start * size for p, pc in zip(ptrs, pieces)] != [base + s * size for s in run.starts[:-1]] \
            or not all(map(torch.Tensor.is_contiguous, grads)):
        return False
    try:  # within the first grad's storage, the others lie in it too, at their places
        return first.as_strided((run.starts[-1],), (1,), first.storage_offset() + pieces[0].start)
    except RuntimeError:
        return False


class _Split(tuple):
    """A run's members' own grads (stage 2, where some of its params have a grad and others none)."""


class Runs:
    """A partition's runs that are not split: each piece's place in one (:attr:`member`, by ``id`` of the
    piece), giving them their grads, splitting them, each piece's state."""

    def __init__(self, runs: Sequence[Run] = (), pieces: Sequence = ()):
        self._live = dict(enumerate(runs))
        self._tensors = tuple(p.tensor for p in pieces)  # each piece's tensor, by position
        self._masters = tuple(p.master for p in pieces)  # each piece's master (or None), by position
        self._ids = tuple(map(id, pieces))
        self.member = {self._ids[m]: (r, k) for r, run in self._live.items() for k, m in enumerate(run.members)}
        # each run's pieces' layout pieces (``piece.piece``) and their params, for a grad that comes as one span
        self._spans = {r: tuple(pieces[m].piece for m in run.members) for r, run in self._live.items()}
        self._params = {r: frozenset(pc.index for pc in span) for r, span in self._spans.items()}
        self._sorted: dict[int, tuple] = {}  # see sort

    def sort(self, chunk: tuple) -> tuple[tuple, tuple]:
        """``chunk`` (a tuple of pieces, kept by its owner) as (its pieces in no run, and per run some of its
        pieces are in: the run and its members' pieces, None for any not in ``chunk``), kept while no run splits."""
        kept = self._sorted.get(id(chunk))
        if kept is None or kept[0] is not chunk:
            loose, runs = [], {}
            for lp in chunk:
                at = self.member.get(id(lp))
                if at is None:
                    loose.append(lp)
                else:
                    runs.setdefault(at[0], [None] * len(self._live[at[0]].members))[at[1]] = lp
            kept = self._sorted[id(chunk)] = (chunk, (tuple(loose), tuple((r, tuple(m)) for r, m in runs.items())))
        return kept[1]

    def span_grad(self, r: int, grad_of):
        """Run ``r``'s grad from stage 2's shards (``grad_of``: ``grad_of(piece)``, ``grad_of.span(pieces)``): one
        span of them, in the run's dtype (a master run's as the shards hold it: :meth:`give_grads` upcasts it);
        where some of its params have a grad and others none, its members' grads (for :meth:`give_grads`,
        which splits it)."""
        run, pieces = self._live[r], self._spans[r]
        dtype = None if run.view is not None else run.tensor.dtype
        grad = grad_of.span(pieces, self._params[r])
        if grad is False:
            return _Split(g if g is None or dtype is None else g.to(dtype) for g in map(grad_of, pieces))
        return grad if grad is None or dtype is None or grad.dtype == dtype else grad.to(dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [run.tensor for run in self._live.values()]

    def unit(self, piece) -> int:
        """The elements stepped with ``piece`` as one unit, starting with it: its run's where it is a run's
        first piece, 0 where it is a later one, else its own."""
        at = self.member.get(id(piece))
        if at is None:
            return piece.tensor.numel()
        return self._live[at[0]].starts[-1] if at[1] == 0 else 0

    def give_grads(self, run_grads: dict[int, Any], optimizer, upcast=None) -> tuple[list[torch.Tensor], list]:
        """Give each run of ``run_grads`` its grad: run -> a list of its members' params' grads (``p.grad``), or
        what :meth:`span_grad` gave. A run whose members' grads cannot be one splits, and each member takes its
        own. ``upcast(grad)``: a 16-bit grad's elements in fp32 (room the caller reuses), for runs of masters.
        Returns the tensors given grads, and what to round after the step (``write_back()``): each master run,
        or each master of a split one, given a grad."""
        given, rounds = [], []
        for r, grads in run_grads.items():
            run, pieces = self._live[r], self._spans[r]
            grad = run_grad(run, grads, pieces) if isinstance(grads, list) else grads
            if grad is False or isinstance(grads, _Split):
                if isinstance(grads, list):  # each member's elements of its param's grad
                    grads = [g if g is None else g.ravel()[pc.start : pc.stop] for g, pc in zip(grads, pieces)]
                self.split(r, optimizer)
                for m, g in zip(run.members, grads):
                    master = self._masters[m]
                    if master is not None and g is not None:
                        g = upcast(g)
                        rounds.append(master)
                    self._tensors[m].grad = g
                    given.append(self._tensors[m])
            else:
                if run.view is not None and grad is not None:
                    grad = upcast(grad)
                    rounds.append(run)
                run.tensor.grad = grad
                given.append(run.tensor)
        return given, rounds

    def split(self, r: int, optimizer) -> None:
        """Run ``r``'s pieces become ``optimizer``'s params again, each with its slice of the run's state."""
        run = self._live.pop(r)
        tensors = [self._tensors[m] for m in run.members]
        state = optimizer.state.pop(run.tensor, None)
        if state:
            for k, t in enumerate(tensors):
                optimizer.state[t] = member_state(run, state, k)
        for group in optimizer.param_groups:
            group["params"] = [x for t in group["params"] for x in (tensors if t is run.tensor else (t,))]
        for m in run.members:
            del self.member[self._ids[m]]
        del self._spans[r], self._params[r]
        self._sorted.clear()

    def split_all(self, optimizer) -> None:
        for r in list(self._live):
            self.split(r, optimizer)

    def state_of(self, piece, optimizer) -> dict | None:
        """``piece``'s state (a slice of its run's), or None where it is in no run."""
        at = self.member.get(id(piece))
        if at is None:
            return None
        run = self._live[at[0]]
        return member_state(run, optimizer.state.get(run.tensor, {}), at[1])
