"""Negative controls for the exactness tests: corrupt one piece of a real KV pool or recurrent-state
pool on purpose (one page of one layer, optionally one head slice of it, or one state slot of one
linear layer) at a chosen moment, so a test can show that its exactness check fails when the KV it
guards is wrong. Test-only: nothing in kvpipe knows of it; the tests call it between a transfer
(or a prefill) and the decode forward that reads the KV (pd_pair.Pair.run's `on_landed`,
engine.generate_after_prefill's `after_prefill`).

The noise is the corrupted tensor's own scale (its standard deviation over the whole buffer, so a
page that is still zero gets the layer's scale), seeded: a wrong but plausible KV, as a misplaced
page or head would be, not NaNs that any check would notice."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvpipe.cache.kv_pool import KVPool
from kvpipe.cache.recurrent_pool import StatePool


@dataclass(frozen=True)
class KVCorruption:
    """What to corrupt in a request's KV: logical page `page` (an index into its page table,
    negative from the end) of pool layer `layer` (ModelConfig.kv_layers order: a hybrid model's
    full-attention layers only), in its K buffer (the latent for MLA) and V buffer, all heads or
    only the rank's local head `head`."""

    layer: int
    page: int = 0
    head: int | None = None

    def apply(self, pool: KVPool, pages: np.ndarray | torch.Tensor, seed: int = 0) -> str:
        """Overwrite the slice in `pool` for a request whose page table is `pages`; returns what
        was corrupted, in words."""
        physical = int(pages[self.page])
        g = torch.Generator().manual_seed(seed)
        for _, buf in pool.layer_buffers(self.layer):
            view = buf[physical] if self.head is None else buf[physical, self.head]  # [heads, ps, d] / [ps, d]
            scale = float(buf.float().std()) or 1.0
            noise = torch.randn(view.shape, generator=g, dtype=torch.float32) * scale
            view.copy_(noise.to(buf.dtype))
        heads = "every head" if self.head is None else f"head {self.head}"
        return f"layer {self.layer}, logical page {self.page} (physical {physical}), {heads}"


def corrupt_state_slot(state: StatePool, slot: int, linear_layer: int = 0, seed: int = 0) -> str:
    """Overwrite one request's recurrent state (`slot`) of the `linear_layer`-th linear-attention
    layer: its delta-rule state [heads, Dk, Dv] and its conv state [conv_dim, kernel - 1]."""
    g = torch.Generator().manual_seed(seed)
    for buf in (state.recurrent[linear_layer], state.conv[linear_layer]):
        scale = float(buf.float().std()) or 1.0
        buf[slot].copy_((torch.randn(buf[slot].shape, generator=g, dtype=torch.float32) * scale).to(buf.dtype))
    return f"state slot {slot} of linear layer {state.layers[linear_layer]}"
