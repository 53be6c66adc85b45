"""hf-zero plan: meta-device models, balance per mode, torch's partition, the JSON report."""

import json
from pathlib import Path

import pytest
import torch

from hf_zero import _planner as planner, cli
from hf_zero._layout import ParamSpec, max_over_mean
from tests.test_layout import real_torch_zero_loads

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


@pytest.mark.parametrize("model, trainable, world_size, balance", [
    ("gpt2", None, 8, 2.48), ("gpt2", None, 64, 19.9),
    ("llama-3-8b", [r"layers\.(30|31)\.", "lm_head"], 8, 4.89), ("gpt2", [r"ln_"], 8, 8.0),
])
def test_torch_figures_come_from_torchs_own_partition(preset_params, model, trainable, world_size, balance):
    """The planner's torch_zero column equals torch's real ZeroRedundancyOptimizer partition, rank by rank."""
    params = planner.select_trainable(preset_params[model], trainable)
    specs = [ParamSpec(p.numel, torch.float32, "cuda", p.trainable) for p in params]
    real = real_torch_zero_loads(specs, world_size)
    planned = planner.plan(params, world_size=world_size)["plans"]["torch_zero"]
    assert planned["trainable_elements_per_rank"] == real
    assert planned["balance"] == max_over_mean(real) == pytest.approx(balance, abs=0.05)  # DESIGN.md 5, rounded


def test_state_bytes_per_optimizer():
    w = planner.NamedParam("w", (6, 4), True)
    b = planner.NamedParam("b", (4,), True)
    frozen = planner.NamedParam("f", (100,), False)
    report = planner.plan([w, b, frozen], world_size=1, optimizer="adamw", shards=("flat",))
    assert report["unsharded"]["state_bytes"] == 2 * 28 * 4 + 2 * 4
    assert report["plans"]["hf_zero_flat"]["state_bytes_per_rank"] == [2 * 28 * 4 + 2 * 4]
    sgd = planner.plan([w, b], world_size=1, optimizer="sgd", dtype=torch.bfloat16, shards=("flat",),
                       master_weights=False)
    assert sgd["unsharded"]["state_bytes"] == 28 * 2
    sgd_masters = planner.plan([w, b], world_size=1, optimizer="sgd", dtype=torch.bfloat16, shards=("flat",))
    assert sgd_masters["unsharded"]["state_bytes"] == 28 * 4 + 28 * 4  # fp32 master + fp32 momentum
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
    assert report["schema"] == "hf_zero.plan/3"
    assert set(report) == {"schema", "model", "world_size", "optimizer", "backend", "per_rank_common",
                           "unsharded", "plans", "master_weights", "references", "ledger"}
    assert set(report["per_rank_common"]) == {"param_bytes", "grad_bytes", "scratch_bytes"}
    assert report["master_weights"] is False  # float32 params never have masters
    assert set(report["model"]) == {"name", "architecture", "params", "param_tensors", "trainable_params",
                                    "trainable_tensors", "module_buffers", "dtype"}
    assert report["model"]["architecture"] == "GPT2LMHeadModel"  # no architectures listed: a causal LM
    assert set(report["plans"]) == {"hf_zero_flat", "hf_zero_param", "torch_zero"}
    common = {"trainable_elements_per_rank", "state_bytes_per_rank", "max_state_bytes", "max_rank_bytes", "balance",
              "collectives_per_step", "sync_bytes_per_step", "bytes_per_param"}
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
    assert torch_plan["max_rank_bytes"] == (report["per_rank_common"]["param_bytes"]
                                            + report["per_rank_common"]["grad_bytes"] + torch_plan["max_state_bytes"])
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


def _bert_dir(tmp_path, **config):
    """A model folder whose config.json lists only ``architectures`` (no weights needed)."""
    from transformers import BertConfig

    path = tmp_path / "model"
    BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
               max_position_embeddings=32, **config).save_pretrained(path)
    return str(path)


