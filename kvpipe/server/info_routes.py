"""The routes that describe a server: `/health`, `/health_generate`, `/server_info`,
`/model_info` (and their `/get_` spellings), `/metrics`, `/debug/requests`.

What a user may read and what only an admin may (`api_key.py`): `/debug/requests` holds other
users' rids, rooms and timelines (admins only, the middleware checks); `/server_info` and
`/model_info` give a user what sglang-router needs (the served name, sizes, context length,
counters: DESIGN.md section 7; it takes no model path it cannot use, and accepts none) but not
the addresses of the PD planes, the bootstrap port or the checkpoint's paths on disk.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import kvpipe
from kvpipe.config import SpeculativeConfig
from kvpipe.engine.cpu_threads import OMP_WAIT_ENV, torch_threads
from kvpipe.engine.request import SamplingParams
from kvpipe.server.api_key import caller_of
from kvpipe.server.app_state import ServerState
from kvpipe.server.listeners import listeners, port_names, port_table, process_tree
from kvpipe.server.metrics import CONTENT_TYPE
from kvpipe.server.protocol import GenerateInput, new_rid

HEALTH_GENERATE_TIMEOUT_S = 30.0
# keys of /server_info (at any depth) only an admin reads: where the planes listen, where the
# checkpoint lives; sglang-router needs none of them
_ADMIN_ONLY_KEYS = frozenset(
    {"bootstrap_port", "model_path", "tokenizer_path", "checkpoint_path", "listeners", "speculative_draft_model_path"}
)
_ADMIN_ONLY_SUFFIXES = ("_address", "_addresses", "_url", "_host", "_endpoint", "_endpoints")


def redacted(value: Any) -> Any:
    """`value` without the addresses and paths (by key, at any depth): what a user reads."""
    if isinstance(value, dict):
        return {
            k: None if k in _ADMIN_ONLY_KEYS or k.endswith(_ADMIN_ONLY_SUFFIXES) else redacted(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redacted(v) for v in value]
    return value


def speculative_info(spec: SpeculativeConfig) -> dict[str, Any]:
    """The speculative settings under SGLang's server-argument names, as they are in effect (the
    step count and draft tokens resolved from their defaults); all None when speculation is off.
    Its statistics are the engine's: internal_states[0].avg_spec_accept_length and spec_*."""
    on = spec.enabled
    return {
        "speculative_algorithm": spec.algorithm,
        "speculative_num_steps": spec.max_drafts if on else None,
        "speculative_eagle_topk": 1 if on else None,  # kvpipe verifies a chain
        "speculative_num_draft_tokens": spec.max_drafts + 1 if on else None,
        "speculative_draft_model_path": spec.draft_model_path,
    }


def server_info(state: ServerState) -> dict[str, Any]:
    """Everything /server_info reports (an admin's view)."""
    c = state.cfg
    return {
        **state.model_paths(),
        "served_model_name": c.model_name,
        "worker_name": c.worker_name,
        "tp_size": c.tp_size,
        "dp_size": 1,
        "page_size": c.cache.page_size,
        "context_length": state.advertised_context_length(),
        "max_total_num_tokens": c.cache.pages() * c.cache.page_size,
        "chunked_prefill_size": c.scheduler.chunked_prefill_size,
        "max_running_requests": c.scheduler.max_running_requests,
        "device": c.device,
        "dtype": c.dtype,  # --dtype and --kv-cache-dtype as given (SGLang reports its args)
        "kv_cache_dtype": c.cache.kv_cache_dtype,
        **speculative_info(c.speculative),
        "disaggregation_mode": state.disaggregation_mode,
        "version": kvpipe.__version__,
        # the plan, and what torch reports in this process (rank 0): they differ only if
        # something changed torch's count after startup
        "cpu_threads": None
        if state.cpu_threads is None
        else {
            **state.cpu_threads.as_dict(),
            "torch": torch_threads(),
            "omp_wait_policy": os.environ.get(OMP_WAIT_ENV),  # what libgomp read at start
        },
        "status": "ready" if state.engine.ready else "loading",
        "internal_states": [state.engine.stats() or {}],
    }


