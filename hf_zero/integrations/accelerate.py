"""Accelerate integration: an ``Accelerator`` that prepares a ZeroBucketOptimizer is
made safe for it, with no call needed (:func:`prepare_accelerator` stays as the
explicit form and to turn on sharded checkpoints).

The wiring runs after every ``Accelerator.prepare_model`` / ``prepare_optimizer``
(which ``prepare`` calls too), so the model and the optimizer may be prepared in any
order or in separate calls. :func:`install` wraps those two methods when
``accelerate.accelerator`` is imported (:mod:`hf_zero._autoload`).
"""

from __future__ import annotations

import os
import shutil
import weakref
from dataclasses import dataclass, field

import torch

from .. import _offline
from .._binding import claimants
from .._views import own_storage_watched, separate_views
from .._optimizer import ZeroBucketOptimizer
from . import _compat
from ._backward import attach_grad_averaging, guard_frozen_under_ddp, unwrap_ddp
from ._clipping import route_clipping
from ._refusals import refusal, unsupported
from .amp import prepare_grad_scaler

_DDP_HINT = (
    "To freeze params during training, build the Accelerator with "
    "kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)], or freeze them before "
    "accelerator.prepare()."
)


@dataclass
class _Wiring:
    sharded_checkpoints: bool | None = None  # None: sharded when the optimizer shards over several ranks
    hooked: bool = False
    # (sharded directory, optimizer file) that save_state streams into a plain file once it has written
    plain_due: list = field(default_factory=list)
    # DistributedDataParallel wrappers prepare_model returned (weakly; _models keeps the inner module)
    ddps: "weakref.WeakSet" = field(default_factory=weakref.WeakSet)
    # stage-2 optimizers among the objects of the running prepare() (their models are not DDP-wrapped)
    stage2: "weakref.WeakSet" = field(default_factory=weakref.WeakSet)


# accelerator -> how it is wired (weak: an Accelerator going away takes its entry along)
_WIRED: "weakref.WeakKeyDictionary[object, _Wiring]" = weakref.WeakKeyDictionary()


