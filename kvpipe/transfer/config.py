"""Timeouts and limits of the disaggregation control plane (one frozen config for both sides)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DisaggConfig:
    # Prefill: add_room -> the decode's TransferRequest. Decode: add_room -> TransferRequest sent
    # (bootstrap fetch, compatibility check, peer registration).
    bootstrap_timeout_s: float = 30.0
    # Decode: TransferRequest sent -> every prefill rank reported Success (SGLang's default 300 s:
    # the prefill may queue the request behind others).
    waiting_timeout_s: float = 300.0
    # A peer silent for misses * interval is dead. Lenient: on a loaded 2-core host a busy
    # process can stall for seconds, and a false death fails every room with that peer.
    heartbeat_interval_s: float = 2.0
    heartbeat_misses: int = 5
    # Prefill: a write batch fails its room when nothing to that peer completed for this long
    # (the backend's own stall detection usually fires first). Decode: a failed room whose
    # prefill never acknowledges keeps its pages reserved at most this long.
    transfer_timeout_s: float = 60.0
    max_inflight_ops: int = 1024  # per sender; Mooncake rejects past ~2,048 per peer (DESIGN §6)
    http_timeout_s: float = 2.0  # one bootstrap HTTP call
    control_send_hwm: int = 10000  # queued control messages per peer before sends are dropped
    tick_s: float = 0.0005  # worker sleep between backend polls while writes are in flight
    # ... doubled after each poll that finished nothing, up to this: on a slow link a write takes
    # far longer than a tick, and polling at 2 kHz would take CPU (and the GIL) from the prefill
    # forward that layer-pipelined transfer overlaps with
    max_tick_s: float = 0.004
    idle_tick_s: float = 0.01  # worker sleep when nothing is in flight

    def __post_init__(self) -> None:
        for name in ("bootstrap_timeout_s", "waiting_timeout_s", "heartbeat_interval_s",
                     "transfer_timeout_s", "http_timeout_s", "tick_s", "max_tick_s", "idle_tick_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"DisaggConfig.{name} must be positive, got {getattr(self, name)}")
        if self.heartbeat_misses < 1 or self.max_inflight_ops < 1 or self.control_send_hwm < 1:
            raise ValueError("DisaggConfig: heartbeat_misses, max_inflight_ops and control_send_hwm must be >= 1")

    @property
    def heartbeat_timeout_s(self) -> float:
        return self.heartbeat_interval_s * self.heartbeat_misses
