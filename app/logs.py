"""Logs: one line per HTTP request, the log format, `X-Request-Id`, and a periodic engine line.

- `AccessLogMiddleware` (pure ASGI, streaming-safe) gives each request a `Trace`, and when the
  response has ended writes exactly one `greenlane.request` line: method, path, status, the
  request id, token counts, timings and, for an error, its reason (the error handlers and the
  routes put it on the trace). It also records the request's metrics. Probes and scrapers
  (`/health`, `/metrics`, `/admin`) are logged at DEBUG only.
- `X-Request-Id`: a valid id the client sends becomes the request's id (log line, response
  `id`); every response carries the id in its `X-Request-Id` header.
- `--log-format json` writes every log record as one JSON object; request lines carry their
  fields as keys (`fields` on the record).
- `EngineStatsLog`: every `--stats-log-interval-s` seconds, one `greenlane.stats` line from
  `engine.stats()`: prompt and generation throughput, running, waiting, KV usage, prefix-cache
  hit rate (over the interval). Idle intervals after an idle line are not logged again.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.common import Trace, new_id
from app.metrics import Metrics
from app.settings import Settings

log = logging.getLogger("greenlane.request")
stats_log = logging.getLogger("greenlane.stats")

REQUEST_ID_HEADER = "x-request-id"
# What we accept as a client's request id: it goes into log lines and headers unescaped.
_VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
# Paths whose requests are logged at DEBUG, not INFO (probes and scrapers would flood the log).
_QUIET_PATHS = ("/health", "/metrics", "/admin")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


# ----------------------------------------------------------------------------- format


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, plus the record's `fields`."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def configure_logging(level: str, log_format: str) -> None:
    """Root logging for a server process: one stderr handler in `log_format` (text | json)."""
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())


class _DropAll(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


def _quiet_uvicorn_access_log() -> None:
    """Our access line replaces uvicorn's (two lines per request, in two formats, otherwise).
    A filter, not handlers or levels: uvicorn's logging set-up, which runs after the app is
    built, resets those but keeps filters."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _DropAll) for f in access.filters):
        access.addFilter(_DropAll())


# ----------------------------------------------------------------------------- request lines


def client_request_id(scope: Scope) -> str | None:
    """The client's X-Request-Id, when it is one we can use verbatim (else None: we make one)."""
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID_HEADER.encode():
            text = value.decode("latin-1").strip()
            return text if _VALID_REQUEST_ID.fullmatch(text) else None
    return None


