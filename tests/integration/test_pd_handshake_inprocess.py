"""A prefill and a decode that must not exchange KV (another KV dtype, page size or checkpoint
under the same name), in one process (tests/helpers/pd_pair.py: real bootstrap server, real ZMQ):
the first request fails on both sides with the handshake's reason, long before the prefill's
bootstrap timeout could have fired, both count the refusal by reason, and no page, room or slot
is left behind; the same when only one side decodes with a STANDALONE draft model (its draft KV
moves with the target's). Then a matching pair serves."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvpipe.config import SpeculativeConfig
from kvpipe.engine.request import FinishReason
from kvpipe.model.presets.writer import write_preset
from kvpipe.transfer.control.bootstrap import report_refusal
from kvpipe.transfer.control.handshake import REFUSED, RefusalNotice
from kvpipe.transfer.control.messages import room_claim
from tests.helpers.pd_pair import make_pair

BOOTSTRAP_S = 30.0  # the prefill's bootstrap timeout: far beyond RUN_S, so it cannot be what fails the request
RUN_S = 10.0  # both sides must have answered within this (a deadline, not a measurement)
PROMPT = [5, 17, 33, 2, 91, 40, 8, 64, 3, 12, 77, 21, 9, 50, 6, 1, 30, 44, 13, 29]


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny preset written with another seed, in a directory of the same name: the same
    served model name and config, different weights."""
    return write_preset("tiny", tmp_path_factory.mktemp("other-seed") / tiny_model_dir.name, seed=1)


def refused_both_sides(pair, what: str, label: str) -> None:
    p, d = pair.reqs(PROMPT)
    p_out, d_out = pair.run([(p, d)], timeout_s=RUN_S)
    for side, outs in (("prefill", p_out), ("decode", d_out)):
        last = outs[p.rid][-1]
        assert last.finish_reason is FinishReason.ABORT, (side, last)
        assert REFUSED in str(last.finish_detail) and what in str(last.finish_detail), (side, last.finish_detail)
        assert "not done within" not in str(last.finish_detail)  # not the bootstrap timeout
    p_stats = pair.prefill.connector.stats()["disaggregation"]
    d_stats = pair.decode.connector.stats()["disaggregation"]
    assert p_stats["handshakes_refused"] == {label: 1} and d_stats["handshakes_refused"] == {label: 1}
    assert d_stats["bootstrap_fetches"] == 1 and pair.receiver.stats.registrations == 0  # nothing registered
    assert p_stats["bytes_written"] == 0
    pair.settle()  # every page free on both sides
    assert pair.sender.num_rooms() == 0 and pair.receiver.num_rooms() == 0
    assert pair.prefill.connector.stats()["disaggregation"]["active_rooms"] == 0


@pytest.mark.parametrize(
    "decode_cache, what, label",
    [
        ({"kv_cache_dtype": "fp8_e4m3"}, "KV cache dtype: prefill 'float32', decode 'float8_e4m3fn'", "kv_dtype"),
        ({"page_size": 64}, "page size: prefill 16, decode 64", "page_size"),
    ],
)
def test_mismatched_pool_is_refused_on_both_sides(tiny_model_dir: Path, decode_cache, what, label):
    with make_pair(tiny_model_dir, decode_cache=decode_cache, bootstrap_timeout_s=BOOTSTRAP_S) as pair:
        refused_both_sides(pair, what, label)
        # every request is refused alike (the address is not black-listed: it answers each time)
        p_out, d_out = pair.run([pair.reqs(PROMPT)], timeout_s=RUN_S)
        assert all(REFUSED in str(o[-1].finish_detail) for o in (*p_out.values(), *d_out.values()))
        pair.settle()


