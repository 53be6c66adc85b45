"""Overlap the parameter sync after a step with what runs before and during the next forward.

[Note: overlapped parameter sync]
After the local step each buffer's sync is launched asynchronously and the step
returns; the sync overlaps whatever runs until the forward needs the params (``zero_grad``,
the data loader, Trainer's start-of-step gather of label counts, which runs on another
group: [Note: a group for the overlapped sync] in _comm.py, and, with units, the forward of
the blocks before).

Units (``bind_ddp(overlap_units=...)``; Trainer and Accelerate pass the model's
``_no_split_modules`` blocks) are subtrees of the model, as FSDP2's: a unit's forward
pre-hook waits only for the buffers that hold its params, and the model's own forward
pre-hook (the root) waits for every other buffer before anything runs. A param counts as a
unit's when every module it is registered under lies inside that unit (a param tied
between a block and the outside is the root's); a buffer is the root's when any of its
params is, or is in no hooked model at all, so the root waits for the embeddings, a tied
head and the final norm, for params moved since binding and for what no unit claims. A
buffer holding params of several units is waited for by the first of them to run. Nested
units count as their outermost one. Every module's pre-hook waits for the root's buffers
and its unit's, so a module called on its own is covered too. Which params a unit holds is
worked out again at every launch from the module tree as it is then: a module added or moved
after binding (LoRA injection, a wrapper) is accounted for, and hooked, from the next step
on. Between a launch and the next one, registering a module or param anywhere (torch's
global registration hooks) first waits for the whole sync, and so does the model's forward
when its module tree differs from the launch's (a change that bypassed registration). Syncs
are launched in the order they are needed: the root's buffers, then each unit's in the
order the units are registered (a model's forward order for transformers' block lists;
the same on every rank, as the collectives must be).

Waiting per unit is safe when a unit's forward reads only params registered under it or
outside every unit: ``nn.MultiheadAttention`` reading ``out_proj.weight`` without calling
``out_proj`` is inside its block; a tied head reading the embedding through ``F.linear``
reads a root param. A forward that reads a param of a unit which has not run yet, through a
reference the module tree does not show (a lambda, a plain attribute), is not covered; with
no units (the default of a plain loop) the first hooked forward waits for the whole sync,
which covers any read inside the model's forward.

The sync is also drained (every pending collective waited for) by the optimizer's next
step or rebuild, ``optimizer.wait_param_sync()`` and ``model.state_dict()`` (a
state-dict pre-hook: saving, ``get_state_dict``, consolidation of a model). The
integrations drain after each step while a user callback is registered and at the end
of training. Not covered: code that reads params between a step and the next forward
without going through any of these (a custom ``compute_loss`` or ``training_step`` that
reads a param before calling the model, an evaluation loop that does not call the
hooked model, a callback under a caller that does not drain). So the integrations
leave the overlap off unless asked (``optim_args="overlap=true"``, Accelerate's
``overlap_param_sync=True`` on the optimizer); docs/gradient_path.md lists the limits.

Waiting is all that is left: the collectives were issued on every rank at the step, so
a rank that never runs another forward does not hang the others. At interpreter exit
whatever is still pending is waited for before the process group goes away.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Iterable

import torch

from ._binding import Binding, Hook

_LIVE: "weakref.WeakSet[ParamSyncOverlap]" = weakref.WeakSet()


class Units:
    """Which modules of a model are units: given instances, classes or class names."""

    def __init__(self, model: torch.nn.Module, units: Iterable):
        modules = list(model.modules())
        instances, classes, names = [], [], set()
        for u in units:
            if isinstance(u, torch.nn.Module):
                if not any(m is u for m in modules):
                    raise ValueError(f"overlap_units: the {type(u).__name__} given is not a submodule of the bound model")
                instances.append(u)
            elif isinstance(u, type) and issubclass(u, torch.nn.Module):
                classes.append(u)
            elif isinstance(u, str):
                names.add(u)
            else:
                raise TypeError(f"overlap_units: expected modules, module classes or class names, got {u!r}")
        self._instances = weakref.WeakSet(instances)
        self._classes, self._names = tuple(classes), frozenset(names)
        for c in [*classes, *names]:
            if not any(self.holds(m) for m in modules):
                raise ValueError(f"overlap_units: no submodule of the bound model is a {getattr(c, '__name__', c)}")

    def holds(self, module: torch.nn.Module) -> bool:
        return module in self._instances or isinstance(module, self._classes) or type(module).__name__ in self._names


class ParamSyncOverlap:
    """Pending parameter syncs, per buffer, and the module hooks that wait for them."""

    def __init__(self):
        self._pending: dict[int, object] = {}  # buffer number -> _works.Pending
        self._binding: Binding | None = None  # what holds the hooks (the bound optimizer's)
        self._models: "weakref.WeakKeyDictionary[torch.nn.Module, Units | None]" = weakref.WeakKeyDictionary()
        self._hooked: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        # Per module, the buffers its forward waits for (worked out at each launch); a
        # module not in it waits for every buffer.
        self._needs: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, ...]]" = weakref.WeakKeyDictionary()
        # Per model with units, its module tree at the last launch (weakly): changed by the
        # next forward, the forward waits for every buffer.
        self._trees: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
        _LIVE.add(self)
        _watch_registrations()

    def launch_order(self, order: list[int], buffer_of: dict[int, int]) -> list[int]:
        """Drain, then work out what each module's forward waits for from ``buffer_of``
        (``id(param) -> buffer number``) and return the buffers ``order`` lists (the
        params' order) rearranged in the order the next forward needs them."""
        self.drain()
        self._needs, self._trees = weakref.WeakKeyDictionary(), weakref.WeakKeyDictionary()
        walked = []
        for model, units in list(self._models.items()):
            tree = _walk(model, units)
            walked += tree
            self._trees[model] = tuple(weakref.ref(m) for m, _ in tree)
        for m, _ in walked:
            self._hook(m)
        if not any(unit is not None for _, unit in walked):
            self._trees.clear()
            return list(order)  # no units: every forward waits for the whole sync
        home: dict[int, torch.nn.Module | None] = {}  # id(param) -> its unit (None: the root's)
        units: dict[torch.nn.Module, None] = {}  # in registration order
        for m, unit in walked:
            if unit is not None:
                units.setdefault(unit)
            for p in m.parameters(recurse=False):
                home[id(p)] = unit if home.get(id(p), unit) is unit else None
        root, of_unit = set(), {u: set() for u in units}
        for pid, b in buffer_of.items():
            unit = home.get(pid)
            (root if unit is None else of_unit[unit]).add(b)
        root |= set(order) - set(buffer_of.values())
        first = tuple(b for b in order if b in root)
        needs = {u: first + tuple(b for b in order if b in of_unit[u] and b not in root) for u in units}
        for m, unit in walked:
            self._needs[m] = tuple(dict.fromkeys(self._needs.get(m, ()) + (first if unit is None else needs[unit])))
        launched = dict.fromkeys(first)
        for u in units:
            launched.update(dict.fromkeys(needs[u]))
        launched.update(dict.fromkeys(order))  # nothing left out
        return list(launched)

    def launch(self, pending: dict[int, object]) -> None:
        """Take the syncs just started (``buffer number -> Pending``), in the order
        :meth:`launch_order` gave."""
        self.drain()
        self._pending = {b: p for b, p in pending.items() if p is not None}

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def drain(self) -> None:
        """Wait for every pending sync."""
        pending, self._pending = self._pending, {}
        for p in pending.values():
            p.wait()

    def wait_for(self, module: torch.nn.Module) -> None:
        """Wait for the buffers ``module``'s forward needs (every buffer when it was not
        in the module tree at the last launch, or is a model whose tree changed since)."""
        needs = self._needs.get(module)
        tree = self._trees.get(module)
        if tree is not None and not _same_tree(tree, _walk(module, self._models.get(module))):
            needs = None
        if needs is None:
            self.drain()
            return
        for b in needs:
            p = self._pending.pop(b, None)
            if p is not None:
                p.wait()

    def attach(self, model: torch.nn.Module, units: Units | None, binding: Binding) -> None:
        """Hook ``model``: the forward of it and of each submodule it has now (and of each
        one it has at a later launch) waits for what it needs; its ``state_dict()`` drains.
        Idempotent per model; ``units`` replaces the model's units when given. The hooks go
        through ``binding``, whose ``close()`` removes them."""
        if model in self._models:
            if units is not None:
                self._models[model] = units
            return
        if self._binding is not binding:
            self._binding = binding
            binding.on_close(self._detached)
        for module in model.modules():  # the model itself first
            self._hook(module)
        binding.keep(model.register_state_dict_pre_hook(_Draining(self)))
        self._models[model] = units

    def _detached(self) -> None:
        """The binding closed: no model is hooked any more."""
        self.drain()
        self._binding = None
        self._models, self._hooked = weakref.WeakKeyDictionary(), weakref.WeakSet()
        self._needs, self._trees = weakref.WeakKeyDictionary(), weakref.WeakKeyDictionary()

    def _hook(self, module: torch.nn.Module) -> None:
        if module in self._hooked or self._binding is None:
            return
        self._binding.keep(module.register_forward_pre_hook(_Waiting(self)))
        self._hooked.add(module)

    def drain_within(self, timeout_s: float) -> None:
        """Wait for every pending sync, each collective at most ``timeout_s`` seconds."""
        pending, self._pending = self._pending, {}
        for p in pending.values():
            p.wait(timeout_s)


class _Waiting(Hook):
    """A module's forward pre-hook: wait for the syncs its forward needs."""

    __slots__ = ("_overlap",)

    def __init__(self, overlap: ParamSyncOverlap):
        self._overlap = weakref.ref(overlap)

    def __call__(self, module, args) -> None:
        overlap = self._overlap()
        if overlap is not None and overlap.pending:
            overlap.wait_for(module)


class _Draining(Hook):
    """The model's state-dict pre-hook: wait for every sync."""

    __slots__ = ("_overlap",)

    def __init__(self, overlap: ParamSyncOverlap):
        self._overlap = weakref.ref(overlap)

    def __call__(self, module, prefix, keep_vars) -> None:
        overlap = self._overlap()
        if overlap is not None:
            overlap.drain()


def _walk(model: torch.nn.Module, units: Units | None) -> list[tuple[torch.nn.Module, torch.nn.Module | None]]:
    """Every (module, its outermost enclosing unit or None) of ``model``, depth first in
    registration order; a module registered at several places appears once per place."""
    out, stack = [], [(model, None)]
    while stack:
        m, unit = stack.pop()
        if unit is None and units is not None and units.holds(m):
            unit = m
        out.append((m, unit))
        stack.extend((c, unit) for c in reversed(list(m.children())))
    return out


_WATCHING: list = []


def _watch_registrations() -> None:
    """Once per process: a module or param registered anywhere (``setattr``, ``add_module``,
    ``ModuleList.append``) while a sync is in flight first waits for the whole sync, as the
    units' waits were worked out for the module tree of the launch."""
    if _WATCHING:
        return

    def registering(module, name, value):
        for overlap in list(_LIVE):
            if overlap.pending:
                overlap.drain()

    from torch.nn.modules import module as nn_module

    _WATCHING.append(nn_module.register_module_module_registration_hook(registering))
    _WATCHING.append(nn_module.register_module_parameter_registration_hook(registering))


def _same_tree(refs: tuple, tree: list) -> bool:
    return len(refs) == len(tree) and all(r() is m for r, (m, _) in zip(refs, tree))


_EXIT_WAIT_S = 5.0  # at exit, per pending collective: a peer that died or stopped must not hold the process


@atexit.register
def _drain_all() -> None:
    for overlap in list(_LIVE):
        try:
            overlap.drain_within(_EXIT_WAIT_S)
        except Exception:  # a peer gone or silent: nothing left to protect at exit
            pass
