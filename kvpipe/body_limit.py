"""An ASGI middleware that refuses request bodies over a size limit with 413, before they are read.

Shared by the HTTP server and the prefill's bootstrap server (hence at the package root: the
transfer layer must not import the server). The limit is enforced in `receive`, not by reading
ahead: a declared Content-Length over the limit fails the first `receive` call, before any body
byte is handed to the app; a chunked body (no Content-Length) fails as soon as the bytes counted
so far pass the limit. Either way the app sees an HTTPException(413) where it reads the body, so
each app answers in its own error shape (OpenAI-style on the server, `{"detail"}` on the
bootstrap server) through its own exception handlers. uvicorn stops reading the socket while
its buffer is full, so at most the limit plus one chunk is ever held in memory.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int, declared: int | None, knob: str | None) -> None:
        size = f" of {declared} bytes" if declared is not None else ""  # chunked: only "more than the limit"
        hint = f" (raise it with {knob})" if knob else ""
        super().__init__(413, f"the request body{size} exceeds the limit of {limit} bytes{hint}")


def _content_length(scope: Scope) -> int | None:
    value = Headers(scope=scope).get("content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:  # the HTTP server rejects these itself; count the bytes instead
        return None


class BodyLimitMiddleware:
    """`app.add_middleware(BodyLimitMiddleware, max_bytes=..., knob="--flag")`."""

    def __init__(self, app: ASGIApp, max_bytes: int, knob: str | None = None) -> None:
        if max_bytes < 1:
            raise ValueError(f"the body limit must be at least 1 byte, got {max_bytes}")
        self.app, self.max_bytes, self.knob = app, max_bytes, knob

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, declared, received = self.max_bytes, _content_length(scope), 0

        async def limited_receive() -> Message:
            nonlocal received
            if declared is not None and declared > limit:
                raise BodyTooLarge(limit, declared, self.knob)
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # chunked, or more bytes than declared
                    raise BodyTooLarge(limit, None, self.knob)
            return message

        await self.app(scope, limited_receive, send)
