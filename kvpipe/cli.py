"""`kvpipe` command line: `serve`, `generate`, `init-model`, and the commands others register.

Subcommands live in a registry (`COMMANDS`) of modules imported only when their command runs
(or when `--help` lists them), so `kvpipe init-model` never imports torch. A command module
provides `add_args(parser)` and `run(args, extra) -> int`; `extra` holds the flags argparse did
not know, for commands that pass flags through (`launch` hands them to both servers).
Flag names follow SGLang's `launch_server`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from kvpipe.config import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    STAGING_MODES,
    CacheConfig,
    ConfigError,
    DisaggregationConfig,
    FaultInjection,
    SchedulerConfig,
    ServerConfig,
    parse_layer_groups,
)
from kvpipe.transfer.control.auth import TOKEN_ENV, token_from_env


@dataclass(frozen=True)
class Command:
    name: str  # "serve", or "GROUP SUB" for a command inside a group ("bench serve")
    help: str
    module: str | None  # provides add_args(parser) and run(args, extra) -> int; None: defined here
    pass_unknown: bool = False  # unknown flags go to run() instead of being an error

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.name.split())


# The registry: add a Command here to add a subcommand (a module with add_args/run).
COMMANDS: list[Command] = [
    Command("serve", "run an HTTP server (SGLang native + OpenAI API)", None),
    Command("generate", "one-shot generation without a server", None),
    Command("init-model", "write a built-in preset checkpoint directory", None),
    Command("launch", "local PD stack: prefill + decode + sglang-router", "kvpipe.server.launcher", pass_unknown=True),
    Command(
        "bench serve", "serving benchmark: TTFT/TPOT/ITL/throughput against a server or stacks", "kvpipe.bench.serve"
    ),
    Command("bench engine", "offline engine prefill/decode throughput on this machine", "kvpipe.bench.engine"),
    Command("bench soak", "soak the local PD stack: mixed requests, injected faults, leak checks", "kvpipe.qa.soak"),
    Command("bench transfer", "KV transfer goodput between a prefill and a decode process", "kvpipe.bench.transfer"),
    Command(
        "bench chaos",
        "kill -9 campaign: kill parts of a supervised PD stack under load, check recovery",
        "kvpipe.qa.chaos",
    ),
    Command("testbed", "emulated link between two network namespaces (up/down/status)", "kvpipe.qa.testbed_cli"),
]
GROUP_HELP = {"bench": "benchmarks (results as JSON and PNG)"}


# ---- flags shared by every command that builds a ServerConfig --------------------------------------
def add_server_args(p: argparse.ArgumentParser) -> None:
    d_cache, d_sched = CacheConfig(), SchedulerConfig()
    p.add_argument(
        "--model-path", default=None, help="local HF checkpoint directory (default: the built-in tiny preset)"
    )
    p.add_argument("--tokenizer-path", default=None, help="tokenizer directory (default: --model-path)")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: the directory name)")
    p.add_argument("--tp-size", "--tp", type=int, default=1, help="tensor parallel ranks")
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch intra-op threads of this server, split among its TP ranks (default: the "
        "cores of its CPU affinity; `kvpipe launch` gives prefill and decode disjoint shares)",
    )
    p.add_argument("--page-size", type=int, default=d_cache.page_size, help="tokens per KV page")
    p.add_argument("--max-total-tokens", type=int, default=d_cache.max_total_tokens, help="KV cache capacity in tokens")
    p.add_argument(
        "--disable-radix-cache", action="store_true", help="do not keep finished requests' KV pages for prefix reuse"
    )
    p.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=d_sched.chunked_prefill_size,
        help="max prompt tokens per prefill step (<= 0 disables chunking)",
    )
    p.add_argument(
        "--max-prefill-tokens", type=int, default=d_sched.max_prefill_tokens, help="token budget of one prefill batch"
    )
    p.add_argument("--max-running-requests", type=int, default=d_sched.max_running_requests)
    p.add_argument(
        "--max-state-slots",
        type=int,
        default=None,
        help="hybrid (linear-attention) models: per-request recurrent-state slots; a request waits "
        "for a free one like for pages (default: --max-running-requests)",
    )
    p.add_argument("--context-length", type=int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--random-seed", "--seed", dest="seed", type=int, default=0, help="sampling seed")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    add_disaggregation_args(p)


def add_disaggregation_args(p: argparse.ArgumentParser) -> None:
    """SGLang's --disaggregation-* flags (PD serving; see kvpipe/disagg/)."""
    d = DisaggregationConfig()
    g = p.add_argument_group("PD disaggregation")
    g.add_argument(
        "--disaggregation-mode",
        choices=["null", "prefill", "decode"],
        default=d.mode,
        help="null: colocated server; prefill / decode: one half of a PD pair behind sglang-router",
    )
    g.add_argument(
        "--disaggregation-bootstrap-port",
        type=int,
        default=d.bootstrap_port,
        help="prefill: port of its bootstrap server (decode servers fetch its KV layout there)",
    )
    g.add_argument(
        "--disaggregation-transfer-backend",
        choices=["mooncake", "local"],
        default=d.transfer_backend,
        help="KV transfer engine (local: in-process copies, tests only)",
    )
    g.add_argument(
        "--disaggregation-ib-device", default=None, help="RDMA device for Mooncake (e.g. mlx5_0); default: TCP"
    )
    g.add_argument(
        "--disaggregation-host",
        default=None,
        help="address peers reach this server's KV data plane at (default: --host)",
    )
    g.add_argument(
        "--disaggregation-layer-groups",
        type=_layer_groups,
        default=d.layer_groups,
        help="prefill: 'auto' (per batch from measured compute and link speed; short prompts "
        "take the plain path) or N layer groups whose KV ships while the next computes "
        "(1: plain transfer after the forward)",
    )
    g.add_argument(
        "--disaggregation-enable-decode-radix-cache",
        action="store_true",
        help="decode: keep finished requests' KV in a radix cache and have the prefill send only "
        "the pages of a prompt past its longest cached prefix",
    )
    g.add_argument(
        "--disaggregation-staging-buffer",
        choices=list(STAGING_MODES),
        default=d.staging,
        help="heterogeneous TP (prefill and decode TP sizes differ): 'on' gathers each send's "
        "head slices into one staged chunk written with one op into the decode's staging "
        "ring, 'auto' stages when the chunk's page ops would cost more, 'off' writes "
        "each (layer, K/V, page) slice as its own op",
    )
    g.add_argument(
        "--disaggregation-staging-pool-size-mb",
        type=int,
        default=d.staging_pool_mb,
        help="decode: staging ring per TP rank; prefill: its local staging buffer (MB)",
    )
    g.add_argument(
        "--disaggregation-bootstrap-timeout",
        type=float,
        default=d.bootstrap_timeout_s,
        help="seconds to reach the peer and exchange the request's pages",
    )
    g.add_argument(
        "--disaggregation-waiting-timeout",
        type=float,
        default=d.waiting_timeout_s,
        help="decode: seconds a request may wait for free pages, then for its KV",
    )
    g.add_argument(
        "--disaggregation-heartbeat-interval",
        type=float,
        default=d.heartbeat_interval_s,
        help="seconds between heartbeats; a peer silent for 5 intervals is dead",
    )
    g.add_argument(
        "--disaggregation-transfer-timeout",
        type=float,
        default=d.transfer_timeout_s,
        help="seconds a KV write may make no progress before its request fails",
    )
    g.add_argument(
        "--disaggregation-auth-token",
        default=None,
        help=f"shared secret of the PD deployment (same on every prefill and decode server): "
        f"authenticates bootstrap calls and every control-plane message (HMAC, timestamp, "
        f"replay check); prefer ${TOKEN_ENV}, which stays out of process lists. Without "
        f"one, bootstrap and control plane listen on the data-plane address only",
    )
    # test-only: fail each transfer batch with this probability (seeded by the next flag)
    g.add_argument("--disaggregation-failure-prob", type=float, default=d.faults.prob, help=argparse.SUPPRESS)
    g.add_argument("--disaggregation-failure-seed", type=int, default=d.faults.seed, help=argparse.SUPPRESS)


