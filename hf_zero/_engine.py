"""The torch internals the core uses: running a callback when a backward pass ends, and
a tensor's version counter.

No public torch API does either; DDP and FSDP use the same autograd-engine call, and
torch's own checkpointing and in-place checks read ``_version`` (tests/test_compat.py
checks both are there).
"""

from __future__ import annotations

from typing import Callable

import torch


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward pass ends (callbacks queued from a
    callback run after the ones already queued, e.g. DDP's finalizer)."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None or not hasattr(engine, "queue_callback"):
        raise RuntimeError(
            f"hf_zero: torch {torch.__version__} has no autograd engine callback queue, which hf_zero relies on; "
            "please report this with your versions of hf_zero and torch"
        )
    engine.queue_callback(callback)


def version_of(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter: bumped by every in-place write through it or a view
    sharing its counter (``detach()``, indexing; not ``.data``, which has one of its own)."""
    return tensor._version
