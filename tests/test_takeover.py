"""A run's binding never outlives it silently ([Note: a newer binding takes over] in hf_zero/_binding.py,
[Note: params own their storage after a run] in hf_zero/_partition.py).

- A newer binding over the same params takes over and the older one is inert: a plain loop binding a
  second stage-2 optimizer while the first is alive, a second optimizer prepared on the same Accelerator
  (a linear probe, then the full fine-tune), each compared with torch AdamW (DDP, or one process on the
  global batch) in float64; the older optimizer's step then refuses, naming the fix, and binding it again
  takes the params back.
- An interrupted ``Trainer.train()`` (a ``KeyboardInterrupt`` from a callback) unbinds: the next Trainer
  on the model, with ``adamw_torch`` or stage 2, trains as on a fresh copy of it, bitwise, the first
  Trainer still referenced.
- After a Trainer run with a save, the params own their storage (``safetensors.torch.save_model``
  works and loads back equal, as under ``adamw_torch``), and once the Trainer and the model are
  deleted nothing of hf_zero holds any storage the params had during the run.
"""

from __future__ import annotations

import copy
import gc
import os

import pytest
import torch
import torch.nn as nn

import hf_zero
from tests._dist import run_ranks
from tests.models import BATCH, MLP, assert_params_equal
from tests.hf_trainer_cases import copy_of_bert as _copy_of_bert
from tests.hf_trainer_cases import small_trainer as _trainer
from tests.hf_trainer_cases import train_with_fresh_copy

pytestmark = pytest.mark.filterwarnings("ignore")

TAKEN_OVER = "another optimizer bound the same params after this one"


def _batch(model, step: int, rank: int, world_size: int):
    x, y = model.batch(step, BATCH * world_size)
    return x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH]


def _steps(model, opt, steps, rank, world_size, forward=None, backward=None, first=0):
    forward = model if forward is None else forward
    for step in range(first, first + steps):
        loss = forward(*_batch(model, step, rank, world_size))
        loss.backward() if backward is None else backward(loss)
        opt.step()
        opt.zero_grad()


def _refusal(opt) -> str | None:
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return None


# -- a plain loop: opt2.bind_module(model) while opt1 is alive ---------------------------------------
def _plain_loop(rank, world_size):
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    first = hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, stage=2)
    first.bind_module(model, bucket_cap_mb=0.0005)
    _steps(model, first, 2, rank, world_size)
    second = hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, stage=2)
    second.bind_module(model, bucket_cap_mb=0.0005)
    refused = _refusal(first)  # before any collective: every rank refuses
    _steps(model, second, 3, rank, world_size, first=2)
    after_second = [p.detach().clone() for p in model.parameters()]
    first.bind_module(model, bucket_cap_mb=0.0005)  # taken back: the newest binding wins again
    refused_second = _refusal(second)
    _steps(model, first, 1, rank, world_size, first=5)

    ddp = nn.parallel.DistributedDataParallel(reference, find_unused_parameters=True)
    opt1 = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    _steps(reference, opt1, 2, rank, world_size, forward=ddp)
    opt2 = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    _steps(reference, opt2, 3, rank, world_size, forward=ddp, first=2)
    want_second = [p.detach().clone() for p in reference.parameters()]
    _steps(reference, opt1, 1, rank, world_size, forward=ddp, first=5)
    return (refused, refused_second, after_second, want_second, [p.detach().clone() for p in model.parameters()],
            [p.detach().clone() for p in reference.parameters()])


@pytest.mark.fast
def test_a_second_optimizer_bound_in_a_plain_loop_takes_over_and_equals_ddp():
    for refused, refused_second, got_second, want_second, got, want in run_ranks(_plain_loop, 2, timeout=120):
        assert refused is not None and TAKEN_OVER in refused and "bind_module(model) again" in refused
        assert refused_second is not None and TAKEN_OVER in refused_second
        assert all(bool(torch.isfinite(p).all()) for p in got_second + got)
        assert_params_equal(got_second, want_second, "the second optimizer's run vs DDP + a second torch AdamW")
        assert_params_equal(got, want, "the first optimizer bound again vs DDP + the first torch AdamW")


