"""Stage 2: hf_zero's own gradient reducer, grads sharded as the backward produces them.

[Note: stage 2 reducer]
Under stage 2 the model is not wrapped in DDP (DDP's reducer allocates every gradient
bucket whole: docs/stage2.md). :meth:`Reducer.bind` broadcasts the module's params and
buffers from rank 0, as DDP does (buffers again after each syncing backward, DDP's
``broadcast_buffers``, unless turned off: [Note: buffers after a syncing backward]), and
hooks every param of the optimizer:

- **Buckets.** The trainable params, in reverse order of the bound module's registration
  (DDP's order, about the order a backward finishes them), are cut into buckets of at most
  ``bucket_cap_mb`` (one larger param alone), one (device, dtype) each (:func:`plan_buckets`).
  The optimizer's layout is planned with these buckets ([Note: bucket layout] in
  _layout.py), so each bucket splits into the N ranges its ranks own. The plan is a function
  of the params' specs and the module's order only: a freeze or unfreeze re-plans it
  identically on every rank.
- **Hook.** Once autograd has finished a param's grad (a post-accumulate-grad hook), it
  is copied into its bucket (allocated at its first copy) and ``p.grad`` is set to None.
  [Note: dividing as the grads come] A grad the reduce-scatter divides before summing
  (narrower than 32 bits: ``early_divisor`` in _comm.py) is divided in that copy, which
  saves the pass over the whole bucket that dividing it in place would take, with the same
  bits (one rounding of each grad divided by N either way); the bucket goes to
  ``Comm.reduce_scatter_`` as ``divided``. A param whose grad reaches its bucket twice in
  one backward (two reentrant regions) adds its second grad divided too: at N = 2 the same
  bits as dividing the sum (halving is exact), otherwise within an ulp of it.
  Params get their hook at bind, or before the first forward after they need a grad
  (unfrozen, or added with ``add_param_group``): torch refuses a hook on a frozen param.
- **Order.** When a backward arms (see [Note: arming a backward]) each bucket counts the
  params this backward will reach (``torch._C._will_engine_execute_node``); a param it will
  not reach adds zeros (or the grad it accumulated under ``no_sync()``). A bucket is
  reduce-scattered (``Comm.reduce_scatter_``, asynchronous, overlapping the rest of the
  backward) once it and every bucket before it are complete: every rank starts them in
  bucket order, which gloo's point-to-point matching needs. The end of the backward (an
  autograd engine callback) starts whatever is left, in the same order, and finishes
  every bucket: every rank reduces every bucket in every syncing backward, so a param
  unused on some ranks is averaged with their zeros (DDP's ``find_unused_parameters``)
  and nothing waits for a grad that never comes.
- **In flight.** At most :func:`buckets_in_flight` buckets are being reduced at once:
  :data:`MAX_IN_FLIGHT` with NCCL's reduce-scatter; one where the reduce-scatters take turns
  with the comm's receive scratch (gloo's point to point, all-to-all: starting one finishes
  the one holding it, [Note: reduce-scatter scratch] in _comm.py), so a bucket is finished
  and back in the pool before the next starts, and no third bucket is alive for a
  reduction that could not run anyway. The first reduction of a
  bucket since the step sums this rank's range straight into its *shard* (the bucket's
  owned range, allocated then and let go at the step; float32 for a 16-bit bucket by default:
  [Note: what stage 2 accumulates in]); a later one (accumulation) adds its average into the
  shard, as it sums into a float32 shard, or when it finishes into one of the bucket's dtype.
  A finished bucket goes back to the
  pool ([Note: bucket pool]). Buckets alive at once: those in flight plus
  those being filled, usually one or two, each at most ``bucket_cap_mb`` (a bucket
  complete before an earlier one waits for it; a param larger than the cap is a bucket
  of its own).
- **Accumulation.** Every syncing backward adds into the shards (as DeepSpeed and
  Colossal-AI do). Under :meth:`Reducer.no_sync` the hooks do nothing: grads accumulate
  in ``p.grad`` and the next syncing backward reduces the sum.
  [Note: what stage 2 accumulates in]
  The shards of a bf16/fp16 bucket are the bucket's dtype (``grad_accum_dtype="param"``, the
  default of ``"auto"``: stage 1's arithmetic, bitwise, at stage 1's speed), or float32
  (``"fp32"``: on the CPU's point-to-point path the mixed-dtype sums cost about 8% of a bf16
  GPT-2 iteration at batch 4, measured with benchmarks.e2e). Each micro-batch's bucket is sent as
  today, in 16 bits, each rank's values divided by N as they are copied in; the
  point-to-point reduce-scatter (gloo, CPU) then sums this rank's range and each peer's
  straight into the float32 shard, adding to what it holds ([Note: summing wider] in
  _comm.py). So the shard holds the sum over ranks and micro-batches of the very bf16
  grads autograd produced, with float32 roundings only; measured on a bf16 GPT-2 with 8
  micro-batches, every element equal to the float64 sum rounded once to float32, and the
  bf16 weights after 8 steps equal to a run stepped on that exact sum
  (benchmarks/accumulation.py). In 16-bit shards, (g1a + g1b)/2 + (g2a + g2b)/2 is
  rounded at every addition, and DDP's local accumulation (stage 1) rounds g1a + g2a
  first: neither is the sum, and the two differ from each other and from it by about a
  bf16 ulp in a third of the weights after 8 steps. NCCL's reduce-scatter sums in the
  bucket's dtype; its 16-bit mean is added into the float32 shard (one 16-bit rounding per
  micro-batch, none across them). Cost: 2/N more bytes per param (the shard), nothing on
  the wire. The step reads float32 grads: the fp32 masters take them as they are (an
  exact copy); without masters they are rounded once to the param's dtype; clipping and a
  GradScaler's ``unscale_`` work on the float32 shards (so fp16 params can use a GradScaler,
  which refuses to unscale 16-bit grads, as it still does with ``"param"``). Shards are
  never saved, and a
  trainability change re-plans them in the same dtype. ``"param"`` keeps stage 1's
  arithmetic: bitwise stage 1's grads without accumulation or under ``no_sync()``
  (``local_accumulation``), at 2/N bytes per param.
- **Arming.** [Note: arming a backward] A forward hook on the bound module puts a prehook
  on the autograd node of each output tensor (torch's pytree: tuples, dicts, a transformers
  ``ModelOutput``), as DDP's ``_DDPSink`` does with a Function: the first to run is the
  outermost start of a backward through the model, where the reducer arms and queues its
  end-of-backward callback (on that backward, not on a nested one). A reentrant checkpoint
  (``use_reentrant=True``) runs its region's backward nested inside its node: the region's
  params are unreachable from the outer graph when it arms, and their hooks fire inside
  the nested backward. So when some params are unreached, a walk of the graph below the
  outputs looks for a reentrant checkpoint node that will run (stopping at the first; its
  answer kept while the same params are unreached); if there is one, the unreached params
  *may still come*: they are counted like reached ones, their buckets go as their regions
  finish, and the end of the backward adds zeros (or their ``no_sync()`` grad) for those that
  never came. A param whose grad comes twice in one backward (two regions) is summed while
  its bucket is open; after its bucket went it is an error. A forward none of whose outputs
  needs a grad (this rank used no trainable param) gets outputs that do (copies through an
  empty leaf), so that this rank's backward arms too and joins the reduce-scatters with
  zeros. A param hook firing before any prehook (a param used outside the model's
  forward) arms there. A backward that raised never ends: the next forward, ``zero_grad()``
  or step finishes the reductions it started, drops the rest, and the step refuses the
  partial shards until ``zero_grad()``.
- **Unanswered forwards.** [Note: a forward without its backward] A rank whose loss does
  not come from the bound module's outputs runs none of the reducer in its backward, while
  the other ranks' backwards wait for its reduce-scatters (DDP hangs the same way), and so
  does a rank that skips the model altogether before stepping. Each rank records whether a
  backward armed since the last step (and whether a forward ran, for the message):
  clipping, ``unscale_`` or the step raise on a rank where none armed, naming the cause, so
  that rank fails at once (and a launcher stops the rest) instead of every rank waiting for
  the collective timeout. It costs a flag per forward and backward, no collective; it also
  refuses, on every rank alike, a step with no backward since the last one, which DDP
  allows as a no-op.
- **Reading.** :meth:`Reducer.sharded` hands the step and clipping this rank's averaged
  grads (:class:`ShardedGrads`). A param no rank got a grad for since the last step has
  none (DDP's ``find_unused_parameters`` leaves it None too; the optimizer skips it):
  one small all-reduce after a backward agrees on that, folded into clipping's norm or a
  GradScaler's inf check where there is one ([Note: agreeing on presence]). The step
  consumes the shards (as ``zero_grad`` would).
- **p.grad.** [Note: p.grad stands in for the shards]
  Under DDP the averaged grads live in ``p.grad``, so everything that clears ``p.grad``
  drops them: ``module.zero_grad()`` of any submodule (the DCGAN loop clears D before G's
  loss backpropagates through D, and again before D's next step), ``p.grad = None`` by hand,
  ``zero_grad(set_to_none=False)``. torch has no hook for any of these; the only thing they
  touch is ``p.grad``. So after each syncing backward every param of the reduced buckets
  gets a *stand-in* in ``p.grad`` (every rank alike): a NaN expanded to the param's shape
  from one element (no memory; kept from one backward to the next). What was done to it is
  read back before the next backward accumulates (a tensor hook of each param, and the
  arming), and before the step or clipping reads the shards: set to None, this rank's
  elements of the param's grad are zeroed in the shard and the param has no grad since the
  step (the step skips it, as torch's optimizers skip a grad of None: no weight decay, no
  moments); zeroed in place, its elements are zeroed and it keeps a grad; replaced by
  another tensor or changed otherwise, it is an error that names the fix (the shards cannot
  follow). Reading a stand-in gives NaN, and an in-place op other than ``zero_()`` on it
  raises (torch refuses writes to an expanded tensor): code that reads or scales ``p.grad``
  between backward and step (``torch.nn.utils.clip_grad_norm_``) fails loudly rather than
  seeing nothing. The step and ``zero_grad`` take the stand-ins out again.
- **Buffers.** [Note: buffers after a syncing backward]
  DDP broadcasts rank 0's buffers at the start of a forward when the forward before it
  synced grads (``require_forward_param_sync``): the next training forward, also the first
  one of an accumulation's micro-batches under ``no_sync()``. Under Trainer the model that
  callbacks get is the bound module itself, so a broadcast at a forward would also run in
  a callback's forward on rank 0 alone (a sample loss, generation) and every rank would
  wait for the collective timeout: a forward must run no collective. So rank 0's buffers
  are sent at the end of each syncing backward, where every rank is, and each other rank
  takes them at its next grad-mode forward: the forward DDP would have broadcast before.
  Training forwards read what they read under DDP, buffers saved for the backward are
  never written during it, and evaluation under ``no_grad`` between steps reads each
  rank's own buffers, as under Trainer + DDP. Two differences remain: what rank 0 changes
  in its buffers between a syncing backward and the next training forward (a forward on
  rank 0 alone in train mode) reaches the other ranks one syncing backward later; and
  buffers made to differ after ``bind_module`` are not overwritten before the first
  forward (DDP's first forward broadcasts), only from the second.
- **Several optimizers.** [Note: several optimizers over one module]
  Each stage-2 optimizer bound to a module reduces its own params' grads (a backbone and a
  head with optimizers of their own); the trainable params must be covered by them, which
  is checked at the first forward (not at a bind: the next optimizer may hold the rest).
  ``no_sync()`` suspends every one, and only the first bound broadcasts buffers. The
  module's two forward hooks are registered by the first bind and call every reducer bound
  to it; each reducer's unbind takes it out, and the last one removes the hooks and
  ``no_sync`` ([Note: a binding ends with its run] in _binding.py). gloo
  matches collectives by order, and two reducers' buckets would complete in an order that
  depends on each rank's graph: so the first reducer armed in a backward reduces its
  buckets as they complete, and every other one armed while it is (one optimizer per
  module of a GAN too) reduces all of its buckets at its own end of the backward; the ends
  run in the order the reducers armed, so every rank starts the same collectives in the
  same order.
- **GradScaler.** :meth:`Reducer.unscale_` unscales the shards and agrees on inf/NaN over
  every rank's shard (one MAX all-reduce), for a GradScaler routed to it
  ([Note: GradScaler over sharded grads] in integrations/amp.py). When the scaler then
  skips the step, the next backward drops the unscaled shards first, as a step would.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from dataclasses import dataclass

import torch

from ._binding import Binding, Hook
from ._comm import Comm, early_divisor
from ._engine import (
    grad_accumulator, graph_task_id, queue_end_of_backward, reentrant_region_below, running_node, tree_tensors,
    version_of, will_run,
)
from ._layout import Layout, Piece, plan_layout

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


def _backward_order(table, module_ref) -> list[int]:
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
class _Plan:
    """One layout as the reducer uses it; ``where[i]``: (buffer, offset, numel) of param i;
    per buffer (in bucket order): its reduced size, bounds, and this rank's range in it."""

    layout: Layout
    where: dict
    sizes: tuple[int, ...]
    owned: tuple[tuple[int, int], ...]
    gaps: tuple[tuple[tuple[int, int], ...], ...]  # per buffer: the ranges no slot covers (alignment)


