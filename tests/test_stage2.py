"""stage=2 (grads sharded as the backward produces them, no DDP) equals the plain optimizer
on the global batch.

Each case trains 7 steps on 2 and 3 gloo ranks (different data per rank, small buckets so a
model spans several) and is compared with a single-process run of the same torch optimizer:
final params (float64, 1e-12 as tests/test_gradient_path.py), the consolidated state dict
and, where clipped, every step's total grad norm (rtol 1e-10). Replicas must be bitwise
identical, every ``p.grad`` None after each backward, and the grads really reduce-scattered.
One spawn per world size runs the table.
"""

import dataclasses
import time

import pytest
import torch
import torch.nn.functional as F

from tests._dist import run_case, run_ranks
from tests.models import (
    BATCH, Setup, assert_params_equal, assert_replicas_identical, assert_state_dict_equal, build_model,
    count_reduce_scatters, make_reference, reference_clip, make_zero, params_of, shard_of, stage2_memory_trace, holds_no_grads,
)

STEPS = 7
BUCKET_MB = 0.0005  # ~65 float64 elements per bucket: several buckets per model

# Freezing and unfreezing every few steps: the buckets are re-planned on every rank.
TOGGLE = ((0, ()), (2, ("net.0.",)), (4, ()), (5, ("net.2.", "scale")), (6, ()))


@dataclasses.dataclass(frozen=True)
class Case:
    setup: Setup
    accumulate: int = 1  # micro-batches per step
    no_sync: bool = False  # all but the last micro-batch under model.no_sync() (else each is reduced)
    clip_norm: float | None = None
    clip_value: float | None = None
    skip_scale_on: int | None = None  # this rank's loss does not use MLP.scale (unused there only)
    overlap: bool = False  # overlap_param_sync: the next forward waits for the parameter sync


CASES = {
    "flat": Case(Setup()),
    "param": Case(Setup(shard="param")),
    "accumulate-4": Case(Setup(), accumulate=4),
    "accumulate-4-no-sync-param": Case(Setup(shard="param"), accumulate=4, no_sync=True),
    "clip-norm": Case(Setup(), clip_norm=0.05),
    "clip-norm-param-accumulate": Case(Setup(shard="param"), clip_norm=0.05, accumulate=2),
    "clip-value": Case(Setup(), clip_value=0.01),
    "tied": Case(Setup(model="tied"), clip_norm=0.5),
    "tied-param": Case(Setup(model="tied", shard="param")),
    "unused-on-one-rank": Case(Setup(), skip_scale_on=1, clip_norm=0.05),
    "freeze-toggle": Case(Setup(schedule=TOGGLE), clip_norm=0.05),
    "freeze-toggle-param-accumulate": Case(Setup(shard="param", schedule=TOGGLE), accumulate=2),
    "groups-sgd": Case(Setup(optimizer="sgd", groups="decay")),
    "adafactor-param": Case(Setup(optimizer="adafactor", shard="param"), clip_norm=0.05),
    "no-param-views": Case(Setup(view=False)),
    "overlap-param-accumulate": Case(Setup(shard="param"), overlap=True, accumulate=2, clip_norm=0.05),
    "tiny-ranks-owning-nothing": Case(Setup(model="tiny")),
}


def _loss(model, batch, case: Case, rank: int):
    if case.skip_scale_on == rank:
        x, y = batch
        return F.mse_loss(model.net(x), y)
    return model(*batch)


