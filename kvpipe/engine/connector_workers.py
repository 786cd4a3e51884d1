"""`RankWorkers`: rank 0's handle on the KV connector worker of every TP rank.

Rank 0's worker is called directly; the children's are reached over their TP step pipes
(TPGroup.command / replies / reports), in order with the forwards. A command reaches a child
between two forwards, never in the middle of one: what a rank must do inside its forward
travels in the ForwardSpec's connector meta instead (SPMD, kvpipe/engine/connector.py).
"""

from __future__ import annotations

from kvpipe.engine.connector import KVConnectorWorker
from kvpipe.engine.tp_group import TPGroup


class RankWorkers:
    def __init__(self, local: KVConnectorWorker, tp: TPGroup | None) -> None:
        self.local = local
        self.tp = tp
        self.tp_size = 1 if tp is None else tp.tp_size

    def call(self, cmd: object, timeout_s: float) -> list[object]:
        """Every rank handles `cmd`; their replies in rank order (children work meanwhile)."""
        if self.tp is not None:
            self.tp.command(cmd, reply=True)
        out = [self.local.handle(cmd)]
        if self.tp is not None:
            out += self.tp.replies(timeout_s)
        return out

    def post(self, cmd: object) -> None:
        """Every rank handles `cmd` (children after the forward they may be in)."""
        if self.tp is not None:
            self.tp.command(cmd, reply=False)
        self.local.handle(cmd)

    def reports(self) -> list[tuple[int, object]]:
        out: list[tuple[int, object]] = []
        news = self.local.poll()
        if news is not None:
            out.append((0, news))
        if self.tp is not None:
            out += self.tp.reports()
        return out

    def gone(self) -> dict[int, str]:
        return {} if self.tp is None else self.tp.gone()
