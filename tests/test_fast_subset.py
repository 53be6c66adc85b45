"""The fast subset (``python -m pytest tests -m "not slow"``) keeps a quick representative of
the masters, checkpoint and gradient-path modules, which are slow as wholes (tests/conftest.py:
SLOW_MODULES and ``@pytest.mark.fast``). Checked without collecting those modules (a
collection imports them: seconds the fast subset does not have)."""

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import conftest

TESTS = Path(__file__).resolve().parent
KEPT = ("test_masters", "test_checkpoint", "test_gradient_path")


def _fast_tests(module: str) -> list[str]:
    def is_fast(decorator) -> bool:
        return ast.unparse(decorator) in ("pytest.mark.fast", "mark.fast")

    tree = ast.parse((TESTS / f"{module}.py").read_text())
    return [f.name for f in tree.body
            if isinstance(f, ast.FunctionDef) and f.name.startswith("test_") and any(map(is_fast, f.decorator_list))]


@pytest.mark.parametrize("module", KEPT)
def test_each_core_module_keeps_a_fast_test(module):
    assert module in conftest.SLOW_MODULES
    assert _fast_tests(module), f"tests/{module}.py: no test marked @pytest.mark.fast"


class _Item:
    """What the collection hook reads of a test item."""

    def __init__(self, module: str, marks=()):
        self.module = SimpleNamespace(__name__=f"tests.{module}")
        self.marks = list(marks)

    def get_closest_marker(self, name):
        return next((m for m in self.marks if m.name == name), None)

    def add_marker(self, mark):
        self.marks.append(mark.mark)


def test_a_slow_modules_tests_are_slow_unless_marked_fast():
    items = [_Item("test_masters"), _Item("test_masters", [pytest.mark.fast.mark]), _Item("test_layout"),
             _Item("test_layout", [pytest.mark.fast.mark])]
    conftest.pytest_collection_modifyitems(None, items)
    assert [item.get_closest_marker("slow") is not None for item in items] == [True, False, False, False]
