"""NEXTN's MTP KV and hidden state in the transfer layer (disagg/mtp_transfer.py): a sender book
whose draft KV sits on the target's page ids (draft_at_prefix) sends the MTP layer from the
decode's prefix on, like the target's, after the target's layers; the aux data carries the hidden
state as raw bytes that come back as the same tensor; the handshake names NEXTN (EAGLE without a
draft model is the same), the MTP layer and its KV layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpipe.bench.kv_bytes import kv_wire_bytes, with_mtp_kv
from kvpipe.config import DisaggregationConfig, ServerConfig, SpeculativeConfig, TransferTuning
from kvpipe.disagg.draft_transfer import speculative_handshake
from kvpipe.engine.spec.mtp_drafter import hidden_from_bytes, hidden_to_bytes
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.presets import preset_config, write_preset
from kvpipe.transfer.control import messages as m
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


def latent(base: int, layers: int, dim: int) -> KVLayout:
    """An MLA latent pool: one buffer per layer, one "head" of `dim`."""
    addrs = tuple(base + i * (1 << 20) for i in range(layers))
    return KVLayout(layers, PS, 1, 0, 1, dim, "float32", 4, addrs, PAGES * PS * dim * 4, buffers_per_layer=1)


SRC, DST = latent(1 << 30, L, 8), latent(1 << 40, L, 8)
SRC_MTP, DST_MTP = latent(3 << 30, 1, 8), latent(3 << 40, 1, 8)


def page_writes(book: SenderBook) -> set[tuple[int, int]]:
    """(src address, dst address) of every page planned (runs split into pages)."""
    out = set()
    take, _, _ = book.take_work(0.0)
    for _, b in take:
        for s, d, n in zip(b.src.tolist(), b.dst.tolist(), b.length.tolist()):
            pn = SRC.page_nbytes
            out |= {(s + i * pn, d + i * pn) for i in range(n // pn)}
    return out


def writes(lay: KVLayout, layers, src_pages, dst_lay: KVLayout, dst_pages) -> set[tuple[int, int]]:
    return {
        (lay.buffer_addrs[i] + int(s) * lay.page_nbytes, dst_lay.buffer_addrs[i] + int(d) * dst_lay.page_nbytes)
        for i in layers
        for s, d in zip(src_pages, dst_pages)
    }


def test_the_mtp_layer_is_sent_from_the_decode_prefix_on_the_target_pages():
    """A 10-token prompt on pages 10..12 (the MTP's are its target pages, page 11 replaced by a
    private copy 50); the decode holds its first page (4 tokens) with that page's MTP KV."""
    sent: list[object] = []
    book = SenderBook(
        CFG, SRC, 0, 1, "p/0", lambda a, msg: sent.append(msg) or True, draft_layout=SRC_MTP, draft_at_prefix=True
    )
    register_answered(book, m.RegisterPeer("d/0", 0, 1, "data-d", "tcp://d", DST, draft=DST_MTP), 0.0)
    book.add_room(1, np.arange(10, 13), 0.0, draft_pages=np.array([10, 50, 12]))
    book.on_message(m.TransferRequest(1, "d/0", (31, 32), 4, 0, dst_draft_pages=(30, 31, 32)), 0.0)
    book.add_call(1, SendCall(0, 8, 0, L + 1, False), None)  # a first chunk: full pages only
    assert page_writes(book) == writes(SRC, range(L), [11], DST, [31]) | writes(SRC_MTP, [0], [50], DST_MTP, [31])
    book.add_call(1, SendCall(8, 10, 0, L, True), (7, -0.5, 0, b"\x01" * 8))  # the last: the partial page too
    assert page_writes(book) == writes(SRC, range(L), [12], DST, [32]) | writes(SRC_MTP, [0], [12], DST_MTP, [32])
    assert book.rooms[1].aux == m.AuxData(1, 7, -0.5, 0, draft_tokens=10, hidden=b"\x01" * 8)
    assert not [s for s in sent if isinstance(s, m.TransferStatus) and s.reason]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hidden_states_travel_as_raw_bytes(dtype: torch.dtype):
    h = torch.randn(2, 24).to(dtype)
    data = hidden_to_bytes(h)
    assert len(data) == h.numel() * h.element_size()
    assert torch.equal(hidden_from_bytes(data, 24, dtype), h)
    assert hidden_from_bytes(b"", 24, dtype).shape == (0, 24)
    with pytest.raises(ValueError, match="not whole rows"):
        hidden_from_bytes(data[:-2], 24, dtype)


def test_handshake_names_nextn_its_mtp_layer_and_kv(tmp_path):
    path = write_preset("tiny-deepseek-v3", tmp_path / "ds")
    cfg = model_config_of(path)

    def handshake(algo: str) -> str:
        return speculative_handshake(ServerConfig(model_path=str(path), speculative=SpeculativeConfig(algo)), SRC_MTP)

    want = f"nextn:mtp=layer{cfg.num_layers}x1:hidden={cfg.hidden_size}:kv=float32/4/1x1x1x8:at=rank0"
    assert handshake("NEXTN") == handshake("EAGLE") == want
    with pytest.raises(ValueError, match="KV layout"):
        speculative_handshake(ServerConfig(model_path=str(path), speculative=SpeculativeConfig("NEXTN")), None)


def test_bench_serve_predicts_the_mtp_layers_kv():
    """bench serve's predicted bytes with NEXTN servers: the target's KV plus one latent layer of
    the MTP's per token, in its compute dtype; a model without an MTP layer predicts nothing."""
    ds = preset_config("tiny-deepseek-v3")
    assert ds.mla is not None
    target = kv_wire_bytes(ds, 16, 2)
    assert target is not None
    both = with_mtp_kv(target, ds, 4)
    assert both is not None and both.request_nbytes(10) == 10 * (target.full_token_nbytes + ds.mla.latent_dim * 4)
    assert with_mtp_kv(target, preset_config("tiny"), 4) is None
