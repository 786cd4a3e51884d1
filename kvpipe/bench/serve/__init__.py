"""`kvpipe bench serve` (command.py): latency of a running server, or of a stack per mode started
here (sweeps, PD against colocated); and what per-request recording costs (recording_cost.py)."""
