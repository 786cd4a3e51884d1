"""Import layering: the CLI sits on top; nothing below it imports kvpipe.cli (a benchmark or
server module that did would pull the whole command registry in and invert the layers)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import kvpipe

PACKAGE = Path(kvpipe.__file__).resolve().parent
ENTRY_POINTS = {
    "cli.py",
    "__main__.py",
    "commands/flag_reference.py",
}  # the CLI, `python -m kvpipe`, and docs/flags.md from its parsers


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


# The package table of docs/architecture.md is the allow list: one row per package (or group of
# top-level modules), its last column the packages it may import ("base": the last row's modules).
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def _ticks(cell: str) -> list[str]:
    """The backticked names of a table cell outside parentheses (a parenthesis gives a reason)."""
    return re.findall(r"`([^`]+)`", re.sub(r"\([^()]*\)", "", cell))


def _unit(name: str) -> str:
    """`commands/` or `config.py` -> the top-level name under kvpipe (commands, config)."""
    return name.rstrip("/").removesuffix(".py")


def allow_list(text: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """(top-level name -> its row's group, group -> the top-level names it may import)."""
    section = text.split("## Packages", 1)[1].split("\n## ", 1)[0]
    rows = [ln.split("|")[1:-1] for ln in section.splitlines() if ln.startswith("| ") and ln.count("|") == 4]
    group_of: dict[str, str] = {}
    allowed: dict[str, list[str]] = {}
    for first, _holds, may in rows[1:]:  # rows[0]: the header
        names = [_unit(n) for n in _ticks(first)]
        group = "base" if first.strip().startswith("base:") else names[0]
        for n in names:
            group_of[n] = group
        allowed[group] = [_unit(n) for n in _ticks(may)]
    members = {g: {n for n, own in group_of.items() if own == g} for g in allowed}
    expanded = {
        g: members[g] | {m for name in names for m in (members["base"] if name == "base" else {name})}
        for g, names in allowed.items()
    }
    return group_of, expanded


def _kvpipe_imports(path: Path) -> set[str]:
    """Top-level kvpipe names `path` imports (relative imports resolved), anywhere in the file."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("").parts
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = rel[: len(rel) - node.level]  # the module's package, then up
            mods = [".".join(base + ((node.module,) if node.module else ()))]
            mods += [f"{mods[0]}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        else:
            continue
        found |= {m.split(".")[1] for m in mods if m.startswith("kvpipe.") and len(m.split(".")) > 1}
    return found


def _top_level_names() -> set[str]:
    return {
        p.name.removesuffix(".py")
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists())
    }


def test_every_package_has_a_row_in_the_table() -> None:
    group_of, _ = allow_list(ARCHITECTURE.read_text())
    assert sorted(_top_level_names() - set(group_of)) == []  # a package or module the doc does not place
    assert sorted(set(group_of) - _top_level_names()) == []  # a row for something that is gone


def test_imports_follow_the_allow_list() -> None:
    group_of, allowed = allow_list(ARCHITECTURE.read_text())
    offenders = []
    for p in sorted(PACKAGE.rglob("*.py")):
        own = p.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if own == "__init__":
            continue
        ok = allowed[group_of[own]]
        bad = sorted(n for n in _kvpipe_imports(p) if n != own and n not in ok)
        if bad:
            offenders.append(f"{p.relative_to(PACKAGE)} imports {bad}, not in the {group_of[own]} row")
    assert offenders == []


def test_the_allow_list_can_fail() -> None:
    """The parser reads what the rows say: an engine row that allowed nothing would be broken by
    the engine's own imports, and a parenthesis names no package."""
    group_of, allowed = allow_list(ARCHITECTURE.read_text())
    assert "disagg" not in allowed["engine"] and "model" in allowed["engine"] and "config" in allowed["engine"]
    assert allowed["cache"] == {"cache"} | {n for n, g in group_of.items() if g == "base"}
    assert "cpu_threads" not in allowed["launch"] and "engine" in allowed["launch"]


# what a module outside the engine must not read of an Engine (its scheduler, finish checks, runner)
ENGINE_INTERNALS = (".scheduler.", ".finisher.", ".runner.")


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
