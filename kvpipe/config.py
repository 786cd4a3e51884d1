"""Frozen configuration dataclasses shared by every layer of kvpipe.

ModelConfig is parsed from an HF `config.json`; the others come from CLI flags.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# HF `architectures[0]` -> our family name. The family decides q/k/v bias and q/k norm.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "GptOssForCausalLM": "gpt_oss",
}

# Families built on the Qwen3.5 hybrid stack (HybridConfig): the dense one and its MoE variant.
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe")


class ConfigError(ValueError):
    """A model directory or flag combination kvpipe cannot serve."""


@dataclass(frozen=True)
class MoEConfig:
    """Sparse MLP: each token goes to top_k of num_experts routed experts (plus shared ones).

    Routing variants by family: Qwen3-MoE softmax over all experts, then top-k (renormalised
    when norm_topk_prob); MiniMax-M2 sigmoid scores, top-k chosen on score + correction bias,
    weights renormalised; DeepSeek-V3 the same plus group-limited choice (the top `topk_groups`
    of `num_groups` groups, a group scored by its two best experts), the shared experts and
    `routed_scaling_factor` on the routed weights; Qwen3.5-MoE softmax top-k, always renormalised,
    plus one shared expert scaled per token by sigmoid(shared_expert_gate(x)); GPT-OSS
    ("topk_softmax") top-k of the biased router logits, then a softmax over the chosen k only,
    into experts with biases and a clamped SwiGLU (gpt_oss_moe.py).
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int  # per routed expert
    scoring: str  # "softmax" | "sigmoid" | "topk_softmax"
    norm_topk_prob: bool
    correction_bias: bool = False  # e_score_correction_bias steers the choice, not the weights
    num_groups: int = 1  # group-limited routing (DeepSeek-V3 n_group); 1: off
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0  # one fused shared expert of this size; 0: none
    shared_expert_gate: bool = False  # Qwen3.5-MoE: the shared expert's output times sigmoid(Linear(hidden, 1))
    dense_layers: tuple[int, ...] = ()  # layers that keep a dense MLP of ModelConfig.intermediate_size
    # GPT-OSS: the router and every expert projection carry a bias; the experts' SwiGLU clamps its
    # gate (above) and up (both sides) at swiglu_limit and uses sigmoid(swiglu_alpha * gate)
    biases: bool = False
    swiglu_alpha: float = 1.0
    swiglu_limit: float | None = None  # None: the plain SwiGLU

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], arch: str) -> MoEConfig | None:
        n_layers = int(cfg["num_hidden_layers"])
        if arch == "qwen3_moe":
            step = int(cfg.get("decoder_sparse_step", 1) or 1)
            only = {int(i) for i in cfg.get("mlp_only_layers") or ()}
            dense = tuple(i for i in range(n_layers) if i in only or (i + 1) % step)
            return cls(
                num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),
                top_k=int(cfg["num_experts_per_tok"]),
                expert_intermediate_size=int(cfg["moe_intermediate_size"]),
                scoring="softmax",
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                dense_layers=dense,
            )
        if arch == "qwen3_5_moe":  # every layer sparse: HF has no decoder_sparse_step / mlp_only_layers here
            return cls(
                num_experts=int(cfg["num_experts"]),
                top_k=int(cfg["num_experts_per_tok"]),
                expert_intermediate_size=int(cfg["moe_intermediate_size"]),
                scoring="softmax",
                norm_topk_prob=True,
                shared_intermediate_size=int(cfg["shared_expert_intermediate_size"]),
                shared_expert_gate=True,
            )
        if arch == "minimax_m2":
            return cls(
                num_experts=int(cfg["num_local_experts"]),
                top_k=int(cfg["num_experts_per_tok"]),
                expert_intermediate_size=int(cfg["intermediate_size"]),
                scoring="sigmoid",
                norm_topk_prob=True,
                correction_bias=True,
            )
        if arch == "deepseek_v3":
            first_dense = int(cfg.get("first_k_dense_replace", 0))
            shared = int(cfg.get("n_shared_experts") or 0)
            return cls(
                num_experts=int(cfg["n_routed_experts"]),
                top_k=int(cfg["num_experts_per_tok"]),
                expert_intermediate_size=int(cfg["moe_intermediate_size"]),
                scoring="sigmoid",
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                correction_bias=True,
                num_groups=int(cfg.get("n_group") or 1),
                topk_groups=int(cfg.get("topk_group") or 1),
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                shared_intermediate_size=shared * int(cfg["moe_intermediate_size"]),
                dense_layers=tuple(range(min(first_dense, n_layers))),
            )
        if arch == "gpt_oss":
            return cls(
                num_experts=int(cfg["num_local_experts"]),
                top_k=int(cfg["num_experts_per_tok"]),
                expert_intermediate_size=int(cfg["intermediate_size"]),
                scoring="topk_softmax",
                norm_topk_prob=False,
                biases=True,
                swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
            )
        return None


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): the KV cache holds one latent per token,
    [kv_lora_rank] compressed KV then [qk_rope_head_dim] shared rotary key, with no head axis."""

    q_lora_rank: int | None  # None: q is one full projection (no low-rank q)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary dims stored as interleaved pairs (x0, x1), (x2, x3), ...

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached token of one layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> MLAConfig:
        q = cfg.get("q_lora_rank")
        return cls(
            q_lora_rank=None if q is None else int(q),
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
            rope_interleave=bool(cfg.get("rope_interleave", True)),
        )


class LayerType(enum.Enum):
    """The token mixer of one layer of a hybrid model (HF `layer_types`)."""

    FULL_ATTENTION = "full_attention"  # gated softmax attention over the paged KV cache
    LINEAR_ATTENTION = "linear_attention"  # gated delta-net: a per-request recurrent state, no KV


@dataclass(frozen=True)
class HybridConfig:
    """Qwen3.5-style hybrid stack: gated delta-net (linear attention) layers between gated
    full-attention layers. A linear layer keeps, per request, a causal-conv state
    [conv_dim, conv_kernel - 1] and a recurrent state [linear_value_heads, key_dim, value_dim]."""

    layer_types: tuple[LayerType, ...]
    linear_key_heads: int
    linear_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t is LayerType.FULL_ATTENTION)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t is LayerType.LINEAR_ATTENTION)

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q and k (key heads) then v (value heads), before TP."""
        k, v = self.linear_key_heads * self.linear_key_head_dim, self.linear_value_heads * self.linear_value_head_dim
        return 2 * k + v

    def state_nbytes(self, conv_itemsize: int) -> int:
        """One request's state over every linear layer before TP (StateLayout.slot_nbytes at TP 1):
        the conv state in the model dtype, the recurrent state in fp32. It does not grow with the
        prompt, so a transfer cost counts it once per request."""
        conv = self.conv_dim * (self.conv_kernel - 1) * conv_itemsize
        recurrent = self.linear_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4
        return len(self.linear_layers) * (conv + recurrent)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> HybridConfig:
        n = int(cfg["num_hidden_layers"])
        types = cfg.get("layer_types")
        if types is None:  # HF's default pattern: every `full_attention_interval`-th layer is full
            every = int(cfg.get("full_attention_interval", 4))
            types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
        if len(types) != n:
            raise ConfigError(f"layer_types has {len(types)} entries for {n} layers")
        try:
            layer_types = tuple(LayerType(t) for t in types)
        except ValueError as e:
            raise ConfigError(f"unsupported layer type in layer_types: {e}") from None
        return cls(
            layer_types=layer_types,
            linear_key_heads=int(cfg["linear_num_key_heads"]),
            linear_value_heads=int(cfg["linear_num_value_heads"]),
            linear_key_head_dim=int(cfg["linear_key_head_dim"]),
            linear_value_head_dim=int(cfg["linear_value_head_dim"]),
            conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a value of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # RMSNorm on q and k before RoPE: per head (Qwen3) unless qk_norm_per_head is False
    rope_scaling: dict[str, Any] | None = None
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None  # sparse MLP (Qwen3-MoE, MiniMax-M2, DeepSeek-V3)
    mla: MLAConfig | None = None  # latent attention and a latent KV cache (DeepSeek-V3)
    hybrid: HybridConfig | None = None  # linear-attention layers with recurrent state (Qwen3.5)
    # False: one RMSNorm over the whole q (and k) projection, all heads together (MiniMax-M2)
    qk_norm_per_head: bool = True
    # RoPE rotates only each head's first rotary_dim dims (MiniMax-M2, Qwen3.5); None: all
    rotary_dim: int | None = None
    # GPT-OSS: layers that attend to a sliding window of their last `sliding_window` keys (the
    # query's own included: key j is visible to query i iff i - sliding_window < j <= i)
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    attention_sinks: bool = False  # a learned logit per head added to the softmax denominator (GPT-OSS)
    o_proj_bias: bool = False  # o_proj carries a bias (GPT-OSS's attention_bias covers q/k/v/o)

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, None where it attends to the whole context."""
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def rope_dim(self) -> int:
        """Leading dims of each q/k head that RoPE rotates (the rest pass through); MLA: its
        decoupled rope dims (qk_rope_head_dim)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """Layers that keep KV pages, in KV-pool order (a hybrid model's full-attention layers)."""
        return self.hybrid.full_layers if self.hybrid is not None else tuple(range(self.num_layers))

    @property
    def kv_cache_heads(self) -> int:
        """Heads of the KV cache before TP: one latent "head" for MLA, replicated on every rank."""
        return 1 if self.mla is not None else self.num_kv_heads

    @property
    def kv_cache_head_dim(self) -> int:
        return self.mla.latent_dim if self.mla is not None else self.head_dim

    @property
    def kv_buffers_per_layer(self) -> int:
        """Cache tensors per layer: K and V, or the one MLA latent."""
        return 1 if self.mla is not None else 2

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(f"unsupported architecture {archs!r}; kvpipe supports {sorted(SUPPORTED_ARCHITECTURES)}")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        # transformers >= 5 writes `rope_parameters` (rope_theta + scaling) instead of the
        # top-level `rope_theta` / `rope_scaling` of older checkpoints; accept both.
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            # Qwen3.5-MoE has no dense MLP, hence no intermediate_size
            intermediate_size=int(
                cfg.get("intermediate_size", 0) if arch == "qwen3_5_moe" else cfg["intermediate_size"]
            ),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch in ("qwen2", "gpt_oss"))),
            qk_norm=arch in ("qwen3", "qwen3_moe", "minimax_m2", *HYBRID_FAMILIES),
            rope_scaling=rope_scaling,
            dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            moe=MoEConfig.from_hf_dict(cfg, arch),
            mla=MLAConfig.from_hf_dict(cfg) if arch == "deepseek_v3" else None,
            qk_norm_per_head=arch != "minimax_m2",
            rotary_dim=_partial_rotary_dim(cfg, head_dim) if arch in ("minimax_m2", *HYBRID_FAMILIES) else None,
            hybrid=HybridConfig.from_hf_dict(cfg) if arch in HYBRID_FAMILIES else None,
            **(_gpt_oss_attention(cfg) if arch == "gpt_oss" else {}),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir}: no config.json (expected a local HF checkpoint directory)")
        return cls.from_hf_dict(json.loads(path.read_text()))


