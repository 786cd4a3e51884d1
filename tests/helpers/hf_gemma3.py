"""Random tiny HF Gemma 3 checkpoints: sliding and global layers, their two RoPE bases (linear
scaling on the global one), zero-centred norms with random weights, q/k norms, an attention scale
that is not head_dim's, the tied sqrt(hidden)-scaled embedding; the parity tests' cases."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

import torch
import transformers

from tests.helpers.hf_models import VOCAB

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from Python 3.11


class Gemma3Kwargs(TypedDict, total=False):
    """The Gemma3TextConfig keyword arguments the tiny checkpoints set (typed, so mypy checks them
    against the config's fields)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    head_dim: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    max_position_embeddings: int
    rope_parameters: dict[str, object]
    initializer_range: float
    sliding_window: int
    layer_types: list[str]
    query_pre_attn_scalar: int
    final_logit_softcapping: float | None
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None


ROPE: dict[str, object] = {
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}
CASES: dict[str, Gemma3Kwargs] = {
    # Gemma 3's pattern (5 sliding, 1 global) and one more sliding layer; window 8, GQA, tied head
    "pattern_gqa": Gemma3Kwargs(num_hidden_layers=7, num_key_value_heads=2, sliding_window=8),
    # global first, then two sliding layers of window 5; MHA, final logit softcapping, untied head
    "custom_layers_mha_softcap": Gemma3Kwargs(
        num_hidden_layers=3,
        num_key_value_heads=4,
        sliding_window=5,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        final_logit_softcapping=3.0,
        tie_word_embeddings=False,
    ),
}


def hf_gemma3(seed: int = 0, **overrides: Unpack[Gemma3Kwargs]) -> transformers.Gemma3ForCausalLM:
    kw = Gemma3Kwargs(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        head_dim=32,  # q is 128 wide against a hidden size of 64
        num_attention_heads=4,
        max_position_embeddings=256,
        rope_parameters=ROPE,
        query_pre_attn_scalar=24,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # HF inits them to 0 ((1 + w) = 1): make every norm matter
                p.normal_(0, 0.3)
    return model
