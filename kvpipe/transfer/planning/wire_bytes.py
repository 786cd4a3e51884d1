"""KV bytes a PD request puts on the wire, as a function of its prompt length.

Full-attention layers (and every layer of a model without sliding windows) send every token.
Sliding-window layers (GPT-OSS) send only the pages the decode reserved for them: the prompt's
last window, logical pages [window_first_page(L, W, ps), ceil(L / ps)) of an L-token prompt
(cache/window_pages.py prompt_window_pages). Counted in tokens, like the layer-group planner's
estimate (a page's unused tail is not counted); the transfer bench counts whole pages from its plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpipe.cache.window_pages import prompt_window_pages

if TYPE_CHECKING:
    from kvpipe.transfer.planning.layout import KVLayout


@dataclass(frozen=True)
class KVWireBytes:
    full_token_nbytes: int  # one token over the layers that send every token (K and V, or the latent)
    swa_token_nbytes: int = 0  # one token over the sliding-window layers
    window: int | None = None  # tokens; None: no sliding layers
    page_size: int = 1

    def __post_init__(self) -> None:
        if self.swa_token_nbytes and (self.window is None or self.window < 1):
            raise ValueError(f"sliding-window layers need a window >= 1, got {self.window!r}")

    @classmethod
    def from_layout(cls, layout: KVLayout, window: int | None) -> KVWireBytes:
        """Of one rank's pool: its local heads, its sliding layers (layout.swa_layers)."""
        per_layer = layout.token_nbytes // layout.num_layers
        n_swa = len(layout.swa_layers)
        return cls(
            (layout.num_layers - n_swa) * per_layer, n_swa * per_layer, window if n_swa else None, layout.page_size
        )

    def swa_tokens(self, start: int, end: int, prompt_len: int) -> int:
        """Tokens of [start, end) that the sliding layers send for a prompt of prompt_len tokens:
        those inside the prompt's window pages (at most window + page_size - 1 of them)."""
        if self.window is None:
            return 0
        first, _ = prompt_window_pages(prompt_len, self.window, self.page_size)
        return max(0, min(end, prompt_len) - max(start, first * self.page_size))

    def span_nbytes(self, start: int, end: int, prompt_len: int) -> int:
        """Bytes of prompt tokens [start, end) (a prefill chunk) of a prompt of prompt_len tokens."""
        full = (end - start) * self.full_token_nbytes
        return full + (self.swa_tokens(start, end, prompt_len) * self.swa_token_nbytes if self.swa_token_nbytes else 0)

    def request_nbytes(self, prompt_len: int) -> int:
        """Bytes of a whole prompt's KV."""
        return self.span_nbytes(0, prompt_len, prompt_len)

    def all_layers_nbytes(self, prompt_len: int) -> int:
        """What the prompt would weigh if every layer sent every token (no window)."""
        return prompt_len * (self.full_token_nbytes + self.swa_token_nbytes)
