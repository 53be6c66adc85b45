"""Comm.reduce_scatter_: each rank ends with the mean over ranks of its own range, by every
primitive (point-to-point + sum, all_to_all_single + sum, native reduce_scatter with
staging, all-reduce), for
equal padded ranges (flat bucket layouts) and unequal ones (param mode), float64 exact."""

import pytest
import torch

from hf_zero._comm import Comm
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
        comm.reduce_scatter_by = how
        for name, make in BOUNDS.items():
            bounds = make(n, world_size)
            buf = _local(rank, n)
            fut = comm.reduce_scatter_(buf, bounds)
            assert fut.wait() is buf
            out[how, name] = (bounds, buf)
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
        for (how, name), (bounds, buf) in ((k, v) for k, v in out.items() if k != "mean"):
            lo, hi = min(bounds[rank], n), min(bounds[rank + 1], n)
            torch.testing.assert_close(buf[lo:hi], mean[lo:hi], rtol=0, atol=1e-15, msg=f"{how} {name}")
            if how == "all_reduce":
                torch.testing.assert_close(buf, mean, rtol=0, atol=1e-15)


def test_unknown_primitive_is_named_before_anything_changes():
    comm = Comm()
    comm.reduce_scatter_by = "carrier_pigeon"
    buf = torch.ones(4)
    with pytest.raises(ValueError, match="reduce_scatter_by must be"):
        comm.reduce_scatter_(buf, [0, 4])
    assert torch.equal(buf, torch.ones(4))
