"""What happens to a grad under stage 2: from autograd into a reduce bucket, reduce-scattered into
this rank's shard, read by the step.

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
  forward) arms there. Only a backward that writes ``.grad`` arms, as only a backward
  through ``ddp(x)``'s outputs reduces under DDP: ``loss.backward()``, or a backward
  restricted to ``inputs=`` that reaches a param of the reducer (``accumulates`` in
  _engine.py). ``torch.autograd.grad`` (a saliency map on one rank, a gradient penalty,
  MAML's inner step, GradNorm, a diagnostic with ``retain_graph=True``) accumulates into no
  ``.grad``: like a forward, it runs no collective and the next backward arms as usual.
  A forward inside a ``torch.func`` transform (per-sample grads) is the transform's: it
  takes no buffers, anchors and arms nothing. A backward that raised never ends: the next forward, ``zero_grad()``
  or step finishes the reductions it started, drops the rest, and the step refuses the
  partial shards until ``zero_grad()``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque

import torch

from .._binding import Binding, claimants
from .._comm import Comm, early_divisor
from .._engine import (
    accumulates, graph_task_id, in_functorch, queue_end_of_backward, reentrant_region_below, tree_tensors,
)
from .buffers import ReceivedBuffers, broadcast_at_bind
from .carrier import Carrying, HEADER, write_flags
from .grads import ShardedGrads, Shards, unscale
from .hooks import (
    ARMED, ParamHooks, alone, anchor_outputs, arming_hook, attach, check_coverage, detach, reducers_of, refuse_binding,
)
from .plan import DEFAULT_BUCKET_CAP_MB, CurrentPlan, Plan, buckets_in_flight, shard_dtype
from .pool import BucketPool
from .stand_ins import StandIns, refuse_unreduced



class Reducer:
    """See [Note: stage 2 reducer]. ``table``: a callable returning the optimizer's ParamTable (held weakly
    by the caller); ``shard``: its shard mode; ``accumulate_dtype``: see :func:`shard_dtype`."""

    def __init__(self, comm: Comm, table, shard: str, accumulate_dtype: torch.dtype | None = None, check=None):
        self.comm, self.accumulate_dtype = comm, accumulate_dtype
        self._table = table
        self._check = check  # the optimizer's layout check as a syncing backward starts (None: no check)
        self._agreed_plan: Plan | None = None  # the plan of the last backward whose check found the ranks agreeing
        self._carrying = Carrying(comm)  # [Note: the check rides a bucket] in carrier.py
        self._shard = shard
        self.cap_bytes = int(DEFAULT_BUCKET_CAP_MB * (1 << 20))
        self.module_ref = None
        self._plan: Plan | None = None  # the current plan, as _current_plan() last found it
        self._plans = CurrentPlan(table, shard, comm.world_size, comm.rank)
        self._suspended = False  # inside no_sync()
        self._broadcast_buffers = False
        self._buffers = ReceivedBuffers()
        self._param_hooks: ParamHooks | None = None  # while bound
        self.binding: Binding | None = None  # while bound
        self._coverage_due, self.local_accumulation = False, True  # bound with params it does not hold; see bind
        self._deferred = False  # this backward reduces at its end only: [Note: several optimizers over one module]
        self._stand_ins = StandIns()
        weakref.finalize(self, self._stand_ins.clear)  # none left in p.grad once this reducer is gone
        # This backward (between its arming and its end).
        self._armed, self._left = False, []  # _left: per buffer, grads still to come this backward
        self._pending: set[int] = set()  # params counted in _left that have not come yet
        self._placed: set[int] = set()  # params whose grad is in their bucket this backward
        self._regions_cache: tuple = (None, False)  # (unreached params, reentrant regions below)
        self._broken = False  # a backward raised midway since the last step / zero_grad
        self._next = self._first = 0  # the next buffer to reduce-scatter; the first this backward does
        self._filling: dict[int, tuple] = {}  # buffer -> (bucket, pooled base or None, divisor of its grads: N or 1)
        self._in_flight: deque = deque()
        self.in_flight_limit = buckets_in_flight(comm.strategy.reduce_scatter_by)
        self._pool = BucketPool(keep=self.in_flight_limit + 1)
        # Since the last step.
        self._shards = Shards()
        self._flags = (0, 0)  # this backward's bits in the carrier's headers
        self._unscaled = False  # a GradScaler unscaled the shards (unscale_): the next backward starts fresh

    # -- binding ------------------------------------------------------------------------
    @property
    def bound(self) -> bool:
        return self.module_ref is not None

    def holds(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is one of the optimizer's params."""
        return self._table().index(p) is not None

    def send_buffers(self) -> None:
        """Take over sending rank 0's buffers after each syncing backward (from a reducer of the same module
        that was unbound): [Note: buffers after a syncing backward]."""
        self._broadcast_buffers = True

    def bind(self, module: torch.nn.Module, binding: Binding, *, cap_bytes: int, broadcast_buffers: bool = True,
             local_accumulation: bool = True) -> None:
        """``local_accumulation=False``: the module's ``no_sync()`` does nothing, so every backward
        reduces into the shards (Accelerate's ``accumulate`` and Trainer enter it on every
        micro-batch but the last). Every hook goes through ``binding``, whose ``close()`` removes
        them and unbinds ([Note: a binding ends with its run]); the module's forward hooks and
        ``no_sync`` are shared by the reducers bound to it ([Note: several optimizers over one module])."""
        if self.module_ref is not None and self.module_ref() is module:
            return
        table = self._table()
        refuse_binding(module, self.module_ref, cap_bytes=cap_bytes, local_accumulation=local_accumulation,
                       leaving=claimants(table.params))
        binding.claim(table.params)  # [Note: a newer binding takes over] in _binding.py: after every refusal
        others = reducers_of(module)
        self.binding = binding
        self._coverage_due = any(p.requires_grad and table.index(p) is None for p in module.parameters())
        self.cap_bytes = cap_bytes
        self.local_accumulation = local_accumulation
        broadcast_at_bind(self.comm, [*table.params, *module.parameters(), *module.buffers()])
        self._param_hooks = ParamHooks(self, binding)
        binding.on_close(self._unbound)
        self._param_hooks.hook(table.params)
        self._broadcast_buffers = (broadcast_buffers and self.comm.world_size > 1 and not others
                                   and any(True for _ in module.buffers()))
        self.module_ref = weakref.ref(module)
        self._plans.forget()  # planned again, in the module's order
        attach(module, self)

    def _unbound(self) -> None:
        """The binding closed (its handles are removed next): drop the grads not stepped (the stand-ins
        leave ``p.grad``) and forget the module, so that a later bind hooks everything again."""
        module = self.module_ref() if self.module_ref is not None else None
        self.step_taken()
        self.module_ref, self._param_hooks, self._coverage_due, self.binding = None, None, False, None
        self._plans.forget()
        broadcasting, self._broadcast_buffers = self._broadcast_buffers, False
        if module is not None:
            detach(module, broadcasting)

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

    def _current_plan(self) -> Plan:
        plan, changed = self._plans.current(self.module_ref, self.cap_bytes)
        if changed:
            self._pool.plan(plan.layout.buffers, plan.sizes, self.cap_bytes)
        self._plan = plan
        return plan

    # -- the backward ----------------------------------------------------------------------
    def before_forward(self, module: torch.nn.Module) -> None:
        """The bound module's forward pre-hook: see [Note: arming a backward]."""
        if graph_task_id() != -1 or in_functorch():  # a checkpoint recomputing the forward; torch.func's
            return
        if self._armed:
            self._abandon()
        if self._coverage_due:
            self._coverage_due = check_coverage(module)  # False, or it raises
        self._param_hooks.hook(self._table().params)
        self._buffers.take()

    def after_forward(self, output):
        """The bound module's forward hook: arm the backward of ``output`` at its start (unless
        that backward runs under ``no_sync()``: decided when it runs)."""
        if not torch.is_grad_enabled() or in_functorch():
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
            output, tensors = anchor_outputs(leaves, rebuild)
            if output is None:
                return None
        self._shards.since.forwarded |= not self._suspended
        hook = arming_hook(weakref.ref(self))
        for node in {t.grad_fn for t in tensors}:
            node.register_prehook(hook)
        return output if anchored else None  # None: the forward's own output, untouched

    def arm(self, root) -> None:
        """A backward through the bound module's outputs starts at autograd node ``root``."""
        if not self._armed and not self._suspended and accumulates(self._param_nodes):  # not torch.autograd.grad
            self._begin(root)

    def _param_nodes(self):
        self._current_plan()
        return self._plans.accumulators.values()

    def on_grad(self, i: int, p: torch.Tensor) -> None:
        if self._suspended or p.grad is None:
            return
        if not self._armed:
            self._begin(None)
        where = self._plan.put.get(i)
        if where is None:  # no elements: in no bucket
            p.grad = None
            return
        b = where[0]
        if b < self._next:
            if b < self._first:  # a probe sent this bucket: [Note: the check rides a bucket] in carrier.py
                p.grad = None
                return
            raise RuntimeError(
                f"hf_zero stage 2: a gradient for {self._table().label(i)} arrived after its bucket was reduced "
                "in this backward (a param used in several reentrant checkpoint regions, or reached by a nested "
                "backward hf_zero did not foresee); use checkpoint(..., use_reentrant=False)"
            )
        self._put_grad(i, p, where)
        if i in self._pending:
            self._pending.discard(i)
            self._left[b] -= 1
            if b == self._next and not self._left[b]:  # the next bucket is complete
                self._launch_ready()

    def _begin(self, root) -> None:
        self.settle(clear=True)
        if self._unscaled:  # unscaled, then no step (GradScaler skipped it on an inf): these grads are spent
            self.step_taken()
        plan, params = self._current_plan(), self._table().params
        left, pending, unreached = self._plans.reach()
        regions = bool(unreached) and root is not None and _reentrant_regions(self, root, unreached)
        held = [] if regions else [i for i in unreached if params[i].grad is not None]  # accumulated under no_sync()
        mirror, start = _check_plan(self, plan, pending.union(held), regions)
        if mirror is not None:  # this rank changed alone: [Note: the check at a backward] in _params.py
            self._plan = plan = mirror
            left, pending, regions, held = [0] * len(plan.sizes), set(), False, []
        self._armed, self._next, self._first, self._shards.since.armed = True, start, start, True
        self._deferred = mirror is not None or any(r is not self for r in ARMED)
        ARMED.add(self)
        self._placed, self._left, self._pending = set(), left, pending
        if regions:
            for i in unreached:  # may still come, from a region's nested backward
                self._left[plan.where[i][0]] += 1
                self._pending.add(i)
        for i in held:
            self._put_grad(i, params[i])
        queue_end_of_backward(self._end_of_backward)
        self._launch_ready()

    def _put_grad(self, i: int, p: torch.Tensor, where: tuple[int, int, int] | None = None) -> None:
        b, offset, numel = where or self._plan.put[i]
        g, held = p.grad, self._filling.get(b)
        if held is None:
            spec = self._plan.layout.buffers[b]
            if (offset == 0 and numel == self._plan.sizes[b] and g.is_contiguous()
                    and g.storage_offset() == 0 and g.untyped_storage().nbytes() == g.nbytes
                    and g.dtype == spec.dtype and g.device == spec.device):
                # The bucket is this one grad (a param above the cap, e.g. an embedding): reduce
                # it in its own storage, which nothing else holds once p.grad lets go, not a copy.
                self._filling[b] = (g.view(-1), None, 1)
                self._pool.count(g, None)
                self._placed.add(i)
                p.grad = None
                self._shards.since.touched.add(i)
                return
            self._bucket(b)
            held = self._filling[b]
        bucket, _, n = held  # n: divided as they come (early_divisor)
        if offset < 0:  # across a rank's header in the carrier: [Note: the check rides a bucket] in carrier.py
            for at, start, count in self._plan.carrier.parts[i]:
                _into(bucket[at : at + count], g.reshape(-1)[start : start + count], n, i in self._placed)
        else:
            slot, g = (bucket.as_strided(g.shape, g.stride(), bucket.storage_offset() + offset), g) \
                if g.is_contiguous() else (bucket[offset : offset + numel], g.reshape(-1))  # as_strided: one call
            if i in self._placed:  # a second grad in one backward (nested backwards)
                _into(slot, g, n, True)
            elif n == 1:
                slot.copy_(g)
            else:
                torch.div(g, n, out=slot)  # [Note: dividing as the grads come]
        self._placed.add(i)
        p.grad = None
        self._shards.since.touched.add(i)

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
            write_flags(buf, b, self._plan.carrier, self._flags)
            divided = early_divisor(plan.dtype, self.comm.world_size) > 1
            held = self._filling[b] = (buf, base, self.comm.world_size if divided else 1)
            self._pool.count(buf, base)
        return held[0]

    @property
    def bucket_bytes(self) -> int:
        """Reduce buckets in use now."""
        return self._pool.in_use

    @property
    def peak_bucket_bytes(self) -> int:
        """The most reduce-bucket memory held (:attr:`held_bucket_bytes`) since the last step."""
        return self._pool.peak_held

    @property
    def held_bucket_bytes(self) -> int:
        """Reduce-bucket memory held now: the buckets in use that are not the pool's, and the pool's."""
        return self._pool.held

    def _launch_ready(self) -> None:
        if self._deferred:
            return
        while self._next < len(self._left) and self._left[self._next] == 0:
            self._launch(self._next)

    def _launch(self, b: int) -> None:
        buf = self._bucket(b)
        _, base, divisor = self._filling.pop(b)
        divided = divisor > 1
        # a bucket, pooled or fresh ([Note: bucket pool]), holds old values where no grad came
        moved = self._plan.carrier.parts if self._plan.carries(b) else {}
        for s in self._plan.layout.buffers[b].slots:
            if s.index not in self._placed:
                for at, _, count in moved.get(s.index, ((s.offset, 0, s.numel),)):
                    buf[at : at + count].zero_()
        self._next = b + 1
        while len(self._in_flight) >= self.in_flight_limit:
            self._finish(*self._in_flight.popleft())
        self._shards.follow(self._plan)
        into, first, dtype = None, b not in self._shards.written, shard_dtype(self.accumulate_dtype, buf.dtype)
        if first or dtype != buf.dtype:  # straight into the shard: [Note: what stage 2 accumulates in]
            into = self._shards.shard(b, dtype, buf.device)
        pending = self.comm.reduce_scatter_(buf, self._plan.bounds(b), out=into, divided=divided,
                                            accumulate=into is not None and not first)
        self._in_flight.append((b, buf, base, into is not None, pending))

    def _finish(self, b: int, buf: torch.Tensor, base: torch.Tensor | None, direct: bool, pending) -> None:
        pending.wait()
        _into_shard(self, b, buf, direct)
        self._shards.written.add(b)
        if base is not None:
            self._pool.give(base)
        self._pool.count(buf, base, given_back=True)
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
        self._armed, self._shards.since.agreed, self._pending = False, None, set()
        ARMED.discard(self)
        self._stand_ins.place(params, self._plan.where, self._table().label)
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
            self._pool.count(buf, base, given_back=True)
        self._filling.clear()
        self._armed, self._shards.since.agreed, self._pending, self._broken = False, None, set(), True
        ARMED.discard(self)

    # -- p.grad between the backward and the step: [Note: p.grad stands in for the shards] ------
    def settle(self, *, clear: bool) -> None:
        """Follow what was done to the stand-ins in ``p.grad``; ``clear``: a grad is about to be accumulated."""
        if self._stand_ins:
            for i, zeroed in self._stand_ins.settle(self._table(), clear=clear):
                self._shards.zero(i)
                if not zeroed:  # dropped: no grad since the step
                    self._shards.since.drop(i)

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
        if not self._stand_ins.untouched((table := self._table()).params):
            self.settle(clear=False)
            refuse_unreduced(table, self._stand_ins)
        self._shards.since.check_answered()
        return self._shards.read(self._current_plan, self.comm, len(table.params))

    def unscale_(self, inv_scale: torch.Tensor, found_inf: torch.Tensor, *, allow_fp16: bool) -> None:
        """A GradScaler's unscale of this rank's shards ([Note: GradScaler over sharded grads] in
        integrations/amp.py): check them for inf/NaN, multiply them by ``inv_scale``, and set
        ``found_inf`` (GradScaler's 0-dim float32 flag) to 1 if any rank's shard holds one: one MAX
        all-reduce, so every rank skips the same steps. The next backward starts fresh unless a
        step or ``zero_grad`` comes first (after an inf GradScaler skips the step). Collective."""
        grads = self.sharded()  # its checks
        unscale(grads, self._shards.written_tensors(), inv_scale, found_inf, allow_fp16=allow_fp16)
        self._unscaled = True

    def step_taken(self) -> None:
        """The step consumed the grads (or ``zero_grad``): the shards are let go (none held through the forward)."""
        if self._armed and graph_task_id() == -1:
            self._abandon()
        self._broken = self._unscaled = False
        self._stand_ins.clear()
        self._shards.clear()
        self._pool.reset_peak_held()

