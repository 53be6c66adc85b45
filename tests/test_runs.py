"""Runs ([Note: runs] in hf_zero/_runs.py): adjacent flat pieces of one param group stepped as one tensor
give every element the update it gets when each piece is stepped alone, bit for bit, through rebuilds
(freeze, unfreeze), a step where some of a run's params have no grad (the run splits), and a sharded
checkpoint resumed; so do runs of fp32 masters of a bf16 model (their masters and state included). Each
run of 2 gloo ranks trains twice, with runs and with them turned off (``hf_zero._runs._MAX_RUN_ELEMENTS = 0``
in that rank's process), and compares."""

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_zero import _partition, _runs
from hf_zero._runs import Run, make_run, member_state, plan_runs, run_grad
from tests._dist import run_ranks
from tests.models import BATCH, assert_params_equal, assert_state_dicts_equal

STEPS = 10
FREEZE_AT, UNFREEZE_AT, SKIP_AT, RESUME_AFTER = 3, 5, 6, 7


# -- the planner and the state, without a process group -------------------------------------------------
def _slices(buf, bounds):
    return [buf[a:b] for a, b in bounds]


def test_runs_are_back_to_back_pieces_of_one_group():
    buf = torch.zeros(200)  # float32: 16 elements fill 64 bytes
    tensors = _slices(buf, [(0, 16), (16, 32), (32, 48), (48, 64), (64, 80), (96, 112), (112, 128)])
    groups = [0, 0, 0, 1, 1, 1, 1]
    states = [{} for _ in tensors]
    assert plan_runs(tensors, groups, states, eligible=[True] * 7) == [(0, 1, 2), (3, 4), (5, 6)]
    # a piece that may not join (a master's, one in a buffer not laid out as a bucket) ends the run before it
    assert plan_runs(tensors, groups, states, eligible=[True, False, True, True, True, True, True]) == [(3, 4), (5, 6)]
    other = torch.zeros(16)  # another storage, whatever its address
    assert plan_runs([tensors[0], other], [0, 0], [{}, {}], eligible=[True, True]) == []
    # a piece that ends in a partial vector register ends its run (its last elements stay a tensor's last)
    odd = _slices(buf, [(0, 16), (16, 26), (26, 42), (42, 58)])
    assert plan_runs(odd, [0] * 4, [{}] * 4, eligible=[True] * 4) == [(0, 1), (2, 3)]


