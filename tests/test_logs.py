"""Logs (fake engine): one line per request with its reason when it failed, X-Request-Id
honoured and echoed, the JSON format, uvicorn's own access line silenced, and the periodic
engine line."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from server_thread import ServerThread, fake_server

from app.cli import main
from app.logs import EngineStatsLog, JsonFormatter

CMPL = "/v1/completions"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with fake_server(stats_log_interval_s=0.05) as srv:
        yield srv


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def _lines(caplog: pytest.LogCaptureFixture, name: str = "greenlane.request") -> list:
    time.sleep(0.05)  # the line is written when the response has ended
    return [r for r in caplog.records if r.name == name]


def test_a_rejected_request_logs_its_reason(
    http: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="greenlane.request"):
        r = http.post(CMPL, json={"prompt": "a", "temperature": 7})
        assert r.status_code == 400
        (record,) = _lines(caplog)
    line = record.getMessage()
    assert "status=400" in line and "method=POST" in line and "path=/v1/completions" in line
    assert 'error="Invalid request: temperature' in line, line
    assert record.fields["error"].startswith("Invalid request: temperature")


def test_an_unknown_parameter_and_an_engine_failure_log_their_reasons(
    http: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="greenlane.request"):
        http.post(CMPL, json={"prompt": "a", "frobnicate": 1})
        http.post(CMPL, json={"prompt": "FAIL", "max_tokens": 2})
        first, second = _lines(caplog)
    assert "frobnicate" in first.fields["error"] and first.fields["status"] == 400
    # A 500's reason may quote internals: the client and the access line get the request id,
    # the engine's own reason is logged beside it under that id.
    assert second.fields["status"] == 500 and "server log" in second.fields["error"]
    detail = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("injected fault" in m and second.fields["id"] in m for m in detail), detail


def test_x_request_id_is_used_and_echoed(
    server: ServerThread, http: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="greenlane.request"):
        r = http.post(
            CMPL, json={"prompt": "ab", "max_tokens": 1}, headers={"X-Request-Id": "job-7"}
        )
        (record,) = _lines(caplog)
    assert r.status_code == 200 and r.headers["x-request-id"] == "job-7"
    assert r.json()["id"] == "job-7" and record.fields["id"] == "job-7"
    assert [q for q in server.added() if q.request_id.startswith("job-7-")]
    # Clients reuse ids: two at once with the same id both run.
    results: list[int] = []

    def call() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            body = {"prompt": "abc", "max_tokens": 3}
            results.append(c.post(CMPL, json=body, headers={"X-Request-Id": "dup"}).status_code)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200, 200]


def test_ids_are_made_when_missing_or_unusable(http: httpx.Client) -> None:
    r = http.post(CMPL, json={"prompt": "ab", "max_tokens": 1}, headers={"X-Request-Id": "a b"})
    assert r.headers["x-request-id"] == r.json()["id"] and r.json()["id"].startswith("cmpl-")
    models = http.get("/v1/models")
    assert models.headers["x-request-id"].startswith("req-")
    bad = http.post(CMPL, json={})
    assert bad.headers["x-request-id"].startswith("req-")


def test_json_format(http: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="greenlane.request"):
        http.post(CMPL, json={"prompt": "abcd", "max_tokens": 2}, headers={"X-Request-Id": "j1"})
        (record,) = _lines(caplog)
    out = json.loads(JsonFormatter().format(record))
    assert out["logger"] == "greenlane.request" and out["level"] == "INFO"
    assert (out["id"], out["status"], out["prompt_tokens"], out["output_tokens"]) == (
        "j1",
        200,
        4,
        2,
    )
    assert out["error"] is None and out["total_s"] >= 0 and out["message"].startswith("id=j1 ")


def test_uvicorn_access_lines_are_silenced(server: ServerThread) -> None:
    record = logging.LogRecord("uvicorn.access", logging.INFO, "x", 1, "GET / 200", None, None)
    assert not logging.getLogger("uvicorn.access").filter(record)


def test_log_format_option_is_checked() -> None:
    assert main(["serve", "--log-format", "xml"]) == 2


def test_engine_stats_line(
    server: ServerThread, http: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="greenlane.stats"):
        server.control("pause")
        try:
            with http.stream("POST", CMPL, json={"prompt": "abc", "max_tokens": 3, "stream": True}):
                deadline = time.monotonic() + 5
                while not any(r.fields["waiting"] for r in _lines(caplog, "greenlane.stats")):
                    assert time.monotonic() < deadline, "no engine line saw the waiting request"
        finally:
            server.control("resume")
    line = next(r for r in _lines(caplog, "greenlane.stats") if r.fields["waiting"])
    for key in (
        "prompt_tokens_per_s",
        "generation_tokens_per_s",
        "running",
        "kv_usage",
        "prefix_hit_rate",
    ):
        assert key in line.fields and f"{key}=" in line.getMessage()


def test_engine_stats_sample_is_computed_from_deltas() -> None:
    log = EngineStatsLog(app=None, interval_s=10)  # type: ignore[arg-type]
    base = {"num_prefill_tokens": 100, "num_decode_tokens": 10, "num_running": 0, "num_waiting": 0}
    base |= {
        "kv_blocks_used": 0,
        "kv_blocks_total": 10,
        "prefix_hit_tokens": 0,
        "prefix_query_tokens": 0,
    }
    assert log.sample(base, 0.0) is None  # the first snapshot has no interval
    busy = base | {"num_prefill_tokens": 300, "num_decode_tokens": 50, "num_running": 2}
    busy |= {"kv_blocks_used": 5, "prefix_hit_tokens": 30, "prefix_query_tokens": 120}
    fields = log.sample(busy, 2.0)
    assert fields == {
        "prompt_tokens_per_s": 100.0,
        "generation_tokens_per_s": 20.0,
        "running": 2,
        "waiting": 0,
        "kv_usage": 0.5,
        "prefix_hit_rate": 0.25,
    }
    idle = busy | {"num_running": 0, "kv_blocks_used": 0}
    assert log.sample(idle, 4.0) is not None  # the first idle line is written
    assert log.sample(idle, 6.0) is None  # and not repeated


def test_engine_stats_line_says_what_sizes_tbt_chunks() -> None:
    log = EngineStatsLog(app=None, interval_s=10)  # type: ignore[arg-type]
    base = {"num_prefill_tokens": 0, "num_decode_tokens": 0, "num_running": 1, "num_waiting": 0}
    base |= {"num_decode_steps": 10, "decode_device_s": 0.05, "tbt_slo_ms": None}
    base |= {"num_mixed_steps": 0, "num_mixed_steps_over_tbt": 0}
    log.sample(base, 0.0)
    later = base | {"num_decode_tokens": 40, "num_decode_steps": 20, "decode_device_s": 0.09}
    assert "tbt_cost_token_scale" not in log.sample(later, 1.0)  # no target: nothing about it
    target = later | {"tbt_slo_ms": 80.0, "tbt_cost_token_scale": 0.71234}
    target |= {"tbt_cost_pair_scale": 1.23456, "tbt_cost_offset_ms": 12.3456}
    target |= {"tbt_cost_context_ms_per_1k": 0.12345}
    target |= {"num_decode_tokens": 80, "num_decode_steps": 30, "decode_device_s": 0.12}
    target |= {"num_mixed_steps": 12, "num_mixed_steps_over_tbt": 3, "mixed_step_ratio_p99": 1.234}
    fields = log.sample(target, 2.0)
    assert fields["tbt_slo_ms"] == 80.0 and fields["tbt_cost_token_scale"] == 0.712
    assert fields["tbt_cost_pair_scale"] == 1.235
    assert fields["tbt_cost_offset_ms"] == 12.35  # rounded to 0.01 ms
    assert fields["tbt_cost_context_ms_per_1k"] == 0.123
    # No mixed steps before this interval: all 12 are in it.
    assert fields["mixed_steps_over_tbt"] == "3/12" and fields["mixed_step_ratio_p99"] == 1.23
    assert fields["decode_step_ms"] == 3.0  # 30 ms of device time over 10 decode steps


def test_engine_stats_line_tells_young_pauses_and_the_collectors_cpu() -> None:
    log = EngineStatsLog(app=None, interval_s=10)  # type: ignore[arg-type]
    base = {"num_prefill_tokens": 0, "num_decode_tokens": 0, "gc_full_collections": 0}
    log.sample(base, 0.0)
    quiet = {**base, "num_prefill_tokens": 10, "gc_pause_ms_max": 1.0}
    assert "gc_pause_ms_max" not in log.sample(quiet, 1.0)  # short pauses: nothing said
    slow = {
        **quiet,
        "num_prefill_tokens": 20,
        "gc_pause_ms_max": 18.6,
        "gc_young_pause_ms_max": 18.6,
        "gc_pause_cpu_ms_max": 5.0,
    }
    fields = log.sample(slow, 2.0)
    assert fields["gc_full_collections"] == 0  # no full collection: a young one, 5 ms its own
    assert fields["gc_young_pause_ms_max"] == 18.6 and fields["gc_pause_cpu_ms_max"] == 5.0
