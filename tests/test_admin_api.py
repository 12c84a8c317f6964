"""Admin API: protection rules, validation, state shape, SSE stream.

Runs the admin router on a bare FastAPI app with the test-only FakeEngine/FakePartition, so it
checks app/admin.py alone; the browser test drives the page against the full app.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from fake_partition import FAKE_SPLITS, FAKE_TOTAL_SMS, FakeEngine
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.admin import is_loopback, percentile, router
from policies import POLICY_NAMES
from runtime.partition import UnavailablePartition

LOOPBACK = ("127.0.0.1", 50123)
REMOTE = ("203.0.113.7", 50123)  # TEST-NET-3: never loopback
LOCAL_URL = "http://127.0.0.1:8000"  # a local Host: loopback-only changes need one


def make_app(token: str | None = None, engine: FakeEngine | None = None) -> FastAPI:
    app = FastAPI()
    app.include_router(router)
    app.state.engine = engine if engine is not None else FakeEngine()
    app.state.metrics = app.state.engine.metrics
    app.state.settings = SimpleNamespace(admin_token=token)
    return app


# --- protection -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body",
    [
        ("/admin/api/partition", {"mode": "static", "prefill_sms": 64}),
        ("/admin/api/policy", {"policy": "fcfs"}),
    ],
)
def test_token_required_when_set(path: str, body: dict) -> None:
    app = make_app(token="s3cret")
    engine: FakeEngine = app.state.engine
    # Loopback gives no pass when a token is configured.
    client = TestClient(app, client=LOOPBACK, base_url=LOCAL_URL)
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Basic s3cret"},
        {"Authorization": "Bearer "},
    ):
        r = client.put(path, json=body, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
    assert engine.partition.calls == [] and engine.policy_calls == []

    r = TestClient(app, client=REMOTE).put(
        path, json=body, headers={"Authorization": "Bearer s3cret"}
    )
    assert r.status_code == 200, r.text
    assert engine.partition.calls == ["static:64"] or engine.policy_calls == ["fcfs"]


def test_no_token_loopback_only() -> None:
    app = make_app(token=None)
    engine: FakeEngine = app.state.engine
    body = {"mode": "static", "prefill_sms": 48}
    # Starlette's TestClient default host is "testclient": deliberately treated as remote.
    for client in (TestClient(app), TestClient(app, client=REMOTE)):
        r = client.put("/admin/api/partition", json=body)
        assert r.status_code == 403, r.text
        assert r.json()["error"]["type"] == "permission_error"
    assert engine.partition.calls == []

    r = TestClient(app, client=LOOPBACK, base_url=LOCAL_URL).put("/admin/api/partition", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["partition"]["prefill_sms"] == 48
    assert engine.partition.calls == ["static:48"]


def test_reads_need_the_token_when_one_is_set() -> None:
    client = TestClient(make_app(token="s3cret"), client=REMOTE)
    assert client.get("/admin/api/state").status_code == 401
    assert client.get("/admin/api/events").status_code == 401
    r = client.get("/admin/api/state", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = client.get("/admin/api/state", headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200
    # Without a token the state is open (the gate's Host rule guards a loopback server).
    assert TestClient(make_app(), client=REMOTE).get("/admin/api/state").status_code == 200
    # The page and its assets are open: the page asks for the token.
    page = client.get("/admin")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "/admin/static/admin.js" in page.text
    assert 'id="gc-text"' in page.text  # the collector's pauses, filled from the state's gc
    for name, kind in (("admin.js", "javascript"), ("admin.css", "css")):
        r = client.get(f"/admin/static/{name}")
        assert r.status_code == 200 and kind in r.headers["content-type"]
    assert "renderGc(s.gc)" in client.get("/admin/static/admin.js").text
    assert client.get("/admin/static/..%2Fadmin.html").status_code == 404
    assert client.get("/admin/static/admin.html").status_code == 404


@pytest.mark.parametrize(
    "host,expected",
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("10.0.0.1", False),
        ("::ffff:10.0.0.1", False),
        ("testclient", False),
        ("", False),
        (None, False),
        ("localhost", False),
    ],
)
def test_is_loopback(host: str | None, expected: bool) -> None:
    assert is_loopback(host) is expected


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"mode": "static", "prefill_sms": 50},  # not a pre-created split (ValueError from set_mode)
        {"mode": "static"},  # split missing
        {"mode": "static", "prefill_sms": "lots"},
        {"mode": "sideways"},
        {"prefill_sms": 64},
        {"mode": "auto", "extra": 1},
        [1, 2],
    ],
)
def test_bad_partition_is_400(body: object) -> None:
    app = make_app()
    r = TestClient(app, client=LOOPBACK, base_url=LOCAL_URL).put("/admin/api/partition", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert app.state.engine.partition.state().mode == "off"


def test_non_json_body_is_400() -> None:
    r = TestClient(make_app(), client=LOOPBACK, base_url=LOCAL_URL).put(
        "/admin/api/policy", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400


@pytest.mark.parametrize("body", [{"policy": "lifo"}, {"policy": 3}, {}, {"policy": "FCFS"}])
def test_bad_policy_is_400(body: object) -> None:
    app = make_app()
    r = TestClient(app, client=LOOPBACK, base_url=LOCAL_URL).put("/admin/api/policy", json=body)
    assert r.status_code == 400, r.text
    assert app.state.engine.policy_calls == []


def test_unavailable_partition_reports_reason_and_refuses_static() -> None:
    engine = FakeEngine(partition=UnavailablePartition("no CUDA device"))
    client = TestClient(make_app(engine=engine), client=LOOPBACK, base_url=LOCAL_URL)
    part = client.get("/admin/api/state").json()["partition"]
    assert part["available"] is False and part["reason"] == "no CUDA device"
    r = client.put("/admin/api/partition", json={"mode": "static", "prefill_sms": 64})
    assert r.status_code == 400 and "no CUDA device" in r.json()["error"]["message"]
    assert client.put("/admin/api/partition", json={"mode": "off"}).status_code == 200


# --- changes reach the engine -----------------------------------------------------------------


def test_partition_pin_and_release() -> None:
    app = make_app()
    client = TestClient(app, client=LOOPBACK, base_url=LOCAL_URL)
    pinned = client.put("/admin/api/partition", json={"mode": "static", "prefill_sms": 80})
    assert pinned.status_code == 200
    part = pinned.json()["partition"]
    assert (part["mode"], part["prefill_sms"], part["decode_sms"], part["pinned"]) == (
        "static",
        80,
        FAKE_TOTAL_SMS - 80,
        True,
    )
    released = client.put("/admin/api/partition", json={"mode": "auto"}).json()["partition"]
    assert released["mode"] == "auto" and released["pinned"] is False
    assert app.state.engine.partition.calls == ["static:80", "auto"]


def test_policy_switch() -> None:
    app = make_app()
    client = TestClient(app, client=LOOPBACK, base_url=LOCAL_URL)
    r = client.put("/admin/api/policy", json={"policy": "spf"})
    assert r.status_code == 200 and r.json()["policy"]["current"] == "spf"
    assert app.state.engine.policy_calls == ["spf"]


# --- state shape ------------------------------------------------------------------------------


def test_state_shape_and_numbers() -> None:
    engine = FakeEngine()
    metrics = engine.metrics
    for i in range(1, 101):  # TTFT 10..1000 ms
        metrics.record(ttft_s=i / 100, tpot_s=0.02, e2e_s=i / 100 + 1.0, num_tokens=10)
    app = make_app(engine=engine)
    state = TestClient(app).get("/admin/api/state").json()

    assert set(state) >= {
        "partition",
        "queues",
        "kv",
        "policy",
        "latency",
        "throughput",
        "cost_model",
        "engine",
        "time_s",
    }
    part = state["partition"]
    assert part["available"] is True and part["total_sms"] == FAKE_TOTAL_SMS
    assert part["splits"] == FAKE_SPLITS and part["mode"] == "off"
    assert state["queues"] == {"waiting": 0, "running": 0}
    assert state["engine"]["num_failed_steps"] == 3  # the engine's counters since start
    assert state["engine"]["num_failed_requests"] == 1
    assert (state["engine"]["num_preemptions"], state["engine"]["num_chunked_scoring"]) == (4, 5)
    assert state["engine"]["num_layer_sliced_prefills"] == 6
    assert state["engine"]["num_sub_layer_sliced_prefills"] == 2
    assert state["engine"]["fallbacks"] == {"prefill graphs": "stand-in: out of memory"}
    assert state["engine"]["kernels_compiled_while_serving"] == 2
    assert state["engine"]["overlap"] == {"num_drains_before_held_launch": 1}
    assert state["kv"]["blocks_total"] == 256 and state["kv"]["usage"] == 0
    assert state["policy"] == {
        "current": "srjf",
        "available": list(POLICY_NAMES),
        "fairness_lambda": None,  # the fake engine reports none
        "ttft_slo_ms": None,
    }
    assert {"srjf", "spf", "fcfs"} <= set(POLICY_NAMES)
    ttft = state["latency"]["ttft_s"]
    assert ttft["count"] == 100
    assert ttft["p50"] == pytest.approx(0.505)
    assert ttft["p99"] == pytest.approx(0.9901)
    assert state["latency"]["tpot_s"]["p90"] == pytest.approx(0.02)
    assert state["throughput"]["completed_total"] == 100
    assert state["throughput"]["tokens_total"] == 1000
    cm = state["cost_model"]
    assert cm["measured_prefill_ms"] == pytest.approx(part["measured_prefill_ms"])
    assert cm["predicted_decode_ms"] is not None


def test_nan_statistics_become_null_not_a_500() -> None:
    """Seen on the H200: a NaN cost-model error (no measurement yet after a switch to a static
    split) made PUT /admin/api/partition and /admin/api/state answer 500."""
    engine = FakeEngine()
    base_stats = engine.stats
    engine.stats = lambda: {**base_stats(), "cost_model_mape": float("nan")}  # type: ignore[method-assign]
    base_state = engine.partition._split_state

    def nan_state():
        st = base_state()
        st.measured_decode_ms = float("nan")
        st.predicted_prefill_ms = float("inf")
        return st

    engine.partition._split_state = nan_state  # type: ignore[method-assign]
    client = TestClient(make_app(engine=engine), client=LOOPBACK, base_url=LOCAL_URL)
    for r, prefill_sms in (
        (client.get("/admin/api/state"), FAKE_TOTAL_SMS),
        (client.put("/admin/api/partition", json={"mode": "static", "prefill_sms": 80}), 80),
    ):
        assert r.status_code == 200
        state = json.loads(r.text)  # strict JSON: no NaN tokens
        assert state["cost_model"]["mape"] is None
        assert state["partition"]["measured_decode_ms"] is None
        assert state["partition"]["predicted_prefill_ms"] is None
        assert state["partition"]["prefill_sms"] == prefill_sms


def test_throughput_rate_from_counter_deltas(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngine()
    app = make_app(engine=engine)
    client = TestClient(app)
    clock = [1000.0]
    monkeypatch.setattr("app.admin.time.monotonic", lambda: clock[0])
    client.get("/admin/api/state")
    for _ in range(4):
        engine.metrics.record(ttft_s=0.1, tpot_s=0.01, e2e_s=0.5, num_tokens=25)
    clock[0] += 2.0
    tp = client.get("/admin/api/state").json()["throughput"]
    assert tp["requests_per_s"] == pytest.approx(2.0)
    assert tp["tokens_per_s"] == pytest.approx(50.0)


def test_state_without_metrics_falls_back_and_says_so() -> None:
    app = make_app()
    del app.state.metrics
    state = TestClient(app).get("/admin/api/state").json()
    assert state["latency"]["source"] == "engine_stats_fallback"
    assert state["latency"]["ttft_s"]["p99"] is None
    assert state["throughput"]["tokens_per_s"] is None


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0], 100) == 2.0


# --- SSE over a real socket -------------------------------------------------------------------


@pytest.fixture()
def live_server() -> Iterator[tuple[str, FastAPI]]:
    app = make_app()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", app
    server.should_exit = True
    thread.join(timeout=10)
    assert not thread.is_alive(), "server did not shut down with an SSE client gone"


def test_sse_stream_yields_state_snapshots(live_server: tuple[str, FastAPI]) -> None:
    base, app = live_server
    events: list[dict] = []
    with httpx.Client(timeout=10) as client:
        with client.stream("GET", f"{base}/admin/api/events", params={"interval_s": 0.1}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            event_name = None
            for line in r.iter_lines():
                if line.startswith("event:"):
                    event_name = line.split(":", 1)[1].strip()
                elif line.startswith("data:"):
                    assert event_name == "state"
                    events.append(json.loads(line.split(":", 1)[1]))
                    if len(events) == 1:
                        # A change made between snapshots shows up in a later one.
                        asyncio.run(app.state.engine.set_policy("fcfs"))
                    if len(events) == 3:
                        break
    assert [e["policy"]["current"] for e in events][0] == "srjf"
    assert events[-1]["policy"]["current"] == "fcfs"
    assert events[0]["time_s"] < events[-1]["time_s"]


def test_loopback_allowed_over_real_socket(live_server: tuple[str, FastAPI]) -> None:
    base, app = live_server
    r = httpx.put(f"{base}/admin/api/policy", json={"policy": "fcfs"}, timeout=10)
    assert r.status_code == 200, r.text
    assert app.state.engine.policy_calls == ["fcfs"]


def test_engine_not_started_yet() -> None:
    """create_app sets app.state.engine = None until the lifespan has built the engine."""
    app = make_app()
    app.state.engine = None
    client = TestClient(app, client=LOOPBACK, base_url=LOCAL_URL)
    state = client.get("/admin/api/state").json()
    assert state["engine"] == {
        "alive": False,
        "starting": True,
        "num_failed_steps": None,
        "num_failed_requests": None,
        "num_preemptions": None,
        "num_chunked_scoring": None,
        "num_layer_sliced_prefills": None,
        "num_sub_layer_sliced_prefills": None,
        "fallbacks": None,
        "kernels_compiled_while_serving": None,
        "overlap": {"num_drains_before_held_launch": None},
        "step": {"running_s": None, "layer": None, "num_layers": None, "prefill_tokens": None},
    }
    assert state["partition"]["available"] is False
    assert state["queues"] == {"waiting": None, "running": None}
    assert client.put("/admin/api/policy", json={"policy": "fcfs"}).status_code == 503
    assert client.put("/admin/api/partition", json={"mode": "off"}).status_code == 503


def test_router_inside_the_full_app() -> None:
    """The admin routes as `app.main.create_app` wires them (its lifespan, error handlers,
    middleware, `Metrics.recent()`), over the fake engine in an engine core process."""
    from fake_engine import FakeEngine as CoreFakeEngine

    from app.main import create_app
    from app.settings import Settings

    app = create_app(Settings(admin_token="full-app-token"), engine_factory=CoreFakeEngine)
    auth = {"Authorization": "Bearer full-app-token"}
    with TestClient(app, client=REMOTE, base_url=LOCAL_URL) as client:
        assert client.get("/admin").status_code == 200
        assert client.get("/admin/api/state").status_code == 401
        state = client.get("/admin/api/state", headers=auth).json()
        assert state["engine"]["alive"] is True
        assert state["latency"]["source"] == "metrics"  # the app's rolling windows
        assert state["partition"]["available"] is False
        assert "no GPU" in state["partition"]["reason"]
        assert client.put("/admin/api/policy", json={"policy": "spf"}).status_code == 401
        r = client.put("/admin/api/policy", json={"policy": "spf"}, headers=auth)
        assert r.status_code == 200 and r.json()["policy"]["current"] == "spf"
        r = client.put(
            "/admin/api/partition", json={"mode": "static", "prefill_sms": 7}, headers=auth
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "prefill_sms"


# --- prefix-cache reset -----------------------------------------------------------------------


class _ResettableEngine(FakeEngine):
    """FakeEngine plus the `reset_prefix_cache` call the reset endpoint makes."""

    def __init__(self) -> None:
        super().__init__()
        self.reset_calls = 0

    async def reset_prefix_cache(self) -> None:
        self.reset_calls += 1


RESET = "/admin/api/prefix-cache/reset"


def test_prefix_cache_reset_protection() -> None:
    engine = _ResettableEngine()
    app = make_app(token="s3cret", engine=engine)
    loop_client = TestClient(app, client=LOOPBACK, base_url=LOCAL_URL)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert loop_client.post(RESET, headers=headers).status_code == 401
    assert engine.reset_calls == 0
    remote = TestClient(app, client=REMOTE)
    r = remote.post(RESET, json={}, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200, r.text
    assert r.json()["reset"] == "queued" and engine.reset_calls == 1

    open_app = make_app(token=None, engine=engine)
    assert TestClient(open_app, client=REMOTE).post(RESET, json={}).status_code == 403
    assert TestClient(open_app).post(RESET, json={}).status_code == 403  # "testclient": remote
    assert engine.reset_calls == 1
    local = TestClient(open_app, client=LOOPBACK, base_url=LOCAL_URL)
    assert local.post(RESET, json={}).status_code == 200
    assert engine.reset_calls == 2
    # CSRF: a web page can POST text/plain (or nothing) cross-site without a preflight.
    for kwargs in ({}, {"content": b"{}", "headers": {"Content-Type": "text/plain"}}):
        assert local.post(RESET, **kwargs).status_code == 415
    assert local.post(RESET, json={"x": 1}).status_code == 400
    assert engine.reset_calls == 2


def test_prefix_cache_reset_before_the_engine_started() -> None:
    app = make_app()
    app.state.engine = None
    client = TestClient(app, client=LOOPBACK, base_url=LOCAL_URL)
    assert client.post(RESET, json={}).status_code == 503


def test_prefix_cache_reset_reaches_the_real_engine() -> None:
    """Full app, real engine on random:tiny: a scoring request fills the prefix cache; after the
    reset and one more (unrelated) request, the engine reports no cached blocks."""
    pytest.importorskip("runtime.engine", reason="runtime.engine not written yet")
    from app.main import create_app
    from app.settings import Settings

    app = create_app(Settings(model="random:tiny", max_num_seqs=4, block_size=4, admin_token=None))
    with TestClient(app, client=LOOPBACK, base_url=LOCAL_URL) as client:
        engine = app.state.engine
        query = list(range(10, 60))  # 50 tokens: several full blocks of 4
        r = client.post(
            "/v1/score", json={"query": query, "items": [[70, 71]], "label_token_ids": [1, 2]}
        )
        assert r.status_code == 200, r.text
        # Stats reach the front end with the engine core's heartbeat (every 0.2 s).
        filled = _eventually(lambda: engine.stats()["prefix_cached_blocks"], lambda v: v > 0)
        r = client.post(RESET, json={})
        assert r.status_code == 200, r.text
        assert r.json()["prefix_cached_blocks_before"] == filled
        # The reset is applied before the engine's next step.
        r = client.post("/v1/score", json={"query": [5], "items": [[6]], "label_token_ids": [1, 2]})
        assert r.status_code == 200, r.text
        _eventually(lambda: engine.stats()["prefix_cached_blocks"], lambda v: v == 0)


def test_prefill_limits_reach_the_real_engine() -> None:
    """Full app, real engine core on random:tiny: a share set through the admin API crosses
    into the engine core (a 400 there would name it) and comes back in its own stats."""
    pytest.importorskip("runtime.engine", reason="runtime.engine not written yet")
    from app.main import create_app
    from app.settings import Settings

    app = create_app(Settings(model="random:tiny", max_num_seqs=4, block_size=4, admin_token=None))
    with TestClient(app, client=LOOPBACK, base_url=LOCAL_URL) as client:
        engine = app.state.engine
        r = client.put("/admin/api/prefill", json={"chunk_fixed_share": 0.15})
        assert r.status_code == 200, r.text
        r = client.post("/v1/score", json={"query": [5], "items": [[6]], "label_token_ids": [1, 2]})
        assert r.status_code == 200, r.text
        # The next heartbeat of the core (every 0.2 s) replaces the front end's note of the
        # change with the engine's own stats: the value must survive it.
        noted_s = engine._core._last_heartbeat_s
        _eventually(lambda: engine._core._last_heartbeat_s, lambda t: t > noted_s)
        assert engine.stats()["chunk_fixed_share"] == 0.15
        r = client.put("/admin/api/prefill", json={"chunk_fixed_share": 1.5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chunk_fixed_share"
        r = client.put("/admin/api/prefill", json={"chunk_fixed_share": None})
        assert r.status_code == 200 and r.json()["prefill"]["chunk_fixed_share"] is None


def test_step_trace_of_the_real_engine() -> None:
    """Full app, real engine on random:tiny: after a scoring request and a chat request, the
    steps endpoint lists the steps that ran them (prefill tokens, decodes, device time), oldest
    first; a bad limit is a 400 naming it."""
    pytest.importorskip("runtime.engine", reason="runtime.engine not written yet")
    from app.main import create_app
    from app.settings import Settings

    app = create_app(Settings(model="random:tiny", max_num_seqs=4, block_size=4, admin_token=None))
    with TestClient(app, client=LOOPBACK, base_url=LOCAL_URL) as client:
        query = list(range(10, 61))  # 51 + 2 tokens: a partial last block of 4
        r = client.post(
            "/v1/score", json={"query": query, "items": [[70, 71]], "label_token_ids": [1, 2]}
        )
        assert r.status_code == 200, r.text
        r = client.post(
            "/v1/completions",
            json={"model": "random:tiny", "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True},
        )
        assert r.status_code == 200, r.text
        r = client.get("/admin/api/steps", params={"limit": 100})
        assert r.status_code == 200, r.text
        steps = r.json()["steps"]
        assert 0 < len(steps) <= 100
        assert set(steps[0]) == {
            "age_s",
            "on_split",
            "num_decodes",
            "decode_context_tokens",
            "num_prefill_seqs",
            "num_prefill_tokens",
            "prefill_context_tokens",
            "prefill_attention_pairs",
            "device_ms",
            "idle_before_ms",
            "predicted_ms",
            "gc_ms",
            "sms",
            "other_sms",
            "chunked_predicted_ms",
            "decode_gap_ms",
            "layer_sliced_span_ms",
            "layer_sliced_predicted_ms",
            "decode_base_ms",
            "plan_ms",
            "launch_ms",
            "prefill_discarded_tokens",
            "split_predicted_ms",
            "chunked_head_predicted_ms",
            "slice_promised_ms",
            "launch_parts_ms",
            "launch_detail",
            "launch_wait_ms",
        }
        assert all(s["launch_parts_ms"] is None for s in steps)  # the serial executor's
        assert all(s["launch_detail"] is None for s in steps)
        # A short scoring prompt with room keeps all of its KV: nothing discarded.
        assert all(s["prefill_discarded_tokens"] == 0 for s in steps)
        assert all(s["chunked_predicted_ms"] is None for s in steps)  # off: no chunked choice
        assert all(s["layer_sliced_span_ms"] is None for s in steps)  # nor layer slices
        assert all(s["split_predicted_ms"] is None for s in steps)  # nor a split
        assert all(s["decode_gap_ms"] is None for s in steps)  # the serial executor: none
        assert all(s["slice_promised_ms"] is None for s in steps)
        ages = [s["age_s"] for s in steps]
        assert ages == sorted(ages, reverse=True) and ages[-1] >= 0.0
        assert sum(s["num_prefill_tokens"] for s in steps) >= len(query) + 2 + 3
        assert sum(s["num_decodes"] for s in steps) >= 3  # 4 tokens: 1 from prefill, 3 decodes
        assert all(s["device_ms"] is None or s["device_ms"] >= 0.0 for s in steps)
        assert all(s["gc_ms"] >= 0.0 for s in steps)
        # The serial executor returns each launch as one result: every step has its host times.
        assert all(s["plan_ms"] >= 0.0 and s["launch_ms"] > 0.0 for s in steps)
        # No device events on CPU: a launch never waits for the device there.
        assert all(s["launch_wait_ms"] == 0.0 for s in steps)
        assert all(s["sms"] == 0 and s["other_sms"] == 0 for s in steps)  # the whole GPU
        one = client.get("/admin/api/steps", params={"limit": 1}).json()["steps"]
        assert len(one) == 1
        for bad in ("0", "x", "5000"):
            r = client.get("/admin/api/steps", params={"limit": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text


def test_step_trace_of_an_engine_without_one_is_404() -> None:
    client = TestClient(make_app(), client=LOOPBACK, base_url=LOCAL_URL)
    r = client.get("/admin/api/steps")
    assert r.status_code == 404 and "step trace" in r.json()["error"]["message"]


def _eventually(read, ok, timeout_s: float = 10.0):
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if ok(value):
            return value
        assert time.monotonic() < deadline, f"last value {value!r}"
        time.sleep(0.05)


# --- prefill limits ---------------------------------------------------------------------------


def test_prefill_limits_change_and_show_in_the_state() -> None:
    app = make_app()
    client = TestClient(app, client=LOOPBACK, base_url=LOCAL_URL)

    def limits(state: dict) -> dict:
        return {k: state["prefill"][k] for k in ("token_budget", "tbt_slo_ms")}

    state = client.get("/admin/api/state").json()
    assert limits(state) == {"token_budget": 8192, "tbt_slo_ms": None}
    assert state["prefill"]["mixed_step_token_budget"] == 2048
    assert state["prefill"]["chunk_tokens"] == 16384  # the engine's, as its stats report it
    # How the cut is doing: keys always there (null where the engine does not report them).
    assert set(state["prefill"]["tbt_cut"]) == {
        "cost_token_scale",
        "cost_pair_scale",
        "cost_offset_ms",
        "cost_context_ms_per_1k",
        "tail_factor",
        "slice_tail_factor",
        "num_mixed_steps",
        "num_mixed_steps_over_tbt",
        "mixed_step_ratio_p50",
        "mixed_step_ratio_p90",
        "mixed_step_ratio_p99",
    }
    assert set(state["gc"]) == {
        "full_collections",
        "full_ms_total",
        "pause_ms_max_ever",
        "young_pause_ms_max_ever",
        "pause_cpu_ms_max_ever",
    }
    assert "prefill_graphs" in state  # null without CUDA graphs
    r = client.put("/admin/api/prefill", json={"prefill_token_budget": 2048})
    assert r.status_code == 200, r.text
    assert limits(r.json()) == {"token_budget": 2048, "tbt_slo_ms": None}
    r = client.put("/admin/api/prefill", json={"tbt_slo_ms": 80.0})  # the budget is kept
    assert limits(r.json()) == {"token_budget": 2048, "tbt_slo_ms": 80.0}
    r = client.put("/admin/api/prefill", json={"tbt_slo_ms": None})  # null removes the target
    assert limits(r.json()) == {"token_budget": 2048, "tbt_slo_ms": None}
    assert app.state.engine.prefill_limits == (2048, None)
    assert r.json()["prefill"]["mixed_step_token_budget"] == 2048  # kept throughout
    # null removes the cap on steps with decodes (the budget alone), a number sets it
    r = client.put("/admin/api/prefill", json={"mixed_step_token_budget": None})
    assert r.status_code == 200 and r.json()["prefill"]["mixed_step_token_budget"] is None
    r = client.put("/admin/api/prefill", json={"mixed_step_token_budget": 1024})
    assert r.json()["prefill"]["mixed_step_token_budget"] == 1024
    assert limits(r.json()) == {"token_budget": 2048, "tbt_slo_ms": None}
    # auto's fixed-part share past the cap: off by default, set and removed at run time,
    # the other limits kept
    assert r.json()["prefill"]["chunk_fixed_share"] is None
    r = client.put("/admin/api/prefill", json={"chunk_fixed_share": 0.15})
    assert r.status_code == 200 and r.json()["prefill"]["chunk_fixed_share"] == 0.15
    assert app.state.engine.chunk_fixed_share == 0.15
    assert r.json()["prefill"]["mixed_step_token_budget"] == 1024
    r = client.put("/admin/api/prefill", json={"prefill_token_budget": 4096})
    assert r.json()["prefill"]["chunk_fixed_share"] == 0.15  # kept when left out
    r = client.put("/admin/api/prefill", json={"chunk_fixed_share": None})
    assert r.status_code == 200 and r.json()["prefill"]["chunk_fixed_share"] is None
    assert app.state.engine.chunk_fixed_share is None


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prefill_token_budget": 16384}, "prefill_token_budget"),  # above the sized budget
        ({"prefill_token_budget": 0}, "prefill_token_budget"),
        ({"prefill_token_budget": "2048"}, "prefill_token_budget"),  # strict: no strings
        ({"prefill_token_budget": None}, "prefill_token_budget"),
        ({"tbt_slo_ms": -5}, "tbt_slo_ms"),
        ({"mixed_step_token_budget": 0}, "mixed_step_token_budget"),
        ({"mixed_step_token_budget": 1.5}, "mixed_step_token_budget"),  # strict: integers
        ({"chunk_fixed_share": 0}, "chunk_fixed_share"),  # a share in (0, 1)
        ({"chunk_fixed_share": 1.0}, "chunk_fixed_share"),
        ({"chunk_fixed_share": "0.15"}, "chunk_fixed_share"),  # strict: no strings
        ({}, "prefill_token_budget"),
        ({"budget": 1}, None),
    ],
)
def test_bad_prefill_limits_are_400(body: dict, param: str | None) -> None:
    app = make_app()
    r = TestClient(app, client=LOOPBACK, base_url=LOCAL_URL).put("/admin/api/prefill", json=body)
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param
    assert app.state.engine.prefill_limits == (8192, None)


def test_prefill_limits_need_the_token_when_one_is_set() -> None:
    client = TestClient(make_app(token="s3cret"), client=LOOPBACK, base_url=LOCAL_URL)
    assert client.put("/admin/api/prefill", json={"prefill_token_budget": 1024}).status_code == 401


ERRORS_RESET = "/admin/api/cost-model/errors/reset"


def test_cost_model_errors_reset() -> None:
    """Benchmarks empty the cost model's error logs before each side; a change like any other
    (loopback without a token, a JSON body if any), and 409 where there is no cost model."""
    engine = FakeEngine()
    app = make_app(token=None, engine=engine)
    local = TestClient(app, client=LOOPBACK, base_url=LOCAL_URL)
    assert TestClient(app, client=REMOTE).post(ERRORS_RESET, json={}).status_code == 403
    assert local.post(ERRORS_RESET, json={"x": 1}).status_code == 400
    assert engine.partition.error_resets == 0
    r = local.post(ERRORS_RESET, json={})
    assert r.status_code == 200 and r.json() == {"reset": True}
    assert local.post(ERRORS_RESET).status_code == 415  # no JSON content type: CSRF guard
    assert engine.partition.error_resets == 1
    none = FakeEngine(partition=UnavailablePartition("no CUDA device"))
    r = TestClient(make_app(token=None, engine=none), client=LOOPBACK, base_url=LOCAL_URL).post(
        ERRORS_RESET, json={}
    )
    assert r.status_code == 409 and "no CUDA device" in r.json()["error"]["message"]
