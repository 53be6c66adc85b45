"""Rank 0's params and buffers: broadcast at bind, and buffers after each syncing backward.

[Note: buffers after a syncing backward]
DDP broadcasts rank 0's buffers at the start of a forward when the forward before it
synced grads (``require_forward_param_sync``): the next training forward, also the first
one of an accumulation's micro-batches under ``no_sync()``. Under Trainer the model that
callbacks get is the bound module itself, so a broadcast at a forward would also run in
a callback's forward on rank 0 alone (a sample loss, generation) and every rank would
wait for the collective timeout: a forward must run no collective. So rank 0's buffers
are sent at the end of each syncing backward, where every rank is, and each other rank
takes them at its next grad-mode forward: the forward DDP would have broadcast before.
Training forwards read what they read under DDP, buffers saved for the backward are
never written during it, and evaluation under ``no_grad`` between steps reads each
rank's own buffers, as under Trainer + DDP. Two differences remain: what rank 0 changes
in its buffers between a syncing backward and the next training forward (a forward on
rank 0 alone in train mode) reaches the other ranks one syncing backward later; and
buffers made to differ after ``bind_module`` are not overwritten before the first
forward (DDP's first forward broadcasts), only from the second.
"""

from __future__ import annotations

import torch

from .._comm import Comm


class ReceivedBuffers:
    """Rank 0's buffers, received after a syncing backward, for the next grad-mode forward to take:
    see [Note: buffers after a syncing backward]."""

    def __init__(self):
        self._received: tuple | None = None  # (the buffers, rank 0's values of them)

    def receive(self, comm: Comm, buffers: list) -> None:
        """Collective: rank 0 sends its buffers (rank 0 takes nothing)."""
        if comm.rank == 0:
            with torch.no_grad():
                comm.broadcast_(buffers, src=0, what="broadcasting buffers from rank 0")
            return
        held = self._received[1] if self._received is not None else ()
        if [(v.shape, v.dtype, v.device) for v in held] != [(b.shape, b.dtype, b.device) for b in buffers]:
            held = [torch.empty_like(b) for b in buffers]
        with torch.no_grad():
            comm.broadcast_(held, src=0, what="broadcasting buffers from rank 0")
        self._received = (buffers, held)

    def take(self) -> None:
        """Before a grad-mode forward: copy what was received into the buffers (once)."""
        if self._received is not None and torch.is_grad_enabled():
            (buffers, values), self._received = self._received, None
            with torch.no_grad():
                for b, v in zip(buffers, values):
                    b.copy_(v)


def broadcast_at_bind(comm: Comm, tensors: list) -> None:
    """Rank 0's values of these params and buffers (each once), as DDP's constructor does."""
    unique = list({id(t): t.data for t in tensors}.values())
    with torch.no_grad():
        comm.broadcast_(unique, src=0, what="broadcasting parameters and buffers from rank 0")
