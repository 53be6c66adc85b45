"""Shims: the only places hf_zero relies on torch / transformers / accelerate internals.

Each shim exists because the library offers no public route for that need; each
checks, when it is first used, the shape of what it patches or reads (the attributes
are there, the methods take the parameters it was written against) and otherwise
raises :class:`CompatError` naming the shim, the library and its version, and the
range CI tested (tests/test_compat.py runs every check, so an upgrade that breaks one
fails loudly in CI).

[Note: the tested range]
setup.cfg sets only lower bounds for transformers and accelerate: a newer release
installs. :data:`TESTED` is the range CI tests (.ci/floor the low end, .ci/run the
high end, pinned by .ci/constraints.txt; tests/test_compat.py checks the three agree).
Using hf_zero with a release outside it warns once per process
(:func:`warn_untested`); a shim whose target changed refuses instead of misbehaving.

Everything that differs between the transformers versions in that range is here too,
one version-checked shim per need, each naming the versions it targets.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import warnings
import weakref
from types import SimpleNamespace
from typing import Any, Callable, Iterator

# The versions CI tests, low and high end ([Note: the tested range]).
TESTED = {"transformers": ("4.57.1", "5.25.0"), "accelerate": ("1.3.0", "1.16.0")}


class CompatError(RuntimeError):
    """A library changed underneath one of hf_zero's shims."""


class UntestedVersionWarning(UserWarning):
    """hf_zero runs with a transformers or accelerate release outside the range CI tested."""


def _version_of(library: str) -> str:
    return getattr(__import__(library), "__version__", "?")


def _pin(library: str) -> str:
    low, high = TESTED[library]
    return f"pip install '{library}>={low},<={high}'"


def _refusal(shim: str, library: str, what: str) -> CompatError:
    """The error of a shim whose target changed: the shim, the library's version, what differs, and the fix."""
    low, high = TESTED.get(library, (None, None))
    tested = (f"hf_zero is tested with {library} {low} to {high}: install a version in that range ({_pin(library)})"
              if low else "")
    return CompatError(
        f"hf_zero ({shim}): {library} {_version_of(library)} {what}, which hf_zero relies on; {tested}"
        f"{', and ' if tested else ''}please report this with your versions of hf_zero, torch, transformers and "
        "accelerate"
    )


def _require(owner: Any, name: str, library: str, shim: str = "") -> Any:
    if not hasattr(owner, name):
        raise _refusal(shim or name, library, f"has no {getattr(owner, '__name__', type(owner).__name__)!r}.{name}")
    return getattr(owner, name)


def _check_params(shim: str, library: str, function: Callable, expected: tuple[str, ...], *,
                  prefix: bool = False) -> inspect.Signature:
    """``function``'s signature, refused unless its parameters are ``expected`` (``prefix``: begin with them)."""
    signature = inspect.signature(function)
    names = tuple(signature.parameters)
    if (names[: len(expected)] if prefix else names) != expected:
        raise _refusal(shim, library, f"{getattr(function, '__qualname__', function)} takes {names}, not "
                       f"{expected}{' first' if prefix else ''}")
    return signature


_WARNED: set[str] = set()


def warn_untested() -> None:
    """Warn once per process for each of transformers and accelerate (those imported) whose version is outside
    :data:`TESTED`. Called where hf_zero is put to use (a Trainer building ``zero_bucket``, an Accelerator
    preparing a ZeroBucketOptimizer), not at import: a process that merely has hf_zero installed is not told."""
    import sys

    from packaging.version import InvalidVersion, Version

    for library, (low, high) in TESTED.items():
        if library in _WARNED or library not in sys.modules:
            continue
        version = _version_of(library)
        try:
            outside = not Version(low) <= Version(version) <= Version(high)
        except InvalidVersion:
            outside = True
        if outside:
            _WARNED.add(library)
            warnings.warn(
                f"hf_zero was tested with {library} {low} to {high}, not {version}. Its shims check what they "
                f"patch and refuse with an error if it changed; if something else misbehaves, {_pin(library)} and "
                "report it.", UntestedVersionWarning, stacklevel=3)


