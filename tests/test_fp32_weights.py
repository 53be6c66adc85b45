"""hf-zero consolidate CHECKPOINT --weights OUT: float32 weights from the fp32 masters, checked
against the saved 16-bit weights, on every kind of checkpoint (see [Note: fp32 export])."""

import json
import os
import shlex
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_zero.cli import build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- helpers ---------------------------------------------------------------------------
def _saved_weights(directory):
    """The model weights of a checkpoint directory (single file or index-sharded), as saved."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return load_file(os.path.join(directory, "model.safetensors"))
    with open(index) as f:
        files = set(json.load(f)["weight_map"].values())
    out = {}
    for name in files:
        out.update(load_file(os.path.join(directory, name)))
    return out


def _plain_masters(optimizer_file):
    """name -> master_param of a consolidated optimizer state dict (the optimizer's own masters)."""
    sd = torch.load(optimizer_file, weights_only=True)
    names = {i: n for g in sd["param_groups"] for i, n in zip(g["params"], g["param_names"])}
    return {names[i]: st["master_param"] for i, st in sd["state"].items() if "master_param" in st}


def _assert_export(weights, saved, masters, *, saved_wins=()):
    """Every saved weight is there as float32 and rounds to the saved one; a weight with a
    master equals it bitwise, except ``saved_wins`` (its saved weight, upcast)."""
    assert set(weights) == set(saved)
    for k, s in saved.items():
        w = weights[k]
        assert w.dtype == (torch.float32 if s.is_floating_point() else s.dtype), k
        assert torch.equal(w.to(s.dtype), s), k
        if k in saved_wins:
            assert not torch.equal(masters[k].to(s.dtype), s), k  # the master really disagreed
            assert torch.equal(w, s.float()), k
        elif k in masters:
            assert torch.equal(w, masters[k]), k
        else:
            assert torch.equal(w, s.float() if s.is_floating_point() else s), k


def _export(capsys, *argv):
    capsys.readouterr()
    code = main(["consolidate", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- single-process checkpoints ------------------------------------------------------------
def _trainer_checkpoint(directory, *, masters=True, names=("a.weight", "b.weight"), weights="model.safetensors"):
    """A Trainer-style checkpoint: bf16 model weights (``weights``: the file or index Trainer writes) and
    optimizer.pt whose state holds masters for a.weight."""
    os.makedirs(directory)
    g = torch.Generator().manual_seed(0)
    master_a = torch.randn(3, 4, generator=g, dtype=torch.float32) * 1e-3 + 1.0  # differs from its bf16 rounding
    frozen_b = torch.randn(5, generator=g).to(torch.bfloat16)
    sd = {"a.weight": master_a.to(torch.bfloat16), "b.weight": frozen_b, "pos": torch.arange(3)}
    if weights == "model.safetensors":
        save_file(sd, os.path.join(directory, weights))
    elif weights == "pytorch_model.bin":
        torch.save(sd, os.path.join(directory, weights))
    else:  # index-sharded
        from huggingface_hub import save_torch_state_dict

        save_torch_state_dict(sd, directory, max_shard_size=30)
        assert os.path.isfile(os.path.join(directory, "model.safetensors.index.json"))
    state = {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(3, 4), "exp_avg_sq": torch.zeros(3, 4)}}
    if masters:
        state[0]["master_param"] = master_a.clone()
    groups = [{"lr": 1e-3, "params": [0], "param_names": [names[0]]}]
    torch.save({"state": state, "param_groups": groups}, os.path.join(directory, "optimizer.pt"))
    return master_a, frozen_b


@pytest.mark.reliability("consolidate --weights on a checkpoint with bf16 weights ({weights}) and fp32 masters",
                         "masters written bitwise, other weights upcast, non-float buffers kept")
@pytest.mark.parametrize("weights", ["model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"])
def test_weights_take_masters_and_upcast_the_rest(tmp_path, capsys, weights):
    directory = str(tmp_path / "checkpoint-3")
    master_a, frozen_b = _trainer_checkpoint(directory, weights=weights)
    out = str(tmp_path / "fp32.safetensors")
    code, printed, _ = _export(capsys, directory, "--weights", out)
    assert code == 0
    assert "3 float32 weights, 1 from fp32 master weights, 1 bfloat16 weights without a master" in printed
    w = load_file(out)
    assert set(w) == {"a.weight", "b.weight", "pos"}
    assert w["a.weight"].dtype == torch.float32 and torch.equal(w["a.weight"], master_a)
    assert not torch.equal(w["a.weight"], master_a.to(torch.bfloat16).float())  # not the rounded param
    assert torch.equal(w["b.weight"], frozen_b.float())
    assert torch.equal(w["pos"], torch.arange(3))


def _bf16_mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    model.register_buffer("scale", torch.tensor([2.0]))
    return model.to(torch.bfloat16)


def _stepped(model, steps=3, **kwargs):
    import hf_zero

    opt = hf_zero.ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW, lr=1e-3, **kwargs)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)).to(next(model.parameters()).dtype)
    for _ in range(steps):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def _masters_of(opt, model):
    names = {id(p): n for n, p in model.named_parameters()}
    sd = opt.state_dict()
    by_index = {i: names[id(p)] for g, pg in zip(sd["param_groups"], opt.param_groups)
                for i, p in zip(g["params"], pg["params"])}
    return {by_index[i]: st["master_param"] for i, st in sd["state"].items() if "master_param" in st}


