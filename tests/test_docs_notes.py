"""docs/notes.md lists every named note in the code (``[Note: name]``, the why of a design
choice) with the file that holds it: a note added, renamed or removed in the code fails here
until the page follows."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "notes.md"
_NOTE = re.compile(r"\[Note: ([^\]]+)\]")
# the line that holds a note's text starts with its name: "# [Note: x]", '"""[Note: x]', "- **...** [Note: x]"
_HOME = re.compile(r'^\s*(?:#\s*|r?"""|- \*\*[^*]+\*\* )?\[Note: ([^\]]+)\]')


def notes_in_code() -> dict[str, str]:
    """note name -> the file (relative to the repository) whose text defines it."""
    homes, named = {}, set()
    for path in sorted((ROOT / "hf_zero").rglob("*.py")):
        text = path.read_text()
        named |= {" ".join(n.split()) for n in _NOTE.findall(text)}
        for line in text.splitlines():
            m = _HOME.match(line)
            if m:
                homes.setdefault(m.group(1), path.relative_to(ROOT).as_posix())
    assert named <= set(homes), f"notes named but defined nowhere: {sorted(named - set(homes))}"
    return homes


def notes_on_page() -> dict[str, str]:
    rows = re.findall(r"^\| (.+?) \| `([^`]+)` \|", PAGE.read_text(), re.M)
    return {name: path for name, path in rows if name != "note"}


def test_every_note_in_the_code_is_listed_with_its_file():
    assert notes_on_page() == notes_in_code()