# -- accelerate --------------------------------------------------------------------
def prepared_optimizers(accelerator) -> list:
    """The optimizers ``accelerator`` prepared, in its order (which names its files
    ``optimizer.bin``, ``optimizer_1.bin``...). Accelerate keeps them in ``_optimizers``."""
    return _prepared(accelerator, "_optimizers", "prepared_optimizers")


def prepared_models(accelerator) -> list:
    """The models ``accelerator`` prepared (``_models``)."""
    return _prepared(accelerator, "_models", "prepared_models")


def _prepared(accelerator, name: str, shim: str) -> list:
    held = _require(accelerator, name, "accelerate", shim)
    if not isinstance(held, list):
        raise _refusal(shim, "accelerate", f"keeps Accelerator.{name} as a {type(held).__name__}, not a list")
    return list(held)


# What each wrapped Accelerator method takes first, in accelerate 1.3 to 1.15.
_PREPARE_PARAMS = {"prepare_model": ("self", "model"), "prepare_optimizer": ("self", "optimizer"),
                   "prepare": ("self", "args")}


_AFTER_PREPARE = "_hf_zero_after_prepare"


def after_prepare(accelerator_class: type, callback: Callable[[Any, Any], Any]) -> None:
    """Call ``callback(accelerator, prepared)`` after every ``prepare_model`` and
    ``prepare_optimizer`` of ``accelerator_class`` (``prepare`` goes through them), with
    what the method returned (``_models`` keeps the model unwrapped: the returned one is
    the DistributedDataParallel). Accelerate has no hook there. Idempotent."""
    for name in ("prepare_model", "prepare_optimizer"):
        method = _require(accelerator_class, name, "accelerate", "after_prepare")
        if getattr(method, _AFTER_PREPARE, False):
            continue
        _check_params("after_prepare", "accelerate", method, _PREPARE_PARAMS[name], prefix=True)

        def wrap(method):
            @functools.wraps(method)
            def prepared(self, *args, **kwargs):
                result = method(self, *args, **kwargs)
                callback(self, result)
                return result

            setattr(prepared, _AFTER_PREPARE, True)
            return prepared

        setattr(accelerator_class, name, wrap(method))


_BEFORE_PREPARE = "_hf_zero_before_prepare"


def before_prepare(accelerator_class: type, check: Callable[[Any, tuple], None]) -> None:
    """Call ``check(accelerator, objects)`` at the start of every ``prepare(*objects)`` of
    ``accelerator_class``, before Accelerate touches anything. DeepSpeed, Megatron-LM and
    FSDP2 runs never reach ``prepare_model`` / ``prepare_optimizer`` (``prepare`` hands
    them to their own paths), so :func:`after_prepare` cannot see them. Idempotent."""
    method = _require(accelerator_class, "prepare", "accelerate", "before_prepare")
    if getattr(method, _BEFORE_PREPARE, False):
        return
    signature = _check_params("before_prepare", "accelerate", method, _PREPARE_PARAMS["prepare"], prefix=True)
    if signature.parameters["args"].kind is not inspect.Parameter.VAR_POSITIONAL:
        raise _refusal("before_prepare", "accelerate", "takes Accelerator.prepare's objects other than as *args")

    @functools.wraps(method)
    def prepare(self, *args, **kwargs):
        check(self, args)
        return method(self, *args, **kwargs)

    setattr(prepare, _BEFORE_PREPARE, True)
    accelerator_class.prepare = prepare


_WITHOUT_DDP = "_hf_zero_without_ddp"


def prepare_without_ddp(accelerator_class: type, wanted: Callable[[Any, Any], bool]) -> None:
    """Make ``prepare_model(model, ...)`` of ``accelerator_class`` skip the
    DistributedDataParallel wrap when ``wanted(accelerator, model)`` (stage 2: hf_zero
    reduces the grads itself), by running it with ``evaluation_mode=True``.

    Accelerate 1.3 to 1.15 build DDP in ``prepare_model`` only ``if not evaluation_mode``,
    after device placement and autocast and before ``torch.compile``, which still apply;
    it has no public way to skip only the wrap. Idempotent."""
    method = _require(accelerator_class, "prepare_model", "accelerate", "prepare_without_ddp")
    if getattr(method, _WITHOUT_DDP, False):
        return
    signature = _check_params("prepare_without_ddp", "accelerate", method, _PREPARE_PARAMS["prepare_model"],
                              prefix=True)
    if "evaluation_mode" not in signature.parameters:
        raise _refusal("prepare_without_ddp", "accelerate",
                       "has no evaluation_mode in Accelerator.prepare_model (stage=2 skips the DistributedDataParallel "
                       "wrap with it)")

    @functools.wraps(method)
    def prepare_model(self, model, *args, **kwargs):
        if wanted(self, model):
            bound = signature.bind(self, model, *args, **kwargs)
            bound.arguments["evaluation_mode"] = True
            return method(*bound.args, **bound.kwargs)
        return method(self, model, *args, **kwargs)

    setattr(prepare_model, _WITHOUT_DDP, True)
    accelerator_class.prepare_model = prepare_model


