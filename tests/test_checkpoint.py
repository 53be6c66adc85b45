"""Checkpoints: state_dict / load_state_dict, sharded save / load, atomic writes.

One training run per optimizer (AdamW, SGD with momentum, Adafactor) is split into
stages on world sizes 1 -> 2 -> 3 -> 1, each stage with another shard mode and
bucket-view setting, each loading the previous stage's sharded checkpoint, with
params frozen and unfrozen between and across stages. After every load the
consolidated state equals the one saved; at every stage params and state equal a
single-process run of the plain optimizer (float64, bitwise: the math is elementwise).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn as nn

from hf_zero import ZeroBucketOptimizer
from hf_zero import _offline, _sharded as ckpt
from tests._dist import run_ranks
from tests.models import (
    CheckpointNet,
    assert_param_dicts_equal,
    assert_state_dicts_equal,
    checkpoint_optimizer_class,
    checkpoint_schedule,
    checkpoint_train,
    checkpoint_zero,
    consolidated_copy,
    param_copy,
)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# (world size, shard, parameters_as_bucket_view) of each stage, per optimizer
STAGES = {
    "adamw": [(1, "flat", True), (2, "param", False), (3, "flat", False), (1, "param", True)],
    "sgd": [(1, "param", False), (2, "flat", True), (3, "param", True), (1, "flat", False)],
    "adafactor": [(1, "param", True), (2, "param", False), (3, "param", True), (1, "param", False)],
}
STEPS = [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]


def _stage(rank, world_size, stage, directory, params, previous):
    """Load the previous stage's checkpoint (and, separately, its full state dict), train, save."""
    from hf_zero import _state as state

    saved_round, state._ROUND_BYTES = state._ROUND_BYTES, 40  # 5 float64s a round: transfers split, blobs alone
    try:
        return _stage_kinds(stage, directory, params, previous)
    finally:
        state._ROUND_BYTES = saved_round


def _stage_kinds(stage, directory, params, previous):
    out = {}
    for kind, configs in STAGES.items():
        _, shard, view = configs[stage]
        steps = STEPS[stage]
        model = CheckpointNet()
        model.load_state_dict(params[kind])
        opt = checkpoint_zero(model, kind, shard, view)
        checkpoint_schedule(model, steps.start)  # load into the trainable set of the next step
        loaded = loaded_full = None
        kept = 0
        if stage > 0:
            opt.load_sharded(os.path.join(directory, f"{kind}-{stage - 1}"))
            loaded = consolidated_copy(opt)
            other = checkpoint_zero(CheckpointNet(), kind, shard, view)
            other.load_state_dict(previous[kind])  # a CPU dict: each rank copies only its pieces
            kept = _state_elements({i: [h.state for h in hs] for i, hs in other._lifecycle.parked.items()})
            loaded_full = consolidated_copy(other)
        checkpoint_train(model, opt, steps)
        opt.save_sharded(os.path.join(directory, f"{kind}-{stage}"))
        out[kind] = {
            "loaded": loaded, "loaded_full": loaded_full, "kept": kept, "saved": consolidated_copy(opt), "params": param_copy(model)
        }
    return out


def _state_elements(state: dict) -> int:
    """Elements of the non-scalar state tensors in ``{index: [state dict, ...]}``."""
    return sum(
        v.numel() for sts in state.values() for st in sts for v in st.values() if isinstance(v, torch.Tensor) and v.dim()
    )


def _reference(kind) -> list[tuple[dict, dict]]:
    """(params, state_dict) of the plain optimizer after each stage."""
    model = CheckpointNet()
    cls, kw = checkpoint_optimizer_class(kind)
    opt = cls(model.named_parameters(), **kw)
    out = []
    for steps in STEPS:
        checkpoint_train(model, opt, steps)
        out.append((param_copy(model), copy.deepcopy(opt.state_dict())))
    return out


