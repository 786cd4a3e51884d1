"""The benchmarks (kvpipe/bench) and the QA harnesses (kvpipe/qa) stand side by side on what they
share (kvpipe/harness), which stands on the stack launcher (kvpipe/launch): bench never imports qa,
qa never imports bench, and nothing below imports what is above it.

Every import counts: inside functions, under `if TYPE_CHECKING:` and relative ones too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvpipe

PACKAGE = Path(kvpipe.__file__).resolve().parent

# package -> the kvpipe packages its modules must not import
FORBIDDEN = {
    "bench": ("kvpipe.qa", "kvpipe.commands", "kvpipe.cli"),
    "qa": ("kvpipe.bench", "kvpipe.commands", "kvpipe.cli"),
    "harness": ("kvpipe.bench", "kvpipe.qa", "kvpipe.commands", "kvpipe.cli"),
    "launch": ("kvpipe.bench", "kvpipe.qa", "kvpipe.harness", "kvpipe.commands", "kvpipe.cli"),
}


def imported_modules(path: Path, root: Path = PACKAGE) -> set[str]:
    """Every kvpipe module `path` (a file under `root`, the kvpipe package) imports (`from a import
    b` names a and a.b), anywhere in the file."""
    rel = path.relative_to(root.parent).with_suffix("").parts
    package = rel if path.name == "__init__.py" else rel[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: against this module's package
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return {n for n in names if n == "kvpipe" or n.startswith("kvpipe.")}


def offenders(pkg: str, banned: tuple[str, ...], root: Path = PACKAGE) -> list[tuple[str, list[str]]]:
    out = []
    for p in sorted((root / pkg).rglob("*.py")):
        bad = sorted(m for m in imported_modules(p, root) if any(m == b or m.startswith(b + ".") for b in banned))
        if bad:
            out.append((str(p.relative_to(root)), bad))
    return out


def test_bench_and_qa_do_not_import_each_other_and_harness_imports_neither() -> None:
    assert {pkg: offenders(pkg, banned) for pkg, banned in FORBIDDEN.items()} == {pkg: [] for pkg in FORBIDDEN}


def test_the_scan_sees_imports_in_functions_type_checking_and_relative(tmp_path: Path) -> None:
    """The rule above can fail: the scanner finds each form of import a module might hide."""
    root = tmp_path / "kvpipe"
    (root / "bench" / "serve").mkdir(parents=True)
    (root / "bench" / "serve" / "probe.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvpipe.qa import soak\n"
        "def f():\n    import kvpipe.qa.chaos\n"
        "from ...qa import leaks\n"
        "from . import sweep\n"
    )
    assert offenders("bench", FORBIDDEN["bench"], root) == [
        ("bench/serve/probe.py", ["kvpipe.qa", "kvpipe.qa.chaos", "kvpipe.qa.leaks", "kvpipe.qa.soak"])
    ]
    assert "kvpipe.bench.serve.sweep" in imported_modules(root / "bench" / "serve" / "probe.py", root)
    # and what the harnesses really import is seen: the kill -9 campaign drives load with the driver
    assert "kvpipe.harness.driver" in imported_modules(PACKAGE / "qa" / "chaos.py")