# Accelerate 1.3 to 1.15 mark a prepared model with this instance attribute and return a marked model
# from prepare_model untouched (accelerator.py, "Ensure we can't double wrap a model"). Under stage 2 the
# marked model is the user's own module (no DDP wrapper carries the mark), so a later Accelerator (a second
# Trainer) would not prepare it at all, not even wrap it in DDP: the binding removes the mark at its end.
PREPARED_MARK = "_is_accelerate_prepared"


def prepared_mark(model) -> str | None:
    """The name of the instance attribute by which Accelerate marked ``model`` prepared, or None."""
    return PREPARED_MARK if getattr(model, "__dict__", {}).get(PREPARED_MARK) is True else None


# -- torch -----------------------------------------------------------------------------
# torch.amp.GradScaler._unscale_grads_'s parameters, read in torch 2.13 (FSDP's ShardedGradScaler overrides it
# with the same ones); route_unscale checks them when it is used, tests/test_compat.py what the scaler does with it.
UNSCALE_GRADS_PARAMS = ("self", "optimizer", "inv_scale", "found_inf", "allow_fp16")


class _RoutedUnscale:
    """A GradScaler's ``_unscale_grads_``, asking ``route`` first (a plain object, not a closure:
    the scaler still pickles, e.g. inside a copied Accelerator)."""

    def __init__(self, scaler, route: Callable):
        self.scaler, self.route = scaler, route

    def __call__(self, optimizer, inv_scale, found_inf, allow_fp16):
        found = self.route(optimizer, inv_scale, found_inf, allow_fp16)
        if found is None:
            return type(self.scaler)._unscale_grads_(self.scaler, optimizer, inv_scale, found_inf, allow_fp16)
        return found


def route_unscale(scaler, route: Callable[[Any, Any, Any, bool], "dict | None"]) -> None:
    """Have ``scaler`` (a ``torch.amp.GradScaler``, this instance only) unscale and inf-check an
    optimizer's grads with ``route(optimizer, inv_scale, found_inf, allow_fp16)`` where that returns
    GradScaler's found-inf record (``{device: found_inf}``), and as torch does where it returns None.

    torch's GradScaler reads grads in one method, ``_unscale_grads_(optimizer, inv_scale,
    found_inf, allow_fp16)``: ``unscale_`` (and so ``step`` without an explicit one) and
    ``_check_inf_per_device`` call it, and ``step`` and ``update`` read the record it returns.
    torch's own ``ShardedGradScaler`` (FSDP) overrides the same method; there is no public route.
    Idempotent (a second call replaces ``route``)."""
    import torch

    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"expected a torch.amp.GradScaler, got {type(scaler).__name__}")
    method = _require(type(scaler), "_unscale_grads_", "torch", "route_unscale")
    _check_params("route_unscale", "torch", method, UNSCALE_GRADS_PARAMS)
    current = vars(scaler).get("_unscale_grads_")
    if isinstance(current, _RoutedUnscale):
        current.route = route
    else:
        scaler._unscale_grads_ = _RoutedUnscale(scaler, route)


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


# [Note: serving a loaded state dict] Trainer loads a checkpoint's optimizer as
# ``self.optimizer.load_state_dict(torch.load(checkpoint/optimizer.pt))`` inside
# ``_load_optimizer_and_scheduler``; nothing between the read and the load is a hook.
_SERVE: list[Callable[[Any, str, Any], Any]] = []