@pytest.mark.timeout(150)
def test_round_trips_across_world_sizes_modes_views_and_trainability(tmp_path):
    refs = {kind: _reference(kind) for kind in STAGES}
    params = {kind: param_copy(CheckpointNet()) for kind in STAGES}
    previous = None
    for stage in range(len(STEPS)):
        world_size = STAGES["adamw"][stage][0]
        if world_size == 1:
            results = [_stage(0, 1, stage, str(tmp_path), params, previous)]
        else:
            results = run_ranks(_stage, world_size, stage, str(tmp_path), params, previous, timeout=120)
        got = results[0]
        for kind in STAGES:
            r = got[kind]
            if stage > 0:
                assert_state_dicts_equal(r["loaded"], previous[kind])  # nothing lost, exactly
                assert_state_dicts_equal(r["loaded_full"], previous[kind])
                full = _state_elements({i: [st] for i, st in previous[kind]["state"].items()})
                assert sum(other[kind]["kept"] for other in results) == full  # no rank copied another's
            ref_params, ref_state = refs[kind][stage]
            assert_state_dicts_equal(r["saved"], ref_state)  # the math is elementwise: bitwise equal
            assert_param_dicts_equal(r["params"], ref_params)
            for other in results[1:]:  # replicas agree
                for k, v in r["params"].items():
                    assert torch.equal(other[kind]["params"][k], v)
        previous = {kind: got[kind]["saved"] for kind in STAGES}
        params = {kind: got[kind]["params"] for kind in STAGES}
    # every file written loads without pickles
    from safetensors.torch import load_file

    for entry in sorted(os.listdir(tmp_path)):
        for name in os.listdir(tmp_path / entry):
            path = tmp_path / entry / name
            if name.endswith(".safetensors"):
                assert load_file(path)
            else:
                assert name == ckpt.COMMIT_FILE
                json.loads(path.read_text())


# -- Accelerate's init round trip ----------------------------------------------------------
def _accelerate_round_trip(rank, world_size):
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=True)
    model = CheckpointNet()
    opt = checkpoint_zero(model, "adamw", "flat", True)
    AcceleratedOptimizer(opt)  # step 0: no state anywhere
    checkpoint_train(model, opt, range(0, 2))
    before = consolidated_copy(opt)
    wrapped = AcceleratedOptimizer(opt)  # mid-training, nothing consolidated
    after = consolidated_copy(opt)
    checkpoint_train(model, wrapped, range(2, 4))

    sharded = opt.state_dict()
    errors = []
    for attempt in (lambda: torch.save(sharded, os.devnull), lambda: sharded["state"][0], lambda: len(sharded["state"])):
        try:
            attempt()
        except RuntimeError as e:
            errors.append(str(e))
    checkpoint_train(model, opt, range(4, 5))
    try:
        opt.load_state_dict(sharded)  # taken before the last step: stale
    except ValueError as e:
        errors.append(str(e))
    opt.consolidate_state_dict(to=1)
    if rank == 1:  # as Trainer does on its main rank: no collective inside
        assert len(opt.state_dict()["state"]) == 5
    checkpoint_train(model, opt, range(5, 6))
    final = consolidated_copy(opt)
    return before, after, errors, final, param_copy(model)


@pytest.mark.reliability("Accelerate prepare() mid-training: state_dict()/load_state_dict() on every rank, nothing consolidated", "state kept; training continues bitwise equal to the reference")
@pytest.mark.timeout(90)
def test_accelerate_init_round_trip_at_step_0_and_mid_training():
    results = run_ranks(_accelerate_round_trip, 2, timeout=80)
    before, after, errors, final, params = results[0]
    assert_state_dicts_equal(after, before)
    assert len(errors) == 4 and all("consolidate_state_dict" in e for e in errors), errors
    model = CheckpointNet()
    cls, kw = checkpoint_optimizer_class("adamw")
    ref = cls(model.named_parameters(), **kw)
    checkpoint_train(model, ref, range(0, 6))
    assert_state_dicts_equal(final, ref.state_dict())
    assert_param_dicts_equal(params, param_copy(model))
    for _, _, errs, _, p in results[1:]:
        assert len(errs) == 4
        for k, v in p.items():
            assert torch.equal(v, params[k])


# -- single process ------------------------------------------------------------------------
def _trained(kind="adamw", steps=range(0, 2), **kw):
    model = CheckpointNet()
    opt = checkpoint_zero(model, kind, kw.get("shard", "auto"), kw.get("view", True))
    checkpoint_train(model, opt, steps)
    return model, opt


def test_state_dict_is_never_a_collective_and_complete_on_one_rank():
    model, opt = _trained()
    sd = opt.state_dict()
    assert isinstance(sd["state"], dict) and len(sd["state"]) == 5
    fresh = checkpoint_zero(CheckpointNet(), "adamw", "flat", True)
    assert fresh.state_dict()["state"] == {}


