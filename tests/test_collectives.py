"""What a step sends: counted by wrapping torch.distributed's collectives inside each rank.

A steady step (trainable set unchanged) may only sync the buffers (on gloo each rank
sends its range of each buffer to every other rank; or at most one broadcast per rank
per buffer, or one all-gather per buffer, NCCL's path), carrying exactly the
buffers' bytes (trainable elements plus alignment padding: no frozen byte), plus one
agreement all-reduce of a few bytes, plus, while params that DDP does not reduce are
trainable, one all-reduce per dtype averaging their grads.

With ``grad_reduce="reduce_scatter"`` (DDP's all-reduce replaced by hf_zero's comm
hook), a steady step moves, per rank, at most DDP's own all-reduce volume
2Ψ(N-1)/N (Ψ: the bytes DDP reduces) plus 1% for padding and control scalars:
counted on the wire, per collective, as the bytes a rank sends in the standard
algorithms (ring all-reduce 2B(N-1)/N, reduce-scatter / all-gather / pipelined
broadcast B(N-1)/N, all-to-all and sends: exactly what goes to other ranks); the counter and
its byte model are the benchmarks' (benchmarks/_common.py), so the docs' byte tables and this
test cannot drift apart.
"""

import functools
from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks._common import CollectiveCounter
from hf_zero._layout import ParamSpec, plan_layout
from tests._dist import run_ranks
from tests.models import (
    Setup, assert_params_equal, assert_replicas_identical, build_model, make_zero, params_of, reference_run,
    train_steps,
)

STEPS = 8
ALIGN_BYTES = 64
AGREEMENT_BYTES = 48  # six int64s: the layout check ([Note: the layout check] in hf_zero/_params.py)
# Calls whose tensor is a rank's share of the param sync.
SYNC_CALLS = ("broadcast", "all_gather_single", "all_gather_into_tensor", "isend", "irecv")


@dataclass(frozen=True)
class Case:
    setup: Setup
    sync_by: str | None = None  # Comm.sync_by; None: the backend's default (gloo: send_recv)


# fp32 and bf16 buffers; fp32.0 frozen throughout (its bytes must never move).
FROZEN_BRANCH = ((0, ("fp32.0.",)),)
# fp32.2 and bf16.2 frozen when DDP is built, trainable for steps 2-4, frozen again from 5;
# fp32.0.weight frozen throughout.
LATE_UNFROZEN = (
    (0, ("fp32.0.weight", "fp32.2.", "bf16.2.")), (2, ("fp32.0.weight",)), (5, ("fp32.0.weight", "fp32.2.", "bf16.2."))
)

CASES = {
    "flat": Case(Setup(model="mixed", schedule=FROZEN_BRANCH)),
    "flat-no-view": Case(Setup(model="mixed", view=False, schedule=FROZEN_BRANCH)),
    "param": Case(Setup(model="mixed", shard="param", schedule=FROZEN_BRANCH)),
    "param-no-view": Case(Setup(model="mixed", shard="param", view=False, schedule=FROZEN_BRANCH)),
    "flat-all-gather": Case(Setup(model="mixed", schedule=FROZEN_BRANCH), sync_by="all_gather"),
    "flat-all-gather-no-view": Case(Setup(model="mixed", view=False, schedule=FROZEN_BRANCH), sync_by="all_gather"),
    "flat-broadcast": Case(Setup(model="mixed", schedule=FROZEN_BRANCH), sync_by="broadcast"),
    "param-broadcast-no-view": Case(Setup(model="mixed", shard="param", view=False, schedule=FROZEN_BRANCH),
                                    sync_by="broadcast"),
    "unfrozen-after-ddp-build": Case(Setup(model="mixed", schedule=LATE_UNFROZEN)),
    "unfrozen-after-ddp-build-param": Case(Setup(model="mixed", shard="param", schedule=LATE_UNFROZEN)),
}


