"""Offline tools for sharded checkpoints (no process group): consolidate and inspect."""

from __future__ import annotations

import math
import os

import torch

from ._codec import decode
from ._sharded import Checkpoint, write_atomic


def consolidate_checkpoint(path: str | os.PathLike) -> dict:
    """The plain PyTorch optimizer state dict of a sharded checkpoint, on CPU.

    No process group needed. Loads into ``optimizer_class`` over the same params
    (or into a :class:`ZeroBucketOptimizer` on any world size).
    """
    with Checkpoint(path) as ckpt:
        state = {}
        for j, p in enumerate(ckpt.params):
            st = ckpt.read(j, 0, math.prod(p["shape"]), tuple(p["shape"]))
            if st is not None:
                state[j] = st
        groups = []
        for g in ckpt.record["param_groups"]:
            dec = {k: decode(v) for k, v in g.items() if k != "params"}
            dec["params"] = list(g["params"])
            groups.append(dec)
    return {"state": state, "param_groups": groups}


def save_state_dict(state_dict: dict, path: str | os.PathLike) -> None:
    """``torch.save`` atomically (a plain state dict: loads with ``weights_only=True``)."""
    write_atomic(os.fspath(path), lambda tmp: torch.save(state_dict, tmp))


def inspect_checkpoint(path: str | os.PathLike) -> str:
    """A human-readable summary of a sharded checkpoint."""
    with Checkpoint(path) as ckpt:
        rec = ckpt.record
        params = ckpt.params
        with_state = sorted(ckpt.pieces)
        lines = [
            f"checkpoint      {ckpt.path}",
            f"optimizer       {rec['optimizer_class']}",
            f"world size      {rec['world_size']}",
            f"shard mode      {rec['shard']}",
            f"bucket view     {rec['parameters_as_bucket_view']}",
            f"params          {len(params)} ({sum(p['trainable'] for p in params)} trainable at save, "
            f"{len(with_state)} with state), {sum(math.prod(p['shape']) for p in params):,} elements",
        ]
        for gi, g in enumerate(rec["param_groups"]):
            hyper = ", ".join(f"{k}={decode(v)!r}" for k, v in g.items() if k not in ("params", "param_names"))
            lines.append(f"param group {gi}   {len(g['params'])} params: {hyper}")
        keys: dict[str, set] = {}
        for j in with_state:
            for piece in ckpt.pieces[j]:
                for key, spec in piece.state.items():
                    if "value" in spec:
                        keys.setdefault(key, set()).add(type(decode(spec["value"])).__name__)
                    else:
                        kind = "scalar" if not spec["shape"] else "elementwise" if tuple(spec["shape"]) == piece.shape else "whole"
                        keys.setdefault(key, set()).add(f"{spec['dtype']} {kind}")
        lines.append("state keys      " + (", ".join(f"{k} ({'/'.join(sorted(v))})" for k, v in sorted(keys.items())) or "none"))
        total = 0
        for f in rec["files"]:
            total += f["bytes"]
            lines.append(f"rank {f['rank']:<10} {f['file']}: {f['bytes']:,} bytes, {len(f['holdings'])} pieces")
        lines.append(f"total bytes     {total:,}")
    return "\n".join(lines)