def _plan_of(layout: Layout, rank: int) -> _Plan:
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
    return _Plan(layout, where, tuple(sizes), tuple(owned), tuple(gaps))


class _SinceStep:
    """This rank's record since the last step: which params had a grad here (``touched``) and the set
    agreed over ranks (``agreed``, None until agreed: [Note: agreeing on presence]); whether a forward
    of the bound module whose backward should sync ran (``forwarded``), and whether a backward armed."""

    def __init__(self, agreed: frozenset | None = None):
        self.touched: set[int] = set()
        self.agreed = agreed
        self.forwarded = self.armed = False

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

    def flags(self, count: int, dtype: torch.dtype, device) -> torch.Tensor:
        """This rank's 0/1 flag per param (``count`` of them): an all-reduce's SUM or MAX of them is
        positive exactly where some rank had a grad."""
        mask = torch.zeros(count, dtype=dtype, device=device)
        if self.touched:
            mask[sorted(self.touched)] = 1
        return mask

    def settle(self, reduced: torch.Tensor) -> None:
        self.agreed = frozenset((reduced > 0).nonzero().flatten().tolist())

    def drop(self, i: int) -> None:
        """Param ``i`` has no grad since the step (on this rank; agreed ones too)."""
        self.touched.discard(i)
        if self.agreed is not None:
            self.agreed = self.agreed - {i}


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
    GradScaler's inf check, and the step finds them agreed. Otherwise the step's
    :meth:`agree` runs it alone."""

    def __init__(self, plan: _Plan, shards: list, since: _SinceStep, comm: Comm, count: int):
        self.layout, self.device = plan.layout, comm.device
        self.pieces: list[Piece] = plan.layout.pieces(comm.rank)
        self._plan, self._shards, self._since, self._comm, self._count = plan, shards, since, comm, count

    def held(self, piece: Piece) -> torch.Tensor | None:
        shard = self._shards[piece.buffer] if self._shards else None
        if shard is None:
            return None
        start = piece.offset - self._plan.owned[piece.buffer][0]
        return shard[start : start + piece.numel]

    def __call__(self, piece: Piece) -> torch.Tensor | None:
        if self._since.agreed is None:
            raise RuntimeError("hf_zero: ShardedGrads read before the ranks agreed on which params have grads")
        return self.held(piece) if piece.index in self._since.agreed else None

    def all_reduce_along(self, scalar: torch.Tensor, *, op: str, what: str) -> torch.Tensor:
        """``scalar`` (0-dim) all-reduced with ``op`` ("sum" or "max"), with the presence flags riding
        along until they are agreed (either op marks presence). Collective (one small all-reduce)."""
        if self._since.agreed is not None:
            return self._comm.all_reduce_(scalar, op=op, what=what)
        flags = self._since.flags(self._count, scalar.dtype, self._comm.device)
        both = self._comm.all_reduce_(torch.cat([scalar.reshape(1), flags]), op=op, what=what)
        self._since.settle(both[1:])
        return both[0]

    def agree(self) -> "ShardedGrads":
        """Agree on which params have grads, unless done already. Collective (one small all-reduce, or none)."""
        if self._since.agreed is None:
            flags = self._since.flags(self._count, torch.float32, self._comm.device)
            self._since.settle(self._comm.all_reduce_(flags, op="max", what="agreeing on which params have gradients"))
        return self


class Reducer:
    """See [Note: stage 2 reducer]. ``table``: a callable returning the optimizer's ParamTable (held weakly
    by the caller); ``shard``: its shard mode; ``accumulate_dtype``: see :func:`shard_dtype`."""

    def __init__(self, comm: Comm, table, shard: str, accumulate_dtype: torch.dtype | None = None):
        self.comm, self.accumulate_dtype = comm, accumulate_dtype
        self._table = table
        self._shard = shard
        self.cap_bytes = int(DEFAULT_BUCKET_CAP_MB * (1 << 20))
        self.module_ref = None
        self._plan: _Plan | None = None
        self._plan_key = None
        self._accumulators: dict = {}  # param index -> its AccumulateGrad node, per plan
        self._suspended = False  # inside no_sync()
        self._broadcast_buffers = False
        self._buffers = _ReceivedBuffers()
        self._param_hooks: _ParamHooks | None = None  # while bound
        self._coverage_due, self.local_accumulation = False, True  # bound with params it does not hold; see bind
        self._deferred = False  # this backward reduces at its end only: [Note: several optimizers over one module]
        self._stand_ins = _StandIns()
        weakref.finalize(self, self._stand_ins.clear)  # none left in p.grad once this reducer is gone
        # This backward (between its arming and its end).
        self._armed, self._left = False, []  # _left: per buffer, grads still to come this backward
        self._pending: set[int] = set()  # params counted in _left that have not come yet
        self._placed: set[int] = set()  # params whose grad is in their bucket this backward
        self._regions_cache: tuple = (None, False)  # (unreached params, reentrant regions below)
        self._broken = False  # a backward raised midway since the last step / zero_grad
        self._next = 0  # the next buffer to reduce-scatter
        self._filling: dict[int, tuple] = {}  # buffer -> (bucket, pooled base or None, divided by N already)
        self._in_flight: deque = deque()
        self.in_flight_limit = buckets_in_flight(comm.strategy.reduce_scatter_by)
        self._pool = _BucketPool(keep=self.in_flight_limit + 1)
        # Since the last step.
        self._shards: list = []  # per buffer of the reduced plan: this rank's range, or None
        self._written: set[int] = set()  # buffers whose shard holds grads since the last step
        self._reduced: _Plan | None = None  # the plan the shards follow
        self._since = _SinceStep()
        self._unscaled = False  # a GradScaler unscaled the shards (unscale_): the next backward starts fresh
        self.bucket_bytes = 0  # reduce buckets in use now
        self._unpooled_bytes = 0  # those of them not from the pool
        self.peak_bucket_bytes = 0  # the most held since the last step (held_bucket_bytes)

    # -- binding ------------------------------------------------------------------------
    @property
    def bound(self) -> bool:
        return self.module_ref is not None

    def bind(self, module: torch.nn.Module, binding: Binding, *, cap_bytes: int, broadcast_buffers: bool = True,
             local_accumulation: bool = True) -> None:
        """``local_accumulation=False``: the module's ``no_sync()`` does nothing, so every backward
        reduces into the shards (Accelerate's ``accumulate`` and Trainer enter it on every
        micro-batch but the last). Every hook goes through ``binding``, whose ``close()`` removes
        them and unbinds ([Note: a binding ends with its run]); the module's forward hooks and
        ``no_sync`` are shared by the reducers bound to it ([Note: several optimizers over one module])."""
        if self.module_ref is not None and self.module_ref() is module:
            return
        others = _refuse_binding(module, self.module_ref, cap_bytes=cap_bytes, local_accumulation=local_accumulation)
        table = self._table()
        self._coverage_due = any(p.requires_grad and table.index(p) is None for p in module.parameters())
        self.cap_bytes = cap_bytes
        self.local_accumulation = local_accumulation
        _broadcast_at_bind(self.comm, [*table.params, *module.parameters(), *module.buffers()])
        self._param_hooks = _ParamHooks(self, binding)
        binding.on_close(self._unbound)
        self._param_hooks.hook(table.params)
        self._broadcast_buffers = (broadcast_buffers and self.comm.world_size > 1 and not others
                                   and any(True for _ in module.buffers()))
        self.module_ref = weakref.ref(module)
        self._plan_key = None  # planned again, in the module's order
        _attach(module, self)

    def _unbound(self) -> None:
        """The binding closed (its handles are removed next): drop the grads not stepped (the stand-ins
        leave ``p.grad``) and forget the module, so that a later bind hooks everything again."""
        module = self.module_ref() if self.module_ref is not None else None
        self.step_taken()
        self.module_ref, self._param_hooks, self._coverage_due = None, None, False
        self._plan_key, self._accumulators = None, {}
        broadcasting, self._broadcast_buffers = self._broadcast_buffers, False
        if module is not None:
            _detach(module, broadcasting)

    @property
    def suspended(self) -> bool:
        """Inside :meth:`no_sync`."""
        return self._suspended

    @contextlib.contextmanager
    def no_sync(self):
        """Grads accumulate in ``p.grad`` (not reduced) inside; the next syncing backward reduces the sum."""
        suspended, self._suspended = self._suspended, True
        try:
            yield
        finally:
            self._suspended = suspended

    # -- planning --------------------------------------------------------------------------
    def buckets(self) -> tuple[tuple[int, ...], ...]:
        """The buckets of the current specs (what the optimizer plans its layout with)."""
        return self._current_plan().layout.buckets

    def _current_plan(self) -> _Plan:
        specs = self._table().specs()
        key = (tuple(specs), self.cap_bytes)
        if key != self._plan_key:
            layout = plan_layout(specs, world_size=self.comm.world_size, shard=self._shard,
                                 buckets=plan_buckets(specs, self.cap_bytes, _backward_order(self._table(), self.module_ref)))
            self._plan, self._plan_key = _plan_of(layout, self.comm.rank), key
            self._pool.plan(layout.buffers, self._plan.sizes, self.cap_bytes)
            params = self._table().params
            self._accumulators = {i: grad_accumulator(params[i]) for i in self._plan.where}
        return self._plan

    # -- the backward ----------------------------------------------------------------------
    def before_forward(self, module: torch.nn.Module) -> None:
        """The bound module's forward pre-hook: see [Note: arming a backward]."""
        if graph_task_id() != -1:  # a checkpoint recomputing the forward inside a backward
            return
        if self._armed:
            self._abandon()
        if self._coverage_due:
            self._coverage_due = _check_coverage(module)  # False, or it raises
        self._param_hooks.hook(self._table().params)
        self._buffers.take()

    def after_forward(self, output):
        """The bound module's forward hook: arm the backward of ``output`` at its start (unless
        that backward runs under ``no_sync()``: decided when it runs)."""
        if not torch.is_grad_enabled():
            return None
        leaves, rebuild = tree_tensors(output)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        anchored = not tensors
        if anchored:
            # Nothing of this forward needs a grad (this rank's control flow used no trainable
            # param): give its float outputs one so that the backward still arms here and
            # this rank joins the other ranks' reduce-scatters (with zeros).
            if not self._current_plan().where:
                return None
            output, tensors = _anchored(leaves, rebuild)
            if output is None:
                return None
        self._since.forwarded |= not self._suspended
        hook = _arm(weakref.ref(self))
        for node in {t.grad_fn for t in tensors}:
            node.register_prehook(hook)
        return output if anchored else None  # None: the forward's own output, untouched

    def arm(self, root) -> None:
        """A backward through the bound module's outputs starts at autograd node ``root``."""
        if not self._armed and not self._suspended:
            self._begin(root)

    def on_grad(self, i: int, p: torch.Tensor) -> None:
        if self._suspended or p.grad is None:
            return
        if not self._armed:
            self._begin(None)
        where = self._plan.where.get(i)
        if where is None:  # no elements: in no bucket
            p.grad = None
            return
        if where[0] < self._next:
            raise RuntimeError(
                f"hf_zero stage 2: a gradient for {self._table().label(i)} arrived after its bucket was reduced "
                "in this backward (a param used in several reentrant checkpoint regions, or reached by a nested "
                "backward hf_zero did not foresee); use checkpoint(..., use_reentrant=False)"
            )
        self._put_grad(i, p)
        if i in self._pending:
            self._pending.discard(i)
            self._left[where[0]] -= 1
            self._launch_ready()

    def _begin(self, root) -> None:
        self.settle(clear=True)
        if self._unscaled:  # unscaled, then no step (GradScaler skipped it on an inf): these grads are spent
            self.step_taken()
        plan = self._current_plan()
        if self._written and self._reduced is not plan:
            raise RuntimeError(
                "hf_zero stage 2: the trainable params (or their shapes) changed between two backwards "
                "of one gradient accumulation: change requires_grad only right after optimizer.step() "
                "or zero_grad()"
            )
        self._armed, self._next, self._since.armed = True, 0, True
        self._deferred = any(r is not self for r in _ARMED)
        _ARMED.add(self)
        self._left, self._pending, self._placed = [0] * len(plan.sizes), set(), set()
        params, accumulators = self._table().params, self._accumulators
        unreached = []
        for i, (b, _, _) in plan.where.items():
            if will_run(accumulators[i]):
                self._left[b] += 1
                self._pending.add(i)
            else:
                unreached.append(i)
        if unreached and root is not None and self._reentrant_regions(root, unreached):
            for i in unreached:  # may still come, from a region's nested backward
                self._left[plan.where[i][0]] += 1
                self._pending.add(i)
        else:
            for i in unreached:
                if params[i].grad is not None:  # accumulated under no_sync(), not reached now
                    self._put_grad(i, params[i])
        queue_end_of_backward(self._end_of_backward)
        self._launch_ready()

    def _reentrant_regions(self, root, unreached: list[int]) -> bool:
        """Whether a reentrant checkpoint region will run below ``root`` (the walk stops at the first; its
        answer kept while the same params are unreached): see [Note: arming a backward]."""
        key = tuple(unreached)
        if self._regions_cache[0] != key:
            self._regions_cache = (key, reentrant_region_below(root))
        return self._regions_cache[1]

    def _put_grad(self, i: int, p: torch.Tensor) -> None:
        b, offset, numel = self._plan.where[i]
        g, spec = p.grad, self._plan.layout.buffers[b]
        if (b not in self._filling and offset == 0 and numel == self._plan.sizes[b] and g.is_contiguous()
                and g.storage_offset() == 0 and g.untyped_storage().nbytes() == g.nbytes
                and g.dtype == spec.dtype and g.device == spec.device):
            # The bucket is this one grad (a param above the cap, e.g. an embedding): reduce
            # it in its own storage, which nothing else holds once p.grad lets go, not a copy.
            self._filling[b] = (g.view(-1), None, False)
            self._count_bucket(g.nbytes, pooled=False)
            self._placed.add(i)
            p.grad = None
            self._since.touched.add(i)
            return
        slot, g = self._bucket(b)[offset : offset + numel], g.reshape(-1)
        n = early_divisor(spec.dtype, self.comm.world_size)
        if i in self._placed:  # a second grad in one backward (nested backwards): summed as autograd would
            slot.add_(g if n == 1 else g / n)
        elif n == 1:
            slot.copy_(g)
        else:
            torch.div(g, n, out=slot)  # [Note: dividing as the grads come]
        self._placed.add(i)
        p.grad = None
        self._since.touched.add(i)

    def _bucket(self, b: int) -> torch.Tensor:
        """Bucket ``b`` of this backward, taken from the pool at its first use: its slots are
        written as the grads come (:meth:`_launch` zeroes the ones that never came) and its
        gaps zeroed now ([Note: bucket pool])."""
        held = self._filling.get(b)
        if held is None:
            plan = self._plan.layout.buffers[b]
            buf, base = self._pool.take(self._plan.sizes[b], plan.dtype, torch.device(plan.device))
            for a, z in self._plan.gaps[b]:
                buf[a:z].zero_()
            held = self._filling[b] = (buf, base, early_divisor(plan.dtype, self.comm.world_size) > 1)
            self._count_bucket(buf.nbytes, pooled=base is not None)
        return held[0]

    def _count_bucket(self, nbytes: int, *, pooled: bool) -> None:
        """A bucket taken into use (``nbytes < 0``: given back)."""
        self.bucket_bytes += nbytes
        if not pooled:
            self._unpooled_bytes += nbytes
        self.peak_bucket_bytes = max(self.peak_bucket_bytes, self.held_bucket_bytes)
        self._pool.seen(self.bucket_bytes, self.bucket_bytes - self._unpooled_bytes)

    @property
    def held_bucket_bytes(self) -> int:
        """Reduce-bucket memory held now: the buckets in use that are not the pool's, and the pool's."""
        return self._unpooled_bytes + self._pool.held_bytes

    def _launch_ready(self) -> None:
        if self._deferred:
            return
        while self._next < len(self._left) and self._left[self._next] == 0:
            self._launch(self._next)

    def _launch(self, b: int) -> None:
        buf = self._bucket(b)
        _, base, divided = self._filling.pop(b)
        # a bucket, pooled or fresh ([Note: bucket pool]), holds old values where no grad came
        for s in self._plan.layout.buffers[b].slots:
            if s.index not in self._placed:
                buf[s.offset : s.offset + s.numel].zero_()
        self._next = b + 1
        while len(self._in_flight) >= self.in_flight_limit:
            self._finish(*self._in_flight.popleft())
        if self._reduced is not self._plan:
            self._shards, self._reduced = [None] * len(self._plan.sizes), self._plan
        into, first, dtype = None, b not in self._written, shard_dtype(self.accumulate_dtype, buf.dtype)
        if first or dtype != buf.dtype:  # straight into the shard: [Note: what stage 2 accumulates in]
            lo, hi = self._plan.owned[b]
            into = self._shards[b]
            if into is None:
                into = self._shards[b] = torch.empty(hi - lo, dtype=dtype, device=buf.device)
        pending = self.comm.reduce_scatter_(buf, self._plan.layout.buffers[b].bounds, out=into, divided=divided,
                                            accumulate=into is not None and not first)
        self._in_flight.append((b, buf, base, into is not None, pending))

    def _finish(self, b: int, buf: torch.Tensor, base: torch.Tensor | None, direct: bool, pending) -> None:
        pending.wait()
        if not direct:  # accumulating in the bucket's dtype: this backward's average added to the shard's
            lo, hi = self._plan.owned[b]
            self._shards[b].add_(buf[lo:hi])
        self._written.add(b)
        if base is not None:
            self._pool.give(base)
        self._count_bucket(-buf.nbytes, pooled=base is not None)
        # gloo keeps a collective's work, and the bucket it sends, a while after it completes
        # ([Note: no Python on communication threads]): without this, every bucket of every
        # backward in the last second or two stays alive, a full set of grads per fast step.
        self.comm.release_completed_works(drop_scratch=self.bucket_bytes == 0)  # [Note: bucket pool]

    def _end_of_backward(self) -> None:
        params = self._table().params
        for i in sorted(self._pending):  # counted but never came: its no_sync() grad, or zeros
            if params[i].grad is not None:
                self._put_grad(i, params[i])
        while self._next < len(self._left):
            self._launch(self._next)
        while self._in_flight:
            self._finish(*self._in_flight.popleft())
        self._armed, self._since.agreed, self._pending = False, None, set()
        _ARMED.discard(self)
        self._stand_ins.place(params, [i for i in self._plan.where if params[i].grad is None and params[i].requires_grad])
        if self._broadcast_buffers and self.module_ref() is not None:
            self._buffers.receive(self.comm, list(self.module_ref().buffers()))

    def _abandon(self) -> None:
        """The armed backward never ended (it raised): finish the reductions it started (every
        rank started the same ones), drop the buckets being filled, and mark the shards partial."""
        while self._in_flight:
            self._finish(*self._in_flight.popleft())
        for buf, base, _ in self._filling.values():
            if base is not None:
                self._pool.give(base)
            self._count_bucket(-buf.nbytes, pooled=base is not None)
        self._filling.clear()
        self._armed, self._since.agreed, self._pending, self._broken = False, None, set(), True
        _ARMED.discard(self)

    # -- p.grad between the backward and the step: [Note: p.grad stands in for the shards] ------
    def settle(self, *, clear: bool) -> None:
        """Follow what was done to the stand-ins in ``p.grad``; ``clear``: a grad is about to be accumulated."""
        if self._stand_ins:
            for i, zeroed in self._stand_ins.settle(self._table(), clear=clear):
                _zero_in_shards(self._reduced, self._shards, i)
                if not zeroed:  # dropped: no grad since the step
                    self._since.drop(i)

    # -- reading ---------------------------------------------------------------------------
    def sharded(self) -> ShardedGrads:
        """This rank's averaged grads, for all ranks to :meth:`ShardedGrads.agree` on before reading them
        (or to settle along with another all-reduce: [Note: agreeing on presence])."""
        if not self.bound:
            raise RuntimeError(
                "hf_zero: stage=2 reduces grads itself: call optimizer.bind_module(model) on every rank "
                "before the first backward (and do not wrap the model in DistributedDataParallel)"
            )
        if self._armed and graph_task_id() == -1:
            self._abandon()
        if self._broken:
            raise RuntimeError(
                "hf_zero stage 2: a backward raised before it finished since the last step: the gradients "
                "hold part of it; call optimizer.zero_grad() before the next backward"
            )
        self.settle(clear=False)
        table = self._table()
        _refuse_unreduced(table, self._stand_ins)
        self._since.check_answered()
        if self._reduced is None or not self._written:  # the same on every rank: nothing to agree on
            return ShardedGrads(self._current_plan(), [], _SinceStep(frozenset()), self.comm, len(table.params))
        return ShardedGrads(self._reduced, self._shards, self._since, self.comm, len(table.params))

    def unscale_(self, inv_scale: torch.Tensor, found_inf: torch.Tensor, *, allow_fp16: bool) -> None:
        """A GradScaler's unscale of this rank's shards ([Note: GradScaler over sharded grads] in
        integrations/amp.py): check them for inf/NaN, multiply them by ``inv_scale``, and set
        ``found_inf`` (GradScaler's 0-dim float32 flag) to 1 if any rank's shard holds one: one MAX
        all-reduce, so every rank skips the same steps. The next backward starts fresh unless a
        step or ``zero_grad`` comes first (after an inf GradScaler skips the step). Collective."""
        grads = self.sharded()  # its checks
        written = sorted(self._written) if self._reduced is not None else []  # the same buffers on every rank
        _unscale(grads, [self._shards[b] for b in written], [self._shards[b].dtype for b in written],
                 inv_scale, found_inf, allow_fp16=allow_fp16)
        self._unscaled = True

    def step_taken(self) -> None:
        """The step consumed the grads (or ``zero_grad``): the shards are let go (none held through the forward)."""
        if self._armed and graph_task_id() == -1:
            self._abandon()
        self._broken = self._unscaled = False
        self._stand_ins.clear()
        self._written.clear()
        self._shards = [None] * len(self._shards)
        self._since = _SinceStep()
        self.peak_bucket_bytes = self.held_bucket_bytes


