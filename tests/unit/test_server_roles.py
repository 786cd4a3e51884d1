"""Issue 45, findings 5 and 8 without an engine: the admin key's routes (abort_all, /debug/*),
who reads the addresses and paths of /server_info, users with keys of their own, and where the
keys come from (files and the environment; never only flags)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvpipe.commands.flags import add_http_api_args, add_server_args, server_config_from_args
from kvpipe.config import ConfigError, ServerConfig
from kvpipe.server.api_key import AccessKeys, Caller, Role, key_id, tenant_salt
from kvpipe.server.async_engine import EngineLike
from kvpipe.server.client_keys import ADMIN_API_KEY_ENV, API_KEY_ENV, client_headers
from kvpipe.server.http_server import create_app
from kvpipe.server.info_routes import redacted

USER, OTHER, ADMIN = "user-key-0123456789", "other-key-0123456789", "admin-key-0123456789"


def _never_loads() -> EngineLike:
    raise AssertionError("the engine is not needed here")


def _client(tmp_path: Path, users: tuple[str, ...] = (USER,), admin: str | None = ADMIN) -> TestClient:
    cfg = ServerConfig(
        model_path=str(tmp_path), api_key=users[0] if users else None, api_keys=users[1:], admin_api_key=admin
    )
    return TestClient(create_app(cfg, _never_loads), raise_server_exceptions=False)


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_user_key_cannot_use_the_admin_routes(tmp_path: Path) -> None:
    client = _client(tmp_path)
    r = client.post("/abort_request", json={"abort_all": True}, headers=_bearer(USER))
    assert r.status_code == 403 and "--admin-api-key" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["type"] == "permission_error"
    assert client.get("/debug/requests", headers=_bearer(USER)).status_code == 403
    for headers in ({}, _bearer("not-a-key-of-ours")):  # no key at all: 401
        assert client.post("/abort_request", json={"abort_all": True}, headers=headers).status_code == 401
        assert client.get("/debug/requests", headers=headers).status_code == 401
    assert client.post("/abort_request", json={"abort_all": True}, headers=_bearer(ADMIN)).json() == {"aborted": 0}
    assert client.get("/debug/requests", headers=_bearer(ADMIN)).status_code == 200
    # abort by rid stays a user's right (its own requests: none run here)
    assert client.post("/abort_request", json={"rid": "x"}, headers=_bearer(USER)).json() == {"aborted": 0}


def test_admin_routes_are_off_without_an_admin_key(tmp_path: Path) -> None:
    client = _client(tmp_path, admin=None)
    r = client.get("/debug/requests", headers=_bearer(USER))
    assert r.status_code == 403 and "no --admin-api-key" in r.json()["error"]["message"]
    assert client.post("/abort_request", json={"abort_all": True}, headers=_bearer(USER)).status_code == 403


def test_an_admin_key_alone_leaves_the_user_routes_open(tmp_path: Path) -> None:
    client = _client(tmp_path, users=())
    assert client.get("/v1/models").status_code == 200
    assert client.post("/abort_request", json={"rid": "x"}).json() == {"aborted": 0}
    assert client.post("/abort_request", json={"abort_all": True}).status_code == 401
    assert client.get("/debug/requests", headers=_bearer(USER)).status_code == 401  # not a key here
    assert client.get("/debug/requests", headers=_bearer(ADMIN)).status_code == 200


def test_server_info_gives_addresses_and_paths_only_to_admins(tmp_path: Path) -> None:
    client = _client(tmp_path)
    full = client.get("/server_info", headers=_bearer(ADMIN)).json()
    assert full["checkpoint_path"] == str(tmp_path) and full["served_model_name"] == tmp_path.name
    user = client.get("/server_info", headers=_bearer(USER)).json()
    assert user["checkpoint_path"] is None and user["model_path"] is None and user["tokenizer_path"] is None
    # what sglang-router reads is there
    assert {k: user[k] for k in ("served_model_name", "tp_size", "dp_size", "page_size")} == {
        k: full[k] for k in ("served_model_name", "tp_size", "dp_size", "page_size")
    }
    assert client.get("/model_info", headers=_bearer(USER)).json()["checkpoint_path"] is None
    assert client.get("/model_info", headers=_bearer(ADMIN)).json()["checkpoint_path"] == str(tmp_path)


def test_redaction_by_key_at_any_depth() -> None:
    pd = {
        "disaggregation": {
            "mode": "prefill",
            "bootstrap_port": 8998,
            "control_address": "tcp://10.0.0.1:5000",
            "data_address": "10.0.0.1:15000",
            "rooms_succeeded": 3,
            "peers": [{"data_address": "x", "rank": 0}],
        },
        "num_running": 1,
    }
    out = redacted({"internal_states": [pd], "model_path": "/models/secret"})
    d = out["internal_states"][0]["disaggregation"]
    assert d["control_address"] is d["data_address"] is d["bootstrap_port"] is out["model_path"] is None
    assert d["rooms_succeeded"] == 3 and d["peers"] == [{"data_address": None, "rank": 0}]
    assert out["internal_states"][0]["num_running"] == 1


def test_callers_and_key_ids() -> None:
    keys = AccessKeys((USER, OTHER), ADMIN)
    assert keys.caller(f"Bearer {USER}") == Caller(Role.USER, key_id(USER))
    assert keys.caller(f"Bearer {OTHER}") == Caller(Role.USER, key_id(OTHER))
    assert keys.caller(f"Bearer {ADMIN}") == Caller(Role.ADMIN, key_id(ADMIN))
    assert keys.caller(None) is None and keys.caller("Bearer nope") is None
    assert AccessKeys().caller(None) == Caller(Role.ADMIN)  # no key: an open server
    assert AccessKeys(admin=ADMIN).caller(None) == Caller(Role.USER)
    assert len({key_id(USER), key_id(OTHER), key_id(ADMIN)}) == 3 and USER not in key_id(USER)
    assert USER not in repr(keys) and ADMIN not in repr(keys)
    with pytest.raises(ValueError, match="empty"):
        AccessKeys(("",))


def test_tenant_salt() -> None:
    alice, bob, anonymous = Caller(Role.USER, "a1"), Caller(Role.USER, "b2"), Caller(Role.USER)
    assert tenant_salt(alice, None, by_key=False) is None and tenant_salt(alice, "s", by_key=False) == "s"
    assert tenant_salt(alice, None, by_key=True) == "a1" != tenant_salt(bob, None, by_key=True)
    assert tenant_salt(alice, "s", by_key=True) != tenant_salt(bob, "s", by_key=True)  # each key its own
    assert tenant_salt(anonymous, "s", by_key=True) == "s"


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_server_args(p)
    add_http_api_args(p)
    return p.parse_args(argv)


def test_keys_from_files_and_the_environment(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for env in (API_KEY_ENV, ADMIN_API_KEY_ENV):
        monkeypatch.delenv(env, raising=False)
    base = ["--model-path", str(tiny_model_dir)]
    users, admin = tmp_path / "users", tmp_path / "admin"
    users.write_text(f"# one key per user\n{USER}\n\n{OTHER}\n")
    admin.write_text(f"{ADMIN}\n")
    cfg = server_config_from_args(_parse([*base, "--api-key-file", str(users), "--admin-api-key-file", str(admin)]))
    assert cfg.user_api_keys == (USER, OTHER) and cfg.admin_api_key == ADMIN and not cfg.cache_salt_by_api_key
    assert ADMIN not in repr(cfg) and USER not in repr(cfg)
    monkeypatch.setenv(ADMIN_API_KEY_ENV, "admin-from-the-environment")
    cfg = server_config_from_args(_parse([*base, "--cache-salt-by-api-key"]))
    assert cfg.admin_api_key == "admin-from-the-environment" and cfg.cache_salt_by_api_key
    for argv, why in (
        (["--api-key", USER, "--api-key-file", str(users)], "not both"),
        (["--admin-api-key", USER, "--api-key", USER], "must differ"),
        (["--api-key-file", str(tmp_path / "missing")], "No such file"),
    ):
        with pytest.raises(SystemExit, match=why):
            server_config_from_args(_parse([*base, *argv]))
    (tmp_path / "blank").write_text("\n# none\n")
    with pytest.raises(SystemExit, match="holds no key"):
        server_config_from_args(_parse([*base, "--admin-api-key-file", str(tmp_path / "blank")]))
    with pytest.raises(ConfigError, match="must differ"):
        ServerConfig(model_path="m", api_keys=(USER,), admin_api_key=USER)


def test_our_clients_send_the_admin_key_only_for_an_admin_s_call() -> None:
    """Inference carries the user key (sglang-router refuses its control-plane admin key there);
    an admin's read the admin key; each falls back to the other."""
    both = {API_KEY_ENV: "u", ADMIN_API_KEY_ENV: "a"}
    assert client_headers(both) == {"Authorization": "Bearer u"}
    assert client_headers(both, admin=True) == {"Authorization": "Bearer a"}
    assert client_headers({API_KEY_ENV: "u"}, admin=True) == {"Authorization": "Bearer u"}
    assert client_headers({ADMIN_API_KEY_ENV: "a"}) == {"Authorization": "Bearer a"}


def test_the_schema_says_which_routes_need_the_admin_key(tmp_path: Path) -> None:
    doc = _client(tmp_path, users=()).get("/openapi.json").json()
    assert "403" in doc["paths"]["/debug/requests"]["get"]["responses"]
    assert doc["paths"]["/debug/requests"]["get"]["security"] == [{"bearer": []}]
    assert doc["paths"]["/abort_request"]["post"]["security"] == [{"bearer": []}, {}]  # abort_all only
    assert "security" not in doc["paths"]["/generate"]["post"]  # no user key: open
