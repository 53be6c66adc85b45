"""Trainer runs used by tests/test_trainer.py (module-level: spawned ranks import them).

A tiny float64 BERT classifier, a fixed dataset read in order (no shuffling), and a
user callback that sets ``requires_grad`` from a schedule keyed by global step, so a
run resumed at step k has the same trainable set as an uninterrupted one.
"""

from __future__ import annotations

import json
import re
import os

import torch
import transformers
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

import hf_zero  # noqa: F401  (registers optim="zero_bucket")

GLOBAL_BATCH = 8
N_EXAMPLES = 32
SEQ = 8


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = N_EXAMPLES, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(5, 50, (n, SEQ), generator=g)
        self.labels = (self.ids[:, 0] % 3).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": self.labels[i]}


class PlainModule(torch.nn.Module):
    """Not a PreTrainedModel: Trainer saves it with safetensors' save_file."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def tiny_bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
    )
    return BertForSequenceClassification(config).to(torch.float64)


def enable_activation_checkpointing(model, *, use_reentrant: bool) -> None:
    """transformers' activation checkpointing on ``model`` (a PEFT model forwards it to its base):
    ``activation_checkpointing_enable`` where transformers has it, else the older name it deprecates."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})


class TrainabilitySchedule(TrainerCallback):
    """At each step begin, apply the latest ``{step: {name_prefix: requires_grad}}`` entries."""

    def __init__(self, schedule: dict[int, dict[str, bool]]):
        self.schedule = schedule

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        wanted: dict[str, bool] = {}
        for step in sorted(s for s in self.schedule if s <= state.global_step):
            wanted.update(self.schedule[step])
        for name, p in model.named_parameters():
            for prefix, flag in wanted.items():
                if name.startswith(prefix):
                    p.requires_grad_(flag)


# Differences of transformers before 5.2 (setup.cfg allows 4.57.1 on): no
# train_sampling_strategy (the sampler is random); a resumed run keeps the per-device batch
# size recorded in the checkpoint's trainer_state.json, whatever the args say; and before
# 5.0, gradient checkpointing is reentrant by default, which DDP with
# find_unused_parameters=True refuses ("marked as ready twice").
TRANSFORMERS = tuple(int(x) for x in transformers.__version__.split(".")[:2])
BEFORE_5_2 = TRANSFORMERS < (5, 2)

if not BEFORE_5_2:
    IN_ORDER = {"train_sampling_strategy": "sequential"}
    InOrderTrainer = Trainer
else:
    IN_ORDER = {}

    class InOrderTrainer(Trainer):
        """Reads the training set in order (transformers < 5.2 always samples at random)."""

        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)


def _restore_indexed_cpu(storage, location):
    return storage if location.startswith("cpu:") else None


# Trainer before 5.19 (5.14 still does) loads optimizer.pt with map_location=args.device,
# which is "cpu:N" in a multi-process CPU run, and torch cannot restore "cpu:N": resuming
# any optimizer fails there. Teach torch that location (public API; no-op where unused).
torch.serialization.register_package(5, lambda obj: None, _restore_indexed_cpu)


class CpuGradScalerTrainer(InOrderTrainer):
    """Accelerate makes no GradScaler on CPU (fp16 there is a no-op): give it torch's CPU
    one, so ``fp16=True`` runs the same scaler code path as on a GPU."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        self.accelerator.native_amp = True
        self.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)


class OverflowOnRank1(TrainerCallback):
    """Makes one param's grad inf on rank 1 only, at one step; records skipped steps."""

    def __init__(self, step: int, param_name: str):
        self.step, self.param_name, self.handle, self.skipped = step, param_name, None, []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step and torch.distributed.get_rank() == 1:
            p = dict(model.named_parameters())[self.param_name]
            self.handle = p.register_hook(lambda g: torch.full_like(g, float("inf")))

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.skipped.append(optimizer.step_was_skipped)
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


class GradStorages(TrainerCallback):
    """Before each optimizer step: (params with a grad, distinct storages their grads live in)."""

    def __init__(self):
        self.seen = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        self.seen.append((len(grads), len({g.untyped_storage().data_ptr() for g in grads})))


