"""The KV connector seam: everything disaggregation needs from the engine, in one interface.

In the spirit of vLLM's KVConnectorBase_V1 (a scheduler side and a worker side) and SGLang's
disaggregation `base/conn.py`, written for this engine. A connector has two halves:

- `KVConnector` lives with the engine on TP rank 0 and runs on the engine thread. It decides:
  which requests compute here and which get their KV from elsewhere (`admit`), what each
  forward ships (`plan_forward` -> `ForwardPlan`), what happens after a step (`after_commit`),
  whether a finished request's pages stay owned by a transfer (`on_finish`), and it reports
  transfers that ended (`poll` -> `KVArrived` / `TransferFinished`).
- `KVConnectorWorker` lives on every TP rank (rank 0 included), next to that rank's KV shard.
  It moves the rank's own KV: `before_forward` / `after_layers` run inside the rank's forward
  with the plan's `meta` (SPMD: each rank issues its own sends from its own layer-group hook),
  `handle` runs commands between forwards, `poll` returns news for rank 0.

The engine owns the scheduler, the finish checks and the pages; a connector sees requests and
batches and never touches those. Rank 0 reaches every worker through a `WorkerGroup`
(engine/connector_workers.py); children build theirs from `worker_factory`, a "module:function" path
imported lazily so the engine never imports a connector package.

Page ownership rule: a request whose transfer may still write into (decode) or read from
(prefill) its pages keeps them after it finished until the connector reports its transfer over.
A normal finish of such a request reaches the client only when its transfer succeeded; an abort
is reported at once.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvpipe.engine.batch import ScheduledBatch
from kvpipe.engine.request import FinishReason, Req

if TYPE_CHECKING:
    from kvpipe.cache.kv_pool import KVPool
    from kvpipe.cache.recurrent_pool import StatePool
    from kvpipe.config import ServerConfig
    from kvpipe.model.checkpoint.schema import ModelConfig


class Admission(enum.Enum):
    LOCAL = "local"  # the prompt is computed here (colocated, PD prefill)
    REMOTE = "remote"  # pages are reserved here and another server writes the prompt's KV (PD decode)


@dataclass(frozen=True)
class EngineRole:
    """What an engine does with prompts, drafts and its prefix cache, as its connector says
    (`EngineRole.of`); the defaults are a colocated engine's (no connector). The engine reads
    these, never the server's disaggregation mode; picklable, so TP children size their runner
    from it too (engine/tp_group.py)."""

    # prompts are computed here, chunk by chunk with their recurrent states, so a hybrid model's
    # prefix cache keeps state snapshots (colocated, PD prefill); False: no snapshot slots at all
    state_snapshots: bool = True
    # the prefix cache holds KV only, never a state: no prompt is computed here (a PD decode: the
    # prefill sends the KV past the cached prefix and the prompt's final state whole)
    kv_only_prefix_cache: bool = False
    # decode steps verify speculative drafts here (False: a PD prefill, whose decode verifies)
    verifies_drafts: bool = True
    # the draft model or MTP layer runs over each prompt chunk and its KV goes out with the
    # target's (a PD prefill: disagg/draft_transfer.py, disagg/mtp_transfer.py)
    drafts_on_prefill: bool = False
    prefix_cache: bool = True  # KVConnector.prefix_cache
    whole_prompt_pages: bool = False  # KVConnector.whole_prompt_pages

    @classmethod
    def of(cls, connector: KVConnector | None) -> EngineRole:
        if connector is None:
            return cls()
        return cls(
            state_snapshots=connector.state_snapshots,
            kv_only_prefix_cache=connector.kv_only_prefix_cache,
            verifies_drafts=connector.verifies_drafts,
            drafts_on_prefill=connector.drafts_on_prefill,
            prefix_cache=connector.prefix_cache,
            whole_prompt_pages=connector.whole_prompt_pages,
        )


@dataclass(frozen=True)
class ForwardPlan:
    layer_groups: int = 1  # the prefill forward runs as this many layer groups (1: one pass)
    meta: Any = None  # picklable; handed to every rank's worker with the forward
    # the groups' [start, end) layer ranges when not split_layers(num_layers, layer_groups)
    layer_bounds: tuple[tuple[int, int], ...] | None = None


@dataclass(frozen=True)
class KVArrived:
    """Decode: the prompt's KV and its first token are in the request's pages; it may decode."""

    rid: str
    first_token_id: int
    first_token_logprob: float
    prefill_cached_tokens: int = 0  # prompt tokens the KV's writer took from its prefix cache
    draft_tokens: int = 0  # prompt tokens whose draft-model KV landed in the request's draft pages
    draft_hidden: bytes = b""  # NEXTN: AuxData.hidden, the target's hidden states (disagg/mtp_transfer.py)


@dataclass(frozen=True)
class TransferFinished:
    """The request's transfer is over; no write can land in (or read from) its pages any more."""

    rid: str
    ok: bool
    reason: str = ""


ConnectorEvent = KVArrived | TransferFinished


class WorkerGroup(Protocol):
    """Rank 0's handle on the connector workers of every TP rank (engine/connector_workers.py)."""

    tp_size: int

    def call(self, cmd: object, timeout_s: float) -> list[object]: ...  # replies in rank order
    def post(self, cmd: object) -> None: ...  # every rank handles it, in order, no reply
    def reports(self) -> list[tuple[int, object]]: ...  # (rank, news) since the last call
    def gone(self) -> dict[int, str]: ...  # ranks that exited, and why