def ours(optimizer) -> ZeroBucketOptimizer | None:
    """The ZeroBucketOptimizer inside Accelerate's wrapper(s), or None."""
    for _ in range(8):
        if optimizer is None or isinstance(optimizer, ZeroBucketOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def _indexed(accelerator) -> list[tuple[str, ZeroBucketOptimizer]]:
    """``(sharded directory name, optimizer)``, named after Accelerate's optimizer files
    (``optimizer.bin``, ``optimizer_1.bin``, ...)."""
    out = []
    for i, opt in enumerate(_compat.prepared_optimizers(accelerator)):
        mine = ours(opt)
        if mine is not None:
            out.append(("hf_zero_optimizer" if i == 0 else f"hf_zero_optimizer_{i}", mine))
    return out


def prepare_accelerator(accelerator, *, sharded_checkpoints: bool | None = None) -> None:
    """Make an ``accelerate.Accelerator`` safe for :class:`~hf_zero.ZeroBucketOptimizer`.

    Optional: hf_zero does the same by itself whenever an Accelerator prepares a
    ZeroBucketOptimizer (with hf_zero imported or installed). Call it on every rank,
    after ``accelerator.prepare(...)``, to choose ``sharded_checkpoints``. The wiring

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
      tensors with their own storage, and a load-state hook releases the views before
      loading (they are rebuilt, with the loaded values, at the next step);
    - makes ``save_state()`` gather nothing: every rank writes its own optimizer state to
      ``<output_dir>/hf_zero_optimizer`` (``save_sharded``; all ranks must see the
      directory) and ``optimizer.bin`` is a small reference to it. ``load_state`` loads
      such a directory whenever the checkpoint has one, on any number of processes.

    - unbinds every ZeroBucketOptimizer (``optimizer.unbind()``) in ``end_training()``,
      ``free_memory()`` and ``clear()``: the model keeps no hook or attribute of hf_zero's.

    ``sharded_checkpoints``: ``None`` (default) as above when the optimizer shards over
    several ranks, a plain ``optimizer.bin`` on one process (nothing to gather); ``True``:
    always sharded; ``False``: always a plain PyTorch ``optimizer.bin``, which the main
    process streams from the sharded files once ``save_state`` has written them (16 MiB
    at a time), then removes them.

    Raises ``ValueError`` when no prepared optimizer is a ZeroBucketOptimizer, when
    ``save_on_each_node`` is set (one optimizer checkpoint per node is not supported
    yet), or when the Accelerator runs one process while the optimizer shards over
    several ranks.
    """
    if not _wire(accelerator):
        raise ValueError(
            "prepare_accelerator: no ZeroBucketOptimizer among the accelerator's prepared optimizers; call "
            "it after accelerator.prepare(model, optimizer, ...)"
        )
    _WIRED[accelerator].sharded_checkpoints = None if sharded_checkpoints is None else bool(sharded_checkpoints)


def install(accelerator_class) -> None:
    """Wire every ``accelerator_class`` instance after each ``prepare_model`` /
    ``prepare_optimizer``. Idempotent; :mod:`hf_zero._autoload` calls it when
    ``accelerate.accelerator`` has been imported."""
    _compat.before_prepare(accelerator_class, _before_prepare)
    _compat.after_prepare(accelerator_class, _wire)
    _compat.prepare_without_ddp(accelerator_class, _without_ddp)


def _before_prepare(accelerator, objects=()) -> None:
    """Before ``prepare(*objects)`` with a ZeroBucketOptimizer among them (or already
    prepared): refuse the engines hf_zero cannot serve, and, when a model is among them,
    have DDP keep each ``p.grad`` as a view of its bucket (``gradient_as_bucket_view``):
    otherwise the grads are held twice, in ``p.grad`` and in DDP's buckets."""
    _end_older_runs(accelerator, objects)
    if not any(ours(o) is not None for o in (*objects, *_compat.prepared_optimizers(accelerator))):
        return
    _compat.warn_untested()
    _refuse_engines(accelerator)
    wiring = _WIRED.setdefault(accelerator, _Wiring())
    wiring.stage2 = weakref.WeakSet(o for o in map(ours, objects) if o is not None and _stage2(o))
    if any(isinstance(o, torch.nn.Module) for o in objects):
        _grads_as_bucket_views(accelerator)


# binding -> the accelerator whose wiring bound it (both weakly)
_BOUND_BY: "weakref.WeakKeyDictionary[object, weakref.ref]" = weakref.WeakKeyDictionary()


def _end_older_runs(accelerator, objects) -> None:
    """[Note: a newer binding takes over] for runs without an optimizer of hf_zero's: a model being prepared
    starts a run, so the bindings over its params that another Accelerator's wiring made (a run interrupted
    without ``end_training()``, whose objects a notebook keeps) end, and are not bound again."""
    params = [p for o in objects if isinstance(o, torch.nn.Module) for p in unwrap_ddp(o).parameters()]
    for binding in claimants(params):
        ref = _BOUND_BY.get(binding)
        if ref is not None and ref() is not accelerator:
            binding.take_over()


def _taken_over_by(optimizer) -> None:
    """A newer optimizer that is not hf_zero's, prepared over params an hf_zero binding serves, takes them over."""
    params = [p for g in getattr(optimizer, "param_groups", ()) for p in g["params"]]
    for binding in claimants(params):
        binding.take_over()


def _stage2(opt: ZeroBucketOptimizer) -> bool:
    return opt.gradient_path.stage == 2


def _holds(opt: ZeroBucketOptimizer, model: torch.nn.Module) -> bool:
    ids = {id(p) for p in opt.params}
    return any(id(p) in ids for p in unwrap_ddp(model).parameters())


def _without_ddp(accelerator, model) -> bool:
    """Whether ``prepare_model`` must not wrap ``model`` in DDP: a stage-2 optimizer (prepared
    already, or prepared in the same ``prepare`` call) holds its params."""
    wiring = _WIRED.get(accelerator)
    candidates = [*map(ours, _compat.prepared_optimizers(accelerator)), *(wiring.stage2 if wiring else ())]
    return any(opt is not None and _stage2(opt) and _holds(opt, model) for opt in candidates)


# stage-2 optimizer -> bind_module keywords the Trainer's optim_args chose (local_accumulation)
_BIND_OPTIONS: "weakref.WeakKeyDictionary[ZeroBucketOptimizer, dict]" = weakref.WeakKeyDictionary()


def set_bind_options(opt: ZeroBucketOptimizer, **options) -> None:
    """Keywords for the ``bind_module`` call the wiring makes for ``opt`` (stage 2)."""
    _BIND_OPTIONS[opt] = options


def _bind_stage2(accelerator, opt: ZeroBucketOptimizer, model: torch.nn.Module) -> None:
    """Stage 2 reduces the grads itself (no DDP): bind ``model`` with the Accelerator's DDP settings
    (``DistributedDataParallelKwargs``: ``bucket_cap_mb``, ``broadcast_buffers``; Trainer fills them from
    ``ddp_bucket_cap_mb`` / ``ddp_broadcast_buffers``). Every micro-batch is reduced into the shards unless
    ``local_accumulation`` was chosen (``accumulate`` / Trainer call ``no_sync`` on all but the last).
    A model the user bound already keeps its binding."""
    handler = getattr(accelerator, "ddp_handler", None)
    hook = getattr(getattr(handler, "comm_hook", None), "value", None)
    if hook not in (None, "no"):
        raise ValueError(
            f"hf_zero: stage=2 does not use DistributedDataParallel, so the DDP communication hook {hook!r} "
            "(DistributedDataParallelKwargs(comm_hook=...)) would never run: remove it, or use stage=1"
        )
    if opt.gradient_path.stage2.bound:
        return
    buffers = getattr(handler, "broadcast_buffers", None)
    options = {"bucket_cap_mb": getattr(handler, "bucket_cap_mb", None) or 25, "local_accumulation": False,
               "broadcast_buffers": True if buffers is None else bool(buffers), **_BIND_OPTIONS.get(opt, {})}
    opt.bind_module(model, **options)
    mark = _compat.prepared_mark(model)
    if mark is not None:  # Accelerate marked the user's own module: unmarked when the binding ends
        opt.gradient_path.binding.adopt_attribute(model, mark)


def _refuse_engines(accelerator) -> None:
    what = unsupported(distributed_type=accelerator.distributed_type,
                       parallelism_config=getattr(accelerator, "parallelism_config", None))
    if what is not None:
        raise refusal(what, where="Accelerator.prepare")


def _grads_as_bucket_views(accelerator) -> None:
    """Set ``gradient_as_bucket_view=True`` in the DDP kwargs ``prepare_model`` will use
    (``accelerator.ddp_handler``, a ``DistributedDataParallelKwargs``; Accelerate 1.3 to
    1.15 and Trainer, which puts its own there, read it when they build DDP). The user's
    handler object is copied, not changed."""
    import dataclasses

    from accelerate.utils import DistributedDataParallelKwargs

    handler = getattr(accelerator, "ddp_handler", None)
    if handler is None:
        accelerator.ddp_handler = DistributedDataParallelKwargs(gradient_as_bucket_view=True)
    elif not handler.gradient_as_bucket_view:
        accelerator.ddp_handler = dataclasses.replace(handler, gradient_as_bucket_view=True)


def _wire(accelerator, prepared=None) -> bool:
    """Wire ``accelerator`` for the ZeroBucketOptimizers it prepared so far; return
    whether it has any. Idempotent (safe after every prepare call). ``prepared``: what
    the prepare call just returned. In order: refuse what cannot run, bind each optimizer
    (its binding holds what goes on the model: [Note: a binding ends with its run]), and
    hook the accelerator once (saves, loads, clipping, the end of the run)."""
    wiring = _WIRED.setdefault(accelerator, _Wiring())
    if isinstance(prepared, torch.nn.parallel.DistributedDataParallel):
        wiring.ddps.add(prepared)
    if isinstance(prepared, torch.optim.Optimizer) and ours(prepared) is None:
        _taken_over_by(getattr(prepared, "optimizer", prepared))
    optimizers = [o for o in map(ours, _compat.prepared_optimizers(accelerator)) if o is not None]
    if not optimizers:
        return False
    _refuse_run(accelerator, optimizers)
    for opt in optimizers:
        _bind(accelerator, wiring, opt)
    if not wiring.hooked:
        _hook_accelerator(accelerator)
        wiring.hooked = True
    return True


def _refuse_run(accelerator, optimizers: list[ZeroBucketOptimizer]) -> None:
    """Refuse, before anything is bound, the runs hf_zero cannot serve."""
    _refuse_engines(accelerator)
    if getattr(accelerator.project_configuration, "save_on_each_node", False):
        raise ValueError(
            "hf_zero: ProjectConfiguration(save_on_each_node=True) is not supported with "
            "ZeroBucketOptimizer; its optimizer state is saved by every rank into one directory that all "
            "ranks must see"
        )
    for opt in optimizers:
        if accelerator.num_processes == 1 and opt.world_size > 1:
            raise ValueError(
                f"hf_zero: Accelerate runs this process alone (num_processes=1, distributed_type="
                f"{accelerator.distributed_type}) but torch.distributed has {opt.world_size} ranks: "
                "ZeroBucketOptimizer would shard the state over processes that do not average gradients. "
                "Launch with `accelerate launch --multi_gpu --num_processes N` (on CPU set ACCELERATE_USE_CPU=1), "
                "or pass process_group= to shard over a group of your choice."
            )


def _bind(accelerator, wiring: _Wiring, opt: ZeroBucketOptimizer) -> None:
    """Bind ``opt`` to what the accelerator prepared: its GradScaler (stage 2), the DDP wrapping its params
    (stage 1) or the unwrapped model holding them (stage 2), and the grad averaging and freeze guard on
    that model (stage 1). Idempotent. One taken over by a newer binding over its params (a later prepared
    optimizer: [Note: a newer binding takes over] in hf_zero/_binding.py) stays unbound."""
    if opt.gradient_path.taken_over:
        return
    if _stage2(opt) and getattr(accelerator, "scaler", None) is not None:
        # fp16: the scaler unscales and inf-checks the shards ([Note: GradScaler over sharded grads], amp.py)
        prepare_grad_scaler(accelerator.scaler)
    ids = {id(p) for p in opt.params}
    for ddp in list(wiring.ddps):
        if not any(id(p) in ids for p in ddp.module.parameters()):
            continue
        if _stage2(opt):
            raise ValueError(
                "hf_zero: stage=2 takes gradient synchronisation over from DistributedDataParallel, but an "
                "earlier accelerator.prepare call wrapped the model holding this optimizer's params in DDP "
                "before the optimizer was prepared. Prepare them in one call, accelerator.prepare(model, "
                "optimizer, ...), or prepare the optimizer before the model"
            )
        # Reduce-scatter by default (clipping is routed below); the overlapped sync
        # stays opt-in, as a loop may read params anywhere (docs/gradient_path.md),
        # and waits per transformer block when on.
        opt.bind_ddp(
            ddp, grad_reduce_default="reduce_scatter", overlap_default=False,
            syncs_every_backward=_syncs_each_batch(accelerator),
            grad_scaler=getattr(accelerator, "scaler", None) is not None,
            overlap_units=_compat.block_classes(ddp.module),
        )
    _BOUND_BY[opt.gradient_path.binding] = weakref.ref(accelerator)
    for model in _compat.prepared_models(accelerator):
        if _stage2(opt) and _holds(opt, model):
            _bind_stage2(accelerator, opt, model)
        elif any(id(p) in ids for p in unwrap_ddp(model).parameters()):
            attach_grad_averaging(model, opt, syncing=lambda: accelerator.sync_gradients)
            guard_frozen_under_ddp(model, opt, find_unused_parameters=_find_unused(accelerator), hint=_DDP_HINT)


def _hook_accelerator(accelerator) -> None:
    """Once per accelerator: its save / load hooks, ``get_state_dict`` giving views their own storage,
    clipping routed to the optimizers, ``save_state`` writing plain files when asked, and the run's ends
    (``end_training``, ``free_memory``, ``clear``) unbinding every optimizer ([Note: a binding ends with its
    run]). Accelerate has no hook for most of these: instance attributes wrapping its methods."""
    accelerator.register_save_state_pre_hook(_save_hook(accelerator))
    accelerator.register_load_state_pre_hook(_load_hook(accelerator))
    accelerator.get_state_dict = _owning_get_state_dict(accelerator, accelerator.get_state_dict)
    route_clipping(accelerator, lambda: [opt for _, opt in _indexed(accelerator)])
    for name in ("end_training", "free_memory", "clear"):
        if hasattr(accelerator, name):
            setattr(accelerator, name, _unbinding(accelerator, getattr(accelerator, name)))
    accelerator.save_state = _plain_after_save_state(accelerator, accelerator.save_state)


def _syncs_each_batch(accelerator) -> bool:
    """Whether gradient accumulation syncs every micro-batch (``sync_each_batch``)."""
    plugin_kwargs = getattr(getattr(accelerator, "gradient_state", None), "plugin_kwargs", None) or {}
    return bool(plugin_kwargs.get("sync_each_batch", False)) and accelerator.gradient_accumulation_steps > 1


def _unbinding(accelerator, ends):
    """``end_training`` / ``free_memory`` / ``clear`` that first unbinds every ZeroBucketOptimizer the
    accelerator prepared (waiting for an overlapped parameter sync: ``end_training`` destroys the
    process group it runs on; ``free_memory`` drops the optimizers)."""

    def unbinding(*args, **kwargs):
        for _, opt in _indexed(accelerator):
            opt.unbind()
        return ends(*args, **kwargs)

    unbinding.__doc__ = ends.__doc__
    return unbinding


def _find_unused(accelerator) -> bool:
    """The ``find_unused_parameters`` accelerate gives DDP (its default: False)."""
    return bool(getattr(accelerator.ddp_handler, "find_unused_parameters", False))


def separate_views_in_state_dict(model: torch.nn.Module, opt: ZeroBucketOptimizer) -> None:
    """Make ``model.state_dict()`` give bucket views storage objects of their own (see
    :func:`hf_zero._views.own_storage`; Trainer saves ``model.state_dict()`` with ``save_pretrained``,
    which would otherwise clone every one of them: the whole model once more), until
    ``opt.unbind()``. Idempotent."""
    separate_views(model, opt.gradient_path.binding)


def _owning_get_state_dict(accelerator, get_state_dict):
    """``accelerator.get_state_dict`` whose result, on the main process (the one that
    writes), holds no bucket views. Accelerate has no hook in ``save_model``, so this
    instance attribute is the one place that covers both ``save_model`` and ``save_state``."""

    def owning(model, *args, **kwargs):
        state_dict = get_state_dict(model, *args, **kwargs)
        if accelerator.is_main_process and isinstance(state_dict, dict):
            own_storage_watched(state_dict, unwrap_ddp(model))
        return state_dict

    owning.__doc__ = get_state_dict.__doc__
    return owning


def sees_one_directory(directory: str) -> bool:
    """Whether every rank sees the files rank 0 writes in ``directory`` (a shared
    filesystem). Collective (default process group): a marker file and two exchanges."""
    import secrets

    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    name = [f".hf_zero-shared-{secrets.token_hex(6)}" if dist.get_rank() == 0 else None]
    if dist.get_rank() == 0:  # written before its name is sent: a rank that has the name can look
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, name[0]), "w"):
            pass
    dist.broadcast_object_list(name, src=0)
    marker = os.path.join(directory, name[0])
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, os.path.exists(marker))
    if dist.get_rank() == 0:
        os.remove(marker)
    return all(seen)


