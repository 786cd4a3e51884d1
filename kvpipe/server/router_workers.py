"""The workers behind a running sglang-router, as its HTTP API lists them (`kvpipe top`, and
`kvpipe bench serve --timeline`, which reads their /debug/requests).

sglang-router 0.3 answers `GET /workers` with each worker's url, worker_type ("Prefill {
bootstrap_port: Some(8998) }", "Decode", "Regular") and is_healthy; older routers only `GET
/list_workers` (urls). A URL that is no router (a server answers 404 to both) is its own worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class Worker:
    url: str
    role: str | None = None  # prefill / decode / colocated as the router lists it (None: not said)
    healthy: bool | None = None


def role_of(worker_type: str) -> str | None:
    kind = worker_type.split()[0].lower() if worker_type else ""
    return {"prefill": "prefill", "decode": "decode", "regular": "colocated"}.get(kind)


def router_workers(client: httpx.Client, router: str) -> list[Worker]:
    """The router's workers; raises httpx.HTTPStatusError when `router` lists none (no router)."""
    base = router.rstrip("/")
    r = client.get(base + "/workers")
    body = r.json() if r.status_code == 200 else None
    if isinstance(body, dict) and isinstance(body.get("workers"), list):
        return [
            Worker(w["url"], role_of(str(w.get("worker_type", ""))), w.get("is_healthy"))
            for w in body["workers"]
            if isinstance(w, dict) and isinstance(w.get("url"), str)
        ]
    r = client.get(base + "/list_workers")
    r.raise_for_status()
    return [Worker(u) for u in r.json().get("urls", []) if isinstance(u, str)]


def workers_or_self(client: httpx.Client, url: str) -> list[Worker]:
    """The router's workers, or `url` itself when it is a server (no worker list there)."""
    try:
        return router_workers(client, url)
    except httpx.HTTPStatusError as e:
        if e.response.status_code in (404, 405):
            return [Worker(url)]
        raise
