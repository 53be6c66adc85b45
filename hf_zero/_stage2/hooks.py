"""The hooks stage 2 puts on the bound module and its params, shared by every reducer bound to it.

[Note: several optimizers over one module]
Each stage-2 optimizer bound to a module reduces its own params' grads (a backbone and a
head with optimizers of their own); the trainable params must be covered by them, which
is checked at the first forward (not at a bind: the next optimizer may hold the rest).
``no_sync()`` suspends every one, and only the first bound broadcasts buffers. The
module's two forward hooks are registered by the first bind and call every reducer bound
to it; each reducer's unbind takes it out, and the last one removes the hooks and
``no_sync`` ([Note: a binding ends with its run] in _binding.py). gloo
matches collectives by order, and two reducers' buckets would complete in an order that
depends on each rank's graph: so the first reducer armed in a backward reduces its
buckets as they complete, and every other one armed while it is (one optimizer per
module of a GAN too) reduces all of its buckets at its own end of the backward; the ends
run in the order the reducers armed, so every rank starts the same collectives in the
same order.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from .._binding import Binding, Hook
from .._engine import running_node

_BOUND: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()  # module -> its reducers
ARMED: "weakref.WeakSet[Reducer]" = weakref.WeakSet()  # reducers whose backward is under way
_HOOKED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()  # its forward hooks


def attach(module: torch.nn.Module, reducer: Reducer) -> None:
    """``reducer`` (bound to ``module`` now) joins the reducers of ``module``: the forward hooks, registered by
    the first, call every one; ``no_sync`` suspends every one."""
    _BOUND[module] = [*map(weakref.ref, reducers_of(module)), weakref.ref(reducer)]
    if module not in _HOOKED:
        before, after = _forward_hooks()
        _HOOKED[module] = (module.register_forward_pre_hook(before), module.register_forward_hook(after))
    module.no_sync = _NoSync(reducers_of(module) if reducer.local_accumulation else ())


def detach(module: torch.nn.Module, broadcasting: bool) -> None:
    """A reducer of ``module`` was unbound (``broadcasting``: the one that sent rank 0's buffers): the others
    keep the forward hooks, a ``no_sync`` of their own and the buffers' broadcast; the last one leaves the
    module as it found it ([Note: a binding ends with its run])."""
    live = reducers_of(module)
    if live:
        _BOUND[module] = [weakref.ref(r) for r in live]
        module.no_sync = _NoSync(live if live[0].local_accumulation else ())
        if broadcasting:
            live[0].send_buffers()
        return
    _BOUND.pop(module, None)
    for handle in _HOOKED.pop(module, ()):
        handle.remove()
    if isinstance(module.__dict__.get("no_sync"), _NoSync):
        del module.no_sync


def alone(reducer: Reducer) -> bool:
    """Whether ``reducer`` is the only reducer bound in this process (no other's collectives can come
    between its own in a backward: [Note: the check rides a bucket] in carrier.py)."""
    return all(reducers_of(module) in ([], [reducer]) for module in list(_BOUND.keys()))


def reducers_of(module: torch.nn.Module) -> list[Reducer]:
    """The live reducers bound to ``module``, in the order they were bound."""
    found = (ref() for ref in _BOUND.get(module, ()))
    return [r for r in found if r is not None and r.module_ref is not None and r.module_ref() is module]


def refuse_binding(module: torch.nn.Module, bound_ref, *, cap_bytes: int, local_accumulation: bool,
                   leaving=()) -> None:
    """Refuse a bind before anything changes (``leaving``: the bindings the bind will take over, whose reducers
    are no longer bound to ``module`` then)."""
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            "bind_module: stage=2 takes gradient synchronisation over from DistributedDataParallel; "
            "pass the unwrapped module (model.module) and do not wrap it in DDP"
        )
    if bound_ref is not None:
        raise ValueError("bind_module: this optimizer is already bound to another module; call optimizer.unbind() first")
    others = [o for o in reducers_of(module) if o.binding not in leaving]
    if getattr(module, "no_sync", None) is not None and not others and not isinstance(module.no_sync, _NoSync):
        raise ValueError(f"bind_module: {type(module).__name__} already has a no_sync attribute")
    if any(o.local_accumulation != local_accumulation for o in others):
        raise ValueError(
            "bind_module: local_accumulation must be the same for every optimizer bound to one module "
            f"(another one bound it with local_accumulation={not local_accumulation})"
        )
    if cap_bytes <= 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {cap_bytes / (1 << 20)}")


def check_coverage(module: torch.nn.Module) -> bool:
    """At the first forward after a bind that left some of ``module``'s trainable params to other
    optimizers: every one must be held by a stage-2 optimizer bound to it (False: checked)."""
    reducers = reducers_of(module)
    missing = [n for n, p in module.named_parameters() if p.requires_grad and not any(r.holds(p) for r in reducers)]
    if missing:
        raise ValueError(
            f"hf_zero stage 2: trainable params of the bound model are in no stage-2 optimizer bound to it: "
            f"{missing[:5]} (their grads would never be averaged); give them to an optimizer (frozen params "
            "may be given too) and bind every optimizer to the model (optimizer.bind_module(model), or "
            "accelerator.prepare(model, *optimizers)), or freeze them"
        )
    return False


def _before_forward(module: torch.nn.Module, args) -> None:
    """The forward pre-hook of a bound module (registered once, for every reducer bound to it): it finds
    the reducers by the module it is called with, so a copy of a bound module (``copy.deepcopy`` shares
    functions, ``torch.save`` pickles them by name) finds none and is not bound ([Note: a binding ends
    with its run] in _binding.py)."""
    for reducer in reducers_of(module):
        reducer.before_forward(module)


def _after_forward(module: torch.nn.Module, args, output):
    """The forward hook of a bound module (as :func:`_before_forward`): each reducer's, in bind order, on
    the output the one before returned, as torch chains hooks."""
    changed = None
    for reducer in reducers_of(module):
        out = reducer.after_forward(output if changed is None else changed)
        changed = changed if out is None else out
    return changed


def _forward_hooks():
    """The forward pre-hook and hook, marked eager ([Note: forward hooks under torch.compile]) at the first
    bind; the module's names are rebound to the marked functions, so that they still pickle by name."""
    global _before_forward, _after_forward
    if not _EAGER:
        _before_forward, _after_forward = _eager(_before_forward), _eager(_after_forward)
        _EAGER.append(True)
    return _before_forward, _after_forward


_EAGER: list = []


def _eager(hook):
    """[Note: forward hooks under torch.compile] Dynamo inlines a compiled module's ``_call_impl``,
    its forward hooks included: traced, these hooks broke the user's graph a dozen times (engine
    state, weak references, autograd nodes of fake outputs) and made ``fullgraph=True`` fail. Marked
    so (as FSDP2 marks its hooks), they run eagerly outside the one graph of the forward, with no
    graph break (``fullgraph=True`` compiles), and the post-hook sees the real outputs, whose node is
    the compiled graph's backward (tests/test_stage2_compile.py). The mark imports ``torch._dynamo``
    at ``bind_module`` (about a second, once, where transformers has not imported it already)."""
    return torch.compiler.disable(hook)


class _NoSync(Hook):
    """A bound module's ``no_sync`` attribute: every bound reducer's :meth:`Reducer.no_sync` at once (none
    under ``local_accumulation=False``: a ``nullcontext``). A copy of the module gets one that does nothing."""

    __slots__ = ("_refs",)

    def __init__(self, reducers=()):
        self._refs = tuple(weakref.ref(r) for r in reducers)

    def __call__(self):
        live = [r for r in (ref() for ref in self._refs) if r is not None]
        return _suspended(live) if live else contextlib.nullcontext()

    def __reduce__(self):
        return (_NoSync, ())


@contextlib.contextmanager
def _suspended(reducers: list):
    with contextlib.ExitStack() as stack:
        for reducer in reducers:
            stack.enter_context(reducer.no_sync())
        yield


def arming_hook(reducer_ref):
    def arm(grad_outputs) -> None:  # a prehook of an output's autograd node (holding no node: no cycle)
        reducer = reducer_ref()
        if reducer is not None:
            reducer.arm(running_node())

    return arm


def anchor_outputs(leaves: list, rebuild) -> tuple:
    """(the output rebuilt from ``leaves`` with its float tensors through :class:`_Anchored`, one of
    them), or (None, None) when it has none."""
    floats = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        return None, None
    anchor = torch.empty(0, requires_grad=True)
    for k, t in zip(floats, _Anchored.apply(anchor, *(leaves[k] for k in floats))):
        leaves[k] = t
    return rebuild(leaves), [leaves[floats[0]]]


class _Anchored(torch.autograd.Function):
    """Copies of ``tensors`` that need a grad through ``anchor`` (an empty leaf), so that a backward
    from them runs (and arms the reducer) on a rank whose forward used no trainable param."""

    @staticmethod
    def forward(ctx, anchor, *tensors):
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *grads)