def _loop(case: Case, model, opt, *, world_size, rank=None):
    """Train; ``rank=None`` is the reference: one backward of the mean of every rank's
    loss (the global batch), torch's clipping. Returns (each step's clipped norm, whether
    every ``p.grad`` was None after every backward, bytes of the buckets alive after)."""
    setup, norms, freed, leftover = case.setup, [], True, 0
    for step in range(STEPS):
        setup.apply_schedule(model, step)
        batch = model.batch(step, BATCH * world_size)
        if rank is None:
            sum(_loss(model, shard_of(batch, r), case, r) for r in range(world_size)).div(world_size).backward()
            reference_clip(model, case, norms)
        else:
            batch = shard_of(batch, rank)
            micro = BATCH // case.accumulate
            for m in range(case.accumulate):
                part = tuple(t[m * micro : (m + 1) * micro] for t in batch)
                if case.no_sync and m + 1 < case.accumulate:
                    with model.no_sync():
                        (_loss(model, part, case, rank) / case.accumulate).backward()
                else:
                    (_loss(model, part, case, rank) / case.accumulate).backward()
                    freed = freed and holds_no_grads(model.parameters())
                    leftover = max(leftover, opt.gradient_path.stage2.bucket_bytes)
            if case.clip_norm is not None:
                norms.append(opt.clip_grad_norm_(case.clip_norm).item())
            if case.clip_value is not None:
                opt.clip_grad_value_(case.clip_value)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms, freed, leftover


def _train(rank, world_size, case: Case):
    setup = case.setup
    model = build_model(setup.model)
    setup.apply_schedule(model, 0)
    opt = make_zero(setup, model, stage=2, overlap_param_sync=case.overlap)
    opt.bind_module(model, bucket_cap_mb=BUCKET_MB)
    assert opt.overlaps_param_sync == (case.overlap and world_size > 1)
    scattered = count_reduce_scatters(opt)
    norms, freed, leftover = _loop(case, model, opt, world_size=world_size, rank=rank)
    model.state_dict()  # with overlap, the last step's sync is still in flight: this drains it
    params = params_of(model)
    opt.consolidate_state_dict(to=0)
    return {
        "params": params,
        "state_dict": opt.state_dict() if rank == 0 else None,
        "norms": norms,
        "scattered": len(scattered),
        "freed": freed,
        "leftover": leftover,
        "buckets": len(opt.gradient_path.wanted_buckets),
    }


def _reference(case: Case, world_size: int):
    model = build_model(case.setup.model)
    case.setup.apply_schedule(model, 0)
    opt = make_reference(case.setup, model)
    norms, _, _ = _loop(case, model, opt, world_size=world_size)
    return params_of(model), opt.state_dict(), norms


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", CASES)
def test_stage2_matches_reference(name, world_size):
    case = CASES[name]
    per_rank = run_case(_train, CASES, name, world_size, timeout=280)
    ref_params, ref_state, ref_norms = _reference(case, world_size)
    assert_replicas_identical([r["params"] for r in per_rank])
    assert_params_equal(per_rank[0]["params"], ref_params)
    assert_state_dict_equal(per_rank[0]["state_dict"], ref_state)
    syncing = STEPS * (1 if case.no_sync else case.accumulate)
    for r in per_rank:
        assert r["freed"] and r["leftover"] == 0
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref_norms), rtol=1e-10, atol=0)
        # Every bucket is reduce-scattered in every syncing backward, on every rank.
        assert r["scattered"] >= syncing * min(2, r["buckets"]), (r["scattered"], r["buckets"])


