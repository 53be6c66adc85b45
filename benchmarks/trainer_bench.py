"""End-to-end Trainer throughput: optim="zero_bucket" vs "adamw_torch", 2 gloo processes.

Each rank runs the same Trainer on a small GPT-2 with fixed random tokens; a
callback times the training steps after a warm-up, so start-up and the first
step's buffer building are left out. Both optims run one after the other in the
same processes as the rest of the suite.
"""

from __future__ import annotations

import os
import tempfile
import time

from .measure import median

SMOKE = {"model": dict(vocab_size=512, n_positions=32, n_embd=32, n_layer=2, n_head=2),
         "seq": 16, "batch": 2, "warmup": 1, "steps": 2, "rounds": 1}
FULL = {"model": dict(vocab_size=8192, n_positions=128, n_embd=256, n_layer=4, n_head=4),
        "seq": 64, "batch": 8, "warmup": 2, "steps": 8, "rounds": 3}
OPTIMS = ("adamw_torch", "zero_bucket")


def zero_bucket_registered() -> bool:
    import hf_zero  # noqa: F401  (registers the optim name, once that integration exists)
    from transformers.training_args import OptimizerNames

    return any(o.value == "zero_bucket" for o in OptimizerNames)


def trainer_rank(rank: int, world_size: int, cfg: dict) -> dict:
    """Per-rank step times of both optims (runs inside the suite's ranks, process group up)."""
    if not zero_bucket_registered():
        return {"measured": False,
                "why": "`import hf_zero` does not register optim='zero_bucket' in this checkout "
                       "(the Trainer integration had not landed when this ran)"}
    step_s = {optim: [] for optim in OPTIMS}
    for _ in range(cfg["rounds"]):  # alternated, so both see the same machine load
        for optim in OPTIMS:
            step_s[optim] += _train_rank(rank, world_size, optim, cfg)
    return {"measured": True, "step_s": step_s}


def summarise(per_rank: list[dict], cfg: dict) -> dict:
    if not per_rank[0]["measured"]:
        return per_rank[0]
    world_size = len(per_rank)
    rates = {}
    for optim in OPTIMS:
        step_s = [max(ts) for ts in zip(*(r["step_s"][optim] for r in per_rank))]
        rates[optim] = cfg["batch"] * world_size / median(step_s)
    return {
        "measured": True,
        "model": "gpt2 " + ", ".join(f"{k}={v}" for k, v in cfg["model"].items()),
        "detail": (f"per-device batch {cfg['batch']} x seq {cfg['seq']}; {cfg['rounds']} alternating runs per optim "
                   f"of {cfg['warmup']} warm-up + {cfg['steps']} timed steps; median step (slowest rank); "
                   "samples/s over both ranks; "
                   "a step is Trainer's on_step_begin to on_step_end (forward, backward, clip, optimizer)."),
        "samples_per_s": rates,
    }


def _train_rank(rank, world_size, optim, cfg):
    os.environ.setdefault("ACCELERATE_USE_CPU", "1")
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    import hf_zero  # noqa: F401

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    last = cfg["model"]["vocab_size"] - 1
    model = GPT2LMHeadModel(GPT2Config(bos_token_id=last, eos_token_id=last, **cfg["model"]))
    n = cfg["batch"] * world_size * (cfg["warmup"] + cfg["steps"] + 1)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg["model"]["vocab_size"], (n, cfg["seq"]), generator=g)
    data = [{"input_ids": t, "labels": t} for t in tokens]

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

    clock = Clock()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, optim=optim, learning_rate=1e-4, per_device_train_batch_size=cfg["batch"],
            max_steps=cfg["warmup"] + cfg["steps"], use_cpu=True, report_to=[], save_strategy="no",
            logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
            ddp_find_unused_parameters=False,
        )
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[clock])
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    return clock.times[cfg["warmup"]:]
