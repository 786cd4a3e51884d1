"""What a newcomer meets in the first hour with `kvpipe launch` (issue 47), on a real stack (tiny
preset, launch's own defaults: no --page-size given):
- the layout echoes the forwarded flags and launch's defaults, and each server's real cores; the
  ready line names every worker; each server carries its part name in /metrics;
- `kvpipe chat --usage`: the second turn finds the first turn's prompt in the prefix cache (the
  prefill caches whole pages of prompts: at 64 tokens a page a short chat never hit), and each
  usage line starts a line of its own (it came before the answer's closing newline);
- `kvpipe top --once` in a pipe: 80 columns, a row per worker name;
- a router port in use: one line and a non-zero exit at once, before any model loads; a router
  that cannot start: one line, no traceback."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.launched import ROOT, Launched, client_env, launched_stack

pytest.importorskip("mooncake.engine")
pytestmark = pytest.mark.timeout(400)

USAGE = re.compile(r"^\[usage\] prompt_tokens=(\d+) cached_tokens=(\d+) completion_tokens=(\d+)$", re.M)


@pytest.fixture(scope="module")
def launched(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launched]:
    with launched_stack(tiny_model_dir, tmp_path_factory.mktemp("first_hour"), "--max-total-tokens", "4096") as s:
        yield s


def test_the_layout_says_what_each_server_runs_with(launched: Launched) -> None:
    text = launched.text
    assert "kvpipe launch: server flags forwarded to every server: --max-total-tokens 4096\n" in text
    assert "launch's defaults for every server (a flag given overrides): --page-size 16\n" in text
    rows = [line for line in launched.out if re.match(r"kvpipe launch:\s+(prefill|decode) ", line)]
    assert len(rows) == 2 and all(re.search(r"TP 1, \d+ threads?, cores [\d,-]+ \((not )?pinned\)\)$", r) for r in rows)
    ready = next(line for line in launched.out if line.startswith("kvpipe PD stack ready"))
    for name, url in zip(("prefill", "decode"), launched.servers):
        assert f"{name} {url}" in ready
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert f'kvpipe_worker_info{{name="{name}",role="{name}"}} 1.0' in metrics


def test_chat_second_turn_hits_the_prefix_cache(launched: Launched) -> None:
    """Two turns as `kvpipe chat` sends them (/v1/chat/completions with the history); stderr and
    stdout in one pipe, as in a terminal."""
    chat = subprocess.run(
        [sys.executable, "-m", "kvpipe.cli", "chat", "--url", launched.router, "--usage", "--temperature", "0"]
        + ["--max-tokens", "16"],
        input="What is the capital of France?\nAnd of Italy?\n",
        env=launched.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert chat.returncode == 0, chat.stdout
    turns = [tuple(map(int, m.groups())) for m in USAGE.finditer(chat.stdout)]
    assert len(turns) == 2, chat.stdout  # each on a line of its own, after its answer's newline
    (prompt1, cached1, _), (prompt2, cached2, _) = turns
    assert prompt2 > prompt1 and 0 < cached2 <= prompt1, turns
    assert cached2 >= 16 * (prompt1 // 16) - 16, turns  # the first prompt's whole pages, give or take one


def test_top_in_a_pipe_has_a_row_per_worker_at_80_columns(launched: Launched) -> None:
    env = {k: v for k, v in launched.env.items() if k != "COLUMNS"}
    top = subprocess.run(
        [sys.executable, "-m", "kvpipe.cli", "top", "--url", launched.router, "--once", "--interval", "0.5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert top.returncode == 0, (top.stdout, top.stderr)
    lines = top.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines) and "…" not in top.stdout, top.stdout
    for name in ("prefill", "decode"):
        assert sum(line.split()[:1] == [name] for line in lines) >= 2, top.stdout  # both tables


def test_a_router_port_in_use_is_one_line_before_any_model_loads(tiny_model_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [sys.executable, "-m", "kvpipe.cli", "launch", "--model-path", str(tiny_model_dir), "--port", str(port)]
        out = subprocess.run(cmd, env=client_env(tmp_path), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode != 0 and "Traceback" not in out.stdout + out.stderr, out
    assert out.stderr.strip() == (
        f"kvpipe launch: the router's port {port} on 127.0.0.1 cannot be used: Address already in use"
    ), out
    assert "layout" not in out.stdout  # nothing started


def test_a_router_that_cannot_start_says_so_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        free = [str(p) for p in (port + 1, port + 2)]  # nothing listens there: the router only logs it
        cmd = [sys.executable, "-m", "kvpipe.launch.router_main", "--pd-disaggregation"]
        cmd += ["--prefill", f"http://127.0.0.1:{free[0]}", free[1], "--decode", f"http://127.0.0.1:{free[0]}"]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "error"]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", free[1]]
        out = subprocess.run(cmd, env=client_env(tmp_path), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == "kvpipe router: cannot start: Address already in use (os error 98)"
