"""Per layer group, when its KV was ready and when it was on the wire: one prefill request's
layer-pipelined timeline (issue 34), from the prefill's own timestamps in `/debug/requests`.

The prefill's timeline (kvpipe/engine/timeline.py) marks each chunk's forward start and end, each
layer group handed to the sender (`layer_group_done`, value: its end layer; handed over once the
group's last layer has stored its K/V, while that layer's attention and MLP still compute), and each stretch of
the room's writes in flight (`transfer_start` -> `transfer_done`, the sender's own clock). Read
together they show the overlap that `exposed_transfer_ms` only summarises: a stretch per group
where the link keeps up; one long stretch where it does not; and what of the transfer was left
after the last forward (`tail_ms`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvpipe.harness.probe import layer_group_estimates_from_server_info


@dataclass(frozen=True)
class GroupTimeline:
    """Milliseconds since the request's first prefill forward started."""

    groups: tuple[tuple[int, float], ...]  # (end layer, KV ready at) of every layer group, in order
    forward_end_ms: float  # the last chunk's forward ended
    stretches: tuple[tuple[float, float], ...]  # (start, end) of each stretch of writes in flight
    tail_ms: float | None  # last write done - last forward end: the transfer left after compute
    # the planner's estimates at its last choice (`layer_groups` in the prefill's /server_info):
    # compute_ms, transfer_ms, predicted_ms; empty when the server did not report them
    planner: Mapping[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _events(timeline: Mapping[str, Any], phase: str) -> list[tuple[float, Any]]:
    return [(float(e["t"]), e.get("value")) for e in timeline.get("events", ()) if e.get("phase") == phase]


def group_timeline(timeline: Mapping[str, Any]) -> GroupTimeline | None:
    """A prefill entry's timeline (meta_info.timeline form) as per-group times; None when it ran
    no forward or no layer groups (the plain path)."""
    starts = _events(timeline, "forward_start")
    groups = _events(timeline, "layer_group_done")
    ends = _events(timeline, "forward_end")
    if not starts or not groups or not ends:
        return None
    t0 = starts[0][0]

    def ms(t: float) -> float:
        return round((t - t0) * 1e3, 3)

    stretches = tuple(
        (ms(a), ms(b))
        for (a, _), (b, _) in zip(_events(timeline, "transfer_start"), _events(timeline, "transfer_done"))
    )
    last_end = ends[-1][0]
    return GroupTimeline(
        groups=tuple((int(v) if v is not None else -1, ms(t)) for t, v in groups),
        forward_end_ms=ms(last_end),
        stretches=stretches,
        tail_ms=round(stretches[-1][1] - ms(last_end), 3) if stretches else None,
    )


def newest_group_timeline(entries: Sequence[Mapping[str, Any]]) -> GroupTimeline | None:
    """The per-group timeline of the newest layer-pipelined request in a prefill's
    /debug/requests entries (oldest first)."""
    for e in reversed(entries):
        tl = e.get("timeline")
        g = group_timeline(tl) if isinstance(tl, Mapping) else None
        if g is not None:
            return g
    return None


def format_group_timeline(label: str, g: GroupTimeline) -> str:
    """A few lines for the terminal: when each group's KV was ready, then the write stretches."""
    groups = ", ".join(f"L{end}@{at:.0f}" for end, at in g.groups)
    wire = ", ".join(f"{a:.0f}-{b:.0f}" for a, b in g.stretches) or "none recorded"
    tail = "?" if g.tail_ms is None else f"{g.tail_ms:.0f}"
    est = ", ".join(f"{k.removesuffix('_ms')} {v:.0f}" for k, v in g.planner.items())
    return (
        f"{label}: {len(g.groups)} layer groups, KV ready (end layer @ ms since the forward began): {groups}\n"
        f"  forward ended at {g.forward_end_ms:.0f} ms; KV writes in flight (ms): {wire}; "
        f"left after the forward: {tail} ms" + (f"\n  planner's estimates (ms): {est}" if est else "")
    )


def with_planner(g: GroupTimeline, info: Mapping[str, Any] | None) -> GroupTimeline:
    """`g` with the planner's estimates from a prefill's /server_info (harness/probe.py parses it)."""
    return replace(g, planner={} if info is None else layer_group_estimates_from_server_info(info))