def _health_responses() -> dict[int | str, dict[str, Any]]:
    # no body when healthy; `{"status": "loading" | "failed" | "timeout" | "draining" | "peers_unreachable"}`
    # (the last with a "reason") with 503 otherwise
    status = {"type": "object", "properties": {"status": {"type": "string"}, "reason": {"type": "string"}}}
    return {
        200: {"description": "ready", "content": None},
        503: {
            "description": "loading, failed, draining (shutting down), or with ?peers=true no PD peer reachable",
            "content": {"application/json": {"schema": status}},
        },
    }


def pd_unreachable(state: ServerState) -> str | None:
    """Why a PD server has no peer to serve with (the prefill's decodes, or the decode's prefills, all
    missed their heartbeats), or None: one is reachable, none is known yet, or not a PD server."""
    if state.disaggregation_mode == "null":
        return None
    pd = (state.engine.stats() or {}).get("disaggregation") or {}
    return pd.get("unreachable")


def register_health_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health", response_class=Response, responses=_health_responses())
    async def health(peers: bool = False) -> Response:
        """200 when the server can take requests. `?peers=true` (a PD server): also 503
        `{"status": "peers_unreachable", "reason"}` while every PD peer it knows missed its heartbeats
        (a server that knows none yet is ready). sglang-router and the manifests probe plain /health:
        a server out of the pool hears from no new peer (docs/deploy.md)."""
        if state.draining:  # shutting down: out of the router's pool and Kubernetes' endpoints at once
            return JSONResponse({"status": "draining"}, status_code=503)
        if not state.engine.ready:
            reason = "failed" if state.engine.fatal_error is not None else "loading"
            return JSONResponse({"status": reason}, status_code=503)
        why = pd_unreachable(state) if peers else None
        if why is not None:
            return JSONResponse({"status": "peers_unreachable", "reason": why}, status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate", response_class=Response, responses=_health_responses())
    async def health_generate() -> Response:
        """Health with a real one-token generation through the engine."""
        if state.disaggregation_mode != "null" or state.draining:  # a PD server cannot generate alone
            return await health()
        inp = GenerateInput(
            rid=f"health-{new_rid()}",
            input_ids=tuple(state.tokenizer.encode("hi")),
            params=SamplingParams(max_new_tokens=1, temperature=0.0),
        )
        stream = state.engine.submit(inp)
        try:
            out = await asyncio.wait_for(stream.result(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return JSONResponse({"status": "timeout"}, status_code=503)
        finally:
            stream.close()
        return Response(status_code=200 if out.completion_tokens == 1 else 503)


def listener_table(http_port: int, engine_stats: dict[str, Any]) -> list[dict[str, Any]]:
    """Every TCP port this server and its TP workers listen on, named (listeners.py): what a
    firewall or a NetworkPolicy must cover."""
    names = port_names(http_port, engine_stats.get("disaggregation") or {})
    return port_table(listeners(process_tree(os.getpid())), names)


def register_info_routes(app: FastAPI, state: ServerState) -> None:
    # /server_info's `listeners` (admins only), read once the engine is ready: every port is bound
    # by then and stays until the server exits, and reading /proc/net/tcp takes ~10 ms
    table: list[list[dict[str, Any]]] = []

    async def get_server_info(request: Request) -> dict[str, Any]:
        info = server_info(state)
        if not caller_of(request).is_admin:
            return redacted(info)
        if not table and state.engine.ready:
            table.append(await asyncio.to_thread(listener_table, state.cfg.port, info["internal_states"][0]))
        return {**info, "listeners": table[0] if table else None}

    async def get_model_info(request: Request) -> dict[str, Any]:
        info = {**state.model_paths(), "is_generation": True, "served_model_name": state.cfg.model_name}
        return info if caller_of(request).is_admin else redacted(info)

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, get_server_info, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, get_model_info, methods=["GET"])

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/debug/requests")
    async def debug_requests() -> dict[str, Any]:
        """The phase timelines of the last finished requests, oldest first (--debug-requests-history);
        admins only (api_key.ADMIN_PATH_PREFIXES)."""
        # "recording": False under --disable-request-metrics (then no request is kept)
        recording = state.cfg.request_metrics
        return {"role": state.metrics.role, "recording": recording, "requests": list(state.engine.recent)}
