"""The cluster's HTTP front: every Greenlane endpoint, forwarded to a replica as raw HTTP.

Per request: read the body, compute the routing key (app/cluster/routing.py), call
`GreenlaneReplica.forward` through a streaming DeploymentHandle (the router picks the
replica), and relay the replica's status, headers and body. SSE bodies are relayed chunk by
chunk as they arrive; other bodies are collected first.

Faults:
* The replica dies before any byte reached the client (for a non-streamed response: before its
  body was complete) -> the request is sent again, once, to whichever replica the router picks
  now; a second failure is a 503 `replica_unavailable`. A replica's own non-streamed 503 (its
  engine died and Ray's health check has not replaced it yet; it is draining) is sent again,
  once, to another replica too.
* The replica dies mid-stream -> the stream ends with an OpenAI-shaped error event
  (`data: {"error": {..., "code": "replica_failed"}}`) and `data: [DONE]`: a clear error, never
  a hang or a silently truncated answer.
* Every replica is at its limit and `max_queued_requests` are already waiting -> 429 with
  `Retry-After` (Ray's BackPressureError); a replica's own 429 passes through unchanged.

Endpoints: `/v1/*` (score, generative-scores, chat/completions, completions, models and
models/{id}), `/generative_scoring`, `/tokenize`, `/detokenize`, `/tokenizer_info`, `/version`
and `/health` are forwarded
(`/health` reaches one replica through the router: it checks the whole data path).
`/metrics` is the cluster's, built here: the ingress's own counters plus one gauge set per
replica (label `replica`) from the replicas' reports; each replica's full metrics (latency
histograms) stay on its own server. `/cluster/replicas` is the same state as JSON;
`POST /admin/api/prefix-cache/reset` empties every replica's prefix cache (benchmarks call it
between runs); `GET /admin/api/state` answers the cluster state. With an admin token in the
replicas' settings, these four need it (`Authorization: Bearer <token>`), as on a replica. A body
over the replicas' cap (`max_body_bytes`, which they report) is their 413, answered here.
"""

# No `from __future__ import annotations` here: Serve rebuilds the ingress methods for FastAPI,
# which then cannot resolve string annotations (a `request: Request` became a query field).
import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from app.cluster.config import ClusterConfig
from app.cluster.deployment import REPORT_STALE_AFTER_PERIODS
from app.cluster.routing import route_key
from app.errors import error_body, install_error_handlers
from app.gate import too_large_body
from app.security import bearer_token, same_secret, secret_of

log = logging.getLogger("greenlane.cluster")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_REPLICA_FAILURES = (ActorDiedError, ActorUnavailableError, RayActorError)
_RESET_TIMEOUT_S = 30.0
_HEALTH_TIMEOUT_S = 10.0

fastapi_app = FastAPI(title="Greenlane cluster", version="0.1.0")
install_error_handlers(fastapi_app)  # unknown paths and methods: OpenAI-shaped 404/405


