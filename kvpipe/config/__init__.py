"""Frozen configuration dataclasses the server and the engine are configured with (CLI flags),
one module per part: `engine` (TP, KV cache, scheduler), `pd` (PD disaggregation), `server`
(ServerConfig and the rest); `from kvpipe.config import X` names any of them.

What a checkpoint says of its model is in kvpipe/model/checkpoint/schema.py (ModelConfig).
"""

from kvpipe.config.engine import (
    DECODE_FUSED_LAYER_MODES,
    KV_CACHE_DTYPES,
    MAMBA_SCHEDULER_STRATEGIES,
    MODEL_DTYPES,
    QUANTIZATIONS,
    CacheConfig,
    ParallelConfig,
    SchedulerConfig,
)
from kvpipe.config.errors import ConfigError
from kvpipe.config.pd import (
    DISAGGREGATION_MODES,
    MIN_AUTH_TOKEN_CHARS,
    STAGING_MODES,
    ControlLimits,
    DisaggregationConfig,
    FaultInjection,
    PortRange,
    TransferTuning,
    parse_bootstrap_allow,
    parse_layer_groups,
    require_counts,
)
from kvpipe.config.server import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    HICACHE_STORAGE_BACKENDS,
    MTP_ALGORITHMS,
    NGRAM_DEFAULT_DRAFT_TOKENS,
    SPECULATIVE_ALGORITHMS,
    SPECULATIVE_NOT_YET,
    STANDALONE_DEFAULT_NUM_STEPS,
    HiCacheConfig,
    ListenerLimits,
    RequestLimits,
    ServerConfig,
    SpeculativeConfig,
)

__all__ = [
    "ConfigError",
    "ParallelConfig",
    "MODEL_DTYPES",
    "KV_CACHE_DTYPES",
    "MAMBA_SCHEDULER_STRATEGIES",
    "QUANTIZATIONS",
    "DECODE_FUSED_LAYER_MODES",
    "CacheConfig",
    "SchedulerConfig",
    "DISAGGREGATION_MODES",
    "STAGING_MODES",
    "PortRange",
    "MIN_AUTH_TOKEN_CHARS",
    "parse_layer_groups",
    "parse_bootstrap_allow",
    "TransferTuning",
    "FaultInjection",
    "require_counts",
    "ControlLimits",
    "DisaggregationConfig",
    "DEFAULT_MAX_REQUEST_BODY_BYTES",
    "SPECULATIVE_ALGORITHMS",
    "SPECULATIVE_NOT_YET",
    "MTP_ALGORITHMS",
    "NGRAM_DEFAULT_DRAFT_TOKENS",
    "STANDALONE_DEFAULT_NUM_STEPS",
    "SpeculativeConfig",
    "RequestLimits",
    "ListenerLimits",
    "HICACHE_STORAGE_BACKENDS",
    "HiCacheConfig",
    "ServerConfig",
]
