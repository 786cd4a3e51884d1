"""Import layering: the CLI sits on top; nothing below it imports kvpipe.cli (a benchmark or
server module that did would pull the whole command registry in and invert the layers)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvpipe

PACKAGE = Path(kvpipe.__file__).resolve().parent
ENTRY_POINTS = {"cli.py", "__main__.py"}  # the CLI itself and `python -m kvpipe`


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)  # `from kvpipe import cli`
    return names


def test_only_entry_points_import_the_cli() -> None:
    offenders = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                       if str(p.relative_to(PACKAGE)) not in ENTRY_POINTS and "kvpipe.cli" in _imported_modules(p))
    assert offenders == []
