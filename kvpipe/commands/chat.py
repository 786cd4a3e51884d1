"""`kvpipe chat`: a terminal chat with a running kvpipe server or sglang-router.

Each turn posts the whole conversation to `/v1/chat/completions` and streams the answer (SSE), so
the server's prefix cache holds the history and only the new turn is computed. `/reset` starts
over, `/set max_tokens N` or `/set temperature T` changes the sampling of the next turns, Ctrl-D
(end of input) exits, Ctrl-C during an answer stops that answer and keeps the session (closing the
connection makes the server abort the request and free its pages). Answers go to stdout; the
banner, the settings, errors and `--usage` lines go to stderr.

Safe defaults: an answer ends within DEFAULT_MAX_TOKENS, sampled at a low DEFAULT_TEMPERATURE (a
server's own defaults, no limit at temperature 1.0, let a small model ramble or loop for minutes).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

import httpx

from kvpipe.harness.answers import error_message
from kvpipe.server.client_keys import client_headers

try:  # line editing and history for input() where the platform has it
    import readline  # noqa: F401
except ImportError:  # pragma: no cover - e.g. Windows
    pass

DEFAULT_URL = "http://127.0.0.1:8000"  # `kvpipe launch` / `make run`'s router
DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 0.3  # low: focused answers, yet not greedy decoding's loops on small models
HELP = (
    "/reset starts a new conversation, /set max_tokens N or /set temperature T changes the sampling, "
    "/exit or Ctrl-D leaves, Ctrl-C stops an answer"
)


class ChatError(Exception):
    """A turn that failed; the message is one line for the user."""


@dataclass(frozen=True)
class Usage:
    """The server's token counts for one turn (the stream's last chunk, `include_usage`)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @classmethod
    def from_json(cls, u: dict[str, Any]) -> Usage:
        details = u.get("prompt_tokens_details") or {}
        return cls(
            int(u.get("prompt_tokens", 0)), int(details.get("cached_tokens") or 0), int(u.get("completion_tokens", 0))
        )


@dataclass
class Conversation:
    """The messages sent with every turn: an optional system prompt, then user/assistant pairs."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def reset(self) -> None:
        self.turns.clear()


@dataclass(frozen=True)
class Sampling:
    """What each turn asks for; `/set` replaces it."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    def describe(self) -> str:
        return f"max_tokens {self.max_tokens}, temperature {self.temperature:g}"

    def with_setting(self, line: str) -> Sampling:
        """`/set NAME VALUE` (NAME: max_tokens or temperature, dashes allowed) -> the new Sampling;
        ValueError with a message for the user."""
        parts = line.split()
        if len(parts) != 3:
            raise ValueError("usage: /set max_tokens N | /set temperature T")
        name, value = parts[1].replace("-", "_"), parts[2]
        try:
            if name == "max_tokens":
                return replace(self, max_tokens=int(value))
            if name == "temperature":
                return replace(self, temperature=float(value))
        except ValueError as e:
            raise ValueError(f"/set {name}: {e}") from None
        raise ValueError(f"/set: unknown setting {parts[1]!r} (max_tokens, temperature)")


