"""A stack's start-up bookkeeping without processes: its ports (picked at once, refreshed for a part
that lost one), its secrets (off the command lines, into the servers' environment) and each
part's spec built from them (start.py's StackSpecs)."""

from __future__ import annotations

import socket

import pytest

from kvpipe.config import ConfigError
from kvpipe.launch.core_split import ServerCores
from kvpipe.launch.ports import StackPorts
from kvpipe.launch.secret_flags import StackArgs, StackSecrets, split_secrets
from kvpipe.launch.start import StackSpecs, start_pd_stack
from kvpipe.launch.store_master import StoreMaster
from kvpipe.server.client_keys import ADMIN_API_KEY_ENV, API_KEY_ENV
from kvpipe.transfer.control.auth import TOKEN_ENV

H = "127.0.0.1"  # the stack's host (fresh ports are bound on it)


def test_ports_are_distinct_and_a_part_gets_fresh_ones_of_its_own() -> None:
    ports, extra = StackPorts.pick("127.0.0.1", 2, 1, None, extra=3)
    every = [*ports.http, *ports.bootstrap, ports.router, ports.metrics, *extra]
    assert len(every) == len(set(every)) == 2 + 1 + 2 + 2 + 3
    assert ports.router_part == 3
    assert ports.picked(0) == [ports.http[0], ports.bootstrap[0]]  # a prefill: HTTP and bootstrap
    assert ports.picked(2) == [ports.http[2]]  # the decode
    assert ports.picked(3) == [ports.metrics, ports.router]
    before = (list(ports.http), list(ports.bootstrap), ports.router, ports.metrics)
    ports.refresh(1)
    assert ports.http[1] != before[0][1] and ports.bootstrap[1] != before[1][1]
    assert (ports.http[0], ports.http[2], ports.bootstrap[0]) == (before[0][0], before[0][2], before[1][0])
    ports.refresh(3)
    assert ports.metrics != before[3]


def test_a_router_port_the_caller_chose_is_never_replaced() -> None:
    ports, extra = StackPorts.pick("127.0.0.1", 1, 1, 8123)
    assert extra == [] and ports.router == 8123 and ports.router_given
    assert ports.picked(2) == [ports.metrics]  # not ours to check for a thief
    ports.refresh(2)
    assert ports.router == 8123


def test_secrets_leave_the_flags_for_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for env in (TOKEN_ENV, API_KEY_ENV, ADMIN_API_KEY_ENV):
        monkeypatch.delenv(env, raising=False)
    args, secrets = split_secrets(
        ["--page-size", "16", "--api-key", "k", "--admin-api-key=a"],
        ["--disaggregation-auth-token=t"],
        ["--disaggregation-auth-token", "t"],
    )
    assert args == StackArgs(["--page-size", "16"], [], [])
    assert secrets.env() == ((TOKEN_ENV, "t"), (API_KEY_ENV, "k"), (ADMIN_API_KEY_ENV, "a"))
    assert secrets.router_env() == ((API_KEY_ENV, "k"), (ADMIN_API_KEY_ENV, "a"))  # no token: not a PD peer
    assert repr(secrets) == "StackSecrets(generated=())"  # never a secret in a log line
    with pytest.raises(ConfigError, match="same --disaggregation-auth-token"):
        split_secrets([], ["--disaggregation-auth-token", "a"], ["--disaggregation-auth-token", "b"])


def test_the_stack_token_is_ours_unless_the_servers_read_a_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    _, fresh = split_secrets([], [], [])
    _, other = split_secrets([], [], [])
    assert fresh.token and other.token and fresh.token != other.token  # one random token per stack
    assert fresh.api_key == "from-env"
    args, from_file = split_secrets(["--disaggregation-auth-token-file", "/f"], [], [])
    assert from_file.token is None and args.server == ["--disaggregation-auth-token-file", "/f"]
    monkeypatch.setenv(TOKEN_ENV, "ours")
    assert split_secrets([], [], [])[1].token == "ours"


def _specs(master: StoreMaster | None = None) -> StackSpecs:
    ports = StackPorts(H, 2, [10, 11, 12], [20, 21], 30, 31, router_given=False)
    args = StackArgs(["--page-size", "16"], ["--tp-size", "2"], [])
    shares = [ServerCores(("--cpu-threads", "1"), (i,)) for i in range(3)]
    return StackSpecs(ports, "/m", args, shares, StackSecrets("tok", "key"), "/logs", master)


