"""Hugging Face integrations. The core never imports this package.

``transformers`` registers ``optim="zero_bucket"`` and :class:`ZeroBucketCallback`
when imported; ``accelerate`` wires any ``Accelerator`` that prepares a
ZeroBucketOptimizer and holds :func:`prepare_accelerator` (no accelerate import needed).
"""

# The Trainer optimizer name: a member of transformers' OptimizerNames (read by
# integrations/transformers.py and by hf_zero/_autoload.py, which adds it before any
# Trainer module loads).
OPTIM_NAME = "zero_bucket"
OPTIM_MEMBER = "ZERO_BUCKET"
