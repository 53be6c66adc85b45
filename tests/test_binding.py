"""A binding ends with its run ([Note: a binding ends with its run] in hf_zero/_binding.py).

What hf_zero attaches to a user's module (stage 2's hooks and ``no_sync``, the integrations'
hooks, the state-dict hook) is removed by ``optimizer.unbind()``, when the optimizer is
collected, and by the Trainer / Accelerate wiring when training ends; a bound module pickles
and deep-copies, unbound. Each case is compared with torch doing the same on a model never
bound: its hooks and attributes, and what torch's AdamW (under DDP on 2 gloo ranks) or a
Trainer makes of it, bitwise. And a write through a tensor of ``model.state_dict()`` on a bf16
model under Trainer stands, as with ``adamw_torch`` ([Note: writes through a state dict's
aliases] in hf_zero/_masters.py).
"""

from __future__ import annotations

import copy
import gc
import io
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from transformers import TrainerCallback

import hf_zero
from tests._dist import run_ranks
from tests.models import BATCH, MLP
from tests.hf_trainer_cases import copy_of_bert as _copy_of_bert
from tests.hf_trainer_cases import grad_norms as _norms
from tests.hf_trainer_cases import named_params as _params
from tests.hf_trainer_cases import small_trainer as _trainer
from tests.hf_trainer_cases import train_with_fresh_copy

pytestmark = pytest.mark.filterwarnings("ignore")

STEPS = 3


def _hooks_and_attributes(model: nn.Module) -> list:
    """Everything a binding may leave on a module tree: per module its forward (pre-)hooks, state-dict
    hooks and attribute names; per param its post-accumulate-grad and tensor hooks."""
    out = []
    for name, m in model.named_modules():
        out.append((name, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._state_dict_hooks),
                    len(m._state_dict_pre_hooks), sorted(m.__dict__)))
    for name, p in model.named_parameters():
        out.append((name, len(p._post_accumulate_grad_hooks or {}), len(p._backward_hooks or {})))
    return out


def _train(model, opt, steps: int = STEPS, rank: int = 0, world_size: int = 1, forward=None):
    forward = model if forward is None else forward
    for step in range(steps):
        x, y = model.batch(step, BATCH * world_size)
        forward(x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH]).backward()
        opt.step()
        opt.zero_grad()


def _bound_mlp(steps: int = STEPS):
    torch.manual_seed(0)
    model = MLP()
    opt = hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, stage=2)
    opt.bind_module(model, bucket_cap_mb=0.0005)
    _train(model, opt, steps)
    return model, opt


def _copy_of(model: nn.Module) -> nn.Module:
    fresh = type(model)()
    fresh.load_state_dict(model.state_dict())
    return fresh


def _torch_run(model: nn.Module, steps: int = STEPS) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, steps)
    return [p.detach().clone() for p in model.parameters()]


# -- in one process -------------------------------------------------------------------------------
@pytest.mark.fast
@pytest.mark.parametrize("end", ["unbind", "collected"])
def test_an_ended_binding_leaves_the_module_as_one_never_bound(end):
    model, opt = _bound_mlp()
    assert _hooks_and_attributes(model) != _hooks_and_attributes(MLP())  # bound: hooks and no_sync
    if end == "unbind":
        opt.unbind()
        opt.unbind()  # idempotent
    else:
        del opt
        gc.collect()
    assert _hooks_and_attributes(model) == _hooks_and_attributes(MLP())
    fresh = _copy_of(model)
    assert all(torch.equal(a, b) for a, b in zip(_torch_run(model), _torch_run(fresh)))