def test_runs_join_only_pieces_with_the_same_scalars():
    buf = torch.zeros(64)
    tensors = _slices(buf, [(0, 16), (16, 32), (32, 48), (48, 64)])
    states = [{"step": torch.tensor(s), "exp_avg": torch.zeros(16)} for s in (3.0, 3.0, 2.0, 2.0)]
    assert plan_runs(tensors, [0] * 4, states, eligible=[True] * 4) == [(0, 1), (2, 3)]
    states[1] = {}  # no state yet (never stepped) next to state
    assert plan_runs(tensors, [0] * 4, states, eligible=[True] * 4) == [(2, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("kernel", [{"fused": True}, {"foreach": True}, {"foreach": False}])
def test_this_torchs_kernels_step_a_run_as_its_pieces(dtype, kernel):
    """The premise, on this torch: AdamW over the runs ``plan_runs`` forms equals AdamW over the pieces,
    bitwise, pieces of every size (a full 64-byte register or not) side by side."""
    sizes = [64, 16, 37, 11, 48, 5, 32, 32, 1, 80]
    buf = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(0)).to(dtype)
    starts = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    pieces = [torch.nn.Parameter(buf[a:b].clone()) for a, b in zip(starts, starts[1:])]
    together = buf.clone()
    slices = _slices(together, list(zip(starts, starts[1:])))
    runs = plan_runs(slices, [0] * len(sizes), [{}] * len(sizes), eligible=[True] * len(sizes))
    assert runs and any(len(r) > 2 for r in runs)
    in_run = {k for r in runs for k in r}
    stepped = [torch.nn.Parameter(together[starts[r[0]] : starts[r[-1] + 1]]) for r in runs]
    stepped += [torch.nn.Parameter(slices[k]) for k in range(len(sizes)) if k not in in_run]
    hyper = dict(lr=1e-2, weight_decay=0.1, **kernel)
    alone, merged = torch.optim.AdamW(pieces, **hyper), torch.optim.AdamW(stepped, **hyper)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        grads = torch.randn(sum(sizes), generator=g).to(dtype)
        for p, (a, b) in zip(pieces, zip(starts, starts[1:])):
            p.grad = grads[a:b].clone()
        for p in stepped:
            offset = (p.data_ptr() - together.data_ptr()) // together.element_size()
            p.grad = grads[offset : offset + p.numel()].clone()
        alone.step()
        merged.step()
    assert torch.equal(torch.cat([p.detach() for p in pieces]), together)


def test_a_runs_state_is_its_pieces_state_and_gives_each_piece_its_own_back():
    buf = torch.zeros(30)
    tensors = _slices(buf, [(0, 10), (10, 25), (25, 30)])
    moments = torch.arange(30.0)
    states = [{"step": torch.tensor(4.0), "exp_avg": moments[a:b], "exp_avg_sq": (moments[a:b] * 2).clone()}
              for a, b in [(0, 10), (10, 25), (25, 30)]]
    run, state = make_run(tensors, (0, 1, 2), states)
    assert all(st == {} for st in states), "each piece's state is given up as it is copied"
    assert state["exp_avg"].data_ptr() == moments.data_ptr(), "back-to-back slices are spanned, not copied"
    assert torch.equal(state["exp_avg_sq"], moments * 2)
    assert run.tensor.data_ptr() == buf.data_ptr() and run.tensor.numel() == 30 and run.starts == (0, 10, 25, 30)
    one = member_state(run, state, 1)
    assert torch.equal(one["exp_avg"], moments[10:25]) and one["exp_avg"].data_ptr() == moments[10:].data_ptr()
    assert one["step"] is not state["step"] and one["step"].item() == 4.0, "each piece gets its own scalar"


def test_a_run_takes_its_pieces_grads_only_where_they_are_back_to_back():
    buf = torch.zeros(30)
    run = Run(buf, (0, 1, 2), (0, 10, 25, 30))
    grads = torch.randn(45)
    # the first member is the last 10 elements of a 2-D param's grad, the others whole params' grads
    params = [grads[0:15].view(3, 5), grads[15:30], grads[30:35]]
    pieces = [SimpleNamespace(start=5), SimpleNamespace(start=0), SimpleNamespace(start=0)]
    got = run_grad(run, params, pieces)
    assert got.data_ptr() == grads[5:].data_ptr() and torch.equal(got, grads[5:35])
    assert run_grad(run, [params[0], params[1].clone(), params[2]], pieces) is False  # one replaced
    assert run_grad(run, [params[0], None, params[2]], pieces) is False  # one param without a grad
    assert run_grad(run, [None, None, None], pieces) is None
    assert run_grad(run, [g.double() for g in params], pieces) is False  # another dtype
    assert run_grad(run, [params[0].t(), params[1], params[2]], pieces) is False  # not contiguous


# -- training: with runs and without, bit for bit --------------------------------------------------------
class Blocks(nn.Module):
    """Four blocks of Linear + LayerNorm (many small params side by side), a head; ``skip`` leaves a block
    out of the forward (its params get no grad). float64, or bfloat16 (stepped through fp32 masters), with
    vectors that fill whole 64-byte registers in the dtype the local optimizer steps: runs span blocks."""

    def __init__(self, dtype=torch.float64):
        super().__init__()
        torch.manual_seed(0)
        width = self.width(dtype)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width)) for _ in range(4))
        self.head = nn.Linear(width, 2)
        self.skip = None
        self.to(dtype)

    def forward(self, x, y):
        for k, block in enumerate(self.blocks):
            if k != self.skip:
                x = torch.tanh(block(x))
        return F.mse_loss(self.head(x), y)

    @staticmethod
    def width(dtype):
        return 8 if dtype == torch.float64 else 16

    @staticmethod
    def batch(step, n, dtype=torch.float64):
        g = torch.Generator().manual_seed(5000 + step)
        return torch.randn(n, Blocks.width(dtype), generator=g, dtype=torch.float64).to(dtype), \
            torch.randn(n, 2, generator=g, dtype=torch.float64).to(dtype)


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adamw-fused": (torch.optim.AdamW, dict(lr=1e-2, fused=True)),
    "sgd": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9)),
}


def _groups(model, groups):
    if groups == "one":
        return list(model.parameters())
    return [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]


def _schedule(model, step):
    if step in (FREEZE_AT, UNFREEZE_AT):
        model.blocks[1].requires_grad_(step == UNFREEZE_AT)
    model.skip = 2 if step == SKIP_AT else None


# the model's dtype: float64, or bfloat16 with fp32 masters (stage 2's shards in bf16, or "-fp32": in fp32)
DTYPES = {"float64": (torch.float64, {}), "bfloat16": (torch.bfloat16, {}),
          "bfloat16-fp32": (torch.bfloat16, {"grad_accum_dtype": "fp32"})}


