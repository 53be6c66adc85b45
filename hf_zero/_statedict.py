"""PyTorch-format optimizer state dicts: the unconsolidated-state handle and the checks
a loaded dict or checkpoint must pass before anything changes.

[Note: unconsolidated state]
On several ranks no rank holds the whole state, and ``state_dict()`` must never be
a collective. Without a fresh ``consolidate_state_dict`` it returns
``{"state": ShardedState, "param_groups": [...]}``: the handle refuses, with an
error naming the fix, to be read, iterated, pickled or ``torch.save``-d, so the
state cannot be saved or inspected by mistake; only ``load_state_dict`` of the same
optimizer, before its state changed, accepts it, meaning "keep the state you hold".
That is exactly what Accelerate's ``AcceleratedOptimizer.__init__`` does
(``state_dict()`` then ``load_state_dict()`` on every rank), so wrapping works at
any point of training.

The checks read the optimizer only through its public protocol (``params``,
``param_names``, ``param_label``, ``group_of``, ``param_groups``, ``defaults``,
``optimizer_class``, ``shard``); see docs/architecture.md.
"""

from __future__ import annotations

from typing import Any

from ._codec import class_name
from ._layout import is_elementwise
from ._state import Kind, kind_of

# Hyperparameters LR schedulers add to param groups: not a sign of another optimizer class.
_SCHEDULER_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "base_lr"})
_NOT_HYPER = ("params", "param_names")
_MAX_LISTED = 20


class ShardedState:
    """What ``state_dict()["state"]`` is on a multi-rank run without fresh consolidation.

    Any attempt to read, iterate, copy, pickle or save it raises an error saying how
    to get the full state (see [Note: unconsolidated state]). ``token`` identifies
    the optimizer state it stands for.
    """

    __slots__ = ("token", "_message")

    def __init__(self, token: object, world_size: int):
        self.token = token
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


# [Note: trainable layout]
# Trainer's own optimizers (adamw_torch, adamw_torch_fused, ...) are built over the params that
# require grad when they are made, in two groups (decay, no decay) kept even when empty, while
# the zero_bucket factory holds every param (a param frozen at build must still train once
# unfrozen). So an optimizer built with ``state_dict_params="trainable"`` writes its
# PyTorch-format state dicts in the layout of an optimizer over its trainable params: each group
# lists only the params that require grad (numbered 0..T-1 in order; empty groups stay), and the
# frozen params' state rides along under FROZEN_KEY, which torch's ``load_state_dict`` ignores:
#     {"param_groups": [{"params": every param's id, frozen ones T..N-1, "param_names": ...}],
#      "state": {frozen id: state}}
# hf_zero's own load puts the two back together, so its resume stays exact (a frozen param's
# moments included). A state dict without FROZEN_KEY whose groups hold exactly the params that
# require grad now (what Trainer's adamw_torch writes) is read the same way: each saved param is
# the next param of its group that requires grad; the frozen ones get no state.
FROZEN_KEY = "hf_zero_frozen"
STATE_DICT_PARAMS = ("all", "trainable")


def trainable_layout(state_dict: dict, trainable: list[bool]) -> dict:
    """``state_dict`` (every param listed, ``trainable[k]``: whether the ``k``-th in group order
    requires grad) in the trainable layout (see [Note: trainable layout]); itself when every
    param is trainable."""
    groups = state_dict["param_groups"]
    order = [j for g in groups for j in g["params"]]
    if all(trainable):
        return state_dict
    flags = dict(zip(order, trainable))
    numbered = [j for j in order if flags[j]] + [j for j in order if not flags[j]]
    new_id = {j: n for n, j in enumerate(numbered)}
    exposed, full = [], []
    for g in groups:
        keep = [k for k, j in enumerate(g["params"]) if flags[j]]
        out = {}
        for key, value in g.items():
            out[key] = ([new_id[g["params"][k]] for k in keep] if key == "params"
                        else [value[k] for k in keep] if key == "param_names" else value)
        exposed.append(out)
        whole = {"params": [new_id[j] for j in g["params"]]}
        if "param_names" in g:
            whole["param_names"] = list(g["param_names"])
        full.append(whole)
    state = state_dict["state"]
    frozen: dict = {}
    if not isinstance(state, ShardedState):
        frozen = {new_id[j]: state[j] for j in order if not flags[j] and j in state}
        state = {new_id[j]: state[j] for j in order if flags[j] and j in state}
    return {"state": state, "param_groups": exposed, FROZEN_KEY: {"param_groups": full, "state": frozen}}


