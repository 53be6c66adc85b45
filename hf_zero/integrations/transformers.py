"""Transformers Trainer integration: ``optim="zero_bucket"`` and :class:`ZeroBucketCallback`.

Importing this module registers the optimizer name and adds the callback to
``transformers.trainer.DEFAULT_CALLBACKS`` (idempotent). With hf_zero installed that
happens as soon as a process imports ``transformers.trainer`` (``hf_zero/_autoload.py``).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any

import torch
import transformers
import transformers.trainer
from transformers import TrainerCallback
from transformers.optimization import Adafactor

from .. import _offline, _sharded
from .._planner import predict_for
from .._optimizer import ZeroBucketOptimizer
from .._statedict import FROZEN_KEY
from . import OPTIM_MEMBER, OPTIM_NAME, _compat
from ._backward import attach_grad_averaging, guard_frozen_under_ddp
from ._refusals import refusal, unsupported
from .accelerate import ours, sees_one_directory, separate_views_in_state_dict, set_bind_options, write_plain_files

logger = logging.getLogger(__name__)
_WORKER_GRACE_S = 0.05  # [Note: exit after a last gather]

SHARDED_DIR = "hf_zero_optimizer"  # inside a Trainer checkpoint: each rank's optimizer state

# inner name -> (optimizer class, fixed kwargs, uses Adam's betas/eps, extra optim_args keys)
_INNER: dict[str, tuple[type, dict, bool, tuple[str, ...]]] = {
    "adamw": (torch.optim.AdamW, {}, True, ("amsgrad",)),
    "adamw_foreach": (torch.optim.AdamW, {"foreach": True}, True, ("amsgrad",)),
    "adamw_fused": (torch.optim.AdamW, {"fused": True}, True, ("amsgrad",)),
    "adam": (torch.optim.Adam, {}, True, ("amsgrad",)),
    "sgd": (torch.optim.SGD, {}, False, ("momentum", "dampening", "nesterov")),
    "adafactor": (
        Adafactor,
        {"scale_parameter": False, "relative_step": False},  # as Trainer's optim="adafactor"
        False,
        ("scale_parameter", "relative_step", "warmup_init", "clip_threshold", "decay_rate", "beta1"),
    ),
}
# The default inner optimizer: Trainer's own default (``adamw_torch_fused`` on torch >= 2.8),
# the fused AdamW kernel, wherever torch has one for the model's params.
DEFAULT_INNER = "adamw_fused"
_FALLBACK_INNER = "adamw"
_COMMON_KEYS = ("inner", "shard", "bucket_view", "sharded_checkpoints", "grad_reduce", "overlap", "master_weights",
                "stage", "local_accumulation", "grad_accum_dtype")
_STAGES = ("1", "2")
_GRAD_ACCUM_DTYPES = ("auto", "fp32", "param")
_MASTER_WEIGHTS = {"auto": "auto", "true": True, "false": False}
_GRAD_REDUCE = ("reduce_scatter", "all_reduce")
_SHARDS = ("auto", "flat", "param")
_BOOL = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
_FLOAT_KEYS = ("momentum", "dampening", "clip_threshold", "decay_rate", "beta1")


def _bool(key: str, value: str) -> bool:
    try:
        return _BOOL[value.lower()]
    except KeyError:
        raise ValueError(f"optim_args: {key}={value!r} is not a boolean; use one of {sorted(_BOOL)}") from None


def parse_optim_args(optim_args: dict[str, str], params=None) -> dict[str, Any]:
    """Turn Trainer's parsed ``optim_args`` into ZeroBucketOptimizer keyword arguments
    (besides the learning rate, betas, eps and weight decay, which come from the args).

    Keys (booleans are ``true``/``false``, ``1``/``0`` or ``yes``/``no``):

    - ``inner``: one of :data:`_INNER`. Default ``adamw_fused``, torch's fused AdamW kernel
      (as Trainer's default ``optim="adamw_torch_fused"``); where torch has no fused kernel
      for ``params``' devices and dtypes (all params when None: checked on CPU float32),
      ``adamw`` (single-tensor, as ``optim="adamw_torch"``), with a warning. An explicit
      ``inner=adamw_fused`` that torch refuses raises;
    - ``shard``: ``auto`` (default), ``flat`` or ``param``;
    - ``bucket_view``: bool, default true (params become views of the flat buffers);
    - ``sharded_checkpoints``: bool, default true over several ranks (read by
      :class:`ZeroBucketCallback`, see :func:`sharded_checkpoints_requested`);
    - ``grad_reduce``: ``reduce_scatter`` (default) or ``all_reduce`` (DDP's own all-reduce);
    - ``overlap``: bool, default false (opt-in: the parameter sync overlaps what runs until
      the next forward and, per block of the model's ``_no_split_modules``, the forward of
      the blocks before; limits in docs/gradient_path.md);
    - ``master_weights``: ``auto``, ``true`` or ``false``: fp32 master weights for 16-bit
      params, passed to the optimizer only when given (its default applies otherwise);
    - ``stage``: ``1`` (default) or ``2``: gradients sharded too, and the model not wrapped in
      DDP (docs/stage2.md); its buckets follow ``ddp_bucket_cap_mb`` and its buffer broadcasts
      ``ddp_broadcast_buffers``, as DDP's would;
    - ``local_accumulation``: bool, default false, stage 2 only: with gradient accumulation keep
      each rank's full local grads until the last micro-batch (DDP's ``no_sync``: fewer bytes
      sent, a full gradient held) instead of reducing every micro-batch into the shards;
    - ``grad_accum_dtype``: ``auto`` (default, ``param``), ``fp32`` or ``param``, stage 2 only: what
      the grad shards of bf16/fp16 params sum micro-batches and ranks in: float32 (+2/N bytes per
      param; the exact sum up to float32 roundings) or the params' dtype (one 16-bit rounding per
      micro-batch; bitwise stage 1 without accumulation or with ``local_accumulation=true``);
    - the inner optimizer's own options: ``amsgrad`` (bool) for ``adamw*`` and ``adam``;
      ``momentum``, ``dampening`` (numbers) and ``nesterov`` (bool) for ``sgd``;
      ``scale_parameter``, ``relative_step``, ``warmup_init`` (bools), ``clip_threshold``,
      ``decay_rate``, ``beta1`` (numbers) for ``adafactor``. Adafactor is built with
      ``scale_parameter=False, relative_step=False`` unless given, as Trainer's own
      ``optim="adafactor"`` does, so the learning rate is Trainer's.

    Unknown keys or values raise ``ValueError`` naming the key and listing the valid ones.
    """
    inner = optim_args.get("inner") or _default_inner(params)
    if inner not in _INNER:
        raise ValueError(f"optim_args: inner={inner!r} is not supported; choose one of {sorted(_INNER)}")
    cls, fixed, _, extra = _INNER[inner]
    valid = _COMMON_KEYS + extra
    unknown = sorted(set(optim_args) - set(valid))
    if unknown:
        raise ValueError(
            f"optim_args: unknown key(s) {unknown} for optim='{OPTIM_NAME}' with inner={inner!r}; "
            f"valid keys: {list(valid)}"
        )
    shard = optim_args.get("shard", "auto")
    if shard not in _SHARDS:
        raise ValueError(f"optim_args: shard={shard!r} is not valid; choose one of {list(_SHARDS)}")
    _bool("sharded_checkpoints", optim_args.get("sharded_checkpoints", "false"))  # validated here, used by the callback
    grad_reduce = optim_args.get("grad_reduce", "reduce_scatter")
    if grad_reduce not in _GRAD_REDUCE:
        raise ValueError(f"optim_args: grad_reduce={grad_reduce!r} is not valid; choose one of {list(_GRAD_REDUCE)}")
    if "master_weights" in optim_args and optim_args["master_weights"].lower() not in _MASTER_WEIGHTS:
        raise ValueError(
            f"optim_args: master_weights={optim_args['master_weights']!r} is not valid; choose one of "
            f"{list(_MASTER_WEIGHTS)}"
        )
    stage = optim_args.get("stage", "1")
    if stage not in _STAGES:
        raise ValueError(f"optim_args: stage={stage!r} is not valid; choose one of {list(_STAGES)}")
    if stage == "2" and grad_reduce != "reduce_scatter":
        raise ValueError(f"optim_args: stage=2 reduce-scatters the grads: grad_reduce={grad_reduce!r} contradicts it")
    if "local_accumulation" in optim_args and stage != "2":
        raise ValueError("optim_args: local_accumulation is a stage=2 option (stage 1 accumulates as DDP does); "
                         "add stage=2 or remove it")
    accum = optim_args.get("grad_accum_dtype", "auto")
    if accum not in _GRAD_ACCUM_DTYPES:
        raise ValueError(f"optim_args: grad_accum_dtype={accum!r} is not valid; choose one of {list(_GRAD_ACCUM_DTYPES)}")
    if "grad_accum_dtype" in optim_args and stage != "2":
        raise ValueError("optim_args: grad_accum_dtype is a stage=2 option (stage 1 accumulates as DDP does, in the "
                         "grads' dtype); add stage=2 or remove it")
    if "inner" in optim_args and inner == "adamw_fused":
        refused = _fused_refusal(params)
        if refused is not None:
            raise ValueError(f"optim_args: inner='adamw_fused' is not available here: {refused}; use inner=adamw")
    out: dict[str, Any] = {
        "optimizer_class": cls,
        "shard": shard,
        "parameters_as_bucket_view": _bool("bucket_view", optim_args.get("bucket_view", "true")),
        "grad_reduce": grad_reduce,
        "overlap_param_sync": _bool("overlap", optim_args.get("overlap", "false")),
        **fixed,
    }
    if stage == "2":  # passed only then (stage 1 is every core's default)
        out["stage"] = 2
        out["local_accumulation"] = _bool("local_accumulation", optim_args.get("local_accumulation", "false"))
        if "grad_accum_dtype" in optim_args:  # passed only when given (older cores have no such keyword)
            out["grad_accum_dtype"] = accum
    if "master_weights" in optim_args:  # passed only when given (older cores have no such keyword)
        out["master_weights"] = _MASTER_WEIGHTS[optim_args["master_weights"].lower()]
    for key in extra:
        if key in optim_args:
            raw = optim_args[key]
            if key in _FLOAT_KEYS:
                try:
                    out[key] = float(raw)
                except ValueError:
                    raise ValueError(f"optim_args: {key}={raw!r} is not a number") from None
            else:
                out[key] = _bool(key, raw)
    return out


def _parse_optim_args_string(text: str | None) -> dict[str, str]:
    """``"k=v,k2=v2"`` (``TrainingArguments.optim_args``) as a dict."""
    out = {}
    for item in (text or "").replace(" ", "").split(","):
        if item:
            key, _, value = item.partition("=")
            out[key] = value
    return out


def sharded_checkpoints_requested(args) -> bool | None:
    """What ``--optim_args`` says of sharded checkpoints: ``sharded_checkpoints=true`` /
    ``false``, or None when it says nothing (then they are sharded over several ranks)."""
    raw = _parse_optim_args_string(args.optim_args).get("sharded_checkpoints")
    return None if raw is None else _bool("sharded_checkpoints", raw)


def _fused_refusal(params=None) -> str | None:
    """Why torch's fused AdamW refuses ``params``' (device, dtype) kinds (CPU float32 when
    None), or None when it takes them."""
    kinds = {(p.device, p.dtype) for p in params} if params is not None else {(torch.device("cpu"), torch.float32)}
    try:  # torch checks devices and dtypes when a step first meets a param: one step of 1-element probes
        probes = [torch.zeros(1, dtype=dt, device=dev, requires_grad=True) for dev, dt in sorted(kinds, key=str)]
        for t in probes:
            t.grad = torch.zeros_like(t)
        torch.optim.AdamW(probes, fused=True).step()
    except (RuntimeError, ValueError, NotImplementedError) as e:
        return f"torch's fused AdamW refuses params on {sorted({f'{d}/{t}' for d, t in kinds})}: {e}"
    return None


def _default_inner(params=None) -> str:
    """:data:`DEFAULT_INNER` where torch's fused AdamW takes ``params``, else the single-tensor one."""
    refused = _fused_refusal(params)
    if refused is None:
        return DEFAULT_INNER
    logger.warning("optim='%s': the default inner optimizer is %s (Trainer's adamw_torch_fused), but %s; "
                   "using inner=%s (single-tensor AdamW, as adamw_torch). Pass --optim_args inner=%s to choose it "
                   "explicitly.", OPTIM_NAME, DEFAULT_INNER, refused, _FALLBACK_INNER, _FALLBACK_INNER)
    return _FALLBACK_INNER


