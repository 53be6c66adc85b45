"""Ranks that disagree on the trainable set raise the same clear error instead of hanging."""

import pytest
import torch

import hf_zero
from tests._dist import run_ranks


def _disagree(rank, world_size, when, stage, change, micro_batches):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    if change == "unfreeze":
        model[0].weight.requires_grad_(False)
    opt = hf_zero.ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW, lr=0.1, stage=stage)
    if stage == 2:
        opt.bind_module(model)
    before = None
    for step in range(3):
        try:  # stage 2 raises in the backward where every rank changed since the last step (the first)
            for micro in range(micro_batches):
                if (step, micro) == when and rank == 1:
                    model[0].weight.requires_grad_(change == "unfreeze")  # rank 1 alone
                if (step, micro) == when:
                    before = [p.detach().clone() for p in model.parameters()]
                model(torch.ones(3, 4)).sum().backward()
            opt.step()
        except RuntimeError as e:
            unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            return step, str(e), unchanged
        opt.zero_grad()
    return None


@pytest.mark.reliability("Only rank 1 freezes a layer (at step {when}, stage {stage})", "every rank raises the same RuntimeError naming the param, within seconds, no hang")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage,when", [(1, 0), (1, 2), (2, 0), (2, 2)])
def test_one_rank_freezing_alone_fails_on_every_rank(stage, when):
    # A hang would last until the collective timeout; run_ranks fails the test at 45 s (spawn
    # included, on a loaded 2-core machine the spawn alone can take 20 s).
    results = run_ranks(_disagree, 2, (when, 0), stage, "freeze", 1, timeout=45)
    assert results[0] == results[1], results
    step, message, unchanged = results[0]
    assert step == when
    assert "ranks disagree on parameter 0.weight" in message
    assert "rank 0: shape=(4, 4), dtype=torch.float32, device=cpu, requires_grad=True" in message
    assert "rank 1: shape=(4, 4), dtype=torch.float32, device=cpu, requires_grad=False" in message
    if stage == 2:  # the step's check comes before the step changes anything
        assert unchanged


@pytest.mark.reliability("Under stage 2, only rank 1 {change}s a layer, between steps or between two micro-batches", "every rank raises the same RuntimeError naming the param before the step changes anything, no hang")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("change,when", [("unfreeze", (1, 0)), ("freeze", (1, 1)), ("unfreeze", (1, 1))])
def test_stage2_one_rank_changing_alone_fails_on_every_rank(change, when):
    results = run_ranks(_disagree, 2, when, 2, change, 2, timeout=45)
    assert results[0] == results[1], results
    step, message, unchanged = results[0]
    assert step == when[0] and unchanged
    assert "ranks disagree on parameter 0.weight" in message
    assert f"rank 1: shape=(4, 4), dtype=torch.float32, device=cpu, requires_grad={change == 'unfreeze'}" in message


def _disagree_before_checkpoint(rank, world_size, op, directory):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = hf_zero.ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW, lr=0.1)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    if rank == 1:
        model[1].bias.requires_grad_(False)
    try:
        if op == "consolidate":
            opt.consolidate_state_dict(to=0)
        elif op == "save_sharded":
            opt.save_sharded(directory)
        else:
            opt.load_sharded(directory)
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.reliability("Only rank 1 freezes a layer, then {op}", "every rank raises the same RuntimeError naming the param before moving any state")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["consolidate", "save_sharded", "load_sharded"])
def test_checkpoint_collectives_check_agreement_first(op, tmp_path):
    results = run_ranks(_disagree_before_checkpoint, 2, op, str(tmp_path / "ckpt"), timeout=40)
    assert results[0] == results[1] and results[0] is not None, results
    assert "ranks disagree on parameter 1.bias" in results[0]


def _freeze_alone_before_the_step(rank, world_size):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = hf_zero.ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW, lr=0.1, stage=2)
    opt.bind_module(model)
    for step in range(3):
        model(torch.ones(3, 4)).sum().backward()
        if step == 1 and rank == 1:
            model[0].weight.requires_grad_(False)  # between the backward and the step, rank 1 alone
        opt.step()  # raises; the process ends, as a script's would
        opt.zero_grad()


@pytest.mark.reliability("Under stage 2, only rank 1 freezes a layer between the backward and the step", "rank 1 raises the clear error at once, without a collective; rank 0 fails as soon as rank 1's process ends, not at the collective timeout")
@pytest.mark.timeout(60)
def test_stage2_one_rank_changing_between_backward_and_step_fails_fast():
    with pytest.raises(RuntimeError) as raised:
        run_ranks(_freeze_alone_before_the_step, 2, timeout=45)
    message = str(raised.value)
    assert "changed between the backward and optimizer.step()" in message
    # rank 0 failed too, in the sync, within the harness's second of grace: it did not wait for a timeout
    assert "2 of 2 ranks failed" in message and "parameter sync failed on rank 0" in message, message


def _ensure_partition_between_backward_and_step(rank, world_size):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = hf_zero.ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW, lr=0.1, stage=2)
    opt.bind_module(model)
    rebuilds = []
    for step in range(3):
        if step == 1:
            model[0].weight.requires_grad_(False)  # every rank
        model(torch.ones(3, 4)).sum().backward()
        opt.ensure_partition()  # e.g. a callback between the backward and the step
        opt.step()
        opt.zero_grad()
        rebuilds.append(opt.rebuilds)
    return rebuilds


@pytest.mark.timeout(60)
def test_stage2_ensure_partition_between_backward_and_step_rebuilds_once():
    """A freeze that every rank made, re-partitioned by ``ensure_partition()`` after the backward: the step
    does not rebuild again."""
    assert run_ranks(_ensure_partition_between_backward_and_step, 2, timeout=45) == [[1, 2, 2]] * 2
