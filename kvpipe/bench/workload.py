"""Synthetic serving workload: token-id prompts of exact lengths, output lengths, arrival times.

Everything here is plain Python/numpy and deterministic for a given `WorkloadConfig` (seeded
`numpy.random.Generator`), so a sweep runs the same requests against every mode.

Prompts are `input_ids` rather than text: a tokenizer round trip would change their lengths, and
the benchmark is about prompt length. Output lengths are exact too: requests set `ignore_eos`.

With `api=Api.CHAT` the same seeded ids are decoded into text by the served model's tokenizer
(`build_workload(cfg, text=...)`) and each request is one user message to `/v1/chat/completions`:
the server renders its chat template around it, so the prompt it computes is longer than the
requested length (and re-encoding may merge or split tokens); the driver records the server's own
prompt-token count. Shared prefixes stay shared (the decoded prefix is the text's head); several
turns are refused (a follow-up would need the answer's text as an assistant message).

Length specs (`parse_lengths`):
  "1024"              every request 1024
  "256,1024,2048"     cycled in request order (request i gets item i % 3)
  "uniform:256:2048"  drawn uniformly from [256, 2048] (inclusive)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from kvpipe.harness.request import Api, Request

TextOf = Callable[[Sequence[int]], str]  # token ids -> the text they decode to (the served tokenizer)


@dataclass(frozen=True)
class LengthSpec:
    """Either a fixed list cycled over requests, or a uniform integer range."""

    values: tuple[int, ...] = ()
    low: int = 0
    high: int = 0

    @property
    def is_range(self) -> bool:
        return not self.values

    def max(self) -> int:
        return self.high if self.is_range else max(self.values)

    def min(self) -> int:
        return self.low if self.is_range else min(self.values)

    def describe(self) -> str:
        """The spec in `parse_lengths` form."""
        return f"uniform:{self.low}:{self.high}" if self.is_range else ",".join(map(str, self.values))

    def sample(self, n: int, rng: np.random.Generator) -> list[int]:
        if self.is_range:
            return [int(x) for x in rng.integers(self.low, self.high + 1, size=n)]
        return [self.values[i % len(self.values)] for i in range(n)]


def parse_lengths(spec: str | int | list[int] | tuple[int, ...], what: str = "length") -> LengthSpec:
    """ "1024" | "256,1024" | "uniform:LO:HI" | an int | a list of ints -> LengthSpec (all ≥ 1)."""
    if isinstance(spec, int):
        spec = [spec]
    if isinstance(spec, str):
        s = spec.strip()
        if s.startswith("uniform:"):
            parts = s.split(":")
            try:
                low, high = int(parts[1]), int(parts[2])
            except (IndexError, ValueError):
                raise ValueError(f"{what}: expected uniform:LO:HI, got {spec!r}") from None
            if len(parts) != 3 or not 1 <= low <= high:
                raise ValueError(f"{what}: expected uniform:LO:HI with 1 <= LO <= HI, got {spec!r}")
            return LengthSpec(low=low, high=high)
        try:
            spec = [int(x) for x in s.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"{what}: expected N, N,N,... or uniform:LO:HI, got {s!r}") from None
    values = tuple(int(v) for v in spec)
    if not values or min(values) < 1:
        raise ValueError(f"{what}: lengths must be positive integers, got {list(values)}")
    return LengthSpec(values=values)


@dataclass(frozen=True)
class WorkloadConfig:
    prompt_lens: LengthSpec
    output_lens: LengthSpec
    num_requests: int
    vocab_size: int
    request_rate: float = math.inf  # requests/s of a Poisson process; inf = all at t=0
    seed: int = 0
    # Shared-prefix mode: request i belongs to group i % num_prefix_groups, and the first
    # `prefix_len` tokens of its prompt are that group's prefix (0 groups = off).
    num_prefix_groups: int = 0
    prefix_len: int = 0
    # Token ids are drawn from [token_id_low, vocab_size): keeps the lowest (often special) ids out.
    token_id_low: int = 0
    # Multi-turn mode (num_turns > 1): the requests form conversations of num_turns consecutive
    # turns; a follow-up turn resends the whole conversation (previous prompt + previous answer,
    # known only when it finished) plus `turn_len` new user tokens.
    num_turns: int = 1
    turn_len: int = 0
    # GENERATE: token-id prompts to /generate; CHAT: the ids decoded to text, one user message each
    api: Api = Api.GENERATE

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not 0 <= self.token_id_low < self.vocab_size:
            raise ValueError(f"need 0 <= token_id_low < vocab_size, got {self.token_id_low}, {self.vocab_size}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf = no pacing), got {self.request_rate}")
        if self.num_prefix_groups < 0 or self.prefix_len < 0:
            raise ValueError("num_prefix_groups and prefix_len must be >= 0")
        if self.num_turns < 1 or (self.num_turns > 1 and self.turn_len < 1):
            raise ValueError(
                f"num_turns must be >= 1 and turn_len >= 1 with several turns, got {self.num_turns}, {self.turn_len}"
            )
        if self.num_requests % self.num_turns:
            raise ValueError(f"num_requests ({self.num_requests}) must be a multiple of num_turns ({self.num_turns})")
        if self.api not in (Api.GENERATE, Api.CHAT):
            raise ValueError(f"api must be generate or chat, got {self.api.value}")
        if self.api is Api.CHAT and self.num_turns > 1:
            raise ValueError(
                "multi-turn mode (--num-turns > 1) resends token-id conversations to /generate; with "
                "--api chat every request is one user message: use --api generate for several turns"
            )
        if self.num_prefix_groups and self.prefix_len >= self.prompt_lens.min():
            raise ValueError(
                f"prefix_len ({self.prefix_len}) must be shorter than every prompt (shortest {self.prompt_lens.min()})"
            )


def arrival_times(n: int, rate: float, rng: np.random.Generator) -> list[float]:
    """Offsets (s) of n Poisson arrivals at `rate` req/s, the first at 0; all 0 when rate is inf."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return [float(x) for x in np.cumsum(gaps)]