@pytest.mark.fast
@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
def test_a_bound_module_pickles_and_deep_copies_and_the_copy_is_unbound(how):
    model, opt = _bound_mlp()
    if how == "torch.save":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    else:
        copied = copy.deepcopy(model)
    fresh = _copy_of(model)
    # the copy trains like a model never bound: its hooks do nothing (its grads stay in p.grad) ...
    assert all(torch.equal(a, b) for a, b in zip(_torch_run(copied), _torch_run(fresh)))
    # ... and the original is still bound: it goes on training as before
    twin_model, twin_opt = _bound_mlp(STEPS)
    _train(model, opt, 2)
    _train(twin_model, twin_opt, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))
    assert all(p.grad is None for p in model.parameters())  # stage 2 still takes every grad


@pytest.mark.fast
def test_binding_a_bound_optimizer_to_another_module_names_the_fix():
    model, opt = _bound_mlp(1)
    other_model = MLP()
    with pytest.raises(ValueError, match=r"already bound to another module; call optimizer.unbind\(\) first"):
        opt.bind_module(other_model)
    assert _hooks_and_attributes(other_model) == _hooks_and_attributes(MLP())  # refused before anything changed
    opt.unbind()
    assert _hooks_and_attributes(model) == _hooks_and_attributes(MLP())


@pytest.mark.fast
def test_two_optimizers_on_one_module_unbind_one_at_a_time():
    """Several stage-2 optimizers may bind one module: the one unbound first leaves the other's
    hooks and no_sync working; the last one leaves the module as never bound."""
    torch.manual_seed(0)
    model = MLP()
    params = list(model.parameters())  # the linears', then scale and unused
    first = hf_zero.ZeroBucketOptimizer(params[-2:], torch.optim.AdamW, lr=1e-2, stage=2)
    second = hf_zero.ZeroBucketOptimizer(params[:-2], torch.optim.AdamW, lr=1e-2, stage=2)
    first.bind_module(model)
    second.bind_module(model)
    first.unbind()
    for p in params[-2:]:
        p.requires_grad_(False)  # no bound optimizer holds them now
    with model.no_sync():  # the second's: its grads stay in p.grad
        model(*model.batch(0, BATCH)).backward()
    assert params[0].grad is not None and bool(torch.isfinite(params[0].grad).all())  # a local grad, not a stand-in
    second.zero_grad()
    twin = _copy_of(model)
    for p in list(twin.parameters())[-2:]:
        p.requires_grad_(False)
    alone = hf_zero.ZeroBucketOptimizer(list(twin.parameters())[:-2], torch.optim.AdamW, lr=1e-2, stage=2)
    alone.bind_module(twin)
    _train(model, second, 2)
    _train(twin, alone, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    second.unbind()
    assert _hooks_and_attributes(model) == _hooks_and_attributes(MLP())


class _Counting(nn.Module):
    """A linear layer and a buffer each forward adds rank + 1 to (BatchNorm's running stats, say)."""

    def __init__(self, rank: int):
        super().__init__()
        torch.manual_seed(0)
        self.rank = rank
        self.first, self.second = nn.Linear(3, 2).double(), nn.Linear(2, 1).double()
        self.register_buffer("seen", torch.zeros(1, dtype=torch.float64))

    def forward(self, x):
        self.seen += self.rank + 1
        return self.second(self.first(x)).sum()


def _buffers_after_an_unbind(rank, world_size, unbind_first: bool):
    """Two stage-2 optimizers on one module; the first bound (which sends rank 0's buffers) unbinds
    after two steps, or stays; the second goes on for two more. Returns the buffer on this rank."""
    model = _Counting(rank)
    first = hf_zero.ZeroBucketOptimizer(model.first.parameters(), torch.optim.SGD, lr=0.1, stage=2)
    second = hf_zero.ZeroBucketOptimizer(model.second.parameters(), torch.optim.SGD, lr=0.1, stage=2)
    first.bind_module(model)
    second.bind_module(model)
    x = torch.ones(2, 3, dtype=torch.float64)
    for step in range(4):
        if step == 2 and unbind_first:
            first.unbind()
            model.first.requires_grad_(False)  # no bound optimizer holds it now
        model(x).backward()
        for opt in (first, second) if step < 2 or not unbind_first else (second,):
            opt.step()
            opt.zero_grad()
    model(x)  # the next training forward takes rank 0's buffers
    return model.seen.item()


def test_the_buffers_broadcast_goes_on_when_the_optimizer_that_sent_them_unbinds():
    """Only the first stage-2 optimizer bound to a module sends rank 0's buffers; when it unbinds, the
    ones still bound take over: every rank's buffer then equals what it is with both bound throughout
    (rank 0's count, plus this rank's last forward), as under DDP's broadcast_buffers."""
    both = run_ranks(_buffers_after_an_unbind, 2, False, timeout=90)
    after = run_ranks(_buffers_after_an_unbind, 2, True, timeout=90)
    assert both == [5.0, 6.0]  # rank 0: 5 forwards of 1; rank 1: rank 0's 4, then its own 2
    assert after == both


@pytest.mark.fast
@pytest.mark.parametrize("end", ["unbind", "collected"])
def test_an_ended_binding_between_backward_and_step_leaves_no_stand_ins(end):
    """Between a backward and the step p.grad holds stand-ins of the sharded grads: an ended binding
    takes them out and leaves no hooks (a collected optimizer too: nothing on the module holds it)."""
    model, opt = _bound_mlp(1)
    model(*model.batch(1, BATCH)).backward()
    assert all(p.grad is not None for p in model.parameters())  # the stand-ins
    if end == "unbind":
        opt.unbind()
    else:
        del opt
        gc.collect()
    assert all(p.grad is None for p in model.parameters())
    assert _hooks_and_attributes(model) == _hooks_and_attributes(MLP())
    fresh = _copy_of(model)
    assert all(torch.equal(a, b) for a, b in zip(_torch_run(model), _torch_run(fresh)))


@pytest.mark.fast
@pytest.mark.parametrize("end", ["end_training", "free_memory", "clear"])
def test_accelerate_unbinds_when_the_run_ends(end):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    torch.manual_seed(0)
    model = MLP()
    opt = hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, stage=2)
    accelerator = Accelerator(cpu=True)
    prepared, prepared_opt = accelerator.prepare(model, opt)
    _train(model, prepared_opt, 2, forward=prepared)
    never = MLP()  # Accelerate's mark on the user's own module goes too: a later Accelerator prepares it anew
    assert _hooks_and_attributes(model) != _hooks_and_attributes(never)  # bound by the wiring
    getattr(accelerator, end)()
    assert _hooks_and_attributes(model) == _hooks_and_attributes(never)
    fresh = _copy_of(model)
    assert all(torch.equal(a, b) for a, b in zip(_torch_run(model), _torch_run(fresh)))


