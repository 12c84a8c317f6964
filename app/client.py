"""The asyncio side of the engine: admission, per-request output queues, abort on disconnect.

Outputs arrive on the event loop from the engine core client (runtime/core/client.py: one
message per engine step, already turned into text by the output processor) and are fanned
out to the requests' `asyncio.Queue`s. Nothing here blocks the loop.

Admission is bounded two ways (429 with Retry-After beyond either, 503 while draining):
  - in flight: at most `max_in_flight` requests (`--max-num-seqs` running + `--max-queue`
    waiting) admitted and unfinished at once on this API server;
  - waiting: at most `max_queue` requests waiting in the engine for a place to run, counted
    from the engine's last stats snapshot (`num_waiting`, at most 0.2 s old) plus what this
    server sent since. So `--max-queue N` means what it says: N requests may wait beyond the
    ones the engine is running, whatever `--max-num-seqs` is.
A request that can never be admitted (more items than `max_in_flight`) is the route's 400.
When the engine core dies, every request in flight gets a final error output at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from runtime.core.client import EngineCoreError
from runtime.request import Request, RequestOutput

log = logging.getLogger("greenlane.app")


class CoreLike(Protocol):
    """The part of `runtime.core.client.EngineCoreClient` the client uses."""

    on_outputs: Any
    on_dead: Any
    num_added_since_heartbeat: int
    num_finished_since_heartbeat: int

    def add(self, reqs: list[Request]) -> None: ...
    def abort(self, request_ids: list[str]) -> None: ...
    def is_alive(self) -> bool: ...
    def stats(self) -> dict[str, Any]: ...


class Overloaded(Exception):
    """The bounded queue is full."""


class Draining(Exception):
    """The server is shutting down and admits nothing new."""


class EngineDead(Exception):
    """The engine loop is not running."""


class EngineClient:
    """Bridges HTTP handlers (event loop) and the engine core (its own process)."""

    def __init__(self, max_in_flight: int, max_queue: int | None = None) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.max_in_flight = max_in_flight
        self.max_queue = max_in_flight if max_queue is None else max_queue
        self.max_running = max(1, max_in_flight - self.max_queue)  # --max-num-seqs
        self.core: CoreLike | None = None
        self.draining = False
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        # When each generating request's last tokens arrived (monotonic s), for the gaps
        # between its outputs; `on_token_gaps` (the metrics) gets them once per engine step.
        self._last_token_s: dict[str, float] = {}
        self.on_token_gaps: Callable[[list[float]], None] | None = None

    # ------------------------------------------------------------------ wiring

    def attach(self, core: CoreLike) -> None:
        self.core = core
        core.on_outputs = self.deliver
        core.on_dead = self.fail_all

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Called on the event loop with one engine step's outputs."""
        queues, last = self._queues, self._last_token_s
        now_s = time.monotonic()
        gaps: list[float] = []
        for out in outputs:
            queue = queues.get(out.request_id)
            if queue is None:  # aborted and forgotten; drop late outputs
                continue
            if out.new_token_ids:
                before = last.get(out.request_id)
                if before is not None:
                    gaps.append(now_s - before)
                last[out.request_id] = now_s
            if out.finished:
                last.pop(out.request_id, None)
            queue.put_nowait(out)
        if gaps and self.on_token_gaps is not None:
            self.on_token_gaps(gaps)

    def fail_all(self, reason: str) -> None:
        """The engine core died: finish every request in flight with an error."""
        for rid, queue in list(self._queues.items()):
            queue.put_nowait(
                RequestOutput(
                    request_id=rid,
                    finished=True,
                    finish_reason="error",
                    error=f"the engine stopped: {reason}",
                )
            )

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
        core = self.core
        if core is None or not core.is_alive():
            raise EngineDead("engine is not running")
        if len(self._queues) + len(reqs) > self.max_in_flight:
            raise Overloaded(
                f"server queue is full ({len(self._queues)} requests in flight, limit "
                f"{self.max_in_flight})"
            )
        # Requests not running yet (waiting in the last snapshot, sent since, and these)
        # take the free running places first; the rest wait. The snapshot is up to 0.2 s old:
        # requests it counts that have finished since free their places (else an idle server
        # refused the next 500-item score call for a heartbeat after the last one finished).
        stats = core.stats()
        finished = core.num_finished_since_heartbeat
        running = int(stats.get("num_running") or 0)
        still_running = max(0, running - finished)
        still_waiting = max(0, int(stats.get("num_waiting") or 0) - max(0, finished - running))
        free = max(0, self.max_running - still_running)
        pending = still_waiting + core.num_added_since_heartbeat
        waiting = max(0, pending + len(reqs) - free)
        if waiting > self.max_queue:
            raise Overloaded(
                f"server queue is full ({waiting} requests would wait, --max-queue "
                f"{self.max_queue})"
            )
        queues = []
        for req in reqs:
            if req.request_id in self._queues:
                raise ValueError(f"duplicate request id {req.request_id}")
            queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
            self._queues[req.request_id] = queue
            queues.append(queue)
        return queues

    def _submit(self, reqs: list[Request]) -> None:
        assert self.core is not None
        try:
            self.core.add(reqs)
        except BaseException as exc:
            for r in reqs:
                self._queues.pop(r.request_id, None)
            if isinstance(exc, EngineCoreError):
                raise EngineDead("engine is not running") from None
            raise  # not the engine's state: a request that could not be sent (a bug here)

    def generate(self, req: Request) -> RequestStream:
        """Admit and submit `req` now; iterate the returned stream for its outputs.

        Raises Overloaded / Draining / EngineDead at once (before any output), so a route can
        still answer with a plain HTTP error. Always `aclose()` the stream (or use it as an
        async context manager): closing it before the final output aborts the request in the
        engine, so its KV blocks return to the pool.
        """
        (queue,) = self._admit([req])
        self._submit([req])
        return RequestStream(self, req, queue)

    def _release(self, request_id: str, finished: bool) -> None:
        self._queues.pop(request_id, None)
        self._last_token_s.pop(request_id, None)
        if not finished and self.core is not None:
            self.core.abort([request_id])

    async def run_all(self, reqs: list[Request]) -> list[list[RequestOutput]]:
        """Submit all `reqs` at once (so the engine can batch them) and collect every output.

        Cancellation aborts the unfinished ones.
        """
        queues = self._admit(reqs)
        results: list[list[RequestOutput]] = [[] for _ in reqs]
        done = [False] * len(reqs)
        try:
            self._submit(reqs)
            for i, queue in enumerate(queues):
                while not done[i]:
                    out = await queue.get()
                    results[i].append(out)
                    done[i] = out.finished
            return results
        finally:
            unfinished = [r.request_id for i, r in enumerate(reqs) if not done[i]]
            for r in reqs:
                self._queues.pop(r.request_id, None)
            if unfinished and self.core is not None:
                self.core.abort(unfinished)


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

    def ready(self) -> list[RequestOutput]:
        """The outputs already queued, without waiting (up to and including the finished
        one): a streaming route sends them as one write."""
        outs: list[RequestOutput] = []
        queue = self._queue
        while not (self.finished or self._closed) and not queue.empty():
            out = queue.get_nowait()
            outs.append(out)
            if out.finished:
                self.finished = True
                self._close()
        return outs

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
