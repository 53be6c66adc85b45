"""Frozen params (every PEFT / LoRA run) and resuming across optimizers.

Trainer's own optimizers (``adamw_torch``, ``adamw_torch_fused``) hold only the params that
require grad, in a decay and a no-decay group kept even when empty; ``zero_bucket`` holds every
param (a frozen one must still train once unfrozen) but writes its state dicts in Trainer's
layout, the frozen params' state carried where torch's loader ignores it ([Note: trainable
layout] in hf_zero/_statedict.py). A checkpoint of either resumes with the other, on stage 1 and
2, sharded or plain, and ``hf-zero consolidate`` writes the file Trainer's optimizer loads.
"""

import copy
import os

import pytest
import torch

import hf_zero
from hf_zero import _offline, _sharded
from hf_zero._statedict import FROZEN_KEY
from hf_zero.cli import main
from hf_zero.integrations import transformers as hf_tr
from tests._dist import run_ranks
from tests.hf_trainer_cases import run_many, tiny_bert
from tests.models import assert_state_dicts_equal

pytestmark = pytest.mark.filterwarnings("ignore")

# PEFT's shape: embeddings, every bias and every LayerNorm frozen, so Trainer's no-decay group is
# empty and its decay group holds the trainable weights only.
FROZEN = r"^bert\.embeddings\.|bias$|LayerNorm"
RUN = dict(global_batch=6, max_steps=3, save_strategy="steps", save_steps=2, user_callbacks=False, frozen_re=FROZEN)
# A layer trained at step 0, frozen from step 1 to 2 (saved then), trained again from step 3: its
# moments from step 0 must survive the checkpoint for the resumed run to equal the uninterrupted one.
REFROZEN = dict(RUN, max_steps=4, user_callbacks=True,
                schedule={1: {"bert.encoder.layer.1.": False}, 3: {"bert.encoder.layer.1.": True}})


def _trainer_groups(model) -> list[list[torch.nn.Parameter]]:
    """Trainer.create_optimizer's groups: decay / no decay, trainable params only, both kept."""
    decay = set(hf_tr.transformers.Trainer.get_decay_parameter_names(None, model))
    return [[p for n, p in model.named_parameters() if (n in decay) == d and p.requires_grad] for d in (True, False)]


def _peft_bert():
    import re

    model = tiny_bert()
    for n, p in model.named_parameters():
        p.requires_grad_(not re.search(FROZEN, n))
    return model


def _close(a, b, what, atol=1e-12):
    for n in b:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=atol, msg=lambda m: f"{what}: {n}: {m}")


@pytest.mark.reliability("Trainer, 2 ranks, frozen params and an empty no-decay group (PEFT's shape): zero_bucket "
                         "checkpoints (stage 1, stage 2, sharded, sharded_checkpoints=false) resumed with adamw_torch / "
                         "adamw_torch_fused, adamw_torch's with zero_bucket; a frozen layer's moments through a checkpoint",
                         "every resumed run equals the uninterrupted one (1e-12); optimizer.pt and hf-zero consolidate have "
                         "Trainer's layout and load into torch AdamW; hf_zero's own resume keeps the frozen layer's moments")
