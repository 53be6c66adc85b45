"""Route ``accelerator.clip_grad_norm_`` / ``clip_grad_value_`` to the optimizer.

With ``grad_reduce="reduce_scatter"`` a rank's grads are only valid in the ranges it
owns between backward and step (the note in hf_zero/_scatter_hook.py), so torch's
``clip_grad_norm_`` over full grads would return a different, wrong norm on each rank.
Trainer clips (and computes its logged ``grad_norm``) with
``accelerator.clip_grad_norm_(model.parameters(), max_norm)``; these instance-level
wrappers send that to :meth:`~hf_zero.ZeroBucketOptimizer.clip_grad_norm_` (owned
ranges, one scalar all-reduce) after Accelerate's own ``unscale_gradients()``, and
leave every other call to Accelerate.
"""

from __future__ import annotations

from typing import Callable

_ROUTED = "_hf_zero_clipping_routed"


def _sharded_owner(optimizers, params):
    """(the reduce-scattering optimizer holding the params of ``params`` that have a grad, its
    params among them); (None, params) when none holds any. A param the optimizer does not hold
    and that has no grad is left out, as torch's clipping leaves every param without a grad out
    (PEFT: the optimizer holds the trainable params, the loop clips ``model.parameters()``).
    Raises when params with a grad are split between it and others."""
    for opt in optimizers:
        if opt.grad_reduce != "reduce_scatter":
            continue
        held = [opt.gradient_path.param_index(p) is not None for p in params]
        if not any(held):
            continue
        foreign = [p for p, h in zip(params, held) if not h and p.grad is not None]
        if foreign:
            raise ValueError(
                "hf_zero: clip_grad_norm_/clip_grad_value_ got params of a ZeroBucketOptimizer with "
                f"grad_reduce='reduce_scatter' mixed with {len(foreign)} other param(s) that have a grad (the first "
                f"of shape {tuple(foreign[0].shape)}); clip each optimizer's params separately (their grads are only "
                "valid in each rank's own ranges)"
            )
        return opt, [p for p, h in zip(params, held) if h]
    return None, params


def route_clipping(accelerator, optimizers: Callable[[], list]) -> None:
    """Wrap ``accelerator``'s clipping methods once; ``optimizers()`` lists its ZeroBucketOptimizers."""
    if getattr(accelerator, _ROUTED, False):
        return
    clip_norm, clip_value = accelerator.clip_grad_norm_, accelerator.clip_grad_value_

    def clip_grad_norm_(parameters, max_norm, norm_type=2):
        params = [parameters] if hasattr(parameters, "grad") else list(parameters)
        opt, params = _sharded_owner(optimizers(), params)
        if opt is None:
            return clip_norm(params, max_norm, norm_type)
        accelerator.unscale_gradients()
        return opt.clip_grad_norm_(max_norm, norm_type, parameters=params)

    def clip_grad_value_(parameters, clip_value_):
        params = [parameters] if hasattr(parameters, "grad") else list(parameters)
        opt, params = _sharded_owner(optimizers(), params)
        if opt is None:
            return clip_value(params, clip_value_)
        accelerator.unscale_gradients()
        return opt.clip_grad_value_(clip_value_, parameters=params)

    clip_grad_norm_.__doc__ = clip_norm.__doc__
    clip_grad_value_.__doc__ = clip_value.__doc__
    accelerator.clip_grad_norm_ = clip_grad_norm_
    accelerator.clip_grad_value_ = clip_grad_value_
    setattr(accelerator, _ROUTED, True)