def _plain_loop_stage1(rank, world_size):
    """Stage 1 under one DDP: the first optimizer's reduce-scatter comm hook averages again once a second
    optimizer over the same params binds the DDP (which keeps one comm hook: the second all-reduces)."""
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    first = hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, grad_reduce="reduce_scatter")
    first.bind_ddp(ddp)
    _steps(model, first, 2, rank, world_size, forward=ddp)
    second = hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, grad_reduce="reduce_scatter")
    second.bind_ddp(ddp)
    taken = (first.gradient_path.taken_over, second.grad_reduce)
    _steps(model, second, 3, rank, world_size, forward=ddp, first=2)

    ref_ddp = nn.parallel.DistributedDataParallel(reference, find_unused_parameters=True)
    _steps(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), 2, rank, world_size, forward=ref_ddp)
    _steps(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), 3, rank, world_size, forward=ref_ddp, first=2)
    got, want = [p.detach().clone() for p in model.parameters()], [p.detach().clone() for p in reference.parameters()]
    from torch.multiprocessing.reductions import StorageWeakRef

    refs = [StorageWeakRef(p.untyped_storage()) for p in model.parameters()]  # views of the flat buffers
    del ddp, first, second, model
    gc.collect()
    return taken, got, want, sum(not r.expired() for r in refs)


def test_a_second_stage1_optimizer_bound_to_the_same_ddp_takes_over_and_equals_ddp():
    """And once the model and the optimizers are deleted (never unbound), no storage of the model is alive."""
    for (taken_over, grad_reduce), got, want, alive in run_ranks(_plain_loop_stage1, 2, timeout=120):
        assert taken_over and grad_reduce == "all_reduce"
        assert_params_equal(got, want, "the second stage-1 optimizer vs DDP + a second torch AdamW")
        assert alive == 0, f"{alive} storages of the model are alive after the model and the optimizers were deleted"


@pytest.mark.fast
def test_a_takeover_that_leaves_params_unserved_is_refused_at_the_next_forward():
    """The newer optimizer holds only the head: the older one's other trainable params would have no
    reducer, so the next forward refuses, naming them, before any backward or step."""
    torch.manual_seed(0)
    model = MLP()
    first = hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, stage=2)
    first.bind_module(model)
    _steps(model, first, 1, 0, 1)
    head = hf_zero.ZeroBucketOptimizer(model.net[4].parameters(), torch.optim.AdamW, lr=1e-2, stage=2)
    head.bind_module(model)
    assert first.gradient_path.taken_over
    with pytest.raises(ValueError, match=r"trainable params of the bound model are in no stage-2 optimizer bound "
                                         r"to it: \['scale', 'unused', 'net.0.weight'"):
        model(*model.batch(1, BATCH))


@pytest.mark.fast
def test_a_bind_that_is_refused_takes_nothing_over():
    """Every refusal of a bind comes before the takeover: a newer optimizer over the head, refused for its
    local_accumulation (the backbone's optimizer, which stays, bound with another), leaves the head's older
    optimizer bound, and the model trains on as if the refused bind had never been tried."""
    def run(try_a_refused_bind: bool):
        torch.manual_seed(0)
        model = MLP()
        body = [p for n, p in model.named_parameters() if not n.startswith("net.4.")]
        backbone = hf_zero.ZeroBucketOptimizer(body, torch.optim.AdamW, lr=1e-2, stage=2)
        head = hf_zero.ZeroBucketOptimizer(model.net[4].parameters(), torch.optim.AdamW, lr=1e-2, stage=2)
        backbone.bind_module(model, local_accumulation=False)
        head.bind_module(model, local_accumulation=False)
        if try_a_refused_bind:
            newer = hf_zero.ZeroBucketOptimizer(model.net[4].parameters(), torch.optim.AdamW, lr=1e-2, stage=2)
            with pytest.raises(ValueError, match="local_accumulation must be the same for every optimizer bound"):
                newer.bind_module(model, local_accumulation=True)
            assert not head.gradient_path.taken_over
        for step in range(3):
            model(*model.batch(step, BATCH)).backward()
            backbone.step()
            head.step()
            backbone.zero_grad()
            head.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    assert_params_equal(run(True), run(False), "after a refused bind vs never tried")


def _save_and_load_back(model, path):
    import safetensors.torch

    safetensors.torch.save_model(model, str(path))
    fresh = MLP()
    safetensors.torch.load_model(fresh, str(path))
    return all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


@pytest.mark.fast
@pytest.mark.parametrize("stage", [1, 2])
def test_safetensors_save_model_works_while_bound_and_after_unbind_and_training_goes_on_exactly(tmp_path, stage):
    """While bound (stage 2: bind_module) the model's state dict gives every param storage of its own; after
    unbind() the params own it (the buffers freed) and the next steps (rebuilt buffers) equal a run that was
    never unbound, bitwise."""
    runs = []
    for unbind in (True, False):
        torch.manual_seed(0)
        model = MLP()
        opt = hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, stage=stage)
        if stage == 2:
            opt.bind_module(model)
        _steps(model, opt, 2, 0, 1)
        if unbind:
            assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) < 8  # views of the buffers
            if stage == 2:
                assert _save_and_load_back(model, tmp_path / "bound.safetensors")
            opt.unbind()
            assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 8
            assert all(p.untyped_storage().nbytes() == p.nbytes for p in model.parameters())
            assert _save_and_load_back(model, tmp_path / "unbound.safetensors")
            if stage == 2:
                opt.bind_module(model)
        _steps(model, opt, 2, 0, 1, first=2)
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


