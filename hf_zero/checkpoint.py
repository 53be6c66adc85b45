"""Optimizer checkpoints: loading state dicts, sharded save/load, offline consolidation.

[Note: unconsolidated state]
On several ranks no rank holds the whole state, and ``state_dict()`` must never be
a collective. Without a fresh :meth:`consolidate_state_dict` it returns
``{"state": ShardedState, "param_groups": [...]}``: the handle refuses, with an
error naming the fix, to be read, iterated, pickled or ``torch.save``-d, so the
state cannot be saved or inspected by mistake; only ``load_state_dict`` of the same
optimizer accepts it, meaning "keep the state you hold". That is exactly what
Accelerate's ``AcceleratedOptimizer.__init__`` does (``state_dict()`` then
``load_state_dict()`` on every rank), so wrapping works at any point of training.

[Note: sharded checkpoint]
A sharded checkpoint is a directory holding

- ``hf_zero_optimizer.json``: the commit record (JSON): optimizer class, shard
  mode, world size, every param's name, shape, dtype, group and trainability, the
  param groups' hyperparameters and, per file, its size and the state pieces in it;
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
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from .layout import plan_layout
from .state import Holding, Holdings, dtype_from_name, split_canonical

if TYPE_CHECKING:
    from .optimizer import ZeroBucketOptimizer

COMMIT_FILE = "hf_zero_optimizer.json"
_FORMAT = "hf_zero.sharded_optimizer"
_VERSION = 1
_SHARD_RE = re.compile(r"^shard-([0-9a-f]+)-rank\d+-of-\d+\.safetensors$")
# Hyperparameters LR schedulers add to param groups: not a sign of another optimizer class.
_SCHEDULER_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "base_lr"})
_MAX_LISTED = 20


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is a directory holding a committed sharded optimizer checkpoint."""
    return os.path.isfile(os.path.join(path, COMMIT_FILE))


# -- the unconsolidated-state handle -------------------------------------------------
class ShardedState:
    """What ``state_dict()["state"]`` is on a multi-rank run without fresh consolidation.

    Any attempt to read, iterate, copy, pickle or save it raises an error saying how
    to get the full state; ``load_state_dict`` of the optimizer that returned it,
    before its state changed, keeps the state each rank holds (see [Note:
    unconsolidated state]).
    """

    __slots__ = ("_owner", "_version", "_message", "__weakref__")

    def __init__(self, owner: "ZeroBucketOptimizer", version: int, world_size: int):
        self._owner = weakref.ref(owner)
        self._version = version
        self._message = (
            f"hf_zero: the optimizer state is sharded over {world_size} ranks and was not "
            "consolidated since it last changed: call optimizer.consolidate_state_dict(to=RANK) "
            "on all ranks, then optimizer.state_dict() on RANK (or optimizer.save_sharded(DIR) "
            "on all ranks)"
        )

    def _refuse(self, *args, **kwargs):
        raise RuntimeError(self._message)

    __getitem__ = __iter__ = __len__ = __contains__ = _refuse
    keys = values = items = get = copy = _refuse
    __reduce_ex__ = __reduce__ = __copy__ = __deepcopy__ = _refuse

    def __repr__(self) -> str:
        return f"<ShardedState: {self._message}>"

    def owned_by(self, optimizer) -> bool:
        return self._owner() is optimizer and self._version == optimizer._state_version


# -- matching a checkpoint to an optimizer ---------------------------------------------
def _listed(problems: list[str]) -> str:
    shown = problems[:_MAX_LISTED]
    more = len(problems) - len(shown)
    return "\n  - " + "\n  - ".join(shown) + (f"\n  ... and {more} more" if more > 0 else "")


def _mismatch_error(what: str, problems: list[str]) -> ValueError:
    return ValueError(
        f"hf_zero: {what} does not match this optimizer (nothing was loaded):{_listed(problems)}"
    )


def param_names(opt: "ZeroBucketOptimizer") -> list[str | None]:
    """Each param's name: set by ``_set_param_names``, else from the groups' ``param_names``."""
    return opt._param_names


