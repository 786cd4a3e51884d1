"""No function of kvpipe runs past 100 lines (house style: a function that long holds several
steps that want names)."""

import ast
from pathlib import Path

import kvpipe

PACKAGE = Path(kvpipe.__file__).resolve().parent
MAX_LINES = 100
# "package/module.py:function" still being split elsewhere (keep this short, and shrinking)
ALLOWED: set[str] = {"commands/flags.py:add_disaggregation_args"}


def _long_functions(path: Path, limit: int) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), str(path))
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_function_is_longer_than_100_lines():
    offenders = []
    for p in sorted(PACKAGE.rglob("*.py")):
        rel = p.relative_to(PACKAGE)
        for name, n in _long_functions(p, MAX_LINES):
            if f"{rel}:{name}" not in ALLOWED:
                offenders.append(f"{rel}:{name} ({n} lines)")
    assert offenders == []


def test_the_check_sees_a_long_function(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def f():\n" + "    x = 1\n" * 100 + "\n\ndef g():\n    pass\n")
    assert _long_functions(p, MAX_LINES) == [("f", 101)]
