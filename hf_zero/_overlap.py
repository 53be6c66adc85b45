"""Overlap the parameter sync after a step with what runs before the next forward.

[Note: overlapped parameter sync]
After the local step each buffer's sync is launched asynchronously and the step
returns; the sync overlaps whatever runs until the model's next forward (``zero_grad``,
the data loader, Trainer's start-of-step gather of label counts, which runs on another
group: [Note: a group for the overlapped sync] in _comm.py). The first forward of any
hooked module (the model passed to :meth:`ParamSyncOverlap.attach` and every submodule
it had then) waits for every pending sync before it runs: a forward may read any param
(``nn.MultiheadAttention`` reads ``out_proj.weight`` without calling ``out_proj``, a
tied head reads the embedding through ``F.linear``, a loss may read params after the
forward), so waiting only for a module's own params is not enough. A module added after
binding (LoRA injection, ``resize_token_embeddings``) is covered when it runs inside the
model's forward; one called on its own is not hooked.

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

import torch

_LIVE: "weakref.WeakSet[ParamSyncOverlap]" = weakref.WeakSet()


class ParamSyncOverlap:
    """Pending parameter syncs, per buffer, and the module hooks that wait for them."""

    def __init__(self):
        self._pending: dict[int, object] = {}  # buffer number -> _works.Pending
        self._hooked: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()
        _LIVE.add(self)

    def launch(self, pending: dict[int, object], buffer_of: dict[int, int] | None = None) -> None:
        """Take the syncs just started (``buffer number -> Pending``); ``buffer_of`` (where
        each param lives) is accepted for callers that still pass it and unused: every
        forward waits for every buffer (see the module note)."""
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

    def attach(self, model: torch.nn.Module) -> None:
        """Hook ``model``: the forward of it and of each submodule it has now waits for
        every pending sync; its ``state_dict()`` drains. Idempotent per model."""
        if model in self._hooked:
            return
        me = weakref.ref(self)
        handles = []

        def before_forward(module, args):
            overlap = me()
            if overlap is not None and overlap._pending:
                overlap.drain()

        def before_state_dict(module, prefix, keep_vars):
            overlap = me()
            if overlap is not None:
                overlap.drain()

        for module in model.modules():  # the model itself first
            handles.append(module.register_forward_pre_hook(before_forward))
        handles.append(model.register_state_dict_pre_hook(before_state_dict))
        self._hooked[model] = handles


    def drain_within(self, timeout_s: float) -> None:
        """Wait for every pending sync, each collective at most ``timeout_s`` seconds."""
        pending, self._pending = self._pending, {}
        for p in pending.values():
            p.wait(timeout_s)


_EXIT_WAIT_S = 5.0  # at exit, per pending collective: a peer that died or stopped must not hold the process


@atexit.register
def _drain_all() -> None:
    for overlap in list(_LIVE):
        try:
            overlap.drain_within(_EXIT_WAIT_S)
        except Exception:  # a peer gone or silent: nothing left to protect at exit
            pass
