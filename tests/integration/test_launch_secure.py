"""`kvpipe launch` is secure by default (issue 45, finding 9: sglang-router's `POST /workers`
accepted an attacker's worker, and nothing asked for a key): a real `kvpipe launch` process (tiny
preset) with no key given makes a user and an admin key, prints where they are (never the keys),
and then
- a request without the user key is refused by the router and by each server;
- the router's control plane (`GET`/`POST /workers`) refuses a client without the admin key, the
  user key included;
- no key and no token is on any part's command line (/proc/PID/cmdline, readable by every user);
- `kvpipe chat` and `kvpipe top`, given only the URL, find the keys in the stack's keys file and
  work; the file is 0600 and gone once the stack stops."""

from __future__ import annotations

import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpipe.launch.secret_flags import AUTH_TOKEN_FLAG, KEY_FLAGS
from kvpipe.server.listeners import process_tree
from kvpipe.transfer.control.auth import TOKEN_ENV
from tests.helpers.launched import Launched, launched_stack

pytest.importorskip("mooncake.engine")
pytestmark = pytest.mark.timeout(400)

BODY = {"text": "Hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def launched(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launched]:
    tmp = tmp_path_factory.mktemp("secure_launch")
    with launched_stack(tiny_model_dir, tmp, "--page-size", "16", "--max-total-tokens", "4096") as stack:
        assert "fresh random user and admin keys" in stack.text
        assert stack.user not in stack.text and stack.admin not in stack.text  # never printed
        yield stack


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _generate(url: str, headers: dict[str, str]) -> httpx.Response:
    """POST /generate; a router that has not admitted its workers yet (503, nothing ran) is retried."""
    deadline = time.monotonic() + 60
    while True:
        r = httpx.post(url + "/generate", json=BODY, headers=headers, timeout=120)
        if r.status_code != 503 or time.monotonic() > deadline:
            return r
        time.sleep(0.5)


def test_requests_need_the_user_key(launched: Launched) -> None:
    assert _generate(launched.router, _bearer(launched.user)).json()["meta_info"]["completion_tokens"] == 3
    for url in [launched.router, *launched.servers]:
        assert _generate(url, {}).status_code == 401, url
        assert _generate(url, _bearer("kvpipe-user-guessed")).status_code == 401, url
    for url in launched.servers:  # the servers' admin routes need the admin key
        assert httpx.get(url + "/debug/requests", headers=_bearer(launched.user)).status_code == 403
        assert httpx.get(url + "/debug/requests", headers=_bearer(launched.admin)).status_code == 200


def test_the_servers_list_their_ports_to_the_admin_only(launched: Launched) -> None:
    """/server_info's `listeners`: every port a server listens on, named (what a firewall covers)."""
    for url in launched.servers:
        assert "listeners" not in httpx.get(url + "/server_info", headers=_bearer(launched.user)).json()
        rows = httpx.get(url + "/server_info", headers=_bearer(launched.admin)).json()["listeners"]
        names = {r["name"] for r in rows}
        assert {"http", "control", "mooncake_handshake", "mooncake_data"} <= names, rows
        assert ("bootstrap" in names) == (url == launched.servers[0]), rows  # the prefill's (listed first)
        assert int(url.rsplit(":", 1)[1]) in {r["port"] for r in rows if r["name"] == "http"}


def test_the_router_s_control_plane_needs_the_admin_key(launched: Launched) -> None:
    attacker = {"url": "http://127.0.0.1:9", "worker_type": "decode"}
    for headers in ({}, _bearer(launched.user)):  # finding 9: POST /workers accepted anyone's worker
        r = httpx.post(launched.router + "/workers", json=attacker, headers=headers, timeout=30)
        assert r.status_code in (401, 403), (r.status_code, r.text)
        assert httpx.get(launched.router + "/workers", headers=headers, timeout=30).status_code in (401, 403)
    listed = httpx.get(launched.router + "/workers", headers=_bearer(launched.admin), timeout=30).json()
    assert sorted(w["url"] for w in listed["workers"]) == sorted(launched.servers)  # nobody else's


def test_no_secret_on_a_command_line(launched: Launched) -> None:
    pids = process_tree(launched.proc.pid)[1:]  # the launcher's descendants: every part
    assert len(pids) >= 3  # prefill, decode, router (and their TP workers, if any)
    lines = [Path(f"/proc/{p}/cmdline").read_bytes() for p in pids]
    environs = [Path(f"/proc/{p}/environ").read_bytes().split(b"\0") for p in pids]
    tokens = {v.partition(b"=")[2] for e in environs for v in e if v.startswith(TOKEN_ENV.encode() + b"=")}
    assert len(tokens) == 1  # the stack's own token, in the servers' environment
    for secret in (launched.user.encode(), launched.admin.encode(), *tokens):
        assert not any(secret in line for line in lines)
    assert not any(f"{flag}\0".encode() in line for line in lines for flag in (*KEY_FLAGS, AUTH_TOKEN_FLAG))


def test_chat_and_top_find_the_keys_by_url(launched: Launched) -> None:
    """Given only the router's URL (no key in their environment) both clients work."""
    chat = subprocess.run(
        [sys.executable, "-m", "kvpipe.cli", "chat", "--url", launched.router, "--max-tokens", "4"],
        input="Hello\n",
        env=launched.env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert chat.returncode == 0 and "401" not in chat.stdout + chat.stderr, (chat.stdout, chat.stderr)
    assert chat.stdout.strip(), chat.stderr
    top = subprocess.run(
        [sys.executable, "-m", "kvpipe.cli", "top", "--url", launched.router, "--once", "--interval", "0.5"],
        env=launched.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert top.returncode == 0, (top.stdout, top.stderr)
    assert "workers 2/2 up" in top.stdout, top.stdout  # the router's /workers: the admin key


def test_the_keys_file_is_private_and_goes_with_the_stack(launched: Launched) -> None:
    """Last in the module: it stops the stack."""
    assert stat.S_IMODE(launched.keys_file.stat().st_mode) == 0o600
    launched.proc.send_signal(signal.SIGINT)
    assert launched.proc.wait(120) == 0
    assert not launched.keys_file.exists()
