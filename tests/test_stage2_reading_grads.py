"""Code that reads or writes grads between backward and step, at stage 2 (and stage 1 under the
reduce-scatter): ``optimizer.full_grad(p)`` equals DDP's ``p.grad``, ``optimizer.local_grad(p)`` is
this rank's range of it (writes go to the step), a NaN-sanitising write into a ``p.grad`` stand-in
is refused naming the fix, and the fix trains as DDP + torch AdamW with the idiom on ``p.grad``.

2 gloo ranks, float64; each scenario runs with DDP + torch AdamW (the reference) and with a
ZeroBucketOptimizer of the same AdamW in the same processes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests._dist import run_ranks
from tests.models import rank_batch as _data
from tests.models import tanh_mlp

STEPS = 3
LR = dict(lr=0.05, weight_decay=0.1)


def _wrap(module: nn.Module, mode: str):
    """"ddp": DDP + torch AdamW; "stage2": bound to the unwrapped module; "stage1-rs": stage 1 under DDP
    with the reduce-scatter (each rank's p.grad holds the average only in its own ranges)."""
    from hf_zero import ZeroBucketOptimizer

    if mode == "ddp":
        return DDP(module), torch.optim.AdamW(module.parameters(), **LR)
    opt = ZeroBucketOptimizer(list(module.parameters()), torch.optim.AdamW, stage=2 if mode == "stage2" else 1,
                              parameters_as_bucket_view=False, **LR)
    if mode == "stage2":
        opt.bind_module(module, bucket_cap_mb=0.0003)
        return module, opt
    ddp = DDP(module, bucket_cap_mb=0.0003)
    opt.bind_ddp(ddp, grad_reduce_default="reduce_scatter")
    return ddp, opt


def _nan_in_one_grad(model: nn.Module, rank: int) -> torch.Tensor:
    """A loss term whose grad puts a NaN into one element of the first weight's grad, on rank 0 only."""
    c = torch.zeros_like(model[0].weight)
    if rank == 0:
        c[1, 2] = float("nan")
    return (model[0].weight * c).sum()


def _sanitise(rank, mode: str, idiom: str):
    """Each step: a NaN in one grad element, set to 0 by the idiom (on p.grad under DDP; on the
    optimizer's local_grad(p) under hf_zero), then the step. Also returns what each idiom said when
    applied to the p.grad stand-ins (the refusal)."""
    model = tanh_mlp(7, (5, 6, 4, 1))
    m, opt = _wrap(model, mode)
    refusals = []
    for step in range(STEPS):
        (m(_data(step, rank, 4, 5)).square().mean() + _nan_in_one_grad(model, rank)).backward()
        for p in model.parameters():
            g = p.grad if mode == "ddp" else opt.local_grad(p)
            if mode == "stage2" and step == 0:
                try:
                    if idiom == "index":
                        p.grad[torch.isnan(p.grad)] = 0
                    else:
                        p.grad.masked_fill_(p.grad.isnan(), 0)
                    refusals.append("no error")
                except RuntimeError as e:
                    refusals.append(str(e))
            if g is None:
                continue
            if idiom == "index":
                g[torch.isnan(g)] = 0
            else:
                g.masked_fill_(g.isnan(), 0)
        opt.step()
        opt.zero_grad()
    return [t.detach().clone() for t in model.parameters()], refusals


def _refusal(read) -> str | None:
    try:
        read()
    except RuntimeError as e:
        return str(e)
    return None


def _read(rank, mode: str):
    """Per-layer grad norms and the full grads, read between backward and step (full_grad under hf_zero,
    p.grad under DDP); the sum of squares over every rank's local_grad (all-reduced). Six steps: stage 1
    reduce-scatters from the third backward on (once its layout follows DDP's rebuilt buckets)."""
    model = tanh_mlp(8, (5, 6, 4, 1))
    m, opt = _wrap(model, mode)
    norms, fulls, local_sq, partial, after_step = [], [], [], [], []
    for step in range(6):
        m(_data(step, rank, 4, 5)).square().mean().backward()
        for p in model.parameters():
            g = p.grad if mode == "ddp" else opt.full_grad(p)
            norms.append(g.norm())
            fulls.append(g.clone())
            if mode == "ddp":
                local_sq.append(g.square().sum())
            else:
                piece = opt.local_grad(p)
                sq = torch.zeros((), dtype=torch.float64) if piece is None else piece.square().sum()
                dist.all_reduce(sq)
                local_sq.append(sq)
        if mode == "stage1-rs":
            partial.append(len(opt.gradient_path.partial_grads))
        opt.step()
        if mode == "stage1-rs":  # AdaLoRA's moment, after the step: refused where p.grad is left partial
            after_step += [_refusal(lambda: opt.full_grad(p)) for p in model.parameters()]
        opt.zero_grad()
        if mode == "stage1-rs":
            assert all(opt.full_grad(p) is None for p in model.parameters())  # as DDP's p.grad after zero_grad()
    return norms, fulls, local_sq, [t.detach().clone() for t in model.parameters()], partial, after_step


def _adalora(rank, mode: str):
    """PEFT's AdaLoRA, ``update_and_allocate`` after each step as PEFT documents: DDP + torch AdamW, or
    hf_zero stage 1 under DDP with the reduce-scatter as default (Trainer's), or stage 2 (refused)."""
    from peft import AdaLoraConfig, get_peft_model

    from hf_zero import ZeroBucketOptimizer

    torch.manual_seed(11)
    base = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    config = AdaLoraConfig(target_modules=["0", "2"], init_r=4, target_r=2, tinit=1, tfinal=1, deltaT=1, total_step=4)
    model = get_peft_model(base, config)
    params = [p for p in model.parameters() if p.requires_grad]
    if mode == "ddp":
        m, opt = DDP(model), torch.optim.AdamW(params, **LR)
    else:
        opt = ZeroBucketOptimizer(params, torch.optim.AdamW, stage=2 if mode == "stage2" else 1,
                                  parameters_as_bucket_view=False, **LR)
        if mode == "stage2":
            try:
                opt.bind_module(model)
            except ValueError as e:
                return str(e)
            return "no error"
        m = DDP(model)
        opt.bind_ddp(m, grad_reduce_default="reduce_scatter")
    for step in range(4):
        m(_data(step, rank, 4, 5)).square().mean().backward()
        opt.step()
        model.base_model.update_and_allocate(step)
        opt.zero_grad()
    return getattr(opt, "grad_reduce", "torch"), [t.detach().clone() for t in model.parameters()]


def _post_accumulate_hooks(rank, mode: str):
    """A user's post-accumulate-grad hooks, one registered before the optimizer binds the model and one
    after, each recording the grad it sees (this rank's own under DDP)."""
    model = tanh_mlp(9, (5, 6, 4, 1))
    seen = []

    def record(p):
        seen.append(None if p.grad is None else p.grad.clone())

    model[2].weight.register_post_accumulate_grad_hook(record)
    m, opt = _wrap(model, mode)
    model[0].bias.register_post_accumulate_grad_hook(record)
    for step in range(STEPS):
        m(_data(step, rank, 4, 5)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return seen, [t.detach().clone() for t in model.parameters()]


def _run(rank, world_size):
    out = {"adalora": [_adalora(rank, mode) for mode in ("ddp", "stage1", "stage2")]}
    out["hooks"] = [_post_accumulate_hooks(rank, mode) for mode in ("ddp", "stage2")]
    for idiom in ("index", "masked_fill"):
        out[f"sanitise-{idiom}"] = [_sanitise(rank, mode, idiom) for mode in ("ddp", "stage2")]
    out["read"] = [_read(rank, mode) for mode in ("ddp", "stage2", "stage1-rs")]
    return out


_RESULTS: list = []


def _results():
    if not _RESULTS:
        _RESULTS.extend(run_ranks(_run, 2, timeout=120))
    return _RESULTS


def _close(have, want, what):
    for i, (a, b) in enumerate(zip(want, have, strict=True)):
        torch.testing.assert_close(b, a, rtol=1e-13, atol=1e-15, msg=lambda m: f"{what}, tensor {i}: {m}")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("idiom", ["index", "masked_fill"])
def test_a_nan_sanitising_write_into_a_stand_in_is_refused_and_local_grad_trains_as_ddp(idiom):
    for rank, out in enumerate(_results()):
        (want, _), (have, refusals) = out[f"sanitise-{idiom}"]
        op = "__setitem__" if idiom == "index" else "masked_fill_"
        assert len(refusals) == 6 and all(
            r.startswith(f"hf_zero stage 2: {op} writes into the grad of ") and "optimizer.local_grad(p)" in r
            and "grad_reduce='all_reduce'" in r for r in refusals), refusals
        assert all(torch.isfinite(t).all() for t in have)
        _close(have, want, f"rank {rank}")


@pytest.mark.timeout(150)
def test_full_grad_and_local_grad_read_what_ddp_p_grad_holds_at_stage_2_and_stage_1_reduce_scatter():
    for rank, out in enumerate(_results()):
        ddp, *zero = out["read"]
        assert zero[1][4][-1] == 6, zero[1][4]  # the last backwards left p.grad partial at stage 1
        for mode, got in zip(("stage2", "stage1-rs"), zero):
            for part, (want, have) in enumerate(zip(ddp[:4], got[:4])):
                _close(have, want, f"rank {rank}, {mode}, part {part}")
        refused = zero[1][5][-len(ddp[3]):]  # the last step's: every grad partial then
        assert all(r is not None and "after the step: its grad was reduce-scattered" in r
                   and "grad_reduce='all_reduce'" in r for r in refused), refused


@pytest.mark.timeout(150)
def test_adalora_trains_as_ddp_at_stage_1_and_is_refused_at_stage_2_naming_the_fix():
    """AdaLoRA's importance scores read every LoRA param's full p.grad after the step: at stage 1 the
    default reduce-scatter gives way to the all-reduce (p.grad whole, as under DDP); stage 2 refuses."""
    for rank, out in enumerate(_results()):
        (_, want), (grad_reduce, have), refused = out["adalora"]
        assert grad_reduce == "all_reduce"
        _close(have, want, f"rank {rank}")
        assert refused.startswith("bind_module: the model is a PEFT AdaLoRA model") and \
            "grad_reduce='all_reduce'" in refused, refused


@pytest.mark.timeout(150)
def test_a_users_post_accumulate_grad_hook_sees_this_ranks_grad_as_under_ddp():
    """Registered before bind_module or after, it runs before stage 2 takes the grad."""
    for rank, out in enumerate(_results()):
        (want_seen, want), (seen, have) = out["hooks"]
        assert len(seen) == len(want_seen) == 2 * STEPS and all(g is not None for g in seen)
        _close(seen, want_seen, f"rank {rank}, seen")
        _close(have, want, f"rank {rank}")


def _writes(rank, world_size):
    """Each write into a stand-in, its refusal; zero_() and module.zero_grad(set_to_none=False) still zero."""
    model = tanh_mlp(12, (5, 6, 4, 1))
    from hf_zero import ZeroBucketOptimizer

    opt = ZeroBucketOptimizer(list(model.parameters()), torch.optim.AdamW, stage=2, **LR)
    opt.bind_module(model)
    model(_data(0, rank, 4, 5)).square().mean().backward()
    g = model[0].weight.grad
    writes = {
        "index": lambda: g.__setitem__(g.isnan(), 0),
        "masked_fill_": lambda: g.masked_fill_(g.isnan(), 0),
        "through .data": lambda: g.data.mul_(2),
        "through a view": lambda: g.view(-1)[:3].add_(1),
        "out=": lambda: torch.add(g, 1, out=g),
        "torch clip": lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0),
        "nan_to_num_": lambda: g.nan_to_num_(0.0),
    }
    said = {}
    for name, write in writes.items():
        try:
            write()
            said[name] = "no error"
        except RuntimeError as e:
            said[name] = str(e)
    model[2].weight.grad.zero_()
    model[4].zero_grad(set_to_none=False)
    full = [opt.full_grad(p) for p in model.parameters()]
    return said, full


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_every_write_into_a_stand_in_but_zeroing_is_refused_naming_the_param_and_the_fix():
    said, full = run_ranks(_writes, 1, timeout=40)[0]
    for name, message in said.items():
        assert message.startswith("hf_zero stage 2: ") and "writes into the grad of #0 (group 0, shape (6, 5))" in message \
            and "optimizer.local_grad(p)" in message, (name, message)
    assert all(torch.isfinite(g).all() for g in full[:2])  # the refused writes changed nothing
    assert all(torch.equal(g, torch.zeros_like(g)) for g in full[2:3] + full[4:])  # zeroed
