"""A Partition: what this rank holds for one layout, immutable once built.

[Note: partition]
A :class:`Partition` is the layout plus everything built from it on this rank: the flat
buffers (params are views into them with ``parameters_as_bucket_view``), the data pointer
each trainable param had when it was built (to notice storage replaced behind our back),
this rank's pieces and the local optimizer stepping them. Nothing of it is reassigned
after :meth:`Partition.build`; a trainability change, a new DDP bucket structure or a load
makes a new Partition with :func:`rebuild`, and the old one is dropped whole. (At the end of a
run :meth:`Partition.without_buffers` hands the params and pieces storage of their own and drops
the buffers: [Note: params own their storage after a run].)

The local optimizer steps each piece's ``tensor``: the piece of the param itself (a view
of its buffer), or, for a 16-bit param with master weights, the piece's fp32 master
(``LocalPiece.tensor`` distinct from ``LocalPiece.view``), which the step rounds back
into ``view`` (see [Note: master weights] in _masters.py).

[Note: pipelined sync]
Without the overlapped sync, :meth:`Partition.step_and_sync` steps the pieces buffer by
buffer (torch's own optimizers only, as for master chunks: see ``_step_chunks``) and
starts each buffer's sync, asynchronously, once this rank's pieces of it are stepped, so
its transfer runs while the next buffer's pieces are stepped; it waits for every sync
before returning, so no one sees a buffer before its receives are waited for. Every
rank starts the syncs in buffer order, which gloo's point-to-point matching needs. The
sends read only this rank's ranges, which no later chunk writes; the receives write
only the other ranks' ranges, which the step never reads. Measured (bf16 GPT-2 of
benchmarks.e2e, 2 gloo ranks, rank 0's step with reduce-scatter): 76-89 ms before,
61-68 ms after, plain DDP + AdamW 45-56 ms.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Mapping

import torch
from torch.profiler import record_function

from ._comm import Comm
from ._engine import profiler_enabled, unhooked_step
from ._layout import Layout, Piece
from ._ledger import state_bytes
from ._masters import MASTER_KEY, Master, aliases_watched, needs_master, split_saved, written_through_aliases
from ._params import ParamTable
from ._runs import Run, Runs, make_run, plan_runs
from ._state import Holding, Holdings, Kind, kind_of, move, plan_moves, shape_as

NOT_HYPER = ("params", "param_names")
_DATA_PTR = torch.Tensor.data_ptr
# torch.profiler labels of the step's parts (benchmarks/e2e.py --profile sums them): the
# grads handed to the local optimizer (the masters' upcast), its step, the masters' round
# into the 16-bit params, the sync's launches and its wait
PROFILE_LABELS = {part: f"hf_zero.{part}" for part in ("grads", "step", "round", "sync", "sync_wait")}
# fp32 master grads alive at once in a step ([Note: masters in chunks]): 4 MiB on the CPU,
# 32 MiB on accelerators
_GRAD_CHUNK_ELEMENTS = 1 << 23
_CPU_GRAD_CHUNK_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class LocalPiece:
    """A piece this rank owns: the local optimizer steps ``tensor``; ``view`` is the
    piece of ``param`` (in its buffer) that the parameter sync sends."""

    tensor: torch.Tensor
    view: torch.Tensor
    param: torch.Tensor
    piece: Piece
    master: Master | None = None  # its ``tensor`` is ``tensor``
    whole: bool = False  # flat shard: the piece is all of its param


def hyperparams(group: Mapping) -> dict:
    return {k: v for k, v in group.items() if k not in NOT_HYPER}


class Partition:
    """This rank's buffers, pieces and local optimizer for one layout (see [Note: partition])."""

    def __init__(self, *, layout: Layout, mask: tuple[bool, ...], shard: str, bucket_view: bool,
                 buffers: tuple[torch.Tensor, ...], ptrs: Mapping[int, int], pieces: tuple[LocalPiece, ...],
                 inner: torch.optim.Optimizer | None, runs: tuple[Run, ...] = ()):
        self.layout = layout
        self.mask = mask
        self.shard = shard
        self.bucket_view = bucket_view
        self.buffers = buffers
        self.ptrs = MappingProxyType(dict(ptrs))
        self._ptr_values = list(self.ptrs.values())
        self.pieces = pieces
        self.inner = inner
        self._grad_scratch: dict[torch.device, torch.Tensor] = {}  # masters' fp32 grads, reused each step
        self._chunks: dict[tuple, tuple] = {}  # _step_chunks' answers, with the pieces they were made of
        self._runs = Runs(runs, pieces)  # [Note: runs] in _runs.py

    @classmethod
    def build(cls, table: ParamTable, layout: Layout, held: Holdings, *, rank: int, optimizer_class: type,
              param_groups: list[dict], bucket_view: bool, previous: "Partition | None",
              old_buffers: tuple[torch.Tensor, ...] = (), masters: bool = False, runs: bool = True) -> "Partition":
        """Lay the buffers out, make params views of them (``bucket_view``), and build the
        local optimizer over this rank's pieces with the state in ``held`` (one group per
        param group, empty where this rank owns nothing of it, so every rank's local
        optimizer sees the same hyperparameters). ``masters``: 16-bit pieces are stepped
        through fp32 masters, from the held ``"master_param"`` where there is one.
        ``old_buffers``: the retired ``previous``'s (see [Note: rebuilding in place]). ``runs``: adjacent pieces
        may be stepped as one tensor where their grads will lie back to back ([Note: runs] in _runs.py)."""
        params = table.params
        if bucket_view and previous is not None:
            old = set(previous.ptrs.values())
            for p in params:  # frozen now: give it back storage of its own
                if not p.requires_grad and p.data_ptr() in old:
                    p.data = p.data.clone()
        reuse = _reusable(previous, old_buffers, layout)
        del old_buffers  # the others are freed as their params move out
        buffers, ptrs = [], {}
        for b, plan in enumerate(layout.buffers):
            buf = reuse.pop(b, None)
            if buf is None:
                buf = torch.zeros(plan.size, dtype=plan.dtype, device=torch.device(plan.device))
            for slot in plan.slots:
                p = params[slot.index]
                view = buf[slot.offset : slot.offset + slot.numel]
                if p.data_ptr() != view.data_ptr() or not p.data.is_contiguous():
                    view.copy_(p.data.reshape(-1))
                if bucket_view:
                    p.data = view.view(p.shape)
                elif not p.data.is_contiguous():
                    p.data = p.data.contiguous()
                ptrs[slot.index] = p.data_ptr()
            buffers.append(buf)
        pieces, states = [], []
        for pc in layout.pieces(rank):
            p = params[pc.index]
            t = p.data.view(-1)[pc.start : pc.stop]
            if layout.shard == "param":
                t = t.view(p.shape)
            mine = held.get(pc.index, [])
            at = next((j for j, h in enumerate(mine) if h.start == pc.start and h.stop == pc.stop), None)
            # given up here: [Note: runs] in _runs.py copies it into a run's, freeing it as it goes
            state = {} if at is None else shape_as(mine.pop(at), t.shape)
            state, saved = split_saved(state)  # a master without a 16-bit param to step is dropped
            master = Master(t, saved, p) if needs_master(masters, p) else None
            whole = layout.shard == "flat" and pc.start == 0 and pc.stop == p.numel()
            lp = LocalPiece(t, t, p, pc, whole=whole) if master is None else \
                LocalPiece(master.tensor, t, p, pc, master, whole)
            pieces.append(lp)
            states.append(_placed(state, lp.tensor) if state else {})
        tensors, groups = [lp.tensor for lp in pieces], [table.group_of[lp.piece.index] for lp in pieces]
        made, run_states, first_of = [], [], {}
        if runs and layout.shard == "flat":
            # where grads come in a bucket's order (DDP's, stage 2's): elsewhere they are not back to back
            eligible = [layout.buffers[lp.piece.buffer].bucket is not None for lp in pieces]
            places = [lp.view for lp in pieces]  # where a master's piece lies: its 16-bit view
            masters = [lp.master for lp in pieces]
            for members in plan_runs(tensors, groups, states, eligible=eligible, places=places):
                run, st = make_run(tensors, members, states, None if masters[members[0]] is None else masters)
                for m in members if run.masters else ():  # each master is now its slice of the run's
                    tensors[m] = pieces[m].master.tensor
                    pieces[m] = replace(pieces[m], tensor=tensors[m])
                first_of[members[0]] = len(made)
                made.append(run)
                run_states.append(st)
        in_run = {m for run in made for m in run.members}
        by_group: list[list[torch.Tensor]] = [[] for _ in param_groups]
        for k, t in enumerate(tensors):
            if k in first_of:
                by_group[groups[k]].append(made[first_of[k]].tensor)
            elif k not in in_run:
                by_group[groups[k]].append(t)
        inner = optimizer_class([{**hyperparams(g), "params": ps} for g, ps in zip(param_groups, by_group)])
        for k, (t, st) in enumerate(zip(tensors, states)):
            if st and k not in in_run:
                inner.state[t] = st
        for run, st in zip(made, run_states):
            if st:
                inner.state[run.tensor] = st
        return cls(layout=layout, mask=table.mask(), shard=layout.shard, bucket_view=bucket_view,
                   buffers=tuple(buffers), ptrs=ptrs, pieces=tuple(pieces), inner=inner, runs=tuple(made))

    def retire(self) -> tuple[torch.Tensor, ...]:
        """End this partition's life (its state taken with :meth:`holdings`): drop its local
        optimizer and pieces and hand its buffers over, keeping no reference to either."""
        buffers, self.buffers, self.pieces, self.inner = self.buffers, (), (), None
        self._grad_scratch, self._runs = {}, Runs()
        return buffers

    def without_buffers(self, params: tuple[torch.Tensor, ...]) -> "Partition":
        """[Note: params own their storage after a run] This partition with every param that is a view of
        one of its buffers given storage of its own (a copy), its pieces new views of that (the local
        optimizer's params and state keys swapped for them), and no buffers: savers that refuse shared
        storage (safetensors' ``save_model``) take the params, and the buffers are freed. One buffer at a
        time: each is freed (when nothing else holds it) before the next one's params are copied, so this
        holds one buffer more at most. (A piece's view cannot be pointed elsewhere in place: it keeps its
        base, and so the buffer, alive.) The state stays; the next step rebuilds (:meth:`views_intact` is
        False), moving no state."""
        if not (self.buffers and self.bucket_view):
            return self
        self._runs.split_all(self.inner)  # a run spans params, which each get storage of their own
        buffers, self.buffers = list(self.buffers), ()
        pieces, self.pieces = list(self.pieces), ()
        by_buffer: dict[int, list[int]] = {}
        for k, lp in enumerate(pieces):
            by_buffer.setdefault(lp.piece.buffer, []).append(k)
        for b, plan in enumerate(self.layout.buffers):
            moved = set()
            for slot in plan.slots:
                p = params[slot.index]
                if p.data_ptr() == self.ptrs.get(slot.index):  # else replaced behind our back: not ours to copy
                    p.data = p.data.clone()
                    moved.add(slot.index)
            swapped = {}  # id(old local param) -> its replacement
            for k in by_buffer.get(b, ()):
                lp = pieces[k]
                if lp.piece.index not in moved:
                    continue
                view = lp.param.data.view(-1)[lp.piece.start : lp.piece.stop].view(lp.view.shape)
                if lp.master is not None:
                    lp.master.view = view
                    pieces[k] = replace(lp, view=view)
                else:
                    swapped[id(lp.tensor)] = view
                    if self.inner is not None and lp.tensor in self.inner.state:
                        self.inner.state[view] = self.inner.state.pop(lp.tensor)
                    pieces[k] = replace(lp, tensor=view, view=view)
            if swapped and self.inner is not None:
                for group in self.inner.param_groups:
                    group["params"] = [swapped.get(id(t), t) for t in group["params"]]
            buffers[b] = lp = None  # freed here unless held elsewhere
        return Partition(layout=self.layout, mask=self.mask, shard=self.shard, bucket_view=self.bucket_view,
                         buffers=(), ptrs=self.ptrs, pieces=tuple(pieces), inner=self.inner)

    def emptied(self) -> "Partition":
        """The same buffers and views, without pieces or state (after a load replaced the state)."""
        return Partition(layout=self.layout, mask=self.mask, shard=self.shard, bucket_view=self.bucket_view,
                         buffers=self.buffers, ptrs=self.ptrs, pieces=(), inner=None)

    # -- facts -------------------------------------------------------------------------
    def views_intact(self, params: tuple[torch.Tensor, ...]) -> bool:
        """Whether every trainable param still has the storage this partition gave it."""
        return list(map(_DATA_PTR, map(params.__getitem__, self.ptrs))) == self._ptr_values

    def owned(self) -> list[Piece]:
        return [lp.piece for lp in self.pieces]

    def holdings(self) -> Holdings:
        """The state of this rank's pieces, as holdings (see [Note: piece state] in _state.py)."""
        held: Holdings = {}
        if self.inner is None:
            return held
        self.follow_edits()
        for lp in self.pieces:
            st = self._runs.state_of(lp, self.inner)
            st = dict(self.inner.state.get(lp.tensor, {})) if st is None else st
            if lp.master is not None and lp.master.stepped:
                st[MASTER_KEY] = lp.master.tensor
            if st:
                pc = lp.piece
                held.setdefault(pc.index, []).append(Holding(pc.start, pc.stop, tuple(lp.tensor.shape), st))
        return held

    def follow_edits(self) -> None:
        """Masters adopt the in-place writes to their params since the last step (see
        [Note: master weights] in _masters.py), through their aliases too."""
        written = written_through_aliases() if aliases_watched() else ()
        for lp in self.pieces:
            if lp.master is not None:
                lp.master.follow_edits(bool(written) and id(lp.param) in written)
        for lp in self.pieces if written else ():
            if lp.master is not None:
                written.pop(id(lp.param), None)

    def master_bytes(self) -> int:
        """Bytes of the fp32 masters of this rank's pieces."""
        return sum(lp.master.nbytes for lp in self.pieces if lp.master is not None)

    def memory(self) -> dict[str, int]:
        """Bytes of the local optimizer's state, the masters and the upcast scratch ([Note: memory ledger])."""
        states = [] if self.inner is None else list(self.inner.state.values())
        return {"optimizer_state": state_bytes(states, MASTER_KEY), "masters": self.master_bytes(),
                "upcast_scratch": sum(t.nbytes for t in self._grad_scratch.values())}

    def tensors(self) -> list[torch.Tensor]:
        """The local optimizer's state tensors and the masters."""
        states = [] if self.inner is None else list(self.inner.state.values())
        return [v for st in states for v in st.values() if isinstance(v, torch.Tensor)] + \
            [lp.master.tensor for lp in self.pieces if lp.master is not None]

    def bucket_bounds(self, composition: tuple[int, ...]) -> tuple[int, ...] | None:
        """Rank bounds of the buffer mirroring the DDP bucket of these params, or None."""
        for k, bucket in enumerate(self.layout.buckets):
            if bucket == composition:
                b = self.layout.bucket_buffer(k)
                return None if b is None else self.layout.buffers[b].bounds
        return None

    # -- the step ---------------------------------------------------------------------
    def step_and_sync(self, param_groups: list[dict], kwargs: dict, comm: Comm, params: tuple[torch.Tensor, ...],
                      overlap, grad_of=None) -> Any:
        """:meth:`step`, then :meth:`sync`. Blocking syncs of bucket views are pipelined
        (see [Note: pipelined sync]); the result is the same."""
        self.follow_edits()
        if comm.world_size == 1 or overlap is not None or not self.bucket_view:
            loss = self.step(param_groups, kwargs, grad_of=grad_of)
            self.sync(comm, params, overlap)
            return loss
        plans, pending = self.layout.buffers, []

        def launch(b: int) -> None:
            with _labelled("sync"):
                pending.append(comm.sync_buffer(self.buffers[b], plans[b].bounds, async_op=True))

        loss = self.step(param_groups, kwargs, buffer_done=launch, grad_of=grad_of)
        with _labelled("sync_wait"):
            for p in pending:
                if p is not None:
                    p.wait()
        return loss

    def step(self, param_groups: list[dict], kwargs: dict, buffer_done=None, grad_of=None) -> Any:
        """Step this rank's pieces with the matching slices of their params' grads.
        Hyperparameters are copied in before and back after (the local optimizer may
        change its own, as with torch's ZeroRedundancyOptimizer). ``buffer_done(b)`` is
        called for every buffer, in buffer order, once this rank's pieces of it are stepped.
        ``grad_of(piece)``: a piece's 1-D grad (or None) where grads are not in ``.grad`` (stage 2)."""
        for inner_group, group in zip(self.inner.param_groups, param_groups):
            inner_group.update(hyperparams(group))
        flat = self.shard == "flat"
        loss = None
        done = 0  # buffers handed to buffer_done

        def done_through(end: int) -> None:
            nonlocal done
            while done < end:
                done += 1
                buffer_done(done - 1)

        step_inner = unhooked_step(self.inner)
        try:
            chunks = self._step_chunks(kwargs, by_buffer=buffer_done is not None)
            for i, chunk in enumerate(chunks):
                with _labelled("grads"):
                    upcast = _upcaster(self._scratch_for(chunk))  # into the chunk's reused fp32 scratch
                    loose, in_runs = self._runs.sort(chunk) if self._runs.member else (chunk, ())
                    # each run takes one grad (below): the span of its params' grads
                    run_grads = ({r: [None if lp is None else lp.param.grad for lp in lps] for r, lps in in_runs}
                                 if grad_of is None else {r: self._runs.span_grad(r, grad_of) for r, _ in in_runs})
                    for lp in loose:
                        if grad_of is None:
                            g = lp.param.grad
                            if g is not None and flat:  # ravel: the cheapest flattening, a view wherever reshape(-1) is one
                                g = g.ravel() if lp.whole else g.ravel()[lp.piece.start : lp.piece.stop]
                        else:  # a 1-D slice of a shard, as a flat piece is; a param-mode piece has its param's shape
                            g = grad_of(lp.piece)
                            if g is not None and not flat:
                                g = g.view_as(lp.view)  # view_as: view(torch.Size) parses its argument slowly
                        if lp.master is not None:
                            lp.master.set_grad(None if g is None else upcast(g))
                        else:  # a float32 stage-2 shard of a 16-bit param stepped without a master: rounded once
                            lp.tensor.grad = g if g is None or g.dtype == lp.tensor.dtype else g.to(lp.tensor.dtype)
                    given, rounds = self._runs.give_grads(run_grads, self.inner, upcast) if run_grads else ((), ())
                with _labelled("step"):
                    out = step_inner(**kwargs)
                loss = out if loss is None else loss
                with _labelled("round"):
                    for lp in loose:  # a run's pieces are not loose: their run took the grad
                        if lp.master is not None and lp.tensor.grad is not None:
                            lp.master.write_back()
                        lp.tensor.grad = None
                    for stepped in rounds:  # runs of masters (rounded in one copy), masters of split ones
                        stepped.write_back()
                    for t in given:
                        t.grad = None
                if buffer_done is not None and i + 1 < len(chunks):
                    done_through(chunks[i + 1][0].piece.buffer)
            if buffer_done is not None:
                done_through(len(self.buffers))
        except BaseException:  # the pieces hold no grad after a step, nor after one that raised
            for t in [lp.tensor for lp in self.pieces] + self._runs.tensors():
                t.grad = None
            raise
        for inner_group, group in zip(self.inner.param_groups, param_groups):
            group.update(hyperparams(inner_group))
        return loss

    def _scratch_for(self, chunk: tuple[LocalPiece, ...]) -> dict[torch.device, torch.Tensor]:
        """fp32 room, per device, for the master grads of ``chunk``: kept from step to step
        (grown when a chunk needs more), so a step upcasts into it instead of allocating per
        piece. A chunk above the chunk size (one piece that large, or an optimizer stepped
        whole) gets room for this step only: the partition keeps at most a chunk's worth."""
        need: dict[torch.device, int] = {}
        for lp in chunk:
            if lp.master is not None:
                need[lp.tensor.device] = need.get(lp.tensor.device, 0) + lp.tensor.numel()
        room = {}
        for d, n in need.items():
            buf = self._grad_scratch.get(d)
            if buf is None or buf.numel() < n:
                buf = torch.empty(n, dtype=torch.float32, device=d)
                if n <= _chunk_elements(d):
                    self._grad_scratch[d] = buf
            room[d] = buf
        return room

    def _step_chunks(self, kwargs: dict, *, by_buffer: bool = False) -> list[tuple[LocalPiece, ...]]:
        """The pieces in the groups the local optimizer steps one after the other.

        A master's fp32 grad is a copy (4 bytes per element): stepping all at once would
        hold one for every piece. torch's own optimizers update each param from its own
        grad and state only (params without a grad are skipped), so stepping them a chunk
        at a time is the same update with one chunk of fp32 grads alive. ``by_buffer``: a
        chunk never spans two buffers. Any other optimizer (which may count its ``step``
        calls) is stepped once."""
        key = (bool(kwargs), by_buffer)
        pieces, chunks = self._chunks.get(key, (None, None))
        if pieces is not self.pieces:
            pieces, chunks = self._chunks[key] = (self.pieces, self._plan_chunks(kwargs, by_buffer=by_buffer))
        return chunks

    def _plan_chunks(self, kwargs: dict, *, by_buffer: bool) -> list[tuple[LocalPiece, ...]]:
        masters = any(lp.master is not None for lp in self.pieces)
        if kwargs or not (masters or by_buffer) or not type(self.inner).__module__.startswith("torch.optim."):
            return [self.pieces]
        chunks, size = [[]], 0
        for lp in self.pieces:
            unit = self._runs.unit(lp)  # a run is never cut: its pieces are stepped as one tensor
            if chunks[-1] and unit and ((masters and size + unit > _chunk_elements(lp.tensor.device))
                                        or (by_buffer and lp.piece.buffer != chunks[-1][-1].piece.buffer)):
                chunks.append([])
                size = 0
            chunks[-1].append(lp)
            size += lp.tensor.numel()
        return [tuple(c) for c in chunks]

    def sync(self, comm: Comm, params: tuple[torch.Tensor, ...], overlap) -> None:
        """Send this rank's ranges of every buffer to the other ranks. With ``overlap``
        (a ParamSyncOverlap, bucket views only) the collectives are launched and the
        model's forwards wait for them ([Note: overlapped parameter sync])."""
        if comm.world_size == 1:
            return
        plans = self.layout.buffers
        if overlap is not None and self.bucket_view:
            # In the order the next forward needs them (the params' order, which models
            # register as they run, rearranged by the overlap's units), not DDP's backward
            # order. The same order on every rank: it depends on the agreed layout and the
            # model's module tree.
            first = [min((slot.index for slot in plan.slots), default=len(params)) for plan in plans]
            order = overlap.launch_order(sorted(range(len(plans)), key=lambda b: (first[b], b)),
                                         {id(params[i]): b for i, (b, _) in self.layout.slots().items()})
            overlap.launch({b: comm.sync_buffer(self.buffers[b], plans[b].bounds, async_op=True) for b in order})
            return
        for b, plan in enumerate(plans):
            buf = self.buffers[b]
            if not self.bucket_view:
                for lp in self.pieces:
                    pc = lp.piece
                    if pc.buffer == b:
                        buf[pc.offset : pc.offset + pc.numel].copy_(lp.view.reshape(-1))
            comm.sync_buffer(buf, plan.bounds)
            if not self.bucket_view:
                # This rank's own range is already in the params: its pieces are views of them.
                lo, hi = plan.range_of(comm.rank)
                for slot in plan.slots:
                    flat = params[slot.index].data.view(-1)
                    start, stop = slot.offset, slot.offset + slot.numel
                    for a, z in ((start, min(stop, lo)), (max(start, hi), stop)):
                        if a < z:
                            flat[a - start : z - start].copy_(buf[a:z])


