"""Checkpoint readers never execute checkpoint content: a pickle planted in a checkpoint is refused."""

import os
import pickle

import pytest
import torch

import hf_zero
from hf_zero.cli import main

from tests.models import saved_linear


class _Planted:
    """Unpickling this creates a file: proof that code from the checkpoint ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.reliability("Security: a pickle planted in place of a checkpoint shard",
                         "inspect / consolidate / load_sharded refuse it with an error; its code never runs")
def test_planted_pickle_is_never_executed(tmp_path, capsys):
    directory, marker = str(tmp_path / "ck"), str(tmp_path / "PWNED")
    model, _ = saved_linear(directory)
    (shard,) = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
    with open(os.path.join(directory, shard), "wb") as f:
        pickle.dump(_Planted(marker), f)

    main(["inspect", directory])  # may succeed: it reads the JSON commit record
    assert main(["consolidate", directory, str(tmp_path / "out.pt")]) != 0
    opt = hf_zero.ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW)
    with pytest.raises(Exception, match="(?i)safetensors|header|deserializ"):
        opt.load_sharded(directory)
    assert not os.path.exists(marker)


@pytest.mark.reliability("Security: every file hf_zero writes", "loads with safetensors, JSON or torch.load(weights_only=True)")
def test_every_written_file_loads_without_pickle(tmp_path):
    from safetensors.torch import load_file
    import json

    directory = str(tmp_path / "ck")
    saved_linear(directory)
    main(["consolidate", directory, str(tmp_path / "out.pt")])
    torch.load(tmp_path / "out.pt", weights_only=True)
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.endswith(".safetensors"):
            assert load_file(path)
        else:
            with open(path) as f:
                json.load(f)