def _hyper_problems(opt, saved_groups: list[dict]) -> list[str]:
    """Param groups whose hyperparameters look like another optimizer class's."""
    problems = []
    known = set(opt.defaults)
    for gi, g in enumerate(saved_groups):
        saved = {k for k in g if k not in ("params", "param_names")}
        mine = {k for k in opt.param_groups[gi] if k not in ("params", "param_names")} if gi < len(opt.param_groups) else set()
        extra = saved - known - mine - _SCHEDULER_KEYS
        missing = known - saved
        if extra and missing:
            problems.append(
                f"param group {gi}: hyperparameters {sorted(extra)} are unknown to "
                f"{opt.optimizer_class.__name__}, which needs {sorted(missing)}: the state was saved by "
                "another optimizer class"
            )
    return problems


def _group_problems(opt, saved_sizes: list[int]) -> list[str]:
    mine = [len(g["params"]) for g in opt.param_groups]
    if len(saved_sizes) != len(mine):
        return [f"{len(saved_sizes)} param groups saved, this optimizer has {len(mine)}"]
    return [
        f"param group {gi}: {s} params saved, this optimizer has {m}"
        for gi, (s, m) in enumerate(zip(saved_sizes, mine))
        if s != m
    ]


# -- loading ------------------------------------------------------------------------
def _targets(opt) -> list[tuple[int, int, int, tuple[int, ...]]]:
    """``(index, start, stop, piece shape)`` this rank holds after a load.

    Its pieces of the layout the next step builds, plus the whole state of params
    outside the layout (frozen), parked on rank ``index % world size``.
    """
    rank, ws = opt._comm.rank, opt._comm.world_size
    layout = plan_layout(opt._specs(), world_size=ws, shard=opt.shard)
    out = []
    for pc in layout.pieces(rank):
        out.append((pc.index, pc.start, pc.stop, opt._piece_shape(pc.index, pc.start, pc.stop)))
    slotted = layout.slots()
    for i, p in enumerate(opt._params):
        if i not in slotted and i % ws == rank:
            out.append((i, 0, p.numel(), tuple(p.shape)))
    return out


def _place(opt, read: Callable[[int, int, int, tuple], dict | None]) -> Holdings:
    held: Holdings = {}
    for i, start, stop, shape in _targets(opt):
        st = read(i, start, stop, shape)
        if st is not None:
            held.setdefault(i, []).append(Holding(start, stop, shape, opt._cast(st, i)))  # flat: maybe several
    return held


