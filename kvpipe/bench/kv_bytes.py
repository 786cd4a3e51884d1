"""What a model's PD request weighs on the wire, from its checkpoint schema (ModelConfig): the KV of
every layer that keeps KV (K and V, or an MLA latent; a hybrid model's full-attention layers
only), a GPT-OSS model's sliding layers only over the prompt's last window (KVWireBytes), plus a
hybrid model's recurrent state once per request, and a STANDALONE draft model's KV where both PD
servers run one (`with_draft_kv`: its KV moves after the target's), or NEXTN's MTP layer KV
(`with_mtp_kv`). Element sizes are the served ones (ServedDtypes:
--dtype and --kv-cache-dtype as the servers resolve them), else the checkpoint's."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvpipe.cache.kv_dtype import kv_storage_dtype
from kvpipe.model.checkpoint.loader import resolve_dtype
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.transfer.planning.wire_bytes import KVWireBytes

# bytes per element of the model dtypes a KV cache is kept in
ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class ServedDtypes:
    """Bytes per element of what servers compute in (a hybrid model's conv state) and
    store KV in: --dtype auto is fp32 on CPU and the checkpoint's dtype elsewhere, --kv-cache-dtype
    auto the model dtype (kvpipe/model/checkpoint/loader.py resolve_dtype, kvpipe/cache/kv_dtype.py)."""

    model: int
    kv: int

    @classmethod
    def of(cls, mc: ModelConfig, dtype: str | None, kv_cache_dtype: str | None, device: str | None) -> ServedDtypes:
        """From the servers' flag values (None: not given, the default)."""
        model = resolve_dtype(None if dtype in (None, "auto") else dtype, mc, device or "cpu")
        kv = kv_storage_dtype(kv_cache_dtype or "auto", model)
        return cls(model.itemsize, kv.itemsize)


def kv_wire_bytes(mc: ModelConfig, page_size: int, itemsize: int | None = None) -> KVWireBytes | None:
    """Bytes of a request's KV by prompt length; `itemsize`: the pool's bytes per element (None:
    the checkpoint dtype's; None back for a dtype of unknown size)."""
    itemsize = ITEMSIZE.get(mc.dtype) if itemsize is None else itemsize
    if itemsize is None:
        return None
    per_layer = mc.kv_buffers_per_layer * mc.kv_cache_heads * mc.kv_cache_head_dim * itemsize
    n, n_swa = len(mc.kv_layers), len(mc.sliding_layers)
    return KVWireBytes((n - n_swa) * per_layer, n_swa * per_layer, mc.sliding_window if n_swa else None, page_size)


def with_draft_kv(kv: KVWireBytes, draft: ModelConfig, itemsize: int) -> KVWireBytes | None:
    """`kv` plus a STANDALONE draft model's KV (every prompt token of every draft layer, in its
    pool's `itemsize`: the draft's compute dtype, disagg/draft_transfer.py); None for a draft the
    drafter refuses (sliding-window or hybrid: it would not move like this)."""
    if draft.sliding_layers or draft.hybrid is not None:
        return None
    d = kv_wire_bytes(draft, kv.page_size, itemsize)
    return None if d is None else replace(kv, full_token_nbytes=kv.full_token_nbytes + d.full_token_nbytes)


def with_mtp_kv(kv: KVWireBytes, mc: ModelConfig, itemsize: int) -> KVWireBytes | None:
    """`kv` plus NEXTN's MTP layer KV (one layer for every prompt token: DeepSeek-V3's latent,
    Qwen3.5's full-attention K and V, in the MTP's compute dtype `itemsize`:
    disagg/mtp_transfer.py); None for a model without an MTP layer."""
    if mc.num_nextn_predict_layers < 1 or (mc.mla is None and mc.hybrid is None):
        return None
    per_token = mc.mla.latent_dim if mc.mla is not None else 2 * mc.num_kv_heads * mc.head_dim
    return replace(kv, full_token_nbytes=kv.full_token_nbytes + per_token * itemsize)


def state_bytes_per_request(mc: ModelConfig, itemsize: int | None = None) -> int | None:
    """Recurrent-state bytes one request moves whatever its length: a hybrid model's conv state in
    the model dtype (`itemsize`; None: the checkpoint's) plus its fp32 recurrent state, per linear
    layer; 0 without linear layers, None for a dtype of unknown size."""
    if mc.hybrid is None:
        return 0
    itemsize = ITEMSIZE.get(mc.dtype) if itemsize is None else itemsize
    return None if itemsize is None else mc.hybrid.state_nbytes(itemsize)
