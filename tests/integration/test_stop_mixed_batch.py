"""Finish rules per request inside one batch, through a real server: one batched `/generate` puts
requests with different EOS handling, stop token ids, max_new_tokens and stop strings (spanning
two tokens, inside the first token, kept with no_stop_trim) into the same engine batch; each ends
exactly where its own rules say, its text is cut exactly there, the others run on unaffected,
and a stream shows nothing it later takes back.

Every expectation comes from the greedy reference of each prompt run alone (ignore_eos, N tokens)
and the model's own tokenizer. Runs on the tiny preset and on SmolLM2-135M-Instruct (real text,
EOS in the middle of the batch): its GGUF written out as an HF directory, and the GGUF itself
once `--model-path` takes one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpipe.model.text.tokenizer import Tokenizer
from tests.helpers.server import ServerProc, server_fixture, sse_events
from tests.helpers.trained_models import gguf_path, kvpipe_tokenizer

pytestmark = pytest.mark.timeout(600)

N = 24  # reference length
QUESTIONS = ["What is the capital of France?", "Say hello in Japanese.", "Name three colors.", "What is 2+2?"]


@dataclass
class Model:
    name: str
    server: ServerProc
    tok: Tokenizer


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[Model]:
    if request.param == "tiny":
        path, tok = tiny_model_dir, Tokenizer.from_dir(tiny_model_dir)
    else:  # SmolLM2-135M-Instruct's GGUF: real weights, its tokenizer and chat template
        path, tok = gguf_path(), kvpipe_tokenizer()
    for srv in server_fixture(path, tmp_path_factory.mktemp(f"stop_{request.param}")):
        yield Model(request.param, srv, tok)


@dataclass
class Ref:
    """One prompt's greedy reference: ids and the text of each prefix of them, as shown
    (special tokens skipped) and with special tokens as their text."""

    prompt: str
    ids: list[int]
    prefix_texts: list[str]  # prefix_texts[k] = decode(ids[:k]), skip_special_tokens
    prefix_raw: list[str]  # decode(ids[:k], skip_special_tokens=False)

    def shown(self, k: int) -> str:
        """What a stream shows after k tokens: complete characters only."""
        return self.prefix_texts[k].rstrip("\ufffd")

    def first_stop(self, stop: str) -> tuple[int, int]:
        """(m, pos): the engine stops at token m, the first after which the stop string is in
        either view of the output; pos: where it is in the shown text (-1: not there)."""
        for m in range(len(self.ids) + 1):
            if stop in self.prefix_texts[m] or stop in self.prefix_raw[m]:
                return m, self.prefix_texts[m].find(stop)
        raise AssertionError(f"{stop!r} not in the reference")

    def spanning_stop(self) -> str:
        """Two characters, the last one shown after token k and the next one, completed by a
        later token (several later where a character spans tokens), whose first match is there."""
        final = self.shown(len(self.ids))
        for k in range(1, len(self.ids)):
            p = len(self.shown(k)) - 1
            if p < 0 or p + 2 > len(final):
                continue
            stop = final[p : p + 2]
            m, pos = self.first_stop(stop)
            if pos == p and m > k:
                return stop
        raise AssertionError(f"no stop string spans two tokens of {final!r}")


def generate(srv: ServerProc, prompts: list[str], params: list[dict[str, Any]]) -> list[dict]:
    r = srv.post("/generate", json={"text": prompts, "sampling_params": params})
    assert r.status_code == 200, r.text
    return r.json()


def generate_stream(srv: ServerProc, prompts: list[str], params: list[dict[str, Any]]) -> dict[int, list[dict]]:
    """Each index's streamed events, in order."""
    events: dict[int, list[dict]] = {}
    body = {"text": prompts, "sampling_params": params, "stream": True}
    with httpx.stream("POST", srv.url + "/generate", json=body, timeout=300.0) as r:
        assert r.status_code == 200
        for e in sse_events(r.iter_lines()):
            if isinstance(e, dict):
                events.setdefault(e["index"], []).append(e)
    return events


@pytest.fixture(scope="module")
def refs(model: Model) -> list[Ref]:
    tok = model.tok
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    out = []
    for p in prompts:
        r = generate(model.server, [p], [{"max_new_tokens": N, "temperature": 0, "ignore_eos": True}])[0]
        ids = r["output_ids"]
        assert len(ids) == N
        texts = [tok.decode(ids[:k]) for k in range(N + 1)]
        out.append(Ref(p, ids, texts, [tok.decode(ids[:k], skip_special_tokens=False) for k in range(N + 1)]))
    return out


