"""(g) disconnects free KV, (h) the queue cap gives 429 + Retry-After, /health, /metrics,
the per-request log line, API keys, and a dead engine. Fake engine: the app layer only."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from server_thread import ServerThread, fake_server

MSG = [{"role": "user", "content": "tell me a long story"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    # Room for 2 engine requests in flight: 1 running + 1 waiting.
    with fake_server(max_num_seqs=1, max_queue=1, retry_after_s=3) as srv:
        yield srv


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def _wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _idle(server: ServerThread) -> bool:
    stats = server.engine.stats()
    return (
        server.app.state.client.num_in_flight == 0
        and stats["kv_blocks_used"] == 0  # referenced blocks only (cached-idle ones excluded)
        and stats["num_running"] == 0
        and stats["num_waiting"] == 0  # an abort reaches a waiting request a step later
    )


def test_queue_cap_gives_429_with_retry_after(server: ServerThread, http: httpx.Client) -> None:
    server.control("pause")
    try:
        body = {"messages": MSG, "stream": True, "max_tokens": 5}
        with (
            http.stream("POST", "/v1/chat/completions", json=body) as s1,
            http.stream("POST", "/v1/chat/completions", json=body) as s2,
        ):
            assert s1.status_code == 200 and s2.status_code == 200
            assert server.app.state.client.num_in_flight == 2
            r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert r.status_code == 429
            assert r.headers["retry-after"] == "3"
            assert r.json()["error"]["code"] == "queue_full"
            # A score call is admitted whole or not at all.
            r = http.post("/v1/score", json={"query": "q", "items": ["a"], "label_token_ids": [1]})
            assert r.status_code == 429
    finally:
        server.control("resume")
    _wait_for(lambda: _idle(server))
    # Capacity is back.
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    # More items than the server can ever hold is the caller's error, not an overload.
    r = http.post(
        "/v1/score", json={"query": "q", "items": ["a", "b", "c"], "label_token_ids": [1]}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_items"


def test_stream_disconnect_frees_kv(
    server: ServerThread, http: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="greenlane.request")
    body = {"messages": MSG, "stream": True, "max_tokens": 200, "ignore_eos": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(8):  # role chunk and a few deltas
            next(lines)
        _wait_for(lambda: server.engine.stats()["kv_blocks_used"] > 0)
        rid = server.control("added")[-1]["request_id"]
    # Leaving the block closes the connection mid-stream.
    _wait_for(lambda: _idle(server))
    aborted = [q for q in server.control("added") if q["request_id"] == rid][0]
    assert aborted["status"] == "FINISHED_ABORTED"
    assert aborted["num_output_tokens"] < 200
    # Its one log line says why it ended early.
    _wait_for(lambda: any("client disconnected" in r.getMessage() for r in caplog.records))


def test_non_streaming_disconnect_aborts(server: ServerThread) -> None:
    # The client goes away only once the request is known to be admitted: a client-side
    # timeout (the old version of this test) could fire before a loaded server had even read
    # the request, and then nothing was admitted, aborted or checked.
    body = json.dumps({"messages": MSG, "max_tokens": 50}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    num_added = len(server.control("added"))
    server.control("pause")
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(head + body)
            _wait_for(
                lambda: (
                    len(server.control("added")) > num_added
                    and server.app.state.client.num_in_flight == 1
                )
            )
        # The socket is closed: the server sees the disconnect and releases the request.
        _wait_for(lambda: server.app.state.client.num_in_flight == 0)
        # The abort reaches the engine while it is still paused.
        _wait_for(lambda: server.control("added")[num_added]["status"] == "FINISHED_ABORTED")
    finally:
        server.control("resume")
    _wait_for(lambda: _idle(server))
    (req,) = server.control("added")[num_added:]
    assert req["status"] == "FINISHED_ABORTED"
    assert req["num_output_tokens"] == 0  # paused until after the abort: nothing was generated


def test_health_and_metrics(server: ServerThread, http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    assert http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2}).status_code == 200
    http.post("/v1/completions", json={"prompt": "abc", "max_tokens": -2})
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert 'greenlane_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'greenlane_requests_total{endpoint="/v1/completions",status="400"}' in text
    for name in (
        "greenlane_ttft_seconds_count",
        "greenlane_tpot_seconds_count",
        "greenlane_e2e_seconds_count",
        "greenlane_queue_depth",
        "greenlane_running_requests",
        "greenlane_kv_blocks_used",
        "greenlane_kv_blocks_total 1000.0",
        "greenlane_prefix_cache_hit_ratio",
        "greenlane_api_server_cpu_share",  # this process's (app/load_watch.py)
    ):
        assert name in text, name
    recent = server.app.state.metrics.recent()
    assert recent["completed_total"] >= 2 and recent["ttft_s"]


def test_one_log_line_per_request(http: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="greenlane.request"):
        http.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 3})
        time.sleep(0.1)
    lines = [r.getMessage() for r in caplog.records if r.name == "greenlane.request"]
    assert len(lines) == 1, lines
    line = lines[0]
    for part in (
        "id=cmpl-",
        "endpoint=/v1/completions",
        "status=200",
        "prompt_tokens=4",
        "output_tokens=3",
        "ttft_s=0.",
        "total_s=",
    ):
        assert part in line, line


def test_api_key() -> None:
    with fake_server(api_key="s3cret") as srv, httpx.Client(base_url=srv.url) as c:
        body = {"prompt": "a", "max_tokens": 1}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models").status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert c.post("/v1/completions", json=body, headers=ok).status_code == 200
        assert c.get("/v1/models", headers=ok).status_code == 200
        assert c.get("/health").status_code == 200  # probes need no key


def test_dead_engine_and_draining() -> None:
    with fake_server() as srv, httpx.Client(base_url=srv.url) as c:
        srv.app.state.client.start_draining()
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        srv.app.state.client.draining = False
        srv.control("kill")
        _wait_for(lambda: c.get("/health").status_code == 503)
        assert c.get("/health").json() == {"status": "engine_dead"}
        r = c.post("/v1/chat/completions", json={"messages": MSG, "stream": True})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"


def test_killed_engine_core_fails_requests_in_flight_cleanly() -> None:
    """The engine core process dies (SIGKILL) while streams and a non-streaming request are
    running: /health turns 503, every request in flight ends with a clear error (an error
    event in the stream, a 5xx JSON error otherwise), the server keeps answering."""
    import os
    import signal

    body = {"messages": MSG, "stream": True, "max_tokens": 200, "ignore_eos": True}
    with fake_server() as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        srv.control("pause")  # nothing finishes before the kill
        results: dict[str, object] = {}

        def non_streaming() -> None:
            r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5})
            results["plain"] = (r.status_code, r.json())

        t = threading.Thread(target=non_streaming)
        with c.stream("POST", "/v1/chat/completions", json=body) as s:
            assert s.status_code == 200
            lines = s.iter_lines()
            next(lines)  # the role chunk: the request is admitted and streaming
            t.start()
            _wait_for(lambda: srv.app.state.client.num_in_flight == 2)
            os.kill(srv.core_pid, signal.SIGKILL)
            rest = "\n".join(lines)
        t.join(30)
        assert '"error"' in rest and "engine" in rest and rest.rstrip().endswith("[DONE]")
        status, err = results["plain"]  # type: ignore[misc]
        assert status >= 500 and "engine" in err["error"]["message"]  # type: ignore[index]
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"


def test_concurrent_requests_all_complete(server: ServerThread) -> None:
    # More concurrent callers than the cap: each gets 200 or 429, nothing else, no leaks.
    statuses: list[int] = []

    def call() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            statuses.append(
                c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3}).status_code
            )

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(statuses) <= {200, 429} and 200 in statuses
    _wait_for(lambda: _idle(server))


_ORPHAN_PARENT = """
import sys, time
sys.path.insert(0, "tests")
from fake_engine import FakeEngine
from runtime.core.process import start_engine_core
from runtime.config import EngineConfig

if __name__ == "__main__":
    handle, proc = start_engine_core(EngineConfig(), FakeEngine, timeout_s=60)
    print(handle.pid, flush=True)
    time.sleep(600)
"""


def test_engine_core_exits_when_its_api_server_is_killed(tmp_path) -> None:  # noqa: ANN001
    """SIGKILL the process that started the engine core: the core notices (its parent is
    gone) and exits on its own instead of holding the device as an orphan."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(_ORPHAN_PARENT)
    parent = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    try:
        core_pid = int(parent.stdout.readline())  # type: ignore[union-attr]

        def alive(pid: int) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            # A zombie (exited, not reaped by init yet) counts as gone.
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(") ")[1][0] != "Z"

        assert alive(core_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        _wait_for(lambda: not alive(core_pid), timeout_s=15)
    finally:
        parent.kill()


def test_the_engine_cores_socket_folder_is_removed_at_shutdown() -> None:
    import os

    with fake_server() as srv:
        address = srv.app.state.engine._core.handle.input_address
        folder = os.path.dirname(address.removeprefix("ipc://"))
        assert os.path.isdir(folder)
    assert not os.path.exists(folder)