# -- 2 gloo ranks: after the binding, DDP + torch AdamW; rebinding with compile / checkpointing ----
class CheckpointedMLP(MLP):
    """MLP whose middle runs under non-reentrant activation checkpointing."""

    def forward(self, x, y):
        h = self.net[1](self.net[0](x))
        h = checkpoint(lambda t: self.net[3](self.net[2](t)), h, use_reentrant=False)
        return F.mse_loss(self.net[4](h) * self.scale, y)


def _after_binding(rank, world_size):
    out = {}
    for end in ("unbind", "collected"):
        model, opt = MLP(), None
        opt = hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, stage=2)
        opt.bind_module(model, bucket_cap_mb=0.0005)
        _train(model, opt, STEPS, rank, world_size)
        if end == "unbind":
            opt.unbind()
        else:
            del opt
            gc.collect()
        fresh = _copy_of(model)
        runs = []
        for m in (model, fresh):
            ddp = nn.parallel.DistributedDataParallel(m, find_unused_parameters=True)  # MLP.unused
            _train(m, torch.optim.AdamW(m.parameters(), lr=1e-2), STEPS, rank, world_size, forward=ddp)
            runs.append([p.detach().clone() for p in m.parameters()])
        out[end] = runs
    for kind in ("compile", "checkpointing"):
        cls = CheckpointedMLP if kind == "checkpointing" else MLP
        model = cls()
        first = hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, stage=2)
        first.bind_module(model, bucket_cap_mb=0.0005)
        _train(model, first, 2, rank, world_size)
        first.unbind()
        fresh = cls()
        fresh.load_state_dict(model.state_dict())
        runs = []
        for m in (model, fresh):  # rebound after an unbind, and bound for the first time
            opt = hf_zero.ZeroBucketOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2, stage=2)
            opt.bind_module(m, bucket_cap_mb=0.0005)
            forward = torch.compile(m, backend="eager") if kind == "compile" else m
            _train(m, opt, STEPS, rank, world_size, forward=forward)
            runs.append([p.detach().clone() for p in m.parameters()])
        out[kind] = runs
    return out