class ZeroBucketFactory:
    """What the ``zero_bucket`` handler returns: Trainer calls ``factory()(model, **kwargs)``.

    Builds Trainer-style decay / no-decay param groups over **all** params, frozen
    ones included (Trainer's own groups drop them, and a param missing from the
    optimizer can never be trained after it is unfrozen). Its state dicts have the
    layout of Trainer's own optimizer (trainable params only, both groups even when one
    is empty; ``state_dict_params="trainable"``), so a checkpoint resumes with
    ``adamw_torch`` and back, frozen params' state kept for hf_zero's own resume.
    """

    def __call__(self, model: torch.nn.Module, *, weight_decay: float, **kwargs: Any) -> ZeroBucketOptimizer:
        # Inside Trainer.create_optimizer: that trainer's (possibly overridden) decay
        # rules; otherwise Trainer's default rules.
        _compat.warn_untested()
        trainer = _compat.creating_trainer()
        decay = set(transformers.Trainer.get_decay_parameter_names(None, model) if trainer is None
                    else trainer.get_decay_parameter_names(model))
        named = list(model.named_parameters())
        groups = [
            {
                "params": [p for n, p in named if n in decay],
                "param_names": [n for n, _ in named if n in decay],
                "weight_decay": weight_decay,
            },
            {
                "params": [p for n, p in named if n not in decay],
                "param_names": [n for n, _ in named if n not in decay],
                "weight_decay": 0.0,
            },
        ]
        local_accumulation = kwargs.pop("local_accumulation", None)
        # Both groups stay, as in Trainer's: a decay rule that selects every param or none leaves one empty.
        opt = ZeroBucketOptimizer(groups, state_dict_params="trainable", **kwargs)
        if local_accumulation is not None:  # for the bind the Accelerate wiring makes at prepare
            set_bind_options(opt, local_accumulation=local_accumulation)
        if trainer is not None:
            _TRAINER_OF[opt] = weakref.ref(trainer)
        return opt


