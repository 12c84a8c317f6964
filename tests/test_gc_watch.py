"""The collector's pauses, timed (runtime/gc_watch.py), and the start-up freeze."""

from __future__ import annotations

import gc

from runtime.gc_watch import GcWatch, freeze_startup_objects


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
