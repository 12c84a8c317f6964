"""Prometheus metrics: one `CollectorRegistry` per app (tests run several apps in one process).

Two families of series:

- Ours, `greenlane_*`: per-endpoint request counters and latency histograms (updated as HTTP
  requests finish), and the engine's state read from `engine.stats()` at scrape time by a
  custom collector (never stale): gauges for what goes up and down (queue depth, running, KV
  blocks, SM split, ...), counters for what only grows (`num_*`, `pd_*` and prefix-cache token
  counts: `greenlane_engine_<key>_total`). The JCT model's prediction error has its own names
  (docs/scheduling.md): `greenlane_jct_prediction_mape` (fraction; NaN until the first
  observed prefill step), `greenlane_jct_observed_steps_total`, `greenlane_jct_model_info`.
- vLLM's, `vllm:*` with a `model_name` label, with vLLM's meaning, so a Grafana dashboard made
  for vLLM shows Greenlane (tests/test_metrics_vllm.py lists the expressions it checks):
  per engine request (each of `n` choices, each scored item) as it finishes: E2E latency, TTFT,
  time per output token, inter-token latency, queue / prefill / decode / inference time,
  prompt and generation length, finish reasons, prompt and generation token counters; from
  `engine.stats()`: running, waiting (and swapped: always 0, we recompute, never swap), KV-cache
  usage fraction (also as vLLM's older `gpu_cache_usage_perc`; `cpu_cache_usage_perc` is 0:
  there is no CPU swap space), prefix-cache queries and hits (tokens), preemptions.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from runtime.request import RequestOutput

log = logging.getLogger("greenlane.app")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Latency buckets in seconds: scoring on a GPU lands in ms, long CPU prefills in tens of s.
_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    25,
    60,
    120,
    float("inf"),
)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, float("inf"))

RECENT_WINDOW = 512  # latency samples kept for `recent()`, per kind of traffic

# Which kind of traffic an endpoint serves (the admin page shows their latencies apart).
_SCORE_ENDPOINTS = ("/v1/score", "/v1/generative-scores", "/generative_scoring")


def traffic_kind(endpoint: str) -> str:
    """ "score" for the scoring endpoints, "chat" for chat and completions."""
    return "score" if endpoint in _SCORE_ENDPOINTS else "chat"


# engine.stats() keys exported under fixed names; other numeric keys are exported generically.
_NAMED_STATS = {
    "num_waiting": ("greenlane_queue_depth", "requests waiting for prefill in the engine"),
    "num_running": ("greenlane_running_requests", "requests holding KV blocks in the engine"),
    "kv_blocks_used": ("greenlane_kv_blocks_used", "KV blocks in use"),
    "kv_blocks_total": ("greenlane_kv_blocks_total", "KV blocks in the pool"),
}
# engine.stats() keys that only grow: exported as counters. Everything `num_*` or `pd_*` is a
# count, except the two queue depths.
_GAUGE_NUM_KEYS = {"num_waiting", "num_running", "num_held", "num_steps_in_flight"}
# Cumulative seconds (device time of decode steps, device idle between them): counters too.
_COUNTER_SECONDS_KEYS = {"decode_device_s", "decode_idle_s"}
_JCT_MAPE_HELP = (
    "JCT model prediction error: mean |predicted - measured| / measured prefill step time over "
    "the last 100 observed prefill-only steps (a fraction: 0.1 = 10%; each prediction is made "
    "before its step runs). NaN until the first step is observed."
)


class _EngineCollector(Collector):
    def __init__(
        self,
        stats_fn: Callable[[], dict[str, Any] | None],
        in_flight_fn: Callable[[], int],
        model_name_fn: Callable[[], str],
    ):
        self._stats_fn = stats_fn
        self._in_flight_fn = in_flight_fn
        self._model_name_fn = model_name_fn

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "greenlane_server_in_flight_requests",
            "engine requests admitted by the server and not finished",
            value=self._in_flight_fn(),
        )
        try:
            stats = self._stats_fn() or {}
        except Exception:  # a scrape must not fail because the engine is gone
            log.exception("engine.stats() failed during a metrics scrape")
            stats = {}
        for key, (name, doc) in _NAMED_STATS.items():
            if isinstance(stats.get(key), int | float):
                yield GaugeMetricFamily(name, doc, value=float(stats[key]))
        hit, query = stats.get("prefix_hit_tokens"), stats.get("prefix_query_tokens")
        if isinstance(hit, int | float) and isinstance(query, int | float):
            yield GaugeMetricFamily(
                "greenlane_prefix_cache_hit_ratio",
                "prompt tokens served from the prefix cache / prompt tokens looked up, since "
                "start (rate() the two counters below for a recent ratio)",
                value=(hit / query) if query else 0.0,
            )
            yield CounterMetricFamily(
                "greenlane_prefix_cache_hit_tokens",
                "prompt tokens served from the prefix cache",
                value=float(hit),
            )
            yield CounterMetricFamily(
                "greenlane_prefix_cache_query_tokens",
                "prompt tokens looked up in the prefix cache",
                value=float(query),
            )
        if isinstance(stats.get("jct_num_observed"), int | float):
            yield CounterMetricFamily(
                "greenlane_jct_observed_steps",
                "prefill-only steps whose measured time refined the JCT model online",
                value=float(stats["jct_num_observed"]),
            )
        if "jct_mape" in stats:
            mape = stats["jct_mape"]
            yield GaugeMetricFamily(
                "greenlane_jct_prediction_mape",
                _JCT_MAPE_HELP,
                value=float(mape) if isinstance(mape, int | float) else float("nan"),
            )
        if isinstance(stats.get("jct_source"), str):
            info = GaugeMetricFamily(
                "greenlane_jct_model_info",
                "the JCT model in use: source is fallback-shape (derived for this model), fallback-default, fit or calibration:<file>",
                labels=["source"],
            )
            info.add_metric([stats["jct_source"]], 1.0)
            yield info
        # Anything else numeric as greenlane_engine_<key>: counts as counters, the rest (SM
        # split, cost-model error, ...) as gauges.
        skip = set(_NAMED_STATS) | {
            "prefix_hit_tokens",
            "prefix_query_tokens",
            "jct_mape",
            "jct_num_observed",
        }
        for key, value in stats.items():
            if key in skip or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            safe = "".join(c if c.isalnum() else "_" for c in key)
            doc = f"engine.stats()['{key}']"
            counts = key.startswith(("num_", "pd_")) and key not in _GAUGE_NUM_KEYS
            if counts or key in _COUNTER_SECONDS_KEYS:
                yield CounterMetricFamily(f"greenlane_engine_{safe}", doc, value=float(value))
            else:
                yield GaugeMetricFamily(f"greenlane_engine_{safe}", doc, value=float(value))
        yield from _vllm_engine_series(stats, self._model_name_fn())


# ----------------------------------------------------------------------------- vLLM's series

# Bucket bounds (ours): seconds from a GPU's milliseconds to a CPU's long prefills; tokens
# up to a 128k context.
_VLLM_SECONDS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
_VLLM_TOKENS = (
    1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072,
)  # fmt: skip
# name (without `vllm:`) -> (help, bounds)
_VLLM_HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "e2e_request_latency_seconds": ("arrival to finish of a request (engine clock)", _VLLM_SECONDS),
    "time_to_first_token_seconds": ("arrival to first token of a request", _VLLM_SECONDS),
    "time_per_output_token_seconds": (
        "time between a request's consecutive outputs (one an engine step), as the API server "
        "received them (vLLM's older name for inter_token_latency_seconds)",
        _VLLM_SECONDS,
    ),
    "request_time_per_output_token_seconds": (
        "a request's decode time / (output tokens - 1) (requests of 2+ tokens)",
        _VLLM_SECONDS,
    ),
    "inter_token_latency_seconds": (
        "time between a request's consecutive outputs (one an engine step), as the API server "
        "received them: each gap on its own, so a stall shows in the tail",
        _VLLM_SECONDS,
    ),
    "request_queue_time_seconds": ("arrival to first scheduled", _VLLM_SECONDS),
    "request_prefill_time_seconds": ("first scheduled to first token", _VLLM_SECONDS),
    "request_decode_time_seconds": ("first token to finish", _VLLM_SECONDS),
    "request_inference_time_seconds": ("first scheduled to finish", _VLLM_SECONDS),
    "request_prompt_tokens": ("prompt tokens of a request", _VLLM_TOKENS),
    "request_generation_tokens": ("output tokens of a request", _VLLM_TOKENS),
    "request_max_num_generation_tokens": (
        "output tokens of a request (each of n choices is a request here)",
        _VLLM_TOKENS,
    ),
}


class _Hist:
    """A histogram we render ourselves (so one observation may count several times)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, the last is +Inf
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times

    def buckets(self) -> list[tuple[str, float]]:
        out, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(total)))
        return out


