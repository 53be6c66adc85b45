"""stage=2 with fp16 loss scaling: torch's own ``torch.amp.GradScaler`` (on CPU here), made to
see the sharded grads by ``hf_zero.prepare_grad_scaler`` in a plain loop and by the wiring
under Accelerate and Trainer, skips the same steps on every rank and equals one process.

The inf is put, on one rank only, into a grad element that *another* rank owns: after the
reduce-scatter the injecting rank's own shards are finite, so only the agreed flag (one MAX
all-reduce) makes it skip. Plain loops (2 gloo ranks, one spawn for the table) are compared
with one process running torch's AdamW and the same GradScaler on the global batch: params
and the consolidated state dict in float64 to 1e-12 (loss scales are powers of two, so scaling
and unscaling are exact there), and in float32 to 1e-5 relative (tests/models.py's float32
tolerance: the ranks' (a + b) / 2 and the global batch's one backward round differently);
clipped norms to rtol 1e-10 (float64) / 1e-5 (float32); the per-step scales and skips exactly.
"""

import dataclasses
import math
import os

import pytest
import torch

import hf_zero
from tests._dist import run_case, run_ranks
from tests.hf_trainer_cases import TokenDataset, run_trainer, tiny_bert
from tests.models import (
    BATCH, Setup, assert_params_equal, assert_replicas_identical, assert_state_dict_equal, build_model, make_reference,
    make_zero, params_of, shard_of, holds_no_grads,
)

pytestmark = pytest.mark.filterwarnings("ignore")

STEPS = 7
BUCKET_MB = 0.0005  # several buckets per model
INIT_SCALE = 2.0**10
GROWTH_INTERVAL = 3  # the scale doubles after 3 clean steps: growth and back-off both happen in 7 steps
OVERFLOW_STEP = 3


@dataclasses.dataclass(frozen=True)
class Case:
    setup: Setup = Setup()
    dtype: torch.dtype = torch.float64
    inject_on: int = 1  # the rank whose local grad gets the non-finite value at OVERFLOW_STEP
    value: float = float("inf")
    clip_norm: float | None = None  # scaler.unscale_(opt), then opt.clip_grad_norm_ (the reference: torch's)
    zero_grad: bool = True  # False: the loop never calls zero_grad (stage 2's step and skip consume the shards)


CASES = {
    "float32-inf-on-rank-1": Case(dtype=torch.float32),
    "float64-nan-on-rank-0-param": Case(Setup(shard="param"), inject_on=0, value=float("nan")),
    "float64-unscale-clip": Case(clip_norm=0.05),
    "float32-unscale-clip-param": Case(Setup(shard="param"), dtype=torch.float32, clip_norm=0.05),
    "float64-unscale-clip-no-zero-grad": Case(clip_norm=0.05, zero_grad=False),
}


def _scaler():
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)


def _poison(index: int, element: int, value: float):
    def hook(grad):
        grad = grad.clone()
        grad.view(-1)[element] = value
        return grad

    return hook


def _loop(case: Case, model, opt, scaler, target, *, world_size, rank=None):
    """Train STEPS steps; ``rank=None``: the reference (global batch, torch's clipping, zero_grad).
    ``target``: (param index, element) that gets the non-finite value at OVERFLOW_STEP (for the
    ranks: chosen once the layout exists, an element the other rank owns). Returns per step
    (scale after update, whether any param changed) and the clipped norms."""
    params, log, norms = list(model.parameters()), [], []
    for step in range(STEPS):
        handle = None
        if step == OVERFLOW_STEP and rank in (None, case.inject_on):
            index, element = target()
            handle = params[index].register_hook(_poison(index, element, case.value))
        batch = model.batch(step, BATCH * world_size)
        if rank is None:
            loss = sum(model(*shard_of(batch, r)) for r in range(world_size)) / world_size
        else:
            loss = model(*shard_of(batch, rank))
        before = [p.detach().clone() for p in params]
        scaler.scale(loss).backward()
        if handle is not None:
            handle.remove()
        if rank is not None:
            assert holds_no_grads(params), "stage 2 left a p.grad after the backward"
        if case.clip_norm is not None:
            scaler.unscale_(opt)
            if rank is None:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip_norm).item())
            else:
                norms.append(opt.clip_grad_norm_(case.clip_norm).item())
        scaler.step(opt)
        scaler.update()
        if case.zero_grad or rank is None:
            opt.zero_grad()
        log.append((scaler.get_scale(), any(not torch.equal(b, p) for b, p in zip(before, params))))
    return log, norms


