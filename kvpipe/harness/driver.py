"""The load driver: sends requests (httpx, asyncio) and records how each ended in an `Outcome`.

`send` runs one request under its own deadline (asyncio.wait_for; httpx's timeouts are set
longer, so a request that neither finishes nor fails ends as TIMEOUT, never as a client error),
streams or not as the request says, and stamps every stream event that brought new tokens.
Leaving `client.stream(...)` before the body ends closes the connection: that is how a request
with `disconnect_after` is cut.

`drive` runs a list of requests: each is released at its `arrival_s` offset and at most
`concurrency` are in flight (a semaphore), so a request's clock starts when it is actually sent.
A follow-up turn (`Request.follows`) is sent once the turn it follows finished, with the whole
conversation: that turn's prompt, its output ids, then the follow-up's new tokens (closed loop, as
a chat client resends the conversation); if that turn failed, the follow-up ends NOT_SENT.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from kvpipe.harness.answers import (
    DONE,
    cached_tokens,
    error_message,
    failure,
    finish,
    output_ids,
    output_tokens,
    parse_sse_line,
    prompt_tokens,
    streamed_text,
)
from kvpipe.harness.outcome import End, Outcome
from kvpipe.harness.request import Prompt, Request
from kvpipe.server.client_keys import client_headers

HTTP_SLACK_S = 30.0  # httpx's own timeouts stay this far behind the per-request deadline


@dataclass(frozen=True)
class RunResult:
    outcomes: list[Outcome]  # in request order
    duration_s: float  # first release -> last request ended


class _Recording:
    """What one request has shown so far, while it runs."""

    def __init__(
        self, req: Request, prompt_len: int, clock: Callable[[], float], on_event: Callable[[int], None] | None
    ):
        self.req, self.prompt_len, self.clock, self.on_event = req, prompt_len, clock, on_event
        self.start_s = clock()
        self.status: int | None = None  # the HTTP status, once the response came
        self.events = 0
        self.times: list[float] = []
        self.counts: list[int] = []
        self.tokens: int | None = None  # the last count the server reported
        self.finish: str | None = None  # the finish type, once one came
        self.ids: tuple[int, ...] = ()
        self.cached: int | None = None
        self.server_prompt: int | None = None  # the prompt tokens the server reported

    def see(self, obj: dict) -> None:
        """A stream event or a plain body: its tokens (stamped when new), ids, finish reason."""
        self.events += 1
        if self.on_event is not None:
            self.on_event(self.events)
        api = self.req.api
        n = output_tokens(api, obj)
        if n is None and streamed_text(api, obj):
            # OpenAI streams report the token count only in the final usage chunk: until then each
            # chunk that adds text counts one token (kvpipe and SGLang send a chunk per decode
            # step), so the first one stamps TTFT; the usage then sets the exact total
            n = (self.counts[-1] if self.counts else 0) + 1
        if n is not None:
            self.tokens = n
            if n > (self.counts[-1] if self.counts else 0):
                self.times.append(self.clock())
                self.counts.append(n)
        ids = output_ids(obj)
        if ids is not None:
            self.ids = tuple(ids)
        cached = cached_tokens(obj)
        if cached is not None:
            self.cached = cached
        prompt = prompt_tokens(api, obj)
        if prompt is not None:
            self.server_prompt = prompt
        fin, _ = finish(api, obj)
        if fin is not None:
            self.finish = fin

    def ended(self, end: End, reason: str = "", *, body: str = "", message: str = "") -> Outcome:
        return Outcome(
            self.req,
            end,
            self.start_s,
            self.clock(),
            self.prompt_len,
            http_status=self.status,
            body=body,
            message=message,
            reason=reason[:300],
            token_times=tuple(self.times),
            token_counts=tuple(self.counts),
            output_ids=self.ids,
            cached_tokens=self.cached,
            events=self.events,
            server_prompt_tokens=self.server_prompt,
        )

    def judged(self, obj: dict) -> Outcome | None:
        """ABORT when `obj` carries a failure, else None (the request goes on)."""
        f = failure(self.req.api, obj)
        return None if f is None else self.ended(End.ABORT, f.reason, message=f.message)

    def finished(self) -> Outcome:
        """The answer is complete ([DONE], or a plain body): OK if it finished with every token."""
        if self.finish is None:
            return self.ended(End.CUT, "no finish reason before the end of the answer")
        want = self.req.max_tokens
        if self.tokens is not None and self.tokens != want:
            return self.ended(End.CUT, f"expected {want} output tokens, got {self.tokens}")
        return self.ended(End.OK)

    def http_error(self, status: int, body: str) -> Outcome:
        msg = error_message(body)
        return self.ended(End.HTTP_ERROR, f"HTTP {status}: {msg or '(no message)'}", body=body[:300], message=msg)


async def _plain(client: httpx.AsyncClient, url: str, body: dict, rec: _Recording) -> Outcome:
    r = await client.post(url, json=body)
    rec.status = r.status_code
    if r.status_code != 200:
        return rec.http_error(r.status_code, r.text)
    try:
        obj = r.json()
    except ValueError:
        return rec.ended(End.CUT, f"malformed JSON body: {r.text[:100]}")
    if not isinstance(obj, dict):
        return rec.ended(End.CUT, f"not a JSON object: {r.text[:100]}")
    rec.see(obj)
    return rec.judged(obj) or rec.finished()


async def _streamed(client: httpx.AsyncClient, url: str, body: dict, rec: _Recording) -> Outcome:
    async with client.stream("POST", url, json=body) as resp:
        rec.status = resp.status_code
        if resp.status_code != 200:
            return rec.http_error(resp.status_code, (await resp.aread()).decode(errors="replace"))
        async for line in resp.aiter_lines():
            try:
                ev = parse_sse_line(line)
            except ValueError:
                return rec.ended(End.CUT, f"malformed event: {line[:100]}")
            if ev is None:
                continue
            if ev is DONE:
                return rec.finished()
            if not isinstance(ev, dict):
                return rec.ended(End.CUT, f"not a JSON object: {line[:100]}")
            rec.see(ev)
            if (aborted := rec.judged(ev)) is not None:
                return aborted
            cut_after = rec.req.disconnect_after
            if cut_after is not None and rec.events >= cut_after and rec.finish is None:
                return rec.ended(End.DISCONNECTED, f"closed by us after {rec.events} events")
        return rec.ended(End.CUT, "the stream ended without [DONE]")


async def send(
    client: httpx.AsyncClient,
    base_url: str,
    req: Request,
    deadline_s: float,
    *,
    model: str = "",
    prompt: Prompt | None = None,
    clock: Callable[[], float] = time.perf_counter,
    on_event: Callable[[int], None] | None = None,
) -> Outcome:
    """Send `req` to `base_url` (a server root) and wait, at most `deadline_s`, for its end.
    `prompt` replaces the request's own (a follow-up's conversation); `on_event(n)` is called
    with the count of stream events so far, as they come."""
    sent = req.prompt if prompt is None else prompt
    body = req.body(model, sent)
    rec = _Recording(req, len(sent), clock, on_event)
    exchange = _streamed if req.stream else _plain
    try:
        return await asyncio.wait_for(exchange(client, base_url.rstrip("/") + req.api.path, body, rec), deadline_s)
    except asyncio.TimeoutError:
        return rec.ended(End.TIMEOUT, f"no final status after {deadline_s:g} s")
    except httpx.TimeoutException as e:
        return rec.ended(End.TIMEOUT, f"{type(e).__name__} after {deadline_s:g} s")
    except (httpx.HTTPError, httpx.StreamError) as e:  # refused, dropped, a protocol error
        return rec.ended(End.CONNECTION, f"{type(e).__name__}: {e}")


def _conversation(prompt: Prompt, answer: Outcome, new: Prompt) -> tuple[int, ...]:
    """What a follow-up turn sends: the previous turn's prompt, its output ids, the new tokens."""
    if isinstance(prompt, str) or isinstance(new, str):
        raise ValueError("multi-turn conversations are token-id prompts")
    return (*prompt, *answer.output_ids, *new)


