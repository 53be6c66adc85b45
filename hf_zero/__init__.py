"""hf_zero: ZeRO stage-1 optimizer-state sharding with parameters as bucket views.

The core (this package minus ``integrations``) imports without transformers or
accelerate.
"""

from .optimizer import ZeroBucketOptimizer
from .integrations.accelerate import prepare_accelerator

__all__ = ["ZeroBucketOptimizer", "prepare_accelerator"]

try:  # registers optim="zero_bucket" and the Trainer callback
    from .integrations.transformers import ZeroBucketCallback
except ImportError as _e:  # transformers not installed: the core works without it
    if not (_e.name or "").split(".")[0] == "transformers":
        raise
else:
    __all__.append("ZeroBucketCallback")
__version__ = "0.1.0"
