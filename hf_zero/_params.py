"""The optimizer's params as one table: order, names, groups, labels, specs, trainability.

A :class:`ParamTable` is built from the param groups and never changes; adding a param
group makes a new table. Everything that numbers params (state dicts, layouts, sharded
checkpoints, the gradient path) numbers them the way this table does: in param-group order.
"""

from __future__ import annotations

import contextlib
from operator import attrgetter
from typing import Iterable, Sequence

import torch

from ._comm import fingerprint
from ._layout import ParamSpec


_REQUIRES_GRAD = attrgetter("requires_grad")


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def check_params(param_groups: list[dict]) -> None:
    """Reject what torch.optim accepts but sharding cannot handle, naming the param."""
    if not any(group["params"] for group in param_groups):
        raise ValueError("params: every param group is empty (an empty group is fine, as in torch, beside others)")
    seen = set()
    for gi, group in enumerate(param_groups):
        names = group.get("param_names") or [None] * len(group["params"])
        for k, (p, name) in enumerate(zip(group["params"], names)):
            label = f"param {name or k} of group {gi} (shape {tuple(p.shape)})"
            if _is_dtensor(p):
                raise ValueError(
                    f"{label} is a DTensor (tensor parallelism / FSDP2): ZeroBucketOptimizer shards plain "
                    "replicated params only; use torch's FSDP2 optimizer setup or plain (non-DTensor) params"
                )
            if p.layout != torch.strided:
                raise ValueError(f"{label} is {p.layout}: only dense (strided) params can be sharded")
            if not (p.is_floating_point() or p.is_complex()):
                raise ValueError(f"{label} has dtype {p.dtype}: only floating point params can be optimized")
            if id(p) in seen:
                raise ValueError(f"{label} appears twice: list each param once")
            seen.add(id(p))


