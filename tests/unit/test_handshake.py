"""The PD handshake as bookkeeping (transfer/control/handshake.py, bootstrap.check_compatible):
which fields are compared, the message naming both sides' values, the /metrics label, the JSON
form a peer sends, and the refusal notice. No sockets."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvpipe.transfer.control.bootstrap import DecodeInfo, IncompatiblePeerError, PrefillInstanceInfo, check_compatible
from kvpipe.transfer.control.handshake import (
    REFUSED,
    REFUSED_STATUS,
    SPECULATIVE_NONE,
    Handshake,
    RefusalNotice,
    compare,
    describe,
    refusal_status,
)
from kvpipe.transfer.recurrent.layout import StateLayout
from tests.helpers.bootstrap_info import layout, rank_info

BASE = Handshake.of("d" * 64, layout(), (1.0, 1.0), (1.0, 1.0))


def state(tp_rank: int = 0, tp_size: int = 1, conv_dtype: str = "float32", conv_len: int = 3) -> StateLayout:
    """Rank `tp_rank` of a hybrid model with 4 layers (1 and 3 linear), 2 key and 4 value heads."""
    heads, keys = 4 // tp_size, 2 // tp_size
    return StateLayout(
        num_model_layers=4,
        kv_layers=(0, 2),
        linear_layers=(1, 3),
        num_slots=8,
        conv_dim=2 * keys * 16 + heads * 32,
        conv_len=conv_len,
        heads=heads,
        key_dim=16,
        value_dim=32,
        conv_dtype=conv_dtype,
        conv_itemsize=4,
        conv_addrs=(1 << 30, 2 << 30),
        recurrent_addrs=(3 << 30, 4 << 30),
        key_head_start=tp_rank * keys,
        value_head_start=tp_rank * heads,
        total_key_heads=2,
        total_value_heads=4,
    )


def test_of_describes_the_instance_not_the_rank():
    """TP ranks of one instance (other head ranges, other addresses) give the same handshake."""
    ranks = [Handshake.of("x", layout(1, r, base=(r + 1) << 24), state=state(r, 2)) for r in range(2)]
    assert ranks[0] == ranks[1] == Handshake.of("x", layout(), state=state())
    h = ranks[0]
    assert (h.kv_dtype, h.page_size, h.kv_kind, h.kv_layers, h.kv_heads, h.head_dim) == ("float32", 4, 2, 2, 2, 8)
    assert h.state_layers == (1, 3) and h.state_conv_shape == (2 * 2 * 16 + 4 * 32, 3)
    assert h.state_recurrent_shape == (4, 16, 32) and h.speculative == SPECULATIVE_NONE
    assert h.quantization == "none" and Handshake.of("x", layout(), quantization="w8a16").quantization == "w8a16"


def test_equal_handshakes_have_no_mismatch():
    assert compare(BASE, dataclasses.replace(BASE)) == ()


@pytest.mark.parametrize(
    "change, label, words",
    [
        ({"model_digest": "e" * 64}, "model", f"model (checkpoint digest): prefill '{'d' * 64}', decode '{'e' * 64}'"),
        ({"kv_dtype": "float8_e4m3fn"}, "kv_dtype", "KV cache dtype: prefill 'float32', decode 'float8_e4m3fn'"),
        ({"page_size": 64}, "page_size", "page size: prefill 4, decode 64"),
        ({"kv_heads": 4}, "kv_layout", "KV heads (whole model): prefill 2, decode 4"),
        ({"kv_kind": 1}, "kv_layout", "KV kind (2: K and V, 1: MLA latent): prefill 2, decode 1"),
        ({"swa_layers": (1,)}, "kv_layout", "sliding-window layers: prefill (), decode (1,)"),
        ({"v_scales": (1.0, 0.5)}, "kv_scales", "fp8 V scales: prefill (1.0, 1.0), decode (1.0, 0.5)"),
        ({"state_conv_dtype": "bfloat16"}, "state_layout", "conv state dtype: prefill '', decode 'bfloat16'"),
        (
            {"speculative": "eagle:steps=3"},
            "speculative",
            "speculative decoding: prefill 'none', decode 'eagle:steps=3'",
        ),
        ({"quantization": "w4a16"}, "quantization", "weight quantization: prefill 'none', decode 'w4a16'"),
    ],
)
def test_each_field_is_named_with_both_values(change, label, words):
    [m] = compare(BASE, dataclasses.replace(BASE, **change))
    assert m.reason == label and m.describe() == words
    assert describe((m,)) == f"{REFUSED}: {words}"


def test_every_mismatch_is_named_in_field_order():
    other = dataclasses.replace(BASE, page_size=64, kv_dtype="bfloat16", state_conv_dtype="float32")
    ms = compare(BASE, other)
    assert [m.reason for m in ms] == ["kv_dtype", "page_size", "state_layout"]
    assert describe(ms) == (
        f"{REFUSED}: KV cache dtype: prefill 'float32', decode 'bfloat16'; page size: prefill 4, decode 64; "
        "conv state dtype: prefill '', decode 'float32'"
    )


def test_long_lists_name_their_first_difference():
    scales = tuple(1.0 for _ in range(30))
    a = dataclasses.replace(BASE, kv_layers=30, k_scales=scales, v_scales=scales)
    b = dataclasses.replace(a, k_scales=scales[:17] + (0.25,) + scales[18:])
    [m] = compare(a, b)
    assert m.describe() == "fp8 K scales: prefill 1.0, decode 0.25 at index 17 of 30"


def test_json_round_trip_and_malformed_peers():
    h = Handshake.of("x", layout(), (1.0, 2.0), (0.5, 1.0), state=state())
    assert Handshake.from_dict(json.loads(json.dumps(h.to_dict()))) == h
    good = h.to_dict()
    for bad, err in [
        ({**good, "extra": 1}, ValueError),
        ({**good, "page_size": True}, TypeError),  # a bool is no int
        ({**good, "page_size": 0}, ValueError),
        ({**good, "k_scales": [1.0]}, ValueError),  # one scale per KV layer
        ({**good, "k_scales": [1.0, float("inf")]}, ValueError),
        ({**good, "state_layers": ["1"]}, TypeError),
        ({**good, "state_layers": list(range(1 << 17))}, TypeError),
        ({**good, "kv_dtype": 3}, TypeError),
        ([good], TypeError),
    ]:
        with pytest.raises(err):
            Handshake.from_dict(bad)
    with pytest.raises(TypeError, match="page_size"):  # a missing field
        Handshake.from_dict({k: v for k, v in good.items() if k != "page_size"})


def instance(h: Handshake | None, model: str = "m") -> PrefillInstanceInfo:
    return PrefillInstanceInfo("inst", 1, model, (dataclasses.replace(rank_info(model=model), handshake=h),))


def test_check_compatible_refuses_another_handshake_with_its_reason():
    with pytest.raises(IncompatiblePeerError) as e:
        check_compatible(instance(BASE), DecodeInfo("m", 1, (layout(),), dataclasses.replace(BASE, page_size=8)))
    assert e.value.reason == "page_size" and str(e.value).startswith(f"{REFUSED}: page size: prefill 4, decode 8")
    assert "prefill instance inst" in str(e.value)
    check_compatible(instance(BASE), DecodeInfo("m", 1, (layout(),), BASE))  # the same: accepted


@pytest.mark.parametrize("prefill_has, decode_has", [(True, False), (False, True)])
def test_a_handshake_on_one_side_only_is_refused(prefill_has, decode_has):
    with pytest.raises(IncompatiblePeerError) as e:
        check_compatible(
            instance(BASE if prefill_has else None), DecodeInfo("m", 1, (layout(),), BASE if decode_has else None)
        )
    assert e.value.reason == "handshake"


def test_the_served_name_is_still_compared_and_labelled():
    with pytest.raises(IncompatiblePeerError) as e:
        check_compatible(instance(BASE, model="other"), DecodeInfo("m", 1, (layout(),), BASE))
    assert e.value.reason == "model_name" and "served model name: prefill 'other', decode 'm'" in str(e.value)


def test_refusal_notice_round_trip_and_limits():
    n = RefusalNotice((1, 2, (1 << 63) - 1), f"{REFUSED}: page size", "page_size", BASE)
    assert RefusalNotice.from_dict(json.loads(json.dumps(n.to_dict()))) == n
    good = n.to_dict()
    for bad in [
        {**good, "rooms": []},
        {**good, "rooms": [-1]},
        {**good, "rooms": [1 << 63]},
        {**good, "rooms": [True]},
        {**good, "rooms": list(range(4097))},
        {**good, "label": "not a label"},
        {**good, "reason": 5},
    ]:
        with pytest.raises(ValueError):
            RefusalNotice.from_dict(bad)
    assert len(RefusalNotice.from_dict({**good, "reason": "x" * 5000}).reason) == 1024


def test_refusal_status_marks_refusals_only():
    assert refusal_status(f"KV transfer failed: {REFUSED}: page size ...") == REFUSED_STATUS == 409
    assert refusal_status("KV transfer failed: bootstrap timeout") is None
    assert refusal_status(None) is None and refusal_status(3) is None
