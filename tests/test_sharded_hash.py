"""Sharded checkpoints record a SHA-256 per file: a same-size corruption is refused, naming the file."""

import json
import os

import pytest
import torch

import hf_zero
from hf_zero import _offline
from hf_zero.cli import main

from tests.models import saved_linear


def _flip_last_byte(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size - 1)
        b = f.read(1)
        f.seek(size - 1)
        f.write(bytes([b[0] ^ 0x01]))
    assert os.path.getsize(path) == size


@pytest.mark.reliability("Sharded checkpoint: one byte of a shard file flipped, same size",
                         "load_sharded and consolidate refuse it, naming the file")
def test_same_size_corruption_is_refused_naming_the_file(tmp_path, capsys):
    directory = str(tmp_path / "ck")
    model, _ = saved_linear(directory)
    (shard,) = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
    with open(os.path.join(directory, "hf_zero_optimizer.json")) as f:
        (entry,) = json.load(f)["files"]
    assert len(entry["sha256"]) == 64
    _flip_last_byte(os.path.join(directory, shard))  # the last byte is tensor data: safetensors alone would accept it

    opt = hf_zero.ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW)
    with pytest.raises(ValueError, match=f"{shard}.*SHA-256"):
        opt.load_sharded(directory)
    with pytest.raises(ValueError, match=f"{shard}.*SHA-256"):
        _offline.consolidate_checkpoint(directory)
    assert main(["consolidate", directory, str(tmp_path / "out.pt")]) == 2
    assert shard in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out.pt")


@pytest.mark.reliability("Sharded checkpoint whose record names a file without a sha256 (or a malformed one)",
                         "load_sharded, consolidate and inspect refuse it, naming the file; nothing is read")
@pytest.mark.parametrize("digest", [None, "", "abc", 64 * "g"])
def test_record_without_a_hash_is_refused_naming_the_file(tmp_path, capsys, digest):
    directory = str(tmp_path / "ck")
    model, _ = saved_linear(directory)
    record_path = os.path.join(directory, "hf_zero_optimizer.json")
    with open(record_path) as f:
        record = json.load(f)
    (entry,) = record["files"]
    if digest is None:
        del entry["sha256"]
    else:
        entry["sha256"] = digest
    with open(record_path, "w") as f:
        json.dump(record, f)

    opt = hf_zero.ZeroBucketOptimizer(model.named_parameters(), torch.optim.AdamW)
    with pytest.raises(ValueError, match=f"no SHA-256 for checkpoint file .*{entry['file']}"):
        opt.load_sharded(directory)
    assert opt.state_dict()["state"] == {}  # nothing was loaded
    with pytest.raises(ValueError, match=f"no SHA-256 .*{entry['file']}"):
        _offline.consolidate_checkpoint(directory)
    assert main(["consolidate", directory, str(tmp_path / "out.pt")]) == 2
    assert main(["inspect", directory]) == 2
    err = capsys.readouterr().err
    assert err.count(entry["file"]) == 2 and "SHA-256" in err
    assert not os.path.exists(tmp_path / "out.pt")
