"""Comm.reduce_scatter_: each rank ends with the mean over ranks of its own range, by every
primitive (point-to-point + sum, all_to_all_single + sum, native reduce_scatter with
staging, all-reduce), for
equal padded ranges (flat bucket layouts) and unequal ones (param mode), float64 exact;
the receive scratch stays within one bucket's however many buckets are in flight, and
point-to-point's within its bound however large a bucket is."""

import pytest
import torch

from hf_zero import _comm
from hf_zero._comm import Comm, Strategy
from tests._dist import run_ranks

BOUNDS = {
    "equal-exact": lambda n, w: [r * (n // w) for r in range(w + 1)],
    "equal-padded": lambda n, w: [r * (n // w + 3) for r in range(w + 1)],
    "unequal-with-empty": lambda n, w: [0] + [min(n, 2 + 5 * r * r) for r in range(1, w)] + [n],
}


def _local(rank, n):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(n, generator=g, dtype=torch.float64)


def _run(rank, world_size, n):
    comm = Comm()
    out = {}
    for how in ("send_recv", "all_to_all", "reduce_scatter", "all_reduce"):
        comm.use_strategy(Strategy(reduce_scatter_by=how))
        for name, make in BOUNDS.items():
            bounds = make(n, world_size)
            buf = _local(rank, n)
            fut = comm.reduce_scatter_(buf, bounds)
            assert fut.wait() is buf
            out[how, name] = (bounds, buf)
            # out=: the mean of this rank's range lands there (the same bits), the rest of buf untouched
            buf = _local(rank, n)
            lo, hi = min(bounds[rank], n), min(bounds[rank + 1], n)
            into = torch.full((hi - lo,), float("nan"), dtype=torch.float64)
            assert comm.reduce_scatter_(buf, bounds, out=into).wait() is buf
            rest = torch.cat([buf[:lo], buf[hi:]]) if how != "all_reduce" else None
            out[how, name, "out"] = (bounds, into, rest)
    buf = _local(rank, n)
    comm.all_reduce_mean_(buf).wait()
    out["mean"] = buf
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_each_rank_gets_the_mean_of_its_range(world_size):
    n = 24 * world_size
    per_rank = run_ranks(_run, world_size, n, timeout=100)
    mean = sum(_local(r, n) for r in range(world_size)) / world_size
    for rank, out in enumerate(per_rank):
        torch.testing.assert_close(out["mean"], mean, rtol=0, atol=1e-15)
        for key, value in ((k, v) for k, v in out.items() if k != "mean"):
            how, name = key[:2]
            lo, hi = min(value[0][rank], n), min(value[0][rank + 1], n)
            if len(key) == 3:  # out=
                bounds, into, rest = value
                assert torch.equal(into, out[how, name][1][lo:hi]), f"{how} {name}: out= differs from in place"
                if rest is not None:
                    own = _local(rank, n)
                    torch.testing.assert_close(rest, torch.cat([own[:lo], own[hi:]]), rtol=0, atol=0)
                continue
            bounds, buf = value
            torch.testing.assert_close(buf[lo:hi], mean[lo:hi], rtol=0, atol=1e-15, msg=f"{how} {name}")
            if how == "all_reduce":
                torch.testing.assert_close(buf, mean, rtol=0, atol=1e-15)


def test_out_of_the_wrong_size_is_refused_before_anything_is_sent():
    comm = Comm()  # world size 1: no process group needed
    with pytest.raises(ValueError, match="out must be 1-D with 8 elements of torch.float64"):
        comm.reduce_scatter_(torch.zeros(8, dtype=torch.float64), [0, 8], out=torch.zeros(7, dtype=torch.float64))
    into = torch.zeros(8, dtype=torch.float64)
    comm.reduce_scatter_(torch.arange(8, dtype=torch.float64), [0, 8], out=into).wait()
    assert torch.equal(into, torch.arange(8, dtype=torch.float64))


def test_unknown_primitive_is_named_when_the_strategy_is_made():
    with pytest.raises(ValueError, match="reduce_scatter_by must be one of"):
        Strategy(reduce_scatter_by="carrier_pigeon")
    with pytest.raises(ValueError, match="sync_by must be one of"):
        Strategy(sync_by="carrier_pigeon")
    with pytest.raises(TypeError, match="strategy must be"):
        Comm(strategy="send_recv")


BUCKETS = (40, 96, 24, 96, 8)  # elements, fp64; and one bf16 bucket after them


def _in_flight(rank, world_size, how, scratch_bytes=None):
    """Start a reduce-scatter per bucket without waiting (as DDP's hooks do during a
    backward), recording the scratch held after each start; then wait for all.
    ``scratch_bytes``: the point-to-point scratch bound, shrunk so that buckets come in pieces."""
    if scratch_bytes is not None:
        _comm._SCRATCH_BYTES = scratch_bytes
    comm = Comm(strategy=Strategy(reduce_scatter_by=how))
    held, pendings, bufs = [], [], []
    for k, n in enumerate(BUCKETS):
        buf = _local(rank * 10 + k, n)
        bounds = [min(n, r * -(-n // world_size)) for r in range(world_size)] + [n]
        pendings.append(comm.reduce_scatter_(buf, bounds))
        bufs.append((bounds, buf))
        held.append(comm.scratch_bytes())
    low = _local(rank * 10 + 9, 64).to(torch.bfloat16)
    pendings.append(comm.reduce_scatter_(low, [min(64, r * -(-64 // world_size)) for r in range(world_size)] + [64]))
    held.append(comm.scratch_bytes())
    for p in pendings:
        p.wait()
    assert pendings[0].wait() is bufs[0][1]  # a second wait gives the same result
    return held, bufs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["send_recv", "all_to_all"])
def test_scratch_is_at_most_one_bucket_with_every_bucket_in_flight(how):
    world_size = 2
    per_rank = run_ranks(_in_flight, world_size, how, timeout=100)
    # all_to_all receives this rank's own chunk too: world * chunk elements, chunk = ceil(n / world).
    per_elem = 8
    largest = max(BUCKETS) * per_elem if how == "all_to_all" else max(BUCKETS) * per_elem * (world_size - 1) // world_size
    everything = sum(BUCKETS) * per_elem * (world_size - 1) // world_size
    for rank, (held, bufs) in enumerate(per_rank):
        assert max(held) <= largest < everything, held
        assert held[-1] == max(held)  # one store, reused for the bf16 bucket (no second one)
        for k, (bounds, buf) in enumerate(bufs):
            mean = sum(_local(r * 10 + k, BUCKETS[k]) for r in range(world_size)) / world_size
            lo, hi = bounds[rank], bounds[rank + 1]
            torch.testing.assert_close(buf[lo:hi], mean[lo:hi], rtol=0, atol=1e-15)


def _whole_then_pieces(rank, world_size, bound):
    return _in_flight(rank, world_size, "send_recv"), _in_flight(rank, world_size, "send_recv", bound)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_buckets_above_the_scratch_bound_come_in_pieces_bitwise(world_size):
    # 96 fp64 elements per bound of 128 bytes: 2-8 pieces a range, whole below it; all in flight.
    bound = 128
    per_rank = run_ranks(_whole_then_pieces, world_size, bound, timeout=100)
    for rank, (whole, pieces) in enumerate(per_rank):
        held, bufs = pieces
        assert 0 < max(held) <= bound, held
        assert max(whole[0]) > bound  # without the bound the largest receive is bigger
        for (bounds, buf), (_, ref) in zip(bufs, whole[1]):
            assert torch.equal(buf, ref)  # the same sums in the same order: bitwise


def _bf16_into_float32(rank, world_size, n):
    """A bf16 bucket reduce-scattered into a float32 ``out`` by every primitive, then a second one added
    (``accumulate``): [Note: summing wider] in _comm.py."""
    comm = Comm()
    bounds = [r * (n // world_size) for r in range(world_size + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]
    out = {}
    for how in ("send_recv", "all_to_all", "reduce_scatter", "all_reduce"):
        comm.use_strategy(Strategy(reduce_scatter_by=how))
        into = torch.full((hi - lo,), float("nan"), dtype=torch.float32)
        comm.reduce_scatter_(_local(rank, n).bfloat16(), bounds, out=into).wait()
        first = into.clone()
        comm.reduce_scatter_(_local(rank + world_size, n).bfloat16(), bounds, out=into, accumulate=True).wait()
        out[how] = (first, into)
    return out


@pytest.mark.timeout(120)
def test_a_bf16_bucket_sums_in_float32_into_a_float32_out():
    """Point-to-point (gloo's CPU path) sums two ranks' bf16 halves in float32, exactly (a/2 + b/2 of
    two bf16 values needs at most 17 significant bits here), and ``accumulate`` adds the next bucket's
    exact mean; the other primitives sum in bf16 and add their rounded mean (the documented limit)."""
    n, world_size = 48, 2
    per_rank = run_ranks(_bf16_into_float32, world_size, n, timeout=100)
    halves = [[_local(r + k * world_size, n).bfloat16().double() / 2 for r in range(world_size)] for k in (0, 1)]
    exact = [h[0] + h[1] for h in halves]
    rounded = [e.bfloat16().double() for e in exact]
    for rank, out in enumerate(per_rank):
        lo, hi = rank * n // 2, (rank + 1) * n // 2
        first, both = out["send_recv"]
        assert torch.equal(first.double(), exact[0][lo:hi])
        torch.testing.assert_close(both.double(), (exact[0] + exact[1])[lo:hi], rtol=2.0**-24, atol=0)
        assert not torch.equal(rounded[0][lo:hi], exact[0][lo:hi])  # bf16 would have rounded the sum
        for how in ("all_to_all", "reduce_scatter", "all_reduce"):
            first, both = out[how]
            assert torch.equal(first.double(), rounded[0][lo:hi]), how
            torch.testing.assert_close(both.double(), (rounded[0] + rounded[1])[lo:hi], rtol=2.0**-24, atol=0)


def test_accumulate_needs_a_float32_out_of_a_16_bit_bucket():
    comm = Comm()  # world size 1: no process group needed
    with pytest.raises(ValueError, match="or float32, as accumulate needs"):
        comm.reduce_scatter_(torch.zeros(8, dtype=torch.bfloat16), [0, 8], out=torch.zeros(8, dtype=torch.bfloat16),
                             accumulate=True)
    with pytest.raises(ValueError, match="or float32, as accumulate needs"):
        comm.reduce_scatter_(torch.zeros(8, dtype=torch.float64), [0, 8], out=torch.zeros(8), accumulate=True)
    into = torch.ones(8)
    comm.reduce_scatter_(torch.full((8,), 0.5, dtype=torch.bfloat16), [0, 8], out=into, accumulate=True).wait()
    assert torch.equal(into, torch.full((8,), 1.5))
