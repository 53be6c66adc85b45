"""The package's shape: imports run one way, no module touches another's private
attributes, no stack-frame reading. docs/architecture.md explains the layers."""

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "hf_zero"

# Lowest first: a module may import only modules listed before it.
LAYERS = [
    "_engine",
    "_works",
    "_binding",
    "_layout",
    "_ledger",
    "_comm",
    "_heard",
    "_params",
    "_grads",
    "_masters",
    "_views",
    "_state",
    "_codec",
    "_statedict",
    "_sharded",
    "_offline",
    "_export",
    "_overlap",
    "_scatter_hook",
    "_stage2.carrier",
    "_stage2.plan",
    "_stage2.pool",
    "_stage2.stand_ins",
    "_stage2.buffers",
    "_stage2.grads",
    "_stage2.hooks",
    "_stage2.reducer",
    "_stage2",
    "_gradpath",
    "_clip",
    "_runs",
    "_partition",
    "_lifecycle",
    "_optimizer",
    "_planner",
    "integrations",
    "integrations._compat",
    "integrations._refusals",
    "integrations._clipping",
    "integrations._backward",
    "integrations._refusals",
    "integrations.amp",
    "integrations.accelerate",
    "integrations.transformers",
    "_autoload",
    "cli",
    "",  # hf_zero/__init__.py
]
# namedtuple's public methods start with an underscore.
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}
# Where reaching into torch / transformers / accelerate internals is allowed: the shims.
SHIMS = {"_engine", "integrations._compat"}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        out[".".join(parts)] = ast.parse(path.read_text(), str(path))
    return out


def _imports(name: str, tree: ast.Module) -> set[str]:
    """hf_zero modules ``name`` imports, anywhere in it (functions included)."""
    package = name.split(".")[:-1] if not _is_package(name) else name.split(".") if name else []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "hf_zero":
                target = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:
                sub = ".".join(target + [alias.name])
                found.add(sub if _exists(sub) else ".".join(target))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "hf_zero":
                    found.add(".".join(alias.name.split(".")[1:]))
    return found


def _is_package(name: str) -> bool:
    return (PACKAGE / name.replace(".", "/") / "__init__.py").exists() if name else True


def _exists(name: str) -> bool:
    path = PACKAGE / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


MODULES = _modules()


def test_every_module_has_a_layer():
    assert set(MODULES) - set(LAYERS) == set(), "place new modules in LAYERS (and docs/architecture.md)"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_run_one_way(name):
    mine = LAYERS.index(name)
    upward = sorted(t for t in _imports(name, MODULES[name]) if t != name and LAYERS.index(t) >= mine)
    assert upward == [], f"hf_zero.{name or '__init__'} imports modules at or above its layer: {upward}"


def test_import_graph_is_acyclic():
    graph = {name: _imports(name, tree) - {name} for name, tree in MODULES.items()}
    state: dict[str, int] = {}

    def visit(node, path):
        if state.get(node) == 1:
            raise AssertionError("import cycle: " + " -> ".join(path + [node]))
        if state.get(node) == 2:
            return
        state[node] = 1
        for nxt in graph.get(node, ()):
            visit(nxt, path + [node])
        state[node] = 2

    for name in graph:
        visit(name, [])


def _own_private_attributes(tree: ast.Module) -> set[str]:
    """Private attributes the module's own classes define (``self._x = ...``, class-level names, slots)."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name):
            if node.value.id == "self":
                own.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                targets = item.targets if isinstance(item, ast.Assign) else [getattr(item, "target", None)]
                own.update(t.id for t in targets if isinstance(t, ast.Name))
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    own.add(item.name)
    return {a for a in own if a.startswith("_")}


@pytest.mark.parametrize("name", sorted(set(MODULES) - SHIMS))
def test_no_private_attribute_of_another_object(name):
    """``x._y`` only on ``self``/``cls`` or for an attribute this module's own classes
    define: other modules' objects are reached through public methods, and library
    internals only through the shims (``_engine.py``, ``integrations/_compat.py``)."""
    own = _own_private_attributes(MODULES[name])
    bad = [
        f"line {node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(MODULES[name])
        if isinstance(node, ast.Attribute)
        and re.match(r"^_[a-zA-Z]", node.attr)
        and not node.attr.startswith("__")
        and node.attr not in NAMEDTUPLE_API
        and node.attr not in own
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
    ]
    assert bad == [], f"hf_zero.{name}: private attributes of other objects: {bad}"


def test_no_stack_frame_reading():
    text = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    assert not re.search(r"_getframe|currentframe|inspect\.stack|\bf_locals\b|\bf_back\b", text)


DOCS = PACKAGE.parent / "docs" / "architecture.md"
MAX_CLASS_LINES = 400


def _section(title: str) -> str:
    text = DOCS.read_text()
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start : end if end != -1 else len(text)]


def _documented(title: str) -> set[str]:
    """Member names in the first column of the tables under ``title``."""
    names = set()
    for line in _section(title).splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            names.update(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)", first))
    return names


def test_public_members_of_the_optimizer_are_the_documented_protocol():
    import torch
    from torch.distributed.algorithms.join import Joinable

    from hf_zero import ZeroBucketOptimizer

    opt = ZeroBucketOptimizer([torch.nn.Parameter(torch.zeros(2))], torch.optim.SGD, lr=0.1)
    torch_api = set(dir(torch.optim.Optimizer)) | set(dir(Joinable)) | {"defaults", "param_groups", "state"}
    public = {n for n in dir(opt) if not n.startswith("_")} - torch_api
    undocumented = public - _documented("## The protocol")
    assert undocumented == set(), f"public members missing from docs/architecture.md's protocol: {sorted(undocumented)}"


def test_the_gradient_path_reaches_only_its_documented_protocol():
    from hf_zero._gradpath import GradientPath

    documented = _documented("### The gradient path's protocol")
    used = set()
    for node in ast.walk(MODULES["_scatter_hook"]):  # calls on the optimizer side: `opt.x` and `optimizer.x`
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("opt", "optimizer"):
            used.add(node.attr)
    assert used and used <= documented, f"_scatter_hook reaches undocumented members: {sorted(used - documented)}"
    assert documented <= set(dir(GradientPath)) | {"comm"}


def test_no_class_is_too_long():
    long = [
        f"hf_zero.{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, tree in MODULES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    ]
    assert long == [], f"classes above {MAX_CLASS_LINES} lines (split them into collaborators): {long}"
