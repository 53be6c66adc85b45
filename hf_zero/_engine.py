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


def backward_reaches(param: torch.Tensor) -> bool:
    """Whether the running backward pass will accumulate a gradient into leaf ``param``
    (its ``AccumulateGrad`` node is in the graph being run). Only inside a backward pass."""
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if will_execute is None:
        raise RuntimeError(
            f"hf_zero: torch {torch.__version__} has no torch._C._will_engine_execute_node, which stage 2 relies on; "
            "please report this with your versions of hf_zero and torch"
        )
    with torch.enable_grad():
        node = param.view_as(param).grad_fn.next_functions[0][0]
    return bool(will_execute(node))