@dataclass(frozen=True)
class ConnectorContext:
    """What the engine hands its connector at start."""

    cfg: ServerConfig
    model_config: ModelConfig
    workers: WorkerGroup
    # any thread: news for poll() arrived, run the engine's next step now instead of after its
    # poll interval (a first token from the prefill should not wait for a timer)
    wake: Callable[[], None] = lambda: None
    # the STANDALONE draft model's KV pool (rank 0's shard), whose pages move with the target's
    # (req.draft_pages), or NEXTN's MTP KV pool (disagg/mtp_transfer.py: rank 0's only); None: no draft model
    draft_pool: KVPool | None = None
    draft_kv_heads: int | None = None  # the draft model's KV heads before TP (None: draft_pool's own)


class KVConnectorWorker(ABC):
    """One TP rank's half of a connector (runs in that rank's process)."""

    # how often a TP child polls this worker while no command arrives (None: never)
    poll_interval_s: float | None = None

    @abstractmethod
    def handle(self, cmd: object) -> object | None:
        """A command from rank 0's connector, between forwards; the reply of a `call`."""

    def before_forward(self, meta: Any) -> None:
        """Right before this rank's forward of a batch whose plan carried `meta`."""

    def after_layers(self, meta: Any, start: int, end: int) -> None:
        """Layers [start, end) of this rank's forward have written their KV."""

    def poll(self) -> object | None:
        """News for rank 0's connector (None: nothing new)."""
        return None

    def set_draft_pool(self, pool: KVPool | None, total_kv_heads: int | None = None) -> None:
        """This rank's shard of a STANDALONE draft model's KV pool (`total_kv_heads`: the draft
        model's, before TP), set before the start; a connector that moves no draft KV ignores it."""

    def close(self) -> None:
        """Stop threads and release transfer resources (idempotent)."""


# (cfg, rank, the rank's KV pool, the model's KV heads, the rank's state pool: hybrid models, else
# None) -> the rank's worker
WorkerFactory = Callable[["ServerConfig", int, "KVPool", int, "StatePool | None"], KVConnectorWorker]


class KVConnector(ABC):
    """Rank 0's half of a connector (engine thread, except `claim`)."""

    # "module:function" building a KVConnectorWorker in each TP child (WorkerFactory)
    worker_factory: str
    # allocate a prompt's pages when it is first scheduled, not chunk by chunk (a prefill hands
    # the whole page table to its transfer at once)
    whole_prompt_pages: bool = False
    # the engine may keep a prefix (radix) cache: LOCAL requests start at their cached prefix,
    # REMOTE ones get req.pages[:req.num_shared_pages] from the cache and need KV for the rest only
    # (a finished request's pages go to the cache once no transfer owns them)
    prefix_cache: bool = False
    # what the engine does besides (EngineRole; a connector that says nothing gets no hybrid
    # state snapshots, verifies drafts, runs no draft over prompts)
    state_snapshots: bool = False
    kv_only_prefix_cache: bool = False
    verifies_drafts: bool = True
    drafts_on_prefill: bool = False

    @abstractmethod
    def make_worker(self, pool: KVPool, total_kv_heads: int, state_pool: StatePool | None = None) -> KVConnectorWorker:
        """Rank 0's worker (the engine calls this once, before `start`); `state_pool`: the
        recurrent state of a hybrid model's requests, which moves with their KV."""

    @abstractmethod
    def start(self, ctx: ConnectorContext) -> None:
        """Set up the transfer machinery (every rank's worker is reachable through ctx.workers)."""

    @abstractmethod
    def claim(self, req: Req) -> None:
        """A new request (any thread, under the engine's lock): raise ValueError to refuse it."""

    @abstractmethod
    def admit(self, req: Req) -> Admission:
        """The engine thread takes the request in."""

    def reserve_deadline_s(self) -> float:
        """REMOTE requests wait at most this long for free pages."""
        return float("inf")

    def on_reserved(self, req: Req) -> None:
        """A REMOTE request got the pages of its prompt (req.pages; with a prefix cache the first
        req.num_shared_pages hold a cached prefix already): ask for its KV. ValueError: it cannot
        be served (the engine aborts it with the message)."""

    def plan_forward(self, batch: ScheduledBatch) -> ForwardPlan:
        """Right before a prefill forward of `batch`."""
        return ForwardPlan()

    def after_forward(self, batch: ScheduledBatch) -> None:
        """The prefill forward of `batch` ended (before sampling)."""

    def after_commit(self, batch: ScheduledBatch) -> None:
        """The step's tokens are appended: rows with req.output_ids[0] just completed prefill."""

    @abstractmethod
    def on_finish(self, req: Req, reason: FinishReason, detail: str | int | None) -> bool:
        """The engine is finishing `req` with `reason` (and `detail`, e.g. an abort message).
        True: a transfer still owns its pages; the engine keeps them until a TransferFinished."""

    def abort_transfer(self, req: Req, reason: str) -> None:
        """The client gave up (`reason`) on a finished request whose transfer still owns its pages."""

    @abstractmethod
    def poll(self) -> list[ConnectorEvent]:
        """Transfers that ended since the last call (each request once)."""

    def wait_hint(self) -> float | None:
        """With nothing runnable: how long the engine loop may sleep before polling again
        (None: nothing in flight, sleep until a request arrives)."""
        return None

    def stats(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        """Stop (idempotent)."""