def _layer_groups(value: str) -> int | str:
    try:
        return parse_layer_groups(value)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def disaggregation_config_from_args(args: argparse.Namespace) -> DisaggregationConfig:
    try:
        return DisaggregationConfig(
            mode=args.disaggregation_mode,
            bootstrap_port=args.disaggregation_bootstrap_port,
            transfer_backend=args.disaggregation_transfer_backend,
            ib_device=args.disaggregation_ib_device,
            host=args.disaggregation_host,
            layer_groups=args.disaggregation_layer_groups,
            decode_radix_cache=args.disaggregation_enable_decode_radix_cache,
            staging=args.disaggregation_staging_buffer,
            staging_pool_mb=args.disaggregation_staging_pool_size_mb,
            bootstrap_timeout_s=args.disaggregation_bootstrap_timeout,
            waiting_timeout_s=args.disaggregation_waiting_timeout,
            heartbeat_interval_s=args.disaggregation_heartbeat_interval,
            transfer_timeout_s=args.disaggregation_transfer_timeout,
            auth_token=args.disaggregation_auth_token or token_from_env(),
            faults=FaultInjection(args.disaggregation_failure_prob, args.disaggregation_failure_seed),
        )
    except ConfigError as e:
        raise SystemExit(f"kvpipe: {e}") from e


