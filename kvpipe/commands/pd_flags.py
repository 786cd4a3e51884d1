"""SGLang's --disaggregation-* flags (PD serving) and the DisaggregationConfig they make; part of
the flags of every command that builds a ServerConfig (flags.py)."""

from __future__ import annotations

import argparse
import os

from kvpipe.config import (
    STAGING_MODES,
    ConfigError,
    ControlLimits,
    DisaggregationConfig,
    FaultInjection,
    PortRange,
    parse_layer_groups,
)
from kvpipe.sglang_env import LayersPerGroup, flag_defaults
from kvpipe.transfer.backends.registry import BACKENDS, backend_names
from kvpipe.transfer.control.auth import TOKEN_ENV, token_from_env


def add_disaggregation_args(p: argparse.ArgumentParser) -> None:
    """SGLang's --disaggregation-* flags (PD serving; see kvpipe/disagg/), with the defaults the
    SGLANG_* variables in our environment give them (ConfigError naming a malformed one)."""
    d = DisaggregationConfig()
    g = p.add_argument_group("PD disaggregation")
    _add_wiring_args(g, d)
    _add_transfer_args(g, d)
    _add_deadline_args(g, d)
    _add_security_args(g)
    _add_limit_args(g, d)
    p.set_defaults(**flag_defaults(os.environ))


def _add_wiring_args(g: argparse._ArgumentGroup, d: DisaggregationConfig) -> None:
    """Which side this server is, and where its peers reach it."""
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
        choices=backend_names(),
        default=d.transfer_backend,
        help="KV transfer engine: " + "; ".join(f"{s.name}: {s.summary}" for s in BACKENDS),
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
        "--disaggregation-control-ports",
        type=_port_range_arg,
        default=None,
        metavar="LO-HI",
        help="ports the control-plane sockets listen on (one per TP rank, a decode's receiver one "
        "more), so a firewall or a NetworkPolicy can name them (default: any free port)",
    )
    g.add_argument(
        "--disaggregation-mooncake-ports",
        type=_port_range_arg,
        default=None,
        metavar="LO-HI",
        help="ports Mooncake's transfer engines listen on (handshake and TCP data: two per TP rank, "
        "two more per rank with the KV tier) (default: $MC_MIN_RPC_PORT-$MC_MAX_RPC_PORT, else 15000-17000)",
    )


def _add_transfer_args(g: argparse._ArgumentGroup, d: DisaggregationConfig) -> None:
    """How the KV moves: layer groups, decode prefix reuse, staging."""
    g.add_argument(
        "--disaggregation-layer-groups",
        type=_layer_groups_arg,
        default=d.layer_groups,
        help="prefill: 'auto' (per batch from measured compute and link speed; short prompts "
        "take the plain path) or N layer groups whose KV ships while the next computes "
        "(1: plain transfer after the forward)",
    )
    g.add_argument(
        "--disaggregation-layer-groups-min-tokens",
        type=int,
        default=d.layer_groups_min_tokens,
        help="prefill, layer groups 'auto': a batch with fewer new prompt tokens takes the plain path",
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


def _add_deadline_args(g: argparse._ArgumentGroup, d: DisaggregationConfig) -> None:
    """Deadlines and heartbeats: no request waits on a peer without one."""
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
        help="seconds between heartbeats",
    )
    g.add_argument(
        "--disaggregation-heartbeat-max-failure",
        type=int,
        default=d.heartbeat_misses,
        help="a peer that misses this many heartbeats in a row is dead",
    )
    g.add_argument(
        "--disaggregation-transfer-timeout",
        type=float,
        default=d.transfer_timeout_s,
        help="seconds a KV write may make no progress before its request fails",
    )


def _add_security_args(g: argparse._ArgumentGroup) -> None:
    """The PD token, what a decode fetches from, and KV integrity."""
    g.add_argument(
        "--disaggregation-auth-token",
        default=None,
        help=f"shared secret of the PD deployment (same on every prefill and decode server): "
        f"authenticates bootstrap calls and every control-plane message (HMAC, timestamp, "
        f"replay check); prefer --disaggregation-auth-token-file or ${TOKEN_ENV}, which stay out "
        f"of process lists. Without one, bootstrap and control plane listen on the data-plane "
        f"address only, and only a loopback one unless --disaggregation-insecure",
    )
    g.add_argument(
        "--disaggregation-auth-token-file",
        default=None,
        help="read the shared PD secret from this file (its first line) instead of a flag",
    )
    g.add_argument(
        "--disaggregation-insecure",
        action="store_true",
        help="serve PD without an auth token on a non-loopback data-plane address (refused otherwise)",
    )
    g.add_argument(
        "--disaggregation-kv-integrity",
        action="store_true",
        help="decode: check a keyed digest of the KV every prefill rank wrote (BLAKE2b, sent with "
        "its final status) before a request's first decode step; a mismatch (a page written by "
        "anyone else meanwhile) fails that request. Costs a pass over the KV on both sides",
    )
    g.add_argument(
        "--disaggregation-bootstrap-allow",
        action="append",
        default=None,
        metavar="CIDR|HOST[,...]",
        help="decode: fetch bootstrap info (the request's bootstrap_host) only from these networks "
        "or host names, loopback included only when listed (repeatable, comma separated; default: "
        "anywhere, and without an auth token loopback only)",
    )


