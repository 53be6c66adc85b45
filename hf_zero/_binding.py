"""What one run attaches to a user's module and its params, held in one place and removed at its end.

[Note: a binding ends with its run]
torch's DDP ``Reducer`` registers its autograd hooks in one place and removes them in its
destructor: drop the DDP wrapper and the module is plain again. hf_zero's stage 2 hooks the
user's own module (per-param hooks, forward hooks, ``no_sync``), and its integrations hook the
unwrapped model under stage 1 too (the grad averaging and freeze guard of
``integrations/_backward.py``, the state-dict hook that gives bucket views their own storage,
the overlapped sync's forward hooks). All of it goes through one :class:`Binding` per optimizer:
it keeps every ``RemovableHandle`` and every attribute it set, and :meth:`Binding.close` removes
them, leaving the module's hooks and attributes those of a module never bound. The optimizer
closes it in ``unbind()`` and when it is garbage-collected (``weakref.finalize``); the Trainer
wiring at ``on_train_end``, the Accelerate wiring at ``end_training`` / ``free_memory`` /
``clear``. A later bind opens it again (a second Trainer on the same model).

[Note: a newer binding takes over]
One param's grads can feed one gradient path only: stage 2's reducer takes each grad out of
``p.grad`` as the backward makes it, and DDP takes one comm hook. A binding left by a run that
never ended (an interrupted ``train()`` whose Trainer a notebook's traceback keeps, a linear probe's
optimizer prepared on the same Accelerator before the full fine-tune's, a plain loop binding a
second optimizer) would take the grads first, and the newer one would reduce what it left: NaN.
So each binding *claims* its optimizer's params when it binds (:meth:`Binding.claim`), and every
older open binding over any of them is *taken over*: its owner unbinds (its ``end``) and stays
marked :attr:`Binding.taken_over`, so that the integrations do not bind it again and a stage-2
step of it refuses, naming the fix, instead of stepping nothing. Binding it again explicitly
(``bind_module`` / ``bind_ddp``) takes it back: the newest binding wins. The claims are a
module-level table of weak references (param, binding): it holds no user object alive.

Hooks keep nothing alive (their owner is held weakly) and copy as nothing: a :class:`Hook`
pickles and deep-copies as :func:`inert`, a no-op, so ``torch.save(model)`` and
``copy.deepcopy(model)`` of a bound model work and the copy is not bound. (A param's
post-accumulate-grad hooks are not copied by torch at all.) Per step nothing is added: hooks
are registered once per bind.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable


def inert(*args: Any, **kwargs: Any) -> None:
    """What a copied :class:`Hook` becomes: a hook that does nothing."""
    return None


def _inert() -> Callable[..., None]:
    return inert


class Hook:
    """Base of hf_zero's hooks on user objects: pickled or deep-copied, a hook is :func:`inert`
    (the copy of a bound module is not bound)."""

    __slots__ = ("__weakref__",)
    __torch_unserializable__ = True  # a param's tensor hook: torch.save leaves it out without a warning

    def __reduce__(self):
        return (_inert, ())


# id(param) -> (the param, the binding that claimed it), both weakly ([Note: a newer binding takes over])
_CLAIMS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _claimant(param: Any) -> "Binding | None":
    entry = _CLAIMS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def claimants(params) -> list["Binding"]:
    """The open bindings that claimed any of ``params`` ([Note: a newer binding takes over])."""
    found: list[Binding] = []
    for p in params:
        b = _claimant(p)
        if b is not None and b not in found:
            found.append(b)
    return found


class Binding:
    """The hook handles and attributes one optimizer attached to user objects (see
    [Note: a binding ends with its run]). Holds no user object alive. ``end``: what ends the
    owner's binding when a newer one takes over ([Note: a newer binding takes over]; default
    :meth:`close`), held weakly when it is a bound method."""

    def __init__(self, end: Callable[[], None] | None = None) -> None:
        self._handles: list = []
        self._attributes: list[tuple[weakref.ref, str, Any]] = []
        self._on_close: list[Callable[[], None]] = []
        self._once: set = set()  # (weakref to an object, what) registered by once()
        self._end = weakref.WeakMethod(end) if hasattr(end, "__self__") else (lambda: end) if end else None
        self._claimed: list[int] = []  # ids of the params claimed, until close()
        self.taken_over = False  # a newer binding over its params took over, and it was not bound again since

    def claim(self, params) -> list["Binding"]:
        """Serve ``params`` from now on: every other open binding over any of them is taken over
        first (its owner's binding ends). Returns those taken over."""
        older = [b for b in claimants(params) if b is not self]
        for other in older:
            other.take_over()
        for key in [k for k, (p, b) in _CLAIMS.items() if p() is None or b() is None]:
            del _CLAIMS[key]  # params or bindings gone
        me = weakref.ref(self)
        for p in params:
            if _claimant(p) is not self:
                _CLAIMS[id(p)] = (weakref.ref(p), me)
                self._claimed.append(id(p))
        self.taken_over = False
        return older

    def take_over(self) -> None:
        """A newer user of its params took over: end the owner's binding and mark it :attr:`taken_over`."""
        end = self._end() if self._end is not None else None
        (end or self.close)()
        self.close()
        self.taken_over = True

    @property
    def empty(self) -> bool:
        """Whether nothing is attached."""
        return not (self._handles or self._attributes or self._on_close)

    def keep(self, handle):
        """Keep ``handle`` (a ``RemovableHandle``) until :meth:`close`; returns it."""
        self._handles.append(handle)
        return handle

    def once(self, obj: Any, what: str, register: Callable[[], Any]) -> None:
        """Keep ``register()``'s handle unless ``what`` is registered on ``obj`` already (until :meth:`close`)."""
        key = (weakref.ref(obj), what)
        if key not in self._once:
            self.keep(register())
            self._once.add(key)

    def set_attribute(self, obj: Any, name: str, value: Any) -> None:
        """``setattr(obj, name, value)``, deleted again at :meth:`close` (if still ``value``)."""
        setattr(obj, name, value)
        self._attributes.append((weakref.ref(obj), name, value))

    def adopt_attribute(self, obj: Any, name: str) -> None:
        """Delete ``obj``'s instance attribute ``name`` (set by another library because of this binding) at
        :meth:`close`, if it is still the value it has now."""
        self._attributes.append((weakref.ref(obj), name, obj.__dict__[name]))

    def on_close(self, undo: Callable[[], None]) -> None:
        """Call ``undo`` at :meth:`close` (before the handles are removed), once."""
        self._on_close.append(undo)

    def close(self) -> None:
        """Remove every hook and attribute kept, and give up the params claimed; idempotent."""
        claimed, self._claimed = self._claimed, []
        for key in claimed:
            entry = _CLAIMS.get(key)
            if entry is not None and entry[1]() is self:
                del _CLAIMS[key]
        undo, self._on_close = self._on_close, []
        for fn in reversed(undo):
            fn()
        handles, self._handles = self._handles, []
        self._once = set()
        for handle in reversed(handles):
            handle.remove()
        attributes, self._attributes = self._attributes, []
        for ref, name, value in reversed(attributes):
            obj = ref()
            if obj is not None and getattr(obj, "__dict__", {}).get(name) is value:
                delattr(obj, name)