def _handler(ctx) -> tuple[Any, dict[str, Any]]:
    kwargs = parse_optim_args(ctx.optim_args, None if ctx.model is None else list(ctx.model.parameters()))
    _check_engine(ctx.args)
    _check_fp16_params(ctx.args, ctx.model)
    _check_parallel(ctx.args)
    kwargs.update(ctx.optimizer_kwargs)  # lr
    if _INNER[ctx.optim_args.get("inner", DEFAULT_INNER)][2]:  # the fallback uses them too
        kwargs.update(ctx.adam_kwargs)  # betas, eps
    kwargs["weight_decay"] = ctx.args.weight_decay
    return ZeroBucketFactory, kwargs


def _check_fp16_params(args, model) -> None:
    """Refuse ``fp16=True`` on a model with float16 trainable params: GradScaler's
    ``unscale_`` refuses float16 gradients ("Attempting to unscale FP16 gradients")."""
    if not getattr(args, "fp16", False) or model is None:
        return
    half = [n for n, p in model.named_parameters() if p.dtype == torch.float16]
    if half:
        raise ValueError(
            f"optim='{OPTIM_NAME}': fp16=True with float16 params ({len(half)}, e.g. {half[0]!r}): fp16 mixed "
            "precision scales the loss and GradScaler cannot unscale float16 gradients. Load the model in "
            "float32 (autocast computes in float16 and keeps float32 weights), or train a 16-bit model with "
            "bf16=True."
        )


