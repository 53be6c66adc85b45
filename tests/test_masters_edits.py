"""The masters never overrule the user: an in-place write to a 16-bit param between steps
is what the next step starts from, as with torch's optimizers ([Note: master weights]);
loading across master settings says what it drops.

Plain loops on 2 gloo ranks with a bf16 model, each compared bitwise with the fp32-master
reference of tests/test_masters.py (an fp32 copy stepped by torch AdamW on the replayed
averaged grads, rounded into the bf16 params) that applies the same edit to its bf16
params and re-derives its masters the same way: the elements whose rounded master is no
longer the param's take the param's value, the others keep theirs. Then the same edits
through Trainer callbacks, against ``adamw_torch`` on the same bf16 model.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests._dist import run_ranks
from tests.models import BATCH, build_model, shard_of
from tests.test_masters import _equal, _full_grads, _owned_grads

BF16 = torch.bfloat16
HYPER = dict(lr=1e-2, weight_decay=0.1)
STEPS = 6
CLAMP = 0.2  # |w| of the MLP starts up to 0.41: the clamp bites at every step
SAVE_AT, LOAD_AT = 1, 3  # load_state_dict: the weights after step 1 are loaded after step 3
EDITS = ("load_state_dict", "clamp")
PATHS = {  # the parameter sync's paths: pipelined (blocking), overlapped, copied (no bucket views)
    "flat-pipelined": dict(shard="flat"),
    "flat-reduce-scatter-overlap": dict(shard="flat", grad_reduce="reduce_scatter", overlap_param_sync=True),
    "param-no-view": dict(shard="param", parameters_as_bucket_view=False),
}


def _edit(edit: str, model, step: int, saved: dict) -> None:
    """The user's edit after ``step``: through the module, under no_grad (as users write it)."""
    with torch.no_grad():
        if edit == "clamp":
            for p in model.parameters():
                p.clamp_(-CLAMP, CLAMP)
        elif step == SAVE_AT:
            saved.update({k: v.clone() for k, v in model.state_dict().items()})
        elif step == LOAD_AT:
            model.load_state_dict(saved)


def _run(rank, world_size):
    from hf_zero import ZeroBucketOptimizer

    out = {}
    for edit in EDITS:
        for path, options in PATHS.items():
            model = build_model("mlp", BF16)
            opt = ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW, **options, **HYPER)
            ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=0.0002)
            if "grad_reduce" in options:
                opt.bind_ddp(ddp)
            grads, params, saved = [], [], {}
            for step in range(STEPS):
                ddp(*shard_of(model.batch(step, BATCH * world_size), rank)).backward()
                grads.append(_owned_grads(opt, rank))
                opt.step()
                opt.zero_grad(set_to_none=True)
                opt.wait_param_sync()  # the documented rule before touching params outside a forward
                params.append([p.detach().clone() for p in model.parameters()])
                _edit(edit, model, step, saved)
            opt.consolidate_state_dict(to=0, device="cpu")
            state = opt.state_dict()["state"] if rank == 0 else None
            out[edit, path] = {"grads": grads, "params": params, "state": state, "overlap": opt.overlaps_param_sync}
    return out


@functools.cache
def _runs():
    return run_ranks(_run, 2, timeout=150)


def adopt(masters: list[torch.Tensor], params: list[torch.Tensor]) -> None:
    """The reference's masters follow an edit of its bf16 params: only the elements whose
    rounded master is no longer the param's are re-derived from it."""
    for m, p in zip(masters, params):
        stale = m.to(p.dtype) != p
        m[stale] = p[stale].float()


