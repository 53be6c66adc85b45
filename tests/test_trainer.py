"""Trainer integration: optim="zero_bucket", its optim_args, and ZeroBucketCallback.

Multi-process runs compare a 2-rank Trainer with optim="zero_bucket" to a 1-process
Trainer with torch AdamW on the same global batch (float64, data read in order).
"""

import json
import os
import pickle
import shutil

import pytest
import torch
from transformers import HfArgumentParser, Trainer, TrainingArguments
from transformers.training_args import OptimizerNames

import hf_zero
from hf_zero import _offline
from hf_zero._statedict import every_param
from hf_zero.integrations import transformers as hf_tr
from tests._dist import run_ranks
from tests.hf_trainer_cases import BEFORE_5_2, run_counting_agreements, run_many, run_trainer_catching, tiny_bert

pytestmark = pytest.mark.filterwarnings("ignore")

# Layer 1 is frozen before the Trainer (and DDP) exist and unfrozen at step 2: DDP never
# reduces it. The embeddings (reduced by DDP) are frozen at step 3, unfrozen at step 5.
SCHEDULE = {2: {"bert.encoder.layer.1.": True}, 3: {"bert.embeddings.": False}, 5: {"bert.embeddings.": True}}
PLAIN_SCHEDULE = {2: {"bert.encoder.layer.0.": False}, 3: {"bert.embeddings.": False},
                  5: {"bert.encoder.layer.0.": True, "bert.embeddings.": True}}
MAIN = dict(schedule=SCHEDULE, frozen_at_build=("bert.encoder.layer.1.",), gradient_accumulation_steps=2,
            save_strategy="epoch")


def _args(tmp_path, **kw):
    return TrainingArguments(str(tmp_path), report_to=[], use_cpu=True, **kw)


# -- registration (in process) ------------------------------------------------------------
def test_optim_name_registered_and_round_trips(tmp_path):
    args = _args(tmp_path, optim="zero_bucket", optim_args="inner=sgd,momentum=0.9")
    assert args.optim == OptimizerNames.ZERO_BUCKET == "zero_bucket"
    assert pickle.loads(pickle.dumps(args)).optim is OptimizerNames.ZERO_BUCKET
    as_json = json.loads(args.to_json_string())
    assert as_json["optim"] == "zero_bucket"
    assert TrainingArguments(str(tmp_path), optim=as_json["optim"], use_cpu=True).optim is OptimizerNames.ZERO_BUCKET
    torch.save(args, tmp_path / "training_args.bin")
    assert torch.load(tmp_path / "training_args.bin", weights_only=False).optim is OptimizerNames.ZERO_BUCKET

    parser = HfArgumentParser(TrainingArguments)
    (parsed,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--optim", "zero_bucket", "--use_cpu"])
    assert parsed.optim is OptimizerNames.ZERO_BUCKET
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--optim", "zero_buckt"])
    with pytest.raises(ValueError, match="zero_buckt is not a valid OptimizerNames"):
        _args(tmp_path, optim="zero_buckt")


def test_registration_is_idempotent_and_keeps_builtins(tmp_path):
    import transformers.trainer as tt

    names_before = [m.value for m in OptimizerNames]
    hf_tr.register()
    hf_tr.register()
    assert [m.value for m in OptimizerNames] == names_before
    assert names_before.count("zero_bucket") == 1
    assert tt.DEFAULT_CALLBACKS.count(hf_zero.ZeroBucketCallback) == 1
    for name, cls in (("adamw_torch", torch.optim.AdamW), ("adamw_torch_fused", torch.optim.AdamW),
                      ("sgd", torch.optim.SGD), ("adafactor", hf_tr.Adafactor)):
        args = _args(tmp_path, optim=name)
        assert args.optim == name
        assert Trainer.get_optimizer_cls_and_kwargs(args)[0] is cls


def test_factory_groups_include_frozen_params_with_trainer_decay_rules(tmp_path):
    model = tiny_bert()
    for p in model.bert.encoder.layer[0].parameters():
        p.requires_grad_(False)
    args = _args(tmp_path, optim="zero_bucket", learning_rate=3e-3, weight_decay=0.05, adam_beta1=0.8,
                 adam_beta2=0.95, adam_epsilon=1e-7)
    trainer = Trainer(model=model, args=args)
    opt = trainer.create_optimizer()
    assert isinstance(opt, hf_zero.ZeroBucketOptimizer)
    assert opt.optimizer_class is torch.optim.AdamW
    decay = set(trainer.get_decay_parameter_names(model))
    names = dict(model.named_parameters())
    decay_group, plain_group = opt.param_groups
    assert decay_group["param_names"] == [n for n in names if n in decay]
    assert plain_group["param_names"] == [n for n in names if n not in decay]
    assert all(not p.requires_grad for p in model.bert.encoder.layer[0].parameters())
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    assert (decay_group["weight_decay"], plain_group["weight_decay"]) == (0.05, 0.0)
    for g in opt.param_groups:
        assert g["lr"] == 3e-3 and g["betas"] == (0.8, 0.95) and g["eps"] == 1e-7


@pytest.mark.parametrize(
    "optim_args, inner_class, checks",
    [
        ("inner=adamw,shard=flat,bucket_view=true", torch.optim.AdamW, {"shard": "flat", "parameters_as_bucket_view": True}),
        ("inner=adamw_foreach,bucket_view=false", torch.optim.AdamW, {"parameters_as_bucket_view": False}),
        ("inner=adamw_fused,shard=param", torch.optim.AdamW, {"shard": "param"}),
        ("inner=sgd,momentum=0.9,nesterov=true", torch.optim.SGD, {"shard": "flat"}),
        ("inner=adafactor", hf_tr.Adafactor, {"shard": "param"}),
    ],
)
def test_optim_args_pick_inner_optimizer_and_match_it(tmp_path, optim_args, inner_class, checks):
    model = tiny_bert()
    args = _args(tmp_path, optim="zero_bucket", optim_args=optim_args, learning_rate=1e-2, weight_decay=0.1)
    opt = Trainer(model=model, args=args).create_optimizer()
    assert opt.optimizer_class is inner_class
    for attr, value in checks.items():
        assert getattr(opt, attr) == value
    # One step equals the plain inner optimizer built with the same hyperparameters.
    reference_model = tiny_bert()
    groups = [
        {"params": [dict(reference_model.named_parameters())[n] for n in g["param_names"]],
         **{k: v for k, v in g.items() if k not in ("params", "param_names")}}
        for g in opt.param_groups
    ]
    reference = inner_class(groups)
    for m in (model, reference_model):
        torch.manual_seed(1)
        m(input_ids=torch.randint(5, 50, (4, 8)), labels=torch.tensor([0, 1, 2, 0])).loss.backward()
    opt.step()
    reference.step()
    for (n, p), q in zip(model.named_parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-14, msg=n)


def test_default_inner_is_fused_adamw_as_trainers_default(tmp_path):
    """Without ``inner``, the local optimizer is torch's fused AdamW, as Trainer's default
    ``optim="adamw_torch_fused"``; ``inner=adamw`` is the single-tensor one (``adamw_torch``)."""
    opt = Trainer(model=tiny_bert(), args=_args(tmp_path, optim="zero_bucket")).create_optimizer()
    assert opt.optimizer_class is torch.optim.AdamW and opt.defaults["fused"] is True
    single = Trainer(model=tiny_bert(), args=_args(tmp_path, optim="zero_bucket", optim_args="inner=adamw"))
    assert not single.create_optimizer().defaults["fused"]
    assert hf_tr.parse_optim_args({})["fused"] is True


def test_default_inner_falls_back_where_torch_has_no_fused_kernel(caplog):
    """Params fused AdamW refuses (here: on the meta device): the default falls back to
    ``adamw`` with a warning naming why; an explicit ``inner=adamw_fused`` raises."""
    meta = [torch.zeros(3, device="meta")]
    with caplog.at_level("WARNING", logger=hf_tr.__name__):
        kwargs = hf_tr.parse_optim_args({}, meta)
    assert "fused" not in kwargs and kwargs["optimizer_class"] is torch.optim.AdamW
    assert "using inner=adamw" in caplog.text and "meta" in caplog.text
    with pytest.raises(ValueError, match=r"inner='adamw_fused' is not available here: .*meta.*; use inner=adamw"):
        hf_tr.parse_optim_args({"inner": "adamw_fused"}, meta)


@pytest.mark.parametrize(
    "optim_args, message",
    [
        ("inner=adamx", r"inner='adamx' is not supported; choose one of \['adafactor', 'adam', 'adamw'"),
        ("inner=adamw,momentum=0.9", r"unknown key\(s\) \['momentum'\].*valid keys: \['inner', 'shard', 'bucket_view', 'sharded_checkpoints', 'grad_reduce', 'overlap', 'master_weights', 'stage', 'local_accumulation', 'grad_accum_dtype', 'amsgrad'\]"),
        ("master_weights=maybe", r"master_weights='maybe' is not valid; choose one of \['auto', 'true', 'false'\]"),
        ("grad_reduce=scatter", r"grad_reduce='scatter' is not valid; choose one of \['reduce_scatter', 'all_reduce'\]"),
        ("overlap=sometimes", r"overlap='sometimes' is not a boolean"),
            ("sharded_checkpoints=maybe", r"sharded_checkpoints='maybe' is not a boolean"),
        ("shard=rows", r"shard='rows' is not valid; choose one of \['auto', 'flat', 'param'\]"),
        ("bucket_view=maybe", r"bucket_view='maybe' is not a boolean"),
        ("inner=sgd,momentum=lots", r"momentum='lots' is not a number"),
    ],
)
@pytest.mark.reliability("Bad input: optim_args=\"{optim_args}\"", "`ValueError` naming the key/value and listing the valid ones")
def test_bad_optim_args_are_clear_errors(tmp_path, optim_args, message):
    args = _args(tmp_path, optim="zero_bucket", optim_args=optim_args)
    with pytest.raises(ValueError, match=message):
        Trainer(model=tiny_bert(), args=args).create_optimizer()


# -- multi-process runs ---------------------------------------------------------------------
def _assert_params_close(got, want, atol, what):
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=atol, msg=lambda m: f"{what}: {n}: {m}")


