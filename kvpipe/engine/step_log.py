"""The engine's speed in its log, as SGLang's scheduler writes it (plain Python, unit-tested):

    Prefill batch. #new-seq: 1, #new-token: 37, #cached-token: 0, token usage: 0.01, #running-req: 0,
        #queue-req: 0
    Decode batch. #running-req: 4, #token: 512, token usage: 0.05, accept len: 2.31,
        gen throughput (token/s): 41.20, #queue-req: 0

(one line each in the log).
A prefill line for every prefill batch, a decode line every `interval` decode steps (SGLang's
--decode-log-interval; 0 turns both off). `accept len` (speculative decoding only) is the tokens a
request's verify step emitted on average since the last line; `gen throughput` the tokens the
engine generated since the last line over the time its steps ran (an idle server's wait is not
counted, so the first line after a pause is not diluted). `generated` counts every token a forward
of this engine sampled (a PD prefill's first tokens included, a decode's received first tokens
not): the counter behind /metrics' kvpipe_engine_generated_tokens_total and `kvpipe top`'s tok/s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpipe.engine.batch import ForwardMode, ScheduledBatch


@dataclass(frozen=True)
class Occupancy:
    """What the scheduler holds when a line is written."""

    running: int
    waiting: int
    used_pages: int
    total_pages: int
    page_size: int

    @property
    def token_usage(self) -> float:
        return self.used_pages / self.total_pages if self.total_pages else 0.0

    @classmethod
    def of(cls, stats: dict[str, Any]) -> Occupancy:
        """From Engine.stats() (its waiting count includes the inbox and the connector's waits)."""
        return cls(
            stats["num_running"], stats["num_waiting"], stats["used_pages"], stats["total_pages"], stats["page_size"]
        )


@dataclass(frozen=True)
class SpecTotals:
    """A server's speculative counts so far (SpecCounts' verify_ct and emitted)."""

    verify_ct: int
    emitted: int


class StepLog:
    """Counts generated tokens and decode steps; says when a line is due and what it reads."""

    def __init__(self, interval: int) -> None:
        if interval < 0:
            raise ValueError(f"the decode log interval must be >= 0 steps, got {interval}")
        self.interval = interval
        self.generated = 0  # tokens this engine's forwards sampled, ever
        self._steps = 0  # decode steps since the last decode line
        self._busy_s = 0.0  # seconds those steps (and the prefill steps between them) ran
        self._generated_at_line = 0
        self._spec_at_line = SpecTotals(0, 0)

    def step_done(self, generated: int, seconds: float) -> None:
        """A forward step ran for `seconds` and sampled `generated` tokens."""
        self.generated += generated
        self._busy_s += seconds

    def after_step(
        self,
        batch: ScheduledBatch,
        generated: int,
        seconds: float,
        stats: Callable[[], dict[str, Any]],
        spec: SpecTotals | None,
    ) -> str | None:
        """A forward step of `batch` ran: count it; the line it brings due, if any (`stats`: the
        engine's, read only then)."""
        self.step_done(generated, seconds)
        if not self.interval:
            return None
        if batch.mode is not ForwardMode.DECODE:
            # the prefix cache's hit: the cached tokens of the rows in their first chunk (a MIXED
            # batch's decode rows are not new sequences, nor their tokens new prompt tokens)
            rows = [i for i in range(len(batch.reqs)) if batch.is_prompt_row(i)]
            cached = sum(batch.prefix_lens[i] for i in rows if batch.prefix_lens[i] == batch.reqs[i].cached_tokens)
            new_tokens = sum(batch.extend_lens[i] for i in rows)
            return self.prefill_line(len(rows), new_tokens, cached, Occupancy.of(stats()))
        return self.decode_line(Occupancy.of(stats()), spec) if self.decode_due() else None

    @staticmethod
    def prefill_line(new_seqs: int, new_tokens: int, cached_tokens: int, occ: Occupancy) -> str:
        return (
            f"Prefill batch. #new-seq: {new_seqs}, #new-token: {new_tokens}, #cached-token: {cached_tokens}, "
            f"token usage: {occ.token_usage:.2f}, #running-req: {occ.running}, #queue-req: {occ.waiting}"
        )

    def decode_due(self) -> bool:
        """Count a decode step; True when its line is due (then call decode_line)."""
        self._steps += 1
        return self._steps >= self.interval > 0

    def decode_line(self, occ: Occupancy, spec: SpecTotals | None = None) -> str:
        rate = (self.generated - self._generated_at_line) / self._busy_s if self._busy_s > 0 else 0.0
        parts = [
            f"#running-req: {occ.running}",
            f"#token: {occ.used_pages * occ.page_size}",
            f"token usage: {occ.token_usage:.2f}",
        ]
        if spec is not None:
            steps = spec.verify_ct - self._spec_at_line.verify_ct
            emitted = spec.emitted - self._spec_at_line.emitted
            parts.append(f"accept len: {emitted / steps if steps else 0.0:.2f}")
            self._spec_at_line = spec
        parts += [f"gen throughput (token/s): {rate:.2f}", f"#queue-req: {occ.waiting}"]
        self._steps, self._busy_s, self._generated_at_line = 0, 0.0, self.generated
        return "Decode batch. " + ", ".join(parts)
