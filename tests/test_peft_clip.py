"""PEFT-style clipping: the optimizer holds only the trainable params, and the loop clips
``accelerator.clip_grad_norm_(model.parameters(), max_norm)`` over all of them, as Hugging Face's
examples do. torch skips the frozen params (they have no grad); so must hf_zero, under stage 1
and stage 2, returning the norm torch returns."""

import os

import pytest
import torch

import hf_zero
from tests._dist import run_ranks
from tests.hf_trainer_cases import TokenDataset, tiny_bert

pytestmark = pytest.mark.filterwarnings("ignore")

STEPS, PER_DEVICE, MAX_NORM, LR = 3, 2, 0.5, 1e-2
FROZEN = ("bert.embeddings.", "bert.encoder.layer.0.")


def _peft_model():
    model = tiny_bert()
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(FROZEN))
    return model


def _run(rank, mode):
    from accelerate import Accelerator

    os.environ.update(LOCAL_RANK=str(rank), ACCELERATE_USE_CPU="1")
    accelerator = Accelerator(cpu=True)
    model = _peft_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    if mode == "ddp":
        optimizer = torch.optim.AdamW(trainable, lr=LR)
    else:
        optimizer = hf_zero.ZeroBucketOptimizer(trainable, torch.optim.AdamW, lr=LR, stage=2 if mode == "stage2" else 1)
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=PER_DEVICE, shuffle=False)
    prepared, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    norms = []
    for step, batch in enumerate(loader):
        accelerator.backward(prepared(**batch).loss)
        norms.append(accelerator.clip_grad_norm_(prepared.parameters(), MAX_NORM))
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 == STEPS:
            break
    return {"norms": torch.stack(norms).detach().cpu(),
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _all_modes(rank, world_size):
    return {mode: _run(rank, mode) for mode in ("ddp", "stage1", "stage2")}


@pytest.mark.timeout(200)
def test_clipping_all_params_with_an_optimizer_of_the_trainable_ones_equals_ddp():
    r0, r1 = run_ranks(_all_modes, 2, timeout=180)
    ddp = r0["ddp"]
    assert float(ddp["norms"].max()) > MAX_NORM  # the clipping clips
    for mode in ("stage1", "stage2"):
        for r in (r0, r1):
            # float64 model: torch's own norm is exact enough to compare tightly.
            torch.testing.assert_close(r[mode]["norms"], ddp["norms"], rtol=1e-10, atol=0)
            torch.testing.assert_close(r[mode]["norms"], r0["stage1"]["norms"], rtol=1e-6, atol=0)
            for n, p in ddp["params"].items():
                torch.testing.assert_close(r[mode]["params"][n], p, rtol=0, atol=1e-12, msg=lambda m: f"{mode} {n}: {m}")
        for n, p in r0[mode]["params"].items():
            assert torch.equal(p, r1[mode]["params"][n]), f"{mode}: replicas differ: {n}"
    frozen = [n for n in ddp["params"] if n.startswith(FROZEN)]
    assert frozen and all(torch.equal(ddp["params"][n], _peft_model().state_dict()[n]) for n in frozen)


@pytest.mark.fast
def test_optimizer_clipping_skips_params_it_does_not_hold_without_a_grad():
    """The optimizer's own ``clip_grad_norm_(parameters=model.parameters())`` in a plain loop, as torch's."""
    norms, params = {}, {}
    for kind in ("torch", "hf_zero"):
        model = _peft_model()
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = (torch.optim.AdamW(trainable, lr=LR) if kind == "torch"
               else hf_zero.ZeroBucketOptimizer(trainable, torch.optim.AdamW, lr=LR))
        norms[kind] = []
        for batch in list(torch.utils.data.DataLoader(TokenDataset(), batch_size=4))[:STEPS]:
            model(**batch).loss.backward()
            if kind == "torch":
                norms[kind].append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
            else:
                norms[kind].append(opt.clip_grad_norm_(MAX_NORM, parameters=model.parameters()))
            opt.step()
            opt.zero_grad()
        params[kind] = dict(model.named_parameters())
    assert max(norms["torch"]) > MAX_NORM
    torch.testing.assert_close(torch.stack(norms["hf_zero"]), torch.stack(norms["torch"]), rtol=1e-12, atol=0)
    for n, p in params["torch"].items():
        assert torch.equal(params["hf_zero"][n], p), n
    stray = torch.nn.Parameter(torch.ones(2))
    stray.grad = torch.ones(2)
    with pytest.raises(ValueError, match=r"clip_grad_norm_: a param of shape \(2,\) is not one of this optimizer's"):
        opt.clip_grad_norm_(MAX_NORM, parameters=[*model.parameters(), stray])