def _hyperparams(groups: list[dict]) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def load_state_dict(opt: "ZeroBucketOptimizer", state_dict: dict) -> None:
    """``opt.load_state_dict``: validate everything, then keep this rank's pieces."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("state_dict must be a dict with 'state' and 'param_groups' (an optimizer state dict)")
    groups = state_dict["param_groups"]
    problems = _group_problems(opt, [len(g["params"]) for g in groups])
    if problems:
        raise _mismatch_error("the loaded state dict", problems)
    state = state_dict["state"]
    if isinstance(state, ShardedState):
        if not state.owned_by(opt):
            raise ValueError(
                "hf_zero: this state dict holds unconsolidated sharded state of another optimizer, or of "
                "this one before its state changed, and cannot be loaded: consolidate_state_dict() first"
            )
        opt._adopt_loaded(_hyperparams(groups), None)
        return

    problems += _hyper_problems(opt, groups)
    names = param_names(opt)
    for gi, (g, mine) in enumerate(zip(groups, opt.param_groups)):
        saved_names = g.get("param_names")
        if saved_names is None:
            continue
        ours = names[sum(len(x["params"]) for x in opt.param_groups[:gi]) :][: len(mine["params"])]
        for k, (s, m) in enumerate(zip(saved_names, ours)):
            if m is not None and s != m:
                problems.append(f"param group {gi}, position {k}: saved param {s!r}, this optimizer has {m!r}")
    ids = [i for g in groups for i in g["params"]]
    position = {saved: i for i, saved in enumerate(ids)}
    by_index: dict[int, dict] = {}
    for saved, value in state.items():
        if saved not in position:
            problems.append(f"state for param id {saved!r}, which no param group lists")
            continue
        by_index[position[saved]] = value
    strict = opt.shard == "flat" or _is_elementwise(opt.optimizer_class)
    for i, value in sorted(by_index.items()):
        shape = tuple(opt._params[i].shape)
        for k, v in value.items():
            if strict and isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != shape:
                problems.append(
                    f"state {k!r} of param {opt._name(i)} has shape {tuple(v.shape)}, not the param's {shape}"
                    + (" (shard='flat' cannot split it: use shard='param')" if opt.shard == "flat" else "")
                )
    if problems:
        raise _mismatch_error("the loaded state dict", problems)

    def read(i, start, stop, piece_shape):
        if i not in by_index:
            return None
        return split_canonical(by_index[i], opt._params[i].shape, start, stop, piece_shape)

    held = _place(opt, read)
    opt._adopt_loaded(_hyperparams(groups), held, has_state=bool(by_index))


def _is_elementwise(cls) -> bool:
    from .optimizer import is_elementwise

    return is_elementwise(cls)


# -- JSON values ------------------------------------------------------------------------
def _encode(v: Any, where: str) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, tuple):
        return {"__tuple__": [_encode(x, where) for x in v]}
    if isinstance(v, list):
        return [_encode(x, where) for x in v]
    if isinstance(v, dict):
        return {"__dict__": [[_encode(k, where), _encode(x, where)] for k, x in v.items()]}
    if isinstance(v, torch.Tensor):
        return {"__tensor__": v.detach().cpu().tolist(), "dtype": str(v.dtype).removeprefix("torch.")}
    if isinstance(v, torch.dtype):
        return {"__dtype__": str(v).removeprefix("torch.")}
    raise ValueError(f"hf_zero: {where} = {v!r} ({type(v).__name__}) cannot be stored in a checkpoint")


def _decode(v: Any) -> Any:
    if isinstance(v, list):
        return [_decode(x) for x in v]
    if isinstance(v, dict):
        if "__tuple__" in v:
            return tuple(_decode(x) for x in v["__tuple__"])
        if "__dict__" in v:
            return {_decode(k): _decode(x) for k, x in v["__dict__"]}
        if "__tensor__" in v:
            return torch.tensor(v["__tensor__"], dtype=dtype_from_name(v["dtype"]))
        if "__dtype__" in v:
            return dtype_from_name(v["__dtype__"])
    return v


# -- files --------------------------------------------------------------------------
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
                    entry["state"][key] = {"value": _encode(v, f"state {key!r} of param {labels[i]}")}
            entries.append(entry)
    return tensors, entries


def save_sharded(opt: "ZeroBucketOptimizer", path: str | os.PathLike) -> None:
    """``opt.save_sharded``: each rank writes its own state; rank 0 commits. Collective."""
    from safetensors.torch import save_file

    comm = opt._comm
    path = os.fspath(path)
    rank, ws = comm.rank, comm.world_size
    token = comm.all_gather_object(secrets.token_hex(8) if rank == 0 else None)[0]
    names = param_names(opt)
    unique = len(set(names)) == len(names)
    labels = [n if n is not None and unique else f"#{i}" if n is None else f"{n}#{i}" for i, n in enumerate(names)]
    fname = f"shard-{token}-rank{rank:05d}-of-{ws:05d}.safetensors"
    meta, err = None, None
    try:
        os.makedirs(path, exist_ok=True)
        groups = []
        index = 0
        for gi, g in enumerate(opt.param_groups):
            enc = {k: _encode(v, f"param group {gi} {k!r}") for k, v in g.items() if k != "params"}
            enc["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(enc)
        tensors, entries = _pack(opt._holdings(), labels)
        target = os.path.join(path, fname)
        write_atomic(target, lambda tmp: save_file(tensors, tmp, metadata={"format": _FORMAT}))
        meta = {"rank": rank, "file": fname, "bytes": os.path.getsize(target), "holdings": entries}
    except Exception as e:  # every rank must reach the exchange below
        err = f"rank {rank}: {type(e).__name__}: {e}"
    metas = comm.all_gather_object((err, meta))
    errors = [e for e, _ in metas if e]
    if errors:
        raise RuntimeError("hf_zero: save_sharded failed, nothing was committed:\n  " + "\n  ".join(errors))
    err = None
    if rank == 0:
        try:
            record = {
                "format": _FORMAT,
                "version": _VERSION,
                "token": token,
                "optimizer_class": class_name(opt.optimizer_class),
                "shard": opt.shard,
                "world_size": ws,
                "parameters_as_bucket_view": opt.parameters_as_bucket_view,
                "torch_version": torch.__version__,
                "params": [
                    {
                        "name": names[i],
                        "shape": list(p.shape),
                        "dtype": str(p.dtype).removeprefix("torch."),
                        "group": opt._group_of[i],
                        "trainable": bool(p.requires_grad),
                    }
                    for i, p in enumerate(opt._params)
                ],
                "param_groups": groups,
                "files": [m for _, m in metas],
            }
            text = json.dumps(record, indent=1)
            write_atomic(os.path.join(path, COMMIT_FILE), lambda tmp: _write_text(tmp, text))
            _remove_stale(path, token)
        except Exception as e:
            err = f"rank 0: {type(e).__name__}: {e}"
    errors = [e for e in comm.all_gather_object(err) if e]
    if errors:
        raise RuntimeError("hf_zero: save_sharded could not commit the checkpoint:\n  " + "\n  ".join(errors))


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _remove_stale(path: str, token: str) -> None:
    for entry in os.listdir(path):
        m = _SHARD_RE.match(entry)
        ours_tmp = entry.startswith((".shard-", f".{COMMIT_FILE}.tmp-")) and ".tmp-" in entry
        if (m and m.group(1) != token) or ours_tmp:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(path, entry))


@dataclass
class _Piece:
    file: str
    start: int
    stop: int
    shape: tuple[int, ...]
    state: dict


class _Checkpoint:
    """A committed sharded checkpoint, read lazily: only the ranges asked for."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        record_path = os.path.join(self.path, COMMIT_FILE)
        if not os.path.isfile(record_path):
            raise ValueError(
                f"hf_zero: {self.path!r} holds no sharded optimizer checkpoint (no {COMMIT_FILE}); "
                "was the save interrupted before its commit?"
            )
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
        for f in record["files"]:
            full = os.path.join(self.path, f["file"])
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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def label(self, j: int) -> str:
        name = self.params[j]["name"]
        return f"{name if name is not None else f'#{j}'} (shape {tuple(self.params[j]['shape'])})"

    def _open(self, file: str):
        if file not in self._files:
            from safetensors import safe_open

            self._files[file] = self._stack.enter_context(
                safe_open(os.path.join(self.path, file), framework="pt", device="cpu")
            )
        return self._files[file]

    def _tensor(self, piece: _Piece, spec: dict, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        f = self._open(piece.file)
        if lo is None:
            return f.get_tensor(spec["tensor"])
        if len(spec["shape"]) == 1:
            return f.get_slice(spec["tensor"])[lo:hi]
        return f.get_tensor(spec["tensor"]).reshape(-1)[lo:hi]

    def read(self, j: int, start: int, stop: int, piece_shape: tuple[int, ...]) -> dict | None:
        """State of elements ``start:stop`` of saved param ``j``, stepped as ``piece_shape``; None if it has none."""
        pieces = self.pieces.get(j)
        if not pieces:
            return None
        numel = math.prod(self.params[j]["shape"])
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
        out: dict[str, Any] = {}
        for key, spec in over[0].state.items():
            if "value" in spec:
                out[key] = _decode(spec["value"])
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
                    raise ValueError(
                        f"hf_zero: state {key!r} of param {self.label(j)} has shape {shape}, not the param's: "
                        "it cannot be split across ranks (load with shard='param')"
                    )
                out[key] = self._tensor(over[0], spec)
        return out

    def has_state(self) -> bool:
        return bool(self.pieces)


def _match(opt, ckpt: _Checkpoint) -> tuple[dict[int, int], list[str]]:
    """Saved index of each of ``opt``'s params, and every mismatch found."""
    rec = ckpt.record
    problems = []
    mine_cls = class_name(opt.optimizer_class)
    if rec["optimizer_class"] != mine_cls:
        problems.append(f"optimizer class: the checkpoint has {rec['optimizer_class']}, this optimizer {mine_cls}")
    problems += _group_problems(opt, [len(g["params"]) for g in rec["param_groups"]])
    names = param_names(opt)
    saved_names = [p["name"] for p in ckpt.params]
    by_name = (
        None not in names
        and None not in saved_names
        and len(set(names)) == len(names)
        and len(set(saved_names)) == len(saved_names)
    )
    mapping: dict[int, int] = {}
    if by_name:
        where = {n: j for j, n in enumerate(saved_names)}
        for i, n in enumerate(names):
            if n in where:
                mapping[i] = where[n]
            else:
                problems.append(f"param {opt._name(i)} is not in the checkpoint")
        missing = set(saved_names) - set(names)
        problems += [f"checkpoint param {ckpt.label(where[n])} is not in this optimizer" for n in sorted(missing)]
    else:
        if len(ckpt.params) != len(opt._params):
            problems.append(f"the checkpoint has {len(ckpt.params)} params, this optimizer {len(opt._params)}")
        mapping = {i: i for i in range(min(len(ckpt.params), len(opt._params)))}
    for i, j in sorted(mapping.items()):
        saved = ckpt.params[j]
        p = opt._params[i]
        if tuple(saved["shape"]) != tuple(p.shape):
            problems.append(f"param {opt._name(i)}: shape {tuple(saved['shape'])} in the checkpoint")
        elif saved["group"] != opt._group_of[i]:
            problems.append(f"param {opt._name(i)}: in param group {saved['group']} in the checkpoint")
    return mapping, problems


def load_sharded(opt: "ZeroBucketOptimizer", path: str | os.PathLike) -> None:
    """``opt.load_sharded``: each rank reads the ranges it will own. Collective."""
    comm = opt._comm
    failure: BaseException | None = None
    try:
        with _Checkpoint(path) as ckpt:
            mapping, problems = _match(opt, ckpt)
            if problems:
                raise _mismatch_error(f"the checkpoint at {os.fspath(path)!r}", problems)
            groups = [{k: _decode(v) for k, v in g.items() if k != "params"} for g in ckpt.record["param_groups"]]
            held = _place(opt, lambda i, start, stop, shape: ckpt.read(mapping[i], start, stop, shape))
            has_state = ckpt.has_state()
    except Exception as e:  # every rank must reach the exchange below
        failure = e
    report = None if failure is None else f"rank {comm.rank}: {type(failure).__name__}: {failure}"
    reports = [r for r in comm.all_gather_object(report) if r]
    if failure is not None:
        raise failure
    if reports:
        raise RuntimeError("hf_zero: load_sharded failed on another rank, nothing was loaded:\n  " + "\n  ".join(reports))
    opt._adopt_loaded(groups, held, has_state=has_state)


# -- offline ----------------------------------------------------------------------
def consolidate_checkpoint(path: str | os.PathLike) -> dict:
    """The plain PyTorch optimizer state dict of a sharded checkpoint, on CPU.

    No process group needed. Loads into ``optimizer_class`` over the same params
    (or into a :class:`ZeroBucketOptimizer` on any world size).
    """
    with _Checkpoint(path) as ckpt:
        state = {}
        for j, p in enumerate(ckpt.params):
            st = ckpt.read(j, 0, math.prod(p["shape"]), tuple(p["shape"]))
            if st is not None:
                state[j] = st
        groups = []
        for g in ckpt.record["param_groups"]:
            dec = {k: _decode(v) for k, v in g.items() if k != "params"}
            dec["params"] = list(g["params"])
            groups.append(dec)
    return {"state": state, "param_groups": groups}


def save_state_dict(state_dict: dict, path: str | os.PathLike) -> None:
    """``torch.save`` atomically (a plain state dict: loads with ``weights_only=True``)."""
    write_atomic(os.fspath(path), lambda tmp: torch.save(state_dict, tmp))


def inspect_checkpoint(path: str | os.PathLike) -> str:
    """A human-readable summary of a sharded checkpoint."""
    with _Checkpoint(path) as ckpt:
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
            hyper = ", ".join(f"{k}={_decode(v)!r}" for k, v in g.items() if k not in ("params", "param_names"))
            lines.append(f"param group {gi}   {len(g['params'])} params: {hyper}")
        keys: dict[str, set] = {}
        for j in with_state:
            for piece in ckpt.pieces[j]:
                for key, spec in piece.state.items():
                    if "value" in spec:
                        keys.setdefault(key, set()).add(type(_decode(spec["value"])).__name__)
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