def _check_engine(args) -> None:
    """Refuse FSDP, DeepSpeed, Megatron-LM and tensor/context parallelism (see
    :mod:`hf_zero.integrations._refusals`), from the args and from the Trainer's accelerator."""
    trainer = _compat.creating_trainer()
    accelerator = getattr(trainer, "accelerator", None)
    what = unsupported(
        distributed_type=getattr(accelerator, "distributed_type", None),
        parallelism_config=getattr(args, "parallelism_config", None) or getattr(accelerator, "parallelism_config", None),
        tp_size=getattr(args, "tp_size", None) or getattr(getattr(trainer, "model", None), "tp_size", None),
        fsdp=getattr(args, "fsdp", None),
        deepspeed=getattr(args, "deepspeed", None),
    )
    if what is not None:
        raise refusal(what, where=f"optim='{OPTIM_NAME}'")


def _check_parallel(args) -> None:
    """Refuse to shard over a world the Trainer does not train in (say, plain ``torchrun``
    on CPU without ``ACCELERATE_USE_CPU=1``: each process runs its own Trainer)."""
    import torch.distributed as dist

    if args.world_size == 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"optim='{OPTIM_NAME}': the Trainer runs this process alone (parallel_mode={args.parallel_mode.value}, "
            f"world_size=1) but torch.distributed has {dist.get_world_size()} processes, so each process trains "
            "its own model and no gradients are averaged; sharding the optimizer over them would be wrong. "
            "Launch so that transformers sees the distributed run: on CPU set ACCELERATE_USE_CPU=1 "
            "(`ACCELERATE_USE_CPU=1 torchrun --nproc-per-node N ...`) or use "
            "`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N ...`."
        )


def register() -> None:
    """Register ``optim="zero_bucket"`` and the default callback. Idempotent.

    All or nothing: when a step fails, what this call added (the name, the handler, the
    callback) is removed again before the error propagates, so a Trainer never sees
    ``zero_bucket`` without its handler. (The method wrappers of ``watch_trainer`` /
    ``before_optimizer_save`` may stay: they change nothing for other optimizers.)"""
    from transformers.training_args import OptimizerNames

    undo = []
    try:
        if OPTIM_NAME not in {m.value for m in OptimizerNames}:
            _compat.add_optimizer_name(OPTIM_NAME, member_name=OPTIM_MEMBER)
            undo.append(lambda: _compat.remove_optimizer_name(OPTIM_NAME))
        if not _compat.optimizer_registered(OPTIM_NAME):
            undo.append(lambda: _compat.unregister_optimizer(OPTIM_NAME))
            _compat.register_optimizer(OPTIM_NAME, _handler)
        _compat.watch_trainer(transformers.Trainer)
        _compat.before_optimizer_save(transformers.Trainer, _before_optimizer_save, _after_optimizer_save)
        _compat.serve_loaded_optimizer_state(_serve_reference)
        _compat.after_failed_train(transformers.Trainer, _unbind_after_failure)
        if ZeroBucketCallback not in transformers.trainer.DEFAULT_CALLBACKS:
            transformers.trainer.DEFAULT_CALLBACKS.append(ZeroBucketCallback)
    except BaseException:
        for step in reversed(undo):
            step()
        raise


