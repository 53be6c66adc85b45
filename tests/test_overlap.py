"""The overlapped parameter sync ([Note: overlapped parameter sync] in hf_zero/_overlap.py)
with each receive visible only at its wait (tests/_seams.py), 2 gloo ranks, float64, DDP
buckets of 0.25 MB: a model whose forward reads params outside their own module's forward
(``nn.MultiheadAttention``'s ``out_proj.weight``, a tied head through ``F.linear`` from a
module added after the optimizer was bound, a param read in the loss) trains bitwise
like the same run without overlap; a control shows a reader that does not wait sees the
stale values the seam leaves (what the old own-params-only pre-hooks let MHA read)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests._dist import run_ranks
from tests._seams import delay_param_receives

V, D, T, STEPS, BATCH = 1024, 128, 6, 6, 4  # 1.5 MB of params: several DDP buckets


class TiedHead(nn.Module):
    """No params of its own: reads the embedding through ``F.linear``."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self._weight = lambda: embedding.weight  # not a submodule: no second registration

    def forward(self, h):
        return F.linear(h, self._weight())


class AttnLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D, dtype=torch.float64)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True, dtype=torch.float64)
        self.norm = nn.LayerNorm(D, dtype=torch.float64)
        self.head = None  # added after binding

    def forward(self, ids, targets):
        h = self.emb(ids)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        logits = self.head(self.norm(h))
        # A regulariser reading a param in the loss.
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + 1e-3 * self.norm.weight.square().sum()


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, V, (BATCH, T), generator=g)
    return ids, torch.roll(ids, 1, dims=1)


def _train(rank, world_size, *, overlap: bool, seam: bool, peek: bool = False):
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from hf_zero import ZeroBucketOptimizer

    model = AttnLM()
    opt = ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, grad_reduce="reduce_scatter",
                              overlap_param_sync=overlap)
    ddp = DDP(model, bucket_cap_mb=0.25)
    opt.bind_ddp(ddp)
    started = delay_param_receives(opt.gradient_path.comm) if seam else []
    events = []  # "step": the local optimizer steps a chunk; "sync": a buffer's sync starts
    comm, real_sync = opt.gradient_path.comm, opt.gradient_path.comm.sync_buffer

    def sync_buffer(*args, **kwargs):
        events.append("sync")
        return real_sync(*args, **kwargs)

    comm.sync_buffer = sync_buffer
    hook = register_optimizer_step_pre_hook(
        lambda o, args, kwargs: events.append("step") if o is not opt else None)
    model.head = TiedHead(model.emb)
    stale = []
    for step in range(STEPS):
        ddp(*_batch(step, rank)).backward()
        events.append("|")
        opt.step()
        opt.zero_grad(set_to_none=True)
        if peek:  # read out_proj.weight without waiting, then after the wait
            before = model.attn.out_proj.weight.detach().clone()
            opt.wait_param_sync()
            stale.append(not torch.equal(before, model.attn.out_proj.weight))
    opt.wait_param_sync()
    hook.remove()
    return {
        "events": events,
        "params": [p.detach().clone() for p in model.parameters()],
        "overlap": opt.overlaps_param_sync,
        "delayed": len(started),
        "stale": stale,
        "buckets": opt.gradient_path.ddp_buckets_planned(),
    }


@pytest.mark.timeout(200)
def test_overlap_with_delayed_receives_equals_no_overlap_bitwise():
    plain = run_ranks(_train, 2, overlap=False, seam=False, timeout=90)
    overlapped = run_ranks(_train, 2, overlap=True, seam=True, timeout=90)
    for rank in range(2):
        assert overlapped[rank]["overlap"] and not plain[rank]["overlap"]
        assert overlapped[rank]["delayed"] > 0  # the seam was on the path
        assert overlapped[rank]["delayed"] > STEPS, overlapped[rank]["buckets"]  # more than one buffer per step
        for got, want in zip(overlapped[rank]["params"], plain[rank]["params"]):
            assert torch.equal(got, want)
    for got, want in zip(overlapped[0]["params"], overlapped[1]["params"]):
        assert torch.equal(got, want)


@pytest.mark.timeout(200)
def test_pipelined_blocking_sync_with_delayed_receives_equals_plain_bitwise():
    """Without overlap, each buffer's sync starts as soon as this rank's pieces of it are
    stepped, while the next buffer's are stepped ([Note: pipelined sync]); the step waits
    for every receive before it returns."""
    plain = run_ranks(_train, 2, overlap=False, seam=False, timeout=90)
    delayed = run_ranks(_train, 2, overlap=False, seam=True, timeout=90)
    for rank in range(2):
        assert not delayed[rank]["overlap"]
        assert delayed[rank]["delayed"] > STEPS, delayed[rank]["buckets"]  # async, several buffers a step
        # Once the buffers follow DDP's buckets (from the third step: DDP rebuilds them
        # after its first iteration), every step starts a sync before its last chunk.
        steps = " ".join(delayed[rank]["events"]).split("|")[1:]
        assert len(steps) == STEPS and all(s.count("sync") > 1 for s in steps[2:]), steps
        assert all("sync step" in s for s in steps if s.count("sync") > 1), steps
        for got, want in zip(delayed[rank]["params"], plain[rank]["params"]):
            assert torch.equal(got, want)
    for got, want in zip(delayed[0]["params"], delayed[1]["params"]):
        assert torch.equal(got, want)


@pytest.mark.timeout(120)
def test_control_the_seam_leaves_unwaited_reads_stale():
    """Without a wait, out_proj.weight on the rank that does not own it holds the values
    from before the step: the read MHA makes without calling out_proj."""
    per_rank = run_ranks(_train, 2, overlap=True, seam=True, peek=True, timeout=90)
    assert any(any(r["stale"]) for r in per_rank), [r["stale"] for r in per_rank]
