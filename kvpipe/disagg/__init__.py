"""PD disaggregation as KV connectors of the engine (kvpipe/engine/connector.py).

prefill.py        PrefillConnector: rooms, layer-group plans, chunk sends, room outcomes
decode.py         DecodeConnector: REMOTE admission, KVReceiver, first token from aux
worker.py         TransferWorker: one per TP rank, its own KVSender / backend (SPMD sends)
commands.py       typed messages between the connector and the ranks' workers
tally.py          a room is over when every prefill rank reported it
layer_groups.py   cost model choosing the layer groups of a prefill batch
layer_pipeline.py timing of the forward, link estimates, transfer tails
setup.py          backend, KV layout and data-plane address of a rank
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpipe.config import ServerConfig
    from kvpipe.engine.connector import KVConnector
    from kvpipe.transfer.backends.base import TransferBackend


def make_connector(cfg: ServerConfig, backend: TransferBackend | None = None) -> KVConnector | None:
    """The connector of `cfg`'s disaggregation mode (None: a colocated server)."""
    mode = cfg.disaggregation.mode
    if mode == "prefill":
        from kvpipe.disagg.prefill import PrefillConnector

        return PrefillConnector(cfg, backend)
    if mode == "decode":
        from kvpipe.disagg.decode import DecodeConnector

        return DecodeConnector(cfg, backend)
    return None
