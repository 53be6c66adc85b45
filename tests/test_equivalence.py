"""ZeroBucketOptimizer over DDP equals the plain optimizer on the global batch.

Each configuration trains on 2 and 3 gloo ranks, different data per rank, and is
compared with a single-process run of the same torch optimizer: final params, and
the consolidated state dict against ``opt.state_dict()``. Replicas must be bitwise
identical. One spawn per world size runs the whole table (spawning is the slow part).
"""

import functools

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests._dist import run_ranks
from tests.models import (
    ELEMENTWISE, Setup, allowed_error, assert_params_equal, assert_replicas_identical, assert_state_dict_equal,
    build_model, make_zero, params_of, reference_run, train_steps,
)

STEPS = 6

SETUPS = {
    "adamw-flat": Setup(),
    "adamw-flat-no-view": Setup(view=False),
    "adamw-param": Setup(shard="param"),
    "adamw-param-no-view": Setup(shard="param", view=False),
    "sgd-momentum": Setup(optimizer="sgd"),
    "sgd-momentum-no-view": Setup(optimizer="sgd", view=False),
    "adafactor-param": Setup(optimizer="adafactor", shard="param"),
    "adafactor-param-no-view": Setup(optimizer="adafactor", shard="param", view=False),
    "two-groups": Setup(groups="decay"),
    "two-groups-param": Setup(groups="decay", shard="param"),
    "named-params": Setup(groups="named"),
    "tied": Setup(model="tied"),
    "tied-param-no-view": Setup(model="tied", shard="param", view=False),
    "fp32-and-bf16": Setup(model="mixed"),
    "fp32-and-bf16-param-no-view": Setup(model="mixed", shard="param", view=False),
    "lr-changed-between-steps": Setup(groups="decay", lr_decay=0.5),
    "lr-changed-between-steps-param": Setup(optimizer="adafactor", shard="param", lr_decay=0.5),
    "ranks-owning-nothing": Setup(model="tiny"),
    "ranks-owning-nothing-param": Setup(model="tiny", shard="param"),
}

# Every elementwise torch optimizer, each shard mode, through a frozen period.
EVERY_ELEMENTWISE = {
    f"{opt}-{shard}-frozen-period": Setup(optimizer=opt, shard=shard, schedule=((2, ("net.0.",)), (4, ())))
    for opt in ELEMENTWISE
    for shard in ("flat", "param")
}

# Params moved or replaced behind the optimizer's back (docs/architecture.md, field facts: accelerate.prepare, model.to).
DISTURBED = {
    "to-float64-after-construction": (Setup(), "to_float64"),
    "data-replaced-after-step-2": (Setup(), "replace_data"),
    "data-replaced-after-step-2-param-no-view": (Setup(shard="param", view=False), "replace_data"),
}


def _shares_one_storage(model) -> bool:
    """Every trainable param of a dtype lives in the same storage (a bucket view)."""
    storages = {}
    for p in model.parameters():
        if p.requires_grad:
            storages.setdefault(p.dtype, set()).add(p.untyped_storage().data_ptr())
    return all(len(s) == 1 for s in storages.values())


def _train(rank, world_size, setup: Setup, disturb: str = ""):
    model = build_model(setup.model, torch.float32 if disturb == "to_float64" else torch.float64)
    opt = make_zero(setup, model)
    if disturb == "to_float64":
        model.to(torch.float64)
    ddp = DDP(model, find_unused_parameters=True) if dist.is_initialized() else model
    train_steps(setup, model, opt, range(2), world_size=world_size, rank=rank, forward=ddp)
    if disturb == "replace_data":
        p = model.net[2].weight
        p.data = p.data.clone()
    train_steps(setup, model, opt, range(2, STEPS), world_size=world_size, rank=rank, forward=ddp)
    grads_cleared = all(p.grad is None for p in model.parameters())
    opt.consolidate_state_dict(to=0)
    return {
        "params": params_of(model),
        "state_dict": opt.state_dict() if rank == 0 else None,
        "grads_cleared": grads_cleared,
        "views": _shares_one_storage(model),
    }


