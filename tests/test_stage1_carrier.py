"""Stage 1's layout check rides a DDP bucket ([Note: stage 1's check rides a bucket] in hf_zero/_scatter_hook.py):
a steady step makes no collective for it, a rank that changes its trainable set alone still gets the same clear
error on every rank, every rank changing alike (before the backward or between it and the step) gives plain torch's
result, and without a bucket small enough the check keeps its all-reduce."""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hf_zero
from hf_zero import _scatter_hook
from hf_zero._comm import Comm
from hf_zero._layout import plan_layout
from hf_zero._params import ParamSpec
from tests._dist import run_ranks

STEPS = 5
BUCKET_MB = 0.0005  # ~60 float64 elements per DDP bucket: several buckets, the smallest carries the check


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3)).to(dtype)


def _batch(step, dtype):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(12, 6, generator=g).to(dtype), torch.randn(12, 3, generator=g).to(dtype)


def _apply(model, changes, step, rank, when):
    for at, ranks, moment, name, trainable in changes:
        if at == step and moment == when and rank in ranks:
            model.get_parameter(name).requires_grad_(trainable)


def _train(rank, world_size, changes, *, dtype=torch.float64, overlap=False, no_carrier=False):
    """STEPS steps of DDP + stage 1 (reduce-scatter) on rank ``rank``'s share of each batch; ``changes``: (step,
    ranks, "before" the forward or "after" the backward, param name, requires_grad). Returns the params, or the
    step and error where one was raised, and the all-reduces each step made."""
    if no_carrier:
        _scatter_hook._CARRIER_BYTES = -1
    model = _model(dtype)
    _apply(model, changes, -1, rank, "before")
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=True)
    opt = hf_zero.ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW, lr=0.05,
                                      grad_reduce="reduce_scatter", overlap_param_sync=overlap)
    opt.bind_ddp(ddp, grad_scaler=False)  # no non-finite agreement: the all-reduces counted are the check's
    calls, reduce = [], dist.all_reduce

    def counted(*args, **kwargs):
        calls[-1] += 1
        return reduce(*args, **kwargs)

    dist.all_reduce = counted
    try:
        for step in range(STEPS):
            calls.append(0)
            _apply(model, changes, step, rank, "before")
            x, y = _batch(step, dtype)
            share = slice(rank * len(x) // world_size, (rank + 1) * len(x) // world_size)
            torch.nn.functional.mse_loss(ddp(x[share]), y[share]).backward()
            _apply(model, changes, step, rank, "after")
            opt.step()
            opt.zero_grad()
        opt.wait_param_sync()
    except RuntimeError as e:
        return {"step": step, "error": str(e), "calls": calls}
    finally:
        dist.all_reduce = reduce
    return {"params": [p.detach().clone() for p in model.parameters()], "calls": calls, "rebuilds": opt.rebuilds}


def _reference(changes, dtype=torch.float64):
    """Plain torch on the global batch, the changes made alike."""
    model = _model(dtype)
    _apply(model, changes, -1, 0, "before")
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(STEPS):
        _apply(model, changes, step, 0, "before")
        x, y = _batch(step, dtype)
        torch.nn.functional.mse_loss(model(x), y).backward()
        _apply(model, changes, step, 0, "after")
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _assert_params(per_rank, want):
    for rank, got in enumerate(per_rank):
        assert "error" not in got, (rank, got)
        for i, (a, b) in enumerate(zip(got["params"], want)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=f"rank {rank}, param {i}")


@pytest.mark.fast
def test_the_carrier_is_the_smallest_bucket_every_rank_picks_alike():
    specs = [ParamSpec(n, torch.float32, "cpu", True, 0) for n in (40, 8, 24, 8)]
    buckets = ((0,), (1, 2), (3,))
    for world_size in (2, 3, 4):
        layout = plan_layout(specs, world_size=world_size, shard="flat", buckets=buckets)
        sizes = {buf.bucket: buf.size for buf in layout.buffers}
        smallest = min(sizes, key=lambda k: (sizes[k], k))
        assert _scatter_hook.carrier_of(layout, world_size) == buckets[smallest]
        assert _scatter_hook.carrier_of(layout, 1) is None  # one rank: nothing to agree on
    assert _scatter_hook.carrier_of(None, 2) is None  # no layout yet (the first step)


@pytest.mark.fast
def test_the_staged_copy_follows_the_headers_when_the_ranks_move():
    """The same size with other rank bounds (another carrier, or a re-partition): the bit goes to the new headers
    only, and nothing is left where the old ones were."""

    class Optimizer:
        comm = Comm()

    state = _scatter_hook.BucketReducer(Optimizer())
    like = torch.zeros(1)
    first = state.staged(10, like, [3, 9], True)
    assert first.nonzero().flatten().tolist() == [3, 9]
    first[:] = 5.0  # the last step's data, written over the whole copy
    again = state.staged(10, like, [4, 9], True)
    assert again.nonzero().flatten().tolist() == [4, 9]
    assert state.staged(10, like, [4, 9], False).nonzero().numel() == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", [False, True])
def test_a_steady_step_makes_no_collective_for_the_check_and_matches_torch(overlap):
    changes = [(2, (0, 1), "before", "2.weight", False), (3, (0, 1), "before", "2.weight", True)]
    per_rank = run_ranks(_train, 2, changes, overlap=overlap, timeout=100)
    _assert_params(per_rank, _reference(changes))
    for got in per_rank:
        # the first step all-reduces (DDP's buckets, the check: no layout to carry it yet); then only a change
        # makes one (every rank changed at steps 2 and 3: the count comes back, then the check runs as before)
        assert got["calls"][1] == got["calls"][4] == 0, got["calls"]
        assert got["calls"][2] == got["calls"][3] == 1, got["calls"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("changes", [
    [(1, (0, 1), "after", "2.weight", False), (3, (0, 1), "after", "2.weight", True)],
    [(2, (0, 1), "after", "0.bias", False)],
    [(1, (0, 1), "after", "2.weight", False), (2, (0, 1), "after", "0.bias", False),
     (3, (0, 1), "after", "2.weight", True)],
    [(2, (0, 1), "before", "2.weight", False), (2, (0, 1), "after", "0.bias", False)],
], ids=["freeze-then-unfreeze", "freeze-a-bias", "a-change-after-each-of-three-backwards",
        "a-change-before-and-another-after-one-backward"])
def test_every_rank_changing_between_the_backward_and_the_step_gives_torchs_result(changes):
    """A param frozen after its backward is stepped with its grad, one unfrozen then is not, as torch does: the
    carrier told every rank nothing changed, so the step keeps the layout the grads were reduced in, and the
    change is agreed on at the next backward. A step that re-partitions for a change made before its backward
    re-partitions to what that backward saw, leaving the later change for the next."""
    per_rank = run_ranks(_train, 2, changes, timeout=100)
    _assert_params(per_rank, _reference(changes))
    # the step after each change after a backward (and the step of one before it) makes the check's all-reduce
    # (every rank changed); the others none
    after = {at + (moment == "after") for at, _, moment, *_ in changes}
    assert all(got["calls"][1:] == [int(step in after) for step in range(1, STEPS)] for got in per_rank), per_rank


@pytest.mark.reliability("Stage 1 under DDP (reduce-scatter, {world_size} ranks, {dtype}{how}): only rank 1 {change}s a layer", "every rank raises the same RuntimeError naming the param, no hang")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,dtype,change,how", [
    (2, "float64", "freeze", ""),
    (2, "float64", "unfreeze", ", overlapped sync"),
    (3, "bfloat16", "freeze", ""),
    (3, "float64", "unfreeze", ", no bucket small enough to carry the check"),
])
def test_one_rank_changing_alone_fails_on_every_rank(world_size, dtype, change, how):
    trainable = change == "unfreeze"
    changes = [(2, (1,), "before", "2.weight", trainable)]
    if trainable:
        changes.append((-1, tuple(range(world_size)), "before", "2.weight", False))
    per_rank = run_ranks(_train, world_size, changes, dtype=getattr(torch, dtype), overlap="overlapped" in how,
                         no_carrier="no bucket" in how, timeout=100)
    errors = {got.get("error") for got in per_rank}
    assert len(errors) == 1 and None not in errors, per_rank
    steps = {got["step"] for got in per_rank}
    assert steps <= {2, 3}, steps  # at the step, or where the check is read late (an overlapped sync: the next)
    message = errors.pop()
    assert "ranks disagree on parameter 2.weight" in message
    assert f"rank 1: shape=(8, 8), dtype=torch.{dtype}, device=cpu, requires_grad={trainable}" in message
    if "no bucket" in how:
        assert all(got["calls"][1] == 1 for got in per_rank)  # the check's all-reduce, every step
    else:
        assert all(got["calls"][1] == 0 for got in per_rank)
