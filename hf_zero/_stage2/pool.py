"""Reduce buckets kept from one backward to the next: see [Note: bucket pool]."""

from __future__ import annotations

import torch


class BucketPool:
    """Reduce buckets kept from one backward to the next.

    [Note: bucket pool]
    A bucket allocated afresh for every bucket of a backward costs its pages again each time
    (on the CPU an allocation this large is mmapped and faulted in, and was zero-filled
    besides: most of stage 2's extra time over stage 1, measured by torch.profiler on the e2e
    GPT-2). So the buckets no wider than the cap come from a pool, all as wide as the widest
    such bucket of the plan (one size fits every bucket), and go back to it when reduced. The
    pool keeps at most ``keep`` free ones per (dtype, device): the buckets in flight plus the
    one being filled, what a backward holds at once anyway. Once a backward has taken as many
    pooled buckets as the one before took, no more will come from the pool: the free ones are
    let go then, and each given back after, not kept (GPT-2's tied embedding, the last grad of
    its backward, is reduced beside its own dense grad and the LM head's waiting one, the
    backward's peak: an idle bucket there is 25 MiB on it). When the backward ends (no bucket
    in use) the free ones are let go, and so is the reduce-scatters' receive scratch: between
    backwards, through the next forward (where the activations peak), a rank holds no reduce
    bucket, and each backward allocates at most ``keep`` of them (on CUDA from the caching
    allocator, which can hand the same memory to the forward's activations meanwhile). A
    pooled bucket is dirty: only the slots a grad is copied into are written, so its gaps
    are zeroed when it is taken and the slots of grads that never came when it is launched.
    A bucket wider than the cap (one large param whose grad could not be reduced in its own
    storage, or one whose grad never came on this rank) is allocated for its backward only,
    as dirty (``torch.empty``): the slots of grads that never came are zeroed in it too. The
    pool follows the plan: a new plan (trainability change) drops it.
    """

    def __init__(self, keep: int):
        self.keep = keep
        self.held_bytes = 0  # every pooled tensor, free or in use
        self.in_use = self._pooled_in_use = 0  # bytes of the reducer's buckets in use now, and of those the pool's
        self._unpooled_in_use = 0  # of those not the pool's (a bucket wider than the cap, a grad reduced in place)
        self.peak_held = 0  # the most :attr:`held` since the reducer's last step
        self._peak_in_use = self._peak_idle = 0  # since the last peaks(reset=True)
        self._width: dict[tuple, int] = {}  # (dtype, device) -> elements of each pooled bucket
        self._free: dict[tuple, list[torch.Tensor]] = {}
        # Pooled takes per (dtype, device): this backward's and the last backward's.
        self._taken: dict[tuple, int] = {}
        self._expected: dict[tuple, int] = {}

    def plan(self, buffers, sizes, cap_bytes: int) -> None:
        """Follow a new plan: the pooled width per (dtype, device) is its widest bucket, leaving out
        the buckets of one param above ``cap_bytes``."""
        width: dict[tuple, int] = {}
        for plan, n in zip(buffers, sizes):
            if len(plan.slots) > 1 or n * plan.dtype.itemsize <= cap_bytes:
                key = (plan.dtype, torch.device(plan.device))
                width[key] = max(width.get(key, 0), n)
        if width != self._width:
            self.held_bytes -= sum(t.nbytes for free in self._free.values() for t in free)
            self._free, self._width = {}, width
            self._expected = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A 1-D bucket of ``numel`` elements (not zeroed), and its pooled base (None: not pooled)."""
        key = (dtype, device)
        width = self._width.get(key, 0)
        if numel > width:
            return torch.empty(numel, dtype=dtype, device=device), None
        free = self._free.setdefault(key, [])
        if free:
            base = free.pop()
        else:
            base = torch.empty(width, dtype=dtype, device=device)
            self.held_bytes += base.nbytes
        self._taken[key] = self._taken.get(key, 0) + 1
        if self._taken[key] == self._expected.get(key):  # the last this backward will take
            self.held_bytes -= sum(t.nbytes for t in free)
            free.clear()
        return base[:numel], base

    def _done_taking(self, key: tuple) -> bool:
        """Whether this backward took as many pooled buckets of ``key`` as the last one did."""
        return key in self._expected and self._taken.get(key, 0) >= self._expected[key]

    @property
    def held(self) -> int:
        """Reduce-bucket memory held now: the buckets in use that are not the pool's, and the pool's."""
        return self._unpooled_in_use + self.held_bytes

    def reset_peak_held(self) -> None:
        """The reducer's step: :attr:`peak_held` counts from now."""
        self.peak_held = self.held

    def count(self, nbytes: int, *, pooled: bool) -> None:
        """A bucket of ``nbytes`` taken into use (``nbytes < 0``: given back; ``pooled``: the pool's); none in
        use (the backward's end): the free ones are let go."""
        self.in_use += nbytes
        if pooled:
            self._pooled_in_use += nbytes
        else:
            self._unpooled_in_use += nbytes
        self.peak_held = max(self.peak_held, self.held)
        self._peak_in_use = max(self._peak_in_use, self.in_use)
        self._peak_idle = max(self._peak_idle, self.idle_bytes())
        if self.in_use == 0:
            self.held_bytes -= sum(t.nbytes for free in self._free.values() for t in free)
            self._free = {}
            if self._taken:
                self._expected, self._taken = self._taken, {}

    def idle_bytes(self) -> int:
        """Pooled buckets not in use."""
        return self.held_bytes - self._pooled_in_use

    def peaks(self, reset: bool) -> dict[str, int]:
        out = {"buckets_in_flight": self._peak_in_use, "buckets_pooled": max(self._peak_idle, self.idle_bytes())}
        if reset:
            self._peak_in_use, self._peak_idle = self.in_use, self.idle_bytes()
        return out

    def give(self, base: torch.Tensor) -> None:
        """``base`` (from :meth:`take`) is free again: kept, or let go."""
        key = (base.dtype, base.device)
        free = self._free.setdefault(key, [])
        if base.numel() == self._width.get(key) and len(free) < self.keep and not self._done_taking(key):
            free.append(base)
        else:
            self.held_bytes -= base.nbytes