# -- stage 2 against stage 1, memory, binding: one spawn for the lot ---------------------------------
def _stage1_run(rank, world_size, setup: Setup, accumulate: int):
    """Stage 1 the way Trainer runs it: DDP, reduce-scatter comm hook, no_sync for accumulation."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model(setup.model)
    opt = make_zero(setup, model, grad_reduce="reduce_scatter")
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB, find_unused_parameters=True)
    opt.bind_ddp(ddp)
    _accumulated_steps(ddp, ddp.no_sync, opt, rank, world_size, accumulate)
    return params_of(model)


def _stage2_run(rank, world_size, setup: Setup, accumulate: int):
    """Stage 2 as stage 1 accumulates: 16-bit grads in their own dtype ([Note: what stage 2 accumulates in])."""
    model = build_model(setup.model)
    opt = make_zero(setup, model, stage=2, grad_accum_dtype="param")
    opt.bind_module(model, bucket_cap_mb=BUCKET_MB)
    _accumulated_steps(model, model.no_sync, opt, rank, world_size, accumulate)
    return params_of(model)


def _accumulated_steps(forward, no_sync, opt, rank, world_size, accumulate):
    model = getattr(forward, "module", forward)
    for step in range(STEPS):
        batch = shard_of(model.batch(step, BATCH * world_size), rank)
        micro = BATCH // accumulate
        for m in range(accumulate):
            part = tuple(t[m * micro : (m + 1) * micro] for t in batch)
            with no_sync() if m + 1 < accumulate else _nothing():
                (forward(*part) / accumulate).backward()
        opt.step()
        opt.zero_grad()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class Deep(torch.nn.Module):
    """Eight equal layers: with a bucket cap of about one layer, eight buckets."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32).double() for _ in range(8))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


LAYER_BYTES = (32 * 32 + 32) * 8


def _memory(rank, world_size, groups="one"):
    return stage2_memory_trace(Deep(), rank, layer_bytes=LAYER_BYTES, shards=True, groups=groups)


def _broadcast_at_bind(rank, world_size):
    torch.manual_seed(rank)  # different params on every rank
    model = torch.nn.Linear(3, 2).double()
    model.register_buffer("count", torch.full((2,), float(rank)))
    opt = make_zero(Setup(), model, stage=2)
    opt.bind_module(model)
    return [t.clone() for t in (*model.parameters(), *model.buffers())]