def _reference(edit: str, per_rank: list) -> tuple[list, list]:
    """(params after each step, final masters) of the fp32-master reference with the edit."""
    model = build_model("mlp", BF16)
    params = [p.detach().clone() for p in model.parameters()]
    shapes = [p.shape for p in params]
    masters = [p.float() for p in params]
    opt = torch.optim.AdamW(masters, **HYPER)
    after, saved = [], None
    for step in range(STEPS):
        grads = _full_grads([r["grads"][step] for r in per_rank], shapes)
        for i, m in enumerate(masters):
            m.grad = grads[i].float() if i in grads else None
        opt.step()
        for i in grads:
            params[i] = masters[i].to(BF16)
        after.append([p.clone() for p in params])
        if edit == "clamp":
            params = [p.clamp(-CLAMP, CLAMP) for p in params]
        elif step == SAVE_AT:
            saved = [p.clone() for p in params]
        elif step == LOAD_AT:
            params = [p.clone() for p in saved]
        adopt(masters, params)
    return after, masters


@pytest.mark.timeout(200)
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("edit", EDITS)
def test_an_edit_between_steps_is_what_the_next_step_starts_from(edit, path):
    per_rank = [r[edit, path] for r in _runs()]
    assert per_rank[0]["overlap"] == ("overlap_param_sync" in PATHS[path])
    want, masters = _reference(edit, per_rank)
    for step in range(STEPS):
        for i, (a, b) in enumerate(zip(per_rank[1]["params"][step], per_rank[0]["params"][step])):
            assert torch.equal(a, b), f"step {step}: param {i} differs between ranks"
        for i, (got, w) in enumerate(zip(per_rank[0]["params"][step], want[step])):
            _equal(got, w, f"{edit}, {path}: bf16 param {i} after step {step}")
    state = per_rank[0]["state"]
    for i, m in enumerate(masters):
        if i in state and "master_param" in state[i]:
            _equal(state[i]["master_param"], m, f"{edit}, {path}: master of param {i} at the end")
    if edit == "clamp":  # the edit bit: without it the weights leave the clamp
        assert max(p.abs().max().item() for p in want[-1]) > CLAMP
        assert max(p.abs().max().item() for p in want[-1]) < CLAMP + 2 * HYPER["lr"]


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_the_masters_keep_their_sub_ulp_part_where_the_edit_left_the_param_alone():
    """One element written: its master takes the param's value, every other master is
    untouched (bitwise), and a write through ``.data`` (not seen: its own version
    counter) is adopted by ``refresh_trainable()``."""
    from hf_zero import ZeroBucketOptimizer

    model = build_model("mlp", BF16)
    opt = ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, **HYPER)
    for step in range(2):
        model(*model.batch(step, BATCH)).backward()
        opt.step()
        opt.zero_grad()
    w = model.net[0].weight
    i = [n for n, _ in model.named_parameters()].index("net.0.weight")
    before = opt.state_dict()["state"][i]["master_param"].clone()
    assert not torch.equal(before, w.detach().float()), "the masters hold nothing below bf16"
    with torch.no_grad():
        w[0, 0] = 0.5
    want = before.clone()
    want[0, 0] = 0.5
    _equal(opt.state_dict()["state"][i]["master_param"], want, "master after a one-element edit")
    w.data[1, 1] = 0.25  # .data: a counter of its own, so the master does not see it ...
    _equal(opt.state_dict()["state"][i]["master_param"], want, "master after a write through .data")
    opt.refresh_trainable()  # ... until a rebuild re-derives it
    want[1, 1] = 0.25
    _equal(opt.state_dict()["state"][i]["master_param"], want, "master after refresh_trainable()")


def test_the_version_counter_moves_on_user_writes_only():
    """What [Note: master weights] relies on: with the param's .data a view of a buffer,
    writes through the buffer or through a slice of ``.data`` (hf_zero's rounding and
    receives) leave the param's counter alone; writes through the param move it."""
    from hf_zero._engine import version_of

    buf = torch.zeros(8, dtype=BF16)
    p = torch.nn.Parameter(torch.ones(2, 2, dtype=BF16))
    p.data = buf[2:6].view(2, 2)
    v = version_of(p)
    buf[0:4].fill_(1.0)
    p.data.view(-1)[0:2].fill_(2.0)
    assert version_of(p) == v
    with torch.no_grad():
        p.clamp_(-1, 1)
    assert version_of(p) > v
    v = version_of(p)
    sd = {"w": p.detach()}
    sd["w"].mul_(2)
    assert version_of(p) > v


