"""The README's quick start and its PD-by-hand recipe, run as written (issue 47): the commands are
read from README.md, not copied here.

Quick start: `make run` is the Makefile's run recipe (`$(BIN)/kvpipe launch`), run from a folder
whose `.venv/bin/kvpipe` is this checkout's CLI, with the tiny preset (`--model-path`) and a free
`--port` added: the only changes. HOME is a fresh folder, so the keys file lands where the README's
`. ~/.cache/kvpipe/run/stack-127.0.0.1-8000.env` looks (port 8000 replaced by the free one). The
curl block then gets a chat completion with text, and `kvpipe chat` answers a line and exits 0 at EOF.

PD by hand: the block's variables (ports) get free ports, the two `kvpipe serve` lines run with the
tiny preset added, the router line as it is; the block's curl gets text through the router."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpipe.launch.ports import free_ports
from kvpipe.launch.process import stop_process
from tests.helpers import readme_blocks as rb

pytest.importorskip("mooncake.engine")
pytest.importorskip("sglang_router")
pytestmark = pytest.mark.timeout(600)

ROOT = rb.ROOT
README_PORT = "8000"
DEADLINE_S = 300.0  # for a stack to answer, on a loaded 2-core machine
# what a user's shell would not have set: keys and run folders of other stacks
DROPPED_ENV = ("KVPIPE_API_KEY", "KVPIPE_ADMIN_API_KEY", "KVPIPE_RUN_DIR", "KVPIPE_DISAGGREGATION_AUTH_TOKEN")


def user_env(home: Path) -> dict[str, str]:
    from kvpipe.model.cpu.kernels.loader import build_dir

    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV and not k.startswith(("OPENAI_", "XDG_"))}
    # the kernels already built for this checkout, though HOME moves
    env |= {"HOME": str(home), "PYTHONPATH": str(ROOT), "KVPIPE_KERNEL_DIR": str(build_dir())}
    return env


def venv_shim(cwd: Path) -> None:
    """`.venv/bin/kvpipe` in `cwd`: this checkout's CLI on this interpreter."""
    bin_dir = cwd / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    shim = bin_dir / "kvpipe"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m kvpipe.cli "$@"\n')
    shim.chmod(0o755)


def make_recipe(target: str) -> list[str]:
    """The recipe lines of a Makefile target, with $(BIN) as the Makefile defines it."""
    text = (ROOT / "Makefile").read_text()
    m = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", text, re.M)
    assert m, f"Makefile has no {target} target"
    bin_dir = re.search(r"^BIN := (.*)$", text, re.M)
    assert bin_dir
    venv = re.search(r"^VENV := (.*)$", text, re.M)
    assert venv
    lines = [line.strip() for line in m.group(1).splitlines()]
    return [line.replace("$(BIN)", bin_dir.group(1)).replace("$(VENV)", venv.group(1)) for line in lines]


def on_port(text: str, port: int) -> str:
    return re.sub(rf"(127\.0\.0\.1[:-]){README_PORT}\b", rf"\g<1>{port}", text)


def bash(
    script: str, cwd: Path, env: dict[str, str], stdin: str = "", timeout: float = 120.0
) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", script], cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=timeout
    )


def poll_json(run: Any, ok: Any, what: str, procs: list[subprocess.Popen], logs: list[Path]) -> dict:
    """run() -> CompletedProcess, again every 2 s until its stdout is JSON that ok() accepts; fails
    at the deadline or as soon as one of `procs` exits, with the logs' tails."""
    deadline = time.monotonic() + DEADLINE_S
    last, dead = "", []
    while time.monotonic() < deadline and not dead:
        out = run()
        last = out.stdout + out.stderr
        try:
            body = json.loads(out.stdout)
        except json.JSONDecodeError:
            body = None
        if isinstance(body, dict) and ok(body):
            return body
        time.sleep(2.0)
        dead = [p.args for p in procs if p.poll() is not None]
    tails = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in logs if p.exists())
    raise AssertionError(f"{what}: no answer (exited: {dead}); last output: {last[-1000:]}\n{tails}")


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    (tmp_path / "home").mkdir()
    venv_shim(tmp_path)
    return tmp_path


def test_readme_names_the_two_commands() -> None:
    first = rb.commands(rb.blocks("Quick start")[0])
    assert [rb.words(c)[:2] for c in first] == [["make", "run"], ["make", "test"]]
    assert "make test" in (ROOT / ".ci" / "run").read_text()  # what CI runs is what the README says


def test_quick_start(user_dir: Path, tiny_model_dir: Path) -> None:
    env = user_env(user_dir / "home")
    (launch,) = make_recipe("run")
    port = free_ports(1)[0]
    log = user_dir / "launch.log"
    argv = [*shlex.split(launch), "--model-path", str(tiny_model_dir), "--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv, cwd=user_dir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        curl_block, chat_block = rb.blocks("Quick start")[1:3]
        assert "curl" in curl_block and "kvpipe chat" in chat_block
        body = poll_json(
            lambda: bash(on_port(curl_block, port), user_dir, env),
            lambda b: "choices" in b,
            "the README's curl",
            [proc],
            [log],
        )
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"].strip()
        chat = bash(on_port(chat_block, port), user_dir, env, stdin="What is the capital of France?\n", timeout=300)
        assert chat.returncode == 0, chat.stderr[-2000:]
        assert chat.stdout.strip(), chat.stderr[-2000:]
    finally:
        stop_process(proc, 60.0)
    keys = user_dir / "home" / ".cache" / "kvpipe" / "run" / f"stack-127.0.0.1-{port}.env"
    assert not keys.exists()  # gone with the stack


def by_hand_argv(command: str, values: dict[str, str], model: Path) -> list[str]:
    words = rb.words(rb.fill(command.rstrip("&").strip(), values))
    if words[0] == "kvpipe":
        return [sys.executable, "-m", "kvpipe.cli", *words[1:], "--model-path", str(model)]
    assert words[0] == "python", words
    return [sys.executable, *words[1:]]


@pytest.fixture
def by_hand(
    user_dir: Path, tiny_model_dir: Path
) -> Iterator[tuple[dict[str, str], list[subprocess.Popen], list[Path]]]:
    setup, *rest = rb.commands(rb.blocks("PD by hand")[0])
    assert rb.is_assignment(setup), setup
    names = list(rb.assignments(setup))
    values = dict(zip(names, map(str, free_ports(len(names)))))
    env = user_env(user_dir / "home")
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    try:
        for i, command in enumerate(rest):
            logs.append(user_dir / f"part{i}.log")
            with logs[-1].open("w") as out:
                procs.append(
                    subprocess.Popen(
                        by_hand_argv(command, values, tiny_model_dir),
                        cwd=user_dir,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        yield values, procs, logs
    finally:
        for p in reversed(procs):
            stop_process(p, 30.0)


def test_pd_by_hand(by_hand: tuple[dict[str, str], list[subprocess.Popen], list[Path]]) -> None:
    values, procs, logs = by_hand
    assert any("sglang_router.launch_router" in " ".join(map(str, p.args)) for p in procs)
    (curl,) = rb.commands(rb.blocks("PD by hand")[1])
    argv = rb.words(rb.fill(curl, values))
    assert argv[0] == "curl"
    body = poll_json(
        lambda: subprocess.run(argv, capture_output=True, text=True, timeout=60),
        lambda b: "text" in b,
        "the README's by-hand curl",
        procs,
        logs,
    )
    assert body["text"].strip()
    assert body["meta_info"]["completion_tokens"] > 0
