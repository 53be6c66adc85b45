"""What hf_zero registers once a transformers / accelerate module has finished executing.

``_hf_zero_autoload`` (a top-level module, run at interpreter start by
``hf_zero_autoload.pth`` and armed by ``import hf_zero``) watches those modules and
calls these functions; each is idempotent:

- :func:`optim_name` after ``transformers.training_args``: ``zero_bucket`` becomes an
  ``OptimizerNames`` member before any parser or args can be built from the enum;
- :func:`trainer` after ``transformers.trainer``: the Trainer handler and
  ``ZeroBucketCallback`` (:func:`hf_zero.integrations.transformers.register`);
- :func:`accelerator` after ``accelerate.accelerator``: every ``Accelerator`` that
  prepares a ZeroBucketOptimizer is wired for it (only in processes that import
  hf_zero: an Accelerate loop builds the optimizer itself).
"""

import sys

from .integrations import OPTIM_MEMBER, OPTIM_NAME


def optim_name() -> None:
    """Add ``zero_bucket`` to ``transformers.training_args.OptimizerNames``."""
    from .integrations import _compat

    _compat.add_optimizer_name(OPTIM_NAME, member_name=OPTIM_MEMBER)


def trainer() -> None:
    """Register the Trainer handler and the default callback (importing
    :mod:`hf_zero.integrations.transformers` does)."""
    importing = sys.modules.get(f"{__package__}.integrations.transformers")
    if importing is not None and not hasattr(importing, "register"):
        return  # that module imported transformers.trainer first; it registers when it ends
    from .integrations import transformers

    transformers.register()


def accelerator() -> None:
    """Wire every ``Accelerator`` that prepares a ZeroBucketOptimizer."""
    from accelerate.accelerator import Accelerator  # the finished module (``accelerate`` may still be importing)

    from .integrations import accelerate

    accelerate.install(Accelerator)