def every_param(state_dict: dict) -> dict:
    """A state dict in the trainable layout with every param listed again and numbered in group order,
    as ``state_dict_params="all"`` has it, the frozen params' state back in ``"state"`` (see [Note:
    trainable layout]); any other as it is."""
    extra = state_dict.get(FROZEN_KEY)
    if extra is None:
        return state_dict
    groups = state_dict["param_groups"]
    if not (isinstance(extra, dict) and isinstance(extra.get("param_groups"), list)
            and len(extra["param_groups"]) == len(groups) and isinstance(extra.get("state"), dict)):
        raise ValueError(f"state_dict[{FROZEN_KEY!r}] must hold 'param_groups' (one per param group) and "
                         "'state', as hf_zero writes it: the state dict was changed")
    position = {j: n for n, j in enumerate(j for whole in extra["param_groups"] for j in whole["params"])}
    merged = [{**{k: v for k, v in g.items() if k not in _NOT_HYPER},
               **whole, "params": [position[j] for j in whole["params"]]}
              for g, whole in zip(groups, extra["param_groups"])]
    state = state_dict["state"]
    if not isinstance(state, ShardedState):
        both = {**state, **extra["state"]}
        state = {position[j]: both[j] for j in position if j in both}
    return {"state": state, "param_groups": merged}


def full_layout(opt, state_dict: Any) -> Any:
    """A loaded state dict in ``opt``'s own layout (every param of its groups listed): one in the
    trainable layout put back together, one of an optimizer over ``opt``'s trainable params mapped
    onto them (see [Note: trainable layout]); anything else as it is."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list):
        return state_dict
    groups = state_dict["param_groups"]
    if FROZEN_KEY in state_dict:
        return every_param(state_dict)
    mine = [len(g["params"]) for g in opt.param_groups]
    trainable = _trainable_by_group(opt)
    saved = [len(g["params"]) if isinstance(g, dict) and "params" in g else -1 for g in groups]
    if saved == mine or saved != [len(t) for t in trainable]:
        return state_dict
    out = []
    for g, wanted, first, n in zip(groups, trainable, _firsts(mine), mine):
        ids = {i: j for i, j in zip(wanted, g["params"])}
        names = dict(zip(wanted, g.get("param_names") or ()))
        mapped = {k: v for k, v in g.items() if k not in _NOT_HYPER}
        mapped["params"] = [ids.get(i, ("frozen", i)) for i in range(first, first + n)]  # never a saved id
        if "param_names" in g:
            mapped["param_names"] = [names.get(i, opt.param_names[i]) for i in range(first, first + n)]
        out.append(mapped)
    return {"state": state_dict["state"], "param_groups": out}


def _firsts(sizes: list[int]) -> list[int]:
    return [sum(sizes[:k]) for k in range(len(sizes))]


def _trainable_by_group(opt) -> list[list[int]]:
    """Per param group, the indices of its params that require grad."""
    sizes = [len(g["params"]) for g in opt.param_groups]
    return [[i for i in range(first, first + n) if opt.params[i].requires_grad] for first, n in zip(_firsts(sizes), sizes)]


def mismatch_error(what: str, problems: list[str]) -> ValueError:
    shown = problems[:_MAX_LISTED]
    more = len(problems) - len(shown)
    listed = "\n  - " + "\n  - ".join(shown) + (f"\n  ... and {more} more" if more > 0 else "")
    return ValueError(f"hf_zero: {what} does not match this optimizer (nothing was loaded):{listed}")


def hyperparams(groups: list[dict]) -> list[dict]:
    """The groups' entries other than ``params``."""
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def group_problems(opt, saved_sizes: list[int]) -> list[str]:
    mine = [len(g["params"]) for g in opt.param_groups]
    trainable = [len(t) for t in _trainable_by_group(opt)]
    why = ""
    if trainable != mine:
        why = (f" (the param groups hold {mine} params, {trainable} of them trainable now: a state dict loads when "
               "its groups hold all of them, or exactly the trainable ones, as an optimizer over only the trainable "
               "params such as Trainer's adamw_torch writes it; was it saved with another set of trainable or "
               "frozen params?)")
    if len(saved_sizes) != len(mine):
        return [f"{len(saved_sizes)} param groups saved, this optimizer has {len(mine)}{why}"]
    return [
        f"param group {gi}: {s} params saved, this optimizer has {m}{why}"
        for gi, (s, m) in enumerate(zip(saved_sizes, mine))
        if s != m
    ]


