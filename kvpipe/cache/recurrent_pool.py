"""Per-request recurrent state of a hybrid model's linear-attention layers (gated delta-net).

Per linear-attention layer and slot (one slot per running request, see recurrent_slots.py):
- conv: [slots, conv_dim, conv_kernel - 1], the last inputs of the causal depthwise conv, in the
  model dtype (HF keeps it so);
- recurrent: [slots, heads, key_dim, value_dim], the delta-rule state, fp32 (HF computes it in fp32).
Under TP a rank holds its linear-attention heads only: its q/k/v conv channels and value heads.

One slot of one buffer is contiguous, so moving a request's state (PD transfer, later) is one op
per (layer, kind): `buffer_infos` gives the base addresses and sizes like KVPool.buffer_infos.
The tensors are allocated once; writes go in place, so the addresses stay valid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpipe.cache.verify_states import VerifyStates


@dataclass(frozen=True)
class StateBufferInfo:
    """Raw view of one state buffer for the transfer layer: base address and sizes in bytes."""

    layer: int  # the model's layer index
    kind: str  # "conv" | "recurrent"
    addr: int
    nbytes: int
    slot_nbytes: int  # one request's state in this buffer: slot s lives at addr + s * slot_nbytes


@dataclass(frozen=True)
class StateShape:
    """One rank's per-slot state of one linear-attention layer."""

    conv_dim: int  # this rank's conv channels (its q, k and v heads)
    conv_len: int  # conv_kernel - 1
    heads: int  # this rank's value heads
    key_dim: int
    value_dim: int


class StatePool:
    def __init__(
        self,
        layers: tuple[int, ...],
        num_slots: int,
        shape: StateShape,
        conv_dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        """`layers`: the model's linear-attention layer indices; buffer i belongs to layers[i]."""
        self.layers = layers
        self.num_slots = num_slots
        self.shape = shape
        self.conv_dtype = conv_dtype
        s = shape
        self.conv = [torch.zeros(num_slots, s.conv_dim, s.conv_len, dtype=conv_dtype, device=device) for _ in layers]
        self.recurrent = [
            torch.zeros(num_slots, s.heads, s.key_dim, s.value_dim, dtype=torch.float32, device=device) for _ in layers
        ]
        # speculative decoding: the per-position states of verify forwards (cache/verify_states.py)
        self.verify: VerifyStates | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def buffer_infos(self) -> list[StateBufferInfo]:
        """Per-(layer, kind) buffers in a fixed order: layer-major, conv before recurrent."""
        out = []
        for i, layer in enumerate(self.layers):
            for kind, buf in (("conv", self.conv[i]), ("recurrent", self.recurrent[i])):
                nbytes = buf.numel() * buf.element_size()
                out.append(StateBufferInfo(layer, kind, buf.data_ptr(), nbytes, nbytes // self.num_slots))
        return out

    def keep_verify_states(self, running_slots: int, positions: int) -> VerifyStates:
        """Speculative decoding: buffers for `positions` per-position states of each of the first
        `running_slots` slots (cache/verify_states.py), which verify forwards fill."""
        self.verify = VerifyStates(self.conv, self.recurrent, running_slots, positions)
        return self.verify

    def commit_verify(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """Apply (slot, j, dst) copies of the last verify forward's per-position states."""
        if copies:
            if self.verify is None:
                raise ValueError("state commits without verify states")
            self.verify.commit(self.conv, self.recurrent, copies)

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Every layer's state of slots `src` into slots `dst` (a cached prefix's snapshot into a
        request's slot; kvpipe/cache/hybrid_radix_cache.py)."""
        if not src:
            return
        s = torch.tensor(src, dtype=torch.int64, device=self.conv[0].device)
        d = torch.tensor(dst, dtype=torch.int64, device=self.conv[0].device)
        for buf in (*self.conv, *self.recurrent):
            buf[d] = buf[s]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffer_infos())

    @property
    def slot_nbytes(self) -> int:
        """One request's state over every layer."""
        return sum(b.slot_nbytes for b in self.buffer_infos())