@pytest.mark.reliability("consolidate --weights on a save_sharded() directory with several masters, with and "
                         "without the model's weights",
                         "without weights: exit 2 naming --model, nothing written; with them (in the parent or "
                         "--model): every master bitwise, buffers kept")
def test_save_sharded_directory_with_several_masters(tmp_path, capsys):
    model = _bf16_mlp()
    opt = _stepped(model)
    masters = _masters_of(opt, model)
    assert len(masters) == 6
    sharded = tmp_path / "ckpt" / "optimizer"
    opt.save_sharded(str(sharded))
    out = tmp_path / "w.safetensors"

    code, _, err = _export(capsys, sharded, "--weights", out)  # no model weights anywhere near
    assert code == 2 and "no model weights" in err and "--model" in err
    assert not out.exists()

    weights_file = tmp_path / "elsewhere.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights_file))
    code, printed, _ = _export(capsys, sharded, "--weights", out, "--model", weights_file)
    assert code == 0, printed
    assert "7 float32 weights, 6 from fp32 master weights, 1 bfloat16 weights without a master" in printed, printed
    _assert_export(load_file(out), load_file(weights_file), masters)

    shutil.copyfile(weights_file, tmp_path / "ckpt" / "model.safetensors")  # next to it: found by itself
    out.unlink()
    assert _export(capsys, sharded, "--weights", out)[0] == 0
    _assert_export(load_file(out), load_file(weights_file), masters)


@pytest.mark.reliability("consolidate --weights on checkpoints holding no masters ({case})",
                         "writes the saved weights; the printed line says they are not masters")
@pytest.mark.parametrize("case, says", [
    ("no optimizer state", "NO master weights: the checkpoint holds no optimizer state (saved with save_only_model?)"),
    ("master_weights=false", "NO master weights: the optimizer state"),
    ("float32 model", "the saved weights as they are (no master weights: the params are not 16-bit)"),
])
def test_no_masters_is_said(tmp_path, capsys, case, says):
    model = _bf16_mlp().float() if case == "float32 model" else _bf16_mlp()
    opt = _stepped(model, master_weights=case != "master_weights=false")
    directory = tmp_path / "checkpoint-3"
    if case != "no optimizer state":
        opt.save_sharded(str(directory / "hf_zero_optimizer"))
    directory.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    out = tmp_path / "w.safetensors"
    code, printed, _ = _export(capsys, directory, "--weights", out)
    assert code == 0 and says in printed, printed
    if case != "float32 model":
        assert "upcast, no more precise than the checkpoint" in printed
    _assert_export(load_file(out), load_file(directory / "model.safetensors"), {})


@pytest.mark.reliability("consolidate --weights of a GPT-2 with tied input/output embeddings, as a directory",
                         "from_pretrained loads it in float32, the head tied to the embedding's master")
