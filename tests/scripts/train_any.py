"""A user's training script that knows nothing about hf_zero: nothing here imports it.

tests/test_autoload.py runs it with ``--optim zero_bucket``, which must work with hf_zero
merely installed. Like transformers' example scripts it parses ``TrainingArguments``
with ``HfArgumentParser`` from the command line, or from a JSON file given as the only
argument, and resumes from ``resume_from_checkpoint``. It trains a tiny float64 GPT-2
(about 1,300 parameters) on synthetic tokens, then saves the model. Rank 0 writes the
log history to ``<output_dir>/log_history.json``; each rank destroys the process group,
then writes ``done-<rank>`` last.
"""

import gc
import json
import os
import sys
from dataclasses import dataclass, field

import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments


@dataclass
class DataArguments:
    n_examples: int = field(default=32, metadata={"help": "synthetic sequences in the training set"})
    seq_len: int = field(default=8, metadata={"help": "tokens per sequence"})


def main() -> None:
    parser = HfArgumentParser((DataArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        data_args, training_args = parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    else:
        data_args, training_args = parser.parse_args_into_dataclasses()

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=1, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).to(torch.float64)
    tokens = torch.randint(0, config.vocab_size, (data_args.n_examples, data_args.seq_len),
                           generator=torch.Generator().manual_seed(1))
    train_dataset = [{"input_ids": t, "labels": t} for t in tokens]

    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    if trainer.is_world_process_zero():
        with open(os.path.join(training_args.output_dir, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f)
    # End as a well-behaved script does (Accelerate's end_training(), trl's trainer.end()):
    # without it gloo's own teardown can abort at exit with any optimizer (docs/gradient_path.md).
    # DDP goes first: dropped after the group was destroyed, its reducer frees the last
    # reference to the gloo group on the main thread, whose worker threads may then wait for
    # the GIL held there (seen: a hang at exit with adamw_torch, 1 run in a few).
    process_index, output_dir = training_args.process_index, training_args.output_dir
    del trainer, model
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    with open(os.path.join(output_dir, f"done-{process_index}"), "w") as f:
        f.write("done\n")


if __name__ == "__main__":
    main()
