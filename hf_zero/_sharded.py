"""Sharded optimizer checkpoints on disk: the directory format, atomic writes, lazy reads.

[Note: sharded checkpoint]
A sharded checkpoint is a directory holding

- ``hf_zero_optimizer.json``: the commit record (JSON): optimizer class, shard
  mode, world size, every param's name, shape, dtype, group and trainability, the
  param groups' hyperparameters and, per file, its size, its SHA-256 (checked
  when a load first opens the file) and the state pieces in it;
- ``shard-<token>-rank<r>-of-<n>.safetensors``: the state rank ``r`` held, as
  tensors named ``<param name>/<state key>/<start>-<stop>`` (element range of the
  param), with no gather.

A save writes its files under a fresh token and only then replaces the record
(``os.replace``, after fsync): killed at any point, the directory holds either the
previous record, whose files are untouched, or the new one, whose files are
complete. Files of other tokens are removed after the commit. Loading reads on each
rank the element ranges its next layout needs, from whichever files hold them:
any world size, shard mode, bucket-view setting and trainable set. All ranks must
see the directory (a shared filesystem, or world size 1).

[Note: sharded reference]
Trainer and Accelerate save an optimizer by ``torch.save(optimizer.state_dict())``
on one process and load it with ``optimizer.load_state_dict(torch.load(...))`` on
every process. To keep the state sharded on disk, an integration has every rank
write it here and then makes ``state_dict()`` return a *reference* instead of the
state until the state changes::

    {"state": {}, "param_groups": [], "hf_zero_sharded": {"path": ..., "token": ..., ...}}

(plain types: loads with ``torch.load(weights_only=True)``; a plain torch optimizer
refuses it, since it has no param groups, rather than loading nothing). The
``token`` identifies one save: a directory is used only if its commit record
carries that token, so a moved checkpoint can be found by its new path and a newer
save in the old path is never taken for it.

This module knows nothing of the optimizer: it writes and reads holdings (see
:mod:`hf_zero._state`) and records that the optimizer prepares.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ._codec import decode, encode
from ._comm import Comm
from ._state import Holdings, dtype_from_name, unsplittable

COMMIT_FILE = "hf_zero_optimizer.json"
REFERENCE_KEY = "hf_zero_sharded"
_FORMAT = "hf_zero.sharded_optimizer"
_VERSION = 1
_SHARD_RE = re.compile(r"^shard-([0-9a-f]+)-rank\d+-of-\d+\.safetensors$")


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is a directory holding a committed sharded optimizer checkpoint."""
    return os.path.isfile(os.path.join(path, COMMIT_FILE))


def token_at(path: str | os.PathLike) -> str | None:
    """The token of the committed sharded checkpoint in ``path``, or None."""
    try:
        with open(os.path.join(path, COMMIT_FILE)) as f:
            return json.load(f).get("token")
    except (OSError, ValueError, AttributeError):
        return None


def reference(info: dict) -> dict:
    """The state dict that stands for the sharded checkpoint ``info`` describes."""
    return {"state": {}, "param_groups": [], REFERENCE_KEY: dict(info)}


def is_reference(state_dict: Any) -> bool:
    return isinstance(state_dict, dict) and REFERENCE_KEY in state_dict


def reference_info(state_dict: dict) -> dict:
    """The ``{"path", "token", ...}`` of a reference; ``ValueError`` if malformed."""
    ref = state_dict[REFERENCE_KEY]
    if not (isinstance(ref, dict) and isinstance(ref.get("token"), str) and isinstance(ref.get("path"), str)):
        raise ValueError(f"hf_zero: state_dict[{REFERENCE_KEY!r}] must be a dict with 'path' and 'token', got {ref!r}")
    return dict(ref)


