"""The memory ledger (``optimizer.memory_ledger()``, [Note: memory ledger] in hf_zero/_ledger.py).

Every category is held to the bytes the design says, computed by the planner's
``predict_ledger`` (itself a function of the layout, tested here against the real tensors):
params, DDP's buckets or the full grads, grad shards, masters and optimizer state exactly;
stage 2's reduce buckets within their bounds (one more than the reducer's in-flight limit); stage 1 with a
DDP built without ``gradient_as_bucket_view`` holds a second copy of the grads, and
``bind_ddp`` says so once, with the numbers. 2 gloo ranks, fp32 and bf16.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from hf_zero._ledger import CATEGORIES, MODEL_STATES, MemoryLedger, Peaks, storage_bytes
from tests._dist import run_ranks

CAP_MB = 0.1  # a few buckets in this model


def _model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8),
                         nn.LayerNorm(8)).to(dtype)


def _run(rank, world, stage, dtype, bucket_view, frozen):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zero import ZeroBucketOptimizer
    from hf_zero._planner import predict_ledger

    model = _model(dtype)
    if frozen:
        model[0].weight.requires_grad_(False)
    caught = []
    if stage == 1:
        module = DDP(model, gradient_as_bucket_view=bucket_view, bucket_cap_mb=CAP_MB)
        opt = ZeroBucketOptimizer(list(model.named_parameters()), torch.optim.AdamW, grad_reduce="reduce_scatter")
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            opt.bind_ddp(module)
        caught = [str(x.message) for x in w if "gradient_as_bucket_view" in str(x.message)]
    else:
        module = model
        opt = ZeroBucketOptimizer(list(model.named_parameters()), torch.optim.AdamW, stage=2)
        opt.bind_module(model, bucket_cap_mb=CAP_MB)
    before_step = []
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        module(torch.randn(4, 64, generator=g).to(dtype)).float().pow(2).mean().backward()
        before_step.append(opt.memory_ledger())
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    after = opt.memory_ledger(reset_peaks=True)
    after_reset = opt.memory_ledger()
    table_specs = [type(s)(s.numel, s.dtype, s.device, s.trainable, s.group) for s in _specs(opt)]
    predicted = predict_ledger(table_specs, world_size=world, stage=stage, buckets=opt.gradient_path.layout.buckets,
                               bucket_cap_mb=CAP_MB, ddp_bucket_view=bucket_view, rank=rank)
    grads_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"before_step": [x.as_dict() for x in before_step], "after": after.as_dict(),
            "after_reset": after_reset.as_dict(), "predicted": predicted, "caught": caught,
            "grad_bytes": grads_numel * torch.empty((), dtype=dtype).element_size(),
            "param_count": sum(p.numel() for p in model.parameters())}


def _specs(opt):
    from hf_zero._layout import ParamSpec

    return [ParamSpec(p.numel(), p.dtype, str(p.device), p.requires_grad, opt.group_of(i))
            for i, p in enumerate(opt.params)]


CASES = [(1, torch.float32, True, False), (1, torch.bfloat16, True, False), (1, torch.float32, False, False),
         (2, torch.float32, True, False), (2, torch.bfloat16, True, False), (2, torch.float32, True, True)]


@pytest.mark.parametrize("stage,dtype,bucket_view,frozen", CASES,
                         ids=[f"stage{s}-{str(d)[6:]}{'' if v else '-ddp-copy'}{'-frozen' if f else ''}"
                              for s, d, v, f in CASES])
def test_each_category_is_what_the_design_says(stage, dtype, bucket_view, frozen):
    for r in run_ranks(_run, 2, stage, dtype, bucket_view, frozen, timeout=180):
        want = r["predicted"]
        # the layout predicted is the last one (DDP re-buckets after its first backward)
        led = r["before_step"][-1]
        for c in MODEL_STATES:
            assert led[c] == want[c], (c, led[c], want[c])
        assert led["model_states"] == want["model_states"]
        for c in MODEL_STATES:  # after the step and zero_grad(): p.grad let go, and stage 2's shards
            assert r["after"][c] == (0 if c in ("full_grads", "grad_shards") else want[c]), c
        if stage == 1:
            # DDP's buckets: every trainable grad once; a DDP without bucket views holds them twice
            assert led["ddp_buckets"] == r["grad_bytes"]
            assert led["full_grads"] == (0 if bucket_view else r["grad_bytes"])
            assert led["grad_shards"] == led["buckets_in_flight"] == led["buckets_pooled"] == 0
        else:
            assert led["ddp_buckets"] == led["full_grads"] == 0
            # one rank's half, alignment aside; 16-bit grads accumulate in float32 shards by default
            widened = 4 // torch.empty((), dtype=dtype).element_size()
            assert 0 < led["grad_shards"] <= widened * r["grad_bytes"] // 2 + 128
            bounds = want["bucket_bounds"]
            assert 0 < led["peaks"]["buckets_in_flight"] <= bounds["buckets_in_flight"]
            assert led["buckets_in_flight"] == 0  # nothing in use between the backward and the step
            # nor idle: the pool and the receive scratch are let go at the backward's end
            assert led["buckets_pooled"] == 0 and led["receive_scratch"] == 0
            assert 0 < led["peaks"]["receive_scratch"] and led["peaks"]["buckets_pooled"] <= bounds["buckets_pooled"]
        if dtype == torch.bfloat16:  # fp32 masters of the owned half, upcast room of at most them
            assert led["masters"] > 0 and led["upcast_scratch"] <= led["masters"]
        assert set(led["peaks"]) <= set(CATEGORIES)
        for c in CATEGORIES:
            assert led["peaks"].get(c, 0) >= led[c]
        assert led["total"] == sum(led[c] for c in CATEGORIES)
        # bind_ddp warns once, with the numbers, on a DDP built without gradient_as_bucket_view=True
        if stage == 1 and not bucket_view:
            assert len(r["caught"]) == 1
            assert f"{r['grad_bytes'] / 2**20:.1f} MiB" in r["caught"][0]
            assert f"{r['grad_bytes'] / r['param_count']:.1f} bytes per param" in r["caught"][0]
        else:
            assert r["caught"] == []
        # reset: peaks start again from what is held now
        after, again = r["after"], r["after_reset"]
        for c in CATEGORIES:
            assert again["peaks"].get(c, 0) == again[c], c
        if stage == 2:
            assert after["peaks"]["buckets_in_flight"] > 0 and again["peaks"].get("buckets_in_flight", 0) == 0


def _consolidating(rank, world):
    from hf_zero import ZeroBucketOptimizer

    model = _model(torch.float32)
    opt = ZeroBucketOptimizer(list(model.named_parameters()), torch.optim.AdamW)
    model(torch.randn(4, 64)).pow(2).mean().backward()
    opt.step()
    before = opt.memory_ledger()
    opt.consolidate_state_dict(0)
    held = opt.memory_ledger()
    sd = opt.state_dict() if rank == 0 else None
    whole = 0 if sd is None else sum(v.nbytes for st in sd["state"].values() for v in st.values()
                                     if isinstance(v, torch.Tensor))
    opt.zero_grad()
    model(torch.randn(4, 64)).pow(2).mean().backward()
    opt.step()  # the state changed: the copy is dropped
    return before.consolidation, held.consolidation, whole, opt.memory_ledger().consolidation


def test_consolidation_counts_the_gathered_copy_only_while_held():
    (b0, h0, whole, a0), (b1, h1, _, a1) = run_ranks(_consolidating, 2, timeout=120)
    assert b0 == b1 == a0 == a1 == 0
    assert h1 == 0 and 0 < h0 <= whole  # rank 0 holds the gathered state (its own shard shared with the live state)


def test_storage_bytes_counts_each_storage_once():
    buf = torch.zeros(100)
    a, b, c = buf[:10], buf[10:], torch.ones(7)
    assert storage_bytes([a, b, None, c]) == 100 * 4 + 7 * 4
    assert storage_bytes([a, c], skip={buf.untyped_storage().data_ptr()}) == 7 * 4


def test_peaks_and_the_dataclass():
    p = Peaks()
    assert p.observe({"params": 5, "masters": 1}) == {"params": 5, "masters": 1}
    assert p.observe({"params": 3, "masters": 4}) == {"params": 5, "masters": 4}
    p.reset()
    assert p.observe({"params": 3}) == {"params": 3}
    led = MemoryLedger(params=10, grad_shards=2, buckets_pooled=7, peaks={"params": 10, "buckets_pooled": 9})
    assert led.total == 19 and led.model_states == 12 and led.peak_total == 19 and led.peak_model_states == 10
    assert "buckets_pooled 0.0 (0.0)" in led.format() and led.as_dict()["total"] == 19


def test_single_process_ledger_without_ddp():
    from hf_zero import ZeroBucketOptimizer

    model = _model(torch.float32)
    opt = ZeroBucketOptimizer(list(model.named_parameters()), torch.optim.AdamW)
    assert opt.memory_ledger().optimizer_state == 0
    model(torch.randn(4, 64)).pow(2).mean().backward()
    grads = sum(p.grad.nbytes for p in model.parameters())
    led = opt.memory_ledger()
    assert led.full_grads == grads and led.ddp_buckets == 0  # p.grad of their own: no DDP
    opt.step()
    led = opt.memory_ledger()
    n = sum(p.numel() for p in model.parameters())
    assert led.optimizer_state == 8 * n + 4 * len(list(model.parameters()))  # exp_avg, exp_avg_sq, step
    assert led.params == storage_bytes(model.parameters()) and led.params >= 4 * n


def _no_sync_grads(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zero import ZeroBucketOptimizer

    model = _model(torch.float32)
    ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=CAP_MB)
    opt = ZeroBucketOptimizer(list(model.named_parameters()), torch.optim.AdamW, grad_reduce="reduce_scatter")
    opt.bind_ddp(ddp)
    g = torch.Generator().manual_seed(rank)
    seen = []
    for _ in range(3):
        with ddp.no_sync():  # set to none by the last zero_grad: autograd gives each param a grad of its own
            ddp(torch.randn(4, 64, generator=g)).pow(2).mean().backward()
        held = storage_bytes(p.grad for p in model.parameters())
        seen.append((opt.memory_ledger().full_grads, held))
        ddp(torch.randn(4, 64, generator=g)).pow(2).mean().backward()  # copied into DDP's buckets, then views
        seen.append((opt.memory_ledger().full_grads, 0))
        opt.step()
        opt.zero_grad()
    return seen


def test_grads_accumulated_under_no_sync_are_counted_until_ddp_copies_them_into_its_buckets():
    for seen in run_ranks(_no_sync_grads, 2, timeout=120):
        for counted, own in seen:
            assert counted == own
        assert seen[2][1] == sum(p.numel() for p in _model(torch.float32).parameters()) * 4


def _pool_at_the_last_grad(rank, world):
    from hf_zero import ZeroBucketOptimizer

    torch.manual_seed(0)
    # an embedding above the cap (a bucket of its own, reduced in its own storage) is the last grad of each
    # backward, as GPT-2's: the pooled buckets before it were all taken, and go back while it is reduced
    model = nn.Sequential(nn.Embedding(512, 64), *[nn.Linear(64, 64) for _ in range(6)])
    opt = ZeroBucketOptimizer(list(model.named_parameters()), torch.optim.AdamW, stage=2)
    opt.bind_module(model, bucket_cap_mb=0.02)
    seen = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(opt.memory_ledger().buckets_pooled))
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        model(torch.randint(0, 512, (4, 8), generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return seen, opt.memory_ledger().peaks["buckets_pooled"]


def test_the_pool_keeps_no_idle_bucket_once_a_backward_took_its_last():
    for seen, peak in run_ranks(_pool_at_the_last_grad, 2, timeout=120):
        assert peak > 0  # the pool is used: buckets go back to it and are taken again
        assert seen[1:] == [0, 0]  # from the second backward on, the pool knows how many it gives
