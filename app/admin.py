"""Admin API and page: live state of the engine, the SM split and the prefill policy.

Routes (all under `/admin`):
- `GET  /admin`                 the page (static/admin.html); its JS/CSS at `/admin/static/<file>`.
- `GET  /admin/api/state`       one JSON snapshot (shape: `build_state`).
- `GET  /admin/api/events`      SSE: the same snapshot as event `state` every `interval_s`.
- `PUT  /admin/api/partition`   `{"mode": "auto"|"off"|"static", "prefill_sms": int}`.
- `PUT  /admin/api/policy`      `{"policy": "srjf"|"spf"|"fcfs"|"srjf-oneshot"|"srjf-cold-fcfs"}`.
- `PUT  /admin/api/prefill`     `{"prefill_token_budget": int, "tbt_slo_ms": float|null,
  "mixed_step_token_budget": int|null, "chunk_fixed_share": float|null}` (any of them; the
  budget at most the one the server started with).
- `POST /admin/api/prefix-cache/reset`  drop every idle prefix-cache block (benchmarks call it
  between runs so one run's prompts do not speed up the next).
- `POST /admin/api/cost-model/errors/reset`  forget the partition cost model's logged errors
  (benchmarks call it before each side, so each side's MAPE per kind is its own).

What the router reads from `app.state` (set by `app.main.create_app`):
- `engine`: `app.engine_view.EngineView` — `stats()`, `is_alive()`, the coroutines
  `set_policy(name)` and `reset_prefix_cache()`, and `partition` (`state()`, and the
  coroutines `set_mode(spec)` and `reset_cost_model_errors()`).
- `metrics` (optional): `recent()` -> `{"ttft_s": [...], "tpot_s": [...], "e2e_s": [...],
  "completed_total": int, "tokens_total": int}`, the recent latency samples and the counters.
  Without it, latencies are reported as missing and throughput comes from the same counters in
  `engine.stats()` if the engine has them.
- `settings` (optional): `admin_token` (str, SecretStr or None), `host`, `allowed_hosts`,
  `admin_max_event_streams`.

Protection (threat model in docs/security.md):
- With an admin token set, every /admin/api/* call needs `Authorization: Bearer <token>` (401
  otherwise), reads included; compared in constant time.
- Without one, reads are open and changes (PUT, POST) come only from loopback clients
  (127.0.0.0/8, ::1) whose Host is local (a DNS-rebinding page has its own name there) and whose
  Origin, if sent, is this site (403 otherwise).
- A change needs a JSON content type (415 otherwise): a browser sends one cross-site only after
  a CORS preflight, which this server never grants, so a web page cannot forge a change (CSRF).
- At most `admin_max_event_streams` event streams are open at once (429 beyond).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.resources
import json
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.types import Receive, Scope, Send

from app.security import (
    bearer_token,
    host_allowed,
    is_json_content_type,
    is_loopback_address,
    origin_allowed,
    same_secret,
    secret_of,
)
from policies import POLICY_NAMES

# The page's files, found through the package: in a checkout `app/static` links to the
# top-level static/; an installed wheel carries them in `app/static` itself.
STATIC_DIR = Path(str(importlib.resources.files("app") / "static"))
# Only these files are served under /admin/static/: a fixed list, so no path from the URL ever
# reaches the file system.
_STATIC_FILES: dict[str, str] = {
    "admin.js": "text/javascript; charset=utf-8",
    "admin.css": "text/css; charset=utf-8",
}
_THROUGHPUT_WINDOW_S = 5.0  # rates are averaged over counter samples this far apart
_SSE_DEFAULT_INTERVAL_S = 0.5
_SSE_MIN_INTERVAL_S = 0.1
_SSE_MAX_INTERVAL_S = 10.0
_DEFAULT_MAX_EVENT_STREAMS = 8

router = APIRouter()


# ---------------------------------------------------------------------------------------------
# Wire models and errors
# ---------------------------------------------------------------------------------------------


MAX_WIRE_INT = 2**31 - 1  # an int field's bound before the engine core's own check


class PartitionChange(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # strict: `false` is not 0 SMs

    mode: Literal["auto", "off", "static"]
    # required with mode "static", refused with the others; bounded here so that no number
    # too large to send reaches the engine core (its own check names the valid splits)
    prefill_sms: int | None = Field(None, ge=0, le=MAX_WIRE_INT)


class PrefillChange(BaseModel):
    """Any of the four; a field left out keeps its value; `tbt_slo_ms: null` removes the
    target, `mixed_step_token_budget: null` the cap on steps with decodes (the budget alone),
    `chunk_fixed_share: null` auto's growth past that cap (`--chunk-fixed-share`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    # Token counts bounded so that none too large to send reaches the engine core, whose own
    # check (`runtime.config.check_prefill_limits`) names the valid range.
    prefill_token_budget: int | None = Field(None, ge=0, le=MAX_WIRE_INT)
    # Finite: JSON's 1e400 is infinity, which the engine took as a target no step misses (and
    # the state showed as null, "no target"); null is how to ask for no target.
    tbt_slo_ms: float | None = Field(None, allow_inf_nan=False)
    mixed_step_token_budget: int | None = Field(None, ge=0, le=MAX_WIRE_INT)
    # A share in (0, 1): the engine's check names the range.
    chunk_fixed_share: float | None = Field(None, allow_inf_nan=False)


