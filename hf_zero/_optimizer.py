"""ZeroBucketOptimizer: ZeRO stage-1 with parameters as views into flat buffers.

A facade (docs/architecture.md, "Collaborators"): the param table (``_params.py``), the
partition this rank holds (``_partition.py``) and the state lifecycle (``_lifecycle.py``)
own the decisions; this module validates, orchestrates the step and keeps torch's
``Optimizer`` / ``Joinable`` contract.
"""

from __future__ import annotations

import logging
import os
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from . import _clip, _lifecycle, _sharded, _stage2
from ._comm import Comm
from ._grads import average_grads
from ._layout import Layout, is_elementwise, plan_layout
from ._ledger import CATEGORIES, MemoryLedger, Peaks, storage_bytes
from ._lifecycle import StateLifecycle
from ._gradpath import GRAD_REDUCE, GradientPath, changed_since_backward
from ._masters import check_choice
from ._params import LayoutCheck, ParamTable, check_params
from ._partition import Partition, all_holdings, rebuild
from ._state import Holdings
from ._statedict import STATE_DICT_PARAMS


logger = logging.getLogger(__name__)


def _checked_options(optimizer_class, overlap_with_ddp: bool, shard: str, grad_reduce: str, stage: int = 1,
                     grad_accum_dtype: str = "auto", state_dict_params: str = "all") -> tuple[str, torch.dtype | None]:
    """Validate the constructor's options before anything changes; returns the resolved shard mode and
    stage 2's accumulation dtype (``_stage2.accumulate_dtype``)."""
    if state_dict_params not in STATE_DICT_PARAMS:
        raise ValueError(f"state_dict_params must be one of {STATE_DICT_PARAMS}, got {state_dict_params!r}")
    if stage not in (1, 2) or isinstance(stage, bool):
        raise ValueError(f"stage must be 1 (optimizer state sharded) or 2 (and gradients), got {stage!r}")
    if stage == 2 and grad_reduce == "all_reduce":
        raise ValueError("stage=2 reduce-scatters gradients into their owners: grad_reduce='all_reduce' contradicts it")
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
            f"optimizers; {optimizer_class.__name__} is not known to be one (a subclass is not its base: it "
            f"may add a per-tensor rule): use shard='param', or declare it in the class body with "
            f"hf_zero_elementwise = True if updating any slice of a param alone equals updating the whole"
        )
    if grad_reduce not in GRAD_REDUCE:
        raise ValueError(f"grad_reduce must be one of {GRAD_REDUCE}, got {grad_reduce!r}")
    accumulate = _stage2.accumulate_dtype(grad_accum_dtype, stage)
    if shard == "auto":
        shard = "flat" if is_elementwise(optimizer_class) else "param"
    return shard, accumulate


def _init_param_groups(optimizer: torch.optim.Optimizer, params: Iterable, optimizer_class, defaults: dict) -> dict:
    """torch's ``Optimizer.__init__`` over ``params`` (a duplicate param, which torch only warns of, is an
    error), the params checked; returns the resolved defaults."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # torch only warns on duplicates
        try:
            torch.optim.Optimizer.__init__(optimizer, params, {})
        except UserWarning as w:
            raise ValueError(f"params: {w}") from None
    check_params(optimizer.param_groups)
    return _resolved_defaults(optimizer_class, optimizer.param_groups, defaults)


def _resolved_defaults(optimizer_class, param_groups: list[dict], defaults: dict) -> dict:
    """``optimizer_class``'s defaults with ``defaults`` applied (it validates them), set in every group."""
    first = next(g["params"][0] for g in param_groups if g["params"])  # check_params: one group holds a param
    resolved = dict(optimizer_class([torch.zeros(1, dtype=first.dtype, device=first.device)], **defaults).defaults)
    for group in param_groups:
        for k, v in resolved.items():
            group.setdefault(k, v)
    return resolved


@dataclass
class _Iteration:
    """What happened since the last step (or ``zero_grad``): reset by both."""

    grads_averaged: bool = False


class _JoinHook(JoinHook):
    """Shadows the step's collectives on a rank that ran out of inputs (as torch's ZeRO does)."""

    def __init__(self, optimizer: "ZeroBucketOptimizer"):
        if optimizer.gradient_path.stage == 2:
            raise _no_join_under_stage2()
        self.optimizer = optimizer

    def main_hook(self) -> None:
        self.optimizer.step()