def _train(rank, world_size, case: Case):
    model = build_model(case.setup.model, case.dtype)
    opt = make_zero(case.setup, model, stage=2)
    opt.bind_module(model, bucket_cap_mb=BUCKET_MB)
    scaler = hf_zero.prepare_grad_scaler(_scaler())
    assert hf_zero.prepare_grad_scaler(scaler) is scaler  # idempotent

    chosen = []

    def target():  # the first element the *other* rank owns (the layout was built at step 0)
        piece = opt.gradient_path.layout.pieces((case.inject_on + 1) % world_size)[0]
        chosen.append((piece.index, piece.start))
        return chosen[-1]

    log, norms = _loop(case, model, opt, scaler, target, world_size=world_size, rank=rank)
    opt.consolidate_state_dict(to=0)
    return {"params": params_of(model), "log": log, "norms": norms, "target": chosen,
            "state_dict": opt.state_dict() if rank == 0 else None}


def _reference(case: Case, world_size: int, target):
    model = build_model(case.setup.model, case.dtype)
    opt = make_reference(case.setup, model)
    log, norms = _loop(case, model, opt, _scaler(), lambda: target, world_size=world_size)
    return params_of(model), opt.state_dict(), log, norms


@pytest.mark.reliability("stage 2 plain loop, torch GradScaler ({name}): a non-finite value in one rank's grad, in an element another rank owns",
                         "every rank skips that step and backs its scale off; params, state and clipped norms equal one process with the same GradScaler; no hang")
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", CASES)
def test_grad_scaler_skips_the_same_steps_on_every_rank_and_equals_one_process(name):
    """2 gloo ranks, torch's CPU GradScaler growing every 3 clean steps, an inf or NaN put on one
    rank into a grad element *another* rank owns (so only the agreed flag makes the injecting
    rank skip): every rank's scales and skips equal one process's with the same GradScaler on the
    global batch (grew, halved at the skip, grew), and so do the params and the consolidated state
    dict (float64 to 1e-12; float32 to 1e-5 relative), flat and param shards. With ``unscale_``
    then ``opt.clip_grad_norm_`` the norms equal torch's (rtol 1e-10 in float64) and are inf at the
    skipped step; a loop that never calls ``zero_grad`` equals the reference that does."""
    case = CASES[name]
    per_rank = run_case(_train, CASES, name, 2, timeout=180)
    r0, r1 = per_rank
    target = (r0["target"] or r1["target"])[0]
    ref_params, ref_state, ref_log, ref_norms = _reference(case, 2, target)
    assert r0["log"] == r1["log"] == ref_log
    scales = [s for s, _ in ref_log]
    assert scales == [1024.0, 1024.0, 2048.0, 1024.0, 1024.0, 1024.0, 2048.0]  # grew, halved at the skip, grew
    assert [changed for _, changed in ref_log] == [True, True, True, False, True, True, True]
    assert_replicas_identical([r["params"] for r in per_rank])
    assert_params_equal(r0["params"], ref_params)
    assert_state_dict_equal(r0["state_dict"], ref_state)
    if case.clip_norm is not None:
        assert r0["norms"] == r1["norms"]
        assert max(n for n in ref_norms if n != float("inf")) > case.clip_norm  # the clipping clips
        assert ref_norms[OVERFLOW_STEP] == r0["norms"][OVERFLOW_STEP] == float("inf")
        finite = [(a, b) for a, b in zip(r0["norms"], ref_norms) if b != float("inf")]
        rtol = 1e-10 if case.dtype == torch.float64 else 1e-5
        torch.testing.assert_close(torch.tensor([a for a, _ in finite]), torch.tensor([b for _, b in finite]),
                                   rtol=rtol, atol=0)


