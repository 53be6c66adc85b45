"""The per-rank memory ledger: the bytes hf_zero holds on this rank, by what holds them.

[Note: memory ledger]
Each category is counted from the tensors that hold it, not estimated, and each storage is
counted once (bucket views share the flat buffer; a tied weight is one param):

- ``params``: the params' storages (the flat buffers, padding included, and frozen params);
- ``full_grads``: ``p.grad`` storages that are not DDP's buckets (stage 1 without
  ``gradient_as_bucket_view``: a second copy of the grads; stage 2: grads kept under
  ``no_sync()``);
- ``ddp_buckets``: DDP's gradient buckets (stage 1; as many bytes as the params DDP reduces; with
  ``gradient_as_bucket_view=True`` the ``p.grad`` are views of them);
- ``grad_shards``: stage 2's reduced grads, this rank's range of each bucket;
- ``buckets_in_flight``: stage 2's reduce buckets in use (being filled or reduce-scattered, a grad
  reduced in its own storage included); ``buckets_pooled``: pooled ones idle between uses;
- ``masters``: fp32 master weights of this rank's 16-bit pieces (parked ones included);
- ``optimizer_state``: the local optimizer's state tensors (moments, ``step``), parked ones included;
- ``upcast_scratch``: fp32 room the step upcasts 16-bit grads into; ``receive_scratch``: the
  reduce-scatters' receive buffer and, at stage 1, the staged copy of the bucket that carries the layout
  check; ``consolidation``: a consolidated state dict held for
  ``state_dict()``.

Peaks are the most each category held at the moments it was observed since the last reset: every
``memory_ledger()`` call, and, from the first call on, before and after every step (the grads are whole
before it, the state after it); stage 2's reduce buckets are observed at every change. Counting walks
every param and grad, which a step that nobody asked about does not pay for. ``total`` is the sum now;
``peak_total`` the sum of the peaks (an upper bound: categories peak at different moments).
Activations, autograd's buffers and the allocator's cache are not hf_zero's and are not counted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable

import torch

CATEGORIES = ("params", "full_grads", "ddp_buckets", "grad_shards", "buckets_in_flight", "buckets_pooled",
              "masters", "optimizer_state", "upcast_scratch", "receive_scratch", "consolidation")
# What the ZeRO paper calls model states: everything but transient buffers and scratch.
MODEL_STATES = ("params", "full_grads", "ddp_buckets", "grad_shards", "masters", "optimizer_state")


@dataclass(frozen=True)
class MemoryLedger:
    """Bytes hf_zero holds on this rank now, per category, and ``peaks`` (the most each held since the
    last reset). See [Note: memory ledger] in ``hf_zero/_ledger.py`` for what each category counts."""

    params: int = 0
    full_grads: int = 0
    ddp_buckets: int = 0
    grad_shards: int = 0
    buckets_in_flight: int = 0
    buckets_pooled: int = 0
    masters: int = 0
    optimizer_state: int = 0
    upcast_scratch: int = 0
    receive_scratch: int = 0
    consolidation: int = 0
    peaks: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Every category's bytes now."""
        return sum(getattr(self, c) for c in CATEGORIES)

    @property
    def model_states(self) -> int:
        """Params, grads (whole, DDP's buckets, shards), masters and optimizer state now."""
        return sum(getattr(self, c) for c in MODEL_STATES)

    @property
    def peak_model_states(self) -> int:
        """The sum of the model-state categories' peaks: after a step, what a steady step holds just before
        its optimizer step (the grads then, the optimizer state after the first step)."""
        return sum(self.peaks.get(c, 0) for c in MODEL_STATES)

    @property
    def peak_total(self) -> int:
        """The sum of the categories' peaks (an upper bound of the peak of their sum)."""
        return sum(self.peaks.get(c, 0) for c in CATEGORIES)

    def as_dict(self) -> dict:
        """Plain values: each category, ``total``, ``model_states``, ``peak_model_states``, ``peak_total`` and
        ``peaks``."""
        out = asdict(self)
        out.update(total=self.total, model_states=self.model_states, peak_model_states=self.peak_model_states,
                   peak_total=self.peak_total)
        return out

    def format(self) -> str:
        """One line: the non-zero categories in MiB, now (peak)."""
        parts = [f"{c} {getattr(self, c) / 2**20:.1f} ({self.peaks.get(c, 0) / 2**20:.1f})"
                 for c in CATEGORIES if getattr(self, c) or self.peaks.get(c)]
        return f"hf_zero memory MiB now (peak): total {self.total / 2**20:.1f}; " + ", ".join(parts)


class Peaks:
    """The most bytes each category held at the moments observed since the last :meth:`reset`."""

    def __init__(self, now=None):
        self._peak: dict[str, int] = {}
        self._now = now  # owner -> category -> bytes now
        self.watching = False  # steps observe from the first ledger on

    def observe_step(self, owner) -> None:
        """A step's moment: observed once a ledger was asked for (counting walks every param and grad)."""
        if self.watching:
            self.observe(self._now(owner))

    def observe(self, now: dict) -> dict:
        """Fold ``now`` (category -> bytes) in; the peaks so far."""
        for k, v in now.items():
            if v > self._peak.get(k, 0):
                self._peak[k] = v
        return dict(self._peak)

    def reset(self) -> None:
        self._peak = {}


def storage_bytes(tensors: Iterable[torch.Tensor | None], skip: set[int] = frozenset()) -> int:
    """Bytes of the distinct storages under ``tensors`` (None skipped), each counted once, leaving
    out those whose storage's data pointer is in ``skip``."""
    seen, total = set(skip), 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def state_bytes(states: Iterable[dict], skip_key: str) -> int:
    """Bytes of the tensors in optimizer state dicts, leaving out ``skip_key`` (the masters)."""
    return sum(v.nbytes for st in states for k, v in st.items() if k != skip_key and isinstance(v, torch.Tensor))


def tensors_in(obj) -> list[torch.Tensor]:
    """Every tensor in a nested dict / list / tuple (a consolidated state dict)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    return []
