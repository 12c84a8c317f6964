"""The API process's CPU-share watch (app/load_watch.py): the share per window, the gauge, and
one warning naming --api-server-count when the process stays saturated."""

from __future__ import annotations

import logging

import pytest

from app import load_watch
from app.load_watch import FrontEndLoad
from app.metrics import Metrics


class _Clocks:
    def __init__(self) -> None:
        self.cpu_s = 0.0
        self.wall_s = 0.0

    def advance(self, wall_s: float, share: float) -> None:
        self.wall_s += wall_s
        self.cpu_s += wall_s * share


def _watch(clocks: _Clocks, count: int = 1, on_share=None) -> FrontEndLoad:
    return FrontEndLoad(count, on_share, cpu_s=lambda: clocks.cpu_s, clock_s=lambda: clocks.wall_s)


def test_share_is_cpu_seconds_per_second_of_each_window() -> None:
    clocks = _Clocks()
    seen: list[float] = []
    watch = _watch(clocks, on_share=seen.append)
    clocks.advance(5.0, 0.25)
    assert watch.sample() == pytest.approx(0.25)
    clocks.advance(10.0, 0.75)
    assert watch.sample() == pytest.approx(0.75)  # this window only, not since the start
    assert seen == pytest.approx([0.25, 0.75]) and watch.cpu_share == pytest.approx(0.75)
    assert watch.sample() is None  # no time passed: nothing to say


def test_warns_once_when_saturated_for_two_windows(caplog: pytest.LogCaptureFixture) -> None:
    clocks = _Clocks()
    watch = _watch(clocks, count=2)
    with caplog.at_level(logging.WARNING, logger="greenlane.app"):
        for share in (0.95, 0.5, 0.97):  # busy windows not in a row: a burst, no warning
            clocks.advance(5.0, share)
            watch.sample()
        assert not caplog.records
        clocks.advance(5.0, 0.99)
        watch.sample()  # the second busy window in a row
        assert len(caplog.records) == 1
        msg = caplog.records[0].getMessage()
        assert "99 % of a core" in msg and "one of 2" in msg and "--api-server-count 4" in msg
        for _ in range(10):  # still saturated, within WARN_EVERY_S: no repeat
            clocks.advance(5.0, 1.0)
            watch.sample()
        assert len(caplog.records) == 1
        clocks.advance(load_watch.WARN_EVERY_S, 1.0)
        watch.sample()
        assert len(caplog.records) == 2


def test_the_share_is_a_metric() -> None:
    metrics = Metrics()
    clocks = _Clocks()
    watch = _watch(clocks, on_share=metrics.api_cpu_share.set)
    clocks.advance(5.0, 0.4)
    watch.sample()
    assert "greenlane_api_server_cpu_share 0.4" in metrics.render().decode()


def test_the_suggestion_keeps_within_the_options_cap(caplog: pytest.LogCaptureFixture) -> None:
    from app.settings import MAX_API_SERVERS

    clocks = _Clocks()
    watch = _watch(clocks, count=MAX_API_SERVERS - 1)
    with caplog.at_level(logging.WARNING, logger="greenlane.app"):
        for _ in range(2):
            clocks.advance(5.0, 1.0)
            watch.sample()
    assert caplog.records[0].getMessage().endswith(f"--api-server-count {MAX_API_SERVERS}")