# Params keep storage of their own (view=False): a forward's bits depend on where a param
# lies (CPU BLAS: a float64 matmul with its weight 8 rather than 16 bytes aligned differs by
# an ulp), and the two stages lay their buffers out after different buckets.
class Counting(torch.nn.Module):
    """A buffer each forward adds rank + 1 to."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1).double()
        self.register_buffer("seen", torch.zeros(1, dtype=torch.float64))

    def forward(self, x):
        self.seen += torch.distributed.get_rank() + 1
        return self.lin(x).sum()


def _buffers_each_forward(rank, world_size, broadcast_buffers):
    """``seen`` after two syncing forwards, a no_sync one and one without grad."""
    model = Counting()
    opt = make_zero(Setup(), model, stage=2)
    opt.bind_module(model, broadcast_buffers=broadcast_buffers)
    x = torch.ones(2, 3, dtype=torch.float64)
    for _ in range(2):
        model(x).backward()
    with model.no_sync():
        model(x).backward()
    with torch.no_grad():
        model(x)
    opt.zero_grad()
    return model.seen.item()


BITWISE = {
    "flat": (Setup(view=False), 1),
    "param": (Setup(shard="param", view=False), 1),
    "flat-no-sync-4": (Setup(view=False), 4),
    "tied-param": (Setup(model="tied", shard="param", view=False), 1),
    # fp32 and bf16 params, the bf16 ones stepped through fp32 masters: stage 1 equals the
    # fp32-master reference bitwise (tests/test_masters.py), so stage 2 does too.
    "mixed-bf16-masters": (Setup(model="mixed", view=False, master_weights=True), 1),
    "mixed-bf16-masters-no-sync-2": (Setup(model="mixed", shard="param", view=False, master_weights=True), 2),
}


def _lot(rank, world_size):
    out = {f"stage1-{k}": _stage1_run(rank, world_size, *v) for k, v in BITWISE.items()}
    out.update({f"stage2-{k}": _stage2_run(rank, world_size, *v) for k, v in BITWISE.items()})
    out["memory"] = _memory(rank, world_size)
    out["memory-decay"] = _memory(rank, world_size, "decay")
    out["broadcast"] = _broadcast_at_bind(rank, world_size)
    out["buffers"] = [_buffers_each_forward(rank, world_size, b) for b in (True, False)]
    return out


_LOT: list = []


def _lot_results() -> list:
    """One spawn of 2 ranks for the tests below (the 3-rank table above checks p.grad and buckets too)."""
    if not _LOT:
        _LOT.append(run_ranks(_lot, 2, timeout=200))
    return _LOT[0]


@pytest.mark.timeout(220)
@pytest.mark.parametrize("name", BITWISE)
def test_stage2_is_bitwise_stage1_at_two_ranks(name):
    """At 2 ranks the mean (a + b) / 2 is the same bits whichever way it is reduced, so stage 2
    equals stage 1 under DDP with the reduce-scatter comm hook bit for bit (with no_sync
    accumulation: both reduce the micro-batches' local sum once), bf16 grads too where stage 2
    accumulates them in bf16 (``grad_accum_dtype="param"``; the default fp32 shards hold the
    exact a/2 + b/2 instead: tests/test_stage2_accumulation.py)."""
    per_rank = _lot_results()
    initial = params_of(build_model(BITWISE[name][0].model))
    for r in per_rank:
        for i, (a, b) in enumerate(zip(r[f"stage2-{name}"], r[f"stage1-{name}"])):
            assert torch.equal(a, b), f"param {i}: max diff {(a - b).abs().max().item():.3g}"
        assert not all(torch.equal(a, b) for a, b in zip(r[f"stage2-{name}"], initial)), "nothing was trained"


@pytest.mark.timeout(220)
def test_no_full_gradient_is_alive_after_the_backward():
    """After each backward every p.grad is None and no reduce bucket is in use; during it at
    most three of the eight one-layer buckets were held (filling and in flight, the pool's
    included), and the pool keeps at most those three for the next backward ([Note: bucket
    pool]); what a rank keeps is its shard: about 1/N of the grads."""
    total, world_size = 8 * LAYER_BYTES, 2
    for r in _lot_results():
        for freed, alive, peak, pooled, shards, buckets in r["memory"]:
            assert freed and alive == 0
            assert buckets == 8
            assert 0 < peak <= 3 * LAYER_BYTES, peak
            assert pooled <= peak, (pooled, peak)
            assert shards <= total / world_size + 8 * 64, (shards, total / world_size)


@pytest.mark.timeout(220)
def test_buckets_follow_the_model_not_the_param_groups():
    """Trainer's param groups (matrices decayed, then biases and norms not) order the optimizer's params
    by group: planned in that order, the first bucket would hold every layer's bias, the first layer's
    too, and every later bucket would wait for it to the end of the backward (a whole gradient alive).
    Planned in the model's order (DDP's), at most three one-layer buckets are held at once, as with one
    group."""
    for r in _lot_results():
        for freed, alive, peak, pooled, shards, buckets in r["memory-decay"]:
            assert freed and alive == 0
            assert 0 < peak <= 3 * LAYER_BYTES, (peak, 3 * LAYER_BYTES)


def _resident_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _resident_over_steps(rank, world_size, steps):
    import gc

    from hf_zero import ZeroBucketOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])  # 64 MiB of fp32 grads
    opt = ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, stage=2)
    opt.bind_module(model, bucket_cap_mb=4)
    resident = []
    for _ in range(steps):
        model(torch.randn(8, 1024)).sum().backward()
        opt.step()
        opt.zero_grad()
        gc.collect()
        resident.append(_resident_mib())
    return resident


@pytest.mark.timeout(120)
def test_resident_memory_does_not_grow_from_step_to_step(monkeypatch):
    """gloo keeps a collective's work (and the bucket it sends) a while after it completes:
    the reducer lets its finished buckets go, or fast steps kept a full set of grads more
    per step (64 MiB here: 247 -> 314 -> 378 MiB before). Fresh ranks, glibc returning
    freed blocks (as tests/test_memory.py)."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    for resident in run_ranks(_resident_over_steps, 2, 8, timeout=100, fresh=True):
        assert resident[-1] - resident[2] < 16, resident  # a quarter of the grads, not one set per step


