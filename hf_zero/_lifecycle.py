"""The optimizer state's lifecycle between steps and checkpoints.

[Note: state lifecycle]
:class:`StateLifecycle` owns every fact about the state that is not the state of the
current partition's pieces:

- *parked* holdings: state of params outside the layout (frozen: torch keeps a frozen
  param's moments too) and loaded state not yet placed into a partition;
- the *token*, a fresh object whenever the state values change (a step, a load), which
  unconsolidated handles and sharded references are checked against by identity;
- the consolidated copy (valid until the token changes);
- the sharded reference (``state_dict()`` stands for a sharded checkpoint that holds the
  current state) and a pending one (loaded, not yet resolved: stepping raises).

Every transition is a method here; the optimizer calls :meth:`stepped` after each step
and :meth:`adopt` after each load, and reads the rest.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Iterable

import torch

from . import _sharded
from ._codec import class_name, decode, encode
from ._comm import Comm
from ._layout import plan_layout
from ._ledger import state_bytes, tensors_in
from ._masters import HALF_DTYPES, MASTER_KEY, needs_master
from ._params import ParamTable
from ._partition import piece_shape
from ._state import Holding, Holdings, redistribute, shape_as, split_canonical
from ._statedict import (ShardedState, check_state_dict, full_layout, group_problems, hyperparams, match_checkpoint,
                         mismatch_error, trainable_layout)


class StateLifecycle:
    """Parked state, the state token, consolidation and sharded references (see [Note: state lifecycle])."""

    def __init__(self):
        self._parked: Holdings = {}
        self._token = object()
        self._has_state = False
        self._consolidated: dict | None = None
        self._sharded_ref: tuple[object, dict] | None = None  # (token, info): see [Note: sharded reference]
        self._pending_ref: dict | None = None

    # -- transitions ---------------------------------------------------------------------
    def stepped(self) -> None:
        """The state values changed in a step: consolidated copies and references are stale."""
        self._has_state = True
        self._consolidated = None
        self._token = object()

    def adopt(self, held: Holdings | None, *, has_state: bool = False) -> None:
        """A load: ``held`` (this rank's loaded state, parked until the next rebuild places
        it) replaces all state; None keeps the current state (its own sharded handle)."""
        self._pending_ref = None
        if held is None:
            return
        self._parked = held
        self._has_state = has_state
        self._consolidated = None
        self._token = object()

    def park(self, held: Holdings) -> None:
        """After a rebuild: the state of params outside the new layout."""
        self._parked = held

    def consolidated(self, state: dict | None) -> None:
        self._consolidated = state

    def refer(self, path: str | os.PathLike, info: dict) -> None:
        token = _sharded.token_at(path)
        if token is None:
            raise ValueError(f"hf_zero: {os.fspath(path)!r} holds no committed sharded optimizer checkpoint")
        self._sharded_ref = (self._token, {"path": os.path.abspath(path), "token": token, **info})

    def expect_reference(self, ref: dict) -> None:
        """``load_state_dict`` got a reference: pending, unless it stands for the state held now."""
        current = self._sharded_ref
        held_now = current is not None and current[0] is self._token and current[1]["token"] == ref["token"]
        self._pending_ref = None if held_now else ref

    def read_state_dict(self, opt, comm: Comm, table: ParamTable, state_dict: Any
                        ) -> tuple[list[dict], Holdings | None, bool]:
        """(hyperparameters, this rank's placed state or None to keep the current state,
        whether it holds state) of a loaded state dict; raises before anything changes
        when it does not fit ``opt`` (see ``ZeroBucketOptimizer.load_state_dict``). A state dict
        in the trainable layout, or of an optimizer over the trainable params only, is read in
        ``opt``'s own (see [Note: trainable layout])."""
        state_dict = full_layout(opt, state_dict)
        if isinstance(state_dict, dict) and isinstance(state_dict.get("state"), ShardedState):
            problems = group_problems(opt, [len(g["params"]) for g in state_dict.get("param_groups", [])])
            if problems:
                raise mismatch_error("the loaded state dict", problems)
            if state_dict["state"].token is not self._token:
                raise ValueError(
                    "hf_zero: this state dict holds unconsolidated sharded state of another optimizer, or of "
                    "this one before its state changed, and cannot be loaded: consolidate_state_dict() first"
                )
            return hyperparams(state_dict["param_groups"]), None, False
        by_index = check_state_dict(opt, state_dict)

        def read(i, start, stop, piece_shape):
            if i not in by_index:
                return None
            return split_canonical(by_index[i], table.params[i].shape, start, stop, piece_shape, table.label(i))

        held = place(comm, table, opt.shard, opt.param_groups, read, masters=opt.master_weights)
        warn_dropped_masters(comm, table, opt.master_weights, (i for i, st in by_index.items() if MASTER_KEY in st))
        return hyperparams(state_dict["param_groups"]), held, bool(by_index)

    # -- facts ---------------------------------------------------------------------------
    @property
    def parked(self) -> Holdings:
        return self._parked

    def parked_master_bytes(self) -> int:
        """Bytes of the fp32 masters among the parked holdings."""
        return sum(h.state[MASTER_KEY].nbytes for hs in self._parked.values() for h in hs if MASTER_KEY in h.state)

    def memory(self) -> dict[str, int]:
        """Bytes of the parked state and masters ([Note: memory ledger] in _ledger.py)."""
        parked = [h.state for hs in self._parked.values() for h in hs]
        return {"optimizer_state": state_bytes(parked, MASTER_KEY), "masters": self.parked_master_bytes()}

    def parked_tensors(self) -> list[torch.Tensor]:
        return [v for hs in self._parked.values() for h in hs for v in h.state.values() if isinstance(v, torch.Tensor)]

    def consolidated_tensors(self) -> list[torch.Tensor]:
        """The tensors of the consolidated copy held for ``state_dict()`` (none when there is none)."""
        return tensors_in(self._consolidated)

    @property
    def pending(self) -> dict | None:
        return self._pending_ref

    def check_pending(self) -> None:
        """Raise if a loaded reference was never resolved: its state would be lost silently."""
        ref = self._pending_ref
        if ref is not None:
            raise RuntimeError(
                f"hf_zero: load_state_dict() was given a reference to the sharded optimizer checkpoint saved in "
                f"{ref['path']!r} (token {ref['token']}), which was not loaded yet: call "
                "optimizer.load_sharded(DIR) on all ranks with that checkpoint's directory first "
                "(ZeroBucketCallback and prepare_accelerator do it when resuming)"
            )

    def state(self, world_size: int, consolidate: Callable[[], None]) -> Any:
        """What ``state_dict()["state"]`` is now: a reference, the consolidated state, or
        a :class:`ShardedState` handle (``consolidate`` is called on one rank, never a collective)."""
        ref = self._pending_ref
        if ref is None and self._sharded_ref is not None and self._consolidated is None:
            token, info = self._sharded_ref  # a reference stands only while its checkpoint is there
            ref = info if token is self._token and _sharded.token_at(info["path"]) == info["token"] else None
        if ref is not None:
            return _sharded.reference(ref)
        if world_size == 1:  # every time: the masters may have followed an edit of the params since
            consolidate()
        elif self._consolidated is None and self._has_state:
            return ShardedState(self._token, world_size)
        return dict(self._consolidated or {})


