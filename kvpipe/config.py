"""Frozen configuration dataclasses the server and the engine are configured with (CLI flags).

What a checkpoint says of its model is in kvpipe/model/checkpoint/schema.py (ModelConfig).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A model directory or flag combination kvpipe cannot serve."""


@dataclass(frozen=True)
class ParallelConfig:
    tp_size: int = 1
    tp_rank: int = 0

    def local_heads(self, num_heads: int) -> int:
        if num_heads % self.tp_size:
            raise ConfigError(f"{num_heads} attention heads do not split over tp_size={self.tp_size}")
        return num_heads // self.tp_size

    def local_kv_heads(self, num_kv_heads: int) -> int:
        """KV heads held by one rank; with tp > kv heads each rank holds one replicated head."""
        if num_kv_heads >= self.tp_size:
            if num_kv_heads % self.tp_size:
                raise ConfigError(f"{num_kv_heads} KV heads do not split over tp_size={self.tp_size}")
            return num_kv_heads // self.tp_size
        if self.tp_size % num_kv_heads:
            raise ConfigError(f"tp_size={self.tp_size} is not a multiple of {num_kv_heads} KV heads")
        return 1

    def kv_head_start(self, num_kv_heads: int) -> int:
        """First global KV head index held by this rank."""
        if num_kv_heads >= self.tp_size:
            return self.tp_rank * (num_kv_heads // self.tp_size)
        return self.tp_rank // (self.tp_size // num_kv_heads)


# --dtype (weights and activations; "auto": fp32 on CPU, the checkpoint's dtype elsewhere) and
# --kv-cache-dtype (the KV pool; "auto": the model dtype), SGLang's names
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")
MAMBA_SCHEDULER_STRATEGIES = ("auto", "no_buffer", "extra_buffer")  # --mamba-scheduler-strategy
# --quantization (weight-only, CPU; kvpipe/model/quant/quantize.py): int8 per output channel, int4 in
# groups of 32; None: the weights in --dtype
QUANTIZATIONS = ("w8a16", "w4a16")
# --decode-fused-layer (kvpipe/model/cpu/fused_decode.py)
DECODE_FUSED_LAYER_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 64
    num_pages: int | None = None  # None: derived from max_total_tokens
    max_total_tokens: int = 65536  # KV capacity in tokens when num_pages is None
    debug_checks: bool = True  # catch double free / use-after-free in the allocator
    # keep finished requests' full KV pages in a radix (prefix) cache: colocated and prefill
    # servers skip computing a cached prefix; a decode server uses it only with
    # DisaggregationConfig.decode_radix_cache (then only the missing KV crosses the wire)
    radix_cache: bool = True
    # per-request recurrent-state slots of a hybrid model (kvpipe/cache/recurrent_pool.py); None:
    # SchedulerConfig.max_running_requests (then slots never limit admission)
    max_state_slots: int | None = None
    # what the KV pool stores (--kv-cache-dtype, SGLang's names): "auto" is the model dtype;
    # fp8 pools keep per-layer K and V scales (the checkpoint's k_scale / v_scale, else 1.0)
    kv_cache_dtype: str = "auto"
    # hybrid models with the radix cache (colocated): recurrent-state slots in all, the running
    # requests' (max_state_slots) plus the prefix cache's state snapshots (SGLang's
    # --max-mamba-cache-size); None: 2 snapshot slots per running one. Bounds snapshot memory
    # to (this - running slots) x one request's state
    max_mamba_cache_size: int | None = None
    # where those snapshots are taken (SGLang's --mamba-scheduler-strategy): "extra_buffer" (and
    # "auto") at any page boundary inside a forward's row (at most 63 tokens of the delta rule
    # run again per snapshot); "no_buffer" only where a row ends (a chunk or decode step)
    mamba_scheduler_strategy: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"KV cache dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.mamba_scheduler_strategy not in MAMBA_SCHEDULER_STRATEGIES:
            raise ConfigError(
                f"mamba scheduler strategy must be one of {MAMBA_SCHEDULER_STRATEGIES}, "
                f"got {self.mamba_scheduler_strategy!r}"
            )
        if self.max_mamba_cache_size is not None and self.max_mamba_cache_size < 1:
            raise ConfigError(f"max_mamba_cache_size must be positive, got {self.max_mamba_cache_size}")

    def pages(self) -> int:
        return self.num_pages if self.num_pages is not None else -(-self.max_total_tokens // self.page_size)


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 64
    chunked_prefill_size: int = 8192  # max prompt tokens per prefill step; <= 0 disables chunking
    max_prefill_tokens: int = 16384  # token budget of one prefill batch
    context_length: int | None = None  # None: model's max_position_embeddings


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


_HOSTNAME = re.compile(r"^(?=.{1,253}$)[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_][a-z0-9_-]{0,62})*$")


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
        if not _HOSTNAME.match(name) or name.replace(".", "").isdigit():
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


DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20  # an HTTP server's --max-request-body-bytes


# --speculative-algorithm (SGLang's names): what kvpipe runs, and what it names but refuses for now
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE", "NEXTN", "EAGLE")
SPECULATIVE_NOT_YET = ("EAGLE3",)
# drafted by the checkpoint's multi-token-prediction layer (SGLang turns NEXTN into EAGLE; kvpipe
# runs EAGLE without a draft model path as NEXTN; with one, an EAGLE head drafts the same way)
MTP_ALGORITHMS = ("NEXTN", "EAGLE")
NGRAM_DEFAULT_DRAFT_TOKENS = 8  # verified tokens per step: the last token and 7 drafts
STANDALONE_DEFAULT_NUM_STEPS = 3  # drafts per step of a draft model when neither count is given


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (SGLang's --speculative-* flags; kvpipe/engine/spec_*.py). algorithm
    None: off. num_draft_tokens counts the tokens one verify forward runs per request, as in
    SGLang: the last accepted token plus num_draft_tokens - 1 drafts (a chain: eagle_topk 1)."""

    algorithm: str | None = None
    num_steps: int | None = None  # a chain's drafts: num_draft_tokens - 1
    eagle_topk: int | None = None  # 1 (a chain) is all kvpipe verifies
    num_draft_tokens: int | None = None  # None: num_steps + 1, else NGRAM_DEFAULT_DRAFT_TOKENS
    # NGRAM: the suffix of the request's tokens looked up in its own earlier tokens, in tokens
    ngram_min_match_window_size: int = 1
    ngram_max_match_window_size: int = 12
    # STANDALONE: the draft model's checkpoint (same tokenizer as the target)
    draft_model_path: str | None = None

    def __post_init__(self) -> None:
        a = self.algorithm
        if a is None:
            return
        if a.upper() in SPECULATIVE_NOT_YET:
            raise ConfigError(
                f"--speculative-algorithm {a} is not implemented yet; kvpipe runs {', '.join(SPECULATIVE_ALGORITHMS)}"
            )
        if a.upper() not in SPECULATIVE_ALGORITHMS:
            raise ConfigError(f"--speculative-algorithm must be one of {SPECULATIVE_ALGORITHMS}, got {a!r}")
        for name in ("num_steps", "eagle_topk", "num_draft_tokens"):
            v = getattr(self, name)
            if v is not None and not (type(v) is int and v >= 1):
                raise ConfigError(f"--speculative-{name.replace('_', '-')} must be a whole number >= 1, got {v!r}")
        if self.eagle_topk not in (None, 1):
            raise ConfigError(f"--speculative-eagle-topk {self.eagle_topk}: kvpipe verifies a chain only (topk 1)")
        if (
            self.num_steps is not None
            and self.num_draft_tokens is not None
            and self.num_draft_tokens != self.num_steps + 1
        ):
            raise ConfigError(
                f"--speculative-num-draft-tokens {self.num_draft_tokens} with --speculative-num-steps "
                f"{self.num_steps}: a chain verifies num_steps + 1 tokens"
            )
        lo, hi = self.ngram_min_match_window_size, self.ngram_max_match_window_size
        if not (type(lo) is int and type(hi) is int and 1 <= lo <= hi):
            raise ConfigError(f"NGRAM match windows must satisfy 1 <= min ({lo!r}) <= max ({hi!r})")
        if a.upper() == "NEXTN" and self.draft_model_path is not None:
            raise ConfigError(
                f"--speculative-algorithm {a} drafts with the target checkpoint's own multi-token-prediction "
                f"layer; a separate draft model ({self.draft_model_path!r}) goes with STANDALONE, "
                "an EAGLE head with EAGLE"
            )
        if a.upper() != "EAGLE" and (a.upper() == "STANDALONE") != (self.draft_model_path is not None):
            raise ConfigError(
                "--speculative-draft-model-path goes with --speculative-algorithm STANDALONE "
                f"(got algorithm {a}, draft model {self.draft_model_path!r})"
            )

    @property
    def enabled(self) -> bool:
        return self.algorithm is not None

    @property
    def uses_mtp(self) -> bool:
        """NEXTN (or EAGLE): drafts come from the target checkpoint's MTP layer (or an EAGLE head)."""
        return self.algorithm is not None and self.algorithm.upper() in MTP_ALGORITHMS

    @property
    def eagle_head_path(self) -> str | None:
        """EAGLE with --speculative-draft-model-path: the EAGLE head's checkpoint (model/draft/eagle.py),
        drafting through the NEXTN drafter's machinery (uses_mtp); None otherwise."""
        if self.algorithm is not None and self.algorithm.upper() == "EAGLE":
            return self.draft_model_path
        return None

    @property
    def standalone_draft_path(self) -> str | None:
        """STANDALONE's draft model (engine/spec/draft_model.py); None otherwise."""
        return None if self.eagle_head_path is not None else self.draft_model_path

    @property
    def max_drafts(self) -> int:
        """Draft tokens proposed per request and step at most (0 when off)."""
        if not self.enabled:
            return 0
        if self.num_draft_tokens is not None:
            return self.num_draft_tokens - 1
        if self.num_steps is not None:
            return self.num_steps
        if self.algorithm is not None and self.algorithm.upper() in ("STANDALONE", *MTP_ALGORITHMS):
            return STANDALONE_DEFAULT_NUM_STEPS  # SGLang's DeepSeek MTP default too: 3 steps, topk 1
        return NGRAM_DEFAULT_DRAFT_TOKENS - 1


@dataclass(frozen=True)
class RequestLimits:
    """What one HTTP request may ask for, and how many requests a server holds (kvpipe/server/):
    past a cap a request is refused with a 400 that names the flag, before the engine sees it."""

    max_prompts_per_request: int = 256  # prompts in one batched /generate or /v1/completions body
    # stop strings per prompt, and characters per stop string: the engine searches each one after
    # every token (1M strings once cost 0.29 s a token), a stream's holdback is quadratic in length
    max_stop_strings: int = 32
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 256  # per prompt
    # characters of every other string field (role, name, rid, model, user, cache_salt, ...) and
    # entries of every other list or object field (tools, logit_bias, ...): checked on the parsed
    # JSON before anything reads them (kvpipe/server/request_caps.py)
    max_field_size: int = 256
    # requests waiting beyond --max-running-requests (SGLang's --max-queued-requests): a server
    # holding max_running_requests + this many answers 503 with Retry-After
    max_queued_requests: int = 1024

    def __post_init__(self) -> None:
        require_counts(self)


@dataclass(frozen=True)
class ListenerLimits:
    """How long an HTTP client may take to send a request, and how many connections a server keeps
    open (kvpipe/http_listener.py, the listener of the HTTP and the bootstrap servers): a client
    that sends its request slowly (slowloris) holds a socket and a descriptor until it is cut."""

    header_timeout_s: float = 10.0  # from a connection's start (or its last response) to a complete request head
    # from the head to the body's last byte, plus one second for every BODY_MIN_RATE bytes received
    body_timeout_s: float = 30.0
    keep_alive_s: float = 30.0  # an idle connection between requests
    # open client connections; one more takes the place of the one waiting longest for its client,
    # or is answered 503 at once when every one has a request in (its descriptor freed)
    max_connections: int = 512
    max_header_bytes: int = 16 << 10  # the request line and headers (h11's incomplete-event bound)

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
                raise ConfigError(f"{name} must be a positive number of seconds, got {v!r}")
        for name in ("max_connections", "max_header_bytes"):
            v = getattr(self, name)
            if not (type(v) is int and v >= 1):
                raise ConfigError(f"{name} must be a whole number >= 1, got {v!r}")


HICACHE_STORAGE_BACKENDS = ("mooncake",)


@dataclass(frozen=True)
class HiCacheConfig:
    """A KV tier shared by every server of a model (kvpipe/cache/store_tier.py): full prefix pages
    go to a Mooncake Store, and a radix miss loads the stored ones (SGLang's
    --enable-hierarchical-cache --hicache-storage-backend mooncake; kvpipe has no host-memory
    tier in between: its pool is host memory already). The mooncake_* fields are SGLang's
    MOONCAKE_* settings."""

    enabled: bool = False
    storage_backend: str | None = None
    mooncake_master: str | None = None  # host:port of mooncake_master's RPC
    # "P2PHANDSHAKE", or the HTTP metadata server's URL (mooncake_master --enable_http_metadata_server)
    mooncake_metadata_server: str = "P2PHANDSHAKE"
    mooncake_global_segment_bytes: int = 256 << 20  # memory this server lends the store
    mooncake_local_buffer_bytes: int = 64 << 20
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""
    fetch_timeout_s: float = 1.0  # the longest a prompt waits for stored pages before computing them
    retry_s: float = 5.0  # after a store failure, compute without it this long, then try again

    def __post_init__(self) -> None:
        if not self.enabled:
            if self.storage_backend is not None:
                raise ConfigError("--hicache-storage-backend needs --enable-hierarchical-cache")
            return
        if self.storage_backend not in HICACHE_STORAGE_BACKENDS:
            raise ConfigError(
                "kvpipe's hierarchical cache is a storage tier: --enable-hierarchical-cache needs "
                f"--hicache-storage-backend {' or '.join(HICACHE_STORAGE_BACKENDS)} (got {self.storage_backend!r})"
            )
        if not self.mooncake_master:
            raise ConfigError(
                "--hicache-storage-backend mooncake needs the master (--hicache-mooncake-master HOST:PORT)"
            )
        if self.fetch_timeout_s <= 0 or self.retry_s <= 0:
            raise ConfigError(f"store timeouts must be positive, got {self.fetch_timeout_s}, {self.retry_s}")
        if self.mooncake_global_segment_bytes < 1 or self.mooncake_local_buffer_bytes < 1:
            raise ConfigError("the Mooncake Store segment and buffer sizes must be positive")


@dataclass(frozen=True)
class ServerConfig:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None
    tokenizer_path: str | None = None
    tp_size: int = 1
    # torch intra-op threads of the whole server, split among its TP ranks (at least 1 each);
    # None: the cores of the process's CPU affinity (kvpipe/engine/cpu_threads.py)
    cpu_threads: int | None = None
    device: str = "cpu"
    seed: int = 0
    log_level: str = "info"
    # bodies over this many bytes are refused with 413 before they are read (kvpipe/body_limit.py)
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # weights and activations (--dtype): "auto" | "float32" | "bfloat16" | "float16"
    dtype: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    limits: RequestLimits = field(default_factory=RequestLimits)
    listener: ListenerLimits = field(default_factory=ListenerLimits)
    # SGLang's --api-key: every HTTP route but /health, /health_generate and /metrics needs
    # `Authorization: Bearer <key>` (kvpipe/server/api_key.py). Not in repr: configs get logged.
    api_key: str | None = field(default=None, repr=False)
    # more user keys, one per user (--api-key-file): each its own identity (abort by rid, cache salt)
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # --admin-api-key: the admin routes (/debug/*, abort_all, addresses and paths in /server_info)
    admin_api_key: str | None = field(default=None, repr=False)
    # --cache-salt-by-api-key: prefixes are shared only between requests sent with the same key
    cache_salt_by_api_key: bool = False
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # finished requests whose timelines GET /debug/requests keeps (kvpipe/engine/timeline.py); 0: none
    debug_requests_history: int = 256
    # the KV tier on a Mooncake Store (--enable-hierarchical-cache --hicache-storage-backend mooncake)
    hicache: HiCacheConfig = field(default_factory=HiCacheConfig)
    # per-request recording (--disable-request-metrics turns it off): each request's phase timeline
    # (meta_info.timeline, /debug/requests) and the latency histograms fed per request or per token
    # (server/metrics.py); counters and the gauges read at scrape time stay
    request_metrics: bool = True
    # weight-only quantization of the linear layers (--quantization): None or one of QUANTIZATIONS
    quantization: str | None = None
    # a decode step's decoder layers as one C++ call each (--decode-fused-layer, kvpipe/model/
    # fused_decode.py): "auto" (decode batches up to 64 rows), "on", "off" (the same bits in all three)
    decode_fused_layer: str = "auto"
    # SGLang's --decode-log-interval: a speed line every this many decode steps, and one per prefill
    # batch (kvpipe/engine/step_log.py); 0: none
    decode_log_interval: int = 40
    # --worker-name: what this server is called in its stack (`kvpipe launch`'s prefill0, decode1, ...),
    # reported in /server_info and /metrics (kvpipe_worker_info) for `kvpipe top`; None: unnamed
    worker_name: str | None = None
    # on SIGTERM (or a first Ctrl-C): seconds the server keeps serving what it holds, refusing new
    # requests and failing /health, before it aborts what is left (kvpipe/server/drain.py)
    graceful_shutdown_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not (type(self.decode_log_interval) is int and self.decode_log_interval >= 0):
            raise ConfigError(f"the decode log interval must be a step count >= 0, got {self.decode_log_interval!r}")
        if not (
            isinstance(self.graceful_shutdown_timeout_s, (int, float))
            and not isinstance(self.graceful_shutdown_timeout_s, bool)
            and self.graceful_shutdown_timeout_s >= 0
        ):
            raise ConfigError(
                f"the graceful shutdown timeout must be >= 0 seconds, got {self.graceful_shutdown_timeout_s!r}"
            )
        if self.dtype not in MODEL_DTYPES:
            raise ConfigError(f"dtype must be one of {MODEL_DTYPES}, got {self.dtype!r}")
        if self.cpu_threads is not None and not (type(self.cpu_threads) is int and self.cpu_threads >= 1):
            raise ConfigError(f"cpu threads must be a whole number >= 1, got {self.cpu_threads!r}")
        if not (type(self.max_request_body_bytes) is int and self.max_request_body_bytes >= 1):
            raise ConfigError(
                f"the request body limit must be a whole number of bytes >= 1, got {self.max_request_body_bytes!r}"
            )
        if any(k is not None and not k.strip() for k in (self.api_key, self.admin_api_key, *self.api_keys)):
            raise ConfigError("the API key must not be empty")
        if self.admin_api_key is not None and self.admin_api_key in self.user_api_keys:
            raise ConfigError("the admin API key must differ from every user key")
        if not (type(self.debug_requests_history) is int and self.debug_requests_history >= 0):
            raise ConfigError(f"the debug request history must be a count >= 0, got {self.debug_requests_history!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.decode_fused_layer not in DECODE_FUSED_LAYER_MODES:
            raise ConfigError(
                f"decode_fused_layer must be one of {DECODE_FUSED_LAYER_MODES}, got {self.decode_fused_layer!r}"
            )

    @property
    def user_api_keys(self) -> tuple[str, ...]:
        """--api-key and the keys of --api-key-file."""
        return ((self.api_key,) if self.api_key is not None else ()) + self.api_keys

    @property
    def model_name(self) -> str:
        """--served-model-name, else the checkpoint's name: its directory's, or a GGUF file's
        without the suffix (SmolLM2-135M-Instruct.Q4_1)."""
        path = Path(self.model_path)
        return self.served_model_name or (path.stem if path.suffix.lower() == ".gguf" else path.name)