@pytest.mark.fast
def test_prepare_grad_scaler_leaves_other_optimizers_to_torch():
    """One process: a stage-1 ZeroBucketOptimizer and a torch optimizer are unscaled by torch as before;
    the stage-2 unscale refuses a stage-1 optimizer."""
    model = torch.nn.Linear(3, 2)
    scaler = hf_zero.prepare_grad_scaler(torch.amp.GradScaler("cpu", init_scale=4.0))
    for opt in (torch.optim.SGD(model.parameters(), lr=0.1),
                hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)):
        scaler.scale(model(torch.ones(2, 3)).sum()).backward()
        scaler.unscale_(opt)
        torch.testing.assert_close(model.bias.grad, torch.full((2,), 2.0))  # the batch of 2 ones, unscaled
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    with pytest.raises(ValueError, match="gradient_path.unscale_ is for stage=2"):
        opt.gradient_path.unscale_(torch.ones(()), torch.zeros(()), allow_fp16=False)
    with pytest.raises(TypeError, match="expected a torch.amp.GradScaler"):
        hf_zero.prepare_grad_scaler(object())


# -- Accelerate and Trainer, 2 ranks --------------------------------------------------------------
ACC_LR, ACC_MAX_NORM, ACC_OVERFLOW = 1e-2, 0.5, 2


