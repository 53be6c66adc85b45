"""float32 model weights from a checkpoint (``hf-zero consolidate CHECKPOINT --weights OUT``).

[Note: fp32 export]
A bf16/fp16 model trained with master weights has two copies of each trained weight on
disk: the 16-bit param in the model's weights (``model.safetensors``, or the files
``model.safetensors.index.json`` lists) and its fp32 master in the optimizer state
(``"master_param"``, consolidated in ``optimizer.pt`` or sharded in a ``save_sharded``
directory). The export writes every weight of the model's files, as float32:

- a weight with a master takes the master, where the master rounds to the saved weight
  (``master.to(saved.dtype) == saved``, element by element); where it does not (the
  param was changed outside the optimizer after its master was last stepped, e.g. while
  frozen) the saved weight wins, upcast, and the export reports the param and the count;
- a 16-bit weight without a master (frozen or never stepped, a buffer, or no optimizer
  state at all) is upcast: exact, but no more precise than the checkpoint;
- a weight of any other dtype is written as saved.

The model's weights are required: they name every weight (buffers and frozen params
included), and the masters are checked against them. The optimizer state is found
next to them or named directly; a sharded reference (``optimizer.pt`` that stands for
a sharded directory, see [Note: sharded reference]) is followed only to a directory
whose commit record carries the reference's token: first the one next to the
reference (a copied checkpoint), then the path recorded at save time.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field

import torch

from ._masters import HALF_DTYPES, MASTER_KEY
from ._statedict import every_param
from ._sharded import (COMMIT_FILE, Checkpoint, confined, is_reference, is_sharded_checkpoint, reference_info, token_at,
                       write_atomic)

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json",  # the order from_pretrained looks in
                "adapter_model.safetensors", "adapter_model.bin")  # a PEFT adapter's (save_pretrained of a PeftModel)
_ADAPTER = "adapter_model"
# PEFT saves adapter weights without the adapter's name ("lora_A.weight"); the model's params carry it
# ("lora_A.default.weight"), and so do the masters' names.
_DEFAULT_ADAPTER = ".default."
OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")  # Trainer's, Accelerate's
SHARDED_DIR = "hf_zero_optimizer"  # inside a Trainer / Accelerate checkpoint
# Files copied from the model's directory into an output directory (besides config.json).
_MODEL_FILES = ("adapter_config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja",
                "chat_template.json", "preprocessor_config.json")


@dataclass
class Export:
    """What :func:`fp32_export` found and built."""

    weights: dict[str, torch.Tensor]
    weights_from: str  # the model weights file (or index) read
    model_dir: str  # its directory (config.json and tokenizer files are copied from it)
    optimizer_from: str | None  # where the masters were read (None: no optimizer state found)
    from_master: list[str] = field(default_factory=list)
    upcast: list[str] = field(default_factory=list)  # 16-bit weights without a master
    as_saved: list[str] = field(default_factory=list)  # float32 and other dtypes, written as saved
    disagreeing: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (elements, numel)
    weights_dtypes: dict = field(default_factory=dict)  # name -> the saved dtype

    def summary(self, out: str) -> list[str]:
        """The lines ``hf-zero consolidate --weights`` prints: first the one line saying what was written."""
        n = len(self.weights)
        half = sorted({str(self.weights_dtypes[k]).removeprefix("torch.") for k in self.upcast})
        if self.from_master:
            what = f"{len(self.from_master)} from fp32 master weights"
            if self.disagreeing:
                what += f" ({len(self.disagreeing)} with saved elements kept, see below)"
            if self.upcast:
                what += (f", {len(self.upcast)} {'/'.join(half)} weights without a master (frozen, never stepped, "
                         "buffers) upcast")
            if self.as_saved:
                what += f", {len(self.as_saved)} as saved (float32 or other dtypes)"
        elif self.upcast:
            why = ("the checkpoint holds no optimizer state (saved with save_only_model?)"
                   if self.optimizer_from is None
                   else f"the optimizer state ({self.optimizer_from}) holds none (master_weights=false?)")
            what = (f"NO master weights: {why}; the saved {'/'.join(half)} weights upcast, no more precise than the "
                    "checkpoint")
        else:
            what = "the saved weights as they are (no master weights: the params are not 16-bit)"
        source = self.weights_from if self.optimizer_from is None else f"{self.weights_from} and {self.optimizer_from}"
        lines = [f"wrote {out}: {n} float32 weights, {what} (read {source})"]
        if self.disagreeing:
            shown = ", ".join(f"{k} ({d} of {t} elements)" for k, (d, t) in sorted(self.disagreeing.items())[:10])
            more = f" and {len(self.disagreeing) - 10} more" if len(self.disagreeing) > 10 else ""
            lines.append(f"warning: {len(self.disagreeing)} master weight(s) do not round to the saved 16-bit weight "
                         f"(changed outside the optimizer, e.g. while frozen); the saved weight was kept there: "
                         f"{shown}{more}")
        return lines


def fp32_export(checkpoint: str | os.PathLike, *, model: str | os.PathLike | None = None) -> Export:
    """float32 weights of ``checkpoint`` (see [Note: fp32 export]).

    ``checkpoint``: a Trainer / Accelerate checkpoint directory, its ``optimizer.pt`` /
    ``optimizer.bin``, its ``hf_zero_optimizer/`` directory, or any ``save_sharded``
    directory. ``model``: the model's weights (a directory, a ``.safetensors`` / ``.bin``
    file or an ``.index.json``) when they are not in or next to ``checkpoint``.
    """
    checkpoint = os.path.abspath(os.fspath(checkpoint))
    if not os.path.exists(checkpoint):
        raise ValueError(f"checkpoint: {checkpoint!r} does not exist")
    optimizer, near = _optimizer_source(checkpoint)
    weights_file = _weights_file(os.fspath(model) if model is not None else None, near)
    saved = _load_weights(weights_file)
    masters, optimizer = ({}, None) if optimizer is None else _masters(optimizer)
    result = Export({}, weights_file, os.path.dirname(weights_file), optimizer)
    unknown = [n for n in masters if _key(n, saved) is None]
    if unknown:
        raise ValueError(
            f"checkpoint: {len(unknown)} master weight(s) have no weight of that name in {weights_file}: "
            f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}; the optimizer state ({optimizer}) and "
            "the model weights do not belong together"
        )
    by_key = {_key(n, saved): m for n, m in masters.items()}
    for name, t in saved.items():
        result.weights_dtypes[name] = t.dtype
        master = by_key.get(name)
        if master is None:
            if t.dtype in HALF_DTYPES:
                result.weights[name] = t.to(torch.float32)
                result.upcast.append(name)
            else:
                result.weights[name] = t
                result.as_saved.append(name)
            continue
        if tuple(master.shape) != tuple(t.shape) or not t.is_floating_point():
            raise ValueError(f"checkpoint: master weight {name!r} is {tuple(master.shape)} float32, the saved weight "
                             f"{tuple(t.shape)} {t.dtype}: the optimizer state and the model weights do not match")
        w = master.to(torch.float32, copy=True)
        rounded = w.to(t.dtype)
        bad = (rounded != t) & ~(rounded.isnan() & t.isnan())
        if bool(bad.any()):
            w[bad] = t[bad].to(torch.float32)
            result.disagreeing[name] = (int(bad.sum()), t.numel())
        result.weights[name] = w
        result.from_master.append(name)
    return result


def _key(name: str, saved: dict) -> str | None:
    if name in saved:
        return name
    if name.startswith("module.") and name[len("module."):] in saved:  # named through a DDP wrapper
        return name[len("module."):]
    if _DEFAULT_ADAPTER in name:  # a PEFT adapter's weight, saved without its adapter name
        return _key(name.replace(_DEFAULT_ADAPTER, ".", 1), saved)
    return None


# -- where things are --------------------------------------------------------------
def _optimizer_source(path: str) -> tuple[str | None, str]:
    """(the optimizer state to read: a file or a sharded directory, or None; the directory
    the model's weights are looked for in first)."""
    if os.path.isfile(path):
        return path, os.path.dirname(path)
    if is_sharded_checkpoint(path):
        return path, path
    for name in OPTIMIZER_FILES:
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name), path
    if is_sharded_checkpoint(os.path.join(path, SHARDED_DIR)):
        return os.path.join(path, SHARDED_DIR), path
    return None, path


