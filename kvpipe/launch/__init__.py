"""A local PD stack as a library: prefill and decode servers and sglang-router started as
processes on free ports, waited for, supervised and stopped. `kvpipe launch`
(kvpipe/commands/launch.py) is its command line; the benchmarks, the QA harnesses and the tests
start stacks with it too.
"""