class _VllmRequestSeries(Collector):
    """vLLM's per-request histograms and counters, fed by `observe` as requests finish."""

    def __init__(self, model_name_fn: Callable[[], str]) -> None:
        self._model_name_fn = model_name_fn
        self._lock = threading.Lock()
        self._hists = {name: _Hist(bounds) for name, (_, bounds) in _VLLM_HISTOGRAMS.items()}
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._finished: dict[str, int] = {}

    def observe(self, out: RequestOutput, num_output_tokens: int) -> None:
        """`out` is a request's final output; `num_output_tokens` what it generated."""
        h = self._hists
        with self._lock:
            self._prompt_tokens += out.num_prompt_tokens
            self._generation_tokens += num_output_tokens
            reason = out.finish_reason or "stop"
            self._finished[reason] = self._finished.get(reason, 0) + 1
            h["request_prompt_tokens"].observe(out.num_prompt_tokens)
            h["request_generation_tokens"].observe(num_output_tokens)
            h["request_max_num_generation_tokens"].observe(num_output_tokens)
            for name, value in (
                ("e2e_request_latency_seconds", out.e2e_s),
                ("time_to_first_token_seconds", out.ttft_s),
                ("request_queue_time_seconds", out.queue_s),
                ("request_prefill_time_seconds", out.prefill_s),
                ("request_decode_time_seconds", out.decode_s),
            ):
                if value is not None:
                    h[name].observe(value)
            if out.prefill_s is not None and out.decode_s is not None:
                h["request_inference_time_seconds"].observe(out.prefill_s + out.decode_s)
            if out.decode_s is not None and num_output_tokens > 1:
                gap_s = out.decode_s / (num_output_tokens - 1)
                h["request_time_per_output_token_seconds"].observe(gap_s)

    def observe_gaps(self, gaps_s: list[float]) -> None:
        """Gaps between consecutive outputs of streaming requests (one engine step's)."""
        h = self._hists
        itl, tpot = h["inter_token_latency_seconds"], h["time_per_output_token_seconds"]
        with self._lock:
            for gap_s in gaps_s:
                itl.observe(gap_s)
                tpot.observe(gap_s)

    def collect(self) -> Iterator[Metric]:
        model = self._model_name_fn()
        with self._lock:
            for name, (doc, _) in _VLLM_HISTOGRAMS.items():
                hist = self._hists[name]
                family = HistogramMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
                family.add_metric([model], hist.buckets(), hist.sum)
                yield family
            for name, doc, value in (
                ("prompt_tokens", "prompt tokens of finished requests", self._prompt_tokens),
                (
                    "generation_tokens",
                    "output tokens of finished requests",
                    self._generation_tokens,
                ),
            ):
                counter = CounterMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
                counter.add_metric([model], float(value))
                yield counter
            success = CounterMetricFamily(
                "vllm:request_success",
                "finished requests by finish reason (stop, length, abort, error)",
                labels=["model_name", "finished_reason"],
            )
            for reason in sorted({"stop", "length", *self._finished}):
                success.add_metric([model, reason], float(self._finished.get(reason, 0)))
            yield success