# -- Accelerate: a linear probe's optimizer, then the full fine-tune's, on one Accelerator ------------
def _probe_then_full(rank, world_size):
    from accelerate import Accelerator

    os.environ.update(LOCAL_RANK=str(rank), ACCELERATE_USE_CPU="1")
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    head = {"net.4.weight", "net.4.bias", "scale"}
    for m in (model, reference):
        for n, p in m.named_parameters():
            p.requires_grad_(n in head)
    probe = hf_zero.ZeroBucketOptimizer([p for p in model.parameters() if p.requires_grad], torch.optim.AdamW,
                                        lr=1e-2, stage=2)
    accelerator = Accelerator(cpu=True)
    prepared, prepared_probe = accelerator.prepare(model, probe)
    _steps(model, prepared_probe, 2, rank, world_size, forward=prepared, backward=accelerator.backward)
    model.requires_grad_(True)
    full = accelerator.prepare(hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, stage=2))
    _steps(model, full, 3, rank, world_size, forward=prepared, backward=accelerator.backward, first=2)
    refused = _refusal(prepared_probe)
    accelerator.end_training()

    # torch AdamW on one process, on the global batch
    def whole(m, opt, steps, first=0):
        for step in range(first, first + steps):
            m(*m.batch(step, BATCH * world_size)).backward()
            opt.step()
            opt.zero_grad()

    whole(reference, torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2), 2)
    reference.requires_grad_(True)
    whole(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), 3, first=2)
    return refused, [p.detach().clone() for p in model.parameters()], [p.detach().clone() for p in reference.parameters()]


def test_a_second_optimizer_prepared_on_one_accelerator_takes_over_and_equals_torch():
    for refused, got, want in run_ranks(_probe_then_full, 2, timeout=120):
        assert refused is not None and TAKEN_OVER in refused
        assert all(bool(torch.isfinite(p).all()) for p in got)
        assert_params_equal(got, want, "probe then full fine-tune vs torch AdamW")


