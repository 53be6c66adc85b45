"""fp32 master weights for 16-bit params, sharded like the optimizer state.

[Note: master weights]
For a trainable bf16 or fp16 param (``master_weights`` on, the default), the rank that
owns a piece keeps an fp32 copy of it, the *master*: the local optimizer steps the
master, with the grad cast to fp32, and its state is fp32; the result is rounded (to
nearest even, ``Tensor.copy_``) into the param's 16-bit piece, which the parameter
sync then moves as 16-bit bytes. Updates smaller than half a 16-bit ulp accumulate in
the master instead of being rounded away.

A master is per-element state: once its param has been stepped it travels with the
optimizer state under the key ``"master_param"`` (fp32, the piece's shape), so
re-partitions, consolidated state dicts (a tensor of the param's full shape), sharded
checkpoints and elastic loads move it like any moment, bitwise. A param never stepped
has none: its master is its 16-bit value. Whenever pieces are (re)built, a master
starts from its saved value where that rounds to the param's current value, and from
the param's value where it does not (a param changed outside the optimizer, e.g.
while frozen): the 16-bit param is what the user sees, and a saved master that agrees
with it is never re-derived from it.

The same holds between steps, as with torch's optimizers: an in-place write to a 16-bit
param (``clamp_``, ``model.load_state_dict``, Trainer's ``load_best_model_at_end``, a
rollback, ``torch.nn.init``) is what the next step starts from. Each master notes its
param's version counter when it is made and whenever it follows; before each step (and
before its state is read for a checkpoint) a master whose param's counter moved
re-derives from the param the elements whose rounded value is no longer the param's,
and only those: the others keep their sub-ulp part. The counter is the param's own,
not its buffer's nor its piece's: setting ``param.data`` to a view of the buffer keeps
the param's counter apart from the buffer's, so hf_zero's own writes (the rounding into
the piece, a slice of ``param.data``, and the parameter sync's receives, blocking,
pipelined or overlapped, whenever they land) never move it, and every write through the param, or a view sharing its
counter (``detach()``, indexing, a module's ``state_dict()`` tensors), does. Nothing
has to be noted after the sync, on any path. Not seen: a write through ``param.data``,
a tensor with a counter of its own (e.g. ``p.data.clamp_()``); write through the param
under ``torch.no_grad()`` instead, or call ``refresh_trainable()`` after it (a rebuild
re-derives every master). Cost: one counter read per owned piece and step, under 0.004%
of the local step of the e2e bf16 model; comparing every owned element each step instead
would cost half that step or more (docs/benchmarks.md, "Following in-place edits").
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ._engine import version_of

MASTER_KEY = "master_param"
HALF_DTYPES = (torch.bfloat16, torch.float16)
CHOICES = ("auto", True, False)


def check_choice(master_weights: Any) -> bool:
    """Whether ``master_weights`` turns masters on; a clear ``ValueError`` for anything but
    ``"auto"``, ``True`` or ``False``."""
    if isinstance(master_weights, bool):
        return master_weights
    if isinstance(master_weights, str) and master_weights == "auto":
        return True
    raise ValueError(
        f"master_weights must be 'auto' (fp32 masters for bf16/fp16 params), True (the same) or False "
        f"(the local optimizer steps the 16-bit params), got {master_weights!r}"
    )


def needs_master(enabled: bool, param: torch.Tensor) -> bool:
    """Whether ``param`` is stepped through an fp32 master (16-bit dtypes only)."""
    return enabled and param.dtype in HALF_DTYPES


class Master:
    """The fp32 master of one 16-bit piece ``view`` (a view of ``param``)."""

    __slots__ = ("tensor", "view", "param", "version", "stepped")

    def __init__(self, view: torch.Tensor, saved: torch.Tensor | None, param: torch.Tensor):
        self.view = view
        self.param = param
        if saved is None:
            self.tensor = view.detach().to(torch.float32, copy=True)
        else:
            self.tensor = saved.to(device=view.device, dtype=torch.float32).reshape(view.shape)
            self._adopt_param()
        self.version = version_of(param)
        self.stepped = saved is not None

    def follow_edits(self, written: bool = False) -> None:
        """Adopt the param's values where it was written in place since the last call (see
        [Note: master weights]; ``written``: through an alias, [Note: writes through a state
        dict's aliases]): a no-op, one counter read, when it was not."""
        version = version_of(self.param)
        if version != self.version or written:
            self._adopt_param()
            self.version = version

    def _adopt_param(self) -> None:
        """Re-derive the elements whose rounded value is no longer the param's from the param."""
        stale = self.tensor.to(self.view.dtype) != self.view
        if bool(stale.any()):  # changed outside the optimizer: the param's value wins
            self.tensor[stale] = self.view[stale].to(torch.float32)

    def set_grad(self, grad: torch.Tensor | None) -> None:
        """``grad``: the piece's grad upcast to fp32 (any shape of the piece's numel), or None; the
        master's grad is then ``grad``, viewed as the master."""
        self.tensor.grad = None if grad is None else grad.view_as(self.tensor)

    def write_back(self) -> None:
        """Round the stepped master into the 16-bit piece."""
        self.view.copy_(self.tensor)
        self.stepped = True

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


# [Note: writes through a state dict's aliases]
# Under Trainer, ``model.state_dict()`` hands out bucket views as tensors with a storage object of
# their own over the same memory (``torch.from_dlpack``: [Note: views in a state dict] in _views.py),
# so that a save does not copy the model. Such an alias has a version counter of its own: a write
# through it (``model.state_dict()["w"].zero_()``) moves no counter of the param's, and a master
# would never see it. So each alias is watched: the counter's value when it was handed out is kept
# with a ``detach()`` of it (same memory, same counter, no copy), and before a step (and before a
# checkpoint reads the masters) a moved counter marks its param as written, whose masters then
# re-derive from it as after any other in-place write. The detach lives exactly as long as the alias:
# when the alias is collected, its counter is read one last time (a param written through it is
# marked) and the entry goes, so nothing here holds a user's storage past the tensors the user holds
# (a save's state dict, once written). With no alias watched the check is one test of an empty dict.
_ALIASES: dict[int, list] = {}  # a number -> [the alias's detach(), the counter seen, the param weakly]
_WRITTEN: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
_NUMBERS = iter(range(1 << 62))


def watch_alias(alias: torch.Tensor, param: torch.Tensor) -> None:
    """Have the masters of ``param`` follow in-place writes through ``alias``, a tensor over the same
    memory with a version counter of its own."""
    twin = alias.detach()
    key = next(_NUMBERS)
    _ALIASES[key] = [twin, version_of(twin), weakref.ref(param)]
    weakref.finalize(alias, _alias_gone, key).atexit = False


def _alias_gone(key: int) -> None:
    entry = _ALIASES.pop(key, None)
    if entry is not None:
        _note_written(entry)


def _note_written(entry: list) -> None:
    twin, version, param = entry
    if version_of(twin) != version:
        entry[1] = version_of(twin)
        p = param()
        if p is not None:
            _WRITTEN[id(p)] = p


def aliases_watched() -> bool:
    """Whether any alias is watched (or a write through one not yet followed)."""
    return bool(_ALIASES) or bool(_WRITTEN)


def written_through_aliases() -> "weakref.WeakValueDictionary[int, torch.Tensor]":
    """``id(param) -> param`` for the params written through a watched alias and not yet followed (the
    caller pops the params it followed)."""
    for entry in list(_ALIASES.values()):
        _note_written(entry)
    return _WRITTEN


def split_saved(state: dict) -> tuple[dict, torch.Tensor | None]:
    """A held state without its master, and the master (None when there is none)."""
    if MASTER_KEY not in state:
        return state, None
    rest = dict(state)
    return rest, rest.pop(MASTER_KEY)