def _vllm_engine_series(stats: dict[str, Any], model: str) -> Iterator[Metric]:
    """vLLM's engine-state series from one `engine.stats()` snapshot."""

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
        family.add_metric([model], value)
        return family

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
        family.add_metric([model], value)
        return family

    def num(key: str) -> float:
        value = stats.get(key)
        return float(value) if isinstance(value, int | float) else 0.0

    used, total = num("kv_blocks_used"), num("kv_blocks_total")
    usage = used / total if total else 0.0
    yield gauge("num_requests_running", "requests holding KV blocks", num("num_running"))
    yield gauge("num_requests_waiting", "requests waiting to be scheduled", num("num_waiting"))
    yield gauge("num_requests_swapped", "always 0: preempted requests recompute", 0.0)
    yield gauge("kv_cache_usage_perc", "KV-cache usage, a fraction (1 = full)", usage)
    yield gauge("gpu_cache_usage_perc", "KV-cache usage, a fraction (vLLM's older name)", usage)
    yield gauge("cpu_cache_usage_perc", "always 0: there is no CPU swap space", 0.0)
    yield counter(
        "prefix_cache_queries",
        "prompt tokens looked up in the prefix cache",
        num("prefix_query_tokens"),
    )
    yield counter(
        "prefix_cache_hits", "prompt tokens found in the prefix cache", num("prefix_hit_tokens")
    )
    yield counter(
        "num_preemptions", "requests preempted (their KV recomputed later)", num("num_preemptions")
    )


