"""Each AdamW kernel, stepping this rank's pieces, equals its own unsharded counterpart bitwise.

``optim="zero_bucket"``'s default inner optimizer is torch's fused AdamW (Trainer's default,
``adamw_torch_fused``); ``inner=adamw`` is the single-tensor one (``adamw_torch``). On 2 gloo
ranks, with the same grads on every rank (so the average is exact and the comparison is
about the optimizer alone), every param and every state element equals a single-process
``torch.optim.AdamW`` built with the same kernel, bitwise, in float32 and bfloat16 (pure,
or through fp32 masters, whose reference steps fp32 copies and rounds them). The two
kernels differ in float32 here, so the comparison tells them apart.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks

BF16 = torch.bfloat16
SHAPES = ((37, 11), (11,), (5, 7, 3), (1,), (64,))  # odd sizes: flat pieces straddle params
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
STEPS = 4
# name -> (dtype, AdamW kernel kwargs, master_weights, shard)
CASES = {
    "fused-fp32-flat": (torch.float32, {"fused": True}, "auto", "flat"),
    "fused-fp32-param": (torch.float32, {"fused": True}, "auto", "param"),
    "single-fp32-flat": (torch.float32, {"foreach": False}, "auto", "flat"),
    "fused-bf16-pure": (BF16, {"fused": True}, False, "flat"),
    "fused-bf16-masters": (BF16, {"fused": True}, "auto", "flat"),
    "single-bf16-masters": (BF16, {"foreach": False}, "auto", "flat"),
}


def _params(dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in SHAPES]


def _grads(step: int, dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _sharded(rank, world_size, name):
    from hf_zero import ZeroBucketOptimizer

    dtype, kernel, masters, shard = CASES[name]
    params = _params(dtype)
    opt = ZeroBucketOptimizer(params, torch.optim.AdamW, master_weights=masters, shard=shard, **kernel, **HYPER)
    for step in range(STEPS):
        for p, g in zip(params, _grads(step, dtype)):
            p.grad = g  # the same on every rank: their average is exact
        opt.step()
        opt.zero_grad()
    opt.consolidate_state_dict(to=0)
    return [p.detach().clone() for p in params], (opt.state_dict()["state"] if rank == 0 else None)


def _reference(name):
    """One process: AdamW with the same kernel over the whole params (fp32 copies for masters)."""
    dtype, kernel, masters, _ = CASES[name]
    params = _params(dtype)
    stepped = [p.detach().float().requires_grad_() for p in params] if dtype == BF16 and masters else params
    opt = torch.optim.AdamW(stepped, **kernel, **HYPER)
    for step in range(STEPS):
        for s, g in zip(stepped, _grads(step, dtype)):
            s.grad = g.to(s.dtype)
        opt.step()
        if stepped is not params:
            with torch.no_grad():
                for p, s in zip(params, stepped):
                    p.copy_(s)  # round to nearest even
    return [p.detach() for p in params], {i: opt.state[s] for i, s in enumerate(stepped)}, stepped


def _run_all(rank, world_size):
    return {name: _sharded(rank, world_size, name) for name in CASES}


@pytest.fixture(scope="module")
def sharded():
    return run_ranks(_run_all, 2, timeout=90)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CASES))
def test_each_kernel_equals_its_unsharded_counterpart_bitwise(sharded, name):
    (params0, state), (params1, _) = sharded[0][name], sharded[1][name]
    want_params, want_state, stepped = _reference(name)
    for i, (a, b, want) in enumerate(zip(params0, params1, want_params)):
        assert torch.equal(a, b), f"param {i}: replicas differ"
        assert a.dtype == want.dtype and torch.equal(a, want), f"param {i}: not bitwise equal to the reference"
    for i, want in want_state.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            got = state[i][key]
            assert torch.equal(got, want[key].to(got.dtype)), f"param {i} state {key}"
        if CASES[name][0] == BF16 and CASES[name][2]:  # masters: the fp32 copy the reference stepped
            assert torch.equal(state[i]["master_param"], stepped[i].detach()), f"param {i} master"


@pytest.mark.timeout(120)
def test_the_kernels_differ_here(sharded):
    """Fused and single-tensor AdamW round differently in float32, so the bitwise
    comparisons above pin each sharded run to its own kernel."""
    assert any(not torch.equal(a, b) for a, b in zip(sharded[0]["fused-fp32-flat"][0],
                                                     sharded[0]["single-fp32-flat"][0]))