def _error(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> Any:
    err_type = {429: "rate_limit_error", 404: "not_found_error"}.get(status, "service_unavailable")
    return JSONResponse(error_body(message, err_type, None, code), status, headers=headers)


def _sse_error(message: str, code: str) -> bytes:
    payload = json.dumps(error_body(message, "service_unavailable", None, code))
    return f"data: {payload}\n\ndata: [DONE]\n\n".encode()


def _is_sse(head: dict[str, Any]) -> bool:
    for k, v in head["headers"]:
        if k.lower() == "content-type":
            return v.lower().startswith("text/event-stream")
    return False


# Serve's proxy adds X-Request-Id to every answer itself (the id the replica was sent, so the
# same value): relayed too, a client would read both at once ("id, id").
_NOT_RELAYED = frozenset({"content-type", "x-request-id"})


def _header_dict(head: dict[str, Any]) -> dict[str, str]:
    headers = {k: v for k, v in head["headers"] if k.lower() not in _NOT_RELAYED}
    for k, v in head["headers"]:
        if k.lower() == "content-type":
            headers["content-type"] = v
    headers["x-greenlane-replica"] = head.get("replica_id", "")
    return headers


class _ReplicaGauges(Collector):
    """Per-replica gauges from the directory's latest reports (set at each scrape)."""

    _NAMES = {
        "num_waiting": ("greenlane_cluster_replica_queue_depth", "requests waiting for prefill"),
        "num_running": ("greenlane_cluster_replica_running_requests", "requests holding KV"),
        "kv_usage": ("greenlane_cluster_replica_kv_usage", "KV blocks used / total"),
        "prefix_hit_tokens": (
            "greenlane_cluster_replica_prefix_hit_tokens",
            "prompt tokens served from the replica's prefix cache",
        ),
        "prefix_query_tokens": (
            "greenlane_cluster_replica_prefix_query_tokens",
            "prompt tokens looked up in the replica's prefix cache",
        ),
        "prefill_backlog_s": (
            "greenlane_cluster_replica_prefill_backlog_seconds",
            "predicted prefill time of the replica's queue (absent: the engine reports none)",
        ),
    }

    def __init__(self) -> None:
        self.reports: dict[str, dict[str, Any]] = {}

    def collect(self) -> Any:
        yield GaugeMetricFamily(
            "greenlane_cluster_replicas", "replicas reporting", value=len(self.reports)
        )
        for key, (name, doc) in self._NAMES.items():
            fam = GaugeMetricFamily(name, doc, labels=["replica"])
            for rid, stats in sorted(self.reports.items()):
                value = stats.get(key)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    fam.add_metric([rid], float(value))
            yield fam


@serve.deployment(max_ongoing_requests=10_000)
@serve.ingress(fastapi_app)
class GreenlaneIngress:
    def __init__(
        self, replicas: DeploymentHandle, directory: DeploymentHandle, config: ClusterConfig
    ) -> None:
        self._replicas = replicas.options(stream=True)
        self._directory = directory
        self._config = config
        self._affinity = config.affinity()
        self._max_report_age_s = REPORT_STALE_AFTER_PERIODS * config.routing_stats_period_s + 5
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests = Counter(
            "greenlane_cluster_requests",
            "requests answered by the ingress, by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self._retries = Counter(
            "greenlane_cluster_retries",
            "requests sent again after their replica failed before answering",
            registry=self.registry,
        )
        self._stream_failures = Counter(
            "greenlane_cluster_stream_failures",
            "streams ended with an error event because their replica failed mid-stream",
            registry=self.registry,
        )
        self._gauges = _ReplicaGauges()
        self.registry.register(self._gauges)
        from app.settings import Settings

        # The replicas' settings, for what the ingress answers itself: the admin token its
        # admin and read endpoints need, like a replica's; the body cap (else learned from
        # the replicas' reports, which know their engine's max_model_len).
        settings = Settings(**config.replica_settings)
        self._admin_token = secret_of(settings, "admin_token")
        self._max_body_bytes: int | None = settings.max_body_bytes

    # ---- admission ---------------------------------------------------------------------------
    def _admin_denied(self, request: Request) -> Response | None:
        """401 unless the caller holds the admin token (when one is set), as on a replica."""
        if self._admin_token is None:
            return None
        given = bearer_token({k.lower(): v for k, v in request.headers.items()})
        if given is not None and same_secret(given, self._admin_token):
            return None
        return JSONResponse(
            error_body(
                "admin token required: Authorization: Bearer <token>",
                "authentication_error",
                None,
                "invalid_admin_token",
            ),
            401,
            headers={"WWW-Authenticate": "Bearer"},
        )

    async def _body_cap(self) -> int | None:
        if self._max_body_bytes is None:
            try:
                reports = await self._reports()
            except Exception:  # the directory is being replaced: the replica checks it too
                return None
            caps = [s.get("max_body_bytes") for s in reports.values()]
            caps = [c for c in caps if isinstance(c, int) and not isinstance(c, bool)]
            if caps:
                self._max_body_bytes = min(caps)
        return self._max_body_bytes

    async def _read_body(self, request: Request) -> bytes | Response:
        """The body, or 413 as soon as it is known to pass the replicas' cap (not read whole
        into this process first, nor sent on to a replica)."""
        cap = await self._body_cap()
        if cap is None:
            return await request.body()
        declared = request.headers.get("content-length", "").strip()
        if declared.isdigit() and int(declared) > cap:
            return self._too_large(int(declared), cap)
        chunks: list[bytes] = []
        num_bytes = 0
        async for chunk in request.stream():
            num_bytes += len(chunk)
            if num_bytes > cap:
                return self._too_large(None, cap)
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self, num_bytes: int | None, cap: int) -> Response:
        return JSONResponse(too_large_body(num_bytes, cap), 413)

    # ---- forwarding --------------------------------------------------------------------------
    async def _open(
        self, key: str | None, request: Request, body: bytes, avoid: str | None = None
    ) -> tuple[Any, dict[str, Any], bytes | None]:
        """Start the exchange on a replica (not `avoid`, when another is there): (generator,
        head, first body chunk or None)."""
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.scope["headers"]]
        gen = self._replicas.forward.remote(
            key,
            request.method,
            request.url.path,
            request.url.query,
            headers,
            body,
            avoid=avoid,
        )
        try:
            head = await gen.__anext__()
            first = await gen.__anext__() if _is_sse(head) else None
        except StopAsyncIteration:
            return gen, head, None
        except BaseException:
            gen.cancel()
            raise
        return gen, head, first

    async def _collect(self, gen: Any) -> bytes:
        try:
            parts = [chunk async for chunk in gen]
        except BaseException:
            gen.cancel()  # the client went away (Serve cancels us): stop the replica's side
            raise
        return b"".join(parts)

    async def _relay(self, request: Request, endpoint: str) -> Response:
        body = await self._read_body(request)
        if isinstance(body, Response):
            self._requests.labels(endpoint, str(body.status_code)).inc()
            return body
        headers = {
            k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.scope["headers"]
        }
        key = route_key(request.url.path, headers, body, self._affinity)
        avoid: str | None = None
        for attempt in (1, 2):
            try:
                gen, head, first = await self._open(key, request, body, avoid)
                if not _is_sse(head):
                    content = await self._collect(gen)
                    if head["status"] == 503 and attempt == 1:
                        # That replica cannot serve now (its engine died and Ray has not yet
                        # replaced it; it is draining) and did no work: try another once.
                        avoid = head.get("replica_id")
                        self._retries.inc()
                        log.warning("replica %s answered 503; retrying once elsewhere", avoid)
                        continue
                    self._requests.labels(endpoint, str(head["status"])).inc()
                    return Response(content, head["status"], headers=_header_dict(head))
            except BackPressureError as exc:
                self._requests.labels(endpoint, "429").inc()
                return _error(
                    429,
                    f"Cluster is overloaded: {exc}. Retry later.",
                    "queue_full",
                    {"Retry-After": str(self._config.retry_after_s)},
                )
            except _REPLICA_FAILURES as exc:
                if attempt == 1:
                    self._retries.inc()
                    log.warning("replica failed before answering (%s); retrying once", exc)
                    continue
                self._requests.labels(endpoint, "503").inc()
                return _error(
                    503,
                    f"The replica serving this request failed twice: {type(exc).__name__}",
                    "replica_unavailable",
                )
            self._requests.labels(endpoint, str(head["status"])).inc()
            return StreamingResponse(
                self._stream(gen, first),
                status_code=head["status"],
                headers=_header_dict(head),
            )
        raise AssertionError("unreachable")

    async def _stream(self, gen: Any, first: bytes | None) -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            async for chunk in gen:
                yield chunk
        except _REPLICA_FAILURES as exc:
            self._stream_failures.inc()
            log.warning("replica failed mid-stream: %s", exc)
            yield _sse_error(
                f"The replica serving this stream failed ({type(exc).__name__}); the answer is "
                "incomplete. Retry the request.",
                "replica_failed",
            )
        finally:
            # The client went away (or we are done): stop the replica's side too, which
            # aborts the engine request there.
            gen.cancel()

    # ---- endpoints ---------------------------------------------------------------------------
    @fastapi_app.post("/v1/score")
    async def score(self, request: Request) -> Response:
        return await self._relay(request, "/v1/score")

    @fastapi_app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._relay(request, "/v1/chat/completions")

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._relay(request, "/v1/completions")

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        return await self._relay(request, "/v1/models")

    @fastapi_app.get("/v1/models/{model_id:path}")
    async def model(self, request: Request) -> Response:
        return await self._relay(request, "/v1/models/{model_id}")

    @fastapi_app.post("/v1/generative-scores")
    async def generative_scores(self, request: Request) -> Response:
        return await self._relay(request, "/v1/generative-scores")

    @fastapi_app.post("/generative_scoring")
    async def generative_scoring(self, request: Request) -> Response:
        return await self._relay(request, "/generative_scoring")

    @fastapi_app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        return await self._relay(request, "/tokenize")

    @fastapi_app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        return await self._relay(request, "/detokenize")

    @fastapi_app.get("/tokenizer_info")
    async def tokenizer_info(self, request: Request) -> Response:
        return await self._relay(request, "/tokenizer_info")

    @fastapi_app.get("/version")
    async def version(self, request: Request) -> Response:
        return await self._relay(request, "/version")

    @fastapi_app.get("/health")
    async def health(self, request: Request) -> Response:
        """One replica's `/health`, reached through the router (the whole data path); 503 when
        no replica answers within `_HEALTH_TIMEOUT_S` (none running, all being replaced)."""
        try:
            return await asyncio.wait_for(self._relay(request, "/health"), _HEALTH_TIMEOUT_S)
        except TimeoutError:
            return _error(503, f"no replica answered within {_HEALTH_TIMEOUT_S:g} s", "no_replica")

    async def _reports(self) -> dict[str, dict[str, Any]]:
        return await self._directory.snapshot.remote(self._max_report_age_s)

    @fastapi_app.get("/cluster/replicas")
    async def replicas(self, request: Request) -> Response:
        denied = self._admin_denied(request)
        if denied is not None:
            return denied
        reports = await self._reports()
        return JSONResponse(
            {
                "router": self._config.router,
                "affinity": {
                    "max_queue_gap": self._affinity.max_queue_gap,
                    "max_backlog_gap_s": self._affinity.max_backlog_gap_s,
                    "prefix_tokens": self._affinity.prefix_tokens,
                    "prefix_chars": self._affinity.prefix_chars,
                },
                "replicas": reports,
            }
        )

    @fastapi_app.get("/admin/api/state")
    async def state(self, request: Request) -> Response:
        return await self.replicas(request)

    @fastapi_app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        denied = self._admin_denied(request)
        if denied is not None:
            return denied
        try:
            self._gauges.reports = await self._reports()
        except Exception as exc:  # the directory is being replaced: counters still render
            log.warning("cluster directory unavailable for /metrics: %s", exc)
            self._gauges.reports = {}
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE)

    @fastapi_app.post("/admin/api/prefix-cache/reset")
    async def reset_prefix_cache(self, request: Request) -> Response:
        """Every live replica empties its idle prefix-cache blocks; answers once all have."""
        denied = self._admin_denied(request)
        if denied is not None:
            return denied
        epoch = await self._directory.request_reset.remote()
        deadline = time.monotonic() + _RESET_TIMEOUT_S
        while True:
            reports = await self._reports()
            behind = [r for r, s in reports.items() if s.get("reset_epoch_done", 0) < epoch]
            if reports and not behind:
                return JSONResponse({"reset_epoch": epoch, "replicas": sorted(reports)})
            if time.monotonic() > deadline:
                return _error(
                    503,
                    f"prefix-cache reset not acknowledged by {behind or 'any replica'} "
                    f"within {_RESET_TIMEOUT_S:g} s",
                    "reset_timeout",
                )
            await asyncio.sleep(0.05)
