"""Keys and records of KV pages in a shared store (the KV tier, cache/store_tier.py): plain bytes,
no tensors, no store.

A page's key is a chained hash over the tokens of every page up to it, rooted in a namespace that
holds everything that makes two servers' page bytes comparable: the checkpoint digest
(model/checkpoint/identity.py), the KV storage dtype, the page size, the pool geometry and the TP slice. Two
servers derive the same key for a page only if they would have computed the same bytes for it, so
a key never names another model's KV, another dtype's or another TP rank's head slice (SGLang's
HiCache keys: SHA-256 of the previous page's hash and the token ids, with the model in a prefix
and the TP rank in a suffix; here all of it is in the chain's root).

A stored page is a record: a header (magic, version, the key it was written under, the payload's
length and SHA-256) and the payload (the page of every K/V buffer of every layer). A record read
back is used only if its header names the key it was fetched under and its payload has the
length and digest the header gives: a corrupted page, or one written under the key by something
else (a foreign writer, a stale format), is rejected, never loaded into the pool.

    ns = StoreNamespace(model_digest, "torch.bfloat16", 64, 2, 8, 64, 0, 1)
    keys = page_keys(ns, token_ids)          # one key per whole page of token_ids
    blob = encode_page(keys[0], payload)     # what goes into the store
    payload = decode_page(keys[0], blob)     # None: not a record of that key (corrupt or foreign)
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAGIC = b"KVPS"
VERSION = 1
# magic, version, key length, payload length, payload SHA-256
_HEADER = struct.Struct("<4sHHQ32s")
KEY_PREFIX = "kvpipe"


@dataclass(frozen=True)
class StoreNamespace:
    """Everything that makes two servers' bytes of one page comparable."""

    model_digest: str  # model/checkpoint/identity.py checkpoint_digest
    kv_dtype: str  # the pool's storage dtype, e.g. "torch.float32"
    page_size: int
    num_buffers: int  # K/V (or latent) buffers of all layers
    kv_heads: int  # heads of this rank's pool (its TP slice)
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1

    def digest(self) -> bytes:
        fields = (
            f"v{VERSION}|{self.model_digest}|{self.kv_dtype}|ps{self.page_size}|buf{self.num_buffers}|"
            f"h{self.kv_heads}|d{self.head_dim}|tp{self.tp_rank}/{self.tp_size}"
        )
        return hashlib.sha256(fields.encode()).digest()

    def key_prefix(self) -> str:
        """The start of every key of this namespace (readable: which model, which rank)."""
        return f"{KEY_PREFIX}-{self.model_digest[:12]}-tp{self.tp_rank}of{self.tp_size}-"


def page_keys(ns: StoreNamespace, token_ids: Sequence[int], root: bytes | None = None) -> list[str]:
    """Keys of the whole pages of `token_ids`: key i hashes pages 0..i (the chain), so a page's key
    names its whole prefix. `root`: ns.digest(), when the caller has it already."""
    ps = ns.page_size
    n = len(token_ids) // ps
    if n == 0:
        return []
    ids = np.asarray(token_ids[: n * ps], dtype="<i4").reshape(n, ps)  # 4-byte little-endian ids
    prev = ns.digest() if root is None else root
    prefix = ns.key_prefix()
    out = []
    for row in ids:
        prev = hashlib.sha256(prev + row.tobytes()).digest()
        out.append(prefix + prev.hex())
    return out


def encode_page(key: str, payload: bytes | memoryview) -> bytes:
    """The record stored under `key`."""
    k = key.encode()
    return _HEADER.pack(MAGIC, VERSION, len(k), len(payload), hashlib.sha256(payload).digest()) + k + bytes(payload)


def decode_page(key: str, blob: bytes, payload_bytes: int) -> memoryview | None:
    """The payload of a record read back under `key`, or None if it is not one: wrong magic or
    version, written under another key, another length than `payload_bytes` (another geometry),
    or a payload whose digest differs from its header's."""
    k = key.encode()
    head = _HEADER.size
    if len(blob) != head + len(k) + payload_bytes:
        return None
    magic, version, klen, plen, digest = _HEADER.unpack_from(blob, 0)
    if magic != MAGIC or version != VERSION or klen != len(k) or plen != payload_bytes:
        return None
    view = memoryview(blob)
    if view[head : head + klen] != k:
        return None
    payload = view[head + klen :]
    if hashlib.sha256(payload).digest() != digest:
        return None
    return payload
