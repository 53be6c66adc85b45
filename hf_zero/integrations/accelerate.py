"""Accelerate integration: :func:`prepare_accelerator`.

Needs no import of accelerate: it works on the ``Accelerator`` object it is given.
"""

from __future__ import annotations

import os
import shutil
from collections import defaultdict

import torch

from .. import reference
from ..optimizer import ZeroBucketOptimizer
from ._backward import attach_grad_averaging, guard_frozen_under_ddp, unwrap_ddp
from ._views import release_views

_HOOKED = "_hf_zero_hooks"
_SHARDED = "_hf_zero_sharded_checkpoints"
_DDP_HINT = (
    "To freeze params during training, build the Accelerator with "
    "kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)], or freeze them before "
    "accelerator.prepare()."
)


def _ours(optimizer) -> ZeroBucketOptimizer | None:
    while optimizer is not None and not isinstance(optimizer, ZeroBucketOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


def _zero_optimizers(accelerator) -> list[ZeroBucketOptimizer]:
    return [o for o in (_ours(opt) for opt in accelerator._optimizers) if o is not None]


def _indexed(accelerator) -> list[tuple[str, ZeroBucketOptimizer]]:
    """``(sharded directory name, optimizer)``, named after Accelerate's optimizer files
    (``optimizer.bin``, ``optimizer_1.bin``, ...)."""
    out = []
    for i, opt in enumerate(accelerator._optimizers):
        ours = _ours(opt)
        if ours is not None:
            out.append(("hf_zero_optimizer" if i == 0 else f"hf_zero_optimizer_{i}", ours))
    return out


def prepare_accelerator(accelerator, *, sharded_checkpoints: bool = False) -> None:
    """Make an ``accelerate.Accelerator`` safe for :class:`~hf_zero.ZeroBucketOptimizer`.

    Call it on every rank right after ``accelerator.prepare(model, optimizer, ...)``
    (again after preparing more models/optimizers; calling it twice is harmless). It

    - averages, at the end of each backward, the grads of params DDP does not reduce
      (params frozen when ``prepare`` built DDP and unfrozen later), so
      ``accelerator.clip_grad_norm_`` and fp16's GradScaler see the same grads on
      every rank;
    - fails early, with what to set, when a param DDP reduces is frozen while DDP was
      built with ``find_unused_parameters=False`` (Accelerate's default);
    - makes ``accelerator.save_state()`` / ``load_state()`` exact and
      ``accelerator.save_model()`` complete: with safetensors (the default) Accelerate
      keeps only one tensor per shared storage, and bucket views share one. On the main
      process ``accelerator.get_state_dict()`` (which both saves use) then returns
      tensors with their own storage; a save-state hook consolidates the optimizer
      state on the main process, and a load-state hook releases the views before
      loading (they are rebuilt, with the loaded values, at the next step).

    With ``sharded_checkpoints=True`` the save-state hook instead has every rank write
    its own state to ``<output_dir>/hf_zero_optimizer`` (``save_sharded``, no gather;
    all ranks must see the directory) and ``optimizer.bin`` is a small reference to it
    (see :mod:`hf_zero.reference`). ``load_state`` loads such a directory whenever the
    checkpoint has one, in either mode, on any number of processes.

    Raises ``ValueError`` when no prepared optimizer is a ZeroBucketOptimizer, or when
    ``save_on_each_node`` is set (one complete optimizer file per node is not
    supported yet).
    """
    optimizers = _zero_optimizers(accelerator)
    if not optimizers:
        raise ValueError(
            "prepare_accelerator: no ZeroBucketOptimizer among the accelerator's prepared optimizers; call "
            "it after accelerator.prepare(model, optimizer, ...)"
        )
    if getattr(accelerator.project_configuration, "save_on_each_node", False):
        raise ValueError(
            "prepare_accelerator: ProjectConfiguration(save_on_each_node=True) is not supported with "
            "ZeroBucketOptimizer; the optimizer state is consolidated on the main process only"
        )
    for opt in optimizers:
        ids = {id(p) for p in opt._params}
        for model in accelerator._models:
            if any(id(p) in ids for p in unwrap_ddp(model).parameters()):
                attach_grad_averaging(model, opt, syncing=lambda: accelerator.sync_gradients)
                guard_frozen_under_ddp(model, opt, find_unused_parameters=_find_unused(accelerator), hint=_DDP_HINT)
    if not getattr(accelerator, _HOOKED, False):
        accelerator.register_save_state_pre_hook(_save_hook(accelerator))
        accelerator.register_load_state_pre_hook(_load_hook(accelerator))
        accelerator.get_state_dict = _owning_get_state_dict(accelerator, accelerator.get_state_dict)
        setattr(accelerator, _HOOKED, True)
    setattr(accelerator, _SHARDED, bool(sharded_checkpoints))


def _find_unused(accelerator) -> bool:
    """The ``find_unused_parameters`` accelerate gives DDP (its default: False)."""
    return bool(getattr(accelerator.ddp_handler, "find_unused_parameters", False))


def _own_storage(state_dict: dict) -> None:
    """Give every tensor that shares storage with a *different* tensor its own copy.

    Exact aliases (tied weights: same data, shape and strides) stay aliases of one
    copy, so Accelerate still drops the duplicates it is meant to drop.
    """
    by_storage: dict[tuple, list[str]] = defaultdict(list)
    for name, t in state_dict.items():
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            by_storage[(t.device, t.untyped_storage().data_ptr())].append(name)
    for names in by_storage.values():
        if len(names) < 2:
            continue
        copies: dict[tuple, torch.Tensor] = {}
        for name in names:
            t = state_dict[name]
            key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
            if key not in copies:
                copies[key] = t.detach().clone()
            state_dict[name] = copies[key]


def _owning_get_state_dict(accelerator, get_state_dict):
    """``accelerator.get_state_dict`` whose result, on the main process (the one that
    writes), holds no bucket views. Accelerate has no hook in ``save_model``, so this
    instance attribute is the one place that covers both ``save_model`` and ``save_state``."""

    def owning(model, *args, **kwargs):
        state_dict = get_state_dict(model, *args, **kwargs)
        if accelerator.is_main_process and isinstance(state_dict, dict):
            _own_storage(state_dict)
        return state_dict

    owning.__doc__ = get_state_dict.__doc__
    return owning


def _save_hook(accelerator):
    def hook(models, weights, output_dir):
        for name, opt in _indexed(accelerator):
            path = os.path.join(output_dir, name)
            if getattr(accelerator, _SHARDED, False):
                opt.save_sharded(path)
                reference.refer(opt, path)
                continue
            if accelerator.is_main_process and os.path.isdir(path):
                shutil.rmtree(path)  # a sharded state of an earlier save here: load_state would take it
            main = 0  # accelerate saves on the process with global rank 0
            opt.consolidate_state_dict(to=main)
            if opt._comm.rank != main:
                # Accelerate calls state_dict() on every rank but writes only the main
                # process's; the others get a state-less dict that is never written.
                opt._consolidated = {}

    return hook


def _load_hook(accelerator):
    def hook(models, input_dir):
        # safetensors' load_model treats params sharing a storage as tied duplicates
        # and reports them as unexpected keys: load into params that own their storage.
        for name, opt in _indexed(accelerator):
            release_views(opt)
            path = os.path.join(input_dir, name)
            # Every rank must take the same branch (load_sharded is a collective).
            tokens = opt._comm.all_gather_object(reference.token_at(path))
            if len(set(tokens)) > 1:
                raise RuntimeError(
                    f"hf_zero: ranks see different sharded optimizer checkpoints in {path!r} (commit tokens "
                    f"per rank: {tokens}); all ranks must see the same directory"
                )
            if tokens[0] is not None:
                # Accelerate then loads optimizer.bin: the reference to this state, a no-op.
                opt.load_sharded(path)
                reference.refer(opt, path)

    return hook
