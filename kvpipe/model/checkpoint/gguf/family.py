"""What llama.cpp calls a model family: its `general.architecture` (the prefix of its metadata
keys) and the names of its tensors. A family that has GGUF files declares one GGUFFamily in its
Family entry (model/families/); the shared name tables are here for it to combine."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# llama.cpp name -> HF name: the tensors outside the layers, then those of every llama-style layer
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
QKV_BIAS_TENSORS = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
QK_NORM_TENSORS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}


@dataclass(frozen=True, eq=False)
class GGUFFamily:
    architecture: str  # general.architecture, and the prefix of the family's metadata keys
    layer_tensors: Mapping[str, str]  # per-layer tensors the family may hold: llama.cpp name -> HF name
    # llama.cpp's convert_hf_to_gguf reorders each head's q/k rows from HF's rotate-half layout into
    # interleaved pairs (for llama only): the loader undoes it (tensors.unpermute_rows)
    permuted_qk: bool = False
    # the family's own metadata: `{architecture}.<key>` -> the HF config key it fills (config.hf_config)
    config_keys: Mapping[str, str] = field(default_factory=dict)
    # llama.cpp stores a norm that scales by (1 + weight) as 1 + weight (its RMSNorm multiplies by
    # the weight alone): subtracted again from every `*norm.weight` tensor on reading, as
    # transformers' GGUF loader does (Gemma)
    norm_shift: float = 0.0
    # the file's SentencePiece vocabulary (tokenizer.ggml.model "llama") has no merges: they are
    # rebuilt from the vocabulary, best first in the order the tokens are listed (Gemma's scores do
    # not follow its merge order), with tokens of two or more spaces respelled "▁▁" (tokenizer.py)
    token_order_merges: bool = False