# [Note: several optimizers over one module]
_BOUND: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()  # module -> its reducers
_ARMED: "weakref.WeakSet[Reducer]" = weakref.WeakSet()  # reducers whose backward is under way
_HOOKED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()  # its forward hooks


def _attach(module: torch.nn.Module, reducer: Reducer) -> None:
    """``reducer`` (bound to ``module`` now) joins the reducers of ``module``: the forward hooks, registered by
    the first, call every one; ``no_sync`` suspends every one."""
    _BOUND[module] = [*map(weakref.ref, _reducers_of(module)), weakref.ref(reducer)]
    if module not in _HOOKED:
        before, after = _forward_hooks()
        _HOOKED[module] = (module.register_forward_pre_hook(before), module.register_forward_hook(after))
    module.no_sync = _NoSync(_reducers_of(module) if reducer.local_accumulation else ())


def _detach(module: torch.nn.Module, broadcasting: bool) -> None:
    """A reducer of ``module`` was unbound (``broadcasting``: the one that sent rank 0's buffers): the others
    keep the forward hooks, a ``no_sync`` of their own and the buffers' broadcast; the last one leaves the
    module as it found it ([Note: a binding ends with its run])."""
    live = _reducers_of(module)
    if live:
        _BOUND[module] = [weakref.ref(r) for r in live]
        module.no_sync = _NoSync(live if live[0].local_accumulation else ())
        live[0]._broadcast_buffers |= broadcasting
        return
    _BOUND.pop(module, None)
    for handle in _HOOKED.pop(module, ()):
        handle.remove()
    if isinstance(module.__dict__.get("no_sync"), _NoSync):
        del module.no_sync