@pytest.fixture(scope="module")
def after_binding():
    return run_ranks(_after_binding, 2, timeout=240)


@pytest.mark.parametrize("case", ["unbind", "collected", "compile", "checkpointing"])
def test_after_the_binding_the_model_trains_as_a_fresh_copy_does(after_binding, case):
    """unbind / collected: DDP + torch AdamW on the model equals it on a fresh copy, bitwise; compile /
    checkpointing: a stage-2 optimizer bound again after an unbind equals one bound to a fresh copy."""
    for rank_runs in after_binding:
        bound, fresh = rank_runs[case]
        for i, (a, b) in enumerate(zip(bound, fresh)):
            assert torch.equal(a, b), f"{case}: param {i} differs from the fresh copy's"


# -- 2 gloo ranks, Trainer ------------------------------------------------------------------------
SECOND = {"adamw_torch": ("adamw_torch", None), "stage1": ("zero_bucket", None),
          "stage2": ("zero_bucket", "stage=2")}


def _trainer_cases(rank, world_size, base):
    from tests.hf_trainer_cases import tiny_bert

    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    out = {}
    for second, (optim, optim_args) in SECOND.items():
        for first_alive in (True, False):
            if second != "stage2" and not first_alive:
                continue
            model = tiny_bert()
            first = _trainer(model, f"{base}/first", "zero_bucket", "stage=2")
            first.train()
            if not first_alive:
                del first
                gc.collect()
            out[(second, first_alive)], _ = train_with_fresh_copy(model, f"{base}/second", optim, optim_args)
    # train() twice, stage 2 and Trainer's own optimizer
    for optim, optim_args in (("zero_bucket", "stage=2"), ("adamw_torch_fused", None)):
        model = tiny_bert()
        trainer = _trainer(model, f"{base}/twice", optim, optim_args)
        trainer.train()
        trainer.train()
        out[("twice", optim)] = (_params(model), _norms(trainer))
    # a copy made under the Trainer wiring is unbound: it trains as a model never bound, and the
    # original trains as without the copy
    copier, runs = _CopyAtStep(2), []
    for callbacks in ([copier], []):
        model = tiny_bert()
        _trainer(model, f"{base}/copy", "zero_bucket", "stage=2", callbacks=callbacks).train()
        runs.append(_params(model))
    out["copy"] = (copier.equal, runs)
    return out


class _CopyAtStep(TrainerCallback):
    """Deep-copies the model after step ``step``, then trains the copy and a never-bound model with its
    values one torch AdamW step each (in grad mode: hooks of the original's reducer would run)."""

    def __init__(self, step):
        self.step, self.equal = step, None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step != self.step:
            return
        copied, never = copy.deepcopy(model), _copy_of_bert(model)
        results = []
        for m in (copied, never):
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
            m(input_ids=torch.arange(8).reshape(1, 8) + 5, labels=torch.tensor([1])).loss.backward()
            opt.step()
            results.append(_params(m))
        self.equal = all(torch.equal(results[0][n], results[1][n]) for n in results[1])


@pytest.fixture(scope="module")
def trainer_cases(tmp_path_factory):
    return run_ranks(_trainer_cases, 2, str(tmp_path_factory.mktemp("binding")), timeout=480)


