"""The bookkeeping of speculative decoding, apart from any tensor: how many drafts a request may
get, which of them the target accepted, and the counts a request and the server report.

One verify step of a request runs the target over [last token, d_1 .. d_k] (positions
p .. p + k) and gets its token t_j after each input x_j. Greedy acceptance: d_{j+1} is accepted
while it equals t_j; with a drafts accepted the request emits t_0 .. t_a (the accepted drafts
and the target's bonus token), at most k + 1 tokens. The KV of x_0 .. x_a is valid afterwards;
what the forward wrote for x_{a+1} .. x_k is stale and the scheduler rolls it back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def draft_budget(max_drafts: int, max_new_tokens: int, num_output: int) -> int:
    """Drafts a request may verify this step: a step emits up to drafts + 1 tokens, never past
    max_new_tokens (which also keeps its KV inside the pages admission promised it)."""
    return max(0, min(max_drafts, max_new_tokens - num_output - 1))


def accepted_prefix(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """Drafts accepted: the longest prefix of `drafts` equal to the target's tokens (targets[j]
    is the target's token after input j; len(targets) == len(drafts) + 1)."""
    if len(targets) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} target tokens, got {len(targets)}")
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


@dataclass
class SpecCounts:
    """Speculative decoding counts, of one request or of a whole server (SGLang's meta_info
    names: spec_verify_ct verify steps, and the drafts proposed and accepted in them)."""

    verify_ct: int = 0  # verify forwards this request ran in (with or without drafts)
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens the target accepted
    emitted: int = 0  # tokens verify steps emitted (accepted drafts + bonus tokens, after stops)
    # a request's counts only: (drafts proposed, drafts accepted) of each verify step, in order, so
    # two servers' proposals for one request can be compared step by step (PD against colocated)
    steps: list[tuple[tuple[int, ...], int]] = field(default_factory=list)

    def record(self, drafts: Sequence[int], accepted: int, emitted: int) -> None:
        """A request's verify step: add() and remember its drafts and how many were accepted."""
        self.add(len(drafts), accepted, emitted)
        self.steps.append((tuple(int(t) for t in drafts), accepted))

    def add(self, proposed: int, accepted: int, emitted: int) -> None:
        self.verify_ct += 1
        self.proposed += proposed
        self.accepted += accepted
        self.emitted += emitted

    @property
    def accept_length(self) -> float:
        """Tokens per verify step (1.0: no draft ever accepted)."""
        return self.emitted / self.verify_ct if self.verify_ct else 0.0

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def meta_info(self) -> dict[str, int | float]:
        return {
            "spec_verify_ct": self.verify_ct,
            "spec_accept_length": round(self.accept_length, 4),
            "spec_accept_rate": round(self.accept_rate, 4),
            "spec_draft_token_num": self.proposed,
            "spec_accept_token_num": self.accepted,
        }