def _reentrant_regions(reducer: Reducer, root, unreached: list[int]) -> bool:
    """Whether a reentrant checkpoint region will run below ``root`` (the walk stops at the first; its
    answer kept while the same params are unreached): see [Note: arming a backward]."""
    key = tuple(unreached)
    if reducer._regions_cache[0] != key:
        reducer._regions_cache = (key, reentrant_region_below(root))
    return reducer._regions_cache[1]


def _into_shard(reducer: Reducer, b: int, buf: torch.Tensor, direct: bool) -> None:
    """Bucket ``b``'s reduction is complete: where it was reduced in the bucket (accumulating in the bucket's
    dtype), add this backward's average to the shard's; the carrier's header is heard."""
    plan, shards = reducer._plan, reducer._shards
    carried = plan.carries(b)
    if not direct:
        lo, hi = plan.bounds(b)[reducer.comm.rank : reducer.comm.rank + 2] if carried else plan.owned[b]
        (shards.carried if carried else shards.tensors[b]).add_(buf[lo:hi])
    if carried:
        reducer._carrying.heard.capture(shards.carried[-HEADER:], buf.dtype)


def _into(slot: torch.Tensor, g: torch.Tensor, n: int, again: bool) -> None:
    """A grad into its bucket ``slot``, divided by ``n`` ([Note: dividing as the grads come]); ``again``: a
    second grad in one backward (nested backwards), summed as autograd would."""
    if again:
        slot.add_(g if n == 1 else g / n)
    elif n == 1:
        slot.copy_(g)
    else:
        torch.div(g, n, out=slot)


