"""The HTTP server: SGLang native routes, server/model info, health, metrics; `run_server`.

The engine loads in the engine thread after the server starts listening, so `/health` answers
503 while loading (what sglang-router and the launcher poll for) and 200 once it is ready.
OpenAI-compatible routes live in `openai_api.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import kvpipe
from kvpipe.body_limit import BodyLimitMiddleware
from kvpipe.config import ServerConfig
from kvpipe.engine.cpu_threads import (
    OMP_WAIT_ENV,
    CpuThreads,
    apply_cpu_threads,
    server_cpu_threads,
    torch_threads,
)
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import SamplingParams
from kvpipe.server.api_key import APIKeyMiddleware
from kvpipe.server.app_state import ServerState
from kvpipe.server.async_engine import AsyncEngine, EngineLike
from kvpipe.server.errors import APIError, install_error_handlers
from kvpipe.server.metrics import CONTENT_TYPE, ServerMetrics
from kvpipe.server.openai_api import register_openai_routes
from kvpipe.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from kvpipe.server.openapi_schema import BODY_ROUTE_RESPONSES, AbortRequest, install_body_schemas, json_body
from kvpipe.server.protocol import (
    GENERATE_BATCH_FIELDS,
    GenerateInput,
    GenerateRequest,
    check_batch_size,
    new_rid,
    split_generate_request,
)
from kvpipe.server.request_tracker import RequestOutput
from kvpipe.server.streaming import (
    SSE_DONE,
    ClosingStreamingResponse,
    close_all,
    merge_streams,
    read_json,
    sse,
    sse_error,
)
from kvpipe.server.validation import prepare_prompts

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 30.0
GRACEFUL_SHUTDOWN_S = 5  # whole seconds: uvicorn.Config takes an int


def generate_response(out: RequestOutput, inp: GenerateInput, batched: bool) -> dict[str, Any]:
    """SGLang's `/generate` object (also each streamed event: cumulative text and output_ids)."""
    meta: dict[str, Any] = {
        "id": out.rid,
        "finish_reason": out.finish_reason_json(),
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "e2e_latency": round(out.e2e_latency, 6),
    }
    if out.spec is not None and out.finished:  # SGLang reports these when a request finished
        meta.update(out.spec.meta_info())
    if inp.return_timeline and out.timeline is not None:
        meta["timeline"] = out.timeline.to_json()
    if inp.return_logprob:
        # [logprob, token_id, text]; prompt logprobs are not computed by this engine.
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(out.output_logprobs, out.output_ids)]
    body: dict[str, Any] = {"text": out.text, "output_ids": out.output_ids, "meta_info": meta}
    if batched:
        body["index"] = out.index
    return body


