"""The torch internals the core uses: running a callback when a backward pass ends, and
a tensor's version counter, and how ``torch.save`` pickles a tensor (for files written
piece by piece); for stage 2, what the running backward pass will execute, which one is
running (and which node), and flattening a model's output; whether a profiler runs; the
coalesced broadcast DDP syncs its buffers with; an optimizer's step without torch's per-call wrapper.

No public torch API does these; DDP and FSDP use the same autograd-engine call, and
torch's own checkpointing and in-place checks read ``_version`` (tests/test_compat.py
checks they are all there).
"""

from __future__ import annotations

import collections
import operator
from typing import Any, Callable

import torch


def profiler_enabled() -> bool:
    """Whether a torch profiler is recording (labels cost microseconds each where none is)."""
    return torch._C._autograd._profiler_enabled()


def unhooked_step(optimizer):
    """``optimizer.step`` without the wrapper ``torch.optim.Optimizer.__init__`` puts around a subclass's ``step``
    (a profiler label, then the global and the optimizer's own step hooks: about 25 us a call on the CPU), for a
    local optimizer only hf_zero holds: its owner labels its own steps, and the user's hooks run once a step, on
    the optimizer they made, not again on each chunk of a local one. ``optimizer.step`` where the wrapper is not
    there (an optimizer that is not a torch one)."""
    step = type(optimizer).step
    raw = getattr(step, "__wrapped__", None)
    if raw is None or not getattr(step, "hooked", False):
        return optimizer.step
    return raw.__get__(optimizer)


def coalesced_broadcast():
    """torch's ``_broadcast_coalesced(group, tensors, buffer_size, src)``, which DDP broadcasts its buffers with
    (``DistributedDataParallel._distributed_broadcast_coalesced``): the tensors flattened per dtype and device in
    buffers of up to ``buffer_size`` bytes, broadcast, copied back."""
    import torch.distributed as dist

    return dist._broadcast_coalesced


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


def versions_of(tensors) -> tuple[int, ...]:
    """:func:`version_of` of each of ``tensors``, read in one C-level pass."""
    return tuple(map(_VERSION, tensors))


_VERSION = operator.attrgetter("_version")


def grad_accumulator(param: torch.Tensor):
    """Leaf ``param``'s ``AccumulateGrad`` autograd node. Torch keeps it only while something
    holds it (DDP holds them too): held, the same node is in every graph that reaches ``param``
    (until ``param`` changes dtype or device)."""
    with torch.enable_grad():
        return param.view_as(param).grad_fn.next_functions[0][0]


_WILL_EXECUTE = getattr(torch._C, "_will_engine_execute_node", None)


def will_run(node) -> bool:
    """Whether the running backward pass will execute autograd ``node``. Only inside a backward pass."""
    will_execute = _WILL_EXECUTE
    if will_execute is None:
        raise RuntimeError(
            f"hf_zero: torch {torch.__version__} has no torch._C._will_engine_execute_node, which stage 2 relies on; "
            "please report this with your versions of hf_zero and torch"
        )
    return bool(will_execute(node))


def will_run_each(nodes) -> list[bool]:
    """:func:`will_run` of each of ``nodes``, in one pass."""
    if _WILL_EXECUTE is None:
        will_run(None)  # its error
    return list(map(_WILL_EXECUTE, nodes))


def will_accumulate(node) -> bool:
    """Whether the running backward pass will execute leaf ``node`` (an ``AccumulateGrad``), writing
    ``.grad``: False under ``torch.autograd.grad``, which captures the leaf's grad instead (torch
    refuses to answer for a captured leaf). Only inside a backward pass."""
    try:
        return will_run(node)
    except RuntimeError as error:
        if "autograd.grad" in str(error):  # "A leaf node was passed ... running autograd.grad()"
            return False
        raise


def accumulates(nodes: Callable[[], Any]) -> bool:
    """Whether the running backward pass writes
    ``.grad``: a backward over the whole graph (``loss.backward()``: the engine executes every node
    it reaches), or one restricted to ``inputs=`` that will execute one of the ``AccumulateGrad``
    nodes ``nodes()`` returns (asked only then). Not ``torch.autograd.grad`` (its leaves' grads are captured, never accumulated).
    Only inside a backward pass. See [Note: arming a backward] in _stage2/reducer.py."""
    whole = getattr(torch.autograd, "_is_checkpoint_valid", None)
    if whole is None:
        raise RuntimeError(
            f"hf_zero: torch {torch.__version__} has no torch.autograd._is_checkpoint_valid, which stage 2 relies on; "
            "please report this with your versions of hf_zero and torch"
        )
    return bool(whole()) or any(will_accumulate(node) for node in nodes())


