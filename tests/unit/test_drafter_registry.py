"""The drafter registry (engine/spec/registry.py): one entry per --speculative-algorithm that
config.py accepts, capabilities that agree with what config.py refuses, unknown names refused
with the known ones named, and where each drafter's KV lives (what PD moves)."""

import pytest

from kvpipe.config import SPECULATIVE_ALGORITHMS, SPECULATIVE_NOT_YET, ConfigError, SpeculativeConfig
from kvpipe.engine.request import Req, SamplingParams
from kvpipe.engine.spec.ngram_drafter import NgramDrafter, propose_ngram
from kvpipe.engine.spec.registry import DRAFTERS, DraftKV, DraftModelPath, draft_kv, drafter_entry, drafter_named


def test_every_algorithm_config_accepts_has_an_entry_and_no_other():
    assert tuple(DRAFTERS) == SPECULATIVE_ALGORITHMS
    assert all(name == e.name for name, e in DRAFTERS.items())


@pytest.mark.parametrize("name", ["MEDUSA", "", *SPECULATIVE_NOT_YET])
def test_unknown_names_are_refused_naming_the_known_ones(name):
    with pytest.raises(ConfigError) as e:
        drafter_named(name)
    assert repr(name) in str(e.value) and "NGRAM, STANDALONE, NEXTN, EAGLE" in str(e.value)


def test_names_are_case_insensitive_and_off_has_no_entry():
    assert drafter_named("nextn") is DRAFTERS["NEXTN"]
    assert drafter_entry(SpeculativeConfig("ngram")) is DRAFTERS["NGRAM"]
    assert drafter_entry(SpeculativeConfig()) is None and draft_kv(SpeculativeConfig()) is DraftKV.NONE


def test_where_the_draft_kv_lives():
    kinds = {name: e.draft_kv for name, e in DRAFTERS.items()}
    assert kinds == {
        "NGRAM": DraftKV.NONE,
        "STANDALONE": DraftKV.SHARDED,
        "NEXTN": DraftKV.RANK0,
        "EAGLE": DraftKV.RANK0,
    }
    assert draft_kv(SpeculativeConfig("EAGLE", draft_model_path="/m/head")) is DraftKV.RANK0


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_the_draft_model_capability_is_what_config_accepts(name):
    """REQUIRED: refused without --speculative-draft-model-path; NEVER: refused with one;
    OPTIONAL: both run."""

    def accepted(path):
        try:
            SpeculativeConfig(name, draft_model_path=path)
        except ConfigError:
            return False
        return True

    need = DRAFTERS[name].draft_model
    assert accepted("/m/draft") == (need is not DraftModelPath.NEVER)
    assert accepted(None) == (need is not DraftModelPath.REQUIRED)


def test_the_ngram_drafter_proposes_what_prompt_lookup_finds():
    spec = SpeculativeConfig("NGRAM", ngram_min_match_window_size=1, ngram_max_match_window_size=2)
    drafter = NgramDrafter(spec)
    req = Req("r", [1, 2, 3, 9, 2, 3], SamplingParams(max_new_tokens=8))
    req.output_ids = [9, 2]
    assert drafter.propose(req, 3) == propose_ngram(req.all_ids, 3, 1, 2) == [3, 9, 2]
    assert not drafter.moves_kv and not drafter.uses_target_hidden and drafter.moving_pool() == (None, None)
