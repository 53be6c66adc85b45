"""The layout planner as a pure function: ownership, balance, and torch's partition as a floor."""

import dataclasses
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_zero import _layout as layout_module
from hf_zero._layout import ParamSpec, plan_layout, torch_zero_loads

ALIGN_BYTES = 64


def real_torch_zero_loads(specs, world_size: int) -> list[int]:
    """Trainable elements per rank under torch's own ``ZeroRedundancyOptimizer`` partition.

    Independent of hf_zero: torch's class partitions meta-device params of the specs'
    sizes (frozen ones included, as torch counts them) over a single-process "fake"
    process group of ``world_size`` ranks, and its ``_partition_parameters()`` is read.
    """
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "real_torch_zero_loads needs the default process group for itself"
    groups: dict[int, list[torch.nn.Parameter]] = {}
    trainable: dict[int, bool] = {}
    for s in specs:
        p = torch.nn.Parameter(torch.empty(s.numel, device="meta"), requires_grad=s.trainable)
        trainable[id(p)] = s.trainable
        groups.setdefault(s.group, []).append(p)
    if not groups:
        return [0] * world_size
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        zero = ZeroRedundancyOptimizer([{"params": ps} for ps in groups.values()],
                                       optimizer_class=torch.optim.SGD, lr=0.1)
        per_rank = zero._partition_parameters()
    finally:
        dist.destroy_process_group()
    return [sum(p.numel() for g in rank for p in g["params"] if trainable[id(p)]) for rank in per_rank]


