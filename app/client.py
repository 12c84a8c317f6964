"""The asyncio side of the engine: admission, per-request output queues, abort on disconnect.

The engine calls `EngineClient.sink` on its own thread; the sink hops onto the event loop with
`loop.call_soon_threadsafe` and feeds the request's `asyncio.Queue`. Nothing here blocks the loop.

Admission is bounded: at most `max_in_flight` engine requests (the engine's running cap plus
`max_queue` waiting ones) may be admitted and unfinished at once; beyond that `Overloaded`
(-> 429 with Retry-After). While draining for shutdown, `Draining` (-> 503).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from runtime.request import Request, RequestOutput

log = logging.getLogger("greenlane.app")


class EngineLike(Protocol):
    """The part of `runtime.engine.Engine` the client uses."""

    def add(self, req: Request) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def is_alive(self) -> bool: ...
    def stats(self) -> dict[str, Any]: ...


class Overloaded(Exception):
    """The bounded queue is full."""


class Draining(Exception):
    """The server is shutting down and admits nothing new."""


class EngineDead(Exception):
    """The engine loop is not running."""


class EngineClient:
    """Bridges HTTP handlers (event loop) and the engine (its own thread)."""

    def __init__(self, max_in_flight: int) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.max_in_flight = max_in_flight
        self.engine: EngineLike | None = None
        self.draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}

    # ------------------------------------------------------------------ wiring

    def attach(self, engine: EngineLike, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self._loop = loop

    def sink(self, out: RequestOutput) -> None:
        """Called on the engine thread for every output."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._deliver, out)
        except RuntimeError:  # loop closed between the check and the call (shutdown)
            pass

    def _deliver(self, out: RequestOutput) -> None:
        queue = self._queues.get(out.request_id)
        if queue is not None:  # None: the request was aborted and forgotten; drop late outputs
            queue.put_nowait(out)

    # ------------------------------------------------------------------ state

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def start_draining(self) -> None:
        self.draining = True

    # ------------------------------------------------------------------ requests

    def _admit(self, reqs: list[Request]) -> list[asyncio.Queue[RequestOutput]]:
        """Register queues for all of `reqs` or none (a score call is admitted whole)."""
        if self.draining:
            raise Draining("server is shutting down")
        if self.engine is None or not self.engine.is_alive():
            raise EngineDead("engine is not running")
        if len(self._queues) + len(reqs) > self.max_in_flight:
            raise Overloaded(
                f"server queue is full ({len(self._queues)} requests in flight, limit {self.max_in_flight})"
            )
        queues = []
        for req in reqs:
            if req.request_id in self._queues:
                raise ValueError(f"duplicate request id {req.request_id}")
            queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
            self._queues[req.request_id] = queue
            queues.append(queue)
        return queues

    def generate(self, req: Request) -> RequestStream:
        """Admit and submit `req` now; iterate the returned stream for its outputs.

        Raises Overloaded / Draining / EngineDead at once (before any output), so a route can
        still answer with a plain HTTP error. Always `aclose()` the stream (or use it as an
        async context manager): closing it before the final output aborts the request in the
        engine, so its KV blocks return to the pool.
        """
        (queue,) = self._admit([req])
        try:
            assert self.engine is not None
            self.engine.add(req)
        except BaseException:
            self._queues.pop(req.request_id, None)
            raise
        return RequestStream(self, req, queue)

    def _release(self, request_id: str, finished: bool) -> None:
        self._queues.pop(request_id, None)
        if not finished and self.engine is not None:
            self.engine.abort(request_id)

    async def run_all(self, reqs: list[Request]) -> list[list[RequestOutput]]:
        """Submit all `reqs` at once (so the engine can batch them) and collect every output.

        Cancellation aborts the unfinished ones.
        """
        queues = self._admit(reqs)
        results: list[list[RequestOutput]] = [[] for _ in reqs]
        done = [False] * len(reqs)
        try:
            assert self.engine is not None
            for req in reqs:
                self.engine.add(req)
            for i, queue in enumerate(queues):
                while not done[i]:
                    out = await queue.get()
                    results[i].append(out)
                    done[i] = out.finished
            return results
        finally:
            for i, req in enumerate(reqs):
                self._release(req.request_id, done[i])


class RequestStream:
    """Async iterator over one request's outputs, ending after the finished one."""

    def __init__(self, client: EngineClient, req: Request, queue: asyncio.Queue[RequestOutput]):
        self._client = client
        self.request = req
        self._queue = queue
        self.finished = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        out = await self._queue.get()
        if out.finished:
            self.finished = True
            self._close()
        return out

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client._release(self.request.request_id, self.finished)

    async def aclose(self) -> None:
        """Stop listening; aborts the request in the engine if it has not finished."""
        self._close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._close()