@pytest.mark.timeout(500)
def test_resume_across_optimizers_with_frozen_params(tmp_path):
    def at(name):
        return str(tmp_path / name)

    def ckpt(name):
        return at(name) + "/checkpoint-2"

    first = run_ranks(run_many, 2, [
        ("run_trainer", dict(output_dir=at("zero"), **RUN)),
        ("run_trainer", dict(output_dir=at("plain"), optim_args="sharded_checkpoints=false", **RUN)),
        ("run_trainer", dict(output_dir=at("stage2"), optim_args="stage=2", **RUN)),
        ("run_trainer", dict(output_dir=at("stage2_plain"), optim_args="stage=2,sharded_checkpoints=false", **RUN)),
        ("run_trainer", dict(output_dir=at("adamw"), optim="adamw_torch", **RUN)),
        ("run_trainer", dict(output_dir=at("refrozen"), optim_args="sharded_checkpoints=false", **REFROZEN)),
    ], timeout=300)
    resumed = run_ranks(run_many, 2, [
        ("run_trainer", dict(output_dir=at("to_adamw"), optim="adamw_torch", resume=ckpt("zero"), **RUN)),
        ("run_trainer", dict(output_dir=at("to_fused"), optim="adamw_torch_fused", resume=ckpt("plain"), **RUN)),
        ("run_trainer", dict(output_dir=at("s2_to_adamw"), optim="adamw_torch", resume=ckpt("stage2"), **RUN)),
        ("run_trainer", dict(output_dir=at("s2p_to_fused"), optim="adamw_torch_fused", resume=ckpt("stage2_plain"), **RUN)),
        ("run_trainer", dict(output_dir=at("from_adamw"), resume=ckpt("adamw"), **RUN)),
        ("run_trainer", dict(output_dir=at("s2_from_adamw"), optim_args="stage=2", resume=ckpt("adamw"), **RUN)),
        ("run_trainer", dict(output_dir=at("refrozen_resumed"), optim_args="sharded_checkpoints=false",
                             resume=ckpt("refrozen"), **REFROZEN)),
    ], timeout=300)
    for runs in (first, resumed):
        for run0, run1 in zip(*runs):
            _close(run1[0], run0[0], "rank 1 vs rank 0", atol=0.0)
    zero, plain, stage2, stage2_plain, adamw, refrozen = (r[0] for r in first[0])
    for name, run in (("plain", plain), ("stage2", stage2), ("stage2_plain", stage2_plain), ("adamw", adamw)):
        _close(run, zero, name)
    names = ("to_adamw", "to_fused", "s2_to_adamw", "s2p_to_fused", "from_adamw", "s2_from_adamw")
    for name, run in zip(names, resumed[0]):
        _close(run[0], zero, name)
    _close(resumed[0][-1][0], refrozen, "a frozen layer's moments through hf_zero's own checkpoint")

    # optimizer.pt (sharded_checkpoints=false) and `hf-zero consolidate` of the sharded checkpoints
    # have Trainer's layout: they load into torch AdamW over Trainer's groups.
    model = _peft_bert()
    groups = _trainer_groups(model)
    sizes = [len(g) for g in groups]
    assert sizes[0] > 0 and sizes[1] == 0  # Trainer's layout: an empty no-decay group
    written = {}
    for name in ("zero", "stage2"):
        out = at(f"{name}.pt")
        assert main(["consolidate", ckpt(name), out]) == 0
        written[name] = torch.load(out, weights_only=True)
        assert_state_dicts_equal(written[name], _offline.consolidate_checkpoint(os.path.join(ckpt(name), hf_tr.SHARDED_DIR)))
    for name in ("plain", "stage2_plain"):
        written[name] = torch.load(ckpt(name) + "/optimizer.pt", weights_only=True)
    adamw_sd = torch.load(ckpt("adamw") + "/optimizer.pt", weights_only=True)
    for name, sd in written.items():
        assert [len(g["params"]) for g in sd["param_groups"]] == sizes, name
        assert list(sd["state"]) == list(adamw_sd["state"]), name
        for i, st in adamw_sd["state"].items():
            for k, v in st.items():
                torch.testing.assert_close(sd["state"][i][k], v, rtol=0, atol=1e-12, msg=lambda m: f"{name} {i} {k}: {m}")
        torch.optim.AdamW([{"params": g} for g in groups]).load_state_dict(copy.deepcopy(sd))
        # Frozen params (never stepped here) are carried with every param listed, and have no state.
        assert len([j for g in sd[FROZEN_KEY]["param_groups"] for j in g["params"]]) == len(list(model.parameters())), name
        assert sd[FROZEN_KEY]["state"] == {}
    # The refrozen layer was stepped once before it was frozen: its moments ride in optimizer.pt.
    refrozen_sd = torch.load(ckpt("refrozen") + "/optimizer.pt", weights_only=True)
    frozen_names = {n: j for g in refrozen_sd[FROZEN_KEY]["param_groups"] for j, n in zip(g["params"], g["param_names"])}
    layer1 = [n for n in frozen_names if n.startswith("bert.encoder.layer.1.") and n.endswith("weight")
              and "LayerNorm" not in n]
    assert layer1 and all(frozen_names[n] in refrozen_sd[FROZEN_KEY]["state"] for n in layer1)
    assert all(float(refrozen_sd[FROZEN_KEY]["state"][frozen_names[n]]["exp_avg"].abs().max()) > 0 for n in layer1)


