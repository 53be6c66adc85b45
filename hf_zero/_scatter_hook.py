"""A DDP comm hook that reduce-scatters each gradient bucket into the ranks that own it.

[Note: reduce-scatter path]
DDP all-reduces every gradient bucket (2Ψ(N-1)/N bytes per rank), and ZeRO-1 then
re-syncs the parameters (Ψ(N-1)/N more). A rank only steps the elements it owns, so it
only needs their averaged gradient: with the optimizer's buffers laid out after DDP's
buckets (see the bucket note in layout.py), this hook replaces DDP's all-reduce with a
reduce-scatter of ``bucket.buffer()`` in place, which with the parameter sync moves
2Ψ(N-1)/N, DDP's own volume (docs/gradient_path.md). With a comm hook DDP does not
divide by the world size; the hook averages.

Lockstep: every rank sees the same buckets (DDP builds them on rank 0 and broadcasts
them) and the same layout (agreed at each step), so every rank takes the same branch
for every bucket. A bucket is reduce-scattered only when the layout was planned with
exactly the bucket structure seen in the previous syncing backward, and this bucket
has the same params there; anything else (the first backward, DDP's one rebuild of its
buckets after the first iteration, a bucket with params this optimizer does not hold,
a bucket without trainable params) is all-reduced, so full grads stay valid. The
structure the optimizer plans with changes only when two consecutive backwards saw
the same one, so the step that follows a reduce-scatter always uses the ranges the
grads were reduced into.

Each hook starts its bucket's collective and returns a future that an end-of-backward
callback, queued by the first hook and so run before DDP's finalizer, completes on the
backward's own thread (waiting, then the local sum of the received ranges): nothing runs
on the backend's threads ([Note: no Python on communication threads] in _works.py).

After the backward (a callback queued from that one runs after DDP has written the
hooks' results into ``.grad``): one scalar MAX all-reduce of
"a non-finite grad in my owned ranges". A local inf/NaN anywhere makes its owner's
average non-finite, so when no rank sets the flag no rank's grads hold one, and when
one does every rank gets a NaN written into the same grad element (on the device, where the
flag is: the host reads nothing): GradScaler's
``unscale_`` then finds an inf on every rank and all skip the step together. Without a
GradScaler (``bind_ddp(grad_scaler=False)``, as the integrations pass when Accelerate has
none) nothing skips steps, every rank steps, and the check is left out.

[Note: stage 1's check rides a bucket]
The layout check ([Note: the layout check] in _params.py) needs one bit from every rank each step: whether it
changed (its trainable set or shapes, a load, ``refresh_trainable()``). DDP's buckets do not follow a rank's
trainable set (DDP builds them once), so every rank reduces the same buckets whatever it changed, and the bit can
ride one of them. The *carrier* is the smallest bucket of the current layout that this hook reduce-scatters, if
it is at most ``_CARRIER_BYTES`` (DDP's first bucket is 1 MiB): every rank picks the same. Its reduce-scatter goes
through a staged copy (kept between steps) in which each rank's range ends with :data:`~hf_zero._heard.HEADER`
more elements, element ``x`` of rank ``r``'s range at ``x + HEADER * r``; every rank writes its bit into every
rank's header, the reduction leaves each rank the count of ranks that changed, and this rank's range is copied
back into DDP's bucket. The header goes to host memory when the bucket's collective is finished (on an
accelerator a non-blocking copy and an event), and the step reads it (:class:`~hf_zero._heard.Heard`): a steady
rank makes no collective for the check. The copy costs a pass over one small bucket where the check's all-reduce
cost a launch and a meeting of the ranks. Two headers alternate, so the next backward's does not overwrite one a
step reads late. The step makes the check itself (an all-reduce) where no bucket carried it: the first steps,
all-reduced buckets, no bucket small enough.

Only the last backward before a step may sync (DDP's ``no_sync()`` for the others):
a second syncing backward would add new local grads to already reduce-scattered ones,
which no reduction can undo, so it raises instead. ``optimizer.step()``,
``optimizer.zero_grad()`` and a backward whose grads are non-finite (GradScaler skips
the step) end the window.
"""

from __future__ import annotations

import logging
import weakref

import torch

from ._comm import early_divisor
from ._engine import queue_end_of_backward
from ._heard import HEADER, Heard