def _gpt_oss_attention(cfg: dict[str, Any]) -> dict[str, Any]:
    """GPT-OSS's attention fields of ModelConfig: sliding and full layers (HF's default pattern
    alternates, sliding first), sinks in every layer, o_proj biased like q/k/v."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if len(types) != n:
        raise ConfigError(f"layer_types has {len(types)} entries for {n} layers")
    bad = sorted(set(types) - {"sliding_attention", "full_attention"})
    if bad:
        raise ConfigError(f"unsupported layer types {bad} for GPT-OSS (only sliding_attention, full_attention)")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    window = cfg.get("sliding_window")
    if sliding and (window is None or int(window) < 1):
        raise ConfigError(f"sliding_attention layers need a sliding_window >= 1, got {window!r}")
    return dict(
        sliding_window=None if window is None else int(window),
        sliding_layers=sliding,
        attention_sinks=True,
        o_proj_bias=bool(cfg.get("attention_bias", True)),
    )


def _partial_rotary_dim(cfg: dict[str, Any], head_dim: int) -> int | None:
    """MiniMax-M2 gives `rotary_dim`, Qwen3.5 `partial_rotary_factor`; transformers >= 5 also writes `partial_rotary_factor` (in
    rope_parameters), which wins as in HF: int(head_dim * factor) dims rotate."""
    factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    dim = int(head_dim * float(factor)) if factor is not None else cfg.get("rotary_dim")
    if dim is None or int(dim) == head_dim:
        return None
    if not 0 < int(dim) < head_dim or int(dim) % 2:
        raise ConfigError(f"rotary dim {dim} must be even and in (0, head_dim={head_dim}]")
    return int(dim)


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
    # per-request recurrent-state slots of a hybrid model (kvpipe/cache/state_pool.py); None:
    # SchedulerConfig.max_running_requests (then slots never limit admission)
    max_state_slots: int | None = None

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


@dataclass(frozen=True)
class DisaggregationConfig:
    """Prefill/decode disaggregation of one server: SGLang's --disaggregation-* flags plus the
    limits of the transfer layer (validated once, here; every layer takes this object)."""

    mode: str = "null"  # "null" (colocated) | "prefill" | "decode"
    bootstrap_port: int = 8998  # prefill: where its bootstrap HTTP server listens (0: a free port)
    transfer_backend: str = "mooncake"  # "mooncake" | "local" (in-process only)
    ib_device: str | None = None  # RDMA device for Mooncake; None: TCP
    host: str | None = None  # data/control-plane address; None: ServerConfig.host
    # prefill: "auto" (a cost model picks the layer groups per batch; short prompts take the plain
    # path) or a fixed group count N (1: plain path, no layer pipelining)
    layer_groups: int | str = "auto"
    # decode: match each prompt against a radix cache of KV this server already holds and ask the
    # prefill only for the pages past it (SGLang's --disaggregation-enable-decode-radix-cache)
    decode_radix_cache: bool = False
    # Heterogeneous-TP transfer through a staging ring (transfer/staging.py): "off" (one write per
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
    failure_prob: float = 0.0  # test knob: each transfer batch fails with this probability
    failure_seed: int = 0
    max_inflight_ops: int = 1024  # per sender; Mooncake rejects past ~2,048 per peer (architecture.md)
    http_timeout_s: float = 2.0  # one bootstrap HTTP call
    control_send_hwm: int = 10000  # queued control messages per peer before sends are dropped
    tick_s: float = 0.0005  # sender worker sleep between backend polls while writes are in flight
    # ... growing to a quarter of the time since a batch last finished (or was submitted), up to
    # this: on a slow link a write takes far longer than a tick, and polling at 2 kHz would take
    # CPU (and the GIL) from the prefill forward that layer-pipelined transfer overlaps with
    max_tick_s: float = 0.004
    idle_tick_s: float = 0.01  # worker sleep when nothing is in flight
    # Shared secret of a PD deployment (transfer/auth.py): authenticates bootstrap registrations
    # and look-ups and every control-plane frame. None: unauthenticated, and both bound to the
    # data-plane address only. Not in repr: configs get logged.
    auth_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in DISAGGREGATION_MODES:
            raise ConfigError(f"disaggregation mode must be one of {DISAGGREGATION_MODES}, got {self.mode!r}")
        if self.transfer_backend not in ("mooncake", "local"):
            raise ConfigError(f"unknown transfer backend {self.transfer_backend!r}; choose mooncake or local")
        if not 0 <= self.bootstrap_port < 65536:
            raise ConfigError(f"bootstrap port {self.bootstrap_port} is not a TCP port")
        if self.layer_groups != "auto" and not (type(self.layer_groups) is int and self.layer_groups >= 1):
            raise ConfigError(f"layer groups must be 'auto' or an integer >= 1, got {self.layer_groups!r}")
        for name in (
            "bootstrap_timeout_s",
            "waiting_timeout_s",
            "heartbeat_interval_s",
            "transfer_timeout_s",
            "http_timeout_s",
            "tick_s",
            "max_tick_s",
            "idle_tick_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.heartbeat_misses < 1 or self.max_inflight_ops < 1 or self.control_send_hwm < 1:
            raise ConfigError("heartbeat_misses, max_inflight_ops and control_send_hwm must be >= 1")
        if self.decode_radix_cache and self.mode != "decode":
            raise ConfigError(
                "the decode radix cache (--disaggregation-enable-decode-radix-cache) is for "
                f"--disaggregation-mode decode, not {self.mode}"
            )
        if not 0.0 <= self.failure_prob <= 1.0:
            raise ConfigError(f"failure probability must be in [0, 1], got {self.failure_prob}")
        if self.staging not in STAGING_MODES:
            raise ConfigError(f"staging buffer must be one of {STAGING_MODES}, got {self.staging!r}")
        if not (type(self.staging_pool_mb) is int and self.staging_pool_mb >= 1):
            raise ConfigError(f"staging pool size must be a whole number of MB >= 1, got {self.staging_pool_mb!r}")
        if self.auth_token is not None and len(self.auth_token) < MIN_AUTH_TOKEN_CHARS:
            raise ConfigError(
                f"the disaggregation auth token needs at least {MIN_AUTH_TOKEN_CHARS} characters "
                "(a short secret is guessable offline from one captured message)"
            )

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
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)

    def __post_init__(self) -> None:
        if self.cpu_threads is not None and not (type(self.cpu_threads) is int and self.cpu_threads >= 1):
            raise ConfigError(f"cpu threads must be a whole number >= 1, got {self.cpu_threads!r}")
        if not (type(self.max_request_body_bytes) is int and self.max_request_body_bytes >= 1):
            raise ConfigError(
                f"the request body limit must be a whole number of bytes >= 1, got {self.max_request_body_bytes!r}"
            )

    def check_servable(self) -> None:
        """Refuse PD set-ups no server can run (a TP group cannot share the in-process local
        backend). Checked when a server is configured, not on construction: tests drive TP ranks'
        transfer parts inside one process with the local backend."""
        d = self.disaggregation
        if not d.enabled:
            return
        if self.tp_size > 1 and d.transfer_backend == "local":
            raise ConfigError(
                f"--disaggregation-mode {d.mode} with --tp-size {self.tp_size} needs "
                "--disaggregation-transfer-backend mooncake: TP ranks are separate processes and "
                "the local backend only copies inside one process"
            )
        if d.ib_device and d.transfer_backend != "mooncake":
            raise ConfigError("--disaggregation-ib-device needs --disaggregation-transfer-backend mooncake")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_path).name
