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
import threading

ENV_VAR = "HF_ZERO_AUTOLOAD"
TARGET = "hf_zero._autoload"
OPTIM_NAME = "zero_bucket"  # hf_zero.integrations.OPTIM_NAME (this module imports no hf_zero)

# watched module -> the function of TARGET to call once it has finished executing
_AT_START = {"transformers.training_args": "optim_name", "transformers.trainer": "trainer"}
_WITH_HF_ZERO = {"accelerate.accelerator": "accelerator"}
# watched modules whose registration has not succeeded yet -> function name: not imported
# yet, or imported and failed (retried at the next watched import and at ``import hf_zero``)
_pending: dict = {}
_done: set = set()  # watched modules registered for
# guards _pending and the registrations: imports can run on several threads, and a
# registration imports watched modules itself (hence reentrant)
_LOCK = threading.RLock()


def enabled() -> bool:
    """Whether the start-up hook is on (``HF_ZERO_AUTOLOAD`` unset, or anything but 0/false/no/off)."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def start() -> None:
    """Interpreter-start entry point (the ``.pth`` line): watch transformers unless turned off.

    Turned off, it only says so when the command line names ``zero_bucket``: otherwise
    the script's parser would refuse ``--optim zero_bucket`` with no hint why."""
    if enabled():
        _watch(_AT_START)
    elif any(OPTIM_NAME in str(arg) for arg in getattr(sys, "argv", ())):
        _report_off()



def _report_off() -> None:
    try:
        sys.stderr.write(
            f"hf_zero: the command line names {OPTIM_NAME!r}, but {ENV_VAR}="
            f"{os.environ.get(ENV_VAR)} has switched off hf_zero's start-up hook, so transformers does not know "
            f"optim={OPTIM_NAME!r} unless the script imports hf_zero. Unset {ENV_VAR} to use it.\n")
    except Exception:  # noqa: BLE001 - no stderr: nothing more to do
        pass


def install() -> None:
    """``import hf_zero``'s entry point: watch transformers and accelerate. Idempotent."""
    _watch({**_AT_START, **_WITH_HF_ZERO})


def _watch(registrations: dict) -> None:
    """Register now for each module already loaded, otherwise once it is."""
    with _LOCK:
        for name, function in registrations.items():
            if name not in _done:
                _pending.setdefault(name, function)
        _retry_loaded()
        if _pending and _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)


def _retry_loaded() -> None:
    """Register for every pending module that has finished executing (a module still
    executing is past the finder: its own loader registers when it ends)."""
    with _LOCK:
        for name, function in list(_pending.items()):
            module = sys.modules.get(name)
            if module is not None and not _executing(module):
                _register(name, function)


def _register(name: str, function: str) -> None:
    """Call ``TARGET.function`` for ``name``, which has executed. On success ``name`` is no
    longer pending; a failure (rolled back by the function itself) keeps it pending, to be
    retried, and is reported without ever raising: it must not break a process that merely
    imports transformers."""
    with _LOCK:
        if _pending.get(name) != function:
            return  # done meanwhile (reentrant import)
        try:
            getattr(__import__(TARGET, fromlist=[function]), function)()
        except Exception as exc:  # noqa: BLE001 - reported, and the process goes on without it for now
            _report(f"hf_zero could not register with {name} ({type(exc).__name__}: {exc}); optim='zero_bucket' "
                    "or the Accelerate wiring may be unavailable in this process until a retry succeeds (at the "
                    f"next transformers/accelerate import or `import hf_zero`). Set {ENV_VAR}=0 to skip this "
                    "start-up hook.")
        else:
            _pending.pop(name, None)
            _done.add(name)


def _report(message: str) -> None:
    """A RuntimeWarning, or a line on stderr where warnings are errors (``python -W error``)."""
    try:
        import warnings

        warnings.warn(message, RuntimeWarning, stacklevel=2)
    except Exception:  # noqa: BLE001 - the warning filter turned it into an error
        try:
            sys.stderr.write(f"RuntimeWarning: {message}\n")
        except Exception:  # noqa: BLE001 - no stderr: nothing more to do
            pass


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
        try:
            with _LOCK:
                if self._name in _pending:  # (still flagged as executing: registered by name)
                    _register(self._name, _pending[self._name])
                _retry_loaded()  # any whose registration failed before
        except Exception:  # noqa: BLE001 - never break the import (_register reports its own failures)
            pass

    def __getattr__(self, attr):  # get_source, get_filename, is_package, ...
        return getattr(self._loader, attr)


class _Finder:
    """Meta-path finder for the watched modules only: asks the other finders for the spec
    and wraps its loader. Every other import costs one dict lookup."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _pending or fullname in sys.modules:
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