class _Joins(Joinable):
    """The optimizer's side of :class:`~torch.distributed.algorithms.join.Join` (uneven inputs)."""

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """For :class:`~torch.distributed.algorithms.join.Join`: a rank out of inputs keeps taking steps (with its
        grads, as torch's ZeroRedundancyOptimizer does). Stage 2 raises ``ValueError`` ([Note: no Join under stage 2])."""
        return _JoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._comm.device

    @property
    def join_process_group(self) -> Any:
        return self._comm.process_group


def _no_join_under_stage2() -> ValueError:
    """[Note: no Join under stage 2] A joined rank would have to shadow what the others run between
    two of its steps: the buffer broadcast before each forward, every bucket's reduce-scatter in each
    backward (how many micro-batches, it cannot know), clipping's all-reduce if they clip, the "had a
    grad" agreement and the step. And Join's own all-reduce comes first in the joined rank's iteration
    but only at the step in the others' (stage 2 has no DDP to notify Join at the forward): mismatched
    collectives, a hang. ``Join.__init__`` calls ``join_hook`` on every rank before anything else, so
    refusing there is safe."""
    return ValueError(
        "hf_zero: stage=2 does not support torch.distributed.algorithms.join.Join (uneven inputs): "
        "a rank out of inputs cannot shadow the other ranks' per-backward gradient reduce-scatters. "
        "Use stage=1 (wrap the model in DistributedDataParallel and use Join([ddp_model, optimizer])), "
        "or give every rank the same number of batches (a DistributedSampler does)"
    )


