"""The README stays a first hour's read: at most 220 lines, and every relative link in it (and in
the docs it links) points at a file or folder of the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_README_LINES = 220
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(doc: Path) -> list[str]:
    links = [m.group(1).split("#")[0] for m in LINK.finditer(doc.read_text())]
    return [u for u in links if u and not re.match(r"[a-z][a-z0-9+.-]*:", u)]


def test_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= MAX_README_LINES


@pytest.mark.parametrize("doc", ["README.md", "docs/security.md", "docs/deploy.md", "docs/features.md"])
def test_relative_links_resolve(doc: str) -> None:
    path = ROOT / doc
    links = relative_links(path)
    missing = [u for u in links if not (path.parent / u).exists()]
    assert not missing, f"{doc}: links to nothing: {missing}"


def test_readme_has_links() -> None:
    assert len(relative_links(ROOT / "README.md")) >= 5  # the docs it hands the reader on to