class SaveOnEvaluate(TrainerCallback):
    """Asks for a checkpoint after every evaluation (a user callback deciding late)."""

    def on_evaluate(self, args, state, control, **kwargs):
        control.should_save = True


class SampleLossOnRank0(TrainerCallback):
    """After every step, rank 0 alone runs a grad-mode forward of the ``model`` callbacks get (a
    sample loss for logging), as a logging or generation callback does; no backward."""

    def __init__(self):
        self.losses = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if torch.distributed.get_rank() == 0:
            batch = transformers.default_data_collator([TokenDataset(n=2, seed=3)[i] for i in range(2)])
            self.losses.append(model(**batch).loss.item())


class PredictBetweenSteps(TrainerCallback):
    """``trainer.predict`` on every rank after steps 2 and 5 (``trainer`` set once built)."""

    trainer = None

    def __init__(self):
        self.predictions = []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in (2, 5):
            self.predictions.append(torch.from_numpy(self.trainer.predict(TokenDataset(n=8, seed=2)).predictions))


def small_trainer(model, output_dir, optim, optim_args=None, callbacks=(), **overrides):
    """A 3-step Trainer on :class:`TokenDataset` (batch 4, sequential order, clipping at 0.5, a line logged per
    step, no saves); ``overrides``: more TrainingArguments."""
    args = dict(output_dir=output_dir, optim=optim, optim_args=optim_args, per_device_train_batch_size=4,
                max_steps=3, learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5, logging_steps=1,
                save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                average_tokens_across_devices=False, **IN_ORDER)
    args.update(overrides)
    return InOrderTrainer(model=model, args=TrainingArguments(**args), train_dataset=TokenDataset(),
                          callbacks=list(callbacks))


def named_params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def grad_norms(trainer) -> list:
    """The grad norms Trainer logged."""
    return [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]


def copy_of_bert(model):
    """A fresh :func:`tiny_bert` holding ``model``'s values."""
    fresh = tiny_bert()
    fresh.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    return fresh


def train_with_fresh_copy(model, output_dir, optim, optim_args=None) -> tuple[list, dict]:
    """A second :func:`small_trainer` run on ``model`` and on a never-bound :func:`copy_of_bert` of it: the
    (params, logged grad norms) of each, and the copy's params before it trained."""
    fresh = copy_of_bert(model)
    before = named_params(fresh)
    runs = []
    for m in (model, fresh):
        trainer = small_trainer(m, output_dir, optim, optim_args)
        trainer.train()
        runs.append((named_params(m), grad_norms(trainer)))
    return runs, before


def trainer_style_adamw(model, args) -> torch.optim.AdamW:
    """The reference: Trainer's default optimizer (``adamw_torch_fused``: torch AdamW, fused
    kernel) with Trainer's decay groups over *all* params (frozen too)."""
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                             fused=True)