class ParamTable:
    """Every param of the optimizer, in param-group order, with its name and group."""

    def __init__(self, param_groups: Sequence[dict]):
        self.params: tuple[torch.Tensor, ...] = tuple(p for g in param_groups for p in g["params"])
        self.names: tuple[str | None, ...] = tuple(
            n for g in param_groups for n in g.get("param_names", [None] * len(g["params"]))
        )
        self.group_of: tuple[int, ...] = tuple(gi for gi, g in enumerate(param_groups) for _ in g["params"])
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        self._fingerprint: tuple[tuple[bool, ...], int] | None = None  # (mask, its fingerprint)

    def __len__(self) -> int:
        return len(self.params)

    def index(self, param: torch.Tensor) -> int | None:
        """``param``'s index, or None when it is not one of the table's params."""
        return self._index_of.get(id(param))

    def indices(self, params) -> tuple[int | None, ...]:
        """:meth:`index` of each of ``params``."""
        return tuple(map(self._index_of.get, map(id, params)))

    def label(self, i: int) -> str:
        """How errors name param ``i``: its name (or ``#i``), group and shape."""
        return f"{self.names[i] or f'#{i}'} (group {self.group_of[i]}, shape {tuple(self.params[i].shape)})"

    def checkpoint_labels(self) -> list[str]:
        """Unique per-param keys of a sharded checkpoint: names when unique, else ``name#i``."""
        unique = len(set(self.names)) == len(self.names)
        return [n if n is not None and unique else f"#{i}" if n is None else f"{n}#{i}" for i, n in enumerate(self.names)]

    def mask(self) -> tuple[bool, ...]:
        """Which params are trainable now."""
        return tuple(map(_REQUIRES_GRAD, self.params))

    @contextlib.contextmanager
    def trainable_as(self, mask: tuple[bool, ...]):
        """Within: the params' ``requires_grad`` as in ``mask`` (what a backward saw); restored after."""
        now = self.mask()
        changed = [p for p, was, want in zip(self.params, now, mask) if was != want]
        try:
            for p in changed:
                p.requires_grad_(not p.requires_grad)
            yield
        finally:
            for p in changed:
                p.requires_grad_(not p.requires_grad)

    def numels(self) -> dict[int, int]:
        return {i: p.numel() for i, p in enumerate(self.params)}

    def specs(self) -> list[ParamSpec]:
        return [
            ParamSpec(p.numel(), p.dtype, str(p.device), p.requires_grad, self.group_of[i])
            for i, p in enumerate(self.params)
        ]

    def check_materialized(self) -> None:
        """Raise, naming it, when a trainable param is still on the meta device."""
        for i, p in enumerate(self.params):
            if p.requires_grad and p.device.type == "meta":
                raise ValueError(
                    f"param {self.label(i)} is on the meta device at step time: materialize the "
                    "model (e.g. model.to_empty(device=...) and load weights) before stepping"
                )

    def selected(self, parameters: Iterable[torch.Tensor] | torch.Tensor | None, what: str) -> set[int]:
        """Indices of the trainable params among ``parameters`` (None: all of them)."""
        if parameters is None:
            return {i for i, p in enumerate(self.params) if p.requires_grad}
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        chosen = set()
        for p in parameters:
            i = self.index(p)
            if i is None and p.grad is None:
                continue  # as torch's clipping skips every param without a grad (a frozen one under PEFT)
            if i is None:
                raise ValueError(f"{what}: a param of shape {tuple(p.shape)} is not one of this optimizer's params")
            if p.requires_grad:
                chosen.add(i)
        return chosen

    def release_shared_storage(self) -> None:
        """Give every param that shares its storage with another its own storage."""
        shared: dict[int, int] = {}
        for p in self.params:
            key = p.untyped_storage().data_ptr()
            shared[key] = shared.get(key, 0) + 1
        for p in self.params:
            if shared[p.untyped_storage().data_ptr()] > 1:
                p.data = p.data.clone()

    # -- agreement across ranks ------------------------------------------------------
    def agreement_items(self, mask: tuple[bool, ...]) -> list:
        """What every rank must hold alike: each param's shape, dtype, device type, trainability."""
        return [(tuple(p.shape), str(p.dtype), p.device.type, m) for p, m in zip(self.params, mask)]

    def fingerprint(self, mask: tuple[bool, ...], *, fresh: bool) -> int:
        """A fingerprint of :meth:`agreement_items` for ``mask`` (kept until the mask changes; ``fresh``: the
        params' storage may have been replaced since, recompute it)."""
        if fresh or self._fingerprint is None or self._fingerprint[0] != mask:
            self._fingerprint = (mask, fingerprint(self.agreement_items(mask)))
        return self._fingerprint[1]

    def check_agreement(self, comm) -> None:
        """Before a checkpoint collective: raise on every rank unless all hold the same params. Collective."""
        mask = self.mask()
        if not comm.agree(self.fingerprint(mask, fresh=True))[0]:
            raise self.disagreement(comm.all_gather_object(self.agreement_items(mask)))

    def disagreement(self, everyone: list[list]) -> RuntimeError:
        """The error naming the first param the ranks' :meth:`agreement_items` differ on."""
        fields = ("shape", "dtype", "device", "requires_grad")
        for i in range(max(len(e) for e in everyone)):
            seen = [e[i] if i < len(e) else None for e in everyone]
            if any(s != seen[0] for s in seen):
                per_rank = "; ".join(
                    f"rank {r}: " + ("missing" if s is None else ", ".join(f"{f}={v}" for f, v in zip(fields, s)))
                    for r, s in enumerate(seen)
                )
                return RuntimeError(
                    f"hf_zero: ranks disagree on parameter {self.label(i)}: {per_rank}. Every rank must "
                    "freeze/unfreeze the same params and keep the same shapes, dtypes and devices."
                )
        return RuntimeError("hf_zero: ranks disagree on the parameter layout")


