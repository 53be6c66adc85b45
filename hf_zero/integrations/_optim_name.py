"""``optim="zero_bucket"`` as a member of transformers' ``OptimizerNames``.

Needs only ``transformers.training_args``, so it can run as soon as that module has
executed (see ``_hf_zero_autoload``), before any parser is built from the enum.
Importing this module registers.
"""

from transformers.training_args import OptimizerNames

OPTIM_NAME = "zero_bucket"


def register() -> None:
    """Add ``ZERO_BUCKET = "zero_bucket"`` to ``OptimizerNames`` in place. Idempotent.

    A real member (not a string alias): ``OptimizerNames("zero_bucket")`` validates,
    ``HfArgumentParser`` lists it among ``--optim`` choices (when built after this),
    and args survive ``to_dict``/JSON/pickle.
    """
    if OPTIM_NAME in OptimizerNames._value2member_map_:
        return
    member = str.__new__(OptimizerNames, OPTIM_NAME)
    member._name_ = "ZERO_BUCKET"
    member._value_ = OPTIM_NAME
    member.__objclass__ = OptimizerNames
    type.__setattr__(OptimizerNames, "ZERO_BUCKET", member)
    OptimizerNames._member_map_["ZERO_BUCKET"] = member
    OptimizerNames._value2member_map_[OPTIM_NAME] = member
    OptimizerNames._member_names_.append("ZERO_BUCKET")


register()