@pytest.mark.reliability("Trainer, 2 ranks: freeze/unfreeze inside and outside DDP, save, resume on 2 and on 1 rank; gradient checkpointing + a freeze with find_unused_parameters=False", "equal to 1 process (1e-12); the gradient-checkpointing case raises `ValueError` saying ddp_find_unused_parameters=True")
@pytest.mark.timeout(900)
def test_trainer_two_ranks_equal_one_process_with_freezing_saving_and_resume(tmp_path):
    main2, main1 = str(tmp_path / "main2"), str(tmp_path / "main1")
    ckpt = str(tmp_path / "main2" / "checkpoint-4")
    two = run_ranks(run_many, 2, [
        ("run_trainer", dict(output_dir=main2, **MAIN)),
        ("run_trainer", dict(output_dir=str(tmp_path / "resume2"), resume=ckpt, **MAIN)),
        # An explicit callback asking for plain files: optimizer.pt streamed from the shards.
        ("run_trainer", dict(output_dir=str(tmp_path / "steps"), save_strategy="steps", save_steps=3, max_steps=4,
                             sharded_checkpoints=False)),
        ("run_trainer", dict(output_dir=str(tmp_path / "only_model"), save_strategy="steps", save_steps=2,
                             max_steps=2, save_only_model=True)),
        ("run_trainer_catching", dict(output_dir=str(tmp_path / "gc_default"), schedule=SCHEDULE,
                                      gradient_checkpointing=True)),
        ("run_trainer", dict(output_dir=str(tmp_path / "gc_unused"), gradient_checkpointing=True,
                             ddp_find_unused_parameters=True, **{**MAIN, "save_strategy": "no"})),
        ("run_trainer", dict(output_dir=str(tmp_path / "bf16"), bf16=True, max_steps=3, schedule=SCHEDULE)),
        ("run_trainer", dict(output_dir=str(tmp_path / "plain2"), schedule=PLAIN_SCHEDULE)),
        ("run_trainer", dict(output_dir=str(tmp_path / "module"), plain_module=True, save_strategy="steps",
                             save_steps=2, max_steps=3)),
        ("run_trainer", dict(output_dir=str(tmp_path / "fp16"), max_steps=5, schedule=SCHEDULE,
                             frozen_at_build=("bert.encoder.layer.1.",),
                             overflow=(3, "bert.encoder.layer.1.output.dense.weight"))),
        # An inf on rank 1 in a param DDP reduces: reduce-scattered, so only its owner sees it.
        ("run_trainer", dict(output_dir=str(tmp_path / "fp16_scattered"), max_steps=5,
                             overflow=(3, "bert.encoder.layer.0.output.dense.weight"))),
        # Overlap opted in, no callback of ours: the parameter sync overlaps the next forward;
        # a mid-run save drains it.
        ("run_trainer", dict(output_dir=str(tmp_path / "overlap"), user_callbacks=False, save_strategy="steps",
                             save_steps=3, optim_args="overlap=true")),
        # bf16's reference: torch AdamW on the same 2 ranks (the same bf16 autocast inputs per rank)
        ("run_trainer", dict(output_dir=str(tmp_path / "bf16_adamw"), bf16=True, max_steps=3, schedule=SCHEDULE,
                             optim="adamw_torch_fused", reference=True)),
    ], timeout=560)
    one = run_ranks(run_many, 1, [
        ("run_trainer", dict(output_dir=main1, optim="adamw_torch_fused", reference=True, **MAIN)),
        ("run_trainer", dict(output_dir=str(tmp_path / "resume1"), resume=ckpt, **MAIN)),
        ("run_trainer", dict(output_dir=str(tmp_path / "plain1"), optim="adamw_torch_fused", schedule=PLAIN_SCHEDULE)),
        ("run_trainer", dict(output_dir=str(tmp_path / "overlap1"), optim="adamw_torch_fused", user_callbacks=False,
                             save_strategy="steps", save_steps=3)),
    ], timeout=300)
    (main, resumed2, steps, only_model, gc_error, gc_ok, bf16, plain, module, fp16, fp16_scattered, overlap,
     bf16_reference) = two[0]
    other_rank = two[1]
    (reference, resumed1, plain_reference, overlap_reference) = one[0]
    initial = dict(tiny_bert().named_parameters())

    # Replicas agree on every rank, in every run.
    for run0, run1 in zip(two[0], other_rank):
        if isinstance(run0, tuple):
            _assert_params_close(run0[0], run1[0], 0.0, "rank 1 vs rank 0")

    # 2 ranks (ZeRO, grad accumulation, clipping, freezes inside and outside DDP) == 1 process AdamW.
    _assert_params_close(main[0], reference[0], 1e-12, "zero_bucket 2 ranks vs adamw_torch_fused 1 process")
    # Nothing frozen at build: the reference is Trainer's own default, optim="adamw_torch_fused".
    _assert_params_close(plain[0], plain_reference[0], 1e-12, "zero_bucket 2 ranks vs Trainer adamw_torch_fused")
    moved = [n for n in initial if not torch.equal(initial[n].detach(), reference[0][n])]
    assert "bert.encoder.layer.1.output.dense.weight" in moved and "bert.embeddings.word_embeddings.weight" in moved
    # Unfrozen outside DDP's reducer and clipped: the grads were averaged before clipping.
    grad_norms = [(e["step"], e["grad_norm"]) for e in main[1] if "grad_norm" in e]
    want_norms = [(e["step"], e["grad_norm"]) for e in reference[1] if "grad_norm" in e]
    assert [s for s, _ in grad_norms] == [s for s, _ in want_norms]
    torch.testing.assert_close(torch.tensor([g for _, g in grad_norms]), torch.tensor([g for _, g in want_norms]),
                               rtol=1e-10, atol=0)

    # The epoch-end checkpoint (each rank's state, optimizer.pt a reference; gathered
    # nowhere) made into a plain file is the reference's state dict.
    assert hf_tr.SHARDED_DIR in os.listdir(ckpt) and os.path.getsize(f"{ckpt}/optimizer.pt") < 2000
    _offline.write_plain_optimizer(os.path.join(ckpt, hf_tr.SHARDED_DIR), str(tmp_path / "plain.pt"))
    # Trainer's layout (the params trainable at the save; the frozen ones' state carried apart) put
    # back together is the state of torch AdamW over every param.
    saved = every_param(torch.load(str(tmp_path / "plain.pt"), weights_only=True))
    want = torch.load(f"{main1}/checkpoint-4/optimizer.pt", weights_only=True)
    assert saved["state"].keys() == want["state"].keys() and len(saved["state"]) == len(initial)
    for i in want["state"]:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(saved["state"][i][k], want["state"][i][k], rtol=0, atol=1e-12)

    # Resumed at step 4 on 2 ranks and on 1 rank: the uninterrupted run's weights.
    _assert_params_close(resumed2[0], main[0], 1e-13, "resume on 2 ranks")
    _assert_params_close(resumed1[0], main[0], 1e-12, "resume on 1 rank")

    # ZeRO facts in the logs: at train begin and after each of the 3 rebuilds, stamped with the step that made
    # them (the schedule's change at the end of step 2 is taken up by step 3).
    facts = [e for e in main[1] if "zero_trainable_elements_per_rank" in e]
    # The second line: the first step lays the buffers out after DDP's gradient buckets,
    # seen in the first backward (docs/gradient_path.md); no optimizer state exists before it.
    assert [e["step"] for e in facts] == [0, 1, 3, 4, 6]
    assert [e["zero_rebuilds"] for e in facts] == [1, 2, 3, 4, 5]
    trainable = sum(p.numel() for n, p in initial.items() if not n.startswith("bert.encoder.layer.1."))
    assert sum(facts[0]["zero_trainable_elements_per_rank"]) == trainable
    assert facts[0]["zero_state_bytes_per_rank"] == [0, 0] and min(facts[1]["zero_state_bytes_per_rank"]) > 0

    # The memory ledger, logged once after the first step, with the planner's prediction of its model states.
    ledgers = [e for e in main[1] if "zero_memory_ledger" in e]
    assert [e["step"] for e in ledgers] == [1]
    led, predicted = ledgers[0]["zero_memory_ledger"], ledgers[0]["zero_memory_predicted"]
    assert led["peak_model_states"] == led["model_states"] == predicted["model_states"] > 0 and led["ddp_buckets"] > 0

    # A ZeroBucketCallback passed explicitly as well as the default one acts once: one facts
    # line at train begin and one for the first step's re-layout after DDP's buckets, none twice.
    assert [e["zero_rebuilds"] for e in steps[1] if "zero_rebuilds" in e and "loss" not in e] == [1, 2]

    # Other save modes. sharded_checkpoints=False: a plain optimizer.pt, the shards removed.
    assert os.listdir(tmp_path / "steps" / "checkpoint-3").count(hf_tr.SHARDED_DIR) == 0
    assert len(torch.load(str(tmp_path / "steps" / "checkpoint-3" / "optimizer.pt"), weights_only=True)["state"]) > 0
    assert os.path.exists(str(tmp_path / "only_model" / "checkpoint-2" / "model.safetensors"))
    assert not os.path.exists(str(tmp_path / "only_model" / "checkpoint-2" / "optimizer.pt"))

    # A model that is not a PreTrainedModel is saved with safetensors' save_file: its
    # bucket views (one storage, no overlap) are all written.
    from safetensors.torch import load_file

    for saved in ("checkpoint-2", "checkpoint-3", "."):
        state = load_file(str(tmp_path / "module" / saved / "model.safetensors"))
        assert len(state) == len(initial), saved
    for n, p in module[0].items():
        assert torch.equal(state[n], p), n

    # Gradient checkpointing: DDP without find_unused_parameters cannot take a freeze.
    assert gc_error.startswith("ValueError: hf_zero: bert.embeddings.") and "ddp_find_unused_parameters=True" in gc_error
    assert other_rank[4] == gc_error
    _assert_params_close(gc_ok[0], reference[0], 1e-12, "gradient checkpointing + find_unused_parameters")

    # bf16 autocast equals torch AdamW on the same ranks: params and grads stay float64 and
    # autocast rounds the same matmul inputs in both runs, so only the float64 sums of the
    # gradient average may differ in order (1e-12, as the float64 runs above); and it trained.
    _assert_params_close(bf16[0], bf16_reference[0], 1e-12, "bf16: zero_bucket vs adamw_torch_fused, 2 ranks")
    losses = [e["loss"] for e in bf16[1] if "loss" in e]
    want = [e["loss"] for e in bf16_reference[1] if "loss" in e]
    assert len(losses) == len(want) == 3
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-10, atol=0)
    assert not torch.equal(bf16[0]["classifier.weight"], initial["classifier.weight"].detach())

    # fp16 with GradScaler: an inf grad on rank 1 only, in a param DDP does not reduce,
    # skips step 4 on both ranks (no hang), and the scale backs off once on both.
    assert fp16[2]["skipped"] == other_rank[9][2]["skipped"] == [False, False, False, True, False]
    assert fp16[2]["scale"] == other_rank[9][2]["scale"] == 2.0**9
    assert fp16_scattered[2]["skipped"] == other_rank[10][2]["skipped"] == [False, False, False, True, False]
    assert fp16_scattered[2]["scale"] == other_rank[10][2]["scale"] == 2.0**9

    # The gradient path Trainer takes by default: reduce-scatter, the parameter sync not
    # overlapped (opt-in: docs/known_limits.md); the opted-in run overlaps.
    for run in (main, plain, fp16, fp16_scattered):
        assert run[2]["grad_reduce"] == "reduce_scatter" and not run[2]["overlap"], run[2]
    assert overlap[2]["grad_reduce"] == "reduce_scatter" and overlap[2]["overlap"], overlap[2]
    _assert_params_close(overlap[0], overlap_reference[0], 1e-12, "overlapped sync vs Trainer adamw_torch_fused")
    grad_norms = [e["grad_norm"] for e in overlap[1] if "grad_norm" in e]
    want_norms = [e["grad_norm"] for e in overlap_reference[1] if "grad_norm" in e]
    assert len(grad_norms) == len(want_norms) == 7
    torch.testing.assert_close(torch.tensor(grad_norms), torch.tensor(want_norms), rtol=1e-10, atol=0)
    from safetensors.torch import load_file

    for saved in ("checkpoint-3", "checkpoint-6"):  # saved while the step's sync was in flight
        state = load_file(str(tmp_path / "overlap" / saved / "model.safetensors"))
        want = load_file(str(tmp_path / "overlap1" / saved / "model.safetensors"))
        assert state.keys() == want.keys()
        _assert_params_close(state, want, 1e-12, f"overlap {saved}")


