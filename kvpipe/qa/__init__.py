"""Harnesses that judge a running stack rather than measure it: the kill -9 campaign
(`chaos.py`), the fault-injected soak with leak checks (`soak*.py`) and the emulated link between
network namespaces (`testbed.py`, `testbed_cli.py`). Their commands stay where users type them
(`kvpipe bench chaos`, `kvpipe bench soak`, `kvpipe testbed`); benchmarks live in kvpipe/bench.
"""
