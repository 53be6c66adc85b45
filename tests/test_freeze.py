"""Freezing and unfreezing mid-training equals plain torch, where frozen params have no grad.

Schedules (step -> param-name prefixes frozen from then on; step 0 is applied before
DDP and the optimizer are built):

- frozen-then-unfrozen: ``net.0`` frozen for two steps; its moments and step count
  survive the frozen period exactly (the state dict is also compared mid-freeze).
- frozen-at-ddp-build: ``net.2`` frozen when DDP is built, unfrozen later. DDP never
  reduces its grads (checked: they differ between ranks); hf_zero must average them.
- rolling: several layers frozen and unfrozen in turn.
- stale-grad: ``zero_grad(set_to_none=False)``, and frozen params' leftover grads are
  overwritten with a different value on each rank: frozen params must stay bitwise
  unchanged and replicas identical.
"""

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests._dist import run_case
from tests.models import (
    Setup, assert_params_equal, assert_replicas_identical, assert_state_dict_equal, build_model,
    make_reference, make_zero, params_of, train_steps,
)

STEPS = 8
MID = 4  # the state dict is also compared after this many steps

FROZEN_THEN_UNFROZEN = ((2, ("net.0.",)), (4, ()))
FROZEN_AT_DDP_BUILD = ((0, ("net.2.",)), (2, ()))
ROLLING = ((1, ("net.4.",)), (3, ("net.0.", "scale")), (5, ("net.2.",)), (6, ()))
STALE = ((2, ("net.0.", "scale")), (5, ()))


@dataclass(frozen=True)
class Case:
    setup: Setup
    set_to_none: bool = True
    stale_grads: bool = False  # overwrite frozen params' grads with rank-specific garbage
    refresh: bool = False  # call refresh_trainable() where the schedule changes


CASES = {
    "frozen-then-unfrozen-adamw-flat": Case(Setup(schedule=FROZEN_THEN_UNFROZEN)),
    "frozen-then-unfrozen-adamw-param-no-view": Case(Setup(shard="param", view=False, schedule=FROZEN_THEN_UNFROZEN)),
    "frozen-then-unfrozen-sgd": Case(Setup(optimizer="sgd", schedule=FROZEN_THEN_UNFROZEN)),
    "frozen-then-unfrozen-adafactor": Case(Setup(optimizer="adafactor", shard="param", schedule=FROZEN_THEN_UNFROZEN)),
    "frozen-at-ddp-build-adamw-flat": Case(Setup(schedule=FROZEN_AT_DDP_BUILD)),
    "frozen-at-ddp-build-adamw-param": Case(Setup(shard="param", groups="decay", schedule=FROZEN_AT_DDP_BUILD)),
    "frozen-at-ddp-build-adafactor-no-view": Case(
        Setup(optimizer="adafactor", shard="param", view=False, schedule=FROZEN_AT_DDP_BUILD)
    ),
    "rolling-adamw-flat-no-view": Case(Setup(view=False, schedule=ROLLING)),
    "rolling-sgd-param-two-groups": Case(Setup(optimizer="sgd", shard="param", groups="decay", schedule=ROLLING)),
    "rolling-adamw-flat-explicit-refresh": Case(Setup(schedule=ROLLING), refresh=True),
    "stale-grad-adamw-flat": Case(Setup(schedule=STALE), set_to_none=False, stale_grads=True),
    "stale-grad-adamw-param-no-view": Case(
        Setup(shard="param", view=False, schedule=STALE), set_to_none=False, stale_grads=True
    ),
    "stale-grad-sgd": Case(Setup(optimizer="sgd", schedule=STALE), set_to_none=False, stale_grads=True),
}


