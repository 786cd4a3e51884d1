"""The engine asks its KV connector what to do, never the server's disaggregation mode: no module
of kvpipe/engine reads `disaggregation.mode` or compares anything with "prefill" / "decode", and
the PD connectors say through EngineRole what the mode strings used to decide."""

import ast
import pickle
from dataclasses import fields
from pathlib import Path

import pytest

import kvpipe
from kvpipe.config import CacheConfig, DisaggregationConfig, SchedulerConfig, ServerConfig
from kvpipe.disagg.decode import DecodeConnector
from kvpipe.disagg.prefill import PrefillConnector
from kvpipe.engine.connector import EngineRole, KVConnector
from kvpipe.engine.model_runner import snapshot_slots

ENGINE = Path(kvpipe.__file__).resolve().parent / "engine"
MODES = {"prefill", "decode", "null"}


def _mode_reads(path: Path) -> list[str]:
    """Where `path` reads X.disaggregation.mode or compares a value with a mode string."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "mode"
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "disaggregation"
        ):
            out.append(f"{path.name}:{node.lineno} reads disaggregation.mode")
        elif isinstance(node, ast.Compare):
            consts = [c for c in (node.left, *node.comparators) if isinstance(c, ast.Constant)]
            if any(c.value in MODES for c in consts):
                out.append(f"{path.name}:{node.lineno} compares with a mode string")
    return out


def test_no_engine_module_reads_the_disaggregation_mode():
    offenders = [hit for p in sorted(ENGINE.rglob("*.py")) for hit in _mode_reads(p)]
    assert offenders == []
    assert not [p for p in ENGINE.rglob("*.py") if "disaggregation.mode" in p.read_text()]


def test_the_scan_finds_a_mode_read(tmp_path):
    p = tmp_path / "m.py"
    p.write_text('x = cfg.disaggregation.mode == "prefill"\nif mode != "decode":\n    pass\n')
    assert len(_mode_reads(p)) == 3


def _cfg(tmp_path: Path, mode: str, decode_radix_cache: bool = False) -> ServerConfig:
    d = DisaggregationConfig(mode=mode, transfer_backend="local", decode_radix_cache=decode_radix_cache)
    return ServerConfig(model_path=str(tmp_path), disaggregation=d)


def test_colocated_and_pd_roles(tmp_path):
    """What the mode strings decided before, now each connector's word."""
    assert EngineRole.of(None) == EngineRole()  # colocated: computes, snapshots, verifies, caches
    prefill = EngineRole.of(PrefillConnector(_cfg(tmp_path, "prefill")))
    assert prefill == EngineRole(
        state_snapshots=True,
        kv_only_prefix_cache=False,
        verifies_drafts=False,
        drafts_on_prefill=True,
        prefix_cache=True,
        whole_prompt_pages=True,
    )
    decode = EngineRole.of(DecodeConnector(_cfg(tmp_path, "decode")))
    assert decode == EngineRole(
        state_snapshots=False,
        kv_only_prefix_cache=True,
        verifies_drafts=True,
        drafts_on_prefill=False,
        prefix_cache=False,
        whole_prompt_pages=False,
    )
    assert EngineRole.of(DecodeConnector(_cfg(tmp_path, "decode", decode_radix_cache=True))).prefix_cache


def test_every_role_field_is_a_connector_attribute_with_a_default():
    for f in fields(EngineRole):
        assert hasattr(KVConnector, f.name), f.name
    role = EngineRole(state_snapshots=False, verifies_drafts=False)
    assert pickle.loads(pickle.dumps(role)) == role  # TP children get it in their StartMsg


# 2 per running request, or --max-mamba-cache-size minus the 3 running requests' slots
@pytest.mark.parametrize("mamba_cache, want", [(None, 6), (10, 7)])
def test_snapshot_slots_follow_the_role(tmp_path, mamba_cache, want):
    cfg = ServerConfig(
        model_path=str(tmp_path),
        cache=CacheConfig(max_mamba_cache_size=mamba_cache),
        scheduler=SchedulerConfig(max_running_requests=3),
    )
    assert snapshot_slots(cfg, EngineRole()) == want
    assert snapshot_slots(cfg, EngineRole(state_snapshots=False)) == 0
