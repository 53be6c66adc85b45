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
follow). Reading a stand-in gives NaN, and an in-place op other than ``zero_()`` on it
raises (torch refuses writes to an expanded tensor): code that reads or scales ``p.grad``
between backward and step (``torch.nn.utils.clip_grad_norm_``) fails loudly rather than
seeing nothing. The step and ``zero_grad`` take the stand-ins out again.
"""

from __future__ import annotations

import torch

from .._engine import version_of


class StandIns:
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


def refuse_unreduced(table, stand_ins: "StandIns") -> None:
    """Raise if a param holds a grad that was never reduced (not its stand-in)."""
    local = [table.label(i) for i, p in enumerate(table.params)
             if p.requires_grad and p.grad is not None and not stand_ins.holds(i, p)]
    if local:
        raise RuntimeError(
            f"hf_zero stage 2: {local[0]} has a gradient that was never reduced: the last backward before "
            "the step (or clipping) ran under no_sync(), or the grad was set by hand"
        )