@pytest.mark.timeout(220)
def test_params_and_buffers_are_broadcast_from_rank_0_at_bind():
    per_rank = _lot_results()
    for r in per_rank[1:]:
        for a, b in zip(r["broadcast"], per_rank[0]["broadcast"]):
            assert torch.equal(a, b)
    assert torch.equal(per_rank[0]["broadcast"][-1], torch.zeros(2))


# -- misuse: clear errors, raised before anything changes -------------------------------------------
def _bound(**kwargs):
    model = build_model("mlp")
    opt = make_zero(Setup(), model, stage=2, **kwargs)
    opt.bind_module(model)
    return model, opt


def _batch(model):
    return model.batch(0, BATCH)


@pytest.mark.parametrize("stage", [0, 3, True, "2"])
def test_stage_must_be_1_or_2(stage):
    with pytest.raises(ValueError, match="stage must be 1"):
        make_zero(Setup(), build_model("mlp"), stage=stage)


def test_stage2_contradicts_all_reduce():
    with pytest.raises(ValueError, match="grad_reduce='all_reduce'"):
        make_zero(Setup(), build_model("mlp"), stage=2, grad_reduce="all_reduce")


def test_bind_module_is_for_stage2_only():
    model = build_model("mlp")
    with pytest.raises(ValueError, match="bind_module is for stage=2"):
        make_zero(Setup(), model).bind_module(model)


def test_step_without_bind_module_is_an_error_not_local_grads():
    model = build_model("mlp")
    opt = make_zero(Setup(), model, stage=2)
    model(*_batch(model)).backward()
    before = params_of(model)
    with pytest.raises(RuntimeError, match="bind_module"):
        opt.step()
    assert_params_equal(params_of(model), before)


def test_a_module_param_outside_the_optimizer_is_refused_at_the_first_forward():
    """Not at bind: another stage-2 optimizer may hold it ([Note: several optimizers over one module])."""
    model = build_model("mlp")
    from hf_zero import ZeroBucketOptimizer

    params = [p for n, p in model.named_parameters() if n != "scale"]
    opt = ZeroBucketOptimizer(params, torch.optim.AdamW, stage=2, lr=1e-2)
    opt.bind_module(model)
    with pytest.raises(ValueError, match=r"in no stage-2 optimizer bound to it: \['scale'\]"):
        model(*_batch(model))


def test_step_after_a_no_sync_backward_only_is_an_error():
    model, opt = _bound()
    with model.no_sync():
        model(*_batch(model)).backward()
    assert model.net[0].weight.grad is not None  # kept, not reduced
    with pytest.raises(RuntimeError, match="never reduced.*no_sync"):
        opt.step()


def test_freezing_between_backward_and_step_is_an_error():
    model, opt = _bound()
    model(*_batch(model)).backward()
    opt.step()
    model(*_batch(model)).backward()
    model.net[0].weight.requires_grad_(False)
    before = params_of(model)
    with pytest.raises(RuntimeError, match="between the backward and optimizer.step"):
        opt.step()
    assert_params_equal(params_of(model), before)


@pytest.mark.fast
def test_grads_are_none_and_clipping_reads_the_shards_on_one_process():
    model, opt = _bound()
    ref_model = build_model("mlp")
    model(*_batch(model)).backward()
    ref_model(*_batch(ref_model)).backward()
    assert holds_no_grads(model.parameters())
    want = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1e9)
    torch.testing.assert_close(opt.clip_grad_norm_(1e9), want, rtol=1e-12, atol=0)


def test_a_param_without_elements_is_in_no_bucket_and_keeps_no_grad():
    model = torch.nn.Linear(3, 2).double()
    empty = torch.nn.Parameter(torch.zeros(0, dtype=torch.float64))
    model.register_parameter("empty", empty)
    opt = make_zero(Setup(), model, stage=2)
    opt.bind_module(model)
    for _ in range(2):
        (model(torch.ones(4, 3, dtype=torch.float64)).sum() + empty.sum()).backward()
        assert holds_no_grads(model.parameters())
        opt.step()
        opt.zero_grad()