class LayoutCheck:
    """Whether every rank holds the same params with the same trainability, and whether any must re-partition:
    checked at every step without a steady step waiting for it.

    [Note: the layout check]
    Each step every rank starts one small all-reduce of its params' fingerprint and whether it must
    re-partition (``Comm.start_agreement``), unless a reduce bucket carried the check during the backward
    (:meth:`at_hook`, [Note: stage 1's check rides a bucket] in _scatter_hook.py; stage 2 below). A rank
    where nothing changed since the last agreed step (the steady case) steps on and reads the result at the
    read point ([Note: reading an agreement late] in _comm.py): the end of the step on the CPU, the start of
    the next on an accelerator or with the overlapped parameter sync (whose pending collectives a dead peer
    would otherwise turn into a failed step). A rank where something changed (its trainable set or shapes, a
    load, ``refresh_trainable()``, the first step) reads at once. If
    every rank is such a rank and the fingerprints agree, every rank re-partitions now. Otherwise some rank
    is steady and steps with the current layout: the changed ranks *mirror* it, taking the step's collectives
    (the parameter sync) without stepping their own pieces, and at the read point every rank raises the same
    error naming what differs. Params whose storage was replaced but still match the agreed fingerprint are
    re-viewed on their rank alone: a rebuild with an unchanged layout moves nothing between ranks.

    [Note: the check at a backward]
    Under stage 2 the first collectives after a change are the backward's reduce-scatters, whose buckets follow
    each rank's trainable set: a rank that froze a param alone would send buckets the others do not expect, and
    every rank would wait on a message that never comes. So stage 2 makes the check as each syncing backward
    starts, before its first reduce-scatter (``Reducer._begin``), not at the step. A steady rank starts it and
    goes on; a changed rank reads it at once and, unless every rank changed alike, *mirrors* the plan last
    agreed: it reduces the buckets the others reduce (a param frozen since adds zeros, one unfrozen since is
    dropped), so no collective is left unmatched. Every rank reads the check at the start of the step, where its
    all-reduce has long completed, and raises the same error there, before anything changes. Where every rank
    changed alike, the backward reduces with the new plan and the step re-partitions (:attr:`due`). Where a
    reduce bucket of the plan last agreed can carry the check, a steady rank makes no collective for it: its
    bits ride that bucket's reduce-scatter, and a changed rank reduces the buckets up to it at once to learn
    whether every rank changed ([Note: the check rides a bucket] in _stage2/carrier.py).

    The check also carries the presence flags the step needs ([Note: agreeing on presence] in
    _stage2/grads.py), as the backward will leave them: the params it will reach (``will_run``), those with a
    grad from ``no_sync()`` and those with one since the step. Only a reentrant checkpoint region makes that
    guess uncertain (its params may or may not come): the check's second flag says so, and the step agrees on
    presence itself. A grad this rank drops after the backward (``p.grad = None``) leaves its presence on this
    rank only."""

    def __init__(self):
        self._late = None  # (the Agreement of the last step not read yet, whether this rank needed)
        self._agreed: int | None = None  # the fingerprint the ranks last agreed on
        self.mirroring = False  # this rank found the ranks disagreeing: see the note
        self.carried = None  # the last begin's payload, reduced: a callable
        self._uncertain = None  # the last begin's Agreement, whose second flag says the payload may be too wide
        self.at_backward: tuple | None = None  # the state a backward's check ran with since the step
        self.due = False  # a backward's check found every rank re-partitioning: the step does
        # stage 1: (state, whether this rank changed, the Heard) where this step's backward's carrier carried the check
        self.hooked: tuple | None = None

    def begin(self, comm, table: ParamTable, mask: tuple[bool, ...], *, need: bool, fresh: bool,
              blocking: bool, payload=None, uncertain: bool | None = None) -> bool:
        """Start this step's check; returns whether every rank re-partitions now. ``need``: this rank must
        (before the fingerprint is compared); ``blocking``: every rank reads now (not a step: ``ensure_partition``);
        ``mask``: ``table.mask()``; ``payload``: an int64 tensor MAX-reduced along (:attr:`carried` gives it);
        ``uncertain`` (a backward's check, on every rank): whether this rank's payload may hold more than it
        should (where any rank's may, :meth:`presence` gives None).
        Collective."""
        self.read_late(comm, table)
        fp = table.fingerprint(mask, fresh=fresh)
        need = need or fp != self._agreed
        agreement = comm.start_agreement(fp, need, payload, extra=bool(uncertain))
        self.carried = None if payload is None else agreement.payload
        self._uncertain = agreement if uncertain is not None else None
        if not (need or blocking):
            self._late = (agreement, False)
            return False
        if blocking or agreement.everyone:  # every rank reads now
            self.hooked = None  # every rank agreed since a backward's carrier heard the check
            if not agreement.same:
                raise table.disagreement(comm.all_gather_object(table.agreement_items(table.mask())))
            if agreement.anyone:  # the caller re-partitions now: a backward's check left nothing due
                self._agreed, self.due = fp, False
            return agreement.anyone
        self._late, self.mirroring = (agreement, True), True
        return False

    def at_backward_start(self, comm, table: ParamTable, state: tuple, *, need: bool, fresh: bool,
                          payload, uncertain: bool, carried=None) -> bool | None:
        """Stage 2: a syncing backward starts, before its first reduce-scatter; see [Note: the check at a
        backward]. ``state``: (``table.mask()``, whether the partition must be rebuilt from a load), which the
        step compares with its own. Returns True where every rank re-partitions (at the step), False where this
        backward reduces with the plan it has, None where this rank must mirror the plan last agreed. ``carried``:
        where a reduce bucket carries the check ([Note: the check rides a bucket] in _stage2/carrier.py), what
        it will hear (``heard``) and a ``probe()`` for a rank that changed. Collective, except on a steady rank
        whose check a bucket carries."""
        if carried is not None:
            self.read_late(comm, table)
            if not (need or table.fingerprint(state[0], fresh=fresh) != self._agreed):
                heard = carried.heard
                self._late, self._uncertain, self.carried = (heard, False), heard, lambda: payload
                self.at_backward = state
                return False
            probed = carried.probe()
            if not probed.everyone:  # some rank is steady: mirror; every rank raises at the step
                self._late, self.mirroring, self.carried, self.at_backward = (probed, True), True, None, state
                return None
        everyone = self.begin(comm, table, state[0], need=need, fresh=fresh, blocking=False, payload=payload,
                              uncertain=uncertain)
        self.at_backward, self.due = state, self.due or everyone
        return None if self.mirroring else everyone

    def at_hook(self, table: ParamTable, state: tuple, *, need: bool, fresh: bool, heard) -> bool:
        """Stage 1, as the DDP bucket that carries the check is reduced ([Note: stage 1's check rides a bucket]
        in _scatter_hook.py): whether this rank changed (its bit in the bucket); the step reads what ``heard``
        hears (:meth:`at_carried_step`). ``state``: (``table.mask()``, whether the partition must be rebuilt
        from a load)."""
        changed = need or table.fingerprint(state[0], fresh=fresh) != self._agreed
        self.hooked = (state, changed, heard)
        return changed

    def at_carried_step(self, comm, table: ParamTable, state: tuple, *, need: bool, fresh: bool) -> tuple:
        """Stage 1's step after a backward whose carrier carried the check (:meth:`at_hook`): (what the step
        does, the mask the backward saw). What the step does: ``"steady"``
        (nothing changed: no collective, the check is read late), ``"mirror"`` (this rank changed and others
        did not: it takes the step's collectives only, and every rank raises at the read point), ``"everyone"``
        (every rank changed: the caller makes the check, every rank with it, with the mask the backward saw,
        so a change since is left for the next one, as below), ``"later"`` (this rank's trainable
        set changed since the backward, which told the others it had not: this step keeps the agreed layout, as
        torch's optimizer steps a param frozen after its backward; the next backward's carrier carries the
        change), ``"check"`` (a load, or params replaced with others, since the backward: the caller makes the
        check, as stage 2 does; every rank must have done it alike)."""
        self.read_late(comm, table)
        (hooked, changed, heard), self.hooked = self.hooked, None
        self.carried = self._uncertain = None
        if changed:
            if heard.changed == comm.world_size:
                return "everyone", hooked[0]
            self._late, self.mirroring = (heard, True), True
            return "mirror", hooked[0]
        fp = table.fingerprint(state[0], fresh=fresh)
        if state[1] != hooked[1] or fresh and fp != self._agreed:
            return "check", hooked[0]
        self._late = (heard, False)
        if state != hooked or need or fp != self._agreed:
            return "later", hooked[0]
        return "steady", hooked[0]

    def presence(self):
        """The last check's payload reduced (a callable), or None where some rank's payload was uncertain."""
        if self.carried is None or (self._uncertain is not None and self._uncertain.extra):
            return None
        return self.carried

    def read_backwards(self, comm, table: ParamTable) -> bool:
        """At the start of a step: whether stage 2's backwards checked since the last step; if so, read their
        check, raising on every rank where the ranks disagreed. Collective only then."""
        if self.at_backward is None:
            return False
        self.read_late(comm, table)
        return True

    def before_overlapped_sync(self, comm) -> None:
        """On the CPU, before a sync the step does not wait for: let the check's all-reduce complete first
        (no value is read), so that a peer that dies or stops in that sync leaves no all-reduce running,
        which would hold one of gloo's threads, and the process at its exit."""
        if self._late is not None and comm.device.type == "cpu":
            self._late[0].wait()

    def end_of_step(self, comm, table: ParamTable, *, synced: bool) -> None:
        """The step ended (``synced``: its collectives were waited for, not left to an overlapped parameter
        sync): read the check (CPU, synced) or queue its copy to the host (an accelerator); otherwise the next
        step reads it, after waiting for the sync."""
        self.at_backward, self.due = None, False  # the grads of the backwards checked are consumed
        if self._late is None:
            return
        if comm.device.type != "cpu":
            self._late[0].settle()
        elif synced:
            self.read_late(comm, table)

    def read_late(self, comm, table: ParamTable) -> None:
        """Read the last step's check, if not read yet: raise on every rank where ranks disagreed. Collective
        only then (every rank reads it at the same point)."""
        if self._late is None:
            return
        (late, needed), self._late = self._late, None
        if late.same and not late.anyone:
            return
        self.mirroring = False
        everyone = comm.all_gather_object((table.agreement_items(table.mask()), needed))
        if any(items != everyone[0][0] for items, _ in everyone):
            raise table.disagreement([items for items, _ in everyone])
        changed = [r for r, (_, need) in enumerate(everyone) if need]
        raise RuntimeError(
            f"hf_zero: ranks disagree on whether to re-partition now: rank(s) {changed} changed their params (their "
            "storage, a loaded state or refresh_trainable()) since the last step and the others did not. Every rank "
            "must load, refresh and replace params alike, at the same step."
        )
