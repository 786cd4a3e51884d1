"""The README stays a first hour's read: at most 220 lines; every relative link in it (and in the
docs it links) points at a file or folder of the repository; every flag its `kvpipe serve` and
`kvpipe launch` lines show is one the parsers know (the quick start itself runs in
tests/integration/test_readme_quickstart.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvpipe.cli import build_parser
from tests.helpers import readme_blocks as rb

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


def readme_command_lines() -> list[tuple[str, dict[str, str]]]:
    """Every `kvpipe serve|launch` line of the README's bash blocks, with the variables its block sets."""
    out: list[tuple[str, dict[str, str]]] = []
    for lang, block in rb.FENCE.findall(rb.README.read_text()):
        values: dict[str, str] = {}
        for command in rb.commands(block) if lang == "bash" else ():
            if rb.is_assignment(command):
                values |= rb.assignments(command)
            elif re.match(r"(\.venv/bin/)?kvpipe (serve|launch)\b", command):
                out.append((command, values.copy()))
    return out


def test_readme_has_serve_and_launch_lines() -> None:
    lines = [c for c, _ in readme_command_lines()]
    assert sum(" launch" in c for c in lines) >= 5 and sum(" serve" in c for c in lines) >= 4


@pytest.mark.parametrize("command,values", readme_command_lines())
def test_readme_commands_take_only_known_flags(command: str, values: dict[str, str]) -> None:
    """A flag the README shows is one the command (or, through launch, a server) parses."""
    text = re.sub(r'"\$\([^)]*\)"', "MODEL", command.rstrip("&").strip())  # "$(kvpipe models path ...)"
    argv = rb.words(rb.fill(text, values))[1:]
    parser, _ = build_parser(argv)
    _, extra = parser.parse_known_args(argv)
    if argv[0] == "launch":  # launch hands what it does not know to the servers
        serve, _ = build_parser(["serve"])
        _, extra = serve.parse_known_args(["serve", *extra])
    assert not extra, f"{command}: unknown flags {extra}"