# optimizer -> the Trainer whose create_optimizer built it (weakly)
_TRAINER_OF: "weakref.WeakKeyDictionary[ZeroBucketOptimizer, weakref.ref]" = weakref.WeakKeyDictionary()
# Callbacks from these packages read no params between a step and the next forward.
_PARAM_FREE_CALLBACK_MODULES = ("transformers.", "hf_zero.")

# optimizer -> the callback instance driving it (a callback passed explicitly *and*
# added by default must not rebuild or consolidate twice)
_DRIVER: "weakref.WeakKeyDictionary[ZeroBucketOptimizer, TrainerCallback]" = weakref.WeakKeyDictionary()
# optimizer -> whether its Trainer checkpoints are sharded: set by the driver at train
# begin, then by any ZeroBucketCallback(sharded_checkpoints=True) of the same Trainer
_SHARDED_SAVES: "weakref.WeakKeyDictionary[ZeroBucketOptimizer, bool]" = weakref.WeakKeyDictionary()


class ZeroBucketCallback(TrainerCallback):
    """Keeps a Trainer's ZeroBucketOptimizer right across trainability changes and saves.

    Added to every Trainer by :func:`register` (automatic with hf_zero installed); does
    nothing unless the Trainer's optimizer is a :class:`~hf_zero.ZeroBucketOptimizer`.
    On every rank, in lockstep:

    - at train begin (DDP has just been built) it records which params DDP reduces,
      arranges for the others' grads to be averaged at the end of each backward
      (before clipping and GradScaler see them), and builds the buffers;
    - each step re-partitions if any ``requires_grad`` changed (freeze / unfreeze from
      your own callbacks or code): the optimizer's step decides it, with one
      agreement all-reduce per step;
    - a forward that follows the freezing of a param DDP reduces fails early, saying
      what to set, when DDP cannot handle it (``find_unused_parameters=False``,
      Trainer's default with gradient checkpointing);
    - right before Trainer writes a checkpoint's optimizer state (whatever decided the
      save: a strategy, ``save_strategy="best"``, a callback setting ``should_save``)
      every rank writes its own state to ``checkpoint-N/hf_zero_optimizer``
      (``save_sharded``, no gather) and ``optimizer.pt`` is a small reference to it
      (see :mod:`hf_zero._sharded`); with ``sharded_checkpoints=False`` rank 0 then
      streams those files into a plain PyTorch ``optimizer.pt`` (16 MiB at a time) and
      removes them. One process writes the plain file directly (nothing to gather);
    - at train begin, when ``resume_from_checkpoint`` loaded such a reference, it loads
      the sharded state (any number of processes), from the resumed checkpoint; a
      Trainer with another optimizer (``--optim adamw_torch``) resuming such a
      checkpoint gets the plain state dict built from those files;
    - at train end, and when ``train()`` raises (an interrupt, an error in a step or a
      callback), it unbinds the optimizer (``optimizer.unbind()``): the model keeps no
      hook or attribute of hf_zero's and its params own their storage, so a later Trainer
      on it (or a second ``train()``) binds it afresh and any saver takes it;
    - it adds ZeRO facts (per-rank trainable elements and optimizer-state bytes,
      rebuild count) to ``state.log_history`` at train begin, after the first step (the
      optimizer state exists then) and after each rebuild, and their summary to the next
      logged line (the line ``log_history`` keeps too); after the first step it logs the
      memory ledger beside the planner's prediction once.

    Args:
        sharded_checkpoints: ``None`` (default): Trainer checkpoints hold each rank's
            optimizer state (sharded) when the optimizer shards over several ranks, a
            plain ``optimizer.pt`` on one process; ``True``: always sharded; ``False``:
            always a plain ``optimizer.pt`` (built in bounded memory, as above). Pass
            ``callbacks=[ZeroBucketCallback(sharded_checkpoints=False)]`` to the Trainer
            (it takes effect alongside the default instance), or from the command line
            ``--optim_args sharded_checkpoints=false`` (which wins). All ranks must see
            the output directory.
    """

    def __init__(self, sharded_checkpoints: bool | None = None) -> None:
        self.sharded_checkpoints = None if sharded_checkpoints is None else bool(sharded_checkpoints)
        self._rebuilds_logged = -1
        self._ledger_logged = False
        self._state_seen = False  # the optimizer state was sampled after a step that made some
        self._pending: dict[str, Any] = {}
        self._drain_after_step = True

    # -- helpers ---------------------------------------------------------------------
    def _mine(self, optimizer) -> ZeroBucketOptimizer | None:
        opt = ours(optimizer)
        if opt is None or _DRIVER.get(opt) is not self:
            return None
        return opt

    @staticmethod
    def _facts(opt: ZeroBucketOptimizer) -> dict[str, Any]:
        """ZeRO facts gathered from every rank. Collective."""
        stats = opt.stats()
        elements = stats["elements_per_rank"]
        mean = sum(elements) / len(elements)
        return {
            "zero_rebuilds": stats["rebuilds"],
            "zero_trainable_elements_per_rank": elements,
            # the fp32 masters are optimizer state too (docs/precision.md counts them so)
            "zero_state_bytes_per_rank": [s + m for s, m in zip(stats["state_bytes_per_rank"],
                                                                stats["master_bytes_per_rank"])],
            "zero_master_bytes_per_rank": stats["master_bytes_per_rank"],
            "zero_balance": round(max(elements) / mean, 4) if mean else 1.0,
        }

    def _record(self, opt: ZeroBucketOptimizer, state, *, force: bool = False) -> None:
        """Log the facts after a rebuild, or when ``force``d. Collective: every rank decides alike."""
        if opt.rebuilds == self._rebuilds_logged and not force:
            return
        facts = self._facts(opt)
        self._state_seen = state.global_step > 0 and max(facts["zero_state_bytes_per_rank"]) > 0
        self._rebuilds_logged = opt.rebuilds
        state.log_history.append({**facts, "step": state.global_step})
        self._pending.update({k: v for k, v in facts.items() if not isinstance(v, list)})  # the ledger's too
        self._pending["zero_state_bytes_max"] = max(facts["zero_state_bytes_per_rank"])
        if state.is_world_process_zero:
            logger.info("hf_zero at step %d: %s", state.global_step, facts)

    # -- events ----------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        opt = ours(optimizer)
        if opt is None:
            return
        if _DRIVER.get(opt) not in (None, self):
            if self.sharded_checkpoints is not None and sharded_checkpoints_requested(args) is None:
                _SHARDED_SAVES[opt] = self.sharded_checkpoints
            return
        _DRIVER[opt] = self
        _compat.check_trainer_log()  # on_log relies on it: refused before the first step, not at the first log
        _SHARDED_SAVES[opt] = _chosen_saves(args, [self, *(_callbacks_of(opt) or [])])
        _check_saving_ranks(opt, args)
        # DDP was built just before this event. Trainer sets accelerate's shared
        # GradientState.sync_gradients before each micro-batch.
        from accelerate.state import GradientState

        attach_grad_averaging(model, opt, syncing=lambda: GradientState().sync_gradients)
        if model is not None:
            separate_views_in_state_dict(model, opt)  # saved without a copy of the model
        guard_frozen_under_ddp(model, opt, find_unused_parameters=_compat.ddp_find_unused_parameters(args, model), hint=_DDP_HINT)
        # Trainer loaded optimizer.pt before this event; a sharded reference is loaded
        # here, before any step (collective).
        candidates = [os.path.join(args.output_dir, f"checkpoint-{state.global_step}")]
        resumed = _compat.resumed_from(optimizer)
        if resumed is not None:
            candidates.insert(0, resumed)
        opt.load_pending_sharded([os.path.join(c, SHARDED_DIR) for c in candidates])
        opt.ensure_partition()
        opt.memory_ledger()  # steps are observed from the first ledger on: the one logged after step 1 has their peaks
        self._rebuilds_logged = -1
        self._ledger_logged = False
        self._record(opt, state)
        self._drain_after_step = opt.overlaps_param_sync and _has_user_callbacks(opt)

    def on_train_end(self, args, state, control, optimizer=None, **kwargs):
        opt = self._mine(optimizer)
        if opt is not None:
            opt.wait_param_sync()
            # the model is the user's again ([Note: a binding ends with its run]): a later Trainer on it,
            # or a second train(), binds it afresh
            opt.unbind()
            # [Note: exit after a last gather] Trainer's last collective (store_flos's
            # all_gather) returns before gloo's worker thread has freed the work, which needs
            # the GIL; when the process ends right after, torch frees DDP's Reducer holding the
            # GIL and joins that worker: a deadlock (pytorch#56297; 6 of 48 plain `trl sft --optim
            # adamw_torch` runs here). Releasing the GIL a moment gives the worker the chance to
            # finish first; that it lowers the rate is not shown (docs/known_limits.md, "Exit").
            time.sleep(_WORKER_GRACE_S)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        opt = self._mine(optimizer)
        if opt is not None:
            if self._drain_after_step:
                # [Note: overlapped parameter sync] a user callback may read params before
                # the next forward (this callback runs before theirs): complete them now.
                opt.wait_param_sync()

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        opt = self._mine(optimizer)
        if opt is None:
            return
        # After the step (Trainer has counted it): the step itself rebuilds after late trainability changes, and
        # the first step makes the optimizer state. stats() is collective: sampled after a rebuild, after the first
        # step, and at logging steps (Trainer gathers the loss there anyway) while no state has been seen (a
        # GradScaler may skip the first steps). Every rank takes the same branches (global_step, control.should_log
        # and the gathered facts agree).
        self._record(opt, state, force=not self._state_seen and (state.global_step == 1 or control.should_log))
        if not self._ledger_logged and self._state_seen:
            self._ledger_logged = True
            self._log_ledger(opt, state)

    def _log_ledger(self, opt: ZeroBucketOptimizer, state) -> None:
        """Once, after the first step that made optimizer state: this rank's memory ledger and the planner's
        prediction of its model states, in ``state.log_history``, the next logged line and the log. The logged
        figures are the ledger's peaks (its ``peak_model_states``, ``peak_total``): what a step holds before its
        optimizer step, as predicted, not what is left after it (stage 2 lets its grad shards go in the step)."""
        ledger = opt.memory_ledger()
        predicted = predict_for(opt)
        entry = {"zero_memory_ledger": ledger.as_dict(), "zero_memory_predicted": predicted, "step": state.global_step}
        state.log_history.append(entry)
        self._pending.update(zero_memory_total_bytes=ledger.peak_total,
                             zero_memory_model_states_bytes=ledger.peak_model_states)
        if predicted is not None:
            self._pending["zero_memory_predicted_model_states_bytes"] = predicted["model_states"]
        if state.is_world_process_zero:
            logger.info("%s; predicted model states %s MiB (rank %d; activations are not hf_zero's and not counted)",
                        ledger.format(), "-" if predicted is None else f"{predicted['model_states'] / 2**20:.1f}",
                        opt.rank)

    def on_log(self, args, state, control, logs=None, optimizer=None, **kwargs):
        if self._mine(optimizer) is not None and logs is not None and self._pending:
            # Trainer stored its entry before this event: the keys go into that entry too
            entry = _compat.logged_entry(state, logs)
            logs.update(self._pending)
            if entry is not None:
                entry.update(self._pending)
            self._pending = {}


