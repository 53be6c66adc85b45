"""Under stage 2, a backward that writes no ``.grad`` (``torch.autograd.grad``; a forward under
``torch.func``) runs no collective and leaves training as DDP + torch AdamW: a saliency map on
rank 0 alone between steps, a gradient-norm penalty, GradNorm, a diagnostic with
``retain_graph=True`` before the real backward, MAML's inner step, per-sample grads.

Each scenario runs on 2 gloo ranks twice in the same processes: the reference (DDP + torch
AdamW; where DDP cannot run the pattern, MAML and per-sample grads through
``functional_call``, the unwrapped module with its grads averaged by an all-reduce, which is
what DDP computes) and a stage-2 ZeroBucketOptimizer of the same AdamW bound to the unwrapped
module. Float64; params and every value read along the way must agree to an ulp.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.func import functional_call, grad, vmap
from torch.nn.parallel import DistributedDataParallel as DDP

from tests._dist import run_ranks
from tests.models import flat_tensors
from tests.models import rank_batch as _data
from tests.models import tanh_mlp as _mlp

STEPS = 3
LR = dict(lr=0.05, weight_decay=0.1)


def _wrap(module: nn.Module, mode: str):
    """(the module to call, its optimizer): "ddp" (DDP + torch AdamW), "manual" (the unwrapped module
    + torch AdamW; the scenario averages the grads), "stage2" (bound to the unwrapped module)."""
    if mode == "stage2":
        from hf_zero import ZeroBucketOptimizer

        opt = ZeroBucketOptimizer(list(module.parameters()), torch.optim.AdamW, stage=2,
                                  parameters_as_bucket_view=False, **LR)
        opt.bind_module(module, bucket_cap_mb=0.0005)
        return module, opt
    opt = torch.optim.AdamW(module.parameters(), **LR)
    return (DDP(module) if mode == "ddp" else module), opt


def _average_if(mode: str, module: nn.Module) -> None:
    if mode == "manual":
        for p in module.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def _state(module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in (*module.parameters(), *module.buffers())]


def _saliency_on_rank_0(rank, mode):
    """A callback on rank 0 alone computes a saliency map between steps (under DDP on the unwrapped
    module, as Trainer's callbacks get it)."""
    model = _mlp(1)
    m, opt = _wrap(model, mode)
    seen = []
    for step in range(STEPS):
        m(_data(step, rank, 4, 5)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            x = _data(step + 30, rank, 2, 5).requires_grad_()
            seen.append(torch.autograd.grad(model(x).sum(), x)[0])
    return _state(model), seen


def _penalty_on_params(rank, mode):
    """A gradient-norm penalty on the params' grads (create_graph=True), then one backward of both."""
    model = _mlp(2)
    m, opt = _wrap(model, mode)
    for step in range(STEPS):
        loss = m(_data(step, rank, 4, 5)).square().mean()
        grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        (loss + 0.1 * sum(g.square().sum() for g in grads)).backward()
        opt.step()
        opt.zero_grad()
    return _state(model)


class TwoTasks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.shared, self.a, self.b = nn.Linear(5, 6), nn.Linear(6, 1), nn.Linear(6, 1)
        self.double()

    def forward(self, x):
        h = torch.tanh(self.shared(x))
        return self.a(h), self.b(h)


def _gradnorm(rank, mode):
    """GradNorm: each task loss's grad norm on the shared layer (retain_graph, create_graph) enters the loss."""
    model = TwoTasks()
    m, opt = _wrap(model, mode)
    norms = []
    for step in range(STEPS):
        ya, yb = m(_data(step, rank, 4, 5))
        la, lb = ya.square().mean(), (yb - 1).square().mean()
        ga, gb = (torch.autograd.grad(l, model.shared.weight, retain_graph=True, create_graph=True)[0].norm()
                  for l in (la, lb))
        norms.append(torch.stack([ga, gb]).detach())
        (la + lb + (ga - gb).abs()).backward()
        opt.step()
        opt.zero_grad()
    return _state(model), norms


def _diagnostic_before_backward(rank, mode):
    """This rank's local grads read with retain_graph=True, then the real backward."""
    model = _mlp(4)
    m, opt = _wrap(model, mode)
    local = []
    for step in range(STEPS):
        loss = m(_data(step, rank, 4, 5)).square().mean()
        local.append([g.clone() for g in torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)])
        loss.backward()
        opt.step()
        opt.zero_grad()
    return _state(model), local


def _maml(rank, mode):
    """MAML: an inner step on the support set (create_graph=True), the outer loss on the query set
    through the adapted weights (functional_call of the model)."""
    model = _mlp(5)
    m, opt = _wrap(model, "manual" if mode == "ddp" else mode)
    for step in range(STEPS):
        params = dict(model.named_parameters())
        inner = m(_data(step, rank, 4, 5)).square().mean()
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
        fast = {n: p - 0.1 * g for (n, p), g in zip(params.items(), grads)}
        functional_call(model, fast, (_data(step + 40, rank, 4, 5),)).square().mean().backward()
        _average_if("manual" if mode == "ddp" else mode, model)
        opt.step()
        opt.zero_grad()
    return _state(model)


def _per_sample_grads(rank, mode):
    """Per-sample grads (torch.func: vmap of grad of functional_call) before the first ordinary step
    and between steps, then training as usual."""
    model = _mlp(6)
    m, opt = _wrap(model, mode)

    def loss_of(params, x):
        return functional_call(model, params, (x.unsqueeze(0),)).square().sum()

    per_sample = []
    for step in range(STEPS):
        params = {n: p.detach() for n, p in model.named_parameters()}
        per_sample.append(vmap(grad(loss_of), in_dims=(None, 0))(params, _data(step + 60, rank, 3, 5)))
        m(_data(step, rank, 4, 5)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return _state(model), per_sample


SCENARIOS = {
    "saliency-on-rank-0-between-steps": _saliency_on_rank_0,
    "gradient-norm-penalty-on-params": _penalty_on_params,
    "gradnorm-shared-layer": _gradnorm,
    "diagnostic-retain-graph-before-backward": _diagnostic_before_backward,
    "maml-inner-step": _maml,
    "per-sample-grads-torch-func": _per_sample_grads,
}


def _run(rank, world_size, names):
    out = {}
    for name in names:
        try:
            out[name] = [SCENARIOS[name](rank, mode) for mode in ("ddp", "stage2")]
        except Exception as e:  # reported per scenario, not as the whole spawn's failure
            out[name] = f"{type(e).__name__}: {e}"
    return out


_RESULTS: dict = {}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", SCENARIOS)
def test_a_backward_writing_no_grad_runs_no_collective_and_training_equals_ddp(name):
    if not _RESULTS:
        _RESULTS.update(enumerate(run_ranks(_run, 2, list(SCENARIOS), timeout=150)))
    for rank, per_rank in _RESULTS.items():
        got = per_rank[name]
        assert not isinstance(got, str), f"rank {rank}: {got}"
        want, have = (flat_tensors(x) for x in got)
        assert len(want) == len(have) > 0
        for i, (a, b) in enumerate(zip(want, have)):
            torch.testing.assert_close(b, a, rtol=1e-13, atol=1e-15, msg=lambda m: f"rank {rank}, tensor {i}: {m}")


def _one_rank(rank, world_size, name):
    return SCENARIOS[name](rank, "stage2")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["gradient-norm-penalty-on-params", "per-sample-grads-torch-func"])
def test_at_one_rank_autograd_grad_of_the_params_and_torch_func_work(name):
    """At world size 1 (no collective at all), against torch AdamW on the module alone."""
    have = run_ranks(_one_rank, 1, name, timeout=40)[0]
    want = run_ranks(_reference_one_rank, 1, name, timeout=40)[0]
    for i, (a, b) in enumerate(zip(flat_tensors(want), flat_tensors(have))):
        torch.testing.assert_close(b, a, rtol=1e-13, atol=1e-15, msg=lambda m: f"tensor {i}: {m}")


def _reference_one_rank(rank, world_size, name):
    return SCENARIOS[name](rank, "manual")


def _plan_fails_once(rank, world_size, stage2: bool):
    """The first bucket plan fails midway (its AccumulateGrad nodes cannot be taken): that backward raises;
    zero_grad() then the next backwards train as torch AdamW does on the same data."""
    import hf_zero._stage2.plan as plan_module  # where the plan takes the AccumulateGrad nodes

    model = _mlp(7)
    m, opt = _wrap(model, "stage2" if stage2 else "manual")
    failed = None
    if stage2:
        taken = plan_module.grad_accumulator

        def broken(p):
            raise RuntimeError("no AccumulateGrad node here")

        plan_module.grad_accumulator = broken
        try:
            m(_data(0, rank, 4, 5)).square().mean().backward()
        except RuntimeError as e:
            failed = str(e)
        finally:
            plan_module.grad_accumulator = taken
        opt.zero_grad()
    for step in range(STEPS):
        m(_data(step, rank, 4, 5)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return failed, _state(model)


@pytest.mark.timeout(60)
def test_a_bucket_plan_that_fails_midway_leaves_the_reducer_as_it_was():
    failed, have = run_ranks(_plan_fails_once, 1, True, timeout=40)[0]
    _, want = run_ranks(_plan_fails_once, 1, False, timeout=40)[0]
    assert failed == "no AccumulateGrad node here"
    for i, (a, b) in enumerate(zip(want, have, strict=True)):
        torch.testing.assert_close(b, a, rtol=1e-13, atol=1e-15, msg=lambda m: f"tensor {i}: {m}")