# -- moving state for checkpoints ------------------------------------------------------
def rank_stats(comm: Comm, rebuilds: int, owned: list, held: Holdings, live_master_bytes: int = 0) -> dict:
    """Per-rank owned elements (of the ``owned`` pieces), state bytes and fp32 master bytes
    (``live_master_bytes`` of the pieces plus parked masters), and ``rebuilds``. Collective."""
    tensors = [(k, v) for hs in held.values() for h in hs for k, v in h.state.items() if isinstance(v, torch.Tensor)]
    state_bytes = sum(v.numel() * v.element_size() for k, v in tensors if k != MASTER_KEY)
    per_rank = comm.all_gather_object((sum(pc.numel for pc in owned), state_bytes, live_master_bytes))
    return {
        "rebuilds": rebuilds,
        "elements_per_rank": [e for e, _, _ in per_rank],
        "state_bytes_per_rank": [b for _, b, _ in per_rank],
        "master_bytes_per_rank": [m for _, _, m in per_rank],
    }


def packed_groups(param_groups: list[dict], encode_values: bool) -> list[dict]:
    """The param groups as a state dict holds them: params numbered, values JSON-able if asked."""
    index, groups = 0, []
    for gi, g in enumerate(param_groups):
        packed = {
            k: encode(v, f"param group {gi} {k!r}") if encode_values else v
            for k, v in g.items()
            if k != "params"
        }
        packed["params"] = list(range(index, index + len(g["params"])))
        index += len(g["params"])
        groups.append(packed)
    return groups


def state_dict_of(opt, state: Any) -> dict:
    """``opt.state_dict()`` around ``state``: every param in its group, or only the trainable ones
    with ``state_dict_params="trainable"`` (see [Note: trainable layout] in _statedict.py)."""
    full = {"state": state, "param_groups": packed_groups(opt.param_groups, encode_values=False)}
    if opt.state_dict_params == "trainable":
        return trainable_layout(full, [p.requires_grad for p in opt.params])
    return full


