"""Every family's preset uses its context: the same last prompt token after other earlier tokens
changes the next token's logprob by far more than any exactness tolerance, and the greedy tokens of
most prompts. Without that, a wrong KV page, head or state slot could leave the exactness tests'
outputs unchanged (presets whose next token follows the last one alone)."""

from __future__ import annotations

import pytest

from kvpipe.commands.init_model import PRESETS
from kvpipe.model.presets import write_preset
from tests.helpers.engine import assert_context_matters, make_engine, one_at_a_time, prompts

# one preset per family (tiny-kv4 and bench are Llamas of other sizes)
# every family's tiny preset: init-model's list without `bench` (the dense Llama at a larger size)
FAMILY_PRESETS = [p for p in PRESETS if p != "bench"]
PROMPTS = prompts()[1:]  # 5 to 150 tokens: a 1-token prompt has no context to change


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_the_same_last_token_after_another_context_gives_other_outputs(name, tmp_path):
    eng = make_engine(write_preset(name, tmp_path / name))
    try:
        assert_context_matters(eng, PROMPTS, one_at_a_time(eng, PROMPTS))
    finally:
        eng.shutdown()
