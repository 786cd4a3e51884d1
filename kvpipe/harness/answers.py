"""What a server's answer says (pure): SSE lines, error bodies, and per API the output tokens so far,
the finish reason and a failure carried in a body or a stream event.

SGLang's native `/generate` reports `meta_info` (completion_tokens, finish_reason {type, message},
cached_tokens, prompt_tokens) and cumulative `output_ids`; the OpenAI APIs report
`choices[0].finish_reason` and, with include_usage, `usage.completion_tokens` and
`usage.prompt_tokens` (for a chat: the prompt as the server rendered it, chat template included).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvpipe.harness.request import Api

DONE = object()  # the `data: [DONE]` sentinel


def parse_sse_line(line: str) -> Any:
    """One SSE line -> the event's JSON object, DONE, or None (blank lines, comments, other fields).
    A malformed event raises ValueError."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return DONE
    return json.loads(payload) if payload else None


def error_message(body: str) -> str:
    """The message of an error body: OpenAI/SGLang {"error": {"message"}}, {"detail"}, or the text."""
    try:
        obj = json.loads(body)
    except ValueError:
        return body.strip()[:300]
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail"))
        if isinstance(err, dict):
            return str(err.get("message") or "").strip()
        if err is not None:
            return str(err).strip()
        if "message" in obj:
            return str(obj["message"]).strip()
    return body.strip()[:300]


def output_tokens(api: Api, obj: dict) -> int | None:
    """Output tokens so far (native: cumulative in every event; OpenAI: the usage, when reported)."""
    if api is Api.GENERATE:
        meta = obj.get("meta_info") or {}
        n = meta.get("completion_tokens")
        if isinstance(n, int):
            return n
        ids = obj.get("output_ids")
        return len(ids) if isinstance(ids, list) else None
    n = (obj.get("usage") or {}).get("completion_tokens")
    return n if isinstance(n, int) else None


def streamed_text(api: Api, obj: dict) -> str:
    """The text an OpenAI stream chunk adds (chat: choices[0].delta.content, completions:
    choices[0].text); "" for native events, role-only, usage-only and finish chunks."""
    if api is Api.GENERATE:
        return ""
    choices = obj.get("choices") or []
    first = choices[0] if choices and isinstance(choices[0], dict) else {}
    delta = first.get("delta")
    text = (delta.get("content") if isinstance(delta, dict) else None) if api is Api.CHAT else first.get("text")
    return text if isinstance(text, str) else ""


def finish(api: Api, obj: dict) -> tuple[str | None, str]:
    """(finish type, its message) of a body or event; type None while running."""
    if api is Api.GENERATE:
        fin = (obj.get("meta_info") or {}).get("finish_reason")
        if isinstance(fin, dict):
            return fin.get("type"), str(fin.get("message") or "")
        return fin, ""
    choices = obj.get("choices") or []
    # an OpenAI "abort" carries no reason (a server answers a failure with an error response or
    # event instead, as SGLang does): a failure without a message
    return (choices[0].get("finish_reason") if choices else None), ""


@dataclass(frozen=True)
class Failure:
    """A failure the server put in a body or an event: its own message ("" when it gave none) and
    the line people read."""

    message: str
    reason: str


def failure(api: Api, obj: dict) -> Failure | None:
    """An error object or an aborted finish in `obj`; None when it is not one."""
    if obj.get("error") is not None:
        msg = error_message(json.dumps(obj))
        return Failure(msg, msg or "error event without a message")
    fin, msg = finish(api, obj)
    if fin == "abort":
        return Failure(msg, f"aborted: {msg}" if msg else "finish_reason abort without a message")
    return None


def prompt_tokens(api: Api, obj: dict) -> int | None:
    """The prompt's token count as the server reports it (native: meta_info; OpenAI: the usage,
    when reported); None when not reported."""
    src = (obj.get("meta_info") if api is Api.GENERATE else obj.get("usage")) or {}
    n = src.get("prompt_tokens")
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def cached_tokens(obj: dict) -> int | None:
    """meta_info.cached_tokens of a native event (None when not reported)."""
    n = (obj.get("meta_info") or {}).get("cached_tokens")
    return n if isinstance(n, int) else None


def output_ids(obj: dict) -> list[int] | None:
    """The cumulative output ids of a native event (None when not reported)."""
    ids = obj.get("output_ids")
    return ids if isinstance(ids, list) else None
