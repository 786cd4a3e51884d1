"""The drafter registry: each --speculative-algorithm name (SGLang's) to what it needs, how its
draft KV lives and moves, and its drafter's checks and constructor.

Everything that dispatches on the algorithm reads its entry: the engine refuses what cannot run
with `check` (before any TP rank starts) and builds its drafter with `build`; TP children load a
draft model shard when `draft_kv` is SHARDED (the engine tells them, engine/tp_group.py); PD picks
how the draft KV registers and moves from the same field (disagg/transfer_worker.py,
disagg/mtp_transfer.py, disagg/draft_transfer.py). `config.SPECULATIVE_ALGORITHMS` (the flag's
choices, validated where flags are parsed) names the same algorithms, and each entry's
`draft_model` says what kvpipe/config/server.py accepts for --speculative-draft-model-path
(tests/unit/test_drafter_registry.py holds the two together).

A new drafter: one module implementing `Drafter` (engine/spec/drafter.py) and one entry here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpipe.config import ConfigError, ServerConfig, SpeculativeConfig
from kvpipe.engine.spec.draft_model import DraftModel, check_draft_model
from kvpipe.engine.spec.drafter import Drafter
from kvpipe.engine.spec.eagle_drafter import EagleDrafter, check_eagle
from kvpipe.engine.spec.mtp_drafter import MTPDrafter, check_nextn
from kvpipe.engine.spec.ngram_drafter import NgramDrafter
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.schema import ModelConfig

if TYPE_CHECKING:
    from kvpipe.engine.model_runner import ModelRunner
    from kvpipe.engine.tp_group import TPGroup


class DraftKV(enum.Enum):
    """Where a drafter's KV lives, and so how PD moves it."""

    NONE = "none"  # no draft KV (NGRAM drafts from the request's own tokens): nothing moves
    # a draft model's own pool, sharded over the TP group like the target's; in PD every rank's
    # shard goes to the decode as the layers after the target's (disagg/draft_transfer.py)
    SHARDED = "sharded"
    # an MTP layer's (or EAGLE head's) pool, whole on TP rank 0 at the target's page ids; in PD it
    # goes rank 0 to rank 0 with the prompt's last hidden state (disagg/mtp_transfer.py)
    RANK0 = "rank0"


class DraftModelPath(enum.Enum):
    """What the algorithm does with --speculative-draft-model-path."""

    NEVER = "never"
    REQUIRED = "required"
    OPTIONAL = "optional"  # EAGLE: a head with it, the checkpoint's MTP layer without


@dataclass(frozen=True)
class DrafterContext:
    """What a drafter is built from: the server's config, the target's checkpoint config, rank
    0's target runner, its device, and the TP group (None: TP 1)."""

    cfg: ServerConfig
    model_config: ModelConfig
    runner: ModelRunner
    device: str
    tp: TPGroup | None


@dataclass(frozen=True)
class DrafterEntry:
    name: str
    draft_model: DraftModelPath
    draft_kv: DraftKV
    # refuse what the drafter cannot serve next to the target (ConfigError), before ranks start
    check: Callable[[ServerConfig, ModelConfig], None]
    build: Callable[[DrafterContext], Drafter]


def _no_check(cfg: ServerConfig, model: ModelConfig) -> None:
    """NGRAM runs next to any target."""


def _check_standalone(cfg: ServerConfig, model: ModelConfig) -> None:
    path = cfg.speculative.draft_model_path
    assert path is not None  # DraftModelPath.REQUIRED: config/server.py refuses STANDALONE without it
    check_draft_model(cfg, model, model_config_of(path))


def _check_eagle(cfg: ServerConfig, model: ModelConfig) -> None:
    if cfg.speculative.eagle_head_path is not None:
        check_eagle(cfg, model)
    else:
        check_nextn(cfg, model)


def _build_standalone(ctx: DrafterContext) -> Drafter:
    return DraftModel(ctx.cfg, ctx.model_config, ctx.device, ctx.tp, ctx.runner.pool.num_layers)


def _build_nextn(ctx: DrafterContext) -> Drafter:
    return MTPDrafter(ctx.cfg, ctx.model_config, ctx.runner.model, ctx.runner.pool.num_pages, ctx.device)


def _build_eagle(ctx: DrafterContext) -> Drafter:
    """An EAGLE head in the MTP layer's place with a draft model path, else NEXTN's machinery."""
    if ctx.cfg.speculative.eagle_head_path is None:
        return _build_nextn(ctx)
    return EagleDrafter(ctx.cfg, ctx.model_config, ctx.runner.model, ctx.runner.pool.num_pages, ctx.device)


DRAFTERS: dict[str, DrafterEntry] = {
    e.name: e
    for e in (
        DrafterEntry(
            "NGRAM", DraftModelPath.NEVER, DraftKV.NONE, _no_check, lambda ctx: NgramDrafter(ctx.cfg.speculative)
        ),
        DrafterEntry("STANDALONE", DraftModelPath.REQUIRED, DraftKV.SHARDED, _check_standalone, _build_standalone),
        DrafterEntry("NEXTN", DraftModelPath.NEVER, DraftKV.RANK0, check_nextn, _build_nextn),
        DrafterEntry("EAGLE", DraftModelPath.OPTIONAL, DraftKV.RANK0, _check_eagle, _build_eagle),
    )
}


def drafter_named(name: str) -> DrafterEntry:
    """The entry of algorithm `name` (any case); ConfigError naming the known ones otherwise."""
    entry = DRAFTERS.get(name.upper())
    if entry is None:
        raise ConfigError(f"--speculative-algorithm {name!r} is not a drafter kvpipe has; known: {', '.join(DRAFTERS)}")
    return entry


def drafter_entry(spec: SpeculativeConfig) -> DrafterEntry | None:
    """The entry of `spec`'s algorithm (None: speculative decoding is off)."""
    return None if spec.algorithm is None else drafter_named(spec.algorithm)


def draft_kv(spec: SpeculativeConfig) -> DraftKV:
    """Where `spec`'s draft KV lives (NONE when speculative decoding is off)."""
    entry = drafter_entry(spec)
    return DraftKV.NONE if entry is None else entry.draft_kv