def _sharded_saves(wiring: _Wiring, opt: ZeroBucketOptimizer) -> bool:
    return opt.world_size > 1 if wiring.sharded_checkpoints is None else wiring.sharded_checkpoints


def _save_hook(accelerator):
    def hook(models, weights, output_dir):
        wiring = _WIRED[accelerator]
        for name, opt in _indexed(accelerator):
            path = os.path.join(output_dir, name)
            plain = not _sharded_saves(wiring, opt)
            if opt.world_size > 1 and plain and not sees_one_directory(output_dir):
                opt.consolidate_state_dict(to=0, device="cpu")  # no shared directory: gathered, as before
                continue
            if opt.world_size > 1 or not plain:  # every rank writes its own: no gather
                opt.save_sharded(path)
                opt.refer_to_sharded(path)
                if plain:  # optimizer.bin, optimizer_1.bin, ... as Accelerate names them
                    wiring.plain_due.append((path, os.path.join(output_dir, f"optimizer{name[len('hf_zero_optimizer'):]}.bin")))
                continue
            if accelerator.is_main_process and os.path.isdir(path):
                shutil.rmtree(path)  # a sharded state of an earlier save here: load_state would take it
            opt.consolidate_state_dict(to=0)  # one process: the state itself, no copy

    return hook


