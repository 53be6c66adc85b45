"""bf16 *models* (params in bfloat16; ``master_weights`` left at "auto", so fp32 masters)
through the paths users take around the step: Trainer resume on the same and on other
world sizes, gradual unfreezing, ``save_strategy="best"``, and Accelerate's
``save_state`` / ``load_state`` on another world size. Each equals the fp32-master
reference bitwise, except where 3 ranks train: there a bf16 grad is a sum of three
rounded terms whose order differs from DDP's (see the resume test for the tolerance).

The reference is unsharded training with fp32 masters: ``Fp32MasterAdamW``
(tests/hf_trainer_cases.py) keeps an fp32 copy of every param, steps it with torch AdamW
on the bf16 grad cast to fp32 and rounds it into the param, as tests/test_masters.py's
reference does. It clips as hf_zero does: the norm summed in float64 and rounded to bf16
(torch's ``clip_grad_norm_`` sums it in bf16; in these runs it is an ulp away at step 2,
which moves 16 of the 21 params, by up to 1.2e-4, when measured).

Why bitwise across world sizes: the reference is one process reading the global batch of 6
in two accumulation steps of 3, the split 2 ranks make. Both add the same two bf16
micro-batch grads once (``a + b`` is commutative), and every other factor on the way is 2
(Trainer's loss times the number of processes, DDP's division by the world size,
Accelerate's loss divided by the accumulation steps), which is exact in bf16. So the grads
are bitwise equal, and with them everything after. 3 ranks add three grads of 2 examples
and multiply and divide by 3, which rounds: a run resumed on 3 ranks is compared with the
reference resumed on 3 ranks from its own checkpoint, under plain DDP.

Trainer runs leave ``bf16=False`` (the model's dtype already makes the compute bf16; ``bf16``
only adds autocast), except the ``save_strategy="best"`` runs, which set ``bf16=True`` as many
scripts do beside a bf16 model. All runs happen in three spawns (2 ranks, 1 process,
3 ranks) shared by the tests.
"""

from __future__ import annotations

import os

import pytest
import torch

import hf_zero
from tests._dist import run_ranks
from tests.hf_trainer_cases import (
    BF16_GLOBAL_BATCH,
    Fp32MasterAdamW,
    LMDataset,
    clip_grad_norm_float64_,
    run_bf16_trainer,
    tiny_llama,
)

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.timeout(400)]

MASTER = "master_param"
# Gradual unfreezing: only the head and the final norm train at first; then the top layer,
# the bottom layer, the embeddings. DDP never reduces what was frozen when it was built.
FROZEN_AT_BUILD = ("model.embed_tokens.", "model.layers.")
UNFREEZE = {2: {"model.layers.1.": True}, 4: {"model.layers.0.": True}, 5: {"model.embed_tokens.": True}}
BEST = dict(evaluate=True, eval_strategy="steps", eval_steps=2, save_strategy="best", metric_for_best_model="eval_loss",
            bf16=True)
# Accelerate: optimizer steps before save_state, and in all.
ACC_SAVE_AT, ACC_STEPS, ACC_LR, ACC_MAX_NORM = 3, 6, 3e-3, 0.5


# -- Accelerate loops ------------------------------------------------------------------------
def _accelerate_loop(rank, world_size, *, save_dir, load):
    """The bf16 model with a ZeroBucketOptimizer in a plain Accelerate loop on the global
    batch of 6 (2 ranks x 3, or 1 process x 3 x 2 accumulation steps). ``load=False``:
    train, ``save_state`` after ACC_SAVE_AT steps, train on. ``load=True``: ``load_state``
    that checkpoint, then the remaining steps."""
    from accelerate import Accelerator

    os.environ.update(LOCAL_RANK=str(rank), ACCELERATE_USE_CPU="1")
    accumulation = BF16_GLOBAL_BATCH // 3 // world_size
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model = tiny_llama()
    optimizer = hf_zero.ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW, lr=ACC_LR, weight_decay=0.1)
    loader = torch.utils.data.DataLoader(LMDataset(), batch_size=3, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = list(loader)

    def train(steps):
        for step in steps:
            for micro in range(accumulation):
                with accelerator.accumulate(model):
                    accelerator.backward(model(**batches[(step * accumulation + micro) % len(batches)]).loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), ACC_MAX_NORM)
                    optimizer.step()
                    optimizer.zero_grad()

    def params():
        return {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}

    out = {"master_weights": optimizer.optimizer.master_weights}
    if load:
        accelerator.load_state(save_dir)
        # load_state restores the saving run's count of micro-steps (one a step there); here
        # ``accumulation`` of them make a step, and Accelerate syncs when the count divides.
        accelerator.step = ACC_SAVE_AT * accumulation
        out["loaded"] = params()
    else:
        train(range(ACC_SAVE_AT))
        out["at_save"] = params()
        accelerator.save_state(save_dir)
    train(range(ACC_SAVE_AT, ACC_STEPS))
    out["final"] = params()
    return out