def run_trainer(
    rank,
    world_size,
    *,
    output_dir,
    optim="zero_bucket",
    reference=False,
    schedule=None,
    frozen_at_build=(),
    frozen_re=None,
    resume=None,
    overflow=None,
    explicit_callback=False,
    sharded_checkpoints=None,
    global_batch=GLOBAL_BATCH,
    plain_module=False,
    user_callbacks=True,
    evaluate=False,
    save_on_evaluate=False,
    grad_storages=False,
    sample_loss_on_rank0=False,
    predict_between_steps=False,
    count_reads=False,
    **overrides,
):
    """One Trainer run; returns (final params, log_history, info) from this rank.

    ``overflow=(step, param name)``: fp16 with a CPU GradScaler and an inf grad on rank 1
    at that step; ``info`` then holds the per-step skip flags and the final loss scale.
    ``user_callbacks=False``: no callback of the test's own (the trainability schedule
    is not applied), so the overlapped parameter sync runs into the next forward.
    ``evaluate``: an evaluation set (16 examples); ``save_on_evaluate``: a callback that
    sets ``control.should_save`` after each evaluation.
    ``sample_loss_on_rank0``: a callback's grad-mode forward on rank 0 alone after every step;
    ``predict_between_steps``: ``trainer.predict`` after steps 2 and 5 (``info``: the losses,
    the predictions). ``info`` also says which gradient path the optimizer took.
    ``frozen_re``: params whose name it matches (re.search) are frozen at build, as ``frozen_at_build``
    (name prefixes) freezes. ``count_reads``: ``info["reads"]``, the host reads of steps 4-7 (:class:`HostReads`).
    """
    if overrides.pop("one_process_per_node", False):  # as if each rank ran on a node of its own
        os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    model = tiny_bert()
    if overflow:
        model = model.float()
        overrides["fp16"] = True
    for name, p in model.named_parameters():
        if name.startswith(tuple(frozen_at_build)) or (frozen_re and re.search(frozen_re, name)):
            p.requires_grad_(False)
    if plain_module:
        model = PlainModule(model)
    if overrides.get("gradient_checkpointing") and TRANSFORMERS < (5, 0):
        overrides.setdefault("gradient_checkpointing_kwargs", {"use_reentrant": False})
    grad_acc = overrides.pop("gradient_accumulation_steps", 1)
    per_device = global_batch // world_size // grad_acc
    if resume and BEFORE_5_2:
        # Trainer keeps the checkpoint's per-device batch size: same global batch through accumulation.
        with open(os.path.join(resume, "trainer_state.json")) as f:
            per_device = json.load(f)["train_batch_size"]
        grad_acc = global_batch // world_size // per_device
    kwargs = dict(
        output_dir=output_dir,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=grad_acc,
        max_steps=7,
        learning_rate=1e-2,
        weight_decay=0.1,
        warmup_steps=2,
        max_grad_norm=0.5,
        optim=optim,
        **IN_ORDER,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        # With gradient accumulation, Trainer 5.23 multiplies the loss by the number of
        # processes for models that ignore num_items_in_batch (BERT classification), so 2
        # ranks would not equal 1 process even with plain DDP + AdamW (zero_bucket
        # matches plain DDP exactly there too).
        average_tokens_across_devices=False,
    )
    kwargs.update(overrides)
    args = TrainingArguments(**kwargs)
    optimizers = (trainer_style_adamw(model, args), None) if reference else (None, None)
    callbacks = [TrainabilitySchedule(schedule or {})] if user_callbacks else []
    if explicit_callback or sharded_checkpoints is not None:  # as well as the default one: must not act twice
        callbacks.insert(0, hf_zero.ZeroBucketCallback(sharded_checkpoints=sharded_checkpoints))
    if overflow:
        callbacks.append(OverflowOnRank1(*overflow))
    if save_on_evaluate:
        callbacks.append(SaveOnEvaluate())
    storages = GradStorages()
    if grad_storages:
        callbacks.append(storages)
    sampling, predicting = SampleLossOnRank0(), PredictBetweenSteps()
    callbacks += [sampling] if sample_loss_on_rank0 else []
    callbacks += [predicting] if predict_between_steps else []
    reads = HostReads() if count_reads else None
    callbacks += [reads] if count_reads else []
    trainer = (CpuGradScalerTrainer if overflow else InOrderTrainer)(
        model=model,
        args=args,
        train_dataset=TokenDataset(),
        eval_dataset=TokenDataset(n=16, seed=1) if evaluate else None,
        callbacks=callbacks,
        optimizers=optimizers,
    )
    overlapping = _record_overlap(trainer)
    predicting.trainer = trainer
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        if reads is not None:
            reads.counter.uninstall()
    if plain_module:
        trainer.save_model()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    info = {}
    if overflow:
        info = {"skipped": callbacks[-1].skipped, "scale": trainer.accelerator.scaler.get_scale()}
    if grad_storages:
        info.update(grad_storages=storages.seen, ddp_grad_views=trainer.model_wrapped.gradient_as_bucket_view)
    zero = getattr(trainer.optimizer, "optimizer", None)
    if isinstance(zero, hf_zero.ZeroBucketOptimizer):
        info.update(grad_reduce=zero.grad_reduce, overlap=overlapping[-1] if overlapping else None, stage=zero.gradient_path.stage)
    info["wrapped"] = type(trainer.model_wrapped).__name__
    info.update(sample_losses=sampling.losses, predictions=predicting.predictions)
    if reads is not None:
        info["reads"] = reads.steps
    return params, trainer.state.log_history, info