def _check_plan(reducer: Reducer, plan: Plan, coming: set[int], uncertain: bool) -> tuple[Plan | None, int]:
    """The layout check as a syncing backward starts, carrying the presence flags of the grads ``coming`` in
    it (``uncertain``: some may not): (None where the backward reduces with ``plan``, the plan last agreed where
    this rank must mirror it; the bucket it reduces from). Collective, unless a bucket carries it: [Note: the
    check rides a bucket] in carrier.py."""
    reducer._flags = (0, int(uncertain or len(coming) != len(plan.where)))  # this rank's bits, where it carries
    if reducer._check is None:
        return None, 0
    since, count = reducer._shards.since, len(reducer._table().params)
    last = reducer._agreed_plan
    carried = None
    if last is not None and last.carrier is not None and alone(reducer):
        carried = reducer._carrying.over(last)
    agreed = reducer._check(since.coming(coming, count, reducer.comm.device, plan), uncertain, plan.layout.buckets,
                            carried)
    if agreed is None:
        if last is None:
            raise RuntimeError("hf_zero stage 2: this rank's trainable params changed before the ranks first "
                               "agreed on them: every rank must freeze and unfreeze the same params")
        return last, 0 if carried is None else last.carrier.bucket + 1
    reducer._agreed_plan = plan
    if reducer._shards.written and reducer._shards.plan is not plan:
        raise RuntimeError(
            "hf_zero stage 2: the trainable params (or their shapes) changed between two backwards "
            "of one gradient accumulation: change requires_grad only right after optimizer.step() "
            "or zero_grad()"
        )
    return None, 0


def memory(reducer: Reducer) -> dict[str, int]:
    """This rank's grad shards and reduce buckets now ([Note: memory ledger] in _ledger.py): the buckets
    in use (being filled or reduced, a grad reduced in its own storage included) and the pool's idle ones."""
    return {"grad_shards": reducer._shards.nbytes(),
            "buckets_in_flight": reducer.bucket_bytes, "buckets_pooled": reducer._pool.idle_bytes()}


def stands_in(reducer: Reducer, i: int, p: torch.Tensor) -> bool:
    """Whether ``p.grad`` (param ``i``) is the reducer's memoryless stand-in, not a grad the rank holds."""
    return reducer._stand_ins.holds(i, p)


def memory_peaks(reducer: Reducer, reset: bool = False) -> dict[str, int]:
    """The most bytes of reduce buckets in use, and idle in the pool, since the last reset."""
    return reducer._pool.peaks(reset)
