"""POST /admin/api/profile and the trace summary (runtime/diagnostics/profiling.py).

The route runs the torch profiler over the real engine's next steps (random:tiny on the CPU:
CPU ops instead of kernels); the summary is checked against a hand-made chrome trace."""

from __future__ import annotations

import gzip
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from runtime.diagnostics.profiling import kernel_category, summarize_trace

LOOPBACK = ("127.0.0.1", 50123)
LOCAL_URL = "http://127.0.0.1:8000"
PROFILE = "/admin/api/profile"


@pytest.mark.parametrize(
    "name,category",
    [
        ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>", "attention"),
        ("flash_fwd_splitkv_kernel", "attention"),
        ("void flashinfer::AppendPagedKVCacheKernel<...>", "rope_kv_write"),
        ("_rope_kv_write_kernel", "rope_kv_write"),
        ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "gemm"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
        ("void flashinfer::norm::FusedAddRMSNormKernel<...>", "norm"),
        ("void flashinfer::activation::act_and_mul_kernel<...>", "activation"),
        ("void at::native::reduce_kernel<ArgMaxOps>", "sampling"),
        ("Memcpy HtoD (Pinned -> Device)", "copy"),
        ("some_unknown_kernel", "other"),
    ],
)
def test_kernel_category(name: str, category: str) -> None:
    assert kernel_category(name) == category


def test_summarize_trace(tmp_path: Path) -> None:
    """Kernels by name and category per step, the busy share of the window; CPU ops ignored."""
    events = [
        {"ph": "X", "cat": "kernel", "name": "nvjet_gemm_a", "ts": 0.0, "dur": 60.0},
        {"ph": "X", "cat": "kernel", "name": "nvjet_gemm_a", "ts": 100.0, "dur": 60.0},
        {
            "ph": "X",
            "cat": "kernel",
            "name": "BatchDecodeWithPagedKVCacheKernel",
            "ts": 60.0,
            "dur": 20.0,
        },
        {"ph": "X", "cat": "Kernel", "name": "rmsnorm", "ts": 180.0, "dur": 20.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 500.0},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 5.0},
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = summarize_trace(str(path), num_steps=2)
    assert s["num_steps"] == 2
    assert s["wall_ms"] == pytest.approx(0.2)  # first kernel start 0 to last end 200 µs
    assert s["kernel_ms"] == pytest.approx(0.16)
    assert s["busy_fraction"] == pytest.approx(0.8)
    assert s["launches_per_step"] == 2.0
    assert s["by_category"]["gemm"] == {
        "launches_per_step": 1.0,
        "ms_per_step": 0.06,
        "share": 0.75,
    }
    assert s["by_category"]["attention"]["ms_per_step"] == 0.01
    assert s["by_category"]["norm"]["launches_per_step"] == 0.5
    top = s["top_kernels"][0]
    assert top["name"] == "nvjet_gemm_a" and top["us_per_launch"] == 60.0
    assert top["us_per_step"] == 60.0 and top["category"] == "gemm"


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def app_client(profile_dir: Path):
    from app.main import create_app
    from app.settings import Settings

    # The trace file's folder (the engine core inherits the variable at its start).
    before = os.environ.get("GREENLANE_PROFILE_DIR")
    os.environ["GREENLANE_PROFILE_DIR"] = str(profile_dir)
    try:
        app = create_app(
            Settings(model="random:tiny", max_num_seqs=4, block_size=4, admin_token=None)
        )
        with TestClient(app, client=LOOPBACK, base_url=LOCAL_URL) as client:
            yield client
    finally:
        if before is None:
            os.environ.pop("GREENLANE_PROFILE_DIR", None)
        else:
            os.environ["GREENLANE_PROFILE_DIR"] = before


