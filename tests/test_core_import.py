"""The core imports, and trains, where transformers and accelerate cannot be imported;
``import hf_zero`` imports none of torch, transformers, accelerate."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = ("hf_zero._layout", "hf_zero._comm", "hf_zero._state", "hf_zero._optimizer")

SCRIPT = f"""
import importlib, sys
for blocked in ("transformers", "accelerate"):
    sys.modules[blocked] = None  # any import of it now raises ImportError
for name in {CORE!r}:
    importlib.import_module(name)
import torch
from hf_zero._optimizer import ZeroBucketOptimizer
model = torch.nn.Linear(3, 2)
opt = ZeroBucketOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
model(torch.ones(4, 3)).sum().backward()
opt.step()
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "accelerate") and sys.modules[m])
print("loaded:", loaded)
"""


@pytest.mark.timeout(120)
def test_core_imports_without_transformers_and_accelerate():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert "loaded: []" in out.stdout


IMPORT_ONLY = """
import sys
import hf_zero
print("loaded:", sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "accelerate")))
"""

# HF_ZERO_AUTOLOAD=0: the registration below comes from ``import hf_zero`` alone. Importing
# the callback imports transformers.trainer, whose own hook then fires mid-import (no warning).
LAZY_NAMES = """
import hf_zero
from hf_zero import ZeroBucketCallback, ZeroBucketOptimizer, prepare_accelerator
import transformers.trainer
from transformers.training_args import OptimizerNames
assert ZeroBucketCallback in transformers.trainer.DEFAULT_CALLBACKS
assert OptimizerNames("zero_bucket") is OptimizerNames.ZERO_BUCKET
assert {"ZeroBucketCallback", "ZeroBucketOptimizer", "prepare_accelerator"} <= set(dir(hf_zero))
print("ok")
"""


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "HF_ZERO_AUTOLOAD"} | env
    return subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=100)


@pytest.mark.timeout(120)
def test_import_hf_zero_imports_no_torch_transformers_or_accelerate():
    out = _python(IMPORT_ONLY)
    assert out.returncode == 0, out.stderr
    assert "loaded: []" in out.stdout


@pytest.mark.timeout(120)
def test_public_names_load_on_first_use_and_register_with_transformers():
    out = _python(LAZY_NAMES, HF_ZERO_AUTOLOAD="0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