def _upcaster(scratch: dict[torch.device, torch.Tensor]):
    """``upcast(grad)``: a 16-bit grad upcast (exactly) into the next unused slice of ``scratch``, a chunk's fp32
    room per device, shaped as the grad."""
    used: dict[torch.device, int] = {}

    def upcast(g: torch.Tensor) -> torch.Tensor:
        d, n = g.device, g.numel()
        at = used.get(d, 0)
        used[d] = at + n
        return scratch[d][at : at + n].view_as(g).copy_(g)

    return upcast


def _labelled(part: str):
    """The profiler label of a part of the step; nothing while no profiler runs (a label costs microseconds,
    several times a step)."""
    return record_function(PROFILE_LABELS[part]) if profiler_enabled() else _UNLABELLED


_UNLABELLED = contextlib.nullcontext()


def _chunk_elements(device: torch.device) -> int:
    """[Note: masters in chunks] A chunk of a masters step is upcast, stepped and rounded before
    the next one: on the CPU 1M elements at most (4 MiB of fp32 grads: the longest piece, [Note:
    chunked pieces] in _layout.py, and the longest run), so that the step reads the upcast grads,
    and the round the masters it just wrote, from the cache, not from memory (rank 0's share of
    the e2e bf16 GPT-2, one process: 1.28 ns per element against 1.41 with 8M-element chunks, 12
    interleaved steps); on an accelerator 8M elements (a kernel launch per part per chunk). A
    chunk holds at least one piece, and a run ([Note: runs] in _runs.py) is never cut."""
    return _CPU_GRAD_CHUNK_ELEMENTS if device.type == "cpu" else _GRAD_CHUNK_ELEMENTS


