"""Random tiny HF GPT-OSS checkpoints: sliding-window and full layers, attention sinks, the
top-k-softmax MoE with biased fused experts, yarn RoPE; the parity tests' cases."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

import torch
import transformers

from tests.helpers.hf_models import VOCAB

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from Python 3.11


class GptOssKwargs(TypedDict, total=False):
    """The GptOssConfig keyword arguments the tiny checkpoints set (typed, so mypy checks them
    against the config's fields)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    head_dim: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    num_local_experts: int
    num_experts_per_tok: int
    max_position_embeddings: int
    rope_parameters: dict[str, object]
    initializer_range: float
    sliding_window: int
    layer_types: list[str]
    attention_bias: bool
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None


YARN: dict[str, object] = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
}
CASES: dict[str, GptOssKwargs] = {
    # HF's default pattern (sliding, full, ...), window 8, GQA, biases on q/k/v/o
    "alternating_gqa": GptOssKwargs(num_hidden_layers=4, num_key_value_heads=2, sliding_window=8),
    # full first, then two sliding layers of window 5; MHA, no attention biases, top-3 routing
    "custom_layers_mha": GptOssKwargs(
        num_hidden_layers=3,
        num_key_value_heads=4,
        sliding_window=5,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        attention_bias=False,
        num_experts_per_tok=3,
    ),
}


def hf_gpt_oss(seed: int = 0, **overrides: Unpack[GptOssKwargs]) -> transformers.GptOssForCausalLM:
    kw = GptOssKwargs(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        head_dim=16,
        num_attention_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        rope_parameters=YARN,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # HF inits sinks small and expert biases to zero: make both matter
            if name.endswith("sinks"):
                p.normal_(0, 1.0)
            elif name.endswith("_bias") or name.endswith("proj.bias"):
                p.normal_(0, 0.1)
    return model
