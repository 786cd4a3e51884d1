"""The bridge between the synchronous engine and the asyncio HTTP server.

One dedicated thread owns the engine: it loads it, then loops `step()` while there is work; when
there is none it sleeps on a `threading.Event`, for as long as `poll_interval()` allows (only
transfers in flight: a few ms) or until add_request / abort / stop set the event (cleared
*before* `poll_interval()` is asked, so a wake-up is never lost). Step outputs go
to per-request asyncio queues through `loop.call_soon_threadsafe` (a step with a request's first
token waits until the loop took it: first_token.py). `generate()` is an async
iterator of cumulative `RequestOutput`s; leaving it early for any reason (client disconnect,
cancellation, error) aborts the request in the engine, which frees its pages.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from kvpipe.engine.errors import EngineLost
from kvpipe.engine.request import FinishReason, Req, TokenOutput
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.text.tokenizer import IncrementalDetokenizer, Tokenizer
from kvpipe.server.errors import APIError
from kvpipe.server.first_token import FIRST_TOKEN_HANDOFF_S, FirstTokens
from kvpipe.server.metrics import ServerMetrics
from kvpipe.server.protocol import GenerateInput
from kvpipe.server.request_tracker import RequestOutput, RequestTracker

logger = logging.getLogger(__name__)

MAX_CONSECUTIVE_STEP_FAILURES = 3
RETRY_AFTER_S = 1  # what a full server's 503 asks clients to wait (the Retry-After header)


class EngineLike(Protocol):
    """What the bridge needs of an engine (kvpipe.engine.engine.Engine, colocated or PD)."""

    tokenizer: Tokenizer
    model_config: ModelConfig
    context_length: int
    eos_token_ids: tuple[int, ...]

    def add_request(self, req: Req) -> None: ...
    def abort(self, rid: str) -> None: ...
    def step(self) -> list[TokenOutput]: ...
    def poll_interval(self) -> float | None: ...
    def set_wakeup(self, fn: Callable[[], None] | None) -> None: ...
    def stats(self) -> dict: ...
    def shutdown(self) -> None: ...


_CLOSED = object()  # queued by RequestStream.close() so a pending iteration ends


class _EngineFailure:
    """Queued to a request when the engine thread failed under it."""

    def __init__(self, message: str) -> None:
        self.message = message


class _Ended:
    """Queued to a request the server ends itself (a drain's timeout): it finishes with ABORT and
    `detail` at once, whatever the engine still sends it."""

    def __init__(self, detail: str) -> None:
        self.detail = detail


class AsyncEngine:
    def __init__(
        self,
        engine_factory: Callable[[], EngineLike],
        on_fatal: Callable[[BaseException], None] | None = None,
        capacity: int | None = None,
        history: int = 0,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        """`history`: finished requests whose timelines `recent` keeps (GET /debug/requests);
        `on_ready`: called on the event loop once the engine has loaded."""
        self._factory = engine_factory
        self._on_fatal = on_fatal
        self._on_ready = on_ready
        # requests this server holds at once (running, waiting, in the engine's inbox); None: no cap
        self.capacity = capacity
        self._engine: EngineLike | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._queues: dict[str, asyncio.Queue] = {}
        self._owners: dict[str, str | None] = {}  # rid -> GenerateInput.owner, while it runs
        self._first_tokens = FirstTokens()  # engine thread only
        self.metrics: ServerMetrics | None = None
        self.fatal_error: BaseException | None = None
        self.recent: deque[dict[str, Any]] = deque(maxlen=history)  # event loop only
        self._refusing: str | None = None  # why new requests are refused (a drain), None: taken

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from inside the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvpipe-engine", daemon=True)
        self._thread.start()

    async def stop(self, timeout_s: float = 30.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout_s)

    @property
    def ready(self) -> bool:
        return self._engine is not None and self.fatal_error is None and not self._stopping

    @property
    def engine(self) -> EngineLike:
        if self.fatal_error is not None:
            raise APIError(f"the engine failed: {self.fatal_error}", 503)
        if self._engine is None:
            raise APIError("the engine is still loading", 503)
        return self._engine

    def stats(self) -> dict | None:
        return self._engine.stats() if self._engine is not None else None

    def num_active(self) -> int:
        return len(self._queues)

    def check_room(self, n: int) -> None:
        """Refuse `n` more requests when they would take the server past its capacity: 503 with
        Retry-After (busy now), or 400 for a batch no idle server could hold either."""
        if self._refusing is not None:
            raise APIError(self._refusing, 503, headers={"Retry-After": str(RETRY_AFTER_S)})
        cap = self.capacity
        if cap is None:
            return
        if n > cap:
            raise APIError(
                f"a batch of {n} prompts is more than this server holds at once ({cap}: "
                "--max-running-requests + --max-queued-requests)"
            )
        if len(self._queues) + n > cap:
            raise APIError(
                f"the server is full: it holds {len(self._queues)} requests, at most {cap} "
                "(--max-running-requests + --max-queued-requests); retry later",
                503,
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )

    # ---- engine thread ---------------------------------------------------------------------------
    def _post(self, fn: Callable, *args: object) -> None:
        try:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is going away
            pass

    def _fatal(self, exc: BaseException) -> None:
        self.fatal_error = exc
        self._post(self._fail_all, f"the engine failed: {exc}")
        if self._on_fatal is not None:
            self._on_fatal(exc)

    def _run(self) -> None:
        try:
            engine = self._factory()
        except BaseException as e:  # noqa: BLE001 - reported through health and on_fatal
            logger.exception("loading the engine failed")
            self._fatal(e)
            return
        self._engine = engine
        engine.set_wakeup(self._wake.set)  # transfer news ends a poll-interval sleep at once
        logger.debug("engine ready")
        if self._on_ready is not None:
            self._post(self._on_ready)
        failures = 0
        try:
            while not self._stopping:
                self._wake.clear()
                wait = engine.poll_interval()
                if wait is None:
                    self._wake.wait()
                    continue
                if wait > 0:  # only transfers in flight: poll them without spinning a core
                    self._wake.wait(wait)
                try:
                    outs = engine.step()
                    failures = 0
                except EngineLost as e:  # a dead TP rank: exit now, a supervisor restarts us
                    logger.error("engine lost: %s", e)
                    self._fatal(e)
                    return
                except Exception as e:  # noqa: BLE001 - fail the requests, keep serving if we can
                    failures += 1
                    logger.exception("engine step failed (%d in a row)", failures)
                    if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                        self._fatal(e)
                        return
                    self._first_tokens.reset()
                    self._post(self._fail_all, f"engine step failed: {type(e).__name__}: {e}")
                    continue
                if outs:
                    self._hand_over(outs)
        finally:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001
                logger.exception("engine shutdown failed")

    def _hand_over(self, outs: list[TokenOutput]) -> None:
        """Post a step's outputs to the event loop; a step with a request's first token waits
        (briefly) until the loop has taken it, so the next forward does not hold the core the loop
        thread needs to send it (first_token.py)."""
        if not self._first_tokens.any_first(outs):
            self._post(self._dispatch, outs)
            return
        taken = threading.Event()
        self._post(self._dispatch, outs, taken)
        taken.wait(FIRST_TOKEN_HANDOFF_S)

    # ---- event loop side -------------------------------------------------------------------------
    def _dispatch(self, outs: list[TokenOutput], taken: threading.Event | None = None) -> None:
        for out in outs:
            q = self._queues.get(out.rid)
            if q is not None:  # else: the request already ended here (stop string, disconnect)
                q.put_nowait(out)
        if taken is not None:
            # set after the callbacks these puts scheduled: the streams that write the tokens out
            assert self._loop is not None
            self._loop.call_soon(taken.set)

    def _fail_all(self, message: str) -> None:
        for rid, q in list(self._queues.items()):
            q.put_nowait(_EngineFailure(message))
            self._abort_in_engine(rid)

    def _abort_in_engine(self, rid: str) -> None:
        if self._engine is not None and self.fatal_error is None:
            try:
                self._engine.abort(rid)
            except Exception:  # noqa: BLE001 - the request may already be gone
                logger.exception("abort of %s failed", rid)
            self._wake.set()

    def abort(self, rid: str, owner: str | None = None) -> bool:
        """Abort a running request (the `/abort_request` route); its stream ends with finish abort.
        With `owner`, only a request of that owner (the same user key): another's is not found."""
        if rid not in self._queues or (owner is not None and self._owners.get(rid) != owner):
            return False
        self._abort_in_engine(rid)
        return True

    def abort_all(self) -> int:
        rids = list(self._queues)
        for rid in rids:
            self._abort_in_engine(rid)
        return len(rids)

    def refuse_new(self, reason: str) -> None:
        """From now on every new request is refused: 503 with Retry-After and `reason` (a drain)."""
        self._refusing = reason

    def abort_all_for(self, detail: str) -> int:
        """End every request here now, finish reason ABORT with `detail` (its stream's last output),
        and abort it in the engine, which frees its pages and tells its PD peer (event loop only)."""
        rids = list(self._queues)
        for rid in rids:
            self._queues[rid].put_nowait(_Ended(detail))
            self._abort_in_engine(rid)
        return len(rids)

    def make_req(self, inp: GenerateInput) -> Req:
        boot = inp.bootstrap
        return Req(
            rid=inp.rid,
            input_ids=list(inp.input_ids),
            params=inp.params,
            eos_token_ids=self.engine.eos_token_ids,
            return_logprob=inp.return_logprob,
            bootstrap_host=boot.host if boot else None,
            bootstrap_port=boot.port if boot else None,
            bootstrap_room=boot.room if boot else None,
            cache_salt=inp.cache_salt,
        )

    def submit(self, inp: GenerateInput) -> RequestStream:
        """Add one prompt to the engine now (errors are raised here, before any response is sent)."""
        engine = self.engine
        if inp.rid in self._queues:
            raise APIError(f"a request with rid {inp.rid!r} is already running", 400, param="rid")
        self.check_room(1)
        req = self.make_req(inp)
        detok = IncrementalDetokenizer(engine.tokenizer, inp.text_options.skip_special_tokens)
        stream = RequestStream(self, RequestTracker(inp, detok, time.monotonic()))
        self._queues[inp.rid] = stream.queue
        self._owners[inp.rid] = inp.owner
        try:
            engine.add_request(req)
        except ValueError as e:  # e.g. the engine still holds this rid
            self._drop(inp.rid)
            raise APIError(str(e), 400) from e
        except RuntimeError as e:  # the engine is shutting down
            self._drop(inp.rid)
            raise APIError(str(e), 503) from e
        self._wake.set()
        return stream

    def _drop(self, rid: str) -> None:
        """The request ended here: no more outputs go to it."""
        self._queues.pop(rid, None)
        self._owners.pop(rid, None)

    def _on_first_token(self, tracker: RequestTracker) -> None:
        if self.metrics is not None and tracker.first_token_time is not None:
            self.metrics.on_first_token(tracker.first_token_time - tracker.start_time)

    def _on_tokens(self, gap_s: float, n: int) -> None:
        if self.metrics is not None:
            self.metrics.on_tokens(gap_s, n)

    def _on_finished(self, tracker: RequestTracker) -> None:
        record = tracker.timeline
        if record is not None and self.recent.maxlen:
            self.recent.append(
                {
                    "rid": tracker.inp.rid,
                    "bootstrap_room": tracker.inp.bootstrap.room if tracker.inp.bootstrap else None,
                    "finish_reason": tracker.finish_reason.value if tracker.finish_reason else None,
                    "timeline": record.to_json(),
                }
            )
        if self.metrics is None:
            return
        if record is not None:
            self.metrics.on_timeline(record)
        ttft = None if tracker.first_token_time is None else tracker.first_token_time - tracker.start_time
        reason = tracker.finish_reason or FinishReason.ABORT
        self.metrics.on_finish(
            reason.value,
            tracker.prompt_tokens,
            tracker.cached_tokens,
            len(tracker.output_ids),
            time.monotonic() - tracker.start_time,
            ttft,
        )


class RequestStream:
    """One submitted request: iterate for cumulative outputs; `close()` (idempotent) ends it.

    Closing before the finish, e.g. because the client went away, aborts the request in the engine.
    """

    def __init__(self, owner: AsyncEngine, tracker: RequestTracker) -> None:
        self._owner = owner
        self.tracker = tracker
        self.queue: asyncio.Queue = asyncio.Queue()
        self._closed = False

    @property
    def rid(self) -> str:
        return self.tracker.inp.rid

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        tracker = self.tracker
        try:
            while not tracker.finished:
                items = [await self.queue.get()]
                while not self.queue.empty():
                    items.append(self.queue.get_nowait())
                if any(x is _CLOSED for x in items):
                    return
                failure = next((x for x in items if isinstance(x, _EngineFailure)), None)
                if failure is not None:
                    raise APIError(failure.message, 500)
                ended = next((x for x in items if isinstance(x, _Ended)), None)
                if ended is not None:
                    items = [x for x in items if not isinstance(x, _Ended)]
                    sent = tracker.update(items, time.monotonic()) if items else None
                    if sent is not None:  # what the engine sent before: the client gets it first
                        yield sent
                    if not tracker.finished:
                        yield tracker.finish_abort(ended.detail, time.monotonic())
                    return
                had_first = tracker.first_token_time is not None
                n_before, last = len(tracker.output_ids), tracker.last_token_time
                now = time.monotonic()
                out = tracker.update(items, now)
                n_new = len(tracker.output_ids) - n_before
                if not had_first:
                    self._owner._on_first_token(tracker)
                    if n_new > 1:  # tokens that came with the first one: no gap
                        self._owner._on_tokens(0.0, n_new - 1)
                elif last is not None and n_new:
                    self._owner._on_tokens(now - last, n_new)
                if tracker.finished:
                    self.close()
                if out is not None:
                    yield out
        finally:
            self.close()

    async def result(self) -> RequestOutput:
        """Run to the end and return the final output."""
        last = None
        async for out in self:
            last = out
        if last is None or not last.finished:  # closed from outside before the finish
            return self.tracker.finish_abort("request closed", time.monotonic())
        return last

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.queue.put_nowait(_CLOSED)
        owner, tracker = self._owner, self.tracker
        owner._drop(self.rid)
        if not tracker.finished:  # client gone, cancelled or failed: free the engine's pages
            owner._abort_in_engine(self.rid)
            tracker.finish_abort("client disconnected or request failed", time.monotonic())
        elif tracker.needs_engine_abort:  # a stop string matched here before the engine stopped
            owner._abort_in_engine(self.rid)
        owner._on_finished(tracker)