def in_functorch() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ...) is running: a forward inside one is
    the transform's, not a training step's."""
    peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
    if peek is None:
        raise RuntimeError(
            f"hf_zero: torch {torch.__version__} has no torch._C._functorch.peek_interpreter_stack, which stage 2 "
            "relies on; please report this with your versions of hf_zero and torch"
        )
    return peek() is not None


def plain_tensors():
    """A context in which a tensor subclass's ``__torch_function__`` runs torch's own op on its instances,
    as torch's default ``Tensor.__torch_function__`` does (results are not re-wrapped)."""
    return torch._C.DisableTorchFunctionSubclass()


def graph_task_id() -> int:
    """The id of the backward pass running on this thread (a nested one, e.g. a reentrant
    checkpoint's, has its own), or -1 outside any backward pass."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    if current is None:
        raise RuntimeError(
            f"hf_zero: torch {torch.__version__} has no torch._C._current_graph_task_id, which stage 2 relies on; "
            "please report this with your versions of hf_zero and torch"
        )
    return int(current())


def tree_tensors(output: Any) -> tuple[list, Callable[[list], Any]]:
    """The leaves of ``output`` (nested tuples, lists, dicts, a transformers ``ModelOutput``: what
    ``torch.utils._pytree`` knows) and a function building the same structure from new leaves."""
    import torch.utils._pytree as pytree

    leaves, spec = pytree.tree_flatten(output)
    return leaves, lambda new: pytree.tree_unflatten(new, spec)


def running_node():
    """The autograd node the running backward pass is executing (in a node's prehook: that node)."""
    current = getattr(torch._C, "_current_autograd_node", None)
    if current is None:
        raise RuntimeError(
            f"hf_zero: torch {torch.__version__} has no torch._C._current_autograd_node, which stage 2 relies on; "
            "please report this with your versions of hf_zero and torch"
        )
    return current()


# Autograd nodes of checkpoints that run a nested backward of their own (inside the node's
# backward, with the params of the region unreachable from the outer graph):
# torch.utils.checkpoint.checkpoint(..., use_reentrant=True).
REENTRANT_NODES = frozenset({"CheckpointFunctionBackward"})


def reentrant_region_below(root) -> bool:
    """Whether the running backward pass will run a reentrant checkpoint node at or below
    autograd node ``root`` (a depth-first walk of the graph, stopping at the first one).
    Only inside a backward pass."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name() in REENTRANT_NODES and will_run(node):
            return True
        stack.extend(f for f, _ in node.next_functions)
    return False


def saved_tensor_reduce(storage: Any, shape: tuple[int, ...]) -> tuple:
    """What ``torch.save`` pickles for a contiguous CPU tensor at offset 0 of ``storage``
    (``Tensor._reduce_ex_internal``): ``torch._utils._rebuild_tensor_v2(storage, 0, shape,
    stride, requires_grad=False, backward_hooks)``, which ``torch.load(weights_only=True)``
    accepts. ``storage`` is what the pickler's ``persistent_id`` replaces."""
    rebuild = getattr(getattr(torch, "_utils", None), "_rebuild_tensor_v2", None)
    if rebuild is None:
        raise RuntimeError(
            f"hf_zero: torch {torch.__version__} has no torch._utils._rebuild_tensor_v2, which hf_zero's "
            "optimizer.pt writer relies on; please report this with your versions of hf_zero and torch"
        )
    stride = torch.empty(shape, device="meta").stride()
    return rebuild, (storage, 0, tuple(shape), stride, False, collections.OrderedDict())


# dtype -> the legacy storage class torch.save names in a storage's persistent id
_STORAGE_CLASS = {
    torch.float64: "DoubleStorage", torch.float32: "FloatStorage", torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage", torch.int64: "LongStorage", torch.int32: "IntStorage",
    torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage", torch.bool: "BoolStorage",
    torch.complex64: "ComplexFloatStorage", torch.complex128: "ComplexDoubleStorage",
}


def saved_storage_id(key: str, dtype: torch.dtype, numel: int) -> tuple:
    """The persistent id ``torch.save`` gives a CPU storage of ``numel`` ``dtype`` elements
    stored in record ``data/<key>``: ``("storage", storage class, key, "cpu", numel)``."""
    name = _STORAGE_CLASS.get(dtype)
    if name is None:
        raise ValueError(f"hf_zero: cannot write {dtype} state into optimizer.pt")
    return ("storage", getattr(torch, name), key, "cpu", numel)
