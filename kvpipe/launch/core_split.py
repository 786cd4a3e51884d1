"""How `kvpipe launch` shares one machine's cores between its prefill and decode servers.

Both servers would otherwise start one torch thread per core each and oversubscribe the machine
(measured on 2 cores: e2e p50 2,759 ms against 365 ms with one thread each). Prefill gets the
larger half: it runs the long forwards (a prompt at a time), decode runs small batched steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpipe.engine.cpu_threads import format_cores

CPU_THREADS_FLAG = "--cpu-threads"


@dataclass(frozen=True)
class CoreSplit:
    prefill: tuple[int, ...]
    decode: tuple[int, ...]

    @property
    def disjoint(self) -> bool:
        """False on one core: both servers then run on it, one thread each."""
        return not set(self.prefill) & set(self.decode)

    def describe(self) -> str:
        return (
            f"cores: prefill {len(self.prefill)} ({format_cores(self.prefill)}), "
            f"decode {len(self.decode)} ({format_cores(self.decode)})" + ("" if self.disjoint else ", shared: one core")
        )

    def as_dict(self) -> dict[str, list[int]]:
        return {"prefill": list(self.prefill), "decode": list(self.decode)}


def split_cores(cores: Sequence[int]) -> CoreSplit:
    """Prefill gets the first ceil(n/2) cores, decode the rest; with one core both get it."""
    ordered = tuple(sorted(set(cores)))
    if not ordered:
        raise ValueError("no cores to split")
    if len(ordered) == 1:
        return CoreSplit(ordered, ordered)
    half = -(-len(ordered) // 2)
    return CoreSplit(ordered[:half], ordered[half:])


def has_flag(args: Sequence[str], flag: str) -> bool:
    """`flag` among command-line args, as `--flag V` or `--flag=V`."""
    return any(a == flag or a.startswith(flag + "=") for a in args)


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of `--flag V` or `--flag=V` among command-line args (the last one), else None."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.partition("=")[2]
    return value


@dataclass(frozen=True)
class ServerCores:
    """What one server of the stack gets from the split."""

    flags: tuple[str, ...]  # extra args: --cpu-threads of its share; () when the user chose them
    pin: tuple[int, ...] | None  # cores to pin it to (None: not pinned)


def server_cores(
    split: CoreSplit, both: Sequence[str], prefill: Sequence[str], decode: Sequence[str]
) -> tuple[ServerCores, ServerCores]:
    """(prefill, decode): each gets --cpu-threads of its share and is pinned to it, unless the
    user's args for that server (`both` + its own) choose its threads: then it gets neither.
    Pinned (measured, docs/benchmarks.md): e2e p50 at concurrency 4 fell from 351-487 ms to
    311-363 ms against threads limited alone; nothing is pinned on one core (both share it)."""

    def share(cores: tuple[int, ...], own: Sequence[str]) -> ServerCores:
        if has_flag([*both, *own], CPU_THREADS_FLAG):
            return ServerCores((), None)
        return ServerCores((CPU_THREADS_FLAG, str(len(cores))), cores if split.disjoint else None)

    return share(split.prefill, prefill), share(split.decode, decode)


@dataclass(frozen=True)
class StackCores:
    """The cores of every server of an xPyD stack (`kvpipe launch --prefills N --decodes M`), in
    the order prefills then decodes. With at least one core per server the shares are disjoint
    (each server pinned to its own); with fewer cores than servers they are shared round-robin and
    nobody is pinned (each server runs one thread)."""

    shares: tuple[tuple[int, ...], ...]

    @property
    def disjoint(self) -> bool:
        seen = [c for s in self.shares for c in s]
        return len(seen) == len(set(seen))


def split_cores_among(cores: Sequence[int], prefills: int, decodes: int) -> StackCores:
    """`prefills + decodes` shares of `cores`: every server gets n // servers cores, the cores left
    over go to the prefills first (they run the long forwards). One prefill and one decode get what
    `split_cores` gives them."""
    ordered = tuple(sorted(set(cores)))
    servers = prefills + decodes
    if not ordered:
        raise ValueError("no cores to split")
    if prefills < 1 or decodes < 1:
        raise ValueError(f"a stack needs at least one prefill and one decode, got {prefills}P{decodes}D")
    if len(ordered) < servers:
        return StackCores(tuple((ordered[i % len(ordered)],) for i in range(servers)))
    base, extra = divmod(len(ordered), servers)
    shares, at = [], 0
    for i in range(servers):
        n = base + (1 if i < extra else 0)
        shares.append(ordered[at : at + n])
        at += n
    return StackCores(tuple(shares))


def stack_server_cores(split: StackCores, both: Sequence[str], own: Sequence[Sequence[str]]) -> list[ServerCores]:
    """`server_cores` for every server of an xPyD stack: `own[i]` are server i's own args."""
    out = []
    for cores, args in zip(split.shares, own):
        if has_flag([*both, *args], CPU_THREADS_FLAG):
            out.append(ServerCores((), None))
        else:
            out.append(ServerCores((CPU_THREADS_FLAG, str(len(cores))), cores if split.disjoint else None))
    return out