# -- writing ------------------------------------------------------------------------
def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: str, write: Callable[[str], None]) -> None:
    """Call ``write(tmp)`` then fsync and rename ``tmp`` to ``path``: readers see all or nothing."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}-{secrets.token_hex(3)}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(directory)


def _pack(held: Holdings, labels: list[str]) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """This rank's holdings as safetensors tensors plus JSON entries describing them."""
    tensors: dict[str, torch.Tensor] = {}
    entries = []
    seen: set[tuple[int, int]] = set()
    for i, hs in sorted(held.items()):
        for h in hs:
            entry = {"param": i, "start": h.start, "stop": h.stop, "shape": list(h.shape), "state": {}}
            for key, v in h.state.items():
                if isinstance(v, torch.Tensor):
                    name = f"{labels[i]}/{key}/{h.start}-{h.stop}"
                    t = v.detach().contiguous()
                    if t.numel() and (t.data_ptr(), t.numel()) in seen:
                        t = t.clone()
                    seen.add((t.data_ptr(), t.numel()))
                    tensors[name] = t
                    entry["state"][key] = {
                        "tensor": name,
                        "shape": list(t.shape),
                        "dtype": str(t.dtype).removeprefix("torch."),
                        "cpu": v.device.type == "cpu",
                    }
                else:
                    entry["state"][key] = {"value": encode(v, f"state {key!r} of param {labels[i]}")}
            entries.append(entry)
    return tensors, entries


def write(comm: Comm, path: str | os.PathLike, held: Holdings, labels: list[str], record: dict) -> str:
    """Write this rank's ``held`` state; rank 0 commits ``record`` (plus the token and the
    files). Collective; returns the token. Every rank must reach each exchange, so
    errors are gathered and raised on every rank, and nothing is committed on failure."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    rank, ws = comm.rank, comm.world_size
    token = comm.all_gather_object(secrets.token_hex(8) if rank == 0 else None)[0]
    fname = f"shard-{token}-rank{rank:05d}-of-{ws:05d}.safetensors"
    meta, err = None, None
    try:
        os.makedirs(path, exist_ok=True)
        tensors, entries = _pack(held, labels)
        target = os.path.join(path, fname)
        write_atomic(target, lambda tmp: save_file(tensors, tmp, metadata={"format": _FORMAT}))
        meta = {"rank": rank, "file": fname, "bytes": os.path.getsize(target), "sha256": file_sha256(target),
                "holdings": entries}
    except Exception as e:  # every rank must reach the exchange below
        err = f"rank {rank}: {type(e).__name__}: {e}"
    metas = comm.all_gather_object((err, meta))
    errors = [e for e, _ in metas if e]
    if errors:
        raise RuntimeError("hf_zero: save_sharded failed, nothing was committed:\n  " + "\n  ".join(errors))
    err = None
    if rank == 0:
        try:
            full = {"format": _FORMAT, "version": _VERSION, "token": token, **record,
                    "files": [m for _, m in metas]}
            text = json.dumps(full, indent=1)
            write_atomic(os.path.join(path, COMMIT_FILE), lambda tmp: _write_text(tmp, text))
            _remove_stale(path, token)
        except Exception as e:
            err = f"rank 0: {type(e).__name__}: {e}"
    errors = [e for e in comm.all_gather_object(err) if e]
    if errors:
        raise RuntimeError("hf_zero: save_sharded could not commit the checkpoint:\n  " + "\n  ".join(errors))
    blind = [r for r, seen in enumerate(comm.all_gather_object(token_at(path) == token)) if not seen]
    if blind:  # each rank wrote into a directory of its own: no rank can load this checkpoint
        raise RuntimeError(f"hf_zero: ranks {blind} do not see the sharded optimizer checkpoint rank 0 committed in "
                           f"{path!r}: all ranks must see one directory (a shared filesystem)")
    return token


def file_sha256(path: str) -> str:
    """The SHA-256 of the file at ``path``, as hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