def _accelerate_reference(rank, world_size):
    """The same loop in one process without Accelerate: Fp32MasterAdamW, the global batch
    in two accumulation steps of 3."""
    model = tiny_llama()
    optimizer = Fp32MasterAdamW([{"params": list(model.parameters())}], lr=ACC_LR, weight_decay=0.1)
    batches = list(torch.utils.data.DataLoader(LMDataset(), batch_size=3, shuffle=False))
    for step in range(ACC_STEPS):
        for micro in range(2):
            (model(**batches[(2 * step + micro) % len(batches)]).loss / 2).backward()
        clip_grad_norm_float64_(model.parameters(), ACC_MAX_NORM)
        optimizer.step()
        model.zero_grad()
    return {"final": {n: p.detach().clone() for n, p in model.named_parameters()}}


# -- the three spawns ------------------------------------------------------------------------
_FUNCTIONS = {"trainer": run_bf16_trainer, "accelerate": _accelerate_loop, "accelerate_reference": _accelerate_reference}


def _table(rank, world_size, entries):
    """Per rank: ``{name: result}`` of ``entries``, a list of (name, function key, kwargs)."""
    return {name: _FUNCTIONS[fn](rank, world_size, **kwargs) for name, fn, kwargs in entries}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run, by name: the per-rank results (rank 0 first). The ``ref_*`` runs use the
    reference optimizer; the others ``optim="zero_bucket"``."""
    root = tmp_path_factory.mktemp("bf16")

    def d(name):
        return str(root / name)

    def trainer(name, **kw):
        return name, "trainer", dict(output_dir=d(name), **kw)

    two = [
        trainer("main", save_strategy="epoch"),  # saves checkpoint-4 and checkpoint-7
        trainer("resume2", resume=d("main/checkpoint-4")),
        trainer("unfreeze", schedule=UNFREEZE, frozen_at_build=FROZEN_AT_BUILD),
        trainer("best", **BEST),
        # Evaluation splits the eval set by rank, which changes its bf16 losses: this reference
        # runs on the same 2 ranks (training on 2 ranks equals 1 process, as "main" shows).
        trainer("ref_best", reference=True, **BEST),
        ("accelerate", "accelerate", dict(save_dir=d("accelerate"), load=False)),
    ]
    one = [
        trainer("ref_main", reference=True, save_strategy="epoch"),
        trainer("resume1", resume=d("main/checkpoint-4")),
        # The control: the reference resumed without its masters (each restarts from its
        # bf16 param) ends elsewhere, so a resume that lost them would be seen.
        trainer("ref_resume1_no_masters", reference=True, resume=d("ref_main/checkpoint-4"), forget_masters=True),
        trainer("ref_unfreeze", reference=True, schedule=UNFREEZE, frozen_at_build=FROZEN_AT_BUILD),
        trainer("best_resume1", resume=d("best")),  # its latest checkpoint
        ("accelerate_load1", "accelerate", dict(save_dir=d("accelerate"), load=True)),
        ("accelerate_reference", "accelerate_reference", {}),
    ]
    three = [
        trainer("resume3", resume=d("main/checkpoint-4")),
        # zero_bucket resumed on 3 ranks from the reference's checkpoint: the same state.
        trainer("resume3_from_ref", resume=d("ref_main/checkpoint-4")),
        trainer("ref_resume3", reference=True, resume=d("ref_main/checkpoint-4")),
    ]
    out = {}
    for world_size, entries, timeout in ((2, two, 200), (1, one, 150), (3, three, 150)):
        per_rank = run_ranks(_table, world_size, entries, timeout=timeout)
        out.update({name: [r[name] for r in per_rank] for name, _, _ in entries})
    out["root"] = root
    return out


# -- comparisons -----------------------------------------------------------------------------
def _bitwise(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    bad = {n: (got[n].double() - want[n].double()).abs().max().item() for n in want
           if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])}
    assert not bad, f"{what}: {len(bad)} of {len(want)} tensors differ, e.g. {sorted(bad.items())[:3]}"


def _ulp_at_max(t: torch.Tensor) -> float:
    """One bf16 ulp (8 significant bits) at the tensor's largest magnitude."""
    return 2.0 ** (torch.floor(torch.log2(t.abs().max().double())).item() - 7)


