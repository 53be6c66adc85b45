"""The only module that calls torch.distributed.

Every function is a collective over ``group`` unless it says otherwise; every rank
must call it with arguments of the same shape, in the same order.
"""

from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ._engine import coalesced_broadcast
from ._works import Pending, keep, let_go_completed, let_go_settled, named as _named

SYNC_BY = ("all_gather", "broadcast", "send_recv")
REDUCE_SCATTER_BY = ("send_recv", "all_to_all", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class Strategy:
    """Which collective carries the parameter sync and the gradient reduce-scatter
    ([Note: sync collective], [Note: reduce-scatter collective]). Checked when made; a
    choice a tensor cannot take (gloo point-to-point on CUDA, all_gather or
    reduce_scatter over unequal ranges) falls back per call, as the notes say."""

    sync_by: str = "send_recv"
    reduce_scatter_by: str = "send_recv"

    def __post_init__(self):
        if self.sync_by not in SYNC_BY:
            raise ValueError(f"sync_by must be one of {', '.join(map(repr, SYNC_BY))}, got {self.sync_by!r}")
        if self.reduce_scatter_by not in REDUCE_SCATTER_BY:
            raise ValueError(
                f"reduce_scatter_by must be one of {', '.join(map(repr, REDUCE_SCATTER_BY))}, "
                f"got {self.reduce_scatter_by!r}"
            )


def default_strategy(backend: str | None) -> Strategy:
    """The measured fastest choice for ``backend`` (NCCL: its native collectives; gloo and
    world size 1: point-to-point)."""
    if backend == "nccl":
        return Strategy(sync_by="all_gather", reduce_scatter_by="reduce_scatter")
    return Strategy(sync_by="send_recv", reduce_scatter_by="send_recv")


class Comm:
    """A process group (or none: world size 1) and the collectives hf_zero needs. ``strategy``: which collectives
    to use (default: :func:`default_strategy` of the group's backend); :meth:`use_strategy` swaps it."""

    def __init__(self, process_group=None, *, strategy: Strategy | None = None):
        if strategy is not None and not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a hf_zero._comm.Strategy, got {type(strategy).__name__}")
        self.group = process_group
        self.enabled = dist.is_available() and dist.is_initialized()
        self._scratch = _Scratch()  # the reduce-scatters' receive scratch
        self._agreement_slots: dict = {}  # see Agreement
        self._last_agreement: Agreement | None = None
        if not self.enabled:
            if process_group is not None:
                raise ValueError("process_group was given but torch.distributed is not initialized")
            self.rank, self.world_size, self.backend = 0, 1, None
            self._keep_works = False
            self._strategy = strategy or default_strategy(None)
            return
        self.rank = dist.get_rank(process_group)
        if self.rank < 0:
            raise ValueError(
                f"process_group does not contain this process (global rank {dist.get_rank()})"
            )
        self.world_size = dist.get_world_size(process_group)
        self.backend = str(dist.get_backend(process_group)).lower()
        self._keep_works = self.backend == "gloo"  # see [Note: no Python on communication threads]
        self._strategy = strategy or default_strategy(self.backend)
        self._globals = [
            r if process_group is None else dist.get_global_rank(process_group, r)
            for r in range(self.world_size)
        ]
        self._sync_group = None  # see own_sync_group

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    def use_strategy(self, strategy: Strategy) -> None:
        """Use ``strategy`` for the collectives started from now on (every rank alike)."""
        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a hf_zero._comm.Strategy, got {type(strategy).__name__}")
        self._strategy = strategy

    def release_completed_works(self, *, drop_scratch: bool = False, at_end: bool = False) -> None:
        """Let go of the completed collectives' work objects now, and of the tensors they reference (gloo keeps
        them a while: [Note: no Python on communication threads] in _works.py); ``drop_scratch``: of the receive
        scratch too, unless a reduce-scatter holds it; ``at_end``: at the end of a run, which may come right
        before exit (``_works.let_go_settled``). Not collective."""
        if self._keep_works:
            let_go_settled() if at_end else let_go_completed()
        self._scratch.drop(drop_scratch)

    def _pending(self, works: list, what: str, finish: Callable[[], Any] | None = None) -> Pending:
        if self._keep_works:
            keep(works)
        return Pending(works, what, self.rank, finish=finish)

    def _blocking(self, what: str, collective: Callable, *args, **kwargs) -> None:
        """Run ``collective(*args, group=..., async_op=True, **kwargs)`` and wait for it
        (through ``Pending``, so its work object is kept: see the note there)."""
        with _named(what, self.rank):
            work = collective(*args, group=self.group, async_op=True, **kwargs)
        self._pending([work], what).wait()

    def own_sync_group(self) -> None:
        """Run the parameter sync over a process group of its own (the same ranks and
        backend), created now: every rank of this group must call it, in the same order.

        [Note: a group for the overlapped sync]
        A backend runs one group's collectives in order: NCCL on one stream, gloo over one
        socket per peer. An overlapped sync still in flight would hold up every other
        collective of the group until it completes, e.g. the one Trainer starts each step
        with (gathering the number of label tokens across ranks, before the forward): the
        forward would then wait for the whole sync. Measured on gloo (Trainer, GPT-2 30M,
        batch 4): that gather took 35 ms behind the sync, 6 ms with the sync on its own group.
        """
        if self.world_size > 1 and self._sync_group is None:
            self._sync_group = _sync_group(self._globals, self.backend)

    def same_group(self, process_group) -> bool:
        """Whether ``process_group`` (None: the world) has exactly this group's ranks, in order."""
        if not self.enabled:
            return process_group is None
        other = process_group if process_group is not None else dist.group.WORLD
        return dist.get_process_group_ranks(other) == self._globals

    @property
    def process_group(self):
        """The group hf_zero shards over (``dist.group.WORLD`` for the default; None without torch.distributed)."""
        if not self.enabled:
            return None
        return self.group if self.group is not None else dist.group.WORLD

    @property
    def device(self) -> torch.device:
        """Where small control tensors live for this backend."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return _CPU

    # -- parameter sync ---------------------------------------------------------
    def sync_buffer(self, buffer: torch.Tensor, bounds: Sequence[int], *, async_op: bool = False):
        """Give every rank the whole ``buffer``; rank r holds the truth in ``bounds[r]:bounds[r+1]``.

        ``async_op=True`` returns a :class:`Pending` to wait on (None when nothing is sent).

        [Note: sync collective]
        Measured on gloo (docs/gradient_path.md, "Measured"; docs/architecture.md, field
        facts): point-to-point sends of each rank's range, straight from and into the
        buffer, match or beat one broadcast per rank (0.38-0.48 of an all-reduce against
        0.40-0.53 on 2 ranks), and all_gather is 2-8x slower; NCCL's
        all_gather_into_tensor is its fastest path.
        So equal ranges on NCCL use one in-place all-gather, CPU tensors on gloo
        sends and receives, everything else one broadcast per rank.
        """
        if self.world_size == 1:
            return None
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        how = self._strategy.sync_by
        if (how == "all_gather" and len(set(sizes)) != 1) or (how == "send_recv" and buffer.device.type != "cpu"):
            how = "broadcast"  # gloo's point-to-point is CPU-only
        group = self._sync_group if self._sync_group is not None else self.group
        with _named("the parameter sync", self.rank):
            if how == "all_gather":
                lo, hi = bounds[self.rank], bounds[self.rank + 1]
                # torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single.
                all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
                works = [all_gather(buffer, buffer[lo:hi], group=group, async_op=True)]
            elif how == "send_recv":
                lo, hi = bounds[self.rank], bounds[self.rank + 1]
                others = [r for r in range(self.world_size) if r != self.rank]
                works = self._exchange(
                    sends=[(r, buffer[lo:hi]) for r in others],
                    recvs=[(r, buffer[bounds[r] : bounds[r + 1]]) for r in others],
                    tag=_TAG_PARAMS,
                    group=group,
                )
            else:
                works = [
                    dist.broadcast(buffer[a:b], src=self._globals[r], group=group, async_op=True)
                    for r, (a, b) in enumerate(zip(bounds, bounds[1:]))
                    if b > a
                ]
        pending = self._pending(works, "the parameter sync")
        if async_op:
            return pending
        pending.wait()
        return None

    def _exchange(self, *, sends, recvs, tag: int, group=None) -> list:
        """Start point-to-point transfers over ``group`` (default: this one): ``sends`` /
        ``recvs`` are (rank, contiguous tensor); empty ones are skipped (both ends know the
        sizes). gloo matches a pair's messages of one tag in the order they were posted, and
        every rank posts in the same order."""
        group = group if group is not None else self.group
        works = [dist.irecv(t, src=self._globals[r], group=group, tag=tag) for r, t in recvs if t.numel()]
        works += [dist.isend(t, dst=self._globals[r], group=group, tag=tag) for r, t in sends if t.numel()]
        return works

    # -- gradients: reduce-scatter ---------------------------------------------------
    def reduce_scatter_(self, buffer: torch.Tensor, bounds: Sequence[int], *, out: torch.Tensor | None = None,
                        divided: bool = False, accumulate: bool = False) -> Pending:
        """Average ``buffer`` over ranks into this rank's range only. Asynchronous: the
        :class:`Pending`'s ``wait()`` finishes the average and returns ``buffer``.

        Afterwards ``buffer[bounds[r]:bounds[r+1]]`` (cut at ``buffer.numel()``: bounds may
        run past the end, into padding) holds the mean over ranks on rank r; the rest of
        ``buffer`` holds this rank's own values (divided by the world size for dtypes
        narrower than 32 bits). Given ``out`` (1-D, as many elements as this rank's cut
        range, ``buffer``'s dtype), the mean goes there instead, the same bits, and this
        rank's range of ``buffer`` is left unspecified: the point-to-point sum writes it
        straight into ``out`` (one pass over the range fewer than a copy after). ``divided``: a
        ``buffer`` narrower than 32 bits already holds this rank's values divided by the world
        size (its writer divided as it copied them in: one pass over the bucket fewer). ``out`` may be
        float32 for a 16-bit ``buffer``, as ``accumulate`` (add the mean to ``out``) needs: [Note: summing wider].

        [Note: reduce-scatter collective]
        Measured on gloo (2 and 3 ranks, 4-120 MB fp32, docs/gradient_path.md), with the
        local sum, relative to an all-reduce: the native ``reduce_scatter_tensor`` runs a
        full all-reduce plus a copy (1.9-2.8x); ``all_to_all_single`` moves only the
        (N-1)/N a reduce-scatter needs but also copies this rank's own chunk (0.6-1.2x);
        point-to-point sends of each other rank's range into one reused scratch buffer,
        summed into this rank's range in place, move the same bytes without that copy
        (0.56-0.98x). gloo's point-to-point is CPU-only: CUDA tensors on gloo take
        ``all_to_all_single``. NCCL's ``reduce_scatter_tensor`` is its fast
        path; it needs equal ranges covering the input, so a bucket is staged into a
        padded copy when its size is not a multiple of N, and unequal ranges
        (``shard="param"``) go through ``all_to_all_single`` there too.

        [Note: reduce-scatter scratch]
        The point-to-point and all-to-all paths receive into scratch: one buffer per
        device, lent to one reduce-scatter at a time. Starting the next one first
        finishes the one holding it (DDP hands buckets in the same order on every rank,
        so the peers' sends for it were posted already); the bucket in flight still
        overlaps the backward of the next one. Point-to-point receives of more than
        ``_SCRATCH_BYTES`` come in pieces through two slots of half that (see
        :meth:`_send_recv_sum`), so that scratch stays within ``_SCRATCH_BYTES`` however
        large a bucket is (a tied embedding is one bucket: GPT-2's would otherwise keep
        74 MiB at 2 ranks); all-to-all's is one bucket's receive.
        """
        how = self._strategy.reduce_scatter_by
        n, world = buffer.numel(), self.world_size
        if len(bounds) != world + 1 or bounds[0] != 0 or bounds[-1] < n:
            raise ValueError(f"bounds {list(bounds)} must start at 0 and cover all {n} elements, one range per rank")
        clipped = [min(b, n) for b in bounds]
        lo, hi = clipped[self.rank], clipped[self.rank + 1]
        mine = buffer[lo:hi]
        wide = out is not None and out.dtype == torch.float32 and buffer.dtype.itemsize < 4
        if (out is not None and (out.dim() != 1 or out.numel() != hi - lo or not (wide or out.dtype == buffer.dtype))
                or accumulate and not wide):
            raise ValueError(f"out must be 1-D with {hi - lo} elements of {buffer.dtype} (or float32, as accumulate "
                             f"needs), got {None if out is None else (tuple(out.shape), out.dtype)}")
        if world == 1:
            return self._pending([], "", finish=lambda: buffer if out is None else _copied(out, mine, buffer, accumulate))
        early = early_divisor(buffer.dtype, world) > 1
        if early and not divided:
            buffer.div_(world)
        if (how == "reduce_scatter" and len({b - a for a, b in zip(bounds, bounds[1:])}) != 1) or (
            how == "send_recv" and buffer.device.type != "cpu"
        ):
            how = "all_to_all"
        with _named("reduce-scattering gradients", self.rank):
            if how == "reduce_scatter":
                chunk = bounds[1] - bounds[0]
                staged = buffer
                if n != chunk * world:
                    staged = torch.zeros(chunk * world, dtype=buffer.dtype, device=buffer.device)
                    staged[:n].copy_(buffer)
                reduced = torch.empty(chunk, dtype=buffer.dtype, device=buffer.device)
                reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
                works = [reduce_scatter(reduced, staged, group=self.group, async_op=True)]

                def finish():
                    mine.copy_(reduced[: hi - lo])
                    if not early:
                        mine.div_(world)
                    return buffer

            elif how == "send_recv":
                works, finish = self._send_recv_sum(buffer, clipped, early, out, accumulate)

            elif how == "all_to_all":
                splits = [b - a for a, b in zip(clipped, clipped[1:])]
                received = self._scratch.take(world * (hi - lo), buffer.dtype, buffer.device)
                works = [dist.all_to_all_single(
                    received, buffer, [hi - lo] * world, splits, group=self.group, async_op=True
                )]

                def finish():
                    torch.sum(received.view(world, hi - lo), 0, out=mine)
                    if not early:
                        mine.div_(world)
                    self._scratch.returned()
                    return buffer

            else:
                if not early:
                    buffer.div_(world)
                works = [dist.all_reduce(buffer, group=self.group, async_op=True)]

                def finish():
                    return buffer

        if out is not None and how != "send_recv":
            finish_in_buffer = finish

            def finish():
                return _copied(out, mine, finish_in_buffer(), accumulate)

        pending = self._pending(works, "reduce-scattering gradients", finish=finish)
        if how in ("send_recv", "all_to_all"):
            self._scratch.lent_to(pending)
        return pending

    def _send_recv_sum(self, buffer: torch.Tensor, clipped: list[int], early: bool, out=None, accumulate=False):
        """Point-to-point reduce-scatter of ``buffer``: start it, return (works, finish); the
        mean of this rank's range lands in ``out`` when given (added to it: ``accumulate``), else in place.

        A range whose receive exceeds ``_SCRATCH_BYTES`` travels in pieces (the cut,
        :func:`_pieces`, depends only on the range, the world size and the dtype, so
        sender and receiver agree): every send is posted now, the receives of the first
        two pieces now and each later one as its slot frees, in ``finish``. Sends are
        waited for last: a peer posts its later receives only while finishing."""
        world, rank = self.world_size, self.rank
        lo, hi = clipped[rank], clipped[rank + 1]
        mine, others = buffer[lo:hi], [r for r in range(world) if r != rank]
        into = mine if out is None else out
        size = buffer.element_size()
        outgoing = [(r, buffer[a:b]) for r in others for a, b in _pieces(clipped[r], clipped[r + 1], world, size)]
        sends = self._exchange(sends=outgoing, recvs=[], tag=_TAG_GRADS)
        cuts = _pieces(0, hi - lo, world, size)
        depth, width = min(2, len(cuts)), max((b - a for a, b in cuts), default=0)
        slots = self._scratch.take(depth * (world - 1) * width, buffer.dtype, buffer.device)
        slots = slots.view(depth, world - 1, width)

        def receive(k: int) -> list:
            n = cuts[k][1] - cuts[k][0]
            incoming = [(r, slots[k % 2, i, :n]) for i, r in enumerate(others)]
            return self._exchange(sends=[], recvs=incoming, tag=_TAG_GRADS)

        receiving = [receive(k) for k in range(depth)]
        if self._keep_works:  # the first piece's receives are kept with the Pending
            keep(sends + [w for ws in receiving[1:] for w in ws])

        def finish():
            with _named("reduce-scattering gradients", rank):
                for k, (a, b) in enumerate(cuts):
                    for w in receiving[k] if k else ():  # the first piece's: Pending waited (twice would hang gloo)
                        w.wait()
                    _sum_piece(into[a:b], None if into is mine else mine[a:b], slots[k % 2, :, : b - a],
                               divide_by=1 if early else world, accumulate=accumulate)
                    if k + 2 < len(cuts):
                        receiving.append(receive(k + 2))
                        if self._keep_works:
                            keep(receiving[-1])
                for w in sends:
                    w.wait()
            self._scratch.returned()
            return buffer

        return (receiving[0] if receiving else []), finish

    def scratch_bytes(self) -> int:
        """Bytes of reduce-scatter receive scratch held now (see [Note: reduce-scatter scratch])."""
        return self._scratch.nbytes

    def scratch_peak(self, reset: bool = False) -> int:
        """The most receive scratch held since the last reset (``reset``: start afresh after)."""
        return self._scratch.peak_since(reset)

    def all_reduce_mean_(self, buffer: torch.Tensor) -> Pending:
        """Average ``buffer`` over ranks in place (every element). Asynchronous: the
        :class:`Pending`'s ``wait()`` returns ``buffer``."""
        if self.world_size == 1:
            return self._pending([], "", finish=lambda: buffer)
        buffer.div_(self.world_size)
        with _named("averaging gradients", self.rank):
            work = dist.all_reduce(buffer, group=self.group, async_op=True)
        return self._pending([work], "averaging gradients", finish=lambda: buffer)

    def all_reduce_(self, tensor: torch.Tensor, *, op: str, what: str) -> torch.Tensor:
        """Sum (``op="sum"``) or max (``op="max"``) a small tensor over ranks, in place."""
        if self.world_size > 1:
            red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
            self._blocking(what, dist.all_reduce, tensor, op=red)
        return tensor

    def broadcast_coalesced_(self, tensors: Sequence[torch.Tensor], *, src: int = 0, what: str) -> None:
        """Give every rank rank ``src``'s values of ``tensors`` (written in place) in as few collectives as their
        bytes allow (one up to 250 MiB), as DDP broadcasts its module's buffers and, at construction, its params
        (torch's ``_broadcast_coalesced``: the tensors flattened per dtype and device, sent, copied back)."""
        if self.world_size == 1 or not tensors:
            return
        staged = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        with _named(what, self.rank):
            coalesced_broadcast()(self.process_group, staged, _COALESCED_BYTES, self._globals[src])
        for t, s in zip(tensors, staged):
            if s is not t:
                t.copy_(s)

    # -- agreement ----------------------------------------------------------------
    def agree(self, fingerprint: int, flag: bool = False) -> tuple[bool, bool]:
        """(every rank passed the same 62-bit ``fingerprint``, some rank passed ``flag``), at once."""
        agreement = self.start_agreement(fingerprint, flag)
        return agreement.same, agreement.anyone

    def start_agreement(self, fingerprint: int, flag: bool, payload: torch.Tensor | None = None, *,
                        extra: bool = False) -> "Agreement":
        """Start comparing ``fingerprint`` and ``flag`` across ranks, a second flag ``extra`` and a ``payload``
        (int64, 1-D) MAX-reduced along; read the :class:`Agreement` when it is due."""
        return Agreement(self, fingerprint, flag, payload, extra=extra)

    def all_gather_object(self, obj: Any) -> list:
        """Small metadata only (rebuilds, errors): pickled."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        with _named("a metadata exchange", self.rank):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    # -- state movement -------------------------------------------------------------
    def all_to_all(self, send: Sequence[torch.Tensor], recv_sizes: Sequence[int], *, dtype, device) -> list[torch.Tensor]:
        """Send ``send[r]`` (1-D) to rank r; receive ``recv_sizes[r]`` elements from rank r."""
        if self.world_size == 1:
            return [send[0].clone()]
        send_sizes = [t.numel() for t in send]
        inp = torch.cat(list(send)) if send else torch.empty(0, dtype=dtype, device=device)
        out = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
        self._blocking("moving optimizer state between ranks", dist.all_to_all_single, out, inp,
                       list(recv_sizes), send_sizes)
        return list(out.split(list(recv_sizes)))

    def barrier(self) -> None:
        if self.world_size > 1:
            self._blocking("a barrier", dist.barrier)


class Agreement:
    """A comparison of a 62-bit fingerprint and a flag across ranks: one MAX all-reduce of six int64s
    (x, -x, the flag, -the flag, a second flag, -it), started when made, read with :attr:`same`, :attr:`anyone`,
    :attr:`everyone` and :attr:`extra`.

    [Note: reading an agreement late]
    Reading a collective's result on the host waits for everything queued before it: on an accelerator, the
    whole step's kernels. So a steady step does not read its agreement where it starts it:

    - on the CPU (gloo): at the end of the step, once the step's own collectives were waited for (stage 2: at
      the start of the step, the check having started with the backward); by then the all-reduce, started
      before them, has completed on every rank, and reading it waits for nothing;
    - an accelerator: :meth:`settle` (when the agreement starts; with gloo, whose wait blocks the host, where it
      is read) queues a copy of the result into pinned host memory on a side stream that waits for the
      all-reduce alone, and records an event there; the result is read after that event, which the queued
      compute does not delay.

    The values are read through a ``ctypes`` view of the host memory, made once per buffer: its reads are plain
    memory reads, which nothing queued can delay (a read of a ``torch.Tensor``'s value is what
    tests/test_hostpath.py counts: on an accelerator, each one waits)."""

    def __init__(self, comm: Comm, fingerprint: int, flag: bool, payload: torch.Tensor | None = None, *,
                 extra: bool = False):
        self._values: tuple[int, ...] | None = None
        self._event = None
        self._cpu = comm.device.type == "cpu"
        values = (fingerprint, -fingerprint, int(flag), -int(flag), int(extra), -int(extra))
        self._payload, self._tensor = payload, None
        if comm.world_size == 1:
            self._values = values
            return
        if comm._last_agreement is not None:  # its slots are reused: its result is read first
            comm._last_agreement._read()
        comm._last_agreement = self
        host, view = _host_slot(comm, 0)
        view[:] = values
        if self._cpu:
            self._tensor = host if payload is None else torch.cat([host, payload])
            self._view = view if payload is None else (ctypes.c_int64 * _HEAD).from_address(self._tensor.data_ptr())
        else:
            head = host.to(comm.device, non_blocking=True)
            self._tensor = head if payload is None else torch.cat([head, payload])
            self._host, self._view = _host_slot(comm, 1)
        with _named("the cross-rank layout agreement check", comm.rank):
            work = dist.all_reduce(self._tensor, op=dist.ReduceOp.MAX, group=comm.group, async_op=True)
        self._pending, self._work = comm._pending([work], "the cross-rank layout agreement check"), work
        if not comm._keep_works:  # gloo's wait() would block the host here: it settles where it is read
            self.settle()

    def payload(self) -> torch.Tensor:
        """The ``payload`` (int64, 1-D) MAX-reduced over ranks (on the device: nothing is read on the host)."""
        if self._tensor is None:  # world size 1
            return self._payload
        self._pending.wait()
        return self._tensor[_HEAD:]

    def wait(self) -> None:
        """Wait for the all-reduce (nothing is read)."""
        if self._tensor is not None:
            self._pending.wait()

    def settle(self) -> None:
        """On an accelerator, queue the result's copy to the host on a side stream that waits for the all-reduce
        only (the compute queued meanwhile does not delay reading it)."""
        if self._values is None and not self._cpu and self._event is None:
            side = _side_stream(self._tensor.device)
            with torch.cuda.stream(side):
                self._work.wait()  # the side stream waits; the host does not (nor, until payload(), the step's)
                self._tensor.record_stream(side)
                self._host.copy_(self._tensor[:_HEAD], non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(side)

    def _read(self) -> tuple[int, ...]:
        if self._values is None:
            if self._cpu:
                self._pending.wait()
            else:
                self.settle()
                self._event.synchronize()
            self._values = tuple(self._view)
        return self._values

    @property
    def same(self) -> bool:
        """Every rank passed the same fingerprint."""
        v = self._read()
        return v[0] == -v[1]

    @property
    def anyone(self) -> bool:
        """Some rank passed the flag."""
        return bool(self._read()[2])

    @property
    def everyone(self) -> bool:
        """Every rank passed the flag."""
        return self._read()[3] == -1

    @property
    def extra(self) -> bool:
        """Some rank passed the second flag."""
        return bool(self._read()[4])


_HEAD = 6  # the int64s an Agreement compares, before its payload


def _host_slot(comm: Comm, slot: int):
    """An Agreement's int64s in host memory (pinned for an accelerator) and a ctypes view of them, made once per
    ``comm``."""
    if slot not in comm._agreement_slots:
        host = torch.zeros(_HEAD, dtype=torch.int64, pin_memory=comm.device.type == "cuda")
        comm._agreement_slots[slot] = (host, (ctypes.c_int64 * _HEAD).from_address(host.data_ptr()))
    return comm._agreement_slots[slot]


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device):
    """The stream an accelerator's agreement results are copied to the host on (one per device)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


_CPU = torch.device("cpu")
_COALESCED_BYTES = 250 * 1024 * 1024  # DDP's broadcast_bucket_size
# Point-to-point tags, one per purpose: gloo matches messages by (peer, tag), in order.
_TAG_GRADS = 0x68660001
_TAG_PARAMS = 0x68660002
# The most a point-to-point reduce-scatter receives into at once. It lives through the backward beside the
# activations: 8 MiB keeps GPT-2 124M's stage-2 peak at 4 ranks 8 MiB lower than 16 did, in pieces of 4 MiB
# per slot, large enough for gloo's point to point to run at full speed.
_SCRATCH_BYTES = 8 << 20


class _Scratch:
    """The reduce-scatters' receive scratch ([Note: reduce-scatter scratch]): one store per
    device, lent to one reduce-scatter at a time."""

    def __init__(self):
        self._store: dict[torch.device, torch.Tensor] = {}
        self._holder: Pending | None = None
        self.peak = 0  # the most held since Comm.scratch_peak reset it

    def take(self, numel: int, dtype, device) -> torch.Tensor:
        """Room for ``numel`` elements, once the reduce-scatter holding it is finished. Kept between
        calls: on the CPU a fresh allocation above glibc's mmap threshold faults in new pages on every
        call (measured: it doubled the time of a 32 MB reduce-scatter)."""
        holder, self._holder = self._holder, None
        if holder is not None:
            holder.wait()
        nbytes = numel * dtype.itemsize
        store = self._store.get(device)
        if store is None or store.numel() < nbytes:
            self._store.pop(device, None)  # room first: old and new never live together
            del store
            store = self._store[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.peak = max(self.peak, self.nbytes)
        return store[:nbytes].view(dtype)

    def lent_to(self, pending: Pending) -> None:
        self._holder = pending

    def drop(self, wanted: bool = True) -> None:
        """Let the store go (if ``wanted``), unless a reduce-scatter holds it."""
        if wanted and self._holder is None:
            self._store = {}

    def peak_since(self, reset: bool) -> int:
        peak = max(self.peak, self.nbytes)
        if reset:
            self.peak = self.nbytes
        return peak

    def returned(self) -> None:
        self._holder = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self._store.values())


def early_divisor(dtype: torch.dtype, world_size: int) -> int:
    """What a reduce-scatter divides each rank's values of ``dtype`` by before summing them: the world
    size for dtypes narrower than 32 bits (as DDP does: keeps fp16 sums in range), else 1 (wider ones are
    divided after the sum, over this rank's range only)."""
    return world_size if world_size > 1 and dtype.itemsize < 4 else 1


def _copied(out: torch.Tensor, mine: torch.Tensor, result, accumulate: bool = False):
    if accumulate:
        out.add_(mine)
    else:
        out.copy_(mine)
    return result


def _sum_piece(into: torch.Tensor, mine: torch.Tensor | None, received: torch.Tensor, *, divide_by: int,
               accumulate: bool) -> None:
    """One piece of the point-to-point reduce-scatter: the ``received`` rows (one per peer) summed into
    ``into`` (this rank's range itself when ``mine`` is None, else ``out``, started from ``mine``), then
    divided by ``divide_by``. Bitwise what DDP's all-reduce gives at 2 ranks, (a + b) / 2 = a / 2 + b / 2
    (a one-pass lerp is within an ulp only: resuming on the all-reduce path would then not replay a run
    exactly). In place, or into ``out``: a temporary sum would fault in fresh pages. Each piece is divided
    while it is still in cache."""
    for i in range(received.shape[0]):
        if i == 0 and mine is not None:
            _first_sum(into, mine, received[0], accumulate)
        else:
            into.add_(received[i])
    if divide_by != 1:
        into.div_(divide_by)


def _first_sum(into: torch.Tensor, mine: torch.Tensor, other: torch.Tensor, accumulate: bool) -> None:
    """``into`` = ``mine`` + ``other`` (``accumulate``: ``into`` += both), each add in ``into``'s dtype.

    [Note: summing wider]
    A 16-bit bucket's values are divided by N before they are sent (``early_divisor``: exact for
    N a power of two, short of underflow). Summed in 16 bits, each partial sum over ranks is
    rounded, and an accumulation into a 16-bit shard rounds once more per micro-batch. A
    float32 ``out`` of :meth:`Comm.reduce_scatter_` gets the point-to-point path's sum in float32
    instead (``torch.add(out=)`` would sum 16-bit inputs in 16 bits, then widen): ``out`` takes
    this rank's range, then adds each peer's, so a float32 shard holds the sum over ranks and
    micro-batches with float32 roundings only (for two ranks, one add of two 16-bit values:
    exact unless their exponents are 2^16 apart), for the same bytes sent. The other paths
    (NCCL's ``reduce_scatter_tensor``, all-to-all for CUDA tensors on gloo) sum in the bucket's
    dtype and their 16-bit mean is then added into ``out``: one 16-bit rounding per micro-batch,
    none across micro-batches."""
    if into.dtype == mine.dtype and not accumulate:
        torch.add(mine, other, out=into)
        return
    if accumulate:
        into.add_(mine)
    else:
        into.copy_(mine)
    into.add_(other)


def _pieces(start: int, stop: int, world: int, itemsize: int) -> list[tuple[int, int]]:
    """``[start, stop)`` as a point-to-point reduce-scatter moves it: whole when its
    receive, world - 1 copies, fits in ``_SCRATCH_BYTES``; else in pieces of half that."""
    if (world - 1) * (stop - start) * itemsize <= _SCRATCH_BYTES:
        return [(start, stop)] if stop > start else []
    step = max(1, _SCRATCH_BYTES // (2 * (world - 1) * itemsize))
    return [(a, min(a + step, stop)) for a in range(start, stop, step)]


_SYNC_GROUPS: dict[tuple, tuple] = {}  # (ranks, backend) -> (the world it was made in, group)


def _sync_group(ranks: list[int], backend: str):
    """One sync group per set of ranks and backend, shared by every optimizer over them
    (each group costs threads and sockets, or a NCCL communicator); made anew after the
    default group was destroyed and re-initialized. Collective over ``ranks`` (once)."""
    key = (tuple(ranks), backend)
    world, group = _SYNC_GROUPS.get(key, (None, None))
    if world is not dist.group.WORLD:
        group = dist.new_group(ranks=list(ranks), backend=backend, use_local_synchronization=True)
        _SYNC_GROUPS[key] = (dist.group.WORLD, group)
    return group


def fingerprint(items: Sequence[Any]) -> int:
    """A 62-bit hash of ``repr(items)``, stable across processes (unlike ``hash``)."""
    digest = hashlib.blake2b(repr(items).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2
