"""Trainer runs used by tests/test_fp32_weights.py (module-level: spawned ranks import it).

A tiny bf16 Llama trained by Trainer with ``optim="zero_bucket"`` (fp32 masters), saving
at steps 2 and 4. A callback freezes ``FROZEN`` at the end of step 2 (its master is
parked with its state at the next step) and halves it at the end of step 3, so
checkpoint-4 holds a master that no longer rounds to the saved weight.
"""

from __future__ import annotations

import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import hf_zero  # noqa: F401  (registers optim="zero_bucket")

FROZEN = "model.layers.0.mlp.down_proj.weight"
SEQ = 16


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config).to(torch.bfloat16)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 32):
        self.ids = torch.randint(3, 128, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class FreezeThenChange(TrainerCallback):
    def on_step_end(self, args, state, control, model=None, **kwargs):
        p = dict(model.named_parameters())[FROZEN]
        if state.global_step == 2:
            p.requires_grad_(False)
        elif state.global_step == 3:
            with torch.no_grad():
                p.mul_(0.5)


def run(rank, world_size, *, output_dir, sharded):
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    args = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=2, max_steps=4, save_strategy="steps", save_steps=2,
        learning_rate=1e-3, optim="zero_bucket", optim_args=f"sharded_checkpoints={str(sharded).lower()}",
        train_sampling_strategy="sequential", logging_steps=1, report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(), callbacks=[FreezeThenChange()])
    trainer.train()
    return trainer.state.global_step


def run_both(rank, world_size, directory):
    return [run(rank, world_size, output_dir=os.path.join(directory, name), sharded=sharded)
            for name, sharded in (("plain", False), ("sharded", True))]


def run_lora(rank, world_size, *, output_dir, optim="zero_bucket", bf16_adapters=False, resume=None, max_steps=3):
    """A PEFT LoRA run of the tiny Llama: float32 (adapters float32 too), or bf16 with bf16
    adapters (``bf16_adapters``: zero_bucket steps them through fp32 masters). Saves at step 2;
    returns the trainable params at the end."""
    from peft import LoraConfig, get_peft_model

    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    base = tiny_llama() if bf16_adapters else tiny_llama().float()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
                           autocast_adapter_dtype=not bf16_adapters)
    args = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=2, max_steps=max_steps, save_strategy="steps", save_steps=2,
        learning_rate=1e-2, optim=optim, train_sampling_strategy="sequential", logging_steps=1, report_to=[],
        use_cpu=True, seed=0, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=resume)
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def run_lora_many(rank, world_size, runs):
    return [run_lora(rank, world_size, **kw) for kw in runs]
