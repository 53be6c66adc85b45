"""``optim="zero_bucket"`` as a member of transformers' ``OptimizerNames``.

Needs only ``transformers.training_args``, so it can run as soon as that module has
executed (see ``_hf_zero_autoload``), before any parser is built from the enum.
Importing this module registers.
"""

from . import _compat

OPTIM_NAME = "zero_bucket"


def register() -> None:
    """Add ``ZERO_BUCKET = "zero_bucket"`` to ``OptimizerNames``. Idempotent.

    A real member (not a string alias): ``OptimizerNames("zero_bucket")`` validates,
    ``HfArgumentParser`` lists it among ``--optim`` choices (when built after this),
    and args survive ``to_dict``/JSON/pickle.
    """
    _compat.add_optimizer_name(OPTIM_NAME, member_name="ZERO_BUCKET")


register()
