"""A rebuild's memory: it never holds old and new buffers and state at once (issue 18.4).

Each rank measures its own resident high-water mark across a rebuild: glibc serves every
tensor above 64 KiB with its own mapping (``MALLOC_MMAP_THRESHOLD_``), so resident memory
follows live tensors, and writing 5 to ``/proc/self/clear_refs`` resets ``VmHWM``.
"""

import os

import pytest
import torch

from tests._dist import run_ranks

LAYERS, WIDTH = 6, 1024  # 6.3M params, 24 MiB in float32; one 4 MiB weight per DDP bucket
SLACK_MIB = 3.0  # the interpreter, the agreement's small tensors, allocator rounding


def _mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _rebuild_peak(opt) -> tuple[float, float]:
    """(MiB above the resident size before, MiB left after) of one forced rebuild."""
    before = _mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    opt.refresh_trainable()
    return _mib("VmHWM") - before, _mib("VmRSS") - before


def _run(rank, world_size, dtype_name):
    import hf_zero

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).to(dtype)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=WIDTH * WIDTH * dtype.itemsize / 2**20,
                                                    gradient_as_bucket_view=True, find_unused_parameters=True)
    opt = hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, grad_reduce="reduce_scatter")
    opt.bind_ddp(ddp)
    x = torch.randn(4, WIDTH, dtype=dtype)

    def step():
        ddp(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):  # DDP rebuilds its buckets after the first iteration; state exists after the first step
        step()
    largest = max(plan.size * plan.dtype.itemsize for plan in opt.gradient_path.layout.buffers) / 2**20
    out = {"largest_buffer_mib": largest, "rebuilds": opt.rebuilds}
    model[2].weight.requires_grad_(False)
    out["freeze"] = _rebuild_peak(opt)
    step()
    model[2].weight.requires_grad_(True)
    out["unfreeze"] = _rebuild_peak(opt)
    step()
    out["unchanged"] = _rebuild_peak(opt)
    out["rebuilds"] = opt.rebuilds - out["rebuilds"]
    stats = opt.stats()
    out["state_mib"] = (stats["state_bytes_per_rank"][rank] + stats["master_bytes_per_rank"][rank]) / 2**20
    return out


@pytest.mark.reliability("freeze, unfreeze and a forced rebuild under DDP (the Trainer's gradient path), 2 ranks, "
                         "AdamW with state, float32 and bf16 with fp32 masters",
                         "each rebuild's resident peak is at most one bucket above what the rank held before")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_a_rebuild_holds_at_most_one_bucket_more(dtype_name, monkeypatch):
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the high-water mark")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # read by glibc as each rank starts
    for r in run_ranks(_run, 2, dtype_name, timeout=100, fresh=True):
        assert r["rebuilds"] == 3, r
        # What a rebuild that kept the old buffers or state would add: all of either.
        assert r["state_mib"] > 4 * r["largest_buffer_mib"], r
        for case in ("freeze", "unfreeze", "unchanged"):
            peak, _left = r[case]
            assert peak <= r["largest_buffer_mib"] + SLACK_MIB, (case, r)


# -- checkpoints: a save costs no rank more than a training step ---------------------------------------------
SAVE_BOUND = 1.03  # every rank's peak during a save / its peak during the training steps


class _Meter:
    """Per-rank high-water marks above the resident size before the model was built: of
    the training steps, and of the saves (the mark is reset right before and after each)."""

    def __init__(self):
        import gc

        gc.collect()
        self.base = _mib("VmRSS")
        self.train = self.save = 0.0
        self._reset()

    @staticmethod
    def _reset():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def saving(self, save):
        self.train = max(self.train, _mib("VmHWM") - self.base)
        self._reset()
        result = save()
        self.save = max(self.save, _mib("VmHWM") - self.base)
        self._reset()
        return result

    def done(self) -> dict:
        self.train = max(self.train, _mib("VmHWM") - self.base)
        return {"train": self.train, "save": self.save}


def _gpt2(dtype):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=512, n_layer=6, n_head=4,
                                       bos_token_id=255, eos_token_id=255, use_cache=False))
    return model.to(getattr(torch, dtype))


def _saving_run(rank, world_size, root, kind, dtype_name):
    """One run (a fresh process: a run before it would leave memory to free during it),
    saving every 3 steps: ``trainer`` (the default checkpoints), ``trainer_plain``
    (``sharded_checkpoints=false``) or ``accelerate`` (a loop calling ``save_state``)."""
    os.environ.update(ACCELERATE_USE_CPU="1", LOCAL_RANK=str(rank))
    import transformers

    import hf_zero
    from hf_zero import _offline

    transformers.logging.set_verbosity_error()
    _offline._CHUNK_BYTES = 1 << 20  # the plain file's buffer, scaled to this model as 16 MiB is to GPT-2 124M
    toks = torch.randint(0, 256, (12, 64), generator=torch.Generator().manual_seed(rank))
    meter = _Meter()
    if kind.startswith("trainer"):
        from transformers import Trainer, TrainingArguments

        class Measured(Trainer):
            def _save_checkpoint(self, *args, **kwargs):
                return meter.saving(lambda: super(Measured, self)._save_checkpoint(*args, **kwargs))

        args = TrainingArguments(root, optim="zero_bucket", max_steps=6, save_strategy="steps", save_steps=3,
                                 optim_args="sharded_checkpoints=false" if kind == "trainer_plain" else None,
                                 per_device_train_batch_size=1, use_cpu=True, bf16=dtype_name == "bfloat16",
                                 report_to=[], disable_tqdm=True, logging_strategy="no")
        trainer = Measured(model=_gpt2(dtype_name), args=args,
                           train_dataset=[{"input_ids": t, "labels": t} for t in toks])
        trainer.train()
        trainer.accelerator.end_training()
        return meter.done()
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision="bf16" if dtype_name == "bfloat16" else "no")
    model = _gpt2(dtype_name)
    opt = hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-5)
    model, opt = accelerator.prepare(model, opt)
    for step in range(6):
        loss = model(input_ids=toks[step : step + 1], labels=toks[step : step + 1]).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        if step % 3 == 2:
            meter.saving(lambda: accelerator.save_state(os.path.join(root, f"checkpoint-{step + 1}")))
    accelerator.end_training()
    return meter.done()


@pytest.mark.reliability("Trainer (default checkpoints, fp32 and bf16; sharded_checkpoints=false) and an Accelerate loop "
                         "(save_state) saving every 3 steps, 2 ranks, GPT-2 19M",
                         f"every rank's peak during a save at most {SAVE_BOUND}x its peak in the training steps")
@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind, dtype_name", [("trainer", "float32"), ("trainer", "bfloat16"),
                                              ("trainer_plain", "float32"), ("accelerate", "float32")])
def test_a_checkpoint_costs_no_rank_more_than_a_training_step(kind, dtype_name, tmp_path, monkeypatch):
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the high-water mark")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    for rank, r in enumerate(run_ranks(_saving_run, 2, str(tmp_path), kind, dtype_name, timeout=180, fresh=True)):
        assert r["save"] <= SAVE_BOUND * r["train"], (rank, r)
    saved = tmp_path / "checkpoint-6"
    if kind == "trainer_plain":
        assert "hf_zero_optimizer" not in os.listdir(saved)
        plain = torch.load(saved / "optimizer.pt", weights_only=True)
        assert len(plain["state"]) == len(list(_gpt2(dtype_name).parameters()))
    else:  # each rank's optimizer state, gathered nowhere
        assert sum(f.endswith("-of-00002.safetensors") for f in os.listdir(saved / "hf_zero_optimizer")) == 2

