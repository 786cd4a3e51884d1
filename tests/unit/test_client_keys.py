"""Where kvpipe's clients find a launched stack's keys (kvpipe/server/client_keys.py), and how the
router's wrapper hands them to sglang-router (kvpipe/launch/router_main.py), without processes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from kvpipe.launch.router_main import key_flags
from kvpipe.server.client_keys import (
    ADMIN_API_KEY_ENV,
    API_KEY_ENV,
    RUN_DIR_ENV,
    StackKeys,
    client_headers,
    keys_file_path,
    read_keys_file,
    remove_stale_keys_files,
    stack_keys_for,
    write_keys_file,
)

ROUTER, PREFILL = "http://127.0.0.1:8000", "http://127.0.0.1:40001"
KEYS = StackKeys("kvpipe-user-u", "kvpipe-admin-a")


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_the_keys_file_is_private_and_shell(tmp_path: Path) -> None:
    env = {RUN_DIR_ENV: str(tmp_path / "run")}
    path = keys_file_path(ROUTER, env)
    assert path == tmp_path / "run" / "stack-127.0.0.1-8000.env"
    write_keys_file(path, StackKeys("it's a key", "a"), ROUTER, [ROUTER, PREFILL], os.getpid())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    out = subprocess.run(
        ["sh", "-c", f'. "{path}" && printf "%s|%s|%s|%s" "$KVPIPE_API_KEY" "$KVPIPE_ADMIN_API_KEY" '
         '"$OPENAI_API_KEY" "$OPENAI_BASE_URL"'],
        capture_output=True, text=True, check=True, env={"PATH": os.environ["PATH"]},
    ).stdout  # fmt: skip
    assert out == f"it's a key|a|it's a key|{ROUTER}/v1"  # what `. FILE` exports, quoted right
    kf = read_keys_file(path)
    assert kf is not None and kf.keys == StackKeys("it's a key", "a") and kf.urls == (ROUTER, PREFILL)
    assert kf.pid == os.getpid()


def test_clients_find_the_keys_by_any_url_of_the_stack(tmp_path: Path) -> None:
    env = {RUN_DIR_ENV: str(tmp_path)}
    write_keys_file(keys_file_path(ROUTER, env), KEYS, ROUTER, [ROUTER, PREFILL], os.getpid())
    assert client_headers(env, url=ROUTER) == {"Authorization": "Bearer kvpipe-user-u"}
    assert client_headers(env, url="localhost:40001/", admin=True) == {"Authorization": "Bearer kvpipe-admin-a"}
    assert client_headers(env, url="http://127.0.0.1:9") == {}  # another stack's URL
    assert client_headers(env) == {}  # no URL: the environment only
    # the environment wins, key by key
    assert client_headers({**env, API_KEY_ENV: "mine"}, url=ROUTER) == {"Authorization": "Bearer mine"}
    assert client_headers({**env, API_KEY_ENV: "mine"}, url=ROUTER, admin=True) == {
        "Authorization": "Bearer kvpipe-admin-a"
    }
    assert client_headers({**env, ADMIN_API_KEY_ENV: "boss"}, url=ROUTER, admin=True) == {
        "Authorization": "Bearer boss"
    }


def test_a_dead_stack_s_file_is_skipped_and_removed_by_the_next_start(tmp_path: Path) -> None:
    env = {RUN_DIR_ENV: str(tmp_path)}
    path = keys_file_path(ROUTER, env)
    write_keys_file(path, KEYS, ROUTER, [ROUTER], _dead_pid())
    assert stack_keys_for(ROUTER, env) == StackKeys()
    (tmp_path / "stack-junk.env").write_text("not a keys file\n")  # left alone
    assert remove_stale_keys_files(env) == [path] and not path.exists()
    assert (tmp_path / "stack-junk.env").exists()


def test_the_router_gets_its_keys_from_the_environment() -> None:
    assert key_flags({}) == []
    assert key_flags({API_KEY_ENV: "u", ADMIN_API_KEY_ENV: "a:b"}) == [
        "--api-key",
        "u",
        "--control-plane-api-keys",
        "kvpipe-admin:kvpipe admin:admin:a:b",  # sglang-router splits on the first three colons only
    ]
