"""Registers hf_zero with transformers in any process, unmodified scripts included.

``hf_zero_autoload.pth`` (installed next to this module by ``pip install``, regular or
editable) calls :func:`start` at interpreter start; ``import hf_zero`` calls
:func:`install`. Nothing heavy is imported here: a meta-path finder waits for the
watched modules and, once each has finished executing, calls its function in
:mod:`hf_zero._autoload` (what is registered is described there):

- ``transformers.training_args`` and ``transformers.trainer``, from interpreter start:
  ``optim="zero_bucket"`` is a string, so a script can use it without importing hf_zero;
- ``accelerate.accelerator``, once hf_zero is imported: an Accelerate loop builds a
  ZeroBucketOptimizer itself, so it imports hf_zero.

``HF_ZERO_AUTOLOAD=0`` turns the start-up hook off; ``import hf_zero`` still registers.
This module lives outside the ``hf_zero`` package so that interpreter start imports no
``hf_zero`` module: which ``hf_zero`` a process uses is decided by its own ``sys.path``
(the script's directory is not on it yet when ``.pth`` files run).
"""

import os
import sys

ENV_VAR = "HF_ZERO_AUTOLOAD"
TARGET = "hf_zero._autoload"

# watched module -> the function of TARGET to call once it has finished executing
_AT_START = {"transformers.training_args": "optim_name", "transformers.trainer": "trainer"}
_WITH_HF_ZERO = {"accelerate.accelerator": "accelerator"}
_pending: dict = {}  # watched modules whose registration has not run yet -> function name


def enabled() -> bool:
    """Whether the start-up hook is on (``HF_ZERO_AUTOLOAD`` unset, or anything but 0/false/no/off)."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def start() -> None:
    """Interpreter-start entry point (the ``.pth`` line): watch transformers unless turned off."""
    if enabled():
        _watch(_AT_START)


def install() -> None:
    """``import hf_zero``'s entry point: watch transformers and accelerate. Idempotent."""
    _watch({**_AT_START, **_WITH_HF_ZERO})


def _watch(registrations: dict) -> None:
    """Register now for each module already loaded, otherwise once it is."""
    for name, function in registrations.items():
        module = sys.modules.get(name)
        if module is None:
            _pending[name] = function
        elif not _executing(module):
            _register(name, function)
        # else: it is executing right now, past the finder; nothing can hook it any more
    if _pending and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def _register(name: str, function: str) -> None:
    """Call ``TARGET.function`` for ``name``, which has executed. A failure warns and leaves
    hf_zero unregistered: it must not break a process that merely imports transformers."""
    _pending.pop(name, None)
    try:
        getattr(__import__(TARGET, fromlist=[function]), function)()
    except Exception as exc:  # noqa: BLE001 - reported, and the process goes on without hf_zero
        import warnings

        warnings.warn(
            f"hf_zero could not register with {name} ({type(exc).__name__}: {exc}); optim='zero_bucket' "
            f"or the Accelerate wiring may be unavailable in this process. Set {ENV_VAR}=0 to skip this "
            "start-up hook.",
            RuntimeWarning,
        )


def _executing(module) -> bool:
    """Whether ``module`` is in sys.modules but still executing (importlib's own flag for it)."""
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
            _register(self._name, _pending[self._name])

    def __getattr__(self, attr):  # get_source, get_filename, is_package, ...
        return getattr(self._loader, attr)


class _Finder:
    """Meta-path finder for the watched modules only: asks the other finders for the spec
    and wraps its loader. Every other import costs one dict lookup."""

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
