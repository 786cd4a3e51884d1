"""How `kvpipe launch` splits the cores between prefill and decode (pure functions)."""

from __future__ import annotations

import pytest

from kvpipe.launch.core_split import CoreSplit, ServerCores, flag_value, has_flag, server_cores, split_cores


@pytest.mark.parametrize(
    "cores, prefill, decode",
    [
        ((0, 1), (0,), (1,)),
        ((0, 1, 2), (0, 1), (2,)),
        ((0, 1, 2, 3), (0, 1), (2, 3)),
        ((7, 3, 5, 1, 9), (1, 3, 5), (7, 9)),  # sorted, prefill gets the larger half
    ],
)
def test_split_is_disjoint_and_covers_every_core(
    cores: tuple[int, ...], prefill: tuple[int, ...], decode: tuple[int, ...]
) -> None:
    s = split_cores(cores)
    assert (s.prefill, s.decode) == (prefill, decode)
    assert s.disjoint and set(s.prefill) | set(s.decode) == set(cores)
    assert len(s.prefill) >= len(s.decode) >= 1


def test_one_core_is_shared() -> None:
    s = split_cores([4])
    assert s == CoreSplit((4,), (4,)) and not s.disjoint
    assert "shared" in s.describe()


def test_no_cores_is_an_error() -> None:
    with pytest.raises(ValueError):
        split_cores([])


def test_each_server_gets_threads_of_its_share_and_is_pinned() -> None:
    p, d = server_cores(split_cores(range(4)), both=["--page-size", "16"], prefill=[], decode=[])
    assert p == ServerCores(("--cpu-threads", "2"), (0, 1))
    assert d == ServerCores(("--cpu-threads", "2"), (2, 3))


def test_one_core_limits_threads_without_pinning() -> None:
    p, d = server_cores(split_cores([0]), [], [], [])
    assert p == d == ServerCores(("--cpu-threads", "1"), None)


def test_user_threads_win_per_server() -> None:
    split = split_cores(range(2))
    p, d = server_cores(split, ["--cpu-threads", "2"], [], [])
    assert p == d == ServerCores((), None)  # for both: neither is split nor pinned
    p, d = server_cores(split, [], ["--cpu-threads=3"], [])
    assert p == ServerCores((), None) and d == ServerCores(("--cpu-threads", "1"), (1,))
    p, d = server_cores(split, [], [], ["--cpu-threads", "1"])
    assert p == ServerCores(("--cpu-threads", "1"), (0,)) and d == ServerCores((), None)


def test_flag_value() -> None:
    assert flag_value(["--x", "--tokenizer-path", "t"], "--tokenizer-path") == "t"
    assert flag_value(["--tokenizer-path=a", "--tokenizer-path", "b"], "--tokenizer-path") == "b"  # the last wins
    assert flag_value(["--tokenizer-path"], "--tokenizer-path") is None  # no value
    assert flag_value(["--tokenizer-paths", "x"], "--tokenizer-path") is None


def test_has_flag() -> None:
    assert has_flag(["--x", "--cpu-threads", "2"], "--cpu-threads")
    assert has_flag(["--cpu-threads=2"], "--cpu-threads")
    assert not has_flag(["--cpu-threads-extra", "2", "cpu-threads"], "--cpu-threads")
