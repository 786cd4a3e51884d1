"""Typed messages on a TP child's step pipe (kvpipe/engine/tp_group.py).

rank 0 -> child: StartMsg, then StepMsg (a forward) | DraftStepMsg (a draft model's forward) |
                 CommandMsg (for its connector worker) |
                 TierMsg (for its side of the KV tier, engine/store_tp.py) ..., StopMsg
child -> rank 0: HelloMsg, ReadyMsg, then ReplyMsg (to a CommandMsg or TierMsg that wants one) |
                 ReportMsg (its worker's news) ..., ErrorMsg before it exits on a failure
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpipe.config import ServerConfig
from kvpipe.engine.batch import ForwardSpec
from kvpipe.engine.connector import EngineRole


@dataclass(frozen=True)
class StartMsg:
    cfg: ServerConfig
    rank: int
    init_method: str
    worker_factory: str | None = None  # "module:function" of the KV connector's worker
    role: EngineRole = EngineRole()  # what the engine does, as its connector says
    sharded_draft: bool = False  # the rank loads its shard of a STANDALONE draft model


@dataclass(frozen=True)
class HelloMsg:  # the child imported everything and is about to join the rendezvous
    rank: int


@dataclass(frozen=True)
class StepMsg:
    spec: ForwardSpec


@dataclass(frozen=True)
class StopMsg:
    pass


@dataclass(frozen=True)
class CommandMsg:  # for the child's connector worker, between forwards
    cmd: object
    reply: bool


@dataclass(frozen=True)
class ReplyMsg:
    rank: int
    reply: object
    error: str | None = None  # the worker raised: its traceback


@dataclass(frozen=True)
class ReportMsg:  # the child's connector worker has news for rank 0
    rank: int
    news: object


@dataclass(frozen=True)
class ReadyMsg:
    rank: int


@dataclass(frozen=True)
class ErrorMsg:
    rank: int
    text: str


@dataclass(frozen=True)
class DraftStepMsg:
    """A STANDALONE draft model's forward (engine/spec/draft_model.py), sharded like the target's:
    every rank runs `spec` (None: no rows this step) on its draft shard; `after` (connector meta,
    first and end send layer): then the rank's connector worker ships those layers (a PD prefill's
    draft KV, the layers after the target's)."""

    spec: ForwardSpec | None
    after: tuple[object, int, int] | None = None


@dataclass(frozen=True)
class TierMsg:  # for the child's side of the KV tier (engine/store_tp.py), between forwards
    cmd: object
    reply: bool