def _num(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def request_fields(
    trace: Trace, method: str, path: str, status: int, client: str | None
) -> dict[str, Any]:
    return {
        "id": trace.request_id,
        "method": method,
        "path": path,
        "endpoint": trace.endpoint,
        "status": status,
        "client": client,
        "prompt_tokens": trace.num_prompt_tokens,
        "cached_tokens": trace.num_cached_tokens,
        "output_tokens": trace.num_output_tokens,
        "queue_s": _num(trace.queue_s),
        "ttft_s": _num(trace.ttft_s),
        "total_s": _num(time.monotonic() - trace.start_s),
        "finish": trace.finish_reason,
        "error": trace.error,
    }


def _text(fields: dict[str, Any]) -> str:
    parts = []
    for key, value in fields.items():
        if value is None:
            value = "-"
        elif key == "error":
            value = json.dumps(value, ensure_ascii=False)  # quoted: reasons contain spaces
        parts.append(f"{key}={value}")
    return " ".join(parts)


def log_request(fields: dict[str, Any], quiet: bool) -> None:
    level = logging.DEBUG if quiet else logging.INFO
    if log.isEnabledFor(level):
        log.log(level, "%s", _text(fields), extra={"fields": fields})


class AccessLogMiddleware:
    """A `Trace` per request; at the end, the request's metrics and its one log line."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        trace = Trace(endpoint="other", start_s=time.monotonic())
        trace.client_request_id = client_request_id(scope)
        if trace.client_request_id:
            trace.request_id = trace.client_request_id
        scope.setdefault("state", {})["trace"] = trace
        status = 499  # if no response starts, the client went away first

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                if trace.request_id == "-":  # not a model request, or it failed before one
                    trace.request_id = new_id("req")
                headers = list(message.get("headers", []))
                headers.append((REQUEST_ID_HEADER.encode(), trace.request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except BaseException as exc:
            status = 500 if status == 499 else status
            trace.error = trace.error or f"{type(exc).__name__}: {exc}"
            raise
        finally:
            # The router records the matched route in the scope: its path template keeps the
            # metrics' label set bounded (unmatched paths are "other").
            route = scope.get("route")
            trace.endpoint = getattr(route, "path", None) or "other"
            e2e_s = time.monotonic() - trace.start_s
            self.metrics.observe_request(
                trace.endpoint,
                status,
                e2e_s,
                trace.ttft_s,
                trace.num_prompt_tokens,
                trace.num_output_tokens,
            )
            if status == 499 and trace.error is None:
                trace.error = "client disconnected"
            client = scope.get("client")
            fields = request_fields(
                trace, scope.get("method", "-"), path, status, client[0] if client else None
            )
            log_request(fields, quiet=path.startswith(_QUIET_PATHS))


# ----------------------------------------------------------------------------- engine stats


class EngineStatsLog:
    """A daemon thread that logs one engine line every `interval_s` (from `engine.stats()`,
    a thread-safe snapshot) until the app stops its engine."""

    def __init__(self, app: FastAPI, interval_s: float) -> None:
        self.app = app
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._last: tuple[float, dict[str, Any]] | None = None
        self._was_idle = False
        self._thread = threading.Thread(target=self._run, name="greenlane-stats-log", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            state = self.app.state
            if getattr(state, "engine_stopped", False):
                return
            engine = getattr(state, "engine", None)
            if engine is None:
                continue
            try:
                fields = self.sample(engine.stats(), time.monotonic())
            except Exception:  # a log line must never take the server down
                stats_log.exception("engine.stats() failed")
                continue
            if fields is not None:
                stats_log.info("%s", _text(fields), extra={"fields": fields})

    def sample(self, stats: dict[str, Any], now_s: float) -> dict[str, Any] | None:
        """The line's fields from this snapshot and the previous one (None: nothing to log —
        the first snapshot, or still idle)."""
        last, self._last = self._last, (now_s, dict(stats))
        if last is None:
            return None
        then_s, before = last
        dt = max(now_s - then_s, 1e-9)

        def delta(key: str) -> float:
            now, prev = stats.get(key), before.get(key)
            if not isinstance(now, int | float) or not isinstance(prev, int | float):
                return 0.0
            return max(0.0, float(now - prev))  # a reset counter is not a negative rate

        used, total = stats.get("kv_blocks_used"), stats.get("kv_blocks_total")
        hit, query = delta("prefix_hit_tokens"), delta("prefix_query_tokens")
        fields = {
            "prompt_tokens_per_s": round(delta("num_prefill_tokens") / dt, 1),
            "generation_tokens_per_s": round(delta("num_decode_tokens") / dt, 1),
            "running": stats.get("num_running"),
            "waiting": stats.get("num_waiting"),
            "kv_usage": round(used / total, 4) if isinstance(used, int) and total else None,
            "prefix_hit_rate": round(hit / query, 4) if query else None,
        }
        if stats.get("tbt_slo_ms") is not None:
            # What sizes each step's prefill under the TBT target: the correction of the JCT
            # model's marginal cost (a scale for its per-token and one for its per-pair term,
            # fixed cost of a mixed step, cost of the prefill parts' cached tokens) and the
            # decode step over this interval (a target missed in the field is read from
            # these).
            steps = delta("num_decode_steps")
            fields["tbt_slo_ms"] = stats["tbt_slo_ms"]
            for key in ("tbt_cost_token_scale", "tbt_cost_pair_scale"):
                scale = stats.get(key)
                fields[key] = round(scale, 3) if isinstance(scale, float) else None
            offset = stats.get("tbt_cost_offset_ms")
            fields["tbt_cost_offset_ms"] = round(offset, 2) if isinstance(offset, float) else None
            per_1k = stats.get("tbt_cost_context_ms_per_1k")
            fields["tbt_cost_context_ms_per_1k"] = (
                round(per_1k, 3) if isinstance(per_1k, float) else None
            )
            tail = stats.get("tbt_tail_factor")
            fields["tbt_tail_factor"] = round(tail, 2) if isinstance(tail, float) else None
            fields["decode_step_ms"] = (
                round(1e3 * delta("decode_device_s") / steps, 2) if steps else None
            )
            # Steps mixing prefill with decodes over this interval: how many exceeded the
            # target, and measured / predicted over the recent ones (P99).
            mixed = delta("num_mixed_steps")
            fields["mixed_steps_over_tbt"] = (
                f"{int(delta('num_mixed_steps_over_tbt'))}/{int(mixed)}" if mixed else None
            )
            ratio = stats.get("mixed_step_ratio_p99")
            fields["mixed_step_ratio_p99"] = round(ratio, 2) if isinstance(ratio, float) else None
        # The collector's pauses over this interval (a full collection stops the step loop).
        full = delta("gc_full_collections")
        if full or (stats.get("gc_pause_ms_max") or 0) >= 10.0:
            fields["gc_full_collections"] = int(full)
            fields["gc_pause_ms_max"] = stats.get("gc_pause_ms_max")
            # Young pauses apart, and the collecting thread's own CPU (a pause's wall time
            # can hold another thread's turn: runtime/diagnostics/gc_watch.py).
            fields["gc_young_pause_ms_max"] = stats.get("gc_young_pause_ms_max")
            fields["gc_pause_cpu_ms_max"] = stats.get("gc_pause_cpu_ms_max")
        idle = not (fields["prompt_tokens_per_s"] or fields["generation_tokens_per_s"]) and not (
            fields["running"] or fields["waiting"]
        )
        if idle and self._was_idle:
            return None
        self._was_idle = idle
        return fields


def install(app: FastAPI, settings: Settings, metrics: Metrics) -> None:
    """The access log (middleware), the log format and the periodic engine line for `app`."""
    app.add_middleware(AccessLogMiddleware, metrics=metrics)
    metrics.model_name = settings.model_name  # the vllm:* series' model_name label
    _quiet_uvicorn_access_log()
    if settings.log_format == "json":
        # The process's handlers exist by now (`serve` configured logging before building
        # the app): give them the JSON format.
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())
    if settings.stats_log_interval_s > 0:
        app.state.stats_log = EngineStatsLog(app, settings.stats_log_interval_s)
        app.state.stats_log.start()