@pytest.mark.parametrize("second, first_alive", [("adamw_torch", True), ("stage1", True), ("stage2", True),
                                                 ("stage2", False)])
def test_a_second_trainer_on_a_stage2_trained_model_trains_as_on_a_fresh_copy(trainer_cases, second, first_alive):
    for per_rank in trainer_cases:
        (got, got_norms), (want, want_norms) = per_rank[(second, first_alive)]
        assert got_norms == want_norms and all(n > 0 for n in got_norms), (got_norms, want_norms)
        for name in want:
            assert torch.equal(got[name], want[name]), f"{name} differs from the fresh copy's"


def test_train_twice_under_stage2_equals_trainers_own_optimizer(trainer_cases):
    from tests.models import assert_params_equal

    for per_rank in trainer_cases:
        got, got_norms = per_rank[("twice", "zero_bucket")]
        want, want_norms = per_rank[("twice", "adamw_torch_fused")]
        assert len(got_norms) == len(want_norms) == 3  # the second train()'s (its log starts afresh)
        torch.testing.assert_close(torch.tensor(got_norms), torch.tensor(want_norms), rtol=1e-6, atol=0)
        assert_params_equal(list(got.values()), list(want.values()), "train() twice vs adamw_torch_fused")


def test_a_deep_copy_made_under_the_trainer_wiring_is_unbound(trainer_cases):
    for per_rank in trainer_cases:
        copy_trains_as_never_bound, (with_copy, without) = per_rank["copy"]
        assert copy_trains_as_never_bound is True
        for name in without:
            assert torch.equal(with_copy[name], without[name]), f"{name}: the copy changed the original's training"


# -- item: an in-place write through model.state_dict() on a bf16 model under Trainer -------------
EDIT_LR = 1e-6


def _edit_cases(rank, world_size, base):
    from tests.hf_trainer_cases import tiny_bert

    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))

    class ZeroHeadAtStep2(TrainerCallback):
        def __init__(self):
            self.after = {}

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:
                model.state_dict()["classifier.weight"].zero_()  # a tensor of the state dict, written in place
            if state.global_step == 1:  # what a save gets: the params' own memory (no copy), storages apart
                sd, params = model.state_dict(), dict(model.named_parameters())
                self.no_copy = all(sd[n].data_ptr() == p.data_ptr() for n, p in params.items())
                self.storages = len({sd[n].untyped_storage().data_ptr() for n in params}) == len(params)
            self.after[state.global_step] = model.classifier.weight.detach().abs().max().item()

    out = {}
    for optim in ("zero_bucket", "adamw_torch"):
        edit = ZeroHeadAtStep2()
        _trainer(tiny_bert().to(torch.bfloat16), f"{base}/{optim}", optim, callbacks=[edit], max_steps=4,
                 learning_rate=EDIT_LR, lr_scheduler_type="constant").train()
        out[optim] = edit.after
        out[f"{optim} save"] = (edit.no_copy, edit.storages)
    return out


@pytest.fixture(scope="module")
def edit_cases(tmp_path_factory):
    return run_ranks(_edit_cases, 2, str(tmp_path_factory.mktemp("edits")), timeout=240)


def test_a_write_through_a_state_dict_tensor_stands_as_with_adamw_torch(edit_cases):
    for per_rank in edit_cases:
        mine, torchs = per_rank["zero_bucket"], per_rank["adamw_torch"]
        assert per_rank["zero_bucket save"] == per_rank["adamw_torch save"] == (True, True)
        assert mine[1] > 100 * EDIT_LR and torchs[1] > 100 * EDIT_LR  # the head was far from zero before
        assert mine[2] == torchs[2] == 0.0  # the edit itself
        for step in (3, 4):  # each step moves a weight by about the learning rate from where the edit left it
            assert torchs[step] <= 4 * step * EDIT_LR, torchs
            assert mine[step] <= 2 * max(torchs[step], EDIT_LR), (step, mine, torchs)
