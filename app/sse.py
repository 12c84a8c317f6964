"""A lean Server-Sent Events response for the token streams.

Why not sse-starlette's `EventSourceResponse`: at tens of thousands of chunks a second the
API server's one core is the decode bottleneck (docs/benchmarks.md), and that response pays
per event for a dict, a `ServerSentEvent` encode and a cancel scope around every send. Here
the route hands over *batches* of already-serialised JSON payloads (everything one request
has ready at once), and each batch is one ASGI send.

Three tasks per response, none per chunk: the stream (pull a batch, send it), a disconnect
watcher (`http.disconnect` from the server ends the stream at once, so the request's KV is
freed while it waits for its next token) and a pinger (a comment line after `ping_s`
without a send keeps idle proxies from closing a long prefill's stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger("greenlane.app")

_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-store"),
    (b"x-accel-buffering", b"no"),  # nginx: do not buffer the stream
]
_PING = b": ping\n\n"
DONE = "[DONE]"


def encode_events(payloads: list[str]) -> bytes:
    """`data: <payload>\\n\\n` for each payload (a payload never holds a newline: JSON)."""
    return "".join([f"data: {p}\n\n" for p in payloads]).encode()


class SSEResponse(Response):
    """ASGI response streaming `batches` (lists of `data:` payloads) as SSE.

    `on_close` runs once the response has ended, whether the stream finished, the client
    went away or sending failed (it must be safe to call after the generator's own
    cleanup). A `Response` subclass only so that FastAPI passes it through as it is."""

    def __init__(
        self,
        batches: AsyncIterator[list[str]],
        on_close: Callable[[], Awaitable[None]],
        ping_s: float,
    ) -> None:
        self.status_code = 200
        self.background = None  # FastAPI may set its background tasks here: run at the end
        self.batches = batches
        self.on_close = on_close
        self.ping_s = ping_s
        self._last_send_s = 0.0
        self._sending = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        self._last_send_s = loop.time()
        try:
            await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
            tasks = [
                asyncio.ensure_future(self._stream(send)),
                asyncio.ensure_future(self._watch(receive)),
                asyncio.ensure_future(self._ping(send)),
            ]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in tasks:
                    task.cancel()
                results = await asyncio.gather(*tasks, return_exceptions=True)
            error = results[0]
            if isinstance(error, Exception) and not isinstance(error, OSError):
                raise error  # a bug in the route's generator: the access log records it
        finally:
            with contextlib.suppress(Exception):
                await self.batches.aclose()  # type: ignore[attr-defined]
            await self.on_close()
            if self.background is not None:
                await self.background()

    async def _stream(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        async for batch in self.batches:
            if not batch:
                continue
            self._sending = True
            try:
                body = encode_events(batch)
                await send({"type": "http.response.body", "body": body, "more_body": True})
            finally:
                self._sending = False
            self._last_send_s = loop.time()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    async def _ping(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        while True:
            wait_s = self._last_send_s + self.ping_s - loop.time()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
                continue
            if not self._sending:
                await send({"type": "http.response.body", "body": _PING, "more_body": True})
            self._last_send_s = loop.time()
