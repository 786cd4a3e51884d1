"""/server_info's speculative settings under SGLang's names, resolved from their defaults, with
the draft model's path for admins only."""

from __future__ import annotations

from kvpipe.config import NGRAM_DEFAULT_DRAFT_TOKENS, SpeculativeConfig
from kvpipe.server.info_routes import redacted, speculative_info


def test_off_is_all_none() -> None:
    assert set(speculative_info(SpeculativeConfig()).values()) == {None}


def test_defaults_are_resolved() -> None:
    ngram = speculative_info(SpeculativeConfig("NGRAM"))
    assert ngram["speculative_num_draft_tokens"] == NGRAM_DEFAULT_DRAFT_TOKENS
    assert ngram["speculative_num_steps"] == NGRAM_DEFAULT_DRAFT_TOKENS - 1
    assert speculative_info(SpeculativeConfig("NGRAM", num_steps=2))["speculative_num_draft_tokens"] == 3


def test_the_draft_models_path_is_for_admins() -> None:
    info = speculative_info(SpeculativeConfig("STANDALONE", draft_model_path="/models/draft"))
    assert info["speculative_draft_model_path"] == "/models/draft"
    assert redacted(info)["speculative_draft_model_path"] is None
    assert redacted(info)["speculative_algorithm"] == "STANDALONE"
