"""hf_zero: ZeRO stage-1 optimizer-state sharding with parameters as bucket views.

``import hf_zero`` is cheap: it imports neither torch, transformers nor accelerate. Each
public name loads its module on first use. The core (this package minus
``integrations``) imports without transformers or accelerate.

With hf_zero installed, ``optim="zero_bucket"`` works in any process without importing
hf_zero (see ``_hf_zero_autoload``). Importing it registers too, even with
``HF_ZERO_AUTOLOAD=0``, and wires every ``Accelerator`` that prepares a
ZeroBucketOptimizer (see :mod:`hf_zero._autoload`), whichever is imported first.
"""

from __future__ import annotations

import importlib
import importlib.util

import _hf_zero_autoload

TYPE_CHECKING = False  # as typing.TYPE_CHECKING (type checkers read the name), without importing typing

__version__ = "0.1.0"

# public name -> the module that defines it
_HOMES = {
    "ZeroBucketOptimizer": "._optimizer",
    "prepare_accelerator": ".integrations.accelerate",
    "prepare_grad_scaler": ".integrations.amp",
    "ZeroBucketCallback": ".integrations.transformers",
}


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # blocked (sys.modules[name] = None) or broken
        return False


__all__ = ["ZeroBucketOptimizer", "prepare_accelerator", "prepare_grad_scaler"]
if _importable("transformers"):  # checked without importing it
    __all__.append("ZeroBucketCallback")

if TYPE_CHECKING:
    from .integrations.accelerate import prepare_accelerator
    from .integrations.amp import prepare_grad_scaler
    from .integrations.transformers import ZeroBucketCallback
    from ._optimizer import ZeroBucketOptimizer


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))


_hf_zero_autoload.install()
