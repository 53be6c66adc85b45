"""Stage 2: hf_zero's own gradient reducer, grads sharded as the backward produces them.

[Note: stage 2 reducer]
Under stage 2 the model is not wrapped in DDP (DDP's reducer allocates every gradient
bucket whole: docs/stage2.md). :meth:`Reducer.bind` broadcasts the module's params and
buffers from rank 0, as DDP does (buffers again before each forward that syncs grads,
DDP's ``broadcast_buffers``, unless turned off), and hooks every param of the optimizer:

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
- **In flight.** At most :data:`MAX_IN_FLIGHT` buckets are being reduced at once (on
  gloo point to point one: starting a reduce-scatter finishes the one holding the
  receive scratch, [Note: reduce-scatter scratch] in _comm.py). The first reduction of a
  bucket since the step sums this rank's range straight into its *shard* (the bucket's
  owned range, in the bucket's dtype, kept until the step); a later one (accumulation)
  adds its average into the shard when it finishes. A finished bucket goes back to the
  pool ([Note: bucket pool]). Buckets alive at once: those in flight plus
  those being filled, usually one or two, each at most ``bucket_cap_mb`` (a bucket
  complete before an earlier one waits for it; a param larger than the cap is a bucket
  of its own).
- **Accumulation.** Every syncing backward adds into the shards (as DeepSpeed and
  Colossal-AI do). Under :meth:`Reducer.no_sync` the hooks do nothing: grads accumulate
  in ``p.grad`` and the next syncing backward reduces the sum.
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
    grad_accumulator, graph_task_id, queue_end_of_backward, reentrant_region_below, running_node, tree_tensors, will_run,
)
from ._layout import Layout, Piece, plan_layout

DEFAULT_BUCKET_CAP_MB = 25.0  # DDP's default
MAX_IN_FLIGHT = 2  # buckets being reduce-scattered at once (see the note)


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
        self.layout = plan.layout
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
    """See [Note: stage 2 reducer]. ``table``: a callable returning the optimizer's
    ParamTable (held weakly by the caller); ``shard``: its shard mode."""

    def __init__(self, comm: Comm, table, shard: str):
        self.comm = comm
        self._table = table
        self._shard = shard
        self.cap_bytes = int(DEFAULT_BUCKET_CAP_MB * (1 << 20))
        self.module_ref = None
        self._binding: Binding | None = None  # while bound
        self._plan: _Plan | None = None
        self._plan_key = None
        self._accumulators: dict = {}  # param index -> its AccumulateGrad node, per plan
        self._suspended = False  # inside no_sync()
        self._broadcast_buffers = False
        self._seen = 0  # params of the table looked at (add_param_group appends)
        self._unhooked: list[int] = []  # frozen ones among them: no hook yet
        # This backward (between its arming and its end).
        self._armed = False
        self._left: list[int] = []  # per buffer: grads still to come this backward
        self._pending: set[int] = set()  # params counted in _left that have not come yet
        self._placed: set[int] = set()  # params whose grad is in their bucket this backward
        self._regions_cache: tuple = (None, False)  # (unreached params, reentrant regions below)
        self._broken = False  # a backward raised midway since the last step / zero_grad
        self._next = 0  # the next buffer to reduce-scatter
        self._filling: dict[int, tuple] = {}  # buffer -> (bucket, pooled base or None, divided by N already)
        self._in_flight: deque = deque()
        self._pool = _BucketPool(keep=MAX_IN_FLIGHT + 1)
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
        micro-batch but the last). Every hook and the ``no_sync`` attribute go through ``binding``,
        whose ``close()`` removes them and unbinds ([Note: a binding ends with its run])."""
        if self.module_ref is not None and self.module_ref() is module:
            return
        table = self._table()
        _check_bindable(module, table, bound=self.module_ref is not None, cap_bytes=cap_bytes)
        self.cap_bytes = cap_bytes
        seen, tensors = set(), []
        for t in [*table.params, *module.parameters(), *module.buffers()]:
            if id(t) not in seen:
                seen.add(id(t))
                tensors.append(t.data)
        with torch.no_grad():
            self.comm.broadcast_(tensors, src=0, what="broadcasting parameters and buffers from rank 0")
        self._binding = binding
        binding.on_close(self._unbound)
        self._hook_params()
        self._broadcast_buffers = broadcast_buffers and self.comm.world_size > 1 and any(True for _ in module.buffers())
        before, after = _forward_hooks()
        _BOUND[module] = weakref.ref(self)
        binding.keep(module.register_forward_pre_hook(before))
        binding.keep(module.register_forward_hook(after))
        self.module_ref = weakref.ref(module)
        self._plan_key = None  # planned again, in the module's order
        binding.set_attribute(module, "no_sync", _NoSync(self if local_accumulation else None))

    def _unbound(self) -> None:
        """The binding closed (its handles are removed next): forget the module, so that a later bind
        hooks everything again."""
        module = self.module_ref() if self.module_ref is not None else None
        if module is not None and _reducer_of(module) is self:
            del _BOUND[module]
        self.module_ref, self._binding = None, None
        self._seen, self._unhooked, self._plan_key, self._accumulators = 0, [], None, {}

    def _hook_params(self) -> None:
        """Hook the params that need a grad and have no hook yet: at bind, then before each forward
        (torch refuses a hook on a frozen param: it gets its own once unfrozen; ``add_param_group``
        appends params)."""
        params = self._table().params
        self._unhooked.extend(range(self._seen, len(params)))
        self._seen = len(params)
        if any(params[i].requires_grad for i in self._unhooked):
            for i in [i for i in self._unhooked if params[i].requires_grad]:
                self._binding.keep(params[i].register_post_accumulate_grad_hook(_GradHook(self, i)))
            self._unhooked = [i for i in self._unhooked if not params[i].requires_grad]

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
        self._hook_params()
        if self._broadcast_buffers and torch.is_grad_enabled() and not self._suspended:
            with torch.no_grad():
                self.comm.broadcast_([b for b in module.buffers()], src=0, what="broadcasting buffers from rank 0")

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
            floats = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if not floats or not self._current_plan().where:
                return None
            anchor = torch.empty(0, requires_grad=True)
            for k, t in zip(floats, _Anchored.apply(anchor, *(leaves[k] for k in floats))):
                leaves[k] = t
            output, tensors = rebuild(leaves), [leaves[floats[0]]]
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
        """Whether a reentrant checkpoint region will run below ``root``. The walk stops at the
        first region (without one it sees the whole graph), and its answer is kept for as long as
        the same params are unreached: see [Note: arming a backward]."""
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

    @property
    def held_bucket_bytes(self) -> int:
        """Reduce-bucket memory held now: the buckets in use that are not the pool's, and the pool's."""
        return self._unpooled_bytes + self._pool.held_bytes

    def _launch_ready(self) -> None:
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
        while len(self._in_flight) >= MAX_IN_FLIGHT:
            self._finish(*self._in_flight.popleft())
        if self._reduced is not self._plan:
            self._shards, self._reduced = [None] * len(self._plan.sizes), self._plan
        into = None
        if b not in self._written:  # the first reduction since the step: straight into the shard
            lo, hi = self._plan.owned[b]
            into = self._shards[b]
            if into is None:
                into = self._shards[b] = torch.empty(hi - lo, dtype=buf.dtype, device=buf.device)
        pending = self.comm.reduce_scatter_(buf, self._plan.layout.buffers[b].bounds, out=into, divided=divided)
        self._in_flight.append((b, buf, base, into is not None, pending))

    def _finish(self, b: int, buf: torch.Tensor, base: torch.Tensor | None, direct: bool, pending) -> None:
        pending.wait()
        if not direct:  # accumulating: this backward's average added to the shard's
            lo, hi = self._plan.owned[b]
            self._shards[b].add_(buf[lo:hi])
        self._written.add(b)
        self._count_bucket(-buf.nbytes, pooled=base is not None)
        if base is not None:
            self._pool.give(base)
        # gloo keeps a collective's work, and the bucket it sends, a while after it completes
        # ([Note: no Python on communication threads]): without this, every bucket of every
        # backward in the last second or two stays alive, a full set of grads per fast step.
        self.comm.release_completed_works()

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

    def _abandon(self) -> None:
        """The armed backward never ended (it raised): finish the reductions it started (every
        rank started the same ones), drop the buckets being filled, and mark the shards partial."""
        while self._in_flight:
            self._finish(*self._in_flight.popleft())
        for buf, base, _ in self._filling.values():
            self._count_bucket(-buf.nbytes, pooled=base is not None)
            if base is not None:
                self._pool.give(base)
        self._filling.clear()
        self._armed, self._since.agreed, self._pending, self._broken = False, None, set(), True

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
        table = self._table()
        local = [table.label(i) for i, p in enumerate(table.params) if p.requires_grad and p.grad is not None]
        if local:
            raise RuntimeError(
                f"hf_zero stage 2: {local[0]} has a gradient that was never reduced: the last backward before "
                "the step (or clipping) ran under no_sync(), or the grad was set by hand"
            )
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
        if not allow_fp16 and any(self._reduced.layout.buffers[b].dtype == torch.float16 for b in written):
            raise ValueError("Attempting to unscale FP16 gradients.")  # torch's GradScaler.unscale_, word for word
        local = _unscaled_non_finite([self._shards[b] for b in written], inv_scale, self.comm.device)
        # the step's agreement rides along: [Note: agreeing on presence]
        local = grads.all_reduce_along(local, op="max", what="agreeing on non-finite gradients (GradScaler)")
        found_inf.copy_(torch.maximum(found_inf, local.to(found_inf.device)))
        self._unscaled = True

    def step_taken(self) -> None:
        """The step consumed the grads (or ``zero_grad``): the shards hold nothing now."""
        if self._armed and graph_task_id() == -1:
            self._abandon()
        self._broken = False
        self._unscaled = False
        self._written.clear()
        self._since = _SinceStep()
        self.peak_bucket_bytes = self.held_bucket_bytes


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
    A bucket allocated afresh in every backward costs its pages again each time (on the CPU
    an allocation this large is mmapped and faulted in, and was zero-filled besides: most of
    stage 2's extra time over stage 1, measured by torch.profiler on the e2e GPT-2). So the
    buckets no wider than the cap come from a pool, all as wide as the widest such bucket of
    the plan (one size fits every bucket), and go back to it when reduced. The pool keeps
    at most ``keep`` free ones per (dtype, device): the buckets in flight plus the one being
    filled, what a backward holds at once anyway, so between backwards a rank holds about
    the reduce buckets the backward's peak already counted, never a gradient's worth. A
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
        self._width: dict[tuple, int] = {}  # (dtype, device) -> elements of each pooled bucket
        self._free: dict[tuple, list[torch.Tensor]] = {}

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
        return base[:numel], base

    def give(self, base: torch.Tensor) -> None:
        """``base`` (from :meth:`take`) is free again: kept, or let go."""
        key = (base.dtype, base.device)
        free = self._free.setdefault(key, [])
        if base.numel() == self._width.get(key) and len(free) < self.keep:
            free.append(base)
        else:
            self.held_bytes -= base.nbytes


def _check_bindable(module: torch.nn.Module, table, *, bound: bool, cap_bytes: int) -> None:
    """Refuse, before anything changes, a module :meth:`Reducer.bind` cannot bind."""
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            "bind_module: stage=2 takes gradient synchronisation over from DistributedDataParallel; "
            "pass the unwrapped module (model.module) and do not wrap it in DDP"
        )
    if bound:
        raise ValueError("bind_module: this optimizer is already bound to another module; call optimizer.unbind() first")
    if _reducer_of(module) is not None:
        raise ValueError(f"bind_module: this {type(module).__name__} is bound to another stage-2 optimizer; call "
                         "unbind() on that one first (Trainer and Accelerate unbind when training ends)")
    if getattr(module, "no_sync", None) is not None and not isinstance(module.no_sync, _NoSync):
        raise ValueError(f"bind_module: {type(module).__name__} already has a no_sync attribute")
    if cap_bytes <= 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {cap_bytes / (1 << 20)}")
    missing = [n for n, p in module.named_parameters() if p.requires_grad and table.index(p) is None]
    if missing:
        raise ValueError(
            f"bind_module: trainable params of the module are not in the optimizer: {missing[:5]}; "
            "give the optimizer every param (frozen ones too) or freeze these"
        )


