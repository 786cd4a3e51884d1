"""The on-disk cache of written presets: $KVPIPE_CACHE_DIR or ~/.cache/kvpipe/models/<preset>,
rewritten when its format version or seed does not match."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from kvpipe.model.presets.writer import PRESET_FORMAT_VERSION, write_preset


def cache_root() -> Path:
    env = os.environ.get("KVPIPE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kvpipe" / "models"


def _is_current(path: Path, name: str, seed: int) -> bool:
    marker = path / "kvpipe_preset.json"
    if not marker.is_file():
        return False
    meta = json.loads(marker.read_text())
    return meta.get("preset") == name and meta.get("seed") == seed and meta.get("version") == PRESET_FORMAT_VERSION


def default_model_dir(preset: str, seed: int = 0) -> Path:
    """Cached checkpoint of `preset` under $KVPIPE_CACHE_DIR or ~/.cache/kvpipe/models/<preset>.

    Written once into a temporary sibling and renamed into place, so concurrent callers never
    see a half-written directory.
    """
    root = cache_root()
    target = root / (preset if seed == 0 else f"{preset}-seed{seed}")
    if _is_current(target, preset, seed):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        write_preset(preset, tmp, seed)
        if target.exists() and not _is_current(target, preset, seed):
            shutil.rmtree(target, ignore_errors=True)  # stale format version
        try:
            tmp.rename(target)
        except OSError:
            if not _is_current(target, preset, seed):  # lost a race to a writer that failed
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def model_path_or_preset(path: str | None, preset: str = "tiny") -> str:
    """A benchmark's or harness's --model-path, or the random `preset` (written once, then reused)
    when none is given: their numbers stay comparable across sessions. Servers default to a trained
    model instead (model/checkpoint/default_model.py)."""
    return path if path else str(default_model_dir(preset))