@pytest.mark.reliability("Load a state dict or sharded checkpoint of another model or optimizer class", "`ValueError` listing every mismatch; optimizer unchanged")
def test_load_state_dict_of_another_model_or_optimizer_raises_and_changes_nothing(tmp_path):
    model, opt = _trained()
    sd = opt.state_dict()
    before = opt.state_dict()

    class Other(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(5, 6)
            self.c = nn.Linear(6, 3)
            self.scale = nn.Parameter(torch.ones(1, 3))
            self.double()

    other_model = Other()
    other = ZeroBucketOptimizer(other_model.named_parameters(), torch.optim.AdamW, lr=1e-2)
    other_before = other.state_dict()
    with pytest.raises(ValueError) as e:
        other.load_state_dict(sd)
    msg = str(e.value)
    assert "nothing was loaded" in msg and "'b.weight'" in msg and "'c.weight'" in msg and "shape" in msg
    assert other.state_dict() == other_before

    sgd = ZeroBucketOptimizer(CheckpointNet().named_parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="another optimizer class"):
        sgd.load_state_dict(sd)

    opt.save_sharded(tmp_path / "ck")
    with pytest.raises(ValueError) as e:
        other.load_sharded(tmp_path / "ck")
    msg = str(e.value)
    assert "b.weight (shape (3, 7)) is not in this optimizer" in msg
    assert "c.weight (group 0, shape (3, 6)) is not in the checkpoint" in msg
    assert "a.weight (group 0, shape (6, 5)): shape (7, 5) in the checkpoint" in msg
    with pytest.raises(ValueError, match="optimizer class: the checkpoint has torch.optim.adamw.AdamW"):
        sgd.load_sharded(tmp_path / "ck")
    assert other.state_dict() == other_before
    # a failed load left the trained optimizer's state as it was
    with pytest.raises(ValueError):
        opt.load_state_dict({"state": sd["state"], "param_groups": sd["param_groups"][:0]})
    assert_state_dicts_equal(opt.state_dict(), before)


@pytest.mark.fast  # the fast subset's checkpoint test: a sharded save / load round trip
def test_unnamed_params_match_by_position_and_shape(tmp_path):
    model, opt = _trained()
    opt.save_sharded(tmp_path / "ck")
    plain = ZeroBucketOptimizer(list(CheckpointNet().parameters()), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    plain.load_sharded(tmp_path / "ck")  # checkpoint has names, this optimizer none: by index
    assert_state_dicts_equal(plain.state_dict(), opt.state_dict())
    swapped = nn.ParameterList([nn.Parameter(torch.zeros(7, 5, dtype=torch.float64)) for _ in range(5)])
    bad = ZeroBucketOptimizer(list(swapped), torch.optim.AdamW, lr=1e-2)
    with pytest.raises(ValueError, match=r"#2 .*shape \(7,\) in the checkpoint"):
        bad.load_sharded(tmp_path / "ck")


def test_named_params_key_checkpoints_by_model_names(tmp_path):
    model = CheckpointNet()
    opt = ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW, lr=1e-2)
    checkpoint_train(model, opt, range(2))
    opt.save_sharded(tmp_path / "ck")
    record = json.loads((tmp_path / "ck" / ckpt.COMMIT_FILE).read_text())
    assert [p["name"] for p in record["params"]] == [n for n, _ in model.named_parameters()]


def test_loaded_step_stays_where_fused_adamw_needs_it_and_cpu_dicts_load():
    model, opt = _trained()
    sd = opt.state_dict()
    fused = ZeroBucketOptimizer(CheckpointNet().named_parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1, fused=True)
    sd_fused = {"state": sd["state"], "param_groups": [dict(g, fused=True) for g in sd["param_groups"]]}
    fused.load_state_dict(sd_fused)
    for hs in fused._lifecycle.parked.values():
        for h in hs:
            assert h.state["step"].dtype == torch.float32 and h.state["step"].device == h.state["exp_avg"].device
    m2 = CheckpointNet()
    m2.load_state_dict(model.state_dict())
    fused2 = ZeroBucketOptimizer(m2.named_parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1, fused=True)
    fused2.load_state_dict(sd_fused)
    checkpoint_train(m2, fused2, range(2, 3))
    checkpoint_train(model, opt, range(2, 3))
    for k, v in param_copy(model).items():  # fused kernels round differently
        torch.testing.assert_close(param_copy(m2)[k], v, rtol=1e-12, atol=1e-14)


def test_consolidated_state_dict_saves_and_loads_weights_only(tmp_path):
    model, opt = _trained("adafactor", shard="param")
    path = tmp_path / "opt.pt"
    _offline.save_state_dict(opt.state_dict(), path)
    assert_state_dicts_equal(torch.load(path, weights_only=True), opt.state_dict())


def test_inspect_and_offline_consolidate_of_a_missing_checkpoint_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="no sharded optimizer checkpoint"):
        _offline.consolidate_checkpoint(tmp_path)
    model, opt = _trained()
    opt.save_sharded(tmp_path)
    record = json.loads((tmp_path / ckpt.COMMIT_FILE).read_text())
    shard = tmp_path / record["files"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-8])  # truncated after the commit: never loads silently
    with pytest.raises(ValueError, match="commit record says"):
        opt.load_sharded(tmp_path)


