"""The checkpoint schema: what kvpipe reads of an HF `config.json`, one frozen dataclass per part
(attention and rope in ModelConfig; MoE, MLA and hybrid layers in their own), and the parsing every
family shares (`ModelConfig.from_hf_dict`). Which family a config is, and the fields only it sets,
come from its Family entry (model/families/, collected by model/registry.py): no family is named
here. `registry.model_config(raw)` and `config_reader.model_config_of(path)` are how callers get a
ModelConfig: they find the family first (this module sits below the families, which import it)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvpipe.config import ConfigError


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
    into experts with biases and a clamped SwiGLU (gpt_oss.py).
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
    def hf(cls, cfg: dict[str, Any], num_experts: int, expert_size_key: str, **routing: Any) -> MoEConfig:
        """Routed experts as every family's HF config gives them: `num_experts` experts of
        cfg[expert_size_key] each, num_experts_per_tok per token; `routing` the family's own fields."""
        return cls(
            num_experts=num_experts,
            top_k=int(cfg["num_experts_per_tok"]),
            expert_intermediate_size=int(cfg[expert_size_key]),
            **routing,
        )


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
        every = int(cfg.get("full_attention_interval", 4))  # HF's default: every 4th layer is full

        def default(i: int) -> str:
            return LayerType.LINEAR_ATTENTION.value if (i + 1) % every else LayerType.FULL_ATTENTION.value

        types = layer_types(cfg, tuple(t.value for t in LayerType), default)
        return cls(
            layer_types=tuple(LayerType(t) for t in types),
            linear_key_heads=int(cfg["linear_num_key_heads"]),
            linear_value_heads=int(cfg["linear_num_value_heads"]),
            linear_key_head_dim=int(cfg["linear_key_head_dim"]),
            linear_value_head_dim=int(cfg["linear_value_head_dim"]),
            conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        )


class ConfigFamily(Protocol):
    """What ModelConfig.from_hf_dict needs of a family (model/families/family.py's Family)."""

    @property
    def name(self) -> str: ...

    @property
    def partial_rotary(self) -> bool: ...

    @property
    def config(self) -> Callable[[dict[str, Any]], dict[str, Any]]: ...


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # the family's name (Family.name, model/registry.py)
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
    # Gemma 3: the sliding layers' RoPE base (rope_local_base_freq, no scaling; rope_theta and
    # rope_scaling are the full layers'); None: every layer uses rope_theta
    sliding_rope_theta: float | None = None
    # the softmax scale; None: head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5)
    attention_scale: float | None = None
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap); None: none
    hidden_act: str = "silu"  # the gated MLP's activation (Family.activations lists what a family runs)
    o_proj_bias: bool = False  # o_proj carries a bias (GPT-OSS's attention_bias covers q/k/v/o)
    # multi-token-prediction layers (model/draft/mtp.py): DeepSeek-V3's after the last decoder layer
    # (num_nextn_predict_layers), Qwen3.5's under mtp.* (mtp_num_hidden_layers); the NEXTN
    # drafter's, the target's forward never runs them
    num_nextn_predict_layers: int = 0

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, None where it attends to the whole context."""
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale

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
    def from_hf_dict(cls, cfg: dict[str, Any], family: ConfigFamily) -> ModelConfig:
        """The config of `cfg` as `family` (registry.hf_family(cfg)): the fields every family
        reads alike, then the family's own (Family.config)."""
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
        own = family.config(cfg)
        fields: dict[str, Any] = dict(
            architecture=family.name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            qk_norm=False,
            rope_scaling=rope_scaling,
            dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            rotary_dim=partial_rotary_dim(cfg, head_dim) if family.partial_rotary else None,
            hidden_act=str(cfg.get("hidden_act") or "silu"),
        )
        if "intermediate_size" not in own:  # a family without a dense MLP gives its own (Qwen3.5-MoE: 0)
            fields["intermediate_size"] = int(cfg["intermediate_size"])
        return cls(**(fields | own))


def layer_types(cfg: dict[str, Any], allowed: tuple[str, ...], default: Callable[[int], str]) -> list[str]:
    """HF's `layer_types`, one per layer, or the family's pattern `default(layer)` where the config
    has none; ConfigError for another count or a type not in `allowed`."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or [default(i) for i in range(n)]
    if len(types) != n:
        raise ConfigError(f"layer_types has {len(types)} entries for {n} layers")
    bad = sorted(set(types) - set(allowed))
    if bad:
        raise ConfigError(f"unsupported layer types {bad} (only {', '.join(allowed)})")
    return list(types)


def partial_rotary_dim(cfg: dict[str, Any], head_dim: int) -> int | None:
    """The rotated dims of a partial-rotary family (Family.partial_rotary), None for all of them.
    MiniMax-M2 gives `rotary_dim`, Qwen3.5 `partial_rotary_factor`; transformers >= 5 also writes
    `partial_rotary_factor` (in rope_parameters), which wins as in HF: int(head_dim * factor) dims
    rotate."""
    factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    dim = int(head_dim * float(factor)) if factor is not None else cfg.get("rotary_dim")
    if dim is None or int(dim) == head_dim:
        return None
    if not 0 < int(dim) < head_dim or int(dim) % 2:
        raise ConfigError(f"rotary dim {dim} must be even and in (0, head_dim={head_dim}]")
    return int(dim)