def write_plain_files(due: list[tuple[str, str]]) -> None:
    """Write each ``(sharded directory, plain file)`` of ``due`` (this rank's share: the
    writing rank's list, empty elsewhere) as a plain optimizer state dict streamed from the
    directory, then remove the directory; every rank learns whether any rank failed
    (collective: every rank calls it, ``due`` empty or not)."""
    import torch.distributed as dist

    error = None
    try:
        for path, out in due:
            _offline.write_plain_optimizer(path, out)
            shutil.rmtree(path)
    except Exception as e:  # every rank must reach the exchange below
        error = f"rank {dist.get_rank()}: {type(e).__name__}: {e}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    if any(errors):
        raise RuntimeError("hf_zero: writing the plain optimizer file failed:\n  " + "\n  ".join(e for e in errors if e))


def _plain_after_save_state(accelerator, save_state):
    """``save_state`` that, with ``sharded_checkpoints=False`` over several ranks, then has
    the main process replace each ``optimizer*.bin`` it wrote (a reference) by the plain
    state dict streamed from the sharded files, and remove those; every rank learns
    whether that failed. Accelerate has no hook after its writes (instance attribute)."""

    def saving(*args, **kwargs):
        wiring = _WIRED[accelerator]
        wiring.plain_due = []
        result = save_state(*args, **kwargs)
        due, wiring.plain_due = wiring.plain_due, []
        if due:
            write_plain_files(due if accelerator.is_main_process else [])
        return result

    saving.__doc__ = save_state.__doc__
    return saving


def _load_hook(accelerator):
    def hook(models, input_dir):
        # safetensors' load_model treats params sharing a storage as tied duplicates
        # and reports them as unexpected keys: load into params that own their storage.
        for name, opt in _indexed(accelerator):
            opt.release_views()
            # Accelerate then loads optimizer.bin: the reference to this state, a no-op.
            opt.load_sharded_if_present(os.path.join(input_dir, name))

    return hook