@dataclass(frozen=True)
class Workload:
    """Streamed native /generate requests with token-id prompts (a follow-up turn's `prompt` is
    its new user tokens only: the driver sends the whole conversation), or chat requests whose
    prompts are the same ids as text."""

    config: WorkloadConfig
    requests: tuple[Request, ...] = field(default_factory=tuple)

    @property
    def total_prompt_tokens(self) -> int:
        """Requested prompt tokens (a chat's rendered prompt is known only from the server)."""
        return sum(r.prompt_len for r in self.requests) if self.config.api is Api.GENERATE else 0

    @property
    def total_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def prefix_group(self, index: int) -> int | None:
        """The shared-prefix group of request `index` (by conversation); None without groups."""
        groups = self.config.num_prefix_groups
        return (index // self.config.num_turns) % groups if groups else None


def build_workload(cfg: WorkloadConfig, text: TextOf | None = None) -> Workload:
    """The requests of `cfg`, identical for identical configs (one seeded generator, fixed draw
    order); with api CHAT `text` decodes each prompt's ids (required then)."""
    if cfg.api is Api.CHAT and text is None:
        raise ValueError("a chat workload needs the served model's tokenizer to turn its token ids into text")
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_requests
    prompt_lens = cfg.prompt_lens.sample(n, rng)
    output_lens = cfg.output_lens.sample(n, rng)
    arrivals = arrival_times(n, cfg.request_rate, rng)
    prefixes = [
        rng.integers(cfg.token_id_low, cfg.vocab_size, size=cfg.prefix_len) for _ in range(cfg.num_prefix_groups)
    ]
    reqs = []
    for i in range(n):
        conv, turn = divmod(i, cfg.num_turns)  # single turn: conv = i, turn = 0
        group = conv % cfg.num_prefix_groups if cfg.num_prefix_groups else None
        if turn:  # a follow-up: new user tokens, sent when the previous turn finished
            ids = tuple(int(t) for t in rng.integers(cfg.token_id_low, cfg.vocab_size, size=cfg.turn_len))
            reqs.append(Request(i, ids, output_lens[i], arrival_s=arrivals[i - turn], follows=i - 1))
            continue
        head = prefixes[group] if group is not None else np.empty(0, dtype=np.int64)
        tail = rng.integers(cfg.token_id_low, cfg.vocab_size, size=prompt_lens[i] - len(head))
        ids = tuple(int(t) for t in np.concatenate([head, tail]))
        if cfg.api is Api.CHAT and text is not None:
            reqs.append(Request(i, text(ids), output_lens[i], api=Api.CHAT, arrival_s=arrivals[i]))
        else:
            reqs.append(Request(i, ids, output_lens[i], arrival_s=arrivals[i]))
    return Workload(cfg, tuple(reqs))


def split_rounds(workload: Workload, size: int) -> list[Workload]:
    """Consecutive slices of `size` conversations each (single turn: `size` requests), arrivals
    reset to 0: the rounds of an interleaved sweep, which never split a conversation."""
    per = size * workload.config.num_turns
    reqs = workload.requests
    return [
        Workload(workload.config, tuple(replace(q, arrival_s=0.0) for q in reqs[i : i + per]))
        for i in range(0, len(reqs), per)
    ]
