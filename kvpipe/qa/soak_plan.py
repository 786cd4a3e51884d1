"""What the soak sends: its configuration and the seeded list of mixed requests (pure).

Every request is one of three API kinds (native `/generate`, `/v1/completions`,
`/v1/chat/completions`), streaming or not, with a prompt of a drawn length given as token ids or
as text (chat and completions: text only; sglang-router's PD mode answers token-id prompts on
/v1/completions with 422). A drawn share of the requests streams and is disconnected by the
client after a few events. Output lengths are exact (`ignore_eos`), greedy sampling. The same
`SoakConfig` gives the same plan (numpy's seeded Generator).

Text prompts are random lowercase letters: the presets' byte-level BPE merges few of them, so a
text of N characters is at most N tokens (a little more with the chat template), and the prompt
length we record for text is that character count.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from kvpipe.harness.request import Api, Request

# Token ids of prompts given as ids: byte tokens, clear of the preset's special tokens above 255
# and of the low ids a real vocabulary keeps for control tokens.
TOKEN_ID_LOW, TOKEN_ID_HIGH = 3, 255
_LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz    "))  # spaces make words


@dataclass(frozen=True)
class Bounds:
    """Leak bounds: what may stay after the soak compared with the warmed-up baseline."""

    rss_growth_mb: float = 200.0  # per server (process group), after - baseline
    fd_delta: int = 8  # open fds per server, growth (sockets of peers that come and go)
    thread_delta: int = 4  # threads per server, growth


@dataclass(frozen=True)
class SoakConfig:
    num_requests: int = 1000
    concurrency: int = 16
    prompt_min: int = 1
    prompt_max: int = 4096
    output_max: int = 16  # outputs drawn in 1..output_max tokens
    disconnect_output: int = 64  # output of a request we disconnect: long enough to be mid-stream
    disconnect_after_max: int = 3  # we close after 1..this many events
    failure_prob: float = 0.05  # the prefill's --disaggregation-failure-prob (per transfer batch)
    disconnect_prob: float = 0.10  # share of requests disconnected by us mid-stream
    stream_prob: float = 0.5  # share of the other requests that stream
    text_prob: float = 0.5  # share of /generate prompts sent as text
    seed: int = 0
    deadline_s: float = 120.0  # per request: neither finished nor failed by then is a hang
    idle_timeout_s: float = 120.0  # after the run: wait this long for both servers to be idle
    sample_interval_s: float = 2.0  # resource samples during the run
    warmup_requests: int = 32  # unmeasured requests first (plan_warmup), so the baseline is after allocator warm-up
    bounds: Bounds = Bounds()

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.concurrency < 1:
            raise ValueError("num_requests and concurrency must be >= 1")
        if not 1 <= self.prompt_min <= self.prompt_max:
            raise ValueError(f"need 1 <= prompt_min <= prompt_max, got {self.prompt_min}..{self.prompt_max}")
        if self.output_max < 1 or self.disconnect_after_max < 1:
            raise ValueError("output_max and disconnect_after_max must be >= 1")
        if self.disconnect_output <= self.disconnect_after_max + 1:
            raise ValueError("disconnect_output must leave tokens after the disconnect")
        for name in ("failure_prob", "disconnect_prob", "stream_prob", "text_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if min(self.deadline_s, self.idle_timeout_s, self.sample_interval_s) <= 0 or self.warmup_requests < 0:
            raise ValueError("deadline, idle timeout and sample interval must be > 0, warmup >= 0")


def _text(rng: np.random.Generator, n: int) -> str:
    s = "".join(rng.choice(_LETTERS, size=n))
    return s if s.strip() else "a" + s[1:]  # never an all-blank prompt


def plan_requests(cfg: SoakConfig, n: int | None = None, seed_offset: int = 0) -> list[Request]:
    """`n` (default cfg.num_requests) requests drawn from cfg.seed + seed_offset."""
    n = cfg.num_requests if n is None else n
    rng = np.random.default_rng(cfg.seed + seed_offset)
    kinds = list(Api)
    out = []
    for i in range(n):
        kind = kinds[int(rng.integers(len(kinds)))]
        length = int(rng.integers(cfg.prompt_min, cfg.prompt_max + 1))
        disconnect = bool(rng.random() < cfg.disconnect_prob)
        stream = disconnect or bool(rng.random() < cfg.stream_prob)
        # sglang-router (PD) takes only string prompts on /v1/completions (422 for token ids)
        as_text = kind is not Api.GENERATE or bool(rng.random() < cfg.text_prob)
        prompt = (
            _text(rng, length)
            if as_text
            else tuple(int(x) for x in rng.integers(TOKEN_ID_LOW, TOKEN_ID_HIGH + 1, size=length))
        )
        out_len = cfg.disconnect_output if disconnect else int(rng.integers(1, cfg.output_max + 1))
        after = int(rng.integers(1, cfg.disconnect_after_max + 1)) if disconnect else None
        out.append(Request(i, prompt, out_len, api=kind, stream=stream, disconnect_after=after))
    return out


WARMUP_SEED_OFFSET = 1_000_003  # warm-up prompts differ from the measured ones


def plan_warmup(cfg: SoakConfig) -> list[Request]:
    """The unmeasured requests before the baseline: `concurrency` of the longest prompts at once
    first (the largest batches and KV use the run can reach, so the allocators' high-water marks
    come before the baseline, not during the run), then `warmup_requests` drawn like the run's.
    Empty when warmup_requests is 0."""
    if cfg.warmup_requests == 0:
        return []
    longest = plan_requests(replace(cfg, prompt_min=cfg.prompt_max), cfg.concurrency, WARMUP_SEED_OFFSET)
    drawn = plan_requests(cfg, cfg.warmup_requests, WARMUP_SEED_OFFSET + 1)
    return [replace(r, index=i) for i, r in enumerate(longest + drawn)]