def test_profile_under_load(app_client: TestClient, profile_dir: Path) -> None:
    """Steps that run while the profile is on are counted by kind; the summary has the top ops
    and the trace file exists (in the server's profile folder)."""
    client = app_client
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            client.post(
                "/v1/completions",
                json={
                    "model": "random:tiny",
                    "prompt": [5, 6, 7, 8],
                    "max_tokens": 24,
                    "ignore_eos": True,
                },
            )

    workers = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        r = client.post(PROFILE, json={"num_steps": 6, "timeout_s": 60, "trace": True})
    finally:
        stop.set()
        for w in workers:
            w.join(30)
    assert r.status_code == 200, r.text
    s = r.json()
    assert s["num_steps"] == 6 and s["num_steps_asked"] == 6 and not s["timed_out"]
    assert sum(s["steps_by_kind"].values()) == 6
    assert set(s["steps_by_kind"]) <= {"decode", "mixed", "prefill"}
    assert s["what"].startswith("CPU ops")
    assert s["top_kernels"] and s["kernel_ms"] > 0
    assert s["wall_ms"] > 0
    # The host's own time by op, largest first, the model's torch ops among them.
    host = s["host_ops"]
    assert host and any(op["name"].startswith("aten::") for op in host)
    ms = [op["self_cpu_ms"] for op in host]
    assert ms == sorted(ms, reverse=True) and ms[0] > 0
    trace = Path(s["trace_path"])
    assert trace.is_relative_to(profile_dir) and trace.exists()
    assert "traceEvents" in json.loads(trace.read_text())