def _train(rank, world_size, stage, optimizer, groups, dtype, directory, runs):
    import hf_zero

    dt, extra = DTYPES[dtype]
    model = Blocks(dt)
    cls, hyper = OPTIMIZERS[optimizer]

    def make():
        opt = hf_zero.ZeroBucketOptimizer(_groups(model, groups), cls, stage=stage, grad_reduce="reduce_scatter",
                                          **hyper, **extra)
        if stage == 1:
            opt.bind_ddp(ddp)
        else:
            opt.bind_module(model)
        return opt

    ddp = DDP(model, find_unused_parameters=True, gradient_as_bucket_view=True) if stage == 1 else None
    forward = ddp if stage == 1 else model
    opt, counts, split_at = make(), [], []
    path = os.path.join(directory, f"{stage}-{optimizer}-{groups}-{dtype}-{runs}")
    for step in range(STEPS):
        _schedule(model, step)
        x, y = Blocks.batch(step, BATCH * world_size, dt)
        forward(x[rank * BATCH : (rank + 1) * BATCH], y[rank * BATCH : (rank + 1) * BATCH]).backward()
        splits = len(_SPLITS)
        opt.step()
        if len(_SPLITS) > splits:
            split_at.append(step)
        opt.zero_grad()
        counts.append(_stepped_tensors(opt))
        if step == RESUME_AFTER:
            opt.save_sharded(path)
            opt.unbind()
            opt = make()
            opt.load_sharded(path)
    opt.consolidate_state_dict(to=0)
    state = opt.state_dict() if rank == 0 else None
    opt.unbind()
    return {"params": [p.detach().clone() for p in model.parameters()], "state": state, "stepped": counts,
            "split_at": split_at}


def _stepped_tensors(opt):
    """How many tensors the local optimizer steps (fewer than the pieces where runs formed)."""
    return sum(len(g["params"]) for g in opt._partition.inner.param_groups)


def _reference(world_size, optimizer, groups):
    model = Blocks()
    cls, hyper = OPTIMIZERS[optimizer]
    opt = cls(_groups(model, groups), **hyper)
    for step in range(STEPS):
        _schedule(model, step)
        model(*Blocks.batch(step, BATCH * world_size)).backward()
        for p in model.parameters():
            if not p.requires_grad:
                p.grad = None
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


CASES = [(stage, optimizer, groups, "float64") for stage in (1, 2) for optimizer in OPTIMIZERS
         for groups in ("one", "decay")] + \
        [(stage, optimizer, "one", "bfloat16") for stage in (1, 2) for optimizer in OPTIMIZERS] + \
        [(2, "adamw-fused", "one", "bfloat16-fp32")]


_SPLITS: list = []  # the runs split in this rank's process, as they split


def _all(rank, world_size, directory):
    out, cap, chunk, split = {}, _runs._MAX_RUN_ELEMENTS, _partition._CPU_GRAD_CHUNK_ELEMENTS, _runs.Runs.split

    def counted(self, r, optimizer):
        _SPLITS.append(r)
        return split(self, r, optimizer)

    _runs.Runs.split = counted
    for runs in (True, False):
        _runs._MAX_RUN_ELEMENTS = cap if runs else 0
        for case in CASES:
            # masters step in chunks: small ones here (a Linear's weight and bias, 272 elements, fill one and
            # more), which would end inside runs if a chunk could cut one
            _partition._CPU_GRAD_CHUNK_ELEMENTS = chunk if case[3] == "float64" else 260
            out[(*case, runs)] = _train(rank, world_size, *case, directory, runs)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_all, 2, str(tmp_path_factory.mktemp("runs")), timeout=300)


@pytest.mark.timeout(320)
@pytest.mark.parametrize("stage, optimizer, groups, dtype", CASES)
def test_runs_step_every_element_as_its_piece_alone_would(results, stage, optimizer, groups, dtype):
    for rank, out in enumerate(results):
        with_runs, without = out[(stage, optimizer, groups, dtype, True)], out[(stage, optimizer, groups, dtype, False)]
        assert all(map(torch.equal, with_runs["params"], without["params"])), f"rank {rank}: params differ"
        if rank == 0:
            assert_state_dicts_equal(with_runs["state"], without["state"])
            if dtype != "float64":  # the masters travel with the state, bit for bit too
                assert any("master_param" in st for st in with_runs["state"]["state"].values())
        # runs formed: fewer tensors stepped than pieces at some step, and none without runs
        assert min(with_runs["stepped"]) < max(without["stepped"]), (with_runs["stepped"], without["stepped"])
        # split only where some of a run's params had no grad (a chunk of masters never cuts one)
        assert set(with_runs["split_at"]) <= {SKIP_AT}, with_runs["split_at"]
    if dtype == "float64":
        assert_params_equal(results[0][(stage, optimizer, groups, dtype, True)]["params"],
                            _reference(2, optimizer, groups), "param (against plain torch on the global batch)")

