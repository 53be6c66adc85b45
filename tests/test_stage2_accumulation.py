"""What stage 2 accumulates 16-bit grads in ([Note: what stage 2 accumulates in] in _stage2/reducer.py).

A bf16 model on 2 gloo ranks, 4 micro-batches per step, every micro-batch reduced (Trainer's
default under stage 2). The exact grad of a step is defined on the ranks themselves: each rank
sums the bf16 grads autograd hands its params (a tensor hook: the grad of one micro-batch, before
it reaches the reducer) in float64, and the sums are all-reduced in float64 and divided by the
number of ranks. ``grad_accum_dtype="fp32"`` must hold that sum in its float32 shards up to
float32's own roundings: one per addition, N x M of them (|error| <= N M 2^-24 sum |g|); the
16-bit shards of ``"param"`` round every partial sum to bf16 and miss that bound by orders of
magnitude. The float64 reference run writes the exact sum (rounded once to float32) into the
shards before each step: the same masters step on the exact sum. Stage 2 with
``grad_accum_dtype="param"`` equal to stage 1 bit for bit is tests/test_stage2.py's BITWISE table.
"""

import pytest
import torch

from hf_zero import ZeroBucketOptimizer
from hf_zero.integrations import transformers as hf_tr
from tests._dist import run_ranks

STEPS, ACCUMULATE, MICRO, LR = 5, 4, 3, 1e-2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).to(torch.bfloat16)


def _micro_batch(step: int, rank: int, m: int):
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + m)
    return torch.randn(MICRO, 16, generator=g).bfloat16(), torch.randn(MICRO, 8, generator=g).bfloat16()


def _train(rank, world_size, *, grad_accum_dtype, exact_into_shards=False, master_weights=True, steps=STEPS):
    """Train; per step, the largest |shard - exact| / (2^-24 sum |g|) over this rank's elements and the
    count of elements not equal to the exact sum rounded to float32. ``exact_into_shards``: the reference
    (the reducer reduces zeros; the exact sum, rounded once to float32, is written into the shards)."""
    import torch.distributed as dist

    model = _model()
    params = list(model.parameters())
    sums: dict[int, torch.Tensor] = {}
    sizes: dict[int, torch.Tensor] = {}

    def capture(i):
        def hook(g):
            d = g.double()
            sums[i] = d if i not in sums else sums[i].add_(d)
            sizes[i] = d.abs() if i not in sizes else sizes[i].add_(d.abs())
            return torch.zeros_like(g) if exact_into_shards else None
        return hook

    for i, p in enumerate(params):
        p.register_hook(capture(i))
    opt = ZeroBucketOptimizer(params, torch.optim.AdamW, lr=LR, weight_decay=0.1, stage=2,
                              grad_accum_dtype=grad_accum_dtype, master_weights=master_weights)
    opt.bind_module(model, bucket_cap_mb=0.002)  # a few buckets
    ratios, inexact = [], []
    for step in range(steps):
        for m in range(ACCUMULATE):
            x, y = _micro_batch(step, rank, m)
            (torch.nn.functional.mse_loss(model(x), y) / ACCUMULATE).backward()
        for i in range(len(params)):
            dist.all_reduce(sums[i])
            dist.all_reduce(sizes[i])
        grads = opt.gradient_path.sharded_grads()
        ratio, off = 0.0, 0
        for pc in grads.pieces:
            held = grads.held(pc)
            exact = sums[pc.index].view(-1)[pc.start : pc.stop] / world_size
            unit = sizes[pc.index].view(-1)[pc.start : pc.stop] / world_size * 2.0**-24
            if exact_into_shards:
                held.copy_(exact)
            ratio = max(ratio, ((held.double() - exact).abs() / unit.clamp_min(1e-300)).max().item())
            off += int((held.float() != exact.float()).sum())
        ratios.append(ratio)
        inexact.append(off)
        sums.clear()
        sizes.clear()
        opt.step()
        opt.zero_grad()
    opt.consolidate_state_dict(to=0)
    state = opt.state_dict()["state"] if rank == 0 else None
    masters = None if state is None or not master_weights else [state[i]["master_param"] for i in range(len(params))]
    shard_dtypes = sorted({str(grads.held(pc).dtype) for pc in grads.pieces})
    return {"params": [p.detach().clone() for p in params], "masters": masters, "ratios": ratios,
            "inexact": inexact, "shard_dtypes": shard_dtypes}


