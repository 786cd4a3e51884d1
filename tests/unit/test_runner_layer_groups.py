"""ModelRunner's layer-group callback (layer-pipelined prefill, issue 34): a group's KV is handed
to the transfer as soon as the group's last layer has stored its K/V, before that layer's MLP,
complete and final; a hybrid model's group (recurrent state, final only at the group's end) after
the whole group. The grouped forward's logits are the one-pass forward's, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpipe.config import CacheConfig
from kvpipe.engine.batch import ForwardSpec
from kvpipe.engine.model_runner import ModelRunner
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.loader import load_model
from kvpipe.model.checkpoint.schema import ModelConfig
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.presets import write_preset
from tests.helpers.hf_models import prompt_ids

PAGE, TOKENS = 4, 13
TABLE, SWA_TABLE = np.arange(4, dtype=np.int64), np.arange(4, 8, dtype=np.int64)


def _spec(cfg: ModelConfig, groups: tuple[tuple[int, int], ...] | None, hybrid: bool, sliding: bool) -> ForwardSpec:
    ids = prompt_ids(TOKENS, seed=3, vocab=cfg.vocab_size)
    return ForwardSpec(
        (ids,),
        (0,),
        (TABLE,),
        (True,),
        layer_groups=groups,
        state_slots=(0,) if hybrid else None,
        swa_page_tables=(SWA_TABLE,) if sliding else None,
    )


def _layer_kv(runner: ModelRunner, layer: int) -> list[torch.Tensor]:
    """Layer `layer`'s K/V (the latent alone under MLA) of the prompt's tokens, from its own pages."""
    table = SWA_TABLE if layer in runner.pool.swa_layers else TABLE
    return [t for t in runner.pool.gather(layer, torch.from_numpy(table), TOKENS) if t is not None]


@pytest.mark.parametrize(
    "name, early", [("tiny", True), ("tiny-deepseek-v3", True), ("tiny-gpt-oss", True), ("tiny-qwen3.5", False)]
)
def test_a_group_ships_once_its_last_layer_stored_its_kv(name, early, tmp_path):
    path = write_preset(name, tmp_path)
    cfg = model_config_of(path)
    hybrid, sliding = name == "tiny-qwen3.5", name == "tiny-gpt-oss"
    runner = ModelRunner(load_model(path), CacheConfig(page_size=PAGE, num_pages=16))
    n = cfg.num_layers
    groups = ((0, 1), (1, n - 1), (n - 1, n))
    want = runner.run(_spec(cfg, None, hybrid, sliding))
    assert want is not None

    events: list[tuple] = []  # ("mlp", i) as layer i's MLP starts, ("group", start, end) as its callback runs
    for i, layer in enumerate(runner.model.layers):
        layer.mlp.register_forward_pre_hook(lambda mod, args, i=i: events.append(("mlp", i)))
    kv_then: dict[int, list[torch.Tensor]] = {}

    def on_group(start: int, end: int, fb: ForwardBatch) -> None:
        events.append(("group", start, end))
        if not hybrid:  # (a hybrid pool holds its attention layers' KV only, under other indices)
            for layer in range(start, end):
                kv_then[layer] = [t.clone() for t in _layer_kv(runner, layer)]

    got = runner.run(_spec(cfg, groups, hybrid, sliding), on_group)
    assert got is not None and torch.equal(got, want)
    for start, end in groups:
        at = events.index(("group", start, end))
        last_mlp = events.index(("mlp", end - 1))
        # early: the callback runs while the group's last layer computes (before its MLP), after every
        # earlier layer of the group; a hybrid group's after its last layer
        assert (at < last_mlp) if early else (at > last_mlp), (start, end, events)
        assert all(events.index(("mlp", i)) < at for i in range(start, end - 1))
        assert [e for e in events if e[0] == "group"].count(("group", start, end)) == 1
    # what the transfer would read at the callback is the layer's final KV
    assert hybrid or len(kv_then) == n
    for layer, tensors in kv_then.items():
        assert all(torch.equal(a, b) for a, b in zip(tensors, _layer_kv(runner, layer))), layer
