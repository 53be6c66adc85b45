"""Overlap the parameter sync after a step with the next forward.

[Note: overlapped parameter sync]
After the local step each buffer's sync is launched asynchronously; a forward pre-hook
on every module that holds params waits only for the buffers its own params live in,
so the first layers start computing while the later layers' params are still in
flight (Megatron-core's ``overlap_param_gather``). Anything else that reads params
before the next forward must see them complete, so the sync is drained (every
pending collective waited for) before: the optimizer's next step or rebuild,
``model.state_dict()`` (a state-dict pre-hook: saving, ``get_state_dict``,
consolidation of a model), and, from the integrations, evaluation, saving, user
callbacks and the end of training. Waiting is all that is left: the collectives were
issued on every rank at the step, so a rank that never runs another forward does not
hang the others. At interpreter exit whatever is still pending is waited for before
the process group goes away.
"""

from __future__ import annotations

import atexit
import weakref

import torch

_LIVE: "weakref.WeakSet[ParamSyncOverlap]" = weakref.WeakSet()


class ParamSyncOverlap:
    """Pending parameter syncs, per buffer, and the module hooks that wait for them."""

    def __init__(self):
        self._pending: dict[int, object] = {}  # buffer number -> _works.Pending
        self._buffer_of: dict[int, int] = {}  # id(param) -> buffer number
        self._hooked: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()
        _LIVE.add(self)

    def launch(self, pending: dict[int, object], buffer_of: dict[int, int]) -> None:
        """Take the syncs just started (``buffer number -> Pending``) and where each param lives."""
        self.drain()
        self._pending = {b: p for b, p in pending.items() if p is not None}
        self._buffer_of = buffer_of

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def wait_for(self, params) -> None:
        """Wait for the syncs of the buffers these params live in."""
        if not self._pending:
            return
        for p in params:
            b = self._buffer_of.get(id(p))
            if b is not None:
                pending = self._pending.pop(b, None)
                if pending is not None:
                    pending.wait()

    def drain(self) -> None:
        """Wait for every pending sync."""
        pending, self._pending = self._pending, {}
        for p in pending.values():
            p.wait()

    def attach(self, model: torch.nn.Module) -> None:
        """Hook ``model``: each submodule's forward waits for its own params; its
        ``state_dict()`` drains. Idempotent per model."""
        if model in self._hooked:
            return
        me = weakref.ref(self)
        handles = []

        def before_forward(module, args):
            overlap = me()
            if overlap is not None and overlap._pending:
                overlap.wait_for(module.parameters(recurse=False))

        def before_state_dict(module, prefix, keep_vars):
            overlap = me()
            if overlap is not None:
                overlap.drain()

        for module in model.modules():
            if any(True for _ in module.parameters(recurse=False)):
                handles.append(module.register_forward_pre_hook(before_forward))
        handles.append(model.register_state_dict_pre_hook(before_state_dict))
        self._hooked[model] = handles


@atexit.register
def _drain_all() -> None:
    for overlap in list(_LIVE):
        try:
            overlap.drain()
        except Exception:  # a peer already gone: nothing left to protect at exit
            pass
