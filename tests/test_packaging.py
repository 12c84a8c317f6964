"""`pip install .` gives a working `greenlane serve`.

The wheel is built from a copy of the sources, installed (no dependencies) into a fresh virtual
environment whose only link to the test's environment is a .pth line naming its site-packages
(so torch and the rest are reused, not downloaded: seconds, not minutes), and run from a folder
outside the repository: `greenlane --version`, the cache folder under $XDG_CACHE_HOME, and
`greenlane serve --model random:tiny` answering /v1/models, /admin and its static files.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import venv
from pathlib import Path

import httpx
import pytest
from server_thread import free_port

from app import __version__

REPO = Path(__file__).resolve().parent.parent
SOURCES = (
    "pyproject.toml",
    "README.md",
    "LICENSE",
    "app",
    "runtime",
    "policies",
    "bench",
    "static",
)

pytestmark = pytest.mark.slow


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)  # type: ignore[call-overload]
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the built wheel installed; returns the venv folder."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "results")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    dist = tmp / "dist"
    pip = [sys.executable, "-m", "pip"]
    # Built with this environment's setuptools (no download): the dev extra pins >= 77, which
    # reads pyproject's PEP 639 licence fields.
    _run(
        [
            *pip,
            "wheel",
            "-q",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(src),
        ]
    )
    (wheel,) = dist.glob("greenlane-*.whl")

    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
        ).stdout.strip()
    )
    # Dependencies from this environment: its site-packages and any other site folder on its
    # path (a venv layered over another one, like make test's on the GPU image, reaches the
    # lower one's packages through a .pth). Lines naming folders, not .pth processing: the
    # editable install of the checkout stays out, so only the wheel provides greenlane's own
    # packages.
    purelib = sysconfig.get_paths()["purelib"]
    sites = [purelib] + [
        p
        for p in sys.path
        if p != purelib and p.endswith(("site-packages", "dist-packages")) and Path(p).is_dir()
    ]
    (site / "_greenlane_test_deps.pth").write_text("\n".join(sites) + "\n")
    _run([*pip, "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)])
    return env_dir


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GREENLANE_")}
    env["XDG_CACHE_HOME"] = str(tmp / "xdg")
    env.pop("PYTHONPATH", None)
    return env


def test_version_and_cache_location(installed: Path, tmp_path: Path) -> None:
    out = _run(
        [str(installed / "bin" / "greenlane"), "--version"], cwd=tmp_path, env=_env(tmp_path)
    )
    assert out.stdout.strip() == f"greenlane {__version__}"
    probe = "import app, runtime.model.convert as c; print(app.__file__); print(c.cache_dir())"
    lines = _run([str(installed / "bin" / "python"), "-c", probe], cwd=tmp_path, env=_env(tmp_path))
    app_file, cache = lines.stdout.split()
    assert Path(app_file).is_relative_to(installed), app_file  # the wheel's, not the checkout's
    assert Path(cache) == tmp_path / "xdg" / "greenlane"


def test_installed_server_answers(installed: Path, tmp_path: Path, default_model_dir: Path) -> None:
    # random:tiny borrows the default model's tokenizer: give the installed package the
    # converted model in its cache folder instead of converting it again (half a minute).
    models = tmp_path / "xdg" / "greenlane" / "models"
    models.mkdir(parents=True)
    (models / default_model_dir.name).symlink_to(default_model_dir)
    port = free_port()
    cmd = [str(installed / "bin" / "greenlane"), "serve", "--model", "random:tiny"]
    cmd += ["--port", str(port), "--cpu-kv-cache-gb", "0.05", "--stats-log-interval-s", "0"]
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=_env(tmp_path), stdout=log, stderr=subprocess.STDOUT
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.5)
        models_resp = httpx.get(f"{base}/v1/models", timeout=10)
        assert (
            models_resp.status_code == 200 and models_resp.json()["data"][0]["id"] == "random:tiny"
        )
        page = httpx.get(f"{base}/admin", timeout=10)
        assert page.status_code == 200 and "<html" in page.text
        for name in ("admin.js", "admin.css"):
            assert httpx.get(f"{base}/admin/static/{name}", timeout=10).status_code == 200
        assert httpx.get(f"{base}/version", timeout=10).json() == {"version": __version__}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    assert proc.returncode == 0, (tmp_path / "serve.log").read_text()
    assert not list(installed.rglob("SmolLM2-135M-Instruct")), "a model was written into the venv"
