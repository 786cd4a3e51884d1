"""glibc accepts the malloc settings model processes run with."""

import platform

import pytest

from kvpipe.engine.host_memory import MMAP_THRESHOLD_MAX, tune_malloc


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_tune_malloc_is_accepted_and_idempotent():
    first, second = tune_malloc(), tune_malloc()
    assert first.applied and second == first
    assert first.mmap_threshold == MMAP_THRESHOLD_MAX == 32 << 20
