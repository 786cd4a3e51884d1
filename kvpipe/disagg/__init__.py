"""PD disaggregation as KV connectors of the engine (kvpipe/engine/connector.py).

connectors.py      make_connector: the connector of a server's disaggregation mode
prefill.py         PrefillConnector: rooms, layer-group plans, chunk sends, room outcomes
decode.py          DecodeConnector: REMOTE admission, KVReceiver, first token from aux
pd_connector.py    what both connectors share: rank 0's TransferWorker, room claims, rank start-up
transfer_worker.py TransferWorker: one per TP rank, its own KVSender / backend (SPMD sends)
commands.py        typed messages between the connector and the ranks' workers
tally.py           a room is over when every prefill rank reported it
layer_groups.py    cost model choosing the layer groups of a prefill batch
layer_pipeline.py  timing of the forward, link estimates, transfer tails
observer.py        TransferObserver and the prefill's TransferCounters (layer-group choices, tails)
setup.py           backend, KV layout and data-plane address of a rank
timeline_events.py a room's bootstrap and transfer times as phases of its request's timeline
"""