def _unbind_after_failure(trainer) -> None:
    """``train()`` raised (an exception in a step or a callback, an interrupt): no ``on_train_end`` comes, so
    the optimizer is unbound here, as there ([Note: a binding ends with its run]); the exception goes on."""
    opt = ours(getattr(trainer, "optimizer", None))
    if opt is None:
        return
    try:
        opt.unbind()
    except Exception:  # the run's own exception is the one to see
        logger.warning("hf_zero: unbinding the optimizer after train() raised failed", exc_info=True)


def _before_optimizer_save(trainer, output_dir: str) -> None:
    """Run on every rank right before Trainer writes a checkpoint's optimizer state
    (whatever decided the save: a strategy, ``"best"``, a callback).

    [Note: checkpoint hook] Trainer writes optimizer.pt from rank 0's state_dict() only,
    then trainer_state.json, then rotates old checkpoints. Over several ranks every rank
    writes its own state here first (no gather), so a checkpoint whose optimizer.pt
    refers to it holds it; for a plain file, :func:`_after_optimizer_save` then streams
    it into optimizer.pt. One process without sharded saves: state_dict() is the state
    itself (no copy). ``sharded_checkpoints=false`` where ranks do not share the output
    directory (no shared filesystem): gathered on rank 0, in CPU memory, as before."""
    opt = ours(trainer.optimizer)
    if opt is None:
        return
    plain = not _sharded_saves(opt, trainer.args)
    if opt.world_size > 1 and plain and not sees_one_directory(output_dir):
        opt.consolidate_state_dict(to=0, device="cpu")  # no shared directory: gathered on rank 0, as before
    elif opt.world_size > 1 or not plain:
        path = os.path.join(output_dir, SHARDED_DIR)
        opt.save_sharded(path)
        opt.refer_to_sharded(path, step=trainer.state.global_step)
    else:
        opt.consolidate_state_dict(to=0)