# -- loading across master settings --------------------------------------------------------
def _trained(masters, steps: int = 2):
    from hf_zero import ZeroBucketOptimizer

    model = build_model("mlp", BF16)
    opt = ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW, master_weights=masters, **HYPER)
    for step in range(steps):
        model(*model.batch(step, BATCH)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _load(kind: str, source, target, tmp_path) -> list:
    """Load ``source``'s state into ``target`` (consolidated dict or sharded checkpoint); the warnings."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if kind == "consolidated":
            target.load_state_dict(source.state_dict())
        else:
            source.save_sharded(tmp_path / "sharded")
            target.load_sharded(tmp_path / "sharded")
    return [str(w.message) for w in seen if "hf_zero" in str(w.message)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["consolidated", "sharded"])
def test_masters_dropped_by_a_load_without_masters_are_named(kind, tmp_path):
    _, source = _trained("auto")
    model, target = _trained(False, steps=0)
    (message,) = _load(kind, source, target, tmp_path)
    assert "'master_param'" in message and "master_weights=False" in message and "dropped" in message
    assert "net.0.weight" in message and "cast to the params' bfloat16" in message
    model(*model.batch(0, BATCH)).backward()
    target.step()
    state = target.state_dict()["state"]
    assert all("master_param" not in st and st["exp_avg"].dtype == BF16 for st in state.values())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["consolidated", "sharded"])
def test_a_load_without_masters_into_masters_says_nothing(kind, tmp_path):
    """bf16 state upcast to fp32 is exact, and each master starts from its param: nothing to say."""
    _, source = _trained(False)
    model, target = _trained("auto", steps=0)
    assert _load(kind, source, target, tmp_path) == []
    model(*model.batch(0, BATCH)).backward()
    target.step()
    assert all(st["exp_avg"].dtype == torch.float32 for st in target.state_dict()["state"].values())


# -- through Trainer: 2 ranks, a tiny bf16 BERT, zero_bucket against adamw_torch --------------
LR_TRAINER = 1e-2
LIMIT = 0.05


def _trainer(output_dir, optim, callbacks, **overrides):
    from tests.hf_trainer_cases import IN_ORDER, InOrderTrainer, TokenDataset, tiny_bert
    from transformers import TrainingArguments

    args = dict(output_dir=output_dir, optim=optim, per_device_train_batch_size=4, learning_rate=LR_TRAINER,
                weight_decay=0.1, lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=1,
                save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                average_tokens_across_devices=False, **IN_ORDER)
    args.update(overrides)
    evaluations = []

    def earlier_is_better(prediction) -> dict:  # "best" is the first checkpoint, whatever the losses
        evaluations.append(1)
        return {"earliness": -len(evaluations)}

    return InOrderTrainer(model=tiny_bert().to(BF16), args=TrainingArguments(**args), train_dataset=TokenDataset(),
                          eval_dataset=TokenDataset(n=16, seed=1), callbacks=callbacks,
                          compute_metrics=earlier_is_better)


def _params(model) -> dict:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _distance(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _trainer_cases(rank, world_size, base):
    import os

    from transformers import TrainerCallback

    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))

    class Clamp(TrainerCallback):
        """WGAN-style: after each step, max |w| is recorded, then every weight clamped to the limit."""

        def __init__(self):
            self.before = []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            with torch.no_grad():
                self.before.append(max(p.abs().max().item() for p in model.parameters()))
                for p in model.parameters():
                    p.clamp_(-LIMIT, LIMIT)

    class Rollback(TrainerCallback):
        """The weights after step 2 are loaded back after step 4; those after step 5 are kept."""

        def __init__(self):
            self.seen = {}

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.seen[state.global_step] = _params(model)
            if state.global_step == 2:
                self.saved = {k: v.clone() for k, v in model.state_dict().items()}
            elif state.global_step == 4:
                model.load_state_dict(self.saved)

    class Record(TrainerCallback):
        """Per train(): the weights at its start and after each step."""

        def __init__(self):
            self.runs = []

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.runs.append({"begin": _params(model), "steps": {}})

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.runs[-1]["steps"][state.global_step] = _params(model)

    out = {}
    for optim in ("zero_bucket", "adamw_torch"):
        clamp = Clamp()
        _trainer(f"{base}/clamp-{optim}", optim, [clamp], max_steps=4).train()
        rollback = Rollback()
        _trainer(f"{base}/rollback-{optim}", optim, [rollback], max_steps=5).train()
        record = Record()
        trainer = _trainer(f"{base}/best-{optim}", optim, [record], max_steps=4, eval_strategy="steps", eval_steps=2,
                           save_strategy="steps", save_steps=2, load_best_model_at_end=True,
                           metric_for_best_model="earliness", greater_is_better=True)
        trainer.train()
        first_losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        best = os.path.basename(trainer.state.best_model_checkpoint)
        trainer.train()  # the optimizer, and its state, carries over
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        out[optim] = {"clamp": clamp.before, "rollback": rollback.seen, "best": record.runs, "best_checkpoint": best,
                      "losses": (first_losses, losses)}
    return out


@functools.cache
def _trainer_runs(base):
    return run_ranks(_trainer_cases, 2, base, timeout=240)


@pytest.mark.slow  # Trainer runs (tests/conftest.py: the fast subset leaves them out)
@pytest.mark.timeout(300)
def test_trainer_edits_are_what_the_next_step_starts_from(tmp_path):
    """Three callbacks' edits on 2 ranks with a bf16 model, ``zero_bucket`` (masters on)
    against ``adamw_torch`` on the same model: a WGAN-style clamp after every step, a
    rollback to earlier weights, and ``load_best_model_at_end`` followed by a second
    ``train()``. One step after an edit the weights are one step's update (AdamW: about
    the lr) from the edited ones, as with ``adamw_torch``; before, the stale masters put
    them back where the edit had taken them from."""
    per_rank = _trainer_runs(str(tmp_path))
    step = 1.5 * LR_TRAINER
    for rank, out in enumerate(per_rank):
        zb, ref = out["zero_bucket"], out["adamw_torch"]
        for who, run in (("zero_bucket", zb), ("adamw_torch", ref)):
            what = f"rank {rank}, {who}"
            assert run["clamp"][0] > 0.5, f"{what}: the clamp never bit"  # LayerNorm weights start at 1
            assert max(run["clamp"][1:]) <= LIMIT + step, f"{what}: max |w| before each re-clamp {run['clamp']}"
            seen = run["rollback"]
            assert _distance(seen[5], seen[2]) <= step < _distance(seen[4], seen[2]), (
                f"{what}: the step after the rollback is {_distance(seen[5], seen[2]):.3g} from the rolled-back weights")
            first, second = run["best"]
            assert run["best_checkpoint"] == "checkpoint-2" and _distance(second["begin"], first["steps"][2]) == 0
            assert _distance(second["steps"][1], second["begin"]) <= step < _distance(first["steps"][4], second["begin"]), (
                f"{what}: the first step after loading the best weights is "
                f"{_distance(second['steps'][1], second['begin']):.3g} from them")
        continued = [abs(a - b) for a, b in zip(zb["losses"][1], ref["losses"][1])]
        assert len(continued) == 4 and max(continued) <= 0.02, (
            f"rank {rank}: continued losses {zb['losses'][1]}, adamw_torch {ref['losses'][1]}")