def _hyper_problems(opt, saved_groups: list[dict]) -> list[str]:
    """Param groups whose hyperparameters look like another optimizer class's."""
    problems = []
    known = set(opt.defaults)
    for gi, g in enumerate(saved_groups):
        saved = {k for k in g if k not in _NOT_HYPER}
        mine = {k for k in opt.param_groups[gi] if k not in _NOT_HYPER} if gi < len(opt.param_groups) else set()
        extra = saved - known - mine - _SCHEDULER_KEYS
        missing = known - saved
        if extra and missing:
            problems.append(
                f"param group {gi}: hyperparameters {sorted(extra)} are unknown to "
                f"{opt.optimizer_class.__name__}, which needs {sorted(missing)}: the state was saved by "
                "another optimizer class"
            )
    return problems


def check_state_dict(opt, state_dict: Any) -> dict[int, dict]:
    """Validate a full PyTorch-format state dict against ``opt``; return each param
    index's whole-param state. Raises ``ValueError`` listing every mismatch."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("state_dict must be a dict with 'state' and 'param_groups' (an optimizer state dict)")
    groups = state_dict["param_groups"]
    problems = group_problems(opt, [len(g["params"]) for g in groups])
    if problems:
        raise mismatch_error("the loaded state dict", problems)
    problems += _hyper_problems(opt, groups)
    names = opt.param_names
    first = 0
    for gi, (g, mine) in enumerate(zip(groups, opt.param_groups)):
        saved_names = g.get("param_names")
        ours = names[first : first + len(mine["params"])]
        first += len(mine["params"])
        for k, (s, m) in enumerate(zip(saved_names or (), ours)):
            if m is not None and s != m:
                problems.append(f"param group {gi}, position {k}: saved param {s!r}, this optimizer has {m!r}")
    ids = [i for g in groups for i in g["params"]]
    position = {saved: i for i, saved in enumerate(ids)}
    by_index: dict[int, dict] = {}
    for saved, value in state_dict["state"].items():
        if saved not in position:
            problems.append(f"state for param id {saved!r}, which no param group lists")
            continue
        by_index[position[saved]] = value
    strict = opt.shard == "flat" or is_elementwise(opt.optimizer_class)
    for i, value in sorted(by_index.items()):
        shape = tuple(opt.params[i].shape)
        for k, v in value.items():
            if strict and kind_of(v, shape) is Kind.BLOB:
                problems.append(
                    f"state {k!r} of param {opt.param_label(i)} has shape {tuple(v.shape)}, not the param's {shape}"
                    + (" (shard='flat' cannot split it: use shard='param')" if opt.shard == "flat" else "")
                )
    if problems:
        raise mismatch_error("the loaded state dict", problems)
    return by_index


def match_checkpoint(opt, ckpt) -> dict[int, int]:
    """The saved index of each of ``opt``'s params in sharded checkpoint ``ckpt``
    (a :class:`hf_zero._sharded.Checkpoint`). Raises ``ValueError`` listing every mismatch."""
    rec = ckpt.record
    problems = []
    mine_cls = class_name(opt.optimizer_class)
    if rec["optimizer_class"] != mine_cls:
        problems.append(f"optimizer class: the checkpoint has {rec['optimizer_class']}, this optimizer {mine_cls}")
    problems += group_problems(opt, [len(g["params"]) for g in rec["param_groups"]])
    names = list(opt.param_names)
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
                problems.append(f"param {opt.param_label(i)} is not in the checkpoint")
        missing = set(saved_names) - set(names)
        problems += [f"checkpoint param {ckpt.label(where[n])} is not in this optimizer" for n in sorted(missing)]
    else:
        if len(ckpt.params) != len(opt.params):
            problems.append(f"the checkpoint has {len(ckpt.params)} params, this optimizer {len(opt.params)}")
        mapping = {i: i for i in range(min(len(ckpt.params), len(opt.params)))}
    for i, j in sorted(mapping.items()):
        saved = ckpt.params[j]
        p = opt.params[i]
        if tuple(saved["shape"]) != tuple(p.shape):
            problems.append(f"param {opt.param_label(i)}: shape {tuple(saved['shape'])} in the checkpoint")
        elif saved["group"] != opt.group_of(i):
            problems.append(f"param {opt.param_label(i)}: in param group {saved['group']} in the checkpoint")
    if problems:
        raise mismatch_error(f"the checkpoint at {ckpt.path!r}", problems)
    return mapping
