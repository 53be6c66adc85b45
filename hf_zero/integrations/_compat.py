"""Shims: the only places hf_zero relies on torch / transformers / accelerate internals.

Each shim exists because the library offers no public route for that need; each
checks, when it is first used, that the internals it relies on are there and raises
:class:`CompatError` naming the library and version otherwise (tests/test_compat.py
runs every check, so an upgrade that breaks one fails loudly in CI).

Everything that differs between the transformers versions setup.cfg allows (4.57.1 to
5.24) is here too, one version-checked shim per need, each naming the versions it
targets. CI runs tests/test_compat.py on both ends of that range.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from types import SimpleNamespace
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


_BEFORE_PREPARE = "_hf_zero_before_prepare"


def before_prepare(accelerator_class: type, check: Callable[[Any, tuple], None]) -> None:
    """Call ``check(accelerator, objects)`` at the start of every ``prepare(*objects)`` of
    ``accelerator_class``, before Accelerate touches anything. DeepSpeed, Megatron-LM and
    FSDP2 runs never reach ``prepare_model`` / ``prepare_optimizer`` (``prepare`` hands
    them to their own paths), so :func:`after_prepare` cannot see them. Idempotent."""
    method = _require(accelerator_class, "prepare", "accelerate")
    if getattr(method, _BEFORE_PREPARE, False):
        return

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
    import inspect

    method = _require(accelerator_class, "prepare_model", "accelerate")
    if getattr(method, _WITHOUT_DDP, False):
        return
    signature = inspect.signature(method)
    if "evaluation_mode" not in signature.parameters:
        import accelerate

        raise CompatError(
            f"hf_zero: accelerate {accelerate.__version__}'s Accelerator.prepare_model has no evaluation_mode, "
            "which stage=2 relies on to skip the DistributedDataParallel wrap; please report this with your "
            "versions of hf_zero, torch, transformers and accelerate"
        )

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
    import inspect

    import torch

    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"expected a torch.amp.GradScaler, got {type(scaler).__name__}")
    method = _require(type(scaler), "_unscale_grads_", "torch")
    if tuple(inspect.signature(method).parameters) != UNSCALE_GRADS_PARAMS:
        raise CompatError(
            f"hf_zero: torch {torch.__version__}'s {type(scaler).__name__}._unscale_grads_ takes "
            f"{tuple(inspect.signature(method).parameters)}, not {UNSCALE_GRADS_PARAMS}, which hf_zero relies on "
            "to unscale stage 2's sharded grads; please report this with your versions of hf_zero, torch, "
            "transformers and accelerate"
        )
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
    (every supported version, 4.57.1 to 5.24), called by ``_save_checkpoint`` on every
    rank whenever a checkpoint is saved, whatever decided it (a save strategy, "best"
    after an evaluation, a callback's ``control.should_save``); no callback event comes
    between that decision and the write. Idempotent.
    """
    save = _require(trainer_class, "_save_optimizer_and_scheduler", "transformers")
    if getattr(save, _TRAINER_WRAPPED, False):
        return

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
    callback, or an interrupt, leaves through no event (transformers 4.57.1 to 5.24). Its subclasses
    (TRL's trainers among them) reach ``Trainer.train`` through ``super()``. Idempotent."""
    train = _require(trainer_class, "train", "transformers")
    if getattr(train, _TRAINER_WRAPPED, False):
        return

    @functools.wraps(train)
    def wrapped_train(self, *args, **kwargs):
        try:
            return train(self, *args, **kwargs)
        except BaseException:
            failed(self)
            raise

    setattr(wrapped_train, _TRAINER_WRAPPED, True)
    trainer_class.train = wrapped_train


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
    from transformers.training_args import OptimizerNames

    value2member = _require(OptimizerNames, "_value2member_map_", "transformers")
    if value in value2member:
        return
    member = str.__new__(OptimizerNames, value)
    member._name_ = member_name
    member._value_ = value
    member.__objclass__ = OptimizerNames
    type.__setattr__(OptimizerNames, member_name, member)
    _require(OptimizerNames, "_member_map_", "transformers")[member_name] = member
    value2member[value] = member
    _require(OptimizerNames, "_member_names_", "transformers").append(member_name)


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

        _require(trainer_optimizer, "_OPTIMIZER_HANDLERS", "transformers")[member] = handler
        return
    _LEGACY_HANDLERS[member.value] = handler
    trainer = transformers.trainer.Trainer
    current = _require(trainer, "get_optimizer_cls_and_kwargs", "transformers")
    if getattr(current, _ORIGINAL, None) is None:
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
    if version >= ACTIVATION_CHECKPOINTING_SINCE:
        return not (model.is_activation_checkpointing or args.activation_checkpointing)
    if version >= CHECKPOINTING_ARG_SINCE:
        return not (model.is_gradient_checkpointing or args.gradient_checkpointing)
    return not model.is_gradient_checkpointing


def block_classes(model) -> list[str] | None:
    """The class names in ``_no_split_modules`` (transformers' blocks kept whole on one
    device, which Accelerate's FSDP wraps as units too) of any module of ``model`` that
    occur in it: the overlapped sync's units. None when there are none."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    present = names & {type(module).__name__ for module in model.modules()}
    return sorted(present) or None