class HostReads(TrainerCallback):
    """The host reads of a tensor's value (benchmarks.hostpath.HostReadCounter: Trainer's own included) from the
    start of steps 4 to 7 to their end: (method, where) per read, per step."""

    def __init__(self):
        from benchmarks.hostpath import HostReadCounter

        self.counter, self.steps, self._recording = HostReadCounter(), [], None

    def on_step_begin(self, args, state, control, **kwargs):
        if 3 <= state.global_step < 7:
            self._recording = self.counter.recording()
            self._recording.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self._recording is not None:
            self._recording.__exit__(None, None, None)
            self._recording = None
            self.steps.append(list(self.counter.calls))


def _record_overlap(trainer) -> list:
    """Whether the optimizer overlaps its parameter sync, after each training step (during the run: its end
    unbinds the optimizer), without adding a callback (callbacks of the user's change when the sync drains)."""
    seen, step = [], trainer.training_step

    def training_step(*args, **kwargs):
        loss = step(*args, **kwargs)
        zero = getattr(trainer.optimizer, "optimizer", None)
        seen.append(zero.overlaps_param_sync if isinstance(zero, hf_zero.ZeroBucketOptimizer) else None)
        return loss

    trainer.training_step = training_step
    return seen


def run_trainer_catching(rank, world_size, **kwargs):
    """Like run_trainer, but returns the message of a ValueError instead of raising."""
    try:
        run_trainer(rank, world_size, **kwargs)
    except ValueError as e:
        return f"ValueError: {e}"
    return "no error"


def trainer_world_size(rank, world_size, **overrides):
    """The world size ``TrainingArguments(**overrides)`` reports in this process."""
    return TrainingArguments("unused", report_to=[], **overrides).world_size


def run_many(rank, world_size, runs):
    """Several runs in one spawn: ``runs`` is a list of (function name, kwargs)."""
    return [globals()[fn](rank, world_size, **kw) for fn, kw in runs]


def run_counting_agreements(rank, world_size, **kwargs):
    """run_trainer, counting the optimizer's cross-rank agreement all-reduces."""
    from hf_zero._comm import Comm

    calls = []
    start = Comm.start_agreement  # every agreement all-reduce, read at once or late

    def counting(self, *args, **kw):
        calls.append(1)
        return start(self, *args, **kw)

    Comm.start_agreement = counting
    try:
        _, log, _ = run_trainer(rank, world_size, **kwargs)
    finally:
        Comm.start_agreement = start
    return len(calls), max(e["step"] for e in log)


# -- bf16 models (tests/test_bf16_models.py) --------------------------------------------------
# The global batch of 6 splits as 2 ranks x 3, 3 ranks x 2, and 1 process x 3 x 2
# accumulation steps; 24 examples make 4 steps an epoch.
BF16_GLOBAL_BATCH = 6
BF16_EXAMPLES = 24