def _after_optimizer_save(trainer, output_dir: str) -> None:
    """Run on every rank right after Trainer wrote a checkpoint's optimizer state: with
    ``sharded_checkpoints=false`` over several ranks, the ranks that wrote optimizer.pt
    (a reference) replace it by the plain state dict streamed from the sharded files,
    which they then remove; every rank learns whether that failed (collective)."""
    opt = ours(trainer.optimizer)
    if opt is None or opt.world_size == 1 or _sharded_saves(opt, trainer.args):
        return
    path = os.path.join(output_dir, SHARDED_DIR)
    due = [(path, os.path.join(output_dir, _OPTIMIZER_FILE))]
    # not after the gather of _before_optimizer_save (no shared directory): nothing sharded there
    write_plain_files(due if trainer.args.should_save and _sharded.is_sharded_checkpoint(path) else [])


_OPTIMIZER_FILE = getattr(transformers.trainer, "OPTIMIZER_NAME", "optimizer.pt")


def _chosen_saves(args, callbacks: list) -> bool | None:
    """Sharded saves as ``--optim_args`` says, else as a ZeroBucketCallback given a value
    says (True wins), else None (the default: sharded over several ranks)."""
    requested = sharded_checkpoints_requested(args)
    if requested is not None:
        return requested
    chosen = {cb.sharded_checkpoints for cb in callbacks if isinstance(cb, ZeroBucketCallback)} - {None}
    return True if True in chosen else (False if chosen else None)