class PolicyChange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: str


PROFILE_MAX_STEPS = 5000  # a profile holds every kernel of every step: bounded
PROFILE_MAX_TIMEOUT_S = 600.0


class ProfileRequest(BaseModel):
    """`POST /admin/api/profile`: the torch profiler over the engine's next steps."""

    model_config = ConfigDict(extra="forbid", strict=True)

    num_steps: int = Field(default=100, ge=1, le=PROFILE_MAX_STEPS)
    timeout_s: float = Field(default=60.0, gt=0, le=PROFILE_MAX_TIMEOUT_S)
    trace: bool = False  # also write the chrome trace (a file in the server's cache folder)


class ResetRequest(BaseModel):
    """`POST /admin/api/prefix-cache/reset` takes no fields; the JSON type is what matters."""

    model_config = ConfigDict(extra="forbid")


def _json_body(model: type[BaseModel], description: str, required: bool = True) -> dict[str, Any]:
    """OpenAPI `requestBody` for a route that parses its body itself (after the auth check)."""
    return {
        "requestBody": {
            "required": required,
            "description": description,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


def _err(text: str) -> dict[str, Any]:
    schema = {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type"]}},
    }
    return {"description": text, "content": {"application/json": {"schema": schema}}}


_READ_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The state snapshot (shape: app.admin.build_state)"},
    401: _err("An admin token is set and was not given"),
    403: _err("Host not allowed (DNS-rebinding guard)"),
}
_STEPS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The engine's recent steps, oldest first (app.admin.admin_steps)"},
    400: _err("`limit` is not an integer from 1 to the number of steps kept"),
    401: _READ_RESPONSES[401],
    403: _READ_RESPONSES[403],
    404: _err("This engine keeps no step trace"),
    503: _err("The engine is starting"),
}
# What every admin write (a JSON body, a loopback or token guard, a running engine) may answer.
_WRITE_COMMON: dict[int | str, dict[str, Any]] = {
    400: _err("Invalid body"),
    401: _err("An admin token is set and was not given"),
    403: _err("Not a loopback client with a local Host and Origin (no token set)"),
    415: _err("The body is not JSON"),
    503: _err("The engine is starting"),
}
_PROFILE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The profile's summary (runtime.diagnostics.profiling.summarize_kernels)"},
    **_WRITE_COMMON,
    409: _err("A profile is already running"),
    404: _err("This engine cannot profile its steps"),
    500: _err("The profiler failed (the engine serves on)"),
}
_ERRORS_RESET_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": '`{"reset": true}`: the error logs are empty'},
    **_WRITE_COMMON,
    409: _err("This server has no partition cost model (SM partitioning unavailable)"),
}
STEP_TRACE_MAX = 4096  # runtime.engine.STEP_TRACE_LEN (app/ does not import the engine)
_EVENTS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Server-Sent Events: `event: state` with the snapshot as data",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
    400: _err("interval_s is not a finite number"),
    401: _READ_RESPONSES[401],
    403: _READ_RESPONSES[403],
    429: _err("Too many event streams are open"),
    "4XX": _err("Other client errors (a bad query parameter is a 400, not FastAPI's 422)"),
}
_CHANGE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The state after the change (reset: queued)"},
    **_WRITE_COMMON,
}