def _all(rank, world_size):
    return {
        "fp32": _train(rank, world_size, grad_accum_dtype="fp32"),
        "auto": _train(rank, world_size, grad_accum_dtype="auto", steps=1),
        "param": _train(rank, world_size, grad_accum_dtype="param"),
        "reference": _train(rank, world_size, grad_accum_dtype="fp32", exact_into_shards=True),
        "no-masters": _train(rank, world_size, grad_accum_dtype="fp32", master_weights=False),
    }


_RUNS: list = []


def _runs() -> list:
    """One spawn of 2 ranks for the tests below."""
    if not _RUNS:
        _RUNS.append(run_ranks(_all, 2, timeout=200))
    return _RUNS[0]


@pytest.mark.timeout(220)
def test_fp32_shards_hold_the_float64_sum_of_the_bf16_micro_batch_grads():
    """Every step, every element of every rank's float32 shard is within float32's roundings of the
    exact sum over ranks and micro-batches (N x M = 8 additions, each rounding by at most 2^-24 of
    the running |sum| <= sum |g|); the bf16 shards are not, by orders of magnitude."""
    additions = 2 * ACCUMULATE
    for r in _runs():
        assert r["fp32"]["shard_dtypes"] == ["torch.float32"]
        assert max(r["fp32"]["ratios"]) <= additions, r["fp32"]["ratios"]
        assert r["param"]["shard_dtypes"] == ["torch.bfloat16"]
        assert min(r["param"]["ratios"]) > 1000 * additions, r["param"]["ratios"]
        assert min(r["param"]["inexact"]) > 0


@pytest.mark.timeout(220)
def test_the_default_accumulates_in_the_params_dtype():
    """The default keeps stage 1's arithmetic (shards in the params' dtype: as fast as stage 1 and
    bitwise equal to it); float32 accumulation is asked for with grad_accum_dtype="fp32"."""
    for r in _runs():
        assert r["auto"]["shard_dtypes"] == ["torch.bfloat16"]
        assert r["auto"]["ratios"] == r["param"]["ratios"][:1]


@pytest.mark.timeout(220)
def test_fp32_accumulation_ends_where_the_float64_sum_ends():
    """After 5 steps the fp32-accumulating run's masters are within 1e-6 of the reference's, whose
    steps took the exact sums (lr 1e-2: the grads differ by float32 roundings only), and its bf16
    params equal the reference's; the bf16-accumulating run ends 100x farther away at least."""
    per_rank = _runs()
    for r in per_rank:
        for a, b in zip(r["fp32"]["params"], per_rank[0]["fp32"]["params"]):
            assert torch.equal(a, b)  # replicas identical
    r = per_rank[0]
    ref = r["reference"]
    assert max(r["reference"]["inexact"]) == 0  # it stepped on the exact sums, rounded once

    def worst(run):
        return max((a.double() - b.double()).abs().max().item() for a, b in zip(run["masters"], ref["masters"]))

    assert worst(r["fp32"]) <= 1e-6, worst(r["fp32"])
    assert worst(r["param"]) > 100 * max(worst(r["fp32"]), 1e-8), (worst(r["param"]), worst(r["fp32"]))
    for a, b in zip(r["fp32"]["params"], ref["params"]):
        assert torch.equal(a, b), (a.float() - b.float()).abs().max().item()
    trained = [p for p in ref["params"]]
    assert not all(torch.equal(a, b) for a, b in zip(trained, [p.detach() for p in _model().parameters()]))


@pytest.mark.timeout(220)
def test_fp32_shards_step_a_bf16_model_without_masters():
    """``master_weights=False``: the local optimizer steps the bf16 params on the float32 shard
    rounded once to bf16 (torch's optimizers want a grad of the param's dtype)."""
    for r in _runs():
        run = r["no-masters"]
        assert run["shard_dtypes"] == ["torch.float32"] and max(run["ratios"]) <= 2 * ACCUMULATE
        assert all(p.dtype == torch.bfloat16 for p in run["params"])
        assert not all(torch.equal(a, b) for a, b in zip(run["params"], [p.detach() for p in _model().parameters()]))


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.fast
@pytest.mark.parametrize("kwargs, message", [
    (dict(stage=2, grad_accum_dtype="bf16"), r"grad_accum_dtype must be one of \('auto', 'fp32', 'param'\), got 'bf16'"),
    (dict(stage=2, grad_accum_dtype=torch.float32), r"grad_accum_dtype must be one of"),
    (dict(grad_accum_dtype="fp32"), r"grad_accum_dtype='fp32' is a stage=2 option"),
])
def test_bad_grad_accum_dtype_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ZeroBucketOptimizer(_model().parameters(), torch.optim.AdamW, lr=1e-3, **kwargs)


