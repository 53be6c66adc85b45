"""What ``p.grad`` holds between a syncing backward and the step.

[Note: p.grad stands in for the shards]
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
follow). Reading a stand-in gives NaN. Every other write into it raises, naming the fix:
the stand-in is a :class:`StandIn` (a tensor subclass whose ``__torch_function__`` sees
every op on it and on its views, ``.data`` included), which lets ``zero_()``,
``torch._foreach_zero_`` and ``requires_grad_`` / ``detach_`` (``module.zero_grad(
set_to_none=False)``) through and refuses every other in-place op, indexed assignment and
``out=`` into it. So "its version moved" means exactly "it was zeroed": no value is read
to guess what the user meant, and a NaN-sanitising ``p.grad[p.grad.isnan()] = 0`` or
``masked_fill_``, torch's ``clip_grad_norm_`` or an unprepared GradScaler fails loudly
rather than zeroing or scaling nothing. (Writes into this rank's piece of the averaged
grad go through ``optimizer.local_grad(p)``.) The step and ``zero_grad`` take the
stand-ins out again.
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter, is_

import torch

from .._engine import plain_tensors, version_of, versions_of


_GRAD, _REQUIRES_GRAD = attrgetter("grad"), attrgetter("requires_grad")
_LETS_THROUGH = frozenset({"zero_", "_foreach_zero_", "requires_grad_", "detach_"})
_IN_PLACE_OPERATORS = frozenset({"__setitem__", "__set__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                                 "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__",
                                 "__ilshift__", "__irshift__", "__imatmul__"})


class StandIn(torch.Tensor):
    """A ``p.grad`` stand-in (and each view of one): reads give NaN; writes other than zeroing raise
    ([Note: p.grad stands in for the shards]). ``label``: the param's, for the message."""

    label = "a param"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        writes = name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.endswith("__"))
        into = _stand_in(kwargs.get("out"))
        if into is not None or (writes and name not in _LETS_THROUGH):
            raise RuntimeError(_refusal(into if into is not None else _stand_in(args), name))
        with plain_tensors():
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and not isinstance(out, StandIn):
                first = _stand_in(args)
                if first is not None and out.untyped_storage().data_ptr() == first.untyped_storage().data_ptr():
                    out = out.as_subclass(StandIn)  # a view (``.data``, ``view``, indexing) refuses writes too
                    out.label = first.label
        return out


def _stand_in(x):
    """The first :class:`StandIn` in ``x`` (a tensor, or a list or tuple of them), or None."""
    if isinstance(x, StandIn):
        return x
    if isinstance(x, (list, tuple)):
        return next((s for s in map(_stand_in, x) if s is not None), None)
    return None


def _refusal(stand_in, op: str) -> str:
    label = stand_in.label if stand_in is not None else "a param"
    return (
        f"hf_zero stage 2: {op} writes into the grad of {label} after the backward; under stage 2 p.grad only "
        "stands in for the averaged grad, which lives in the optimizer's shards, and only p.grad = None and "
        "zero_() are followed. Write into this rank's piece of it instead (optimizer.local_grad(p), e.g. "
        "optimizer.local_grad(p).nan_to_num_(0.0) on every rank), clip with optimizer.clip_grad_norm_ / "
        "clip_grad_value_, prepare a GradScaler with hf_zero.prepare_grad_scaler, or use stage=1 with "
        "grad_reduce='all_reduce' for code that writes p.grad"
    )


