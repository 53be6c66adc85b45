"""Gradient clipping over sharded grads: each rank counts its own elements once.

After a reduce-scatter a param's grad holds the average only in this rank's ranges; after
an all-reduce it is whole everywhere. Either way each rank sums the elements of its own
pieces and one scalar all-reduce makes the total, and scaling touches only the elements
that hold the average.
"""

from __future__ import annotations

import torch

from ._comm import Comm
from ._layout import Piece, plan_layout
from ._params import ParamTable

_NORM_CHUNK = 1 << 14


def _pow_sum(g: torch.Tensor, norm_type: float) -> torch.Tensor:
    """sum(|g|^p) of a 1-D grad in float64 without a float64 copy of it: the norms of
    16K-element chunks in the grad's own dtype (rounding error ~1e-7, where one norm
    over millions of float32 elements is off by ~1e-4), raised and summed in float64."""
    if g.dtype == torch.float64:
        return torch.linalg.vector_norm(g, norm_type).pow(norm_type)
    full = g.numel() - g.numel() % _NORM_CHUNK
    total = torch.zeros((), dtype=torch.float64, device=g.device)
    if full:
        norms = torch.linalg.vector_norm(g[:full].view(-1, _NORM_CHUNK), norm_type, dim=1, dtype=torch.float32)
        total += norms.double().pow(norm_type).sum()
    if full < g.numel():
        total += torch.linalg.vector_norm(g[full:], norm_type, dtype=torch.float32).double().pow(norm_type)
    return total


def norm_pieces(table: ParamTable, comm: Comm, shard: str, live) -> list[Piece]:
    """The elements this rank counts in a sharded norm: the pieces of ``live`` (the current
    Partition, or None), planned afresh (no collective: every rank has the same trainable
    set) when trainability changed since it was built. The DDP buckets stay those of the
    current layout, whose ranges the grads were reduce-scattered into; other grads are
    whole on every rank."""
    if live is not None and table.mask() == live.mask:
        return live.owned()
    buckets = live.layout.buckets if live is not None else ()
    return plan_layout(table.specs(), world_size=comm.world_size, shard=shard, buckets=buckets).pieces(comm.rank)


def valid_grads(table: ParamTable, chosen: set[int], pieces: list[Piece], partial: set[int],
                grad_of=None) -> list[torch.Tensor]:
    """The grads of these params where they hold the average: whole, or only this
    rank's ranges (``pieces``) for the ``partial`` ones, reduce-scattered (scaling the
    rest, which only holds this rank's own contribution, would be a wasted pass).
    ``grad_of`` (stage 2's ShardedGrads: grads live in shards, not ``.grad``): only ``pieces``, those of
    params no rank had a grad for included (they hold zeros: [Note: agreeing on presence] in _stage2/grads.py)."""
    if grad_of is not None:
        return [g for g in (grad_of.held(pc) for pc in pieces if pc.index in chosen) if g is not None]
    owned: dict[int, list[Piece]] = {}
    if partial & chosen:
        for pc in pieces:
            owned.setdefault(pc.index, []).append(pc)
    out = []
    for i in sorted(chosen):
        g = table.params[i].grad
        if g is None:
            continue
        if i in partial and g.is_contiguous():
            out += [g.view(-1)[pc.start : pc.stop] for pc in owned.get(i, ())]
        else:
            out.append(g)
    return out


def clip_norm(comm: Comm, table: ParamTable, chosen: set[int], pieces: list[Piece], partial: set[int], *,
              max_norm: float, norm_type: float, error_if_nonfinite: bool, grad_of=None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the ``chosen`` params' grads, each rank
    summing the elements of its ``pieces``. Collective (one small all-reduce: a scalar, and under
    stage 2 the presence flags the step needs, when not agreed yet). ``grad_of``: as for :func:`valid_grads`."""
    params = table.params
    if grad_of is not None:
        grads = valid_grads(table, chosen, pieces, partial, grad_of)
        first = params[min(chosen)].detach() if chosen else None  # a grad has its param's dtype and device
    else:
        grads = [
            params[pc.index].grad.reshape(-1)[pc.start : pc.stop]
            for pc in pieces
            if pc.index in chosen and params[pc.index].grad is not None
        ]
        first = next((params[i].grad for i in sorted(chosen) if params[i].grad is not None), None)
    dtype = first.dtype if first is not None else torch.float32
    device = comm.device
    if norm_type == float("inf"):
        local = max((torch.linalg.vector_norm(g, norm_type).double().to(device) for g in grads if g.numel()), default=None)
        total = torch.zeros((), dtype=torch.float64, device=device) if local is None else local.clone()
        total = _all_reduced(comm, total, "max", grad_of)
    else:
        total = torch.zeros((), dtype=torch.float64, device=device)
        for g in grads:
            total += _pow_sum(g, norm_type).to(device)
        total = _all_reduced(comm, total, "sum", grad_of).pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be clipped. "
            "To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    total = total.to(dtype=dtype)
    if max_norm != float("inf"):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in valid_grads(table, chosen, pieces, partial, grad_of):
            g.mul_(coef.to(device=g.device, dtype=g.dtype))
    return total.to(first.device) if first is not None else total


def _all_reduced(comm: Comm, total: torch.Tensor, op: str, grad_of) -> torch.Tensor:
    """``total`` (a float64 scalar) all-reduced with ``op``; under stage 2 the presence flags ride along
    ([Note: agreeing on presence] in _stage2/grads.py)."""
    if grad_of is None:
        return comm.all_reduce_(total, op=op, what="the gradient norm")
    return grad_of.all_reduce_along(total, op=op, what="the gradient norm")
