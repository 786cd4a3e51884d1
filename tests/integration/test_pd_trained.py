"""PD serving of trained models (tests/helpers/trained_models.py) through sglang-router against a
colocated `kvpipe serve`, with the decode radix cache and layer groups on: SmolLM2-135M-Instruct
(the default model) at TP (1,1), (1,3), (3,1) (9 query and 3 KV heads do not split over 2);
Qwen2.5-Coder-0.5B-Instruct at (1,1), (1,2), (2,1), (2,2) (14 query and 2 KV heads), and again
with --quantization w8a16 and --kv-cache-dtype fp8_e4m3 on every server at (1,1);
Qwen2.5-Coder-1.5B-Instruct at the four pairings (all `slow` but SmolLM2's (1,1)). The same
chat prompts go, one after the other and in the same order, to `/generate` (the rendered template
as text) and `/v1/chat/completions` (the server renders it), streamed and not, greedy; tokens,
text, finish and every token's logprob are compared. A negative control corrupts one page of
SmolLM2's KV after it landed on an (in-process) decode: the same comparison fails.

Tolerance. Every server is the same binary on one thread per process (--cpu-threads 1; TP ranks
get one each), and requests go one at a time in the same order, so every forward sees the same
batch shapes and the prefix caches make the same hits on both sides. The KV moves as raw bytes.
On 1P1D the prefill's forward of a prompt (in layer groups: the same operations, cut between
layers) and the decode's steps are then the very floating-point operations of the colocated
server: tokens and logprobs must be bit-equal as float32 (tolerance 0), quantized weights and fp8
KV included. With TP on either side the row-parallel projections (o_proj, down_proj) sum partial
products in an all-reduce instead of in one GEMM, and each rank's GEMMs are narrower: a reordering
of fp32 sums and nothing else, which tests/helpers/tolerance.py bounds for the logits from fp32
eps, the logits' magnitude, the model's depth and width, with SAME_BINARY_TP_GAIN (1: about one
rounding per reordered sum, not the 32 it allows two different implementations); a logprob (a
logit minus a logsumexp) within twice that (about 7e-3 for SmolLM2, where 1.2e-5 was measured).
Tokens must still be equal. (fp8 KV is compared at (1,1) only: a reordered fp32 sum may round a
K or V element to the neighbouring fp8 value, a step of 1/8 of it, which no fp32 bound covers.)
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from kvpipe.engine.request import SamplingParams
from kvpipe.launch.process import stop_process
from kvpipe.model.checkpoint.loader import load_model
from kvpipe.model.text.tokenizer import Tokenizer
from tests.helpers import trained_models as trained
from tests.helpers.corrupt_kv import KVCorruption
from tests.helpers.paged_model import incremental_logits
from tests.helpers.pd_pair import Pair, make_pair
from tests.helpers.pd_stack import Stack, disagg_stats, generate, start_stack
from tests.helpers.server import sse_events, start_server
from tests.helpers.tolerance import SAME_BINARY_TP_GAIN, logit_atol

pytest.importorskip("mooncake.engine")
# a liveness deadline, setup included: loading a Qwen (transformers dequantizes the whole file, kvpipe
# packs it) took 2-8 minutes on a loaded 2-core host
pytestmark = pytest.mark.timeout(1800)

NEW = 12  # new tokens at most per request
Chat = list[dict[str, str]]
SMOLLM2_CHATS: list[Chat] = [
    [{"role": "user", "content": "What is the capital of France?"}],  # stops at EOS after 8 tokens
    [
        {"role": "user", "content": "Hi! Who are you?"},
        {"role": "assistant", "content": "I am SmolLM, a small AI assistant. How can I help?"},
        {"role": "user", "content": "¿Cuál es la capital de España? Responde en español."},
    ],
]
QWEN_CHATS: list[Chat] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {
            "role": "user",
            "content": "Fix the bug in this function:\n```python\ndef is_even(n):\n    return n % 2 == 1\n```",
        }
    ],
]
SERVER_FLAGS = ["--page-size", "16", "--max-total-tokens", "4096", "--chunked-prefill-size", "64", "--cpu-threads", "1"]
PD_FLAGS = [
    *SERVER_FLAGS,
    "--disaggregation-layer-groups",
    "3",
    "--disaggregation-layer-groups-min-tokens",
    "0",  # the chats are ~50 tokens: pipeline them too
    "--disaggregation-heartbeat-interval",
    "0.5",
    "--disaggregation-bootstrap-timeout",
    "30",
    "--disaggregation-transfer-timeout",
    "5",
]
QUANTIZED = ("--quantization", "w8a16", "--kv-cache-dtype", "fp8_e4m3")
START_S = 900.0  # a server loading a Qwen on a loaded 2-core host (minutes); SmolLM2 takes seconds
REQUEST_S = 600.0  # one request's deadline: 12 tokens of a 0.5B on one thread took over 120 s there


@dataclass(frozen=True)
class Setup:
    """One model with one set of server flags, and the TP pairings its PD stacks run."""

    id: str
    model: str  # a trained_models name
    flags: tuple[str, ...]  # on every server, the colocated one too
    chats: list[Chat]
    expect: tuple[tuple[int, str], ...]  # (chat index, a substring of its answer)
    pairings: tuple[tuple[int, int], ...]  # `make test` runs (1,1) of the setups and models not marked slow
    slow: bool = False

    @property
    def fp32_kv(self) -> bool:
        return "--kv-cache-dtype" not in self.flags


QWEN_PAIRINGS = ((1, 1), (1, 2), (2, 1), (2, 2))
SETUPS = {
    s.id: s
    for s in (
        Setup(
            trained.SMOLLM2, trained.SMOLLM2, (), SMOLLM2_CHATS, ((0, "Paris"), (1, "España")), ((1, 1), (1, 3), (3, 1))
        ),
        # slow too: at (1,1) the same path as SmolLM2's (1,1) on a second trained model, for 4 of make
        # test's worker-minutes on 2 cores (its reference server and its pair, one thread each); the
        # 0.5B stays exact in make test through speculative decoding (test_spec_trained_pair.py)
        # and its file against transformers' (test_gguf_trained.py)
        Setup(trained.QWEN_05B, trained.QWEN_05B, (), QWEN_CHATS, ((0, "Paris"),), QWEN_PAIRINGS, True),
        # slow: three more Qwen servers for what the quantization and KV-dtype tests on presets cover
        Setup(
            f"{trained.QWEN_05B}-w8a16-fp8kv", trained.QWEN_05B, QUANTIZED, QWEN_CHATS, ((0, "Paris"),), ((1, 1),), True
        ),
        Setup(trained.QWEN_15B, trained.QWEN_15B, (), QWEN_CHATS, ((0, "Paris"),), QWEN_PAIRINGS),
    )
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`setup` for every test that asks for it, with the pairings for the PD test."""
    if "setup" not in metafunc.fixturenames or any(
        "setup" in m.args[0] for m in metafunc.definition.iter_markers("parametrize")
    ):
        return  # a test that names its own setups
    if "p_tp" not in metafunc.fixturenames:
        cases = [pytest.param(s.id, id=s.id, marks=_marks(s, (1, 1))) for s in SETUPS.values()]
        metafunc.parametrize("setup", cases, indirect=True)
        return
    cases = [
        pytest.param(s.id, p, d, id=f"{s.id}-{p}P{d}D", marks=_marks(s, (p, d)))
        for s in SETUPS.values()
        for p, d in s.pairings
    ]
    metafunc.parametrize(("setup", "p_tp", "d_tp"), cases, indirect=["setup"])


