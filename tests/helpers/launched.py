"""A real `kvpipe launch` process for integration tests: started with the flags given, read until
its ready line, its keys found in the keys file it names (it prints where, never the keys), stopped
with Ctrl-C (SIGINT) at the end."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvpipe.launch.ports import free_port
from kvpipe.server.client_keys import RUN_DIR_ENV, read_keys_file

ROOT = Path(__file__).resolve().parents[2]
READY = "kvpipe PD stack ready"


@dataclass
class Launched:
    proc: subprocess.Popen
    out: list[str]  # the launcher's output up to its ready banner's first line
    router: str
    servers: list[str]
    keys_file: Path
    user: str
    admin: str
    env: dict[str, str]  # a client's environment: no key in it, the stack's run directory

    @property
    def text(self) -> str:
        return "".join(self.out)


def client_env(run_dir: Path) -> dict[str, str]:
    """Our environment without any key, with the stack's run directory (where clients find its keys)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPIPE_API", "KVPIPE_ADMIN", "OPENAI_"))}
    return env | {RUN_DIR_ENV: str(run_dir), "PYTHONPATH": str(ROOT)}


@contextmanager
def launched_stack(model_dir: Path, tmp: Path, *flags: str) -> Iterator[Launched]:
    """`kvpipe launch --model-path model_dir *flags` on a free router port with its logs under
    `tmp`, once ready; stopped (SIGINT, then kill) on exit unless a test stopped it."""
    env = client_env(tmp / "run")
    port = free_port()
    cmd = [sys.executable, "-m", "kvpipe.cli", "launch", "--model-path", str(model_dir), "--port", str(port)]
    cmd += ["--log-dir", str(tmp / "logs"), "--timeout", "240", *flags]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # bounded by the launcher's own --timeout per part
            out.append(line)
            if line.startswith(READY):
                break
        text = "".join(out)
        assert READY in text, text[-3000:]
        m = re.search(r"HTTP API keys: [^,]+, in (\S+) \(mode 0600", text)
        assert m, text
        kf = read_keys_file(Path(m.group(1)))
        assert kf is not None and kf.keys.user and kf.keys.admin
        router = f"http://127.0.0.1:{port}"
        servers = [u for u in kf.urls if u != router]
        yield Launched(proc, out, router, servers, Path(m.group(1)), kf.keys.user, kf.keys.admin, env)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
