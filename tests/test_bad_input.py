"""Bad input gets a clear error naming the parameter or option, before anything changes."""

import pytest
import torch
import torch.distributed as dist

import hf_zero
from tests._dist import run_ranks

AdamW = torch.optim.AdamW


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def _sparse():
    return torch.zeros(4, 3).to_sparse().requires_grad_()


def _non_leaf():
    return _model()[0].weight * 2


# (what, make params, extra kwargs, exception, words the message must hold)
CASES = [  # checks hf_zero adds to torch.optim's
    ("an empty param group", lambda m: [{"params": []}], {}, ValueError, "empty"),
    ("a sparse param", lambda m: [_sparse()], {}, ValueError, "sparse_coo"),
    ("an integer param", lambda m: [torch.zeros(3, dtype=torch.int64)], {}, ValueError, "dtype torch.int64"),
    ("a param listed twice in a group", lambda m: [m[0].weight, m[0].weight], {}, ValueError, "duplicate"),
    ("shard='flat' with a non-elementwise optimizer", lambda m: m.parameters(), {"optimizer_class": torch.optim.LBFGS,
     "shard": "flat"}, ValueError, "shard='flat'"),
    ("an unknown shard mode", lambda m: m.parameters(), {"shard": "rows"}, ValueError, "shard must be"),
    ("an optimizer_class that is not an optimizer", lambda m: m.parameters(), {"optimizer_class": dict}, TypeError,
     "optimizer_class"),
    ("overlap_with_ddp=True", lambda m: m.parameters(), {"overlap_with_ddp": True}, ValueError, "overlap_with_ddp=False"),
]
TORCH_CASES = [  # torch.optim's own checks, which must still apply before anything changes
    ("empty params", lambda m: [], {}, ValueError, "empty parameter list"),
    ("a non-tensor", lambda m: [1.0], {}, TypeError, "can only optimize Tensors"),
    ("a non-leaf tensor", lambda m: [_non_leaf()], {}, ValueError, "non-leaf"),
    ("a param in two groups", lambda m: [{"params": [m[0].weight]}, {"params": [m[0].weight]}], {}, ValueError,
     "more than one parameter group"),
    ("a hyperparameter the optimizer rejects", lambda m: m.parameters(), {"lr": -1.0}, ValueError, "learning rate"),
    ("an unknown hyperparameter", lambda m: m.parameters(), {"betas3": 1}, TypeError, "betas3"),
]


def _rejects(params, kwargs, exc, words):
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    kwargs = {"optimizer_class": AdamW, **kwargs}
    with pytest.raises(exc, match=words.replace("(", r"\(").replace(")", r"\)")):
        hf_zero.ZeroBucketOptimizer(params(model), **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.reliability("Bad input: {what}", "`{exc.__name__}` naming it (\"{words}\"), params unchanged")
@pytest.mark.parametrize("what,params,kwargs,exc,words", CASES, ids=[c[0] for c in CASES])
def test_constructor_rejects(what, params, kwargs, exc, words):
    _rejects(params, kwargs, exc, words)


@pytest.mark.parametrize("what,params,kwargs,exc,words", TORCH_CASES, ids=[c[0] for c in TORCH_CASES])
def test_torch_checks_still_apply(what, params, kwargs, exc, words):
    _rejects(params, kwargs, exc, words)


@pytest.mark.reliability("Bad input: a named param listed twice", "`ValueError` before anything changes")
def test_named_param_listed_twice_is_named():
    model = _model()
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="duplicate|twice"):
        hf_zero.ZeroBucketOptimizer([named[0], named[0]], AdamW)


@pytest.mark.reliability("Bad input: meta-device params at step time", "`ValueError` naming the param")
def test_meta_params_at_step_time_name_the_param():
    with torch.device("meta"):
        model = torch.nn.Linear(3, 2)
    opt = hf_zero.ZeroBucketOptimizer(model.named_parameters(), AdamW)
    with pytest.raises(ValueError, match=r"param weight .* meta device"):
        opt.step()


def _outside_group(rank, world_size):
    group = dist.new_group([0])
    if rank == 0:
        opt = hf_zero.ZeroBucketOptimizer(_model().parameters(), AdamW, process_group=group)
        return opt._comm.world_size
    try:
        hf_zero.ZeroBucketOptimizer(_model().parameters(), AdamW, process_group=group)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.reliability("Bad input: a process group that does not contain this rank", "`ValueError` on that rank")
@pytest.mark.timeout(60)
def test_process_group_without_this_rank():
    inside, outside = run_ranks(_outside_group, 2, timeout=40)
    assert inside == 1
    assert "process_group does not contain this process" in outside


@pytest.mark.reliability("Bad input: a process group but torch.distributed not initialized", "`ValueError`")
def test_process_group_without_torch_distributed():
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        hf_zero.ZeroBucketOptimizer(_model().parameters(), AdamW, process_group=object())


@pytest.mark.reliability("Bad input: consolidate_state_dict(to=) outside the group", "`ValueError` naming the range")
def test_consolidate_to_a_rank_that_does_not_exist():
    opt = hf_zero.ZeroBucketOptimizer(_model().parameters(), AdamW)
    with pytest.raises(ValueError, match=r"to must be a rank in \[0, 1\)"):
        opt.consolidate_state_dict(to=3)


def _dtensor_param(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    weight = torch.nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh, [Replicate()]))
    plain = torch.nn.Parameter(torch.ones(2))
    try:
        hf_zero.ZeroBucketOptimizer([("plain", plain), ("tp.weight", weight)], AdamW)
    except ValueError as e:
        return str(e), torch.equal(weight.full_tensor(), torch.ones(4, 3))
    return "no error", None


@pytest.mark.reliability("Bad input: a DTensor param (tensor parallelism, FSDP2)", "`ValueError` naming the param")
@pytest.mark.timeout(60)
def test_dtensor_params_are_refused_naming_the_param():
    message, unchanged = run_ranks(_dtensor_param, 1, timeout=40)[0]
    assert "param tp.weight of group 0" in message and "DTensor" in message
    assert unchanged