def _marks(s: Setup, pairing: tuple[int, int]) -> list[pytest.MarkDecorator]:
    return [] if pairing == (1, 1) and not (s.slow or trained.MODELS[s.model].slow) else [pytest.mark.slow]


@dataclass(frozen=True)
class Answer:
    what: str  # "generate", "generate stream", "chat", "chat stream" of chat i
    text: str
    ids: list[int] | None  # /generate only
    logprobs: list[float]
    finish: str


def difference(want: Answer, have: Answer, tol: float) -> str | None:
    """Where `have` leaves `want` (text, ids, finish, or a logprob, as float32: sglang-router
    re-serializes the JSON numbers it forwards, which moves the last bit of a float64, never a
    float32's, and the model computes in float32), in words; None when within `tol`."""
    if have.ids is not None and want.ids is not None and have.ids != want.ids:
        pos = next((i for i, (a, b) in enumerate(zip(have.ids, want.ids)) if a != b), min(len(have.ids), len(want.ids)))
        return f"{want.what}: token ids differ from output position {pos}: {have.ids} vs {want.ids}"
    if (have.text, have.finish) != (want.text, want.finish):
        return f"{want.what}: {have.text!r} ({have.finish}) vs {want.text!r} ({want.finish})"
    if len(have.logprobs) != len(want.logprobs):
        return f"{want.what}: {len(have.logprobs)} logprobs vs {len(want.logprobs)}"
    diff = np.abs(np.float32(have.logprobs) - np.float32(want.logprobs))
    if not (diff <= tol).all():  # NaN fails too
        pos = int(np.argmax(~(diff <= tol)))
        return (
            f"{want.what}: logprob at output position {pos} off by {diff[pos]:.3g} "
            f"(largest {diff.max():.3g}, tolerance {tol:.3g})"
        )
    return None


