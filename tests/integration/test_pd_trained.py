"""PD serving of the trained default model (SmolLM2-135M-Instruct from its GGUF) through
sglang-router against a colocated `kvpipe serve`: 1P1D, and TP (1,3) and (3,1) (9 query and
3 KV heads do not split over 2), with the decode radix cache and layer groups on. The same chat
prompts go, one after the other and in the same order, to `/generate` (the rendered template as
text) and `/v1/chat/completions` (the server renders it), streamed and not, greedy; tokens, text,
finish and every token's logprob are compared.

Tolerance. Every server is the same binary on one thread per process (--cpu-threads 1; TP ranks
get one each), and requests go one at a time in the same order, so every forward sees the same
batch shapes and the prefix caches make the same hits on both sides. The KV moves as raw bytes.
On 1P1D the prefill's forward of a prompt (in layer groups: the same operations, cut between
layers) and the decode's steps are then the very floating-point operations of the colocated
server: tokens and logprobs must be bit-equal as float32 (tolerance 0). With TP 3 on either side the
row-parallel projections (o_proj, down_proj) sum three partial products in an all-reduce instead
of in one GEMM, and each rank's GEMMs are a third as wide: a reordering of fp32 sums and nothing
else, which tests/helpers/tolerance.py bounds for the logits from fp32 eps, the logits' magnitude,
30 layers and width 576, with SAME_BINARY_TP_GAIN (1: about one rounding per reordered sum, not
the 32 it allows two different implementations); a logprob (a logit minus a logsumexp) within
twice that: about 7e-3 here, where 1.2e-5 was measured. Tokens must still be equal.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from kvpipe.model.checkpoint.default_model import default_model_path
from kvpipe.model.checkpoint.loader import load_model
from kvpipe.model.text.tokenizer import Tokenizer
from tests.helpers.paged_model import incremental_logits
from tests.helpers.pd_stack import Stack, disagg_stats, generate, start_stack
from tests.helpers.server import ServerProc, server_fixture, sse_events
from tests.helpers.tolerance import SAME_BINARY_TP_GAIN, logit_atol

pytest.importorskip("mooncake.engine")

NEW = 12  # new tokens at most per request
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],  # stops at EOS after 8 tokens
    [
        {"role": "user", "content": "Hi! Who are you?"},
        {"role": "assistant", "content": "I am SmolLM, a small AI assistant. How can I help?"},
        {"role": "user", "content": "¿Cuál es la capital de España? Responde en español."},
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
PAIRINGS = [(1, 1), (1, 3), (3, 1)]
SLOW_PAIRINGS = {(1, 3), (3, 1)}  # the full sweep (`make test-full`); 1P1D runs in `make test` (xPyD: test_launch_xpyd)


@dataclass(frozen=True)
class Answer:
    what: str  # "generate", "generate stream", "chat", "chat stream" of chat i
    text: str
    ids: list[int] | None  # /generate only
    logprobs: list[float]
    finish: str


@pytest.fixture(scope="module")
def model() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def tok(model: Path) -> Tokenizer:
    return Tokenizer.from_dir(model)


@pytest.fixture(scope="module")
def tp_logprob_tol(model: Path, tok: Tokenizer) -> float:
    """2 * logit_atol (same binary, TP split) at the largest logit magnitude the chats' prompts
    produce, over the longest context a compared token sees (see the module's docstring)."""
    m = load_model(model)
    with torch.inference_mode():
        tols = []
        for chat in CHATS:
            ids = tok.encode_chat(chat)
            logits = incremental_logits(m, ids, len(ids), page_size=16)  # type: ignore[arg-type]
            tols.append(2 * logit_atol(logits, m.cfg, len(ids) + NEW, gain=SAME_BINARY_TP_GAIN))
    return max(tols)


@pytest.fixture(scope="module")
def colocated(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    yield from server_fixture(model, tmp_path_factory.mktemp("colocated"), *SERVER_FLAGS)


@pytest.fixture(scope="module")
def reference(colocated: ServerProc, tok: Tokenizer) -> list[Answer]:
    return ask(colocated.url, tok)


def ask(url: str, tok: Tokenizer) -> list[Answer]:
    """Every chat through the four paths, one request at a time."""
    out = []
    for i, chat in enumerate(CHATS):
        body: dict[str, Any] = {
            "text": tok.apply_chat_template(chat),
            "sampling_params": {"max_new_tokens": NEW, "temperature": 0.0},
            "return_logprob": True,
        }
        for stream in (False, True):
            r = generate(url, {**body, "stream": stream})
            lps = [t[0] for t in r["meta_info"]["output_token_logprobs"]]
            kind = r["meta_info"]["finish_reason"]["type"]
            out.append(Answer(f"generate{' stream' * stream} {i}", r["text"], r["output_ids"], lps, kind))
        chat_body = {"messages": chat, "max_tokens": NEW, "temperature": 0, "logprobs": True}
        out.append(chat_answer(url, chat_body, f"chat {i}"))
        out.append(chat_stream_answer(url, chat_body, f"chat stream {i}"))
    return out


def chat_answer(url: str, body: dict[str, Any], what: str) -> Answer:
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    lps = [t["logprob"] for t in c["logprobs"]["content"]]
    return Answer(what, c["message"]["content"], None, lps, c["finish_reason"])


def chat_stream_answer(url: str, body: dict[str, Any], what: str) -> Answer:
    text, lps, finish, chunks = [], [], None, 0
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
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


def test_reference_answers_are_real_text(reference: list[Answer], tp_logprob_tol: float) -> None:
    """The colocated answers themselves: real text, the same on every path of a chat (the later
    paths compute the prompt after a cached prefix: other GEMM shapes, a reordering of sums like a
    TP split, so within the same tolerance rather than equal)."""
    assert "Paris" in reference[0].text and reference[0].finish == "stop"
    assert "España" in reference[4].text  # a 135M model: Spanish, if not the right city
    for i in range(len(CHATS)):
        group = reference[4 * i : 4 * i + 4]
        assert len({a.text for a in group}) == 1 and group[0].ids == group[1].ids, group
        assert all(len(a.logprobs) == len(group[0].logprobs) > 0 for a in group), group
        for a in group[1:]:
            assert max(abs(x - y) for x, y in zip(a.logprobs, group[0].logprobs)) <= tp_logprob_tol, group


@pytest.mark.parametrize(
    "p_tp,d_tp",
    [
        pytest.param(p, d, id=f"{p}P{d}D", marks=[pytest.mark.slow] if (p, d) in SLOW_PAIRINGS else [])
        for p, d in PAIRINGS
    ],
)
def test_pd_router_matches_colocated(
    model: Path,
    tok: Tokenizer,
    reference: list[Answer],
    tp_logprob_tol: float,
    tmp_path: Path,
    p_tp: int,
    d_tp: int,
) -> None:
    tol = 0.0 if p_tp == d_tp == 1 else tp_logprob_tol
    stack = start_stack(
        model,
        tmp_path,
        *PD_FLAGS,
        prefill_args=("--tp-size", str(p_tp)),
        decode_args=("--tp-size", str(d_tp), "--disaggregation-enable-decode-radix-cache"),
    )
    try:
        got = ask(stack.router, tok)
        worst = 0.0
        for want, have in zip(reference, got):
            assert (have.text, have.ids, have.finish) == (want.text, want.ids, want.finish), (want, have)
            assert len(have.logprobs) == len(want.logprobs), (want, have)
            # as float32 (the model's dtype): sglang-router re-serializes the JSON numbers it
            # forwards, which moves the last bit of a float64 (2.2e-16 seen), never a float32's
            have32, want32 = np.float32(have.logprobs), np.float32(want.logprobs)
            diff = float(np.abs(have32 - want32).max())
            assert diff <= tol, (want.what, diff, tol, want.logprobs, have.logprobs)
            worst = max(worst, diff)
        print(f"TP ({p_tp},{d_tp}): max |logprob - colocated| = {worst:.3g} (tolerance {tol:.3g})")
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
