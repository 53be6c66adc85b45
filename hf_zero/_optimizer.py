"""ZeroBucketOptimizer: ZeRO stage-1 with parameters as views into flat buffers."""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from . import _scatter_hook, _sharded
from ._codec import class_name, decode, encode
from ._statedict import ShardedState, check_state_dict, group_problems, hyperparams, match_checkpoint, mismatch_error
from ._overlap import ParamSyncOverlap
from ._comm import Comm, fingerprint
from ._grads import average_grads
from ._layout import Layout, ParamSpec, Piece, is_elementwise, plan_layout
from ._state import Holding, Holdings, Kind, kind_of, redistribute, shape_as, split_canonical

_NOT_HYPER = ("params", "param_names")
GRAD_REDUCE = ("auto", "all_reduce", "reduce_scatter")

logger = logging.getLogger(__name__)


def _check_params(param_groups: list[dict]) -> None:
    """Reject what torch.optim accepts but sharding cannot handle, naming the param."""
    seen = set()
    for gi, group in enumerate(param_groups):
        names = group.get("param_names") or [None] * len(group["params"])
        if not group["params"]:
            raise ValueError(f"param group {gi} is empty")
        for k, (p, name) in enumerate(zip(group["params"], names)):
            label = f"param {name or k} of group {gi} (shape {tuple(p.shape)})"
            if p.layout != torch.strided:
                raise ValueError(f"{label} is {p.layout}: only dense (strided) params can be sharded")
            if not (p.is_floating_point() or p.is_complex()):
                raise ValueError(f"{label} has dtype {p.dtype}: only floating point params can be optimized")
            if id(p) in seen:
                raise ValueError(f"{label} appears twice: list each param once")
            seen.add(id(p))


@dataclass(frozen=True)
class _LocalPiece:
    """A piece this rank owns: ``tensor`` (a view of ``param``) is what the local optimizer steps."""

    tensor: torch.Tensor
    param: torch.Tensor
    piece: Piece


@dataclass
class _Iteration:
    """What happened since the last step (or ``zero_grad``): reset by both."""

    grads_averaged: bool = False


_NORM_CHUNK = 1 << 14


def _pow_sum(g: torch.Tensor, norm_type: float) -> torch.Tensor:
    """sum(|g|^p) of a 1-D grad in float64 without a float64 copy of it: the norms of
    16K-element chunks in the grad's own dtype (rounding error ~1e-7, where one norm
    over millions of float32 elements is off by ~1e-4), raised and summed in float64."""
    if g.dtype == torch.float64:
        return torch.linalg.vector_norm(g, norm_type).pow(norm_type)
    full = g.numel() - g.numel() % _NORM_CHUNK
    total = torch.zeros((), dtype=torch.float64, device=g.device)
    if full:
        norms = torch.linalg.vector_norm(g[:full].view(-1, _NORM_CHUNK), norm_type, dim=1, dtype=torch.float32)
        total += norms.double().pow(norm_type).sum()
    if full < g.numel():
        total += torch.linalg.vector_norm(g[full:], norm_type, dtype=torch.float32).double().pow(norm_type)
    return total


class _JoinHook(JoinHook):
    """Shadows the step's collectives on a rank that ran out of inputs (as torch's ZeRO does)."""

    def __init__(self, optimizer: "ZeroBucketOptimizer"):
        self.optimizer = optimizer

    def main_hook(self) -> None:
        self.optimizer.step()


