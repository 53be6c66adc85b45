"""A drop-in for torch's ZeroRedundancyOptimizer: its constructor, step(closure, **kwargs),
local param-group changes written back, and Join with uneven inputs."""

import inspect

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_zero import ZeroBucketOptimizer
from tests._dist import run_ranks
from tests.models import BATCH, MLP, shard_of


class HalvingSGD(torch.optim.SGD):
    """Halves its own learning rate after every step (an 'adaptive' local optimizer)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            group["lr"] *= 0.5
        return loss


class ScaledSGD(torch.optim.SGD):
    """Takes a step keyword argument, as some optimizers do."""

    @torch.no_grad()
    def step(self, closure=None, *, scale=1.0):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * scale)


def _groups(model):
    return [
        {"params": list(model.net.parameters())},
        {"params": [model.scale], "lr": 0.05},  # 3 elements: one rank owns nothing of this group
    ]


def test_constructor_takes_torch_zero_arguments():
    ours = inspect.signature(ZeroBucketOptimizer).parameters
    torch_zero = inspect.signature(ZeroRedundancyOptimizer).parameters
    assert [n for n in torch_zero if n != "defaults"] == [n for n in ours if n in torch_zero and n != "defaults"]
    model = MLP()
    ZeroBucketOptimizer(model.parameters(), torch.optim.SGD, None, False, False, lr=0.1)  # torch's positional order
    with pytest.raises(ValueError, match="overlap_with_ddp=True .* not supported .* pass overlap_with_ddp=False"):
        ZeroBucketOptimizer(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)


def _run(rank, world_size, optimizer_class, step_kwargs, steps=3):
    torch.manual_seed(0)
    model = MLP()
    ddp = DDP(model, find_unused_parameters=True)  # MLP.unused gets no grad
    opt = ZeroBucketOptimizer(_groups(model), optimizer_class, lr=0.1)
    for step in range(steps):
        loss = ddp(*shard_of(model.batch(step, BATCH * world_size), rank))
        loss.backward()
        opt.step(**step_kwargs)
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], [g["lr"] for g in opt.param_groups]


def _plain(optimizer_class, step_kwargs, world_size, steps=3):
    torch.manual_seed(0)
    model = MLP()
    opt = optimizer_class(_groups(model), lr=0.1)
    for step in range(steps):
        model(*model.batch(step, BATCH * world_size)).backward()
        opt.step(**step_kwargs)
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], [g["lr"] for g in opt.param_groups]


@pytest.mark.parametrize(
    "optimizer_class, step_kwargs",
    [(HalvingSGD, {}), (ScaledSGD, {"scale": 0.5})],
    ids=["local lr changes written back", "step kwargs forwarded"],
)
@pytest.mark.timeout(60)
def test_local_optimizer_behaves_as_in_plain_torch(optimizer_class, step_kwargs):
    want_params, want_lrs = _plain(optimizer_class, step_kwargs, 2)
    for got_params, got_lrs in run_ranks(_run, 2, optimizer_class, step_kwargs, timeout=50):
        assert got_lrs == want_lrs
        for got, want in zip(got_params, want_params):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if optimizer_class is HalvingSGD:
        assert want_lrs == [0.1 / 8, 0.05 / 8]


def _uneven(rank, world_size, kind):
    """Rank r trains 2 + r steps inside Join (DDP and the optimizer both joinable)."""
    torch.manual_seed(0)
    model = MLP()
    del model.unused  # every param gets a grad: DDP's join hook assumes it without find_unused_parameters
    ddp = DDP(model)
    if kind == "torch":
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05)
    else:
        opt = ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, shard="param", lr=0.05)
    with Join([ddp, opt]):
        for step in range(2 + rank):
            loss = ddp(*shard_of(model.batch(step, BATCH * world_size), rank))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
    dist.barrier()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.reliability("Join with uneven inputs (rank r runs 2 + r steps), 3 ranks", "no hang; parameters equal on all ranks and equal to torch's ZeroRedundancyOptimizer")
@pytest.mark.timeout(200)
def test_join_with_uneven_inputs_matches_torch_zero():
    ours = run_ranks(_uneven, 3, "hf_zero", timeout=90)
    theirs = run_ranks(_uneven, 3, "torch", timeout=90)
    for got in ours[1:]:
        for a, b in zip(got, ours[0]):
            assert torch.equal(a, b), "replicas differ"
    for a, b in zip(ours[0], theirs[0]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


class SGDWithStepKWArg(torch.optim.SGD):
    """torch's test_step_with_kwargs optimizer: its step takes a closure it ignores and a kwarg."""

    def step(self, closure=None, dummy_kwarg=None):
        super().step()
        dummy_kwarg.append((closure, 5))
        return "inner loss"


def test_step_with_kwargs_forwards_a_non_callable_closure():
    # torch's own test_step_with_kwargs: o.step(0, dummy_kwarg=...) reaches the local step.
    seen = []
    x = torch.tensor([1.0], requires_grad=True)
    o = ZeroBucketOptimizer([x], optimizer_class=SGDWithStepKWArg, lr=0.1)
    x.backward()
    assert o.step(0, dummy_kwarg=seen) == "inner loss"
    assert seen == [(0, 5)]
    assert torch.equal(x.detach(), torch.tensor([0.9]))


def test_step_runs_a_callable_closure_once_itself():
    calls = []
    x = torch.tensor([1.0], requires_grad=True)
    o = ZeroBucketOptimizer([x], optimizer_class=ScaledSGD, lr=0.1)

    def closure():
        calls.append(1)
        loss = (x * 2).sum()
        loss.backward()
        return loss

    loss = o.step(closure, scale=0.5)
    assert calls == [1] and loss.item() == 2.0
    assert torch.equal(x.detach(), torch.tensor([0.9]))  # 1 - 0.1 * 0.5 * 2
