"""Flat pieces chunked small (several pieces per param and rank) train, rebuild,
consolidate and checkpoint exactly like the plain optimizer on the global batch.

The models here are far below the default chunk limit, so each rank lowers it
(``hf_zero._layout._MAX_PIECE_ELEMENTS``) for its own process. Each scenario saves a
sharded checkpoint under one limit and resumes under the other, so the saved ranges
and the new pieces differ (as after a change of the limit between versions).
"""

import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_zero import _layout as layout_module
from tests._dist import run_ranks
from tests.models import (
    Setup, assert_params_equal, assert_replicas_identical, assert_state_dict_equal, build_model, make_zero,
    params_of, reference_run, train_steps,
)

STEPS = 6
SETUPS = {
    "adamw-flat": Setup(),
    "adamw-flat-no-view": Setup(view=False),
    "sgd-flat-frozen-period": Setup(optimizer="sgd", schedule=((2, ("net.0.",)), (4, ()))),
    "adamw-fp32-and-bf16": Setup(model="mixed"),
}
LIMITS = (7, 20)  # 7: below the float64 alignment (8 elements); 20: aligned chunks of 16


def _train(rank, world_size, setup: Setup, directory: str, name: str, resume_limit: int):
    model = build_model(setup.model)
    setup.apply_schedule(model, 0)
    opt = make_zero(setup, model)
    ddp = DDP(model, find_unused_parameters=True)
    train_steps(setup, model, opt, range(3), world_size=world_size, rank=rank, forward=ddp)
    pieces = opt.gradient_path.layout.pieces(rank)
    path = os.path.join(directory, name)
    opt.save_sharded(path)
    # Resume under another limit: the checkpoint's ranges differ from the new pieces.
    layout_module._MAX_PIECE_ELEMENTS = resume_limit
    opt = make_zero(setup, model)
    opt.load_sharded(path)
    train_steps(setup, model, opt, range(3, STEPS), world_size=world_size, rank=rank, forward=ddp)
    opt.consolidate_state_dict(to=0)
    return {
        "params": params_of(model),
        "state_dict": opt.state_dict() if rank == 0 else None,
        "pieces_per_param": max(sum(pc.index == i for pc in pieces) for i in {pc.index for pc in pieces}),
        "longest_piece": max(pc.numel for pc in pieces),
    }


def _train_all(rank, world_size, directory):
    out = {}
    for limit, resume_limit in zip(LIMITS, LIMITS[::-1]):
        for name, setup in SETUPS.items():
            layout_module._MAX_PIECE_ELEMENTS = limit
            out[(limit, name)] = _train(rank, world_size, setup, directory, f"{name}-{limit}", resume_limit)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_train_all, 2, str(tmp_path_factory.mktemp("chunked")), timeout=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("limit", LIMITS)
@pytest.mark.parametrize("name", SETUPS)
def test_chunked_pieces_match_reference(results, name, limit):
    per_rank = [r[(limit, name)] for r in results]
    assert all(r["longest_piece"] <= limit for r in per_rank)
    assert max(r["pieces_per_param"] for r in per_rank) > 1, "no param was chunked: the test proves nothing"
    ref_params, ref_state = reference_run(SETUPS[name], 2, STEPS)
    assert_replicas_identical([r["params"] for r in per_rank])
    assert_params_equal(per_rank[0]["params"], ref_params)
    assert_state_dict_equal(per_rank[0]["state_dict"], ref_state)


def test_default_limit_is_untouched_here():
    assert not dist.is_initialized()
    assert layout_module._MAX_PIECE_ELEMENTS == 1 << 20
