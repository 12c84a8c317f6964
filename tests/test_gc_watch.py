"""The collector's pauses, timed (runtime/diagnostics/gc_watch.py), and the start-up freeze."""

from __future__ import annotations

import gc

from runtime.diagnostics.gc_watch import GcWatch, freeze_startup_objects


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_full_collections_and_the_longest_pause_are_counted() -> None:
    clock = Clock()
    w = GcWatch(clock)
    w._on_gc("start", {"generation": 0})
    clock.t += 0.002
    w._on_gc("stop", {"generation": 0})
    w._on_gc("start", {"generation": 2})
    clock.t += 0.030
    w._on_gc("stop", {"generation": 2})
    first = w.take_window()
    assert first["gc_full_collections"] == 1
    assert abs(first["gc_full_ms_total"] - 30.0) < 1e-6
    assert abs(first["gc_pause_ms_max"] - 30.0) < 1e-6
    w._on_gc("start", {"generation": 1})
    clock.t += 0.005
    w._on_gc("stop", {"generation": 1})
    assert abs(w.take_pause_ms() - 37.0) < 1e-6  # every collection since the last take
    assert w.take_pause_ms() == 0.0
    second = w.take_window()
    assert abs(second["gc_pause_ms_max"] - 5.0) < 1e-6  # the window restarted
    assert abs(second["gc_pause_ms_max_ever"] - 30.0) < 1e-6
    assert second["gc_full_collections"] == 1  # a running count


def test_installed_it_sees_real_collections() -> None:
    w = GcWatch()
    w.install()
    try:
        gc.collect(2)
        assert w.num_full >= 1 and w.max_ms > 0.0
    finally:
        w.uninstall()
    assert w._on_gc not in gc.callbacks


def test_freeze_moves_live_objects_out_of_collections() -> None:
    try:
        assert freeze_startup_objects() > 0
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_engine_stats_carry_the_pauses() -> None:
    from test_engine import make_engine

    engine, _ = make_engine()
    try:
        gc.collect(2)
        st = engine.fresh_stats()
        assert st["gc_full_collections"] >= 1
        assert {"gc_full_ms_total", "gc_pause_ms_max", "gc_pause_ms_max_ever"} <= st.keys()
    finally:
        engine.shutdown(0)


_API_SERVER_SCRIPT = """
import gc, sys
sys.path[:0] = [{root!r}, {tests!r}]
from fastapi.testclient import TestClient
from fake_engine import FakeEngine
from app.main import create_app
from app.settings import Settings
app = create_app(Settings(log_level="warning"), engine_factory=FakeEngine, freeze_gc_at_start={freeze})
with TestClient(app, base_url="http://127.0.0.1") as client:
    assert client.get("/health").status_code == 200
    print(gc.get_freeze_count())
"""


def test_the_api_server_freezes_its_start_up_objects_when_asked() -> None:
    """The CLI's API servers freeze what start-up left, so a full collection does not stop the
    event loop (and every stream) over it; an embedding process is left alone. In a fresh
    interpreter each: freezing this one would keep the test session's garbage forever."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    counts = {}
    for freeze in (False, True):
        script = _API_SERVER_SCRIPT.format(root=str(root), tests=str(root / "tests"), freeze=freeze)
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr[-2000:]
        counts[freeze] = int(out.stdout.strip().splitlines()[-1])
    assert counts[False] == 0
    assert counts[True] > 10_000, counts  # FastAPI, pydantic, the app: tens of thousands
