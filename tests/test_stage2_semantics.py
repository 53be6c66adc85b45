"""Under stage 2, the torch patterns that read or clear grads outside ``opt.step()`` /
``opt.zero_grad()``, forwards outside a training step, and several optimizers over one
model behave as with torch's own AdamW under DistributedDataParallel.

Every scenario runs on 2 gloo ranks twice in the same processes: once with DDP and torch's
AdamW (the reference), once with a stage-2 ZeroBucketOptimizer of the same AdamW bound to
the unwrapped module. Float64 throughout; params and buffers, on every rank, must agree to
an ulp (DDP all-reduces what ``p.grad`` accumulated over several syncing backwards, stage 2
adds each backward's average: a last-bit difference, not a different result).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests._dist import run_ranks
from tests.models import flat_tensors
from tests.models import rank_batch as _data
from tests.models import tanh_mlp as _mlp

STEPS = 3
LR = dict(lr=0.05, weight_decay=0.1)


def _zero(params, **kwargs):
    from hf_zero import ZeroBucketOptimizer

    return ZeroBucketOptimizer(list(params), torch.optim.AdamW, stage=2, parameters_as_bucket_view=False,
                               **{**LR, **kwargs})


def _wrap(module: nn.Module, stage2: bool, opt_params=None, **bind):
    """(the module to call, its optimizer): DDP + torch AdamW, or stage 2 bound to the module."""
    params = list(module.parameters()) if opt_params is None else opt_params
    if stage2:
        opt = _zero(params)
        opt.bind_module(module, bucket_cap_mb=0.0005, **bind)
        return module, opt
    return DDP(module, **bind), torch.optim.AdamW(params, **LR)


def _state(*modules) -> list[torch.Tensor]:
    return [t.detach().clone() for m in modules for t in (*m.parameters(), *m.buffers())]


# -- model.zero_grad() and p.grad by hand ----------------------------------------------------
def _dcgan(rank, stage2: bool, set_to_none: bool):
    """The DCGAN loop: netD.zero_grad(), then errG's backward passes through D too (D's grads of it
    are dropped by the next netD.zero_grad(), not stepped)."""
    netG, netD = _mlp(1, (3, 6, 5)), _mlp(2, (5, 6, 1))
    G, optG = _wrap(netG, stage2)
    D, optD = _wrap(netD, stage2)
    for step in range(STEPS):
        real, noise = _data(step, rank, 4, 5), _data(step + 50, rank, 4, 3)
        D.zero_grad(set_to_none=set_to_none)
        F.binary_cross_entropy_with_logits(D(real), torch.ones(4, 1, dtype=torch.float64)).backward()
        fake = G(noise)
        F.binary_cross_entropy_with_logits(D(fake.detach()), torch.zeros(4, 1, dtype=torch.float64)).backward()
        optD.step()
        G.zero_grad(set_to_none=set_to_none)
        F.binary_cross_entropy_with_logits(D(fake), torch.ones(4, 1, dtype=torch.float64)).backward()
        optG.step()
    return _state(netG, netD)


def _grad_dropped_by_hand(rank, stage2: bool):
    """After the backward: ``p.grad = None`` for one param, the other layer's ``zero_grad(set_to_none=False)``,
    a zero_grad between forward and backward; the optimizer is never zeroed (the module is)."""
    model = _mlp(3, (5, 6, 4, 1))
    m, opt = _wrap(model, stage2)
    for step in range(STEPS):
        out = m(_data(step, rank, 4, 5)).square().mean()
        model.zero_grad()  # between forward and backward: drops nothing of this backward
        out.backward()
        model[0].weight.grad = None  # skipped by the step (no decay either)
        model[2].zero_grad(set_to_none=False)  # stepped with zero grads (decay, moments)
        opt.step()
        model.zero_grad()
    return _state(model)


def _gradient_penalty(rank, stage2: bool):
    """WGAN-GP: torch.autograd.grad through the model (create_graph), then one backward of both."""
    model = _mlp(4)
    m, opt = _wrap(model, stage2)
    for step in range(STEPS):
        x = _data(step, rank, 4, 5).requires_grad_()
        out = m(x)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (out.mean() + (g.norm(dim=1) - 1).square().mean()).backward()
        opt.step()
        opt.zero_grad()
    return _state(model)


def _two_forwards_one_backward(rank, stage2: bool):
    model = _mlp(5)
    m, opt = _wrap(model, stage2)
    for step in range(STEPS):
        (m(_data(step, rank, 4, 5)).square().mean() + m(_data(step + 9, rank, 4, 5)).mean()).backward()
        opt.step()
        opt.zero_grad()
    return _state(model)


# -- buffers, and a forward outside a training step ---------------------------------------
class Normed(nn.Module):
    """BatchNorm (running stats) and a buffer the forward reads and updates."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(6)
        self.lin = nn.Linear(5, 4)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("seen", torch.zeros(4))
        self.double()

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.seen.add_(x.mean(0)[:4])
        return (self.norm(self.lin(x)) * (1 + self.seen)).sum(1)


