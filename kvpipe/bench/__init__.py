"""Benchmarks, one subpackage per benchmark, its command in `command.py`:

engine/     `kvpipe bench engine`: the offline engine against HF transformers and llama.cpp; the
            decode-step profile and the kernels' micro-benchmarks (`python -m kvpipe.bench.engine.<name>`)
transfer/   `kvpipe bench transfer`: KV goodput between two processes over Mooncake against raw transfers
serve/      `kvpipe bench serve`: latency of a server, or of a stack per mode started here
kv_store/   `kvpipe bench kv-store`: the KV tier on Mooncake Store
accuracy/   `kvpipe bench kv-accuracy`, `kvpipe bench quant-accuracy`
workload.py the synthetic serving workload; rotation.py variant order by round; kv_bytes.py a
            request's KV bytes on the wire

Requests go out through the load driver of kvpipe/harness, which the QA harnesses (kvpipe/qa)
share; bench never imports qa (the allow list of docs/architecture.md, tests/unit/test_layering.py).
"""
