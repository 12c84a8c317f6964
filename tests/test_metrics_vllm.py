"""/metrics speaks vLLM's dialect: every series that vLLM's example Grafana dashboard (and the
newer vLLM names for the same panels) queries exists, with a `model_name` label; and counts
are counters, not gauges.

DASHBOARD is our own list of the PromQL expressions, written from reading vLLM's example
dashboard (examples/online_serving/prometheus_grafana/grafana.json) panel by panel, plus the
V1 names for the same quantities; their JSON is not vendored.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_thread import ServerThread, fake_server

from app.metrics import Metrics

SEL = '{model_name="$model_name"}'
WIN = "[$__rate_interval]"


def _quantiles(hist: str) -> list[str]:
    return [
        f"histogram_quantile({q}, sum by(le) (rate(vllm:{hist}_bucket{SEL}{WIN})))"
        for q in (0.99, 0.95, 0.9, 0.5)
    ] + [f"rate(vllm:{hist}_sum{SEL}{WIN})\n/\nrate(vllm:{hist}_count{SEL}{WIN})"]


DASHBOARD: dict[str, list[str]] = {
    "E2E Request Latency": _quantiles("e2e_request_latency_seconds"),
    "Token Throughput": [
        f"rate(vllm:prompt_tokens_total{SEL}{WIN})",
        f"rate(vllm:generation_tokens_total{SEL}{WIN})",
    ],
    "Time Per Output Token Latency": _quantiles("time_per_output_token_seconds"),
    "Scheduler State": [
        f"vllm:num_requests_running{SEL}",
        f"vllm:num_requests_swapped{SEL}",
        f"vllm:num_requests_waiting{SEL}",
    ],
    "Time To First Token Latency": _quantiles("time_to_first_token_seconds"),
    "Cache Utilization": [f"vllm:gpu_cache_usage_perc{SEL}", f"vllm:cpu_cache_usage_perc{SEL}"],
    "Request Prompt Length": [
        f"sum by(le) (increase(vllm:request_prompt_tokens_bucket{SEL}{WIN}))"
    ],
    "Request Generation Length": [
        f"sum by(le) (increase(vllm:request_generation_tokens_bucket{SEL}{WIN}))"
    ],
    "Finish Reason": [f"sum by(finished_reason) (increase(vllm:request_success_total{SEL}{WIN}))"],
    "Queue Time": [f"rate(vllm:request_queue_time_seconds_sum{SEL}{WIN})"],
    "Requests Prefill and Decode Time": [
        f"rate(vllm:request_prefill_time_seconds_sum{SEL}{WIN})",
        f"rate(vllm:request_decode_time_seconds_sum{SEL}{WIN})",
    ],
    "Max Generation Token in Sequence Group": [
        f"rate(vllm:request_max_num_generation_tokens_sum{SEL}{WIN})"
    ],
    # The same panels with vLLM V1's names.
    "KV Cache Utilization (V1)": [f"vllm:kv_cache_usage_perc{SEL}"],
    "Inter-Token Latency (V1)": _quantiles("inter_token_latency_seconds")
    + _quantiles("request_time_per_output_token_seconds"),
    "Prefix Cache Hit Rate (V1)": [
        f"rate(vllm:prefix_cache_hits_total{SEL}{WIN}) / rate(vllm:prefix_cache_queries_total{SEL}{WIN})"
    ],
    "Inference Time (V1)": [f"rate(vllm:request_inference_time_seconds_sum{SEL}{WIN})"],
    "Preemptions (V1)": [f"rate(vllm:num_preemptions_total{SEL}{WIN})"],
}
MODEL = "dash-model"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with fake_server(served_model_name=MODEL) as srv:
        yield srv


def _samples(text: str) -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label sets it was exposed with."""
    out: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(dict(sample.labels))
    return out


def _value(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"no sample {name} {labels}")


