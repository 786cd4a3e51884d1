"""Helpers of the NEXTN (MTP drafter) PD tests: what the MTP layer's KV weighs on the wire, the
decode's MTP state when a request's KV landed, and the check that no MTP state is left."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvpipe.engine.engine import Engine
from kvpipe.engine.request import Req
from kvpipe.model.config import ModelConfig
from tests.helpers.pd_pair import Pair


def mtp_kv_bytes(model_dir: Path, lens: list[int], page_size: int, itemsize: int = 4) -> int:
    """The MTP layer's KV of prompts of `lens` tokens: whole pages, one layer, in the model's
    dtype (`itemsize`): DeepSeek-V3's latent, or Qwen3.5's full-attention K and V of every KV head."""
    mc = ModelConfig.from_dir(model_dir)
    per_token = mc.mla.latent_dim if mc.mla is not None else 2 * mc.num_kv_heads * mc.head_dim
    return sum(-(-n // page_size) for n in lens) * page_size * per_token * itemsize


def mtp_state_at_landing(landed: dict[str, tuple[int, int, int]]) -> Callable[[Pair, Req], None]:
    """Pair.run's on_landed: (valid MTP KV positions, hidden rows, hidden size) the decode's MTP
    state holds for the request when its KV landed, before any decode step."""

    def keep(pair: Pair, d: Req) -> None:
        mtp = pair.decode.mtp
        assert mtp is not None
        seq = mtp.seqs.get(d.rid)
        landed[d.rid] = (-1, 0, 0) if seq is None else (seq.valid, *seq.hidden.shape)

    return keep


def assert_no_mtp_state(engine: Engine) -> None:
    mtp = engine.mtp
    assert mtp is not None and not mtp.seqs, None if mtp is None else list(mtp.seqs)
    assert len(mtp.free_private) == mtp.num_private  # every copy-on-write page is back