# module -> its reducer (weakly both ways): the forward hooks look their reducer up by the module they are
# called with, so a copy of a bound module (copy.deepcopy shares functions, torch.save pickles them by name)
# finds none and is not bound ([Note: a binding ends with its run] in _binding.py)
_BOUND: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def _reducer_of(module: torch.nn.Module) -> "Reducer | None":
    ref = _BOUND.get(module)
    return None if ref is None else ref()


def _before_forward(module: torch.nn.Module, args) -> None:
    reducer = _reducer_of(module)
    if reducer is not None:
        reducer.before_forward(module)


def _after_forward(module: torch.nn.Module, args, output):
    reducer = _reducer_of(module)
    return None if reducer is None else reducer.after_forward(output)


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
    """The bound module's ``no_sync`` attribute: the reducer's :meth:`Reducer.no_sync` (None: a
    ``nullcontext``, ``local_accumulation=False``). A copy of the module gets one that does nothing."""

    __slots__ = ("_reducer",)

    def __init__(self, reducer: "Reducer | None"):
        self._reducer = None if reducer is None else weakref.ref(reducer)

    def __call__(self):
        reducer = None if self._reducer is None else self._reducer()
        return contextlib.nullcontext() if reducer is None else reducer.no_sync()

    def __reduce__(self):
        return (_NoSync, (None,))


def _arm(reducer_ref):
    def arm(grad_outputs) -> None:  # a prehook of an output's autograd node (holding no node: no cycle)
        reducer = reducer_ref()
        if reducer is not None:
            reducer.arm(running_node())

    return arm


class _Anchored(torch.autograd.Function):
    """Copies of ``tensors`` that need a grad through ``anchor`` (an empty leaf), so that a backward
    from them runs (and arms the reducer) on a rank whose forward used no trainable param."""

    @staticmethod
    def forward(ctx, anchor, *tensors):
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *grads)


class _GradHook(Hook):
    """Param ``i``'s post-accumulate-grad hook: hand the grad to the reducer (held weakly)."""

    __slots__ = ("_reducer", "_i")

    def __init__(self, reducer: Reducer, i: int):
        self._reducer, self._i = weakref.ref(reducer), i

    def __call__(self, p: torch.Tensor) -> None:
        reducer = self._reducer()
        if reducer is not None:
            reducer.on_grad(self._i, p)
