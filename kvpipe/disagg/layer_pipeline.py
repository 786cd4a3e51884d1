"""Layer-pipelined prefill, the engine side: per batch, choose the layer groups, time the forward,
feed the planner's estimators, and keep the choices for logs, /server_info and /metrics.

The PrefillConnector calls, per prefill batch (engine thread, rank 0):

    choice = pipe.begin(batch_tokens, tokens_to_send, states_to_send)   # right before the forward
    pipe.end()                                          # after the forward
and, as rooms finish, `pipe.observe_link(busy_bytes, busy_s)` with the sender's cumulative
link counters (kvpipe.transfer.sender.stats.SenderStats) and `pipe.room_done(timing, forward_done_at)`
per room that succeeded (its log line and the transfer tail that stayed exposed).

Compute time on CPU is host wall time (the forward is synchronous); on CUDA it is the elapsed time
between two timing events, read once the end event completed (never a synchronize).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvpipe.disagg.layer_groups import GroupChoice, LayerGroupPlanner, LayerGroupPolicy
from kvpipe.disagg.observer import TransferCounters, TransferObserver
from kvpipe.transfer.sender.stats import TransferTiming

logger = logging.getLogger(__name__)

# Link samples smaller than this are kept accumulating: a few pages are mostly per-op latency.
MIN_LINK_SAMPLE_BYTES = 256 * 1024


class LayerPipeline:
    def __init__(
        self,
        policy: LayerGroupPolicy,
        num_layers: int,
        token_nbytes: int,
        device: torch.device | str = "cpu",
        clock: Callable[[], float] = time.perf_counter,
        observers: Sequence[TransferObserver] = (),
        state_nbytes: int = 0,
    ) -> None:
        """`observers` hear every batch's choice and every landed room, besides `counters`.
        `state_nbytes`: a hybrid model's recurrent state of one request (this rank), 0 otherwise."""
        self.policy = policy
        self.planner = LayerGroupPlanner(policy, num_layers)
        self.num_layers = num_layers
        self.token_nbytes = token_nbytes  # KV bytes of one token over all KV layers (this rank)
        # sent once per request with its last forward, whatever the prompt's length
        self.state_nbytes = state_nbytes
        self.device = torch.device(device)
        self._clock = clock
        self.counters = TransferCounters()
        self.observers: tuple[TransferObserver, ...] = (self.counters, *observers)
        self._tokens = 0  # tokens of the batch being forwarded
        self._send_tokens = 0  # of which go to a decode
        self._t0: float | None = None
        self._cuda_start: Any = None
        self._cuda_pending: list[tuple[int, Any, Any]] = []  # (tokens, start event, end event)
        self._link_base = (0, 0.0)  # sender's (busy_bytes, busy_s) at the last sample

    @property
    def last(self) -> GroupChoice:
        return self.planner.last

    def begin(
        self, tokens: int, send_tokens: int, send_states: int = 0, send_kv_bytes: int | None = None
    ) -> GroupChoice:
        """Choose the groups of a prefill batch of `tokens` new tokens, `send_tokens` of which
        go to a decode, with the final state of `send_states` requests (hybrid models: their
        last forward); starts its compute timer. `send_kv_bytes`: the KV bytes of those tokens
        when not send_tokens x token_nbytes (sliding-window layers send their window only:
        kvpipe.transfer.planning.wire_bytes)."""
        kv = send_tokens * self.token_nbytes if send_kv_bytes is None else send_kv_bytes
        choice = self.planner.choose(tokens, kv + send_states * self.state_nbytes)
        for obs in self.observers:
            obs.on_layer_groups(tokens, choice)
        self._tokens = tokens
        self._poll_cuda()
        if self.device.type == "cuda":
            self._cuda_start = torch.cuda.Event(enable_timing=True)
            self._cuda_start.record()
        else:
            self._t0 = self._clock()
        self._send_tokens = send_tokens
        return choice

    def end(self) -> None:
        """The last layer group of the batch was issued (CPU: computed)."""
        if self.device.type == "cuda":
            if self._cuda_start is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._cuda_pending.append((self._tokens, self._cuda_start, end))
                self._cuda_start = None
            self._log()  # the forward's time is known once its end event completed
            return
        if self._t0 is not None:
            ms = (self._clock() - self._t0) * 1e3
            self.planner.compute.observe(self._tokens, self.num_layers, ms)
            self._t0 = None
            self._log(ms)

    def _log(self, forward_ms: float | None = None) -> None:
        c = self.planner.last
        # per batch: DEBUG (--log-level debug); the choices are counted in stats() and /metrics
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "prefill batch of %d tokens (%d to send): %d layer group%s (%s; estimated C %s ms, "
                "T %s ms, TTFT %s ms); forward took %s ms",
                self._tokens,
                self._send_tokens,
                c.groups,
                "s" if c.groups > 1 else "",
                c.reason,
                _ms(c.compute_ms),
                _ms(c.transfer_ms),
                _ms(c.predicted_ms),
                _ms(forward_ms),
            )

    def _poll_cuda(self) -> None:
        while self._cuda_pending and self._cuda_pending[0][2].query():
            tokens, start, end = self._cuda_pending.pop(0)
            self.planner.compute.observe(tokens, self.num_layers, start.elapsed_time(end))

    def observe_link(self, busy_bytes: int, busy_s: float) -> None:
        """The sender's cumulative (bytes, seconds) of finished busy periods; a sample is taken
        once enough bytes accumulated since the last one."""
        b0, s0 = self._link_base
        db, ds = busy_bytes - b0, busy_s - s0
        if db >= MIN_LINK_SAMPLE_BYTES and ds > 0:
            self.planner.link.observe(db, ds * 1e3)
            self._link_base = (busy_bytes, busy_s)

    def room_done(self, timing: TransferTiming | None, forward_done_at: float | None) -> None:
        """A room's KV all landed. `forward_done_at`: when its last prefill forward ended (the
        sender's clock, time.monotonic). What is left after that forward is the transfer time
        the request saw exposed on the prefill side (`transfer_tail_ms`)."""
        if timing is None:
            return
        span = (
            timing.last_done_at - timing.first_submit_at
            if timing.first_submit_at is not None and timing.last_done_at is not None
            else 0.0
        )
        tail = (
            timing.last_done_at - forward_done_at
            if forward_done_at is not None and timing.last_done_at is not None
            else None
        )
        for obs in self.observers:
            obs.on_room_landed(timing, None if tail is None else tail * 1e3)
        logger.debug(
            "room %d: %d bytes written, link busy %.0f ms, first write to last done %.0f ms, "
            "last done %s ms after the forward",
            timing.room,
            timing.nbytes,
            timing.busy_s * 1e3,
            span * 1e3,
            _ms(None if tail is None else tail * 1e3),
        )

    def stats(self) -> dict[str, Any]:
        last = self.planner.last
        rate = self.planner.link.bytes_per_ms
        return {
            "policy": "auto" if self.policy.fixed_groups is None else self.policy.fixed_groups,
            "num_groups": last.groups,
            "reason": last.reason,
            "predicted_ms": last.predicted_ms,
            "compute_ms": last.compute_ms,
            "transfer_ms": last.transfer_ms,
            "batches_by_groups": {str(k): v for k, v in sorted(self.counters.batches_by_groups.items())},
            "reasons": dict(self.counters.reasons),
            "link_goodput_gbps": None if rate is None else rate * 8e3 / 1e9,
        }


def _ms(v: float | None) -> str:
    return "?" if v is None else f"{v:.0f}"