SUBGROUP_SETUPS = {
    "subgroup-flat": Setup(schedule=((0, ("net.2.",)), (2, ()), (4, ("net.0.",)))),
    "subgroup-param-no-view": Setup(shard="param", view=False, schedule=((2, ("net.0.",)), (4, ()))),
}


def _train_in_subgroup(rank, world_size, setup: Setup):
    """Global ranks 1 and 2 train over a process group of their own (group rank = global - 1)."""
    group = dist.new_group([1, 2])  # every rank must take part in creating it
    if rank == 0:
        return None
    model = build_model(setup.model)
    setup.apply_schedule(model, 0)
    opt = make_zero(setup, model, process_group=group)
    ddp = DDP(model, find_unused_parameters=True, process_group=group)
    train_steps(setup, model, opt, range(STEPS), world_size=2, rank=rank - 1, forward=ddp)
    opt.consolidate_state_dict(to=1)
    return {"params": params_of(model), "state_dict": opt.state_dict() if rank == 2 else None}


def _train_all(rank, world_size):
    assert not set(SETUPS) & set(DISTURBED) and not set(SETUPS) & set(EVERY_ELEMENTWISE)
    out = {name: _train(rank, world_size, setup) for name, setup in SETUPS.items()}
    out.update({name: _train(rank, world_size, setup, how) for name, (setup, how) in DISTURBED.items()})
    out.update({name: _train(rank, world_size, setup) for name, setup in EVERY_ELEMENTWISE.items()})
    if world_size == 3:
        out.update({name: _train_in_subgroup(rank, world_size, setup) for name, setup in SUBGROUP_SETUPS.items()})
    return out


@functools.cache
def _results(world_size):
    return run_ranks(_train_all, world_size, timeout=200)


def _check(per_rank, setup, world_size):
    ref_params, ref_state = reference_run(setup, world_size, STEPS)
    assert_replicas_identical([r["params"] for r in per_rank])
    assert_params_equal(per_rank[0]["params"], ref_params)
    assert_state_dict_equal(per_rank[0]["state_dict"], ref_state)
    assert all(r["grads_cleared"] for r in per_rank), "zero_grad(set_to_none=True) left a grad"
    assert all(r["views"] == setup.view for r in per_rank), "bucket views not as configured"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", SETUPS)
def test_matches_reference(name, world_size):
    _check([r[name] for r in _results(world_size)], SETUPS[name], world_size)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", EVERY_ELEMENTWISE)
def test_every_elementwise_optimizer(name, world_size):
    _check([r[name] for r in _results(world_size)], EVERY_ELEMENTWISE[name], world_size)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", DISTURBED)
def test_params_moved_behind_its_back(name, world_size):
    _check([r[name] for r in _results(world_size)], DISTURBED[name][0], world_size)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", SUBGROUP_SETUPS)
def test_process_group_of_some_ranks(name):
    per_rank = [r[name] for r in _results(3)]
    ref_params, ref_state = reference_run(SUBGROUP_SETUPS[name], 2, STEPS)
    assert per_rank[0] is None
    assert_replicas_identical([r["params"] for r in per_rank[1:]])
    assert_params_equal(per_rank[1]["params"], ref_params)
    assert_state_dict_equal(per_rank[2]["state_dict"], ref_state)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["adamw-flat", "adamw-param-no-view", "adafactor-param", "fp32-and-bf16"])
def test_without_process_group_is_a_plain_optimizer(name):
    assert not dist.is_initialized(), "this test needs a process without a process group"
    _check([_train(0, 1, SETUPS[name])], SETUPS[name], 1)


@pytest.mark.timeout(60)
def test_bf16_comparison_is_meaningful():
    """Training moves every bf16 param far beyond the error the comparison allows."""
    setup = SETUPS["fp32-and-bf16"]
    start = params_of(build_model(setup.model))
    end, _ = reference_run(setup, 2, STEPS)
    bf16 = [(a, b) for a, b in zip(start, end) if a.dtype == torch.bfloat16]
    assert bf16
    for a, b in bf16:
        assert (b.double() - a.double()).abs().max().item() > 5 * allowed_error(b)
