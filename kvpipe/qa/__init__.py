"""Harnesses that judge a running stack rather than measure it: the kill -9 campaign
(`chaos*.py`), the fault-injected soak (`soak*.py`), the leak check both run once the servers are
idle (`leaks.py`) and the emulated link between network namespaces (`testbed.py`,
`testbed_cli.py`). Their commands stay where users type them (`kvpipe bench chaos`,
`kvpipe bench soak`, `kvpipe testbed`); benchmarks and the load driver live in kvpipe/bench.
"""