def _reducers_of(module: torch.nn.Module) -> list[Reducer]:
    """The live reducers bound to ``module``, in the order they were bound."""
    found = (ref() for ref in _BOUND.get(module, ()))
    return [r for r in found if r is not None and r.module_ref is not None and r.module_ref() is module]


def _refuse_binding(module: torch.nn.Module, bound_ref, *, cap_bytes: int, local_accumulation: bool) -> list:
    """Refuse a bind before anything changes; return the other reducers bound to ``module``."""
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            "bind_module: stage=2 takes gradient synchronisation over from DistributedDataParallel; "
            "pass the unwrapped module (model.module) and do not wrap it in DDP"
        )
    if bound_ref is not None:
        raise ValueError("bind_module: this optimizer is already bound to another module; call optimizer.unbind() first")
    others = _reducers_of(module)
    if getattr(module, "no_sync", None) is not None and not others and not isinstance(module.no_sync, _NoSync):
        raise ValueError(f"bind_module: {type(module).__name__} already has a no_sync attribute")
    if any(o.local_accumulation != local_accumulation for o in others):
        raise ValueError(
            "bind_module: local_accumulation must be the same for every optimizer bound to one module "
            f"(another one bound it with local_accumulation={not local_accumulation})"
        )
    if cap_bytes <= 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {cap_bytes / (1 << 20)}")
    return others


