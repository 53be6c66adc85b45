"""The only module that calls torch.distributed.

Every function is a collective over ``group`` unless it says otherwise; every rank
must call it with arguments of the same shape, in the same order.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Sequence

import torch
import torch.distributed as dist


@contextlib.contextmanager
def _named(op: str, rank: int):
    """Say which hf_zero operation a failed or timed-out collective belonged to."""
    try:
        yield
    except RuntimeError as e:
        raise RuntimeError(f"hf_zero: collective for {op} failed on rank {rank}: {e}") from e


class Comm:
    """A process group (or none: world size 1) and the collectives hf_zero needs."""

    def __init__(self, process_group=None):
        self.group = process_group
        self.enabled = dist.is_available() and dist.is_initialized()
        if not self.enabled:
            if process_group is not None:
                raise ValueError("process_group was given but torch.distributed is not initialized")
            self.rank, self.world_size, self.backend = 0, 1, None
            return
        self.rank = dist.get_rank(process_group)
        if self.rank < 0:
            raise ValueError(
                f"process_group does not contain this process (global rank {dist.get_rank()})"
            )
        self.world_size = dist.get_world_size(process_group)
        self.backend = str(dist.get_backend(process_group)).lower()
        # See [Note: sync collective]; an attribute so tests can take either path on gloo.
        self.sync_by_all_gather = self.backend == "nccl"
        self._globals = [
            r if process_group is None else dist.get_global_rank(process_group, r)
            for r in range(self.world_size)
        ]

    @property
    def process_group(self):
        """The group hf_zero shards over (``dist.group.WORLD`` for the default; None without torch.distributed)."""
        if not self.enabled:
            return None
        return self.group if self.group is not None else dist.group.WORLD

    @property
    def device(self) -> torch.device:
        """Where small control tensors live for this backend."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- parameter sync ---------------------------------------------------------
    def sync_buffer(self, buffer: torch.Tensor, bounds: Sequence[int]) -> None:
        """Give every rank the whole ``buffer``; rank r holds the truth in ``bounds[r]:bounds[r+1]``.

        [Note: sync collective]
        Measured on gloo (docs/architecture.md, field facts), one broadcast per rank beats all_gather by
        2-8x; NCCL's all_gather_into_tensor is its fastest path. So equal ranges on
        NCCL use one in-place all-gather, everything else one broadcast per rank.
        """
        if self.world_size == 1:
            return
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        if self.sync_by_all_gather and len(set(sizes)) == 1:
            lo, hi = bounds[self.rank], bounds[self.rank + 1]
            # torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single.
            all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            with _named("the parameter sync", self.rank):
                all_gather(buffer, buffer[lo:hi], group=self.group)
            return
        with _named("the parameter sync", self.rank):
            works = [
                dist.broadcast(buffer[a:b], src=self._globals[r], group=self.group, async_op=True)
                for r, (a, b) in enumerate(zip(bounds, bounds[1:]))
                if b > a
            ]
            for w in works:
                w.wait()

    # -- agreement ----------------------------------------------------------------
    def agree(self, fingerprint: int, flag: bool = False) -> tuple[bool, bool]:
        """(every rank passed the same 62-bit ``fingerprint``, some rank passed ``flag``).

        One all-reduce of three int64s: max of x, of -x and of the flag.
        """
        if self.world_size == 1:
            return True, flag
        t = torch.tensor([fingerprint, -fingerprint, int(flag)], dtype=torch.int64, device=self.device)
        with _named("the cross-rank layout agreement check", self.rank):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t[0]) == -int(t[1]), bool(t[2])

    def all_gather_object(self, obj: Any) -> list:
        """Small metadata only (rebuilds, errors): pickled."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        with _named("a metadata exchange", self.rank):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    # -- gradients ----------------------------------------------------------------
    def average_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Average the ``.grad`` of ``params`` over ranks, one all-reduce per (device, dtype).

        A grad missing on a rank counts as zero there; a grad missing on every rank
        stays ``None`` (a count of present grads rides in the same buffer).
        """
        if self.world_size == 1 or not params:
            return
        by_key: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            by_key.setdefault((p.device, p.dtype), []).append(p)
        for (device, dtype), ps in by_key.items():
            flat = torch.zeros(sum(p.numel() for p in ps) + len(ps), dtype=dtype, device=device)
            offset = len(ps)
            for k, p in enumerate(ps):
                if p.grad is not None:
                    flat[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
                    flat[k] = 1
                offset += p.numel()
            with _named("averaging grads DDP does not reduce", self.rank):
                dist.all_reduce(flat, group=self.group)
            present = flat[: len(ps)].tolist()
            flat.div_(self.world_size)
            offset = len(ps)
            for k, p in enumerate(ps):
                g = flat[offset : offset + p.numel()].view(p.shape)
                offset += p.numel()
                if present[k] == 0:
                    p.grad = None
                elif p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)

    # -- state movement -------------------------------------------------------------
    def all_to_all(self, send: Sequence[torch.Tensor], recv_sizes: Sequence[int], *, dtype, device) -> list[torch.Tensor]:
        """Send ``send[r]`` (1-D) to rank r; receive ``recv_sizes[r]`` elements from rank r."""
        if self.world_size == 1:
            return [send[0].clone()]
        send_sizes = [t.numel() for t in send]
        inp = torch.cat(list(send)) if send else torch.empty(0, dtype=dtype, device=device)
        out = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
        with _named("moving optimizer state between ranks", self.rank):
            dist.all_to_all_single(out, inp, list(recv_sizes), send_sizes, group=self.group)
        return list(out.split(list(recv_sizes)))

    def barrier(self) -> None:
        if self.world_size > 1:
            with _named("a barrier", self.rank):
                dist.barrier(group=self.group)


def fingerprint(items: Sequence[Any]) -> int:
    """A 62-bit hash of ``repr(items)``, stable across processes (unlike ``hash``)."""
    digest = hashlib.blake2b(repr(items).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2
