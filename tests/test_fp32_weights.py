"""hf-zero consolidate DIR --weights: float32 weights from the masters plus the other saved weights."""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_zero.cli import main


def _trainer_checkpoint(directory, *, masters=True, names=("a.weight", "b.weight")):
    """A Trainer-style checkpoint: bf16 model.safetensors, optimizer.pt whose state holds masters for a.weight."""
    os.makedirs(directory)
    g = torch.Generator().manual_seed(0)
    master_a = torch.randn(3, 4, generator=g, dtype=torch.float32) * 1e-3 + 1.0  # differs from its bf16 rounding
    frozen_b = torch.randn(5, generator=g).to(torch.bfloat16)
    save_file({"a.weight": master_a.to(torch.bfloat16), "b.weight": frozen_b, "pos": torch.arange(3)},
              os.path.join(directory, "model.safetensors"))
    state = {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(3, 4), "exp_avg_sq": torch.zeros(3, 4)}}
    if masters:
        state[0]["master_param"] = master_a.clone()
    groups = [{"lr": 1e-3, "params": [0], "param_names": [names[0]]}]
    torch.save({"state": state, "param_groups": groups}, os.path.join(directory, "optimizer.pt"))
    return master_a, frozen_b


@pytest.mark.reliability("consolidate --weights on a checkpoint with bf16 weights and fp32 masters",
                         "masters written bitwise, other weights upcast, non-float buffers kept")
def test_weights_take_masters_and_upcast_the_rest(tmp_path):
    directory = str(tmp_path / "checkpoint-3")
    master_a, frozen_b = _trainer_checkpoint(directory)
    out = str(tmp_path / "fp32.safetensors")
    assert main(["consolidate", directory, "--weights", out]) == 0
    w = load_file(out)
    assert set(w) == {"a.weight", "b.weight", "pos"}
    assert w["a.weight"].dtype == torch.float32 and torch.equal(w["a.weight"], master_a)
    assert not torch.equal(w["a.weight"], master_a.to(torch.bfloat16).float())  # not the rounded param
    assert torch.equal(w["b.weight"], frozen_b.float())
    assert torch.equal(w["pos"], torch.arange(3))


def test_sharded_checkpoint_consolidates_first(tmp_path):
    import hf_zero

    model = torch.nn.Linear(3, 2)
    opt = hf_zero.ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    directory = str(tmp_path / "ck")
    opt.save_sharded(directory)
    save_file({k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()},
              os.path.join(directory, "model.safetensors"))
    out = str(tmp_path / "w.safetensors")
    assert main(["consolidate", directory, "--weights", out]) == 0  # no masters: the weights upcast
    w = load_file(out)
    for k, v in model.state_dict().items():
        assert torch.equal(w[k], v.detach().to(torch.bfloat16).float()), k


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("nothing", "neither master weights"),
    ("mismatch", "no weight of that name"),
])
def test_bad_input_is_named(tmp_path, capsys, case, message):
    directory = str(tmp_path / "checkpoint-3")
    if case == "nothing":
        os.makedirs(directory)
    elif case == "mismatch":
        _trainer_checkpoint(directory, names=("other.weight", "b.weight"))
    out = str(tmp_path / "fp32.safetensors")
    assert main(["consolidate", directory, "--weights", out]) == 2
    assert message in capsys.readouterr().err
    assert not os.path.exists(out)