_CARRIER_BYTES = 4 << 20  # the largest bucket that carries the layout check: see the note

logger = logging.getLogger(__name__)


class BucketReducer:
    """The state DDP passes to :func:`_hook`: which optimizer, what was seen."""

    def __init__(self, optimizer):
        self._opt = weakref.ref(optimizer)
        self.comm = optimizer.comm
        self.seen: dict[int, tuple | None] = {}  # this backward: bucket index -> param indices
        # The buckets of the previous syncing backward (those holding only this optimizer's params).
        self.last: tuple | None = None
        self.scattered: list[torch.Tensor] = []  # this backward: the owned range of each reduce-scattered bucket
        self.scattered_params: set[int] = set()  # this backward: the params of those buckets
        self.reduced_since_step: set[int] = set()  # bucket indices
        # Params whose grads hold the average only in this rank's ranges until the next step.
        self.partial_grads: set[int] = set()
        # Those the last step left so (p.grad stays partial until zero_grad): until the next syncing backward
        self.stepped_partial: set[int] = set()
        self._queued = False
        # This backward's collectives and the futures DDP waits on: finished on the
        # backward's own thread before DDP's finalizer runs (see _finish_collectives).
        self._in_flight: list[tuple[torch.futures.Future, object]] = []
        # DDP's static graph runs every hook of its first backward inside its own
        # end-of-backward callback and waits there: finish each collective in its hook.
        self.finish_in_hook = False
        # Whether anything skips steps on non-finite grads (GradScaler): see the module note.
        self.agree_on_finite = True
        # The last syncing backward's agreed non-finite flag (a tensor, read only if another syncing backward
        # comes before the step: every rank's GradScaler then skipped the step if it is set)
        self.non_finite: torch.Tensor | None = None
        # bucket index -> its buffer's storage (data pointer, bytes): this backward's, and the last syncing one's
        self._storages_now: dict[int, tuple[int, int]] = {}
        self._storages: dict[int, tuple[int, int]] = {}
        # [Note: stage 1's check rides a bucket]: the carrier's staged copy, kept; the headers the step reads
        self._staged: torch.Tensor | None = None
        self._heads: tuple[tuple[int, ...], torch.Tensor] | None = None  # (positions, them on the device)
        self._heard = (Heard(self.comm), Heard(self.comm))
        self._turn = 0

    def bucket_storages(self) -> set[tuple[int, int]]:
        """DDP's bucket storages (data pointer, bytes) in the last syncing backward (empty before the first): a ``p.grad`` in one of them is a bucket view, not a grad of its own."""
        return set(self._storages.values())

    def step_taken(self) -> None:
        self.non_finite = None
        self.reduced_since_step.clear()
        self.stepped_partial |= self.partial_grads
        self.partial_grads.clear()

    def detach(self) -> None:
        """The optimizer unbound: from now on the hook averages every bucket, as DDP would
        (DDP keeps a comm hook for its lifetime)."""
        self._opt = _no_optimizer

    def defer(self, pending) -> torch.futures.Future:
        """The future DDP waits on for ``pending`` (a ``_works.Pending`` whose value is the bucket)."""
        if self.finish_in_hook:
            return _done(pending.wait())
        fut = torch.futures.Future()
        self._in_flight.append((fut, pending))
        return fut

    def staged(self, size: int, like: torch.Tensor, heads: list[int], changed: bool) -> torch.Tensor:
        """The carrier's staged copy: ``size`` elements of ``like``'s dtype, zeros where nothing is written,
        this rank's bit ``changed`` in every rank's header (at ``heads``)."""
        t, heads = self._staged, tuple(heads)
        if t is None or (t.numel(), t.dtype, t.device, self._heads[0]) != (size, like.dtype, like.device, heads):
            # another carrier, or the same one's ranks moved: a header left where data now lies would be summed
            self._staged = t = torch.zeros(size, dtype=like.dtype, device=like.device)
            self._heads = (heads, torch.tensor(heads).to(like.device, non_blocking=True))  # no host sync
        return t.index_fill_(0, self._heads[1], 1.0 if changed else 0.0)

    def next_heard(self) -> Heard:
        """Where this backward's carrier leaves its header (the other one may still be read late)."""
        self._turn ^= 1
        return self._heard[self._turn]

    def staged_bytes(self) -> int:
        return 0 if self._staged is None else self._staged.numel() * self._staged.element_size()

    def _finish_collectives(self) -> None:
        """Runs before DDP's finalizer: wait for each bucket's collective, finish it
        here rather than in a callback on the backend's thread ([Note: no Python on
        communication threads] in _works.py), and hand DDP its result."""
        in_flight, self._in_flight = self._in_flight, []
        for fut, pending in in_flight:
            fut.set_result(pending.wait())
        queue_end_of_backward(self._after_backward)

    def _after_backward(self) -> None:
        """Runs after DDP's own end-of-backward work (grads written)."""
        self._queued = False
        opt = self._opt()
        structure = tuple(self.seen[k] for k in sorted(self.seen) if self.seen[k] is not None)
        scattered, self.seen, self.scattered = self.scattered, {}, []
        self._storages, self._storages_now = self._storages_now, {}
        in_scattered, self.scattered_params = self.scattered_params, set()
        if opt is None:
            return
        self.partial_grads |= in_scattered
        self.stepped_partial = set()
        if scattered and self.agree_on_finite:
            self.non_finite = _agree_on_finite(opt, scattered, in_scattered)
        if self.last is None or structure == self.last:
            opt.plan_with_ddp_buckets(structure)
        self.last = structure
        # gloo keeps each collective's work, and what it references, a second or two after it completes
        # ([Note: no Python on communication threads]); let this backward's go now, as stage 2 does: measured
        # under Trainer (GPT-2 124M, bf16, 2 ranks), 28 MiB per rank otherwise held into the step and the next
        # forward whenever steps are faster than the sweep.
        self.comm.release_completed_works()


