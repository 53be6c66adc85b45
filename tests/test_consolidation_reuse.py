"""consolidate_state_dict reuses the receiving rank's own whole-param state instead of copying it.

Param mode gives each param whole to one rank: what rank ``to`` owns must come back
as its live state tensors (no new memory, as torch's ZeroRedundancyOptimizer does),
everything else as new tensors, and all of it equal to the plain optimizer's state.
A later step invalidates the consolidation; a new one reflects the new state.
"""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests._dist import run_ranks
from tests.models import Setup, assert_state_dict_equal, build_model, make_zero, reference_run, train_steps

SETUP = Setup(shard="param")


def _ptrs(state: dict) -> set[int]:
    return {v.data_ptr() for st in state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0}


def _consolidate(rank, world_size):
    model = build_model(SETUP.model)
    opt = make_zero(SETUP, model)
    ddp = DDP(model, find_unused_parameters=True)
    out = {}
    for steps in (range(0, 3), range(3, 5)):
        train_steps(SETUP, model, opt, steps, world_size=world_size, rank=rank, forward=ddp)
        opt.consolidate_state_dict(to=1)
        inner = opt._partition.inner
        live = _ptrs({lp.tensor: inner.state[lp.tensor] for lp in opt._partition.pieces if lp.tensor in inner.state})
        if rank == 1:
            sd = opt.state_dict()
            got = _ptrs(sd["state"])
            out[steps.stop] = {
                "state_dict": {**sd, "state": {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}},
                "shared": len(got & live),
                "own": len(live),
                "total": len(got),
            }
    return out


@pytest.mark.timeout(90)
def test_receiver_reuses_its_own_whole_param_state():
    per_rank = run_ranks(_consolidate, 2, timeout=75)
    assert per_rank[0] == {}
    for steps, r in per_rank[1].items():
        _, ref_state = reference_run(SETUP, 2, steps)
        assert_state_dict_equal(r["state_dict"], ref_state)
        assert r["own"] > 0 and r["shared"] == r["own"], "rank 1's own state was copied, not reused"
        assert r["total"] > r["shared"], "state gathered from rank 0 must be new tensors"
    assert not dist.is_initialized()
