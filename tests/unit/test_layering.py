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
    offenders = sorted(
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if str(p.relative_to(PACKAGE)) not in ENTRY_POINTS and "kvpipe.cli" in _imported_modules(p)
    )
    assert offenders == []


# package -> packages it must not import (the layers of docs/architecture.md point downward)
FORBIDDEN = {
    "engine": ("kvpipe.disagg", "kvpipe.transfer", "kvpipe.server", "kvpipe.bench", "kvpipe.qa"),
    "transfer": ("kvpipe.disagg", "kvpipe.engine", "kvpipe.server", "kvpipe.bench", "kvpipe.qa"),
    "cache": ("kvpipe.engine", "kvpipe.disagg", "kvpipe.transfer", "kvpipe.server"),
    "model": ("kvpipe.engine", "kvpipe.disagg", "kvpipe.transfer", "kvpipe.server"),
    "disagg": ("kvpipe.server", "kvpipe.bench", "kvpipe.qa"),
    "server": ("kvpipe.bench", "kvpipe.qa", "kvpipe.harness", "kvpipe.launch"),
    # bench, qa, harness and launch among themselves: tests/unit/test_harness_layering.py
}
# what a module outside the engine must not read of an Engine (its scheduler, finish checks, runner)
ENGINE_INTERNALS = (".scheduler.", ".finisher.", ".runner.")


def test_layers_point_downward() -> None:
    offenders = []
    for pkg, banned in FORBIDDEN.items():
        for p in (PACKAGE / pkg).rglob("*.py"):
            bad = sorted(m for m in _imported_modules(p) if m.startswith(banned))
            if bad:
                offenders.append((str(p.relative_to(PACKAGE)), bad))
    assert offenders == []


def test_only_the_engine_touches_its_scheduler_finisher_and_runner() -> None:
    offenders = []
    for p in PACKAGE.rglob("*.py"):
        rel = p.relative_to(PACKAGE)
        if rel.parts[0] == "engine":
            continue
        text = p.read_text()
        for attr in ENGINE_INTERNALS:
            # config objects have a `.scheduler` too (cfg.scheduler.chunked_prefill_size): those are fine
            hits = [
                line
                for line in text.splitlines()
                if attr in line and "cfg.scheduler." not in line and "c.scheduler." not in line
            ]
            if hits:
                offenders.append((str(rel), attr, hits[:2]))
    assert offenders == []


# transfer/'s parts bottom to top: a module of one imports only kvpipe.transfer modules of the
# same part or of parts before it (docs/architecture.md, Packages)
TRANSFER_ORDER = (
    "lifecycle",
    "planning",
    "recurrent",
    "control",
    "backends",
    "staging",
    "kv_digest",
    ("sender", "receiver"),
    "api",
)


def _transfer_part(module: str) -> int | None:
    """Index in TRANSFER_ORDER of the part `module` (kvpipe.transfer.<part>...) belongs to."""
    parts = module.split(".")
    if parts[:2] != ["kvpipe", "transfer"] or len(parts) < 3:
        return None
    for i, names in enumerate(TRANSFER_ORDER):
        if parts[2] in (names if isinstance(names, tuple) else (names,)):
            return i
    return None


def test_transfer_parts_import_downward() -> None:
    offenders = []
    for p in (PACKAGE / "transfer").rglob("*.py"):
        rel = p.relative_to(PACKAGE.parent).with_suffix("")
        own = _transfer_part(".".join(rel.parts))
        if own is None:  # the package __init__: re-exports api.py
            continue
        for m in _imported_modules(p):
            other = _transfer_part(m)
            if other is not None and other > own:
                offenders.append((str(rel), m))
    assert offenders == []


def test_transfer_part_order_is_checked() -> None:
    """The rule above can fail: the planner importing a sender module is above it."""
    assert _transfer_part("kvpipe.transfer.sender.book") > _transfer_part("kvpipe.transfer.planning.planner")
    assert _transfer_part("kvpipe.transfer.backends") is not None