def attach(ddp: torch.nn.parallel.DistributedDataParallel, optimizer) -> BucketReducer | str:
    """Register the hook on ``ddp``; returns its state, or why it cannot be used."""
    state = BucketReducer(optimizer)
    state.finish_in_hook = bool(getattr(ddp, "static_graph", False))
    try:
        ddp.register_comm_hook(state, _hook)
    except RuntimeError as e:  # DDP takes one comm hook, registered before any backward
        return f"DistributedDataParallel already has a communication hook or has run a backward ({e})"
    return state


def _hook(state: BucketReducer, bucket):  # unannotated: DDP checks a real annotation, not a string
    opt = state._opt()
    buffer = bucket.buffer()
    if opt is None:  # the optimizer is gone: average, as DDP would
        return _done(state.comm.all_reduce_mean_(buffer).wait())
    k = bucket.index()
    state._storages_now[k] = (buffer.untyped_storage().data_ptr(), buffer.untyped_storage().nbytes())
    if k in state.reduced_since_step and state.non_finite is not None and bool(state.non_finite):
        # Every rank's GradScaler skipped the step (no optimizer.step()): what the grads hold no
        # longer matters, so this syncing backward is not an error.
        state.reduced_since_step.clear()
        state.non_finite = None
    if k in state.reduced_since_step:
        raise RuntimeError(
            "hf_zero: a second gradient-syncing backward before optimizer.step(): with "
            "grad_reduce='reduce_scatter' only the last backward of a gradient accumulation may sync "
            "(wrap the others in DistributedDataParallel.no_sync(), as Trainer and Accelerate do), or "
            "use grad_reduce='all_reduce'"
        )
    state.reduced_since_step.add(k)
    if not state._queued:
        state._queued = True
        # Queued now, this callback runs before DDP's finalizer; it queues _after_backward, which runs after it.
        queue_end_of_backward(state._finish_collectives)
    indices = opt.param_indices(bucket.parameters())
    composition = None if None in indices else indices
    state.seen[k] = composition
    bounds = None
    if composition is not None and state.last is not None and opt.ddp_buckets_planned() == state.last:
        bounds = opt.bucket_bounds(composition)
    if bounds is None:
        return state.defer(opt.comm.all_reduce_mean_(buffer))
    rank, n = opt.comm.rank, buffer.numel()
    state.scattered.append(buffer[min(bounds[rank], n) : min(bounds[rank + 1], n)])
    state.scattered_params.update(composition)
    if composition == opt.check_carrier():
        heard = state.next_heard()
        return state.defer(_Carried(state, opt.comm, buffer, bounds, opt.carry_check(heard), heard))
    return state.defer(opt.comm.reduce_scatter_(buffer, bounds))