# [Note: stale temporaries]
# A save killed mid-write (a preempted job, an OOM kill) leaves its temporary behind: each rank's
# ``.shard-<token>-rank<r>-of-<n>.safetensors.tmp-<pid>-<hex>`` (as big as its state) or rank 0's
# ``.hf_zero_optimizer.json.tmp-<pid>-<hex>``. The next save or load there removes it, on rank 0,
# between two of its collectives, so no rank of the run can be writing a save of its own then (a
# save's first write follows a collective every rank enters after the load or the commit). Only files
# of exactly these names go, and only those no writer can still be at work on:
# - a save, once it committed: in its directory every temporary (every rank had written its file
#   before the commit: they are earlier saves'); when it is in a run's checkpoint
#   (``<output>/checkpoint-N/<name>``, as Trainer lays them out, or Accelerate's ``checkpoint_N``), in
#   the run's other checkpoints (``<output>/checkpoint-M/<name>``) the idle ones;
# - a load, once every rank read: in its directory the idle ones not of the save it loaded.
# Idle: not written for ``_IDLE_S`` (a writer at work writes all the time; a killed one stopped),
# which also keeps the files of another program saving into the same tree meanwhile.
_SHARD_TMP_RE = re.compile(r"^\.shard-([0-9a-f]+)-rank\d+-of-\d+\.safetensors\.tmp-\d+-[0-9a-f]+$")
_COMMIT_TMP_RE = re.compile(r"^\." + re.escape(COMMIT_FILE) + r"\.tmp-\d+-[0-9a-f]+$")
_RUN_CHECKPOINT_RE = re.compile(r"^checkpoint[-_]\d+$")
_IDLE_S = 60.0


def _temporaries(path: str) -> list[tuple[str, str | None]]:
    """(file name, its save's token or None) of the temporaries a save of this module leaves in ``path``."""
    try:
        entries = os.listdir(path)
    except OSError:
        return []
    out = []
    for entry in entries:
        m = _SHARD_TMP_RE.match(entry)
        if m or _COMMIT_TMP_RE.match(entry):
            out.append((entry, m.group(1) if m else None))
    return out


def _remove_older(path: str, names: list[str], before: float | None) -> list[str]:
    """Remove the files ``names`` of ``path`` last written before ``before`` (None: any); returns those removed."""
    removed = []
    for name in names:
        full = os.path.join(path, name)
        with contextlib.suppress(OSError):
            if before is None or os.stat(full).st_mtime < before:
                os.remove(full)
                removed.append(full)
    return removed


def _remove_stale(path: str, token: str) -> None:
    """After ``token``'s commit in ``path`` (rank 0): other saves' files, and stale temporaries (see
    [Note: stale temporaries])."""
    for entry in os.listdir(path):
        m = _SHARD_RE.match(entry)
        if m and m.group(1) != token:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(path, entry))
    _remove_older(path, [name for name, _ in _temporaries(path)], None)
    with contextlib.suppress(OSError):
        here = os.path.abspath(path)
        checkpoint, name = os.path.dirname(here), os.path.basename(here)
        if not _RUN_CHECKPOINT_RE.match(os.path.basename(checkpoint)):
            return
        tree = os.path.dirname(checkpoint)
        for sibling in os.listdir(tree):
            other = os.path.join(tree, sibling, name)
            if _RUN_CHECKPOINT_RE.match(sibling) and other != here and os.path.isdir(other):
                _remove_older(other, [n for n, _ in _temporaries(other)], time.time() - _IDLE_S)


def remove_stale_after_load(path: str | os.PathLike) -> list[str]:
    """Remove the temporaries in ``path`` that a load may remove ([Note: stale temporaries]): idle and not of
    the save it loaded. Call on one rank once every rank has read. Returns the paths removed."""
    path = os.fspath(path)
    token = token_at(path)
    return _remove_older(path, [n for n, t in _temporaries(path) if t is None or t != token], time.time() - _IDLE_S)