def _weights_file(model: str | None, near: str) -> str:
    if model is not None:
        model = os.path.abspath(model)
        if os.path.isfile(model):
            return model
        found = _weights_in(model)
        if found is None:
            raise ValueError(f"--model: {model!r} holds none of {', '.join(WEIGHT_FILES)}")
        return found
    looked = [near]
    if is_sharded_checkpoint(near):  # a sharded directory inside a checkpoint: its parent
        looked.append(os.path.dirname(near))
    for directory in looked:
        found = _weights_in(directory)
        if found is not None:
            return found
    raise ValueError(
        f"checkpoint: no model weights ({', '.join(WEIGHT_FILES)}) in {' or '.join(map(repr, looked))}. The export "
        "needs them (they name every weight, and each master is checked against its saved 16-bit weight): pass "
        "--model DIR_OR_FILE"
    )


def _weights_in(directory: str) -> str | None:
    for name in WEIGHT_FILES:
        if os.path.isfile(os.path.join(directory, name)):
            return os.path.join(directory, name)
    return None


def sharded_directory(reference_file: str, state_dict: dict) -> str:
    """The directory holding the sharded checkpoint that ``state_dict`` (a reference
    loaded from ``reference_file``) stands for: the first, next to the file then at the
    recorded path, whose commit record carries the reference's token."""
    ref = reference_info(state_dict)
    here = os.path.dirname(os.path.abspath(reference_file))
    recorded = ref["path"] if os.path.isabs(ref["path"]) else os.path.join(here, ref["path"])
    looked = list(dict.fromkeys([os.path.join(here, os.path.basename(os.path.normpath(ref["path"]))), here,
                                 os.path.normpath(recorded)]))
    for candidate in looked:
        if token_at(candidate) == ref["token"]:
            return candidate
    seen = "; ".join(f"{c}: " + ("token " + str(token_at(c)) if is_sharded_checkpoint(c) else
                                 "exists, no " + COMMIT_FILE if os.path.isdir(c) else "missing") for c in looked)
    raise ValueError(
        f"checkpoint: {reference_file} refers to the sharded optimizer state saved in {ref['path']!r} with token "
        f"{ref['token']}, and no directory holds it ({seen}). A directory with another token is a later save, not "
        "this checkpoint's state. Copy the checkpoint's own sharded directory next to the reference, or name it "
        "as CHECKPOINT"
    )