def test_tied_weights_directory_loads_with_from_pretrained(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64, n_positions=16,
                                       bos_token_id=0, eos_token_id=0)).to(torch.bfloat16)
    import hf_zero

    opt = hf_zero.ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW, lr=1e-3)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    masters = _masters_of(opt, model)
    directory = tmp_path / "checkpoint-2"
    model.save_pretrained(str(directory))
    opt.save_sharded(str(directory / "hf_zero_optimizer"))
    out = tmp_path / "fp32-model"
    code, printed, _ = _export(capsys, directory, "--weights", out)
    assert code == 0 and f"wrote {out}/model.safetensors" in printed
    saved = _saved_weights(directory)
    assert "lm_head.weight" not in saved  # save_pretrained writes a tied weight once
    _assert_export(load_file(out / "model.safetensors"), saved, masters)
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    assert loaded.dtype == torch.float32
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert torch.equal(loaded.lm_head.weight, masters["transformer.wte.weight"])


@pytest.mark.reliability("consolidate --weights with bad input ({case})",
                         "exit 2, a message naming the problem, nothing written")
@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("nothing", "no model weights"),
    ("mismatch", "have no weight of that name"),
    ("output and --weights", "not both"),
    ("directory not empty", "exists and is not empty"),
    ("bad shard size", "is not a size"),
    ("shard size for a file", "only for a directory output"),
    ("weights file as checkpoint", "is not an optimizer state"),
    ("garbage optimizer.pt", "is not a torch.save'd optimizer state dict"),
])
def test_bad_input_is_named(tmp_path, capsys, case, message):
    directory = str(tmp_path / "checkpoint-3")
    if case == "nothing":
        os.makedirs(directory)
    elif case == "mismatch":
        _trainer_checkpoint(directory, names=("other.weight", "b.weight"))
    elif case != "missing":
        _trainer_checkpoint(directory)
    out = str(tmp_path / ("fp32" if case in ("directory not empty", "bad shard size") else "fp32.safetensors"))
    extra = {"output and --weights": ["x.pt"], "bad shard size": ["--max-shard-size", "big"],
             "shard size for a file": ["--max-shard-size", "1GB"]}.get(case, [])
    if case == "directory not empty":
        os.makedirs(out)
        open(os.path.join(out, "keep.txt"), "w").close()
    if case == "weights file as checkpoint":
        directory = os.path.join(directory, "model.safetensors")
    elif case == "garbage optimizer.pt":
        with open(os.path.join(directory, "optimizer.pt"), "w") as f:
            f.write("not a pickle")
    code, _, err = _export(capsys, directory, *extra, "--weights", out)
    assert code == 2 and message in err, err
    assert not os.path.exists(out) or os.listdir(out) == ["keep.txt"]


def test_checkpoints_doc_consolidate_lines_parse_as_documented():
    with open(os.path.join(ROOT, "docs", "checkpoints.md")) as f:
        lines = [line.split("#")[0].strip() for line in f if line.startswith("hf-zero consolidate")]
    assert sum("--weights" in line for line in lines) >= 2
    for line in lines:
        args = build_parser().parse_args(shlex.split(line)[1:])
        if args.weights:  # --weights OUT takes the next word: CHECKPOINT comes first, no second positional
            assert args.output is None and not args.checkpoint.endswith(".safetensors"), line
        else:
            assert args.output is not None, line


