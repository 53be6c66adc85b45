"""The consolidated state dict is a plain torch optimizer's, and resuming from it is exact.

Train SAVED steps on 2 ranks, consolidate, then continue RESUMED more steps from that
dict: in a plain optimizer, in ZeroBucketOptimizer on 3 ranks and on 1 (no process
group), also in the other shard mode. Every continuation must equal one uninterrupted
single-process run (whose global batch follows the world size of each phase), and the
loaded dict, consolidated again before any step, must equal the saved one.
"""

import copy
import functools
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests._dist import run_ranks
from tests.models import (
    Setup, assert_params_equal, assert_replicas_identical, assert_state_dict_equal, build_model, make_reference,
    make_zero, params_of, train_steps,
)

SAVED, RESUMED = 3, 3
SAVE_WS = 2

SAVES = {
    "adamw-flat": Setup(),
    "adamw-param": Setup(shard="param"),
    "sgd-momentum-no-view": Setup(optimizer="sgd", view=False),
    "adafactor": Setup(optimizer="adafactor", shard="param"),
    "two-groups": Setup(groups="decay"),
    # net.0 is frozen when the dict is saved and loaded, unfrozen after: its state must survive.
    "frozen-at-save": Setup(schedule=((2, ("net.0.",)), (SAVED + 1, ()))),
}

# (saved configuration, shard mode to resume in, source of the dict)
RESUMES = {
    "adamw-flat": ("adamw-flat", "flat", "hf_zero"),
    "adamw-param": ("adamw-param", "param", "hf_zero"),
    "sgd-momentum-no-view": ("sgd-momentum-no-view", "flat", "hf_zero"),
    "adafactor": ("adafactor", "param", "hf_zero"),
    "two-groups": ("two-groups", "flat", "hf_zero"),
    "frozen-at-save": ("frozen-at-save", "flat", "hf_zero"),
    "flat-into-param": ("adamw-flat", "param", "hf_zero"),
    "param-into-flat": ("adamw-param", "flat", "hf_zero"),
    "plain-torch-dict": ("adamw-flat", "flat", "reference"),
}


def _save(rank, world_size, setup: Setup):
    model = build_model(setup.model)
    setup.apply_schedule(model, 0)
    opt = make_zero(setup, model)
    empty = opt.state_dict()  # before any step: not a collective, and nothing to gather
    ddp = DDP(model, find_unused_parameters=True)
    train_steps(setup, model, opt, range(SAVED), world_size=world_size, rank=rank, forward=ddp)
    try:  # sharded state must not be readable as if it were the full state
        dict(opt.state_dict()["state"])
        unconsolidated_error = None
    except RuntimeError as e:
        unconsolidated_error = str(e)
    opt.consolidate_state_dict(to=world_size - 1)
    return {
        "params": params_of(model),
        "state_dict": copy.deepcopy(opt.state_dict()) if rank == world_size - 1 else None,
        "empty_state": empty["state"],
        "unconsolidated_error": unconsolidated_error,
    }


def _save_all(rank, world_size):
    return {name: _save(rank, world_size, setup) for name, setup in SAVES.items()}


@functools.cache
def _saved():
    per_rank = run_ranks(_save_all, SAVE_WS, timeout=200)
    return {name: (per_rank[0][name]["params"], per_rank[-1][name]["state_dict"]) for name in SAVES}, per_rank


def _restore(setup: Setup, params: list):
    """A fresh model holding ``params``, with the schedule's state at step SAVED."""
    model = build_model(setup.model)
    with torch.no_grad():
        for p, saved in zip(model.parameters(), params):
            p.copy_(saved)
    for step in range(SAVED):
        setup.apply_schedule(model, step)
    return model