def _positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value < 1:
        raise SystemExit(f"kvpipe: {name} must be a positive integer, got {value}")


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Flags from `add_server_args` (plus --host/--port when present) -> a ServerConfig."""
    for name in ("tp_size", "page_size", "max_total_tokens", "max_running_requests", "max_prefill_tokens"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    _positive("--context-length", args.context_length, allow_none=True)
    _positive("--max-state-slots", args.max_state_slots, allow_none=True)
    _positive("--cpu-threads", args.cpu_threads, allow_none=True)
    body_limit = getattr(args, "max_request_body_bytes", DEFAULT_MAX_REQUEST_BODY_BYTES)
    _positive("--max-request-body-bytes", body_limit)
    disagg = disaggregation_config_from_args(args)
    from kvpipe.model.presets import resolve_model_path  # lazy: presets import torch

    model_path = resolve_model_path(args.model_path)
    try:
        cfg = ServerConfig(
            model_path=model_path,
            host=getattr(args, "host", "127.0.0.1"),
            port=getattr(args, "port", 30000),
            max_request_body_bytes=body_limit,
            served_model_name=args.served_model_name,
            tokenizer_path=args.tokenizer_path,
            tp_size=args.tp_size,
            cpu_threads=args.cpu_threads,
            device=args.device,
            seed=args.seed,
            log_level=args.log_level,
            cache=CacheConfig(
                page_size=args.page_size,
                max_total_tokens=args.max_total_tokens,
                radix_cache=not args.disable_radix_cache,
                max_state_slots=args.max_state_slots,
            ),
            scheduler=SchedulerConfig(
                max_running_requests=args.max_running_requests,
                chunked_prefill_size=args.chunked_prefill_size,
                max_prefill_tokens=args.max_prefill_tokens,
                context_length=args.context_length,
            ),
            disaggregation=disagg,
        )
        cfg.check_servable()
        return cfg
    except ConfigError as e:
        raise SystemExit(f"kvpipe: {e}") from e


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Mooncake's transfer engine reads its log level from the environment when it starts (later,
    # and in TP children, which inherit it): its INFO lines only with --log-level debug; a
    # user's MC_LOG_LEVEL wins
    os.environ.setdefault("MC_LOG_LEVEL", "INFO" if level == "debug" else "WARNING")
    if level != "debug":  # httpx logs a line per bootstrap call at INFO
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)


# ---- serve ---------------------------------------------------------------------------------------
def _serve_args(p: argparse.ArgumentParser) -> None:
    add_server_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="refuse request bodies larger than this with 413 (default: 32 MiB)",
    )


def _serve(args: argparse.Namespace, extra: list[str]) -> int:
    cfg = server_config_from_args(args)
    mode = cfg.disaggregation.mode
    if mode != "null" and cfg.disaggregation.transfer_backend == "local":
        raise SystemExit(
            "kvpipe: --disaggregation-transfer-backend local only connects engines inside one "
            "process; PD servers need mooncake"
        )
    _setup_logging(cfg.log_level)
    from kvpipe.server.http_server import run_server

    return run_server(cfg, engine_factory(cfg), mode)


def engine_factory(cfg: ServerConfig) -> Callable[[], object]:
    """What the server's engine thread builds: an Engine, with the PD connector of its mode."""

    def build() -> object:
        from kvpipe.disagg import make_connector
        from kvpipe.engine.engine import Engine

        return Engine(cfg, make_connector(cfg))

    return build


