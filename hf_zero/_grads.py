"""Averaging ``.grad`` over ranks for the params DDP does not reduce (optimizer-side work:
the collective itself is :meth:`hf_zero._comm.Comm.all_reduce_`)."""

from __future__ import annotations

from typing import Sequence

import torch


def average_grads(comm, params: Sequence[torch.Tensor]) -> None:
    """Average the ``.grad`` of ``params`` over ``comm``'s ranks, one all-reduce per
    (device, dtype). Collective: every rank passes the same params in the same order.

    A grad missing on a rank counts as zero there; a grad missing on every rank
    stays ``None`` (a count of present grads rides in the same buffer).
    """
    if comm.world_size == 1 or not params:
        return
    by_key: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        by_key.setdefault((p.device, p.dtype), []).append(p)
    for (device, dtype), ps in by_key.items():
        flat = torch.zeros(sum(p.numel() for p in ps) + len(ps), dtype=dtype, device=device)
        offset = len(ps)
        for k, p in enumerate(ps):
            if p.grad is not None:
                flat[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
                flat[k] = 1
            offset += p.numel()
        comm.all_reduce_(flat, op="sum", what="averaging grads DDP does not reduce")
        present = flat[: len(ps)].tolist()
        flat.div_(comm.world_size)
        offset = len(ps)
        for k, p in enumerate(ps):
            g = flat[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
            if present[k] == 0:
                p.grad = None
            elif p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