# -- a real Trainer run: bf16 tiny Llama, 2 ranks, optim="zero_bucket" --------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two 2-rank Trainer runs (sharded_checkpoints=false: a consolidated optimizer.pt, the optimizer's own
    masters, whatever the default; sharded_checkpoints=true), checkpoints at
    steps 2 and 4, each checkpoint's weights re-saved in 4 safetensors files (as Trainer writes a
    model over its 50 GB shard size)."""
    from huggingface_hub import save_torch_state_dict

    from tests._dist import run_ranks
    from tests.fp32_export_cases import run_both

    directory = tmp_path_factory.mktemp("fp32_runs")
    assert run_ranks(run_both, 2, str(directory), timeout=240) == [[4, 4], [4, 4]]
    for run in ("plain", "sharded"):
        for step in (2, 4):
            ckpt = directory / run / f"checkpoint-{step}"
            sd = load_file(ckpt / "model.safetensors")
            (ckpt / "model.safetensors").unlink()
            save_torch_state_dict(sd, str(ckpt), max_shard_size=20_000)
            assert len([f for f in os.listdir(ckpt) if f.startswith("model-")]) >= 3
    return directory


def _expected(runs, step):
    """(saved weights, the optimizer's masters) of checkpoint-``step``: both runs trained alike."""
    return (_saved_weights(runs / "plain" / f"checkpoint-{step}"),
            _plain_masters(runs / "plain" / f"checkpoint-{step}" / "optimizer.pt"))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.reliability("consolidate --weights on a 2-rank Trainer checkpoint of a bf16 Llama whose weights are "
                         "in 4 safetensors files ({run} optimizer state)",
                         "from_pretrained loads the directory in float32 and load_state_dict(strict=True) the "
                         "file; every master bitwise, every tensor rounds to the saved bf16")
@pytest.mark.parametrize("run", ["plain", "sharded"])
def test_trainer_checkpoint_in_several_files(runs, tmp_path, capsys, run):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from tests.fp32_export_cases import tiny_llama

    ckpt = runs / run / "checkpoint-2"
    saved, masters = _expected(runs, 2)
    assert _saved_weights(ckpt).keys() == saved.keys()
    assert len(masters) == len(saved) == 21
    for k in saved:
        assert torch.equal(_saved_weights(ckpt)[k], saved[k]), k  # the two runs are one run

    code, printed, err = _export(capsys, ckpt, "--weights", tmp_path / "out", "--max-shard-size", "30KB")
    assert code == 0 and "21 float32 weights, 21 from fp32 master weights" in printed and not err, (printed, err)
    if run == "sharded":
        assert "hf_zero_optimizer (token" in printed
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert loaded.dtype == torch.float32
    assert len([f for f in os.listdir(tmp_path / "out") if f.startswith("model-")]) >= 2
    _assert_export(loaded.state_dict(), saved, masters)

    file = tmp_path / "out.safetensors"
    assert _export(capsys, ckpt, "--weights", file)[0] == 0
    model = tiny_llama().float()
    model.load_state_dict(load_file(file), strict=True)
    _assert_export(dict(model.state_dict()), saved, masters)
    assert isinstance(model, LlamaForCausalLM)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.reliability("consolidate --weights pointed at a Trainer checkpoint's optimizer.pt or hf_zero_optimizer/ "
                         "folder; plain consolidate pointed at a Trainer checkpoint with a sharded reference",
                         "the same weights as from the checkpoint directory (model weights found in the parent); "
                         "the plain optimizer state dict of the referenced sharded state")
@pytest.mark.parametrize("target", ["plain/checkpoint-2/optimizer.pt", "sharded/checkpoint-2/optimizer.pt",
                                    "sharded/checkpoint-2/hf_zero_optimizer"])
def test_pointing_at_the_optimizer_file_or_folder(runs, tmp_path, capsys, target):
    saved, masters = _expected(runs, 2)
    out = tmp_path / "w.safetensors"
    code, printed, _ = _export(capsys, runs / target, "--weights", out)
    assert code == 0 and "21 from fp32 master weights" in printed, printed
    _assert_export(load_file(out), saved, masters)
    if target.startswith("sharded"):
        from hf_zero import _offline

        assert _export(capsys, runs / target, tmp_path / "optimizer.pt")[0] == 0
        merged = torch.load(tmp_path / "optimizer.pt", weights_only=True)
        direct = _offline.consolidate_checkpoint(runs / "sharded" / "checkpoint-2" / "hf_zero_optimizer")
        assert merged["state"].keys() == direct["state"].keys() and len(merged["state"]) == 21
        for i, st in direct["state"].items():
            for key, v in st.items():
                assert torch.equal(merged["state"][i][key], v), (i, key)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_accelerate_style_reference_and_inspect(runs, tmp_path, capsys):
    """Accelerate names the reference optimizer.bin; inspect follows a reference too."""
    saved, masters = _expected(runs, 2)
    ckpt = tmp_path / "accelerate-checkpoint"
    shutil.copytree(runs / "sharded" / "checkpoint-2", ckpt)
    (ckpt / "optimizer.pt").rename(ckpt / "optimizer.bin")
    assert _export(capsys, ckpt, "--weights", tmp_path / "w.safetensors")[0] == 0
    _assert_export(load_file(tmp_path / "w.safetensors"), saved, masters)
    capsys.readouterr()
    assert main(["inspect", str(ckpt / "optimizer.bin")]) == 0
    shown = capsys.readouterr().out
    assert f"checkpoint      {ckpt / 'hf_zero_optimizer'}" in shown and "world size      2" in shown, shown


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.reliability("consolidate --weights on a Trainer checkpoint where a param frozen at step 2 (master "
                         "parked) was halved at step 3 ({run} optimizer state)",
                         "a warning names the param and 2048 of 2048 elements; its saved weight wins, upcast; "
                         "every other master bitwise")
@pytest.mark.parametrize("run", ["plain", "sharded"])
def test_frozen_param_changed_after_its_master_was_parked(runs, tmp_path, capsys, run):
    from tests.fp32_export_cases import FROZEN

    saved, masters = _expected(runs, 4)
    out = tmp_path / "w.safetensors"
    code, printed, err = _export(capsys, runs / run / "checkpoint-4", "--weights", out)
    assert code == 0 and "(1 with saved elements kept, see below)" in printed
    assert "warning: 1 master weight(s) do not round to the saved 16-bit weight" in err
    assert f"{FROZEN} (2048 of 2048 elements)" in err
    _assert_export(load_file(out), saved, masters, saved_wins={FROZEN})


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.reliability("consolidate --weights on a copied sharded Trainer checkpoint whose original place was "
                         "saved over later, or deleted; with and without the copy's hf_zero_optimizer/",
                         "the directory carrying the reference's token is used (the copy's, else the original); "
                         "none: exit 2 naming the token and each place looked at, never the later save's weights")
def test_copied_checkpoint_honours_the_token(runs, tmp_path, capsys):
    original = runs / "sharded" / "checkpoint-2"
    saved, masters = _expected(runs, 2)
    copy, bare = tmp_path / "copy", tmp_path / "bare"
    shutil.copytree(original, copy)
    shutil.copytree(original, bare, ignore=shutil.ignore_patterns("hf_zero_optimizer"))
    out = tmp_path / "w.safetensors"

    def export(directory):
        if out.exists():
            out.unlink()
        return _export(capsys, directory, "--weights", out)

    assert export(bare)[0] == 0  # original in place: found at the recorded path
    _assert_export(load_file(out), saved, masters)

    moved = tmp_path / "moved-aside"
    shutil.move(original / "hf_zero_optimizer", moved)
    try:
        # A later save over the original place: another token there.
        shutil.copytree(runs / "sharded" / "checkpoint-4" / "hf_zero_optimizer", original / "hf_zero_optimizer")
        code, printed, _ = export(copy)
        assert code == 0 and str(copy / "hf_zero_optimizer") in printed
        _assert_export(load_file(out), saved, masters)
        code, _, err = export(bare)
        assert code == 2 and "no directory holds it" in err and "a later save" in err and not out.exists()

        shutil.rmtree(original / "hf_zero_optimizer")  # the original deleted
        assert export(copy)[0] == 0
        _assert_export(load_file(out), saved, masters)
        code, _, err = export(bare)
        assert code == 2 and "no directory holds it" in err and "missing" in err and not out.exists()
    finally:
        shutil.rmtree(original / "hf_zero_optimizer", ignore_errors=True)
        shutil.move(moved, original / "hf_zero_optimizer")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.reliability("consolidate --weights on a Trainer checkpoint without optimizer state (save_only_model)",
                         "writes the saved bf16 weights upcast; the printed line says NO master weights")
def test_trainer_checkpoint_without_optimizer_state(runs, tmp_path, capsys):
    only_model = tmp_path / "checkpoint-2"
    shutil.copytree(runs / "plain" / "checkpoint-2", only_model, ignore=shutil.ignore_patterns("optimizer.pt"))
    saved, _ = _expected(runs, 2)
    code, printed, _ = _export(capsys, only_model, "--weights", tmp_path / "w.safetensors")
    assert code == 0 and "NO master weights" in printed and "save_only_model" in printed
    _assert_export(load_file(tmp_path / "w.safetensors"), saved, {})
