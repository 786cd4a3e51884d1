"""What one request of `kvpipe bench transfer` moves: the KV shape, and a hybrid model's state.

A shape is a model preset (kvpipe.model.presets, any family) or one of EXTRA_SHAPES, real-size
models' KV (and state) without their weights. A hybrid shape (Qwen3.5) keeps KV pages in its
full-attention layers only, and per request one recurrent-state slot over its linear layers
(kvpipe/cache/recurrent_pool.py): `num_layers` is then the KV layers and `hybrid` the layer map.
A sliding-window shape (GPT-OSS) names its sliding layers and window: PD sends those layers
only the pages of the prompt's last window.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpipe.bench.kv_bytes import ITEMSIZE
from kvpipe.cache.window_pages import prompt_window_pages
from kvpipe.model.checkpoint.schema import HybridConfig
from kvpipe.model.presets import preset_config, preset_names


@dataclass(frozen=True)
class KVShape:
    num_layers: int  # layers with KV pages (a hybrid model's full-attention layers)
    kv_heads: int
    head_dim: int
    dtype: str  # of the KV and of a hybrid model's conv state (the model dtype)
    latent: bool = False  # MLA: one latent buffer per layer (kv_heads 1, head_dim = kv_lora_rank + rope dims)
    hybrid: HybridConfig | None = None  # linear-attention layers with a per-request state (Qwen3.5)
    # GPT-OSS: KV layers that attend to a sliding window of `sliding_window` tokens; a PD request
    # sends them only the prompt's last window's pages (cache/window_pages.py prompt_window_pages)
    sliding_layers: tuple[int, ...] = ()
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.sliding_layers and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(f"sliding layers {self.sliding_layers} need a window >= 1, got {self.sliding_window!r}")

    @property
    def kv_token_nbytes(self) -> int:
        """KV bytes of one token over the KV layers: K and V, or the one MLA latent."""
        return (1 if self.latent else 2) * self.num_layers * self.kv_heads * self.head_dim * ITEMSIZE[self.dtype]

    def request_kv_nbytes(self, prompt_len: int, page_size: int) -> int:
        """KV bytes a PD request of prompt_len tokens moves, in whole pages: the full layers every
        page, the sliding layers the pages of the prompt's last window."""
        first, end = (
            (0, -(-prompt_len // page_size))
            if not self.sliding_layers
            else prompt_window_pages(prompt_len, self.sliding_window or 0, page_size)
        )
        per_layer_page = self.kv_token_nbytes // self.num_layers * page_size
        n_swa = len(self.sliding_layers)
        return (self.num_layers - n_swa) * end * per_layer_page + n_swa * (end - first) * per_layer_page

    @property
    def state_nbytes(self) -> int:
        """Recurrent-state bytes of one request (0 without linear layers): not per token."""
        return 0 if self.hybrid is None else self.hybrid.state_nbytes(ITEMSIZE[self.dtype])


def _qwen3_5_text_defaults() -> HybridConfig:
    """transformers' Qwen3_5TextConfig defaults (configuration_qwen3_5.py, transformers 5; its
    docstring names Qwen/Qwen3.5-27B): 32 layers, every 4th full attention (16 heads, 4 KV heads
    of 256), gated delta-net layers with 16 key and 32 value heads of 128, conv kernel 4."""
    return HybridConfig.from_hf_dict(
        {
            "num_hidden_layers": 32,
            "full_attention_interval": 4,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
        }
    )


_QWEN3_5 = _qwen3_5_text_defaults()

# Shapes besides the model presets in kvpipe.model.presets.
EXTRA_SHAPES: dict[str, KVShape] = {
    "llama3-8b": KVShape(32, 8, 128, "bfloat16"),  # 128 KiB of KV per token
    "qwen2-0.5b": KVShape(24, 2, 64, "bfloat16"),  # 12 KiB per token
    "deepseek-v3": KVShape(61, 1, 512 + 64, "bfloat16", latent=True),  # MLA latent: 70 KiB per token
    # 8 full-attention layers: 32 KiB of KV per token; 24 linear layers: 48 KiB of conv state
    # (bf16) + 2 MiB of recurrent state (fp32) each, 49.1 MiB per request
    "qwen3.5": KVShape(len(_QWEN3_5.full_layers), 4, 256, "bfloat16", hybrid=_QWEN3_5),
    # GPT-OSS-20B: transformers' GptOssConfig defaults for attention (8 KV heads of head_dim 64,
    # sliding_window 128, layer_types alternating sliding / full, sliding first) with the 20B's
    # 24 layers (the defaults' 36 are the 120B's); bf16. 48 KiB of KV per token over all layers,
    # of which the 12 sliding layers send only the last window's pages.
    "gpt-oss-20b": KVShape(24, 8, 64, "bfloat16", sliding_layers=tuple(range(0, 24, 2)), sliding_window=128),
}


def shape_names() -> list[str]:
    return preset_names() + sorted(EXTRA_SHAPES)


def lookup_shape(name: str) -> KVShape | None:
    """The shape of a preset or an extra shape; None when unknown."""
    if name in EXTRA_SHAPES:
        return EXTRA_SHAPES[name]
    if name not in preset_names():
        return None
    mc = preset_config(name)
    return KVShape(
        len(mc.kv_layers),
        mc.kv_cache_heads,
        mc.kv_cache_head_dim,
        mc.dtype,
        latent=mc.mla is not None,
        hybrid=mc.hybrid,
        sliding_layers=mc.sliding_layers,
        sliding_window=mc.sliding_window if mc.sliding_layers else None,
    )