class ZeroBucketOptimizer(torch.optim.Optimizer, Joinable):
    """ZeRO stage-1: each rank keeps optimizer state only for the elements it owns.

    A drop-in for :class:`torch.distributed.optim.ZeroRedundancyOptimizer` (its
    whole constructor signature, ``step(closure, **kwargs)``, local param-group
    changes written back, :class:`~torch.distributed.algorithms.join.Join`
    support), which follows ``requires_grad`` changes, mixes dtypes and devices,
    and syncs parameters with a few whole-buffer collectives per step.

    Args:
        params: tensors, ``(name, tensor)`` pairs or param groups. Include frozen
            params: only those listed here can be trained after being unfrozen.
        optimizer_class: the local optimizer, e.g. ``torch.optim.AdamW``.
        process_group: the group to shard over (default: the world; world size 1
            when torch.distributed is not initialized).
        parameters_as_bucket_view: make every trainable param's ``.data`` a view
            into one flat buffer per (device, dtype), so the sync moves whole
            buffers. ``False`` keeps params' own storage (the sync then copies
            through a staging buffer). Default ``True`` (torch's default is ``False``).
        overlap_with_ddp: accepted for torch compatibility; only ``False`` is
            supported (``True`` raises ``ValueError``).
        shard: ``"flat"`` (equal ranges, params may straddle ranks; elementwise
            optimizers only), ``"param"`` (whole params; any optimizer) or
            ``"auto"`` (flat when ``optimizer_class`` is elementwise).
        grad_reduce: ``"all_reduce"`` (DDP all-reduces the grads, as without
            hf_zero) or ``"reduce_scatter"``: once :meth:`bind_ddp` is called, DDP's
            all-reduce is replaced by a reduce-scatter into the ranks that own the
            elements, so a step moves DDP's bytes instead of 1.5 times them (see
            docs/gradient_path.md). Grads are then only valid in this rank's own
            ranges between backward and step: clip with :meth:`clip_grad_norm_` /
            :meth:`clip_grad_value_`, not torch's. ``"auto"`` (default): what the
            integration binding DDP chooses (``reduce_scatter`` for Trainer and
            Accelerate, which route clipping), ``all_reduce`` in a plain loop.
        overlap_param_sync: sync the params after a step asynchronously; each module's
            forward waits for its own params (needs bucket views and :meth:`bind_ddp`;
            call :meth:`wait_param_sync` before reading params outside a forward or
            ``model.state_dict()``). ``None`` (default): what the integration binding
            DDP chooses, off in a plain loop.
        **defaults: hyperparameters for ``optimizer_class``.

    Buffers are built at the first :meth:`step` (after ``model.to`` or
    ``accelerator.prepare`` moved the params) and checked at every step.
    Every method that says *collective* must be called on all ranks.

    Integration protocol (used by hf_zero's Trainer/Accelerate integrations; see
    docs/architecture.md): :attr:`params`, :attr:`param_names`, :meth:`param_label`,
    :meth:`group_of`, :attr:`rank`, :attr:`world_size`, :meth:`ensure_partition`,
    :meth:`mark_ddp_reduced`, :meth:`unreduced_params`, :meth:`average_unreduced_grads`,
    :meth:`release_views`, :meth:`stats`, :meth:`refer_to_sharded`,
    :meth:`load_pending_sharded`, :meth:`load_sharded_if_present`.
    """

    def __init__(
        self,
        params: Iterable,
        optimizer_class: type[torch.optim.Optimizer],
        process_group: Any = None,
        parameters_as_bucket_view: bool = True,
        overlap_with_ddp: bool = False,
        shard: str = "auto",
        grad_reduce: str = "auto",
        overlap_param_sync: bool | None = None,
        **defaults: Any,
    ):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        if overlap_with_ddp:
            raise ValueError(
                "overlap_with_ddp=True (torch's DDP-communication-hook mode) is not supported by "
                "ZeroBucketOptimizer; pass overlap_with_ddp=False: the parameter sync is a few "
                "whole-buffer collectives per step"
            )
        if shard not in ("auto", "flat", "param"):
            raise ValueError(f"shard must be 'auto', 'flat' or 'param', got {shard!r}")
        if shard == "flat" and not is_elementwise(optimizer_class):
            raise ValueError(
                f"shard='flat' splits params across ranks, which is only exact for elementwise "
                f"optimizers; {optimizer_class.__name__} is not one: use shard='param'"
            )
        if grad_reduce not in GRAD_REDUCE:
            raise ValueError(f"grad_reduce must be one of {GRAD_REDUCE}, got {grad_reduce!r}")
        if shard == "auto":
            shard = "flat" if is_elementwise(optimizer_class) else "param"
        self._ready = False
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # torch only warns on duplicates
            try:
                torch.optim.Optimizer.__init__(self, params, {})
            except UserWarning as w:
                raise ValueError(f"params: {w}") from None
        _check_params(self.param_groups)
        first = self.param_groups[0]["params"][0]
        probe = optimizer_class([torch.zeros(1, dtype=first.dtype, device=first.device)], **defaults)
        self.defaults = dict(probe.defaults)
        for group in self.param_groups:
            for k, v in self.defaults.items():
                group.setdefault(k, v)
        del probe
        Joinable.__init__(self)

        self.optimizer_class = optimizer_class
        self.shard = shard
        self.parameters_as_bucket_view = bool(parameters_as_bucket_view)
        self._comm = Comm(process_group)
        self._layout: Layout | None = None
        self._mask: tuple[bool, ...] | None = None
        self._fingerprint: int | None = None
        self._ddp_reduced: tuple[bool, ...] | None = None
        self._inner: torch.optim.Optimizer | None = None
        self._pieces: list[_LocalPiece] = []
        self._buffers: list[torch.Tensor] = []
        self._ptrs: dict[int, int] = {}
        self._parked: Holdings = {}
        self._consolidated: dict | None = None
        self._state_token = object()  # replaced whenever state values change
        self._has_state = False
        self._sharded_ref: tuple[object, dict] | None = None  # (state token, info): see [Note: sharded reference]
        self._pending_ref: dict | None = None
        self._iteration = _Iteration()
        self.grad_reduce = grad_reduce
        self._reducer: _scatter_hook.BucketReducer | None = None  # set by bind_ddp
        self._ddp_buckets: tuple[tuple[int, ...], ...] = ()  # to plan with; see _scatter_hook
        self._overlap_choice = overlap_param_sync
        self._overlap: ParamSyncOverlap | None = None
        self._index_of: dict[int, int] = {}
        self.rebuilds = 0
        self._ready = True
        self._index_params()

    # -- params --------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if getattr(self, "_ready", False):
            for k, v in self.defaults.items():
                self.param_groups[-1].setdefault(k, v)
            self._index_params()

    def _index_params(self) -> None:
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        self._group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        self._param_names = [n for g in self.param_groups for n in g.get("param_names", [None] * len(g["params"]))]

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        """Every param, in param-group order (the order ``state_dict`` numbers them)."""
        return tuple(self._params)

    @property
    def param_names(self) -> tuple[str | None, ...]:
        """Each param's name from the groups' ``param_names`` (None where not given)."""
        return tuple(self._param_names)

    def param_label(self, i: int) -> str:
        """How errors name param ``i``: its name (or ``#i``), group and shape."""
        p = self._params[i]
        label = self._param_names[i] or f"#{i}"
        return f"{label} (group {self._group_of[i]}, shape {tuple(p.shape)})"

    def group_of(self, i: int) -> int:
        """The index of the param group holding param ``i``."""
        return self._group_of[i]

    @property
    def rank(self) -> int:
        """This process's rank in the process group."""
        return self._comm.rank

    @property
    def world_size(self) -> int:
        """The number of ranks the state is sharded over."""
        return self._comm.world_size

    def _specs(self) -> list[ParamSpec]:
        return [
            ParamSpec(p.numel(), p.dtype, str(p.device), p.requires_grad, self._group_of[i])
            for i, p in enumerate(self._params)
        ]

    # -- step ----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any):
        """Update the params this rank owns, then sync every buffer. Collective.

        ``closure`` (re-evaluates the model, returns the loss) runs once, before the
        update, on every rank; ``kwargs`` go to the local optimizer's ``step``, as
        torch's ZeroRedundancyOptimizer forwards them. Returns the closure's loss.
        """
        Join.notify_join_context(self)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.wait_param_sync()
        self.ensure_partition()
        if not self._iteration.grads_averaged:
            self.average_unreduced_grads()
        self._local_step(kwargs)
        self._sync()
        self._iteration = _Iteration()
        if self._reducer is not None:
            self._reducer.step_taken()
        self._has_state = True
        self._consolidated = None
        self._state_token = object()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._iteration = _Iteration()
        if self._reducer is not None:
            self._reducer.step_taken()

    def refresh_trainable(self) -> None:
        """Re-partition the current trainable set and move optimizer state. Collective."""
        self._ensure_partition(force=True)

    def ensure_partition(self) -> None:
        """Check trainability and views on every rank and rebuild on every rank if any
        rank needs it: one 24-byte agreement all-reduce. Collective; :meth:`step` calls it."""
        self._ensure_partition(force=False)

    def _ensure_partition(self, force: bool) -> None:
        self._check_pending()
        mask = tuple(p.requires_grad for p in self._params)
        intact = self._views_intact()
        if mask != self._mask or not intact or self._fingerprint is None:
            self._fingerprint = fingerprint(self._agreement_items(mask))
        need = (
            force or self._layout is None or mask != self._mask or not intact
            or self._layout.buckets != self._ddp_buckets
        )
        agree, anyone_needs = self._comm.agree(self._fingerprint, need)
        if not agree:
            self._raise_disagreement(mask)
        if anyone_needs:
            self.wait_param_sync()
            self._rebuild(mask)

    def _check_agreement(self) -> None:
        """Before a checkpoint collective: raise on every rank unless all hold the same params."""
        mask = tuple(p.requires_grad for p in self._params)
        agree, _ = self._comm.agree(fingerprint(self._agreement_items(mask)))
        if not agree:
            self._raise_disagreement(mask)

    def _agreement_items(self, mask) -> list:
        return [(tuple(p.shape), str(p.dtype), p.device.type, m) for p, m in zip(self._params, mask)]

    def _raise_disagreement(self, mask) -> None:
        mine = self._agreement_items(mask)
        everyone = self._comm.all_gather_object(mine)
        fields = ("shape", "dtype", "device", "requires_grad")
        for i in range(max(len(e) for e in everyone)):
            seen = [e[i] if i < len(e) else None for e in everyone]
            if any(s != seen[0] for s in seen):
                per_rank = "; ".join(
                    f"rank {r}: " + ("missing" if s is None else ", ".join(f"{f}={v}" for f, v in zip(fields, s)))
                    for r, s in enumerate(seen)
                )
                raise RuntimeError(
                    f"hf_zero: ranks disagree on parameter {self.param_label(i)}: {per_rank}. Every rank must "
                    "freeze/unfreeze the same params and keep the same shapes, dtypes and devices."
                )
        raise RuntimeError("hf_zero: ranks disagree on the parameter layout")

    def _views_intact(self) -> bool:
        return all(self._params[i].data_ptr() == ptr for i, ptr in self._ptrs.items())

    # -- gradients DDP does not reduce (see docs/architecture.md, "Unreduced gradients")
    def mark_ddp_reduced(self) -> None:
        """Record that DDP reduces exactly the params trainable now: call it when DDP has
        just been built. Without a call, the set trainable at the first step is taken."""
        self._ddp_reduced = tuple(p.requires_grad for p in self._params)

    def unreduced_params(self) -> list[torch.Tensor]:
        """The params DDP never reduces (frozen when it was built): hf_zero averages their grads."""
        if self._ddp_reduced is None:
            self.mark_ddp_reduced()
        return [p for p, reduced in zip(self._params, self._ddp_reduced) if not reduced]

    def average_unreduced_grads(self) -> None:
        """Average over ranks the grads of trainable params DDP does not reduce. Collective.

        :meth:`step` does it unless it was done since the last step or ``zero_grad``;
        integrations call it at the end of each syncing backward, so clipping and
        GradScaler see averaged grads.
        """
        if self._comm.world_size > 1:
            average_grads(self._comm, [p for p in self.unreduced_params() if p.requires_grad])
        self._iteration.grads_averaged = True

    def _local_step(self, kwargs: dict) -> None:
        for inner_group, group in zip(self._inner.param_groups, self.param_groups):
            for k, v in group.items():
                if k not in _NOT_HYPER:
                    inner_group[k] = v
        flat = self.shard == "flat"
        for lp in self._pieces:
            g = lp.param.grad
            if g is None:
                lp.tensor.grad = None
            elif flat:
                lp.tensor.grad = g.reshape(-1)[lp.piece.start : lp.piece.stop]
            else:
                lp.tensor.grad = g
        try:
            self._inner.step(**kwargs)
        finally:
            for lp in self._pieces:
                lp.tensor.grad = None
        # The local optimizer may change its own hyperparameters (as torch's ZeRO, copy them back).
        for inner_group, group in zip(self._inner.param_groups, self.param_groups):
            for k, v in inner_group.items():
                if k not in _NOT_HYPER:
                    group[k] = v

    def _sync(self) -> None:
        if self._comm.world_size == 1:
            return
        if self._overlap is not None and self.parameters_as_bucket_view:
            # In the order the next forward needs them (the params' order, which models
            # register as they run), not DDP's backward order: the first layers wait least.
            # The same order on every rank: it depends only on the agreed layout.
            plans = self._layout.buffers
            first = [min((slot.index for slot in plan.slots), default=len(self._params)) for plan in plans]
            pending = {
                b: self._comm.sync_buffer(self._buffers[b], plans[b].bounds, async_op=True)
                for b in sorted(range(len(plans)), key=lambda b: (first[b], b))
            }
            where = {id(self._params[i]): b for i, (b, _) in self._layout.slots().items()}
            self._overlap.launch(pending, where)
            return
        for b, plan in enumerate(self._layout.buffers):
            buf = self._buffers[b]
            if not self.parameters_as_bucket_view:
                for lp in self._pieces:
                    pc = lp.piece
                    if pc.buffer == b:
                        buf[pc.offset : pc.offset + pc.numel].copy_(lp.tensor.reshape(-1))
            self._comm.sync_buffer(buf, plan.bounds)
            if not self.parameters_as_bucket_view:
                # This rank's own range is already in the params: its pieces are views of them.
                lo, hi = plan.range_of(self._comm.rank)
                for slot in plan.slots:
                    flat = self._params[slot.index].data.view(-1)
                    start, stop = slot.offset, slot.offset + slot.numel
                    for a, b in ((start, min(stop, lo)), (max(start, hi), stop)):
                        if a < b:
                            flat[a - start : b - start].copy_(buf[a:b])

    # -- DDP and the gradient path ------------------------------------------------------
    def bind_ddp(
        self,
        ddp: torch.nn.parallel.DistributedDataParallel,
        *,
        grad_reduce_default: str = "all_reduce",
        overlap_default: bool = False,
        syncs_every_backward: bool = False,
        grad_scaler: bool = True,
    ) -> None:
        """Tell the optimizer about the DDP wrapping its params. Call on every rank right
        after building DDP, before its first backward (the integrations do).

        Records the params DDP reduces (those trainable now; the others' grads are
        averaged by the optimizer). With ``grad_reduce="reduce_scatter"`` it registers the
        DDP comm hook that reduce-scatters the grads (falling back, with a logged reason,
        to DDP's all-reduce when DDP already has a comm hook or a different process
        group); with ``overlap_param_sync`` it hooks the wrapped module's forwards and
        makes the process group the overlapped sync runs on (same ranks and backend).
        ``grad_reduce_default`` / ``overlap_default`` resolve ``"auto"`` / ``None``;
        ``syncs_every_backward`` (gradient accumulation that syncs every micro-batch)
        keeps DDP's all-reduce, which such accumulation needs. ``grad_scaler=False``
        says nothing skips steps on inf/NaN grads (no fp16 ``GradScaler``): the reduce-scatter
        path then leaves out its per-backward agreement on non-finite grads (a pass over
        the owned grads, a scalar all-reduce and, on GPUs, a host sync). Idempotent.
        """
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(f"bind_ddp needs a torch.nn.parallel.DistributedDataParallel, got {type(ddp).__name__}")
        if grad_reduce_default not in GRAD_REDUCE[1:]:
            raise ValueError(f"grad_reduce_default must be one of {GRAD_REDUCE[1:]}, got {grad_reduce_default!r}")
        self.mark_ddp_reduced()
        overlap = self._overlap_choice if self._overlap_choice is not None else overlap_default
        if overlap and self._comm.world_size > 1:
            if self.parameters_as_bucket_view:
                self._overlap = self._overlap or ParamSyncOverlap()
                self._overlap.attach(ddp.module)
                self._comm.own_sync_group()  # [Note: a group for the overlapped sync]
            else:
                logger.warning("hf_zero: overlap_param_sync needs parameters_as_bucket_view=True; syncing in the step")
        if self.grad_reduce == "auto":
            self.grad_reduce = grad_reduce_default
        if self.grad_reduce == "reduce_scatter" and self._reducer is None and self._comm.world_size > 1:
            reason = None
            if syncs_every_backward:
                reason = "gradient accumulation syncs every micro-batch (sync_each_batch), which needs full grads"
            elif not self._comm.same_group(ddp.process_group):
                reason = "DistributedDataParallel runs over another process group than this optimizer"
            else:
                attached = _scatter_hook.attach(ddp, self)
                if isinstance(attached, str):
                    reason = attached
                else:
                    self._reducer = attached
            if reason is not None:
                logger.warning("hf_zero: grad_reduce='reduce_scatter' is off, DDP all-reduces the grads: %s", reason)
                self.grad_reduce = "all_reduce"
        if self._reducer is not None:
            self._reducer.agree_on_finite = grad_scaler

    @property
    def layout(self) -> Layout | None:
        """The current layout (buffers and each rank's ranges); None before the first step."""
        return self._layout

    @property
    def comm(self) -> Comm:
        """The process group wrapper this optimizer communicates through."""
        return self._comm

    def param_index(self, param: torch.Tensor) -> int | None:
        """``param``'s index in :attr:`params`, or None when it is not one of them."""
        return self._index_of.get(id(param))

    def plan_with_ddp_buckets(self, buckets: tuple[tuple[int, ...], ...]) -> None:
        """Lay the buffers out after these DDP buckets (param indices, in bucket order)
        from the next re-partition on (the next step notices). Same on every rank."""
        self._ddp_buckets = tuple(tuple(b) for b in buckets)

    def ddp_buckets_planned(self) -> tuple[tuple[int, ...], ...] | None:
        """The DDP buckets the current layout follows (None before the first step)."""
        return None if self._layout is None else self._layout.buckets

    def bucket_bounds(self, composition: tuple[int, ...]) -> tuple[int, ...] | None:
        """Rank bounds of the buffer mirroring the DDP bucket of these params, or None."""
        if self._layout is None or self.grad_reduce != "reduce_scatter":
            return None
        for k, bucket in enumerate(self._layout.buckets):
            if bucket == composition:
                b = self._layout.bucket_buffer(k)
                return None if b is None else self._layout.buffers[b].bounds
        return None

    @property
    def overlaps_param_sync(self) -> bool:
        """Whether the parameter sync after a step runs while the next forward starts."""
        return self._overlap is not None

    def wait_param_sync(self) -> None:
        """Wait for an overlapped parameter sync still in flight (a no-op otherwise), so
        every param is complete. Not a collective: each rank waits for its own."""
        if self._overlap is not None:
            self._overlap.drain()

    def _selected(self, parameters, what: str) -> set[int]:
        """Indices of the trainable params among ``parameters`` (None: all of them)."""
        if parameters is None:
            return {i for i, p in enumerate(self._params) if p.requires_grad}
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        chosen = set()
        for p in parameters:
            i = self.param_index(p)
            if i is None:
                raise ValueError(f"{what}: a param of shape {tuple(p.shape)} is not one of this optimizer's params")
            if p.requires_grad:
                chosen.add(i)
        return chosen

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, *, parameters=None
    ) -> torch.Tensor:
        """Clip grads like ``torch.nn.utils.clip_grad_norm_(parameters, ...)``; returns the
        total norm (before clipping). Collective: every rank passes the same params.

        ``parameters``: some of this optimizer's params (default: all); frozen ones are
        left out, as they have no grad in a training step. Each rank sums its own
        elements only (valid whether the grads were all-reduced or reduce-scattered)
        and one scalar all-reduce makes the total; grads DDP does not reduce are
        averaged first. No agreement check: the step makes it.
        """
        norm_type = float(norm_type)
        chosen = self._selected(parameters, "clip_grad_norm_")
        if not self._iteration.grads_averaged:
            self.average_unreduced_grads()
        pieces = self._norm_pieces()
        grads = [
            self._params[pc.index].grad.reshape(-1)[pc.start : pc.stop]
            for pc in pieces
            if pc.index in chosen and self._params[pc.index].grad is not None
        ]
        first = next((self._params[i].grad for i in sorted(chosen) if self._params[i].grad is not None), None)
        dtype = first.dtype if first is not None else torch.float32
        device = self._comm.device
        if norm_type == float("inf"):
            local = max((torch.linalg.vector_norm(g, norm_type).double().to(device) for g in grads if g.numel()), default=None)
            total = torch.zeros((), dtype=torch.float64, device=device) if local is None else local.clone()
            total = self._comm.all_reduce_(total, op="max", what="the gradient norm")
        else:
            total = torch.zeros((), dtype=torch.float64, device=device)
            for g in grads:
                total += _pow_sum(g, norm_type).to(device)
            total = self._comm.all_reduce_(total, op="sum", what="the gradient norm").pow(1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be clipped. "
                "To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`"
            )
        total = total.to(dtype=dtype)
        if max_norm != float("inf"):
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for g in self._valid_grads(chosen, pieces):
                g.mul_(coef.to(device=g.device, dtype=g.dtype))
        return total.to(first.device) if first is not None else total

    def _valid_grads(self, chosen: set[int], pieces: list[Piece] | None = None) -> list[torch.Tensor]:
        """The grads of these params where they hold the average: whole, or only this
        rank's ranges after a reduce-scatter (scaling the rest, which only holds this
        rank's own contribution, would be a wasted pass over (N-1)/N of it).
        ``pieces``: :meth:`_norm_pieces` when the caller has them already."""
        partial = self._reducer.partial_grads if self._reducer is not None else set()
        owned: dict[int, list[Piece]] = {}
        if partial & chosen:
            for pc in pieces if pieces is not None else self._norm_pieces():
                owned.setdefault(pc.index, []).append(pc)
        out = []
        for i in sorted(chosen):
            g = self._params[i].grad
            if g is None:
                continue
            if i in partial and g.is_contiguous():
                out += [g.view(-1)[pc.start : pc.stop] for pc in owned.get(i, ())]
            else:
                out.append(g)
        return out

    def _norm_pieces(self) -> list[Piece]:
        """The elements this rank counts in a sharded norm: its pieces, planned afresh
        (no collective: every rank has the same trainable set) when trainability changed
        since the last step. The DDP buckets stay those of the current layout, whose
        ranges the grads were reduce-scattered into; other grads are whole on every rank."""
        mask = tuple(p.requires_grad for p in self._params)
        if self._layout is not None and mask == self._mask:
            return [lp.piece for lp in self._pieces]
        buckets = self._layout.buckets if self._layout is not None else ()
        layout = plan_layout(self._specs(), world_size=self._comm.world_size, shard=self.shard, buckets=buckets)
        return layout.pieces(self._comm.rank)

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float, *, parameters=None) -> None:
        """Clamp grads to ``[-clip_value, clip_value]`` like
        ``torch.nn.utils.clip_grad_value_(parameters, ...)`` (default: all params), after
        averaging the grads DDP does not reduce. Collective."""
        chosen = self._selected(parameters, "clip_grad_value_")
        if not self._iteration.grads_averaged:
            self.average_unreduced_grads()
        for g in self._valid_grads(chosen):
            g.clamp_(-clip_value, clip_value)

    # -- Join ------------------------------------------------------------------------
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """For :class:`~torch.distributed.algorithms.join.Join`: a rank out of inputs keeps
        taking steps (with the grads it holds, as torch's ZeroRedundancyOptimizer does)."""
        return _JoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._comm.device

    @property
    def join_process_group(self) -> Any:
        return self._comm.process_group

    # -- rebuild -------------------------------------------------------------------
    def _holdings(self) -> Holdings:
        """All state this rank holds: its active pieces' and parked (frozen / not yet placed)."""
        held: Holdings = {i: list(hs) for i, hs in self._parked.items()}
        if self._inner is not None:
            for lp in self._pieces:
                st = self._inner.state.get(lp.tensor)
                if st:
                    pc = lp.piece
                    held.setdefault(pc.index, []).append(Holding(pc.start, pc.stop, tuple(lp.tensor.shape), dict(st)))
        for hs in held.values():
            hs.sort(key=lambda h: h.start)
        return held

    def _rebuild(self, mask: tuple[bool, ...]) -> None:
        for i, p in enumerate(self._params):
            if p.requires_grad and p.device.type == "meta":
                raise ValueError(
                    f"param {self.param_label(i)} is on the meta device at step time: materialize the "
                    "model (e.g. model.to_empty(device=...) and load weights) before stepping"
                )
        layout = plan_layout(
            self._specs(), world_size=self._comm.world_size, shard=self.shard, buckets=self._ddp_buckets
        )
        held = self._holdings()
        trainable = {i for i, m in enumerate(mask) if m}
        if layout == self._layout and not any(i in trainable for i in self._parked):
            new_held = {i: hs for i, hs in held.items() if i in trainable}
        else:
            targets: dict[int, list[tuple[int, int, int]]] = {}
            for r, pcs in enumerate(layout.all_pieces()):
                for pc in pcs:
                    targets.setdefault(pc.index, []).append((r, pc.start, pc.stop))
            new_held = redistribute(
                self._comm,
                held,
                targets,
                numels={i: p.numel() for i, p in enumerate(self._params)},
                device_of=lambda i: self._params[i].device,
                names=self.param_label,
                piece_shape=self._piece_shape,
            )
        self._parked = {i: hs for i, hs in held.items() if i not in trainable}
        self._build_buffers(layout)
        self._build_inner(layout.pieces(self._comm.rank), new_held)
        self._layout = layout
        self._mask = mask
        if self._ddp_reduced is None:
            self.mark_ddp_reduced()
        self.rebuilds += 1

    def _piece_shape(self, i: int, start: int, stop: int) -> tuple[int, ...]:
        """The shape the local optimizer steps elements ``start:stop`` of param ``i`` as."""
        return tuple(self._params[i].shape) if self.shard == "param" else (stop - start,)

    def _build_buffers(self, layout: Layout) -> None:
        if self.parameters_as_bucket_view:
            for p in self._params:
                if not p.requires_grad and p.data_ptr() in self._ptrs.values():
                    p.data = p.data.clone()
        self._buffers, self._ptrs = [], {}
        for plan in layout.buffers:
            buf = torch.zeros(plan.size, dtype=plan.dtype, device=torch.device(plan.device))
            for slot in plan.slots:
                p = self._params[slot.index]
                view = buf[slot.offset : slot.offset + slot.numel]
                view.copy_(p.data.reshape(-1))
                if self.parameters_as_bucket_view:
                    p.data = view.view(p.shape)
                elif not p.data.is_contiguous():
                    p.data = p.data.contiguous()
                self._ptrs[slot.index] = p.data_ptr()
            self._buffers.append(buf)

    def _build_inner(self, pieces: list[Piece], held: Holdings) -> None:
        """The local optimizer: one group per param group (empty where this rank owns
        nothing of it, so every rank's local optimizer sees the same hyperparameters)."""
        by_group: list[list[torch.Tensor]] = [[] for _ in self.param_groups]
        self._pieces = []
        for pc in pieces:
            p = self._params[pc.index]
            t = p.data.view(-1)[pc.start : pc.stop]
            if self.shard == "param":
                t = t.view(p.shape)
            self._pieces.append(_LocalPiece(t, p, pc))
            by_group[self._group_of[pc.index]].append(t)
        groups = [
            {**{k: v for k, v in group.items() if k not in _NOT_HYPER}, "params": params}
            for group, params in zip(self.param_groups, by_group)
        ]
        self._inner = self.optimizer_class(groups)
        for lp in self._pieces:
            for h in held.get(lp.piece.index, ()):
                if h.start == lp.piece.start and h.stop == lp.piece.stop:
                    self._inner.state[lp.tensor] = {
                        k: v.to(lp.tensor.device) if kind_of(v, lp.tensor.shape) in (Kind.ELEMENTWISE, Kind.BLOB) else v
                        for k, v in shape_as(h, lp.tensor.shape).items()
                    }

    def release_views(self) -> None:
        """Give every param that shares its storage with another its own storage, for
        savers that reject shared storage. The next step rebuilds the buffers from the
        params' current values on every rank (no optimizer state moves)."""
        self.wait_param_sync()
        shared: dict[int, int] = {}
        for p in self._params:
            key = p.untyped_storage().data_ptr()
            shared[key] = shared.get(key, 0) + 1
        for p in self._params:
            if shared[p.untyped_storage().data_ptr()] > 1:
                p.data = p.data.clone()

    def stats(self) -> dict[str, Any]:
        """Per-rank trainable elements owned and optimizer-state bytes held, and the
        rebuild count. Collective (one small object exchange)."""
        elements = sum(lp.piece.numel for lp in self._pieces)
        state_bytes = sum(
            v.numel() * v.element_size()
            for hs in self._holdings().values()
            for h in hs
            for v in h.state.values()
            if isinstance(v, torch.Tensor)
        )
        per_rank = self._comm.all_gather_object((elements, state_bytes))
        return {
            "rebuilds": self.rebuilds,
            "elements_per_rank": [e for e, _ in per_rank],
            "state_bytes_per_rank": [b for _, b in per_rank],
        }

    # -- state dict ------------------------------------------------------------------
    def consolidate_state_dict(self, to: int = 0, *, device: str | torch.device | None = None) -> None:
        """Gather the full optimizer state on rank ``to`` for :meth:`state_dict`. Collective.

        State moves with tensor collectives, a bounded round at a time: rank ``to``
        needs about the full state once (plus one round), the others about their
        own shard. ``device="cpu"`` gathers into CPU memory (default: each param's
        device). State rank ``to`` already holds whole is not copied: like
        ``torch.optim.Optimizer.state_dict()``, the result shares those tensors with
        the live state, so save or copy it before the next step.
        """
        if not 0 <= to < self._comm.world_size:
            raise ValueError(f"to must be a rank in [0, {self._comm.world_size}), got {to}")
        self._check_pending()
        self._check_agreement()
        target = None if device is None else torch.device(device)
        numels = {i: p.numel() for i, p in enumerate(self._params)}
        got = redistribute(
            self._comm,
            self._holdings(),
            lambda indices: {i: [(to, 0, numels[i])] for i in indices},
            numels=numels,
            device_of=lambda i: target or self._params[i].device,
            names=self.param_label,
            piece_shape=lambda i, start, stop: tuple(self._params[i].shape),
            reuse_own=True,  # see [Note: reused holdings]
        )
        if self._comm.rank == to:
            self._consolidated = {i: shape_as(hs[0], self._params[i].shape) for i, hs in sorted(got.items())}
        else:
            self._consolidated = None

    def state_dict(self) -> dict:
        """A dict a plain ``optimizer_class`` over the same params would return.

        Never a collective. On one rank, or before any state exists, it is complete.
        On several ranks call :meth:`consolidate_state_dict` (on all ranks) after the
        last step and read this on the rank it gathered to. Otherwise ``"state"`` is
        a ``ShardedState`` handle: reading, pickling or saving it raises an error
        naming that fix, and only this optimizer's :meth:`load_state_dict` accepts it,
        keeping the state each rank holds (so Accelerate's ``state_dict()`` /
        ``load_state_dict()`` round trip in ``AcceleratedOptimizer.__init__`` works at
        any point of training). After :meth:`refer_to_sharded`, until the state
        changes, it is a small reference to that sharded checkpoint instead.
        """
        ref = self._pending_ref
        if ref is None and self._sharded_ref is not None and self._consolidated is None:
            token, info = self._sharded_ref
            ref = info if token is self._state_token else None
        if ref is not None:
            return _sharded.reference(ref)
        sharded = None
        if self._consolidated is None:
            if self._comm.world_size == 1:
                self.consolidate_state_dict(0)
            elif self._has_state:
                sharded = ShardedState(self._state_token, self._comm.world_size)
        state = sharded if sharded is not None else dict(self._consolidated or {})
        return {"state": state, "param_groups": self._packed_groups(encode_values=False)}

    def _packed_groups(self, encode_values: bool) -> list[dict]:
        index, groups = 0, []
        for gi, g in enumerate(self.param_groups):
            packed = {
                k: encode(v, f"param group {gi} {k!r}") if encode_values else v
                for k, v in g.items()
                if k != "params"
            }
            packed["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(packed)
        return groups

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full (PyTorch-format) state dict; each rank keeps what it owns.

        Works on any world size and shard mode; every rank must pass the same dict
        (it may live on the CPU: only this rank's pieces are copied to the device).
        A dict of another model (group sizes, ``param_names``, state shapes) or
        another optimizer class raises ``ValueError`` listing the mismatches, and
        nothing changes. Not a collective. A reference to a sharded checkpoint is
        kept pending until loaded (:meth:`load_pending_sharded`); stepping before raises.
        """
        if _sharded.is_reference(state_dict):
            ref = _sharded.reference_info(state_dict)
            current = self._sharded_ref
            held_now = current is not None and current[0] is self._state_token and current[1]["token"] == ref["token"]
            self._pending_ref = None if held_now else ref
            return
        if isinstance(state_dict, dict) and isinstance(state_dict.get("state"), ShardedState):
            problems = group_problems(self, [len(g["params"]) for g in state_dict.get("param_groups", [])])
            if problems:
                raise mismatch_error("the loaded state dict", problems)
            if state_dict["state"].token is not self._state_token:
                raise ValueError(
                    "hf_zero: this state dict holds unconsolidated sharded state of another optimizer, or of "
                    "this one before its state changed, and cannot be loaded: consolidate_state_dict() first"
                )
            self._adopt_loaded(hyperparams(state_dict["param_groups"]), None)
            return
        by_index = check_state_dict(self, state_dict)

        def read(i, start, stop, piece_shape):
            if i not in by_index:
                return None
            return split_canonical(by_index[i], self._params[i].shape, start, stop, piece_shape, self.param_label(i))

        self._adopt_loaded(hyperparams(state_dict["param_groups"]), self._place(read), has_state=bool(by_index))

    def _place(self, read: Callable[[int, int, int, tuple], dict | None]) -> Holdings:
        """This rank's holdings after a load, ``read(i, start, stop, piece_shape)`` giving
        the state of each: its pieces of the layout the next step builds, plus the whole
        state of params outside the layout (frozen), parked on rank ``i % world size``."""
        rank, ws = self._comm.rank, self._comm.world_size
        layout = plan_layout(self._specs(), world_size=ws, shard=self.shard)
        targets = [(pc.index, pc.start, pc.stop, self._piece_shape(pc.index, pc.start, pc.stop))
                   for pc in layout.pieces(rank)]
        slotted = layout.slots()
        targets += [(i, 0, p.numel(), tuple(p.shape)) for i, p in enumerate(self._params)
                    if i not in slotted and i % ws == rank]
        held: Holdings = {}
        for i, start, stop, shape in targets:
            st = read(i, start, stop, shape)
            if st is not None:
                held.setdefault(i, []).append(Holding(start, stop, shape, self._cast(st, i)))
        return held

    def _cast(self, state: dict, i: int) -> dict:
        """Copy loaded values to param ``i``'s device and dtype, as torch's load_state_dict does."""
        p, group = self._params[i], self.param_groups[self._group_of[i]]
        out = {}
        for k, v in state.items():
            if not isinstance(v, torch.Tensor):
                out[k] = v
            elif k == "step":
                if group.get("capturable") or group.get("fused"):
                    out[k] = v.to(dtype=torch.float32, device=p.device, copy=True)
                else:
                    out[k] = v.clone()
            elif p.is_floating_point():
                out[k] = v.to(dtype=p.dtype, device=p.device, copy=True)
            else:
                out[k] = v.to(device=p.device, copy=True)
        return out

    def _adopt_loaded(self, hyper: list[dict], held: Holdings | None, has_state: bool = False) -> None:
        """Take loaded hyperparameters and this rank's loaded state (None: keep the current state)."""
        for mine, hp in zip(self.param_groups, hyper):
            mine.update(hp)
        self._pending_ref = None
        # Every rank loads, and at the next step every rank rebuilds through
        # redistribute: whether it has to must not depend on what this rank holds.
        self._layout = None
        if held is None:
            return
        self._parked = held
        self._inner, self._pieces = None, []
        self._mask = None
        self._has_state = has_state
        self._consolidated = None
        self._state_token = object()

    # -- sharded checkpoints -----------------------------------------------------------
    def save_sharded(self, path: str | os.PathLike) -> None:
        """Write a sharded checkpoint to directory ``path`` (its own; all ranks must see it),
        each rank its own state, with no gather. Collective.

        Atomic: until it returns the directory keeps its previous checkpoint. See
        :mod:`hf_zero._sharded` for the format and ``hf-zero consolidate`` / ``inspect``.
        """
        self._check_agreement()
        self._check_pending()
        names = self._param_names
        unique = len(set(names)) == len(names)
        labels = [n if n is not None and unique else f"#{i}" if n is None else f"{n}#{i}" for i, n in enumerate(names)]
        record = {
            "optimizer_class": class_name(self.optimizer_class),
            "shard": self.shard,
            "world_size": self._comm.world_size,
            "parameters_as_bucket_view": self.parameters_as_bucket_view,
            "torch_version": torch.__version__,
            "params": [
                {
                    "name": names[i],
                    "shape": list(p.shape),
                    "dtype": str(p.dtype).removeprefix("torch."),
                    "group": self._group_of[i],
                    "trainable": bool(p.requires_grad),
                }
                for i, p in enumerate(self._params)
            ],
            "param_groups": self._packed_groups(encode_values=True),
        }
        _sharded.write(self._comm, path, self._holdings(), labels, record)

    def load_sharded(self, path: str | os.PathLike) -> None:
        """Load a sharded checkpoint written on any world size and shard mode. Collective.

        Each rank reads only the ranges it will own. A checkpoint of another model or
        optimizer class raises ``ValueError`` listing the mismatches; nothing changes.
        """
        self._check_agreement()
        failure: BaseException | None = None
        try:
            with _sharded.Checkpoint(path) as ckpt:
                mapping = match_checkpoint(self, ckpt)
                groups = [{k: decode(v) for k, v in g.items() if k != "params"} for g in ckpt.record["param_groups"]]
                held = self._place(lambda i, start, stop, shape: ckpt.read(mapping[i], start, stop, shape))
                has_state = ckpt.has_state()
        except Exception as e:  # every rank must reach the exchange below
            failure = e
        report = None if failure is None else f"rank {self._comm.rank}: {type(failure).__name__}: {failure}"
        reports = [r for r in self._comm.all_gather_object(report) if r]
        if failure is not None:
            raise failure
        if reports:
            raise RuntimeError("hf_zero: load_sharded failed on another rank, nothing was loaded:\n  " + "\n  ".join(reports))
        self._adopt_loaded(groups, held, has_state=has_state)

    def load_sharded_if_present(self, path: str | os.PathLike) -> bool:
        """Load the sharded checkpoint in ``path`` if there is one (then refer to it, see
        :meth:`refer_to_sharded`); return whether one was loaded. Collective: raises on
        every rank when ranks see different checkpoints there."""
        tokens = self._comm.all_gather_object(_sharded.token_at(path))
        if len(set(tokens)) > 1:
            raise RuntimeError(
                f"hf_zero: ranks see different sharded optimizer checkpoints in {os.fspath(path)!r} (commit tokens "
                f"per rank: {tokens}); all ranks must see the same directory"
            )
        if tokens[0] is None:
            return False
        self.load_sharded(path)
        self.refer_to_sharded(path)
        return True

    def refer_to_sharded(self, path: str | os.PathLike, **info: Any) -> None:
        """Until the state changes, make :meth:`state_dict` a small reference to the sharded
        checkpoint in ``path``, which must hold this optimizer's current state (just saved
        or loaded there); ``info``: extra JSON-able facts to record. Not a collective.
        See [Note: sharded reference] in :mod:`hf_zero._sharded`."""
        token = _sharded.token_at(path)
        if token is None:
            raise ValueError(f"hf_zero: {os.fspath(path)!r} holds no committed sharded optimizer checkpoint")
        self._sharded_ref = (self._state_token, {"path": os.path.abspath(path), "token": token, **info})

    def load_pending_sharded(self, candidates: list[str]) -> str | None:
        """Load the sharded checkpoint a loaded reference points to, from the first of
        ``candidates`` (directories), then the path recorded at save time, that holds
        it; return that directory (None when nothing is pending). Collective; raises,
        on every rank, naming the directories looked in when no rank-wide agreed one
        holds it."""
        ref = self._pending_ref
        if self._comm.world_size == 1 and ref is None:
            return None
        looked = list(dict.fromkeys([os.path.abspath(c) for c in candidates] + ([ref["path"]] if ref else [])))
        found = None if ref is None else next((c for c in looked if _sharded.token_at(c) == ref["token"]), None)
        everyone = self._comm.all_gather_object((ref is not None, found))
        if not any(pending for pending, _ in everyone):
            return None
        if any(f is None for _, f in everyone) or len({f for _, f in everyone}) > 1:
            per_rank = "; ".join(f"rank {r}: {f or 'none'}" for r, (_, f) in enumerate(everyone))
            raise RuntimeError(
                f"hf_zero: cannot find the sharded optimizer checkpoint the loaded state dict refers to "
                f"(token {ref['token'] if ref else '?'}, saved in {ref['path'] if ref else '?'!r}); looked in "
                f"{looked} (found: {per_rank}). Every rank must see that directory; load it with "
                "optimizer.load_sharded(DIR) on all ranks."
            )
        self.load_sharded(found)
        return found

    def _check_pending(self) -> None:
        """Raise if a loaded reference was never resolved: its state would be lost silently."""
        ref = self._pending_ref
        if ref is not None:
            raise RuntimeError(
                f"hf_zero: load_state_dict() was given a reference to the sharded optimizer checkpoint saved in "
                f"{ref['path']!r} (token {ref['token']}), which was not loaded yet: call "
                "optimizer.load_sharded(DIR) on all ranks with that checkpoint's directory first "
                "(ZeroBucketCallback and prepare_accelerator do it when resuming)"
            )
