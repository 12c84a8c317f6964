"""bench.serve end to end against a fake OpenAI/score server on loopback (SSE framing included),
and the max-QPS search logic against a synthetic latency curve."""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from toy_tokenizer import make_tokenizer

from bench import serve
from bench.metrics import SLO, summarize_ms
from bench.workloads import encode_ids

TOKEN_DELAY_S = 0.002


def fake_app(tok: Any) -> FastAPI:
    """Mimics the Greenlane endpoints the harness uses. Every 5th chat request gets a 503;
    without `ignore_eos` a chat stops after 2 tokens (an 'EOS')."""
    app = FastAPI()
    app.state.seen = []  # (endpoint, body) of every benchmark request
    app.state.log = []  # every request in arrival order: "chat", "score", "reset", "PUT <body>"
    app.state.count = 0
    app.state.policy = "fcfs"
    app.state.partition = "off"
    app.state.admin_enabled = True  # False: the admin endpoints answer 404 (an older server)
    # > 0: every such token (not the first, not the last) carries no text and sends no chunk,
    # as a partial UTF-8 sequence does; asked for, usage comes in every chunk.
    app.state.textless_every = 0

    def fake_state() -> dict:
        return {
            "policy": {"current": app.state.policy},
            "partition": {"available": True, "mode": app.state.partition},
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/admin/api/state")
    async def state() -> dict:
        return fake_state()

    @app.post("/admin/api/prefix-cache/reset")
    async def reset() -> JSONResponse:
        if not app.state.admin_enabled:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        app.state.log.append("reset")
        return JSONResponse({"reset": "queued", "prefix_cached_blocks_before": 3})

    @app.put("/admin/api/policy")
    async def policy(request: Request) -> JSONResponse:
        body = await request.json()
        if body["policy"] not in ("fcfs", "srjf", "spf"):
            return JSONResponse({"error": {"message": "unknown policy"}}, status_code=400)
        app.state.log.append(f"PUT {json.dumps(body, sort_keys=True)}")
        app.state.policy = body["policy"]
        return JSONResponse(fake_state())

    @app.put("/admin/api/partition")
    async def partition(request: Request) -> JSONResponse:
        body = await request.json()
        app.state.log.append(f"PUT {json.dumps(body, sort_keys=True)}")
        app.state.partition = body["mode"]
        return JSONResponse(fake_state())

    @app.post("/v1/score")
    async def score(request: Request) -> JSONResponse:
        body = await request.json()
        app.state.seen.append(("score", body))
        app.state.log.append("score")
        n = len(body["query"]) + len(body["items"][0])
        await asyncio.sleep(0.001 * n / 100)
        # Greenlane's own account: the query counted as cached, the engine's timings.
        usage = {"prompt_tokens": n, "prompt_tokens_details": {"cached_tokens": len(body["query"])}}
        timing = {"server_s": 0.001 * n / 100, "queue_s": [0.0002], "ttft_s": [0.0007]}
        return JSONResponse({"scores": [[0.7, 0.3]], "usage": usage, "timing": timing})

    # vLLM's spellings (bench.serve --server vllm): generative scoring, the dev-mode prefix
    # cache reset (an empty 200), Prometheus counters of prefix-cache tokens.
    app.state.vllm_hits = 0

    @app.post("/generative_scoring")
    async def vllm_score(request: Request) -> JSONResponse:
        body = await request.json()
        app.state.seen.append(("vllm-score", body))
        app.state.log.append("vllm-score")
        n = len(body["query"]) + len(body["items"][0])
        app.state.vllm_hits += len(body["query"])
        data = [{"index": 0, "object": "score", "score": 0.7}]
        return JSONResponse({"object": "list", "data": data, "usage": {"prompt_tokens": n}})

    @app.post("/v1/completions")
    async def vllm_completion(request: Request) -> JSONResponse:  # one token, not streamed
        body = await request.json()
        app.state.seen.append(("vllm-completion", body))
        app.state.log.append("vllm-completion")
        choice = {"index": 0, "text": "Yes", "logprobs": {"token_logprobs": [-0.1]}}
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1}
        return JSONResponse({"object": "text_completion", "choices": [choice], "usage": usage})

    @app.post("/reset_prefix_cache")
    async def vllm_reset() -> Response:
        app.state.log.append("vllm-reset")
        return Response(status_code=200)

    @app.get("/metrics")
    async def vllm_metrics() -> Response:
        text = (
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of tokens.\n"
            "# TYPE vllm:prefix_cache_hits_total counter\n"
            f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {app.state.vllm_hits}.0\n'
            f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} '
            f"{2 * app.state.vllm_hits}.0\n"
        )
        return Response(text, media_type="text/plain")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        app.state.seen.append(("chat", body))
        app.state.log.append("chat")
        app.state.count += 1
        if app.state.count % 5 == 0:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        prompt = len(encode_ids(tok, body["messages"][0]["content"]))
        num_out = body["max_tokens"] if body.get("ignore_eos") else min(2, body["max_tokens"])

        every = app.state.textless_every
        continuous = (body.get("stream_options") or {}).get("continuous_usage_stats")

        async def events() -> Any:
            def sse(obj: dict, done: int = 0) -> str:
                if continuous and "usage" not in obj:
                    obj["usage"] = {"prompt_tokens": prompt, "completion_tokens": done}
                return f"data: {json.dumps(obj)}\n\n"

            yield sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for i in range(num_out):
                await asyncio.sleep(TOKEN_DELAY_S)
                if every and i % every == every - 1 and i < num_out - 1:
                    continue  # no text: no chunk
                yield sse({"choices": [{"index": 0, "delta": {"content": f" t{i}"}}]}, i + 1)
            yield sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}, num_out)
            yield sse(
                {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": num_out}}
            )
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    make_tokenizer().save(str(path))
    return path


@pytest.fixture(scope="module")
def fake_server(tokenizer_file: Path) -> Iterator[tuple[str, FastAPI]]:
    from tokenizers import Tokenizer

    app = fake_app(Tokenizer.from_file(str(tokenizer_file)))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # loopback only
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    server.should_exit = True
    thread.join(timeout=5)


def run_cli(argv: list[str]) -> dict[str, Any]:
    assert serve.main(argv) == 0
    out = argv[argv.index("--out") + 1]
    return json.loads(Path(out).read_text())


def _sharegpt_sweep(url: str, tokenizer_file: Path) -> list[str]:
    """bench.serve arguments of the sharegpt sweep the fake-server tests share: 10 requests at
    50 QPS, then all at once (seed 3)."""
    return [
        "--url",
        url,
        "--workload",
        "sharegpt",
        "--scale",
        "0.05",
        "--num-requests",
        "10",
        "--qps",
        "50,inf",
        "--seed",
        "3",
        "--tokenizer",
        str(tokenizer_file),
    ]


def test_chat_sweep_against_fake_server(fake_server, tokenizer_file, tmp_path):
    url, app = fake_server
    app.state.seen.clear()
    app.state.count = 0
    out = tmp_path / "chat.json"
    plot = tmp_path / "chat.png"
    record = run_cli(
        [
            *_sharegpt_sweep(url, tokenizer_file),
            "--out",
            str(out),
            "--plot",
            str(plot),
            "--slo",
            "ttft:5000,tpot:5000",
            "--no-progress",
        ]
    )
    assert record["server"]["models"] == ["fake-model"]
    assert record["server"]["state"]["policy"] == {"current": "fcfs"}
    assert record["options"]["model"] == "fake-model"
    assert [r["qps"] for r in record["runs"]] == [50.0, "inf"]
    assert "metrics" not in record  # several runs: only the list
    for run in record["runs"]:
        m = run["metrics"]
        # Requests 5 and 10 of each run hit the fake 503 (the counter runs over both runs).
        assert m["completed"] + m["failed"] == 10
        assert m["failed"] == 2
        assert m["failure_reasons"] == {"HTTP 503: overloaded": 2}
        assert m["output_len_exact_fraction"] == 1.0  # ignore_eos honoured -> exact lengths
        assert m["output_tokens_from_usage_fraction"] == 1.0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert set(m[key]) >= {"mean", "median", "p90", "p99"}
        # The fake server sends tokens TOKEN_DELAY_S apart, but a client starved of CPU reads
        # them in bunches: on CI's 2-core machine even the P99 gap read 0.02 ms, the spacing
        # swallowed by a late first read. Starvation only adds time, so the bound that holds
        # is on the whole request: it cannot end sooner than its tokens were sent.
        # (The gaps themselves are checked request by request in the --record-requests test.)
        mean_out_tokens = m["total_output_tokens"] / m["completed"]
        assert m["e2el_ms"]["mean"] >= (mean_out_tokens - 1) * TOKEN_DELAY_S * 1e3 * 0.9
        assert m["ttft_ms"]["mean"] <= m["e2el_ms"]["mean"]
        assert m["goodput"] == pytest.approx(m["completed"] / m["duration_s"])
        assert m["started_unix_s"] < m["ended_unix_s"]  # every run's wall-clock window
        # the client's own CPU share of the run: measured, so above zero and below all cores
        assert 0.0 < m["client_cpu_percent"] < 100.0 * (os.cpu_count() or 1)
        assert "requests" not in run  # per-request timings only with --record-requests
    bodies = [b for kind, b in app.state.seen if kind == "chat"]
    assert all(
        b["stream"] and b["ignore_eos"] and b["stream_options"]["include_usage"] for b in bodies
    )

    # Both runs send the same requests (same seed); only arrivals (and so receive order) differ.
    def prompts(bs: list[dict]) -> list[str]:
        return sorted(b["messages"][0]["content"] for b in bs)

    assert prompts(bodies[:10]) == prompts(bodies[10:])
    assert plot.stat().st_size > 1000
    assert record["git"].keys() == {"revision", "dirty"}
    assert "bench.serve" in record["command"]


def test_record_requests_writes_per_request_timings_inside_the_run_windows(
    fake_server, tokenizer_file, tmp_path
):
    """--record-requests: each request's send time (wall clock) lies in its run's window, and
    its TTFT, TPOT and token gaps give back the run's percentiles (up to the rounding)."""
    url, app = fake_server
    app.state.count = 0
    record = run_cli(
        [
            *_sharegpt_sweep(url, tokenizer_file),
            "--record-requests",
            "--out",
            str(tmp_path / "r.json"),
            "--no-progress",
        ]
    )
    assert record["options"]["record_requests"] is True
    first, second = record["runs"]
    assert first["metrics"]["ended_unix_s"] <= second["metrics"]["started_unix_s"]
    for run in record["runs"]:
        m, reqs = run["metrics"], run["requests"]
        start_s, end_s = m["started_unix_s"], m["ended_unix_s"]
        assert end_s - start_s == pytest.approx(m["duration_s"], abs=0.05)
        assert len(reqs) == 10 and all(start_s <= r["start_unix_s"] < end_s for r in reqs)
        failed = [r for r in reqs if not r["ok"]]
        assert len(failed) == m["failed"] == 2
        assert all(set(r) == {"request_id", "start_unix_s", "ok"} for r in failed)
        ok = [r for r in reqs if r["ok"]]
        # One content chunk per token: a request of n tokens has n - 1 gaps.
        assert sum(len(r["itl_s"]) + 1 for r in ok) == m["total_output_tokens"]
        for key, values_s in (
            ("ttft_ms", [r["ttft_s"] for r in ok]),
            ("tpot_ms", [r["tpot_s"] for r in ok if r["tpot_s"] is not None]),
            ("itl_ms", [gap for r in ok for gap in r["itl_s"]]),
        ):
            assert summarize_ms(values_s)["p99"] == pytest.approx(m[key]["p99"], abs=0.01)


def test_chunk_usage_counts_the_tokens_each_chunk_carries(fake_server, tokenizer_file, tmp_path):
    """Chat streams ask for usage in every chunk (`continuous_usage_stats`): a chunk after a
    token that sent none (no text) is counted as two tokens, and `token_itl_ms` shares its
    gap between them, where `itl_ms` (what the client saw) has one doubled gap."""
    url, app = fake_server
    app.state.count = 0
    app.state.textless_every = 3
    try:
        record = run_cli(
            [
                *_sharegpt_sweep(url, tokenizer_file),
                "--record-requests",
                "--out",
                str(tmp_path / "r.json"),
                "--no-progress",
            ]
        )
    finally:
        app.state.textless_every = 0
    assert record["options"]["chunk_usage"] is True
    chat = [b for kind, b in app.state.seen if kind == "chat"][-1]
    assert chat["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    for run in record["runs"]:
        m, ok = run["metrics"], [r for r in run["requests"] if r["ok"]]
        assert all(len(r["itl_tokens"]) == len(r["itl_s"]) for r in ok)
        # The first chunk carries one token; every token is counted once.
        assert sum(sum(r["itl_tokens"]) + 1 for r in ok) == m["total_output_tokens"]
        assert any(2 in r["itl_tokens"] for r in ok) and set(
            k for r in ok for k in r["itl_tokens"]
        ) == {1, 2}
        assert m["token_itl_ms"]["p99"] < m["itl_ms"]["p99"]
    # Not asked for: no token counts, no token_itl_ms.
    app.state.count = 0
    plain = run_cli(
        [
            *_sharegpt_sweep(url, tokenizer_file),
            "--no-chunk-usage",
            "--out",
            str(tmp_path / "plain.json"),
            "--no-progress",
        ]
    )
    chat = [b for kind, b in app.state.seen if kind == "chat"][-1]
    assert chat["stream_options"] == {"include_usage": True}
    assert all("token_itl_ms" not in run["metrics"] for run in plain["runs"])


def test_without_ignore_eos_output_lengths_are_reported_inexact(
    fake_server, tokenizer_file, tmp_path
):
    url, app = fake_server
    app.state.count = 1  # shift the 503 pattern; failures are not the point here
    record = run_cli(
        [
            "--url",
            url,
            "--workload",
            "sharegpt",
            "--scale",
            "0.2",
            "--num-requests",
            "4",
            "--qps",
            "inf",
            "--seed",
            "11",
            "--tokenizer",
            str(tokenizer_file),
            "--no-ignore-eos",
            "--out",
            str(tmp_path / "r.json"),
            "--no-progress",
        ]
    )
    m = record["metrics"]
    assert m["completed"] >= 3
    # The fake stops after 2 tokens without ignore_eos; requested lengths are mostly longer.
    assert m["output_len_exact_fraction"] < 1.0
    assert m["total_output_tokens"] == 2 * m["completed"]


def test_scoring_run_sends_token_ids_with_shared_prefixes(fake_server, tokenizer_file, tmp_path):
    url, app = fake_server
    app.state.seen.clear()
    record = run_cli(
        [
            "--url",
            url,
            "--workload",
            "post-recommendation",
            "--scale",
            "0.01",
            "--duration",
            "0.5",
            "--qps",
            "40",
            "--seed",
            "5",
            "--tokenizer",
            str(tokenizer_file),
            "--out",
            str(tmp_path / "s.json"),
            "--no-progress",
        ]
    )
    m = record["metrics"]
    assert m["failed"] == 0 and m["completed"] >= 5
    assert m["ttft_ms"]["mean"] == pytest.approx(m["e2el_ms"]["mean"])  # scoring: TTFT = E2EL
    assert m["tpot_ms"]["mean"] is None and m["itl_ms"]["mean"] is None
    bodies = [b for kind, b in app.state.seen if kind == "score"]
    assert len(bodies) == m["completed"]
    for b in bodies:
        assert all(isinstance(t, int) for t in b["query"] + b["items"][0])
        assert not b["item_first"] and b["apply_softmax"]
        assert b.get("label_token_ids") or b.get("labels") == ["Yes", "No"]
    # 20 users: with more requests than users some users repeat, and their queries are equal.
    queries = [tuple(b["query"]) for b in bodies]
    assert len(set(queries)) < len(queries) or len(queries) <= 1


def test_score_records_carry_the_servers_own_account(fake_server, tokenizer_file, tmp_path):
    """--record-requests on /v1/score: each record names its request and adds what the server
    said of it (cached prompt tokens, its own time, the engine's queue and TTFT), through the
    client processes too."""
    url, app = fake_server
    argv = ["--url", url, "--workload", "post-recommendation", "--scale", "0.01"]
    argv += ["--num-requests", "8", "--qps", "60", "--seed", "5", "--no-progress"]
    argv += ["--tokenizer", str(tokenizer_file), "--client-procs", "2", "--record-requests"]
    app.state.seen.clear()
    record = run_cli([*argv, "--out", str(tmp_path / "r.json")])
    reqs = record["runs"][0]["requests"]
    bodies = {
        len(b["query"]) + len(b["items"][0]): b for kind, b in app.state.seen if kind == "score"
    }
    assert len(reqs) == 8 and len({r["request_id"] for r in reqs}) == 8
    for r in reqs:
        assert r["ok"] and r["engine_queue_s"] == 0.0002 and r["engine_ttft_s"] == 0.0007
        body = bodies[round(r["server_s"] * 1e5)]  # the fake's server_s: n / 100 ms
        assert r["cached_tokens"] == len(body["query"])
        assert r["ttft_s"] >= r["server_s"]


def test_client_procs_send_the_same_requests_on_one_clock(fake_server, tokenizer_file, tmp_path):
    """Two client processes deal one run's requests between them: the server gets the same
    bodies as from one process, and the record says how the processes fared."""
    url, app = fake_server

    def run(procs: int) -> tuple[dict[str, Any], list[tuple]]:
        app.state.seen.clear()
        argv = ["--url", url, "--workload", "post-recommendation", "--scale", "0.01"]
        argv += ["--num-requests", "24", "--qps", "60", "--seed", "5", "--no-progress"]
        argv += ["--tokenizer", str(tokenizer_file), "--client-procs", str(procs)]
        record = run_cli([*argv, "--out", str(tmp_path / f"p{procs}.json")])
        bodies = [b for kind, b in app.state.seen if kind == "score"]
        return record, sorted((tuple(b["query"]), tuple(b["items"][0])) for b in bodies)

    one, bodies_one = run(1)
    two, bodies_two = run(2)
    assert bodies_two == bodies_one and len(bodies_one) == 24
    m = two["metrics"]
    assert m["completed"] == 24 and m["failed"] == 0
    assert two["options"]["client_procs"] == 2 and "client_procs" not in one["metrics"]
    procs = m["client_procs"]
    assert procs["num"] == 2 and len(procs["cpu_percent"]) == 2
    assert m["client_cpu_percent"] == max(procs["cpu_percent"])
    # One clock: both processes started at the common instant, and the requests left near
    # their planned times on it (a late process's lag is added to its requests').
    assert max(procs["late_start_s"]) < 0.5
    assert m["send_lag_ms"]["median"] < 500
    with pytest.raises(SystemExit, match="client-procs"):
        closed = ["--workload", "sharegpt", "--seed", "1", "--qps", "5", "--num-requests", "2"]
        closed += ["--client-procs", "2"]
        closed += ["--max-concurrency", "4", "--out", str(tmp_path / "x.json")]
        serve.main(["--url", url, *closed])
    with pytest.raises(SystemExit, match="client-procs must be at least 1"):
        serve.main(["--url", url, *closed[:8], "--client-procs", "0", "--out", "x.json"])


def test_arrival_times_are_seeded_and_have_the_requested_rate():
    a = serve.arrival_times_s(20.0, seed=1, num_requests=4000)
    b = serve.arrival_times_s(20.0, seed=1, num_requests=4000)
    assert a == b and a[0] == 0.0
    gaps = [y - x for x, y in zip(a, a[1:], strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20.0, rel=0.06)
    bursty = serve.arrival_times_s(20.0, seed=1, burstiness=0.25, num_requests=4000)
    bgaps = [y - x for x, y in zip(bursty, bursty[1:], strict=False)]
    cv = lambda g: (sum((x - sum(g) / len(g)) ** 2 for x in g) / len(g)) ** 0.5 / (sum(g) / len(g))  # noqa: E731
    assert cv(gaps) == pytest.approx(1.0, abs=0.1)  # Poisson: coefficient of variation 1
    assert cv(bgaps) == pytest.approx(2.0, abs=0.3)  # gamma shape k: CV = 1/sqrt(k)
    timed = serve.arrival_times_s(10.0, seed=2, duration_s=5.0)
    assert max(timed) <= 5.0 and 25 < len(timed) < 80
    assert serve.arrival_times_s(math.inf, seed=0, num_requests=3) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        serve.arrival_times_s(math.inf, seed=0, duration_s=1.0)


def _fake_metrics(p99_ttft_ms: float, failed: int = 0) -> dict[str, Any]:
    stat = {"mean": p99_ttft_ms, "median": p99_ttft_ms, "p90": p99_ttft_ms, "p99": p99_ttft_ms}
    none = {"mean": None, "median": None, "p90": None, "p99": None}
    return {
        "completed": 10 - failed,
        "failed": failed,
        "ttft_ms": stat,
        "e2el_ms": stat,
        "tpot_ms": none,
        "itl_ms": none,
    }


async def test_search_max_qps_brackets_the_knee():
    # Synthetic server: P99 TTFT = 100 ms below 7.3 QPS, then it explodes.
    calls: list[float] = []

    async def run_at(qps: float) -> dict[str, Any]:
        calls.append(qps)
        return _fake_metrics(100.0 if qps <= 7.3 else 10_000.0)

    out = await serve.search_max_qps(
        run_at, SLO(ttft_ms=500), start_qps=1.0, max_probes=12, rel_tol=0.02
    )
    assert calls[:4] == [1.0, 2.0, 4.0, 8.0]  # doubling until the first failure
    assert len(calls) <= 12
    assert out["max_qps"] <= 7.3 < out["lowest_failing_qps"]
    assert (out["lowest_failing_qps"] - out["max_qps"]) / out["lowest_failing_qps"] <= 0.02
    assert [p["meets_slo"] for p in out["probes"]] == [q <= 7.3 for q in calls]


async def test_search_max_qps_counts_failures_and_respects_probe_budget():
    async def run_at(qps: float) -> dict[str, Any]:
        return _fake_metrics(1.0, failed=1)  # fast but failing: never meets the SLO

    out = await serve.search_max_qps(run_at, SLO(ttft_ms=500), start_qps=4.0, max_probes=3)
    assert out["max_qps"] is None
    assert [p["qps"] for p in out["probes"]] == [4.0, 2.0, 1.0]


def test_compare_runs_rounds_against_both_servers(fake_server, tokenizer_file, tmp_path, capsys):
    from bench import compare

    url, app = fake_server
    app.state.seen.clear()
    out = tmp_path / "ab.json"
    assert (
        compare.main(
            [
                "--url-a",
                url,
                "--url-b",
                url + "/",
                "--name-a",
                "fcfs",
                "--name-b",
                "srjf",
                "--workload",
                "short-scoring",
                "--scale",
                "0.05",
                "--num-requests",
                "6",
                "--qps",
                "inf",
                "--rounds",
                "3",
                "--seed",
                "1",
                "--tokenizer",
                str(tokenizer_file),
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    record = json.loads(out.read_text())
    assert len(record["a"]["runs"]) == len(record["b"]["runs"]) == 3
    assert len(app.state.seen) == 6 * 3 * 2
    # Within a round both sides get the same requests; each round draws fresh ones.
    queries = [tuple(b["query"]) for _, b in app.state.seen]
    runs = [sorted(queries[i : i + 6]) for i in range(0, 36, 6)]
    assert runs[0] == runs[1] and runs[2] == runs[3] and runs[4] == runs[5]
    assert runs[0] != runs[2] != runs[4]
    rows = {r["metric"]: r for r in record["comparison"]}
    assert rows["failed"]["a"] == rows["failed"]["b"] == 0
    assert rows["TTFT mean (ms)"]["ratio_b_over_a"] > 0
    assert "TPOT mean (ms)" not in rows  # scoring has no TPOT
    assert "| TTFT P99 (ms) |" in capsys.readouterr().out


def test_summarize_ab_by_hand():
    from bench.compare import summarize_ab

    def m(ttft_mean: float, thr: float) -> dict[str, Any]:
        return {"ttft_ms": {"mean": ttft_mean, "p99": None}, "request_throughput": thr, "failed": 0}

    rows = {
        r["metric"]: r for r in summarize_ab([m(100, 2.0), m(300, 2.0)], [m(50, 3.0), m(250, 5.0)])
    }
    ttft = rows["TTFT mean (ms)"]
    assert (ttft["a"], ttft["b"]) == (200.0, 150.0)
    assert ttft["ratio_b_over_a"] == pytest.approx(0.75)
    assert ttft["round_ratio_min"] == pytest.approx(0.5)
    assert ttft["round_ratio_max"] == pytest.approx(250 / 300)
    assert rows["request throughput (req/s)"]["ratio_b_over_a"] == pytest.approx(2.0)
    assert "TTFT P99 (ms)" not in rows  # no values on either side: no row


def test_small_run_against_the_real_smollm2_server(tmp_path):
    """bench.serve against `app.main.create_app` with the real engine and SmolLM2-135M on CPU:
    a few scoring and streamed chat requests, scaled down to run in seconds."""
    pytest.importorskip("runtime.engine", reason="runtime.engine not written yet")
    from server_thread import running_server

    from runtime.model.convert import ensure_default_model

    model_dir = ensure_default_model()
    with running_server(None, model="default") as srv:
        for workload, extra in (("short-scoring", []), ("sharegpt", ["--max-concurrency", "2"])):
            out = tmp_path / f"{workload}.json"
            record = run_cli(
                [
                    "--url",
                    srv.url,
                    "--workload",
                    workload,
                    "--scale",
                    "0.03",
                    "--num-requests",
                    "4",
                    "--qps",
                    "inf",
                    "--seed",
                    "0",
                    "--tokenizer",
                    str(model_dir),
                    "--out",
                    str(out),
                    "--no-progress",
                    "--request-timeout",
                    "120",
                    *extra,
                ]
            )
            m = record["metrics"]
            assert m["failed"] == 0, m["failure_reasons"]
            assert m["completed"] == 4
            assert "state" in record["server"], record["server"].get("state_error")
            if workload == "sharegpt":
                assert m["output_tokens_from_usage_fraction"] == 1.0
                assert m["output_len_exact_fraction"] == 1.0  # the server honours ignore_eos
                assert m["tpot_ms"]["mean"] is not None


# --- prefix-cache resets between runs, one-server A/B switching ---------------------------------


def _reset_log(app: FastAPI) -> None:
    app.state.log.clear()
    app.state.seen.clear()
    app.state.admin_enabled = True
    app.state.policy, app.state.partition = "fcfs", "off"


def test_sweep_resets_the_prefix_cache_between_runs_only(fake_server, tokenizer_file, tmp_path):
    url, app = fake_server
    _reset_log(app)
    common = [
        "--url",
        url,
        "--workload",
        "short-scoring",
        "--scale",
        "0.05",
        "--num-requests",
        "5",
        "--qps",
        "inf,500",
        "--seed",
        "2",
        "--tokenizer",
        str(tokenizer_file),
        "--no-progress",
        "--warmup-requests",
        "2",
    ]
    record = run_cli([*common, "--out", str(tmp_path / "r.json")])
    # Warm-up first (unrecorded), then reset -> run -> reset -> run: never a reset mid-run.
    assert app.state.log == ["score"] * 2 + (["reset"] + ["score"] * 5) * 2
    assert record["options"]["reset_prefix_cache"] is True
    assert record["prefix_cache_reset"] == {"requested": True, "done_before_every_run": True}
    assert [r["prefix_cache_reset"]["done"] for r in record["runs"]] == [True, True]

    _reset_log(app)
    record = run_cli([*common, "--no-reset-prefix-cache", "--out", str(tmp_path / "k.json")])
    assert "reset" not in app.state.log and len(app.state.log) == 2 + 10
    assert [r["prefix_cache_reset"] for r in record["runs"]] == [None, None]
    assert record["prefix_cache_reset"]["requested"] is False

    # A server without the endpoint: the runs go on, and the JSON says the reset was not done.
    _reset_log(app)
    app.state.admin_enabled = False
    record = run_cli([*common, "--out", str(tmp_path / "o.json")])
    assert record["prefix_cache_reset"]["done_before_every_run"] is False
    first = record["runs"][0]["prefix_cache_reset"]
    assert first["done"] is False and "404" in first["error"]
    assert all(r["metrics"]["completed"] == 5 for r in record["runs"])
    app.state.admin_enabled = True


def test_compare_one_server_switches_settings_in_abba_order(
    fake_server, tokenizer_file, tmp_path, capsys
):
    from bench import compare

    url, app = fake_server
    _reset_log(app)
    out = tmp_path / "one.json"
    assert (
        compare.main(
            [
                "--url",
                url,
                "--a",
                "policy=fcfs",
                "--b",
                "policy=srjf,partition=auto",
                "--workload",
                "short-scoring",
                "--scale",
                "0.05",
                "--num-requests",
                "4",
                "--qps",
                "inf",
                "--rounds",
                "3",
                "--seed",
                "1",
                "--tokenizer",
                str(tokenizer_file),
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    put_a = ['PUT {"policy": "fcfs"}']
    put_b = ['PUT {"policy": "srjf"}', 'PUT {"mode": "auto"}']
    side_a = [*put_a, "reset", *["score"] * 4]
    side_b = [*put_b, "reset", *["score"] * 4]
    assert app.state.log == side_a + side_b + side_b + side_a + side_a + side_b
    record = json.loads(out.read_text())
    assert record["mode"] == "one-server"
    assert record["a"]["name"] == "policy=fcfs" and record["b"]["settings"] == (
        "policy=srjf,partition=auto"
    )
    assert [r["server_settings"]["policy"] for r in record["a"]["runs"]] == ["fcfs"] * 3
    assert [r["server_settings"]["partition"]["mode"] for r in record["b"]["runs"]] == ["auto"] * 3
    assert [r["position_in_round"] for r in record["a"]["runs"]] == [1, 2, 1]
    assert all(r["prefix_cache_reset"]["done"] for r in record["a"]["runs"] + record["b"]["runs"])
    assert record["a"]["server"]["state"]["policy"]["current"] == "fcfs"
    assert "| TTFT mean (ms) |" in capsys.readouterr().out


def test_compare_one_server_stops_when_a_setting_is_refused(fake_server, tokenizer_file, tmp_path):
    from bench import compare

    url, app = fake_server
    _reset_log(app)
    with pytest.raises(SystemExit, match="policy"):
        compare.main(
            [
                "--url",
                url,
                "--a",
                "policy=fcfs",
                "--b",
                "policy=lifo",
                "--workload",
                "short-scoring",
                "--scale",
                "0.05",
                "--num-requests",
                "2",
                "--qps",
                "inf",
                "--rounds",
                "1",
                "--seed",
                "1",
                "--tokenizer",
                str(tokenizer_file),
                "--no-progress",
            ]
        )
    # Side A ran; side B never sent a benchmark request under the wrong configuration.
    assert app.state.log == ['PUT {"policy": "fcfs"}', "reset", "score", "score"]
    # Without the reset endpoint a comparison stops too (its B side would be cache-warmed).
    _reset_log(app)
    app.state.admin_enabled = False
    with pytest.raises(SystemExit, match="reset"):
        compare.main(
            [
                "--url",
                url,
                "--a",
                "policy=fcfs",
                "--b",
                "policy=fcfs",
                "--workload",
                "short-scoring",
                "--scale",
                "0.05",
                "--num-requests",
                "2",
                "--qps",
                "inf",
                "--rounds",
                "1",
                "--seed",
                "1",
                "--tokenizer",
                str(tokenizer_file),
                "--no-progress",
            ]
        )
    assert "score" not in app.state.log
    app.state.admin_enabled = True


def test_parse_settings():
    from bench.compare import AdminChange, parse_settings

    assert parse_settings("policy=fcfs") == [AdminChange("/admin/api/policy", {"policy": "fcfs"})]
    assert parse_settings(" partition=static:64 , policy=srjf ") == [
        AdminChange("/admin/api/partition", {"mode": "static", "prefill_sms": 64}),
        AdminChange("/admin/api/policy", {"policy": "srjf"}),
    ]
    assert parse_settings("partition=off") == [AdminChange("/admin/api/partition", {"mode": "off"})]
    # The baseline's knobs: one PUT for both, after the others.
    # A budget alone is the budget of every step: the cap on steps with decodes is removed,
    # and so is auto's share past it (no side inherits an earlier side's on one server).
    fixed = {
        "prefill_token_budget": 2048,
        "tbt_slo_ms": 80.0,
        "mixed_step_token_budget": None,
        "chunk_fixed_share": None,
    }
    assert parse_settings("budget=2048,partition=off,tbt=80") == [
        AdminChange("/admin/api/partition", {"mode": "off"}),
        AdminChange("/admin/api/prefill", fixed),
    ]
    assert parse_settings("tbt=none") == [AdminChange("/admin/api/prefill", {"tbt_slo_ms": None})]
    assert parse_settings("budget=8192,mixed=2048") == [
        AdminChange(
            "/admin/api/prefill",
            {
                "prefill_token_budget": 8192,
                "mixed_step_token_budget": 2048,
                "chunk_fixed_share": None,
            },
        )
    ]
    assert parse_settings("budget=8192,mixed=2048,share=0.15") == [
        AdminChange(
            "/admin/api/prefill",
            {
                "prefill_token_budget": 8192,
                "mixed_step_token_budget": 2048,
                "chunk_fixed_share": 0.15,
            },
        )
    ]
    assert parse_settings("share=none") == [
        AdminChange("/admin/api/prefill", {"chunk_fixed_share": None})
    ]
    assert parse_settings("mixed=none") == [
        AdminChange("/admin/api/prefill", {"mixed_step_token_budget": None})
    ]
    for bad in (
        "budget=0",
        "budget=lots",
        "mixed=0",
        "mixed=some",
        "share=0",
        "share=1",
        "share=nan",
        "share=most",
        "tbt=soon",
        "",
        "policy",
        "policy=",
        "colour=red",
        "partition=static",
        "partition=auto:3",
        "partition=sideways",
        "policy=fcfs,policy=srjf",
    ):
        with pytest.raises(ValueError):
            parse_settings(bad)


def test_every_side_of_the_gpu_plans_parses():
    """The device plans' sides (`--side NAME:SETTINGS` in bench/gpu_next.sh) are settings
    `parse_settings` takes: a typo fails here, not in a device call."""
    import re

    from bench.compare import parse_settings

    text = (Path(__file__).resolve().parents[1] / "bench" / "gpu_next.sh").read_text()
    # (A side's settings hold a `key=`: the comments' `--side NAME:SETTINGS` do not.)
    sides = re.findall(r"--side ([\w-]+):(\w+=[^\s)\"'\\]*)", text)
    assert len(sides) >= 10 and ("auto-share" in {name for name, _ in sides})
    for name, settings in sides:
        assert parse_settings(settings), name


def test_compare_mode_arguments():
    from bench import compare

    base = ["--workload", "short-scoring", "--num-requests", "1", "--qps", "1", "--seed", "0"]
    for extra in (
        ["--url", "u", "--a", "policy=fcfs"],
        ["--url", "u", "--a", "policy=fcfs", "--b", "policy=srjf", "--url-a", "v"],
        ["--url-a", "u"],
        [],
    ):
        args = compare.build_parser().parse_args([*base, *extra])
        with pytest.raises(SystemExit):
            compare.check_mode(args)


def test_sigterm_stops_the_run_and_still_writes_what_completed(
    fake_server, tokenizer_file, tmp_path
):
    """A background load ended by its harness (SIGTERM) writes the latencies of the requests
    that completed, says it was stopped, and exits cleanly."""
    import signal
    import subprocess
    import sys

    url, app = fake_server
    app.state.seen.clear()
    out = tmp_path / "bg.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.serve",
            "--url",
            url,
            "--workload",
            "sharegpt",
            "--scale",
            "0.05",
            "--duration",
            "60",
            "--qps",
            "8",
            "--seed",
            "1",
            "--tokenizer",
            str(tokenizer_file),
            "--no-reset-prefix-cache",
            "--no-progress",
            "--out",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while len(app.state.seen) < 6 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        if len(app.state.seen) < 6:
            proc.kill()
            raise AssertionError(f"the background load never started: {proc.communicate()[1]}")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    record = json.loads(out.read_text())
    assert record["stopped_by_signal"] is True
    (run,) = record["runs"]
    m = run["metrics"]
    assert m["stopped_early"] is True and m["completed"] >= 1
    assert m["duration_s"] < 30  # stopped, not run to its 60 s
    assert m["itl_ms"]["p99"] is not None


async def test_search_factor_brackets_a_good_first_guess_in_fewer_probes():
    calls: list[float] = []

    async def run_at(qps: float) -> dict[str, Any]:
        calls.append(qps)
        return _fake_metrics(100.0 if qps <= 7.3 else 10_000.0)

    out = await serve.search_max_qps(
        run_at, SLO(ttft_ms=500), start_qps=4.0, max_probes=4, factor=1.5
    )
    assert calls == [4.0, 6.0, 9.0, 7.5]  # x1.5 until a failure, then bisection
    assert out["max_qps"] == 6.0 and out["lowest_failing_qps"] == 7.5
    calls.clear()
    out = await serve.search_max_qps(
        run_at, SLO(ttft_ms=500), start_qps=12.0, max_probes=3, factor=1.5
    )
    assert calls == [12.0, 8.0, 8.0 / 1.5]  # a failing first guess: divide until one passes
    assert out["max_qps"] == pytest.approx(8.0 / 1.5)
    with pytest.raises(ValueError):
        await serve.search_max_qps(run_at, SLO(ttft_ms=500), start_qps=1.0, factor=1.0)


def test_prime_prefixes_sends_one_request_per_user_before_the_runs(
    fake_server, tokenizer_file, tmp_path
):
    url, app = fake_server
    _reset_log(app)
    common = [
        "--url",
        url,
        "--workload",
        "post-recommendation",
        "--scale",
        "0.01",
        "--num-requests",
        "4",
        "--qps",
        "inf,500",
        "--seed",
        "3",
        "--tokenizer",
        str(tokenizer_file),
        "--no-progress",
        "--prime-prefixes",
    ]
    record = run_cli([*common, "--out", str(tmp_path / "p.json")])
    # After each reset: 20 priming requests (one per user), then the run's 4.
    assert app.state.log == (["reset"] + ["score"] * 24) * 2
    bodies = [b for kind, b in app.state.seen if kind == "score"]
    prime = [tuple(b["query"]) for b in bodies[:20]]
    assert len(set(prime)) == 20  # every user's profile once
    assert all(tuple(b["query"]) in set(prime) for b in bodies[20:24])  # runs reuse them
    assert [r["prime"]["requests"] for r in record["runs"]] == [20, 20]
    # The fake server has no prefix-cache counters: the per-run hit rate says so (None).
    assert [r["prefix_cache"] for r in record["runs"]] == [None, None]
    assert record["options"]["prime_prefixes"] is True
    # Without resets the cache is primed once, before the first run.
    _reset_log(app)
    record = run_cli([*common, "--no-reset-prefix-cache", "--out", str(tmp_path / "q.json")])
    assert app.state.log == ["score"] * (20 + 4 + 4)
    by_qps = {r["qps"]: r for r in record["runs"]}  # runs are listed by QPS; inf ran first
    assert by_qps["inf"]["prime"]["requests"] == 20 and by_qps[500.0]["prime"] is None


def test_server_itl_histogram_delta():
    """The server's inter-token histogram (vLLM's name, Greenlane's too) read around a run:
    label sets summed, +Inf as the count, fractions over each bound from the deltas."""

    def text(counts: dict[str, tuple[int, int]]) -> str:
        lines = ["# HELP vllm:inter_token_latency_seconds gaps", "# TYPE ... histogram"]
        for le, (a, b) in counts.items():
            lines.append(
                f'vllm:inter_token_latency_seconds_bucket{{le="{le}",model_name="a"}} {a}.0'
            )
            lines.append(
                f'vllm:inter_token_latency_seconds_bucket{{model_name="b",le="{le}"}} {b}.0'
            )
        lines.append("vllm:inter_token_latency_seconds_count 99.0")
        return "\n".join(lines)

    before = serve.parse_itl_buckets(text({"0.08": (5, 5), "0.1": (6, 6), "+Inf": (10, 10)}))
    assert before == {0.08: 10.0, 0.1: 12.0, math.inf: 20.0}
    after = serve.parse_itl_buckets(text({"0.08": (50, 45), "0.1": (50, 50), "+Inf": (60, 60)}))
    delta = serve.server_itl_delta(before, after)
    # 100 gaps in the run: 85 within 80 ms, 100 - 88 = 12 over 100 ms.
    assert delta == {"count": 100, "fraction_over_s": {"0.08": 0.15, "0.1": 0.12}}
    assert serve.server_itl_delta(None, after) is None
    assert serve.parse_itl_buckets("vllm:other_total 3.0") is None
    assert serve.server_itl_delta(after, after) == {"count": 0, "fraction_over_s": {}}


def test_prefix_cache_delta():
    a = {"hit_tokens": 100, "query_tokens": 1000}
    b = {"hit_tokens": 700, "query_tokens": 2000}
    assert serve.prefix_cache_delta(a, b) == {
        "hit_tokens": 600,
        "query_tokens": 1000,
        "hit_rate": 0.6,
    }
    assert serve.prefix_cache_delta(None, b) is None
    assert serve.prefix_cache_delta(a, a)["hit_rate"] is None


def test_engine_failures_delta():
    """Greenlane's failed-step counters over a run; None where a server reports none (vLLM,
    an older Greenlane)."""
    a = {"hit_tokens": 0, "query_tokens": 0, "num_failed_steps": 2, "num_failed_requests": 0}
    b = {**a, "num_failed_steps": 79, "num_failed_requests": 1}
    assert serve.engine_failures_delta(a, b) == {"num_failed_steps": 77, "num_failed_requests": 1}
    assert serve.engine_failures_delta({"hit_tokens": 0, "query_tokens": 0}, b) is None
    assert serve.engine_failures_delta(a, None) is None


def test_server_vllm_uses_vllm_endpoints(fake_server, tokenizer_file, tmp_path):
    """--server vllm: the same score bodies to /generative_scoring, resets at
    /reset_prefix_cache, prefix-cache hits from /metrics."""
    url, app = fake_server
    _reset_log(app)
    record = run_cli(
        [
            "--url",
            url,
            "--server",
            "vllm",
            "--workload",
            "post-recommendation",
            "--scale",
            "0.01",
            "--num-requests",
            "6",
            "--qps",
            "inf",
            "--seed",
            "3",
            "--tokenizer",
            str(tokenizer_file),
            "--no-progress",
            "--out",
            str(tmp_path / "v.json"),
        ]
    )
    assert app.state.log == ["vllm-reset"] + ["vllm-score"] * 6
    assert record["metrics"]["completed"] == 6 and record["metrics"]["failed"] == 0
    assert record["options"]["server"] == "vllm"
    assert record["options"]["score_path"] == "/generative_scoring"
    assert record["prefix_cache_reset"]["done_before_every_run"] is True
    bodies = [b for kind, b in app.state.seen if kind == "vllm-score"]
    queries = sum(len(b["query"]) for b in bodies)
    pc = record["runs"][0]["prefix_cache"]
    assert pc["hit_tokens"] == queries and pc["hit_rate"] == pytest.approx(0.5)
    assert all(b["label_token_ids"] or b["labels"] for b in bodies)


def test_server_vllm_completions_scores_as_one_token_completions(
    fake_server, tokenizer_file, tmp_path
):
    """--server vllm-completions: each scoring request as a one-token greedy completion of
    query + item with logprobs (vLLM's other scoring path), vLLM's reset and counters."""
    url, app = fake_server
    _reset_log(app)
    args = ["--url", url, "--server", "vllm-completions", "--workload", "post-recommendation"]
    args += ["--scale", "0.01", "--num-requests", "4", "--qps", "inf", "--seed", "3"]
    args += ["--tokenizer", str(tokenizer_file), "--no-progress", "--out", str(tmp_path / "c.json")]
    record = run_cli(args)
    assert app.state.log == ["vllm-reset"] + ["vllm-completion"] * 4
    assert record["metrics"]["completed"] == 4 and record["metrics"]["failed"] == 0
    assert record["options"]["score_as_completion"] is True
    bodies = [b for kind, b in app.state.seen if kind == "vllm-completion"]
    assert all(b["max_tokens"] == 1 and b["logprobs"] and b["temperature"] == 0 for b in bodies)
    assert all(len(b["prompt"]) > 100 and isinstance(b["prompt"][0], int) for b in bodies)


def test_parse_vllm_prefix_counters():
    text = (
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        'vllm:prefix_cache_hits_total{engine="0"} 10.0\n'
        'vllm:prefix_cache_hits_total{engine="1"} 5.0\n'
        'vllm:prefix_cache_queries_total{engine="0"} 40.0\n'
        "vllm:num_requests_running 2.0\n"
    )
    assert serve.parse_vllm_prefix_counters(text) == {"hit_tokens": 15, "query_tokens": 40}
    assert serve.parse_vllm_prefix_counters("vllm:num_requests_running 2.0\n") is None


def test_save_steps_is_said_per_run_and_refused_for_another_server(
    fake_server, tokenizer_file, tmp_path
):
    """`--save-steps`: after each run the server's step trace is asked for; a server without
    one (the fake here; the real engine's save: tests/test_gpu_serving.py's dry run) is said in
    the run's record, not raised, and nothing is written. Against vLLM the option is refused
    before any request (it reads Greenlane's admin API)."""
    url, _ = fake_server
    argv = [*_sharegpt_sweep(url, tokenizer_file), "--no-progress"]
    prefix = tmp_path / "steps" / "side"
    record = run_cli([*argv, "--save-steps", str(prefix), "--out", str(tmp_path / "s.json")])
    assert len(record["runs"]) == 2
    for run in record["runs"]:
        assert run["steps"]["saved"] is False and "404" in run["steps"]["why"], run["steps"]
    assert not (tmp_path / "steps").exists()
    with pytest.raises(SystemExit, match="save-steps"):
        serve.main(
            [
                *argv,
                "--server",
                "vllm",
                "--save-steps",
                str(prefix),
                "--out",
                str(tmp_path / "v.json"),
            ]
        )


def test_save_steps_covers_the_run_only_if_the_trace_reaches_its_start(
    monkeypatch, tmp_path
) -> None:
    """A step's age counts back from the trace's reply, which comes after the run ended: the
    trace covers the run when its oldest step is older than the run's start, not merely older
    than the run's length."""
    now = time.time()
    ages: list[float] = []

    async def reply(*args, **kwargs):  # type: ignore[no-untyped-def]
        return True, {"steps": [{"age_s": a} for a in ages]}

    monkeypatch.setattr(serve, "admin_call", reply)
    for oldest_s, covers in ((9.0, False), (10.5, True)):
        ages[:] = [0.5, oldest_s]
        # A run of 8 s that started 10 s ago (ended 2 s before the trace was read).
        saved = asyncio.run(serve.save_steps("u", None, tmp_path / "s.json", now - 10, now - 2))
        assert saved["covers_run"] is covers and saved["run_s"] == 8.0
