"""Makes ``optim="zero_bucket"`` known to transformers in any process, unmodified scripts included.

``hf_zero_autoload.pth`` (installed next to this module by ``pip install``, regular or
editable) calls :func:`start` at interpreter start; ``import hf_zero`` calls
:func:`install`. Either way nothing heavy is imported here: the hook waits for
transformers' own modules and, once each has finished executing, registers hf_zero:

- ``transformers.training_args``: ``zero_bucket`` becomes an ``OptimizerNames`` member,
  so ``HfArgumentParser`` (``--optim`` choices are fixed when a parser is built), JSON
  args and an unpickled ``training_args.bin`` accept it;
- ``transformers.trainer``: the Trainer handler and ``ZeroBucketCallback`` are registered
  (:func:`hf_zero.integrations.transformers.register`);
- ``accelerate.accelerator``: every ``Accelerator`` that prepares a ZeroBucketOptimizer is
  wired for it (:func:`hf_zero.integrations.accelerate.register`).

``HF_ZERO_AUTOLOAD=0`` turns the start-up hook off; ``import hf_zero`` still registers.
This module lives outside the ``hf_zero`` package so that interpreter start imports no
``hf_zero`` module: which ``hf_zero`` a process uses is decided by its own ``sys.path``.
"""

import os
import sys

ENV_VAR = "HF_ZERO_AUTOLOAD"

# transformers module -> (hf_zero module, function) to call once it has finished executing
_REGISTRATIONS = {
    "transformers.training_args": ("hf_zero.integrations._optim_name", "register"),
    "transformers.trainer": ("hf_zero.integrations.transformers", "register"),
    "accelerate.accelerator": ("hf_zero.integrations.accelerate", "register"),
}
_pending: set = set()  # watched modules whose registration has not run yet


def enabled() -> bool:
    """Whether the start-up hook is on (``HF_ZERO_AUTOLOAD`` unset, or anything but 0/false/no/off)."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def start() -> None:
    """Interpreter-start entry point (the ``.pth`` line): :func:`install` unless turned off."""
    if enabled():
        install()


def install() -> None:
    """Register with every watched transformers module now if it is loaded, else when it is. Idempotent."""
    for name in _REGISTRATIONS:
        module = sys.modules.get(name)
        if module is None:
            _pending.add(name)
        elif not _executing(module):
            _register(name)
        # else: it is executing right now, past the finder; nothing can hook it any more
    if _pending and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def _register(name: str) -> None:
    """Run the registration for ``name`` once it has executed. A failure warns and leaves
    ``zero_bucket`` unknown: it must not break a process that merely imports transformers."""
    _pending.discard(name)
    module_name, function = _REGISTRATIONS[name]
    if _executing(sys.modules.get(module_name)):
        return  # that module is importing transformers' module right now; importing it registers
    try:
        getattr(__import__(module_name, fromlist=[function]), function)()
    except Exception as exc:  # noqa: BLE001 - reported, and the process goes on without zero_bucket
        import warnings

        warnings.warn(
            f"hf_zero could not register with {name} ({type(exc).__name__}: {exc}); optim='zero_bucket' "
            f"or the Accelerate wiring may be unavailable in this process. Set {ENV_VAR}=0 to skip this "
            "start-up hook.",
            RuntimeWarning,
        )


def _executing(module) -> bool:
    """Whether ``module`` is in sys.modules but still executing (set by importlib while it runs)."""
    return module is not None and bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


class _Loader:
    """Wraps a watched module's loader: runs it, then the registration (the module is complete)."""

    def __init__(self, loader, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module) -> None:
        module.__loader__ = self._loader  # the module keeps its real loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        if self._name in _pending:
            _register(self._name)

    def __getattr__(self, attr):  # get_source, get_filename, is_package, ...
        return getattr(self._loader, attr)


class _Finder:
    """Meta-path finder for the watched modules only: asks the other finders for the spec
    and wraps its loader. Every other import costs one set lookup."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, fullname)
        return spec


_FINDER = _Finder()