def new_client(
    concurrency: int, deadline_s: float, transport: httpx.AsyncBaseTransport | None = None, url: str | None = None
) -> httpx.AsyncClient:
    """A client for `concurrency` requests in flight whose own timeouts stay out of the deadline's
    way, with the user key of `url`'s stack (server/client_keys.py)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(
        timeout=httpx.Timeout(deadline_s + HTTP_SLACK_S),
        limits=limits,
        transport=transport,
        headers=client_headers(url=url),
    )


async def drive(
    base_url: str,
    requests: Sequence[Request],
    concurrency: int,
    deadline_s: float,
    *,
    model: str = "",
    progress: bool = False,
    desc: str = "requests",
    transport: httpx.AsyncBaseTransport | None = None,
    clock: Callable[[], float] = time.perf_counter,
    on_outcome: Callable[[Outcome], None] | None = None,
) -> RunResult:
    """Every request of `requests` against `base_url` (see the module doc); `on_outcome` gets each
    outcome as it comes."""
    if concurrency < 1 or deadline_s <= 0:
        raise ValueError(f"concurrency must be >= 1 and the deadline > 0, got {concurrency}, {deadline_s}")
    pos = {r.index: k for k, r in enumerate(requests)}
    for r in requests:
        prev = requests[pos[r.follows]] if r.follows in pos else None
        if r.follows is not None and (prev is None or isinstance(r.prompt, str) or isinstance(prev.prompt, str)):
            raise ValueError(f"request {r.index} follows request {r.follows}: not a token-id turn of this run")
    sem = asyncio.Semaphore(concurrency)
    outcomes: list[Outcome | None] = [None] * len(requests)
    prompts: list[Prompt] = [r.prompt for r in requests]  # what each request sent
    done = [asyncio.Event() for _ in requests]
    bar = tqdm(total=len(requests), desc=desc, disable=not progress, file=sys.stderr, leave=False)
    async with new_client(concurrency, deadline_s, transport, base_url) as client:
        t0 = clock()

        async def run_one(k: int, req: Request) -> Outcome:
            await asyncio.sleep(max(0.0, t0 + req.arrival_s - clock()))
            if req.follows is not None:
                j = pos[req.follows]
                await done[j].wait()
                prev = outcomes[j]
                if prev is None or not prev.ok:
                    now = clock()
                    why = f"not sent: the turn it follows (request {req.follows}) failed"
                    return Outcome(req, End.NOT_SENT, now, now, len(req.prompt), reason=why)
                prompts[k] = _conversation(prompts[j], prev, req.prompt)
            async with sem:
                return await send(client, base_url, req, deadline_s, model=model, prompt=prompts[k], clock=clock)

        async def one(k: int, req: Request) -> None:
            try:
                outcomes[k] = out = await run_one(k, req)
                if on_outcome is not None:
                    on_outcome(out)
            finally:
                done[k].set()
                bar.update(1)

        try:
            await asyncio.gather(*(one(k, r) for k, r in enumerate(requests)))
        finally:
            bar.close()
        duration = clock() - t0
    return RunResult([o for o in outcomes if o is not None], max(duration, 1e-9))


def run(
    base_url: str,
    requests: Sequence[Request],
    concurrency: int = 1,
    deadline_s: float = 300.0,
    progress: bool = True,
    desc: str = "requests",
    model: str = "",
) -> RunResult:
    """`drive` from synchronous code (its own event loop, so it also runs in a thread inside a
    network namespace: Endpoint.call)."""
    return asyncio.run(drive(base_url, requests, concurrency, deadline_s, model=model, progress=progress, desc=desc))
