"""``Join`` (uneven inputs) under stage 2 is refused, on every rank, before any collective.

A joined rank would have to shadow every backward's reduce-scatters, and Join's own all-reduce
would come at different points on joined and non-joined ranks ([Note: no Join under stage 2] in
hf_zero/_optimizer.py). So building ``Join([optimizer])`` raises ``ValueError`` naming the fixes
(stage 1 under DDP, or even inputs), on every rank; the ranks' collectives stay matched after it.
Stage 1's Join is tested in tests/test_drop_in.py and tests/test_masters.py.
"""

import pytest
import torch
from torch.distributed.algorithms.join import Join

import hf_zero
from tests._dist import run_ranks
from tests.models import BATCH, build_model, params_of, shard_of

MESSAGE = "hf_zero: stage=2 does not support torch.distributed.algorithms.join.Join (uneven inputs)"


def _uneven(rank, world_size):
    """Rank r has 2 + r batches and trains them inside Join, then (the error caught) every rank
    takes 2 more steps on even inputs: they must still be in step with each other."""
    model = build_model("mlp")
    opt = hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, stage=2)
    opt.bind_module(model, bucket_cap_mb=0.0005)
    errors = []
    for enable in (True, False):
        try:
            with Join([opt], enable=enable):
                for step in range(2 + rank):
                    model(*shard_of(model.batch(step, BATCH * world_size), rank)).backward()
                    opt.step()
                    opt.zero_grad()
        except ValueError as e:
            errors.append(str(e))
    for step in range(2):
        model(*shard_of(model.batch(10 + step, BATCH * world_size), rank)).backward()
        opt.step()
        opt.zero_grad()
    return errors, params_of(model)


@pytest.mark.reliability("stage 2 inside Join with uneven inputs (rank r has 2 + r batches), 2 ranks",
                         "ValueError naming stage=1 on every rank when Join is built, no hang; "
                         "training goes on in step")
@pytest.mark.timeout(120)
def test_join_under_stage2_is_refused_on_every_rank_before_any_collective():
    per_rank = run_ranks(_uneven, 2, timeout=90)
    for errors, _ in per_rank:
        # enable=False too: Join builds its hooks before it reads enable
        assert len(errors) == 2 and all(e.startswith(MESSAGE) and "Use stage=1" in e for e in errors), errors
    (_, params0), (_, params1) = per_rank
    for a, b in zip(params0, params1):
        assert torch.equal(a, b)  # the collectives after the refusal still matched
    initial = params_of(build_model("mlp"))
    assert any(not torch.equal(a, b) for a, b in zip(params0, initial))  # and trained


@pytest.mark.fast
def test_join_under_stage2_is_refused_in_one_process_too_and_stage1_is_not():
    model = torch.nn.Linear(3, 2)
    stage2 = hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, stage=2)
    with pytest.raises(ValueError, match="Use stage=1"):
        stage2.join_hook()
    stage1 = hf_zero.ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW)
    assert stage1.join_hook().optimizer is stage1
