"""The asyncio bridge around a real tiny Engine, without HTTP: streaming, cancellation, batches
that fail half-way, metrics. Every path must leave all KV pages free."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from kvpipe.config import CacheConfig, ServerConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import FinishReason, SamplingParams
from kvpipe.server.async_engine import AsyncEngine
from kvpipe.server.errors import APIError
from kvpipe.server.metrics import ServerMetrics
from kvpipe.server.protocol import GenerateInput

pytestmark = pytest.mark.timeout(120)


def _inp(rid: str, n: int, ids: tuple[int, ...] = (5, 6, 7, 8)) -> GenerateInput:
    return GenerateInput(
        rid=rid, input_ids=ids, params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    )


async def _started(model_dir: Path) -> AsyncEngine:
    cfg = ServerConfig(model_path=str(model_dir), cache=CacheConfig(page_size=16, max_total_tokens=2048))
    ae = AsyncEngine(lambda: Engine(cfg))
    ae.metrics = ServerMetrics("t", ae.stats)
    ae.start()
    deadline = time.monotonic() + 60
    while not ae.ready:
        assert time.monotonic() < deadline and ae.fatal_error is None
        await asyncio.sleep(0.05)
    return ae


async def _idle(ae: AsyncEngine, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        s = ae.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["free_pages"] == s["total_pages"]:
            return s
        assert time.monotonic() < deadline, s
        await asyncio.sleep(0.02)


def test_bridge(tiny_model_dir: Path) -> None:
    async def main() -> None:
        ae = await _started(tiny_model_dir)
        try:
            # streaming: cumulative outputs (a slow consumer may get several steps at once)
            outs = [o async for o in ae.submit(_inp("a", 6))]
            lens = [len(o.output_ids) for o in outs]
            assert len(outs) >= 2 and lens == sorted(set(lens)) and lens[-1] == 6
            assert outs[-1].finish_reason is FinishReason.LENGTH and not any(o.finished for o in outs[:-1])
            assert ae.num_active() == 0
            # concurrent requests with the same prompt agree (continuous batching is transparent)
            r1, r2 = await asyncio.gather(ae.submit(_inp("b", 6)).result(), ae.submit(_inp("c", 6)).result())
            assert r1.output_ids == r2.output_ids == outs[-1].output_ids

            # a consumer cancelled mid-stream aborts the request in the engine
            stream = ae.submit(_inp("d", 1500))

            async def consume() -> None:
                async for _ in stream:
                    pass

            task = asyncio.ensure_future(consume())
            while stream.tracker.first_token_time is None:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert stream.tracker.finish_reason is FinishReason.ABORT
            await _idle(ae)

            # duplicate rid is refused for that request only; the running one is unaffected
            keep = ae.submit(_inp("e", 4))
            with pytest.raises(APIError) as err:
                ae.submit(_inp("e", 4))
            assert err.value.status == 400
            assert (await keep.result()).finish_reason is FinishReason.LENGTH

            # submitted, never iterated, closed (a batch whose later prompt failed): pages come back
            orphan = ae.submit(_inp("f", 1500))
            await asyncio.sleep(0.2)
            orphan.close()
            await _idle(ae)

            # abort through the API ends the stream with an abort finish
            s = ae.submit(_inp("g", 1500))
            assert ae.abort("g") and not ae.abort("nope")
            final = await s.result()
            assert final.finish_reason is FinishReason.ABORT
            await _idle(ae)

            text = ae.metrics.render().decode()
            assert 'kvpipe_requests_total{finish_reason="abort",model_name="t"} 3.0' in text
            assert 'kvpipe_requests_total{finish_reason="length",model_name="t"} 4.0' in text
        finally:
            await ae.stop()

    asyncio.run(main())


def test_two_servers_have_separate_metrics() -> None:
    a, b = ServerMetrics("a", lambda: {"free_pages": 3, "total_pages": 4}), ServerMetrics("b", lambda: None)
    a.on_finish("stop", prompt_tokens=5, cached_tokens=0, completion_tokens=3, e2e_s=0.3, ttft_s=0.1)
    ta, tb = a.render().decode(), b.render().decode()
    assert 'kvpipe_generation_tokens_total{model_name="a"} 3.0' in ta and "kvpipe_free_pages 3.0" in ta
    assert 'kvpipe_time_per_output_token_seconds_count{model_name="a"} 1.0' in ta
    assert "generation_tokens_total{" not in tb and "kvpipe_free_pages" not in tb  # nothing from `a` leaks