@functools.cache
def gpt2_specs(trainable: str) -> tuple[ParamSpec, ...]:
    """GPT-2 small (124M), built on the meta device. ``trainable``: ``"all"`` or
    ``"last-2-blocks+head"`` (the head is tied to the token embedding)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024))
    keep = ("transformer.h.10.", "transformer.h.11.", "transformer.ln_f.", "transformer.wte.")
    return tuple(
        ParamSpec(p.numel(), p.dtype, str(p.device), trainable == "all" or name.startswith(keep))
        for name, p in model.named_parameters()
    )


def check_ownership(specs, layout) -> None:
    """Every trainable element is owned by exactly one rank; nothing else is owned."""
    ws = layout.world_size
    covered = {i: [] for i, s in enumerate(specs) if s.trainable and s.numel > 0}
    keys = [(b.device, b.dtype) for b in layout.buffers]
    assert len(keys) == len(set(keys)) == len({(s.device, s.dtype) for i, s in enumerate(specs) if i in covered})
    for b, buf in enumerate(layout.buffers):
        assert len(buf.bounds) == ws + 1 and buf.bounds[0] == 0 and buf.bounds[-1] == buf.size
        assert all(lo <= hi for lo, hi in zip(buf.bounds, buf.bounds[1:]))
        ends = sorted((s.offset, s.offset + s.numel) for s in buf.slots)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:])), "slots overlap"
        assert not ends or ends[-1][1] <= buf.size
    slots = layout.slots()
    assert set(slots) == set(covered), "slots must be exactly the trainable, non-empty params"
    for rank in range(ws):
        for pc in layout.pieces(rank):
            buf = layout.buffers[pc.buffer]
            lo, hi = buf.range_of(rank)
            _, slot = slots[pc.index]
            assert (buf.device, buf.dtype) == (specs[pc.index].device, specs[pc.index].dtype)
            assert 0 <= pc.start < pc.stop <= specs[pc.index].numel
            assert pc.offset == slot.offset + pc.start and lo <= pc.offset and pc.offset + pc.numel <= hi
            covered[pc.index].append((pc.start, pc.stop))
    for i, ranges in covered.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == specs[i].numel, f"param {i} not fully owned"
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), f"param {i}: gap or overlap {ranges}"
    assert sum(layout.owned_elements()) == sum(specs[i].numel for i in covered)


def check_mode(specs, layout) -> None:
    if layout.shard == "flat":
        for buf in layout.buffers:
            assert buf.equal_ranges
            align = max(1, ALIGN_BYTES // buf.dtype.itemsize)
            assert all(b % align == 0 for b in buf.bounds)
            assert buf.size - sum(s.numel for s in buf.slots) < layout.world_size * align, "too much padding"
        for rank in range(layout.world_size):
            check_chunks(layout, layout.pieces(rank))
    else:
        for rank in range(layout.world_size):
            for pc in layout.pieces(rank):
                assert pc.start == 0 and pc.stop == specs[pc.index].numel, "param mode split a param"


def check_chunks(layout, pieces) -> None:
    """Flat pieces of CPU buffers are at most ``max_piece`` long; a param's range on a rank is
    split into consecutive chunks of one length (but the last), aligned where the range starts
    aligned. Pieces of other devices' buffers are never chunked."""
    on_cpu = [pc for pc in pieces if layout.buffers[pc.buffer].device == "cpu"]
    assert all(pc.numel <= layout.max_piece for pc in on_cpu), "a flat piece is longer than max_piece"
    others = [(pc.buffer, pc.index) for pc in pieces if layout.buffers[pc.buffer].device != "cpu"]
    assert len(others) == len(set(others)), "a piece of a non-CPU buffer was chunked"
    pieces = on_cpu
    runs: dict[int, list] = {}
    for pc in pieces:
        runs.setdefault(pc.index, []).append(pc)
    for run in runs.values():
        assert all(a.stop == b.start and a.offset + a.numel == b.offset for a, b in zip(run, run[1:]))
        assert len({pc.numel for pc in run[:-1]}) <= 1 and run[-1].numel <= run[0].numel
        total = run[-1].stop - run[0].start
        assert len(run) == -(-total // layout.max_piece), "more chunks than needed"
        align = max(1, ALIGN_BYTES // layout.buffers[run[0].buffer].dtype.itemsize)
        if run[0].offset % align == 0 and layout.max_piece % align == 0:
            assert all(pc.offset % align == 0 for pc in run), "chunks of an aligned range must start aligned"


spec_strategy = st.builds(
    ParamSpec,
    numel=st.one_of(st.integers(0, 40), st.integers(0, 5000)),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    device=st.sampled_from(["cpu", "cuda:0"]),
    trainable=st.booleans(),
    group=st.integers(0, 2),
)


@settings(max_examples=300, deadline=None)
@given(
    specs=st.lists(spec_strategy, max_size=30), world_size=st.integers(1, 9), shard=st.sampled_from(["flat", "param"])
)
def test_every_trainable_element_owned_exactly_once(specs, world_size, shard):
    layout = plan_layout(specs, world_size=world_size, shard=shard)
    check_ownership(specs, layout)
    check_mode(specs, layout)
    assert plan_layout(list(specs), world_size=world_size, shard=shard) == layout, "not a pure function"


@settings(max_examples=300, deadline=None)
@given(
    specs=st.lists(spec_strategy, max_size=30),
    world_size=st.integers(1, 9),
    shard=st.sampled_from(["flat", "param"]),
    max_piece=st.one_of(st.integers(1, 40), st.sampled_from([64, 256, 1000])),
)
def test_chunked_pieces_still_own_every_element_once(specs, world_size, shard, max_piece):
    layout = dataclasses.replace(plan_layout(specs, world_size=world_size, shard=shard), max_piece=max_piece)
    check_ownership(specs, layout)
    check_mode(specs, layout)  # param mode: whole params whatever max_piece says
    unchunked = dataclasses.replace(layout, max_piece=10**12)
    assert layout.owned_elements() == unchunked.owned_elements() and layout.balance() == unchunked.balance()


def test_large_flat_pieces_are_chunked_by_default():
    specs = [ParamSpec(16_000_005, torch.float32, "cpu", True), ParamSpec(3000, torch.float32, "cpu", True)]
    limit = layout_module._MAX_PIECE_ELEMENTS
    flat = plan_layout(specs, world_size=2, shard="flat")
    assert flat.max_piece == limit == 1 << 20
    for rank in range(2):
        pieces = flat.pieces(rank)
        assert max(pc.numel for pc in pieces) <= limit and len(pieces) >= 8
        check_chunks(flat, pieces)
    param = plan_layout(specs, world_size=2, shard="param")
    assert sorted(pc.numel for r in range(2) for pc in param.pieces(r)) == [3000, 16_000_005]


def test_chunk_limit_is_read_when_planning(monkeypatch):
    specs = [ParamSpec(100, torch.float32, "cpu", True)]
    monkeypatch.setattr(layout_module, "_MAX_PIECE_ELEMENTS", 16)
    layout = plan_layout(specs, world_size=1, shard="flat")
    assert [(pc.start, pc.stop) for pc in layout.pieces(0)] == [(a, min(a + 16, 100)) for a in range(0, 100, 16)]
    assert layout != dataclasses.replace(layout, max_piece=1 << 20), "the limit is part of the layout"


@settings(max_examples=150, deadline=None)
@given(specs=st.lists(spec_strategy, max_size=30), world_size=st.integers(1, 9))
def test_param_mode_never_worse_than_torch_partition(specs, world_size):
    loads = plan_layout(specs, world_size=world_size, shard="param").owned_elements()
    assert max(loads) <= max(real_torch_zero_loads(specs, world_size))


@settings(max_examples=150, deadline=None)
@given(specs=st.lists(spec_strategy, max_size=30), world_size=st.integers(1, 9))
def test_reimplemented_torch_partition_equals_torchs_own(specs, world_size):
    assert torch_zero_loads(specs, world_size=world_size) == real_torch_zero_loads(specs, world_size)


GPT2_CASES = [(t, n) for t in ("all", "last-2-blocks+head") for n in (8, 64)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trainable, world_size", GPT2_CASES)
def test_gpt2_flat_balance(trainable, world_size):
    specs = gpt2_specs(trainable)
    layout = plan_layout(specs, world_size=world_size, shard="flat")
    check_ownership(specs, layout)
    check_mode(specs, layout)
    assert layout.balance() <= 1.01


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trainable, world_size", GPT2_CASES)
def test_gpt2_param_mode_never_worse_than_torch(trainable, world_size):
    specs = gpt2_specs(trainable)
    layout = plan_layout(specs, world_size=world_size, shard="param")
    check_ownership(specs, layout)
    check_mode(specs, layout)
    torch_loads = real_torch_zero_loads(specs, world_size)
    assert torch_zero_loads(specs, world_size=world_size) == torch_loads
    assert sum(torch_loads) == sum(layout.owned_elements())
    assert max(layout.owned_elements()) <= max(torch_loads)


def test_gpt2_frozen_params_are_not_planned():
    specs = gpt2_specs("last-2-blocks+head")
    trainable = sum(s.numel for s in specs if s.trainable)
    assert trainable < sum(s.numel for s in specs) / 2  # the premise: most of the model is frozen
    layout = plan_layout(specs, world_size=8, shard="flat")
    assert sum(b.size for b in layout.buffers) - trainable < 8 * ALIGN_BYTES // 4


def test_one_rank_owns_everything():
    specs = [ParamSpec(5, torch.float32, "cpu", True), ParamSpec(3, torch.float32, "cpu", False),
             ParamSpec(7, torch.float32, "cpu", True)]
    for shard in ("flat", "param"):
        layout = plan_layout(specs, world_size=1, shard=shard)
        assert [(pc.index, pc.start, pc.stop) for pc in layout.pieces(0)] == [(0, 0, 5), (2, 0, 7)]


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=0, shard="flat"), "world_size"),
    (dict(world_size=2, shard="rows"), "shard"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_layout([ParamSpec(4, torch.float32, "cpu", True)], **kwargs)


# -- layouts that follow DDP's gradient buckets ------------------------------------------
def check_bucket_layout(specs, buckets, layout) -> None:
    """Each bucket's buffer puts its trainable params at the bucket's own offsets (DDP's
    bucket buffer: the grads concatenated), ranges cover the bucket in rank order, and
    every trainable element is owned exactly once, by a piece inside its owner's range."""
    ws = layout.world_size
    assert layout.buckets == tuple(tuple(b) for b in buckets)
    owned = {i: [] for i, s in enumerate(specs) if s.trainable and s.numel > 0}
    in_bucket = {i for b in buckets for i in b}
    for k, bucket in enumerate(buckets):
        b = layout.bucket_buffer(k)
        trainable = [i for i in bucket if i in owned]
        if not trainable:
            assert b is None
            continue
        buf = layout.buffers[b]
        assert buf.bucket == k and (buf.device, buf.dtype) == (specs[bucket[0]].device, specs[bucket[0]].dtype)
        offsets, offset = {}, 0
        for i in bucket:
            offsets[i] = offset
            offset += specs[i].numel
        assert [(s.index, s.offset, s.numel) for s in buf.slots] == [(i, offsets[i], specs[i].numel) for i in trainable]
        assert buf.bounds[0] == 0 and buf.bounds[-1] == buf.size >= offset and len(buf.bounds) == ws + 1
        assert all(lo <= hi for lo, hi in zip(buf.bounds, buf.bounds[1:]))
        if layout.shard == "flat":
            align = max(1, ALIGN_BYTES // buf.dtype.itemsize)
            assert buf.equal_ranges and all(x % align == 0 for x in buf.bounds)
            assert buf.size - offset < ws * align, "padding beyond one alignment unit per rank"
        else:
            assert buf.size == offset
    extra = [buf for buf in layout.buffers if buf.bucket is None]
    assert {s.index for buf in extra for s in buf.slots} == set(owned) - in_bucket
    for rank in range(ws):
        for pc in layout.pieces(rank):
            buf = layout.buffers[pc.buffer]
            lo, hi = buf.range_of(rank)
            assert lo <= pc.offset and pc.offset + pc.numel <= hi
            owned[pc.index].append((pc.start, pc.stop))
            if layout.shard == "param":
                assert (pc.start, pc.stop) == (0, specs[pc.index].numel), "param mode split a param"
    for i, ranges in owned.items():
        ranges.sort()
        assert ranges and ranges[0][0] == 0 and ranges[-1][1] == specs[i].numel, f"param {i} not fully owned"
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), f"param {i}: gap or overlap {ranges}"


@st.composite
def specs_and_buckets(draw):
    specs = draw(st.lists(spec_strategy, max_size=30))
    by_kind: dict = {}
    for i, s in enumerate(specs):
        if draw(st.booleans()):  # in some DDP bucket (DDP buckets params trainable when it was built)
            by_kind.setdefault((s.device, s.dtype), []).append(i)
    buckets = []
    for indices in by_kind.values():
        indices = draw(st.permutations(indices))
        while indices:
            n = draw(st.integers(1, len(indices)))
            buckets.append(indices[:n])
            indices = indices[n:]
    return specs, draw(st.permutations(buckets))


@settings(max_examples=300, deadline=None)
@given(case=specs_and_buckets(), world_size=st.integers(1, 9), shard=st.sampled_from(["flat", "param"]),
       max_piece=st.one_of(st.just(1 << 20), st.integers(1, 40)))
def test_bucket_layout_owns_every_element_once_at_bucket_offsets(case, world_size, shard, max_piece):
    specs, buckets = case
    layout = plan_layout(specs, world_size=world_size, shard=shard, buckets=buckets)
    check_bucket_layout(specs, buckets, dataclasses.replace(layout, max_piece=max_piece))
    assert plan_layout(list(specs), world_size=world_size, shard=shard, buckets=buckets) == layout, "not pure"
    # A bucket's ranges do not depend on which of its params are trainable.
    flipped = [dataclasses.replace(s, trainable=not s.trainable) for s in specs]
    other = plan_layout(flipped, world_size=world_size, shard=shard, buckets=buckets)
    for k in range(len(buckets)):
        a, b = layout.bucket_buffer(k), other.bucket_buffer(k)
        if a is not None and b is not None:
            assert layout.buffers[a].bounds == other.buffers[b].bounds


def ddp_buckets(specs, cap_bytes=25 * 2**20, first_cap_bytes=2**20):
    """DDP's first bucketing (reverse param order, a size cap per bucket), for planning tests."""
    buckets, current, size, cap = [], [], 0, first_cap_bytes
    for i in reversed(range(len(specs))):
        if not specs[i].trainable:
            continue
        current.append(i)
        size += specs[i].numel * specs[i].dtype.itemsize
        if size >= cap:
            buckets.append(current)
            current, size, cap = [], 0, cap_bytes
    return buckets + ([current] if current else [])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trainable, world_size", GPT2_CASES)
def test_gpt2_bucket_layout_balance(trainable, world_size):
    specs = gpt2_specs(trainable)
    buckets = ddp_buckets(specs)
    flat = plan_layout(specs, world_size=world_size, shard="flat", buckets=buckets)
    check_bucket_layout(specs, buckets, flat)
    assert flat.balance() <= 1.01
    param = plan_layout(specs, world_size=world_size, shard="param", buckets=buckets)
    check_bucket_layout(specs, buckets, param)
    assert max(param.owned_elements()) <= max(real_torch_zero_loads(specs, world_size))


def test_bucket_layout_example():
    """Two buckets in DDP's reverse order, a frozen param as a hole, one param in no bucket."""
    f32 = torch.float32
    specs = [ParamSpec(10, f32, "cpu", True), ParamSpec(6, f32, "cpu", False), ParamSpec(4, f32, "cpu", True),
             ParamSpec(16, f32, "cpu", True), ParamSpec(5, f32, "cpu", True)]
    layout = plan_layout(specs, world_size=2, shard="flat", buckets=[[3], [2, 1, 0]])
    a, b, extra = layout.buffers
    assert (a.bucket, a.size, a.bounds, [(s.index, s.offset) for s in a.slots]) == (0, 32, (0, 16, 32), [(3, 0)])
    assert (b.bucket, b.bounds, [(s.index, s.offset) for s in b.slots]) == (1, (0, 16, 32), [(2, 0), (0, 10)])
    assert extra.bucket is None and [s.index for s in extra.slots] == [4]
    assert [(p.index, p.start, p.stop) for p in layout.pieces(1) if p.buffer == 1] == [(0, 6, 10)]
    param = plan_layout(specs, world_size=2, shard="param", buckets=[[3], [2, 1, 0]])
    # Largest bucket first, cut on a param boundary (the hole counts: ranges ignore trainability).
    assert [buf.bounds for buf in param.buffers[:2]] == [(0, 16, 16), (0, 10, 20)]
    assert [(p.index, p.start, p.stop) for p in param.pieces(1) if p.buffer < 2] == [(0, 0, 10)]


@pytest.mark.parametrize("buckets, match", [
    ([[0, 5]], r"buckets\[0\] names param 5"),
    ([[0], [0]], "param 0 is in more than one bucket"),
    ([[0, 1]], r"buckets\[0\] mixes devices/dtypes"),
])
def test_bad_buckets_are_named(buckets, match):
    specs = [ParamSpec(4, torch.float32, "cpu", True), ParamSpec(4, torch.float64, "cpu", True)]
    with pytest.raises(ValueError, match=match):
        plan_layout(specs, world_size=2, shard="flat", buckets=buckets)


# -- which optimizers may be sharded flat ------------------------------------------------
class LarsSGD(torch.optim.SGD):
    """A LARS-style per-tensor trust ratio over SGD: the update of an element depends on
    its whole param's norm, so updating slices of a param separately is wrong."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    trust = p.norm() / (p.grad.norm() + 1e-12)
                    p.add_(p.grad * trust, alpha=-group["lr"])


class DeclaredSGD(torch.optim.SGD):
    hf_zero_elementwise = True  # only changes a default: still elementwise, and says so


class InheritsDeclaration(DeclaredSGD):
    pass


def test_flat_only_for_exact_or_declared_elementwise_classes():
    from hf_zero._layout import is_elementwise

    assert is_elementwise(torch.optim.SGD) and is_elementwise(torch.optim.AdamW) and is_elementwise(torch.optim.Adam)
    assert not is_elementwise(LarsSGD), "a subclass is not its base"
    assert is_elementwise(DeclaredSGD)
    assert not is_elementwise(InheritsDeclaration), "the declaration belongs to the class that makes it"
    assert not is_elementwise(torch.optim.LBFGS)


def test_flat_on_an_undeclared_subclass_is_a_clear_error():
    from hf_zero import ZeroBucketOptimizer

    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="shard='flat'.*LarsSGD.*not known.*shard='param'.*hf_zero_elementwise = True"):
        ZeroBucketOptimizer(model.parameters(), LarsSGD, shard="flat", lr=0.1)
    assert ZeroBucketOptimizer(model.parameters(), LarsSGD, lr=0.1).shard == "param"
    assert ZeroBucketOptimizer(model.parameters(), DeclaredSGD, lr=0.1).shard == "flat"


def _lars(rank, world_size):
    """(shard mode, params) of 3 steps with shard="auto", and with "flat" forced past the check."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zero import ZeroBucketOptimizer
    from tests.models import BATCH, build_model, shard_of

    out = {}
    for mode in ("auto", "forced-flat"):
        model = build_model("mlp")
        ddp = DDP(model, find_unused_parameters=True)
        opt = ZeroBucketOptimizer(model.parameters(), LarsSGD, lr=0.1)
        if mode == "forced-flat":  # what "auto" chose before (issubclass): shows the comparison can fail
            opt.shard = "flat"
        for step in range(3):
            ddp(*shard_of(model.batch(step, BATCH * world_size), rank)).backward()
            opt.step()
            opt.zero_grad()
        out[mode] = opt.shard, [p.detach().clone() for p in model.parameters()]
    return out


@pytest.mark.timeout(60)
def test_lars_like_subclass_with_auto_shard_equals_one_process():
    from tests._dist import run_ranks
    from tests.models import BATCH, build_model

    model = build_model("mlp")
    ref = LarsSGD(model.parameters(), lr=0.1)
    for step in range(3):
        model(*model.batch(step, BATCH * 2)).backward()
        ref.step()
        ref.zero_grad()
    want = [p.detach() for p in model.parameters()]
    for got in run_ranks(_lars, 2, timeout=50):
        shard, params = got["auto"]
        assert shard == "param"
        for i, (g, w) in enumerate(zip(params, want)):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=f"param {i}")
        assert any((g - w).abs().max() > 1e-6 for g, w in zip(got["forced-flat"][1], want)), "flat would be right too"
