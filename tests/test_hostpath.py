"""A steady step reads no tensor value on the host and makes DDP's collectives: the reduce buckets and the
parameter sync. The layout check makes none of its own: a reduce bucket carries it ([Note: stage 1's check rides
a bucket] in hf_zero/_scatter_hook.py, [Note: the check rides a bucket] in hf_zero/_stage2/carrier.py).

On an accelerator every host read (``.item()``, ``bool(t)``, ``int(t)``, ``float(t)``, ``.tolist()``,
``.numpy()``) waits for all queued work. benchmarks/hostpath.py counts them by wrapping those ``torch.Tensor``
methods over steps 4-8 on 2 gloo ranks, torch's own Python calls included (DDP + fused AdamW and torch's
``clip_grad_norm_`` make none: the control), and counts the collectives with the benchmarks' counter. The
layout check's result is read through a view of host memory once the collective has completed
([Note: reading an agreement late] in hf_zero/_comm.py), which nothing queued can delay.
"""

import functools
import os

import pytest
import torch

from benchmarks.hostpath import CONTENDERS, Options, counted_rank
from tests._dist import run_ranks
from tests.models import assert_replicas_identical

OPTIONS = {
    "plain": Options(),
    "accumulation-clip": Options(accumulation=2, clip=1.0),
    "bf16-masters-overlap-clip": Options(dtype="bfloat16", overlap=True, clip=1.0),
    "buffers": Options(norm=True),
}
CASES = {f"{name}/{label}": (name, "48", opts) for name in CONTENDERS for label, opts in OPTIONS.items()}
CASES["stage1/non-finite-agreement"] = ("stage1", "48", Options(grad_scaler=True))
# hf_zero's optimizer prepared by Accelerate (its wiring binds DDP or the module), clipped by the accelerator
CASES.update({f"{name}/accumulation-clip": (name, "48", OPTIONS["accumulation-clip"])
              for name in ("accelerate/stage1", "accelerate/stage2")})


@functools.cache
def _counted():
    os.environ["ACCELERATE_USE_CPU"] = "1"  # the ranks inherit it
    try:
        return run_ranks(counted_rank, 2, CASES, timeout=400)
    finally:
        os.environ.pop("ACCELERATE_USE_CPU")


@pytest.mark.timeout(450)
@pytest.mark.parametrize("case", CASES)
def test_a_steady_step_reads_nothing_on_the_host(case):
    per_rank = _counted()
    for rank, result in enumerate(per_rank):
        for k, step in enumerate(result[case]["steps"]):
            assert step["reads"] == [], f"rank {rank}, steady step {k}: {step['reads']}"
    assert_replicas_identical([r[case]["params"] for r in per_rank])


@pytest.mark.timeout(450)
@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("ddp/")])
def test_a_steady_step_makes_ddps_collectives(case):
    name, _, opts = CASES[case]
    per_rank = _counted()
    for rank, result in enumerate(per_rank):
        buffers = result[case]["buffers"]
        # stage 2 under Accelerate reduces every micro-batch into the shards (its no_sync() does nothing: docs/stage2.md)
        reductions = opts.accumulation if name == "accelerate/stage2" else 1
        for k, step in enumerate(result[case]["steps"]):
            calls = step["collectives"]
            # each reduction reduce-scatters one bucket per layout buffer, the sync sends each buffer: a send and a
            # receive each
            p2p = (reductions + 1) * buffers
            assert calls.count("isend") == calls.count("irecv") == p2p, (rank, k, calls)
            # the norm's all-reduce with clipping; the non-finite agreement if asked for; none for the layout
            # check, whose bits a reduce bucket carries
            assert calls.count("all_reduce") == (opts.clip is not None) + opts.grad_scaler, (rank, k, calls)
            # the buffers: one coalesced broadcast, as DDP's
            assert calls.count("_broadcast_coalesced") == opts.norm, (rank, k, calls)
            assert len(calls) == 2 * p2p + calls.count("all_reduce") + opts.norm, (rank, k, calls)


@pytest.mark.timeout(450)
def test_ddp_broadcasts_buffers_coalesced_too():
    """The premise of the buffers' count: DDP's own step makes one coalesced broadcast of them."""
    per_rank = _counted()
    for result in per_rank:
        for step in result["ddp/buffers"]["steps"]:
            assert step["collectives"].count("_broadcast_coalesced") == 1, step["collectives"]


def test_the_counter_counts_every_kind_of_read():
    """The premise: each wrapped method counts once per call, torch's own Python calls included."""
    from benchmarks.hostpath import READS, HostReadCounter

    counter = HostReadCounter()
    try:
        t, p = torch.ones(1), torch.nn.Parameter(torch.ones(1))
        p.grad = torch.ones(1)
        with counter.recording():
            t.item(), bool(t), int(t), float(t), t.tolist(), t.numpy()
            torch.nn.utils.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
        names = [name for name, _ in counter.calls]
        assert names[:6] == list(READS)
        assert len(names) > 6, "error_if_nonfinite=True reads the norm on the host: counted"
    finally:
        counter.uninstall()
    assert torch.Tensor.item.__name__ == "item" and "counted" not in repr(torch.Tensor.item)


@pytest.mark.timeout(300)
def test_under_trainer_a_step_reads_what_trainers_default_reads(tmp_path):
    """Trainer reads the loss on the host itself (it logs every step here): stage 1 and stage 2 read nothing more
    than Trainer with its default optimizer, ``adamw_torch_fused``, in steps 4-7 (clipping at 0.5, as Trainer does)."""
    from tests.hf_trainer_cases import run_many

    runs = [("run_trainer", dict(output_dir=str(tmp_path / optim), optim=optim, optim_args=optim_args,
                                 count_reads=True, user_callbacks=False))
            for optim, optim_args in (("adamw_torch_fused", None), ("zero_bucket", None), ("zero_bucket", "stage=2"))]
    for rank, (default, stage1, stage2) in enumerate(run_ranks(run_many, 2, runs, timeout=280)):
        assert stage1[2]["stage"] == 1 and stage2[2]["stage"] == 2
        baseline = [sorted(where for _, where in step) for step in default[2]["reads"]]
        assert len(baseline) == 4
        for info in (stage1[2], stage2[2]):
            assert [sorted(where for _, where in step) for step in info["reads"]] == baseline, (rank, info["reads"])
