"""What the benchmarks (kvpipe/bench) and the QA harnesses (kvpipe/qa) share, below both: neither
imports the other (the allow list of docs/architecture.md, tests/unit/test_layering.py).

request.py      what the load driver sends: one request as data and its JSON body
driver.py       the load driver: sends requests (httpx, asyncio), one Outcome per request
outcome.py      how one request ended, and when
answers.py      what a server's answer says (pure): SSE lines, error bodies, tokens, finish reasons
latency.py      TTFT/TPOT/ITL statistics of a run from its Outcomes (pure)
probe.py        what a harness asks a running server (/server_info, /metrics, model info)
machine.py      the CPU, the usable cores and the load average a report names
sigterm.py      SIGTERM as SystemExit while a command runs, so servers it started are stopped
testbed.py      the emulated link between two network namespaces (tc tbf)
testbed_cli.py  `kvpipe testbed up/down/status`
"""