def test_every_dashboard_series_exists_with_model_name(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": 2}
        assert c.post("/v1/chat/completions", json=chat).status_code == 200
        assert c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 8}).status_code == 200
        score = {"query": "q", "items": ["a", "b"], "label_token_ids": [65]}
        assert c.post("/v1/score", json=score).status_code == 200
        text = c.get("/metrics").text
    samples = _samples(text)
    names = {n for exprs in DASHBOARD.values() for e in exprs for n in re.findall(r"vllm:\w+", e)}
    assert len(names) >= 25
    for name in sorted(names):
        assert name in samples, f"{name} is not in /metrics"
        assert all(labels.get("model_name") == MODEL for labels in samples[name]), name
    # The values mean what vLLM's do: 2 chat choices + 1 completion + 2 scored items.
    assert _value(text, "vllm:e2e_request_latency_seconds_count") == 5
    assert _value(text, "vllm:request_success_total", finished_reason="length") == 2
    assert _value(text, "vllm:request_success_total", finished_reason="stop") == 3
    # The completion echoes its 3 prompt tokens, then EOS: counted, as vLLM counts it.
    assert _value(text, "vllm:generation_tokens_total") == 5 + 5 + 3 + 1
    assert _value(text, "vllm:request_prompt_tokens_bucket", le="+Inf") == 5
    assert _value(text, "vllm:num_requests_swapped") == 0
    assert 'vllm:kv_cache_usage_perc{model_name="dash-model"}' in text


def test_counts_are_counters() -> None:
    metrics = Metrics(model_name="m")
    stats = {
        "num_waiting": 2,
        "num_running": 1,
        "num_steps": 10,
        "num_prefill_tokens": 500,
        "num_preemptions": 1,
        "pd_split_prefills": 3,
        "prefill_sms": 66,
        "kv_blocks_used": 5,
        "kv_blocks_total": 20,
        "prefix_hit_tokens": 40,
        "prefix_query_tokens": 100,
        "jct_num_observed": 7,
    }
    metrics.bind_engine(lambda: stats, lambda: 0)
    types = {f.name: f.type for f in text_string_to_metric_families(metrics.render().decode())}
    for name in (
        "greenlane_engine_num_steps",
        "greenlane_engine_num_prefill_tokens",
        "greenlane_engine_num_preemptions",
        "greenlane_engine_pd_split_prefills",
        "greenlane_prefix_cache_hit_tokens",
        "greenlane_prefix_cache_query_tokens",
        "greenlane_jct_observed_steps",
        "vllm:prefix_cache_hits",
        "vllm:num_preemptions",
    ):
        assert types.get(name) == "counter", (name, types.get(name))
    for name in (
        "greenlane_queue_depth",
        "greenlane_engine_prefill_sms",
        "vllm:kv_cache_usage_perc",
    ):
        assert types.get(name) == "gauge", (name, types.get(name))
    text = metrics.render().decode()
    assert _value(text, "vllm:kv_cache_usage_perc", model_name="m") == 0.25
    assert _value(text, "vllm:prefix_cache_hits_total", model_name="m") == 40


def test_inter_token_latency_counts_each_gap_so_a_stall_shows(monkeypatch) -> None:  # noqa: ANN001
    """Outputs of one request 10 ms apart, then one after a 7-s stall: the histogram has each
    gap on its own (its mean would read ~0.6 s and hide the stall); outputs of a request that
    finished or was never admitted here, and scoring outputs, add none."""
    import asyncio

    import app.client as client_mod
    from app.client import EngineClient
    from runtime.request import RequestOutput

    clock = iter([0.0, 0.01, 0.02, 0.03, 7.03, 7.04])
    # app.client's own `time` only: patching time.monotonic itself fed this clock to every
    # thread in the process (a server thread left by an earlier test ran it dry once in CI).
    monkeypatch.setattr(client_mod, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    metrics = Metrics(model_name="m")
    client = EngineClient(max_in_flight=4)
    client.on_token_gaps = metrics.observe_token_gaps
    client._queues["g"] = asyncio.Queue()
    client._queues["s"] = asyncio.Queue()
    for i in range(5):
        outs = [RequestOutput("g", new_token_ids=[i], finished=i == 4)]
        outs.append(RequestOutput("s", label_probs=[0.5], finished=True))
        outs.append(RequestOutput("gone", new_token_ids=[1]))
        client.deliver(outs)
    text = metrics.render().decode()
    assert _value(text, "vllm:inter_token_latency_seconds_count") == 4
    assert _value(text, "vllm:inter_token_latency_seconds_sum") == pytest.approx(7.03)
    assert _value(text, "vllm:inter_token_latency_seconds_bucket", le="5.0") == 3
    assert _value(text, "vllm:time_per_output_token_seconds_count") == 4
    assert "g" not in client._last_token_s  # forgotten when it finished
    # An output after the final one (a stop string finished it here before the engine's
    # abort) is kept only until the route releases the request.
    client.deliver([RequestOutput("g", new_token_ids=[9])])
    client._release("g", finished=True)
    assert client._last_token_s == {}
