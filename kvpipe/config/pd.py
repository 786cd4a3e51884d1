"""PD disaggregation's config (SGLang's --disaggregation-* flags): DisaggregationConfig with its
TransferTuning, FaultInjection and ControlLimits parts, port ranges, layer groups, the bootstrap
allow list."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from kvpipe.config.errors import ConfigError

DISAGGREGATION_MODES = ("null", "prefill", "decode")


STAGING_MODES = ("off", "on", "auto")


@dataclass(frozen=True)
class PortRange:
    """TCP ports `first`..`last` (both included) a server's listeners draw from, so that a firewall
    or a Kubernetes NetworkPolicy can name them (kvpipe/listen_ports.py)."""

    first: int
    last: int

    def __post_init__(self) -> None:
        if not (type(self.first) is int and type(self.last) is int and 1 <= self.first <= self.last <= 65535):
            raise ConfigError(f"a port range needs 1 <= first <= last <= 65535, got {self.first}-{self.last}")

    @property
    def size(self) -> int:
        return self.last - self.first + 1

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"

    @classmethod
    def parse(cls, text: str) -> PortRange:
        """`LO-HI` (or one port `P`) -> a PortRange."""
        lo, sep, hi = text.strip().partition("-")
        try:
            return cls(int(lo), int(hi) if sep else int(lo))
        except ValueError:
            raise ConfigError(f"expected a port range LO-HI (e.g. 17000-17031), got {text!r}") from None


MIN_AUTH_TOKEN_CHARS = 16  # shorter shared secrets are guessable offline from one captured frame


def parse_layer_groups(value: str | int) -> int | str:
    """The text of --disaggregation-layer-groups -> 'auto' or a group count N >= 1 (1: plain path)."""
    v = value.strip().lower() if isinstance(value, str) else value
    if v == "auto":
        return "auto"
    try:
        n = int(v)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or isinstance(v, bool) or isinstance(v, float):
        raise ConfigError(f"layer groups must be 'auto' or an integer >= 1, got {value!r}")
    return n


# fullmatch, and \Z in the look-ahead: "$" also matches before a trailing newline
_HOSTNAME = re.compile(r"(?=.{1,253}\Z)[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_][a-z0-9_-]{0,62})*")


def parse_bootstrap_allow(
    entries: Sequence[str],
) -> tuple[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...], frozenset[str]]:
    """--disaggregation-bootstrap-allow entries -> (networks, host names, lower case); a single
    address is a network of one. ConfigError for anything else."""
    if isinstance(entries, str):
        raise ConfigError("the bootstrap allow list is a sequence of entries, not one string")
    nets, names = [], set()
    for raw in entries:
        entry = str(raw).strip()
        try:
            nets.append(ipaddress.ip_network(entry, strict=False))
            continue
        except ValueError:
            pass
        name = entry.lower().rstrip(".")
        if not _HOSTNAME.fullmatch(name) or name.replace(".", "").isdigit():
            raise ConfigError(
                f"--disaggregation-bootstrap-allow entry {raw!r} is neither a network (CIDR), "
                "an address nor a host name"
            )
        names.add(name)
    return tuple(nets), frozenset(names)


@dataclass(frozen=True)
class TransferTuning:
    """How the transfer layer paces and bounds itself. No flags: the defaults hold on the links
    measured (docs/benchmarks.md); tests tighten them."""

    max_inflight_ops: int = 1024  # per sender; Mooncake rejects past ~2,048 per peer (architecture.md)
    http_timeout_s: float = 2.0  # one bootstrap HTTP call
    control_send_hwm: int = 10000  # queued control messages per peer before sends are dropped
    tick_s: float = 0.0005  # sender worker sleep between backend polls while writes are in flight
    # ... growing to a quarter of the time since a batch last finished (or was submitted), up to
    # this: on a slow link a write takes far longer than a tick, and polling at 2 kHz would take
    # CPU (and the GIL) from the prefill forward that layer-pipelined transfer overlaps with
    # (issue 34: the worker took 0.18 CPU-s per 2,048-token request at 4 ms, 0.10 at 16 ms, on 150
    # Mbit/s; a write that finishes is seen at most 16 ms or a quarter of its time late)
    max_tick_s: float = 0.016
    idle_tick_s: float = 0.01  # worker sleep when nothing is in flight
    # decode: the receiver worker's period for deadlines, heartbeats and failures that no message
    # brings (messages are handled as they arrive, on their own thread). At 10 ms its wake-ups took
    # ~0.055 CPU-s per 2,048-token request from the cores a prefill on the same host computes on
    # (issue 34); deadlines and heartbeat periods are in seconds
    receiver_tick_s: float = 0.05
    # decode: a bootstrap address never fetched from successfully whose fetch failed is refused
    # this long without a new try (transfer/control/fetch_guard.py)
    bootstrap_negative_ttl_s: float = 10.0

    def __post_init__(self) -> None:
        for name in (
            "http_timeout_s",
            "tick_s",
            "max_tick_s",
            "idle_tick_s",
            "receiver_tick_s",
            "bootstrap_negative_ttl_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_inflight_ops < 1 or self.control_send_hwm < 1:
            raise ConfigError("max_inflight_ops and control_send_hwm must be >= 1")


@dataclass(frozen=True)
class FaultInjection:
    """Test knob (--disaggregation-failure-prob/-seed): each KV transfer batch fails with
    probability `prob`, drawn from a generator seeded with `seed` (reproducible). A failed batch
    really writes a random prefix of its ops first, like a link that dies midway (the backends'
    injector, kvpipe/transfer/backends/base.py). With `max_failures` set, a backend fails at most
    that many batches and runs every later one: which room a batch belongs to (a room's chunks and
    how they coalesce) depends on timing, so a test that needs rooms of both outcomes bounds the
    failures below its number of rooms instead of hoping the seed spreads them."""

    prob: float = 0.0
    seed: int = 0
    max_failures: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.prob <= 1.0:
            raise ConfigError(f"failure probability must be in [0, 1], got {self.prob}")
        if self.max_failures is not None and not (type(self.max_failures) is int and self.max_failures >= 0):
            raise ConfigError(f"max failures must be a whole number >= 0 or None, got {self.max_failures!r}")

    @property
    def enabled(self) -> bool:
        return self.prob > 0.0


def require_counts(limits: Any) -> None:
    """Every field of a frozen limits dataclass is a whole number >= 1 (a cap of 0 would refuse
    everything; a float or a bool is a typo)."""
    for f in fields(limits):
        v = getattr(limits, f.name)
        if not (type(v) is int and v >= 1):
            raise ConfigError(f"{f.name} must be a whole number >= 1, got {v!r}")


@dataclass(frozen=True)
class ControlLimits:
    """What one peer's control messages may make a PD server hold (issue 30): per session (a decode
    rank's registration on a prefill rank; a prefill rank's chunks at a decode rank's staging
    agent), sessions per prefill rank and per decode endpoint, open sockets per control endpoint. A
    peer past a per-peer bound gets a refusal that names it (a failed status or grant), never
    another peer's state dropped; past the session bounds the least recently used session without
    rooms in flight is evicted and told (transfer/sender/peers.py), so no decode is locked out."""

    max_sessions: int = 1024  # decode sessions registered with one prefill rank at a time
    # rooms a session requested before the prefill engine admitted them (each holds its page list
    # for up to waiting_timeout_s)
    max_orphan_rooms_per_session: int = 256
    # rooms a session made a prefill rank remember as refused or aborted (each for 2 x
    # waiting_timeout_s + bootstrap_timeout_s); past it the session's oldest is forgotten
    max_tombstones_per_session: int = 1024
    max_staging_waits_per_session: int = 64  # slot requests queued at a staging agent (a full ring)
    max_reply_sockets: int = 1024  # PUSH sockets a control endpoint keeps open (least recently used closed)
    # decode sessions one endpoint (control address, decode rank) keeps with a prefill rank: a decode
    # has one per prefill instance it knows under each bootstrap address (issue 45)
    max_sessions_per_endpoint: int = 8
    # seconds a decode session without a room stays registered (heartbeats or not); then it is
    # evicted and its decode registers again when it needs the prefill (one round trip)
    session_idle_s: int = 600

    def __post_init__(self) -> None:
        require_counts(self)


@dataclass(frozen=True)
class DisaggregationConfig:
    """Prefill/decode disaggregation of one server: SGLang's --disaggregation-* flags (validated
    once, here; every layer takes this object), with the transfer layer's tuning and the test
    fault injection as their own parts."""

    mode: str = "null"  # "null" (colocated) | "prefill" | "decode"
    bootstrap_port: int = 8998  # prefill: where its bootstrap HTTP server listens (0: a free port)
    # a name in kvpipe/transfer/backends/registry.py, which checks it (check_backend; this layer
    # imports nothing of kvpipe)
    transfer_backend: str = "mooncake"
    ib_device: str | None = None  # RDMA device for Mooncake; None: TCP
    host: str | None = None  # data/control-plane address; None: ServerConfig.host
    # where the ZeroMQ control endpoints listen (one per TP rank, plus a decode's receiver); None:
    # any free port. Mooncake's listeners: its handshake and TCP data ports (two per transfer
    # engine; MC_MIN_RPC_PORT..MC_MAX_RPC_PORT); None: $MC_MIN_RPC_PORT..$MC_MAX_RPC_PORT, else
    # Mooncake's own 15000-17000. Fixed ranges let a firewall or a NetworkPolicy name them.
    control_ports: PortRange | None = None
    mooncake_ports: PortRange | None = None
    # prefill: "auto" (a cost model picks the layer groups per batch; short prompts take the plain
    # path) or a fixed group count N (1: plain path, no layer pipelining)
    layer_groups: int | str = "auto"
    # prefill, "auto": a batch with fewer new prompt tokens than this takes the plain path (above
    # it the cost model still keeps the plain path where groups save under 5%; 256-token prompts at
    # T ~ C took 0.61x the plain path's TTFT in groups, docs/benchmarks.md, issue 34)
    layer_groups_min_tokens: int = 128
    # decode: match each prompt against a radix cache of KV this server already holds and ask the
    # prefill only for the pages past it (SGLang's --disaggregation-enable-decode-radix-cache)
    decode_radix_cache: bool = False
    # Heterogeneous-TP transfer through a staging ring (transfer/staging/buffers.py): "off" (one write per
    # layer, K/V and page of a head slice), "on" (every head-sliced send is gathered into one
    # staged chunk per destination and written with one op) or "auto" (staged when the planner's
    # cost model says the chunk's ops cost more than staging it). A decode with "off" offers no
    # ring; a prefill stages only into decodes that offer one.
    staging: str = "off"
    # decode: bytes of its staging ring per TP rank; prefill: bytes of its local staging buffer
    staging_pool_mb: int = 64
    # Prefill: add_room -> the decode's TransferRequest. Decode: add_room -> TransferRequest sent
    # (bootstrap fetch, compatibility check, peer registration).
    bootstrap_timeout_s: float = 30.0
    # Decode: seconds a request may wait for free pages, then (from the TransferRequest) for every
    # prefill rank's Success (SGLang's default 300 s: the prefill may queue the request).
    waiting_timeout_s: float = 300.0
    # A peer silent for misses * interval is dead. Lenient: on a loaded 2-core host a busy
    # process can stall for seconds, and a false death fails every room with that peer.
    heartbeat_interval_s: float = 2.0
    heartbeat_misses: int = 5
    # Prefill: a write batch fails its room when nothing to that peer completed for this long
    # (the backend's own stall detection usually fires first). Decode: a failed room whose
    # prefill never acknowledges keeps its pages reserved at most this long.
    transfer_timeout_s: float = 60.0
    # Shared secret of a PD deployment (transfer/control/auth.py): authenticates bootstrap registrations
    # and look-ups and every control-plane frame. None: unauthenticated, and both bound to the
    # data-plane address only. Not in repr: configs get logged.
    auth_token: str | None = field(default=None, repr=False)
    # decode: where it may fetch bootstrap info (networks in CIDR notation or host names, loopback
    # included only when listed; empty: anywhere, and without an auth token loopback only); the
    # request body names the host (transfer/control/fetch_guard.py)
    bootstrap_allow: tuple[str, ...] = ()
    # without an auth token, serve PD on a non-loopback data-plane address anyway
    insecure: bool = False
    # decode: ask every prefill rank for a keyed digest of the KV it wrote and check it before the
    # first decode step (transfer/kv_digest.py; a prefill always answers such a request)
    kv_integrity: bool = False
    tuning: TransferTuning = field(default_factory=TransferTuning)
    faults: FaultInjection = field(default_factory=FaultInjection)
    limits: ControlLimits = field(default_factory=ControlLimits)

    def __post_init__(self) -> None:
        if self.mode not in DISAGGREGATION_MODES:
            raise ConfigError(f"disaggregation mode must be one of {DISAGGREGATION_MODES}, got {self.mode!r}")
        if not 0 <= self.bootstrap_port < 65536:
            raise ConfigError(f"bootstrap port {self.bootstrap_port} is not a TCP port")
        if self.layer_groups != "auto" and not (type(self.layer_groups) is int and self.layer_groups >= 1):
            raise ConfigError(f"layer groups must be 'auto' or an integer >= 1, got {self.layer_groups!r}")
        if not (type(self.layer_groups_min_tokens) is int and self.layer_groups_min_tokens >= 0):
            raise ConfigError(
                f"layer groups min tokens must be a whole number >= 0, got {self.layer_groups_min_tokens!r}"
            )
        for name in ("bootstrap_timeout_s", "waiting_timeout_s", "heartbeat_interval_s", "transfer_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.heartbeat_misses < 1:
            raise ConfigError(f"heartbeat_misses must be >= 1, got {self.heartbeat_misses}")
        if self.decode_radix_cache and self.mode != "decode":
            raise ConfigError(
                "the decode radix cache (--disaggregation-enable-decode-radix-cache) is for "
                f"--disaggregation-mode decode, not {self.mode}"
            )
        if self.staging not in STAGING_MODES:
            raise ConfigError(f"staging buffer must be one of {STAGING_MODES}, got {self.staging!r}")
        if not (type(self.staging_pool_mb) is int and self.staging_pool_mb >= 1):
            raise ConfigError(f"staging pool size must be a whole number of MB >= 1, got {self.staging_pool_mb!r}")
        if self.auth_token is not None and len(self.auth_token) < MIN_AUTH_TOKEN_CHARS:
            raise ConfigError(
                f"the disaggregation auth token needs at least {MIN_AUTH_TOKEN_CHARS} characters "
                "(a short secret is guessable offline from one captured message)"
            )
        parse_bootstrap_allow(self.bootstrap_allow)

    @property
    def enabled(self) -> bool:
        return self.mode != "null"

    @property
    def heartbeat_timeout_s(self) -> float:
        return self.heartbeat_interval_s * self.heartbeat_misses

    @property
    def staging_pool_nbytes(self) -> int:
        return self.staging_pool_mb << 20