class _Carried:
    """The carrier's reduce-scatter ([Note: stage 1's check rides a bucket]): started when made; :meth:`wait`
    copies this rank's range back into DDP's ``buffer``, the header into ``heard``, and returns ``buffer``."""

    def __init__(self, state: BucketReducer, comm, buffer: torch.Tensor, bounds, changed: bool, heard: Heard):
        world, rank, n = comm.world_size, comm.rank, buffer.numel()
        clipped = [min(b, n) for b in bounds]
        moved = [b + HEADER * r for r, b in enumerate(bounds)]
        staged = state.staged(moved[-1], buffer, [b - HEADER for b in moved[1:]], changed)
        divisor = early_divisor(buffer.dtype, world)  # divided as copied in (a pass fewer), the headers not
        chunk = bounds[1] - bounds[0]
        if n == chunk * world and all(b - a == chunk for a, b in zip(bounds, bounds[1:])):
            pairs = [(buffer.view(world, chunk), staged.view(world, chunk + HEADER)[:, :chunk])]
        else:
            pairs = [(buffer[a:z], staged[a + HEADER * r : z + HEADER * r])
                     for r, (a, z) in enumerate(zip(clipped, clipped[1:]))]
        for source, into in pairs:
            if divisor > 1:
                torch.div(source, divisor, out=into)
            else:
                into.copy_(source)
        self._pending = comm.reduce_scatter_(staged, moved, divided=divisor > 1)
        self._mine = buffer[clipped[rank] : clipped[rank + 1]]
        at = clipped[rank] + HEADER * rank
        self._reduced = staged[at : at + self._mine.numel()]
        self._header = staged[moved[rank + 1] - HEADER : moved[rank + 1]]
        self._buffer, self._heard = buffer, heard

    def wait(self) -> torch.Tensor:
        self._pending.wait()
        self._mine.copy_(self._reduced)
        self._heard.capture(self._header, self._buffer.dtype)
        return self._buffer


def carrier_of(layout, world_size: int) -> tuple[int, ...] | None:
    """The params of ``layout``'s carrier bucket ([Note: stage 1's check rides a bucket]), or None."""
    if layout is None or world_size == 1:
        return None
    smallest = min(((buf.size * buf.dtype.itemsize, buf.bucket) for buf in layout.buffers if buf.bucket is not None),
                   default=(_CARRIER_BYTES + 1, None))
    return layout.buckets[smallest[1]] if smallest[0] <= _CARRIER_BYTES else None


def _no_optimizer() -> None:
    return None


def _done(value) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def _agree_on_finite(opt, owned: list[torch.Tensor], scattered: set[int]) -> torch.Tensor:
    """Make GradScaler's inf check agree on every rank (see the module note); returns the agreed flag, a 0-dim
    tensor that is 1 where some rank's grads hold an inf or NaN (GradScaler skips the step), read by nobody in a
    steady step: the NaN goes into the grad on the device. ``owned``: this rank's range of each
    reduce-scattered bucket (DDP keeps the hook's result there); the grads of other params (all-reduced, or
    averaged by hf_zero) are checked whole."""
    rest = [p.grad for i, p in enumerate(opt.params) if i not in scattered and p.grad is not None]
    flag = opt.comm.all_reduce_(_non_finite(owned + rest, opt.comm.device), op="max",
                                what="agreeing on non-finite gradients")
    for p in opt.params:  # the same param on every rank: grads are present alike everywhere
        if p.requires_grad and p.grad is not None and p.grad.numel():
            cell = p.grad.view(-1)[:1]
            cell.copy_(torch.where(flag.to(cell.device) > 0, torch.full_like(cell, float("nan")), cell))
            break
    return flag


def _non_finite(grads: list[torch.Tensor], device) -> torch.Tensor:
    """1.0 (a 0-dim float32 on ``device``) if some grad holds an inf or NaN, else 0.0, computed without reading
    anything on the host. A float64 sum is finite exactly when every element is (no float16, bfloat16 or
    float32 sum of finite values reaches float64's range), so one pass of sums settles it."""
    grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    sums = torch.stack([g.sum(dtype=torch.float64).to(device) for g in grads])
    return (~torch.isfinite(sums)).any().to(torch.float32)