def test_profile_idle_times_out_and_one_at_a_time(app_client: TestClient) -> None:
    """No load: the profile answers after its timeout with no steps; a second profile asked
    for while the first waits is a 409; the engine serves on afterwards."""
    client = app_client
    first: dict = {}

    def idle_profile() -> None:
        first["r"] = client.post(PROFILE, json={"num_steps": 3, "timeout_s": 4})

    t = threading.Thread(target=idle_profile)
    t.start()
    time.sleep(1.5)  # the first one reaches the engine (it waits 4 s for steps)
    r = client.post(PROFILE, json={"num_steps": 1, "timeout_s": 1})
    t.join(30)
    assert r.status_code == 409, r.text
    assert "already running" in r.json()["error"]["message"]
    s = first["r"].json()
    assert first["r"].status_code == 200 and s["timed_out"] and s["num_steps"] == 0
    assert "trace_path" not in s  # no trace asked for
    r = client.post(
        "/v1/completions", json={"model": "random:tiny", "prompt": [5, 6], "max_tokens": 2}
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "body,param",
    [
        ({"num_steps": 0}, "num_steps"),
        ({"num_steps": 10**6}, "num_steps"),
        ({"num_steps": "5"}, "num_steps"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"trace": "yes"}, "trace"),
        ({"path": "/etc/x"}, "path"),  # the server picks the trace file, never the caller
    ],
)
def test_profile_bad_body_is_400(app_client: TestClient, body: dict, param: str) -> None:
    r = app_client.post(PROFILE, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_profile_needs_a_local_client_or_the_token() -> None:
    """A change route: from a non-loopback client without a token it is refused (403)."""
    from types import SimpleNamespace

    from fake_partition import FakeEngine
    from fastapi import FastAPI

    from app.admin import router

    app = FastAPI()
    app.include_router(router)
    app.state.engine = FakeEngine()
    app.state.settings = SimpleNamespace(admin_token=None)
    r = TestClient(app, client=("203.0.113.7", 50123), base_url=LOCAL_URL).post(PROFILE, json={})
    assert r.status_code == 403, r.text
    r = TestClient(app, client=LOOPBACK, base_url=LOCAL_URL).post(PROFILE, json={})
    assert r.status_code == 404, r.text  # the fake engine cannot profile


def test_a_profiler_that_fails_to_start_leaves_the_engine_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The profiler starts on the engine thread: its failure is the caller's error, never the
    end of the step loop."""
    from test_engine import make_engine

    from runtime.diagnostics import profiling
    from runtime.request import Request, RequestKind, SamplingParams

    def broken_start(self, device):  # type: ignore[no-untyped-def]
        raise RuntimeError("profiler already active in this process")

    monkeypatch.setattr(profiling.StepProfile, "start", broken_start)
    engine, sink = make_engine()
    try:
        with pytest.raises(RuntimeError, match="did not start: profiler already active"):
            engine.profile_steps(3, timeout_s=10)
        assert engine.is_alive()
        sp = SamplingParams(max_tokens=3, ignore_eos=True)
        engine.add(Request("after", RequestKind.GENERATE, [5, 6, 7], sp))
        sink.wait("after")
        assert len(sink.tokens("after")) == 3
    finally:
        engine.shutdown(0)


def test_the_profile_is_read_in_a_process_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a profile's events takes seconds of Python for a few hundred GPU steps: on the
    engine thread it stalled serving (the H100, 2026-12-05: 30 s), and on another thread of
    the engine's process it starved the engine thread of the GIL (scoring P50 12 s). The
    engine's process only writes the trace; `key_averages` never runs there, and the summary
    still has the ops, and says what the stop and the export cost."""
    from test_engine import make_engine

    from runtime.request import Request, RequestKind, SamplingParams

    def in_process(self, *a, **kw):  # type: ignore[no-untyped-def]
        raise AssertionError("the profile's events were read in the engine's process")

    monkeypatch.setattr(torch.profiler.profile, "key_averages", in_process)
    monkeypatch.setattr(torch.autograd.profiler.profile, "key_averages", in_process)
    engine, sink = make_engine()
    try:
        sp = SamplingParams(max_tokens=40, ignore_eos=True)
        engine.add(Request("busy", RequestKind.GENERATE, [5, 6, 7], sp))
        s = engine.profile_steps(4, timeout_s=60)
        sink.wait("busy")
    finally:
        engine.shutdown(0)
    assert s["num_steps"] == 4 and not s["timed_out"]
    assert s["what"] == "CPU ops (no CUDA device)" and s["kernel_ms"] > 0
    names = {op["name"] for op in s["host_ops"]}
    assert any(n.startswith("aten::") for n in names), names
    assert s["engine_stop_ms"] >= 0 and s["export_ms"] > 0
    assert s["summarize_ms"] >= s["export_ms"]


def test_host_ops_own_time_excludes_their_nested_ops(tmp_path: Path) -> None:
    """A host op's own time is its duration less its direct children's on the same thread;
    another thread's ops never nest in it; kernels count only as device rows."""
    from runtime.diagnostics.profile_trace import trace_rows

    def op(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}

    events = [
        op("aten::linear", 0.0, 100.0),
        op("aten::addmm", 10.0, 60.0),  # in linear
        op("cudaLaunchKernel", 20.0, 15.0, cat="cuda_runtime"),  # in addmm
        op("aten::relu", 80.0, 10.0),  # in linear, after addmm
        op("aten::relu", 50.0, 500.0, tid=2),  # another thread: nests in nothing
        op("gemm_kernel", 30.0, 40.0, cat="kernel"),
        op("gemm_kernel", 200.0, 40.0, cat="kernel"),
        {"ph": "i", "cat": "cpu_op", "name": "instant", "ts": 5.0},
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    rows = trace_rows(str(path), on_cuda=True)
    host = {name: (count, us) for name, count, us in rows["host"]}
    assert host == {
        "aten::linear": (1, 30.0),  # 100 - 60 - 10
        "aten::addmm": (1, 45.0),  # 60 - 15
        "cudaLaunchKernel": (1, 15.0),
        "aten::relu": (2, 510.0),
    }
    assert rows["device"] == [("gemm_kernel", 2, 80.0)]
    assert trace_rows(str(path), on_cuda=False)["device"] == rows["host"]
