"""ServerConfig, what a server is built from, and its parts beside the engine's and PD's:
speculative decoding, HTTP request and listener limits, the KV tier (HiCache)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvpipe.config.engine import DECODE_FUSED_LAYER_MODES, MODEL_DTYPES, QUANTIZATIONS, CacheConfig, SchedulerConfig
from kvpipe.config.errors import ConfigError
from kvpipe.config.pd import DisaggregationConfig, require_counts

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