def _buffers(rank, stage2: bool, *, side_forward: bool, accumulate: int, evaluate: bool):
    """Train 3 steps (``accumulate`` micro-batches, all but the last under no_sync); between steps
    optionally an eval-mode no-grad forward on every rank and a grad-mode train-mode forward on
    rank 0 only (a callback's sample loss: under DDP it runs on the unwrapped module). Returns
    every step's params and buffers."""
    model = Normed()
    m, opt = _wrap(model, stage2)
    seen = []
    for step in range(STEPS):
        for k in range(accumulate):
            ctx = m.no_sync() if k + 1 < accumulate else torch.enable_grad()
            with ctx:
                m(_data(step * 10 + k, rank, 4, 5)).square().mean().div(accumulate).backward()
        opt.step()
        opt.zero_grad()
        seen.append(_state(model))
        if evaluate:
            model.eval()
            with torch.no_grad():
                model(_data(77, rank, 4, 5))
            model.train()
        if side_forward and rank == 0:  # the bound module itself (stage 2) / the unwrapped one (DDP)
            model.eval()  # a sample loss that changes no buffer (see test_a_grad_mode_forward_on_rank_0_alone...)
            model(_data(99, rank, 4, 5)).sum()
            model.train()
        seen.append(_state(model))
    return seen


def _counting(rank, stage2: bool, broadcast_buffers: bool):
    """Two syncing forwards, a no_sync one and one without grad; a buffer each forward adds rank + 1 to."""

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(3, 1).double()
            self.register_buffer("seen", torch.zeros(1, dtype=torch.float64))

        def forward(self, x):
            self.seen += rank + 1
            return self.lin(x).sum()

    model = Counting()
    m, opt = _wrap(model, stage2, broadcast_buffers=broadcast_buffers)
    x = torch.ones(2, 3, dtype=torch.float64)
    for _ in range(2):
        m(x).backward()
    with m.no_sync():
        m(x).backward()
    with torch.no_grad():
        m(x)
    return model.seen.item()


# -- two optimizers over one model ----------------------------------------------------------
def _two_optimizers(rank, stage2: bool, accumulate: int):
    """Backbone and head of one model under two optimizers (different lr), both stepped each step."""
    model = _mlp(7, (5, 6, 4, 1))
    backbone, head = list(model[0].parameters()), [*model[2].parameters(), *model[4].parameters()]
    if stage2:
        opt_b, opt_h = _zero(backbone), _zero(head, lr=0.01)
        for opt in (opt_b, opt_h):
            opt.bind_module(model, bucket_cap_mb=0.0005)
        m = model
    else:
        m = DDP(model)
        opt_b, opt_h = torch.optim.AdamW(backbone, **LR), torch.optim.AdamW(head, **{**LR, "lr": 0.01})
    for step in range(STEPS):
        for k in range(accumulate):
            ctx = m.no_sync() if k + 1 < accumulate else torch.enable_grad()
            with ctx:
                m(_data(step * 10 + k, rank, 4, 5)).square().mean().backward()
        opt_b.step()
        opt_h.step()
        opt_b.zero_grad()
        opt_h.zero_grad()
    return _state(model)


