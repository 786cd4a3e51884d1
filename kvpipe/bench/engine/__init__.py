"""`kvpipe bench engine` (command.py) and the engine's micro-benchmarks (decode_profile.py,
kv_kernel.py, linear_kernels.py: `python -m kvpipe.bench.engine.<name>`)."""
