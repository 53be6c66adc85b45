"""README.md and docs/ as a reader meets them: every relative link points to a file that
exists and every ``#anchor`` to a heading of that file (GitHub's slugs; ``mkdocs build
--strict`` checks the site's own); every file or test a page names in backticks exists; the
pages stay short, undated, and free of issue numbers."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text())
    headings = {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}
    # mkdocstrings' API entries (``::: hf_zero.Name``) are anchored by their full name
    return headings | set(re.findall(r"^::: (\S+)$", text, re.M))


def links(page: Path) -> list[str]:
    return _LINK.findall(_FENCE.sub("", page.read_text()))


def test_slug_matches_github():
    assert slug("Trainer: `optim=\"zero_bucket\"`") == "trainer-optimzero_bucket"
    assert slug("The start-up hook, and how to opt out") == "the-start-up-hook-and-how-to-opt-out"


def test_pages_have_links():
    assert len(PAGES) >= 4 and all(links(page) for page in PAGES[:1])


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


# -- what the pages name ----------------------------------------------------------------------
_NAMED = re.compile(r"`((?:hf_zero|tests|examples|benchmarks)/[\w./-]+\.py)(?:::(\w+))?`")
# generated from the code or from data, or pages about the design (longer by nature)
GENERATED = {"docs/reliability.md", "docs/benchmarks.md", "docs/notes.md"}
DESIGN = {"docs/architecture.md", "docs/gradient_path.md", "docs/stage2_internals.md", "docs/planner.md"}
HISTORY = {"CHANGELOG.md"}  # dated by design


def _rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_named_files_and_tests_exist(page):
    missing = []
    for path, test in _NAMED.findall(page.read_text()):
        target = ROOT / path
        if not target.is_file():
            missing.append(path)
        elif test and not re.search(rf"^\s*(?:async )?def {test}\(", target.read_text(), re.M):
            missing.append(f"{path}::{test}")
    assert not missing, f"{_rel(page)} names what does not exist: {missing}"


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text()) < 6000


@pytest.mark.parametrize("page", [p for p in PAGES if _rel(p) not in GENERATED | DESIGN | HISTORY], ids=_rel)
def test_user_pages_are_short_undated_and_for_users(page):
    text = page.read_text()
    assert len(text.encode()) < 15_000, f"{_rel(page)}: {len(text.encode())} bytes; split it by task"
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), f"{_rel(page)}: a date (history goes to CHANGELOG.md)"
    assert not re.search(r"\b[Ii]ssue \d+|#\d{2,}\b", text), f"{_rel(page)}: an issue number"
