"""What the kill -9 campaign does: its configuration, the server flags that make a dead peer
noticed in seconds, and the seeded plan of (target, phase) per round."""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import Enum

from kvpipe.launch.stack import PARTS
from kvpipe.launch.supervisor import RestartPolicy

TP_CHILD = "tp-child"
# The lifecycle tests' timeouts: a peer silent for 5 heartbeats (2.5 s) is dead, a bootstrap or
# transfer that does not progress fails in seconds, so in-flight requests end quickly.
FAST_FLAGS = (
    "--page-size",
    "16",
    "--max-total-tokens",
    "32768",
    "--chunked-prefill-size",
    "128",
    "--disaggregation-heartbeat-interval",
    "0.5",
    "--disaggregation-bootstrap-timeout",
    "5",
    "--disaggregation-waiting-timeout",
    "20",
    "--disaggregation-transfer-timeout",
    "3",
)
LONG_PROMPT = 4000  # tokens: ~30 chunks of 128, seconds of prefill to kill into


class Phase(Enum):
    BOOTSTRAP = "bootstrap"
    TRANSFER = "transfer"
    DECODE = "decode"


@dataclass(frozen=True)
class ChaosConfig:
    rounds: int = 20
    seed: int = 0
    clients: int = 3
    tp_side: str | None = None  # "prefill" or "decode": served with --tp-size 2, TP-child rounds added
    tp_rounds: int = 2  # of `rounds`, when tp_side is set
    inflight_deadline_s: float = 40.0  # a request in flight at the kill ends by then
    recover_timeout_s: float = 120.0  # kill -> part healthy and a request through the router succeeds
    idle_timeout_s: float = 30.0
    model_path: str | None = None
    log_dir: str | None = None
    server_args: tuple[str, ...] = FAST_FLAGS
    policy: RestartPolicy = RestartPolicy(max_restarts=5, window_s=60.0, backoff_s=1.0, backoff_max_s=8.0)

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.clients < 0 or self.tp_side not in (None, "prefill", "decode"):
            raise ValueError(f"invalid chaos config: {self}")


def plan_rounds(cfg: ChaosConfig) -> list[tuple[str, Phase]]:
    """(target, phase) per round: every part x phase pairing equally often (seeded order), then
    the TP-child rounds at seeded places."""
    rng = random.Random(cfg.seed)
    n_tp = min(cfg.tp_rounds, cfg.rounds) if cfg.tp_side else 0
    combos = [(t, p) for t in PARTS for p in Phase]
    plan: list[tuple[str, Phase]] = []
    while len(plan) < cfg.rounds - n_tp:
        batch = combos[:]
        rng.shuffle(batch)
        plan += batch
    plan = plan[: cfg.rounds - n_tp]
    for _ in range(n_tp):
        plan.insert(rng.randrange(len(plan) + 1), (TP_CHILD, rng.choice(list(Phase))))
    return plan
