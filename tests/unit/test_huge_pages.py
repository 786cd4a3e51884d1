"""huge_pages.py: the arena starts on a 2 MiB boundary, relocated tensors keep shape, dtype and
values, an original nobody refers to any more is freed before the next one is copied, a model's
parameters keep their objects and ties, and KVPIPE_HUGE_PAGES=0 moves nothing."""

from __future__ import annotations

import sys
import weakref

import pytest
import torch
from torch import nn

from kvpipe.model.cpu import huge_pages
from kvpipe.model.cpu.huge_pages import HUGE_PAGE, arena, place_weights, relocate


def test_arena_is_aligned_and_relocate_keeps_values() -> None:
    a = arena(3 * HUGE_PAGE + 5)
    assert a.data_ptr() % HUGE_PAGE == 0 and a.numel() == 3 * HUGE_PAGE + 5
    ts = [torch.randn(3, 5), torch.arange(7, dtype=torch.int8), torch.randn(4, 6).t(), torch.tensor([1.5])]
    moved = relocate(ts)
    for t, m in zip(ts, moved, strict=True):
        assert m.dtype == t.dtype and m.shape == t.shape and m.is_contiguous() and torch.equal(m, t)
        assert m.data_ptr() % huge_pages.ALIGN == 0
    assert len({m.untyped_storage().data_ptr() for m in moved}) == 1  # one arena


def test_relocate_lets_each_original_go_before_the_next_copy() -> None:
    """What keeps a model's load from holding its weights twice (place_weights drops each original
    in `moved`): when copy i is made, originals 0..i-1 are already freed."""
    ts = [torch.randn(64, 64) for _ in range(4)]
    want = [t.clone() for t in ts]
    refs = [weakref.ref(t) for t in ts]
    alive_at_copy: list[list[bool]] = []

    def moved(i: int, copy: torch.Tensor) -> None:
        alive_at_copy.append([r() is not None for r in refs])
        ts[i] = copy

    out = relocate(ts, moved)
    assert alive_at_copy == [[j >= i for j in range(4)] for i in range(4)]
    assert all(torch.equal(o, w) for o, w in zip(out, want, strict=True))


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8, bias=False)
        self.b.weight = nn.Parameter(self.a.weight.detach().t().contiguous())
        self.head = nn.Linear(16, 8, bias=False)
        self.head.weight = self.b.weight  # tied: one Parameter in two modules
        self.register_buffer("table", torch.randn(5, 3))


@pytest.mark.skipif(sys.platform != "linux", reason="huge pages are Linux's")
def test_place_weights_moves_every_tensor_once_and_keeps_parameters(monkeypatch) -> None:
    monkeypatch.delenv("KVPIPE_HUGE_PAGES", raising=False)
    m = _Tied()
    params = {n: p for n, p in m.named_parameters(remove_duplicate=False)}
    before = {n: t.clone() for n, t in m.state_dict(keep_vars=False).items()}
    x = torch.randn(2, 8)
    want = m.head(m.a(x))
    nbytes = place_weights(m)
    assert nbytes == sum(t.numel() * 4 for t in before.values()) - m.b.weight.numel() * 4  # the tie once
    assert all(p is dict(m.named_parameters(remove_duplicate=False))[n] for n, p in params.items())
    assert m.head.weight is m.b.weight
    storages = {t.untyped_storage().data_ptr() for t in m.state_dict().values()}
    assert len(storages) == 1
    for n, t in m.state_dict().items():
        assert torch.equal(t, before[n]), n
    assert torch.equal(m.head(m.a(x)), want)


def test_switch_off_moves_nothing(monkeypatch) -> None:
    monkeypatch.setenv("KVPIPE_HUGE_PAGES", "0")
    m = _Tied()
    ptr = m.a.weight.data_ptr()
    assert place_weights(m) == 0 and m.a.weight.data_ptr() == ptr