# [Note: confined records]
# A commit record is read before any hash can be checked, and a checkpoint may come from
# anyone: each file it names must be a plain name inside the checkpoint directory (no
# separator, no "..", not absolute; after symlinks are resolved, still inside), and carry the
# SHA-256 this hf_zero writes for every file, so nothing outside the directory is ever
# opened and no file is read unchecked.
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def confined(directory: str, name: Any, record_path: str) -> str:
    """The path of file ``name`` of the checkpoint in ``directory``, or ``ValueError`` naming it
    when it is not a plain file name that resolves inside the directory (see [Note: confined records])."""
    bad = (not isinstance(name, str) or not name or name in (".", "..") or os.path.isabs(name)
           or "/" in name or os.sep in name or (os.altsep is not None and os.altsep in name) or "\0" in name)
    if not bad:
        full = os.path.join(directory, name)
        root = os.path.realpath(directory)
        bad = os.path.commonpath([root, os.path.realpath(full)]) != root or os.path.realpath(full) == root
    if bad:
        raise ValueError(
            f"hf_zero: {record_path!r} names the file {name!r}, which is not a file of the directory "
            f"{directory!r} (a path outside it, or a link leading out of it). A checkpoint names only files "
            "of its own directory: this one was changed or comes from elsewhere; nothing was read"
        )
    return full


def _recorded_sha256(entry: dict, full: str, record_path: str) -> str:
    digest = entry.get("sha256")
    if not (isinstance(digest, str) and _SHA256_RE.match(digest)):
        raise ValueError(
            f"hf_zero: the commit record {record_path!r} gives no SHA-256 for checkpoint file {full!r} (got "
            f"{digest!r}); hf_zero records one for every file it writes, so the record was not written by this "
            "hf_zero or was changed, and the file cannot be checked: nothing was read"
        )
    return digest


@dataclass
class _Piece:
    file: str
    start: int
    stop: int
    shape: tuple[int, ...]
    state: dict


def _no_checkpoint(path: str) -> ValueError:
    """Why ``path`` holds no committed checkpoint, in the words that send the user the right way."""
    if not os.path.exists(path):
        return ValueError(f"hf_zero: {path!r} does not exist: check the path (a sharded optimizer checkpoint is a "
                          f"directory holding {COMMIT_FILE})")
    if not os.path.isdir(path):
        return ValueError(f"hf_zero: {path!r} is a file, not a sharded optimizer checkpoint (a directory holding "
                          f"{COMMIT_FILE}); a plain optimizer state dict loads with load_state_dict")
    if any(_SHARD_RE.match(name) for name in os.listdir(path)):
        return ValueError(f"hf_zero: {path!r} holds no sharded optimizer checkpoint (no {COMMIT_FILE}) but holds "
                          "shard files: a save into it was interrupted before its commit; resume from the previous "
                          "checkpoint")
    return ValueError(f"hf_zero: {path!r} holds no sharded optimizer checkpoint (no {COMMIT_FILE}): check the path")


