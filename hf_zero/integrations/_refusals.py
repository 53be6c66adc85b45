"""Configurations ZeroBucketOptimizer cannot serve, refused before the first step.

hf_zero shards optimizer state over plain data-parallel (DDP) replicas of whole params.
FSDP and DeepSpeed shard the params themselves (and bring their own optimizer
sharding), Megatron-LM and tensor / context / sequence parallelism split params over
ranks that are not replicas: a ZeroBucketOptimizer there would average or sync the
wrong tensors. Accelerate and Trainer run such setups without complaint, so the
integrations ask :func:`unsupported` at optimizer creation (Trainer) and before
``Accelerator.prepare`` (both) and raise what it returns.
"""

from __future__ import annotations

from typing import Any

# accelerate.utils.DistributedType values hf_zero refuses, with the name users know them by
_ENGINES = {"FSDP": "FSDP", "DEEPSPEED": "DeepSpeed", "MEGATRON_LM": "Megatron-LM"}
# ParallelismConfig sizes other than plain replication (dp_replicate_size is DDP)
_SPLITS = {"tp_size": "tensor parallelism", "cp_size": "context parallelism", "sp_size": "sequence parallelism",
           "dp_shard_size": "FSDP (dp_shard_size)"}


def unsupported(*, distributed_type: Any = None, parallelism_config: Any = None, tp_size: Any = None,
                fsdp: Any = None, deepspeed: Any = None) -> str | None:
    """What, among the given settings, ZeroBucketOptimizer cannot run under (None: nothing).

    Args:
        distributed_type: ``accelerator.distributed_type`` (an ``accelerate.utils.DistributedType``).
        parallelism_config: an ``accelerate.ParallelismConfig`` (Accelerate >= 1.10), or None.
        tp_size: a tensor-parallel degree (``TrainingArguments.tp_size`` in transformers 4.x,
            a model's ``tp_size`` when loaded with a ``tp_plan``).
        fsdp: ``TrainingArguments.fsdp`` (a non-empty list or string turns FSDP on).
        deepspeed: ``TrainingArguments.deepspeed`` (a config path or dict).
    """
    kind = getattr(distributed_type, "value", distributed_type)
    if kind in _ENGINES:
        return f"{_ENGINES[kind]} (distributed_type={kind})"
    if fsdp:
        return f"FSDP (fsdp={fsdp!r})"
    if deepspeed:
        return "DeepSpeed (deepspeed=...)"
    if (tp_size or 1) > 1:
        return f"tensor parallelism (tp_size={tp_size})"
    if parallelism_config is not None:
        for name, what in _SPLITS.items():
            size = getattr(parallelism_config, name, None) or 1
            if size > 1:
                return f"{what} (parallelism_config.{name}={size})"
    return None


def refusal(what: str, *, where: str) -> ValueError:
    """The error for running ZeroBucketOptimizer under ``what`` (from :func:`unsupported`)."""
    return ValueError(
        f"hf_zero: {where}: ZeroBucketOptimizer cannot run under {what}. It shards optimizer state over plain "
        "data-parallel (DDP) replicas; FSDP and DeepSpeed shard the params (and the optimizer state) themselves, "
        "and tensor/context/sequence parallelism and Megatron-LM split params over ranks that are not replicas. "
        "Use that engine's own optimizer sharding with a plain torch optimizer (e.g. optim='adamw_torch'), or "
        "train with plain data parallelism to use ZeroBucketOptimizer."
    )