def _params(run, what):
    """The final params of a run, after checking every rank holds the same (in bf16)."""
    for r, other in enumerate(run[1:], start=1):
        _bitwise(other[0], run[0][0], f"{what}: rank {r} vs rank 0")
    assert all(p.dtype == torch.bfloat16 for p in run[0][0].values()), what
    return run[0][0]


def _logged(run, key):
    return [(e["step"], e[key]) for e in run[0][1] if key in e]


def _assert_masters_equal(got: dict, want: dict, what: str) -> None:
    """Two optimizer state dicts hold the same masters and AdamW state, bitwise."""
    assert sorted(got["state"]) == sorted(want["state"]) != [], what
    for i, st in want["state"].items():
        assert sorted(got["state"][i]) == sorted(st), f"{what}: state keys of param {i}"
        assert st[MASTER].dtype == torch.float32, what
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(got["state"][i][k]), torch.as_tensor(v)), f"{what}: {k} of param {i}"


def _saved_optimizer_state(checkpoint: str) -> dict:
    """The consolidated optimizer state a Trainer checkpoint holds, sharded or not."""
    from hf_zero import _offline, _sharded
    from hf_zero.integrations import transformers as hf_tr

    sharded = os.path.join(checkpoint, hf_tr.SHARDED_DIR)
    if _sharded.is_sharded_checkpoint(sharded):
        return _offline.consolidate_checkpoint(sharded)
    return torch.load(os.path.join(checkpoint, "optimizer.pt"), weights_only=True)


# -- Trainer ---------------------------------------------------------------------------------
def test_trainer_resume_on_the_same_and_other_world_sizes_equals_the_reference_bitwise(runs):
    main = _params(runs["main"], "zero_bucket, 2 ranks")
    _bitwise(main, _params(runs["ref_main"], "reference"), "zero_bucket on 2 ranks vs the fp32-master reference")
    initial = {n: p.detach() for n, p in tiny_llama().named_parameters()}
    assert all(not torch.equal(main[n], initial[n]) for n in initial), "a param never trained"
    assert _logged(runs["main"], "loss") == _logged(runs["ref_main"], "loss")
    assert _logged(runs["main"], "grad_norm") == _logged(runs["ref_main"], "grad_norm")
    assert max(g for _, g in _logged(runs["main"], "grad_norm")) > 0.5, "the clipping never clipped"
    # What the resumes start from: the checkpoint's masters equal the reference's, round to
    # the saved bf16 weights, and hold more than those do.
    from safetensors.torch import load_file

    ckpt = runs["root"] / "main" / "checkpoint-4"
    saved = _saved_optimizer_state(str(ckpt))
    _assert_masters_equal(saved, _saved_optimizer_state(str(runs["root"] / "ref_main" / "checkpoint-4")),
                          "checkpoint-4: zero_bucket vs the reference")
    weights = load_file(str(ckpt / "model.safetensors"))
    names = {i: n for g in saved["param_groups"] for i, n in zip(g["params"], g["param_names"])}
    assert sorted(names[i] for i in saved["state"]) == sorted(weights) == sorted(initial)
    for i, st in saved["state"].items():
        assert torch.equal(st[MASTER].to(torch.bfloat16), weights[names[i]]), names[i]
    below_bf16 = sum(int((st[MASTER] != st[MASTER].to(torch.bfloat16).float()).sum()) for st in saved["state"].values())
    assert below_bf16 > sum(w.numel() for w in weights.values()) // 2, below_bf16
    # Resumed at step 4: on 2 ranks and on 1 process, the uninterrupted run bitwise.
    for name in ("resume2", "resume1"):
        _bitwise(_params(runs[name], name), main, f"{name} vs the uninterrupted run")
        assert _logged(runs[name], "loss") == _logged(runs["main"], "loss"), name  # steps 1-4 from the checkpoint
    # On 3 ranks: what zero_bucket resumed from the reference's checkpoint gives, bitwise.
    resumed3 = _params(runs["resume3"], "resume3")
    _bitwise(resumed3, _params(runs["resume3_from_ref"], "resume3_from_ref"),
             "resumed on 3 ranks: from its own checkpoint vs from the reference's")
    # The reference resumed on 3 ranks from its own checkpoint, under plain DDP: equal up to
    # the order in which each grad element's three bf16 summands are added (each addition
    # rounds). DDP runs gloo's ring all-reduce over its own buckets; hf_zero reduce-scatters
    # its buffers, each owner adding the others' ranges to its own (both divide by 3 first).
    # Some grad elements differ by an ulp; their masters move by far less than an update, and
    # a few params round to the neighbouring bf16 value: within one ulp at the tensor's
    # largest magnitude (16 of 21 tensors differ, each by at most half that, when measured).
    for n, want in _params(runs["ref_resume3"], "ref_resume3").items():
        error = (resumed3[n].double() - want.double()).abs().max().item()
        assert error <= _ulp_at_max(want), f"resumed on 3 ranks vs the reference: {n}: {error:.3g}"
    # The control: losing the masters at the resume changes the result.
    forgot = _params(runs["ref_resume1_no_masters"], "control")
    changed = sum(int((forgot[n] != main[n]).sum()) for n in main)
    assert changed > sum(p.numel() for p in main.values()) // 20, f"only {changed} elements moved without masters"