def _count(rank, world_size, counter, case: Case):
    setup = case.setup
    model = build_model(setup.model)
    setup.apply_schedule(model, 0)
    opt = make_zero(setup, model)
    ddp = DDP(model, find_unused_parameters=True)
    if case.sync_by is not None:
        opt.gradient_path.comm.use_strategy(replace(opt.gradient_path.comm.strategy, sync_by=case.sync_by))
    at_ddp_build = [p.requires_grad for p in model.parameters()]
    steps = []

    def before_step(step):
        specs = [ParamSpec(p.numel(), p.dtype, str(p.device), p.requires_grad) for p in model.parameters()]
        unreduced = [p for p, then in zip(model.parameters(), at_ddp_build) if p.requires_grad and not then]
        steps.append({"specs": specs, "unreduced": [(p.numel(), p.dtype) for p in unreduced]})

    class CountingOptimizer:  # step() under the counter; everything else passes through
        def step(self):
            with counter.recording():
                opt.step()
            steps[-1]["calls"] = [(name, payload) for name, payload, _ in counter.calls]

        def zero_grad(self, set_to_none=True):
            opt.zero_grad(set_to_none=set_to_none)

    train_steps(setup, model, CountingOptimizer(), range(STEPS), world_size=world_size, rank=rank,
                forward=ddp, before_step=before_step)
    return {"steps": steps, "params": params_of(model)}


def _count_all(rank, world_size):
    counter = CollectiveCounter()
    return {name: _count(rank, world_size, counter, case) for name, case in CASES.items()}


@functools.cache
def _results(world_size):
    return run_ranks(_count_all, world_size, timeout=200)


