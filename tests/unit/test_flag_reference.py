"""docs/flags.md is what `python -m kvpipe.commands.flag_reference` prints (so the reference cannot
drift from the parsers), it names every flag of the commands it covers, and its table of kvpipe's
own environment variables names every KVPIPE_* variable the code reads."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kvpipe.commands.flag_reference import KVPIPE_ENV, REFERENCE_COMMANDS, code_defaults, command_parser, render

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "flags.md"


def test_docs_flags_is_generated() -> None:
    assert DOC.read_text() == render(), "regenerate: python -m kvpipe.commands.flag_reference > docs/flags.md"


@pytest.mark.parametrize("name", REFERENCE_COMMANDS)
def test_every_visible_flag_is_listed(name: str) -> None:
    with code_defaults():
        parser = command_parser(name)
    doc = DOC.read_text()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or not action.option_strings or action.dest == "help":
            continue
        assert f"`{action.option_strings[0]}`" in doc, action.option_strings


def test_defaults_do_not_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "7")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "rdma")
    assert render() == DOC.read_text()


def test_every_kvpipe_variable_is_documented() -> None:
    used = set()
    for path in (ROOT / "kvpipe").rglob("*.py"):
        used |= set(re.findall(r"[\"'](KVPIPE_[A-Z0-9_]+)[\"']", path.read_text()))
    assert used == {name for name, _ in KVPIPE_ENV}
