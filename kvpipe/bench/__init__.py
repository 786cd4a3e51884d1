"""Benchmarks: `kvpipe bench engine` (engine.py, the offline engine against HF transformers),
`kvpipe bench transfer` (transfer*.py, KV goodput between two processes over Mooncake against raw
transfers) and `kvpipe bench serve` (serve*.py, latency of a server or of a stack per mode started
here). The load driver (driver.py: requests as data in request.py, how each ended in outcome.py)
is the one every harness sends requests with, the QA harnesses in kvpipe/qa too. May import the
rest of kvpipe and, of kvpipe/qa, only the emulated link (harness/testbed.py).
"""