def serve_loaded_optimizer_state(serve: Callable[[Any, str, Any], Any]) -> None:
    """While a Trainer loads its optimizer from ``checkpoint``, pass the loaded state dict
    through ``serve(trainer.optimizer, checkpoint, state_dict)`` (what it returns is
    loaded). Replaces any earlier one; effective once :func:`watch_trainer` wrapped the class."""
    _SERVE[:] = [serve]


@contextlib.contextmanager
def _serving(optimizer, checkpoint: str) -> Iterator[None]:
    """``optimizer.load_state_dict`` passes its argument through the served function, for
    the duration (an instance attribute, removed afterwards)."""
    if not _SERVE or optimizer is None or "load_state_dict" in vars(optimizer):
        yield
        return
    serve, load_state_dict = _SERVE[0], optimizer.load_state_dict

    def served(state_dict, *args, **kwargs):
        return load_state_dict(serve(optimizer, checkpoint, state_dict), *args, **kwargs)

    optimizer.load_state_dict = served
    try:
        yield
    finally:
        del optimizer.load_state_dict


def watch_trainer(trainer_class: type) -> None:
    """Wrap ``create_optimizer`` (to expose :func:`creating_trainer`) and
    ``_load_optimizer_and_scheduler(checkpoint)`` (to record :func:`resumed_from` and
    serve the loaded state dict, see :func:`serve_loaded_optimizer_state`). Idempotent."""
    create = _require(trainer_class, "create_optimizer", "transformers", "watch_trainer")
    if not getattr(create, _TRAINER_WRAPPED, False):
        _check_params("watch_trainer", "transformers", create, ("self",), prefix=True)

        @functools.wraps(create)
        def create_optimizer(self, *args, **kwargs):
            with _set(_CREATING, self):
                return create(self, *args, **kwargs)

        setattr(create_optimizer, _TRAINER_WRAPPED, True)
        trainer_class.create_optimizer = create_optimizer

    load = _require(trainer_class, "_load_optimizer_and_scheduler", "transformers", "watch_trainer")
    if not getattr(load, _TRAINER_WRAPPED, False):
        _check_params("watch_trainer", "transformers", load, ("self", "checkpoint"), prefix=True)

        @functools.wraps(load)
        def _load_optimizer_and_scheduler(self, checkpoint, *args, **kwargs):
            opt = self.optimizer
            for _ in range(8):  # the optimizer and whatever it wraps (Accelerate's wrapper)
                if opt is None or not isinstance(checkpoint, str):
                    break
                _RESUMED[opt] = checkpoint
                opt = getattr(opt, "optimizer", None)
            if not isinstance(checkpoint, str):
                return load(self, checkpoint, *args, **kwargs)
            with _serving(self.optimizer, checkpoint):
                return load(self, checkpoint, *args, **kwargs)

        setattr(_load_optimizer_and_scheduler, _TRAINER_WRAPPED, True)
        trainer_class._load_optimizer_and_scheduler = _load_optimizer_and_scheduler


def before_optimizer_save(trainer_class: type, before: Callable[[Any, str], None],
                          after: Callable[[Any, str], None] | None = None) -> None:
    """Call ``before(trainer, output_dir)`` on every rank right before ``trainer_class``
    writes a checkpoint's optimizer state, and ``after(trainer, output_dir)`` right after.

    Trainer writes ``optimizer.pt`` in ``_save_optimizer_and_scheduler(output_dir)``
    (every supported version, 4.57.1 to 5.25), called by ``_save_checkpoint`` on every
    rank whenever a checkpoint is saved, whatever decided it (a save strategy, "best"
    after an evaluation, a callback's ``control.should_save``); no callback event comes
    between that decision and the write. Idempotent.
    """
    save = _require(trainer_class, "_save_optimizer_and_scheduler", "transformers", "before_optimizer_save")
    if getattr(save, _TRAINER_WRAPPED, False):
        return
    _check_params("before_optimizer_save", "transformers", save, ("self", "output_dir"), prefix=True)

    @functools.wraps(save)
    def _save_optimizer_and_scheduler(self, output_dir, *args, **kwargs):
        before(self, output_dir)
        result = save(self, output_dir, *args, **kwargs)
        if after is not None:
            after(self, output_dir)
        return result

    setattr(_save_optimizer_and_scheduler, _TRAINER_WRAPPED, True)
    trainer_class._save_optimizer_and_scheduler = _save_optimizer_and_scheduler


