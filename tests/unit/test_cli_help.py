"""Every flag of every kvpipe command has help text that shows its default, and `--help` of the
commands a newcomer meets first imports no torch (the parse path stays light: issue 47)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvpipe.cli import DefaultsHelpFormatter, build_parser

KNOWN_GAPS: set[tuple[str, str]] = set()  # (command, flag) allowed without help: none


def _walk(parser: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, argparse.ArgumentParser, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _walk(sub, f"{name} {sub_name}")
        elif not isinstance(action, argparse._HelpAction) and action.help != argparse.SUPPRESS:
            yield name, parser, action


def _flags() -> list[tuple[str, argparse.ArgumentParser, argparse.Action]]:
    parser, _ = build_parser()
    return list(_walk(parser, "kvpipe"))


def _rendered(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    formatter.add_argument(action)
    return " ".join(formatter.format_help().split())


def test_the_walk_sees_every_command() -> None:
    commands = {name for name, _, _ in _flags()}
    assert {"kvpipe serve", "kvpipe chat", "kvpipe top", "kvpipe bench serve", "kvpipe launch"} <= commands


def test_every_flag_has_help_that_shows_its_default() -> None:
    missing, no_default = [], []
    for name, parser, action in _flags():
        flag = action.option_strings[0] if action.option_strings else action.dest
        if (name, flag) in KNOWN_GAPS:
            continue
        if not action.help:
            missing.append(f"{name} {flag}")
            continue
        assert isinstance(parser.formatter_class, type) and issubclass(parser.formatter_class, DefaultsHelpFormatter)
        switch = action.nargs == 0
        if action.option_strings and not switch and not action.required:
            if "default" not in _rendered(parser, action).lower():
                no_default.append(f"{name} {flag}")
    assert not missing, f"flags without help: {missing}"
    assert not no_default, f"flags whose help shows no default: {no_default}"


def test_defaults_are_rendered_from_the_parser() -> None:
    parser, _ = build_parser(["serve"])
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    text = " ".join(serve.format_help().split())
    assert "--port PORT port of the HTTP server (default: 30000)" in text
    assert "--page-size PAGE_SIZE tokens per KV page (default: 64)" in text
    assert "(default: None)" not in text  # an unset value reads "none"


# what a --help must not load: the tensor stack and the HTTP server stack (seconds of imports;
# `serve --help` took 6.2 s with them, issue 47)
HEAVY = frozenset({"torch", "numpy", "scipy", "safetensors", "transformers", "starlette", "uvicorn", "fastapi", "zmq"})


def _help_imports(command: str) -> tuple[str, set[str]]:
    """(the help text, the top-level modules imported) of `kvpipe COMMAND --help` in a fresh process."""
    code = (
        "import sys\n"
        "from kvpipe.cli import main\n"
        "try:\n"
        f"    main([{command!r}, '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})), file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return out.stdout, set(out.stderr.strip().splitlines()[-1].split())


@pytest.mark.parametrize("command", ["serve", "generate", "chat", "top", "init-model", "models", "launch"])
def test_help_imports_no_torch_numpy_or_http_server(command: str) -> None:
    """The parse path stays light: what `--help` imports decides how long it takes (no timing here)."""
    text, modules = _help_imports(command)
    assert "usage: kvpipe" in text
    assert "kvpipe" in modules and not modules & HEAVY, sorted(modules & HEAVY)
