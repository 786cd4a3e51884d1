"""An EAGLE head's part of PD (disagg/mtp_transfer.py): the handshake names EAGLE, the head's
checkpoint digest, the hidden size the aux carries and the head's K/V layout, so servers whose
heads differ (or one without a head) refuse each other; bench serve predicts the bytes per
request as the target's KV plus one layer of the head's K and V."""

from __future__ import annotations

from pathlib import Path

from kvpipe.bench.kv_bytes import kv_wire_bytes
from kvpipe.bench.serve.sweep_run import _model_bytes
from kvpipe.config import ServerConfig, SpeculativeConfig
from kvpipe.disagg.draft_transfer import speculative_handshake
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.identity import checkpoint_digest
from kvpipe.transfer.planning.layout import KVLayout
from tests.helpers.draft_models import write_eagle_head

PS = 4


def gqa(kv_heads: int, head_dim: int, pages: int = 64) -> KVLayout:
    """A one-layer K/V pool (TP 1) as the handshake sees it."""
    nbytes = pages * PS * kv_heads * head_dim * 4
    return KVLayout(1, PS, kv_heads, 0, kv_heads, head_dim, "float32", 4, (1 << 30, 2 << 30), nbytes)


def test_handshake_names_the_head_and_its_kv(tiny_model_dir: Path, tmp_path: Path):
    a, b = write_eagle_head(tiny_model_dir, tmp_path / "a", seed=1), write_eagle_head(tiny_model_dir, tmp_path / "b")
    cfg = model_config_of(tiny_model_dir)
    lay = gqa(cfg.num_kv_heads, cfg.head_dim)

    def handshake(spec: SpeculativeConfig) -> str:
        return speculative_handshake(ServerConfig(model_path=str(tiny_model_dir), speculative=spec), lay)

    got = handshake(SpeculativeConfig("EAGLE", draft_model_path=str(a)))
    kv = f"float32/{PS}/2x1x{cfg.num_kv_heads}x{cfg.head_dim}"  # K and V, one layer, the head's KV heads
    want = f"eagle:head={checkpoint_digest(a)}:hidden={cfg.hidden_size}:kv={kv}:at=rank0"
    assert got == want
    assert got != handshake(SpeculativeConfig("EAGLE", draft_model_path=str(b)))  # another head's weights
    assert handshake(SpeculativeConfig("EAGLE")).startswith("nextn:")  # no path: NEXTN's
    assert handshake(SpeculativeConfig()) == "none"


def test_bench_serve_predicts_the_heads_kv(tiny_model_dir: Path, tmp_path: Path):
    head = write_eagle_head(tiny_model_dir, tmp_path / "h")
    cfg = model_config_of(tiny_model_dir)
    target = kv_wire_bytes(cfg, 16, 4)
    assert target is not None
    args = ("--page-size", "16", "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(head))
    kv, state = _model_bytes(str(tiny_model_dir), args)
    assert kv is not None and state == 0
    assert kv.request_nbytes(10) == target.request_nbytes(10) + 10 * 2 * cfg.num_kv_heads * cfg.head_dim * 4
