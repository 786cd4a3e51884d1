"""Issue 45, findings 5 and 8, against a real engine on the tiny model (in process): two users
with keys of their own and an operator with the admin key.

- Finding 5: a user's `abort_all` stopped another user's stream. Now it is a 403, aborting the
  other user's rid finds nothing, and the other user's request runs to its length.
- Finding 8: `/debug/requests` (rids, rooms, timelines) was open, `/server_info` gave paths to
  anyone, and `cached_tokens` told a user whether another user's prompt was cached (64 for a
  right guess, 0 for a wrong one). Now the first two are the admin's, and with
  `--cache-salt-by-api-key` a right guess and a wrong one both say 0 while the owner still hits.
Afterwards the server holds no request and every KV page is free.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvpipe.config import CacheConfig, SchedulerConfig, ServerConfig
from kvpipe.server.app_state import ServerState
from tests.helpers.app_client import InBackground, app_client, assert_back_to_idle, wait_held

pytestmark = pytest.mark.timeout(300)

ALICE, BOB, ADMIN = "alice-key-0123456789", "bob-key-0123456789", "admin-key-0123456789"
LONG_TOKENS = 1500  # long enough that the attacks land while it runs


def _as(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {"Authorization": ""}


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[tuple[TestClient, ServerState]]:
    cfg = ServerConfig(
        model_path=str(tiny_model_dir),
        cache=CacheConfig(page_size=16, max_total_tokens=16384),
        scheduler=SchedulerConfig(context_length=4096, max_running_requests=4),
        api_key=ALICE,
        api_keys=(BOB,),
        admin_api_key=ADMIN,
        cache_salt_by_api_key=True,
        log_level="warning",
    )
    with app_client(cfg) as served:
        yield served


def test_finding_5_a_user_cannot_stop_another_user_s_stream(served: tuple[TestClient, ServerState]) -> None:
    client, state = served
    assert_back_to_idle(state)
    sampling = {"max_new_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0.0}

    def alice(_: int) -> Any:
        body = {"text": "alice's long answer", "rid": "alice-1", "sampling_params": sampling}
        return client.post("/generate", json=body, headers=_as(ALICE)).json()

    victim = InBackground(alice, 1)
    wait_held(state, 1)
    r = client.post("/abort_request", json={"abort_all": True}, headers=_as(BOB))
    assert r.status_code == 403 and "--admin-api-key" in r.json()["error"]["message"], r.text
    assert client.post("/abort_request", json={"abort_all": True}, headers=_as(None)).status_code == 401
    # her rid is not his to abort: as if it did not exist
    assert client.post("/abort_request", json={"rid": "alice-1"}, headers=_as(BOB)).json() == {"aborted": 0}
    assert state.engine.num_active() == 1, "the attacks landed after her request ended: make it longer"
    victim.join()
    meta = victim.outs[0]["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == LONG_TOKENS, meta
    assert_back_to_idle(state)


def _cached(client: TestClient, key: str, prompt: str, salt: str | None = None, rid: str | None = None) -> int:
    body: dict[str, Any] = {"text": prompt, "sampling_params": {"max_new_tokens": 1}}
    if salt is not None:
        body["cache_salt"] = salt
    if rid is not None:
        body["rid"] = rid
    r = client.post("/generate", json=body, headers=_as(key))
    assert r.status_code == 200, r.text
    return int(r.json()["meta_info"]["cached_tokens"])


def test_finding_8_what_leaks(served: tuple[TestClient, ServerState]) -> None:
    client, state = served
    assert_back_to_idle(state)
    secret = "Alice's confidential system prompt: the launch code is 0000, tell nobody. " * 3
    wrong = "Bob's guess at what Alice asked about, which is wrong in every word. " * 3
    assert _cached(client, ALICE, secret, rid="alice-secret") == 0
    assert _cached(client, ALICE, secret) >= 64  # her own prefix is cached for her

    # the oracle: a right guess and a wrong one answer alike
    assert _cached(client, BOB, secret) == 0 == _cached(client, BOB, wrong)
    assert _cached(client, BOB, secret) >= 64  # Bob's own copy now, in his namespace
    # a request's cache_salt narrows its key's namespace further (vLLM's field; OpenAI route too)
    assert _cached(client, BOB, secret, salt="s1") == 0
    chat = {"messages": [{"role": "user", "content": secret}], "max_tokens": 1, "cache_salt": "s1"}
    first = client.post("/v1/chat/completions", json=chat, headers=_as(BOB)).json()["usage"]
    again = client.post("/v1/chat/completions", json=chat, headers=_as(BOB)).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0 < again["prompt_tokens_details"]["cached_tokens"]

    # the debug route holds every user's rids and timelines: the admin's
    assert client.get("/debug/requests", headers=_as(BOB)).status_code == 403
    assert client.get("/debug/requests", headers=_as(None)).status_code == 401
    recent = client.get("/debug/requests", headers=_as(ADMIN)).json()["requests"]
    assert any(e["rid"] == "alice-secret" for e in recent), recent

    # paths and plane addresses: the admin's; what sglang-router reads stays for users
    user, full = (client.get("/server_info", headers=_as(k)).json() for k in (BOB, ADMIN))
    assert user["model_path"] is user["checkpoint_path"] is user["tokenizer_path"] is None
    assert Path(full["model_path"]).is_dir() and full["checkpoint_path"] == full["model_path"]
    assert user["served_model_name"] == full["served_model_name"] and user["context_length"] == 4096
    assert user["internal_states"][0]["total_pages"] == full["internal_states"][0]["total_pages"]
    assert_back_to_idle(state)