@pytest.mark.timeout(240)
def test_stage2_logs_comparable_memory_and_the_state_it_made_into_log_history(tmp_path):
    """Stage 2, 2 ranks, 3 steps, a line logged every step. The optimizer state is sampled again after the first
    step (stage 2 has no first-step re-layout to do it); the memory ledger, logged once after step 1 and stamped
    so, gives the peak of its model states: the grad shards the step let go are in it, as in the planner's
    prediction beside it (within the 10% docs/choosing.md states). The summary keys reach log_history's
    entry of the line they are printed in."""
    (run, other), = zip(*run_ranks(run_many, 2, [
        ("run_trainer", dict(output_dir=str(tmp_path / "s2"), optim_args="stage=2", max_steps=3))], timeout=200))
    history = run[1]
    assert run[2]["stage"] == 2
    facts = [e for e in history if "zero_trainable_elements_per_rank" in e]
    assert [e["step"] for e in facts] == [0, 1]
    assert facts[0]["zero_state_bytes_per_rank"] == [0, 0] and min(facts[1]["zero_state_bytes_per_rank"]) > 0

    (entry,) = [e for e in history if "zero_memory_ledger" in e]
    led, predicted = entry["zero_memory_ledger"], entry["zero_memory_predicted"]
    assert entry["step"] == 1
    assert led["grad_shards"] == 0 and led["peaks"]["grad_shards"] > 0  # released by the step, held before it
    assert led["model_states"] < 0.9 * predicted["model_states"]  # what the step left: not comparable
    assert abs(led["peak_model_states"] - predicted["model_states"]) <= 0.10 * predicted["model_states"]

    lines = {e["step"]: e for e in history if "loss" in e}
    assert sorted(lines) == [1, 2, 3]
    first = lines[1]
    assert first["zero_state_bytes_max"] == max(facts[1]["zero_state_bytes_per_rank"]) > 0
    assert first["zero_memory_model_states_bytes"] == led["peak_model_states"]
    assert first["zero_memory_predicted_model_states_bytes"] == predicted["model_states"]
    assert first["zero_memory_total_bytes"] == led["peak_total"]
    assert not any(k.startswith("zero_") for k in (*lines[2], *lines[3]))  # said once


