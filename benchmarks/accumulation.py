"""What stage 2 accumulates in: how far each gradient path ends from an exact sum, bf16 model.

``python -m benchmarks.accumulation [--steps 8] [--accumulation 8] [--runs clm unfreeze] [--out bench_out/accumulation]``

A run_clm-like Trainer run on 2 gloo ranks: a tiny GPT-2 causal LM built from its config,
params in bfloat16 (fp32 masters: ``master_weights`` at its default), learning a fixed random
permutation of its vocabulary, per-device batch 2, ``gradient_accumulation_steps`` 8, AdamW (the
zero_bucket default inner), constant lr, no clipping (``max_grad_norm=0``: clipping scales
every variant's grads by its own norm, which would mix the norm's precision into the grads');
and the same with gradual unfreezing (the first block, then the embeddings, frozen at the
start and unfrozen at later steps). Variants, each from the same initial weights and data:

- ``stage1``: ``optim_args`` empty (DDP; Trainer's ``no_sync`` accumulates each rank's bf16
  grads in ``p.grad``, then DDP averages them in bf16), ``grad_reduce=all_reduce`` so that the
  first step's grads can be read whole (at 2 ranks the same bits as the reduce-scatter hook:
  one rounding of a/2 + b/2 either way);
- ``stage2_param``: ``stage=2,grad_accum_dtype=param`` (bf16 shards, every micro-batch reduced);
- ``stage2_fp32``: ``stage=2,grad_accum_dtype=fp32`` (float32 shards);
- ``reference``: every param's bf16 micro-batch grad (what autograd hands its AccumulateGrad
  node, a tensor hook) is summed on its rank in float64, the sums are all-reduced in float64
  and divided by the number of ranks, and that is rounded once to float32 and written into a
  stage-2 ``fp32`` optimizer's shards just before its step (the reducer itself reduced zeros):
  the same masters step (AdamW on the fp32 masters, rounded into the bf16 params) on the
  float64-exact sum of the same bf16 micro-batch grads.

Reported per variant against the reference: final bf16 params (elements differing, of those
more than one bf16 ulp at the reference value apart, max and mean |diff|), final fp32 masters
(max and mean |diff|), and the first step's grads, where every variant saw the same weights and
data (max and mean |grad - exact| where the exact grad is the float64 sum; "relative": divided
by the largest |exact grad|; "elements": summed over ranks, each rank's shard under stage 2 and
its whole grads under stage 1). Bytes: each rank's grad shards at that step.
Writes ``results.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import environment  # noqa: E402
from tests._dist import run_ranks  # noqa: E402

VARIANTS = {
    "stage1": "grad_reduce=all_reduce",
    "stage2_param": "stage=2,grad_accum_dtype=param",
    "stage2_fp32": "stage=2,grad_accum_dtype=fp32",
    "reference": "stage=2,grad_accum_dtype=fp32",
}
VOCAB, SEQ, PER_DEVICE = 256, 32, 2
# the gradual-unfreezing run: {global step: {name prefix: requires_grad}}
UNFREEZE = {0: {"transformer.h.0.": False, "transformer.wte": False, "transformer.wpe": False},
            3: {"transformer.h.0.": True}, 5: {"transformer.wte": True, "transformer.wpe": True}}


def tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).to(torch.bfloat16)


class PermutationLM(torch.utils.data.Dataset):
    """Sequences whose next token is a fixed random permutation of the current one."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        perm = torch.randperm(VOCAB, generator=g)
        ids = torch.empty(n, SEQ, dtype=torch.long)
        ids[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
        for t in range(1, SEQ):
            ids[:, t] = perm[ids[:, t - 1]]
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _rank(rank, world_size, *, variant, steps, accumulation, schedule, out_dir):
    import torch.distributed as dist
    from transformers import TrainerCallback, TrainingArguments

    import hf_zero  # noqa: F401  (registers optim="zero_bucket")
    from tests.hf_trainer_cases import IN_ORDER, InOrderTrainer, TrainabilitySchedule

    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    model = tiny_gpt2()
    sums: dict[int, torch.Tensor] = {}  # param index -> this rank's float64 sum of its bf16 micro-batch grads
    params = list(model.parameters())
    reference = variant == "reference"

    def capture(i):
        def hook(g):
            sums[i] = g.double() if i not in sums else sums[i].add_(g.double())
            return torch.zeros_like(g) if reference else None  # the reference's reducer reduces zeros
        return hook

    for i, p in enumerate(params):
        p.register_hook(capture(i))
    first: dict = {}

    class Exact(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            opt = trainer.optimizer.optimizer
            exact = {}
            for i in sorted(sums):  # the same params on every rank (DDP / the reducer need that too)
                dist.all_reduce(sums[i])
                exact[i] = sums[i].div_(world_size).view(-1)
            sums.clear()
            index = {id(p): k for k, p in enumerate(opt.params)}
            of = {index[id(params[i])]: i for i in exact}  # optimizer index -> model index
            grads = opt.gradient_path.sharded_grads()
            if grads is not None:
                got = [(grads.held(pc), exact[of[pc.index]][pc.start:pc.stop]) for pc in grads.pieces
                       if pc.index in of and grads.held(pc) is not None]
                shard_bytes = sum(g.nbytes for g, _ in got)
            else:
                got = [(params[i].grad.view(-1), e) for i, e in exact.items() if params[i].grad is not None]
                shard_bytes = None
            if reference:
                for g, e in got:
                    g.copy_(e)  # float64 -> float32: one rounding
            if state.global_step == 0 and not first:
                err = torch.cat([(g.double() - e).abs() for g, e in got])
                top = torch.cat([e.abs() for _, e in got]).max()
                stats = torch.tensor([err.max(), err.sum(), err.numel(), top], dtype=torch.float64)
                dist.all_reduce(stats[:1], op=dist.ReduceOp.MAX)
                dist.all_reduce(stats[1:3])
                dist.all_reduce(stats[3:], op=dist.ReduceOp.MAX)
                first.update(max_abs=stats[0].item(), mean_abs=(stats[1] / stats[2]).item(),
                             max_rel=(stats[0] / stats[3]).item(), elements=int(stats[2]),
                             grad_shard_bytes_rank=shard_bytes)

    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=PER_DEVICE, gradient_accumulation_steps=accumulation,
        max_steps=steps, learning_rate=1e-3, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        optim="zero_bucket", optim_args=VARIANTS[variant], logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, seed=0, disable_tqdm=True, **IN_ORDER,
    )
    trainer = InOrderTrainer(
        model=model, args=args, train_dataset=PermutationLM(steps * accumulation * PER_DEVICE * world_size),
        callbacks=[TrainabilitySchedule(schedule or {}), Exact()],
    )
    trainer.train()
    opt = trainer.optimizer.optimizer
    opt.consolidate_state_dict(to=0, device="cpu")
    names = {id(p): n for n, p in model.named_parameters()}
    masters = {}
    if rank == 0:
        for k, st in opt.state_dict()["state"].items():
            if "master_param" in st:
                masters[names[id(opt.params[k])]] = st["master_param"].clone()
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"params": final, "masters": masters, "first_step": first, "losses": losses}


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at each element of ``t`` (bf16; zeros: the smallest normal's)."""
    m = t.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    return torch.pow(2.0, torch.floor(torch.log2(m)) - 7)


def compare(got: dict, want: dict) -> dict:
    """Final params (bf16) and masters (fp32) of ``got`` against ``want``."""
    diff = ulps = elements = 0
    worst, total = 0.0, 0.0
    for n, w in want["params"].items():
        g = got["params"][n]
        d = (g.double() - w.double()).abs()
        diff += int((d > 0).sum())
        ulps += int((d > _ulp(w).double()).sum())
        elements += d.numel()
        worst, total = max(worst, d.max().item()), total + d.sum().item()
    m_worst, m_total, m_elements = 0.0, 0.0, 0
    for n, w in want["masters"].items():
        d = (got["masters"][n].double() - w.double()).abs()
        m_worst, m_total, m_elements = max(m_worst, d.max().item()), m_total + d.sum().item(), m_elements + d.numel()
    return {"params_elements": elements, "params_differing": diff, "params_beyond_one_bf16_ulp": ulps,
            "params_max_abs": worst, "params_mean_abs": total / elements,
            "masters_max_abs": m_worst, "masters_mean_abs": m_total / max(m_elements, 1)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=8)
    parser.add_argument("--runs", nargs="+", default=["clm", "unfreeze"], choices=["clm", "unfreeze"])
    parser.add_argument("--out", default="bench_out/accumulation")
    parser.add_argument("--timeout", type=float, default=900.0)
    a = parser.parse_args(argv)
    os.environ["ACCELERATE_USE_CPU"] = "1"
    report = {"environment": environment("python -m benchmarks.accumulation " + " ".join(argv or sys.argv[1:]),
                                         world_size=2, steps=a.steps, accumulation=a.accumulation),
              "variants": VARIANTS, "runs": {}}
    for run in a.runs:
        results = {}
        for variant in VARIANTS:
            with tempfile.TemporaryDirectory() as tmp:
                ranks = run_ranks(_rank, 2, timeout=a.timeout, variant=variant, steps=a.steps, accumulation=a.accumulation,
                                  schedule=UNFREEZE if run == "unfreeze" else None, out_dir=tmp)
            results[variant] = ranks[0]
            print(f"{run} {variant}: losses {[round(x, 4) for x in ranks[0]['losses']]}", flush=True)
        n = sum(p.numel() for p in results["reference"]["params"].values())
        rows = {}
        for variant in ("stage1", "stage2_param", "stage2_fp32"):
            rows[variant] = {**compare(results[variant], results["reference"]),
                             "first_step_grads": results[variant]["first_step"]}
            print(f"{run} {variant}: {json.dumps(rows[variant])}", flush=True)
        rows["reference"] = {"first_step_grads": results["reference"]["first_step"]}
        report["runs"][run] = {"params": n, "losses": {v: r["losses"] for v, r in results.items()}, "rows": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'results.json'}")
    return report


if __name__ == "__main__":
    main()
