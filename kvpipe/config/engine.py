"""The engine's own configs: tensor parallelism, the KV cache, the scheduler; the dtypes and
modes their flags take."""

from __future__ import annotations

from dataclasses import dataclass

from kvpipe.config.errors import ConfigError


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
    # SGLang's --enable-mixed-chunk: a prefill step also carries every decoding request's next token
    # (their tokens count against the step's budget), so decoders advance while prompts are computed
    # and ride on weights the prefill reads anyway (engine/scheduler.py)
    enable_mixed_chunk: bool = False
