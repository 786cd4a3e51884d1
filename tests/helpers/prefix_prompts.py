"""Prompts that share prefixes, for the prefix-cache tests (colocated, PD in-process and through
the router), and what a prefix cache must report for them."""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvpipe.engine.engine import Engine
from kvpipe.engine.request import SamplingParams
from tests.helpers.engine import one_at_a_time
from tests.helpers.tolerance import Generation


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    """32 prompts: 4 system prefixes (page-aligned and not) x 8 questions of 1-40 tokens."""
    rnd = random.Random(seed)
    out = []
    for plen in (16, 37, 64, 90):
        prefix = [rnd.randrange(3, 290) for _ in range(plen)]
        out += [prefix + [rnd.randrange(3, 290) for _ in range(rnd.randint(1, 40))] for _ in range(8)]
    return out


def system_prompts(system_lens: Sequence[int], per_system: int, seed: int = 0) -> list[list[int]]:
    """Groups of `per_system` prompts sharing a system prompt of each length, then two unrelated ones."""
    rnd = random.Random(seed)
    tok = lambda n: [rnd.randrange(3, 250) for _ in range(n)]  # noqa: E731
    out = []
    for n in system_lens:
        system = tok(n)
        out += [system + tok(rnd.randint(3, 30)) for _ in range(per_system)]
    return out + [tok(20), tok(33)]


def conversation(
    eng: Engine, turns: int, params: SamplingParams, seed: int = 1
) -> tuple[list[list[int]], list[Generation]]:
    """A conversation of `turns` turns, each prompt everything so far (the previous prompt and its
    answer) plus a new user message; run one turn at a time on `eng`."""
    rnd = random.Random(seed)
    prompt, ps, gens = [rnd.randrange(3, 250) for _ in range(40)], [], []
    for _ in range(turns):
        ps.append(prompt)
        gens.append(one_at_a_time(eng, [prompt], params)[0])
        answer = [int(t) for t in gens[-1].tokens]  # engine generations carry token ids
        prompt = prompt + answer + [rnd.randrange(3, 250) for _ in range(rnd.randint(5, 20))]
    return ps, gens


def assert_system_and_turn_hits(
    cached: Sequence[int],
    ps: Sequence[Sequence[int]],
    system_lens: Sequence[int],
    per_system: int,
    turns: int,
    page: int,
    chunk: int = 0,
) -> None:
    """cached_tokens of `system_prompts` + `conversation` run one at a time with a prefix cache:
    page-aligned hits shorter than each prompt; per system prompt the first caches its prompt,
    the second finds the shared pages but a hit point (a state snapshot, a window) there only if
    the first prompt's end fell in the same page (else it keeps one there: the branch point), the
    rest hit it; each turn of the conversation reuses the last. `chunk`: the first prompt was
    prefilled in chunks of that many tokens and left a hit point at each chunk boundary (floored
    to a page; a hybrid model's state snapshots), so the second hits the deepest one it shares."""
    assert all(c % page == 0 and c < len(p) for c, p in zip(cached, ps))
    for g, n in enumerate(system_lens):
        group, shared = list(cached[g * per_system : (g + 1) * per_system]), n // page * page
        first_len = len(ps[g * per_system])
        points = [(first_len - 1) // page * page]
        points += [k * chunk // page * page for k in range(1, first_len) if chunk and k * chunk < first_len]
        second = max((x for x in points if x <= shared), default=0)
        assert group[0] == 0 and group[1] == second, (n, group, second)
        assert group[2:] == [shared] * (per_system - 2), (n, group)
    last = list(cached[-turns:])
    assert last[0] == 0 and all(c >= 32 for c in last[1:]), last