def _broadcast_at_bind(comm: Comm, tensors: list) -> None:
    """Rank 0's values of these params and buffers (each once), as DDP's constructor does."""
    unique = list({id(t): t.data for t in tensors}.values())
    with torch.no_grad():
        comm.broadcast_(unique, src=0, what="broadcasting parameters and buffers from rank 0")


def _check_coverage(module: torch.nn.Module) -> bool:
    """At the first forward after a bind that left some of ``module``'s trainable params to other
    optimizers: every one must be held by a stage-2 optimizer bound to it (False: checked)."""
    tables = [r._table() for r in _reducers_of(module)]
    missing = [n for n, p in module.named_parameters() if p.requires_grad and all(t.index(p) is None for t in tables)]
    if missing:
        raise ValueError(
            f"hf_zero stage 2: trainable params of the bound model are in no stage-2 optimizer bound to it: "
            f"{missing[:5]} (their grads would never be averaged); give them to an optimizer (frozen params "
            "may be given too) and bind every optimizer to the model (optimizer.bind_module(model), or "
            "accelerator.prepare(model, *optimizers)), or freeze them"
        )
    return False


def _zero_in_shards(plan: _Plan | None, shards: list, i: int) -> None:
    """Zero param ``i``'s elements in this rank's ``shards`` (of ``plan``)."""
    if plan is not None and i in plan.where:
        b, offset, numel = plan.where[i]
        lo, hi = plan.owned[b]
        a, z = max(offset, lo), min(offset + numel, hi)
        if a < z and shards[b] is not None:
            shards[b][a - lo : z - lo].zero_()