# -- sharded checkpoints ---------------------------------------------------------------------
@pytest.mark.reliability("Trainer with ZeroBucketCallback(sharded_checkpoints=True): save at step 4 on 2 ranks, resume on 2 and on 1 rank", "equal to the uninterrupted run (1e-12); optimizer.pt is a tiny reference, loadable with weights_only=True")
@pytest.mark.timeout(240)
def test_trainer_sharded_checkpoints_resume_on_two_and_one_rank(tmp_path):
    from hf_zero import _offline, _sharded

    main, ckpt = str(tmp_path / "main"), str(tmp_path / "main" / "checkpoint-4")
    sharded = dict(MAIN, sharded_checkpoints=True)
    two = run_ranks(run_many, 2, [
        ("run_trainer", dict(output_dir=main, **sharded)),
        ("run_trainer", dict(output_dir=str(tmp_path / "resume2"), resume=ckpt, **sharded)),
        # --optim_args sharded_checkpoints=true: the same as the explicit callback
        ("run_trainer", dict(output_dir=str(tmp_path / "rotate"), optim_args="sharded_checkpoints=true",
                             save_strategy="steps", save_steps=2, max_steps=5, save_total_limit=1)),
    ], timeout=220)
    # Moved (the path recorded at save time is gone), resumed by one process with the
    # default (consolidating) callback: found through Trainer's resume path and loaded.
    shutil.move(ckpt, str(tmp_path / "moved"))
    ckpt = str(tmp_path / "moved")
    (resumed1,), = run_ranks(run_many, 1, [("run_trainer", dict(output_dir=str(tmp_path / "resume1"), resume=ckpt, **MAIN))],
                             timeout=120)
    (uninterrupted, resumed2, _), other_rank = two
    for run0, run1 in zip(two[0], other_rank):
        _assert_params_close(run0[0], run1[0], 0.0, "rank 1 vs rank 0")
    _assert_params_close(resumed2[0], uninterrupted[0], 1e-13, "sharded resume on 2 ranks")
    _assert_params_close(resumed1[0], uninterrupted[0], 1e-12, "sharded resume on 1 rank")
    # The explicit callback and the default one act once: ZeRO facts at train begin and per rebuild.
    assert [e["step"] for e in uninterrupted[1] if "zero_rebuilds" in e and "loss" not in e] == [0, 1, 3, 4, 6]
    # save_total_limit rotates whole checkpoints; the kept one holds its sharded state.
    assert sorted(os.listdir(tmp_path / "rotate")) == ["checkpoint-5"]
    assert _sharded.is_sharded_checkpoint(str(tmp_path / "rotate" / "checkpoint-5" / hf_tr.SHARDED_DIR))

    # The checkpoint: the sharded state of both ranks, and an optimizer.pt that only refers to it.
    initial = dict(tiny_bert().named_parameters())
    shards = os.path.join(ckpt, hf_tr.SHARDED_DIR)
    assert _sharded.is_sharded_checkpoint(shards)
    assert sum(name.endswith("-of-00002.safetensors") for name in os.listdir(shards)) == 2
    marker = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True)
    assert marker["state"] == {} and marker["param_groups"] == []
    assert marker[_sharded.REFERENCE_KEY]["token"] == _sharded.token_at(shards) and marker[_sharded.REFERENCE_KEY]["step"] == 4
    assert os.path.getsize(os.path.join(ckpt, "optimizer.pt")) < 2000
    full = every_param(_offline.consolidate_checkpoint(shards))  # frozen params' state too (Trainer's layout)
    assert len(full["state"]) == len(initial) and all("exp_avg_sq" in st for st in full["state"].values())
    # The resumed 2-rank run wrote its final checkpoint sharded too; the 1-process one consolidated.
    assert _sharded.is_sharded_checkpoint(str(tmp_path / "resume2" / "checkpoint-7" / hf_tr.SHARDED_DIR))
    final1 = every_param(torch.load(str(tmp_path / "resume1" / "checkpoint-7" / "optimizer.pt"), weights_only=True))
    assert len(final1["state"]) == len(initial)