class ParamHooks:
    """A bound reducer's hooks on its params, kept in its binding: each param that needs a grad gets
    them at bind, or before the first forward it needs one (torch refuses a hook on a frozen param:
    it gets its own once unfrozen; ``add_param_group`` appends params)."""

    def __init__(self, reducer: Reducer, binding: Binding):
        self._reducer, self._binding = weakref.ref(reducer), binding
        self._seen = 0  # params of the table looked at
        self._unhooked: list[int] = []  # frozen ones among them: no hook yet

    def hook(self, params: list) -> None:
        """Hook the params that need a grad and have no hook yet."""
        self._unhooked.extend(range(self._seen, len(params)))
        self._seen = len(params)
        reducer = self._reducer()
        if reducer is not None and any(params[i].requires_grad for i in self._unhooked):
            for i in [i for i in self._unhooked if params[i].requires_grad]:
                taking = params[i].register_post_accumulate_grad_hook(_GradHook(reducer, i))
                self._binding.keep(params[i].register_hook(_BeforeAccumulating(reducer, taking)))
                self._binding.keep(taking)
            self._unhooked = [i for i in self._unhooked if not params[i].requires_grad]


class _BeforeAccumulating(Hook):
    """A param's tensor hook: no stand-in may be in ``p.grad`` when autograd accumulates into it
    ([Note: p.grad stands in for the shards]); the reducer is held weakly. And the reducer's
    post-accumulate-grad hook (``taking``, which takes the grad out of ``p.grad``) runs after every
    other one of the param, registered before the bind or since: those see this rank's grad in
    ``p.grad``, as under DDP (torch runs them in their dict's insertion order: ours is put back last)."""

    __slots__ = ("_reducer", "_hooks", "_last")

    def __init__(self, reducer: Reducer, taking):
        self._reducer = weakref.ref(reducer)
        self._hooks, self._last = taking.hooks_dict_ref(), taking.id  # the param's own dict: no cycle

    def __call__(self, grad: torch.Tensor) -> None:
        reducer = self._reducer()
        if reducer is not None:
            reducer.settle(clear=True)
            hooks, last = self._hooks, self._last
            if len(hooks) > 1 and next(reversed(hooks)) != last and last in hooks:
                hooks[last] = hooks.pop(last)


class _GradHook(Hook):
    """Param ``i``'s post-accumulate-grad hook: hand the grad to the reducer (held weakly)."""

    __slots__ = ("_reducer", "_i")

    def __init__(self, reducer: Reducer, i: int):
        self._reducer, self._i = weakref.ref(reducer), i

    def __call__(self, p: torch.Tensor) -> None:
        reducer = self._reducer()
        if reducer is not None:
            reducer.on_grad(self._i, p)
