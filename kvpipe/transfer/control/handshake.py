"""What a prefill and a decode must agree on before a byte of KV moves (issue 26), and the
comparison that names every disagreement with both sides' values.

`Handshake` describes one server instance, independent of its TP size and of where its buffers
live (those are checked per rank pair: bootstrap.check_compatible, sender/peers.py):
- the model by content (`model_digest`, model/checkpoint/identity.py: config, tokenizer and a sample of
  every weight tensor), so two checkpoints served under one name are refused;
- the KV pool: storage dtype, page size, kind (K and V, or one MLA latent), layers, total KV
  heads, head dim, sliding-window layers;
- the fp8 K and V scales per KV layer: the transfer copies raw fp8 bytes and never sends scales,
  so both sides must load the same ones (1.0 each for other dtypes);
- a hybrid model's recurrent state (conv and delta-rule state dtypes and whole-model shapes);
- `speculative`: the speculative-decoding settings that change what moves with the KV (draft
  KV, draft inputs), a canonical string: "none" (no speculation, or NGRAM, which moves nothing),
  or for a STANDALONE draft model the algorithm, the draft checkpoint's digest and its KV layout
  (disagg/draft_transfer.py); the comparison takes it as is.
- `quantization`: --quantization ("none" without it). The KV layout would agree, but weights
  quantized differently give other logits and other KV values: a decode continuing a prefill's
  KV with other weights would generate what neither side alone would.

The prefill publishes its handshake with every rank's bootstrap registration; the decode
compares it with its own when it fetches the prefill's info and, on a mismatch, refuses every
waiting request (nothing is registered, so nothing can be written) and reports the refusal to the
prefill's bootstrap server, which fails the same rooms there (`REFUSED` marks such failures: the
HTTP servers answer them as REFUSED_STATUS says).
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.recurrent.layout import StateLayout

SPECULATIVE_NONE = "none"
QUANTIZATION_NONE = "none"  # the handshake's quantization without --quantization
REFUSED = "PD handshake refused"  # in every refusal message (what the HTTP servers look for)
# 409 Conflict: the two servers' configurations conflict, and trying again cannot help. The OpenAI
# routes answer a refused request with it (their answers have no place for the reason). Native
# /generate answers it, on both servers, with SGLang's abort and the reason instead (a 200):
# sglang-router 0.3.2 retries every error status of either server, 409 included (measured: 5
# attempts, a new room each, every one refused at once), but not an answer; sgl-model-gateway's
# own retry list is 408, 429, 500, 502, 503 and 504.
REFUSED_STATUS = 409
MAX_ENTRIES = 1 << 16  # list fields of a peer's handshake (layers): far more than any model has

# metadata of each field: what the message calls it, and its `reason` label in /metrics
_LABEL = "what"
_REASON = "reason"


def _meta(what: str, reason: str) -> dict[str, str]:
    return {_LABEL: what, _REASON: reason}


@dataclass(frozen=True)
class Handshake:
    """One server instance as its peers must see it (fields compared in this order)."""

    model_digest: str = field(metadata=_meta("model (checkpoint digest)", "model"))
    kv_dtype: str = field(metadata=_meta("KV cache dtype", "kv_dtype"))  # torch name, e.g. "float8_e4m3fn"
    page_size: int = field(metadata=_meta("page size", "page_size"))
    kv_kind: int = field(metadata=_meta("KV kind (2: K and V, 1: MLA latent)", "kv_layout"))
    kv_layers: int = field(metadata=_meta("KV layers", "kv_layout"))
    kv_heads: int = field(metadata=_meta("KV heads (whole model)", "kv_layout"))
    head_dim: int = field(metadata=_meta("KV head dim", "kv_layout"))
    swa_layers: tuple[int, ...] = field(default=(), metadata=_meta("sliding-window layers", "kv_layout"))
    # per KV layer: stored = value / scale (fp8 pools; 1.0 for every other dtype)
    k_scales: tuple[float, ...] = field(default=(), metadata=_meta("fp8 K scales", "kv_scales"))
    v_scales: tuple[float, ...] = field(default=(), metadata=_meta("fp8 V scales", "kv_scales"))
    # hybrid models (empty / "" otherwise): model layers holding state, and per layer the state's
    # dtype and whole-model shape: conv [conv channels, kernel - 1], delta rule [value heads, key dim, value dim]
    state_layers: tuple[int, ...] = field(default=(), metadata=_meta("recurrent-state layers", "state_layout"))
    state_conv_dtype: str = field(default="", metadata=_meta("conv state dtype", "state_layout"))
    state_conv_shape: tuple[int, ...] = field(default=(), metadata=_meta("conv state shape", "state_layout"))
    state_recurrent_dtype: str = field(default="", metadata=_meta("recurrent state dtype", "state_layout"))
    state_recurrent_shape: tuple[int, ...] = field(default=(), metadata=_meta("recurrent state shape", "state_layout"))
    speculative: str = field(default=SPECULATIVE_NONE, metadata=_meta("speculative decoding", "speculative"))
    quantization: str = field(default=QUANTIZATION_NONE, metadata=_meta("weight quantization", "quantization"))

    def __post_init__(self) -> None:
        for name in ("page_size", "kv_kind", "kv_layers", "kv_heads", "head_dim"):
            v = getattr(self, name)
            if type(v) is not int or v <= 0:
                raise ValueError(f"handshake {name} must be a positive int, got {v!r}")
        for name in ("k_scales", "v_scales"):
            scales = getattr(self, name)
            if scales and (len(scales) != self.kv_layers or not all(math.isfinite(s) and s > 0 for s in scales)):
                raise ValueError(f"handshake {name}: {self.kv_layers} positive finite numbers, got {len(scales)}")

    @classmethod
    def of(
        cls,
        model_digest: str,
        layout: KVLayout,
        k_scales: tuple[float, ...] = (),
        v_scales: tuple[float, ...] = (),
        state: StateLayout | None = None,
        speculative: str = SPECULATIVE_NONE,
        quantization: str | None = None,
    ) -> Handshake:
        """An instance's handshake from one of its ranks' pools (every rank's gives the same: the
        TP-dependent parts, head ranges and addresses, are left out)."""
        st: dict[str, Any] = {}
        if state is not None:
            conv_channels = 2 * state.all_key_heads * state.key_dim + state.all_value_heads * state.value_dim
            st = dict(
                state_layers=state.linear_layers,
                state_conv_dtype=state.conv_dtype,
                state_conv_shape=(conv_channels, state.conv_len),
                state_recurrent_dtype="float32",  # recurrent_pool.py keeps the delta-rule state in fp32
                state_recurrent_shape=(state.all_value_heads, state.key_dim, state.value_dim),
            )
        return cls(
            model_digest=model_digest,
            kv_dtype=layout.dtype,
            page_size=layout.page_size,
            kv_kind=layout.buffers_per_layer,
            kv_layers=layout.num_layers,
            kv_heads=layout.total_kv_heads,
            head_dim=layout.head_dim,
            swa_layers=layout.swa_layers,
            k_scales=tuple(float(x) for x in k_scales),
            v_scales=tuple(float(x) for x in v_scales),
            speculative=speculative,
            quantization=quantization or QUANTIZATION_NONE,
            **st,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (bootstrap): tuples as lists."""
        return {f.name: list(v) if isinstance(v, tuple) else v for f in fields(self) for v in (getattr(self, f.name),)}

    @classmethod
    def from_dict(cls, d: Any) -> Handshake:
        """From to_dict's form (a peer's JSON); TypeError / ValueError for anything malformed."""
        if not isinstance(d, dict):
            raise TypeError(f"a handshake is a JSON object, not {type(d).__name__}")
        hints = typing.get_type_hints(cls)
        unknown = set(d) - set(hints)
        if unknown:
            raise ValueError(f"unknown handshake fields {sorted(unknown)[:5]}")
        kw: dict[str, Any] = {}
        for name, value in d.items():
            tp = hints[name]
            if typing.get_origin(tp) is tuple:
                elem = typing.get_args(tp)[0]
                if not isinstance(value, list) or len(value) > MAX_ENTRIES:
                    raise TypeError(f"handshake {name} must be a list of at most {MAX_ENTRIES} numbers")
                if not all(type(x) is int or (elem is float and type(x) is float) for x in value):
                    raise TypeError(f"handshake {name} must hold {elem.__name__}s")
                kw[name] = tuple(elem(x) for x in value)
            elif tp is str:
                if not isinstance(value, str) or len(value) > 256:
                    raise TypeError(f"handshake {name} must be a string of at most 256 characters")
                kw[name] = value
            elif type(value) is not int:
                raise TypeError(f"handshake {name} must be an int")
            else:
                kw[name] = value
        return cls(**kw)