# -- one process: the layouts against torch's own AdamW -------------------------------------------
def _two_layers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if "weight" in n], "param_names": [n for n, _ in named if "weight" in n]},
              {"params": [p for n, p in named if "bias" in n], "param_names": [n for n, _ in named if "bias" in n],
               "weight_decay": 0.0}]
    return model, groups


def _step(model, opt, seed):
    torch.manual_seed(seed)
    model(torch.randn(5, 3, dtype=torch.float64)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.fast
def test_trainable_layout_loads_into_torch_over_the_trainable_params_and_back_exactly():
    """Trained, then the first layer frozen: the state dict lists the trainable params only (as torch
    AdamW over them would), carries the frozen layer's moments, and hf_zero's own load keeps them: after
    unfreezing, it steps as torch AdamW over all params, which never lost them."""
    ref_model, ref_groups = _two_layers()
    ref = torch.optim.AdamW(ref_groups, lr=0.1)
    model, groups = _two_layers()
    opt = hf_zero.ZeroBucketOptimizer(groups, torch.optim.AdamW, lr=0.1, state_dict_params="trainable")
    for m, o in ((ref_model, ref), (model, opt)):
        _step(m, o, 0)
        m[0].requires_grad_(False)
        _step(m, o, 1)
    sd = copy.deepcopy(opt.state_dict())
    want = ref.state_dict()  # every param: 0.weight, 1.weight | 0.bias, 1.bias
    assert [g["param_names"] for g in sd["param_groups"]] == [["1.weight"], ["1.bias"]]
    assert [g["params"] for g in sd["param_groups"]] == [[0], [1]]
    for mine, theirs in ((sd["state"][0], want["state"][1]), (sd["state"][1], want["state"][3]),
                         (sd[FROZEN_KEY]["state"][2], want["state"][0]), (sd[FROZEN_KEY]["state"][3], want["state"][2])):
        assert mine.keys() == theirs.keys()
        for k in theirs:
            assert torch.equal(mine[k], theirs[k]), k
    # torch AdamW over the trainable params (Trainer's adamw_torch) loads it as it is.
    torch_over_trainable = torch.optim.AdamW([{"params": [model[1].weight]}, {"params": [model[1].bias]}], lr=0.1)
    torch_over_trainable.load_state_dict(copy.deepcopy(sd))
    assert torch.equal(torch_over_trainable.state[model[1].weight]["exp_avg"], want["state"][1]["exp_avg"])
    # hf_zero's own resume: exact, the frozen layer's moments included.
    resumed = hf_zero.ZeroBucketOptimizer(groups, torch.optim.AdamW, lr=0.1, state_dict_params="trainable")
    resumed.load_state_dict(copy.deepcopy(sd))
    assert_state_dicts_equal(resumed.state_dict(), sd)
    for m, o in ((ref_model, ref), (model, resumed)):
        m[0].requires_grad_(True)
        _step(m, o, 2)
    for (n, p), q in zip(ref_model.named_parameters(), model.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.fast
def test_a_state_dict_of_torch_over_the_trainable_params_loads_with_an_empty_group():
    """Trainer's adamw_torch over a model whose no-decay params are all frozen: groups [2, 0]; hf_zero
    holds all four params (frozen ones too) in the same two groups and continues as torch does."""
    ref_model, _ = _two_layers()
    for n, p in ref_model.named_parameters():
        p.requires_grad_("weight" in n)
    ref = torch.optim.AdamW([{"params": [ref_model[0].weight, ref_model[1].weight]},
                             {"params": [], "weight_decay": 0.0}], lr=0.1)
    _step(ref_model, ref, 0)
    saved = copy.deepcopy(ref.state_dict())
    model, groups = _two_layers()
    model.load_state_dict(ref_model.state_dict())
    for n, p in model.named_parameters():
        p.requires_grad_("weight" in n)
    opt = hf_zero.ZeroBucketOptimizer(groups, torch.optim.AdamW, lr=0.1, state_dict_params="trainable")
    opt.load_state_dict(saved)
    got = opt.state_dict()
    assert [len(g["params"]) for g in got["param_groups"]] == [2, 0]
    for i, st in saved["state"].items():
        for k, v in st.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
    for m, o in ((ref_model, ref), (model, opt)):
        _step(m, o, 1)
    for (n, p), q in zip(ref_model.named_parameters(), model.parameters()):
        assert torch.equal(p, q), n
    # With the default layout, the same: a state dict of the trainable params is mapped onto them.
    plain = hf_zero.ZeroBucketOptimizer(_two_layers()[1], torch.optim.AdamW, lr=0.1)
    for p in plain.params:
        p.requires_grad_(p.dim() == 2)
    plain.load_state_dict(saved)
    assert [len(g["params"]) for g in plain.state_dict()["param_groups"]] == [2, 2]


@pytest.mark.fast
def test_a_state_dict_that_fits_neither_layout_says_why():
    model, groups = _two_layers()
    model[0].requires_grad_(False)
    opt = hf_zero.ZeroBucketOptimizer(groups, torch.optim.AdamW, lr=0.1)
    other = torch.optim.AdamW([{"params": [model[1].weight]}, {"params": [model[0].bias, model[1].bias]}])
    with pytest.raises(ValueError, match=r"param group 0: 1 params saved, this optimizer has 2 \(the param groups hold "
                                         r"\[2, 2\] params, \[1, 1\] of them trainable now"):
        opt.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match=r"state_dict_params must be one of \('all', 'trainable'\), got 'frozen'"):
        hf_zero.ZeroBucketOptimizer(groups, torch.optim.AdamW, state_dict_params="frozen")
    with pytest.raises(ValueError, match="every param group is empty"):
        hf_zero.ZeroBucketOptimizer([{"params": []}], torch.optim.AdamW)


# -- PEFT LoRA ----------------------------------------------------------------------------------
@pytest.mark.reliability("Trainer, 2 ranks, PEFT LoRA on a tiny Llama: a zero_bucket checkpoint resumed with "
                         "adamw_torch_fused and an adamw_torch_fused one with zero_bucket",
                         "each equals the uninterrupted run of the optimizer it resumes with (1e-6, float32)")
@pytest.mark.timeout(400)
def test_peft_lora_resumes_across_optimizers(tmp_path):
    pytest.importorskip("peft")
    from tests.fp32_export_cases import run_lora_many

    def at(name):
        return str(tmp_path / name)

    first = run_ranks(run_lora_many, 2, [dict(output_dir=at("zero")),
                                         dict(output_dir=at("fused"), optim="adamw_torch_fused")], timeout=200)
    resumed = run_ranks(run_lora_many, 2, [
        dict(output_dir=at("to_fused"), optim="adamw_torch_fused", resume=at("zero") + "/checkpoint-2"),
        dict(output_dir=at("from_fused"), resume=at("fused") + "/checkpoint-2"),
    ], timeout=200)
    zero, fused = first[0]
    to_fused, from_fused = resumed[0]
    assert len(zero) == 8 and all(".lora_" in n for n in zero)
    _close(fused, zero, "adamw_torch_fused vs zero_bucket", atol=1e-6)
    _close(to_fused, fused, "zero_bucket checkpoint resumed by adamw_torch_fused", atol=1e-6)
    _close(from_fused, zero, "adamw_torch_fused checkpoint resumed by zero_bucket", atol=1e-6)


@pytest.mark.reliability("hf-zero consolidate --weights on a PEFT LoRA checkpoint (bf16 adapters, fp32 masters)",
                         "finds adapter_model.safetensors as it finds model.safetensors; every adapter weight is its "
                         "master bitwise; a directory output is an adapter directory")
@pytest.mark.timeout(300)
def test_weights_of_a_lora_checkpoint_come_from_its_adapter_file(tmp_path, capsys):
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    from tests.fp32_export_cases import run_lora_many

    run_ranks(run_lora_many, 1, [dict(output_dir=str(tmp_path / "lora"), bf16_adapters=True, max_steps=2)], timeout=200)
    ckpt = tmp_path / "lora" / "checkpoint-2"
    assert (ckpt / "adapter_model.safetensors").exists() and not (ckpt / "model.safetensors").exists()
    adapter = load_file(str(ckpt / "adapter_model.safetensors"))
    assert adapter and all(v.dtype == torch.bfloat16 for v in adapter.values())
    sd = torch.load(ckpt / "optimizer.pt", weights_only=True)
    names = {i: n for g in sd["param_groups"] for i, n in zip(g["params"], g["param_names"])}
    masters = {names[i].replace(".default.", "."): st["master_param"] for i, st in sd["state"].items()}
    assert masters.keys() == adapter.keys()
    assert main(["consolidate", str(ckpt), "--weights", str(tmp_path / "fp32.safetensors")]) == 0
    printed = capsys.readouterr().out
    assert f"{len(adapter)} from fp32 master weights" in printed and "adapter_model.safetensors" in printed, printed
    fp32 = load_file(str(tmp_path / "fp32.safetensors"))
    assert fp32.keys() == adapter.keys()
    for k, v in masters.items():
        assert fp32[k].dtype == torch.float32 and torch.equal(fp32[k], v), k
    assert main(["consolidate", str(ckpt), "--weights", str(tmp_path / "fp32")]) == 0
    assert sorted(os.listdir(tmp_path / "fp32")) == ["adapter_config.json", "adapter_model.safetensors"]


@pytest.mark.fast
def test_trainer_resuming_a_checkpoint_of_other_trainable_params_says_why(tmp_path):
    """Trainer's adamw_torch handed zero_bucket's state of another trainable set: hf_zero's error says
    why (torch's would only say a group's size differs), naming both layouts and the fix."""
    model, groups = _two_layers()
    opt = hf_zero.ZeroBucketOptimizer(groups, torch.optim.AdamW, lr=0.1, state_dict_params="trainable")
    model[0].requires_grad_(False)
    _step(model, opt, 0)
    saved = copy.deepcopy(opt.state_dict())  # groups [1, 1]: the second layer only
    everything = torch.optim.AdamW([{"params": [model[0].weight, model[1].weight]},
                                    {"params": [model[0].bias, model[1].bias]}])
    with pytest.raises(ValueError, match=r"optim='zero_bucket' with param groups of \[1, 1\] params, and this AdamW "
                                         r"has \[2, 2\]: the run that saved it had other params trainable"):
        hf_tr._serve_reference(everything, str(tmp_path), saved)
    fitting = torch.optim.AdamW([{"params": [model[1].weight]}, {"params": [model[1].bias]}])
    assert hf_tr._serve_reference(fitting, str(tmp_path), saved) is saved