def _placed(state: dict, tensor: torch.Tensor) -> dict:
    """Held state as the local optimizer's state of ``tensor``: on its device, floating
    values in its dtype (float32 for a master, whatever the state was saved in)."""
    out = {}
    for k, v in state.items():
        if kind_of(v, tensor.shape) in (Kind.ELEMENTWISE, Kind.BLOB):
            v = v.to(device=tensor.device, dtype=tensor.dtype if v.is_floating_point() and tensor.is_floating_point()
                     else v.dtype)
        out[k] = v
    return out


# [Note: rebuilding in place]
# A rebuild holds old and new params and state at once only where it must. The old
# partition is retired once the state moves are planned (and checked): its state is
# given up to the move (see [Note: moving without a spike] in _state.py), and a new
# buffer with the same plan as an old one (same DDP bucket, size and rank bounds: a
# trainability change inside DDP's buckets keeps them) is the old one, reused in place;
# any other old buffer is freed as soon as its last param has moved out.
def _reusable(previous: Partition | None, old_buffers: tuple[torch.Tensor, ...], layout: Layout) -> dict:
    """``{new buffer number: old buffer}`` for the new plans an old buffer matches exactly."""
    if previous is None or not old_buffers:
        return {}
    def key(lay: Layout, plan):  # a DDP bucket's buffer: its params' offsets follow from the bucket
        return None if plan.bucket is None else (lay.buckets[plan.bucket], plan.device, plan.dtype, plan.size,
                                                 plan.bounds)

    old = {key(previous.layout, plan): buf for plan, buf in zip(previous.layout.buffers, old_buffers)}
    old.pop(None, None)
    return {b: old[key(layout, plan)] for b, plan in enumerate(layout.buffers) if key(layout, plan) in old}


