"""The import graph of kvpipe's own modules: no cycles, and imports inside functions only where
they defer something heavy and optional.

Every import counts, also those inside functions and under `if TYPE_CHECKING:`: a cycle hidden
there is still two modules that each need the other, and it breaks as soon as someone moves the
import to the top. (Importing `a.b.c` also runs the package `a.b`'s __init__; those implicit
parent edges are not counted, Python orders them itself.)
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import kvpipe

PACKAGE = Path(kvpipe.__file__).resolve().parent

# (importing module, imported module prefix) pairs allowed inside functions, and why
LAZY_ALLOWED = {
    # the CLI imports a command's module only when that command runs (`kvpipe init-model` never
    # imports torch)
    ("kvpipe.cli", "kvpipe."),
    # a command's --help imports no torch (tests/unit/test_cli_help.py): the engine, the server
    # and the checkpoint readers are imported when the command runs
    ("kvpipe.commands.serve", "kvpipe."),
    ("kvpipe.commands.generate", "kvpipe.engine."),
    ("kvpipe.commands.init_model", "kvpipe.model."),
    ("kvpipe.commands.flags", "kvpipe.model.checkpoint."),
    ("kvpipe.commands.pd_flags", "kvpipe.model.checkpoint."),
    ("kvpipe.commands.launch", "kvpipe.model.checkpoint."),
}
# (The transfer backend registry imports a backend's module by its "module:Class" path, with
# importlib, only when the backend is chosen: kvpipe/transfer/backends/registry.py.)


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    in_function: bool


def _module_names() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        parts = ("kvpipe", *p.relative_to(PACKAGE).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _edges(modules: dict[str, Path]) -> list[Edge]:
    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges = []
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        in_func = {
            id(sub)
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for sub in ast.walk(node)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            found = {resolve(t) for t in targets if t.startswith("kvpipe")}
            for dst in sorted(d for d in found if d and d != mod):
                # `from kvpipe.x import y` names both kvpipe.x and kvpipe.x.y: keep the deepest
                if any(o != dst and o is not None and o.startswith(dst + ".") for o in found):
                    continue
                edges.append(Edge(mod, dst, node.lineno, id(node) in in_func))
    return edges


def _cycles(nodes: list[str], edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for e in edges:
        succ[e.src].append(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on_stack.add(v)
            if i < len(succ[v]):
                work.append((v, i + 1))
                w = succ[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return out


def test_no_import_cycles() -> None:
    modules = _module_names()
    assert _cycles(sorted(modules), _edges(modules)) == []


def test_imports_inside_functions_only_defer_heavy_optional_parts() -> None:
    modules = _module_names()
    lazy = [e for e in _edges(modules) if e.in_function]
    bad = [
        f"{e.src}:{e.line} imports {e.dst}"
        for e in lazy
        if not any(e.src == src and e.dst.startswith(dst) for src, dst in LAZY_ALLOWED)
    ]
    assert bad == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The checker itself can fail: a two-module cycle and a three-module cycle are reported."""
    edges = [Edge("a", "b", 1, False), Edge("b", "a", 1, True), Edge("c", "d", 1, False)]
    edges += [Edge("d", "e", 1, False), Edge("e", "c", 1, False), Edge("a", "c", 1, False)]
    assert sorted(_cycles(["a", "b", "c", "d", "e"], edges)) == [["a", "b"], ["c", "d", "e"]]
