"""sglang-router's command line in PD mode over a stack's prefill and decode servers. It runs
through router_main.py, which adds the stack's keys from its environment (StackSecrets.router_env)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

# How soon the router trusts a worker again. Its defaults (circuit open for 60 s after 10
# failures, health checks every 60 s, two good checks to come back) kept a prefill restarted in
# ~15 s, or a link healed, out of service for a minute (68 s measured after a partition, issue 50).
# Here: a check every 2 s that gives up after 3 s, one good check re-admits a worker (three bad
# ones still mark it down: 6 s), an open circuit half-opens after 3 s and one success closes it;
# so a healed worker is routed to again within ~3 + 2 s of answering. A check costs one GET per
# worker. README's router command by hand and deploy/k8s/base/router.yaml carry the same flags.
ROUTER_RECOVERY_FLAGS = (
    "--health-check-interval-secs",
    "2",
    "--health-check-timeout-secs",
    "3",
    "--health-success-threshold",
    "1",
    "--cb-timeout-duration-secs",
    "3",
    "--cb-success-threshold",
    "1",
)
# sglang-router 0.3.2's policies (its --prefill-policy also takes "bucket")
ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two", "manual")


def router_command(
    prefill_url: str,
    bootstrap_port: int,
    decode_url: str,
    host: str,
    port: int,
    prometheus_port: int,
) -> list[str]:
    """sglang-router in PD mode over one prefill and one decode (router_command_xpyd)."""
    return router_command_xpyd([(prefill_url, bootstrap_port)], [decode_url], host, port, prometheus_port)


def router_command_xpyd(
    prefills: Sequence[tuple[str, int]],
    decodes: Sequence[str],
    host: str,
    port: int,
    prometheus_port: int,
    prefill_policy: str | None = None,
    decode_policy: str | None = None,
) -> list[str]:
    """sglang-router in PD mode: `--prefill URL BOOTSTRAP_PORT` for each prefill, `--decode URL`
    for each decode, and the policies when given (the router's default: cache_aware). Its
    Prometheus exporter gets a port of its own (it defaults to a fixed one, so a second router on
    the machine would die at startup). No key is on it: router_main.py reads them from the
    environment."""
    workers: list[str] = []
    for url, bport in prefills:
        workers += ["--prefill", url, str(bport)]
    for url in decodes:
        workers += ["--decode", url]
    return [
        sys.executable,
        "-m",
        "kvpipe.launch.router_main",
        "--pd-disaggregation",
        *workers,
        *(["--prefill-policy", prefill_policy] if prefill_policy else []),
        *(["--decode-policy", decode_policy] if decode_policy else []),
        "--host",
        host,
        "--port",
        str(port),
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(prometheus_port),
        "--log-level",
        "warn",
        *ROUTER_RECOVERY_FLAGS,
    ]
