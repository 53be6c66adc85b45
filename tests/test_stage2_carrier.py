"""Stage 2's layout check rides a reduce bucket ([Note: the check rides a bucket] in hf_zero/_stage2/carrier.py):
a steady backward makes no collective of its own for it, and a rank that changes alone still gets the same clear
error as every other rank, before the step changes anything, with no hang.

- The geometry (pure): every grad element lands once, outside every header; each rank's range ends with its
  header; equal ranges stay equal.
- The exactness of the moved bucket is proven by tests/test_stage2.py (float64 against the reference at 2 and 3
  ranks, several buckets per model, grads straddling ranks), test_stage2_accumulation.py and the bf16 and
  bitwise-stage-1 tests there: they all run through the carrier.
- Here: the collectives of a steady step (none for the check where a bucket carries it; the all-reduce where
  none can), and one-sided changes at 3 ranks, with the carrier past a one-grad bucket and without a carrier.
"""

import random

import pytest
import torch

import hf_zero
from hf_zero._layout import ParamSpec, plan_layout
from hf_zero._stage2.carrier import HEADER, carrier_of
from hf_zero._stage2.plan import plan_buckets
from tests._dist import run_ranks


def _specs(rng: random.Random, count: int) -> list[ParamSpec]:
    return [ParamSpec(rng.randint(0, 40), torch.float32, "cpu", rng.random() < 0.85) for _ in range(count)]


@pytest.mark.fast
@pytest.mark.parametrize("shard", ["flat", "param"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_grad_element_lands_once_outside_the_headers(shard, world_size):
    rng, carried = random.Random(world_size * 10 + len(shard)), 0
    for _ in range(40):
        specs = _specs(rng, rng.randint(2, 12))
        buckets = plan_buckets(specs, cap_bytes=rng.choice([64, 200, 10_000]))
        if not buckets:
            continue
        layout = plan_layout(specs, world_size=world_size, shard=shard, buckets=buckets)
        carriers = [carrier_of(layout.buffers, r, world_size) for r in range(world_size)]
        if carriers[0] is None:
            assert all(len(b.slots) < 2 for b in layout.buffers)
            continue
        c = carriers[0]
        buf = layout.buffers[c.bucket]
        assert len(buf.slots) > 1 and all(len(b.slots) < 2 for b in layout.buffers[: c.bucket])
        assert all(o.bounds == c.bounds and o.parts == c.parts and o.gaps == c.gaps for o in carriers)
        assert c.size == c.bounds[-1] == buf.bounds[-1] + HEADER * world_size
        owner = [None] * c.size  # what each element of the carried bucket holds
        for s in buf.slots:
            moved = c.parts[s.index]
            assert all(n > 0 for _, _, n in moved) and sum(n for _, _, n in moved) == s.numel
            assert [start for _, start, _ in moved] == [sum(n for _, _, n in moved[:j]) for j in range(len(moved))]
            for at, start, n in moved:
                for e in range(n):
                    assert owner[at + e] is None
                    owner[at + e] = (s.index, start + e)
                    element = s.offset + start + e  # as planned: rank r's range moves by r headers
                    r = max(q for q in range(world_size) if buf.bounds[q] <= element)
                    assert at + e == element + HEADER * r
        for a, z in c.gaps:
            assert all(owner[e] is None for e in range(a, z))
            for e in range(a, z):
                owner[e] = "gap"
        assert all(o is not None for o in owner), "every element is a grad's or zeroed"
        for r in range(world_size):
            lo, hi = c.bounds[r], c.bounds[r + 1]
            assert c.heads[r] == hi - HEADER and all(owner[e] == "gap" for e in range(hi - HEADER, hi))
            assert carriers[r].shard == hi - lo
            grads = [o for o in owner[lo : hi - HEADER] if o != "gap"]
            planned = buf.bounds[r], buf.bounds[r + 1]
            assert all(planned[0] <= buf.slots[[s.index for s in buf.slots].index(i)].offset + e < planned[1]
                       for i, e in grads), "a rank's range holds the grads it owns as planned"
        if buf.equal_ranges:
            assert len({b - a for a, b in zip(c.bounds, c.bounds[1:])}) == 1, "NCCL's equal ranges stay equal"
        carried += 1
    assert carried >= 10, "the premise: most random plans have a carrier"


@pytest.mark.fast
def test_one_rank_or_one_grad_buckets_have_no_carrier():
    specs = [ParamSpec(8, torch.float32, "cpu", True), ParamSpec(8, torch.float32, "cpu", True)]
    layout = plan_layout(specs, world_size=2, shard="flat", buckets=plan_buckets(specs, cap_bytes=32))
    assert carrier_of(layout.buffers, 0, 2) is None
    layout = plan_layout(specs, world_size=1, shard="flat", buckets=plan_buckets(specs, cap_bytes=1 << 20))
    assert carrier_of(layout.buffers, 0, 1) is None


# -- on ranks ----------------------------------------------------------------------------------------------
# bucket caps (MB) for _model() in float32, last param first: 2.weight (72 bytes), 1.bias, 1.weight, 0.bias (24
# each), 0.weight (144). One bucket of every grad; a one-grad first bucket, then the carrier; every bucket one
# grad (no carrier: the check keeps its all-reduce).
CAPS = {"one-bucket": 25.0, "carrier-second": 80 / (1 << 20), "no-carrier": 1 / (1 << 20)}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 3, bias=False))


