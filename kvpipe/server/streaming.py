"""HTTP plumbing shared by the native and OpenAI routes: JSON bodies, SSE, client disconnects,
and merging the output streams of a batched request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvpipe.server.async_engine import RequestStream
from kvpipe.server.errors import APIError, error_body
from kvpipe.server.request_tracker import RequestOutput

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def sse_error(exc: APIError) -> bytes:
    return sse(error_body(exc.message, exc.status, exc.err_type, exc.param))


# bodies past this many bytes are parsed in a worker thread: a 32 MiB body takes the loop ~0.3 s
PARSE_INLINE_BYTES = 256 << 10


def require_json_content_type(request: Request) -> None:
    """415 unless the body is declared `application/json`: a web page can POST `text/plain` (or
    a form) to us cross-site without a CORS preflight, but not `application/json`, so this keeps
    other sites' pages from driving the API through a visitor's browser."""
    declared = request.headers.get("content-type")
    media = (declared or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        got = f"Content-Type {declared!r}" if declared else "no Content-Type"
        raise APIError(f"the body must be JSON sent as Content-Type application/json, got {got}", 415)


def _parse(raw: bytes) -> Any:
    if not raw.strip():
        raise APIError("the request body is empty; expected a JSON object")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"malformed JSON body: {e}") from e
    except RecursionError:  # "[[[[..." a few thousand deep: json recurses per level
        raise APIError("malformed JSON body: nested too deeply") from None


async def read_json(request: Request) -> Any:
    require_json_content_type(request)  # before the body is read
    try:
        raw = await request.body()
    except ClientDisconnect:  # it left, or was cut for sending too slowly (kvpipe/http_listener.py)
        raise APIError("the client left before its body arrived") from None
    if len(raw) > PARSE_INLINE_BYTES:
        return await asyncio.to_thread(_parse, raw)
    return _parse(raw)


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is http.disconnect (uvicorn delivers it
    # when the peer closes the connection while the response is still pending).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (non-streaming requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientDisconnected()
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        with contextlib.suppress(BaseException):
            await task


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` however it ends (done, error, disconnect).

    Starlette cancels the body iterator on disconnect; while the iterator is suspended at a
    `yield` that cancellation never reaches it, so the streams are closed here explicitly.
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def close_all(streams: Iterable[RequestStream]) -> Callable[[], None]:
    streams = list(streams)

    def _close() -> None:
        for s in streams:
            s.close()

    return _close


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[RequestOutput]:
    """Interleave the outputs of several requests as they arrive (a batched request)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield out
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(s: RequestStream) -> None:
        try:
            async for out in s:
                queue.put_nowait(out)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait(e)
        finally:
            queue.put_nowait(end)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


async def collect(streams: list[RequestStream]) -> list[RequestOutput]:
    """Final outputs of all requests, in request order."""
    tasks = [asyncio.ensure_future(s.result()) for s in streams]
    try:
        return [await t for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
