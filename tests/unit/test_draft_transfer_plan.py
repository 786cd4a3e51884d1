"""A STANDALONE draft model's KV in the transfer layer (disagg/draft_transfer.py): a sender book
with a draft layout plans the draft's pages as the layers after the target's (from logical page 0
whatever prefix the decode holds, chunk by chunk and as its own layer group), only for a decode
that asked for them, and says in the aux data how many tokens it sent; registrations and requests
are checked against the draft pool; the messages round-trip; the handshake names the draft."""

from __future__ import annotations

import numpy as np

from kvpipe.config import DisaggregationConfig, ServerConfig, SpeculativeConfig, TransferTuning
from kvpipe.disagg.draft_transfer import speculative_handshake
from kvpipe.transfer.control import messages as m
from kvpipe.transfer.control.handshake import SPECULATIVE_NONE
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.sender.book import SenderBook
from kvpipe.transfer.sender.plan_types import SendCall
from tests.helpers.registered import register_answered

L, PS, PAGES = 2, 4, 64
CFG = DisaggregationConfig(
    bootstrap_timeout_s=5,
    waiting_timeout_s=50,
    heartbeat_interval_s=1,
    heartbeat_misses=3,
    transfer_timeout_s=10,
    tuning=TransferTuning(max_inflight_ops=1 << 20),
)


def layout(base: int, layers: int = L, heads: int = 2, head_dim: int = 8) -> KVLayout:
    page = heads * PS * head_dim * 4
    addrs = tuple(base + i * (1 << 20) for i in range(2 * layers))
    return KVLayout(layers, PS, heads, 0, heads, head_dim, "float32", 4, addrs, PAGES * page)


# the target: 2 layers of 2 heads x 8; the draft: 1 layer of 1 head x 4 (its own page size in bytes)
SRC, DST = layout(1 << 30), layout(1 << 40)
SRC_DRAFT, DST_DRAFT = layout(3 << 30, 1, 1, 4), layout(3 << 40, 1, 1, 4)
SRC_PAGES, SRC_DRAFT_PAGES = np.arange(10, 13), np.arange(20, 23)  # a 10-token prompt: 3 pages


def writes(lay: KVLayout, layers, src_pages, dst_lay: KVLayout, dst_pages) -> set[tuple[int, int]]:
    """(src address, dst address) of every page written, per layer, K and V."""
    sp, dp = lay.page_nbytes, dst_lay.page_nbytes
    return {
        (lay.buffer_addrs[2 * i + kv] + int(s) * sp, dst_lay.buffer_addrs[2 * i + kv] + int(d) * dp)
        for i in layers
        for kv in (0, 1)
        for s, d in zip(src_pages, dst_pages)
    }