def _add_limit_args(g: argparse._ArgumentGroup, d: DisaggregationConfig) -> None:
    """Per-session caps on what a peer can make this server keep, and the test-only fault flags."""
    lim = d.limits
    for flag, default, what in (
        ("--disaggregation-max-sessions", lim.max_sessions, "decode sessions one prefill rank keeps registered"),
        (
            "--disaggregation-max-orphan-rooms",
            lim.max_orphan_rooms_per_session,
            "per decode session: rooms requested before the prefill admitted them",
        ),
        (
            "--disaggregation-max-tombstones",
            lim.max_tombstones_per_session,
            "per decode session: refused or aborted rooms a prefill rank remembers",
        ),
        (
            "--disaggregation-max-staging-waits",
            lim.max_staging_waits_per_session,
            "per prefill session: staging slot requests queued at a full staging ring",
        ),
        (
            "--disaggregation-max-reply-sockets",
            lim.max_reply_sockets,
            "control-plane sockets kept open per endpoint (least recently used closed)",
        ),
        (
            "--disaggregation-max-sessions-per-endpoint",
            lim.max_sessions_per_endpoint,
            "decode sessions one decode endpoint (control address, rank) keeps with a prefill rank",
        ),
        (
            "--disaggregation-session-idle-timeout",
            lim.session_idle_s,
            "seconds a decode session without a room stays registered with a prefill rank",
        ),
    ):
        g.add_argument(flag, type=int, default=default, help=f"{what} (default %(default)s)")
    # test-only: fail each transfer batch with this probability (seeded by the next flag)
    g.add_argument("--disaggregation-failure-prob", type=float, default=d.faults.prob, help=argparse.SUPPRESS)
    g.add_argument("--disaggregation-failure-seed", type=int, default=d.faults.seed, help=argparse.SUPPRESS)


def _port_range_arg(value: str) -> PortRange:
    try:
        return PortRange.parse(value)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _layer_groups_arg(value: str) -> int | str:
    try:
        return parse_layer_groups(value)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def disaggregation_config_from_args(args: argparse.Namespace, model_path: str) -> DisaggregationConfig:
    """The --disaggregation-* flags -> a DisaggregationConfig (`model_path`: the served checkpoint,
    whose depth turns SGLANG_PIPELINE_GROUP_SIZE's layers per group into a group count)."""
    try:
        layer_groups = args.disaggregation_layer_groups
        if isinstance(layer_groups, LayersPerGroup):
            from kvpipe.model.checkpoint.config_reader import model_config_of  # torch (GGUF): not on --help's path

            try:
                layer_groups = layer_groups.groups(model_config_of(model_path).num_layers)
            except ConfigError as e:
                raise ConfigError(f"SGLANG_PIPELINE_GROUP_SIZE counts layers, so it needs the model's: {e}") from e
        return DisaggregationConfig(
            mode=args.disaggregation_mode,
            bootstrap_port=args.disaggregation_bootstrap_port,
            transfer_backend=args.disaggregation_transfer_backend,
            ib_device=args.disaggregation_ib_device,
            host=args.disaggregation_host,
            control_ports=args.disaggregation_control_ports,
            mooncake_ports=args.disaggregation_mooncake_ports,
            layer_groups=layer_groups,
            layer_groups_min_tokens=args.disaggregation_layer_groups_min_tokens,
            decode_radix_cache=args.disaggregation_enable_decode_radix_cache,
            staging=args.disaggregation_staging_buffer,
            staging_pool_mb=args.disaggregation_staging_pool_size_mb,
            bootstrap_timeout_s=args.disaggregation_bootstrap_timeout,
            waiting_timeout_s=args.disaggregation_waiting_timeout,
            heartbeat_interval_s=args.disaggregation_heartbeat_interval,
            heartbeat_misses=args.disaggregation_heartbeat_max_failure,
            transfer_timeout_s=args.disaggregation_transfer_timeout,
            auth_token=_auth_token(args),
            bootstrap_allow=tuple(
                e.strip() for arg in args.disaggregation_bootstrap_allow or () for e in arg.split(",") if e.strip()
            ),
            insecure=args.disaggregation_insecure,
            kv_integrity=args.disaggregation_kv_integrity,
            faults=FaultInjection(args.disaggregation_failure_prob, args.disaggregation_failure_seed),
            limits=ControlLimits(
                args.disaggregation_max_sessions,
                args.disaggregation_max_orphan_rooms,
                args.disaggregation_max_tombstones,
                args.disaggregation_max_staging_waits,
                args.disaggregation_max_reply_sockets,
                args.disaggregation_max_sessions_per_endpoint,
                args.disaggregation_session_idle_timeout,
            ),
        )
    except ConfigError as e:
        raise SystemExit(f"kvpipe: {e}") from e


def _auth_token(args: argparse.Namespace) -> str | None:
    """--disaggregation-auth-token, else the first line of --disaggregation-auth-token-file, else
    the environment."""
    path = args.disaggregation_auth_token_file
    if path is None:
        return args.disaggregation_auth_token or token_from_env()
    if args.disaggregation_auth_token:
        raise ConfigError("give --disaggregation-auth-token or --disaggregation-auth-token-file, not both")
    try:
        with open(path, encoding="utf-8") as f:
            token = f.readline(4096).strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--disaggregation-auth-token-file {path}: {e}") from None
    if not token:
        raise ConfigError(f"--disaggregation-auth-token-file {path} is empty")
    return token
