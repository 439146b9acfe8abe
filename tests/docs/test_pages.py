"""The pages in ``docs/`` and the README stand on their own and point at what is there.

- every relative link resolves to a file in the repository, and a ``#anchor``
  to a heading of that page;
- every repository path a page names in backticks exists;
- no page, and no module docstring in ``shim/`` or ``hooks/``, names an issue
  number or a document outside the repository;
- the README's two commands are the scripts that exist.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
# Pages other documents own: linked from here, written there.
OWNED_ELSEWHERE = {DOCS / "report.md", DOCS / "gpu.md", DOCS / "kubernetes.md"}
TOP = ("shim/", "hooks/", "proto/", "nodeimage/", "tests/", "integration/", "harness/", "bench/", "scripts/", "docs/")

_OUTSIDE = re.compile(r"\.\./shared|/work/shared|DESIGN\.md|ENVIRONMENT\.md|\bDESIGN \d|\bseeds/")
_ISSUE = re.compile(r"\bissues? #?\d+|(?<![\w&])#\d+\b", re.IGNORECASE)


def _ids(pages: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in pages]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {_slug(m[1]) for m in re.finditer(r"^#+\s+(.*)$", text, re.MULTILINE)}


def _prose(page: Path) -> str:
    """The page without its fenced code blocks."""
    return re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page)):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if dest in OWNED_ELSEWHERE and not dest.exists():
            continue
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_repository_path_named_exists(page: Path) -> None:
    missing = []
    for token in re.findall(r"`([^`\s]+)`", _prose(page)):
        token = token.rstrip(".,:;")
        if not token.startswith(TOP) or re.search(r"[<>*{}|]", token):
            continue
        if (ROOT / token) in OWNED_ELSEWHERE:
            continue
        if not (ROOT / token).exists():
            missing.append(token)
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_no_page_names_an_issue_or_a_document_outside_the_repository(page: Path) -> None:
    text = page.read_text()
    assert not _OUTSIDE.search(text), f"{page.relative_to(ROOT)}: {_OUTSIDE.search(text)[0]!r}"
    assert not _ISSUE.search(text), f"{page.relative_to(ROOT)}: {_ISSUE.search(text)[0]!r}"


def _module_docstrings() -> list[tuple[str, str]]:
    out = []
    for path in [*sorted((ROOT / "shim").rglob("*.py")), *sorted((ROOT / "hooks").rglob("*.py"))]:
        if "_pb" in path.parts:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if doc:
            out.append((str(path.relative_to(ROOT)), doc))
    return out


def test_no_module_docstring_names_an_issue_or_a_document_outside_the_repository() -> None:
    bad = [f"{path}: {m[0]!r}" for path, doc in _module_docstrings()
           for m in [_ISSUE.search(doc) or _OUTSIDE.search(doc)] if m]
    assert not bad, bad


def test_the_readmes_two_commands_are_there() -> None:
    readme = (ROOT / "README.md").read_text()
    for script in ("scripts/demo.sh", "scripts/test.sh"):
        assert f"bash {script}" in readme
        assert (ROOT / script).exists()


def test_the_layout_names_every_package() -> None:
    layout = (DOCS / "architecture.md").read_text().split("## Layout", 1)[1]
    named = set(re.findall(r"^\| `([^`]+)/`", layout, re.MULTILINE))  # each row's first cell
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "shim").rglob("__init__.py")}
    covered = {p for p in packages if any(p == n or p.startswith(n + "/") for n in named)}
    missing = packages - covered - {"shim", "shim/cri"}  # the CRI proxy is named by its sub-packages
    assert not missing, f"docs/architecture.md's layout misses {sorted(missing)}"


def test_the_index_lists_every_page() -> None:
    index = (DOCS / "README.md").read_text()
    for page in DOCS.glob("*.md"):
        if page.name != "README.md":
            assert f"]({page.name})" in index, f"docs/README.md does not link {page.name}"
