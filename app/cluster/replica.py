"""One Greenlane replica: a real Greenlane server on a loopback port, driven over raw HTTP.

`GreenlaneServer` builds the app with the public factory (`app.main.create_app(Settings)`) and
runs it under uvicorn on a background thread, on a socket bound to 127.0.0.1 (never reachable
from outside this process's host). `forward()` sends one HTTP request to it and yields the
response head, then each body chunk as it arrives (httpx reads the socket incrementally, so SSE
events pass through one by one, unbuffered). The Ray Serve deployment (`deployment.py`) wraps
this class; it has no Ray import, so it is tested and benchmarked on its own too.

Routing stats come from the engine in this process (`engine.stats()`): queue depth, KV usage,
prefix-cache counters and, when the engine provides it, `prefill_backlog_s` (predicted prefill
time of the queue, from the JCT model). Without it the stats say `prefill_backlog_source:
"unavailable"` and the router decides on queue depth alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn

log = logging.getLogger("greenlane.cluster")

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones httpx/uvicorn set themselves.
_DROP_REQUEST_HEADERS = frozenset(
    {"host", "connection", "keep-alive", "transfer-encoding", "te", "upgrade", "content-length"}
)
_DROP_RESPONSE_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server"}
)


def response_head(status: int, headers: list[tuple[str, str]]) -> dict[str, Any]:
    """The first item `forward` yields."""
    return {"status": status, "headers": headers}


def error_head_and_body(status: int, message: str, code: str) -> tuple[dict[str, Any], bytes]:
    body = json.dumps(
        {"error": {"message": message, "type": "service_unavailable", "param": None, "code": code}}
    ).encode()
    return response_head(status, [("content-type", "application/json")]), body


class GreenlaneServer:
    """A Greenlane server for this replica (one engine, one GPU) on a free loopback port."""

    def __init__(self, settings: dict[str, Any], start_timeout_s: float = 600.0) -> None:
        from app.main import create_app
        from app.settings import Settings

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self.settings = Settings(**{**settings, "host": "127.0.0.1", "port": self.port})
        self.app = create_app(self.settings)
        config = uvicorn.Config(
            self.app,
            log_level=self.settings.log_level.lower(),
            # The ingress keeps connections open across requests; so do we.
            timeout_keep_alive=60,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._sock]},
            name="greenlane-replica-server",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the Greenlane server failed to start (see its log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Greenlane server did not start in {start_timeout_s} s")
            time.sleep(0.05)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._client: httpx.AsyncClient | None = None
        log.info("replica server up on %s (model %s)", self.base_url, self.settings.model)

    # ---- state -----------------------------------------------------------------------------
    @property
    def engine(self) -> Any:
        return self.app.state.engine

    def is_alive(self) -> bool:
        engine = self.engine
        return self._thread.is_alive() and engine is not None and bool(engine.is_alive())

    def routing_stats(self) -> dict[str, Any]:
        """A plain dict for the router and the cluster state (never raises)."""
        engine = self.engine
        try:
            stats = dict(engine.stats()) if engine is not None else {}
        except Exception:  # the engine is going away: report what is known
            log.exception("engine.stats() failed")
            stats = {}
        used, total = stats.get("kv_blocks_used"), stats.get("kv_blocks_total")
        backlog = stats.get("prefill_backlog_s")
        num_waiting = int(stats.get("num_waiting", 0) or 0)
        num_running = int(stats.get("num_running", 0) or 0)
        return {
            "alive": self.is_alive(),
            "num_waiting": num_waiting,
            "num_running": num_running,
            "queue_depth": num_waiting + num_running,
            "kv_blocks_used": used,
            "kv_blocks_total": total,
            "kv_usage": (used / total) if isinstance(used, int) and total else None,
            "prefill_backlog_s": float(backlog) if isinstance(backlog, int | float) else None,
            "prefill_backlog_source": "engine"
            if isinstance(backlog, int | float)
            else "unavailable",
            "prefix_hit_tokens": stats.get("prefix_hit_tokens"),
            "prefix_query_tokens": stats.get("prefix_query_tokens"),
            "policy": stats.get("policy"),
            "max_body_bytes": self.max_body_bytes(),
            "reported_at_s": time.time(),
        }

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def max_body_bytes(self) -> int:
        """The server's body cap (app/gate.py's rule: `--max-body-bytes`, else sized from the
        engine's max_model_len)."""
        from app.limits import default_max_body_bytes

        if self.settings.max_body_bytes is not None:
            return int(self.settings.max_body_bytes)
        engine = self.engine
        max_model_len = getattr(engine, "max_model_len", None)
        if max_model_len is None:
            max_model_len = getattr(self.settings, "max_model_len", None)
        return default_max_body_bytes(max_model_len)

    # ---- forwarding ------------------------------------------------------------------------
    def _http(self) -> httpx.AsyncClient:
        # One client per event loop that uses it (the replica's user-code loop).
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.base_url,
                timeout=httpx.Timeout(None, connect=10.0),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            )
        return self._client

    async def forward(
        self,
        method: str,
        path: str,
        query: str,
        headers: list[tuple[str, str]],
        body: bytes,
    ) -> AsyncIterator[dict[str, Any] | bytes]:
        """Yield the response head (`{"status", "headers"}`), then body chunks as they come.

        Closing the generator early (the client went away) closes the connection, which the
        Greenlane server sees as a disconnect and aborts the request (freeing its KV)."""
        url = path + (f"?{query}" if query else "")
        cap = self.max_body_bytes()
        if len(body) > cap:
            # The server would answer 413 and close the connection before reading the body,
            # which the upload here meets as a broken connection (a 503): answer its 413 here.
            from app.gate import too_large_body

            yield response_head(413, [("content-type", "application/json")])
            yield json.dumps(too_large_body(len(body), cap)).encode()
            return
        send_headers = [(k, v) for k, v in headers if k.lower() not in _DROP_REQUEST_HEADERS]
        request = self._http().build_request(method, url, headers=send_headers, content=body)
        try:
            response = await self._http().send(request, stream=True)
        except httpx.HTTPError as exc:
            head, err = error_head_and_body(
                503, f"replica server unreachable: {type(exc).__name__}", "replica_unavailable"
            )
            yield head
            yield err
            return
        try:
            yield response_head(
                response.status_code,
                [
                    (k, v)
                    for k, v in response.headers.multi_items()
                    if k.lower() not in _DROP_RESPONSE_HEADERS
                ],
            )
            async for chunk in response.aiter_raw():
                if chunk:
                    yield chunk
        finally:
            await response.aclose()

    async def get_text(self, path: str) -> tuple[int, str]:
        response = await self._http().get(path)
        return response.status_code, response.text

    def shutdown(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=self.settings.shutdown_grace_s + 10)
        if self._client is not None:
            client, self._client = self._client, None
            try:
                asyncio.get_running_loop().create_task(client.aclose())
            except RuntimeError:
                pass
