"""Shims: the only places hf_zero relies on torch / transformers / accelerate internals.

Each shim exists because the library offers no public route for that need; each
checks, when it is first used, that the internals it relies on are there and raises
:class:`CompatError` naming the library and version otherwise (tests/test_compat.py
runs every check, so an upgrade that breaks one fails loudly in CI).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from typing import Any, Callable, Iterator


class CompatError(RuntimeError):
    """A library changed underneath one of hf_zero's shims."""


def _require(owner: Any, name: str, library: str) -> Any:
    if not hasattr(owner, name):
        version = getattr(__import__(library), "__version__", "?")
        raise CompatError(
            f"hf_zero: {library} {version} has no {getattr(owner, '__name__', owner)!r}.{name}, which hf_zero relies "
            "on; please report this with your versions of hf_zero, torch, transformers and accelerate"
        )
    return getattr(owner, name)


# -- torch ------------------------------------------------------------------------
def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward pass ends.

    No public torch API does this; DDP and FSDP use the same engine call.
    """
    import torch

    engine = _require(torch.autograd.Variable, "_execution_engine", "torch")
    engine.queue_callback(callback)


# -- accelerate --------------------------------------------------------------------
def prepared_optimizers(accelerator) -> list:
    """The optimizers ``accelerator`` prepared, in its order (which names its files
    ``optimizer.bin``, ``optimizer_1.bin``...). Accelerate keeps them in ``_optimizers``."""
    return list(_require(accelerator, "_optimizers", "accelerate"))


def prepared_models(accelerator) -> list:
    """The models ``accelerator`` prepared (``_models``)."""
    return list(_require(accelerator, "_models", "accelerate"))


_AFTER_PREPARE = "_hf_zero_after_prepare"


def after_prepare(accelerator_class: type, callback: Callable[[Any, Any], Any]) -> None:
    """Call ``callback(accelerator, prepared)`` after every ``prepare_model`` and
    ``prepare_optimizer`` of ``accelerator_class`` (``prepare`` goes through them), with
    what the method returned (``_models`` keeps the model unwrapped: the returned one is
    the DistributedDataParallel). Accelerate has no hook there. Idempotent."""
    for name in ("prepare_model", "prepare_optimizer"):
        method = _require(accelerator_class, name, "accelerate")
        if getattr(method, _AFTER_PREPARE, False):
            continue

        def wrap(method):
            @functools.wraps(method)
            def prepared(self, *args, **kwargs):
                result = method(self, *args, **kwargs)
                callback(self, result)
                return result

            setattr(prepared, _AFTER_PREPARE, True)
            return prepared

        setattr(accelerator_class, name, wrap(method))


# -- transformers -------------------------------------------------------------------
_CREATING: contextvars.ContextVar = contextvars.ContextVar("hf_zero_creating_trainer", default=None)
_RESUMED: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
_TRAINER_WRAPPED = "_hf_zero_wrapped"


def creating_trainer():
    """The Trainer whose ``create_optimizer`` is running (None outside it). Trainer
    calls an optimizer factory with the model only; hf_zero needs the Trainer's
    (possibly overridden) ``get_decay_parameter_names``."""
    return _CREATING.get()


def resumed_from(optimizer) -> str | None:
    """The checkpoint directory the Trainer holding ``optimizer`` (or a wrapper of it)
    loaded it from in the running ``train(resume_from_checkpoint=...)``, or None.
    Trainer passes that directory to no callback."""
    return _RESUMED.get(optimizer)


def watch_trainer(trainer_class: type) -> None:
    """Wrap ``create_optimizer`` (to expose :func:`creating_trainer`) and
    ``_load_optimizer_and_scheduler(checkpoint)`` (to record :func:`resumed_from`).
    Idempotent."""
    create = _require(trainer_class, "create_optimizer", "transformers")
    if not getattr(create, _TRAINER_WRAPPED, False):

        @functools.wraps(create)
        def create_optimizer(self, *args, **kwargs):
            with _set(_CREATING, self):
                return create(self, *args, **kwargs)

        setattr(create_optimizer, _TRAINER_WRAPPED, True)
        trainer_class.create_optimizer = create_optimizer

    load = _require(trainer_class, "_load_optimizer_and_scheduler", "transformers")
    if not getattr(load, _TRAINER_WRAPPED, False):

        @functools.wraps(load)
        def _load_optimizer_and_scheduler(self, checkpoint, *args, **kwargs):
            opt = self.optimizer
            for _ in range(8):  # the optimizer and whatever it wraps (Accelerate's wrapper)
                if opt is None or not isinstance(checkpoint, str):
                    break
                _RESUMED[opt] = checkpoint
                opt = getattr(opt, "optimizer", None)
            return load(self, checkpoint, *args, **kwargs)

        setattr(_load_optimizer_and_scheduler, _TRAINER_WRAPPED, True)
        trainer_class._load_optimizer_and_scheduler = _load_optimizer_and_scheduler


@contextlib.contextmanager
def _set(var: contextvars.ContextVar, value) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)
