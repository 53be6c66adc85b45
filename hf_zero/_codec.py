"""Plain values in JSON: hyperparameters and scalar state in checkpoint records."""

from __future__ import annotations

from typing import Any

import torch

from ._state import dtype_from_name


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def encode(v: Any, where: str) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, tuple):
        return {"__tuple__": [encode(x, where) for x in v]}
    if isinstance(v, list):
        return [encode(x, where) for x in v]
    if isinstance(v, dict):
        return {"__dict__": [[encode(k, where), encode(x, where)] for k, x in v.items()]}
    if isinstance(v, torch.Tensor):
        return {"__tensor__": v.detach().cpu().tolist(), "dtype": str(v.dtype).removeprefix("torch.")}
    if isinstance(v, torch.dtype):
        return {"__dtype__": str(v).removeprefix("torch.")}
    raise ValueError(f"hf_zero: {where} = {v!r} ({type(v).__name__}) cannot be stored in a checkpoint")


def decode(v: Any) -> Any:
    if isinstance(v, list):
        return [decode(x) for x in v]
    if isinstance(v, dict):
        if "__tuple__" in v:
            return tuple(decode(x) for x in v["__tuple__"])
        if "__dict__" in v:
            return {decode(k): decode(x) for k, x in v["__dict__"]}
        if "__tensor__" in v:
            return torch.tensor(v["__tensor__"], dtype=dtype_from_name(v["dtype"]))
        if "__dtype__" in v:
            return dtype_from_name(v["__dtype__"])
    return v


