"""Average the gradients DDP does not reduce at the end of each backward, as DDP would.

[Note: unreduced gradients]
DDP reduces only the params that required grad when it was built
(``torch/nn/parallel/distributed.py``; docs/architecture.md, "Unreduced gradients"). A param
unfrozen later keeps a purely local gradient. ZeroBucketOptimizer averages those at
``step()``, which is too late for anything that reads gradients between backward and
step: gradient clipping (the total norm would differ per rank) and GradScaler's
inf/NaN check (ranks would disagree on skipping the step and then hang). So, like DDP,
we average them when the backward ends, from an autograd-engine callback queued by a
hook on the forward's outputs. Averaging is a linear projection, so doing it after
several backwards (gradient accumulation without ``no_sync`` information) still
gives the exact average. Every rank runs the same graph, so every rank queues the
callback in the same backward and the collectives stay in lockstep.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from .._binding import Hook
from .._engine import queue_end_of_backward

_ATTACHED: "weakref.WeakKeyDictionary[torch.nn.Module, object]" = weakref.WeakKeyDictionary()


def _tensors(output):
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, dict):
        for v in output.values():
            yield from _tensors(v)
    elif isinstance(output, (list, tuple)):
        for v in output:
            yield from _tensors(v)


def unwrap_ddp(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside ``DistributedDataParallel`` (``model`` itself otherwise)."""
    while isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return model


def attach_grad_averaging(model: torch.nn.Module, optimizer, *, syncing: Callable[[], bool] | None = None) -> None:
    """Average, at the end of every backward through ``model``, the grads of the
    optimizer's params that DDP does not reduce. Idempotent per ``model``.

    Call when DDP has just been built: the params frozen now are the ones DDP
    will never reduce (``optimizer.mark_ddp_reduced()`` is called here).
    ``syncing`` (read at each forward; the same on every rank) skips the backwards
    DDP does not sync either, i.e. the non-final micro-batches of gradient accumulation.
    The hook is the optimizer's binding's (``optimizer.unbind()`` removes it).
    """
    optimizer.mark_ddp_reduced()
    if optimizer.world_size == 1:
        return
    model = unwrap_ddp(model)
    previous = _ATTACHED.pop(model, None)
    if previous is not None:
        previous.remove()
    unreduced = optimizer.unreduced_params()
    if not unreduced:
        return  # DDP reduces every param this optimizer can ever train
    handle = model.register_forward_hook(_Averaging(optimizer, unreduced, syncing))
    _ATTACHED[model] = optimizer.gradient_path.binding.keep(handle)


class _Averaging(Hook):
    """The forward hook of :func:`attach_grad_averaging`: queue the averaging at the end of the backward."""

    __slots__ = ("_opt", "_unreduced", "_syncing")

    def __init__(self, optimizer, unreduced: list, syncing: Callable[[], bool] | None):
        self._opt, self._unreduced, self._syncing = weakref.ref(optimizer), unreduced, syncing

    def __call__(self, module, args, output):
        if not torch.is_grad_enabled() or not any(p.requires_grad for p in self._unreduced):
            return
        if self._syncing is not None and not self._syncing():
            return
        queued = [False]
        opt_ref = self._opt

        def on_output_grad(grad):
            if not queued[0]:
                queued[0] = True

                def run():
                    queued[0] = False
                    opt = opt_ref()
                    if opt is not None:
                        opt.average_unreduced_grads()

                queue_end_of_backward(run)
            return None

        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(on_output_grad)


def guard_frozen_under_ddp(model: torch.nn.Module, optimizer, *, find_unused_parameters: bool, hint: str) -> None:
    """Fail at the forward, on every rank, when a param DDP reduces has been frozen while
    DDP was built with ``find_unused_parameters=False``: DDP would raise an opaque error
    one iteration later, after a backward that left the other grads of its bucket
    unreduced. Call when DDP has just been built; idempotent per ``model``; ``hint``
    says what to set instead. The hook is the optimizer's binding's."""
    model = unwrap_ddp(model)
    previous = _GUARDED.pop(model, None)
    if previous is not None:
        previous.remove()
    if find_unused_parameters or optimizer.world_size == 1 or optimizer.gradient_path.stage == 2:
        return  # stage 2 has no DDP: its own reducer re-plans at a freeze
    reduced = [i for i, p in enumerate(optimizer.params) if p.requires_grad]
    handle = model.register_forward_pre_hook(_FreezeGuard(optimizer, reduced, hint))
    _GUARDED[model] = optimizer.gradient_path.binding.keep(handle)


class _FreezeGuard(Hook):
    """The forward pre-hook of :func:`guard_frozen_under_ddp`."""

    __slots__ = ("_opt", "_reduced", "_hint")

    def __init__(self, optimizer, reduced: list[int], hint: str):
        self._opt, self._reduced, self._hint = weakref.ref(optimizer), reduced, hint

    def __call__(self, module, args) -> None:
        opt = self._opt()
        if opt is None or not torch.is_grad_enabled():
            return
        params = opt.params
        frozen = [i for i in self._reduced if not params[i].requires_grad]
        if frozen:
            raise ValueError(
                f"hf_zero: {opt.param_label(frozen[0])} was frozen after DistributedDataParallel was built with "
                f"find_unused_parameters=False, which DDP cannot handle. {self._hint}"
            )


_GUARDED: "weakref.WeakKeyDictionary[torch.nn.Module, object]" = weakref.WeakKeyDictionary()