@dataclass
class Case:
    name: str
    ref: Ref
    params: dict[str, Any]
    ids: list[int]  # expected output_ids
    text: str  # expected text
    finish: dict[str, Any]  # expected meta_info.finish_reason
    stop: str | None = None  # a stop string the stream must never show


def cases(model: Model, refs: list[Ref]) -> list[Case]:
    tok = model.tok
    greedy = {"temperature": 0, "max_new_tokens": N}
    out = [Case("plain", refs[0], {**greedy, "ignore_eos": True}, refs[0].ids, refs[0].prefix_texts[N], _length(N))]

    # EOS honoured (ignore_eos false), shown with no_stop_trim and skip_special_tokens false
    r = refs[3]
    k = next((i for i, t in enumerate(r.ids) if t in tok.eos_token_ids), None)
    params = {**greedy, "no_stop_trim": True, "skip_special_tokens": False}
    if k is None:  # the tiny random model may never say EOS in N tokens: it runs to the length
        out.append(Case("eos", r, params, r.ids, tok.decode(r.ids, skip_special_tokens=False), _length(N)))
    else:
        ids = r.ids[: k + 1]
        out.append(Case("eos", r, params, ids, tok.decode(ids, skip_special_tokens=False), _stop(r.ids[k])))

    # a stop token id: kept in output_ids, left out of the text
    r = refs[1]
    t = r.ids[4]
    m = r.ids.index(t) + 1
    p = {**greedy, "ignore_eos": True, "stop_token_ids": [t]}
    out.append(Case("stop_token_id", r, p, r.ids[:m], tok.decode(r.ids[: m - 1]), _stop(t)))

    r = refs[2]
    p = {**greedy, "ignore_eos": True, "max_new_tokens": 5}
    out.append(Case("max_new_tokens", r, p, r.ids[:5], r.prefix_texts[5], _length(5)))

    # stop strings across a token boundary, trimmed and kept
    for name, r, keep in (("span", refs[0], False), ("span_no_stop_trim", refs[1], True)):
        stop = r.spanning_stop()
        m, pos = r.first_stop(stop)
        p = {**greedy, "ignore_eos": True, "stop": [stop], "no_stop_trim": keep}
        text = r.prefix_texts[m][: pos + (len(stop) if keep else 0)]
        out.append(Case(name, r, p, r.ids[:m], text, _stop(stop), None if keep else stop))

    # a stop string inside the first token
    r = next((r for r in refs if r.shown(1).strip()), None)
    assert r is not None, "no prompt's first token is text"
    stop = r.shown(1).strip()[:2]
    pos = r.prefix_texts[1].index(stop)
    p = {**greedy, "ignore_eos": True, "stop": [stop, "never-generated-xyz"]}
    out.append(Case("first_token", r, p, r.ids[:1], r.prefix_texts[1][:pos], _stop(stop), stop))
    return out


def _length(n: int) -> dict[str, Any]:
    return {"type": "length", "length": n}


def _stop(matched: int | str) -> dict[str, Any]:
    return {"type": "stop", "matched": matched}


def test_each_request_ends_by_its_own_rules(model: Model, refs: list[Ref]) -> None:
    cs = cases(model, refs)
    got = generate(model.server, [c.ref.prompt for c in cs], [c.params for c in cs])
    for c, g in zip(cs, got):
        assert g["output_ids"] == c.ids, c.name
        assert g["text"] == c.text, c.name
        assert g["meta_info"]["finish_reason"] == c.finish, c.name
    model.server.wait_idle()  # requests stopped by a string in the server were aborted in the engine


def test_streamed_batch_shows_nothing_it_takes_back(model: Model, refs: list[Ref]) -> None:
    cs = cases(model, refs)
    events = generate_stream(model.server, [c.ref.prompt for c in cs], [c.params for c in cs])
    assert sorted(events) == list(range(len(cs)))
    for i, c in enumerate(cs):
        texts = [e["text"] for e in events[i]]
        final = events[i][-1]
        assert final["text"] == c.text and final["output_ids"] == c.ids, c.name
        assert final["meta_info"]["finish_reason"] == c.finish, c.name
        assert all(e["meta_info"]["finish_reason"] is None for e in events[i][:-1]), c.name
        assert all(c.text.startswith(t) for t in texts), (c.name, texts)  # only ever grows
        assert all("\ufffd" not in t for t in texts if "\ufffd" not in c.text), c.name
        if c.stop is not None:
            assert all(c.stop not in t for t in texts), c.name
    model.server.wait_idle()
