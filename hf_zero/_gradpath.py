"""The optimizer's side of the gradient path: what DDP's comm hook may reach.

[Note: gradient path protocol]
``_scatter_hook.py`` (the DDP comm hook that reduce-scatters each bucket into its owners)
and the overlapped parameter sync (``_overlap.py``) see the optimizer only through a
:class:`GradientPath`: the params and their indices, the current layout, the DDP bucket
structure to plan the next layout with, and each bucket's rank bounds. It also owns the
choices made when DDP is bound (all-reduce or reduce-scatter, overlap or not), the comm
hook's state and the overlap. It holds the optimizer only through weak callables: DDP
keeps the hook's state alive, which must not keep the optimizer alive.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections import Counter
from typing import Callable

import torch

from . import _scatter_hook, _stage2
from ._binding import Binding
from ._comm import Comm
from ._layout import Layout
from ._ledger import storage_bytes
from ._overlap import ParamSyncOverlap, Units
from ._views import separate_views

GRAD_REDUCE = ("auto", "all_reduce", "reduce_scatter")

logger = logging.getLogger("hf_zero._optimizer")  # where these warnings were always logged (users filter on it)


class GradientPath:
    """See [Note: gradient path protocol]. ``facts``: the optimizer's (held weakly) param
    table and current layout; ``grad_reduce`` / ``overlap_param_sync``: its constructor's.
    ``stage``: 1, DDP reduces (through the comm hook when reduce-scattering); 2, hf_zero's
    own reducer (the ``_stage2`` package), bound to the model with :meth:`bind_module`; ``accumulate_dtype``: its
    shards' (``_stage2.accumulate_dtype``); ``check``: the optimizer's layout check at a syncing backward's start
    (``_stage2.Reducer``'s, held weakly); ``carry``: the optimizer's at stage 1, where a DDP bucket carries it
    (held weakly: :meth:`carry_check`)."""

    def __init__(self, comm: Comm, *, facts: Callable[[], tuple], grad_reduce: str,
                 overlap_param_sync: bool | None, bucket_view: bool, stage: int = 1, shard: str = "flat",
                 accumulate_dtype: torch.dtype | None = None, check: Callable | None = None,
                 carry: Callable | None = None):
        self.comm = comm
        self.grad_reduce = "reduce_scatter" if stage == 2 else grad_reduce
        self._facts = weakref.WeakMethod(facts)  # () -> (ParamTable, current Layout or None)
        self._overlap_choice = overlap_param_sync
        self._bucket_view = bucket_view
        self._ddp_buckets: tuple[tuple[int, ...], ...] = ()  # to plan the next layout with (stage 1)
        self.ddp_reduced: tuple[bool, ...] | None = None  # which params DDP reduces
        self.reducer: _scatter_hook.BucketReducer | None = None
        self.overlap: ParamSyncOverlap | None = None
        self.stage = stage
        self.stage2 = _stage2.Reducer(comm, self._table, shard, accumulate_dtype,
                                      check=_held_weakly(check)) if stage == 2 else None
        self.ddp_bucket_view: bool | None = None  # the bound DDP's gradient_as_bucket_view (None: none bound)
        # every hook and attribute on the user's module ([Note: a binding ends with its run]); a newer
        # binding over the same params unbinds it ([Note: a newer binding takes over] in _binding.py)
        self.binding = Binding(end=self.unbind)
        self._equal_layouts: tuple = ()  # see _same_layout
        self._carry = _held_weakly(carry)
        self._carrier: tuple = (None, None)  # (a layout, its carrier)

    def _table(self):
        return self._facts()()[0]

    @property
    def wanted_buckets(self) -> tuple[tuple[int, ...], ...]:
        """The buckets the next layout is planned with: DDP's (stage 1), the reducer's (stage 2)."""
        return self.stage2.buckets() if self.stage2 is not None else self._ddp_buckets

    # -- the protocol _scatter_hook uses ------------------------------------------------
    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        """Every param, in the optimizer's order."""
        return self._facts()()[0].params

    def param_index(self, param: torch.Tensor) -> int | None:
        """``param``'s index in :attr:`params`, or None when it is not one of them."""
        return self._facts()()[0].index(param)

    def param_indices(self, params) -> tuple[int | None, ...]:
        """:meth:`param_index` of each of ``params`` (one table lookup for all: a DDP bucket's)."""
        return self._facts()()[0].indices(params)

    @property
    def layout(self) -> Layout | None:
        """The current layout (buffers and each rank's ranges); None before the first step."""
        return self._facts()()[1]

    def plan_with_ddp_buckets(self, buckets: tuple[tuple[int, ...], ...]) -> None:
        """Lay the buffers out after these DDP buckets (param indices, in bucket order)
        from the next re-partition on (the next step notices). Same on every rank."""
        self._ddp_buckets = tuple(tuple(b) for b in buckets)

    def ddp_buckets_planned(self) -> tuple[tuple[int, ...], ...] | None:
        """The DDP buckets the current layout follows (None before the first step)."""
        layout = self.layout
        return None if layout is None else layout.buckets

    def bucket_bounds(self, composition: tuple[int, ...]) -> tuple[int, ...] | None:
        """Rank bounds of the buffer mirroring the DDP bucket of these params, or None."""
        layout = self.layout
        if layout is None or self.grad_reduce != "reduce_scatter":
            return None
        for k, bucket in enumerate(layout.buckets):
            if bucket == composition:
                b = layout.bucket_buffer(k)
                return None if b is None else layout.buffers[b].bounds
        return None

    def check_carrier(self) -> tuple[int, ...] | None:
        """The DDP bucket (its params) whose reduce-scatter carries the layout check ([Note: stage 1's check
        rides a bucket] in _scatter_hook.py): the current layout's smallest one, where small enough."""
        layout = self.layout
        if self._carrier[0] is not layout:
            self._carrier = (layout, _scatter_hook.carrier_of(layout, self.comm.world_size))
        return self._carrier[1]

    def carry_check(self, heard) -> bool:
        """The layout check, as the carrier is reduced: whether this rank changed (its bit); the step reads
        what ``heard`` hears."""
        return bool(self._carry(heard)) if self._carry is not None else False

    # -- what the optimizer asks ----------------------------------------------------------
    def staged_bytes(self) -> int:
        """Stage 1: the bytes of the carrier's staged copy."""
        return 0 if self.reducer is None else self.reducer.staged_bytes()

    @property
    def partial_grads(self) -> set[int]:
        """Params whose grads hold the average only in this rank's ranges until the next step."""
        return self.reducer.partial_grads if self.reducer is not None else set()

    def refuse_partial_after_step(self, chosen: set[int], what: str) -> None:
        """Raise if a ``chosen`` param's ``p.grad`` is what a step left of a reduce-scattered grad (the average in
        this rank's ranges only) and a syncing backward has not replaced it yet: nothing tells it from a grad
        accumulated since, so its full value cannot be had."""
        stale = chosen & self.reducer.stepped_partial if self.reducer is not None else set()
        table = self._table()
        for i in sorted(stale):
            if table.params[i].grad is not None:
                raise RuntimeError(
                    f"hf_zero: {what}({table.label(i)}) after the step: its grad was reduce-scattered, so after the "
                    "step p.grad holds the average only in this rank's ranges; read it between the backward and the "
                    "step, or use grad_reduce='all_reduce' (p.grad whole until zero_grad(), as under DDP)"
                )

    def mark_reduced(self, mask: tuple[bool, ...], *, keep: bool = False) -> None:
        """DDP reduces the params trainable in ``mask`` (``keep``: unless already recorded)."""
        if not (keep and self.ddp_reduced is not None):
            self.ddp_reduced = mask

    def unreduced(self, table) -> list[torch.Tensor]:
        """The params DDP never reduces (frozen when it was built; default: now); none under stage 2."""
        if self.stage2 is not None:
            return []
        if self.ddp_reduced is None:
            self.mark_reduced(table.mask())
        return [p for p, reduced in zip(table.params, self.ddp_reduced) if not reduced]

    def step_taken(self) -> None:
        if self.reducer is not None:
            self.reducer.step_taken()
        if self.stage2 is not None:
            self.stage2.step_taken()

    @property
    def taken_over(self) -> bool:
        """Whether a newer binding over the same params took this one's over ([Note: a newer binding takes
        over] in _binding.py) and it was not bound again since."""
        return self.binding.taken_over

    def sharded_grads(self) -> _stage2.ShardedGrads | None:
        """Stage 2: this rank's averaged grads, after its checks (no collective); None under stage 1."""
        if self.stage2 is None:
            return None
        if self.binding.taken_over:
            raise RuntimeError(
                "hf_zero stage 2: another optimizer bound the same params after this one (a later bind_module, "
                "Trainer or accelerator.prepare), so their grads go to it and this optimizer has none to step: "
                "step the newer optimizer, or call this one's bind_module(model) again to take the params back"
            )
        return self.stage2.sharded()

    def for_step(self, grads: _stage2.ShardedGrads | None, carried=None) -> _stage2.ShardedGrads | None:
        """``grads`` (from :meth:`sharded_grads`) for the step, which reads them from the layout they were
        reduced into, after the ranks agreed on which params have grads (collective, unless clipping or a
        GradScaler agreed already, or another all-reduce carried the flags: ``carried`` gives them reduced)."""
        if grads is None:
            return None
        if grads.pieces and not self._same_layout(grads.layout):
            raise changed_since_backward()
        return grads.agree(carried)

    def _same_layout(self, reduced_into: Layout) -> bool:
        """Whether ``reduced_into`` (the reducer's layout) equals the current one. Layouts are immutable and
        two equal ones are usually two objects (the reducer plans its own): the last pair found equal is kept,
        so a steady step compares two identities, not every slot of both."""
        current, kept = self.layout, self._equal_layouts
        if not (kept and kept[0] is reduced_into and kept[1] is current):
            if reduced_into != current:
                return False
            self._equal_layouts = (reduced_into, current)
        return True

    def memory(self, params: tuple[torch.Tensor, ...]) -> dict[str, int]:
        """This rank's gradient bytes by holder ([Note: memory ledger] in _ledger.py): DDP's buckets (as many
        bytes as the params it reduces), the ``p.grad`` that are not views of them, stage 2's shards and buckets."""
        ddp, views = 0, set()
        if self.ddp_bucket_view is not None and self.ddp_reduced is not None:
            reduced = [p for p, r in zip(params, self.ddp_reduced) if r]
            ddp = sum(p.numel() * p.element_size() for p in reduced)
            if self.ddp_bucket_view:
                views = _bucket_views([p.grad for p in reduced if p.grad is not None],
                                      set() if self.reducer is None else self.reducer.bucket_storages())
        grads = (p.grad for i, p in enumerate(params) if self.stage2 is None or not _stage2.stands_in(self.stage2, i, p))
        out = {"ddp_buckets": ddp, "full_grads": storage_bytes(grads, views)}
        if self.stage2 is not None:
            out.update(_stage2.memory(self.stage2))
        return out

    def memory_peaks(self, reset: bool = False) -> dict[str, int]:
        """Stage 2's reduce buckets' peaks (in use, pooled idle) since the last reset; ``reset``: start afresh after."""
        return {} if self.stage2 is None else _stage2.memory_peaks(self.stage2, reset)

    def unscale_(self, inv_scale: torch.Tensor, found_inf: torch.Tensor, *, allow_fp16: bool) -> None:
        """Stage 2: what ``torch.amp.GradScaler.unscale_`` does to an optimizer's grads, for this rank's shards:
        multiply them by ``inv_scale``, and set ``found_inf`` (GradScaler's 0-dim float32 flag) to 1 if any rank's
        shard holds an inf or NaN (one MAX all-reduce: every rank skips the same steps). Collective. A scaler
        reaches it through ``hf_zero.prepare_grad_scaler`` (``_stage2.Reducer.unscale_``)."""
        if self.stage2 is None:
            raise ValueError(
                "gradient_path.unscale_ is for stage=2, whose grads live in shards; under stage 1 the grads are "
                "in p.grad and torch's GradScaler unscales them itself"
            )
        self.stage2.unscale_(inv_scale, found_inf, allow_fp16=allow_fp16)

    def bind_module(self, module: torch.nn.Module, *, bucket_cap_mb: float, broadcast_buffers: bool = True,
                    local_accumulation: bool = True, overlap_default: bool = False) -> None:
        """The body of ``ZeroBucketOptimizer.bind_module`` (documented there; ``local_accumulation``:
        see ``_stage2.Reducer.bind``)."""
        if self.stage2 is None:
            raise ValueError(
                "bind_module is for stage=2 (hf_zero reduces the grads, no DDP); a stage-1 optimizer binds "
                "the DistributedDataParallel wrapping the model with bind_ddp(ddp)"
            )
        reader = reads_full_grads_after_step(module)
        if reader is not None:
            raise ValueError(
                f"bind_module: {reader}; under stage=2 the grads are sharded and freed at the step. Use stage=1 with "
                "grad_reduce='all_reduce' (Trainer: --optim_args stage=1,grad_reduce=all_reduce), where p.grad is the "
                "full averaged grad until zero_grad(), as under DDP"
            )
        _refuse_needing_ddp(module)
        self.stage2.bind(module, self.binding, cap_bytes=int(bucket_cap_mb * (1 << 20)), broadcast_buffers=broadcast_buffers,
                         local_accumulation=local_accumulation)
        separate_views(module, self.binding)  # savers take the bound model: [Note: views in a state dict]
        self._attach_overlap(module, overlap_default)

    def _attach_overlap(self, module: torch.nn.Module, overlap_default: bool, units=None) -> None:
        units = None if units is None else Units(module, units)  # [Note: overlapped parameter sync]
        overlap = self._overlap_choice if self._overlap_choice is not None else overlap_default
        if overlap and self.comm.world_size > 1:
            if self._bucket_view:
                self.overlap = self.overlap or ParamSyncOverlap()
                self.overlap.attach(module, units, self.binding)
                self.comm.own_sync_group()  # [Note: a group for the overlapped sync]
            else:
                logger.warning("hf_zero: overlap_param_sync needs parameters_as_bucket_view=True; syncing in the step")

    def wait(self) -> None:
        if self.overlap is not None:
            self.overlap.drain()

    def unbind(self) -> None:
        """The body of ``ZeroBucketOptimizer.unbind`` (documented there)."""
        self.wait()
        self.binding.close()
        self.overlap = None  # no forward waits for a sync any more: the next steps sync in the step
        if self.reducer is not None:  # the DDP that holds its comm hook averages, as without one
            self.reducer.detach()
            self.reducer = None

    def bind(self, ddp, *, grad_reduce_default: str, overlap_default: bool, syncs_every_backward: bool,
             grad_scaler: bool, units=None) -> None:
        """The body of ``ZeroBucketOptimizer.bind_ddp`` (documented there; ``units``: its
        ``overlap_units``)."""
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(f"bind_ddp needs a torch.nn.parallel.DistributedDataParallel, got {type(ddp).__name__}")
        if grad_reduce_default not in GRAD_REDUCE[1:]:
            raise ValueError(f"grad_reduce_default must be one of {GRAD_REDUCE[1:]}, got {grad_reduce_default!r}")
        if self.stage2 is not None:
            raise ValueError(
                "stage=2 takes gradient synchronisation over from DistributedDataParallel: do not wrap the "
                "model in DDP; call optimizer.bind_module(model) on the unwrapped model instead of bind_ddp"
            )
        self.binding.claim(self._table().params)
        self._attach_overlap(ddp.module, overlap_default, units)
        if self._bucket_view:
            separate_views(ddp.module, self.binding)  # savers take the bound model: [Note: views in a state dict]
        self.ddp_bucket_view = bool(getattr(ddp, "gradient_as_bucket_view", False))
        if not self.ddp_bucket_view:
            _warn_copy_of_grads(ddp)
        reader = reads_full_grads_after_step(ddp.module)
        if reader is not None and self.grad_reduce == "reduce_scatter":
            raise ValueError(f"bind_ddp: {reader}; with grad_reduce='reduce_scatter' p.grad holds the average only in "
                             "this rank's ranges: use grad_reduce='all_reduce' (or leave it 'auto')")
        if self.grad_reduce == "auto":
            self.grad_reduce = "all_reduce" if reader is not None else grad_reduce_default
        if self.grad_reduce == "reduce_scatter" and self.reducer is None and self.comm.world_size > 1:
            reason = None
            if syncs_every_backward:
                reason = "gradient accumulation syncs every micro-batch (sync_each_batch), which needs full grads"
            elif not self.comm.same_group(ddp.process_group):
                reason = "DistributedDataParallel runs over another process group than this optimizer"
            else:
                attached = _scatter_hook.attach(ddp, self)
                if isinstance(attached, str):
                    reason = attached
                else:
                    self.reducer = attached
            if reason is not None:
                logger.warning("hf_zero: grad_reduce='reduce_scatter' is off, DDP all-reduces the grads: %s", reason)
                self.grad_reduce = "all_reduce"
        if self.reducer is not None:
            self.reducer.agree_on_finite = grad_scaler


def changed_since_backward() -> RuntimeError:
    """Stage 2's error for a trainable set (or shapes) changed between the backward and the step."""
    return RuntimeError(
        "hf_zero stage 2: the trainable params (or their shapes) changed between the backward and "
        "optimizer.step(): change requires_grad only right after step() or zero_grad()"
    )


def _held_weakly(method: Callable | None) -> Callable | None:
    """``method`` (a bound method) through a weak reference; once its object is gone, calls return False."""
    if method is None:
        return None
    ref = weakref.WeakMethod(method)

    def call(*args):
        live = ref()
        return False if live is None else live(*args)

    return call


def reads_full_grads_after_step(module: torch.nn.Module) -> str | None:
    """What in ``module`` reads every param's whole averaged ``p.grad`` after ``optimizer.step()`` (PEFT's
    AdaLoRA: ``update_and_allocate`` scores each LoRA param by ``p * p.grad``, the same on every rank), or None."""
    for m in (module, getattr(module, "base_model", None)):
        configs = getattr(m, "peft_config", None)
        for config in configs.values() if isinstance(configs, dict) else ():
            kind = getattr(config, "peft_type", None)
            if getattr(kind, "value", kind) == "ADALORA":
                return ("the model is a PEFT AdaLoRA model, whose update_and_allocate() reads every LoRA param's "
                        "full averaged p.grad after optimizer.step()")
    return None


_warned_copy = False


def _warn_copy_of_grads(ddp) -> None:
    """Once per process: a DDP built without ``gradient_as_bucket_view=True`` keeps the grads twice."""
    global _warned_copy
    if _warned_copy:
        return
    _warned_copy = True
    reduced = [p for p in ddp.module.parameters() if p.requires_grad]
    nbytes, count = sum(p.numel() * p.element_size() for p in reduced), sum(p.numel() for p in ddp.module.parameters())
    warnings.warn(
        f"hf_zero: bind_ddp: this DistributedDataParallel was built without gradient_as_bucket_view=True, so it "
        f"keeps a second copy of the gradients: {nbytes / 2**20:.1f} MiB on each rank "
        f"({nbytes / max(count, 1):.1f} bytes per param) that bucket views save. Build it with "
        "DistributedDataParallel(model, gradient_as_bucket_view=True) (hf_zero's Trainer and Accelerate wiring does)",
        UserWarning, stacklevel=4,  # the caller of bind_ddp
    )


def _refuse_needing_ddp(module: torch.nn.Module) -> None:
    """Refuse, before anything changes, a module stage 2 cannot serve without DDP."""
    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.SyncBatchNorm):
            raise ValueError(
                f"hf_zero: stage=2 refuses SyncBatchNorm ({name or type(module).__name__}): its backward runs "
                "collectives of its own in the middle of the backward, interleaved with stage 2's gradient "
                "reduce-scatters, which hf_zero does not order; convert it back to BatchNorm or use "
                "stage=1 (under DistributedDataParallel)"
            )


def _bucket_views(grads: list[torch.Tensor], buckets: set[tuple[int, int]]) -> set[int]:
    """The storages (data pointers) among ``grads`` that are DDP's buckets. A grad accumulated under
    ``no_sync()`` is a tensor of its own until the syncing backward copies it into its bucket: the buckets
    are the storages the comm hook saw (``buckets``: data pointer and size, as a storage DDP freed when it
    rebuilt its buckets may lend its address to a grad) or, before it ran, those holding more than one grad."""
    ptrs = [g.untyped_storage().data_ptr() for g in grads]
    if buckets:
        return {p for g, p in zip(grads, ptrs) if (p, g.untyped_storage().nbytes()) in buckets}
    shared = Counter(ptrs)
    return {p for g, p in zip(grads, ptrs) if shared[p] > 1 or g.untyped_storage().nbytes() > g.nbytes}

