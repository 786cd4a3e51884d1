"""kvpipe's test suite: tests/unit (no servers, processes or process groups), tests/integration
(servers, subprocesses and TP process groups on loopback), tests/gpu (needs CUDA). What the tests
share is in tests/helpers and in the conftest.py fixtures; no test module imports another."""
