"""hf_zero: ZeRO stage-1 optimizer-state sharding with parameters as bucket views.

The core (this package minus ``integrations``) imports without transformers or
accelerate.
"""

import importlib.util

from .optimizer import ZeroBucketOptimizer
from .integrations.accelerate import prepare_accelerator

__all__ = ["ZeroBucketOptimizer", "prepare_accelerator"]


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # blocked (sys.modules[name] = None) or broken
        return False


# Without transformers the core works alone; with it, importing registers
# optim="zero_bucket" and the Trainer callback (errors there are real and raise).
if _importable("transformers"):
    from .integrations.transformers import ZeroBucketCallback

    __all__.append("ZeroBucketCallback")

# An Accelerator that prepares a ZeroBucketOptimizer is wired for it with no call.
if _importable("accelerate"):
    from accelerate import Accelerator as _Accelerator

    from .integrations.accelerate import install as _install

    _install(_Accelerator)

__version__ = "0.1.0"