def test_another_checkpoint_under_the_same_name_is_refused(tiny_model_dir: Path, other_checkpoint: Path):
    with make_pair(tiny_model_dir, decode_model_dir=other_checkpoint, bootstrap_timeout_s=BOOTSTRAP_S) as pair:
        assert pair.prefill.cfg.model_name == pair.decode.cfg.model_name
        refused_both_sides(pair, "model (checkpoint digest): prefill '", "model")


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_draft_model_on_one_side_only_is_refused(tiny_model_dir: Path, side: str):
    """A STANDALONE draft model on one side only: the prefill would send draft KV nobody holds, or
    the decode wait for draft KV nobody sends; refused by the `speculative` field."""
    spec = SpeculativeConfig("STANDALONE", num_steps=2, draft_model_path=str(tiny_model_dir))
    kw = {f"{side}_speculative": spec}
    with make_pair(tiny_model_dir, bootstrap_timeout_s=BOOTSTRAP_S, **kw) as pair:
        mine = "'standalone:draft="
        want = f"prefill {mine}" if side == "prefill" else f"prefill 'none', decode {mine}"
        refused_both_sides(pair, f"speculative decoding: {want}", "speculative")


def test_another_quantization_is_refused(tiny_model_dir: Path):
    """The same checkpoint and KV pool, but the decode's weights quantized (--quantization): its
    KV values and logits would differ from what the prefill computes, so the pair is refused."""
    with make_pair(tiny_model_dir, decode_config={"quantization": "w8a16"}, bootstrap_timeout_s=BOOTSTRAP_S) as pair:
        refused_both_sides(pair, "weight quantization: prefill 'none', decode 'w8a16'", "quantization")


def test_the_same_checkpoint_elsewhere_serves(tiny_model_dir: Path, tmp_path: Path):
    """The same checkpoint written twice (another directory, same seed) is the same model."""
    twin = write_preset("tiny", tmp_path / tiny_model_dir.name, seed=0)
    with make_pair(tiny_model_dir, decode_model_dir=twin, bootstrap_timeout_s=BOOTSTRAP_S) as pair:
        p, d = pair.reqs(PROMPT)
        _, d_out = pair.run([(p, d)], timeout_s=60.0)
        assert d_out[d.rid][-1].finish_reason is FinishReason.LENGTH
        assert pair.decode.connector.stats()["disaggregation"]["handshakes_refused"] == {}
        pair.settle()


def test_a_refusal_cannot_fail_a_room_its_decode_asked_for(tiny_model_dir: Path):
    """A refusal notice for a room a (compatible, registered) decode asked for is ignored: the room
    was not refused by its own decode, and a notice must not fail another decode's transfer."""
    with make_pair(tiny_model_dir, bootstrap_timeout_s=BOOTSTRAP_S) as pair:
        p, d = pair.reqs(PROMPT)
        assert d.bootstrap_room is not None
        pair.decode.add_request(d)
        end = time.monotonic() + RUN_S
        while not pair.sender.is_bound(d.bootstrap_room):  # the decode's request reached the prefill
            assert time.monotonic() < end, "the decode never asked for the room"
            pair.decode.step()
        forged = RefusalNotice((d.bootstrap_room,), f"{REFUSED}: forged", "page_size")
        report_refusal("127.0.0.1", pair.bootstrap_port, forged)
        assert pair.prefill_connector.refused.snapshot() == {}
        pair.run([(p, None)], timeout_s=60.0, until=lambda: p.finished and d.finished)
        assert p.finish_reason is FinishReason.LENGTH and d.finish_reason is FinishReason.LENGTH
        pair.settle()


def test_a_refusal_without_the_requests_claim_cannot_fail_it(tiny_model_dir: Path):
    """Issue 45, finding 6: a holder of the token who learnt a room id posts a refusal for it before
    the request reaches either server (the decode has asked for nothing yet), without the room's
    claim or with another; the request is served."""
    with make_pair(tiny_model_dir, bootstrap_timeout_s=BOOTSTRAP_S) as pair:
        p, d = pair.reqs(PROMPT)
        assert d.bootstrap_room is not None
        other = room_claim(d.bootstrap_room, [1, 2, 3])
        for claims in ((), (other,)):
            forged = RefusalNotice((d.bootstrap_room,), f"{REFUSED}: forged", "page_size", None, claims)
            report_refusal("127.0.0.1", pair.bootstrap_port, forged)
        _, d_out = pair.run([(p, d)], timeout_s=60.0)
        assert p.finish_reason is FinishReason.LENGTH and d_out[d.rid][-1].finish_reason is FinishReason.LENGTH
        pair.settle()
