"""The core imports, and trains, where transformers and accelerate cannot be imported."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = ("hf_zero.layout", "hf_zero.comm", "hf_zero.state", "hf_zero.optimizer")

SCRIPT = f"""
import importlib, sys
for blocked in ("transformers", "accelerate"):
    sys.modules[blocked] = None  # any import of it now raises ImportError
for name in {CORE!r}:
    importlib.import_module(name)
import torch
from hf_zero.optimizer import ZeroBucketOptimizer
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
