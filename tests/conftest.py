"""Make ``tests`` importable as a package, also in processes spawned by tests/_dist.py.

Spawned children start with the parent's ``sys.path``; putting the repository root on it
here means a child can unpickle ``tests.test_x.some_fn`` and import ``tests._dist`` whatever
pytest's import mode or working directory.
"""
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