@pytest.mark.timeout(220)
def test_buffers_follow_rank_0_after_each_syncing_backward_as_ddp_does():
    """DDP's broadcast_buffers: a forward after a syncing one starts from rank 0's buffers (DDP's
    ``require_forward_param_sync``); stage 2 receives them at the end of each syncing backward and
    takes them at the next grad-mode forward ([Note: buffers after a syncing backward];
    tests/test_stage2_semantics.py compares with DDP itself)."""
    (on0, off0), (on1, off1) = (r["buffers"] for r in _lot_results())
    assert (on0, on1) == (4.0, 2 + 2 * 2)  # rank 1: rank 0's 2 before its no_sync forward, then +2 twice
    assert (off0, off1) == (4.0, 8.0)


class _BigUnused(torch.nn.Module):
    """A small layer and one param above the bucket cap (a bucket of its own, outside the pool)."""

    def __init__(self):
        super().__init__()
        self.small = torch.nn.Linear(4, 4).double()
        self.big = torch.nn.Parameter(torch.zeros(4096, dtype=torch.float64))

    def forward(self, x, use_big: bool):
        out = self.small(x).sum()
        return out + self.big.sum() if use_big else out


def _big_unused_on_rank_1(rank, world_size):
    from hf_zero import ZeroBucketOptimizer

    torch.manual_seed(0)
    model = _BigUnused()
    opt = ZeroBucketOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, stage=2)
    opt.bind_module(model, bucket_cap_mb=0.001)
    for _ in range(3):
        # Freed memory of the big bucket's size, full of NaN: a bucket the reducer does not zero reads it.
        torch.full((4096,), float("nan"), dtype=torch.float64)
        model(torch.ones(2, 4, dtype=torch.float64), use_big=rank == 0).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.big.detach().clone()


@pytest.mark.timeout(120)
def test_a_param_above_the_cap_unused_on_one_rank_gets_zeros_from_it_not_stale_memory():
    """Rank 0's loss adds big.sum() (grad 1), rank 1's leaves big out: the average is 1/2 on every
    element, 3 SGD steps of lr 0.1 move big to -0.15. Its bucket is one param above the cap, taken
    fresh, not from the pool: the slot of the grad that never came must be zeroed there too."""
    for big in run_ranks(_big_unused_on_rank_1, 2, timeout=100):
        expected = torch.full((4096,), -3 * 0.1 * 0.5, dtype=torch.float64)
        assert torch.allclose(big, expected, rtol=0, atol=1e-15), (big - expected).abs().max()


def _small_all_reduces_per_step(rank, world_size):
    """The all-reduces of 3 steps (backward, clipping, step), with clipping on, then off."""
    from benchmarks._common import CollectiveCounter

    counter = CollectiveCounter()
    model = build_model("mlp")
    opt = make_zero(Setup(), model, stage=2)
    opt.bind_module(model, bucket_cap_mb=BUCKET_MB)
    seen = {}
    for clip in (True, False):
        seen[clip] = []
        for step in range(3):
            loss = model(*shard_of(model.batch(step, BATCH * world_size), rank))
            with counter.recording():
                loss.backward()
                if clip:
                    opt.clip_grad_norm_(0.05)
                opt.step()
            seen[clip].append(sorted(payload for name, payload, _ in counter.calls if name == "all_reduce"))
            opt.zero_grad()
    counter.uninstall()
    return seen, len(list(model.parameters()))