@dataclass(frozen=True)
class Mismatch:
    """One field the two sides disagree on."""

    name: str  # the Handshake field
    what: str  # how the message calls it
    reason: str  # the /metrics label
    prefill: Any
    decode: Any

    def describe(self) -> str:
        p, d = self.prefill, self.decode
        if isinstance(p, tuple) and isinstance(d, tuple) and len(p) == len(d) and len(p) > 4:
            i = next(i for i, (a, b) in enumerate(zip(p, d)) if a != b)  # long lists: the first difference
            return f"{self.what}: prefill {p[i]!r}, decode {d[i]!r} at index {i} of {len(p)}"
        return f"{self.what}: prefill {_short(p)}, decode {_short(d)}"


def _short(v: Any) -> str:
    if isinstance(v, tuple) and len(v) > 8:
        return f"({', '.join(repr(x) for x in v[:8])}, ... {len(v)} entries)"
    return repr(v)


def compare(prefill: Handshake, decode: Handshake) -> tuple[Mismatch, ...]:
    """Every field the two sides disagree on, in field order (empty: compatible)."""
    out = []
    for f in fields(Handshake):
        p, d = getattr(prefill, f.name), getattr(decode, f.name)
        if p != d:
            out.append(Mismatch(f.name, f.metadata[_LABEL], f.metadata[_REASON], p, d))
    return tuple(out)


