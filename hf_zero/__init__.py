"""hf_zero: ZeRO stage-1 optimizer-state sharding with parameters as bucket views.

The core (this package minus ``integrations``) imports without transformers or
accelerate.
"""

from .optimizer import ZeroBucketOptimizer

__all__ = ["ZeroBucketOptimizer"]
__version__ = "0.1.0"