def all_holdings(parked: Holdings, partition: Partition | None) -> Holdings:
    """All state this rank holds: ``parked`` and ``partition``'s pieces', sorted by start."""
    held: Holdings = {i: list(hs) for i, hs in parked.items()}
    if partition is not None:
        for i, hs in partition.holdings().items():
            held.setdefault(i, []).extend(hs)
    for hs in held.values():
        hs.sort(key=lambda h: h.start)
    return held


def piece_shape(table: ParamTable, shard: str, i: int, start: int, stop: int) -> tuple[int, ...]:
    """The shape the local optimizer steps elements ``start:stop`` of param ``i`` as."""
    return tuple(table.params[i].shape) if shard == "param" else (stop - start,)


def rebuild(previous: Partition | None, parked: Holdings, table: ParamTable, layout: Layout, comm: Comm, *,
            moved: bool, optimizer_class: type, param_groups: list[dict],
            bucket_view: bool, masters: bool = False, runs: bool = True) -> tuple[Partition, Holdings]:
    """The Partition for ``layout``, built from ``previous`` and the ``parked`` state
    (frozen or loaded, not yet placed). Collective. Returns it and the state that stays
    parked (that of params outside the layout). ``moved``: whether state may have to
    change hands (else, with an unchanged layout, every rank keeps what it holds)."""
    held = all_holdings(parked, previous)
    trainable = {i for i, p in enumerate(table.params) if p.requires_grad}
    still_parked = {i: hs for i, hs in held.items() if i not in trainable}
    moves = None
    if moved or previous is None or layout != previous.layout or trainable & set(parked):
        targets: dict[int, list[tuple[int, int, int]]] = {}
        for r, pcs in enumerate(layout.all_pieces()):
            for pc in pcs:
                targets.setdefault(pc.index, []).append((r, pc.start, pc.stop))
        moves = plan_moves(comm, held, targets, numels=table.numels(), names=table.label)
    # Checked: from here on the old partition's state and buffers are given up as they go
    # (see [Note: rebuilding in place]).
    comm.release_completed_works()  # the last syncs' works still reference the old buffers
    old_buffers = () if previous is None else previous.retire()
    if moves is None:
        new_held = {i: hs for i, hs in held.items() if i in trainable}
    else:
        new_held = move(comm, moves, held, device_of=lambda i: table.params[i].device,
                        piece_shape=lambda i, start, stop: piece_shape(table, layout.shard, i, start, stop),
                        reuse_own=True, release=True)
    del held
    partition = Partition.build(table, layout, new_held, rank=comm.rank, optimizer_class=optimizer_class,
                                param_groups=param_groups, bucket_view=bucket_view, previous=previous,
                                old_buffers=old_buffers, masters=masters, runs=runs)
    return partition, still_parked