def register_native_routes(app: FastAPI, state: ServerState) -> None:
    # no body when healthy; `{"status": "loading" | "failed" | "timeout"}` with 503 otherwise
    health_responses: dict[int | str, dict[str, Any]] = {
        200: {"description": "ready", "content": None},
        503: {
            "description": "loading or failed",
            "content": {
                "application/json": {"schema": {"type": "object", "properties": {"status": {"type": "string"}}}}
            },
        },
    }

    @app.get("/health", response_class=Response, responses=health_responses)
    async def health() -> Response:
        if not state.engine.ready:
            reason = "failed" if state.engine.fatal_error is not None else "loading"
            return JSONResponse({"status": reason}, status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate", response_class=Response, responses=health_responses)
    async def health_generate() -> Response:
        """Health with a real one-token generation through the engine."""
        if state.disaggregation_mode != "null":  # a PD server cannot generate alone
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

    async def server_info() -> dict[str, Any]:
        c = state.cfg
        return {
            **state.model_paths(),
            "served_model_name": c.model_name,
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

    async def model_info() -> dict[str, Any]:
        return {**state.model_paths(), "is_generation": True, "served_model_name": state.cfg.model_name}

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, server_info, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, model_info, methods=["GET"])

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/debug/requests")
    async def debug_requests() -> dict[str, Any]:
        """The phase timelines of the last finished requests, oldest first (--debug-requests-history)."""
        # "recording": False under --disable-request-metrics (then no request is kept)
        recording = state.cfg.request_metrics
        return {"role": state.metrics.role, "recording": recording, "requests": list(state.engine.recent)}

    @app.post("/abort_request", openapi_extra=json_body(AbortRequest), responses=BODY_ROUTE_RESPONSES)
    async def abort_request(request: Request) -> dict[str, Any]:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise APIError('expected a JSON object {"rid": ...}')
        rid, abort_all = body.get("rid"), body.get("abort_all", False)
        if not isinstance(abort_all, bool) or not (rid is None or isinstance(rid, str)):
            raise APIError("rid must be a string and abort_all a boolean", param="rid")
        if abort_all:
            return {"aborted": state.engine.abort_all()}
        if not rid:
            raise APIError("rid is required (or abort_all: true)", param="rid")
        return {"aborted": int(state.engine.abort(rid))}

    def prepare(body: Any) -> tuple[GenerateRequest, list[GenerateInput], bool]:
        """Validate and tokenize a /generate body (in a prep thread)."""
        req = GenerateRequest.model_validate(body)
        specs, batched = split_generate_request(req)
        limits = state.input_limits()
        return req, prepare_prompts(specs, state.tokenizer, limits, request_limits=state.cfg.limits), batched

    @app.post("/generate", openapi_extra=json_body(GenerateRequest), responses=BODY_ROUTE_RESPONSES)
    async def generate(request: Request) -> Response:
        raw = await read_json(request)
        check_batch_size(raw, GENERATE_BATCH_FIELDS, state.cfg.limits)
        req, inputs, batched = await state.offload(prepare, raw)
        if req.return_timeline:
            inputs = [replace(inp, return_timeline=True) for inp in inputs]
        by_rid = {inp.rid: inp for inp in inputs}
        streams = state.submit_all(inputs)
        if req.stream and not state.is_prefill:

            async def events() -> AsyncIterator[bytes]:
                try:
                    async for out in merge_streams(streams):
                        yield sse(generate_response(out, by_rid[out.rid], batched))
                except APIError as e:
                    yield sse_error(e)
                yield SSE_DONE

            return ClosingStreamingResponse(events(), on_close=close_all(streams))

        def body(outs: list[RequestOutput]) -> Any:
            bodies = [generate_response(o, inp, False) for o, inp in zip(outs, inputs)]
            return bodies if batched else bodies[0]

        return await state.respond_when_done(request, streams, body)


def create_app(
    cfg: ServerConfig,
    engine_factory: Callable[[], EngineLike] | None = None,
    on_fatal: Callable[[BaseException], None] | None = None,
    disaggregation_mode: str = "null",
    cpu_threads: CpuThreads | None = None,
) -> FastAPI:
    """The ASGI app of one server; the engine starts loading when the app starts.

    `engine_factory` runs in the engine thread (default: the colocated Engine); PD workers pass
    their own engine and mode here. `cpu_threads`: what `run_server` applied to this process
    (default: the config's plan, reported only).
    """
    if engine_factory is None:

        def engine_factory() -> EngineLike:
            return Engine(cfg)

    capacity = cfg.scheduler.max_running_requests + cfg.limits.max_queued_requests
    async_engine = AsyncEngine(engine_factory, on_fatal=on_fatal, capacity=capacity, history=cfg.debug_requests_history)
    role = "colocated" if disaggregation_mode == "null" else disaggregation_mode
    metrics = ServerMetrics(cfg.model_name, async_engine.stats, role, per_request=cfg.request_metrics)
    async_engine.metrics = metrics
    state = ServerState(cfg, async_engine, metrics, disaggregation_mode, cpu_threads or server_cpu_threads(cfg))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.stop()
            state.prep.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kvpipe", version=kvpipe.__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.kvpipe = state
    app.add_middleware(BodyLimitMiddleware, max_bytes=cfg.max_request_body_bytes, knob="--max-request-body-bytes")
    if cfg.api_key is not None:  # added last: the outermost layer, before any body is read
        app.add_middleware(APIKeyMiddleware, api_key=cfg.api_key)
    install_error_handlers(app)
    register_native_routes(app, state)
    register_openai_routes(app, state)
    install_body_schemas(
        app,
        [GenerateRequest, AbortRequest, CompletionRequest, ChatCompletionRequest],
        cfg.limits,
        key_required=cfg.api_key is not None,
    )
    return app


def _drop_router_probe_noise(record: logging.LogRecord) -> bool:
    """sglang-router probes each worker with an HTTP/2 preface, which h11 refuses and uvicorn logs
    as a warning every time: noise, not a fault of ours or of a client (shown with debug logs)."""
    return record.getMessage() != "Invalid HTTP request received."


def run_server(
    cfg: ServerConfig, engine_factory: Callable[[], EngineLike] | None = None, disaggregation_mode: str = "null"
) -> int:
    """Serve until SIGINT/SIGTERM; returns 1 if the engine failed to load or died."""
    import uvicorn

    holder: dict[str, Any] = {}

    def on_fatal(exc: BaseException) -> None:
        logger.error("engine failed (%s): shutting the server down", exc)
        holder["failed"] = exc
        server = holder.get("server")
        if server is not None:
            server.should_exit = True  # read by uvicorn's main loop; safe from another thread

    # torch's thread counts are per process: set them before the engine thread loads the model
    threads = server_cpu_threads(cfg)
    apply_cpu_threads(threads)
    logger.info(threads.describe())
    app = create_app(cfg, engine_factory, on_fatal, disaggregation_mode, threads)
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        timeout_keep_alive=30,
        access_log=cfg.log_level == "debug",
        # on SIGTERM, streams still running after this long are cut (and aborted)
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    if cfg.log_level != "debug":  # after uvicorn.Config: it (re)configures its loggers
        logging.getLogger("uvicorn.error").addFilter(_drop_router_probe_noise)
    server = uvicorn.Server(config)
    holder["server"] = server
    server.run()
    return 1 if "failed" in holder else 0