@pytest.mark.fast
def test_optim_args_grad_accum_dtype():
    def parse(text):
        return hf_tr.parse_optim_args(hf_tr._parse_optim_args_string(text))

    assert parse("stage=2,grad_accum_dtype=param")["grad_accum_dtype"] == "param"
    assert parse("stage=2,grad_accum_dtype=fp32")["grad_accum_dtype"] == "fp32"
    assert "grad_accum_dtype" not in parse("stage=2")  # the optimizer's default applies
    with pytest.raises(ValueError, match=r"grad_accum_dtype='bf16' is not valid; choose one of \['auto', 'fp32', 'param'\]"):
        parse("stage=2,grad_accum_dtype=bf16")
    with pytest.raises(ValueError, match=r"grad_accum_dtype is a stage=2 option"):
        parse("grad_accum_dtype=fp32")


# -- the benchmark -------------------------------------------------------------------------------
@pytest.mark.timeout(400)
def test_the_accumulation_benchmark_measures_what_it_claims(tmp_path):
    """``python -m benchmarks.accumulation``, shortened (2 steps of 2 micro-batches, the Trainer run
    only): every variant trains, the fp32 shards end at the float64 reference, the others do not."""
    from benchmarks import accumulation

    report = accumulation.main(["--steps", "2", "--accumulation", "2", "--runs", "clm", "--out", str(tmp_path)])
    rows = report["runs"]["clm"]["rows"]
    assert rows["stage2_fp32"]["params_differing"] == 0 and rows["stage2_fp32"]["first_step_grads"]["max_rel"] < 1e-6
    for name in ("stage1", "stage2_param"):
        assert rows[name]["params_differing"] > 0 and rows[name]["first_step_grads"]["max_rel"] > 1e-3, name
    assert rows["stage2_fp32"]["first_step_grads"]["grad_shard_bytes_rank"] == \
        2 * rows["stage2_param"]["first_step_grads"]["grad_shard_bytes_rank"]
    assert (tmp_path / "results.json").exists()


# -- fp16 params and a GradScaler ----------------------------------------------------------------
def _fp16_scaled_steps(grad_accum_dtype: str, steps: int = 3):
    """One process (world size 1), fp16 params, torch's GradScaler prepared for stage 2, 2 micro-batches
    per step; returns (the optimizer's masters, the params, an fp32-master AdamW stepped on each step's
    float64 sum of the scaled fp16 grads times 1/scale)."""
    import hf_zero

    model = _model().half()
    params = list(model.parameters())
    masters = [p.detach().float().clone() for p in params]
    reference = torch.optim.AdamW(masters, lr=LR, weight_decay=0.1)
    sums: dict[int, torch.Tensor] = {}
    for i, p in enumerate(params):
        p.register_hook(lambda g, i=i: sums.__setitem__(i, sums[i] + g.double() if i in sums else g.double()))
    opt = ZeroBucketOptimizer(params, torch.optim.AdamW, lr=LR, weight_decay=0.1, stage=2,
                              grad_accum_dtype=grad_accum_dtype)
    opt.bind_module(model, bucket_cap_mb=0.002)
    scaler = hf_zero.prepare_grad_scaler(torch.amp.GradScaler("cpu", init_scale=2.0**10))
    for step in range(steps):
        for m in range(2):
            x, y = _micro_batch(step, 0, m)
            scaler.scale(torch.nn.functional.mse_loss(model(x.half()), y.half()) / 2).backward()
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        for i, mst in enumerate(masters):
            mst.grad = (sums[i] / scale).float()
        reference.step()
        sums.clear()
    opt.consolidate_state_dict(to=0)
    state = opt.state_dict()["state"]
    return [state[i]["master_param"] for i in range(len(params))], params, masters


@pytest.mark.fast
def test_fp16_params_unscale_their_fp32_shards_with_a_grad_scaler():
    """torch's GradScaler refuses to unscale fp16 grads ("Attempting to unscale FP16 gradients.", as it
    does for 16-bit shards); the float32 shards of fp16 params are unscaled in float32 and the masters
    step on the exact sum (two fp16 grads add exactly in float32, and 1/scale is a power of two)."""
    got, params, want = _fp16_scaled_steps("fp32")
    for a, b in zip(got, want):
        assert torch.equal(a, b), (a - b).abs().max().item()
    assert all(p.dtype == torch.float16 for p in params)
    assert not all(torch.equal(p.detach(), q.detach()) for p, q in zip(params, _model().half().parameters()))
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        _fp16_scaled_steps("param", steps=1)
