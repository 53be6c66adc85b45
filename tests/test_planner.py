"""hf-zero plan: meta-device models, balance per mode, torch's partition, the JSON report."""

import json

import pytest
import torch

from hf_zero import cli, planner

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def preset_params():
    return {name: planner.load_model_params(name)[0] for name in planner.PRESETS}


def test_presets_have_published_sizes(preset_params):
    totals = {name: sum(p.numel for p in ps) for name, ps in preset_params.items()}
    # Parameter counts of the published checkpoints (tied embeddings counted once).
    assert totals == {
        "gpt2": 124_439_808,
        "qwen2.5-0.5b": 494_032_768,
        "llama-3.2-1b": 1_235_814_400,
        "llama-3-8b": 8_030_261_248,
    }


@pytest.mark.parametrize("world_size", [8, 64])
def test_flat_is_balanced_for_every_preset(preset_params, world_size):
    for name, params in preset_params.items():
        report = planner.plan(params, world_size=world_size, model_name=name)
        flat = report["plans"]["hf_zero_flat"]
        assert flat["balance"] <= 1.01, name
        assert sum(flat["trainable_elements_per_rank"]) == report["model"]["trainable_params"]
        assert flat["max_state_bytes"] <= 1.01 * report["unsharded"]["ideal_state_bytes_per_rank"], name
        # Whole-param modes can only be as good as the largest tensor allows.
        assert report["plans"]["hf_zero_param"]["balance"] <= report["plans"]["torch_zero"]["balance"] + 1e-9


def test_torch_partition_matches_design_figures(preset_params):
    gpt2 = planner.plan(preset_params["gpt2"], world_size=8)["plans"]["torch_zero"]
    assert gpt2["balance"] == pytest.approx(2.48, abs=0.01)
    gpt2_64 = planner.plan(preset_params["gpt2"], world_size=64)["plans"]["torch_zero"]
    assert gpt2_64["balance"] == pytest.approx(19.9, abs=0.1)
    last_two = planner.select_trainable(preset_params["llama-3-8b"], [r"layers\.(30|31)\.", "lm_head"])
    llama = planner.plan(last_two, world_size=8)["plans"]
    assert llama["torch_zero"]["balance"] == pytest.approx(4.89, abs=0.01)
    assert llama["hf_zero_flat"]["balance"] <= 1.01
    # torch counts frozen params at full size, so small trainable sets pile up.
    norms = planner.select_trainable(preset_params["gpt2"], [r"ln_"])
    assert planner.plan(norms, world_size=8)["plans"]["torch_zero"]["balance"] == pytest.approx(8.0)


def test_state_bytes_per_optimizer():
    w = planner.NamedParam("w", (6, 4), True)
    b = planner.NamedParam("b", (4,), True)
    frozen = planner.NamedParam("f", (100,), False)
    report = planner.plan([w, b, frozen], world_size=1, optimizer="adamw", shards=("flat",))
    assert report["unsharded"]["state_bytes"] == 2 * 28 * 4 + 2 * 4
    assert report["plans"]["hf_zero_flat"]["state_bytes_per_rank"] == [2 * 28 * 4 + 2 * 4]
    sgd = planner.plan([w, b], world_size=1, optimizer="sgd", dtype=torch.bfloat16, shards=("flat",))
    assert sgd["unsharded"]["state_bytes"] == 28 * 2
    ada = planner.plan([w, b], world_size=2, optimizer="adafactor", shards=("param",))
    assert ada["unsharded"]["state_bytes"] == (6 + 4) * 4 + 4 * 4
    assert sorted(ada["plans"]["hf_zero_param"]["state_bytes_per_rank"]) == [16, 40]
    with pytest.raises(ValueError, match="elementwise"):
        planner.plan([w], world_size=2, optimizer="adafactor", shards=("flat",))


def test_json_report_schema(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(model_type="gpt2", vocab_size=1000, n_positions=64, n_embd=32,
                                      n_layer=2, n_head=2)))
    png = tmp_path / "plan.png"
    argv = ["plan", "--model", str(config), "--world-size", "4", "--trainable", r"\.h\.1\.", "--json"]
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", str(png)]
    except ImportError:
        png = None
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == "hf_zero.plan/1"
    assert set(report) == {"schema", "model", "world_size", "optimizer", "backend", "per_rank_common",
                           "unsharded", "plans"}
    assert set(report["model"]) == {"name", "params", "param_tensors", "trainable_params",
                                    "trainable_tensors", "module_buffers", "dtype"}
    assert set(report["plans"]) == {"hf_zero_flat", "hf_zero_param", "torch_zero"}
    common = {"trainable_elements_per_rank", "state_bytes_per_rank", "max_state_bytes", "max_rank_bytes", "balance",
              "collectives_per_step", "sync_bytes_per_step"}
    for name in ("hf_zero_flat", "hf_zero_param"):
        p = report["plans"][name]
        assert set(p) == common | {"buffers"}
        assert set(p["collectives_per_step"]) == {"sync", "sync_kind", "control"}
        assert len(p["state_bytes_per_rank"]) == 4
        assert sum(p["trainable_elements_per_rank"]) == report["model"]["trainable_params"]
        assert p["max_rank_bytes"] == sum(report["per_rank_common"].values()) + max(p["state_bytes_per_rank"])
        for buf in p["buffers"]:
            assert set(buf) == {"dtype", "elements", "bytes", "padding", "rank_bounds"}
            assert buf["elements"] == buf["rank_bounds"][-1] or name == "hf_zero_param"
    torch_plan = report["plans"]["torch_zero"]
    assert set(torch_plan) == common
    assert set(torch_plan["collectives_per_step"]) == {"bucket_view", "no_bucket_view"}
    assert report["plans"]["hf_zero_flat"]["collectives_per_step"] == {
        "sync": 1, "sync_kind": "all_gather_into_tensor", "control": 1}
    assert report["model"]["trainable_tensors"] == 12  # one GPT-2 block: 2 ln x2, attn x4, mlp x4
    if png is not None:
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_bad_input_is_named(capsys):
    assert cli.main(["plan", "--model", "gpt2", "--world-size", "2", "--trainable", "nothing-matches"]) == 2
    assert "trainable" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "gpt2", "--world-size", "2", "--shard", "flat",
                     "--optimizer", "adafactor"]) == 2
    assert "--shard" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "no/such/config.json", "--world-size", "2"]) == 2
    assert "model" in capsys.readouterr().err