class Metrics:
    """The app's metrics. `observe_request` is called once per finished HTTP request,
    `observe_engine_request` once per finished engine request (a choice, a scored item)."""

    def __init__(self, model_name: str = "default") -> None:
        self.model_name = model_name  # the `model_name` label of the vllm:* series
        self.registry = CollectorRegistry(auto_describe=True)
        self._vllm = _VllmRequestSeries(lambda: self.model_name)
        self.registry.register(self._vllm)
        self.requests = Counter(
            "greenlane_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "greenlane_ttft_seconds",
            "arrival to first token (engine clock)",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "greenlane_tpot_seconds",
            "mean time per output token after the first",
            ["endpoint"],
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "greenlane_e2e_seconds",
            "server receive to response end",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "greenlane_prompt_tokens",
            "prompt tokens processed",
            ["endpoint"],
            registry=self.registry,
        )
        self.output_tokens = Counter(
            "greenlane_output_tokens",
            "output tokens generated",
            ["endpoint"],
            registry=self.registry,
        )
        self.api_cpu_share = Gauge(
            "greenlane_api_server_cpu_share",
            "this API server process's CPU seconds per second over its last window "
            "(app/load_watch.py; near 1: requests wait for it, --api-server-count adds processes)",
            registry=self.registry,
        )
        self._engine_collector: _EngineCollector | None = None
        # Rolling windows for the admin page (`recent()`); Prometheus keeps only buckets.
        self._lock = threading.Lock()
        self._recent: dict[str, dict[str, deque[float]]] = {
            kind: {k: deque(maxlen=RECENT_WINDOW) for k in ("ttft_s", "tpot_s", "e2e_s")}
            for kind in ("chat", "score")
        }
        self._completed_total = 0  # finished model requests (any status)
        self._tokens_total = 0  # prompt + output tokens of those requests

    def bind_engine(
        self, stats_fn: Callable[[], dict[str, Any] | None], in_flight_fn: Callable[[], int]
    ) -> None:
        if self._engine_collector is not None:
            self.registry.unregister(self._engine_collector)
        self._engine_collector = _EngineCollector(stats_fn, in_flight_fn, lambda: self.model_name)
        self.registry.register(self._engine_collector)

    def observe_request(
        self,
        endpoint: str,
        status: int,
        e2e_s: float,
        ttft_s: float | None = None,
        num_prompt_tokens: int = 0,
        num_output_tokens: int = 0,
    ) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        if not endpoint.startswith("/v1/"):
            return  # only model endpoints get latency and token metrics
        self.e2e.labels(endpoint).observe(e2e_s)
        tpot_s = None
        if ttft_s is not None:
            self.ttft.labels(endpoint).observe(ttft_s)
            if num_output_tokens > 1:
                tpot_s = max(0.0, e2e_s - ttft_s) / (num_output_tokens - 1)
                self.tpot.labels(endpoint).observe(tpot_s)
        with self._lock:
            recent = self._recent[traffic_kind(endpoint)]
            recent["e2e_s"].append(e2e_s)
            if ttft_s is not None:
                recent["ttft_s"].append(ttft_s)
            if tpot_s is not None:
                recent["tpot_s"].append(tpot_s)
            self._completed_total += 1
            self._tokens_total += num_prompt_tokens + num_output_tokens
        if num_prompt_tokens:
            self.prompt_tokens.labels(endpoint).inc(num_prompt_tokens)
        if num_output_tokens:
            self.output_tokens.labels(endpoint).inc(num_output_tokens)

    def observe_engine_request(self, out: RequestOutput, num_output_tokens: int) -> None:
        """A finished engine request (its final output): the vllm:* per-request series."""
        self._vllm.observe(out, num_output_tokens)

    def observe_token_gaps(self, gaps_s: list[float]) -> None:
        """The gaps between generating requests' consecutive outputs over one engine step
        (`EngineClient.on_token_gaps`): vllm:inter_token_latency_seconds, each on its own."""
        self._vllm.observe_gaps(gaps_s)

    def recent(self) -> dict[str, Any]:
        """Recent latency samples, per kind of traffic ("chat": chat and completions;
        "score": the scoring endpoints) and together, and running totals (the admin page's
        live view)."""
        with self._lock:
            by_kind = {
                kind: {k: list(v) for k, v in samples.items()}
                for kind, samples in self._recent.items()
            }
            return {
                **{k: by_kind["chat"][k] + by_kind["score"][k] for k in by_kind["chat"]},
                "by_kind": by_kind,
                "completed_total": self._completed_total,
                "tokens_total": self._tokens_total,
            }

    def render(self) -> bytes:
        return generate_latest(self.registry)