def _expected_sync(specs, world_size, shard):
    """(number of buffers, total buffer bytes) of the layout for ``specs``; checks no frozen
    element has a slot and padding stays below one alignment unit per rank."""
    layout = plan_layout(specs, world_size=world_size, shard=shard)
    for buf in layout.buffers:
        trainable = sum(s.numel for s in specs if s.trainable and s.dtype == buf.dtype)
        assert sum(slot.numel for slot in buf.slots) == trainable
        assert 0 <= buf.size - trainable < world_size * max(1, ALIGN_BYTES // buf.dtype.itemsize)
    return len(layout.buffers), sum(b.size * b.dtype.itemsize for b in layout.buffers)


def _averaging_bytes(unreduced) -> list[int]:
    """Bytes of the one all-reduce per dtype: the grads plus one presence count per param."""
    by_dtype = {}
    for numel, dtype in unreduced:
        by_dtype[dtype] = by_dtype.get(dtype, 0) + (numel + 1) * dtype.itemsize
    return sorted(by_dtype.values())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", CASES)
def test_steady_steps_send_only_the_buffers(name, world_size):
    case = CASES[name]
    per_rank = [r[name] for r in _results(world_size)]
    changes = {at for at, _ in case.setup.schedule}
    steady_checked = 0
    for rank, result in enumerate(per_rank):
        for step, record in enumerate(result["steps"]):
            calls = record["calls"]
            if step in changes or step == 0:
                continue  # building or re-partitioning: metadata and state moves are expected here
            steady_checked += 1
            n_buffers, buffer_bytes = _expected_sync(record["specs"], world_size, case.setup.shard)
            assert n_buffers == 2, "the mixed model has an fp32 and a bf16 buffer"
            frozen_bytes = sum(s.numel * s.dtype.itemsize for s in record["specs"] if not s.trainable)
            assert frozen_bytes > 0, "the premise: some params are frozen"

            sync = [c for c in calls if c[0] in SYNC_CALLS]
            if case.sync_by == "all_gather":
                assert len(sync) == n_buffers
                assert {c[0] for c in sync} <= {"all_gather_single", "all_gather_into_tensor"}
                assert sum(b * world_size for _, b in sync) == buffer_bytes
            elif case.sync_by == "broadcast":
                assert {c[0] for c in sync} == {"broadcast"}
                assert len(sync) <= world_size * n_buffers
                assert sum(b for _, b in sync) == buffer_bytes, "bytes synced != buffer bytes"
            else:  # its own range to every other rank, every other range from its owner
                assert {c[0] for c in sync} == {"isend", "irecv"}
                sent = [b for c, b in sync if c == "isend"]
                received = [b for c, b in sync if c == "irecv"]
                assert len(sent) <= (world_size - 1) * n_buffers and len(received) <= (world_size - 1) * n_buffers
                assert sum(sent) % (world_size - 1) == 0
                assert sum(received) + sum(sent) // (world_size - 1) == buffer_bytes, "bytes synced != buffer bytes"

            reduces = [b for c, b in calls if c == "all_reduce"]
            assert reduces[0] == AGREEMENT_BYTES, f"rank {rank} step {step}: {calls}"
            assert sorted(reduces[1:]) == _averaging_bytes(record["unreduced"]), f"rank {rank} step {step}: {calls}"
            assert len(calls) == len(sync) + len(reduces), f"rank {rank} step {step}: unexpected {calls}"
    assert steady_checked >= 4 * world_size
    if case.setup.schedule is LATE_UNFROZEN:
        # the premise: params DDP does not reduce were trainable at steps 2-4 only
        for result in per_rank:
            assert [len(r["unreduced"]) for r in result["steps"]] == [0, 0, 4, 4, 4, 0, 0, 0]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", CASES)
def test_counted_runs_match_reference(name, world_size):
    per_rank = [r[name] for r in _results(world_size)]
    assert_replicas_identical([r["params"] for r in per_rank])
    ref_params, _ = reference_run(CASES[name].setup, world_size, STEPS)
    assert_params_equal(per_rank[0]["params"], ref_params)


# -- the reduce-scatter gradient path: no more bytes than DDP ------------------------------------
class Wide(torch.nn.Module):
    """~51K float32 params over several DDP buckets: padding stays far below 1% of the bytes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8)
        )

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.net(x), y)


PATH_STEPS = 6
PATHS = {  # name -> (grad_reduce, overlap, shard, find_unused_parameters)
    "today": ("all_reduce", False, "flat", True),
    "reduce-scatter": ("reduce_scatter", False, "flat", True),
    "reduce-scatter-overlap": ("reduce_scatter", True, "flat", True),
    "reduce-scatter-param": ("reduce_scatter", False, "param", True),
    "reduce-scatter-rebuilt-buckets": ("reduce_scatter", True, "flat", False),
}


def _count_path(rank, world_size, grad_reduce, overlap, shard, find_unused, grad_scaler=True):
    from hf_zero import ZeroBucketOptimizer

    counter = CollectiveCounter()
    model = Wide()
    opt = ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, shard=shard,
                              grad_reduce=grad_reduce, overlap_param_sync=overlap)
    ddp = DDP(model, find_unused_parameters=find_unused, gradient_as_bucket_view=True, bucket_cap_mb=0.05)
    opt.bind_ddp(ddp, grad_scaler=grad_scaler)
    psi = sum(p.numel() * p.element_size() for p in model.parameters())
    per_step = []
    for step in range(PATH_STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 64, generator=g), torch.randn(8, 8, generator=g)
        with counter.recording():  # forward (overlap waits), backward (hook), step
            ddp(x[rank::world_size], y[rank::world_size]).backward()
            opt.step()
            opt.zero_grad()
        per_step.append([(name, wire) for name, _, wire in counter.calls])
    opt.wait_param_sync()
    return {"psi": psi, "steps": per_step, "params": params_of(model)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", PATHS)
def test_reduce_scatter_path_moves_no_more_than_ddp(name, world_size):
    per_rank = run_ranks(_count_path, world_size, *PATHS[name], timeout=200)
    assert_replicas_identical([r["params"] for r in per_rank])
    grad_reduce, _, shard, find_unused = PATHS[name]
    first_steady = 2 if find_unused else 4  # see the lockstep note in hf_zero/_scatter_hook.py
    ddp_bytes = 2 * per_rank[0]["psi"] * (world_size - 1) / world_size  # DDP's ring all-reduce of every grad
    for step in range(first_steady, PATH_STEPS):
        per_rank_bytes = []
        for rank, result in enumerate(per_rank):
            wire = result["steps"][step]
            assert all(b >= 0 for _, b in wire), f"uncounted collective in {wire}"
            assert {n for n, _ in wire} <= {"isend", "irecv", "all_reduce"}, wire
            per_rank_bytes.append(sum(b for _, b in wire))
        if grad_reduce == "all_reduce":  # today: DDP's all-reduce (not seen here) plus the sync
            for ours in per_rank_bytes:
                assert 1.45 * ddp_bytes < ours + ddp_bytes < 1.55 * ddp_bytes, (step, ours / ddp_bytes)
            continue
        # Flat ranges are equal, so is every rank's share; whole params (shard="param") are
        # not: a rank owning less sends more of its grads, and the mean is what is bounded.
        checked = per_rank_bytes if shard == "flat" else [sum(per_rank_bytes) / world_size]
        for ours in checked:
            assert ours <= 1.01 * ddp_bytes, f"step {step}: {ours / ddp_bytes:.4f} of DDP's bytes"
            assert ours >= 0.99 * ddp_bytes  # the premise: all of it is counted


@pytest.mark.timeout(120)
def test_without_grad_scaler_no_finite_agreement():
    """``bind_ddp(grad_scaler=False)``: a steady reduce-scatter step makes no all-reduce, not one (no 4-byte
    non-finite flag; the layout check rides a reduce bucket); results stay exact."""
    world_size = 2
    with_scaler, without = (
        run_ranks(_count_path, world_size, "reduce_scatter", False, "flat", True, scaler, timeout=100)
        for scaler in (True, False)
    )
    for a, b in zip(with_scaler, without):
        assert_params_equal(b["params"], a["params"])
    step = PATH_STEPS - 1
    for rank in range(world_size):
        reduces = [b for n, b in with_scaler[rank]["steps"][step] if n == "all_reduce"]
        assert len(reduces) == 1, with_scaler[rank]["steps"][step]
        reduces = [b for n, b in without[rank]["steps"][step] if n == "all_reduce"]
        assert len(reduces) == 0, without[rank]["steps"][step]


def _sync_groups(rank, world_size, overlap):
    from hf_zero import ZeroBucketOptimizer
    from hf_zero._comm import _TAG_PARAMS

    seen = []
    isend = dist.isend

    def recording(tensor, *args, **kwargs):
        if kwargs.get("tag") == _TAG_PARAMS:
            group = kwargs.get("group")
            seen.append(None if group is None else (group is dist.group.WORLD, dist.get_process_group_ranks(group)))
        return isend(tensor, *args, **kwargs)

    dist.isend = recording
    try:
        model = Wide()
        opt = ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, grad_reduce="reduce_scatter",
                                  overlap_param_sync=overlap)
        ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=0.05)
        opt.bind_ddp(ddp)
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 64, generator=g), torch.randn(8, 8, generator=g)
            ddp(x[rank::world_size], y[rank::world_size]).backward()
            opt.step()
            opt.zero_grad()
            dist.all_reduce(torch.ones(1))  # another collective of the default group while the sync is in flight
        opt.wait_param_sync()
    finally:
        dist.isend = isend
    return {"seen": seen, "params": params_of(model)}


@pytest.mark.timeout(120)
def test_overlapped_sync_runs_on_its_own_group():
    """[Note: a group for the overlapped sync]: with the overlapped sync every param-sync send
    goes over a group of the same ranks other than the default one (so a collective the
    default group starts meanwhile does not queue behind it); without overlap over the
    optimizer's own group. Results equal either way."""
    own = run_ranks(_sync_groups, 2, True, timeout=100)
    plain = run_ranks(_sync_groups, 2, False, timeout=100)
    for r in own:
        assert r["seen"] and all(s == (False, [0, 1]) for s in r["seen"]), r["seen"]
    for r in plain:
        assert r["seen"] and all(s is None for s in r["seen"]), r["seen"]
    assert_replicas_identical([r["params"] for r in own])
    for a, b in zip(own, plain):
        assert_params_equal(a["params"], b["params"])


# -- a bf16 model with fp32 masters syncs 16-bit bytes ----------------------------------------------------
def _count_masters_sync(rank, world_size):
    from hf_zero import ZeroBucketOptimizer

    counter = CollectiveCounter()
    model = build_model("mlp", torch.bfloat16)
    opt = ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, fused=True, master_weights=True)
    synced = []
    for step in range(3):
        model(*model.batch(step, 4)).backward()
        with counter.recording():
            opt.step()
        opt.zero_grad()
        synced.append([(name, payload) for name, payload, _ in counter.calls if name in SYNC_CALLS])
    specs = [ParamSpec(p.numel(), p.dtype, str(p.device), p.requires_grad) for p in model.parameters()]
    return {"synced": synced, "specs": specs, "master_bytes": opt.stats()["master_bytes_per_rank"]}


@pytest.mark.timeout(120)
def test_bf16_param_sync_with_masters_moves_16bit_bytes():
    """The fp32 masters stay with their owner: what a step sends of a bf16 model is its
    bf16 buffer (2 bytes per element plus alignment padding), not fp32 masters."""
    per_rank = run_ranks(_count_masters_sync, 2, timeout=110)
    n_buffers, buffer_bytes = _expected_sync(per_rank[0]["specs"], 2, "flat")
    assert n_buffers == 1 and all(s.dtype == torch.bfloat16 for s in per_rank[0]["specs"])
    assert min(per_rank[0]["master_bytes"]) > 0, "the premise: every rank steps fp32 masters"
    for step in (1, 2):  # steady steps
        sent = [sum(b for c, b in r["synced"][step] if c == "isend") for r in per_rank]
        received = [sum(b for c, b in r["synced"][step] if c == "irecv") for r in per_rank]
        assert sent[0] + sent[1] == buffer_bytes and received == sent[::-1], (step, sent, received)
