"""`kvpipe top` against a running PD stack (issue 29), read off a terminal: the command runs in a
detached tmux session of a fixed size (its own tmux server, killed at the end), requests go
through the router from two client threads, and `tmux capture-pane` must show both workers with
nonzero request rates, the decode's token rate and the prefill's KV transfer rate. Then `--once`
prints one frame of the same stack. Every wait is bounded; nothing here times anything."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.pd_stack import Stack, generate, greedy, start_stack, wait_for

pytest.importorskip("mooncake.engine")
if shutil.which("tmux") is None:
    pytest.skip("tmux is not installed", allow_module_level=True)

COLS, ROWS = 230, 40
SCREEN_TIMEOUT_S = 120.0


@pytest.fixture
def tmux() -> Iterator[list[str]]:
    """`tmux -L <socket of its own>`: the server this test starts, killed (with its sessions) at the end."""
    cmd = ["tmux", "-L", f"kvpipe-top-{uuid.uuid4().hex[:8]}"]
    yield cmd
    subprocess.run([*cmd, "kill-server"], capture_output=True, timeout=30)


def cells(screen: str, url: str) -> list[str] | None:
    """The table row of the worker at `url`: role, url, up, restarts, req/s, tok/s, ... (rich draws
    its columns with │)."""
    for line in screen.splitlines():
        if url in line and "│" in line:
            return [c.strip() for c in line.split("│")[1:-1]]
    return None


def shows_load(screen: str, stack: Stack) -> bool:
    p, d = cells(screen, stack.pd.prefill_url), cells(screen, stack.pd.decode_url)
    if p is None or d is None:
        return False

    def num(s: str) -> float:
        try:
            return float(s)
        except ValueError:
            return 0.0

    # role, url, up, restarts, req/s, tok/s, TTFT p50, TTFT p99, ITL p50, run/wait, pages, slots, KV GB/s
    return (
        p[0] == "prefill"
        and d[0] == "decode"
        and num(p[4]) > 0
        and num(d[4]) > 0
        and num(d[5]) > 0
        and num(p[12]) > 0
        and p[3] == d[3] == "0"
    )


def test_top_shows_a_stack_under_load(tiny_model_dir: Path, tmp_path: Path, tmux: list[str]) -> None:
    stack = start_stack(tiny_model_dir, tmp_path, "--page-size", "16")
    stop = threading.Event()

    def load(seed: int) -> None:
        i = 0
        while not stop.is_set():
            ids = [(seed * 31 + i * 7 + k) % 250 + 3 for k in range(40 + i % 50)]
            generate(stack.router, {"input_ids": ids, "sampling_params": greedy(8)})
            i += 1

    clients = [threading.Thread(target=load, args=(s,), daemon=True) for s in range(2)]
    screen = ""
    try:
        top = [sys.executable, "-m", "kvpipe.cli", "top", "--url", stack.router, "--interval", "1"]
        env = [f"-e{k}={os.environ[k]}" for k in ("PYTHONPATH", "KVPIPE_API_KEY") if k in os.environ]
        shell = f"{shlex.join(top)}; sleep 600"  # the pane outlives top (an error stays on screen)
        subprocess.run(
            [*tmux, "new-session", "-d", "-s", "top", "-x", str(COLS), "-y", str(ROWS), *env, shell],
            check=True,
            timeout=30,
        )
        for c in clients:
            c.start()

        def capture() -> bool:
            nonlocal screen
            r = subprocess.run([*tmux, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True, timeout=30)
            screen = r.stdout
            return shows_load(screen, stack)

        wait_for(capture, SCREEN_TIMEOUT_S, "kvpipe top to show both workers under load", interval_s=0.5)
        assert "TTFT components" in screen and "prefill compute" in screen and "kv wait" in screen

        wide = {**os.environ, "COLUMNS": str(COLS)}  # rich's width off a terminal
        once = subprocess.run([*top[:-1], "0.5", "--once"], capture_output=True, text=True, timeout=60, env=wide)
        assert once.returncode == 0, once.stdout + once.stderr
        assert cells(once.stdout, stack.pd.prefill_url) is not None and cells(once.stdout, stack.pd.decode_url)
    except BaseException:
        print(screen)
        print(stack.logs())
        raise
    finally:
        stop.set()
        for c in clients:
            if c.is_alive():
                c.join(timeout=60)
        stack.close()