def sharded_source(path: str | os.PathLike) -> str:
    """The sharded optimizer directory ``path`` names: the directory itself, or the one the
    reference in ``path`` (an optimizer file, or a checkpoint directory holding one) stands
    for. ``ValueError`` when there is none."""
    path = os.path.abspath(os.fspath(path))
    source, _ = _optimizer_source(path) if os.path.exists(path) else (None, path)
    if source is not None and os.path.isfile(source):
        sd = _load_optimizer_file(source)
        if is_reference(sd):
            return sharded_directory(source, sd)
        raise ValueError(f"checkpoint: {source} is already a plain optimizer state dict, not a sharded reference")
    return source or path  # a sharded directory (a checkpoint's hf_zero_optimizer/), or Checkpoint's error naming what is missing


# -- reading -------------------------------------------------------------------------
def _load_weights(file: str) -> dict[str, torch.Tensor]:
    if file.endswith(".index.json"):
        with open(file) as f:
            weight_map = json.load(f)["weight_map"]
        out: dict[str, torch.Tensor] = {}
        for part in dict.fromkeys(weight_map.values()):
            loaded = _load_weights(confined(os.path.dirname(file), part, file))
            out.update({k: v for k, v in loaded.items() if weight_map.get(k) == part})
        missing = sorted(set(weight_map) - set(out))
        if missing:
            raise ValueError(f"checkpoint: {file} lists weights its files do not hold: {', '.join(missing[:5])}")
        return out
    if file.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(file)
    sd = _torch_load(file)
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"checkpoint: {file} is not a state dict of tensors")
    return sd


def _masters(source: str) -> tuple[dict[str, torch.Tensor], str]:
    """(name -> fp32 master, where they were read), from an optimizer state dict file or a sharded directory."""
    if os.path.isdir(source):
        return _sharded_masters(source), source
    sd = _load_optimizer_file(source)
    if is_reference(sd):
        directory = sharded_directory(source, sd)
        return _sharded_masters(directory), f"{directory} (token {token_at(directory)}, the one {source} refers to)"
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ValueError(f"checkpoint: {source} is not an optimizer state dict")
    sd = every_param(sd)  # frozen params' masters too
    names: dict = {}
    for g in sd["param_groups"]:
        names.update(zip(g["params"], g.get("param_names") or [None] * len(g["params"])))
    out = {}
    for i, st in sd["state"].items():
        if isinstance(st, dict) and MASTER_KEY in st:
            if names.get(i) is None:
                raise ValueError(f"checkpoint: param {i} of {source} has a master weight but the param_groups carry "
                                 "no param_names to say which weight it is (build the optimizer from "
                                 "model.named_parameters())")
            out[names[i]] = st[MASTER_KEY]
    return out, source