def read_sharded(opt, comm: Comm, table: ParamTable, path) -> tuple[list[dict], Holdings, bool]:
    """(hyperparameters, this rank's placed state, whether it holds state) of the sharded
    checkpoint in ``path``, or the same error on every rank. Collective."""
    failure: BaseException | None = None
    try:
        with _sharded.Checkpoint(path) as ckpt:
            mapping = match_checkpoint(opt, ckpt)
            groups = [{k: decode(v) for k, v in g.items() if k != "params"} for g in ckpt.record["param_groups"]]
            held = place(comm, table, opt.shard, opt.param_groups,
                         lambda i, start, stop, shape: ckpt.read(mapping[i], start, stop, shape),
                         masters=opt.master_weights)
            has_state = ckpt.has_state()
            with_master = (i for i, j in mapping.items() if any(MASTER_KEY in p.state for p in ckpt.pieces.get(j, ())))
            warn_dropped_masters(comm, table, opt.master_weights, with_master)
    except Exception as e:  # every rank must reach the exchange below
        failure = e
    report = None if failure is None else f"rank {comm.rank}: {type(failure).__name__}: {failure}"
    reports = [r for r in comm.all_gather_object(report) if r]
    if failure is not None:
        raise failure
    if reports:
        raise RuntimeError("hf_zero: load_sharded failed on another rank, nothing was loaded:\n  " + "\n  ".join(reports))
    if comm.rank == 0:  # every rank has read: [Note: stale temporaries]
        _sharded.remove_stale_after_load(path)
    return groups, held, has_state

def consolidate(comm: Comm, table: ParamTable, held: Holdings, to: int, device) -> dict | None:
    """Gather every param's whole state on rank ``to`` (None elsewhere), on ``device``
    (None: each param's). Collective."""
    device = None if device is None else torch.device(device)
    numels = table.numels()
    got = redistribute(
        comm,
        held,
        lambda indices: {i: [(to, 0, numels[i])] for i in indices},
        numels=numels,
        device_of=lambda i: device or table.params[i].device,
        names=table.label,
        piece_shape=lambda i, start, stop: tuple(table.params[i].shape),
        reuse_own=True,  # see [Note: reused holdings]
    )
    if comm.rank != to:
        return None
    return {i: shape_as(hs[0], table.params[i].shape) for i, hs in sorted(got.items())}


def place(comm: Comm, table: ParamTable, shard: str, param_groups: list[dict],
          read: Callable[[int, int, int, tuple], dict | None], *, masters: bool = False) -> Holdings:
    """This rank's holdings after a load, ``read(i, start, stop, piece_shape)`` giving
    the state of each: its pieces of the layout the next step builds, plus the whole
    state of params outside the layout (frozen), parked on rank ``i % world size``.
    ``masters``: 16-bit params keep fp32 state and their ``"master_param"``."""
    rank, ws = comm.rank, comm.world_size
    layout = plan_layout(table.specs(), world_size=ws, shard=shard)
    targets = [(pc.index, pc.start, pc.stop, piece_shape(table, shard, pc.index, pc.start, pc.stop))
               for pc in layout.pieces(rank)]
    slotted = layout.slots()
    targets += [(i, 0, p.numel(), tuple(p.shape)) for i, p in enumerate(table.params)
                if i not in slotted and i % ws == rank]
    held: Holdings = {}
    for i, start, stop, shape in targets:
        st = read(i, start, stop, shape)
        if st is not None:
            group = param_groups[table.group_of[i]]
            st = _cast(st, table.params[i], group, master=needs_master(masters, table.params[i]))
            held.setdefault(i, []).append(Holding(start, stop, shape, st))
    return held


def warn_dropped_masters(comm: Comm, table: ParamTable, masters: bool, with_master: Iterable[int]) -> None:
    """Warn (on rank 0: every rank loads the same) when loaded fp32 masters are dropped
    because their params are no longer stepped through one, saying what else changes."""
    dropped = sorted(i for i in with_master if not needs_master(masters, table.params[i]))
    if not dropped or comm.rank != 0:
        return
    names = ", ".join(table.label(i) for i in dropped[:3])
    names += f" and {len(dropped) - 3} more" if len(dropped) > 3 else ""
    half = [i for i in dropped if table.params[i].dtype in HALF_DTYPES]
    why = "master_weights=False" if half else "they are not bf16/fp16 params now"
    cast = (f"; their fp32 optimizer state (e.g. Adam's moments) is cast to the params' "
            f"{str(table.params[half[0]].dtype).removeprefix('torch.')}, as a plain optimizer over them keeps it"
            if half else "")
    warnings.warn(
        f"hf_zero: the loaded optimizer state holds fp32 master weights ('master_param') of {len(dropped)} "
        f"param(s) this optimizer steps without one ({why}): {names}. The masters are dropped{cast}; the "
        "params keep their values. To keep the masters, load with master_weights='auto' (the default).",
        UserWarning, stacklevel=4,
    )


