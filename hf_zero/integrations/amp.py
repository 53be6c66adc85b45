"""fp16 loss scaling with ``torch.amp.GradScaler`` over stage 2's sharded grads.

[Note: GradScaler over sharded grads]
torch's GradScaler finds an optimizer's grads by walking ``optimizer.param_groups`` and
reading ``p.grad``, in one method, ``_unscale_grads_``: ``unscale_`` (and so ``step``
without an explicit ``unscale_``) calls it, and ``step`` (skip on inf) and ``update``
(back off or grow the scale) read the found-inf record it returns. Under stage 2 ``p.grad``
only stands in for the sharded grads after the backward (a NaN expanded to the param's
shape: [Note: p.grad stands in for the shards] in _stage2/stand_ins.py), so the scaler's in-place
unscale of it raises ("more than one element of the written-to tensor refers to a single
memory location"); the grads it must unscale are the shards.

torch's FSDP ``ShardedGradScaler`` is a subclass that overrides ``_unscale_grads_`` (for
sharded grads) and all-reduces found_inf in ``unscale_``. hf_zero overrides the same one
method, but on the scaler *instance* (:func:`prepare_grad_scaler`, through the
version-checked ``_compat.route_unscale``), so users keep torch's own class and
Accelerate's scaler (which Accelerate builds itself) works unchanged. For a stage-2
ZeroBucketOptimizer, the method hands the optimizer the scaler's ``inv_scale`` and
``found_inf``: each rank checks and unscales its own shards and one MAX all-reduce of the
flag runs inside the same call, so the record ``step`` and ``update`` read is already
agreed: every rank skips the same steps and moves its scale the same way, with no
further change to torch's state machine. Any other optimizer goes to torch's method.

Not chosen: ``_step_supports_amp_scaling`` (the optimizer unscales inside ``step``, as
torch's fused Adam does): ``unscale_`` before clipping ignores it and ``update`` would
still find no inf check recorded; a subclass of GradScaler: users would have to swap
classes, and Accelerate's scaler is not ours to replace.

A skipped step never reaches ``optimizer.step()``: the unscaled (non-finite) shards stay
until ``zero_grad()`` or the next backward, which drops them first (stage 2's step
consumes its shards likewise), so a skipped step leaves params and optimizer state
untouched and the next step sees only new grads.
"""

from __future__ import annotations

from .._optimizer import ZeroBucketOptimizer
from . import _compat


def prepare_grad_scaler(scaler):
    """Make ``scaler`` (a ``torch.amp.GradScaler``, this instance) unscale and inf-check the
    sharded grads of a ``ZeroBucketOptimizer(..., stage=2)``; returns ``scaler``.

    Needed in a plain loop only (Accelerate's scaler, and so Trainer's with ``fp16=True``, is
    prepared by hf_zero when it prepares a stage-2 optimizer). ``scaler.unscale_(opt)``,
    ``scaler.step(opt)`` and ``scaler.update()`` then behave as under DDP: the grads the
    optimizer steps (and ``opt.clip_grad_norm_`` clips after ``unscale_``) are unscaled, and an
    inf/NaN in any rank's grads skips the step on every rank and backs off every rank's scale.
    Other optimizers (stage 1 included) are unscaled by torch as before. Without it, torch's
    GradScaler unscales the ``p.grad`` stand-ins of stage 2 in place, which raises
    (``RuntimeError: unsupported operation: more than one element of the written-to tensor
    ...``)."""  # how: [Note: GradScaler over sharded grads]
    _compat.route_unscale(scaler, _unscale_sharded)
    return scaler


def _unscale_sharded(optimizer, inv_scale, found_inf, allow_fp16):
    """The route: a stage-2 ZeroBucketOptimizer's shards, else None (torch's own ``_unscale_grads_``)."""
    if not (isinstance(optimizer, ZeroBucketOptimizer) and optimizer.gradient_path.stage == 2):
        return None
    optimizer.gradient_path.unscale_(inv_scale, found_inf, allow_fp16=allow_fp16)
    return {found_inf.device: found_inf}
