"""Hugging Face integrations. The core never imports this package.

``transformers`` registers ``optim="zero_bucket"`` and :class:`ZeroBucketCallback`
when imported; ``accelerate`` holds :func:`prepare_accelerator` (no accelerate
import needed).
"""