def after_failed_train(trainer_class: type, failed: Callable[[Any], None]) -> None:
    """Call ``failed(trainer)`` when ``trainer_class.train`` raises (any exception, ``KeyboardInterrupt``
    included), before the exception goes on.

    Trainer's callbacks see ``on_train_end`` only when ``train()`` returns: an exception in a step or a
    callback, or an interrupt, leaves through no event (transformers 4.57.1 to 5.25). Its subclasses
    (TRL's trainers among them) reach ``Trainer.train`` through ``super()``. Idempotent."""
    train = _require(trainer_class, "train", "transformers", "after_failed_train")
    if getattr(train, _TRAINER_WRAPPED, False):
        return
    _check_params("after_failed_train", "transformers", train, ("self", "resume_from_checkpoint"), prefix=True)

    @functools.wraps(train)
    def wrapped_train(self, *args, **kwargs):
        try:
            return train(self, *args, **kwargs)
        except BaseException:
            failed(self)
            raise

    setattr(wrapped_train, _TRAINER_WRAPPED, True)
    trainer_class.train = wrapped_train


# Trainer.log's parameters, read in transformers 4.57.1 to 5.25: it appends a copy of ``logs``,
# ``{**logs, "step": state.global_step}``, to ``state.log_history`` and then calls the callbacks' ``on_log``
# with ``logs``: keys a callback adds to ``logs`` reach the printed line and the reporting integrations
# (called after it), not ``log_history``.
TRAINER_LOG_PARAMS = ("self", "logs", "start_time")


def logged_entry(state, logs: dict) -> dict | None:
    """In a callback's ``on_log``, the ``state.log_history`` entry Trainer stored for ``logs`` (what a callback
    adds to ``logs`` goes there too), or None where the last entry is not it (``logs`` logged by hand, not
    through ``Trainer.log``). The entry itself where Trainer appended ``logs`` as it is."""
    check_trainer_log()
    history = getattr(state, "log_history", None)
    if not history:
        return None
    entry = history[-1]
    if entry is logs:
        return entry
    if isinstance(entry, dict) and entry.get("step") == state.global_step and all(k in logs for k in entry if k != "step"):
        return entry
    return None


@functools.cache
def check_trainer_log() -> None:
    """Refuse (:class:`CompatError`) a ``Trainer.log`` whose parameters are not the ones :func:`logged_entry` was
    written against."""
    import transformers

    _check_params("logged_entry", "transformers", _require(transformers.Trainer, "log", "transformers", "logged_entry"),
                  TRAINER_LOG_PARAMS[:2], prefix=True)


@contextlib.contextmanager
def _set(var: contextvars.ContextVar, value) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


# -- transformers: what differs between versions -------------------------------------
def _transformers_version() -> tuple[int, ...]:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release


# transformers 5.2.0 moved optimizer selection out of Trainer into
# ``transformers.trainer_optimizer`` (one handler per ``OptimizerNames`` member).
HANDLER_TABLE_SINCE = (5, 2, 0)
# Trainer's rule for DDP's ``find_unused_parameters`` changed in these two releases.
CHECKPOINTING_ARG_SINCE = (5, 4, 0)
ACTIVATION_CHECKPOINTING_SINCE = (5, 23, 0)


def has_optimizer_handler_table() -> bool:
    """Whether the installed transformers dispatches optimizers through
    ``transformers.trainer_optimizer._OPTIMIZER_HANDLERS`` (5.2.0 and later)."""
    return _transformers_version() >= HANDLER_TABLE_SINCE