def _steady_collectives(rank, world_size, cap):
    from benchmarks._common import CollectiveCounter

    model = _model()
    opt = hf_zero.ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW, lr=0.1, stage=2)
    opt.bind_module(model, bucket_cap_mb=cap)
    counter, steps = CollectiveCounter(), []
    try:
        for step in range(4):
            with counter.recording():
                model(torch.ones(3, 6) * (rank + step)).sum().backward()
                opt.step()
            steps.append([name for name, _, _ in counter.calls])
            opt.zero_grad()
        return steps, len(opt.gradient_path.wanted_buckets)
    finally:
        counter.uninstall()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", CAPS)
def test_a_steady_backward_makes_no_collective_for_the_check_where_a_bucket_carries_it(layout):
    for steps, buckets in run_ranks(_steady_collectives, 2, CAPS[layout], timeout=90):
        assert buckets == 1 if layout == "one-bucket" else buckets > 1
        assert steps[0].count("all_reduce") == 1, steps[0]  # the first backward's check: nothing agreed yet
        for calls in steps[1:]:
            assert calls.count("all_reduce") == (layout == "no-carrier"), calls
            assert calls.count("irecv") >= buckets, calls  # every bucket reduce-scattered (and the sync)


def _change_alone(rank, world_size, cap, changing, change):
    model = _model()
    if change == "unfreeze":
        model[0].weight.requires_grad_(False)
    opt = hf_zero.ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW, lr=0.1, stage=2)
    opt.bind_module(model, bucket_cap_mb=cap)
    for step in range(4):
        if step == 2 and rank in changing:
            model[0].weight.requires_grad_(change == "unfreeze")
        before = [p.detach().clone() for p in model.parameters()]
        try:
            model(torch.ones(3, 6) * (rank + 1)).sum().backward()
            opt.step()
        except RuntimeError as e:
            return step, str(e), all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        opt.zero_grad()
    return None


@pytest.mark.reliability("Stage 2, 3 ranks, buckets {layout}: rank(s) {changing} {change} a layer alone",
                         "every rank raises the same RuntimeError naming the param before the step changes anything, "
                         "no hang")
@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout", CAPS)
@pytest.mark.parametrize("changing,change", [("1", "freeze"), ("0 and 2", "freeze"), ("2", "unfreeze")])
def test_ranks_changing_alone_fail_on_every_rank_at_three_ranks(layout, changing, change):
    changing = tuple(int(r) for r in changing.split(" and "))
    results = run_ranks(_change_alone, 3, CAPS[layout], changing, change, timeout=120)
    assert results[0] is not None and all(r == results[0] for r in results), results
    step, message, unchanged = results[0]
    assert step == 2 and unchanged
    assert "ranks disagree on parameter 0.weight" in message
    for r in range(3):
        trainable = (r in changing) == (change == "unfreeze")
        assert f"rank {r}: shape=(6, 6), dtype=torch.float32, device=cpu, requires_grad={trainable}" in message


def _all_change(rank, world_size, cap):
    model = _model()
    opt = hf_zero.ZeroBucketOptimizer(model.named_parameters(), torch.optim.SGD, lr=0.1, stage=2)
    opt.bind_module(model, bucket_cap_mb=cap)
    for step in range(4):
        model[0].weight.requires_grad_(step != 2)  # every rank alike: the check agrees, the buckets re-plan
        model(torch.ones(3, 6) * (rank + 1)).sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _all_change_reference(world_size, cap):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        model[0].weight.requires_grad_(step != 2)
        sum(model(torch.ones(3, 6) * (r + 1)).sum() for r in range(world_size)).div(world_size).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", CAPS)
def test_every_rank_changing_alike_re_plans_and_matches_the_reference(layout):
    results = run_ranks(_all_change, 3, CAPS[layout], timeout=90)
    for got in results:
        for a, b in zip(got, _all_change_reference(3, CAPS[layout])):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _two_optimizers(rank, world_size, freeze_on):
    """Two stage-2 optimizers over two modules, one loss: their reductions interleave in one backward, so each
    keeps the check's all-reduce; a rank freezing alone still fails on every rank."""
    from benchmarks._common import CollectiveCounter

    torch.manual_seed(0)
    a, b = _model(), _model()
    opts = [hf_zero.ZeroBucketOptimizer(m.named_parameters(), torch.optim.AdamW, lr=0.1, stage=2) for m in (a, b)]
    for opt, m in zip(opts, (a, b)):
        opt.bind_module(m)
    counter, all_reduces = CollectiveCounter(), []
    try:
        for step in range(4):
            if step == 2 and rank == freeze_on:
                a[0].weight.requires_grad_(False)
            try:
                with counter.recording():
                    (a(torch.ones(3, 6) * (rank + 1)).sum() + b(torch.ones(3, 6)).sum()).backward()
                    for opt in opts:
                        opt.step()
            except RuntimeError as e:
                return step, str(e), all_reduces
            all_reduces.append([name for name, _, _ in counter.calls].count("all_reduce"))
            for opt in opts:
                opt.zero_grad()
        return None, None, all_reduces
    finally:
        counter.uninstall()


@pytest.mark.timeout(120)
def test_two_stage2_optimizers_in_one_backward_keep_the_checks_all_reduce():
    results = run_ranks(_two_optimizers, 2, None, timeout=90)
    assert results[0] == results[1] == (None, None, [2] * 4), results  # one check per reducer per backward


@pytest.mark.reliability("Two stage-2 optimizers over two models, one loss: rank 1 freezes a layer alone",
                         "every rank raises the same RuntimeError naming the param, no hang")
@pytest.mark.timeout(120)
def test_two_stage2_optimizers_one_rank_freezing_alone_fails_on_every_rank():
    results = run_ranks(_two_optimizers, 2, 1, timeout=90)
    assert results[0] == results[1], results
    step, message, all_reduces = results[0]
    assert all_reduces == [2, 2] and step == 2 and "ranks disagree on parameter 0.weight" in message