def _error(
    status: int,
    message: str,
    err_type: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An OpenAI-style error body, like the rest of the API."""
    body = {"error": {"message": message, "type": err_type, "param": param, "code": None}}
    if status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    loc = ".".join(str(part) for part in first.get("loc", ()))
    return f"{loc}: {first.get('msg', 'invalid value')}" if loc else str(
        first.get("msg")
    ), loc or None


async def _parse_body(request: Request, model: type[BaseModel]) -> BaseModel | JSONResponse:
    try:
        raw = await request.json()
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the parser
        return _error(400, "request body must be a JSON object", "invalid_request_error")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        message, param = _validation_message(exc)
        return _error(400, message, "invalid_request_error", param)


# ---------------------------------------------------------------------------------------------
# Protection of changes
# ---------------------------------------------------------------------------------------------


is_loopback = is_loopback_address  # the admin's rule for "a local client"


def _settings(request: Request) -> Any:
    return getattr(request.app.state, "settings", None)


def _check_token(request: Request, token: str) -> JSONResponse | None:
    given = bearer_token(request.headers)
    if given is None:
        return _error(
            401, "admin token required: Authorization: Bearer <token>", "authentication_error"
        )
    if not same_secret(given, token):
        return _error(401, "invalid admin token", "authentication_error")
    return None


def check_admin_read(request: Request) -> JSONResponse | None:
    """None when the caller may read the admin state: anyone without a token set (the Host
    rule of app/gate.py still applies on a loopback server), else the token's holder."""
    token = secret_of(_settings(request), "admin_token")
    return None if token is None else _check_token(request, token)


def check_admin(request: Request) -> JSONResponse | None:
    """None when the caller may change settings, else the error response to send."""
    settings = _settings(request)
    token = secret_of(settings, "admin_token")
    if token is not None:
        denied = _check_token(request, token)
        if denied is not None:
            return denied
    else:
        host = request.headers.get("host")
        peer = request.client.host if request.client else None
        if not is_loopback(peer):
            return _error(
                403,
                "admin changes are allowed only from loopback clients when "
                "GREENLANE_ADMIN_TOKEN is not set",
                "permission_error",
            )
        if not host_allowed(host, settings):
            return _error(
                403,
                f"admin changes need a local Host (got {host!r}): a DNS-rebinding guard; "
                "use localhost or 127.0.0.1, or set --allowed-hosts / an admin token",
                "permission_error",
            )
        if not origin_allowed(request.headers.get("origin"), host, settings):
            return _error(403, "cross-site admin changes are refused", "permission_error")
    if not is_json_content_type(request.headers.get("content-type")):
        return _error(
            415,
            "admin changes need a JSON body (Content-Type: application/json)",
            "invalid_request_error",
        )
    return None


# ---------------------------------------------------------------------------------------------
# State snapshot
# ---------------------------------------------------------------------------------------------


def percentile(samples: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) of unsorted samples; None when empty."""
    if not samples:
        return None
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def _summary(samples: Sequence[float]) -> dict[str, float | int | None]:
    return {
        "count": len(samples),
        "mean": sum(samples) / len(samples) if samples else None,
        "p50": percentile(samples, 50),
        "p90": percentile(samples, 90),
        "p99": percentile(samples, 99),
    }


class _RateTracker:
    """Turns monotonically growing counters into per-second rates over a short window.

    Lives on `app.state.admin_rates`; touched only from the event loop, so no lock."""

    def __init__(self, window_s: float = _THROUGHPUT_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int, int]] = deque()  # (monotonic s, completed, tokens)

    def rates(self, now_s: float, completed: int, tokens: int) -> tuple[float, float]:
        self._samples.append((now_s, completed, tokens))
        # Keep one sample at or beyond the window edge so the rate always spans ~window_s.
        while len(self._samples) > 2 and now_s - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        t0, c0, k0 = self._samples[0]
        dt = now_s - t0
        if dt <= 0:
            return 0.0, 0.0
        # max(0, ...): a counter reset (engine restart) must not show a negative rate.
        return max(0, completed - c0) / dt, max(0, tokens - k0) / dt


def _partition_state(engine: Any, stats: dict[str, Any]) -> dict[str, Any]:
    manager = getattr(engine, "partition", None)
    if manager is not None:
        state = manager.state()
        return dataclasses.asdict(state) if dataclasses.is_dataclass(state) else dict(state)
    snap = stats.get("partition")
    if isinstance(snap, dict):
        return dict(snap)
    if dataclasses.is_dataclass(snap) and not isinstance(snap, type):
        return dataclasses.asdict(snap)
    return _unavailable_partition("the engine exposes no partition manager")


def _unavailable_partition(reason: str) -> dict[str, Any]:
    return {
        "available": False,
        "reason": reason,
        "mode": "off",
        "total_sms": 0,
        "prefill_sms": 0,
        "decode_sms": 0,
        "splits": [],
        "pinned": False,
        "predicted_prefill_ms": None,
        "predicted_decode_ms": None,
        "measured_prefill_ms": None,
        "measured_decode_ms": None,
        "choice_counts": {},
        "disabled_splits": {},
    }


def _recent_metrics(app_state: Any, stats: dict[str, Any]) -> dict[str, Any]:
    metrics = getattr(app_state, "metrics", None)
    recent = getattr(metrics, "recent", None)
    if callable(recent):
        return {"source": "metrics", **recent()}
    # Fallback: no rolling windows from the app; only counters the engine may carry.
    return {
        "source": "engine_stats_fallback",
        "ttft_s": [],
        "tpot_s": [],
        "e2e_s": [],
        "completed_total": stats.get("completed_total"),
        "tokens_total": stats.get("tokens_total"),
    }


def _latency_by_kind(recent: dict[str, Any]) -> dict[str, Any]:
    """`chat` and `score` latency summaries from `recent()["by_kind"]`; without it (a metrics
    source that does not tell kinds apart) everything counts as chat."""
    by_kind = recent.get("by_kind")
    if not isinstance(by_kind, dict):
        by_kind = {"chat": recent, "score": {}}
    chat, score = by_kind.get("chat") or {}, by_kind.get("score") or {}
    return {
        "chat": {k: _summary(chat.get(k) or []) for k in ("ttft_s", "tpot_s", "e2e_s")},
        # A score's latency is its request's end to end (it has one token, no TPOT).
        "score": {k: _summary(score.get(k) or []) for k in ("ttft_s", "e2e_s")},
    }


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float (NaN, +-inf) replaced by None, recursively: strict
    JSON has no NaN, and one NaN statistic (a cost-model error before any measurement, say)
    must not turn the whole state into a 500."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _stream_snapshot(app: Any) -> str:
    """The state as JSON for event streams: built at most once per `_SSE_MIN_INTERVAL_S / 2`
    and shared by every open stream (each used to build its own: 200 streams, 100 % CPU)."""
    now_s = time.monotonic()
    cached = getattr(app.state, "admin_snapshot", None)
    if cached is not None and now_s - cached[0] < _SSE_MIN_INTERVAL_S / 2:
        return cached[1]
    text = json.dumps(build_state(app))
    app.state.admin_snapshot = (now_s, text)
    return text


def build_state(app: Any) -> dict[str, Any]:
    """The snapshot served by /admin/api/state and streamed by /admin/api/events (JSON-safe:
    no NaN or infinity, see `json_safe`)."""
    return json_safe(_build_state(app))


def _build_state(app: Any) -> dict[str, Any]:
    engine = getattr(app.state, "engine", None)  # None while the app is still starting up
    stats: dict[str, Any] = dict(engine.stats()) if engine is not None else {}
    partition = (
        _partition_state(engine, stats)
        if engine is not None
        else _unavailable_partition("the engine is starting")
    )
    recent = _recent_metrics(app.state, stats)

    blocks_used = stats.get("kv_blocks_used")
    blocks_total = stats.get("kv_blocks_total")
    kv_usage = blocks_used / blocks_total if blocks_used is not None and blocks_total else None
    hit = stats.get("prefix_hit_tokens")
    query = stats.get("prefix_query_tokens")

    completed, tokens = recent.get("completed_total"), recent.get("tokens_total")
    if completed is not None and tokens is not None:
        tracker = getattr(app.state, "admin_rates", None)
        if tracker is None:
            tracker = app.state.admin_rates = _RateTracker()
        req_rate, tok_rate = tracker.rates(time.monotonic(), int(completed), int(tokens))
    else:
        req_rate = tok_rate = None

    return {
        "time_s": time.time(),
        "engine": {
            "alive": engine is not None and bool(engine.is_alive()),
            "starting": engine is None,
            # Steps that raised (their requests were re-run one at a time, or failed) and the
            # requests that failed: since start. A benchmark reads them around each run.
            "num_failed_steps": stats.get("num_failed_steps"),
            "num_failed_requests": stats.get("num_failed_requests"),
            # Requests preempted for KV blocks (recomputed later: their work so far is lost)
            # and long scoring prompts chunked next to decodes, since start.
            "num_preemptions": stats.get("num_preemptions"),
            "num_chunked_scoring": stats.get("num_chunked_scoring"),
            # auto's prefills run in layer slices, and of those in row pieces of each layer
            # (sub-layer slices), since start (None: no split executor).
            "num_layer_sliced_prefills": stats.get("pd_layer_sliced_prefills"),
            "num_sub_layer_sliced_prefills": stats.get("pd_sub_layer_sliced_prefills"),
            # Every fallback the engine took since it started, and why
            # (runtime/diagnostics/fallbacks.py): merged steps turned off, prefill graphs not
            # captured, ...
            "fallbacks": stats.get("fallbacks"),
            # Triton kernel variants compiled after start-up, each a first use paid on the
            # engine thread (runtime/diagnostics/compile_watch.py; None: not counted, e.g. on a
            # CPU).
            "kernels_compiled_while_serving": stats.get("kernels_compiled_while_serving"),
            # Overlapped scheduling's exceptions since start: steps in flight answered before
            # a launch gated for aborts (a prefill of >= 16,384 tokens on CUDA, which holds the
            # engine thread).
            "overlap": {
                "num_drains_before_held_launch": stats.get("num_drains_before_held_launch"),
            },
            # The step under way (as of the last heartbeat): seconds since its launch, and for
            # an eager prefill forward the layer it is at, of how many, over how many tokens
            # (a long scoring prompt runs tens of seconds in one step).
            "step": {
                "running_s": stats.get("step_running_s"),
                "layer": stats.get("step_layer"),
                "num_layers": stats.get("step_num_layers"),
                "prefill_tokens": stats.get("step_prefill_tokens"),
            },
        },
        "partition": partition,
        "queues": {"waiting": stats.get("num_waiting"), "running": stats.get("num_running")},
        "kv": {"blocks_used": blocks_used, "blocks_total": blocks_total, "usage": kv_usage},
        "prefix_cache": {
            "hit_tokens": hit,
            "query_tokens": query,
            "hit_rate": hit / query if hit is not None and query else None,
        },
        "policy": {
            "current": stats.get("policy"),
            "available": list(POLICY_NAMES),
            # SRJF's fairness offset now (derived from ttft_slo_ms when that is set).
            "fairness_lambda": stats.get("fairness_lambda"),
            "ttft_slo_ms": stats.get("ttft_slo_ms"),
        },
        "prefill": {
            "token_budget": stats.get("prefill_token_budget"),
            # Tokens a step with decodes may take, decodes included; a TBT target may cut such a
            # step shorter (None: the budget).
            "mixed_step_token_budget": stats.get("mixed_step_token_budget"),
            # auto's chunks beside decodes grow past that cap until the step's fixed part is
            # at most this share of the step (None: the cap alone; `--chunk-fixed-share`).
            "chunk_fixed_share": stats.get("chunk_fixed_share"),
            # Hybrid prefill's chunk (fixed at start-up; on CUDA sized from the memory unless
            # --prefill-chunk-tokens set it).
            "chunk_tokens": stats.get("prefill_chunk_tokens"),
            "tbt_slo_ms": stats.get("tbt_slo_ms"),
            # How the TBT cut sizes chunks (the online correction of the chunk cost) and how
            # steps that mixed prefill with decodes came out against it (counters since start;
            # ratios over the recent ones).
            "tbt_cut": {
                # the JCT model's per-token and per-pair terms, each as mixed steps scale it
                "cost_token_scale": stats.get("tbt_cost_token_scale"),
                "cost_pair_scale": stats.get("tbt_cost_pair_scale"),
                "cost_offset_ms": stats.get("tbt_cost_offset_ms"),
                # per 1,000 cached tokens of a step's prefill parts (0: not told apart yet)
                "cost_context_ms_per_1k": stats.get("tbt_cost_context_ms_per_1k"),
                # The cut aims at the target / this (the tail of waited / predicted steps).
                "tail_factor": stats.get("tbt_tail_factor"),
                # auto's layer slices aim at the target / this (their own tail of waited /
                # promised; null until measured: they take the chunks' aim)
                "slice_tail_factor": stats.get("slice_tail_factor"),
                "num_mixed_steps": stats.get("num_mixed_steps"),
                "num_mixed_steps_over_tbt": stats.get("num_mixed_steps_over_tbt"),
                **{
                    f"mixed_step_ratio_p{q}": stats.get(f"mixed_step_ratio_p{q}")
                    for q in (50, 90, 99)
                },
            },
        },
        # The interpreter's collections stop the step loop: how many full ones, how long in
        # all, the longest pause of any collection since the engine started, of a young one,
        # and the most CPU a collection took of its thread (runtime/diagnostics/gc_watch.py).
        "gc": {
            "full_collections": stats.get("gc_full_collections"),
            "full_ms_total": stats.get("gc_full_ms_total"),
            "pause_ms_max_ever": stats.get("gc_pause_ms_max_ever"),
            "young_pause_ms_max_ever": stats.get("gc_young_pause_ms_max_ever"),
            "pause_cpu_ms_max_ever": stats.get("gc_pause_cpu_ms_max_ever"),
        },
        # Piecewise prefill graphs (None: none captured: CPU, FlashInfer off, or turned off).
        "prefill_graphs": stats.get("prefill_graphs"),
        # Seconds of the start-up prefill warm-up (None: it did not run: CPU, off, or failed).
        "prefill_warm_up_s": stats.get("prefill_warm_up_s"),
        "latency": {
            "source": recent["source"],
            # All traffic together, then chat (chat + completions) and scoring apart: a
            # scoring burst must not hide in (or inflate) the chat percentiles.
            "ttft_s": _summary(recent.get("ttft_s") or []),
            "tpot_s": _summary(recent.get("tpot_s") or []),
            "e2e_s": _summary(recent.get("e2e_s") or []),
            **_latency_by_kind(recent),
        },
        "throughput": {
            "completed_total": completed,
            "tokens_total": tokens,
            "requests_per_s": req_rate,
            "tokens_per_s": tok_rate,
            "window_s": _THROUGHPUT_WINDOW_S,
        },
        "cost_model": {
            "predicted_prefill_ms": partition.get("predicted_prefill_ms"),
            "measured_prefill_ms": partition.get("measured_prefill_ms"),
            "predicted_decode_ms": partition.get("predicted_decode_ms"),
            "measured_decode_ms": partition.get("measured_decode_ms"),
            "mape": stats.get("cost_model_mape"),
            # per kind (splits' prefill/decode, chunked steps), with counts
            "errors": stats.get("cost_model_errors"),
        },
    }


# ---------------------------------------------------------------------------------------------
# Routes
# ---------------------------------------------------------------------------------------------


@router.get("/admin", include_in_schema=False)
async def admin_page() -> Response:
    return FileResponse(STATIC_DIR / "admin.html", media_type="text/html; charset=utf-8")


@router.get("/admin/static/{name}", include_in_schema=False)
async def admin_static(name: str) -> Response:
    media_type = _STATIC_FILES.get(name)
    if media_type is None:
        return _error(404, f"no admin asset {name!r}", "not_found_error")
    return FileResponse(STATIC_DIR / name, media_type=media_type)


@router.get("/admin/api/state", responses=_READ_RESPONSES)
async def admin_state(request: Request) -> JSONResponse:
    denied = check_admin_read(request)
    if denied is not None:
        return denied
    return JSONResponse(build_state(request.app))


@router.get("/admin/api/steps", responses=_STEPS_RESPONSES)
async def admin_steps(request: Request, limit: str = "512") -> JSONResponse:
    """The engine's most recent steps, one object each: how many decodes and prefill tokens
    it ran, its device time, the device idle before it (the host's gap) and, for a step that
    mixed prefill with decodes on the whole GPU, what the TBT cut predicted for it. What a
    long gap between tokens was made of is read here (bench.gpu_serving summarises it per run)."""
    denied = check_admin_read(request)
    if denied is not None:
        return denied
    try:
        num = int(limit)
    except ValueError:
        num = 0
    if not 1 <= num <= STEP_TRACE_MAX:
        msg = f"limit must be an integer from 1 to {STEP_TRACE_MAX}, got {limit!r}"
        return _error(400, msg, "invalid_request_error", "limit")
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        return _error(503, "the engine is starting; try again shortly", "service_unavailable")
    trace = getattr(engine, "step_trace", None)
    if trace is None:
        return _error(404, "this engine keeps no step trace", "not_found_error")
    try:
        steps = await trace(num)
    except ValueError as exc:
        return _error(404, str(exc), "not_found_error")
    return JSONResponse({"steps": steps})


@router.post(
    "/admin/api/profile",
    responses=_PROFILE_RESPONSES,
    openapi_extra=_json_body(ProfileRequest, "How many steps; the timeout; keep the trace"),
)
async def admin_profile(request: Request) -> JSONResponse:
    """Run the torch profiler over the engine's next `num_steps` steps, under whatever load the
    server has, and answer with the kernels (CUDA; CPU ops without a GPU) by device time, per
    step and by category, the device-busy share of the window and the steps by kind (decode-only,
    mixed, prefill). Answers when the steps are done, or after `timeout_s` with what came
    (`timed_out`). One at a time; the engine keeps serving throughout (slower: profiling)."""
    denied = check_admin(request)
    if denied is not None:
        return denied
    body = await _parse_body(request, ProfileRequest) if await request.body() else ProfileRequest()
    if isinstance(body, JSONResponse):
        return body
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        return _error(503, "the engine is starting; try again shortly", "service_unavailable")
    profile = getattr(engine, "profile_steps", None)
    if profile is None:  # as /admin/api/steps without a trace: a test engine, not the server's
        return _error(404, "this engine cannot profile its steps", "not_found_error")
    try:
        summary = await profile(body.num_steps, body.timeout_s, body.trace)
    except ValueError as exc:  # the engine's refusals, by what they say
        text = str(exc)
        if "already running" in text:
            return _error(409, text, "invalid_request_error")
        if "cannot profile" in text:
            return _error(404, text, "not_found_error")
        return _error(503, text, "service_unavailable")
    except Exception as exc:  # noqa: BLE001 - the profiler failed; the engine serves on
        return _error(500, f"profiling failed: {exc}", "server_error")
    return JSONResponse(summary)


class _CountedEventSource(EventSourceResponse):
    """An SSE response that gives its slot back when it ends, however it ends."""

    def __init__(self, *args: Any, app_state: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._app_state = app_state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._app_state.admin_event_streams -= 1


@router.get("/admin/api/events", responses=_EVENTS_RESPONSES)
async def admin_events(request: Request, interval_s: float = _SSE_DEFAULT_INTERVAL_S) -> Response:
    """SSE stream of `state` events. sse-starlette cancels the generator when the client goes
    away or uvicorn shuts down; the disconnect check below also ends it between snapshots."""
    denied = check_admin_read(request)
    if denied is not None:
        return denied
    if not math.isfinite(interval_s):
        return _error(
            400, "interval_s must be a finite number", "invalid_request_error", "interval_s"
        )
    interval_s = min(max(interval_s, _SSE_MIN_INTERVAL_S), _SSE_MAX_INTERVAL_S)
    state = request.app.state
    limit = getattr(_settings(request), "admin_max_event_streams", _DEFAULT_MAX_EVENT_STREAMS)
    open_now = getattr(state, "admin_event_streams", 0)
    if open_now >= limit:
        return _error(
            429,
            f"{open_now} admin event streams are open, the limit (--admin-max-event-streams); "
            "close one or poll /admin/api/state",
            "rate_limit_error",
            headers={"Retry-After": "5"},
        )
    state.admin_event_streams = open_now + 1

    async def stream() -> AsyncIterator[dict[str, str]]:
        while not await request.is_disconnected():
            yield {"event": "state", "data": _stream_snapshot(request.app)}
            await asyncio.sleep(interval_s)

    return _CountedEventSource(stream(), ping=15, app_state=state)


@router.put(
    "/admin/api/partition",
    responses=_CHANGE_RESPONSES,
    openapi_extra=_json_body(PartitionChange, "The SM split mode (prefill_sms with static)"),
)
async def admin_set_partition(request: Request) -> JSONResponse:
    denied = check_admin(request)
    if denied is not None:
        return denied
    body = await _parse_body(request, PartitionChange)
    if isinstance(body, JSONResponse):
        return body
    assert isinstance(body, PartitionChange)
    if body.mode == "static":
        if body.prefill_sms is None:
            return _error(
                400,
                "prefill_sms is required when mode is static",
                "invalid_request_error",
                "prefill_sms",
            )
        spec = f"static:{body.prefill_sms}"
    elif body.prefill_sms is not None:
        return _error(
            400,
            f"prefill_sms applies only to mode static (mode {body.mode} chooses no fixed split)",
            "invalid_request_error",
            "prefill_sms",
        )
    else:
        spec = body.mode
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        return _error(503, "the engine is starting; try again shortly", "service_unavailable")
    manager = getattr(engine, "partition", None)
    if manager is None:
        return _error(
            400, "the engine exposes no partition manager", "invalid_request_error", "mode"
        )
    try:
        await manager.set_mode(spec)
    except ValueError as exc:
        return _error(
            400,
            str(exc),
            "invalid_request_error",
            "prefill_sms" if body.mode == "static" else "mode",
        )
    return JSONResponse(build_state(request.app))


@router.put(
    "/admin/api/policy",
    responses=_CHANGE_RESPONSES,
    openapi_extra=_json_body(PolicyChange, "The prefill policy to switch to"),
)
async def admin_set_policy(request: Request) -> JSONResponse:
    denied = check_admin(request)
    if denied is not None:
        return denied
    body = await _parse_body(request, PolicyChange)
    if isinstance(body, JSONResponse):
        return body
    assert isinstance(body, PolicyChange)
    if body.policy not in POLICY_NAMES:
        return _error(
            400,
            f"unknown prefill policy {body.policy!r}; choose one of {', '.join(POLICY_NAMES)}",
            "invalid_request_error",
            "policy",
        )
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        return _error(503, "the engine is starting; try again shortly", "service_unavailable")
    try:
        await engine.set_policy(body.policy)
    except ValueError as exc:  # e.g. a policy the engine cannot build
        return _error(400, str(exc), "invalid_request_error", "policy")
    return JSONResponse(build_state(request.app))


@router.put(
    "/admin/api/prefill",
    responses=_CHANGE_RESPONSES,
    openapi_extra=_json_body(PrefillChange, "The per-step prefill limits"),
)
async def admin_set_prefill(request: Request) -> JSONResponse:
    """The prefill token budget per step (at most the one the server started with: activation
    memory was reserved for it), the time-between-tokens target (`--tbt-slo-ms`), the cap on
    a step that carries decodes (`--mixed-step-token-budget`) and the share of such a step
    past which auto's chunks stop growing beyond the cap (`--chunk-fixed-share`)."""
    denied = check_admin(request)
    if denied is not None:
        return denied
    body = await _parse_body(request, PrefillChange)
    if isinstance(body, JSONResponse):
        return body
    assert isinstance(body, PrefillChange)
    given = body.model_fields_set
    if not given:
        return _error(
            400,
            "give prefill_token_budget, tbt_slo_ms, mixed_step_token_budget, "
            "chunk_fixed_share or several",
            "invalid_request_error",
            "prefill_token_budget",
        )
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        return _error(503, "the engine is starting; try again shortly", "service_unavailable")
    # A field left out keeps the engine's value (its stats name each limit as the body does);
    # the model's fields are in `set_prefill_limits`' argument order.
    stats = engine.stats()
    budget, tbt, mixed, share = (
        getattr(body, name) if name in given else stats.get(name)
        for name in PrefillChange.model_fields
    )
    if budget is None:
        return _error(
            400,
            "prefill_token_budget may not be null",
            "invalid_request_error",
            "prefill_token_budget",
        )
    try:
        await engine.set_prefill_limits(budget, tbt, mixed, share)
    except ValueError as exc:
        param = next(
            (
                p
                for p in ("tbt_slo_ms", "mixed_step_token_budget", "chunk_fixed_share")
                if p in str(exc)
            ),
            "prefill_token_budget",
        )
        return _error(400, str(exc), "invalid_request_error", param)
    return JSONResponse(build_state(request.app))


async def _reset_engine(request: Request) -> Any:
    """What the reset routes check first: admin rights, an empty JSON object if a body is
    sent, a running engine. Returns the engine, or the error response to send."""
    denied = check_admin(request)
    if denied is not None:
        return denied
    if await request.body():  # optional; when sent, it must be the empty object
        body = await _parse_body(request, ResetRequest)
        if isinstance(body, JSONResponse):
            return body
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        return _error(503, "the engine is starting; try again shortly", "service_unavailable")
    return engine


@router.post(
    "/admin/api/prefix-cache/reset",
    responses=_CHANGE_RESPONSES,
    openapi_extra=_json_body(ResetRequest, "An empty JSON object", required=False),
)
async def admin_reset_prefix_cache(request: Request) -> JSONResponse:
    """Ask the engine to drop its idle prefix-cache blocks. The engine applies it on its own
    thread before its next step, so the reply means "queued", not "done": a request sent after
    this reply is scheduled after the reset (the engine's inbox is ordered). Blocks that running
    requests hold stay until those finish."""
    engine = await _reset_engine(request)
    if isinstance(engine, JSONResponse):
        return engine
    # The count last published by the engine (before the reset takes effect); informative only.
    cached_before = engine.stats().get("prefix_cached_blocks")
    await engine.reset_prefix_cache()
    return JSONResponse({"reset": "queued", "prefix_cached_blocks_before": cached_before})


@router.post(
    "/admin/api/cost-model/errors/reset",
    responses=_ERRORS_RESET_RESPONSES,
    openapi_extra=_json_body(ResetRequest, "An empty JSON object", required=False),
)
async def admin_reset_cost_model_errors(request: Request) -> JSONResponse:
    """Forget the partition cost model's logged prediction errors (the MAPE per kind on this
    page and in `/metrics`, and the evidence the split margin reads): what is logged next
    belongs to what runs next. Done when the reply comes. 409 when the server has no cost
    model (SM partitioning unavailable)."""
    engine = await _reset_engine(request)
    if isinstance(engine, JSONResponse):
        return engine
    if not await engine.partition.reset_cost_model_errors():
        reason = engine.partition.state().reason or "no cost model"
        return _error(
            409,
            f"this server has no partition cost model (SM partitioning unavailable: {reason})",
            "invalid_request_error",
        )
    return JSONResponse({"reset": True})
