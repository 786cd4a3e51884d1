"""What the two processes of `kvpipe bench transfer` are told: the KV shape, the prompt lengths,
the repeats and the transport settings; one config for the same-TP bench (procs.py)
and one for the heterogeneous-TP bench (tp.py). Both name the process's log file and
network namespace, which the harness (process_pair.py) enters first."""

from __future__ import annotations

from dataclasses import dataclass

from kvpipe.bench.transfer.raw_mooncake import RawPattern
from kvpipe.cache.window_pages import prompt_window_pages
from kvpipe.model.checkpoint.schema import HybridConfig


@dataclass(frozen=True)
class WorkerConfig:
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name
    page_size: int
    prompt_lens: tuple[int, ...]
    repeat: int
    fragmentation: float  # probability that a decode page starts a new run (0: one run)
    window: int  # Mooncake ops in flight per peer
    seed: int
    log_path: str  # this process's stderr (Mooncake logs a lot) goes here
    hostname: str = "127.0.0.1"
    netns: str | None = None
    max_op_bytes: int | None = None  # the backend splits longer ops into pieces; None: never
    raw_patterns: tuple[RawPattern, ...] = ()  # swept per length; the one-op pattern is always timed
    compare_max_op_bytes: tuple[int, ...] = (0,)  # kvpipe also timed split at these (0: unsplit)
    latent: bool = False  # an MLA latent pool: one buffer per layer (kv_heads 1, head_dim = latent width)
    # a hybrid model: num_layers are its full-attention layers; its linear layers keep a state slot
    hybrid: HybridConfig | None = None
    sliding_layers: tuple[int, ...] = ()  # KV layers paged by the window table (GPT-OSS)
    sliding_window: int | None = None

    @property
    def max_pages(self) -> int:
        return -(-max(self.prompt_lens) // self.page_size)

    def window_pages(self, prompt_len: int) -> tuple[int, int]:
        """Logical pages [first, end) the sliding layers move for a prompt; (end, end): none."""
        end = -(-prompt_len // self.page_size)
        if not self.sliding_layers:
            return end, end
        return prompt_window_pages(prompt_len, self.sliding_window or 0, self.page_size)

    @property
    def max_window_pages(self) -> int:
        return max(e - f for f, e in map(self.window_pages, self.prompt_lens))

    @property
    def full_region(self) -> int:  # decode's full pages; fragmented runs have gaps: up to 2x the pages
        return self.max_pages * (2 if self.fragmentation > 0 else 1)

    @property
    def pool_pages(self) -> int:
        """Decode pool: its full pages, then (sliding shapes) as many again for window pages."""
        return self.full_region + self.max_window_pages * (2 if self.fragmentation > 0 else 1)

    @property
    def prefill_pages(self) -> int:
        """Prefill pool: a request's full pages [0, n), its window pages from max_pages on."""
        return self.max_pages + self.max_window_pages


@dataclass(frozen=True)
class TPConfig:
    num_layers: int
    kv_heads: int  # total KV heads of the model
    head_dim: int
    dtype: str
    page_size: int
    prompt_lens: tuple[int, ...]
    repeat: int
    fragmentation: float
    window: int
    seed: int
    log_path: str
    prefill_tp: int
    decode_tp: int
    staging: str  # "on" | "auto": the staged variant's mode
    staging_pool_mb: int
    prefill_host: str  # where the decode reaches the prefill's bootstrap servers
    hostname: str = "127.0.0.1"
    netns: str | None = None

    @property
    def max_pages(self) -> int:
        return -(-max(self.prompt_lens) // self.page_size)