def _sharded_saves(opt: ZeroBucketOptimizer, args) -> bool:
    """Whether ``opt``'s Trainer checkpoints stay sharded (else optimizer.pt is plain)."""
    sharded = _SHARDED_SAVES.get(opt)
    if sharded is None:
        sharded = sharded_checkpoints_requested(args)
    return opt.world_size > 1 if sharded is None else sharded


def _serve_reference(optimizer, checkpoint: str, state_dict):
    """[Note: serving a loaded state dict] A Trainer whose optimizer is not hf_zero's
    (``--optim adamw_torch``) resuming a checkpoint whose optimizer.pt refers to sharded
    state gets the plain state dict built from those files (on CPU, as torch.load of a
    plain file would give it); hf_zero's own optimizer takes the reference."""
    if ours(optimizer) is not None:
        return state_dict
    if not _sharded.is_reference(state_dict):
        return _fitting(optimizer, checkpoint, state_dict)
    token = _sharded.reference_info(state_dict)["token"]
    inside = os.path.join(checkpoint, SHARDED_DIR)
    for path in (inside, _sharded.reference_info(state_dict)["path"]):
        if _sharded.token_at(path) == token:
            return _fitting(optimizer, checkpoint, _offline.consolidate_checkpoint(path), hf_zero_state=True)
    raise ValueError(
        f"hf_zero: {os.path.join(checkpoint, _OPTIMIZER_FILE)} refers to sharded optimizer state (token {token}) "
        f"that is not in {inside!r}; make a plain file with `hf-zero consolidate DIR {_OPTIMIZER_FILE}` from the "
        "directory that holds it"
    )


def _fitting(optimizer, checkpoint: str, state_dict, *, hf_zero_state: bool = False):
    """``state_dict``, or a ``ValueError`` saying why it cannot fit ``optimizer`` (torch would only
    say that a group's size differs) when hf_zero wrote it (``hf_zero_state``, or it carries
    frozen params' state or param names, which Trainer's own optimizers do not write)."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list):
        return state_dict
    groups = state_dict["param_groups"]
    ours_wrote = hf_zero_state or FROZEN_KEY in state_dict or any("param_names" in g for g in groups)
    saved = [len(g.get("params", ())) for g in groups]
    mine = [len(g["params"]) for g in optimizer.param_groups]
    if not ours_wrote or saved == mine:
        return state_dict
    raise ValueError(
        f"hf_zero: the optimizer state in {checkpoint!r} was saved by optim='{OPTIM_NAME}' with param groups of "
        f"{saved} params, and this {type(optimizer).__name__} has {mine}: the run that saved it had other params "
        "trainable (frozen params are not in Trainer's own optimizer), or it was saved by an hf_zero whose state "
        f"dicts listed frozen params too. Resume with the trainable params of the save, or with optim='{OPTIM_NAME}', "
        "which loads either layout"
    )


def _check_saving_ranks(opt: ZeroBucketOptimizer, args) -> None:
    """Refuse, on every rank, a run where several ranks write a plain ``optimizer.pt``
    (``save_on_each_node`` over several nodes, ``sharded_checkpoints=false``): it is
    built from files every rank writes into one directory."""
    import torch.distributed as dist

    if _sharded_saves(opt, args) or not args.save_on_each_node or not dist.is_initialized():
        return
    saving = [None] * dist.get_world_size()
    dist.all_gather_object(saving, bool(args.should_save))
    if sum(saving) > 1:
        raise ValueError(
            f"optim='{OPTIM_NAME}': save_on_each_node=True makes ranks {[r for r, s in enumerate(saving) if s]} "
            "each write optimizer.pt, but with sharded_checkpoints=false the plain optimizer.pt is built on one "
            "rank. Use --optim_args sharded_checkpoints=true, the default (every rank writes its own shard; all "
            "ranks must see the output directory) or save_on_each_node=False."
        )


_DDP_HINT = (
    "Set TrainingArguments(ddp_find_unused_parameters=True) (with gradient checkpointing keep "
    "gradient_checkpointing_kwargs={'use_reentrant': False}, transformers' default since 5.0), or freeze "
    "the param before the Trainer starts."
)


def _callbacks_of(opt: ZeroBucketOptimizer) -> list | None:
    """The callbacks of the Trainer that built ``opt`` (None when that Trainer is unknown)."""
    ref = _TRAINER_OF.get(opt)
    trainer = ref() if ref is not None else None
    return None if trainer is None else list(trainer.callback_handler.callbacks)


def _has_user_callbacks(opt: ZeroBucketOptimizer) -> bool:
    """Whether the Trainer that built ``opt`` has callbacks other than transformers' and
    hf_zero's (True when that Trainer is unknown)."""
    callbacks = _callbacks_of(opt)
    if callbacks is None:
        return True
    return any(not type(cb).__module__.startswith(_PARAM_FREE_CALLBACK_MODULES) for cb in callbacks)


register()