def test_task_plans_a_head_the_config_does_not_list(tmp_path, capsys):
    # Like sentence-transformers/all-MiniLM-L6-v2: the config names only BertModel.
    model = _bert_dir(tmp_path, architectures=["BertModel"])
    base, _, base_class = planner.load_model_params(model)
    assert base_class == "BertModel" and not any(p.name.startswith("classifier") for p in base)

    argv = ["plan", "--model", model, "--world-size", "2", "--trainable", "classifier"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "no parameter name matches ['classifier'] in BertModel" in err
    assert "--task (one of base, causal-lm, masked-lm" in err and "sequence-classification" in err

    assert cli.main(argv + ["--task", "sequence-classification", "--num-labels", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["architecture"] == "BertForSequenceClassification"
    assert (report["model"]["trainable_params"], report["model"]["trainable_tensors"]) == (16 * 3 + 3, 2)
    # The head is the only addition (BertForSequenceClassification keeps the pooler).
    assert report["model"]["params"] == sum(p.numel for p in base) + 16 * 3 + 3
    assert sum(report["plans"]["hf_zero_flat"]["trainable_elements_per_rank"]) == 51

    tokens, _, cls = planner.load_model_params(model, task="token-classification", num_labels=7)
    assert cls == "BertForTokenClassification"
    assert {p.name: p.shape for p in tokens}["classifier.weight"] == (7, 16)


def test_auto_task_follows_the_configs_architectures(tmp_path):
    model = _bert_dir(tmp_path, architectures=["BertForTokenClassification"], num_labels=5)
    params, _, cls = planner.load_model_params(model)
    assert cls == "BertForTokenClassification"
    assert {p.name: p.shape for p in params}["classifier.weight"] == (5, 16)
    # A class this transformers lacks (remote code): the default rule, a causal LM or the bare model.
    other = _bert_dir(tmp_path / "x", architectures=["MyCustomBertModel"])
    assert planner.load_model_params(other)[2] == "BertLMHeadModel"
    assert planner.load_model_params("gpt2")[2] == "GPT2LMHeadModel"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--num-labels", "3"], "--num-labels applies only to --task sequence-classification or --task "
                                "token-classification (got --task auto)"),
        (["--task", "causal-lm", "--num-labels", "3"], "--num-labels applies only to"),
        (["--task", "sequence-classification", "--num-labels", "0"], "--num-labels must be >= 1, got 0"),
        (["--task", "seq2seq-lm"], "has no seq2seq-lm model for model_type 'gpt2' (--task seq2seq-lm); "
                                   "choose another of ['auto', 'base', 'causal-lm'"),
    ],
)
def test_bad_task_options_are_named(tmp_path, capsys, extra, message):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(model_type="gpt2", vocab_size=100, n_positions=16, n_embd=8, n_layer=1, n_head=2)))
    assert cli.main(["plan", "--model", str(config), "--world-size", "2", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-zero plan: error: ") and message in err, err
    with pytest.raises(ValueError, match=r"task: 'nope' is not a valid task; choose one of \['auto', 'base'"):
        planner.load_model_params(str(config), task="nope")
    with pytest.raises(SystemExit):  # argparse lists the choices
        cli.main(["plan", "--model", str(config), "--world-size", "2", "--task", "nope"])
    assert "invalid choice: 'nope' (choose from" in capsys.readouterr().err


def test_sync_collectives_per_backend():
    """As Comm.sync_buffer: NCCL one all-gather per equal-range buffer; gloo each nonempty
    range sent once to every other rank (3 messages per range at N = 4)."""
    params = [planner.NamedParam("w", (6, 4), True), planner.NamedParam("b", (4,), True)]
    for shard in ("flat", "param"):
        nccl = planner.plan(params, world_size=4, shards=(shard,), backend="nccl")["plans"][f"hf_zero_{shard}"]
        gloo = planner.plan(params, world_size=4, shards=(shard,), backend="gloo")["plans"][f"hf_zero_{shard}"]
        bounds = gloo["buffers"][0]["rank_bounds"]
        ranges = sum(1 for a, b in zip(bounds, bounds[1:]) if b > a)
        assert gloo["collectives_per_step"] == {"sync": 3 * ranges, "sync_kind": "send_recv", "control": 1}
        if shard == "flat":
            assert nccl["collectives_per_step"] == {"sync": 1, "sync_kind": "all_gather_into_tensor", "control": 1}
        else:  # whole params: unequal ranges, one broadcast per nonempty range
            assert nccl["collectives_per_step"] == {"sync": ranges, "sync_kind": "broadcast", "control": 1}


LLAMA_8B = 8_030_261_248
DOCS_PLANNER = Path(__file__).resolve().parent.parent / "docs" / "planner.md"


@pytest.mark.parametrize("dtype, masters, hf_zero_flat, torch_zero, paper, deepspeed, megatron", [
    # ZeRO paper stage 1 (2 + 2 + 12/N), DeepSpeed ZeRO-1 bf16 (4 + 16/N), Megatron bf16 fp32 grads (6 + 12/N)
    ("bfloat16", "auto", 5.5, 4.5, 5.5, 6.0, 7.5),
    ("bfloat16", "false", 4.5, 4.5, 5.5, 6.0, 7.5),
    ("float32", "auto", 9.0, 9.0, None, None, 9.0),
])
def test_llama_3_8b_bytes_per_param_at_8_ranks(capsys, dtype, masters, hf_zero_flat, torch_zero, paper, deepspeed,
                                              megatron):
    assert cli.main(["plan", "--model", "llama-3-8b", "--world-size", "8", "--dtype", dtype,
                     "--master-weights", masters, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["params"] == LLAMA_8B
    assert report["master_weights"] is (dtype == "bfloat16" and masters == "auto")
    flat = report["plans"]["hf_zero_flat"]
    # params + grads once + masters and state for 1/N + one 25 MiB bucket of scratch
    assert round(flat["bytes_per_param"], 2) == hf_zero_flat
    assert flat["bytes_per_param"] <= hf_zero_flat + 0.005
    assert report["per_rank_common"]["scratch_bytes"] == 25 * 2**20
    if report["master_weights"]:
        # fp32 master + two fp32 moments for 1/N of the elements, plus the float32 ``step`` per piece
        assert 12 * LLAMA_8B / 8 <= flat["max_state_bytes"] < 12 * LLAMA_8B / 8 + 2**20
    assert round(report["plans"]["torch_zero"]["bytes_per_param"], 2) == torch_zero
    for name, expected in (("zero_paper_stage1", paper), ("deepspeed_zero1", deepspeed),
                           ("megatron_distributed", megatron)):
        ref = report["references"][name]
        assert (ref is None) if expected is None else ref["bytes_per_param"] == pytest.approx(expected), name


def test_master_weights_option_is_named():
    w = planner.NamedParam("w", (4, 7), True)
    with pytest.raises(ValueError, match="master_weights"):
        planner.plan([w], world_size=2, master_weights="yes")


@pytest.mark.parametrize("dtype, accum, analytic, itemsize, docs_row", [
    # shards in the params' dtype ([Note: what stage 2 accumulates in])
    ("bfloat16", "auto", 2 + 14 / 8, 2, "| bfloat16 (masters), bf16 grad shards (the default) |"),
    ("bfloat16", "param", 2 + 14 / 8, 2, None),
    ("bfloat16", "fp32", 2 + 16 / 8, 4, "| bfloat16 (masters), `--grad-accum-dtype fp32` |"),
    ("float32", "auto", 4 + 12 / 8, 4, "| float32 |"),
])
def test_stage2_llama_3_8b_bytes_per_param_at_8_ranks(capsys, dtype, accum, analytic, itemsize, docs_row):
    assert cli.main(["plan", "--model", "llama-3-8b", "--world-size", "8", "--dtype", dtype, "--stage", "2",
                     "--grad-accum-dtype", accum, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    common = report["per_rank_common"]
    assert report["stage"] == 2 and common["grad_bytes"] == 0
    # NCCL keeps two buckets in flight and fills a third: the three largest are the embedding's and the head's
    # grads (128256 x 4096) and an MLP weight's (14336 x 4096), each above the 25 MiB cap, a bucket of its own
    # reduced in the grad's storage.
    assert common["reduce_bucket_bytes"] == (2 * 128256 + 14336) * 4096 * (2 if dtype == "bfloat16" else 4)
    assert common["scratch_bytes"] == 25 * 2**20
    flat = report["plans"]["hf_zero_flat"]
    # Every grad element is in exactly one rank's shard.
    assert sum(flat["grad_shard_bytes_per_rank"]) == LLAMA_8B * itemsize
    # params + the grad shard + masters and state for 1/N, + the reduce buckets and one bucket of scratch
    model_states = flat["max_rank_bytes"] - common["reduce_bucket_bytes"] - common["scratch_bytes"]
    assert analytic <= model_states / LLAMA_8B <= analytic + 0.001
    if docs_row is not None:  # docs/planner.md's stage 2 table: bytes/param (GiB per rank, ...)
        section = DOCS_PLANNER.read_text().split("### `--stage 2`")[1]
        row = next(line for line in section.splitlines() if line.startswith(docs_row))
        cell = row[len(docs_row):].split("|")[0]
        assert cell.strip().startswith(f"{flat['bytes_per_param']:.2f} ({flat['max_rank_bytes'] / 2**30:.2f} GiB"), row
    paper = report["references"]["zero_paper_stage2"]
    assert (paper is None) if dtype == "float32" else paper["bytes_per_param"] == pytest.approx(2 + 14 / 8)
    assert "stage" not in planner.plan([planner.NamedParam("w", (4, 7), True)], world_size=2)


# -- the planner against the ledger of a real run ------------------------------------------------------
def _tiny_run(rank, world, stage, dtype):
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zero import ZeroBucketOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(512, 64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64),
                          nn.Linear(64, 512)).to(dtype)
    if stage == 1:
        module = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=0.05)
        opt = ZeroBucketOptimizer(list(model.named_parameters()), torch.optim.AdamW, grad_reduce="reduce_scatter")
        opt.bind_ddp(module)
    else:
        module = model
        opt = ZeroBucketOptimizer(list(model.named_parameters()), torch.optim.AdamW, stage=2)
        opt.bind_module(model, bucket_cap_mb=0.05)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        ids = torch.randint(0, 512, (4, 8), generator=g)
        module(ids).float().logsumexp(-1).mean().backward()
        ledger = opt.memory_ledger()
        opt.step()
        opt.zero_grad()
    names = [n for n, _ in model.named_parameters()]
    return ledger.as_dict(), [(n, tuple(p.shape)) for n, p in zip(names, model.parameters())]


@pytest.mark.slow  # 2 gloo ranks per case
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_predicts_the_ledger_of_a_real_run_within_ten_percent(stage, dtype):
    """``hf-zero plan``'s ledger (model states: params, grads, shards, masters, state) against what a real
    2-rank run's ``memory_ledger()`` holds on its fullest rank, between a backward and the step."""
    from tests._dist import run_ranks

    out = run_ranks(_tiny_run, 2, stage, getattr(torch, dtype), timeout=120)
    measured = max(led["model_states"] for led, _ in out)
    params = [planner.NamedParam(n, shape, True) for n, shape in out[0][1]]
    report = planner.plan(params, world_size=2, dtype=getattr(torch, dtype), stage=stage, shards=("flat",),
                          backend="gloo", bucket_cap_mb=0.05)
    predicted = report["ledger"]["model_states"]
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)
    for c in ("params", "masters", "grad_shards"):  # not a matter of the bucket plan: equal
        assert report["ledger"][c] == max(led[c] for led, _ in out) or c == "grad_shards", c


def test_fits_says_which_option_fits_and_what_it_leaves_out():
    params = planner.load_model_params("gpt2")[0]
    gib = 2**30
    roomy = planner.fits(params, world_size=4, device_memory=80 * gib)
    assert roomy["choice"] == "hf_zero_stage1" and "not included" in roomy["note"]
    opts = roomy["options"]
    # stage 2 holds less than stage 1, FSDP2 full shard least; every option's bytes add up
    assert opts["hf_zero_stage2"]["bytes"] < opts["hf_zero_stage1"]["bytes"]
    assert opts["fsdp2_full_shard"]["bytes"] < opts["fsdp2_no_reshard"]["bytes"]
    for o in opts.values():
        assert o["bytes"] == o["model_states"] + o["transient"]
    tight = opts["hf_zero_stage2"]["bytes"] + 1
    f = planner.fits(params, world_size=4, device_memory=tight)
    assert f["choice"] == "hf_zero_stage2" and not f["options"]["hf_zero_stage1"]["fits"]
    acts = planner.fits(params, world_size=4, device_memory=tight, activations=gib)
    assert acts["choice"] == "fsdp2_full_shard" or acts["choice"] is None
    assert acts["options"]["hf_zero_stage2"]["bytes"] == tight - 1 + gib and "included" in acts["note"]
    none = planner.fits(params, world_size=4, device_memory=1)
    assert none["choice"] is None


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_table_and_fit_check_count_the_same_transients(preset_params, stage, dtype):
    """One model, one answer: the table's max rank and the fit check's option count the same reduce buckets
    and scratch (a param above the cap is a bucket of its own in both), and model states that differ by at most
    the layouts' padding."""
    for name, params in preset_params.items():
        report = planner.plan(params, world_size=8, dtype=planner.DTYPES[dtype], stage=stage, shards=("flat",))
        option = planner.fits(params, world_size=8, device_memory=2**40, dtype=planner.DTYPES[dtype])[
            "options"][f"hf_zero_stage{stage}"]
        common = report["per_rank_common"]
        assert option["transient"] == common["scratch_bytes"] + common.get("reduce_bucket_bytes", 0), name
        assert abs(report["plans"]["hf_zero_flat"]["max_rank_bytes"] - option["bytes"]) < 2**16, name


def test_device_memory_option_and_bad_sizes(capsys):
    assert cli.main(["plan", "--model", "gpt2", "--world-size", "4", "--device-memory", "1.5GiB"]) == 0
    out = capsys.readouterr().out
    assert "fits in 1.50 GiB per rank (activations not included" in out and "choice: hf_zero_stage1" in out
    for bad, what in ((["--device-memory", "lots"], "--device-memory: 'lots' is not a size"),
                      (["--activation-memory", "1GiB"], "--activation-memory: goes with --device-memory")):
        assert cli.main(["plan", "--model", "gpt2", "--world-size", "4", *bad]) == 2
        assert what in capsys.readouterr().err
    assert planner._parse_bytes("24GiB", "x") == 24 * 2**30 and planner._parse_bytes("80GB", "x") == 80 * 10**9
