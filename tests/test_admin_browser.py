"""The admin page in a real browser: Playwright for Python driving Debian's chromium.

Never downloads a browser: it uses /usr/bin/chromium (installed by `.ci/run` with apt-get) and
skips with a reason when that is missing. On CPU the partition controls are exercised through
the test-only `FakePartition` (132 pretend SMs), injected as `engine.partition`.

Two servers are driven, both on a real socket on 127.0.0.1 (so the loopback rule applies):
- "full-app": `app.main.create_app` with the real engine on a tiny random model; load comes from
  real `/v1/completions` requests. Skipped (with the reason) if the app factory cannot be built.
- "router+fake-engine": the admin router alone over the test-only `FakeEngine`, whose toy job
  thread turns submitted jobs into queue/latency numbers. It checks the page, not the engine.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import uvicorn
from fake_partition import (
    FAKE_SPLITS,
    FAKE_TOTAL_SMS,
    AsyncPartition,
    FakeEngine,
    FakePartition,
)
from fastapi import FastAPI

from runtime.partition import UnavailablePartition

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Where to save a screenshot of the page under load (e.g. docs/admin-page.png); unset = none.
SCREENSHOT_ENV = "GREENLANE_ADMIN_SCREENSHOT"


@dataclass
class Served:
    base_url: str
    app: FastAPI
    send_load: Callable[[int], None]  # start n requests in the background


def _serve(app: FastAPI, lifespan: str) -> tuple[str, Callable[[], None]]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan=lifespan, timeout_graceful_shutdown=5)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120  # the full app loads a model at start-up
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=30)

    return f"http://127.0.0.1:{port}", stop


def _fake_server() -> Iterator[Served]:
    engine = FakeEngine(partition=FakePartition(), prefill_s=0.3, tpot_s=0.02, max_running=3)
    app = FastAPI()
    from app.admin import router

    app.include_router(router)
    app.state.engine = engine
    app.state.metrics = engine.metrics
    app.state.settings = SimpleNamespace(admin_token=None)
    engine.start()
    base, stop = _serve(app, lifespan="off")

    def send_load(n: int) -> None:
        for i in range(n):
            engine.submit(num_tokens=8 + 4 * (i % 5))

    try:
        yield Served(base, app, send_load)
    finally:
        stop()
        engine.shutdown()


def _set_partition(engine: Any, manager: Any) -> None:
    """Give the app a stand-in partition manager as the front end holds one (async set_mode:
    app/engine_view.py); the fake engine wraps what it is given itself."""
    engine.partition = manager if isinstance(engine, FakeEngine) else AsyncPartition(manager)


def _full_app_server() -> Iterator[Served]:
    try:
        import runtime.engine  # noqa: F401  (the real engine; the app imports it lazily)
        from app.main import create_app
        from app.settings import Settings
    except ImportError as exc:
        pytest.skip(f"full app or engine not available yet: {exc}")
    settings = Settings(model="random:tiny", max_num_seqs=4, admin_token=None)
    app = create_app(settings)
    base, stop = _serve(app, lifespan="on")
    if not hasattr(app.state, "engine"):
        stop()
        pytest.skip("create_app stored no app.state.engine")
    # Test-only: pretend SM partitioning exists so the controls have something to drive.
    _set_partition(app.state.engine, FakePartition())

    def one_request(i: int) -> None:
        try:
            httpx.post(
                f"{base}/v1/completions",
                timeout=120,
                json={
                    "prompt": "Green lanes " * (2 + i % 6),
                    "max_tokens": 24,
                    "temperature": 0,
                },
            )
        except httpx.HTTPError:
            pass  # the page test only needs load; the API tests check responses

    def send_load(n: int) -> None:
        for i in range(n):
            threading.Thread(target=one_request, args=(i,), daemon=True).start()

    try:
        yield Served(base, app, send_load)
    finally:
        stop()


@pytest.fixture(params=["full-app", "router+fake-engine"])
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    gen = _full_app_server() if request.param == "full-app" else _fake_server()
    yield from gen


@pytest.fixture()
def page_and_errors() -> Iterator[tuple[Any, list[str]]]:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1100})
            errors: list[str] = []
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
            page.set_default_timeout(30_000)
            yield page, errors
        finally:
            browser.close()


def _updates(page: Any) -> int:
    return int(page.evaluate("Number(document.body.dataset.updates || 0)"))


def _wait_updates(page: Any, more: int = 2) -> None:
    """Wait until the page has applied `more` further state snapshots (SSE or PUT replies)."""
    target = _updates(page) + more
    page.wait_for_function(f"Number(document.body.dataset.updates || 0) >= {target}")


def _text(page: Any, selector: str) -> str:
    return (page.locator(selector).text_content() or "").strip()


def test_admin_page_live_and_controls(
    served: Served, page_and_errors: tuple[Any, list[str]]
) -> None:
    page, errors = page_and_errors
    engine = served.app.state.engine
    partition: FakePartition = engine.partition

    page.goto(f"{served.base_url}/admin")
    _wait_updates(page, 2)  # initial GET + at least one SSE event
    assert page.locator("#conn").inner_text() == "live"
    assert page.locator("#sm-grid .sm").count() == FAKE_TOTAL_SMS
    assert page.locator("#sm-grid .sm-shared").count() == FAKE_TOTAL_SMS  # mode off: time-sliced
    assert _text(page, "#mode-badge") == "off"
    # How a step's prefill is sized, as the engine reports it (the CPU engine: no cap beside
    # decodes; the fake one: 2048).
    stats = engine.stats()
    mixed = stats.get("mixed_step_token_budget")
    beside = "the same with decodes" if mixed is None else f"{mixed} with decodes"
    budget = stats["prefill_token_budget"]
    # ... and hybrid prefill's chunk (the CPU engine's 2,048; the fake one's 16,384).
    chunk = f"; long prompts' MLP in chunks of {stats['prefill_chunk_tokens']}"
    assert _text(page, "#prefill-limits") == f"prefill per step: {budget} tokens; {beside}{chunk}"
    # A TBT target set while serving: the cap stays, the cut is added to it.
    r = httpx.put(f"{served.base_url}/admin/api/prefill", json={"tbt_slo_ms": 50.0})
    assert r.status_code == 200, r.text
    want = f"prefill per step: {budget} tokens; {beside}, cut to a 50 ms TBT target{chunk}"
    page.wait_for_function(
        f"document.getElementById('prefill-limits').textContent.trim() === {want!r}"
    )
    r = httpx.put(f"{served.base_url}/admin/api/prefill", json={"tbt_slo_ms": None})
    assert r.status_code == 200, r.text

    # --- numbers move under load ---
    completed_before = _text(page, "#stat-completed")
    served.send_load(12)
    page.wait_for_function(
        "document.getElementById('stat-completed').textContent.trim() !== "
        + repr(completed_before),
        timeout=120_000,
    )
    page.wait_for_function("document.getElementById('stat-ttft').textContent.trim() !== '–'")
    page.wait_for_function("document.getElementById('stat-ttft-p99').textContent.includes('p99')")
    page.wait_for_function("document.getElementById('stat-tokps').textContent.trim() !== '–'")
    assert not errors, errors

    # --- the controls reach the server ---
    page.locator("#split-range").fill(str(FAKE_SPLITS.index(80)))
    assert _text(page, "#split-out") == f"80 prefill / {FAKE_TOTAL_SMS - 80} decode"
    page.locator("#pin-btn").click()
    page.wait_for_function("document.getElementById('mode-badge').textContent.includes('static')")
    assert partition.calls[-1] == "static:80"
    assert page.locator("#sm-grid .sm-prefill").count() == 80
    assert page.locator("#sm-grid .sm-decode").count() == FAKE_TOTAL_SMS - 80
    assert "pinned" in _text(page, "#mode-badge")

    page.locator("#auto-btn").click()
    page.wait_for_function("document.getElementById('mode-badge').textContent.trim() === 'auto'")
    assert partition.calls[-1] == "auto"
    # What the manager reports about auto's choices and failed splits reaches the page.
    partition.choice_counts = {"0": 2, "64": 1, "layer-sliced": 1}
    partition.disabled_splits = {"120": "CUBLAS_STATUS_EXECUTION_FAILED (test)"}
    page.wait_for_function(
        "document.getElementById('choices-text').textContent.includes('time-sliced 2 (50 %)')"
    )
    choices = _text(page, "#choices-text")
    assert "64 prefill SMs 1 (25 %)" in choices
    assert "time-sliced by layers 1 (25 %)" in choices
    assert "120 (CUBLAS_STATUS_EXECUTION_FAILED (test))" in choices
    # auto's chunked time-slicing (prefill cut to the TBT target) has its own label.
    partition.choice_counts = {"chunked": 3, "64": 1}
    page.wait_for_function(
        "document.getElementById('choices-text').textContent.includes("
        "'time-sliced in chunks 3 (75 %)')"
    )

    page.locator(".policy-btn[data-policy='fcfs']").click()
    page.wait_for_selector(".policy-btn.active[data-policy='fcfs']")
    assert engine.stats()["policy"] == "fcfs"
    assert not errors, errors

    if os.environ.get(SCREENSHOT_ENV):
        served.send_load(12)
        _wait_updates(page, 6)
        page.screenshot(path=os.environ[SCREENSHOT_ENV], full_page=True)

    # --- with a token configured, the page's token field is what lets a change through ---
    served.app.state.settings.admin_token = "browser-test-token"
    try:
        page.locator(".policy-btn[data-policy='spf']").click()
        page.wait_for_selector("#toast.error")
        assert "401" in _text(page, "#toast")
        assert engine.stats()["policy"] == "fcfs"
        page.locator("#token-input").fill("browser-test-token")
        page.locator(".policy-btn[data-policy='spf']").click()
        page.wait_for_selector(".policy-btn.active[data-policy='spf']")
        assert engine.stats()["policy"] == "spf"
        assert (
            page.evaluate("sessionStorage.getItem('greenlane.adminToken')") == "browser-test-token"
        )
    finally:
        served.app.state.settings.admin_token = None
    # The refused PUT is logged by the browser as a failed resource load; nothing else may be.
    assert all("401" in e for e in errors), errors
    errors.clear()

    # --- no partitioning on this machine: the page says why ---
    _set_partition(engine, UnavailablePartition("no CUDA device (test stand-in)"))
    page.reload()
    _wait_updates(page, 2)
    reason = page.locator("#partition-reason")
    assert reason.is_visible()
    assert "no CUDA device (test stand-in)" in reason.inner_text()
    assert _text(page, "#mode-badge") == "unavailable"
    assert not page.locator("#pin-btn").is_visible()
    assert not errors, errors
    if os.environ.get(SCREENSHOT_ENV):
        shot = Path(os.environ[SCREENSHOT_ENV])
        page.screenshot(path=str(shot.with_stem(shot.stem + "-unavailable")), full_page=True)
