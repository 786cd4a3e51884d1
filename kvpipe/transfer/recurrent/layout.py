"""One rank's recurrent-state pool (a hybrid model's linear-attention layers) as the transfer layer sees it.

Per linear layer i (model layer `linear_layers[i]`) the pool has two buffers
(kvpipe/cache/recurrent_pool.py):
  conv      [num_slots, conv_dim, conv_len]        model dtype
  recurrent [num_slots, heads, key_dim, value_dim] fp32
Slot s of a buffer is contiguous at base + s * slot_nbytes, so a request's state moves as one
op per (linear layer, conv|recurrent) when both ranks hold the same heads (same TP). Under TP a
rank holds key heads [key_head_start, +key_heads) and value heads [value_head_start, +heads)
(linear heads always split evenly, never replicated); its conv channels are [q | k | v] of those
heads, so a head range of one slot is 3 channel ranges of the conv state and one contiguous
range of the recurrent state (heterogeneous TP, plan.py).

The layout also carries the model's layer map: a hybrid KV pool has one buffer per full-attention
layer only (ModelConfig.kv_layers), so a layer group [a, b) of model layers covers KV buffers
`kv_range(a, b)` and linear layers `linear_range(a, b)`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the pool pulls in torch; the layout itself is plain data
    from kvpipe.cache.recurrent_pool import StatePool


@dataclass(frozen=True)
class StateLayout:
    num_model_layers: int
    kv_layers: tuple[int, ...]  # model layers with KV buffers, in KV-pool order
    linear_layers: tuple[int, ...]  # model layers with state, in state-pool order
    num_slots: int
    conv_dim: int  # this rank's conv channels (its q, k and v heads)
    conv_len: int  # conv_kernel - 1
    heads: int  # this rank's value heads
    key_dim: int
    value_dim: int
    conv_dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    conv_itemsize: int
    conv_addrs: tuple[int, ...]  # one per linear layer
    recurrent_addrs: tuple[int, ...]  # one per linear layer (fp32)
    key_head_start: int = 0  # global index of this rank's first linear key head
    value_head_start: int = 0  # ... and of its first linear value head
    total_key_heads: int = 0  # linear key heads of the model (0: this rank's, i.e. TP 1)
    total_value_heads: int = 0

    def __post_init__(self) -> None:
        n = len(self.linear_layers)
        if len(self.conv_addrs) != n or len(self.recurrent_addrs) != n:
            raise ValueError(
                f"{n} linear layers but {len(self.conv_addrs)} conv and "
                f"{len(self.recurrent_addrs)} recurrent buffer addresses"
            )
        layers = sorted(self.kv_layers + self.linear_layers)
        # lengths first: a peer's num_model_layers of 2**62 must be refused, not materialised
        if len(layers) != self.num_model_layers or layers != list(range(self.num_model_layers)):
            raise ValueError(
                f"KV layers {self.kv_layers} and linear layers {self.linear_layers} do not "
                f"partition the model's {self.num_model_layers} layers"
            )
        if list(self.kv_layers) != sorted(self.kv_layers) or list(self.linear_layers) != sorted(self.linear_layers):
            raise ValueError("layer indices must increase")
        for name in ("num_slots", "conv_dim", "conv_len", "heads", "key_dim", "value_dim", "conv_itemsize"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        qk = self.conv_dim - self.heads * self.value_dim
        if qk <= 0 or qk % (2 * self.key_dim):
            raise ValueError(
                f"conv_dim {self.conv_dim} is not [q | k | v] of whole heads "
                f"(value heads {self.heads} x {self.value_dim}, key dim {self.key_dim})"
            )
        if not (self.key_head_end <= self.all_key_heads and self.value_head_end <= self.all_value_heads):
            raise ValueError(
                f"key heads [{self.key_head_start}, {self.key_head_end}) / value heads "
                f"[{self.value_head_start}, {self.value_head_end}) outside the model's "
                f"{self.all_key_heads} / {self.all_value_heads}"
            )

    @property
    def key_heads(self) -> int:
        """This rank's linear key heads (q and k channels are key_heads * key_dim each)."""
        return (self.conv_dim - self.heads * self.value_dim) // (2 * self.key_dim)

    @property
    def key_head_end(self) -> int:
        return self.key_head_start + self.key_heads

    @property
    def value_head_end(self) -> int:
        return self.value_head_start + self.heads

    @property
    def all_key_heads(self) -> int:
        return self.total_key_heads or self.key_heads

    @property
    def all_value_heads(self) -> int:
        return self.total_value_heads or self.heads

    @property
    def num_linear(self) -> int:
        return len(self.linear_layers)

    @property
    def conv_slot_nbytes(self) -> int:
        return self.conv_dim * self.conv_len * self.conv_itemsize

    @property
    def recurrent_slot_nbytes(self) -> int:
        return self.heads * self.key_dim * self.value_dim * 4  # fp32

    @property
    def slot_nbytes(self) -> int:
        """One request's state over every linear layer (this rank's heads)."""
        return self.num_linear * (self.conv_slot_nbytes + self.recurrent_slot_nbytes)

    def buffers(self) -> list[tuple[int, int]]:
        """(base address, bytes) of every buffer, for registration with a backend."""
        out = []
        for c, r in zip(self.conv_addrs, self.recurrent_addrs):
            out += [(c, self.num_slots * self.conv_slot_nbytes), (r, self.num_slots * self.recurrent_slot_nbytes)]
        return out

    def kv_range(self, start: int, end: int) -> tuple[int, int]:
        """KV buffer indices [i0, i1) of the full-attention layers among model layers [start, end)."""
        self._check_range(start, end)
        return bisect.bisect_left(self.kv_layers, start), bisect.bisect_left(self.kv_layers, end)

    def linear_range(self, start: int, end: int) -> tuple[int, int]:
        """State-pool indices [j0, j1) of the linear layers among model layers [start, end)."""
        self._check_range(start, end)
        return bisect.bisect_left(self.linear_layers, start), bisect.bisect_left(self.linear_layers, end)

    def _check_range(self, start: int, end: int) -> None:
        if not 0 <= start <= end <= self.num_model_layers:
            raise ValueError(f"layers [{start}, {end}) outside the model's [0, {self.num_model_layers})")

    @classmethod
    def from_pool(
        cls, pool: StatePool, kv_layers: tuple[int, ...], num_model_layers: int, tp_rank: int = 0, tp_size: int = 1
    ) -> StateLayout:
        """Rank `tp_rank` of `tp_size` holds the tp_rank-th equal share of the linear heads."""
        s = pool.shape
        nk = (s.conv_dim - s.heads * s.value_dim) // (2 * s.key_dim)
        return cls(
            key_head_start=tp_rank * nk,
            value_head_start=tp_rank * s.heads,
            total_key_heads=tp_size * nk,
            total_value_heads=tp_size * s.heads,
            num_model_layers=num_model_layers,
            kv_layers=tuple(kv_layers),
            linear_layers=tuple(pool.layers),
            num_slots=pool.num_slots,
            conv_dim=s.conv_dim,
            conv_len=s.conv_len,
            heads=s.heads,
            key_dim=s.key_dim,
            value_dim=s.value_dim,
            conv_dtype=str(pool.conv_dtype).removeprefix("torch."),
            conv_itemsize=pool.conv[0].element_size() if pool.conv else 4,
            conv_addrs=tuple(t.data_ptr() for t in pool.conv),
            recurrent_addrs=tuple(t.data_ptr() for t in pool.recurrent),
        )

    def compatible_with(self, other: StateLayout) -> str | None:
        """None when a request's state can move between the two pools, else why not (the ranks may
        hold different heads: heterogeneous TP moves the heads both hold)."""
        checks = (
            ("number of layers", self.num_model_layers, other.num_model_layers),
            ("full-attention layers", self.kv_layers, other.kv_layers),
            ("linear-attention layers", self.linear_layers, other.linear_layers),
            ("conv state dtype", self.conv_dtype, other.conv_dtype),
            ("conv kernel - 1", self.conv_len, other.conv_len),
            ("linear key head dim", self.key_dim, other.key_dim),
            ("linear value head dim", self.value_dim, other.value_dim),
            ("linear key heads", self.all_key_heads, other.all_key_heads),
            ("linear value heads", self.all_value_heads, other.all_value_heads),
        )
        for what, mine, theirs in checks:
            if mine != theirs:
                return f"recurrent state {what} mismatch: {mine!r} here vs {theirs!r} on the peer"
        return None
