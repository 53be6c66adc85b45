"""Give bucket-view params their own storage, for savers that reject shared storage."""

from __future__ import annotations

from collections import Counter


def release_views(optimizer) -> None:
    """Copy every param of ``optimizer`` that shares its storage with another into its
    own storage. The optimizer notices at its next step and rebuilds the buffers from
    the params' current values, on every rank (no optimizer state moves)."""
    params = optimizer._params
    shared = Counter(p.untyped_storage().data_ptr() for p in params)
    for p in params:
        if shared[p.untyped_storage().data_ptr()] > 1:
            p.data = p.data.clone()
