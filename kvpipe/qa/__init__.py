"""Harnesses that judge a running stack rather than measure it: the kill -9 campaign
(`chaos*.py`), the fault-injected soak (`soak*.py`) and the leak check both run once the servers are
idle (`leaks.py`, `checks.py`). Their commands stay where users type them (`kvpipe bench chaos`,
`kvpipe bench soak`). The load driver and the emulated link are kvpipe/harness, shared with the
benchmarks; qa never imports kvpipe/bench (tests/unit/test_harness_layering.py).
"""