# ---- generate ------------------------------------------------------------------------------------
def _generate_args(p: argparse.ArgumentParser) -> None:
    add_server_args(p)
    p.add_argument("--prompt", required=True, action="append", help="prompt text (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt (text, output_ids, ...)")


def _generate(args: argparse.Namespace, extra: list[str]) -> int:
    from kvpipe.engine.engine import Engine
    from kvpipe.engine.request import SamplingParams

    _positive("--max-new-tokens", args.max_new_tokens)
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise SystemExit("kvpipe: --temperature must be >= 0 and --top-p in (0, 1]")
    cfg = server_config_from_args(args)
    _setup_logging("warning" if args.log_level == "info" else args.log_level)
    from kvpipe.engine.cpu_threads import apply_cpu_threads, server_cpu_threads

    apply_cpu_threads(server_cpu_threads(cfg))  # as a server would, before the model loads
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
    )
    engine = Engine(cfg)
    try:
        results = engine.generate(args.prompt, params)
    finally:
        engine.shutdown()
    for prompt, r in zip(args.prompt, results):
        if args.json:
            print(json.dumps({"prompt": prompt, **r}, ensure_ascii=False))
        else:
            print(r["text"])
    return 0


# ---- init-model ----------------------------------------------------------------------------------
def _init_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        default="tiny",
        choices=[
            "tiny",
            "bench",
            "tiny-qwen3-moe",
            "tiny-minimax-m2",
            "tiny-deepseek-v3",
            "tiny-qwen3.5",
            "tiny-qwen3.5-moe",
            "tiny-gpt-oss",
        ],
    )
    p.add_argument("--out", required=True, help="directory to write the checkpoint into")
    p.add_argument("--seed", type=int, default=0, help="weight seed")


def _init_model(args: argparse.Namespace, extra: list[str]) -> int:
    from kvpipe.model.presets import write_preset

    out = write_preset(args.preset, args.out, seed=args.seed)
    print(out)
    return 0


_LOCAL: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace, list[str]], int]]] = {
    "serve": (_serve_args, _serve),
    "generate": (_generate_args, _generate),
    "init-model": (_init_model_args, _init_model),
}


def _handlers(cmd: Command) -> tuple[Callable, Callable]:
    if cmd.module is None:
        return _LOCAL[cmd.name]
    mod = importlib.import_module(cmd.module)
    return mod.add_args, mod.run


def _positionals(argv: list[str]) -> list[str]:
    return [a for a in argv if not a.startswith("-")][:2]


def build_parser(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, dict[tuple[str, ...], tuple]]:
    """The full parser; with `argv`, only the command it names imports its module and adds its flags
    (so `kvpipe serve` never imports the benchmarks). Returns the parser and path -> (Command, run)."""
    wanted = _positionals(argv) if argv is not None else None
    parser = argparse.ArgumentParser(prog="kvpipe", description="prefill/decode disaggregated LLM serving")
    sub = parser.add_subparsers(dest="cmd0", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    runners: dict[tuple[str, ...], tuple] = {}
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
            runners[path] = (cmd, run)
    return parser, runners


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, runners = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    path = (args.cmd0,) if (args.cmd0,) in runners else (args.cmd0, getattr(args, "cmd1", None))
    cmd, run = runners[path]
    if extra and not cmd.pass_unknown:
        parser.error(f"unrecognized arguments for {cmd.name}: {' '.join(extra)}")
    return int(run(args, extra) or 0)


if __name__ == "__main__":
    sys.exit(main())