def test_specs_of_a_2p1d_stack() -> None:
    specs = _specs(StoreMaster(H, 40, 41, 42))
    stack = specs.new_stack(None, ("round_robin", None))
    assert [s.name for s in stack.specs] == ["prefill0", "prefill1", "decode0", "router", "store"]
    p1 = " ".join(stack.specs[1].cmd)
    assert p1.endswith(
        f"serve --host {H} --model-path /m --page-size 16 --hicache-mooncake-master {H}:40 "
        f"--hicache-mooncake-metadata-server http://{H}:41/metadata --cpu-threads 1 --port 11 "
        "--disaggregation-mode prefill --disaggregation-bootstrap-port 21 --tp-size 2 --worker-name prefill1"
    )
    assert stack.specs[2].cmd[-5:] == ("12", "--disaggregation-mode", "decode", "--worker-name", "decode0")
    assert stack.specs[1].pin == (1,) and stack.specs[1].log_path == "/logs/prefill1.log"
    assert dict(stack.specs[0].env) == {TOKEN_ENV: "tok", API_KEY_ENV: "key"} and stack.auth_token == "tok"
    assert stack.specs[3].env == ((API_KEY_ENV, "key"),)  # the router's key in its environment, no token
    router = " ".join(stack.specs[3].cmd)
    assert f"--prefill http://{H}:10 20 --prefill http://{H}:11 21 --decode http://{H}:12" in router
    assert "--prefill-policy round_robin" in router and "key" not in router.split()
    assert (stack.prefill_urls, stack.decode_urls, stack.bootstrap_ports) == (
        [f"http://{H}:10", f"http://{H}:11"],
        [f"http://{H}:12"],
        [20, 21],
    )
    assert (stack.router_url, stack.router_metrics_url, stack.store_master) == (
        f"http://{H}:30",
        f"http://{H}:31",
        specs.master,
    )


def test_a_server_on_fresh_ports_moves_the_stack_urls_and_the_router_follows() -> None:
    specs = _specs()
    stack = specs.new_stack(None, (None, None))
    assert [s.name for s in stack.specs] == ["prefill0", "prefill1", "decode0", "router"]
    spec = specs.fresh(2)
    new = specs.ports.http[2]
    assert new != 12 and spec.health_url == f"http://{H}:{new}/health"
    assert stack.decode_url == stack.decode_urls[0] == f"http://{H}:{new}"
    assert f"--decode http://{H}:{new}" in " ".join(specs.router().cmd)


def test_a_secure_stack_gets_fresh_keys_unless_given(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """`kvpipe launch` (new_keys): the keys given (flag, one-line file, environment), else random
    ones, each stack its own; one user key only (the router sends one); user and admin differ."""
    for env in (TOKEN_ENV, API_KEY_ENV, ADMIN_API_KEY_ENV):
        monkeypatch.delenv(env, raising=False)
    _, a = split_secrets([], [], [], new_keys=True)
    _, b = split_secrets([], [], [], new_keys=True)
    assert a.generated == ("user", "admin") and a.api_key and a.admin_key
    assert a.api_key.startswith("kvpipe-user-") and a.admin_key.startswith("kvpipe-admin-")
    assert len({a.api_key, a.admin_key, b.api_key, b.admin_key}) == 4
    assert split_secrets([], [], [])[1].keys.user is None  # without new_keys: open, as before
    (tmp_path / "admin").write_text("# ops\nadmin-from-file\n")
    args, given = split_secrets(["--api-key=u", "--admin-api-key-file", str(tmp_path / "admin")], [], [], new_keys=True)
    assert (given.api_key, given.admin_key, given.generated, args.server) == ("u", "admin-from-file", (), [])
    monkeypatch.setenv(ADMIN_API_KEY_ENV, "admin-from-env")
    _, env = split_secrets([], [], [], new_keys=True)
    assert env.admin_key == "admin-from-env" and env.generated == ("user",)
    (tmp_path / "users").write_text("one\ntwo\n")
    with pytest.raises(ConfigError, match="one user key"):
        split_secrets(["--api-key-file", str(tmp_path / "users")], [], [], new_keys=True)
    with pytest.raises(ConfigError, match="must differ"):
        split_secrets(["--api-key", "same", "--admin-api-key", "same"], [], [])


def test_a_router_port_in_use_is_refused_before_anything_starts() -> None:
    """A given router port another process holds: one ConfigError at once, not after the servers
    loaded their models (issue 47: 21 s, then a traceback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind((H, 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"router's port {port} on {H} cannot be used: Address already in use"):
            start_pd_stack(None, H, port, split_cpus=False)
