"""Checkpoint readers never execute checkpoint content: a pickle planted in a checkpoint is refused."""

import os
import pickle

import pytest
import torch

import hf_zero
from hf_zero import _offline
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


def _point_record_at(directory, name):
    """Rewrite the commit record so its one file entry names ``name`` (size and hash of that file)."""
    import json

    from hf_zero._sharded import file_sha256

    record_path = os.path.join(directory, "hf_zero_optimizer.json")
    with open(record_path) as f:
        record = json.load(f)
    (entry,) = record["files"]
    target = name if os.path.isabs(name) else os.path.join(directory, name)
    entry.update(file=name, bytes=os.path.getsize(target), sha256=file_sha256(target))
    with open(record_path, "w") as f:
        json.dump(record, f)


@pytest.mark.reliability("Security: a commit record naming a file outside its checkpoint directory "
                         "(../x, an absolute path, a link leading out)",
                         "load_sharded, consolidate and inspect refuse it, naming the file; it is never read")
@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink", "subdir"])
def test_record_paths_are_confined_to_the_checkpoint(tmp_path, capsys, how):
    directory = str(tmp_path / "ck")
    model, _ = saved_linear(directory)
    (shard,) = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    outside = str(elsewhere / "x.safetensors")
    os.replace(os.path.join(directory, shard), outside)  # a valid shard, with a hash that matches: only its place is wrong
    name = {"dotdot": "../elsewhere/x.safetensors", "absolute": outside, "symlink": "link.safetensors",
            "subdir": "sub/x.safetensors"}[how]
    if how == "symlink":
        os.symlink(outside, os.path.join(directory, name))
    if how == "subdir":
        os.makedirs(os.path.join(directory, "sub"))
        os.symlink(outside, os.path.join(directory, name))
    _point_record_at(directory, name)

    opt = hf_zero.ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW)
    with pytest.raises(ValueError, match="not a file of the directory"):
        opt.load_sharded(directory)
    assert opt.state_dict()["state"] == {}
    with pytest.raises(ValueError, match="not a file of the directory"):
        _offline.consolidate_checkpoint(directory)
    assert main(["consolidate", directory, str(tmp_path / "out.pt")]) == 2
    assert main(["inspect", directory]) == 2
    err = capsys.readouterr().err
    assert err.count(repr(name)) == 2, err
    assert not os.path.exists(tmp_path / "out.pt")


@pytest.mark.reliability("Security: a symlink inside the checkpoint to a file inside it", "still loads (only escapes are refused)")
def test_a_link_inside_the_checkpoint_loads(tmp_path):
    directory = str(tmp_path / "ck")
    model, saved = saved_linear(directory)
    (shard,) = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
    os.replace(os.path.join(directory, shard), os.path.join(directory, "real.safetensors"))
    os.symlink("real.safetensors", os.path.join(directory, "link.safetensors"))
    _point_record_at(directory, "link.safetensors")
    opt = hf_zero.ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW)
    opt.load_sharded(directory)
    expected = saved.state_dict()["state"]
    got = opt.state_dict()["state"]
    assert set(got) == set(expected)
    for i, st in expected.items():
        for key, v in st.items():
            assert torch.equal(got[i][key], v), (i, key)


@pytest.mark.reliability("Security: a model index naming a weight file outside its directory",
                         "hf-zero consolidate --weights refuses it, naming the file")
def test_weights_index_is_confined(tmp_path, capsys):
    import json

    from safetensors.torch import save_file

    directory = tmp_path / "ck"
    model, _ = saved_linear(str(directory / "hf_zero_optimizer"))
    (tmp_path / "elsewhere").mkdir()
    save_file({k: v.detach().clone() for k, v in model.state_dict().items()},
              str(tmp_path / "elsewhere" / "w.safetensors"))
    with open(directory / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: "../elsewhere/w.safetensors" for k in model.state_dict()}}, f)
    assert main(["consolidate", str(directory), "--weights", str(tmp_path / "fp32.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "../elsewhere/w.safetensors" in err and "not a file of the directory" in err
    assert not os.path.exists(tmp_path / "fp32.safetensors")