def test_sharded_reference_is_never_silently_ignored(tmp_path):
    """A loaded reference must be resolved before any step; a plain optimizer refuses it."""
    from hf_zero import _sharded

    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3).double()
        return model, hf_zero.ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW, lr=0.1)

    def step(model, opt):
        model(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
        opt.step()
        opt.zero_grad()

    model, opt = build()
    step(model, opt)
    path = str(tmp_path / "ckpt" / "hf_zero_optimizer")
    opt.save_sharded(path)
    opt.refer_to_sharded(path, step=1)
    marker = opt.state_dict()
    assert marker[_sharded.REFERENCE_KEY]["path"] == path and marker["state"] == {}
    opt.load_state_dict(marker)  # its own current state: nothing to load
    step(model, opt)
    assert "state" in opt.state_dict() and _sharded.REFERENCE_KEY not in opt.state_dict()  # the state changed

    model2, opt2 = build()
    with pytest.raises(ValueError, match="different number of parameter groups"):
        torch.optim.AdamW(model2.parameters()).load_state_dict(marker)
    opt2.load_state_dict(marker)
    assert opt2.state_dict() == marker  # still pending: it stands for that checkpoint
    with pytest.raises(RuntimeError, match="reference to the sharded optimizer checkpoint .* not loaded yet"):
        step(model2, opt2)
    opt2.zero_grad()  # the failed step's backward left grads
    moved = str(tmp_path / "moved")
    os.rename(str(tmp_path / "ckpt"), moved)
    with pytest.raises(RuntimeError, match=r"cannot find the sharded optimizer checkpoint .*looked in \[.*elsewhere"):
        opt2.load_pending_sharded([str(tmp_path / "elsewhere")])
    assert opt2.load_pending_sharded([os.path.join(moved, "hf_zero_optimizer")]) == os.path.join(moved, "hf_zero_optimizer")
    # Equal to the original after the same step from the saved state.
    model3, opt3 = build()
    step(model3, opt3)
    for p2, p3 in zip(model2.parameters(), model3.parameters()):
        p2.data.copy_(p3.data)
    step(model2, opt2)
    step(model3, opt3)
    for p2, p3 in zip(model2.parameters(), model3.parameters()):
        assert torch.equal(p2, p3)


@pytest.mark.reliability("Two Trainers that each run alone (parallel_mode NOT_PARALLEL) under a torch.distributed world of 2", "`ValueError` at optimizer creation on both, naming the mismatch and ACCELERATE_USE_CPU=1; no cross-trainer sharding")
@pytest.mark.timeout(120)
def test_independent_trainers_under_a_distributed_world_are_refused(tmp_path):
    # use_cpu=False on a machine without accelerators: transformers 5 sees one process, as with
    # plain `torchrun` on CPU without ACCELERATE_USE_CPU=1. (4.57 sees both and trains them
    # as one DDP run: then nothing is independent and there is nothing to refuse.)
    runs = [("trainer_world_size", dict(use_cpu=False)),
            ("run_trainer_catching", dict(output_dir=str(tmp_path / "alone"), use_cpu=False))]
    (seen, error), other_rank = run_ranks(run_many, 2, runs, timeout=100)
    if seen == 2:
        assert other_rank == [2, "no error"] and error == "no error", (error, other_rank)
        return
    assert seen == other_rank[0] == 1
    for error in (error, other_rank[1]):
        assert error.startswith("ValueError: optim='zero_bucket': the Trainer runs this process alone"), error
        assert "torch.distributed has 2 processes" in error and "ACCELERATE_USE_CPU=1" in error


@pytest.mark.timeout(120)
def test_the_layout_check_makes_no_all_reduce_in_a_steady_trainer_step(tmp_path):
    """The trainability/view check makes a small all-reduce when training begins, at the first step (no layout
    for a gradient bucket to carry it yet) and at each step where every rank changed its trainable set; in the
    other steps its bits ride a gradient bucket ([Note: stage 1's check rides a bucket])."""
    for calls, steps in run_ranks(run_counting_agreements, 2, output_dir=str(tmp_path / "count"), timeout=100,
                                  schedule={3: {"bert.embeddings.": False}, 5: {"bert.embeddings.": True}}):
        assert steps == 7
        assert calls == 1 + 1 + 2


def test_factory_with_a_decay_rule_selecting_no_param(tmp_path):
    """A Trainer whose get_decay_parameter_names returns nothing: an empty decay group and a no-decay
    group of every param, as Trainer's own optimizer has them (its checkpoints then fit each other's)."""

    class NoDecayTrainer(Trainer):
        def get_decay_parameter_names(self, model):
            return []

    model = tiny_bert()
    opts = {optim: NoDecayTrainer(model=model, args=_args(tmp_path, optim=optim, weight_decay=0.1)).create_optimizer()
            for optim in ("zero_bucket", "adamw_torch")}
    for opt in opts.values():
        assert [len(g["params"]) for g in opt.param_groups] == [0, len(list(model.parameters()))]
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


# -- configurations hf_zero cannot serve -------------------------------------------------------
def _refused(callable_, what):
    with pytest.raises(ValueError, match=rf"ZeroBucketOptimizer cannot run under {what}") as info:
        callable_()
    assert "optim='zero_bucket'" in str(info.value) and "adamw_torch" in str(info.value)


@pytest.mark.reliability("Trainer with optim='zero_bucket' under FSDP, DeepSpeed, Megatron-LM, tensor/context parallelism",
                         "`ValueError` at optimizer creation (before any step) naming the engine and the setting")
def test_trainer_refuses_engines_that_shard_or_split_params(tmp_path, monkeypatch):
    import accelerate
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    model = tiny_bert()
    # Read from the args (the decision Trainer makes before it builds the accelerator).
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    _refused(lambda: Trainer.get_optimizer_cls_and_kwargs(_args(tmp_path, optim="zero_bucket", fsdp=True), model),
             r"FSDP \(fsdp=")
    # TrainingArguments(fsdp=...) exported ACCELERATE_USE_FSDP=true (transformers 4.57): the Trainers
    # below and later tests must not build FSDP accelerators (undo() restores the variable's absence).
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    if hasattr(accelerate, "ParallelismConfig"):  # Accelerate >= 1.10 (the floor, 1.3, has none to refuse)
        tp = _args(tmp_path, optim="zero_bucket", parallelism_config=accelerate.ParallelismConfig(tp_size=2))
        _refused(lambda: Trainer.get_optimizer_cls_and_kwargs(tp, model),
                 r"tensor parallelism \(parallelism_config.tp_size=2\)")
        cp = _args(tmp_path, optim="zero_bucket", parallelism_config=accelerate.ParallelismConfig(cp_size=2))
        _refused(lambda: Trainer.get_optimizer_cls_and_kwargs(cp, model), r"context parallelism")
    # Read from the Trainer's accelerator (DeepSpeed needs its package to build the args:
    # the decision Trainer takes from them is the accelerator's distributed type).
    trainer = Trainer(model=model, args=_args(tmp_path, optim="zero_bucket"))
    for kind, name in ((DistributedType.DEEPSPEED, "DeepSpeed"), (DistributedType.MEGATRON_LM, "Megatron-LM"),
                       (DistributedType.FSDP, "FSDP")):
        monkeypatch.setattr(Accelerator, "distributed_type", property(lambda self, kind=kind: kind))
        _refused(trainer.create_optimizer, rf"{name} \(distributed_type={kind.value}\)")
        assert trainer.optimizer is None
    monkeypatch.undo()
    # A model loaded with a tensor-parallel plan says so (its tp_size property).
    trainer = Trainer(model=model, args=_args(tmp_path, optim="zero_bucket"))
    monkeypatch.setattr(type(model), "tp_size", property(lambda self: 2), raising=False)
    _refused(trainer.create_optimizer, r"tensor parallelism \(tp_size=2\)")
    monkeypatch.undo()
    assert isinstance(Trainer(model=model, args=_args(tmp_path, optim="zero_bucket")).create_optimizer(),
                      hf_zero.ZeroBucketOptimizer)


# -- saves decided after the step's callbacks ----------------------------------------------------
def _checkpoints(root):
    return sorted((d for d in os.listdir(root) if d.startswith("checkpoint-")), key=lambda d: int(d.split("-")[1]))


@pytest.mark.reliability("Trainer, 2 ranks: save_strategy='best' (the save is decided after evaluation) and a user callback "
                         "setting should_save in on_evaluate",
                         "the same checkpoints, optimizer.pt state and logged losses as adamw_torch_fused (1e-12)")
@pytest.mark.timeout(400)
def test_saves_decided_after_evaluation_write_what_adamw_torch_fused_writes(tmp_path):
    runs = {
        "best": dict(evaluate=True, eval_strategy="steps", eval_steps=2, save_strategy="best",
                     metric_for_best_model="eval_loss"),
        "callback": dict(evaluate=True, eval_strategy="steps", eval_steps=3, save_on_evaluate=True),
    }
    table = [("run_trainer", dict(output_dir=str(tmp_path / f"{name}-{optim}"), optim=optim, user_callbacks=False,
                                  **kw))
             for name, kw in runs.items() for optim in ("zero_bucket", "adamw_torch_fused")]
    rank0, rank1 = run_ranks(run_many, 2, table, timeout=380)
    for i, name in enumerate(runs):
        (zero, zero_log, _), (adamw, adamw_log, _) = rank0[2 * i], rank0[2 * i + 1]
        _assert_params_close(rank1[2 * i][0], zero, 0.0, f"{name}: rank 1 vs rank 0")
        _assert_params_close(zero, adamw, 1e-12, f"{name}: zero_bucket vs adamw_torch_fused")
        for key in ("loss", "eval_loss", "grad_norm"):
            got = [(e["step"], e[key]) for e in zero_log if key in e]
            want = [(e["step"], e[key]) for e in adamw_log if key in e]
            assert [s for s, _ in got] == [s for s, _ in want] and got, (name, key)
            torch.testing.assert_close(torch.tensor([v for _, v in got]), torch.tensor([v for _, v in want]),
                                       rtol=1e-10, atol=0)
        zero_dir, adamw_dir = tmp_path / f"{name}-zero_bucket", tmp_path / f"{name}-adamw_torch_fused"
        assert _checkpoints(zero_dir) == _checkpoints(adamw_dir) != []
        for ckpt in _checkpoints(adamw_dir):  # each rank's state in the checkpoint, gathered offline here
            got = _offline.consolidate_checkpoint(zero_dir / ckpt / hf_tr.SHARDED_DIR)
            want = torch.load(adamw_dir / ckpt / "optimizer.pt", weights_only=True)
            assert got["state"].keys() == want["state"].keys() and len(want["state"]) == len(zero), ckpt
            for j in want["state"]:
                for k in ("exp_avg", "exp_avg_sq", "step"):
                    torch.testing.assert_close(got["state"][j][k], want["state"][j][k], rtol=0, atol=1e-12)
    # The callback saved after every evaluation: steps 3 and 6, and the last step where Trainer evaluates
    # there (transformers >= 4.58; 4.57 does not).
    evaluated = [e["step"] for e in rank0[3][1] if "eval_loss" in e]
    assert evaluated[:2] == [3, 6]
    assert _checkpoints(tmp_path / "callback-adamw_torch_fused") == [f"checkpoint-{s}" for s in evaluated]


def test_master_weights_option_is_parsed_and_passed_only_when_given():
    assert "master_weights" not in hf_tr.parse_optim_args({})
    for raw, want in (("auto", "auto"), ("true", True), ("FALSE", False)):
        assert hf_tr.parse_optim_args({"master_weights": raw})["master_weights"] == want
    with pytest.raises(ValueError, match=r"optim_args: master_weights='1' is not valid"):
        hf_tr.parse_optim_args({"master_weights": "1"})


@pytest.mark.reliability("Trainer fp16=True with a model whose params are float16",
                         "`ValueError` at optimizer creation: GradScaler cannot unscale float16 grads")
def test_fp16_mixed_precision_on_float16_params_is_refused(tmp_path):
    model = tiny_bert().half()
    trainer = Trainer(model=model, args=_args(tmp_path, optim="zero_bucket", fp16=True))
    with pytest.raises(ValueError, match=r"fp16=True with float16 params .*GradScaler cannot unscale float16 gradients"):
        trainer.create_optimizer()
    # float32 params under fp16 mixed precision are what fp16=True is for.
    assert isinstance(Trainer(model=tiny_bert().float(), args=_args(tmp_path, optim="zero_bucket", fp16=True))
                      .create_optimizer(), hf_zero.ZeroBucketOptimizer)


@pytest.mark.reliability("Trainer, 2 ranks: where p.grad lives with optim='zero_bucket'",
                         "DDP built with gradient_as_bucket_view=True: the grads are views of DDP's buckets (held once); "
                         "results equal adamw_torch_fused (1e-12)")
@pytest.mark.timeout(300)
def test_trainer_grads_are_views_of_ddps_buckets(tmp_path):
    table = [("run_trainer", dict(output_dir=str(tmp_path / optim), optim=optim, grad_storages=True, max_steps=4))
             for optim in ("zero_bucket", "adamw_torch_fused")]
    rank0, rank1 = run_ranks(run_many, 2, table, timeout=280)
    (zero, zero_log, zero_info), (adamw, adamw_log, adamw_info) = rank0
    _assert_params_close(zero, adamw, 1e-12, "zero_bucket vs adamw_torch_fused")
    _assert_params_close(rank1[0][0], zero, 0.0, "rank 1 vs rank 0")
    assert zero_info["ddp_grad_views"] is True and adamw_info["ddp_grad_views"] is False  # Trainer's own default
    n = len(list(tiny_bert().parameters()))
    for info in (zero_info, rank1[0][2]):
        # every grad lives in one of DDP's (here at most 2) buckets
        assert len(info["grad_storages"]) == 4 and all(count == n and storages <= 2 for count, storages in info["grad_storages"]), info
    assert all(storages == count == n for count, storages in adamw_info["grad_storages"])
    want = [e["loss"] for e in adamw_log if "loss" in e]
    torch.testing.assert_close(torch.tensor([e["loss"] for e in zero_log if "loss" in e]), torch.tensor(want), rtol=1e-10, atol=0)


@pytest.mark.reliability("Trainer, 2 ranks as 2 nodes with save_on_each_node=True (both ranks write optimizer.pt), "
                         "with sharded_checkpoints=false; and with the default sharded checkpoints in a shared directory",
                         "`ValueError` on both ranks at train begin naming save_on_each_node and sharded_checkpoints=true; "
                         "the default saves each rank's state and both write the same reference")
@pytest.mark.timeout(200)
def test_save_on_each_node_over_nodes_is_refused_before_the_first_step(tmp_path):
    runs = [("run_trainer_catching", dict(output_dir=str(tmp_path / name), save_on_each_node=True,
                                          one_process_per_node=True, save_strategy="steps", save_steps=2, max_steps=2,
                                          optim_args=optim_args))
            for name, optim_args in (("nodes", "sharded_checkpoints=false"), ("shared", None))]
    results = run_ranks(run_many, 2, runs, timeout=180)
    for error, shared in results:
        assert error.startswith("ValueError: optim='zero_bucket': save_on_each_node=True makes ranks [0, 1]"), error
        assert "sharded_checkpoints=true" in error
        assert shared == "no error"
    assert not os.path.exists(tmp_path / "nodes" / "checkpoint-2")
    from hf_zero import _sharded

    marker = torch.load(tmp_path / "shared" / "checkpoint-2" / "optimizer.pt", weights_only=True)
    assert marker[_sharded.REFERENCE_KEY]["token"] == _sharded.token_at(tmp_path / "shared" / "checkpoint-2" / hf_tr.SHARDED_DIR)


# -- the default checkpoints: resumed anywhere, by either optimizer ---------------------------------------
# A global batch of 6 splits evenly over 1, 2 and 3 ranks and stays inside the first epoch.
ANYWHERE = dict(global_batch=6, max_steps=3, save_strategy="steps", save_steps=2, user_callbacks=False)


@pytest.mark.reliability("Trainer, default checkpoints saved on 2 ranks, resumed on 1, 2 and 3 ranks; switched to "
                         "--optim adamw_torch on resume and from adamw_torch to zero_bucket; sharded_checkpoints=false",
                         "every resumed run equals the uninterrupted one (1e-12); the plain optimizer.pt equals the "
                         "sharded state bitwise, adamw_torch's key for key, and loads into torch AdamW")
@pytest.mark.timeout(400)
def test_default_checkpoints_resume_on_one_two_three_ranks_and_across_optimizers(tmp_path):
    def at(name):
        return str(tmp_path / name)

    saved = at("zero") + "/checkpoint-2"
    two = run_ranks(run_many, 2, [
        ("run_trainer", dict(output_dir=at("zero"), **ANYWHERE)),
        ("run_trainer", dict(output_dir=at("plain"), optim_args="sharded_checkpoints=false", **ANYWHERE)),
        ("run_trainer", dict(output_dir=at("adamw"), optim="adamw_torch", **ANYWHERE)),
        ("run_trainer", dict(output_dir=at("resume2"), resume=saved, **ANYWHERE)),
        ("run_trainer", dict(output_dir=at("to_adamw"), optim="adamw_torch", resume=saved, **ANYWHERE)),
        ("run_trainer", dict(output_dir=at("from_adamw"), resume=at("adamw") + "/checkpoint-2", **ANYWHERE)),
        ("run_trainer", dict(output_dir=at("from_plain"), resume=at("plain") + "/checkpoint-2", **ANYWHERE)),
    ], timeout=300)
    # Before transformers 5.2 Trainer resumes with the checkpoint's per-device batch (3): 3 ranks
    # cannot make the global batch of 6 with it, so the 3-rank resume runs on 5.2 and later.
    three = None if BEFORE_5_2 else run_ranks(
        run_many, 3, [("run_trainer", dict(output_dir=at("resume3"), resume=saved, **ANYWHERE))], timeout=150)[0][0]
    (one,), = run_ranks(run_many, 1, [("run_trainer", dict(output_dir=at("resume1"), resume=saved, **ANYWHERE))],
                        timeout=100)
    zero, plain, adamw, *resumed = two[0]
    for run0, run1 in zip(two[0], two[1]):
        _assert_params_close(run1[0], run0[0], 0.0, "rank 1 vs rank 0")
    _assert_params_close(adamw[0], zero[0], 1e-12, "adamw_torch vs zero_bucket")
    _assert_params_close(plain[0], zero[0], 0.0, "sharded_checkpoints=false vs the default")
    for name, run in zip(("resume2", "to_adamw", "from_adamw", "from_plain", "resume3", "resume1"),
                         [*resumed, three, one]):
        if run is not None:
            _assert_params_close(run[0], zero[0], 1e-12, name)

    # The default checkpoint holds each rank's state; the plain one a torch state dict and no shards.
    assert hf_tr.SHARDED_DIR in os.listdir(saved) and os.path.getsize(os.path.join(saved, "optimizer.pt")) < 2000
    assert hf_tr.SHARDED_DIR not in os.listdir(at("plain") + "/checkpoint-2")
    got = torch.load(at("plain") + "/checkpoint-2/optimizer.pt", weights_only=True)
    sharded = _offline.consolidate_checkpoint(os.path.join(saved, hf_tr.SHARDED_DIR))
    from tests.models import assert_state_dicts_equal

    assert_state_dicts_equal(got, sharded)
    want = torch.load(at("adamw") + "/checkpoint-2/optimizer.pt", weights_only=True)
    assert got["state"].keys() == want["state"].keys()
    for i in want["state"]:
        assert got["state"][i].keys() == want["state"][i].keys()
        for k in want["state"][i]:
            torch.testing.assert_close(got["state"][i][k], want["state"][i][k], rtol=0, atol=1e-12)
    model = tiny_bert()
    decay = set(Trainer.get_decay_parameter_names(None, model))
    groups = [[p for n, p in model.named_parameters() if (n in decay) == d] for d in (True, False)]
    torch.optim.AdamW([{"params": g} for g in groups]).load_state_dict(got)
