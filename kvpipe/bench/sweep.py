"""Sweep bookkeeping: modes, the (prompt_len, mode) loop, result rows and exposed-transfer ratios.

Plain Python: the loop takes the stack factory and the measurement as callables, so it runs in
tests without servers. Modes:
  inproc        colocated server: the transfer costs nothing (the reference)
  pd            PD as `kvpipe launch` starts it: server defaults, no mode flags
  baseline      PD with the plain transfer (one layer group)
  pipelined     PD with layer-pipelined transfer, group count chosen by the server
  pipelined-N   PD with layer-pipelined transfer forced to N groups
  decode-cache  PD with the plain transfer and the decode radix cache: the prefill sends only the
                KV past the prefix the decode holds (compare with baseline on shared-prefix and
                multi-turn workloads; the prefill's own prefix cache is on in every mode)
Exposed transfer time of a PD mode = TTFT(mode) - TTFT(inproc), medians of the same run;
exposed_transfer_ratio of a pipelined mode = its exposed time / the baseline's. The transfer tail
(the prefill's own measure of the KV still landing after the forward) and its ratio say the same
without the compute noise between the processes.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Any, TypeVar

from kvpipe.config import ConfigError
from kvpipe.model.config import HybridConfig, _gpt_oss_attention
from kvpipe.transfer.planning.wire_bytes import KVWireBytes

E = TypeVar("E")
BASELINE, PIPELINED, INPROC, DECODE_CACHE, PD = "baseline", "pipelined", "inproc", "decode-cache", "pd"
PLAIN_MODES = (BASELINE, PIPELINED, INPROC, DECODE_CACHE, PD)
_PIPELINED_N = re.compile(r"^pipelined-(\d+)$")


def is_pipelined(mode: str) -> bool:
    return mode == PIPELINED or _PIPELINED_N.match(mode) is not None


def parse_modes(spec: str) -> list[str]:
    modes = [m.strip() for m in spec.split(",") if m.strip()]
    for m in modes:
        if m not in PLAIN_MODES and not (_PIPELINED_N.match(m) and int(m[10:]) >= 1):
            raise ValueError(
                f"unknown mode {m!r}: choose from baseline, pipelined, pipelined-N, decode-cache, pd, inproc"
            )
    if not modes or len(set(modes)) != len(modes):
        raise ValueError(f"modes must be a non-empty list without repeats, got {spec!r}")
    return modes


@dataclass(frozen=True)
class ModeFlags:
    """Server flags of a PD mode."""

    both: tuple[str, ...]  # for the prefill and the decode
    decode: tuple[str, ...] = ()  # for the decode only


def mode_server_flags(mode: str) -> ModeFlags | None:
    """Server flags of a PD mode; None for the colocated inproc mode."""
    if mode == INPROC:
        return None
    if mode == PD:
        return ModeFlags(())
    if mode == BASELINE:
        return ModeFlags(("--disaggregation-layer-groups", "1"))
    if mode == DECODE_CACHE:
        return ModeFlags(("--disaggregation-layer-groups", "1"), ("--disaggregation-enable-decode-radix-cache",))
    if mode == PIPELINED:
        return ModeFlags(("--disaggregation-layer-groups", "auto"))
    m = _PIPELINED_N.match(mode)
    if m:
        return ModeFlags(("--disaggregation-layer-groups", m.group(1)))
    raise ValueError(f"unknown mode {mode!r}")


def parse_prompt_lens(spec: str) -> list[int]:
    try:
        lens = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"prompt lengths: expected N,N,..., got {spec!r}") from None
    if not lens or min(lens) < 1:
        raise ValueError(f"prompt lengths must be positive, got {spec!r}")
    return lens


@dataclass(frozen=True)
class SweepPoint:
    prompt_len: int
    mode: str
    summary: Mapping[str, Any]  # kvpipe.bench.latency.summarize() of this point
    num_groups: int | None = None
    # median over requests (rounds) of the KV transfer time left after the prefill forward, from
    # the prefill's own clock: exposed transfer without the compute noise between processes
    transfer_tail_ms: float | None = None
    # KV bytes the prefill wrote per request that succeeded (PD modes)
    kv_bytes_per_request: float | None = None


def run_sweep(
    prompt_lens: Sequence[int],
    modes: Sequence[str],
    open_stack: Callable[[str], AbstractContextManager[E]],
    measure: Callable[[E, str, int], tuple[Any, ...]],
) -> list[SweepPoint]:
    """One stack per mode (started once, stopped before the next), every prompt length on it.
    `measure` returns (summary, num_groups[, transfer_tail_ms[, kv_bytes_per_request]])."""
    points = []
    for mode in modes:
        with open_stack(mode) as endpoint:
            for n in prompt_lens:
                points.append(SweepPoint(n, mode, *measure(endpoint, mode, n)))
    return points


@dataclass(frozen=True)
class TransferCount:
    """KV bytes a prefill wrote and rooms that succeeded (a delta between two readings)."""

    bytes_written: int
    rooms: int

    def __add__(self, other: TransferCount) -> TransferCount:
        return TransferCount(self.bytes_written + other.bytes_written, self.rooms + other.rooms)

    @property
    def per_room(self) -> float | None:
        return self.bytes_written / self.rooms if self.rooms > 0 else None


@dataclass(frozen=True)
class SliceResult:
    """One round of an interleaved sweep on one mode: its request records and wall time."""

    records: Sequence[Any]  # kvpipe.bench.latency.RequestRecord
    duration_s: float
    num_groups: int | None = None
    transfer_tail_ms: float | None = None  # mean over the slice's rooms (PD modes)
    transfer: TransferCount | None = None  # what the prefill wrote during the slice (PD modes)


def round_order(modes: Sequence[str], r: int) -> list[str]:
    """Modes of round r, rotated by r, so no mode always runs first (right after a mode switch)."""
    k = r % len(modes) if modes else 0
    return [*modes[k:], *modes[:k]]


def run_sweep_interleaved(
    prompt_lens: Sequence[int],
    modes: Sequence[str],
    open_stack: Callable[[str], AbstractContextManager[E]],
    measure_slice: Callable[[E, str, int, int], SliceResult],
    rounds: int,
    summarize: Callable[[Sequence[Any], float], Mapping[str, Any]],
) -> list[SweepPoint]:
    """Every mode's stack runs at once; per prompt length, `rounds` rounds each run one slice of
    the workload (`measure_slice(endpoint, mode, prompt_len, round)`) on every mode in turn.
    On a shared, noisy machine a load change then hits all modes alike instead of the one mode
    that happened to run at the time, which is what the side-by-side ratios need."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    points = []
    with ExitStack() as stacks:
        eps = {m: stacks.enter_context(open_stack(m)) for m in modes}
        for n in prompt_lens:
            parts: dict[str, list[SliceResult]] = {m: [] for m in modes}
            for r in range(rounds):
                for m in round_order(modes, r):
                    parts[m].append(measure_slice(eps[m], m, n, r))
            for m in modes:
                records = [rec for p in parts[m] for rec in p.records]
                groups = next((p.num_groups for p in reversed(parts[m]) if p.num_groups is not None), None)
                tails = [p.transfer_tail_ms for p in parts[m] if p.transfer_tail_ms is not None]
                counts = [p.transfer for p in parts[m] if p.transfer is not None]
                kv = sum(counts[1:], counts[0]).per_room if counts else None
                points.append(
                    SweepPoint(
                        n,
                        m,
                        summarize(records, sum(p.duration_s for p in parts[m])),
                        groups,
                        statistics.median(tails) if tails else None,
                        kv,
                    )
                )
    return points