class Checkpoint:
    """A committed sharded checkpoint, read lazily: only the ranges asked for."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        record_path = os.path.join(self.path, COMMIT_FILE)
        if not os.path.isfile(record_path):
            raise _no_checkpoint(self.path)
        with open(record_path) as f:
            try:
                record = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"hf_zero: {record_path!r} is not valid JSON: {e}") from None
        if record.get("format") != _FORMAT or record.get("version") != _VERSION:
            raise ValueError(
                f"hf_zero: {record_path!r} is format {record.get('format')!r} version "
                f"{record.get('version')!r}; this hf_zero reads {_FORMAT!r} version {_VERSION}"
            )
        self.record = record
        self.params = record["params"]
        self.pieces: dict[int, list[_Piece]] = {}
        self._sha256 = {}
        for f in record["files"]:
            full = confined(self.path, f.get("file"), record_path)
            self._sha256[f["file"]] = _recorded_sha256(f, full, record_path)
            size = os.path.getsize(full) if os.path.isfile(full) else None
            if size != f["bytes"]:
                found = "missing" if size is None else f"{size} bytes"
                raise ValueError(f"hf_zero: checkpoint file {full!r} is {found}, its commit record says {f['bytes']} bytes")
            for h in f["holdings"]:
                self.pieces.setdefault(h["param"], []).append(
                    _Piece(f["file"], h["start"], h["stop"], tuple(h["shape"]), h["state"])
                )
        for ps in self.pieces.values():
            ps.sort(key=lambda p: p.start)
        self._stack = contextlib.ExitStack()
        self._files: dict[str, Any] = {}
        self._checked: set[str] = set()
        self._headers: dict[str, tuple[int, dict]] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def label(self, j: int) -> str:
        name = self.params[j]["name"]
        return f"{name if name is not None else f'#{j}'} (shape {tuple(self.params[j]['shape'])})"

    def _verified(self, file: str) -> str:
        """The path of ``file``, its SHA-256 checked against the record (once)."""
        full = os.path.join(self.path, file)
        if file not in self._checked:
            if file_sha256(full) != self._sha256[file]:
                raise ValueError(
                    f"hf_zero: checkpoint file {full!r} does not match its commit record (SHA-256 differs): "
                    "it is corrupt or was changed after the save"
                )
            self._checked.add(file)
        return full

    def _open(self, file: str):
        if file not in self._files:
            from safetensors import safe_open

            full = self._verified(file)
            self._files[file] = self._stack.enter_context(safe_open(full, framework="pt", device="cpu"))
        return self._files[file]

    def byte_range(self, file: str, tensor: str) -> tuple[str, int, int]:
        """(path, offset, length) of the bytes of ``tensor`` in ``file`` (checked as a load
        checks it), to read with plain file reads: a mapped file's pages count as the
        reading process's resident memory until it is unmapped."""
        full = self._verified(file)
        if file not in self._headers:
            with open(full, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                self._headers[file] = (8 + size, json.loads(f.read(size)))
        base, header = self._headers[file]
        lo, hi = header[tensor]["data_offsets"]
        return full, base + lo, hi - lo

    def _tensor(self, piece: _Piece, spec: dict, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        f = self._open(piece.file)
        if lo is None:
            return f.get_tensor(spec["tensor"])
        if len(spec["shape"]) == 1:
            return f.get_slice(spec["tensor"])[lo:hi]
        return f.get_tensor(spec["tensor"]).reshape(-1)[lo:hi]

    def covering(self, j: int, start: int, stop: int) -> list[_Piece]:
        """The saved pieces of param ``j`` holding elements ``start:stop``, in order (empty:
        no state); raises when they leave a gap or disagree on the state keys."""
        pieces = self.pieces.get(j)
        if not pieces:
            return []
        over = [p for p in pieces if p.start < stop and p.stop > start]
        covered = sum(min(stop, p.stop) - max(start, p.start) for p in over)
        if covered != stop - start:
            raise ValueError(
                f"hf_zero: the checkpoint holds state for {covered} of elements {start}:{stop} of param "
                f"{self.label(j)}: it is incomplete or corrupt"
            )
        keys = set(over[0].state)
        if any(set(p.state) != keys for p in over):
            raise ValueError(f"hf_zero: the pieces of param {self.label(j)} in the checkpoint hold different state keys")
        return over

    def read(self, j: int, start: int, stop: int, piece_shape: tuple[int, ...], keys=None) -> dict | None:
        """State of elements ``start:stop`` of saved param ``j``, stepped as ``piece_shape``; None if it has none.
        ``keys``: read only these state keys (those the param has)."""
        over = self.covering(j, start, stop)
        if not over:
            return None
        numel = math.prod(self.params[j]["shape"])
        out: dict[str, Any] = {}
        for key, spec in over[0].state.items():
            if keys is not None and key not in keys:
                continue
            if "value" in spec:
                out[key] = decode(spec["value"])
                continue
            shape = tuple(spec["shape"])
            if not shape:
                out[key] = self._tensor(over[0], spec)
            elif shape == over[0].shape:
                t = torch.empty(stop - start, dtype=dtype_from_name(spec["dtype"]))
                for p in over:
                    lo, hi = max(start, p.start), min(stop, p.stop)
                    t[lo - start : hi - start].copy_(self._tensor(p, p.state[key], lo - p.start, hi - p.start))
                out[key] = t.view(piece_shape)
            else:
                if not (start == 0 and stop == numel and over[0].start == 0 and over[0].stop == numel):
                    raise unsplittable(key, self.label(j), shape)
                out[key] = self._tensor(over[0], spec)
        return out

    def has_state(self) -> bool:
        return bool(self.pieces)


