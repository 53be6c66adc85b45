"""ZeroBucketOptimizer: ZeRO stage-1 with parameters as views into flat buffers."""

from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch

from . import checkpoint, reference
from .comm import Comm, fingerprint
from .layout import Layout, ParamSpec, Piece, plan_layout
from .state import Holding, Holdings, redistribute, shape_as

_ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)
# Third-party elementwise optimizers, matched by class name (no import needed).
_ELEMENTWISE_NAMES = frozenset({"Lion"})
_NOT_HYPER = ("params", "param_names")


def is_elementwise(optimizer_class: type) -> bool:
    """True when updating slices of a param separately equals updating the whole param."""
    return issubclass(optimizer_class, _ELEMENTWISE) or optimizer_class.__name__ in _ELEMENTWISE_NAMES


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


class ZeroBucketOptimizer(torch.optim.Optimizer):
    """ZeRO stage-1: each rank keeps optimizer state only for the elements it owns.

    A drop-in for :class:`torch.distributed.optim.ZeroRedundancyOptimizer` (same
    argument names), which follows ``requires_grad`` changes, mixes dtypes and
    devices, and syncs parameters with a few whole-buffer collectives per step.

    Args:
        params: tensors, ``(name, tensor)`` pairs or param groups. Include frozen
            params: only those listed here can be trained after being unfrozen.
        optimizer_class: the local optimizer, e.g. ``torch.optim.AdamW``.
        process_group: the group to shard over (default: the world; world size 1
            when torch.distributed is not initialized).
        parameters_as_bucket_view: make every trainable param's ``.data`` a view
            into one flat buffer per (device, dtype), so the sync moves whole
            buffers. ``False`` keeps params' own storage (the sync then copies
            through a staging buffer).
        shard: ``"flat"`` (equal ranges, params may straddle ranks; elementwise
            optimizers only), ``"param"`` (whole params; any optimizer) or
            ``"auto"`` (flat when ``optimizer_class`` is elementwise).
        **defaults: hyperparameters for ``optimizer_class``.

    Buffers are built at the first :meth:`step` (after ``model.to`` or
    ``accelerator.prepare`` moved the params) and checked at every step.
    Every method that says *collective* must be called on all ranks.
    """

    def __init__(
        self,
        params: Iterable,
        optimizer_class: type[torch.optim.Optimizer],
        process_group: Any = None,
        parameters_as_bucket_view: bool = True,
        shard: str = "auto",
        **defaults: Any,
    ):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        if shard not in ("auto", "flat", "param"):
            raise ValueError(f"shard must be 'auto', 'flat' or 'param', got {shard!r}")
        if shard == "flat" and not is_elementwise(optimizer_class):
            raise ValueError(
                f"shard='flat' splits params across ranks, which is only exact for elementwise "
                f"optimizers; {optimizer_class.__name__} is not one: use shard='param'"
            )
        if shard == "auto":
            shard = "flat" if is_elementwise(optimizer_class) else "param"
        self._ready = False
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # torch only warns on duplicates
            try:
                super().__init__(params, {})
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

        self.optimizer_class = optimizer_class
        self.shard = shard
        self.parameters_as_bucket_view = bool(parameters_as_bucket_view)
        self._comm = Comm(process_group)
        self._layout: Layout | None = None
        self._mask: tuple[bool, ...] | None = None
        self._fingerprint: int | None = None
        self._ddp_reduced: tuple[bool, ...] | None = None
        self._inner: torch.optim.Optimizer | None = None
        self._inner_groups: list[int] = []
        self._pieces: list[tuple[torch.Tensor, torch.Tensor, Piece]] = []
        self._buffers: list[torch.Tensor] = []
        self._ptrs: dict[int, int] = {}
        self._parked: Holdings = {}
        self._consolidated: dict | None = None
        self._sharded_ref: tuple[int, dict] | None = None  # see [Note: sharded reference]
        self._pending_sharded: dict | None = None
        self._has_state = False
        self._state_version = 0  # bumped whenever state values change (see checkpoint.ShardedState)
        self._names_by_id: dict[int, str] = {}
        self._grads_averaged = False
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
        self._group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        names = [n for g in self.param_groups for n in g.get("param_names", [None] * len(g["params"]))]
        self._param_names = [self._names_by_id.get(id(p)) or n for p, n in zip(self._params, names)]

    def _name(self, i: int) -> str:
        p = self._params[i]
        label = self._param_names[i] or f"#{i}"
        return f"{label} (group {self._group_of[i]}, shape {tuple(p.shape)})"

    def _specs(self) -> list[ParamSpec]:
        return [
            ParamSpec(p.numel(), p.dtype, str(p.device), p.requires_grad, self._group_of[i])
            for i, p in enumerate(self._params)
        ]

    # -- step ----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Update the params this rank owns, then sync every buffer. Collective."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._prepare()
        self._average_unreduced_grads()
        if self._inner is not None:
            self._local_step()
        self._sync()
        self._grads_averaged = False
        self._has_state = True
        self._consolidated = None
        self._state_version += 1
        return loss

    def refresh_trainable(self) -> None:
        """Re-partition the current trainable set and move optimizer state. Collective."""
        self._prepare(force=True)

    def _prepare(self, force: bool = False) -> None:
        """Check trainability and views; rebuild on every rank if any rank needs it."""
        reference.check_pending(self)
        mask = tuple(p.requires_grad for p in self._params)
        intact = self._views_intact()
        if mask != self._mask or not intact or self._fingerprint is None:
            self._fingerprint = fingerprint(self._agreement_items(mask))
        need = force or self._layout is None or mask != self._mask or not intact
        agree, anyone_needs = self._comm.agree(self._fingerprint, need)
        if not agree:
            self._raise_disagreement(mask)
        if anyone_needs:
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
                    f"hf_zero: ranks disagree on parameter {self._name(i)}: {per_rank}. Every rank must "
                    "freeze/unfreeze the same params and keep the same shapes, dtypes and devices."
                )
        raise RuntimeError("hf_zero: ranks disagree on the parameter layout")

    def _views_intact(self) -> bool:
        return all(self._params[i].data_ptr() == ptr for i, ptr in self._ptrs.items())

    def _average_unreduced_grads(self) -> None:
        """Average grads DDP does not reduce: params frozen when it was built (DESIGN §4).

        Runs once per step; integrations call it earlier where a GradScaler must
        see the averaged grads.
        """
        if self._comm.world_size == 1 or self._grads_averaged:
            return
        if self._ddp_reduced is None:
            self._note_ddp_built()
        unreduced = [p for p, then in zip(self._params, self._ddp_reduced) if p.requires_grad and not then]
        self._comm.average_grads(unreduced)
        self._grads_averaged = True

    def _note_ddp_built(self) -> None:
        """Record the params DDP reduces: those trainable now. Without a call, the
        set trainable at the first step is taken."""
        self._ddp_reduced = tuple(p.requires_grad for p in self._params)

    def _local_step(self) -> None:
        for inner_group, gi in zip(self._inner.param_groups, self._inner_groups):
            for k, v in self.param_groups[gi].items():
                if k not in _NOT_HYPER:
                    inner_group[k] = v
        flat = self.shard == "flat"
        for t, p, pc in self._pieces:
            g = p.grad
            if g is None:
                t.grad = None
            elif flat:
                t.grad = g.reshape(-1)[pc.start : pc.stop]
            else:
                t.grad = g
        try:
            self._inner.step()
        finally:
            for t, _, _ in self._pieces:
                t.grad = None

    def _sync(self) -> None:
        if self._comm.world_size == 1:
            return
        for b, plan in enumerate(self._layout.buffers):
            buf = self._buffers[b]
            if not self.parameters_as_bucket_view:
                for t, _, pc in self._pieces:
                    if pc.buffer == b:
                        buf[pc.offset : pc.offset + pc.numel].copy_(t.reshape(-1))
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

    # -- rebuild -------------------------------------------------------------------
    def _holdings(self) -> Holdings:
        """All state this rank holds: its active pieces' and parked (frozen / not yet placed)."""
        held: Holdings = {i: list(hs) for i, hs in self._parked.items()}
        if self._inner is not None:
            for t, _, pc in self._pieces:
                st = self._inner.state.get(t)
                if st:
                    held.setdefault(pc.index, []).append(Holding(pc.start, pc.stop, tuple(t.shape), dict(st)))
        for hs in held.values():
            hs.sort(key=lambda h: h.start)
        return held

    def _rebuild(self, mask: tuple[bool, ...]) -> None:
        for i, p in enumerate(self._params):
            if p.requires_grad and p.device.type == "meta":
                raise ValueError(
                    f"param {self._name(i)} is on the meta device at step time: materialize the "
                    "model (e.g. model.to_empty(device=...) and load weights) before stepping"
                )
        specs = self._specs()
        layout = plan_layout(specs, world_size=self._comm.world_size, shard=self.shard)
        held = self._holdings()
        rank = self._comm.rank
        trainable = {i for i, m in enumerate(mask) if m}
        if layout == self._layout and not self._parked_trainable(trainable):
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
                names=self._name,
                piece_shape=self._piece_shape,
            )
        self._parked = {i: hs for i, hs in held.items() if i not in trainable}
        self._build_buffers(layout)
        self._build_inner(layout.pieces(rank), new_held)
        self._layout = layout
        self._mask = mask
        if self._ddp_reduced is None:
            self._note_ddp_built()
        self.rebuilds += 1

    def _piece_shape(self, i: int, start: int, stop: int) -> tuple[int, ...]:
        """The shape the local optimizer steps elements ``start:stop`` of param ``i`` as."""
        return tuple(self._params[i].shape) if self.shard == "param" else (stop - start,)

    def _parked_trainable(self, trainable: set[int]) -> bool:
        return any(i in trainable for i in self._parked)

    def _build_buffers(self, layout: Layout) -> None:
        if self.parameters_as_bucket_view:
            for p in self._params:
                if not p.requires_grad and p.data_ptr() in self._ptrs.values():
                    p.data = p.data.clone()
        self._buffers, self._ptrs = [], {}
        for plan in layout.buffers:
            device = torch.device(plan.device)
            buf = torch.zeros(plan.size, dtype=plan.dtype, device=device)
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
        by_group: dict[int, list[torch.Tensor]] = {}
        self._pieces = []
        for pc in pieces:
            p = self._params[pc.index]
            t = p.data.view(-1)[pc.start : pc.stop]
            if self.shard == "param":
                t = t.view(p.shape)
            self._pieces.append((t, p, pc))
            by_group.setdefault(self._group_of[pc.index], []).append(t)
        if not self._pieces:
            self._inner, self._inner_groups = None, []
            return
        self._inner_groups = sorted(by_group)
        groups = [
            {**{k: v for k, v in self.param_groups[gi].items() if k not in _NOT_HYPER}, "params": by_group[gi]}
            for gi in self._inner_groups
        ]
        self._inner = self.optimizer_class(groups)
        for t, p, pc in self._pieces:
            for h in held.get(pc.index, ()):
                if h.start == pc.start and h.stop == pc.stop:
                    self._inner.state[t] = {
                        k: v.to(t.device) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                        for k, v in shape_as(h, t.shape).items()
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
        reference.check_pending(self)
        self._check_agreement()
        target = None if device is None else torch.device(device)
        numels = {i: p.numel() for i, p in enumerate(self._params)}
        got = redistribute(
            self._comm,
            self._holdings(),
            lambda indices: {i: [(to, 0, numels[i])] for i in indices},
            numels=numels,
            device_of=lambda i: target or self._params[i].device,
            names=self._name,
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
        a :class:`~hf_zero.checkpoint.ShardedState`: reading, pickling or saving it
        raises an error naming that fix, and only this optimizer's
        :meth:`load_state_dict` accepts it, keeping the state each rank holds (so
        Accelerate's ``state_dict()``/``load_state_dict()`` round trip in
        ``AcceleratedOptimizer.__init__`` works at any point of training). Integrations
        writing sharded checkpoints make it a small reference to one instead (see
        :mod:`hf_zero.reference`).
        """
        ref = reference.state_dict_for(self)
        if ref is not None:
            return ref
        sharded = None
        if self._consolidated is None:
            if self._comm.world_size == 1:
                self.consolidate_state_dict(0)
            elif self._has_state:
                sharded = checkpoint.ShardedState(self, self._state_version, self._comm.world_size)
        index, groups = 0, []
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(packed)
        state = sharded if sharded is not None else dict(self._consolidated or {})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full (PyTorch-format) state dict; each rank keeps what it owns.

        Works on any world size and shard mode; every rank must pass the same dict
        (it may live on the CPU: only this rank's pieces are copied to the device).
        A dict of another model (group sizes, ``param_names``, state shapes) or
        another optimizer class raises ``ValueError`` listing the mismatches, and
        nothing changes. Not a collective. A reference to a sharded checkpoint (see
        :mod:`hf_zero.reference`) is kept pending until loaded; stepping before raises.
        """
        if reference.is_reference(state_dict):
            reference.load(self, state_dict)
            return
        checkpoint.load_state_dict(self, state_dict)

    def save_sharded(self, path) -> None:
        """Write a sharded checkpoint to directory ``path`` (its own; all ranks must see it),
        each rank its own state, with no gather. Collective.

        Atomic: until it returns the directory keeps its previous checkpoint. See
        :mod:`hf_zero.checkpoint` for the format and ``hf-zero consolidate`` / ``inspect``.
        """
        self._check_agreement()
        reference.check_pending(self)
        checkpoint.save_sharded(self, path)

    def load_sharded(self, path) -> None:
        """Load a sharded checkpoint written on any world size and shard mode. Collective.

        Each rank reads only the ranges it will own. A checkpoint of another model or
        optimizer class raises ``ValueError`` listing the mismatches; nothing changes.
        """
        self._check_agreement()
        checkpoint.load_sharded(self, path)

    def _set_param_names(self, named_params) -> None:
        """Name params for checkpoints from ``(name, param)`` pairs, e.g. ``model.named_parameters()``."""
        self._names_by_id = {id(p): n for n, p in named_params}
        self._index_params()

    def _adopt_loaded(self, hyperparams: list[dict], held: Holdings | None, has_state: bool = False) -> None:
        """Take loaded hyperparameters and this rank's loaded state (None: keep the current state)."""
        for mine, hp in zip(self.param_groups, hyperparams):
            mine.update(hp)
        self._pending_sharded = None
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
        self._state_version += 1

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
