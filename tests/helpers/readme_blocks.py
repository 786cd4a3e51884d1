"""The README's shell blocks, read as a user copies them: a section's fenced code blocks, their
commands (continuation lines joined, comments and blank lines dropped), the `NAME=value` variables
a block sets, and `$NAME` filled in from a mapping. tests/integration/test_readme_quickstart.py
runs them; tests/unit/test_readme.py checks that their flags exist."""

from __future__ import annotations

import re
import shlex
import string
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
ASSIGNMENTS = re.compile(r"^[A-Za-z_]\w*=")


def section(heading: str, text: str | None = None) -> str:
    """The text of `## heading` up to the next `## ` heading (AssertionError when there is none)."""
    text = README.read_text() if text is None else text
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README has no '## {heading}' section"
    return m.group(1)


def blocks(heading: str, lang: str = "bash") -> list[str]:
    """The fenced `lang` blocks of a section, in order."""
    return [body for kind, body in FENCE.findall(section(heading)) if kind == lang]


def commands(block: str) -> list[str]:
    """The block's command lines: backslash continuations joined, comment and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def words(command: str) -> list[str]:
    """The command's words as the shell splits them, a trailing `# comment` dropped."""
    return shlex.split(command, comments=True)


def is_assignment(command: str) -> bool:
    """`A=1 B="x y"`: a line that only sets variables."""
    ws = words(command)
    return bool(ws) and all(ASSIGNMENTS.match(w) for w in ws)


def assignments(command: str) -> dict[str, str]:
    return dict(w.split("=", 1) for w in words(command))


def fill(command: str, values: Mapping[str, str]) -> str:
    """`$NAME` / `${NAME}` replaced from `values` (KeyError for a name it lacks)."""
    return string.Template(command).substitute(values)
