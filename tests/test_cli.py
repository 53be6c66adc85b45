"""``hf-zero consolidate`` / ``inspect`` on a checkpoint sharded over 2 ranks."""

from __future__ import annotations

import pytest
import torch

from hf_zero.cli import main
from tests._dist import run_ranks
from tests.models import (
    CheckpointNet,
    assert_param_dicts_equal,
    assert_state_dicts_equal,
    checkpoint_optimizer_class,
    checkpoint_train,
    checkpoint_zero,
    consolidated_copy,
    param_copy,
)


def _save_on_two_ranks(rank, world_size, directory):
    from hf_zero import _sharded as checkpoint

    model = CheckpointNet()
    opt = checkpoint_zero(model, "adamw", "flat", True)
    checkpoint_train(model, opt, range(0, 4))  # a.weight frozen at step 3: its state is parked
    opt.save_sharded(directory)
    saved, params = consolidated_copy(opt), param_copy(model)

    # A rank failing to write: every rank raises, nothing is committed, no hang.
    checkpoint_train(model, opt, range(4, 5))
    if rank == 1:
        def disk_full(path, write):
            raise OSError(28, "No space left on device")

        checkpoint.write_atomic = disk_full
    try:
        opt.save_sharded(directory)
        error = None
    except RuntimeError as e:
        error = str(e)
    return params, saved, error


@pytest.mark.reliability("A sharded save failing (disk full) on rank 1 of 2", "both ranks raise the same error; nothing committed; previous checkpoint intact")
@pytest.mark.timeout(90)
def test_consolidate_output_loads_into_the_plain_optimizer_and_continues(tmp_path, capsys):
    directory, out = str(tmp_path / "ck"), str(tmp_path / "optimizer.pt")
    (params, saved, error0), (_, _, error1) = run_ranks(_save_on_two_ranks, 2, directory, timeout=80)
    assert error0 == error1 and "rank 1: OSError" in error0 and "nothing was committed" in error0

    assert main(["consolidate", directory, out]) == 0
    merged = torch.load(out, weights_only=True)
    assert_state_dicts_equal(merged, saved)  # the failed second save left the first in place

    model = CheckpointNet()
    model.load_state_dict(params)
    cls, kw = checkpoint_optimizer_class("adamw")
    plain = cls(model.named_parameters(), **kw)
    plain.load_state_dict(merged)
    checkpoint_train(model, plain, range(4, 7))

    ref_model = CheckpointNet()
    ref = cls(ref_model.named_parameters(), **kw)
    checkpoint_train(ref_model, ref, range(0, 7))
    assert_param_dicts_equal(param_copy(model), param_copy(ref_model))  # continues exactly
    assert_state_dicts_equal(plain.state_dict(), ref.state_dict())

    capsys.readouterr()
    assert main(["inspect", directory]) == 0
    shown = capsys.readouterr().out
    for expected in ("torch.optim.adamw.AdamW", "world size      2", "shard mode      flat",
                     "params          5 (4 trainable at save, 5 with state)", "exp_avg (float64 elementwise)",
                     "step (float32 scalar)", "rank 1", "total bytes"):
        assert expected in shown, shown


@pytest.mark.reliability("CLI on a missing or broken checkpoint", "non-zero exit and a message naming the problem")
def test_cli_errors_name_the_problem(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "holds no sharded optimizer checkpoint" in capsys.readouterr().err
    assert main(["consolidate", str(tmp_path / "missing"), str(tmp_path / "x.pt")]) == 2
    err = capsys.readouterr().err
    assert "hf-zero consolidate: error" in err and "does not exist: check the path" in err
    assert "interrupted" not in err  # a mistyped path is not sent looking for an interrupted save
    (tmp_path / "shard-0a1b-rank00000-of-00002.safetensors").write_bytes(b"")  # a save killed before its commit
    assert main(["inspect", str(tmp_path)]) == 2
    assert "interrupted before its commit" in capsys.readouterr().err