class ZeroBucketOptimizer(torch.optim.Optimizer, _Joins):
    """ZeRO stage-1: each rank keeps optimizer state only for the elements it owns.

    A drop-in for :class:`torch.distributed.optim.ZeroRedundancyOptimizer` (constructor,
    ``step(closure, **kwargs)``, :class:`~torch.distributed.algorithms.join.Join`) that
    follows ``requires_grad`` changes, mixes dtypes and devices, and syncs parameters
    with a few whole-buffer collectives per step.

    Args:
        params: tensors, ``(name, tensor)`` pairs or param groups. Include frozen params: only those listed can be trained later.
        optimizer_class: the local optimizer, e.g. ``torch.optim.AdamW``.
        process_group: the group to shard over (default: the world; 1 without torch.distributed).
        parameters_as_bucket_view: trainable params are views into flat buffers the sync moves whole (default ``True``).
        overlap_with_ddp: accepted for torch compatibility; only ``False`` is supported.
        shard: ``"flat"`` (equal ranges; elementwise optimizers: torch's exact classes, or one whose body
            says ``hf_zero_elementwise = True``), ``"param"`` (whole params; any) or ``"auto"`` (flat if so).
        grad_reduce: ``"all_reduce"`` (DDP's own) or ``"reduce_scatter"`` (after :meth:`bind_ddp`, grads go to
            their owners: DDP's bytes; clip with :meth:`clip_grad_norm_`). ``"auto"`` (default): the integration's.
        overlap_param_sync: sync params asynchronously after a step; the bound model's forwards wait for it
            (else call :meth:`wait_param_sync`). ``None``: the integration's choice (off by default).
        master_weights: ``"auto"`` (default) or ``True``: bf16/fp16 params step through
            sharded fp32 masters, saved as state ``"master_param"``; ``False``: pure
            16-bit steps. fp16 params use a ``GradScaler`` under stage 2 only, with ``grad_accum_dtype="fp32"``
            (docs/precision.md).
        stage: ``2`` shards grads too (no DDP: :meth:`bind_module`, docs/stage2.md); default ``1``.
        grad_accum_dtype: stage 2's grad shards of 16-bit params: in their dtype (``"param"``, and ``"auto"``, the default)
            or in float32 (``"fp32"``: 2/N bytes per param more; docs/stage2.md).
        state_dict_params: ``"all"`` (default) or ``"trainable"``: state dicts list only params that require grad.
        **defaults: hyperparameters for ``optimizer_class``.

    Buffers are built at the first :meth:`step` and checked at every step. Every method that says *collective*
    must be called on all ranks.
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
        master_weights: bool | str = "auto",
        stage: int = 1, grad_accum_dtype: str = "auto", state_dict_params: str = "all",
        **defaults: Any,
    ):
        masters = check_choice(master_weights)
        shard, accumulate = _checked_options(optimizer_class, overlap_with_ddp, shard, grad_reduce, stage, grad_accum_dtype,
                                             state_dict_params)
        self._ready = False
        self.defaults = _init_param_groups(self, params, optimizer_class, defaults)
        Joinable.__init__(self)

        self.optimizer_class = optimizer_class
        self.shard = shard
        self.parameters_as_bucket_view = bool(parameters_as_bucket_view)
        self.master_weights = masters
        self.state_dict_params = state_dict_params
        self.rebuilds = 0
        self._comm = Comm(process_group)
        self._table = ParamTable(self.param_groups)
        self._partition: Partition | None = None
        self._reload_due = False  # a load happened: the next step rebuilds on every rank
        self._lifecycle = StateLifecycle()
        self._check = LayoutCheck()  # [Note: the layout check]
        self._iteration = _Iteration()
        self._peaks = Peaks(_memory_now)  # [Note: memory ledger]
        self._grad = GradientPath(self._comm, facts=self._gradient_facts, grad_reduce=grad_reduce, stage=stage,
                                  shard=shard, overlap_param_sync=overlap_param_sync, bucket_view=parameters_as_bucket_view,
                                  accumulate_dtype=accumulate, check=self._check_at_backward,
                                  carry=self._check_at_hook)
        weakref.finalize(self, _collected, self._grad.binding, self._comm).atexit = False
        self._ready = True

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if getattr(self, "_ready", False):
            for k, v in self.defaults.items():
                self.param_groups[-1].setdefault(k, v)
            self._table = ParamTable(self.param_groups)

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        """Every param, in param-group order (the order ``state_dict`` numbers them)."""
        return self._table.params

    @property
    def param_names(self) -> tuple[str | None, ...]:
        """Each param's name from the groups' ``param_names`` (None where not given)."""
        return self._table.names

    def param_label(self, i: int) -> str:
        """How errors name param ``i``: its name (or ``#i``), group and shape."""
        return self._table.label(i)

    def group_of(self, i: int) -> int:
        """The index of the param group holding param ``i``."""
        return self._table.group_of[i]

    @property
    def rank(self) -> int:
        """This process's rank in the process group."""
        return self._comm.rank

    @property
    def world_size(self) -> int:
        """The number of ranks the state is sharded over."""
        return self._comm.world_size

    @property
    def gradient_path(self) -> GradientPath:
        """What the gradient path reaches (docs/architecture.md, "The gradient path's protocol")."""
        return self._grad

    def _live(self) -> Partition | None:
        """The partition the next step uses unchanged, or None when it must be rebuilt after a load."""
        return None if self._reload_due else self._partition

    def _gradient_facts(self) -> tuple[ParamTable, Layout | None]:
        return self._table, getattr(self._live(), "layout", None)

    def _check_at_backward(self, presence: torch.Tensor, uncertain: bool, buckets: tuple,
                           carried=None) -> bool | None:
        return _check_at_backward(self, presence, uncertain, buckets, carried)  # a method: the reducer holds it weakly

    def _check_at_hook(self, heard) -> bool:
        return _check_at_hook(self, heard)  # a method: the gradient path holds it weakly

    # -- step ----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any):
        """Update the params this rank owns, then sync every buffer. Collective.

        A callable ``closure`` runs once, before the update, on every rank, and its loss is returned; any
        other non-None ``closure`` goes with ``kwargs`` to the local optimizer's ``step`` (as torch's ZeRO does)."""
        Join.notify_join_context(self)
        loss = None
        if callable(closure):
            with torch.enable_grad():
                loss = closure()
        elif closure is not None:
            kwargs = {"closure": closure, **kwargs}
        checked = self._check.read_backwards(self._comm, self._table)  # [Note: the check at a backward]
        grads = self._grad.sharded_grads()  # checked before any collective: [Note: a forward without its backward]
        self._peaks.observe_step(self)  # the grads whole (or sharded), before the step frees them
        self.wait_param_sync()
        _partition_for_step(self, grads, checked)
        if self.overlaps_param_sync:
            self._check.before_overlapped_sync(self._comm)
        local_loss = _step_pieces(self, kwargs, grads)
        self._check.end_of_step(self._comm, self._table, synced=not self.overlaps_param_sync)
        self._iteration = _Iteration()
        self._grad.step_taken()
        self._lifecycle.stepped()
        self._peaks.observe_step(self)
        return loss if loss is not None else local_loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._iteration = _Iteration()
        self._grad.step_taken()

    def refresh_trainable(self) -> None:
        """Re-partition the current trainable set and move optimizer state. Collective."""
        self._ensure_partition(force=True)

    def ensure_partition(self) -> None:
        """Rebuild on every rank if any rank's trainability changed: one 48-byte all-reduce, read at once. Collective."""
        self._ensure_partition(force=False)

    def _ensure_partition(self, force: bool, blocking: bool = True, payload: torch.Tensor | None = None) -> None:
        """``blocking``: every rank reads the layout check now; else a steady step reads it late ([Note: the layout check])."""
        mask, _, intact, need = _layout_now(self, self._grad.wanted_buckets)
        everyone = self._check.begin(self._comm, self._table, mask, need=force or need, fresh=not intact,
                                     blocking=blocking, payload=payload)
        if everyone or not (intact or self._check.mirroring):  # or storage replaced, the same params: this rank re-views
            self.wait_param_sync()
            self._rebuild()

    def _rebuild(self) -> None:
        self._table.check_materialized()
        layout = plan_layout(self._table.specs(), world_size=self._comm.world_size, shard=self.shard,
                             buckets=self._grad.wanted_buckets)
        self._partition, parked = rebuild(
            self._partition, self._lifecycle.parked, self._table, layout, self._comm, moved=self._reload_due,
            optimizer_class=self.optimizer_class, param_groups=self.param_groups,
            bucket_view=self.parameters_as_bucket_view, masters=self.master_weights,
            runs=self._grad.ddp_bucket_view is not False,  # DDP's copies of the grads lie apart: [Note: runs]
        )
        self._lifecycle.park(parked)
        self._reload_due = False
        self._grad.mark_reduced(self._table.mask(), keep=True)
        self.rebuilds += 1

    def _holdings(self) -> Holdings:  # its pieces' state and the parked
        return all_holdings(self._lifecycle.parked, self._partition)

    # -- gradients DDP does not reduce (see docs/architecture.md, "Unreduced gradients")
    def mark_ddp_reduced(self) -> None:
        """Record that DDP reduces the params trainable now (call it right after building DDP; default: at the first step)."""
        self._grad.mark_reduced(self._table.mask())

    def unreduced_params(self) -> list[torch.Tensor]:
        """The params DDP never reduces (frozen when it was built): hf_zero averages their grads."""
        return self._grad.unreduced(self._table)

    def average_unreduced_grads(self) -> None:
        """Average over ranks the grads of trainable params DDP does not reduce. Collective.

        :meth:`step` does it unless done since the last step or ``zero_grad``; integrations
        call it after each syncing backward, so clipping and GradScaler see averaged grads."""
        if self._comm.world_size > 1:
            average_grads(self._comm, [p for p in self.unreduced_params() if p.requires_grad])
        self._iteration.grads_averaged = True

    # -- DDP and the gradient path ------------------------------------------------------
    def bind_ddp(self, ddp: torch.nn.parallel.DistributedDataParallel, *, grad_reduce_default: str = "all_reduce",
                 overlap_default: bool = False, syncs_every_backward: bool = False, grad_scaler: bool = True,
                 overlap_units: Iterable | None = None) -> None:
        """Tell the optimizer about the DDP wrapping its params: on every rank, right after building
        DDP, before its first backward (the integrations do). Idempotent. Records the params DDP
        reduces; registers the reduce-scatter comm hook and the overlap's forward hooks as chosen
        (docs/gradient_path.md). The defaults resolve ``"auto"`` / ``None``; ``syncs_every_backward``
        (accumulation syncing every micro-batch) keeps DDP's all-reduce; ``grad_scaler=False`` (nothing
        skips steps on inf/NaN grads) leaves out the per-backward non-finite agreement; ``overlap_units``
        (blocks: modules, classes or class names) wait only for their own params' sync."""
        self._grad.bind(ddp, grad_reduce_default=grad_reduce_default, overlap_default=overlap_default,
                        syncs_every_backward=syncs_every_backward, grad_scaler=grad_scaler, units=overlap_units)
        self.mark_ddp_reduced()

    def bind_module(self, module: torch.nn.Module, *, bucket_cap_mb: float = 25.0, broadcast_buffers: bool = True,
                    local_accumulation: bool = True):
        """Stage 2, no DDP: broadcast ``module``'s params and buffers from rank 0 (buffers after each syncing backward),
        reduce-scatter grads as the backward makes them, give it ``no_sync()`` (``local_accumulation=False``: one that
        does nothing: every backward reduces into the shards). Collective; see docs/stage2.md."""
        self._grad.bind_module(module, bucket_cap_mb=bucket_cap_mb, broadcast_buffers=broadcast_buffers,
                               local_accumulation=local_accumulation)

    def unbind(self) -> None:
        """Remove hf_zero's hooks and attributes from the model, give each param its own storage (buffers freed): as if never
        bound; bind again at will (the next step rebuilds). Not a collective; Trainer / Accelerate call it at the end."""
        self._grad.unbind()
        _own_storage(self)

    @property
    def grad_reduce(self) -> str:
        """``"auto"`` until :meth:`bind_ddp` resolves it, then ``"all_reduce"`` or ``"reduce_scatter"``."""
        return self._grad.grad_reduce

    @property
    def overlaps_param_sync(self) -> bool:
        """Whether the parameter sync after a step runs while the next forward starts."""
        return self._grad.overlap is not None

    def wait_param_sync(self) -> None:
        """Wait for an overlapped parameter sync in flight (else a no-op): every param is then complete. Not a collective."""
        self._grad.wait()

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, *, parameters=None
    ) -> torch.Tensor:
        """Clip grads like ``torch.nn.utils.clip_grad_norm_(parameters, ...)`` (default: all
        params; frozen ones have no grad); returns the total norm before clipping. Collective:
        every rank passes the same params, sums its own elements, one scalar all-reduce."""
        chosen, pieces, partial, sharded = _clip_args(self, parameters, "clip_grad_norm_")
        return _clip.clip_norm(self._comm, self._table, chosen, pieces, partial, max_norm=max_norm, grad_of=sharded,
                               norm_type=float(norm_type), error_if_nonfinite=error_if_nonfinite)

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float, *, parameters=None) -> None:
        """Clamp grads to ``[-clip_value, clip_value]`` like ``torch.nn.utils.clip_grad_value_(parameters, ...)``
        (default: all params), after averaging the grads DDP does not reduce. Collective."""
        chosen, pieces, partial, sharded = _clip_args(self, parameters, "clip_grad_value_")
        for g in _clip.valid_grads(self._table, chosen, pieces, partial, sharded):
            g.clamp_(-clip_value, clip_value)

    @torch.no_grad()
    def full_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s averaged grad, whole (a new tensor), between the backward and the step, at either stage: DDP's
        ``p.grad`` (None where no rank had one). Collective: one all-reduce of its size where it is sharded."""
        chosen, pieces, partial, sharded = _clip_args(self, param, "full_grad")
        return _clip.full_grad(self._comm, self._table, chosen, pieces, partial, sharded and sharded.agree())

    def local_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """This rank's range of ``param``'s averaged grad, a 1-D view of what the step reads (write into it to change
        the step's grad), between the backward and the step; None where this rank owns none of it: docs/stage2.md."""
        chosen, pieces, _, sharded = _clip_args(self, param, "local_grad")
        return _clip.local_grad(self._table, chosen, pieces, sharded)

    def release_views(self) -> None:
        """Give every param sharing storage its own (for savers refusing it); the next step rebuilds, moving no state."""
        _own_storage(self)
        self._table.release_shared_storage()

    def stats(self) -> dict[str, Any]:
        """Per-rank owned elements, state and fp32 master bytes, rebuild count. Collective (a small exchange)."""
        owned = [] if self._partition is None else self._partition.owned()
        live = self._lifecycle.parked_master_bytes() + (0 if self._partition is None else self._partition.master_bytes())
        return _lifecycle.rank_stats(self._comm, self.rebuilds, owned, self._holdings(), live)

    def memory_ledger(self, *, reset_peaks: bool = False) -> MemoryLedger:
        """The bytes hf_zero holds on this rank now, by holder, with each one's peak since the last reset
        (params, DDP's buckets or full grads, grad shards, reduce buckets, fp32 masters, optimizer state, scratch;
        steps are observed from the first call on, so call it once early to have peaks cover the run);
        ``reset_peaks``: start the peaks afresh after. Not a collective."""
        return _ledger_of(self, reset_peaks)

    # -- state dict ------------------------------------------------------------------
    def consolidate_state_dict(self, to: int = 0, *, device: str | torch.device | None = None) -> None:
        """Gather the full optimizer state (masters too) on rank ``to`` for :meth:`state_dict`. Collective.

        Costs rank ``to`` the whole state (AdamW: 8 bytes per param, 12 with fp32 masters) on ``device`` (default:
        each param's; ``"cpu"`` keeps it off accelerators), sent in 16 MiB rounds: no rank holds more than its shard
        plus a round besides. Like torch's ``state_dict()``, tensors rank ``to`` holds whole are shared with the live
        state. To checkpoint without a gather: :meth:`save_sharded` (``hf-zero consolidate`` makes the file).
        """
        if not 0 <= to < self._comm.world_size:
            raise ValueError(f"to must be a rank in [0, {self._comm.world_size}), got {to}")
        self._lifecycle.check_pending()
        _check_agreement(self)
        self._lifecycle.consolidated(_lifecycle.consolidate(self._comm, self._table, self._holdings(), to, device))

    def state_dict(self) -> dict:
        """A dict a plain ``optimizer_class`` over the same params would return, except with masters: a 16-bit
        param's state is then fp32, plus ``"master_param"`` (docs/precision.md). Never a collective.

        Complete on one rank or before any state exists; on several ranks, read it on the rank
        :meth:`consolidate_state_dict` gathered to. Otherwise ``"state"`` is a ``ShardedState`` handle that only this
        optimizer's :meth:`load_state_dict` accepts (reading, pickling or saving it raises, naming the fix).
        After :meth:`refer_to_sharded`, until the state changes: a small reference to that checkpoint.
        """
        state = self._lifecycle.state(self._comm.world_size, lambda: self.consolidate_state_dict(0))
        return state if _sharded.is_reference(state) else _lifecycle.state_dict_of(self, state)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full (PyTorch-format) state dict, the same on every rank (CPU is fine); each
        rank keeps what it owns. Any world size and shard mode. Not a collective.

        Another model's or optimizer class's dict raises ``ValueError`` listing the mismatches,
        and nothing changes. A sharded checkpoint's reference stays pending until
        :meth:`load_pending_sharded` (stepping before raises).
        """
        if _sharded.is_reference(state_dict):
            self._lifecycle.expect_reference(_sharded.reference_info(state_dict))
            return
        hyper, held, has_state = self._lifecycle.read_state_dict(self, self._comm, self._table, state_dict)
        self._adopt_loaded(hyper, held, has_state=has_state)

    def _adopt_loaded(self, hyper: list[dict], held: Holdings | None, has_state: bool = False) -> None:
        """Take loaded hyperparameters and this rank's loaded state (None: keep the current state)."""
        for mine, hp in zip(self.param_groups, hyper):
            mine.update(hp)
        # Every rank rebuilds at the next step: that must not depend on what this rank holds.
        self._reload_due = True
        if held is not None and self._partition is not None:
            self._partition = self._partition.emptied()
        self._lifecycle.adopt(held, has_state=has_state)

    # -- sharded checkpoints -----------------------------------------------------------
    def save_sharded(self, path: str | os.PathLike) -> None:
        """Write a sharded checkpoint to directory ``path`` (its own, seen by all ranks), each rank its own state, no
        gather; atomic. Collective. The layout: docs/checkpoints.md."""
        _check_agreement(self)
        self._lifecycle.check_pending()
        _lifecycle.write_sharded(self, self._comm, self._table, self._holdings(), path)

    def load_sharded(self, path: str | os.PathLike) -> None:
        """Load a sharded checkpoint of any world size and shard mode, each rank reading the ranges it will own.
        Collective. Another model's or optimizer class's raises ``ValueError`` listing the mismatches; nothing changes."""
        _check_agreement(self)
        groups, held, has_state = _lifecycle.read_sharded(self, self._comm, self._table, path)
        self._adopt_loaded(groups, held, has_state=has_state)

    def load_sharded_if_present(self, path: str | os.PathLike) -> bool:
        """Load the sharded checkpoint in ``path`` if there is one (then refer to it, see :meth:`refer_to_sharded`);
        return whether one was loaded. Collective: raises on every rank when ranks see different checkpoints there."""
        if _lifecycle.agreed_token(self._comm, path) is None:
            return False
        self.load_sharded(path)
        self.refer_to_sharded(path)
        return True

    def refer_to_sharded(self, path: str | os.PathLike, **info: Any) -> None:
        """Until the state changes, make :meth:`state_dict` a small reference to the sharded
        checkpoint in ``path``, which must hold this optimizer's current state (just saved
        or loaded there); ``info``: extra JSON-able facts to record. Not a collective.
        See [Note: sharded reference] in :mod:`hf_zero._sharded`."""
        self._lifecycle.refer(path, info)

    def load_pending_sharded(self, candidates: list[str]) -> str | None:
        """Load the sharded checkpoint a loaded reference points to from the first directory of
        ``candidates``, then the one recorded at save time, holding it; return it (None: nothing
        pending). Collective; raises on every rank, naming where it looked, when none holds it."""
        found = _lifecycle.find_pending(self._comm, self._lifecycle.pending, candidates)
        if found is not None:
            self.load_sharded(found)
        return found


def _clip_args(opt: ZeroBucketOptimizer, parameters, what: str) -> tuple[set[int], list, set[int], Any]:
    """(chosen, this rank's pieces, the partial grads, stage 2's grads), after averaging the unreduced grads."""
    chosen = opt._table.selected(parameters, what)
    if what in ("full_grad", "local_grad"):
        opt._grad.refuse_partial_after_step(chosen, what)
    if not opt._iteration.grads_averaged:
        opt.average_unreduced_grads()
    sharded = opt._grad.sharded_grads()
    pieces = sharded.pieces if sharded else _clip.norm_pieces(opt._table, opt._comm, opt.shard, opt._live())
    return chosen, pieces, opt._grad.partial_grads, sharded


def _check_at_backward(opt: ZeroBucketOptimizer, presence: torch.Tensor, uncertain: bool,
                       buckets: tuple, carried=None) -> bool | None:
    """Stage 2's layout check as a syncing backward starts ([Note: the check at a backward] in _params.py);
    ``presence``: this rank's presence flags as the backward will leave them (int64), ``uncertain``: where
    they may name a param whose grad never comes; ``buckets``: the reducer's (its plan's, as
    ``gradient_path.wanted_buckets`` gives them); ``carried``: where a reduce bucket carries the check.
    Returns what :meth:`LayoutCheck.at_backward_start` does. Collective."""
    mask, reload_due, intact, need = _layout_now(opt, buckets)
    return opt._check.at_backward_start(opt._comm, opt._table, (mask, reload_due), need=need,
                                        fresh=not intact, payload=presence, uncertain=uncertain, carried=carried)


def _check_at_hook(opt: ZeroBucketOptimizer, heard) -> bool:
    """Stage 1's layout check as the DDP bucket that carries it is reduced ([Note: stage 1's check rides a bucket]
    in _scatter_hook.py): this rank's bit. Not a collective."""
    mask, reload_due, intact, need = _layout_now(opt, opt._grad.wanted_buckets, refuse=False)
    return opt._check.at_hook(opt._table, (mask, reload_due), need=need, fresh=not intact, heard=heard)


def _layout_now(opt: ZeroBucketOptimizer, buckets: tuple, refuse: bool = True) -> tuple:
    """What the layout check starts from (after refusing an unresolved load, unless not ``refuse``): (``table.mask()``,
    whether the partition must be rebuilt from a load, whether the params still have the storage it gave them,
    whether this rank must re-partition: a load, a trainability change or other ``buckets`` to plan with)."""
    if refuse:
        opt._lifecycle.check_pending()
    live, mask = opt._live(), opt._table.mask()
    intact = opt._partition is not None and opt._partition.views_intact(opt._table.params)
    return mask, live is None, intact, live is None or mask != live.mask or live.layout.buckets != buckets


def _partition_for_step(opt: ZeroBucketOptimizer, grads, checked: bool) -> None:
    """Re-partition where the ranks agreed to: as stage 2's backwards found (``checked``: [Note: the check at
    a backward] in _params.py), or by the step's own check (stage 1, or a load since the backward)."""
    if checked:
        mask, reload_due = opt._check.at_backward
        if opt._table.mask() != mask:
            raise changed_since_backward()  # no collective: one that no other rank makes would never return
        if (opt._live() is None) == reload_due:
            opt._lifecycle.check_pending()
            if opt._check.due or not (opt._partition is None or opt._partition.views_intact(opt._table.params)):
                opt._rebuild()
            return
    if opt._check.hooked is not None:  # [Note: stage 1's check rides a bucket] in _scatter_hook.py
        mask, reload_due, intact, need = _layout_now(opt, opt._grad.wanted_buckets)
        carried, at_backward = opt._check.at_carried_step(opt._comm, opt._table, (mask, reload_due), need=need,
                                                          fresh=not intact)
        if carried == "steady":
            if not intact:  # storage replaced, the same params: this rank alone re-views
                opt.wait_param_sync()
                opt._rebuild()
            return
        if carried in ("mirror", "later"):  # "later": a trainability change since the backward waits for the next
            return
        with opt._table.trainable_as(at_backward if carried == "everyone" else mask):
            opt._ensure_partition(force=carried == "everyone", blocking=False)
        return
    opt._ensure_partition(force=False, blocking=False, payload=None if grads is None else grads.presence_flags())


def _step_pieces(opt: ZeroBucketOptimizer, kwargs: dict, grads) -> Any:
    """The local step and the parameter sync; a rank that is mirroring ([Note: the layout check]) takes the
    step's collectives only."""
    if opt._check.mirroring:
        opt._grad.for_step(grads, opt._check.presence())
        opt._partition.sync(opt._comm, opt._table.params, opt._grad.overlap)
        return None
    if not opt._iteration.grads_averaged:
        opt.average_unreduced_grads()
    return opt._partition.step_and_sync(opt.param_groups, kwargs, opt._comm, opt._table.params, opt._grad.overlap,
                                        opt._grad.for_step(grads, opt._check.presence()))


def _check_agreement(opt: ZeroBucketOptimizer) -> None:
    """Before a checkpoint collective: raise on every rank unless all hold the same params. Collective."""
    opt._check.read_late(opt._comm, opt._table)
    opt._table.check_agreement(opt._comm)


def _collected(binding, comm: Comm) -> None:
    """An optimizer was collected (never at exit): its binding ends, and the completed works of its last
    collectives, which hold its buffers, are let go."""
    binding.close()
    comm.release_completed_works(drop_scratch=True, at_end=True)


def _own_storage(opt: ZeroBucketOptimizer) -> None:
    """See [Note: params own their storage after a run] in _partition.py."""
    opt.wait_param_sync()
    if opt._partition is not None:
        opt._comm.release_completed_works(drop_scratch=True, at_end=True)  # the last syncs' works hold the buffers
        opt._partition = opt._partition.without_buffers(opt._table.params)


def _ledger_of(opt: ZeroBucketOptimizer, reset_peaks: bool) -> MemoryLedger:
    now = _memory_now(opt)
    opt._peaks.watching = True
    peaks = {**opt._peaks.observe(now), **opt._grad.memory_peaks(reset_peaks)}
    peaks["receive_scratch"] = opt._comm.scratch_peak(reset_peaks) + opt._grad.staged_bytes()  # observed as taken
    ledger = MemoryLedger(**now, peaks={k: v for k, v in peaks.items() if v})
    if reset_peaks:
        opt._peaks.reset()
    return ledger


def _memory_now(opt: ZeroBucketOptimizer) -> dict[str, int]:
    """Bytes per ledger category on this rank now ([Note: memory ledger] in _ledger.py)."""
    now = dict.fromkeys(CATEGORIES, 0)
    params = opt._table.params
    now["params"] = storage_bytes(params)
    parts = [opt._lifecycle.memory(), opt._grad.memory(params)]
    if opt._partition is not None:
        parts.append(opt._partition.memory())
    for part in parts:
        for k, v in part.items():
            now[k] += v
    now["receive_scratch"] = opt._comm.scratch_bytes() + opt._grad.staged_bytes()
    consolidated = opt._lifecycle.consolidated_tensors()
    if consolidated:  # it shares what rank ``to`` held whole with the live state: only the rest is its own
        live = [*params, *opt._lifecycle.parked_tensors(), *([] if opt._partition is None else opt._partition.tensors())]
        now["consolidation"] = storage_bytes(consolidated, skip={t.untyped_storage().data_ptr() for t in live})
    return now