class _StandIns:
    """What ``p.grad`` holds between a syncing backward and the step: see [Note: p.grad stands in for the shards]."""

    def __init__(self):
        self._standing: dict[int, tuple] = {}  # param index -> (the param, its stand-in in p.grad, its version then)
        self._kept: dict[int, torch.Tensor] = {}  # reused from one backward to the next while untouched

    def __bool__(self) -> bool:
        return bool(self._standing)

    def holds(self, i: int, p: torch.Tensor) -> bool:
        """Whether ``p.grad`` (param ``i``) is its stand-in."""
        return i in self._standing and p.grad is self._standing[i][1]

    def place(self, params, indices) -> None:
        """Put the stand-ins of these params (whose ``p.grad`` is None) in ``p.grad``."""
        for i in indices:
            p, s = params[i], self._kept.get(i)
            if s is None or s.shape != p.shape or s.dtype != p.dtype or s.device != p.device or version_of(s):
                s = self._kept[i] = torch.full((), float("nan"), dtype=p.dtype, device=p.device).expand(p.shape)
            p.grad = s
            self._standing[i] = (p, s, version_of(s))

    def settle(self, table, *, clear: bool) -> list[tuple[int, bool]]:
        """What was done to the stand-ins since they were placed: (param index, zeroed rather than
        dropped) for each set to None (dropped) or zeroed in place; anything else raises. ``clear``:
        a backward starts: take the stand-ins out of ``p.grad`` (autograd accumulates into it)."""
        params, changed = table.params, []
        for i, (_, s, version) in list(self._standing.items()):
            g = params[i].grad
            if g is s and version_of(s) == version:
                pass
            elif g is None:
                changed.append((i, False))
                del self._standing[i]
                continue
            elif g is not s:
                raise RuntimeError(
                    f"hf_zero stage 2: the grad of {table.label(i)} was replaced by hand after the backward; "
                    "under stage 2 the averaged grads live in the optimizer's shards and p.grad only stands in "
                    "for them: set p.grad = None (or zero_grad()) to drop a grad, zero_() it to zero it, clip "
                    "with optimizer.clip_grad_norm_ / clip_grad_value_, or use stage=1"
                )
            elif bool(s.reshape(-1)[:1].ne(0).any()):
                raise RuntimeError(
                    f"hf_zero stage 2: the grad of {table.label(i)} was changed in place after the backward; "
                    "under stage 2 p.grad only stands in for the sharded grad: set it to None or zero_() it, clip "
                    "with optimizer.clip_grad_norm_ / clip_grad_value_ (not torch.nn.utils'), or use stage=1"
                )
            else:
                changed.append((i, True))
                self._standing[i] = (params[i], s, version_of(s))
            if clear:
                params[i].grad = None
                del self._standing[i]
        return changed

    def clear(self) -> None:
        """The grads are spent (a step, ``zero_grad``, the reducer is gone): the stand-ins leave ``p.grad``."""
        for p, s, _ in self._standing.values():
            if p.grad is s:
                p.grad = None
        self._standing = {}