def _accelerate_fp16(rank, world_size, *, stage):
    """fp16 under Accelerate with its (here CPU) GradScaler, as tests/test_accelerate.py's
    ``_fp16_overflow_run``: an inf grad on rank 1 only at step 2, ``accelerator.clip_grad_norm_``."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    os.environ.update(LOCAL_RANK=str(rank), ACCELERATE_USE_CPU="1")
    AcceleratorState._reset_state()  # this process's earlier Accelerators had other settings
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    # Accelerate creates no GradScaler on CPU; give it the CPU one so its fp16 code path runs.
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    model = tiny_bert().float()
    optimizer = hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=ACC_LR, stage=stage,
                                            parameters_as_bucket_view=False)
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=4, shuffle=False)
    prepared, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    target = model.bert.encoder.layer[1].output.dense.weight
    log, norms = [], []
    for step, batch in enumerate(loader):
        handle = None
        if step == ACC_OVERFLOW and rank == 1:
            handle = target.register_hook(lambda g: torch.full_like(g, float("inf")))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with accelerator.autocast():
            loss = prepared(**batch).loss
        accelerator.backward(loss)
        norms.append(accelerator.clip_grad_norm_(prepared.parameters(), ACC_MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        if handle is not None:
            handle.remove()
        changed = any(not torch.equal(before[n], p) for n, p in model.named_parameters())
        log.append((accelerator.optimizer_step_was_skipped, changed, accelerator.scaler.get_scale()))
    wrapped = type(prepared).__name__
    return {"log": log, "norms": norms, "wrapped": wrapped,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _hf_many(rank, world_size, root):
    overflow = (3, "bert.encoder.layer.0.output.dense.weight")
    return [_accelerate_fp16(rank, world_size, stage=1), _accelerate_fp16(rank, world_size, stage=2),
            run_trainer(rank, world_size, output_dir=os.path.join(root, "s1"), max_steps=5, overflow=overflow),
            run_trainer(rank, world_size, output_dir=os.path.join(root, "s2"), max_steps=5, overflow=overflow,
                        optim_args="stage=2")]


@pytest.mark.reliability("stage 2 under Accelerate and Trainer (fp16=True, optim_args stage=2) with a GradScaler: inf grad on rank 1 only",
                         "every rank skips the step and halves the loss scale, as stage 1 does; the runs equal stage 1's; no hang")
@pytest.mark.timeout(300)
def test_accelerate_and_trainer_fp16_stage2_skip_as_stage1(tmp_path):
    """2 ranks, a float32 tiny BERT under fp16 autocast, Accelerate given torch's CPU GradScaler
    (Accelerate creates none on CPU), an inf grad on rank 1 only. An Accelerate loop with
    ``accelerator.clip_grad_norm_`` skips the same step on both ranks and halves the scale, and its
    norms and params are bitwise the stage-1 run's. Trainer with ``fp16=True`` and
    ``optim_args="stage=2"`` skips the same step as stage 1, ends at the same scale, and its logged
    losses, grad norms and params equal stage 1's (rtol 1e-5). At the skipped step the logged
    ``grad_norm`` is ``inf`` under stage 2 and ``nan`` under stage 1 (whose agreement writes a NaN
    into one grad element)."""
    (acc1, acc2, tr1, tr2), (acc1_b, acc2_b, tr1_b, tr2_b) = run_ranks(_hf_many, 2, str(tmp_path), timeout=280)
    assert acc2["wrapped"] != "DistributedDataParallel" and acc1["wrapped"] == "DistributedDataParallel"
    for a, b in ((acc1, acc1_b), (acc2, acc2_b)):
        assert a["log"] == b["log"]
        for n in a["params"]:
            assert torch.equal(a["params"][n], b["params"][n]), f"replicas differ: {n}"
    assert acc2["log"] == acc1["log"]
    assert [s for s, _, _ in acc2["log"]] == [False, False, True, False]  # 4 batches per rank
    assert [c for _, c, _ in acc2["log"]] == [True, True, False, True]
    assert acc2["log"][2][2] == acc2["log"][1][2] / 2  # the scale backed off once, on both ranks
    # Bitwise equal to stage 1 ((a + b) / 2 is the same bits however it is reduced; params in storage
    # of their own, as tests/test_stage2.py compares the stages), the clipped norms too.
    assert acc2["norms"] == acc1["norms"] and acc2["norms"][ACC_OVERFLOW] == float("inf")
    for n in acc1["params"]:
        assert torch.equal(acc2["params"][n], acc1["params"][n]), n
    # Trainer, fp16=True: the stage-2 run skips the same step on both ranks, as stage 1 does.
    (p1, logs1, info1), (p2, logs2, info2) = tr1, tr2
    assert info2["stage"] == 2 and info2["wrapped"] != "DistributedDataParallel"
    assert info2["skipped"] == tr2_b[2]["skipped"] == info1["skipped"] == [False, False, False, True, False]
    assert info2["scale"] == tr2_b[2]["scale"] == info1["scale"] == 2.0**9
    for n in p1:
        assert torch.equal(p2[n], tr2_b[0][n]), f"replicas differ: {n}"
        # bitwise here too, but with bucket views (Trainer's default) an ulp may depend on alignment
        torch.testing.assert_close(p2[n], p1[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    # The logged losses and grad norms too; at the skipped step both norms are non-finite (stage 1's
    # agreement writes a NaN into one grad element, stage 2's shards hold the inf itself).
    for key in ("loss", "grad_norm"):
        got, want = ([e[key] for e in logs if key in e and "train_loss" not in e] for logs in (logs2, logs1))
        assert len(got) == len(want) == 5, key
        assert [math.isfinite(g) for g in got] == [math.isfinite(w) for w in want] == [key == "loss" or i != 3
                                                                                      for i in range(5)], key
        torch.testing.assert_close(torch.tensor([g for g in got if math.isfinite(g)]),
                                   torch.tensor([w for w in want if math.isfinite(w)]), rtol=1e-5, atol=0)
