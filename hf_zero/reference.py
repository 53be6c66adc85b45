"""References to sharded checkpoints: the small state dict that stands for one.

[Note: sharded reference]
Trainer and Accelerate save an optimizer by ``torch.save(optimizer.state_dict())``
on one process and load it with ``optimizer.load_state_dict(torch.load(...))`` on
every process. To keep the state sharded on disk, an integration writes
``optimizer.save_sharded(DIR)`` on all ranks and then calls :func:`refer` so that,
until the state changes, ``state_dict()`` returns a *reference* instead of the
state::

    {"state": {}, "param_groups": [], "hf_zero_sharded": {"path": ..., "token": ..., ...}}

(plain types: loads with ``torch.load(weights_only=True)``; a plain torch optimizer
refuses it, since it has no param groups, rather than loading nothing).
``load_state_dict(reference)`` cannot read the state without a collective, so it
records the reference as *pending*; until :func:`load_pending` (collective) loads
the checkpoint, every step, consolidation or sharded save raises. The ``token``
identifies one save (see [Note: sharded checkpoint]): a directory is used only if
its commit record carries that token, so a moved checkpoint can be found by its
new path and a newer save in the old path is never taken for it.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from . import checkpoint

if TYPE_CHECKING:
    from .optimizer import ZeroBucketOptimizer

KEY = "hf_zero_sharded"


def token_at(path: str | os.PathLike) -> str | None:
    """The token of the committed sharded checkpoint in ``path``, or None."""
    try:
        with open(os.path.join(path, checkpoint.COMMIT_FILE)) as f:
            return json.load(f).get("token")
    except (OSError, ValueError, AttributeError):
        return None


def refer(opt: "ZeroBucketOptimizer", path: str | os.PathLike, **info: Any) -> None:
    """Until its state changes, make ``opt.state_dict()`` a reference to the sharded
    checkpoint in ``path`` (which must hold ``opt``'s current state: just saved or
    loaded there). ``info``: extra JSON-able facts to record (e.g. ``step``). Not a
    collective."""
    token = token_at(path)
    if token is None:
        raise ValueError(f"hf_zero: {os.fspath(path)!r} holds no committed sharded optimizer checkpoint")
    opt._sharded_ref = (opt._state_version, {"path": os.path.abspath(path), "token": token, **info})


def is_reference(state_dict: Any) -> bool:
    return isinstance(state_dict, dict) and KEY in state_dict


def state_dict_for(opt: "ZeroBucketOptimizer") -> dict | None:
    """What ``state_dict()`` returns instead of the state, or None: the pending
    reference, else a valid one set by :func:`refer` (a fresh consolidation wins)."""
    ref = opt._pending_sharded
    if ref is None and opt._sharded_ref is not None and opt._consolidated is None:
        version, info = opt._sharded_ref
        ref = info if version == opt._state_version else None
    return None if ref is None else {"state": {}, "param_groups": [], KEY: dict(ref)}


def load(opt: "ZeroBucketOptimizer", state_dict: dict) -> None:
    """``opt.load_state_dict(reference)``: nothing to do if ``opt`` holds that state
    already, else record the reference as pending. Not a collective."""
    ref = state_dict[KEY]
    if not (isinstance(ref, dict) and isinstance(ref.get("token"), str) and isinstance(ref.get("path"), str)):
        raise ValueError(f"hf_zero: state_dict[{KEY!r}] must be a dict with 'path' and 'token', got {ref!r}")
    current = opt._sharded_ref
    if current is not None and current[0] == opt._state_version and current[1]["token"] == ref["token"]:
        opt._pending_sharded = None
        return
    opt._pending_sharded = dict(ref)


def check_pending(opt: "ZeroBucketOptimizer") -> None:
    """Raise if a loaded reference was never resolved: its state would be lost silently."""
    ref = opt._pending_sharded
    if ref is not None:
        raise RuntimeError(
            f"hf_zero: load_state_dict() was given a reference to the sharded optimizer checkpoint saved in "
            f"{ref['path']!r} (token {ref['token']}), which was not loaded yet: call "
            "optimizer.load_sharded(DIR) on all ranks with that checkpoint's directory first "
            "(ZeroBucketCallback and prepare_accelerator do it when resuming)"
        )


def load_pending(opt: "ZeroBucketOptimizer", candidates: list[str]) -> str | None:
    """Load a pending reference from the first of ``candidates`` (directories), then of
    the path recorded at save time, that holds it; return that directory (None when
    nothing is pending). Collective; raises, on every rank, naming the directories
    looked in when no rank-wide agreed one holds it."""
    ref = opt._pending_sharded
    if opt._comm.world_size == 1 and ref is None:
        return None
    looked = list(dict.fromkeys([os.path.abspath(c) for c in candidates] + ([ref["path"]] if ref else [])))
    found = None if ref is None else next((c for c in looked if token_at(c) == ref["token"]), None)
    everyone = opt._comm.all_gather_object((ref is not None, found))
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
    checkpoint.load_sharded(opt, found)
    return found