# -- interrupted saves ----------------------------------------------------------------
_KILLER = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {root!r})
    import safetensors.torch
    from hf_zero import _sharded as checkpoint
    from tests.models import CheckpointNet, checkpoint_train, checkpoint_zero

    where = sys.argv[1]
    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    real_save, real_replace, real_remove = safetensors.torch.save_file, os.replace, checkpoint._remove_stale
    def save_file(tensors, path, metadata=None):
        real_save(tensors, path, metadata=metadata)
        if where == "shard":
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
            die()
    def replace(src, dst):
        if where == "commit" and dst.endswith(checkpoint.COMMIT_FILE):
            die()
        real_replace(src, dst)
    def remove_stale(path, token):
        if where == "cleanup":
            die()
        real_remove(path, token)
    safetensors.torch.save_file = save_file
    checkpoint.os.replace = replace
    checkpoint._remove_stale = remove_stale

    model = CheckpointNet()
    opt = checkpoint_zero(model, "adamw", "flat", True)
    checkpoint_train(model, opt, range(0, 4))
    opt.save_sharded(sys.argv[2])
    """
)


@pytest.mark.reliability("Checkpoint save SIGKILLed mid-shard, before and after the commit record; a shard truncated after commit", "the previous (or the committed) checkpoint loads exactly; the truncated one is refused")
@pytest.mark.timeout(120)
def test_save_killed_mid_write_leaves_previous_checkpoint_loadable(tmp_path):
    model, opt = _trained(steps=range(0, 2))
    directory = tmp_path / "ck"
    opt.save_sharded(directory)
    old = opt.state_dict()
    model4, opt4 = _trained(steps=range(0, 4))
    new = opt4.state_dict()
    script = tmp_path / "killer.py"
    script.write_text(_KILLER.format(root=_ROOT))
    for where, expected in (("shard", old), ("commit", old), ("cleanup", new)):
        proc = subprocess.run([sys.executable, str(script), where, str(directory)], timeout=100, capture_output=True)
        assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
        fresh = checkpoint_zero(CheckpointNet(), "adamw", "param", False)
        fresh.load_sharded(directory)
        assert_state_dicts_equal(fresh.state_dict(), expected)
    opt.save_sharded(directory)  # a later save commits and clears the debris
    assert sorted(os.listdir(directory)) == sorted(
        [ckpt.COMMIT_FILE] + [f["file"] for f in json.loads((directory / ckpt.COMMIT_FILE).read_text())["files"]]
    )


def _killed_mid_shard(tmp_path, directory) -> list:
    """Run a save into ``directory`` that is SIGKILLed mid-shard; returns the temporaries it left."""
    script = tmp_path / "killer.py"
    script.write_text(_KILLER.format(root=_ROOT))
    proc = subprocess.run([sys.executable, str(script), "shard", str(directory)], timeout=100, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    left = [n for n in os.listdir(directory) if n.startswith(".shard-") and ".tmp-" in n]
    assert len(left) == 1 and os.path.getsize(directory / left[0]) > 0  # what the killed save leaves
    os.utime(directory / left[0], (time.time() - 2 * ckpt._IDLE_S,) * 2)  # the run restarted since
    return left


def _others(directory) -> dict:
    """Files of names close to a save's temporaries that are not stale ones of this hf_zero's (another
    program's; a save's temporary being written now, as by another program saving there meanwhile),
    all idle but the last."""
    names = {"foreign": ".shard-notes.txt.tmp-1-ab", "near": ".shard-abc-rank00000-of-00002.safetensors.tmp-x",
             "user": "mine.tmp-12-ab", "under way": ".shard-0123abcd-rank00001-of-00002.safetensors.tmp-77-abcdef"}
    for what, name in names.items():
        (directory / name).write_bytes(b"x")
        if what != "under way":
            os.utime(directory / name, (time.time() - 2 * ckpt._IDLE_S,) * 2)
    return names


@pytest.mark.reliability("A save SIGKILLed mid-shard leaves its temporary; the next load of that checkpoint, and the "
                         "next save in another checkpoint of the run, remove it",
                         "only that file goes: another program's files and a newer save's temporary stay")
@pytest.mark.timeout(120)
def test_the_next_load_or_save_in_the_tree_removes_a_killed_saves_temporary(tmp_path):
    model, opt = _trained(steps=range(0, 2))
    loaded = tmp_path / "loaded" / "hf_zero_optimizer"
    opt.save_sharded(loaded)  # committed; then a later save into it is killed
    left = _killed_mid_shard(tmp_path, loaded)
    others = _others(loaded)
    fresh = checkpoint_zero(CheckpointNet(), "adamw", "param", False)
    fresh.load_sharded(loaded)
    assert_state_dicts_equal(fresh.state_dict(), opt.state_dict())  # the committed checkpoint, loaded
    assert not any((loaded / n).exists() for n in left)
    assert all((loaded / n).exists() for n in others.values())

    run = tmp_path / "run"
    killed = run / "checkpoint-2" / "hf_zero_optimizer"
    left = _killed_mid_shard(tmp_path, killed)  # the run's save at step 2, killed: no commit there
    others = _others(killed)
    elsewhere = tmp_path / "elsewhere" / "hf_zero_optimizer"  # not a checkpoint of the run
    left_elsewhere = _killed_mid_shard(tmp_path, elsewhere)
    opt.save_sharded(run / "checkpoint-4" / "hf_zero_optimizer")  # the resumed run's next save
    assert not any((killed / n).exists() for n in left)
    assert all((killed / n).exists() for n in others.values())
    assert all((elsewhere / n).exists() for n in left_elsewhere)


# -- a plain optimizer.pt streamed from the sharded files -------------------------------------------
@pytest.mark.reliability("A sharded checkpoint (AdamW, SGD, Adafactor, bf16 with fp32 masters) streamed into a plain "
                         "optimizer.pt in 24-byte pieces, also through `hf-zero consolidate CHECKPOINT_DIR OUT.pt`",
                         "torch.load(weights_only=True) equals the consolidated state dict key for key and loads "
                         "into the plain torch optimizer")
def test_plain_optimizer_file_streamed_from_shards_equals_the_consolidated_dict(tmp_path):
    from hf_zero.cli import main

    for kind, shard in (("adamw", "flat"), ("sgd", "flat"), ("adafactor", "param")):
        model, opt = _trained(kind, steps=range(0, 3), shard=shard)
        directory = tmp_path / kind / "hf_zero_optimizer"
        opt.save_sharded(directory)
        _offline.write_plain_optimizer(directory, tmp_path / f"{kind}.pt", chunk_bytes=24)
        got = torch.load(tmp_path / f"{kind}.pt", weights_only=True)
        assert_state_dicts_equal(got, opt.state_dict())
        assert_state_dicts_equal(got, _offline.consolidate_checkpoint(directory))
        cls, kw = checkpoint_optimizer_class(kind)
        cls(CheckpointNet().named_parameters(), **kw).load_state_dict(got)
        assert main(["consolidate", str(tmp_path / kind), str(tmp_path / f"{kind}-cli.pt")]) == 0  # the parent dir
        assert_state_dicts_equal(torch.load(tmp_path / f"{kind}-cli.pt", weights_only=True), got)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3)).to(torch.bfloat16)
    opt = ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW, lr=1e-2)
    model(torch.randn(2, 5, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    opt.save_sharded(tmp_path / "bf16")
    _offline.write_plain_optimizer(tmp_path / "bf16", tmp_path / "bf16.pt", chunk_bytes=10)
    got = torch.load(tmp_path / "bf16.pt", weights_only=True)
    assert got["state"][0]["master_param"].dtype == torch.float32
    assert_state_dicts_equal(got, opt.state_dict())
