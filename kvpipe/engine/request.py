"""Requests as the engine sees them: sampling parameters, lifecycle state, streamed outputs."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import numpy as np

from kvpipe.cache.radix_cache import salted
from kvpipe.engine.spec.verify import SpecCounts
from kvpipe.engine.state_snapshots import ReqSnapshots
from kvpipe.engine.timeline import Timeline, TimelineRecord

# Temperatures below this sample greedily (SGLang's _SAMPLING_EPS): logits / 1e-300 overflow to
# inf and the softmax to NaN, and the limit of tempered sampling is the argmax anyway.
SAMPLING_EPS = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # below SAMPLING_EPS (0 included) means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: no limit
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # queued, no pages yet
    RUNNING = "running"  # has pages; prefilling (maybe in chunks) or decoding
    FINISHED = "finished"


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"  # EOS, stop token id or stop string
    ABORT = "abort"


def finish_reason_json(
    reason: FinishReason | None, detail: str | int | None, completion_tokens: int
) -> dict[str, Any] | None:
    """SGLang's `meta_info.finish_reason`: {"type": "stop", "matched": stop string or token id},
    {"type": "length", "length": n} or {"type": "abort", "message": ...}; None while running."""
    if reason is None:
        return None
    if reason is FinishReason.STOP:
        return {"type": "stop", "matched": detail}
    if reason is FinishReason.LENGTH:
        return {"type": "length", "length": completion_tokens}
    return {"type": "abort", "message": detail or ABORTED_ON_REQUEST}


# finish_detail of a request aborted because someone asked (/abort_request, a client that left);
# any other abort detail is the server's reason for giving up on it
ABORTED_ON_REQUEST = "aborted"


@dataclass
class Req:
    """Mutable per-request state owned by the scheduler thread."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    return_logprob: bool = False
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: FinishReason | None = None
    finish_detail: str | int | None = None  # matched stop string / token id, or abort message
    pages: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    num_cached: int = 0  # tokens whose KV is in `pages`
    # prefix cache: pages[:num_shared_pages] are the cache's (read-only, pinned by `cache_node`)
    num_shared_pages: int = 0
    cache_node: Any = None  # the RadixNode this request locked (None: nothing matched)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    state_slot: int | None = None  # hybrid models: its recurrent-state slot while admitted
    snapshots: ReqSnapshots | None = None  # hybrid models with a prefix cache: its state snapshots
    # sliding-window models: the pages of the sliding layers, by logical page like `pages` (at
    # most as long; shorter: not allocated yet), -1 where the window has slid past (freed) or
    # never reached (a PD decode holds only the prompt's last window)
    swa_pages: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # PD disaggregation (injected by sglang-router): where the KV comes from / goes to
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None  # None: the default bootstrap port
    bootstrap_room: int | None = None
    spec: SpecCounts | None = None  # speculative decoding: this request's verify counts
    timeline: Timeline = field(default_factory=Timeline)  # where its time went (engine/timeline.py)
    # sliding-window models with a prefix cache (engine/window_cache.py): token positions (page
    # aligned) whose preceding window pages the request keeps from sliding out, for the cache
    swa_hit_points: tuple[int, ...] = ()
    # PD with a STANDALONE draft model: the draft pool's pages of its whole prompt, reserved with
    # its prompt's pages, whose draft KV moves with the target's (empty: none)
    draft_pages: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # PD with NEXTN, on the prefill: the target's hidden states the decode's MTP layer starts from
    # (disagg/mtp_transfer.py; raw bytes for AuxData.hidden, set after the prompt's last forward)
    draft_hidden: bytes = b""
    # sliding-window models, a PD decode with a prefix cache (engine/window_cache.py match_full):
    # logical pages below num_shared_pages whose window page is the request's own (the prompt's
    # last window reaches back into its cached prefix where the cache holds no window page: the
    # prefill fills them); every other window page below num_shared_pages is the cache's
    swa_own_shared: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # the prefix-cache namespace (a tenant's: server/api_key.tenant_salt): prefixes are shared only between
    # requests of the same salt; None: with every unsalted request
    cache_salt: str | None = None

    def cache_ids(self, ids: list[int]) -> Sequence[int]:
        """`ids` (of this request) as the prefix caches key them (radix_cache.salted)."""
        return salted(ids, self.cache_salt)

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def prefill_done(self) -> bool:
        return self.num_cached >= len(self.input_ids)

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED


@dataclass(frozen=True)
class TokenOutput:
    """One engine step's news for one request: new token(s), and the finish if it ended."""

    rid: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason | None = None
    finish_detail: str | int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # by keyword only: optional reports that different features attach to a final output
    _: KW_ONLY
    spec: SpecCounts | None = None  # a speculative engine's counts of the request, when it finished
    timeline: TimelineRecord | None = None  # with a request's final output