class _ReceivedBuffers:
    """Rank 0's buffers, received after a syncing backward, for the next grad-mode forward to take:
    see [Note: buffers after a syncing backward]."""

    def __init__(self):
        self._received: tuple | None = None  # (the buffers, rank 0's values of them)

    def receive(self, comm: Comm, buffers: list) -> None:
        """Collective: rank 0 sends its buffers (rank 0 takes nothing)."""
        if comm.rank == 0:
            with torch.no_grad():
                comm.broadcast_(buffers, src=0, what="broadcasting buffers from rank 0")
            return
        held = self._received[1] if self._received is not None else ()
        if [(v.shape, v.dtype, v.device) for v in held] != [(b.shape, b.dtype, b.device) for b in buffers]:
            held = [torch.empty_like(b) for b in buffers]
        with torch.no_grad():
            comm.broadcast_(held, src=0, what="broadcasting buffers from rank 0")
        self._received = (buffers, held)

    def take(self) -> None:
        """Before a grad-mode forward: copy what was received into the buffers (once)."""
        if self._received is not None and torch.is_grad_enabled():
            (buffers, values), self._received = self._received, None
            with torch.no_grad():
                for b, v in zip(buffers, values):
                    b.copy_(v)


def _refuse_unreduced(table, stand_ins: "_StandIns") -> None:
    """Raise if a param holds a grad that was never reduced (not its stand-in)."""
    local = [table.label(i) for i, p in enumerate(table.params)
             if p.requires_grad and p.grad is not None and not stand_ins.holds(i, p)]
    if local:
        raise RuntimeError(
            f"hf_zero stage 2: {local[0]} has a gradient that was never reduced: the last backward before "
            "the step (or clipping) ran under no_sync(), or the grad was set by hand"
        )


def _unscale(grads: ShardedGrads, shards: list, dtypes: list, inv_scale: torch.Tensor, found_inf: torch.Tensor, *,
             allow_fp16: bool) -> None:
    """The body of :meth:`Reducer.unscale_` over the ``shards`` written since the step (their ``dtypes``)."""
    if not allow_fp16 and torch.float16 in dtypes:
        raise ValueError("Attempting to unscale FP16 gradients.")  # torch's GradScaler.unscale_, word for word
    local = _unscaled_non_finite(shards, inv_scale, grads.device)
    # the step's agreement rides along: [Note: agreeing on presence]
    local = grads.all_reduce_along(local, op="max", what="agreeing on non-finite gradients (GradScaler)")
    found_inf.copy_(torch.maximum(found_inf, local.to(found_inf.device)))


def memory(reducer: Reducer) -> dict[str, int]:
    """This rank's grad shards and reduce buckets now ([Note: memory ledger] in _ledger.py): the buckets
    in use (being filled or reduced, a grad reduced in its own storage included) and the pool's idle ones."""
    return {"grad_shards": sum(s.nbytes for s in reducer._shards if s is not None),
            "buckets_in_flight": reducer.bucket_bytes, "buckets_pooled": reducer._pool.idle_bytes()}


def stands_in(reducer: Reducer, i: int, p: torch.Tensor) -> bool:
    """Whether ``p.grad`` (param ``i``) is the reducer's memoryless stand-in, not a grad the rank holds."""
    return reducer._stand_ins.holds(i, p)


def memory_peaks(reducer: Reducer, reset: bool = False) -> dict[str, int]:
    """The most bytes of reduce buckets in use, and idle in the pool, since the last reset."""
    return reducer._pool.peaks(reset)


def _unscaled_non_finite(shards: list, inv_scale: torch.Tensor, device) -> torch.Tensor:
    """Multiply each shard by ``inv_scale``; 1.0 (float32, on ``device``) if any held an inf or NaN before."""
    flags = []
    for shard in shards:
        if shard.numel():  # checked before unscaling, as torch's kernel does
            flags.append(torch.isfinite(shard).all().logical_not().to(device))
            shard.mul_(inv_scale.to(shard.device))
    return torch.stack(flags).any().float() if flags else torch.zeros((), dtype=torch.float32, device=device)


