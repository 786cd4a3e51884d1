"""What a model's PD request weighs on the wire, from its checkpoint schema (ModelConfig): the KV of
every layer that keeps KV (K and V, or an MLA latent; a hybrid model's full-attention layers
only), a GPT-OSS model's sliding layers only over the prompt's last window (KVWireBytes), plus a
hybrid model's recurrent state once per request."""

from __future__ import annotations

from kvpipe.model.config import ModelConfig
from kvpipe.transfer.planning.wire_bytes import KVWireBytes

# bytes per element of the model dtypes a KV cache is kept in
ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def kv_wire_bytes(mc: ModelConfig, page_size: int) -> KVWireBytes | None:
    """Bytes of a request's KV by prompt length (None for a dtype of unknown size)."""
    itemsize = ITEMSIZE.get(mc.dtype)
    if itemsize is None:
        return None
    per_layer = mc.kv_buffers_per_layer * mc.kv_cache_heads * mc.kv_cache_head_dim * itemsize
    n, n_swa = len(mc.kv_layers), len(mc.sliding_layers)
    return KVWireBytes((n - n_swa) * per_layer, n_swa * per_layer, mc.sliding_window if n_swa else None, page_size)


def state_bytes_per_request(mc: ModelConfig) -> int | None:
    """Recurrent-state bytes one request moves whatever its length: a hybrid model's conv state in
    the model dtype plus its fp32 recurrent state, per linear layer; 0 without linear layers,
    None for a dtype of unknown size."""
    if mc.hybrid is None:
        return 0
    itemsize = ITEMSIZE.get(mc.dtype)
    return None if itemsize is None else mc.hybrid.state_nbytes(itemsize)