class TwoBranches(nn.Module):
    """Two branches summed; with ``flip`` the second gets no grad."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.a, self.b = nn.Linear(5, 3).double(), nn.Linear(5, 3, bias=False).double()

    def forward(self, x, flip: bool):
        if flip:  # b is unused on this rank: its reducer adds zeros at the end of the backward
            return self.a(x) + 0 * self.b(x).detach()
        return self.b(x) + self.a(x)


def _branches_in_rank_order(rank, stage2: bool):
    """Two optimizers over one model, one per branch; the second branch is unused on rank 1, so its
    buckets complete there only at the end of the backward, after the first branch's, and on
    rank 0 before them."""
    model = TwoBranches()
    if stage2:
        opts = (_zero(model.a.parameters()), _zero(model.b.parameters(), lr=0.01))
        for opt in opts:
            opt.bind_module(model, bucket_cap_mb=0.0001)
        m = model
    else:
        m = DDP(model, find_unused_parameters=True)
        opts = (torch.optim.AdamW(model.a.parameters(), **LR), torch.optim.AdamW(model.b.parameters(), **{**LR, "lr": 0.01}))
    for step in range(STEPS):
        m(_data(step, rank, 4, 5), rank == 1).square().mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return _state(model)


SCENARIOS = {
    "dcgan-set-to-none": (_dcgan, dict(set_to_none=True)),
    "dcgan-zeroed": (_dcgan, dict(set_to_none=False)),
    "grad-dropped-by-hand": (_grad_dropped_by_hand, {}),
    "gradient-penalty": (_gradient_penalty, {}),
    "two-forwards-one-backward": (_two_forwards_one_backward, {}),
    "buffers": (_buffers, dict(side_forward=False, accumulate=1, evaluate=False)),
    "buffers-no-sync-3-eval": (_buffers, dict(side_forward=False, accumulate=3, evaluate=True)),
    "counting-broadcast": (_counting, dict(broadcast_buffers=True)),
    "counting-no-broadcast": (_counting, dict(broadcast_buffers=False)),
    "two-optimizers-one-model": (_two_optimizers, dict(accumulate=1)),
    "two-optimizers-one-model-no-sync-2": (_two_optimizers, dict(accumulate=2)),
    "two-optimizers-branches-in-rank-order": (_branches_in_rank_order, {}),
}


def _run(rank, world_size, names):
    out = {}
    for name in names:
        fn, kwargs = SCENARIOS[name]
        try:
            out[name] = [fn(rank, stage2, **kwargs) for stage2 in (False, True)]
        except Exception as e:  # reported per scenario, not as the whole spawn's failure
            out[name] = f"{type(e).__name__}: {e}"
    return out


_RESULTS: dict = {}


def _results():
    if not _RESULTS:
        _RESULTS.update(enumerate(run_ranks(_run, 2, list(SCENARIOS), timeout=240)))
    return _RESULTS


@pytest.mark.timeout(260)
@pytest.mark.parametrize("name", SCENARIOS)
def test_stage2_equals_ddp_with_torch_adamw(name):
    for rank, per_rank in _results().items():
        got = per_rank[name]
        assert not isinstance(got, str), f"rank {rank}: {got}"
        want, have = (flat_tensors(x) for x in got)
        assert len(want) == len(have)
        for i, (a, b) in enumerate(zip(want, have)):
            # DDP reduces what p.grad accumulated over several syncing backwards (the sum), stage 2 adds
            # each backward's average: an ulp apart (float64)
            torch.testing.assert_close(b, a, rtol=1e-13, atol=1e-15, msg=lambda m: f"rank {rank}, tensor {i}: {m}")


# -- a forward on one rank only ---------------------------------------------------------------
def _side_forward(rank, world_size):
    return [_buffers(rank, stage2, side_forward=True, accumulate=2, evaluate=True) for stage2 in (False, True)]


@pytest.mark.timeout(120)
def test_a_grad_mode_forward_on_rank_0_alone_runs_no_collective_and_changes_nothing_ddp_would_not():
    """A callback's grad-mode forward of the bound module on rank 0 only, between steps (under DDP it
    runs on the unwrapped module): it must run no collective (both ranks would wait for the
    collective timeout), and every step's params and buffers equal DDP's on every rank. (A forward
    on rank 0 alone that changes buffers the training forwards read differs from DDP: DDP sends
    rank 0's change at the next training forward, stage 2 at the end of the next syncing backward.)"""
    for rank, (want, have) in enumerate(run_ranks(_side_forward, 2, timeout=60)):
        for i, (a, b) in enumerate(zip(flat_tensors(want), flat_tensors(have))):
            torch.testing.assert_close(b, a, rtol=1e-13, atol=1e-15, msg=lambda m: f"rank {rank}, tensor {i}: {m}")


@pytest.mark.timeout(500)
def test_trainer_callback_forward_on_rank_0_and_predict_evaluate_between_steps_equal_ddp_adamw(tmp_path):
    """Under Trainer the ``model`` callbacks get is the bound module itself: a callback computing a
    sample loss on rank 0 alone after every step, ``trainer.predict`` after steps 2 and 5 and an
    evaluation every 3 steps train exactly as without them, and as DDP + torch AdamW with the same
    callbacks (which the callbacks see equally)."""
    from tests.hf_trainer_cases import run_many

    extra = dict(sample_loss_on_rank0=True, predict_between_steps=True, evaluate=True, eval_strategy="steps",
                 eval_steps=3)
    stage2, ddp, plain = run_ranks(run_many, 2, [
        ("run_trainer", dict(output_dir=str(tmp_path / "s2"), optim_args="stage=2", **extra)),
        ("run_trainer", dict(output_dir=str(tmp_path / "ddp"), optim="adamw_torch", **extra)),
        ("run_trainer", dict(output_dir=str(tmp_path / "plain"), optim_args="stage=2")),
    ], timeout=300)[0]
    assert stage2[2]["wrapped"] == "BertForSequenceClassification" and ddp[2]["wrapped"] == "DistributedDataParallel"
    for n, want in ddp[0].items():
        torch.testing.assert_close(stage2[0][n], want, rtol=0, atol=1e-12, msg=lambda m: f"{n}: {m}")
        assert torch.equal(stage2[0][n], plain[0][n]), f"the callbacks changed {n}"
    assert len(stage2[2]["sample_losses"]) == 7 and len(stage2[2]["predictions"]) == 2
    torch.testing.assert_close(torch.tensor(stage2[2]["sample_losses"]), torch.tensor(ddp[2]["sample_losses"]),
                               rtol=1e-10, atol=0)
    for got, want in zip(stage2[2]["predictions"], ddp[2]["predictions"]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    evals = [[(e["step"], e["eval_loss"]) for e in run[1] if "eval_loss" in e] for run in (stage2, ddp)]
    assert [s for s, _ in evals[0]] == [s for s, _ in evals[1]] == [3, 6, 7]
    torch.testing.assert_close(torch.tensor([v for _, v in evals[0]]), torch.tensor([v for _, v in evals[1]]),
                               rtol=1e-10, atol=0)


# -- several optimizers over one model ------------------------------------------------------------
def _uncovered(rank, world_size):
    model = _mlp(8, (5, 6, 1))
    opt = _zero(model[0].parameters())
    opt.bind_module(model)  # model[2] is in no optimizer
    try:
        model(_data(0, rank, 4, 5))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(60)
def test_a_trainable_param_in_no_bound_optimizer_is_refused_at_the_first_forward():
    for message in run_ranks(_uncovered, 2, timeout=30):
        assert "in no stage-2 optimizer bound to it: ['2.weight', '2.bias']" in message, message


def _accelerate_two_optimizers(rank, world_size, stage2: bool):
    """An Accelerate loop whose model has a backbone and a head with optimizers of their own
    (prepared in one call), accumulate(2), each optimizer's params clipped on their own."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    os.environ.update(LOCAL_RANK=str(rank), ACCELERATE_USE_CPU="1")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = _mlp(9, (5, 6, 4, 1))
    backbone, head = list(model[0].parameters()), [*model[2].parameters(), *model[4].parameters()]
    if stage2:
        opts = (_zero(backbone), _zero(head, lr=0.01))
    else:
        opts = (torch.optim.AdamW(backbone, **LR), torch.optim.AdamW(head, **{**LR, "lr": 0.01}))
    prepared, *opts = accelerator.prepare(model, *opts)
    for step in range(2 * STEPS):
        with accelerator.accumulate(prepared):
            accelerator.backward(prepared(_data(step, rank, 4, 5)).square().mean())
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(backbone, 0.1)
                accelerator.clip_grad_norm_(head, 0.1)
            for opt in opts:
                opt.step()
                opt.zero_grad()
    return type(prepared).__name__, _state(model)


def _accelerate_both(rank, world_size):
    return [_accelerate_two_optimizers(rank, world_size, stage2) for stage2 in (False, True)]


@pytest.mark.timeout(200)
def test_accelerate_prepares_two_stage2_optimizers_over_one_model_as_ddp_with_two_adamw():
    for rank, ((ddp_kind, want), (kind, have)) in enumerate(run_ranks(_accelerate_both, 2, timeout=150)):
        assert (ddp_kind, kind) == ("DistributedDataParallel", "Sequential")
        for i, (a, b) in enumerate(zip(want, have)):
            torch.testing.assert_close(b, a, rtol=1e-13, atol=1e-15, msg=lambda m: f"rank {rank}, tensor {i}: {m}")


# -- what p.grad holds between backward and step: one process ------------------------------------
def _bound_mlp():
    model = _mlp(10, (5, 6, 1))
    opt = _zero(model.parameters())
    opt.bind_module(model)
    model(_data(0, 0, 4, 5)).sum().backward()
    return model, opt


@pytest.mark.fast
def test_a_grad_replaced_by_hand_is_refused_naming_the_fix():
    model, opt = _bound_mlp()
    model[0].weight.grad = torch.ones_like(model[0].weight)
    with pytest.raises(RuntimeError, match=r"replaced by hand after the backward.*set p.grad = None"):
        opt.step()


@pytest.mark.fast
def test_torch_clipping_of_the_stand_ins_fails_loudly_instead_of_clipping_nothing():
    """Before, ``torch.nn.utils.clip_grad_norm_`` found every p.grad None and returned 0."""
    model, opt = _bound_mlp()
    with pytest.raises(RuntimeError, match=r"writes into the grad of .*clip with optimizer.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


@pytest.mark.fast
def test_the_stand_ins_hold_no_memory_and_leave_at_the_step():
    model, opt = _bound_mlp()
    assert all(p.grad is not None and p.grad.untyped_storage().nbytes() == 8 for p in model.parameters())
    assert all(p.grad.isnan().all() for p in model.parameters())
    opt.step()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.fast
def test_the_steps_one_pass_check_of_the_stand_ins_sees_every_touch():
    """The step skips settling the stand-ins when ``StandIns.untouched`` says nothing was done to them: it must
    see each thing settling follows (dropped, zeroed, replaced), stand-ins placed over earlier ones included."""
    from hf_zero._stage2.stand_ins import StandIns

    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2)),
              torch.nn.Parameter(torch.ones(1), requires_grad=False)]
    touches = {"dropped": lambda p: setattr(p, "grad", None), "zeroed": lambda p: p.grad.zero_(),
               "replaced": lambda p: setattr(p, "grad", torch.zeros_like(p))}
    for name, touch in touches.items():
        stand_ins = StandIns()
        stand_ins.place(params, range(3), str)
        assert stand_ins.untouched(params) and params[2].grad is None, name  # the frozen one gets none
        touch(params[1])
        assert not stand_ins.untouched(params), name
        stand_ins.clear()
        params[1].grad = None
    stand_ins = StandIns()
    stand_ins.place(params, [0], str)
    params[0].grad.zero_()
    stand_ins.place(params, [1], str)  # over param 0's, zeroed since and not settled
    assert not stand_ins.untouched(params)
    assert stand_ins.settle(SimpleNamespace(params=params), clear=False) == [(0, True)]
    assert stand_ins.untouched(params) is False  # settling forgets the one-pass check until the next place