class _BucketPool:
    """Reduce buckets kept from one backward to the next.

    [Note: bucket pool]
    A bucket allocated afresh for every bucket of a backward costs its pages again each time
    (on the CPU an allocation this large is mmapped and faulted in, and was zero-filled
    besides: most of stage 2's extra time over stage 1, measured by torch.profiler on the e2e
    GPT-2). So the buckets no wider than the cap come from a pool, all as wide as the widest
    such bucket of the plan (one size fits every bucket), and go back to it when reduced. The
    pool keeps at most ``keep`` free ones per (dtype, device): the buckets in flight plus the
    one being filled, what a backward holds at once anyway. Once a backward has taken as many
    pooled buckets as the one before took, no more will come from the pool: the free ones are
    let go then, and each given back after, not kept (GPT-2's tied embedding, the last grad of
    its backward, is reduced beside its own dense grad and the LM head's waiting one, the
    backward's peak: an idle bucket there is 25 MiB on it). When the backward ends (no bucket
    in use) the free ones are let go, and so is the reduce-scatters' receive scratch: between
    backwards, through the next forward (where the activations peak), a rank holds no reduce
    bucket, and each backward allocates at most ``keep`` of them (on CUDA from the caching
    allocator, which can hand the same memory to the forward's activations meanwhile). A
    pooled bucket is dirty: only the slots a grad is copied into are written, so its gaps
    are zeroed when it is taken and the slots of grads that never came when it is launched.
    A bucket wider than the cap (one large param whose grad could not be reduced in its own
    storage, or one whose grad never came on this rank) is allocated for its backward only,
    as dirty (``torch.empty``): the slots of grads that never came are zeroed in it too. The
    pool follows the plan: a new plan (trainability change) drops it.
    """

    def __init__(self, keep: int):
        self.keep = keep
        self.held_bytes = 0  # every pooled tensor, free or in use
        self._in_use = self._pooled_in_use = 0  # the reducer's buckets in use now, and those of the pool
        self._peak_in_use = self._peak_idle = 0  # since the last peaks(reset=True)
        self._width: dict[tuple, int] = {}  # (dtype, device) -> elements of each pooled bucket
        self._free: dict[tuple, list[torch.Tensor]] = {}
        # Pooled takes per (dtype, device): this backward's and the last backward's.
        self._taken: dict[tuple, int] = {}
        self._expected: dict[tuple, int] = {}

    def plan(self, buffers, sizes, cap_bytes: int) -> None:
        """Follow a new plan: the pooled width per (dtype, device) is its widest bucket, leaving out
        the buckets of one param above ``cap_bytes``."""
        width: dict[tuple, int] = {}
        for plan, n in zip(buffers, sizes):
            if len(plan.slots) > 1 or n * plan.dtype.itemsize <= cap_bytes:
                key = (plan.dtype, torch.device(plan.device))
                width[key] = max(width.get(key, 0), n)
        if width != self._width:
            self.held_bytes -= sum(t.nbytes for free in self._free.values() for t in free)
            self._free, self._width = {}, width
            self._expected = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A 1-D bucket of ``numel`` elements (not zeroed), and its pooled base (None: not pooled)."""
        key = (dtype, device)
        width = self._width.get(key, 0)
        if numel > width:
            return torch.empty(numel, dtype=dtype, device=device), None
        free = self._free.setdefault(key, [])
        if free:
            base = free.pop()
        else:
            base = torch.empty(width, dtype=dtype, device=device)
            self.held_bytes += base.nbytes
        self._taken[key] = self._taken.get(key, 0) + 1
        if self._taken[key] == self._expected.get(key):  # the last this backward will take
            self.held_bytes -= sum(t.nbytes for t in free)
            free.clear()
        return base[:numel], base

    def _done_taking(self, key: tuple) -> bool:
        """Whether this backward took as many pooled buckets of ``key`` as the last one did."""
        return key in self._expected and self._taken.get(key, 0) >= self._expected[key]

    def seen(self, in_use: int, pooled_in_use: int) -> None:
        """The reducer's buckets in use changed: ``in_use`` bytes now, ``pooled_in_use`` of them the pool's;
        none in use (the backward's end): the free ones are let go."""
        self._in_use, self._pooled_in_use = in_use, pooled_in_use
        self._peak_in_use = max(self._peak_in_use, in_use)
        self._peak_idle = max(self._peak_idle, self.idle_bytes())
        if in_use == 0:
            self.held_bytes -= sum(t.nbytes for free in self._free.values() for t in free)
            self._free = {}
            if self._taken:
                self._expected, self._taken = self._taken, {}

    def idle_bytes(self) -> int:
        """Pooled buckets not in use."""
        return self.held_bytes - self._pooled_in_use

    def peaks(self, reset: bool) -> dict[str, int]:
        out = {"buckets_in_flight": self._peak_in_use, "buckets_pooled": max(self._peak_idle, self.idle_bytes())}
        if reset:
            self._peak_in_use, self._peak_idle = self._in_use, self.idle_bytes()
        return out

    def give(self, base: torch.Tensor) -> None:
        """``base`` (from :meth:`take`) is free again: kept, or let go."""
        key = (base.dtype, base.device)
        free = self._free.setdefault(key, [])
        if base.numel() == self._width.get(key) and len(free) < self.keep and not self._done_taking(key):
            free.append(base)
        else:
            self.held_bytes -= base.nbytes


def _before_forward(module: torch.nn.Module, args) -> None:
    """The forward pre-hook of a bound module (registered once, for every reducer bound to it): it finds
    the reducers by the module it is called with, so a copy of a bound module (``copy.deepcopy`` shares
    functions, ``torch.save`` pickles them by name) finds none and is not bound ([Note: a binding ends
    with its run] in _binding.py)."""
    for reducer in _reducers_of(module):
        reducer.before_forward(module)


def _after_forward(module: torch.nn.Module, args, output):
    """The forward hook of a bound module (as :func:`_before_forward`): each reducer's, in bind order, on
    the output the one before returned, as torch chains hooks."""
    changed = None
    for reducer in _reducers_of(module):
        out = reducer.after_forward(output if changed is None else changed)
        changed = changed if out is None else out
    return changed


def _forward_hooks():
    """The forward pre-hook and hook, marked eager ([Note: forward hooks under torch.compile]) at the first
    bind; the module's names are rebound to the marked functions, so that they still pickle by name."""
    global _before_forward, _after_forward
    if not _EAGER:
        _before_forward, _after_forward = _eager(_before_forward), _eager(_after_forward)
        _EAGER.append(True)
    return _before_forward, _after_forward


_EAGER: list = []


def _eager(hook):
    """[Note: forward hooks under torch.compile] Dynamo inlines a compiled module's ``_call_impl``,
    its forward hooks included: traced, these hooks broke the user's graph a dozen times (engine
    state, weak references, autograd nodes of fake outputs) and made ``fullgraph=True`` fail. Marked
    so (as FSDP2 marks its hooks), they run eagerly outside the one graph of the forward, with no
    graph break (``fullgraph=True`` compiles), and the post-hook sees the real outputs, whose node is
    the compiled graph's backward (tests/test_stage2_compile.py). The mark imports ``torch._dynamo``
    at ``bind_module`` (about a second, once, where transformers has not imported it already)."""
    return torch.compiler.disable(hook)


class _NoSync(Hook):
    """A bound module's ``no_sync`` attribute: every bound reducer's :meth:`Reducer.no_sync` at once (none
    under ``local_accumulation=False``: a ``nullcontext``). A copy of the module gets one that does nothing."""

    __slots__ = ("_refs",)

    def __init__(self, reducers=()):
        self._refs = tuple(weakref.ref(r) for r in reducers)

    def __call__(self):
        live = [r for r in (ref() for ref in self._refs) if r is not None]
        return _suspended(live) if live else contextlib.nullcontext()

    def __reduce__(self):
        return (_NoSync, ())


@contextlib.contextmanager
def _suspended(reducers: list):
    with contextlib.ExitStack() as stack:
        for reducer in reducers:
            stack.enter_context(reducer.no_sync())
        yield


def _arm(reducer_ref):
    def arm(grad_outputs) -> None:  # a prehook of an output's autograd node (holding no node: no cycle)
        reducer = reducer_ref()
        if reducer is not None:
            reducer.arm(running_node())

    return arm


def _anchored(leaves: list, rebuild) -> tuple:
    """(the output rebuilt from ``leaves`` with its float tensors through :class:`_Anchored`, one of
    them), or (None, None) when it has none."""
    floats = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        return None, None
    anchor = torch.empty(0, requires_grad=True)
    for k, t in zip(floats, _Anchored.apply(anchor, *(leaves[k] for k in floats))):
        leaves[k] = t
    return rebuild(leaves), [leaves[floats[0]]]


class _Anchored(torch.autograd.Function):
    """Copies of ``tensors`` that need a grad through ``anchor`` (an empty leaf), so that a backward
    from them runs (and arms the reducer) on a rank whose forward used no trainable param."""

    @staticmethod
    def forward(ctx, anchor, *tensors):
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *grads)


class _ParamHooks:
    """A bound reducer's hooks on its params, kept in its binding: each param that needs a grad gets
    them at bind, or before the first forward it needs one (torch refuses a hook on a frozen param:
    it gets its own once unfrozen; ``add_param_group`` appends params)."""

    def __init__(self, reducer: Reducer, binding: Binding):
        self._reducer, self._binding = weakref.ref(reducer), binding
        self._seen = 0  # params of the table looked at
        self._unhooked: list[int] = []  # frozen ones among them: no hook yet

    def hook(self, params: list) -> None:
        """Hook the params that need a grad and have no hook yet."""
        self._unhooked.extend(range(self._seen, len(params)))
        self._seen = len(params)
        reducer = self._reducer()
        if reducer is not None and any(params[i].requires_grad for i in self._unhooked):
            for i in [i for i in self._unhooked if params[i].requires_grad]:
                self._binding.keep(params[i].register_hook(_BeforeAccumulating(reducer)))
                self._binding.keep(params[i].register_post_accumulate_grad_hook(_GradHook(reducer, i)))
            self._unhooked = [i for i in self._unhooked if not params[i].requires_grad]


class _BeforeAccumulating(Hook):
    """A param's tensor hook: no stand-in may be in ``p.grad`` when autograd accumulates into it
    ([Note: p.grad stands in for the shards]); the reducer is held weakly."""

    __slots__ = ("_reducer",)

    def __init__(self, reducer: Reducer):
        self._reducer = weakref.ref(reducer)

    def __call__(self, grad: torch.Tensor) -> None:
        reducer = self._reducer()
        if reducer is not None:
            reducer.settle(clear=True)


class _GradHook(Hook):
    """Param ``i``'s post-accumulate-grad hook: hand the grad to the reducer (held weakly)."""

    __slots__ = ("_reducer", "_i")

    def __init__(self, reducer: Reducer, i: int):
        self._reducer, self._i = weakref.ref(reducer), i

    def __call__(self, p: torch.Tensor) -> None:
        reducer = self._reducer()
        if reducer is not None:
            reducer.on_grad(self._i, p)