@dataclass(frozen=True)
class ChatClient:
    """Streams one answer of `/v1/chat/completions` at a time."""

    http: httpx.Client
    url: str
    model: str | None

    def body(self, messages: list[dict[str, str]], sampling: Sampling) -> dict[str, Any]:
        body: dict[str, Any] = {
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
        }
        if self.model is not None:
            body["model"] = self.model
        return body

    def stream(self, messages: list[dict[str, str]], sampling: Sampling) -> Iterator[str | Usage]:
        """Text pieces of the answer as they arrive, then its Usage if the server sends one."""
        body = self.body(messages, sampling)
        try:
            with self.http.stream("POST", self.url + "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise ChatError(f"the server answered {resp.status_code}: {_error_message(resp.text)}")
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[len("data:") :].strip()
                    if payload == "[DONE]":
                        return
                    yield from _chunk_items(payload)
        except httpx.ConnectError as e:
            raise ChatError(f"cannot reach {self.url}: {_reason(e)}") from None
        except httpx.TimeoutException as e:
            raise ChatError(f"{self.url} did not answer in time ({type(e).__name__})") from None
        except httpx.HTTPError as e:  # e.g. the server died mid-answer
            raise ChatError(f"the connection to {self.url} broke: {_reason(e)}") from None
        raise ChatError("the answer stream ended without [DONE] (the server went away?)")

    def check(self) -> str | None:
        """Raise ChatError when nothing answers at the URL; the served model's name, if it says."""
        try:
            resp = self.http.get(self.url + "/v1/models", timeout=10.0)
        except httpx.HTTPError as e:
            raise ChatError(f"cannot reach {self.url}: {_reason(e)}") from None
        try:
            return str(resp.json()["data"][0]["id"]) if resp.status_code == 200 else None
        except (ValueError, KeyError, IndexError, TypeError):
            return None


def _reason(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _error_message(text: str) -> str:
    """The server's error message (bench's parser of OpenAI/SGLang error bodies) on one line."""
    return " ".join(error_message(text).split()) or "(empty body)"


def _chunk_items(payload: str) -> Iterator[str | Usage]:
    try:
        chunk = json.loads(payload)
    except ValueError:
        raise ChatError(f"the server sent a malformed stream event: {payload[:100]!r}") from None
    if not isinstance(chunk, dict):
        raise ChatError(f"the server sent a malformed stream event: {payload[:100]!r}")
    if "error" in chunk:
        raise ChatError(f"the server failed the answer: {_error_message(payload)}")
    for choice in chunk.get("choices") or []:
        piece = (choice.get("delta") or {}).get("content")
        if piece:
            yield piece
        if choice.get("finish_reason") == "abort":
            raise ChatError("the server aborted the answer")
    if chunk.get("usage"):
        yield Usage.from_json(chunk["usage"])


@dataclass
class ChatLoop:
    """Reads lines, runs turns, keeps the conversation."""

    client: ChatClient
    conv: Conversation
    out: TextIO
    err: TextIO
    show_usage: bool = False
    sampling: Sampling = field(default_factory=Sampling)
    failed: bool = False  # a turn failed: the exit status says so

    def turn(self, text: str) -> None:
        self.conv.turns.append({"role": "user", "content": text})
        pieces: list[str] = []
        usage: Usage | None = None  # printed after the answer's closing newline, not inside its line
        try:
            for item in self.client.stream(self.conv.messages(), self.sampling):
                if isinstance(item, Usage):
                    usage = item
                    continue
                pieces.append(item)
                self.out.write(item)
                self.out.flush()
        except KeyboardInterrupt:
            # Keep what the user saw as the assistant's answer (as a chat UI's "stop" does); an
            # answer stopped before its first word leaves no turn behind.
            self.out.write("\n")
            self.out.flush()
            print("[interrupted]", file=self.err, flush=True)
            self._close_turn("".join(pieces))
            return
        except ChatError as e:
            self.out.write("\n" if pieces else "")
            self.out.flush()
            print(f"kvpipe chat: {e}", file=self.err, flush=True)
            self.conv.turns.pop()  # the turn did not happen: the user may send it again
            self.failed = True
            return
        self.out.write("\n")
        self.out.flush()
        if usage is not None and self.show_usage:
            print(
                f"[usage] prompt_tokens={usage.prompt_tokens} cached_tokens={usage.cached_tokens} "
                f"completion_tokens={usage.completion_tokens}",
                file=self.err,
                flush=True,
            )
        self.conv.turns.append({"role": "assistant", "content": "".join(pieces)})

    def set(self, line: str) -> None:
        """`/set NAME VALUE`, or `/set` alone: print the settings."""
        try:
            self.sampling = self.sampling if line == "/set" else self.sampling.with_setting(line)
        except ValueError as e:
            print(f"kvpipe chat: {e}", file=self.err, flush=True)
            return
        print(f"[settings] {self.sampling.describe()}", file=self.err, flush=True)

    def _close_turn(self, answer: str) -> None:
        if answer:
            self.conv.turns.append({"role": "assistant", "content": answer})
        else:
            self.conv.turns.pop()

    def run(self, prompt: str) -> int:
        while True:
            try:
                line = input(prompt)
            except EOFError:
                break
            except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
                self.out.write("\n")
                continue
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                self.conv.reset()
                print("[conversation reset]", file=self.err, flush=True)
            elif text == "/set" or text.startswith("/set "):
                self.set(text)
            elif text.startswith("/") and " " not in text:
                print(f"unknown command {text}: {HELP}", file=self.err, flush=True)
            else:
                self.turn(text)
        if prompt:
            self.out.write("\n")
        return 1 if self.failed else 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help=f"server or router address (default {DEFAULT_URL})")
    p.add_argument("--model", default=None, help="model name to send (default: none, the server's own)")
    p.add_argument(
        "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="answer length limit in tokens (/set max_tokens N)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=DEFAULT_TEMPERATURE,
        help="sampling temperature, 0 = greedy (/set temperature T)",
    )
    p.add_argument("--system", default=None, help="system prompt, kept across /reset")
    p.add_argument("--usage", action="store_true", help="print each turn's token counts (cached ones too) to stderr")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the next piece of an answer")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    try:
        sampling = Sampling(args.max_tokens, args.temperature)
    except ValueError as e:
        raise SystemExit(f"kvpipe chat: --{e}".replace("_", "-")) from None
    url = args.url.rstrip("/")
    if "://" not in url:
        url = "http://" + url
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    with httpx.Client(timeout=timeout, headers=client_headers(url=url)) as http:
        client = ChatClient(http, url, args.model)
        try:
            served = client.check()
        except ChatError as e:
            print(f"kvpipe chat: {e}", file=sys.stderr)
            return 1
        interactive = sys.stdin.isatty()
        if interactive:
            print(f"kvpipe chat with {args.model or served or 'the served model'} at {url}. {HELP}.", file=sys.stderr)
        print(f"[settings] {sampling.describe()}", file=sys.stderr, flush=True)
        loop = ChatLoop(client, Conversation(args.system), sys.stdout, sys.stderr, args.usage, sampling)
        return loop.run("> " if interactive else "")
