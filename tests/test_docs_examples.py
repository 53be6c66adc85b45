"""The code blocks of README.md and docs/ run, so an example cannot rot.

- ``python`` blocks run, one page per fresh interpreter, in page order and sharing one
  namespace (a later block may use what an earlier one built), in a temporary directory. A
  block that cannot run on a CPU in one process (a fragment using your ``model``, a CUDA-only
  recipe) is marked right above its fence with ``<!-- docs-test: skip (why) -->``.
- Other blocks (``bash``, ``text``) are commands to read, not run, unless marked
  ``<!-- docs-test: run -->``; then they run with ``bash -e`` in the same temporary directory.
- Every ``hf-zero ...`` command line in any block parses with the CLI's own parser, so a
  renamed flag fails here even where the command is not run.

The pages' interpreters start together (a module fixture) and each test waits for its own.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_BLOCK = re.compile(r"(?:^<!-- docs-test: (?P<mark>[a-z]+)(?P<why>[^>]*)-->\n)?^```(?P<lang>[\w-]*)\n(?P<code>.*?)^```",
                    re.M | re.S)
TIMEOUT_S = 240


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    mark: str | None
    code: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    out = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("lang")) + 1
        out.append(Block(page, line, m.group("lang"), m.group("mark"), m.group("code")))
    return out


def _session(page: Path) -> str:
    """One interpreter's program: each runnable python block exec'd in turn, in one namespace."""
    runnable = [b for b in blocks(page) if b.lang == "python" and b.mark != "skip"]
    parts = ["import sys, traceback", "ns = {'__name__': '__main__'}"]
    for b in runnable:
        parts.append(f"try:\n    exec(compile({b.code!r}, {str(b)!r}, 'exec'), ns)\n"
                     f"except BaseException:\n    traceback.print_exc()\n"
                     f"    sys.exit('docs-test: the block at {b} failed')")
    return "\n".join(parts) + "\n"


RUN_PAGES = [p for p in PAGES if any(b.lang == "python" and b.mark != "skip" for b in blocks(p))]
RUN_COMMANDS = [b for p in PAGES for b in blocks(p) if b.lang != "python" and b.mark == "run"]


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.pop("WORLD_SIZE", None), env.pop("RANK", None), env.pop("LOCAL_RANK", None)
    return env


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """Every page's interpreter and every marked command, started at once."""
    procs = {}
    for page in RUN_PAGES:
        cwd = tmp_path_factory.mktemp(page.stem)
        procs[page] = subprocess.Popen([sys.executable, "-c", _session(page)], cwd=cwd, env=_env(),
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for block in RUN_COMMANDS:
        cwd = tmp_path_factory.mktemp(f"{block.page.stem}_{block.line}")
        procs[str(block)] = subprocess.Popen(["bash", "-e", "-c", block.code], cwd=cwd, env=_env(),
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return -9, out + f"\n(killed after {TIMEOUT_S} s)"
    return proc.returncode, out


@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_blocks_run(started, page):
    code, out = _finish(started[page])
    assert code == 0, f"{page.relative_to(ROOT)}:\n{out[-6000:]}"


@pytest.mark.parametrize("block", RUN_COMMANDS, ids=str)
def test_marked_commands_run(started, block):
    code, out = _finish(started[str(block)])
    assert code == 0, f"{block}:\n{out[-6000:]}"


def test_marks_are_known_and_pages_have_runnable_examples():
    marks = {(str(b), b.mark) for p in PAGES for b in blocks(p) if b.mark is not None}
    assert all(mark in ("skip", "run") for _, mark in marks), marks
    assert all(b.lang for p in PAGES for b in blocks(p)), "every fence names its language"
    names = {p.relative_to(ROOT).as_posix() for p in RUN_PAGES}
    assert {"docs/trainer.md", "docs/accelerate.md", "docs/pytorch.md", "docs/stage2.md", "docs/precision.md",
            "docs/checkpoints.md"} <= names


def test_skipped_blocks_say_why():
    unexplained = [str(b) for p in PAGES for b in blocks(p) if b.mark == "skip" and not b.code.strip()]
    assert not unexplained
    for page in PAGES:
        for m in re.finditer(r"<!-- docs-test: skip(?P<why>[^>]*)-->", page.read_text()):
            assert m.group("why").strip(" ()"), f"{page.relative_to(ROOT)}: a skip without a reason"


def test_every_hf_zero_command_line_parses():
    from hf_zero.cli import build_parser

    parser = build_parser()
    lines = []
    for page in PAGES:
        for b in blocks(page):
            for raw in b.code.replace("\\\n", " ").splitlines():
                line = raw.strip()
                if line.startswith("$ "):
                    line = line[2:]
                if line.startswith("hf-zero "):
                    lines.append((f"{b}", line.split(" #")[0].strip()))
    assert len(lines) >= 8
    for where, line in lines:
        words = shlex.split(line)[1:]
        if any(w.isupper() and w.isalpha() for w in words) or "..." in words or any("[" in w for w in words):
            continue  # a synopsis (PLACEHOLDERS, [optional] parts), not a command
        try:
            parser.parse_args(words)
        except SystemExit as e:
            raise AssertionError(f"{where}: `{line}` does not parse") from e