def describe(mismatches: tuple[Mismatch, ...]) -> str:
    """One message naming both sides' values of every mismatch (REFUSED starts it)."""
    return f"{REFUSED}: " + "; ".join(m.describe() for m in mismatches)


def refusal(what: str, reason: str, prefill: Any, decode: Any) -> tuple[Mismatch, ...]:
    """A refusal for something outside the Handshake (the served model name, the TP mapping)."""
    return (Mismatch(reason, what, reason, prefill, decode),)


MAX_REFUSED_ROOMS = 4096  # rooms one refusal notice names (the decode sends more in several)
MAX_REASON_CHARS = 1024


@dataclass(frozen=True)
class RefusalNotice:
    """A decode refused this prefill's handshake for these rooms (POST /v1/prefill/refusals): the
    prefill fails them at once instead of holding their KV until its bootstrap timeout. Nothing
    was registered, so nothing was written. `handshake`: the decode's, so the prefill can name
    both sides' values itself; `label`: the decode's /metrics reason; `claims`: each room's claim
    (messages.room_claim), without which the prefill fails no request (disagg/refusals.py)."""

    rooms: tuple[int, ...]
    reason: str
    label: str
    handshake: Handshake | None = None
    claims: tuple[bytes, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "rooms": list(self.rooms),
            "reason": self.reason[:MAX_REASON_CHARS],
            "label": self.label,
            "handshake": None if self.handshake is None else self.handshake.to_dict(),
            "claims": [c.hex() for c in self.claims],
        }

    @classmethod
    def from_dict(cls, d: Any) -> RefusalNotice:
        """From a decode's JSON; KeyError / TypeError / ValueError for anything malformed."""
        if not isinstance(d, dict):
            raise TypeError("a refusal notice is a JSON object")
        rooms, reason, label = d["rooms"], d["reason"], d["label"]
        if not isinstance(rooms, list) or not 0 < len(rooms) <= MAX_REFUSED_ROOMS:
            raise ValueError(f"rooms: a list of 1 to {MAX_REFUSED_ROOMS} rooms")
        if not all(type(r) is int and 0 <= r < 1 << 63 for r in rooms):
            raise ValueError("rooms: 63-bit non-negative ints")
        if not isinstance(reason, str) or not isinstance(label, str) or not label.isidentifier() or len(label) > 64:
            raise ValueError("reason: a string, label: an identifier")
        hs = d.get("handshake")
        claims = d.get("claims", [])
        if not isinstance(claims, list) or (claims and len(claims) != len(rooms)):
            raise ValueError("claims: one per room, or none")
        if not all(isinstance(c, str) and len(c) == 32 for c in claims):
            raise ValueError("claims: 16-byte hex strings")
        return cls(
            tuple(rooms),
            reason[:MAX_REASON_CHARS],
            label,
            None if hs is None else Handshake.from_dict(hs),
            tuple(bytes.fromhex(c) for c in claims),
        )


def refusal_status(detail: object) -> int | None:
    """REFUSED_STATUS for a failure (its finish detail or error message) caused by a refused
    handshake, else None (the caller keeps its own status)."""
    return REFUSED_STATUS if isinstance(detail, str) and REFUSED in detail else None