@pytest.fixture
def setup(request: pytest.FixtureRequest) -> Setup:
    return SETUPS[request.param]


@pytest.fixture
def model(setup: Setup) -> Path:
    return trained.gguf_path(setup.model)


@pytest.fixture
def tok(setup: Setup) -> Tokenizer:
    return trained.kvpipe_tokenizer(setup.model)


@pytest.fixture
def tol(setup: Setup) -> float:
    return tp_logprob_tol(setup.model)


@pytest.fixture
def reference(setup: Setup, tmp_path_factory: pytest.TempPathFactory) -> list[Answer]:
    return colocated_answers(setup.id, tmp_path_factory.getbasetemp())


# What a setup's tests share, computed once per test process whatever order the tests run in
# (pytest's module-scoped parametrized fixtures would be rebuilt each time the setup changes).


@cache
def tp_logprob_tol(name: str) -> float:
    """2 * logit_atol (same binary, TP split) at the largest logit magnitude the model's chats'
    prompts produce, over the longest context a compared token sees (see the module's docstring).
    The model is freed before any server of the setup starts."""
    tok = trained.kvpipe_tokenizer(name)
    m = load_model(trained.gguf_path(name))
    with torch.inference_mode():
        tols = []
        for chat in next(s.chats for s in SETUPS.values() if s.model == name):
            ids = tok.encode_chat(chat)
            logits = incremental_logits(m, ids, len(ids), page_size=16)  # type: ignore[arg-type]
            tols.append(2 * logit_atol(logits, m.cfg, len(ids) + NEW, gain=SAME_BINARY_TP_GAIN))
    del m
    gc.collect()
    return max(tols)


@cache
def colocated_answers(setup_id: str, base: Path) -> list[Answer]:
    """The colocated server's answers; the server is stopped once they are in (a Qwen server holds
    GBs: the PD stacks after it run alone)."""
    setup = SETUPS[setup_id]
    tp_logprob_tol(setup.model)  # its model loads and goes before the server starts
    log = base / f"colocated-{setup_id}.log"
    srv = start_server(trained.gguf_path(setup.model), log, *SERVER_FLAGS, *setup.flags, timeout_s=START_S)
    try:
        return ask(srv.url, trained.kvpipe_tokenizer(setup.model), setup.chats)
    finally:
        stop_process(srv.proc)


def ask(url: str, tok: Tokenizer, chats: list[Chat]) -> list[Answer]:
    """Every chat through the four paths, one request at a time."""
    out = []
    for i, chat in enumerate(chats):
        body: dict[str, Any] = {
            "text": tok.apply_chat_template(chat),
            "sampling_params": {"max_new_tokens": NEW, "temperature": 0.0},
            "return_logprob": True,
        }
        for stream in (False, True):
            r = generate(url, {**body, "stream": stream}, timeout_s=REQUEST_S)
            lps = [t[0] for t in r["meta_info"]["output_token_logprobs"]]
            kind = r["meta_info"]["finish_reason"]["type"]
            out.append(Answer(f"generate{' stream' * stream} {i}", r["text"], r["output_ids"], lps, kind))
        chat_body = {"messages": chat, "max_tokens": NEW, "temperature": 0, "logprobs": True}
        out.append(chat_answer(url, chat_body, f"chat {i}"))
        out.append(chat_stream_answer(url, chat_body, f"chat stream {i}"))
    return out


def chat_answer(url: str, body: dict[str, Any], what: str) -> Answer:
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=REQUEST_S)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    lps = [t["logprob"] for t in c["logprobs"]["content"]]
    return Answer(what, c["message"]["content"], None, lps, c["finish_reason"])


def chat_stream_answer(url: str, body: dict[str, Any], what: str) -> Answer:
    text, lps, finish, chunks = [], [], None, 0
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=REQUEST_S) as r:
        assert r.status_code == 200, r.read()
        for ev in sse_events(r.iter_lines()):
            if ev == "[DONE]" or not isinstance(ev, dict) or not ev.get("choices"):
                continue
            chunks += 1
            c = ev["choices"][0]
            text.append(c["delta"].get("content") or "")
            lps += [t["logprob"] for t in (c.get("logprobs") or {}).get("content") or []]
            finish = c.get("finish_reason") or finish
    assert chunks > 2, what  # streamed token by token, not one blob
    return Answer(what, "".join(text), None, lps, str(finish))