def _cast(state: dict, p: torch.Tensor, group: dict, *, master: bool = False) -> dict:
    """Copy loaded values to the param's device and dtype, as torch's load_state_dict does;
    ``master``: stepped through an fp32 master, so float32 (a master is dropped without one)."""
    out = {}
    dtype = torch.float32 if master else p.dtype
    for k, v in state.items():
        if k == MASTER_KEY and not master:
            continue
        if not isinstance(v, torch.Tensor):
            out[k] = v
        elif k == "step":
            if group.get("capturable") or group.get("fused"):
                out[k] = v.to(dtype=torch.float32, device=p.device, copy=True)
            else:
                out[k] = v.clone()
        elif p.is_floating_point():
            out[k] = v.to(dtype=dtype, device=p.device, copy=True)
        else:
            out[k] = v.to(device=p.device, copy=True)
    return out


def sharded_record(table: ParamTable, *, optimizer_class: str, shard: str, world_size: int,
                   bucket_view: bool, param_groups: list[dict], state_dict_params: str = "all") -> dict:
    """The commit record of a sharded checkpoint (see :mod:`hf_zero._sharded`)."""
    return {
        "optimizer_class": optimizer_class,
        "state_dict_params": state_dict_params,
        "shard": shard,
        "world_size": world_size,
        "parameters_as_bucket_view": bucket_view,
        "torch_version": torch.__version__,
        "params": [
            {
                "name": table.names[i],
                "shape": list(p.shape),
                "dtype": str(p.dtype).removeprefix("torch."),
                "group": table.group_of[i],
                "trainable": bool(p.requires_grad),
            }
            for i, p in enumerate(table.params)
        ],
        "param_groups": param_groups,
    }


def write_sharded(opt, comm: Comm, table: ParamTable, held: Holdings, path) -> None:
    """Write ``held`` (this rank's state) as ``opt``'s sharded checkpoint in ``path``. Collective."""
    record = sharded_record(
        table, optimizer_class=class_name(opt.optimizer_class), shard=opt.shard, world_size=comm.world_size,
        bucket_view=opt.parameters_as_bucket_view, param_groups=packed_groups(opt.param_groups, encode_values=True),
        state_dict_params=opt.state_dict_params,
    )
    _sharded.write(comm, path, held, table.checkpoint_labels(), record)


def find_pending(comm: Comm, ref: dict | None, candidates: list[str]) -> str | None:
    """The directory among ``candidates`` (then the path recorded at save time) holding
    the pending reference's checkpoint, agreed on every rank (None: nothing pending).
    Collective; raises on every rank when no rank-wide agreed one holds it."""
    if comm.world_size == 1 and ref is None:
        return None
    looked = list(dict.fromkeys([os.path.abspath(c) for c in candidates] + ([ref["path"]] if ref else [])))
    found = None if ref is None else next((c for c in looked if _sharded.token_at(c) == ref["token"]), None)
    everyone = comm.all_gather_object((ref is not None, found))
    if not any(pending for pending, _ in everyone):
        return None
    if any(f is None for _, f in everyone) or len({f for _, f in everyone}) > 1:
        per_rank = "; ".join(f"rank {r}: {f or 'none'}" for r, (_, f) in enumerate(everyone))
        raise RuntimeError(
            f"hf_zero: cannot find the sharded optimizer checkpoint the loaded state dict refers to "
            f"(token {ref['token'] if ref else '?'}, saved in {ref['path'] if ref else '?'!r}); looked in "
            f"{looked} (found: {per_rank}). Every rank must see that directory; load it with "
            "optimizer.load_sharded(DIR) on all ranks."
        )
    return found


def agreed_token(comm: Comm, path: str | os.PathLike) -> str | None:
    """The commit token of the sharded checkpoint in ``path`` (None: none), the same on
    every rank or an error on every rank. Collective."""
    tokens = comm.all_gather_object(_sharded.token_at(path))
    if len(set(tokens)) > 1:
        raise RuntimeError(
            f"hf_zero: ranks see different sharded optimizer checkpoints in {os.fspath(path)!r} (commit tokens "
            f"per rank: {tokens}); all ranks must see the same directory"
        )
    return tokens[0]