def add_optimizer_name(value: str, *, member_name: str) -> None:
    """Add ``member_name = value`` to ``transformers.training_args.OptimizerNames`` in place.

    Every supported version (4.57.1 and later): ``TrainingArguments`` validates ``optim``
    with ``OptimizerNames(self.optim)`` and ``HfArgumentParser`` takes the ``--optim``
    choices from the enum's members; neither has a registry for new names. A real member
    (not a string alias) validates, is listed among the choices of a parser built
    afterwards, and survives ``to_dict``/JSON/pickle in any process that registered it.
    Idempotent.
    """
    import enum

    from transformers.training_args import OptimizerNames

    if not (issubclass(OptimizerNames, str) and issubclass(OptimizerNames, enum.Enum)):
        raise _refusal("add_optimizer_name", "transformers", "has an OptimizerNames that is not a str Enum")
    maps = {}
    for name, kind in (("_value2member_map_", dict), ("_member_map_", dict), ("_member_names_", list)):
        maps[name] = _require(OptimizerNames, name, "transformers", "add_optimizer_name")
        if not isinstance(maps[name], kind):
            raise _refusal("add_optimizer_name", "transformers", f"keeps OptimizerNames.{name} as a "
                           f"{type(maps[name]).__name__}, not a {kind.__name__}")
    value2member = maps["_value2member_map_"]
    if value in value2member:
        return
    member = str.__new__(OptimizerNames, value)
    member._name_ = member_name
    member._value_ = value
    member.__objclass__ = OptimizerNames
    type.__setattr__(OptimizerNames, member_name, member)
    maps["_member_map_"][member_name] = member
    value2member[value] = member
    maps["_member_names_"].append(member_name)


def remove_optimizer_name(value: str) -> None:
    """Undo :func:`add_optimizer_name` (a registration rolled back). No-op when absent."""
    from transformers.training_args import OptimizerNames

    member = OptimizerNames._value2member_map_.pop(value, None)
    if member is None:
        return
    OptimizerNames._member_map_.pop(member._name_, None)
    if member._name_ in OptimizerNames._member_names_:
        OptimizerNames._member_names_.remove(member._name_)
    if OptimizerNames.__dict__.get(member._name_) is member:
        type.__delattr__(OptimizerNames, member._name_)


def optimizer_registered(value: str) -> bool:
    """Whether :func:`register_optimizer` holds a handler for ``value``."""
    if not has_optimizer_handler_table():
        return value in _LEGACY_HANDLERS
    import transformers.trainer_optimizer as trainer_optimizer
    from transformers.training_args import OptimizerNames

    member = OptimizerNames._value2member_map_.get(value)
    return member is not None and member in trainer_optimizer._OPTIMIZER_HANDLERS


def unregister_optimizer(value: str) -> None:
    """Undo :func:`register_optimizer` for ``value`` (the legacy dispatch wrapper stays: it
    passes every unregistered name to the original). No-op when absent."""
    _LEGACY_HANDLERS.pop(value, None)
    if has_optimizer_handler_table():
        import transformers.trainer_optimizer as trainer_optimizer
        from transformers.training_args import OptimizerNames

        member = OptimizerNames._value2member_map_.get(value)
        if member is not None:
            trainer_optimizer._OPTIMIZER_HANDLERS.pop(member, None)


# what a handler reads of the context transformers 5.2+ passes it (the legacy dispatch builds the same)
_CONTEXT_FIELDS = ("args", "model", "optimizer_kwargs", "adam_kwargs", "optim_args")
# value -> handler, for versions without the handler table (answered by _legacy_dispatch)
_LEGACY_HANDLERS: dict[str, Callable] = {}
_ORIGINAL = "_hf_zero_original"