class StandIns:
    """What ``p.grad`` holds between a syncing backward and the step: see [Note: p.grad stands in for the shards]."""

    def __init__(self):
        self._standing: dict[int, tuple] = {}  # param index -> (the param, its stand-in in p.grad, its plain alias, its version then)
        self._kept: dict[int, tuple] = {}  # (stand-in, plain alias): reused from one backward to the next while untouched
        self._placed: tuple | None = None  # (per param of the table: its stand-in or None, the plain aliases, their versions)
        # The last placing that put a kept stand-in in every candidate's p.grad, to do again in one pass:
        # (params, candidates, the params chosen, their stand-ins, :attr:`_standing` then, :attr:`_placed` then).
        self._again: tuple | None = None

    def __bool__(self) -> bool:
        return bool(self._standing)

    def untouched(self, params) -> bool:
        """Whether every one of ``params`` (the table's) holds in ``p.grad`` what :meth:`place` put there (its
        stand-in, unchanged, or None): then :meth:`settle` finds nothing and nothing was left unreduced. One pass of
        C-level reads over the params, where those two look at each one in Python."""
        placed = self._placed
        return (placed is not None and len(placed[0]) == len(params) and all(map(is_, map(_GRAD, params), placed[0]))
                and versions_of(placed[1]) == placed[2])

    def holds(self, i: int, p: torch.Tensor) -> bool:
        """Whether ``p.grad`` (param ``i``) is its stand-in."""
        return i in self._standing and p.grad is self._standing[i][1]

    def place(self, params, candidates, label) -> None:
        """Put a stand-in in ``p.grad`` of each trainable param among ``candidates`` (indices into ``params``, the
        table's) whose ``p.grad`` is None; ``label(i)``: param i's name."""
        if self._place_again(params, candidates):
            return
        fresh = not self._standing
        kept, standing, chosen = self._kept, self._standing, list(map(params.__getitem__, candidates))
        for i, p, g, trainable in zip(candidates, chosen, map(_GRAD, chosen), map(_REQUIRES_GRAD, chosen)):
            if g is not None or not trainable:
                continue
            s, plain = kept.get(i, (None, None))
            if s is not None and not version_of(plain):
                try:
                    p.grad = s  # refused where the param's shape, dtype or device is no longer the stand-in's
                except RuntimeError:
                    s = None
            else:
                s = None
            if s is None:
                plain = torch.full((), float("nan"), dtype=p.dtype, device=p.device).expand(p.shape)
                s = plain.as_subclass(StandIn)  # shares plain's version counter, read without __torch_function__
                s.label = label(i)
                kept[i] = (s, plain)
                p.grad = s
            standing[i] = (p, s, plain, 0)  # untouched: its version is 0
        expected = [None] * len(params)  # what untouched() compares: every stand-in standing, placed now or before
        for i, (_, s, _, _) in standing.items():
            expected[i] = s
        self._placed = (expected, tuple(e[2] for e in standing.values()), tuple(e[3] for e in standing.values()))
        self._again = None
        if fresh and len(standing) == len(chosen):  # every candidate took a stand-in: the steady case
            self._again = (params, candidates, tuple(chosen), tuple(standing[i][1] for i in candidates),
                           dict(standing), self._placed)

    def _place_again(self, params, candidates) -> bool:
        """:meth:`place` as the last steady one did, where nothing it looked at one by one has changed (the same
        plan and params, none standing, every candidate's ``p.grad`` None and trainable, no kept stand-in
        zeroed): what a backward's end costs per param is then one assignment. False where it did nothing."""
        again = self._again
        if again is None or again[0] is not params or again[1] is not candidates or self._standing:
            return False
        _, _, chosen, stand_ins, standing, placed = again
        if not (all(map(is_, map(_GRAD, chosen), repeat(None))) and all(map(_REQUIRES_GRAD, chosen))
                and versions_of(placed[1]) == placed[2]):
            return False
        try:
            for p, s in zip(chosen, stand_ins):
                p.grad = s
        except RuntimeError:  # a param's shape, dtype or device is no longer its stand-in's: place() sorts it out
            for p, s in zip(chosen, stand_ins):
                if p.grad is s:
                    p.grad = None
            return False
        self._standing, self._placed = dict(standing), placed
        return True

    def settle(self, table, *, clear: bool) -> list[tuple[int, bool]]:
        """What was done to the stand-ins since they were placed: (param index, zeroed rather than
        dropped) for each set to None (dropped) or zeroed in place; anything else raises. ``clear``:
        a backward starts: take the stand-ins out of ``p.grad`` (autograd accumulates into it)."""
        params, changed, self._placed = table.params, [], None
        for i, (_, s, plain, version) in list(self._standing.items()):
            g = params[i].grad
            if g is s and version_of(plain) == version:
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
            else:  # zeroed: the only write a stand-in lets through
                changed.append((i, True))
                self._standing[i] = (params[i], s, plain, version_of(plain))
            if clear:
                params[i].grad = None
                del self._standing[i]
        return changed

    def clear(self) -> None:
        """The grads are spent (a step, ``zero_grad``, the reducer is gone): the stand-ins leave ``p.grad``."""
        for p, s, _, _ in self._standing.values():
            if p.grad is s:
                p.grad = None
        self._standing, self._placed = {}, None


def refuse_unreduced(table, stand_ins: "StandIns") -> None:
    """Raise if a param holds a grad that was never reduced (not its stand-in)."""
    local = [table.label(i) for i, p in enumerate(table.params)
             if p.requires_grad and p.grad is not None and not stand_ins.holds(i, p)]
    if local:
        raise RuntimeError(
            f"hf_zero stage 2: {local[0]} has a gradient that was never reduced: the last backward before "
            "the step (or clipping) ran under no_sync(), or the grad was set by hand"
        )