def _resume(rank, world_size, setup: Setup, params, state_dict):
    model = _restore(setup, params)
    opt = make_zero(setup, model)
    opt.load_state_dict(state_dict)
    opt.consolidate_state_dict(to=0)  # before any step: the loaded state, split over ranks, gathered back
    reloaded = copy.deepcopy(opt.state_dict()) if rank == 0 else None
    forward = DDP(model, find_unused_parameters=True) if dist.is_initialized() else model
    train_steps(setup, model, opt, range(SAVED, SAVED + RESUMED), world_size=world_size, rank=rank, forward=forward)
    opt.consolidate_state_dict(to=0)
    return {"params": params_of(model), "reloaded": reloaded, "state_dict": opt.state_dict() if rank == 0 else None}


def _resume_all(rank, world_size, jobs):
    return {name: _resume(rank, world_size, *job) for name, job in jobs.items()}


@functools.cache
def _uninterrupted(name: str, resume_ws: int):
    """Plain optimizer: SAVED steps on SAVE_WS ranks' data, then RESUMED on resume_ws ranks' data."""
    setup = SAVES[name]
    model = build_model(setup.model)
    setup.apply_schedule(model, 0)
    opt = make_reference(setup, model)
    train_steps(setup, model, opt, range(SAVED), world_size=SAVE_WS)
    at_save = copy.deepcopy(opt.state_dict())
    train_steps(setup, model, opt, range(SAVED, SAVED + RESUMED), world_size=resume_ws)
    return at_save, params_of(model), opt.state_dict()


def _jobs():
    saved, _ = _saved()
    jobs = {}
    for name, (saved_name, shard, source) in RESUMES.items():
        params, state_dict = saved[saved_name]
        if source == "reference":
            state_dict = _uninterrupted(saved_name, 1)[0]
        jobs[name] = (replace(SAVES[saved_name], shard=shard), params, state_dict)
    return jobs


@functools.cache
def _resumed(world_size):
    if world_size == 1:
        assert not dist.is_initialized(), "world size 1 runs in this process, without a process group"
        return [_resume_all(0, 1, _jobs())]
    return run_ranks(_resume_all, world_size, _jobs(), timeout=200)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", SAVES)
def test_saved_dict_is_the_plain_optimizers(name):
    saved, per_rank = _saved()
    at_save, _, _ = _uninterrupted(name, SAVE_WS)
    assert_state_dict_equal(saved[name][1], at_save)
    assert_replicas_identical([r[name]["params"] for r in per_rank])
    for r in per_rank:
        assert r[name]["empty_state"] == {}
        assert "consolidate_state_dict" in r[name]["unconsolidated_error"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", SAVES)
def test_plain_optimizer_continues_from_saved_dict(name):
    setup = SAVES[name]
    params, state_dict = _saved()[0][name]
    model = _restore(setup, params)
    opt = make_reference(setup, model)
    opt.load_state_dict(copy.deepcopy(state_dict))  # torch's load keeps the dict's tensors
    train_steps(setup, model, opt, range(SAVED, SAVED + RESUMED), world_size=SAVE_WS)
    _, want_params, want_state = _uninterrupted(name, SAVE_WS)
    assert_params_equal(params_of(model), want_params)
    assert_state_dict_equal(opt.state_dict(), want_state)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [3, 1])
@pytest.mark.parametrize("name", RESUMES)
def test_resume_on_another_world_size(name, world_size):
    per_rank = [r[name] for r in _resumed(world_size)]
    at_save, want_params, want_state = _uninterrupted(RESUMES[name][0], world_size)
    assert_state_dict_equal(per_rank[0]["reloaded"], at_save)
    assert_replicas_identical([r["params"] for r in per_rank])
    assert_params_equal(per_rank[0]["params"], want_params)
    assert_state_dict_equal(per_rank[0]["state_dict"], want_state)


def test_load_rejects_a_dict_of_another_shape():
    model = build_model("mlp")
    opt = make_zero(Setup(), model)
    plain = make_reference(Setup(groups="decay"), model)
    with pytest.raises(ValueError, match="param groups"):
        opt.load_state_dict(plain.state_dict())
