"""docs/benchmarks.md is a results page: short, every image and link it names exists, and every
image is drawn from recorded JSON by the `kvpipe bench plot` command the page gives for it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from kvpipe.bench.plot_command import plot_files

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "benchmarks.md"
MAX_LINES, MIN_IMAGES = 400, 5


def page() -> str:
    return PAGE.read_text()


def images() -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", page())


def plot_commands() -> list[list[str]]:
    """The argument lists after `kvpipe bench plot` on the page's own lines."""
    return [shlex.split(ln)[3:] for ln in page().splitlines() if ln.startswith("kvpipe bench plot ")]


def test_page_is_short_with_plots() -> None:
    assert len(page().splitlines()) <= MAX_LINES
    assert len(images()) >= MIN_IMAGES


def test_every_image_and_link_exists() -> None:
    links = re.findall(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)", page())
    local = [t for t in images() + links if not t.startswith(("http://", "https://", "#"))]
    missing = [t for t in local if not (PAGE.parent / t).exists()]
    assert local and missing == []
    # the anchors of the summary table name the page's headings (GitHub's slugs)
    slugs = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^## (.+)$", page(), re.M)}
    assert {t[1:] for t in links if t.startswith("#")} <= slugs


def test_files_the_page_names_exist() -> None:
    """Every docs/bench file the page names in backticks (brace alternatives and globs expanded)."""

    def expand(name: str) -> list[str]:
        m = re.search(r"\{([^{}]*)\}", name)
        if m is None:
            return [name]
        return [x for alt in m.group(1).split(",") for x in expand(name[: m.start()] + alt + name[m.end() :])]

    named = re.findall(r"`([\w{},.*-]+\.(?:json|png|txt))`", page())
    assert named
    bench = PAGE.parent / "bench"
    missing = [n for name in named for n in expand(name) if not list(bench.glob(n))]
    assert missing == []


def test_every_image_is_drawn_by_its_command(tmp_path: Path) -> None:
    commands = plot_commands()
    outs = {}
    for args in commands:
        out = args[args.index("--out") + 1]
        inputs = [f for a in args[: args.index("--out")] for f in sorted(ROOT.glob(a))]
        assert inputs, args
        drawn = plot_files(inputs, tmp_path / Path(out).name)
        assert drawn.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        outs[str(Path(out).relative_to("docs"))] = drawn
    assert sorted(outs) == sorted(images())
