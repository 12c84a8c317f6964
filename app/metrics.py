"""Prometheus metrics: one `CollectorRegistry` per app (tests run several apps in one process).

Request counters and latency histograms are updated by the app as requests finish; engine
gauges (queue depth, running, KV blocks, prefix-cache hit ratio) are read from
`engine.stats()` at scrape time by a custom collector, so they are never stale.

The JCT model's prediction error has its own names (docs/scheduling.md):
`greenlane_jct_prediction_mape` (fraction; NaN until the first observed prefill step),
`greenlane_jct_observed_steps`, and `greenlane_jct_model_info{source=...}` (which calibration).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

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

RECENT_WINDOW = 512  # latency samples kept for `recent()`

# engine.stats() keys exported under fixed names; other numeric keys are exported generically.
_NAMED_STATS = {
    "num_waiting": ("greenlane_queue_depth", "requests waiting for prefill in the engine"),
    "num_running": ("greenlane_running_requests", "requests holding KV blocks in the engine"),
    "kv_blocks_used": ("greenlane_kv_blocks_used", "KV blocks in use"),
    "kv_blocks_total": ("greenlane_kv_blocks_total", "KV blocks in the pool"),
    "jct_num_observed": (
        "greenlane_jct_observed_steps",
        "prefill-only steps whose measured time refined the JCT model online",
    ),
}
_JCT_MAPE_HELP = (
    "JCT model prediction error: mean |predicted - measured| / measured prefill step time over "
    "the last 100 observed prefill-only steps (a fraction: 0.1 = 10%; each prediction is made "
    "before its step runs). NaN until the first step is observed."
)


class _EngineCollector(Collector):
    def __init__(
        self, stats_fn: Callable[[], dict[str, Any] | None], in_flight_fn: Callable[[], int]
    ):
        self._stats_fn = stats_fn
        self._in_flight_fn = in_flight_fn

    def collect(self) -> Iterator[GaugeMetricFamily]:
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
                "prompt tokens served from the prefix cache / prompt tokens looked up",
                value=(hit / query) if query else 0.0,
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
                "the JCT model in use: source is fallback-default, fit or calibration:<file>",
                labels=["source"],
            )
            info.add_metric([stats["jct_source"]], 1.0)
            yield info
        # Anything else numeric (SM split, cost-model error, ...) as greenlane_engine_<key>.
        skip = set(_NAMED_STATS) | {"prefix_hit_tokens", "prefix_query_tokens", "jct_mape"}
        for key, value in stats.items():
            if key in skip or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            safe = "".join(c if c.isalnum() else "_" for c in key)
            yield GaugeMetricFamily(
                f"greenlane_engine_{safe}", f"engine.stats()['{key}']", value=float(value)
            )


class Metrics:
    """The app's metrics. `observe_request` is called once per finished HTTP request."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
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
        self._engine_collector: _EngineCollector | None = None
        # Rolling windows for the admin page (`recent()`); Prometheus keeps only buckets.
        self._lock = threading.Lock()
        self._recent: dict[str, deque[float]] = {
            k: deque(maxlen=RECENT_WINDOW) for k in ("ttft_s", "tpot_s", "e2e_s")
        }
        self._completed_total = 0  # finished model requests (any status)
        self._tokens_total = 0  # prompt + output tokens of those requests

    def bind_engine(
        self, stats_fn: Callable[[], dict[str, Any] | None], in_flight_fn: Callable[[], int]
    ) -> None:
        if self._engine_collector is not None:
            self.registry.unregister(self._engine_collector)
        self._engine_collector = _EngineCollector(stats_fn, in_flight_fn)
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
            self._recent["e2e_s"].append(e2e_s)
            if ttft_s is not None:
                self._recent["ttft_s"].append(ttft_s)
            if tpot_s is not None:
                self._recent["tpot_s"].append(tpot_s)
            self._completed_total += 1
            self._tokens_total += num_prompt_tokens + num_output_tokens
        if num_prompt_tokens:
            self.prompt_tokens.labels(endpoint).inc(num_prompt_tokens)
        if num_output_tokens:
            self.output_tokens.labels(endpoint).inc(num_output_tokens)

    def recent(self) -> dict[str, Any]:
        """Recent latency samples and running totals (the admin page's live view)."""
        with self._lock:
            return {
                **{k: list(v) for k, v in self._recent.items()},
                "completed_total": self._completed_total,
                "tokens_total": self._tokens_total,
            }

    def render(self) -> bytes:
        return generate_latest(self.registry)