def exposed_ratio(ttft_mode: float | None, ttft_baseline: float | None, ttft_inproc: float | None) -> float | None:
    """(TTFT_mode - TTFT_inproc) / (TTFT_baseline - TTFT_inproc); None when undefined (a missing
    figure, or a baseline that exposes nothing: no transfer to hide)."""
    if None in (ttft_mode, ttft_baseline, ttft_inproc):
        return None
    denom = ttft_baseline - ttft_inproc
    return (ttft_mode - ttft_inproc) / denom if denom > 0 else None


def _text_config(model_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config: a multimodal checkpoint (Qwen3.5) nests it under text_config."""
    text = model_config.get("text_config")
    return text if "num_hidden_layers" not in model_config and isinstance(text, Mapping) else model_config


def _dtype_bytes(model_config: Mapping[str, Any]) -> int:
    dt = str(model_config.get("torch_dtype") or model_config.get("dtype") or "float32")
    return {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}.get(dt, 4)


def _hybrid(model_config: Mapping[str, Any]) -> HybridConfig | None:
    """A hybrid model's layer map and linear-attention shape (Qwen3.5), None for others."""
    if "linear_num_key_heads" not in model_config:
        return None
    return HybridConfig.from_hf_dict(dict(model_config))


def kv_bytes_per_token(model_config: Mapping[str, Any], dtype_bytes: int | None = None) -> int | None:
    """KV bytes of one token over the layers that keep KV, from an HF config.json: K and V
    (GQA/MHA), or the latent of an MLA model (DeepSeek-V3); a hybrid model's (Qwen3.5)
    full-attention layers only, its linear layers keep a per-request state instead
    (state_bytes_per_request). None if unknown. Every layer counts, a GPT-OSS model's sliding
    ones included, though a PD request sends those only their window: kv_wire_bytes."""
    model_config = _text_config(model_config)
    try:
        hybrid = _hybrid(model_config)
        layers = len(hybrid.full_layers) if hybrid else int(model_config["num_hidden_layers"])
        if model_config.get("kv_lora_rank"):  # MLA: [kv_lora_rank + rope] per token and layer, no heads
            per_layer = int(model_config["kv_lora_rank"]) + int(model_config["qk_rope_head_dim"])
        else:
            heads = int(model_config["num_attention_heads"])
            kv_heads = int(model_config.get("num_key_value_heads") or heads)
            head_dim = int(model_config.get("head_dim") or int(model_config["hidden_size"]) // heads)
            per_layer = 2 * kv_heads * head_dim
    except (KeyError, TypeError, ValueError, ConfigError):
        return None
    return layers * per_layer * (dtype_bytes or _dtype_bytes(model_config))


def kv_wire_bytes(
    model_config: Mapping[str, Any], page_size: int, dtype_bytes: int | None = None
) -> KVWireBytes | None:
    """What a request's KV weighs on the wire, from an HF config.json: every token of the layers
    that keep KV, except that a GPT-OSS model's sliding-window layers send only the prompt's last
    window (kv_wire_bytes.py); for other models request_nbytes(n) is n x kv_bytes_per_token.
    None if unknown."""
    per_token = kv_bytes_per_token(model_config, dtype_bytes)
    if per_token is None:
        return None
    model_config = _text_config(model_config)
    if model_config.get("model_type") != "gpt_oss":
        return KVWireBytes(per_token, page_size=page_size)
    try:
        attn = _gpt_oss_attention(dict(model_config))
    except (KeyError, TypeError, ValueError, ConfigError):
        return None
    n, n_swa = int(model_config["num_hidden_layers"]), len(attn["sliding_layers"])
    per_layer = per_token // n
    return KVWireBytes((n - n_swa) * per_layer, n_swa * per_layer, attn["sliding_window"] if n_swa else None, page_size)


def server_page_size(server_args: Sequence[str]) -> int:
    """The servers' --page-size (tokens per KV page) among their flags, else the default."""
    from kvpipe.config import CacheConfig

    size = CacheConfig().page_size
    for i, a in enumerate(server_args):
        if a == "--page-size" and i + 1 < len(server_args):
            size = int(server_args[i + 1])
        elif a.startswith("--page-size="):
            size = int(a.split("=", 1)[1])
    return size


def state_bytes_per_request(model_config: Mapping[str, Any], dtype_bytes: int | None = None) -> int | None:
    """Recurrent-state bytes one request moves whatever its length (a hybrid model's conv state in
    the model dtype plus its fp32 recurrent state, per linear layer); 0 for a model without
    linear layers, None if unknown."""
    model_config = _text_config(model_config)
    try:
        hybrid = _hybrid(model_config)
    except (KeyError, TypeError, ValueError, ConfigError):
        return None
    return 0 if hybrid is None else hybrid.state_nbytes(dtype_bytes or _dtype_bytes(model_config))


def _get(summary: Mapping[str, Any] | None, key: str) -> Any:
    return None if summary is None else summary.get(key)


def sweep_rows(
    points: Iterable[SweepPoint],
    link_rate_bps: float | None = None,
    kv_bytes_token: int | None = None,
    state_bytes_request: int = 0,
    kv_wire: KVWireBytes | None = None,
) -> list[dict[str, Any]]:
    """One row per (prompt_len, mode), ordered by prompt length then by the order modes ran.

    With the link rate and the KV size known, a row also states the ideal transfer time of the
    prompt's KV (plus a hybrid model's per-request state) at line rate and its ratio to compute
    (T/C, C = the inproc TTFT). The KV size: `kv_wire.request_nbytes(n)` when given (a
    sliding-window model sends those layers' window only), else n x `kv_bytes_token`."""
    points = list(points)
    mode_order = list(dict.fromkeys(p.mode for p in points))
    by_key = {(p.prompt_len, p.mode): p for p in points}
    rows = []
    for n in sorted({p.prompt_len for p in points}):
        ref = by_key.get((n, INPROC))
        base = by_key.get((n, BASELINE))
        ttft_inproc = _get(ref.summary if ref else None, "ttft_p50_ms")
        ttft_base = _get(base.summary if base else None, "ttft_p50_ms")
        tail_base = base.transfer_tail_ms if base else None
        kv_bytes = kv_wire.request_nbytes(n) if kv_wire is not None else kv_bytes_token * n if kv_bytes_token else None
        wire = kv_bytes + state_bytes_request if kv_bytes else None  # the state goes once per request
        t_ms = wire * 8 / link_rate_bps * 1e3 if wire and link_rate_bps else None
        for mode in mode_order:
            p = by_key.get((n, mode))
            if p is None:
                continue
            s = p.summary
            ttft = s.get("ttft_p50_ms")
            exposed = ttft - ttft_inproc if mode != INPROC and None not in (ttft, ttft_inproc) else None
            rows.append(
                {
                    "prompt_len": n,
                    "mode": mode,
                    "ttft_p50_ms": ttft,
                    "ttft_p99_ms": s.get("ttft_p99_ms"),
                    "tpot_p50_ms": s.get("tpot_p50_ms"),
                    "itl_p50_ms": s.get("itl_p50_ms"),
                    "e2e_p50_ms": s.get("e2e_p50_ms"),
                    "output_throughput": s.get("output_throughput"),
                    "completed": s.get("completed"),
                    "failed": s.get("failed"),
                    "num_groups": p.num_groups,
                    "exposed_transfer_ms": exposed,
                    "exposed_transfer_ratio": exposed_ratio(ttft, ttft_base, ttft_inproc)
                    if is_pipelined(mode)
                    else None,
                    "transfer_tail_ms": p.transfer_tail_ms,
                    "transfer_tail_ratio": (
                        p.transfer_tail_ms / tail_base
                        if is_pipelined(mode) and tail_base and p.transfer_tail_ms is not None
                        else None
                    ),
                    "ttft_vs_baseline": ttft / ttft_base - 1 if mode != BASELINE and ttft and ttft_base else None,
                    "ttft_speedup_vs_baseline": ttft_base / ttft if mode != BASELINE and ttft and ttft_base else None,
                    "kv_bytes_per_request": p.kv_bytes_per_request,
                    "cached_tokens_mean": s.get("cached_tokens_mean"),
                    "prompt_tokens_mean": s.get("prompt_tokens_mean"),
                    "kv_bytes": kv_bytes,
                    "state_bytes": state_bytes_request,
                    "ideal_transfer_ms": t_ms,
                    "t_over_c": t_ms / ttft_inproc if t_ms and ttft_inproc else None,
                }
            )
    return rows
