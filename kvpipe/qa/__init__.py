"""Harnesses that judge a running stack rather than measure it: the kill -9 campaign
(`chaos*.py`), the fault-injected soak (`soak*.py`) and the leak check both run once the servers are
idle (`leaks.py`, `checks.py`). Their commands stay where users type them (`kvpipe bench chaos`,
`kvpipe bench soak`). The load driver and the emulated link are kvpipe/harness, shared with the
benchmarks; qa never imports kvpipe/bench (the allow list of docs/architecture.md, tests/unit/test_layering.py).
"""
