"""Raw HTTP/1.1 on a socket, for tests that speak to a listener byte by byte."""

from __future__ import annotations

import socket
import time


def read_response(s: socket.socket, limit_s: float = 60.0) -> bytes:
    """One whole response with a Content-Length: its head and body may come in separate reads (a
    test that took the first read for the whole answer then read the body as the next one's)."""
    data, deadline = b"", time.monotonic() + limit_s
    while time.monotonic() < deadline:
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            lines = head.split(b"\r\n")
            lengths = [int(h.split(b":", 1)[1]) for h in lines if h.lower().startswith(b"content-length:")]
            if len(body) >= (lengths[0] if lengths else 0):
                return data
        chunk = s.recv(65536)
        if not chunk:
            return data
        data += chunk
    return data