class Book:
    def __init__(self, peer_draft: KVLayout | None = DST_DRAFT, own_draft: KVLayout | None = SRC_DRAFT):
        self.sent: list[object] = []
        send = lambda a, msg: self.sent.append(msg) or True  # noqa: E731
        self.book = SenderBook(CFG, SRC, 0, 1, "p/0", send, draft_layout=own_draft)
        register_answered(self.book, m.RegisterPeer("d/0", 0, 1, "data-d", "tcp://d", DST, draft=peer_draft), 0.0)

    def request(self, room: int, prefix: int = 0, draft: tuple[int, ...] | None = (40, 41, 42)) -> None:
        pages = tuple(range(30 + prefix // PS, 33))
        self.book.on_message(m.TransferRequest(room, "d/0", pages, prefix, 0, dst_draft_pages=draft), 0.0)

    def planned(self) -> set[tuple[int, int]]:
        out = set()
        take, _, _ = self.book.take_work(0.0)
        for _, b in take:
            for s, d, n in zip(b.src.tolist(), b.dst.tolist(), b.length.tolist()):
                # split runs into pages: a draft page is smaller than a target page
                pn = SRC.page_nbytes if s < (3 << 30) else SRC_DRAFT.page_nbytes
                dn = DST.page_nbytes if s < (3 << 30) else DST_DRAFT.page_nbytes
                out |= {(s + i * pn, d + i * dn) for i in range(n // pn)}
        return out

    def reasons(self) -> dict[int, str]:
        return {s.room: s.reason for s in self.sent if isinstance(s, m.TransferStatus) and s.reason}


def test_draft_pages_go_after_the_target_from_page_zero_chunk_by_chunk():
    """The decode holds a 4-token prefix of the target's KV (page 0), none of the draft's."""
    b = Book()
    b.book.add_room(1, SRC_PAGES, 0.0, draft_pages=SRC_DRAFT_PAGES)
    b.request(1, prefix=4)
    b.book.add_call(1, SendCall(0, 8, 0, L + 1, False), None)  # a first chunk: full pages only
    assert b.planned() == writes(SRC, range(L), [11], DST, [31]) | writes(SRC_DRAFT, [0], [20, 21], DST_DRAFT, [40, 41])
    b.book.add_call(1, SendCall(8, 10, 0, L + 1, True), (7, -0.5))  # the last: the partial page too
    assert b.planned() == writes(SRC, range(L), [12], DST, [32]) | writes(SRC_DRAFT, [0], [22], DST_DRAFT, [42])
    assert b.book.rooms[1].aux == m.AuxData(1, 7, -0.5, 0, draft_tokens=10)


def test_draft_layers_are_their_own_layer_group():
    b = Book()
    b.book.add_room(2, SRC_PAGES, 0.0, draft_pages=SRC_DRAFT_PAGES)
    b.request(2)
    b.book.add_call(2, SendCall(0, 10, 0, L, False), None)  # the target's groups: no draft page
    assert b.planned() == writes(SRC, range(L), [10, 11], DST, [30, 31])
    b.book.add_call(2, SendCall(0, 10, L, L + 1, False), None)  # the draft's group
    assert b.planned() == writes(SRC_DRAFT, [0], [20, 21], DST_DRAFT, [40, 41])
    b.book.add_call(2, SendCall(0, 10, 0, L + 1, True), (7, -0.5))
    assert b.planned() == writes(SRC, range(L), [12], DST, [32]) | writes(SRC_DRAFT, [0], [22], DST_DRAFT, [42])


def test_no_draft_pages_no_draft_writes():
    """A decode that reserved no draft pages gets the target's KV only; a room without draft pages
    here sends none and its aux says 0 draft tokens (the decode then computes the draft itself)."""
    b = Book()
    b.book.add_room(3, SRC_PAGES, 0.0, draft_pages=SRC_DRAFT_PAGES)
    b.request(3, draft=None)
    b.book.add_call(3, SendCall(0, 10, 0, L + 1, True), (7, -0.5))
    assert b.planned() == writes(SRC, range(L), [10, 11, 12], DST, [30, 31, 32])
    b.book.add_room(4, SRC_PAGES, 0.0)
    b.request(4)
    b.book.add_call(4, SendCall(0, 10, 0, L + 1, True), (7, -0.5))
    assert b.planned() == writes(SRC, range(L), [10, 11, 12], DST, [30, 31, 32])
    assert b.book.rooms[4].aux == m.AuxData(4, 7, -0.5)


def test_registrations_with_another_draft_pool_are_refused():
    """Refused at registration; the session's requests are answered with the reason."""
    other = Book(peer_draft=layout(3 << 40, 2, 1, 4))
    other.request(8)
    assert "draft-model KV pool incompatible: number of layers mismatch" in other.reasons()[8]
    no_draft_here = Book(own_draft=None)
    no_draft_here.request(9)
    assert "this prefill has no draft model" in no_draft_here.reasons()[9]


def test_requests_name_draft_pages_inside_a_registered_draft_pool():
    b = Book()
    b.request(5, draft=(40, 41, PAGES))
    b.request(6, draft=(40, 40, 41))
    reasons = b.reasons()
    assert "outside the decode's draft pool" in reasons[5] and "duplicate draft pages" in reasons[6]
    none = Book(peer_draft=None)
    none.request(7)
    assert "registered no draft-model KV pool" in none.reasons()[7]


def test_protocol_round_trip_with_draft_kv():
    for msg in (
        m.RegisterPeer("d/0", 0, 1, "x", "tcp://x", DST, draft=DST_DRAFT),
        m.TransferRequest(5, "d/0", (4, 5), 0, 1, dst_draft_pages=(8, 9)),
        m.TransferStatus(5, "d/0", m.WireState.SUCCESS, aux=m.AuxData(5, 1, -0.5, 0, draft_tokens=9), sender="p/0"),
    ):
        assert m.decode(m.encode(msg)) == msg


def test_handshake_names_the_draft_model_and_its_kv(tiny_model_dir):
    ngram = ServerConfig(model_path=str(tiny_model_dir), speculative=SpeculativeConfig("NGRAM"))
    assert speculative_handshake(ngram, None) == SPECULATIVE_NONE  # NGRAM moves nothing
    spec = SpeculativeConfig("STANDALONE", draft_model_path=str(tiny_model_dir))
    s = speculative_handshake(ServerConfig(model_path=str(tiny_model_dir), speculative=spec), SRC_DRAFT)
    assert s.startswith("standalone:draft=") and s.endswith(":kv=float32/4/2x1x1x4")
    # no draft KV moves (a hybrid target or draft): the decode's draft catches up on the prompt
    none = speculative_handshake(ServerConfig(model_path=str(tiny_model_dir), speculative=spec), None)
    assert none.startswith("standalone:draft=") and none.endswith(":kv=none") and none != s