def tiny_llama() -> torch.nn.Module:
    """A 2-layer Llama causal LM built from a config, its params in bfloat16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).to(torch.bfloat16)


class LMDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = BF16_EXAMPLES, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, 64, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": self.ids[i]}


class Fp32MasterAdamW(torch.optim.AdamW):
    """The fp32-master reference, unsharded: torch AdamW steps an fp32 copy of every param
    on the param's grad cast to fp32, and each stepped param then takes its copy rounded to
    nearest even (``copy_``); a param without a grad is skipped, as AdamW skips it. The
    state dict carries the copies as ``"master_param"``, as hf_zero's does, so a Trainer
    resumes it exactly; ``forget_masters=True`` loads without them (each restarts from its
    param), a control."""

    def __init__(self, groups, *, forget_masters=False, **hyper):
        self.model_params = [p for g in groups for p in g["params"]]
        self.forget_masters = forget_masters
        super().__init__([{**g, "params": [p.detach().to(torch.float32, copy=True) for p in g["params"]]}
                          for g in groups], **hyper)

    def _pairs(self):
        return zip(self.model_params, (m for g in self.param_groups for m in g["params"]))

    @torch.no_grad()
    def step(self, closure=None):
        for p, m in self._pairs():
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
        super().step()
        for p, m in self._pairs():
            if m.grad is not None:
                p.copy_(m)
                m.grad = None

    def state_dict(self):
        out = super().state_dict()
        masters = [m for g in self.param_groups for m in g["params"]]
        for i, st in out["state"].items():
            st["master_param"] = masters[i].detach().clone()
        return out

    def load_state_dict(self, state_dict):
        state = {i: dict(st) for i, st in state_dict["state"].items()}
        saved = {i: st.pop("master_param") for i, st in state.items() if "master_param" in st}
        super().load_state_dict({**state_dict, "state": state})
        masters = [m for g in self.param_groups for m in g["params"]]
        with torch.no_grad():
            for i, m in saved.items():
                masters[i].copy_(self.model_params[i] if self.forget_masters else m)


def clip_grad_norm_float64_(params, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with the norm summed in float64, then rounded to the
    grads' dtype (hf_zero's clipping; torch's takes each grad's norm and the total in the
    grads' dtype, for bf16 grads at times an ulp away)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.stack([g.double().pow(2).sum() for g in grads]).sum().sqrt().to(grads[0].dtype)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


class ReferenceTrainer(InOrderTrainer):
    """Clips as hf_zero does (:func:`clip_grad_norm_float64_`)."""

    def _clip_grad_norm(self, model):
        return clip_grad_norm_float64_(model.parameters(), self.args.max_grad_norm)


def trainer_style_groups(model, args) -> list:
    """Trainer's decay / no-decay groups over *all* params (frozen ones too)."""
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]


def run_bf16_trainer(rank, world_size, *, output_dir, reference=False, schedule=None, frozen_at_build=(),
                     resume=None, evaluate=False, forget_masters=False, **overrides):
    """One Trainer run of :func:`tiny_llama` (bf16 params) on the global batch of 6; returns
    (final params, log_history, info) from this rank.

    ``reference``: :class:`Fp32MasterAdamW` instead of ``optim="zero_bucket"`` (whose
    ``master_weights`` stays at its default, "auto": fp32 masters). One process reads the
    global batch in two accumulation steps of 3, as 2 ranks read it. ``resume``: a
    checkpoint, or a directory whose latest checkpoint is resumed. ``info``: the state dict
    of the final optimizer (rank 0; zero_bucket's consolidated) and the best checkpoint.
    """
    from transformers.trainer_utils import get_last_checkpoint

    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    model = tiny_llama()
    for name, p in model.named_parameters():
        if name.startswith(tuple(frozen_at_build)):
            p.requires_grad_(False)
    if resume and not os.path.exists(os.path.join(resume, "trainer_state.json")):
        resume = get_last_checkpoint(resume)
    per_device = BF16_GLOBAL_BATCH // max(world_size, 2)
    kwargs = dict(
        output_dir=output_dir, per_device_train_batch_size=per_device,
        gradient_accumulation_steps=BF16_GLOBAL_BATCH // world_size // per_device,
        max_steps=7, learning_rate=3e-3, weight_decay=0.1, warmup_steps=2, max_grad_norm=0.5,
        optim="zero_bucket", **IN_ORDER, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    args = TrainingArguments(**kwargs)
    optimizers = (None, None)
    if reference:
        optimizers = (Fp32MasterAdamW(trainer_style_groups(model, args), forget_masters=forget_masters,
                                      lr=args.learning_rate, fused=True,  # as zero_bucket's default inner
                                      betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon), None)
    trainer = (ReferenceTrainer if reference else InOrderTrainer)(
        model=model, args=args, train_dataset=LMDataset(),
        eval_dataset=LMDataset(n=12, seed=1) if evaluate else None,
        callbacks=[TrainabilitySchedule(schedule or {})], optimizers=optimizers,
    )
    trainer.train(resume_from_checkpoint=resume)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = trainer.optimizer.optimizer  # inside Accelerate's wrapper
    if isinstance(optimizer, hf_zero.ZeroBucketOptimizer):
        optimizer.consolidate_state_dict(to=0, device="cpu")
    state = optimizer.state_dict() if rank == 0 else None
    info = {"state": state, "best": trainer.state.best_model_checkpoint, "resumed_from": resume}
    return params, trainer.state.log_history, info
