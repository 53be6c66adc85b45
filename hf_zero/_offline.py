"""Offline tools for sharded checkpoints (no process group): consolidate and inspect."""

from __future__ import annotations

import io
import math
import os
import pickle
import zipfile

import torch

from ._codec import decode
from ._engine import saved_storage_id, saved_tensor_reduce
from ._sharded import Checkpoint, write_atomic
from ._state import dtype_from_name
from ._statedict import trainable_layout

_CHUNK_BYTES = 16 << 20  # what write_plain_optimizer holds at a time


def consolidate_checkpoint(path: str | os.PathLike) -> dict:
    """The plain PyTorch optimizer state dict of a sharded checkpoint, on CPU.

    No process group needed. Loads into ``optimizer_class`` over the same params
    (or into a :class:`ZeroBucketOptimizer` on any world size); saved by an optimizer with
    ``state_dict_params="trainable"`` (Trainer's ``zero_bucket``), it has the layout of one over
    the params trainable at the save, as Trainer's own optimizer holds them.
    """
    with Checkpoint(path) as ckpt:
        state = {}
        for j, p in enumerate(ckpt.params):
            st = ckpt.read(j, 0, math.prod(p["shape"]), tuple(p["shape"]))
            if st is not None:
                state[j] = st
        groups = _param_groups(ckpt)
        return _as_saved(ckpt, {"state": state, "param_groups": groups})


def _as_saved(ckpt: Checkpoint, state_dict: dict) -> dict:
    """``state_dict`` in the layout the optimizer's own ``state_dict()`` has (see [Note: trainable
    layout] in _statedict.py): every param, or only those trainable at the save."""
    if ckpt.record.get("state_dict_params", "all") != "trainable":
        return state_dict
    return trainable_layout(state_dict, [bool(p["trainable"]) for p in ckpt.params])


def _param_groups(ckpt: Checkpoint) -> list[dict]:
    """The checkpoint's param groups as a PyTorch state dict has them (hyperparameters decoded)."""
    return [{**{k: decode(v) for k, v in g.items() if k != "params"}, "params": list(g["params"])}
            for g in ckpt.record["param_groups"]]


def save_state_dict(state_dict: dict, path: str | os.PathLike) -> None:
    """``torch.save`` atomically (a plain state dict: loads with ``weights_only=True``)."""
    write_atomic(os.fspath(path), lambda tmp: torch.save(state_dict, tmp))


# [Note: streamed optimizer.pt]
# torch.save pickles the whole object first and then writes every storage, so it needs the
# whole state in memory at once. The file it writes is a zip archive: ``data.pkl`` (the
# object, each tensor a persistent id naming a record ``data/<key>``), the records, and a
# few small ones (``version``, ``byteorder``). write_plain_optimizer writes the same
# archive from a sharded checkpoint with the zipfile module: each state tensor's record is
# copied from the shard files in chunks of _CHUNK_BYTES (plain reads, no mapping), and
# ``data.pkl`` is written last, when every record exists (a zip's entries are found through
# its central directory, in any order). torch.load(weights_only=True) reads it as it reads
# torch.save's; the memory it takes is one chunk, whatever the size of the state.


class _Storage:
    """A record of the archive: what ``data.pkl`` refers to by persistent id."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _Tensor:
    """A tensor of ``data.pkl``: pickled as torch.save pickles a contiguous CPU tensor."""

    def __init__(self, storage: _Storage, shape: tuple[int, ...]):
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol):
        return saved_tensor_reduce(self.storage, self.shape)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return saved_storage_id(obj.key, obj.dtype, obj.numel)
        return None


def write_plain_optimizer(path: str | os.PathLike, out: str | os.PathLike, *, chunk_bytes: int | None = None) -> int:
    """Write the sharded checkpoint in ``path`` as a plain PyTorch optimizer state dict file
    ``out`` (atomically), holding ``chunk_bytes`` of state at a time (see [Note: streamed
    optimizer.pt]); returns the number of params with state. ``torch.load(out,
    weights_only=True)`` equals :func:`consolidate_checkpoint` of ``path``."""
    buf = bytearray(max(1, chunk_bytes or _CHUNK_BYTES))

    def write(tmp: str) -> int:
        with Checkpoint(path) as ckpt, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
            state: dict[int, dict] = {}
            records = 0

            def record(dtype: torch.dtype, numel: int, shape, segments) -> _Tensor:
                """A record copied from ``segments`` ((file path, offset, length) in order)."""
                nonlocal records
                storage = _Storage(str(records), dtype, numel)
                records += 1
                with z.open(f"archive/data/{storage.key}", "w", force_zip64=True) as entry:
                    for full, offset, length in segments:
                        with open(full, "rb") as f:
                            f.seek(offset)
                            while length:
                                n = f.readinto(memoryview(buf)[: min(length, len(buf))])
                                if not n:
                                    raise ValueError(f"hf_zero: checkpoint file {full!r} ends early")
                                entry.write(memoryview(buf)[:n])
                                length -= n
                return _Tensor(storage, tuple(shape))

            for j, p in enumerate(ckpt.params):
                shape = tuple(p["shape"])
                numel = math.prod(shape)
                over = ckpt.covering(j, 0, numel)
                if not over:
                    continue
                st: dict = {}
                for key, spec in over[0].state.items():
                    if "value" in spec:
                        st[key] = decode(spec["value"])
                        continue
                    dtype = dtype_from_name(spec["dtype"])
                    if tuple(spec["shape"]) == over[0].shape and spec["shape"]:  # elementwise: every piece, in order
                        segments = []
                        for piece in over:
                            full, offset, _ = ckpt.byte_range(piece.file, piece.state[key]["tensor"])
                            segments.append((full, offset, (piece.stop - piece.start) * dtype.itemsize))
                        st[key] = record(dtype, numel, shape, segments)
                    else:  # a scalar (the first piece's, as a load takes it) or whole-param state
                        if spec["shape"] and len(over) > 1:
                            raise ValueError(f"hf_zero: state {key!r} of param {ckpt.label(j)} is split over pieces "
                                             "but is not elementwise: the checkpoint is corrupt")
                        full, offset, length = ckpt.byte_range(over[0].file, spec["tensor"])
                        st[key] = record(dtype, math.prod(spec["shape"]), spec["shape"], [(full, offset, length)])
                state[j] = st
            groups = _param_groups(ckpt)
            pickled = io.BytesIO()
            _Pickler(pickled, protocol=2).dump(_as_saved(ckpt, {"state": state, "param_groups": groups}))
            z.writestr("archive/data.pkl", pickled.getvalue())
            z.writestr("archive/.format_version", "1")
            z.writestr("archive/byteorder", "little")  # safetensors stores little-endian
            z.writestr("archive/version", "3\n")
            return len(state)

    result = []
    write_atomic(os.fspath(out), lambda tmp: result.append(write(tmp)))
    return result[0]


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
            f"state dict      {'trainable params only (frozen ones carried apart)' if rec.get('state_dict_params') == 'trainable' else 'every param'}",
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