def test_reference_answers_are_real_text(setup: Setup, reference: list[Answer], tol: float) -> None:
    """The colocated answers themselves: real text, the same on every path of a chat (the later
    paths compute the prompt after a cached prefix: other GEMM shapes, a reordering of sums like a
    TP split, so within the same tolerance rather than equal; with fp8 KV the cached prefix is read
    back rounded to fp8 where the first request attended to its own unrounded K/V, so only the
    text is compared there)."""
    for i, text in setup.expect:
        assert text in reference[4 * i].text, reference[4 * i]
    for i in range(len(setup.chats)):
        group = reference[4 * i : 4 * i + 4]
        assert len({a.text for a in group}) == 1 and group[0].ids == group[1].ids, group
        assert all(len(a.logprobs) == len(group[0].logprobs) > 0 for a in group), group
        if setup.fp32_kv:
            for a in group[1:]:
                assert max(abs(x - y) for x, y in zip(a.logprobs, group[0].logprobs)) <= tol, group


def test_pd_router_matches_colocated(
    setup: Setup,
    model: Path,
    tok: Tokenizer,
    reference: list[Answer],
    tol: float,
    tmp_path: Path,
    p_tp: int,
    d_tp: int,
) -> None:
    bound = 0.0 if p_tp == d_tp == 1 else tol
    stack = start_stack(
        model,
        tmp_path,
        *PD_FLAGS,
        *setup.flags,
        prefill_args=("--tp-size", str(p_tp)),
        decode_args=("--tp-size", str(d_tp), "--disaggregation-enable-decode-radix-cache"),
        timeout_s=START_S,
    )
    try:
        got = ask(stack.router, tok, setup.chats)
        problems = [d for want, have in zip(reference, got) if (d := difference(want, have, bound)) is not None]
        assert not problems, "\n".join(problems)
        worst = max(
            float(np.abs(np.float32(h.logprobs) - np.float32(w.logprobs)).max()) for w, h in zip(reference, got)
        )
        print(f"{setup.id} TP ({p_tp},{d_tp}): max |logprob - colocated| = {worst:.3g} (tolerance {bound:.3g})")
        check_stack(stack, len(got), p_tp, d_tp)
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.close()


def check_stack(stack: Stack, requests: int, p_tp: int, d_tp: int) -> None:
    """Every room done and every page back; the decode's radix cache served repeated prompts; the
    prefill ran in 3 layer groups."""
    p, d = stack.prefill.wait_idle(30), stack.decode.wait_idle(30)
    st = disagg_stats(stack.prefill)
    assert (st["rooms_succeeded"], st["rooms_failed"]) == (requests, 0), st
    assert (p["tp_size"], d["tp_size"]) == (p_tp, d_tp)
    assert d["prefix_hit_tokens"] > 0, d
    assert p["layer_group_batches"].get("3", 0) > 0, p["layer_group_batches"]


# on the default model: the control is of the comparison, and a Qwen pair in this process cost make test 50 s
@pytest.mark.parametrize("setup", [trained.SMOLLM2], indirect=True)
def test_a_corrupted_page_of_trained_kv_fails_the_comparison(
    setup: Setup, model: Path, tok: Tokenizer, tol: float
) -> None:
    """Negative control: the chats through a prefill and a decode engine in this process (layer
    groups on, tests/helpers/pd_pair.py), twice; the second time one page of one layer of chat 1's
    KV is overwritten on the decode after it landed and before the decode read it. The comparison
    the router test makes fails on chat 1 alone, at a decoded position (the first token is the
    prefill's), even at the TP tolerance; chat 0 stays bit-equal."""
    ps = [tok.encode_chat(c) for c in setup.chats]
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    hit = KVCorruption(layer=trained.MODELS[setup.model].layers // 2, page=1)

    def answers(pair: Pair, corrupt: bool) -> list[Answer]:
        def on_landed(pair: Pair, d: Any) -> None:
            if corrupt and d.input_ids == ps[1]:
                hit.apply(pair.decode.runner.pool, d.pages)

        reqs = [pair.reqs(ids, params) for ids in ps]
        pair.run(reqs, timeout_s=600.0, on_landed=on_landed)
        return [
            Answer(
                f"chat {i}", tok.decode(d.output_ids), list(d.output_ids), list(d.output_logprobs), str(d.finish_reason)
            )
            for i, (_, d) in enumerate(reqs)
        ]

    with make_pair(model, 0, prefill_radix_cache=False, layer_groups=3, layer_groups_min_tokens=0) as pair:
        clean, corrupted = answers(pair, False), answers(pair, True)
        pair.settle()
    assert difference(clean[0], corrupted[0], 0.0) is None
    found = difference(clean[1], corrupted[1], tol)
    assert found is not None and "position 0" not in found, found
    print(f"corrupted {hit}: {found}")
