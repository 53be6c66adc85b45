"""Optimizer state moves between hf_zero and FSDP2 as docs/from_deepspeed.md says: hf_zero's
consolidated state dict, loaded into torch's optimizer over the unwrapped model and turned into a
full state dict by ``torch.distributed.checkpoint.state_dict``, continues under FSDP2; FSDP2's full
optimizer state dict loads straight into a ``ZeroBucketOptimizer`` over ``named_parameters()``.
Both continue exactly as one uninterrupted run (float64, every rank on the same batch, so that the
check is of the state moved)."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks

LR = 0.05


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def _train(model, opt, steps) -> None:
    for i in steps:
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(100 + i), dtype=torch.float64)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _round_trip(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_optimizer_state_dict)
    from torch.distributed.fsdp import fully_shard

    import hf_zero

    full = StateDictOptions(full_state_dict=True)
    ref = _net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    _train(ref, ref_opt, range(3))
    after_3 = {k: v.clone() for k, v in ref.state_dict().items()}
    _train(ref, ref_opt, range(3, 4))

    # hf_zero -> FSDP2
    model = _net()
    zero = hf_zero.ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW, lr=LR)
    _train(model, zero, range(2))
    zero.consolidate_state_dict(to=0)
    box = [zero.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(box, 0)  # as if each rank had read `hf-zero consolidate`'s file
    consolidated = box[0]
    for group in consolidated["param_groups"]:
        group.pop("param_names", None)  # torch.distributed.checkpoint's helpers refuse it
    plain = torch.optim.AdamW(model.parameters(), lr=LR)
    plain.load_state_dict(consolidated)
    full_osd = get_optimizer_state_dict(model, plain, options=full)
    fully_shard(model)
    fsdp_opt = torch.optim.AdamW(model.parameters(), lr=LR)
    set_optimizer_state_dict(model, fsdp_opt, full_osd, options=full)
    _train(model, fsdp_opt, range(2, 3))
    fsdp_weights = get_model_state_dict(model, options=full)

    # FSDP2 -> hf_zero
    fsdp_osd = get_optimizer_state_dict(model, fsdp_opt, options=full)
    back = _net()
    back.load_state_dict(fsdp_weights)
    zero_back = hf_zero.ZeroBucketOptimizer(back.named_parameters(), torch.optim.AdamW, lr=LR)
    zero_back.load_state_dict(fsdp_osd)
    _train(back, zero_back, range(3, 4))
    return ({k: v.clone() for k, v in fsdp_weights.items()}, after_3,
            {k: v.clone() for k, v in back.state_dict().items()}, ref.state_dict())


@pytest.mark.reliability("Optimizer state moved hf_zero -> FSDP2 -> hf_zero (2 ranks)",
                         "each continues bitwise as one uninterrupted run")
@pytest.mark.timeout(120)
def test_optimizer_state_moves_between_hf_zero_and_fsdp2_exactly():
    for fsdp_weights, after_3, back, ref in run_ranks(_round_trip, 2, timeout=110):
        for name, expected in after_3.items():
            assert torch.equal(fsdp_weights[name], expected), name
        for name, expected in ref.items():
            assert torch.equal(back[name], expected), name