def test_trainer_gradual_unfreezing_equals_the_reference_bitwise(runs):
    got = _params(runs["unfreeze"], "zero_bucket")
    want = _params(runs["ref_unfreeze"], "reference")
    _bitwise(got, want, "gradual unfreezing: zero_bucket on 2 ranks vs the fp32-master reference")
    initial = {n: p.detach() for n, p in tiny_llama().named_parameters()}
    assert all(not torch.equal(got[n], initial[n]) for n in initial), "a layer was never unfrozen"
    assert _logged(runs["unfreeze"], "loss") == _logged(runs["ref_unfreeze"], "loss")
    state = runs["unfreeze"][0][2]["state"]["state"]
    assert all(MASTER in st for st in state.values()) and len(state) == len(initial)


def test_trainer_save_strategy_best_saves_and_resumes_bitwise(runs):
    from transformers.trainer_utils import get_last_checkpoint

    got = _params(runs["best"], "zero_bucket")
    _bitwise(got, _params(runs["ref_best"], "reference"), "save_strategy='best': zero_bucket vs the reference")
    assert _logged(runs["best"], "eval_loss") == _logged(runs["ref_best"], "eval_loss") != []
    root = runs["root"]
    checkpoints = sorted(os.listdir(root / "best"))
    assert checkpoints == sorted(os.listdir(root / "ref_best")) != []
    assert runs["best"][0][2]["best"].endswith(runs["ref_best"][0][2]["best"].rpartition("/")[2])
    for ckpt in checkpoints:
        _assert_masters_equal(_saved_optimizer_state(str(root / "best" / ckpt)),
                              _saved_optimizer_state(str(root / "ref_best" / ckpt)), f"best: {ckpt}")
    # Resumed on 1 process from the latest of them (saved at an evaluation before the last
    # step): the uninterrupted run, bitwise.
    resumed_from = runs["best_resume1"][0][2]["resumed_from"]
    assert resumed_from == get_last_checkpoint(str(root / "best")) and not resumed_from.endswith("-7")
    _bitwise(_params(runs["best_resume1"], "resumed"), got, "save_strategy='best': resumed on 1 process")


# -- Accelerate ------------------------------------------------------------------------------
def test_accelerate_save_state_load_state_on_another_world_size_bitwise(runs):
    saved = runs["accelerate"]
    loaded = runs["accelerate_load1"]
    assert saved[0]["master_weights"] is True  # "auto" with bf16 params
    _bitwise(saved[1]["final"], saved[0]["final"], "accelerate: rank 1 vs rank 0")
    final = saved[0]["final"]
    _bitwise(final, runs["accelerate_reference"][0]["final"], "accelerate, 2 ranks, vs the fp32-master reference")
    # load_state on 1 process: the saved weights, then the remaining steps bitwise.
    _bitwise(loaded[0]["loaded"], saved[0]["at_save"], "accelerate: weights after load_state on 1 process")
    _bitwise(loaded[0]["final"], final, "accelerate: saved on 2 ranks, loaded and trained on 1 process")