def register_optimizer(value: str, handler: Callable[[Any], "tuple[Any, dict[str, Any]]"]) -> None:
    """Make ``Trainer`` build its optimizer with ``handler`` when ``args.optim == value``.

    ``handler(ctx)`` gets the context transformers 5.2+ builds (``args``, ``model``,
    ``optimizer_kwargs`` = lr, ``adam_kwargs`` = betas/eps, ``optim_args`` = the parsed
    ``args.optim_args``) and returns ``(factory class, kwargs)``: Trainer builds the
    optimizer as ``factory_class()(model, **kwargs)``, so the factory sees the whole model.

    - transformers >= 5.2.0: an entry in ``transformers.trainer_optimizer._OPTIMIZER_HANDLERS``,
      the table ``Trainer.get_optimizer_cls_and_kwargs`` dispatches on; a handler returning
      a non-Optimizer class is a factory there (``is_optimizer_factory``).
    - transformers 4.57.x to 5.1.x: ``Trainer.get_optimizer_cls_and_kwargs`` is a static
      method with a fixed if/elif chain. It is wrapped once: for ``value`` the wrapper calls
      ``handler`` with the same context and returns ``(factory_class(), kwargs + {"model":
      model})``, which ``Trainer.create_optimizer`` calls as ``factory(model, **kwargs)``
      (its "model" override, there for LOMO); every other name goes to the original.

    Neither has a public registry for optimizer names. Idempotent.
    """
    import transformers.trainer
    from transformers.training_args import OptimizerNames

    member = OptimizerNames(value)
    if has_optimizer_handler_table():
        import transformers.trainer_optimizer as trainer_optimizer

        handlers = _require(trainer_optimizer, "_OPTIMIZER_HANDLERS", "transformers", "register_optimizer")
        _require(trainer_optimizer, "is_optimizer_factory", "transformers", "register_optimizer")
        context = _require(trainer_optimizer, "OptimizerContext", "transformers", "register_optimizer")
        missing = [f for f in _CONTEXT_FIELDS if f not in getattr(context, "__annotations__", {})]
        if not isinstance(handlers, dict) or missing:
            raise _refusal("register_optimizer", "transformers",
                           f"has an optimizer handler table of another shape (OptimizerContext lacks {missing})"
                           if missing else "keeps trainer_optimizer._OPTIMIZER_HANDLERS other than as a dict")
        handlers[member] = handler
        return
    _LEGACY_HANDLERS[member.value] = handler
    trainer = transformers.trainer.Trainer
    current = _require(trainer, "get_optimizer_cls_and_kwargs", "transformers", "register_optimizer")
    if getattr(current, _ORIGINAL, None) is None:
        _check_params("register_optimizer", "transformers", current, ("args", "model"))
        trainer.get_optimizer_cls_and_kwargs = staticmethod(_legacy_dispatch(current))


def _legacy_dispatch(original: Callable) -> Callable:
    import torch

    @functools.wraps(original)
    def get_optimizer_cls_and_kwargs(args, model=None):
        optim = getattr(args.optim, "value", args.optim)
        handler = _LEGACY_HANDLERS.get(optim)
        if handler is None:
            return original(args, model)
        optim_args = {}
        if args.optim_args:  # parsed as transformers 4.57 and 5.2 parse it
            for mapping in args.optim_args.replace(" ", "").split(","):
                key, val = mapping.split("=")
                optim_args[key] = val
        ctx = SimpleNamespace(
            args=args,
            model=model,
            optimizer_kwargs={"lr": args.learning_rate},
            adam_kwargs={"betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon},
            optim_args=optim_args,
        )
        cls, kwargs = handler(ctx)
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
            return cls, kwargs
        kwargs = dict(kwargs)
        if model is not None:
            kwargs["model"] = model
        return cls(), kwargs

    setattr(get_optimizer_cls_and_kwargs, _ORIGINAL, original)
    return get_optimizer_cls_and_kwargs


def ddp_find_unused_parameters(args, model) -> bool:
    """The ``find_unused_parameters`` Trainer gives DDP for ``model`` under ``args``.

    Trainer computes it inline when it builds DDP and keeps it nowhere. For a
    ``PreTrainedModel`` without ``ddp_find_unused_parameters`` it is False while activation
    (gradient) checkpointing is on, read from version-dependent names:

    - transformers >= 5.23.0: ``model.is_activation_checkpointing or args.activation_checkpointing``;
    - 5.4.0 to 5.22.x: ``model.is_gradient_checkpointing or args.gradient_checkpointing``;
    - 4.57.x to 5.3.x: ``model.is_gradient_checkpointing``.
    """
    import transformers

    if args.ddp_find_unused_parameters is not None:
        return bool(args.ddp_find_unused_parameters)
    if not isinstance(model, transformers.PreTrainedModel):
        return True
    version = _transformers_version()
    prefix = "activation" if version >= ACTIVATION_CHECKPOINTING_SINCE else "gradient"
    on = _require(model, f"is_{prefix}_checkpointing", "transformers", "ddp_find_unused_parameters")
    if version >= CHECKPOINTING_ARG_SINCE:
        on = on or _require(args, f"{prefix}_checkpointing", "transformers", "ddp_find_unused_parameters")
    return not on


def block_classes(model) -> list[str] | None:
    """The class names in ``_no_split_modules`` (transformers' blocks kept whole on one
    device, which Accelerate's FSDP wraps as units too) of any module of ``model`` that
    occur in it: the overlapped sync's units. None when there are none."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    present = names & {type(module).__name__ for module in model.modules()}
    return sorted(present) or None