def _train(rank, world_size, case: Case):
    setup = case.setup
    model = build_model(setup.model)
    setup.apply_schedule(model, 0)
    frozen_at_build = {n for n, p in model.named_parameters() if not p.requires_grad}
    opt = make_zero(setup, model)
    ddp = DDP(model, find_unused_parameters=True)
    report = {"frozen_checks": 0, "stale_grads_set": 0, "unreduced_grads_seen": 0}
    frozen_values = {}

    def before_step(step):
        if case.refresh and setup.changes_at(step):
            opt.refresh_trainable()
        for name, p in model.named_parameters():
            if p.requires_grad:
                frozen_values.pop(name, None)
                if name in frozen_at_build and p.grad is not None and _differs_across_ranks(p.grad):
                    report["unreduced_grads_seen"] += 1
                continue
            if name in frozen_values:
                assert torch.equal(p.detach(), frozen_values[name]), f"frozen {name} changed"
                report["frozen_checks"] += 1
            else:
                frozen_values[name] = p.detach().clone()
            if case.stale_grads and p.grad is not None:
                p.grad.fill_(rank + 1.0)
                report["stale_grads_set"] += 1

    kwargs = dict(world_size=world_size, rank=rank, forward=ddp, set_to_none=case.set_to_none, before_step=before_step)
    train_steps(setup, model, opt, range(MID), **kwargs)
    opt.consolidate_state_dict(to=0)
    mid = copy.deepcopy(opt.state_dict()) if rank == 0 else None
    train_steps(setup, model, opt, range(MID, STEPS), **kwargs)
    opt.consolidate_state_dict(to=0)
    params = params_of(model)
    for p in model.parameters():  # frozen ones included
        p.grad = torch.ones_like(p)
    opt.zero_grad(set_to_none=True)
    return {
        "grads_cleared": all(p.grad is None for p in model.parameters()),
        "params": params,
        "mid_state_dict": mid,
        "state_dict": opt.state_dict() if rank == 0 else None,
        "rebuilds": opt.rebuilds,
        **report,
    }


def _differs_across_ranks(t: torch.Tensor) -> bool:
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t.contiguous())
    return any(not torch.equal(everyone[0], x) for x in everyone[1:])


def _reference(case: Case, world_size: int):
    setup = case.setup
    model = build_model(setup.model)
    setup.apply_schedule(model, 0)
    opt = make_reference(setup, model)
    train_steps(setup, model, opt, range(MID), world_size=world_size, set_to_none=case.set_to_none)
    mid = copy.deepcopy(opt.state_dict())
    train_steps(setup, model, opt, range(MID, STEPS), world_size=world_size, set_to_none=case.set_to_none)
    return params_of(model), mid, opt.state_dict()


@pytest.mark.reliability("Trainability schedule \"{name}\" on {world_size} ranks", "equal to plain torch; frozen params bitwise unchanged")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", CASES)
def test_schedule_matches_reference(name, world_size):
    case = CASES[name]
    per_rank = run_case(_train, CASES, name, world_size, timeout=200)
    ref_params, ref_mid, ref_final = _reference(case, world_size)

    assert_replicas_identical([r["params"] for r in per_rank])
    assert_params_equal(per_rank[0]["params"], ref_params)
    assert_state_dict_equal(per_rank[0]["mid_state_dict"], ref_mid)
    assert_state_dict_equal(per_rank[0]["state_dict"], ref_final)

    # One build, then one rebuild per change of the trainable set, none otherwise.
    changes = sum(1 for at, _ in case.setup.schedule if at > 0)
    assert all(r["rebuilds"] == 1 + changes for r in per_rank), [r["rebuilds"] for r in per_rank]
    assert all(r["frozen_checks"] > 0 for r in per_rank), "no frozen param was checked"
    assert all(r["grads_cleared"] for r in per_rank), "zero_grad(set_to_none=True) left a grad"
    if case.stale_grads:
        assert all(r["stale_grads_set"] > 0 for r in per_rank)
    if case.setup.schedule[0][0] == 0:
        # The premise: DDP left these grads rank-local, so hf_zero had to average them.
        assert all(r["unreduced_grads_seen"] > 0 for r in per_rank)
