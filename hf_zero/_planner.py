"""Plan a fine-tune before launching it: per-rank optimizer memory and balance.

The model is built on the meta device from a Hugging Face config (no weights, no
download), its parameters are turned into :class:`~hf_zero._layout.ParamSpec` and
planned with :func:`~hf_zero._layout.plan_layout` for hf_zero's ``flat`` and
``param`` modes, next to torch's ``ZeroRedundancyOptimizer`` partition of the same
params (whole params, largest first, frozen params counted at full size).

The JSON report (``hf-zero plan --json``) is documented in ``docs/planner.md``;
its ``schema`` field names its version and changes only with the layout of the
report.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ._comm import default_strategy
from ._layout import ParamSpec, torch_zero_owners, max_over_mean, plan_layout, torch_zero_loads
from ._runs import may_follow
from ._stage2 import GRAD_ACCUM_DTYPES, accumulate_dtype, buckets_in_flight, carrier_of, plan_buckets, shard_dtype

SCHEMA = "hf_zero.plan/3"  # 3: "ledger" (and "fits" with --device-memory)
OPTIMIZERS = ("adamw", "sgd", "adafactor")
BACKENDS = ("nccl", "gloo")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Optimizers whose update is elementwise, so shard="flat" is exact for them.
_ELEMENTWISE = ("adamw", "sgd")
_STEP_BYTES = 4  # torch.optim.AdamW keeps ``step`` as a float32 scalar tensor per param
MASTER_WEIGHTS = ("auto", "true", "false")
_DDP_BUCKET_CAP_MB = 25.0  # torch DistributedDataParallel's default bucket_cap_mb

# Published per-rank accountings, bytes = a * params + b * trainable + c * trainable / N
# (sources and formulas: docs/planner.md). Keyed by the param dtype; None where the
# source gives no figure for that dtype. Adam(W) only.
REFERENCES: dict[str, dict[str, tuple[int, int, int] | None]] = {
    "zero_paper_stage1": {"bfloat16": (2, 2, 12), "float16": (2, 2, 12), "float32": None},
    "deepspeed_zero1": {"bfloat16": (2, 2, 16), "float16": (2, 2, 16), "float32": None},
    "megatron_distributed": {"bfloat16": (2, 4, 12), "float16": (2, 2, 16), "float32": (4, 4, 8)},
}
# With ``--stage 2`` (gradients sharded): docs/planner.md.
REFERENCES_STAGE2: dict[str, dict[str, tuple[int, int, int] | None]] = {
    "zero_paper_stage2": {"bfloat16": (2, 0, 14), "float16": (2, 0, 14), "float32": None},
}

# Published shapes (the models' config.json on the Hugging Face Hub), written out
# so planning needs no download.
PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": dict(
        model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
        tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
    ),
    "llama-3.2-1b": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                          original_max_position_embeddings=8192),
    ),
    "llama-3-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    ),
}


# --task: the transformers Auto class that builds the model with that head
TASKS: dict[str, str] = {
    "base": "AutoModel",
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "question-answering": "AutoModelForQuestionAnswering",
    "multiple-choice": "AutoModelForMultipleChoice",
}
_LABELLED = ("sequence-classification", "token-classification")  # the tasks --num-labels applies to


@dataclass(frozen=True)
class NamedParam:
    """One parameter of a meta-device model, as the planner sees it."""

    name: str
    shape: tuple[int, ...]
    trainable: bool

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def load_model_params(
    model: str, *, task: str = "auto", num_labels: int | None = None
) -> tuple[list[NamedParam], int, str]:
    """The params (tied weights once), buffer count and class name of ``model``, built on the meta device.

    ``model`` is a preset name (see :data:`PRESETS`), a ``config.json`` file or a
    folder holding one. ``task`` picks the head: one of :data:`TASKS` (e.g.
    ``"sequence-classification"`` builds ``AutoModelForSequenceClassification``), or
    ``"auto"``: the first class of the config's ``architectures`` that transformers
    has, else a causal LM where the model type has one, else the bare model.
    ``num_labels`` sets the classifier's width for the tasks in :data:`_LABELLED`
    (default: the config's ``num_labels``).
    """
    if task != "auto" and task not in TASKS:
        raise ValueError(f"task: {task!r} is not a valid task; choose one of {['auto', *TASKS]}")
    if num_labels is not None:
        if task not in _LABELLED:
            raise ValueError(f"num_labels: --num-labels applies only to --task {' or --task '.join(_LABELLED)} "
                             f"(got --task {task})")
        if num_labels < 1:
            raise ValueError(f"num_labels: --num-labels must be >= 1, got {num_labels}")
    config = _load_config(model)
    if num_labels is not None:
        config.num_labels = num_labels
    with torch.device("meta"):
        module = _build(config, task)
    params = [NamedParam(n, tuple(p.shape), True) for n, p in module.named_parameters()]
    return params, sum(1 for _ in module.buffers()), type(module).__name__


def _load_config(model: str):
    from transformers import AutoConfig, CONFIG_MAPPING

    key = model.lower()
    if key in PRESETS:
        kwargs = dict(PRESETS[key])
        return CONFIG_MAPPING[kwargs.pop("model_type")](**kwargs)
    if os.path.isdir(model) and os.path.isfile(os.path.join(model, "config.json")):
        return AutoConfig.from_pretrained(model, local_files_only=True)
    if os.path.isfile(model):
        with open(model) as f:
            kwargs = json.load(f)
        if "model_type" not in kwargs:
            raise ValueError(f"model: {model} has no 'model_type' field, so no config class can be chosen")
        return CONFIG_MAPPING[kwargs.pop("model_type")](**kwargs)
    raise ValueError(
        f"model: {model!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json "
        "file nor a folder holding one"
    )


def _build(config, task: str) -> torch.nn.Module:
    import transformers

    if task == "auto":
        for name in getattr(config, "architectures", None) or ():
            try:
                cls = getattr(transformers, name)
            except (AttributeError, ImportError):  # remote code, or a class this version lacks
                continue
            if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
                return cls(config)
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a causal LM: the bare model
            return transformers.AutoModel.from_config(config)
    try:
        return getattr(transformers, TASKS[task]).from_config(config)
    except ValueError:
        raise ValueError(
            f"task: transformers {transformers.__version__} has no {task} model for model_type "
            f"{config.model_type!r} (--task {task}); choose another of {['auto', *TASKS]}"
        ) from None


def select_trainable(params: Sequence[NamedParam], patterns: Sequence[str] | None) -> list[NamedParam]:
    """Params whose name matches any of ``patterns`` (``re.search``) are trainable; all when None."""
    if not patterns:
        return [NamedParam(p.name, p.shape, True) for p in params]
    try:
        compiled = [re.compile(x) for x in patterns]
    except re.error as e:
        raise ValueError(f"trainable: bad regular expression: {e}") from None
    out = [NamedParam(p.name, p.shape, any(c.search(p.name) for c in compiled)) for p in params]
    if not any(p.trainable for p in out):
        raise ValueError(f"trainable: no parameter name matches {list(patterns)}")
    return out


def state_bytes(shape: tuple[int, ...], numel: int, *, optimizer: str, itemsize: int) -> int:
    """Optimizer-state bytes for a tensor of ``shape`` (``numel`` elements when it is a flat piece).

    adamw: exp_avg + exp_avg_sq in the param dtype and a float32 ``step``.
    sgd: one momentum buffer (``momentum > 0``). adafactor (transformers, default
    ``beta1=None``): factored row and column second moments for >= 2-D params, a
    full one for 1-D params (its ``step`` and ``RMS`` are Python numbers).
    """
    if optimizer == "adamw":
        return 2 * numel * itemsize + _STEP_BYTES
    if optimizer == "sgd":
        return numel * itemsize
    if optimizer == "adafactor":
        if len(shape) >= 2:
            rows = numel // shape[-1]
            cols = numel // shape[-2]
            return (rows + cols) * itemsize
        return numel * itemsize
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")


def plan(
    params: Sequence[NamedParam],
    *,
    world_size: int,
    optimizer: str = "adamw",
    shards: Sequence[str] = ("flat", "param"),
    dtype: torch.dtype = torch.float32,
    backend: str = "nccl",
    model_name: str = "",
    architecture: str = "",
    buffer_count: int = 0,
    master_weights: str | bool = "auto",
    bucket_cap_mb: float = _DDP_BUCKET_CAP_MB,
    stage: int = 1,
    grad_accum_dtype: str = "auto",
) -> dict:
    """The plan report (the ``--json`` document) for ``params`` on ``world_size`` ranks.

    ``master_weights``: as the optimizer's option: ``"auto"`` or ``True`` keeps, for
    16-bit params, a float32 master and float32 optimizer state for the elements a
    rank owns; ``False`` steps the 16-bit params with state in their dtype. float32
    params never have masters. Every rank holds the params and the grads once (``p.grad``
    a view of DDP's bucket) and at most one bucket (``bucket_cap_mb``) of
    reduce-scatter scratch. ``stage=2``: each rank holds only its shard of the grads
    (the owned ranges of stage 2's buckets, in the params' dtype unless
    ``grad_accum_dtype="fp32"``, the optimizer's option, widens 16-bit ones) and, during the
    backward, the two (gloo) or three (NCCL) largest reduce buckets, each at most ``bucket_cap_mb``
    except a param above it, a bucket of its own (docs/stage2.md); the report then has ``stage``, ``reduce_bucket_bytes`` and each
    hf_zero plan's ``grad_shard_bytes_per_rank``.
    """
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 or 2, got {stage!r}")
    grad_dtype = shard_dtype(accumulate_dtype(grad_accum_dtype, stage), dtype)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    for s in shards:
        if s not in ("flat", "param"):
            raise ValueError(f"shard must be 'flat' or 'param', got {s!r}")
        if s == "flat" and optimizer not in _ELEMENTWISE:
            raise ValueError(f"shard='flat' needs an elementwise optimizer; {optimizer} is not one: use 'param'")
    if isinstance(master_weights, str):
        if master_weights.lower() not in MASTER_WEIGHTS:
            raise ValueError(f"master_weights must be one of {MASTER_WEIGHTS} or a bool, got {master_weights!r}")
        master_weights = master_weights.lower() != "false"
    if not isinstance(master_weights, bool):
        raise ValueError(f"master_weights must be one of {MASTER_WEIGHTS} or a bool, got {master_weights!r}")
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    masters = master_weights and itemsize < 4
    state_itemsize = 4 if masters else itemsize
    specs = [ParamSpec(p.numel, dtype, "cuda" if backend == "nccl" else "cpu", p.trainable) for p in params]
    trainable = [p for p in params if p.trainable]
    total = sum(p.numel for p in params)
    train_numel = sum(p.numel for p in trainable)
    unsharded_state = sum(_owned_bytes(p.shape, p.numel, optimizer, state_itemsize, masters) for p in trainable)
    buckets = plan_buckets(specs, int(bucket_cap_mb * 2**20)) if stage == 2 else None
    grads = train_numel * itemsize if stage == 1 else 0
    ledger = predict_ledger(specs, world_size=world_size, stage=stage, optimizer=optimizer, shard=shards[0],
                            master_weights=masters, bucket_cap_mb=bucket_cap_mb, shapes=[p.shape for p in params],
                            grad_accum_dtype=grad_accum_dtype)
    scratch, reduce_buckets = _transient_bytes(ledger, stage=stage, world_size=world_size, bucket_cap_mb=bucket_cap_mb,
                                               grad_bytes=train_numel * itemsize)
    report = {
        "schema": SCHEMA,
        "model": {
            "name": model_name,
            "architecture": architecture,
            "params": total,
            "param_tensors": len(params),
            "trainable_params": train_numel,
            "trainable_tensors": len(trainable),
            "module_buffers": buffer_count,
            "dtype": str(dtype).removeprefix("torch."),
        },
        "master_weights": masters,
        "world_size": world_size,
        "optimizer": optimizer,
        "backend": backend,
        "per_rank_common": {
            "param_bytes": total * itemsize,
            "grad_bytes": grads,
            "scratch_bytes": scratch,
        },
        "unsharded": {
            "state_bytes": unsharded_state,
            "ideal_state_bytes_per_rank": unsharded_state / world_size,
        },
        "plans": {},
    }
    if stage == 2:
        report["stage"] = 2
        report["per_rank_common"]["reduce_bucket_bytes"] = reduce_buckets
    for shard in shards:
        plan_ = _hf_zero_plan(params, specs, world_size, shard, optimizer, itemsize, backend, state_itemsize, masters,
                              buckets, grad_dtype.itemsize)
        sharded = plan_["state_bytes_per_rank"]
        if stage == 2:
            sharded = [a + b for a, b in zip(sharded, plan_["grad_shard_bytes_per_rank"])]
        plan_["max_rank_bytes"] = total * itemsize + grads + reduce_buckets + scratch + max(sharded)
        report["plans"][f"hf_zero_{shard}"] = plan_
    # torch's ZeroRedundancyOptimizer: one dtype, no masters, grads in p.grad, broadcasts (no scratch)
    torch_plan = _torch_plan(params, specs, world_size, optimizer, itemsize)
    torch_plan["max_rank_bytes"] = total * itemsize + train_numel * itemsize + torch_plan["max_state_bytes"]
    report["plans"]["torch_zero"] = torch_plan
    for p in report["plans"].values():
        p["bytes_per_param"] = p["max_rank_bytes"] / total if total else 0.0
    report["references"] = _references(total, train_numel, world_size, dtype, optimizer,
                                       {**REFERENCES, **(REFERENCES_STAGE2 if stage == 2 else {})})
    report["ledger"] = ledger
    report["ledger"]["shard"] = shards[0]
    return report


def _parse_bytes(text: str, what: str) -> int:
    """``24GiB``, ``24GB``, ``500MiB``, ``1.5TiB`` or plain bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)\s*", text or "", re.IGNORECASE)
    if not m:
        raise ValueError(f"{what}: {text!r} is not a size; write e.g. 24GiB, 80GB or 512MiB")
    unit = m.group(2).upper().rstrip("B")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    if unit not in scale:
        raise ValueError(f"{what}: unknown unit in {text!r}; write e.g. 24GiB, 80GB or 512MiB")
    return int(float(m.group(1)) * scale[unit])


_BLOCK = re.compile(r"^(.*?\.\d+)\.")  # a numbered block: transformer.h.3., model.layers.3.


def fits(params: Sequence[NamedParam], *, world_size: int, device_memory: int, activations: int | None = None,
         dtype: torch.dtype = torch.float32, master_weights: bool = True, bucket_cap_mb: float = _DDP_BUCKET_CAP_MB,
         optimizer: str = "adamw", grad_accum_dtype: str = "auto") -> dict[str, Any]:
    """Which of hf_zero stage 1, stage 2 or FSDP2 fits ``device_memory`` bytes per rank for ``params`` on
    ``world_size`` ranks. Each option's bytes: model states as :func:`predict_ledger` predicts them, plus what
    it holds besides at its peak, as the table counts it (:func:`_transient_bytes`): one bucket of
    reduce-scatter scratch, and at stage 2 its reduce buckets (the ``in_flight + 1`` largest of
    :func:`predict_ledger`, a param above the cap being one, e.g. an embedding); FSDP2 (fp32 sharded params,
    grads and AdamW state, a 16-bit model computing through ``MixedPrecisionPolicy``), the unsharded params
    alive at once: all of them without resharding, else the root's and two blocks' (one computing, one
    prefetched), blocks being the numbered modules. ``activations``: added to every option when given;
    otherwise left out and said so. ``choice``: the first that fits, in that order (the least sharding first)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    specs = [ParamSpec(p.numel, dtype, "cuda", p.trainable) for p in params]
    masters = master_weights and itemsize < 4
    shapes = [p.shape for p in params]
    total = sum(p.numel for p in params)
    train = sum(p.numel for p in params if p.trainable)
    options: dict[str, dict] = {}
    for stage in (1, 2):
        led = predict_ledger(specs, world_size=world_size, stage=stage, optimizer=optimizer, master_weights=masters,
                             bucket_cap_mb=bucket_cap_mb, shapes=shapes,
                             grad_accum_dtype=grad_accum_dtype if stage == 2 else "auto")
        extra = sum(_transient_bytes(led, stage=stage, world_size=world_size, bucket_cap_mb=bucket_cap_mb,
                                     grad_bytes=train * itemsize))
        options[f"hf_zero_stage{stage}"] = {"model_states": led["model_states"], "transient": extra}
    blocks: dict[str, int] = {}
    for p in params:
        m = _BLOCK.match(p.name)
        blocks[m.group(1) if m else ""] = blocks.get(m.group(1) if m else "", 0) + p.numel
    root = blocks.pop("", 0)
    biggest = sorted(blocks.values(), reverse=True)[:2]
    sharded = (4 * total + 4 * train + (8 if optimizer == "adamw" else 4) * train) / world_size
    for name, unsharded in (("fsdp2_no_reshard", total), ("fsdp2_full_shard", root + sum(biggest))):
        options[name] = {"model_states": int(sharded), "transient": unsharded * itemsize}
    for o in options.values():
        o["bytes"] = o["model_states"] + o["transient"] + (activations or 0)
        o["fits"] = o["bytes"] <= device_memory
    return {"device_memory": device_memory, "activations": activations, "options": options,
            "choice": next((n for n, o in options.items() if o["fits"]), None),
            "note": "activations included" if activations is not None else
                    "activations not included: add --activation-memory (they depend on batch, sequence and checkpointing)"}


def _transient_bytes(ledger: dict, *, stage: int, world_size: int, bucket_cap_mb: float,
                     grad_bytes: int) -> tuple[int, int]:
    """What a rank holds besides its model states at the backward's peak, for :func:`predict_ledger`'s
    ``ledger`` (``grad_bytes``: the trainable params' bytes): one bucket of reduce-scatter scratch (0 at one
    rank), and at stage 2 the reduce buckets alive at once, its ``bucket_bounds["buckets_in_flight"]`` (a param
    above the cap is a bucket of its own, reduced in its grad's storage: [Note: stage 2 reducer] in _stage2.py).
    The table and the fit check both count this."""
    scratch = min(int(bucket_cap_mb * 2**20), grad_bytes) if world_size > 1 else 0
    return scratch, ledger["bucket_bounds"]["buckets_in_flight"] if stage == 2 else 0


def format_fits(f: dict) -> str:
    """The ``--device-memory`` lines of ``hf-zero plan``."""
    gib = 2**30
    lines = ["", f"fits in {f['device_memory'] / gib:.2f} GiB per rank ({f['note']}):"]
    for name, o in f["options"].items():
        lines.append(f"  {name:<18} {o['bytes'] / gib:>8.2f} GiB  (model states {o['model_states'] / gib:.2f}, "
                     f"buckets / unsharded params {o['transient'] / gib:.2f})  {'fits' if o['fits'] else 'does not fit'}")
    lines.append(f"choice: {f['choice'] or 'none fits: more ranks, a 16-bit model, or fewer trainable params'}")
    return "\n".join(lines)


def _owned_bytes(shape, numel, optimizer, state_itemsize, masters) -> int:
    """Optimizer state (plus the float32 master when ``masters``) for ``numel`` owned elements."""
    return state_bytes(shape, numel, optimizer=optimizer, itemsize=state_itemsize) + (4 * numel if masters else 0)


def _references(total, trainable, world_size, dtype, optimizer, references=REFERENCES) -> dict:
    """Per-rank bytes of the published accountings in ``references`` (Adam(W) only)."""
    name = str(dtype).removeprefix("torch.")
    out = {}
    for ref, by_dtype in references.items():
        coef = by_dtype.get(name) if optimizer == "adamw" else None
        if coef is None:
            out[ref] = None
            continue
        a, b, c = coef
        nbytes = a * total + b * trainable + c * trainable / world_size
        out[ref] = {"formula": f"{a} * params + {b} * trainable + {c} * trainable / N",
                    "max_rank_bytes": nbytes, "bytes_per_param": nbytes / total if total else 0.0}
    return out


def _hf_zero_plan(params, specs, world_size, shard, optimizer, itemsize, backend, state_itemsize, masters,
                  buckets=None, grad_itemsize=None) -> dict:
    layout = plan_layout(specs, world_size=world_size, shard=shard, buckets=buckets)
    elements = layout.owned_elements()
    state = []
    for r in range(world_size):
        total = 0
        for pc in layout.pieces(r):
            shape = params[pc.index].shape if shard == "param" else (pc.numel,)
            total += _owned_bytes(shape, pc.numel, optimizer, state_itemsize, masters)
        state.append(total)
    # As Comm.sync_buffer: NCCL one all-gather per buffer with equal ranges, else one
    # broadcast per range; gloo sends each range to every other rank (CPU tensors).
    sync, kind = 0, "broadcast" if backend == "nccl" else "send_recv"
    for buf in layout.buffers:
        ranges = sum(1 for a, b in zip(buf.bounds, buf.bounds[1:]) if b > a)
        if backend == "nccl" and buf.equal_ranges:
            sync, kind = sync + 1, "all_gather_into_tensor"
        elif backend == "nccl":
            sync += ranges
        else:
            sync += ranges * (world_size - 1)
    buffers = [
        {
            "dtype": str(b.dtype).removeprefix("torch."),
            "elements": b.size,
            "bytes": b.size * itemsize,
            "padding": b.size - sum(s.numel for s in b.slots),
            "rank_bounds": list(b.bounds),
        }
        for b in layout.buffers
    ]
    out = {
        "trainable_elements_per_rank": elements,
        "state_bytes_per_rank": state,
        "max_state_bytes": max(state),
        "balance": max_over_mean(elements),
        "buffers": buffers,
        "collectives_per_step": {"sync": sync, "sync_kind": kind, "control": 1 if world_size > 1 else 0},
        "sync_bytes_per_step": sum(b["bytes"] for b in buffers),
    }
    if buckets is not None:  # stage 2: each rank keeps its range of every bucket (cut at the bucket's end)
        ends = [max(s.offset + s.numel for s in b.slots) for b in layout.buffers]
        out["grad_shard_bytes_per_rank"] = [
            sum(min(b.bounds[r + 1], end) - min(b.bounds[r], end) for b, end in zip(layout.buffers, ends)) * grad_itemsize
            for r in range(world_size)
        ]
    return out


def _torch_plan(params, specs, world_size, optimizer, itemsize) -> dict:
    elements = torch_zero_loads(specs, world_size=world_size)
    owner = torch_zero_owners(specs, world_size)
    state = [0] * world_size
    for i, p in enumerate(params):
        if p.trainable:
            state[owner[i]] += state_bytes(p.shape, p.numel, optimizer=optimizer, itemsize=itemsize)
    return {
        "trainable_elements_per_rank": elements,
        "state_bytes_per_rank": state,
        "max_state_bytes": max(state),
        "balance": max_over_mean(elements),
        # One bucket per rank, always broadcast (a dummy one when empty); without
        # bucket views one broadcast per param of every partition, frozen included.
        "collectives_per_step": {"bucket_view": world_size, "no_bucket_view": len(params)},
        "sync_bytes_per_step": {
            "bucket_view": sum(p.numel for p in params if p.trainable) * itemsize,
            "no_bucket_view": sum(p.numel for p in params) * itemsize,
        },
    }


def format_report(report: dict) -> str:
    """The human-readable table ``hf-zero plan`` prints."""
    m, ws = report["model"], report["world_size"]
    gib = 1024**3
    common = report["per_rank_common"]
    grads = (f"grads {common['grad_bytes'] / gib:.3f} GiB (held once), " if report.get("stage") != 2 else
             f"grads sharded (stage 2), reduce buckets {common['reduce_bucket_bytes'] / gib:.3f} GiB, ")
    lines = [
        f"model {m['name']}{f' ({arch})' if (arch := m.get('architecture')) else ''}: {m['params']:,} params in {m['param_tensors']} tensors, "
        f"{m['trainable_params']:,} trainable in {m['trainable_tensors']} ({m['dtype']})",
        f"world size {ws}, optimizer {report['optimizer']}, backend {report['backend']}",
        f"every rank: params {report['per_rank_common']['param_bytes'] / gib:.3f} GiB, " + grads
        + f"reduce-scatter scratch {report['per_rank_common']['scratch_bytes'] / gib:.3f} GiB (one bucket)",
        f"fp32 master weights: {'yes, sharded with the state' if report['master_weights'] else 'no'}",
        f"unsharded optimizer state {report['unsharded']['state_bytes'] / gib:.3f} GiB "
        f"(ideal per rank {report['unsharded']['ideal_state_bytes_per_rank'] / gib:.3f} GiB)",
        "",
        f"{'plan':<14}{'balance':>9}{'max state GiB':>15}{'max rank GiB':>14}{'bytes/param':>13}{'min elems/rank':>16}"
        f"{'max elems/rank':>16}{'collectives':>13}",
    ]
    for name, p in report["plans"].items():
        c = p["collectives_per_step"]
        coll = c["bucket_view"] if name == "torch_zero" else c["sync"] + c["control"]
        el = p["trainable_elements_per_rank"]
        lines.append(
            f"{name:<14}{p['balance']:>9.3f}{p['max_state_bytes'] / gib:>15.3f}{p['max_rank_bytes'] / gib:>14.3f}"
            f"{p['bytes_per_param']:>13.2f}"
            f"{min(el):>16,}{max(el):>16,}{coll:>13}"
        )
    for ref, r in report["references"].items():
        if r is not None:
            lines.append(f"{ref:<23}{'':>9}{r['max_rank_bytes'] / gib:>29.3f}{r['bytes_per_param']:>13.2f}   {r['formula']}")
    lines.append("max rank = params + grads + scratch + the largest rank's optimizer state and masters "
                 + ("(stage 2: + its grad shard + reduce buckets) " if report.get("stage") == 2 else "")
                 + "(activations not included); references: docs/planner.md")
    lines.append("collectives per step: hf_zero = sync + 1 control all-reduce; torch_zero = bucket-view broadcasts "
                 f"({report['plans']['torch_zero']['collectives_per_step']['no_bucket_view']} without bucket views)")
    if ws <= 16:
        lines.append("")
        lines.append("optimizer state per rank (MiB):")
        header = "rank " + "".join(f"{name:>15}" for name in report["plans"])
        lines.append(header)
        for r in range(ws):
            lines.append(f"{r:<5}" + "".join(f"{p['state_bytes_per_rank'][r] / 2**20:>15.1f}" for p in report["plans"].values()))
    return "\n".join(lines)


def plot_report(report: dict, path: str) -> None:
    """Bar chart of optimizer-state bytes per rank for every plan (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("plot: matplotlib is not installed (pip install 'hf_zero[bench]')") from None
    ws = report["world_size"]
    names = list(report["plans"])
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(6, min(ws, 64) * 0.25 + 4), 4))
    for k, name in enumerate(names):
        vals = [b / 2**20 for b in report["plans"][name]["state_bytes_per_rank"]]
        ax.bar([r + k * width for r in range(ws)], vals, width=width,
               label=f"{name} (balance {report['plans'][name]['balance']:.2f})")
    ax.axhline(report["unsharded"]["ideal_state_bytes_per_rank"] / 2**20, color="k", ls="--", lw=0.8, label="unsharded / N")
    ax.set_xlabel("rank")
    ax.set_ylabel("optimizer state (MiB)")
    ax.set_title(f"{report['model']['name']}: {report['optimizer']} state per rank, N={ws}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_arguments(parser) -> None:
    """The ``hf-zero plan`` options."""
    parser.add_argument("--model", required=True,
                        help=f"a preset ({', '.join(PRESETS)}), a config.json or a model folder")
    parser.add_argument("--world-size", type=int, required=True, help="number of ranks")
    parser.add_argument("--trainable", nargs="+", metavar="REGEX",
                        help="params whose name matches any REGEX are trainable (default: all)")
    parser.add_argument("--task", choices=("auto", *TASKS), default="auto",
                        help="which head to build: auto (default) takes the config's architectures, else a "
                        "causal LM, else the bare model")
    parser.add_argument("--num-labels", type=int, metavar="N",
                        help=f"classifier width for --task {' / '.join(_LABELLED)} (default: the config's)")
    parser.add_argument("--shard", choices=("flat", "param"),
                        help="plan only this hf_zero mode (default: both that apply)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="param dtype")
    parser.add_argument("--backend", choices=BACKENDS, default="nccl",
                        help="decides the sync collective (all_gather on nccl, point-to-point sends on gloo)")
    parser.add_argument("--master-weights", choices=MASTER_WEIGHTS, default="auto",
                        help="fp32 master weights for 16-bit params (auto, the optimizer's default: yes for "
                        "bfloat16/float16)")
    parser.add_argument("--stage", type=int, choices=(1, 2), default=1,
                        help="2: gradients sharded too (ZeroBucketOptimizer(stage=2), docs/stage2.md)")
    parser.add_argument("--grad-accum-dtype", choices=GRAD_ACCUM_DTYPES, default="auto",
                        help="stage 2: the grad shards of 16-bit params in the params' dtype (auto, the optimizer's "
                        "default: param) or in fp32 (fp32)")
    parser.add_argument("--device-memory", metavar="SIZE",
                        help="say which of stage 1, stage 2 or FSDP2 fits SIZE per rank (e.g. 24GiB, 80GB)")
    parser.add_argument("--activation-memory", metavar="SIZE",
                        help="activations per rank to add for --device-memory (default: left out, and said so)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (docs/planner.md)")
    parser.add_argument("--plot", metavar="FILE.png", help="also write a bar chart of per-rank state")


def run(args) -> dict:
    """Run ``hf-zero plan`` for parsed ``args``; print and return the report."""
    if args.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
    if args.shard == "flat" and args.optimizer not in _ELEMENTWISE:
        raise ValueError(f"--shard flat needs an elementwise optimizer; {args.optimizer} is not one: use --shard param")
    device = getattr(args, "device_memory", None)
    device = None if device is None else _parse_bytes(device, "--device-memory")
    acts = getattr(args, "activation_memory", None)
    if acts is not None and device is None:
        raise ValueError("--activation-memory: goes with --device-memory")
    acts = None if acts is None else _parse_bytes(acts, "--activation-memory")
    if args.shard:
        shards = (args.shard,)
    else:
        shards = ("flat", "param") if args.optimizer in _ELEMENTWISE else ("param",)
    params, n_buffers, architecture = load_model_params(args.model, task=args.task, num_labels=args.num_labels)
    try:
        params = select_trainable(params, args.trainable)
    except ValueError as e:
        if args.task != "auto" or not args.trainable:
            raise
        raise ValueError(
            f"{e} in {architecture}; to plan a head the config does not list, name the task with "
            f"--task (one of {', '.join(TASKS)})"
        ) from None
    report = plan(params, world_size=args.world_size, optimizer=args.optimizer, shards=shards,
                  dtype=DTYPES[args.dtype], backend=args.backend, model_name=args.model,
                  architecture=architecture, buffer_count=n_buffers, master_weights=args.master_weights,
                  stage=args.stage, grad_accum_dtype=args.grad_accum_dtype if args.stage == 2 else "auto")
    if device is not None:
        report["fits"] = fits(params, world_size=args.world_size, device_memory=device, activations=acts,
                              dtype=DTYPES[args.dtype], master_weights=args.master_weights.lower() != "false",
                              optimizer=args.optimizer, grad_accum_dtype=args.grad_accum_dtype if args.stage == 2 else "auto")
    if args.plot:
        plot_report(report, args.plot)
    text = format_report(report) + (format_fits(report["fits"]) if "fits" in report else "")
    print(json.dumps(report, indent=2) if args.json else text)
    return report


# -- the ledger, predicted ---------------------------------------------------------------------------
def predict_ledger(specs: Sequence[ParamSpec], *, world_size: int, stage: int = 1, optimizer: str = "adamw",
                   shard: str = "flat", master_weights: bool = True, bucket_cap_mb: float = _DDP_BUCKET_CAP_MB,
                   buckets: Sequence[Sequence[int]] | None = None, ddp_bucket_view: bool = True,
                   shapes: Sequence[tuple[int, ...]] | None = None, rank: int | None = None,
                   grad_accum_dtype: str = "auto", in_flight: int | None = None) -> dict[str, Any]:
    """What ``optimizer.memory_ledger()`` holds on the fullest rank in a steady step (after the first step,
    between a backward and the step), per category ([Note: memory ledger] in _ledger.py), for ``specs`` (the
    optimizer's params, frozen ones included) on ``world_size`` ranks. ``buckets``: the layout's buckets
    (default: stage 2's plan, or DDP's cut in the params' reverse order under stage 1); ``shapes``: each
    param's shape (needed by ``shard="param"`` with a factored optimizer); ``rank``: that rank's instead;
    ``grad_accum_dtype``: stage 2's option (the dtype of its 16-bit grad shards). Model states are predicted
    (``model_states``, the sum); stage 2's reduce buckets as bounds (``bucket_bounds``): in use at most
    ``in_flight + 1`` of the largest buckets, the pool at most that many of the widest pooled one (``in_flight``:
    the reducer's ``in_flight_limit``; default: NCCL's where the params are on CUDA, else gloo's)."""
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 or 2, got {stage!r}")
    cap = int(bucket_cap_mb * 2**20)
    if buckets is None:
        buckets = plan_buckets(specs, cap)
    layout = plan_layout(specs, world_size=world_size, shard=shard, buckets=buckets)
    size = {dt: torch.empty((), dtype=dt).element_size() for dt in {s.dtype for s in specs}}
    in_buffers = {s.index for b in layout.buffers for s in b.slots}
    params = sum(b.size * size[b.dtype] for b in layout.buffers) + sum(
        s.numel * size[s.dtype] for i, s in enumerate(specs) if i not in in_buffers and s.numel)
    trainable = sum(s.numel * size[s.dtype] for s in specs if s.trainable)
    # the bytes of an element the local optimizer steps, per param dtype (a 16-bit param's: its fp32 master's)
    stepped = {dt: 4 if master_weights and n < 4 else n for dt, n in size.items()}
    per_rank = []
    for r in range(world_size):
        state = masters = shards = 0
        pieces = layout.pieces(r)
        for pc in pieces:
            s = specs[pc.index]
            shape = shapes[pc.index] if shapes is not None and shard == "param" else (pc.numel,)
            state += state_bytes(shape, pc.numel, optimizer=optimizer, itemsize=stepped[s.dtype])
            masters += 4 * pc.numel if stepped[s.dtype] != size[s.dtype] else 0
        if optimizer == "adamw" and (stage == 2 or ddp_bucket_view):  # a run: one tensor, one step
            state -= _STEP_BYTES * _joined(layout, pieces, specs, stepped)
        if stage == 2:
            widen, carrier = accumulate_dtype(grad_accum_dtype, stage), carrier_of(layout.buffers, r, world_size)
            for k, b in enumerate(layout.buffers):
                end = max(s.offset + s.numel for s in b.slots)
                itemsize = shard_dtype(widen, b.dtype).itemsize
                owned = min(b.bounds[r + 1], end) - min(b.bounds[r], end)
                # the carrier's shard holds its range with padding and the check's header after it
                shards += (carrier.shard if carrier is not None and carrier.bucket == k else owned) * itemsize
        per_rank.append((state, masters, shards))
    state, masters, shards = max(per_rank, key=sum) if rank is None else per_rank[rank]
    out = {"params": params, "full_grads": 0 if stage == 2 or ddp_bucket_view else trainable,
           "ddp_buckets": trainable if stage == 1 and world_size > 1 else 0, "grad_shards": shards,
           "masters": masters, "optimizer_state": state}
    out["model_states"] = sum(out.values())
    if stage == 2:
        carrier = carrier_of(layout.buffers, 0, world_size)
        widths = [(carrier.size if carrier is not None and carrier.bucket == k else max(s.offset + s.numel for s in b.slots))
                  * size[b.dtype] for k, b in enumerate(layout.buffers)]
        pooled = max((w for w, b in zip(widths, layout.buffers) if w <= cap or len(b.slots) > 1), default=0)
        if in_flight is None:
            backend = "nccl" if any(s.device.startswith("cuda") for s in specs) else "gloo"
            in_flight = buckets_in_flight(default_strategy(backend).reduce_scatter_by)
        out["bucket_bounds"] = {"buckets_in_flight": sum(sorted(widths, reverse=True)[: in_flight + 1]),
                                "buckets_pooled": (in_flight + 1) * pooled}
    return out


def _joined(layout, pieces, specs, size) -> int:
    """How many of a rank's ``pieces`` join the one before in a run ([Note: runs] in _runs.py); ``size``: the
    bytes of an element the local optimizer steps, per param dtype."""
    if layout.shard != "flat":
        return 0
    joined, prev, run = 0, None, 0
    for pc in pieces:
        spec = specs[pc.index]
        if (prev is not None and layout.buffers[pc.buffer].bucket is not None and pc.buffer == prev.buffer
                and prev.offset + prev.numel == pc.offset and specs[prev.index].group == spec.group
                and may_follow(prev.numel * size[spec.dtype], run, pc.numel)):
            joined, run = joined + 1, run + pc.numel
        else:
            run = pc.numel
        prev = pc
    return joined


_OPTIMIZER_NAMES = {"adamw": "adamw", "adam": "adamw", "sgd": "sgd", "adafactor": "adafactor"}


def predict_for(opt) -> dict[str, Any] | None:
    """:func:`predict_ledger` for a ``ZeroBucketOptimizer``'s params, options and current layout, on its rank
    (None when its optimizer class is not one the planner knows: AdamW, Adam, SGD, Adafactor)."""
    name = _OPTIMIZER_NAMES.get(opt.optimizer_class.__name__.lower())
    layout = opt.gradient_path.layout
    if name is None or layout is None:
        return None
    specs = [ParamSpec(p.numel(), p.dtype, str(p.device), p.requires_grad, opt.group_of(i))
             for i, p in enumerate(opt.params)]
    bucket_view = opt.gradient_path.ddp_bucket_view
    reducer = opt.gradient_path.stage2
    widened = reducer is not None and reducer.accumulate_dtype == torch.float32
    return predict_ledger(specs, world_size=opt.world_size, stage=opt.gradient_path.stage, optimizer=name,
                          shard=opt.shard, master_weights=opt.master_weights, buckets=layout.buckets,
                          ddp_bucket_view=True if bucket_view is None else bucket_view,
                          shapes=[tuple(p.shape) for p in opt.params], rank=opt.rank,
                          grad_accum_dtype="auto" if reducer is None else ("fp32" if widened else "param"),
                          in_flight=None if reducer is None else reducer.in_flight_limit)
