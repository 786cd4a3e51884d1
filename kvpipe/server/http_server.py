"""The HTTP server: the app (`create_app`: its middleware and routes) and `run_server`.

SGLang's native `/generate` and `/abort_request` are here; health, info, metrics and debug routes
in `info_routes.py`, the OpenAI-compatible ones in `openai_api.py`. The engine loads in the engine
thread after the server starts listening, so `/health` answers 503 while loading (what
sglang-router and the launcher poll for) and 200 once it is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from types import FrameType
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

import kvpipe
from kvpipe.body_limit import BodyLimitMiddleware
from kvpipe.config import ServerConfig
from kvpipe.engine.cpu_threads import (
    CpuThreads,
    apply_cpu_threads,
    server_cpu_threads,
)
from kvpipe.engine.engine import Engine
from kvpipe.http_listener import listener_settings
from kvpipe.server.api_key import AccessKeys, APIKeyMiddleware, caller_of, require_admin
from kvpipe.server.app_state import ServerState
from kvpipe.server.async_engine import AsyncEngine, EngineLike
from kvpipe.server.drain import DRAIN_DETAIL, Drain, DrainControl, is_drain_abort
from kvpipe.server.errors import APIError, install_error_handlers
from kvpipe.server.info_routes import register_health_routes, register_info_routes
from kvpipe.server.metrics import ServerMetrics
from kvpipe.server.openai_api import register_openai_routes
from kvpipe.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from kvpipe.server.openapi_schema import BODY_ROUTE_RESPONSES, install_body_schemas, json_body
from kvpipe.server.protocol import (
    GENERATE_BATCH_FIELDS,
    AbortRequest,
    GenerateInput,
    GenerateRequest,
    check_batch_size,
    split_generate_request,
)
from kvpipe.server.request_tracker import RequestOutput
from kvpipe.server.startup_log import announce_ready, quiet_uvicorn_start
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

GRACEFUL_SHUTDOWN_S = 5  # whole seconds: uvicorn.Config takes an int


def generate_response(out: RequestOutput, inp: GenerateInput, batched: bool) -> dict[str, Any]:
    """SGLang's `/generate` object (also each streamed event: cumulative text and output_ids)."""
    meta = out.meta_info()
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


def register_abort_route(app: FastAPI, state: ServerState) -> None:
    """`/abort_request`: one request by rid (a user only its own key's: `Caller.key_id`), or
    every request with `abort_all` (admins only)."""

    @app.post("/abort_request", openapi_extra=json_body(AbortRequest), responses=BODY_ROUTE_RESPONSES)
    async def abort_request(request: Request) -> dict[str, Any]:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise APIError('expected a JSON object {"rid": ...}')
        state.check_body(body, "AbortRequest", model_caps=False)
        rid, abort_all = body.get("rid"), body.get("abort_all", False)
        if not isinstance(abort_all, bool) or not (rid is None or isinstance(rid, str)):
            raise APIError("rid must be a string and abort_all a boolean", param="rid")
        caller = caller_of(request)
        if abort_all:
            require_admin(request, "abort_all")
            return {"aborted": state.engine.abort_all()}
        if not rid:
            raise APIError("rid is required (or abort_all: true)", param="rid")
        return {"aborted": int(state.engine.abort(rid, owner=None if caller.is_admin else caller.key_id))}


def register_generate_route(app: FastAPI, state: ServerState) -> None:
    def prepare(body: Any) -> tuple[GenerateRequest, list[GenerateInput], bool]:
        """Validate and tokenize a /generate body (in a prep thread)."""
        state.check_body(body, "GenerateRequest")
        req = GenerateRequest.model_validate(body)
        specs, batched = split_generate_request(req)
        limits = state.input_limits()
        return req, prepare_prompts(specs, state.tokenizer, limits, request_limits=state.cfg.limits), batched

    @app.post("/generate", openapi_extra=json_body(GenerateRequest), responses=BODY_ROUTE_RESPONSES)
    async def generate(request: Request) -> Response:
        raw = await read_json(request)
        check_batch_size(raw, GENERATE_BATCH_FIELDS, state.cfg.limits)
        req, inputs, batched = await state.offload(prepare, raw)
        inputs = state.for_caller(request, inputs, req.cache_salt)
        if req.return_timeline:
            inputs = [replace(inp, return_timeline=True) for inp in inputs]
        by_rid = {inp.rid: inp for inp in inputs}
        streams = state.submit_all(inputs)
        if req.stream and not state.is_prefill:

            async def events() -> AsyncIterator[bytes]:
                try:
                    async for out in merge_streams(streams):
                        yield sse(generate_response(out, by_rid[out.rid], batched))
                        if is_drain_abort(out):  # cut by a shutdown: an explicit error, not just a finish
                            yield sse_error(APIError(f"request {out.rid}: {DRAIN_DETAIL}", 503))
                except APIError as e:
                    yield sse_error(e)
                yield SSE_DONE

            return ClosingStreamingResponse(events(), on_close=close_all(streams))

        def body(outs: list[RequestOutput]) -> Any:
            bodies = [generate_response(o, inp, False) for o, inp in zip(outs, inputs)]
            return bodies if batched else bodies[0]

        return await state.respond_when_done(request, streams, body)