def _torch_after_interrupted_stage2(rank, world_size):
    """A stage-2 loop on one Accelerator stops between a backward and its step (an exception; nothing ends
    the run); then another Accelerator prepares the model with torch's AdamW under DDP, as it would a fresh
    copy of it. Returns, per model, the grad norms and the params."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    os.environ.update(LOCAL_RANK=str(rank), ACCELERATE_USE_CPU="1")
    torch.manual_seed(0)
    model = MLP()
    first = Accelerator(cpu=True)
    prepared, opt = first.prepare(model, hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                                                                     stage=2))
    _steps(model, opt, 2, rank, world_size, forward=prepared, backward=first.backward)
    first.backward(prepared(*_batch(model, 2, rank, world_size)))  # interrupted before its step
    fresh = MLP()  # never bound, with the model's values
    fresh.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    runs = []
    for m in (model, fresh):
        accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
        ddp, adamw = accelerator.prepare(m, torch.optim.AdamW(m.parameters(), lr=1e-2))
        norms = []
        adamw.zero_grad()
        for step in range(3):
            accelerator.backward(ddp(*_batch(m, step, rank, world_size)))
            norms.append(accelerator.clip_grad_norm_(m.parameters(), 0.5).item())
            adamw.step()
            adamw.zero_grad()
        runs.append((norms, [p.detach().clone() for p in m.parameters()]))
    return runs


def test_torch_adamw_under_another_accelerator_after_an_interrupted_stage2_loop_trains_as_on_a_fresh_copy():
    for (norms, got), (want_norms, want) in run_ranks(_torch_after_interrupted_stage2, 2, timeout=120):
        assert norms == want_norms and all(n == n and n > 0 for n in norms), (norms, want_norms)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


# -- Trainer: an interrupted train(), then another Trainer on the model; saves and what stays held -----
class _Interrupt:
    """A callback raising ``KeyboardInterrupt`` at the end of step ``step`` (as Ctrl-C in a notebook)."""

    def __new__(cls, step):
        from transformers import TrainerCallback

        class Interrupt(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == step:
                    raise KeyboardInterrupt

        return Interrupt()


def _hooks(model) -> list:
    return [(n, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._state_dict_hooks), sorted(m.__dict__))
            for n, m in model.named_modules()] + \
        [(n, len(p._post_accumulate_grad_hooks or {}), len(p._backward_hooks or {})) for n, p in model.named_parameters()]


class _Storages:
    """A Trainer callback noting a weak reference to every storage the model's params have at each step's end."""

    def __new__(cls):
        from torch.multiprocessing.reductions import StorageWeakRef
        from transformers import TrainerCallback

        class Storages(TrainerCallback):
            refs: list = []

            def on_step_end(self, args, state, control, model=None, **kwargs):
                self.refs.extend(StorageWeakRef(p.untyped_storage()) for p in model.parameters())

        return Storages()


def _saved_and_loaded_back(model, path) -> bool:
    import safetensors.torch

    safetensors.torch.save_model(model, path)
    fresh = _copy_of_bert(model)
    for p in fresh.parameters():
        p.data.zero_()
    safetensors.torch.load_model(fresh, path)
    return all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def _trainer_cases(rank, world_size, base):
    from torch.multiprocessing.reductions import StorageWeakRef

    from tests.hf_trainer_cases import tiny_bert

    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    out = {}
    # an interrupted stage-2 run, its Trainer kept (a notebook's traceback keeps it), then a second Trainer
    for second, (optim, optim_args) in {"adamw_torch": ("adamw_torch", None),
                                        "stage2": ("zero_bucket", "stage=2")}.items():
        model = tiny_bert()
        interrupted = _trainer(model, f"{base}/first", "zero_bucket", "stage=2", callbacks=[_Interrupt(2)])
        try:
            interrupted.train()
            raised = False
        except KeyboardInterrupt:
            raised = True
        unbound = _hooks(model) == _hooks(tiny_bert())
        runs, before = train_with_fresh_copy(model, f"{base}/second", optim, optim_args)
        out[("interrupted", second)] = (raised, unbound, runs, before)
        del interrupted
    # a run with a save: then every saver takes the params, and once deleted nothing holds their storage
    # (stage 1 saves the model only: no optimizer save reads the state-dict aliases after the model's save)
    for optim, optim_args in (("adamw_torch", None), ("zero_bucket", None), ("zero_bucket", "stage=2")):
        model, storages = tiny_bert(), _Storages()
        trainer = _trainer(model, f"{base}/saves-{optim}-{optim_args}", optim, optim_args, callbacks=[storages],
                           save_strategy="steps", save_steps=3, save_only_model=optim_args is None)
        trainer.train()
        own = len({p.untyped_storage().data_ptr() for p in model.parameters()}) == len(list(model.parameters()))
        loaded_back = _saved_and_loaded_back(model, f"{base}/model-{rank}-{optim}-{optim_args}.safetensors")
        refs = storages.refs + [StorageWeakRef(p.untyped_storage()) for p in model.parameters()]
        del trainer, model, storages
        gc.collect()
        out[("saves", optim, optim_args)] = (own, loaded_back, sum(not r.expired() for r in refs))
    return out


@pytest.fixture(scope="module")
def trainer_cases(tmp_path_factory):
    return run_ranks(_trainer_cases, 2, str(tmp_path_factory.mktemp("takeover")), timeout=400)


@pytest.mark.reliability("A stage-2 Trainer interrupted (KeyboardInterrupt from a callback, its Trainer kept), then a "
                         "second Trainer on the model with {second}, 2 ranks",
                         "the interrupt goes on, the model keeps no hook; the second run equals it on a fresh copy "
                         "bitwise (grad norms and params), no NaN")
@pytest.mark.parametrize("second", ["adamw_torch", "stage2"])
def test_after_an_interrupted_stage2_train_the_next_trainer_trains_as_on_a_fresh_copy(trainer_cases, second):
    for per_rank in trainer_cases:
        raised, unbound, ((got, got_norms), (want, want_norms)), before = per_rank[("interrupted", second)]
        assert raised and unbound  # the interrupt went on, and the model is the user's again
        assert len(got_norms) == 3 and got_norms == want_norms, (got_norms, want_norms)
        assert all(n == n and n > 0 for n in got_norms)  # not NaN
        for name in want:
            assert torch.equal(got[name], want[name]), f"{name} differs from the fresh copy's"
            assert bool(torch.isfinite(got[name]).all())
        assert sum(not torch.equal(want[n], before[n]) for n in want) == len(want)  # every param trained


@pytest.mark.parametrize("optim, optim_args", [("adamw_torch", None), ("zero_bucket", None),
                                               ("zero_bucket", "stage=2")])
def test_after_a_trainer_run_with_a_save_the_params_own_their_storage_and_nothing_holds_it(trainer_cases, optim,
                                                                                          optim_args):
    for per_rank in trainer_cases:
        own, loaded_back, alive = per_rank[("saves", optim, optim_args)]
        assert own, "params share storage after the run"
        assert loaded_back, "safetensors.torch.save_model / load_model did not give the params back"
        assert alive == 0, f"{alive} storages the params had during the run are still alive"
