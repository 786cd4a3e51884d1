"""`kvpipe bench serve` with speculative servers (--server-args "--speculative-algorithm ..."): each
server's verify steps, drafts proposed and accepted over a mode's run, read from its engine stats
(/server_info `internal_states[0]`, the same counters as Prometheus' kvpipe_spec_*) when its stack
stops, with the acceptance length: 1 + accepted / verify steps, the tokens a verify step emits
(stop tokens aside). A PD decode drafts, a PD prefill never does (its requests end at their first
token): both are reported, so a stack that did not draft shows as such. Counts include the mode's
warm-up requests."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from kvpipe.bench.serve.stacks import Endpoint
from kvpipe.harness.probe import engine_stats

SPEC_KEYS = ("spec_verify_steps", "spec_proposed_tokens", "spec_accepted_tokens")


def spec_counts(stats: Mapping[str, Any] | None) -> dict[str, float] | None:
    """A server's speculative counters and acceptance from its engine stats; None without them
    (no speculation, or unreachable)."""
    if stats is None or not all(isinstance(stats.get(k), int) for k in SPEC_KEYS):
        return None
    steps, proposed, accepted = (int(stats[k]) for k in SPEC_KEYS)
    return {
        "verify_steps": steps,
        "proposed": proposed,
        "accepted": accepted,
        "accept_rate": round(accepted / proposed, 4) if proposed else 0.0,
        "accept_length": round(1 + accepted / steps, 4) if steps else 0.0,
    }


def reporting_spec(
    open_stack: Callable[[str], contextlib.AbstractContextManager[Endpoint]], into: dict[str, Any]
) -> Callable[[str], contextlib.AbstractContextManager[Endpoint]]:
    """`open_stack` that also records, per mode, each server's speculative counts (spec_counts)
    before the stack stops; a mode whose servers report none is left out."""

    @contextlib.contextmanager
    def opened(mode: str) -> Iterator[Endpoint]:
        with open_stack(mode) as ep:
            yield ep
            counts = {name: spec_counts(ep.call(engine_stats, url)) for name, url in ep.servers}
            if any(c is not None for c in counts.values()):
                into[mode] = counts
                for name, c in counts.items():
                    if c is not None:
                        print(f"{mode} {name}: speculative {c}", file=sys.stderr)

    return opened
