"""Property: moving optimizer state from one layout to another keeps every element.

N ranks are simulated by N threads sharing an in-memory exchange, so the real
``state.redistribute`` runs unchanged over random shapes, masks, modes and world sizes.
"""

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_zero._layout import ParamSpec, plan_layout
from hf_zero._state import Holding, move, plan_moves, redistribute, split_canonical


class _Exchange:
    def __init__(self, n):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=20)
        self.slots = [None] * n

    def gather(self, rank, obj):
        self.slots[rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class _ThreadComm:
    device = torch.device("cpu")

    def __init__(self, exchange, rank):
        self.exchange, self.rank, self.world_size = exchange, rank, exchange.n

    def all_gather_object(self, obj):
        return self.exchange.gather(self.rank, obj)

    def all_to_all(self, send, recv_sizes, *, dtype, device):
        everyone = self.exchange.gather(self.rank, [t.clone() for t in send])
        got = [everyone[src][self.rank] for src in range(self.world_size)]
        assert [t.numel() for t in got] == list(recv_sizes)
        return got

    def release_completed_works(self):
        pass


def _canonical(i, numel):
    return {
        "exp_avg": torch.arange(numel, dtype=torch.float64) + 1000.0 * i,
        "exp_avg_sq": torch.arange(numel, dtype=torch.float32) * -1.0 - i,
        "step": torch.tensor(float(i + 1)),
    }


def _run(world_size, numels, old_mask, new_mask, old_shard, new_shard, release=False):
    specs = lambda mask: [ParamSpec(n, torch.float64, "cpu", m) for n, m in zip(numels, mask)]
    old = plan_layout(specs(old_mask), world_size=world_size, shard=old_shard)
    new = plan_layout(specs(new_mask), world_size=world_size, shard=new_shard)
    slotted = old.slots()
    targets = {}
    for r, pieces in enumerate(new.all_pieces()):
        for pc in pieces:
            targets.setdefault(pc.index, []).append((r, pc.start, pc.stop))

    def held_by(rank):
        held = {}
        for pc in old.pieces(rank):
            state = split_canonical(_canonical(pc.index, numels[pc.index]), (numels[pc.index],), pc.start, pc.stop, (pc.numel,))
            held.setdefault(pc.index, []).append(Holding(pc.start, pc.stop, (pc.numel,), state))
        for i, n in enumerate(numels):  # frozen params' state parked whole on rank i % N
            if i not in slotted and i % world_size == rank:
                held[i] = [Holding(0, n, (n,), _canonical(i, n))]
        return held

    exchange, results, errors = _Exchange(world_size), [None] * world_size, []

    given_up = [None] * world_size

    def worker(rank):
        try:
            comm, held = _ThreadComm(exchange, rank), held_by(rank)
            if not release:
                results[rank] = redistribute(comm, held, targets, numels=dict(enumerate(numels)),
                                             device_of=lambda i: torch.device("cpu"))
                return
            # A rebuild's way: checked first, then the holdings are given up as the state moves.
            moves = plan_moves(comm, held, targets, numels=dict(enumerate(numels)))
            results[rank] = move(comm, moves, held, device_of=lambda i: torch.device("cpu"), reuse_own=True,
                                 release=True)
            given_up[rank] = held
        except BaseException as e:  # surfaced below
            errors.append(e)
            exchange.barrier.abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    for rank, held in enumerate(given_up):
        for i, hs in (held or {}).items():
            for h in hs:  # emptied once read, unless its tensors became the rank's new state whole
                mine = (rank, h.start, h.stop) in targets.get(i, [])
                assert i not in targets or not h.state or mine, (rank, i, h.start, h.stop)
    return targets, results


@pytest.mark.reliability("Property: state migration between random layouts (world size 1-9, flat/param, random masks)", "every element arrives once, unchanged")
@settings(max_examples=40, deadline=None)
@given(
    world_size=st.integers(1, 9),
    params=st.lists(st.tuples(st.integers(1, 300), st.booleans(), st.booleans()), min_size=1, max_size=12),
    old_shard=st.sampled_from(["flat", "param"]),
    new_shard=st.sampled_from(["flat", "param"]),
    release=st.booleans(),
)
def test_migration_preserves_every_element(world_size, params, old_shard, new_shard, release):
    numels = [n for n, _, _ in params]
    old_mask = [a for _, a, _ in params]
    new_mask = [b for _, _, b in params]
    targets, results = _run(world_size, numels, old_mask, new_mask, old_shard, new_shard, release)
    for i, wanted in targets.items():
        full = _canonical(i, numels[i])
        covered = 0
        for rank, start, stop in wanted:
            (h,) = [h for h in results[rank].get(i, []) if h.start == start]
            assert h.stop == stop
            assert torch.equal(h.state["exp_avg"], full["exp_avg"][start:stop])
            assert torch.equal(h.state["exp_avg_sq"], full["exp_avg_sq"][start:stop])
            assert h.state["exp_avg_sq"].dtype == torch.float32
            assert h.state["step"].item() == i + 1
            covered += stop - start
        assert covered == numels[i]
    untargeted = {i for r in results for i in r} - set(targets)
    assert not untargeted


def test_blob_state_cannot_be_split():
    """A non-elementwise state (Adafactor's factored rows) only moves with a whole param."""
    exchange = _Exchange(2)
    held = [{0: [Holding(0, 6, (2, 3), {"row": torch.ones(2)})]}, {}]
    errors = []

    def worker(rank):
        try:
            redistribute(_ThreadComm(exchange, rank), held[rank], {0: [(0, 0, 3), (1, 3, 6)]},
                         numels={0: 6}, device_of=lambda i: torch.device("cpu"))
        except ValueError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(errors) == 2 and all("cannot be split" in e for e in errors)