def _load_optimizer_file(file: str):
    if file.endswith((".safetensors", ".json")):
        raise ValueError(f"checkpoint: {file} is not an optimizer state: name the checkpoint directory, its "
                         "optimizer.pt or its hf_zero_optimizer/ (and --model for model weights elsewhere)")
    try:
        return _torch_load(file)
    except Exception as e:  # torch raises several types for a file that is not its format
        raise ValueError(f"checkpoint: {file} is not a torch.save'd optimizer state dict ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None


def _torch_load(file: str):
    try:  # memory-mapped: only the tensors used are read
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):  # a file in torch's legacy (non-zip) format cannot be mapped
            raise
        return torch.load(file, map_location="cpu", weights_only=True)


def _sharded_masters(directory: str) -> dict[str, torch.Tensor]:
    out = {}
    with Checkpoint(directory) as ckpt:
        for j, pieces in sorted(ckpt.pieces.items()):
            if MASTER_KEY not in pieces[0].state:
                continue
            p = ckpt.params[j]
            if p["name"] is None:
                raise ValueError(f"checkpoint: param {j} of {directory} has a master weight but no name (the "
                                 "optimizer was built from unnamed params)")
            shape = tuple(p["shape"])
            out[p["name"]] = ckpt.read(j, 0, math.prod(shape), shape, keys=(MASTER_KEY,))[MASTER_KEY]
    return out


# -- writing -------------------------------------------------------------------------
def _owned(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, no two sharing a storage (safetensors refuses shared ones)."""
    seen, out = set(), {}
    for k, v in weights.items():
        v = v.contiguous()
        key = (v.untyped_storage().data_ptr(), v.storage_offset())
        out[k] = v.clone() if v.numel() and key in seen else v
        seen.add(key)
    return out


def write_file(export: Export, path: str) -> None:
    """``export``'s weights as one safetensors file, written atomically."""
    from safetensors.torch import save_file

    weights = _owned(export.weights)
    write_atomic(path, lambda tmp: save_file(weights, tmp, metadata={"format": "pt"}))


def write_directory(export: Export, path: str, max_shard_bytes: int) -> list[str]:
    """``export`` as a model directory ``from_pretrained`` loads: ``model.safetensors`` (or
    files of at most ``max_shard_bytes`` plus ``model.safetensors.index.json``), the model's
    ``config.json`` with ``dtype`` float32, and its generation / tokenizer files. Returns the
    weight files written."""
    from safetensors.torch import save_file

    if os.path.isdir(path) and os.listdir(path):
        raise ValueError(f"--weights: {path!r} exists and is not empty; name a new directory (or a .safetensors file)")
    weights = _owned(export.weights)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in weights.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    os.makedirs(path, exist_ok=True)
    stem = _ADAPTER if os.path.basename(export.weights_from).startswith(_ADAPTER) else "model"
    names = ([f"{stem}.safetensors"] if len(shards) == 1 else
             [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, shard in zip(names, shards):
        write_atomic(os.path.join(path, name), lambda tmp, s=shard: save_file(s, tmp, metadata={"format": "pt"}))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in weights.values())},
                 "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
        _write_json(os.path.join(path, f"{stem}.safetensors.index.json"), index)
    config = os.path.join(export.model_dir, "config.json")
    if os.path.isfile(config):
        with open(config) as f:
            cfg = json.load(f)
        for key in ("dtype", "torch_dtype"):  # from_pretrained's default dtype ("auto") reads it
            if key in cfg:
                cfg[key] = "float32"
        _write_json(os.path.join(path, "config.json"), cfg)
    for name in _MODEL_FILES:
        if os.path.isfile(os.path.join(export.model_dir, name)):
            shutil.copyfile(os.path.join(export.model_dir, name), os.path.join(path, name))
    return names


def _write_json(path: str, value) -> None:
    text = json.dumps(value, indent=2)

    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)

    write_atomic(path, write)


def parse_size(text: str) -> int:
    """``"5GB"``, ``"200MB"``, ``"64KB"`` or a byte count, as bytes (powers of 1000, as Hugging Face)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    t = text.strip().upper()
    for unit, factor in units.items():
        if t.endswith(unit) and t[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * factor)
    if t.isdigit():
        return int(t)
    raise ValueError(f"--max-shard-size: {text!r} is not a size like 5GB, 200MB or a byte count")