def register_native_routes(app: FastAPI, state: ServerState) -> None:
    """SGLang's native routes: health, info, metrics, debug, abort, generate."""
    register_health_routes(app, state)
    register_info_routes(app, state)
    register_abort_route(app, state)
    register_generate_route(app, state)


def create_app(
    cfg: ServerConfig,
    engine_factory: Callable[[], EngineLike] | None = None,
    on_fatal: Callable[[BaseException], None] | None = None,
    disaggregation_mode: str = "null",
    cpu_threads: CpuThreads | None = None,
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    """The ASGI app of one server; the engine starts loading when the app starts.

    `engine_factory` runs in the engine thread (default: the colocated Engine); PD workers pass
    their own engine and mode here. `cpu_threads`: what `run_server` applied to this process
    (default: the config's plan, reported only). `on_ready`: called on the event loop once the
    engine has loaded.
    """
    if engine_factory is None:

        def engine_factory() -> EngineLike:
            return Engine(cfg)

    capacity = cfg.scheduler.max_running_requests + cfg.limits.max_queued_requests
    async_engine = AsyncEngine(
        engine_factory, on_fatal=on_fatal, capacity=capacity, history=cfg.debug_requests_history, on_ready=on_ready
    )
    role = server_role(disaggregation_mode)
    metrics = ServerMetrics(
        cfg.model_name, async_engine.stats, role, per_request=cfg.request_metrics, worker_name=cfg.worker_name
    )
    async_engine.metrics = metrics
    state = ServerState(cfg, async_engine, metrics, disaggregation_mode, cpu_threads or server_cpu_threads(cfg))
    state.drain = DrainControl(Drain(cfg.graceful_shutdown_timeout_s), async_engine)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        watcher = asyncio.ensure_future(state.drain.watch()) if state.drain is not None else None
        try:
            yield
        finally:
            if watcher is not None:
                watcher.cancel()
            await async_engine.stop()
            state.prep.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kvpipe", version=kvpipe.__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.kvpipe = state
    app.add_middleware(BodyLimitMiddleware, max_bytes=cfg.max_request_body_bytes, knob="--max-request-body-bytes")
    keys = AccessKeys(cfg.user_api_keys, cfg.admin_api_key)
    # added last: the outermost layer, before any body is read (also without keys: it tells the
    # routes who calls)
    app.add_middleware(APIKeyMiddleware, keys=keys)
    install_error_handlers(app)
    register_native_routes(app, state)
    register_openai_routes(app, state)
    install_body_schemas(
        app, [GenerateRequest, AbortRequest, CompletionRequest, ChatCompletionRequest], cfg.limits, keys
    )
    return app


def server_role(disaggregation_mode: str) -> str:
    return "colocated" if disaggregation_mode == "null" else disaggregation_mode


def draining_server(config: Any, control: DrainControl) -> Any:
    """uvicorn's Server whose SIGTERM / SIGINT start a drain (drain.py) instead of closing the
    listener: the server keeps answering (/health with 503, requests in flight to their end) and
    exits once drained. A second signal aborts what is left at once; a third exits without waiting.
    Unlike uvicorn it does not raise the signal again after its shutdown, so a drained server exits
    with status 0 (what a Kubernetes rolling update and a supervisor's restart count read)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        signals = 0

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            self.signals += 1
            if self.signals >= 3 or self.should_exit:
                self.should_exit = self.force_exit = True
            else:
                control.signal()

        def exit_now(self) -> None:
            self.should_exit = True  # read by uvicorn's main loop; safe from another thread

    return DrainingServer(config)


def run_server(
    cfg: ServerConfig, engine_factory: Callable[[], EngineLike] | None = None, disaggregation_mode: str = "null"
) -> int:
    """Serve until a SIGTERM / SIGINT drain ends (0, drain.py); 1 if the engine failed to load or died."""
    import uvicorn

    holder: dict[str, Any] = {}
    since = time.monotonic()

    def on_fatal(exc: BaseException) -> None:
        logger.error("engine failed (%s): shutting the server down", exc)
        holder["failed"] = exc
        server = holder.get("server")
        if server is not None:
            server.exit_now()

    # torch's thread counts are per process: set them before the engine thread loads the model
    threads = server_cpu_threads(cfg)
    apply_cpu_threads(threads)
    logger.info(threads.describe())
    tasks: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks

    def on_ready() -> None:  # on the event loop
        task = asyncio.ensure_future(announce_ready(server, cfg, server_role(disaggregation_mode), since))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    app = create_app(cfg, engine_factory, on_fatal, disaggregation_mode, threads, on_ready)
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        access_log=cfg.log_level == "debug",
        # after a drain (drain.py), connections still open this long later are closed
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        # read deadlines and the connection cap (slow clients)
        **listener_settings(cfg.listener),
    )
    if cfg.log_level != "debug":  # after uvicorn.Config: it (re)configures its loggers
        logging.getLogger("uvicorn.error").addFilter(quiet_uvicorn_start)
    control: DrainControl = app.state.kvpipe.drain
    server = draining_server(config, control)
    holder["server"] = server
    control.exit_server = server.exit_now
    server.run()
    logger.info("server stopped")
    return 1 if "failed" in holder else 0