@pytest.mark.timeout(120)
def test_clipping_carries_the_presence_agreement_so_a_step_costs_one_small_all_reduce():
    """[Note: agreeing on presence]: the first backward's layout check (48 bytes) is an all-reduce carrying the
    presence flags (int64); from the second on a reduce bucket carries the check ([Note: the check rides a
    bucket]), and MLP.unused (never reached) leaves the flags partial, so they ride the norm's all-reduce (a
    float64 scalar, plus one float64 flag per param) when clipping, or are agreed at the step (one float32 flag
    per param) otherwise. MLP.unused keeps its value: test_stage2_matches_reference's clipping cases compare it
    with the reference."""
    for seen, count in run_ranks(_small_all_reduces_per_step, 2, timeout=100):
        norm = 8 * (1 + count)
        assert seen[True] == [sorted([48 + 8 * count, norm]), [norm], [norm]], seen[True]
        assert seen[False] == [[4 * count]] * 3, seen[False]


def _rank_1_answers_no_backward(rank, world_size, skip_model):
    model = build_model("mlp")
    opt = make_zero(Setup(), model, stage=2)
    opt.bind_module(model, bucket_cap_mb=BUCKET_MB)
    batch = shard_of(model.batch(0, BATCH * world_size), rank)
    if rank == 1 and skip_model:  # this rank skips the batch and goes straight to the step
        opt.step()
    loss = model(*batch)
    if rank == 1:  # a loss that does not come from the model's outputs: nothing of the model's backward runs here
        loss = torch.zeros((), dtype=torch.float64, requires_grad=True) * 2
    loss.backward()  # rank 0 waits here for rank 1's reduce-scatters
    opt.clip_grad_norm_(1.0)
    opt.step()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("skip_model", [False, True], ids=["loss-not-from-the-outputs", "model-skipped"])
def test_a_rank_whose_backward_misses_the_model_is_a_clear_error_not_a_hang(skip_model):
    """[Note: a forward without its backward]: rank 1's backward does not go through the model's
    outputs (its loss comes from elsewhere), or rank 1 skips the model and steps. Rank 1 raises at
    clipping or the step, naming the cause, at once, where rank 0 would otherwise wait in its
    backward for the 90 s collective timeout (a launcher then stops rank 0, as torchrun does when a
    rank fails)."""
    start = time.monotonic()
    with pytest.raises(RuntimeError) as failed:
        run_ranks(_rank_1_answers_no_backward, 2, skip_model, timeout=90)
    assert time.monotonic() - start < 45
    report = str(failed.value)
    cause = "no backward through the bound model's outputs" if skip_model else "no backward went through its outputs"
    assert "rank 1 failed" in report and cause in report, report


def _bf16_both_stages(rank, world_size):
    setup = BITWISE["mixed-bf16-masters"][0]
    return _stage1_run(rank, world_size, setup, 1), _stage2_run(rank, world_size, setup, 1)


@pytest.mark.timeout(150)
def test_bf16_grads_divided_as_they_are_copied_in_are_stage_1s_bits_at_three_ranks():
    """[Note: dividing as the grads come] in _stage2/reducer.py: stage 2 divides each bf16 grad by N as it
    copies it into its bucket, stage 1's comm hook divides the whole bucket in place: at 3 ranks
    (1/3 inexact) both give the same bits, so the bf16 params stepped through fp32 masters do too.
    (The model's fp32 params, divided after the sum, are not compared: at 3 ranks the two stages'
    buckets cut the sums differently.)"""
    initial = [p for p in params_of(build_model(BITWISE["mixed-bf16-masters"][0].model)) if p.dtype == torch.bfloat16]
    for stage1, stage2 in run_ranks(_bf16_both_stages, 3, timeout=130):
        bf16 = [(a, b) for a, b in zip(stage2, stage1) if a.dtype == torch.bfloat16]
        assert len(bf16) == len(initial) >= 2
        assert not all(torch.equal(a, p) for (a, _), p in zip(bf16, initial)), "nothing was trained"
        for i, (a, b) in enumerate(bf16):
            assert torch.equal(a, b), f"bf16 param {i}: max diff {(a.float() - b.float()).abs().max().item():.3g}"
