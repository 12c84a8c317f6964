"""The API server's side of the engine core.

One per API-server process. It sends requests, aborts and control calls from the event loop
on a send-only socket; a reader thread receives everything the core sends (per-step outputs,
call results, heartbeats with the engine's stats snapshot) on the other socket, blocking in
ZMQ without the GIL, and hands each message to the event loop, where outputs go through the
output processor (text, stop strings) to `on_outputs`. (Why not asyncio ZMQ sockets: one
socket read and written from coroutines at once stalled under uvloop on the H200 - the core's
heartbeats never arrived - and a thread per direction has no such mode.) The core is dead when
its process exits, when its heartbeats stop for `heartbeat_timeout_s`, or when it reports its
engine loop dead: then `on_dead(reason)` is called once, and every later call fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from runtime.core.messages import (
    CORE_DECODER,
    ENCODER,
    AbortRequests,
    AddRequests,
    Call,
    CallResult,
    Heartbeat,
    Hello,
    Outputs,
    WireRequest,
)
from runtime.core.output_processor import OutputProcessor
from runtime.core.process import CoreHandle
from runtime.diagnostics.gc_watch import untrack_int_list
from runtime.kv.prefix_cache import prompts_block_hashes, salt_digest
from runtime.request import Request, RequestOutput

log = logging.getLogger("greenlane.core")


class EngineCoreError(RuntimeError):
    """The engine core is dead or did not answer."""


class EngineCoreClient:
    def __init__(
        self,
        handle: CoreHandle,
        tokenizer: Any,
        *,
        process: Any = None,
        heartbeat_timeout_s: float = 5.0,
        keepalive_s: float = 1.0,
    ) -> None:
        """process: the core's multiprocessing.Process when this API server started it (its
        exit is then noticed at once); else its pid is checked."""
        self.handle = handle
        self.process = process
        # Tokens per prefix-cache block of the core (None: no prefix cache, no digests).
        self._prefix_block_size: int | None = handle.info.get("prefix_block_size")
        self.processor = OutputProcessor(tokenizer)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.keepalive_s = keepalive_s
        self.dead_reason: str | None = None
        self._identity = f"api-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode()
        self._ctx: zmq.Context | None = None
        self._in: Any = None  # send-only, event loop thread
        self._out: Any = None  # receive-only, reader thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._closing = False
        self._tasks: list[asyncio.Task[None]] = []
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._stats: dict[str, Any] = {}
        self._partition: dict[str, Any] = {}
        self._last_heartbeat_s = time.monotonic()
        self._heartbeat = asyncio.Event()
        self._out_ready = asyncio.Event()
        # Requests sent since the last heartbeat that have produced no output yet: with the
        # heartbeat's `num_waiting`, the front end's estimate of the engine's waiting queue.
        self._unseen: set[str] = set()
        # Requests the last heartbeat's snapshot counted (running or waiting) whose final
        # output has come since: admission must not count their places as taken.
        self._num_finished_since_heartbeat = 0
        self.on_outputs: Callable[[list[RequestOutput]], None] = lambda _o: None
        self.on_dead: Callable[[str], None] = lambda _r: None

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self, timeout_s: float = 30.0) -> None:
        """Connect and wait until the core has answered on the output connection and sent
        its first heartbeat."""
        self._loop = loop = asyncio.get_running_loop()
        self._ctx = zmq.Context()
        for name, addr in (
            ("_in", self.handle.input_address),
            ("_out", self.handle.output_address),
        ):
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, self._identity)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr)
            setattr(self, name, sock)
        self._reader = threading.Thread(
            target=self._read_loop, name="greenlane-core-reader", daemon=True
        )
        self._reader.start()
        self._tasks = [loop.create_task(self._keepalive(), name="greenlane-core-keepalive")]
        # Hello until the core has answered on both: it acknowledges on the output socket (an
        # empty Outputs) only once that connection exists, so no output is lost.
        hello = Hello(self._identity.decode())
        deadline = time.monotonic() + timeout_s
        last_log = time.monotonic()
        while not (self._heartbeat.is_set() and self._out_ready.is_set()):
            now = time.monotonic()
            if now > deadline:
                raise EngineCoreError(
                    f"no answer from the engine core in {timeout_s} s (heartbeat: "
                    f"{self._heartbeat.is_set()}, output connection: {self._out_ready.is_set()})"
                )
            if now - last_log > 2.0:
                last_log = now
                log.info(
                    "waiting for the engine core: heartbeat %s, output connection %s",
                    self._heartbeat.is_set(),
                    self._out_ready.is_set(),
                )
            # Wait on the event not set yet. Hazard: awaiting an event that is already set
            # does not yield to the loop (Python 3.12's wait_for awaits it directly), so this
            # loop would spin and the reader thread's callbacks, the heartbeat among them,
            # would never run.
            if not self._out_ready.is_set():
                self._send(hello)
                pending = self._out_ready
            else:
                pending = self._heartbeat
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pending.wait(), 0.1)

    async def close(self) -> None:
        self._closing = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        if self._in is not None:
            self._in.close(linger=0)
        if self._ctx is not None:
            # Terminating the context wakes the reader thread (ETERM), which closes its socket.
            await asyncio.to_thread(self._ctx.term)
            self._ctx = None
        if self._reader is not None:
            self._reader.join(timeout=5)

    # ---- requests -----------------------------------------------------------------------------
    def digest(self, reqs: list[Request]) -> None:
        """Fill each request's prefix-cache block digests (`Request.block_hashes`), here
        rather than on the engine thread: the core has one thread for every step, API servers
        can be many. Touches only `reqs`, so the routes run it on their preparation threads
        before `add` (a score call of 200 items after a 14k-token query takes ~50 ms); `add`
        digests whatever is still missing. A prompt that cannot be digested (a token id past
        int32, which the engine's validation then refuses) is left to the engine."""
        if not self._prefix_block_size:
            return
        todo = [r for r in reqs if not r.block_hashes]
        try:
            digests = prompts_block_hashes(
                [r.prompt_token_ids for r in todo],
                self._prefix_block_size,
                [salt_digest(r.cache_salt) for r in todo],
            )
        except OverflowError:
            return
        for r, hashes in zip(todo, digests, strict=True):
            r.block_hashes = untrack_int_list(hashes)

    def add(self, reqs: list[Request]) -> None:
        """Send requests to the engine (one message); their outputs come to `on_outputs`."""
        if self.dead_reason is not None:
            raise EngineCoreError(self.dead_reason)
        self.digest(reqs)
        # Encoded first: a request that cannot be sent leaves nothing behind here.
        data = ENCODER.encode(AddRequests([WireRequest.of(r) for r in reqs]))
        for r in reqs:
            r.block_hashes = []  # sent: the engine keeps them, not the request's life here
            # The API server holds each prompt until its request ends: ints only, out of the
            # young collections' walk, which stops the event loop and every stream with it
            # (runtime/diagnostics/gc_watch.py; the engine core does the same on its side).
            untrack_int_list(r.prompt_token_ids)
            self.processor.add(r)
        self._unseen.update(r.request_id for r in reqs)
        try:
            self._send_encoded(data, "AddRequests")
        except zmq.ZMQError as exc:  # the socket is gone (shutting down): nothing was sent
            for r in reqs:
                self.processor.drop(r.request_id)
                self._unseen.discard(r.request_id)
            raise EngineCoreError(f"cannot reach the engine core: {exc}") from None

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.processor.drop(rid)
            self._unseen.discard(rid)
        if self.dead_reason is None and request_ids:
            self._send(AbortRequests(list(request_ids)))

    async def call(self, method: str, *args: Any, timeout_s: float = 30.0) -> Any:
        """A control call; re-raises the engine's ValueError as ValueError."""
        if self.dead_reason is not None:
            raise EngineCoreError(self.dead_reason)
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self._send(Call(call_id, method, list(args)))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            raise EngineCoreError(f"the engine core did not answer {method!r}") from None
        finally:
            self._calls.pop(call_id, None)

    @property
    def num_added_since_heartbeat(self) -> int:
        """Requests sent since the last heartbeat that have not produced any output yet."""
        return len(self._unseen)

    @property
    def num_finished_since_heartbeat(self) -> int:
        """Requests the last heartbeat's snapshot counted that have finished since."""
        return self._num_finished_since_heartbeat

    def stats(self) -> dict[str, Any]:
        """The engine's latest stats snapshot (from the last heartbeat)."""
        return dict(self._stats)

    def partition_state(self) -> dict[str, Any]:
        return dict(self._partition)

    def note(
        self,
        *,
        partition: dict[str, Any] | None = None,
        policy: str | None = None,
        stats: dict[str, Any] | None = None,
    ) -> None:
        """Apply the result of a control call to the cached snapshot until the next
        heartbeat brings the engine's own."""
        if partition is not None:
            self._partition = dict(partition)
        if policy is not None:
            self._stats["policy"] = policy
        if stats:
            self._stats.update(stats)

    def is_alive(self) -> bool:
        return self.dead_reason is None

    # ---- internals ----------------------------------------------------------------------------
    def _send(self, msg: Any) -> None:
        """Send on the send-only socket (event loop thread). Unbounded queues: it only waits
        when the core's connection is not up yet, and then the message is retried by its
        sender (hello) or the core is dead (everything else fails with it)."""
        self._send_encoded(
            ENCODER.encode(msg), None if isinstance(msg, Hello) else type(msg).__name__
        )

    def _send_encoded(self, data: bytes, what: str | None) -> None:
        """`_send` of an encoded message; `what` names it in the warning (None: no warning)."""
        try:
            self._in.send(data, zmq.NOBLOCK)
        except zmq.Again:
            if what is not None:
                log.warning("engine core not connected: %s not sent", what)

    def _read_loop(self) -> None:
        """Reader thread: receive everything the core sends, hand it to the event loop."""
        sock, loop = self._out, self._loop
        assert loop is not None
        try:
            while True:
                frame = sock.recv()
                loop.call_soon_threadsafe(self._on_message, CORE_DECODER.decode(frame))
        except zmq.ContextTerminated:
            pass
        except Exception:  # noqa: BLE001 - say why; the keepalive declares the core dead
            if not self._closing:
                log.exception("engine core reader stopped")
        finally:
            sock.close(linger=0)

    def _on_message(self, msg: Any) -> None:
        """One message from the core, on the event loop."""
        if isinstance(msg, Outputs):
            self._on_outputs(msg.outputs)
        elif isinstance(msg, Heartbeat):
            self._stats = msg.stats
            self._partition = msg.partition
            self._last_heartbeat_s = time.monotonic()
            self._unseen.clear()
            self._num_finished_since_heartbeat = 0
            self._heartbeat.set()
            if not msg.stats.get("alive", True):
                self._die("the engine loop died (see the engine core's log)")
        elif isinstance(msg, CallResult):
            fut = self._calls.get(msg.call_id)
            if fut is None or fut.done():
                return
            if msg.ok:
                fut.set_result(msg.value)
            elif msg.error_type == "ValueError":
                fut.set_exception(ValueError(msg.error))
            else:
                fut.set_exception(EngineCoreError(f"{msg.error_type}: {msg.error}"))

    def _on_outputs(self, batch: list[Any]) -> None:
        if not batch:  # the core's acknowledgement of this output connection
            self._out_ready.set()
            return
        processor, unseen = self.processor, self._unseen
        outs: list[RequestOutput] = []
        stopped: list[str] = []
        for o in batch:
            if o.request_id in unseen:
                unseen.discard(o.request_id)  # sent after the snapshot: not counted in it
            elif o.finished:
                self._num_finished_since_heartbeat += 1
            out, by_string = processor.process(o)
            outs.append(out)
            if by_string:
                stopped.append(o.request_id)
        if stopped:  # finished here by a stop string: free the engine's work at once
            self._send(AbortRequests(stopped))
        try:
            self.on_outputs(outs)
        except Exception:  # noqa: BLE001 - one bad consumer must not stop the others
            log.exception("output consumer raised")

    async def _keepalive(self) -> None:
        hello = Hello(self._identity.decode())
        while True:
            await asyncio.sleep(self.keepalive_s / 2)
            reason = self._death_reason()
            if reason is not None:
                self._die(reason)
                return
            self._send(hello)

    def _death_reason(self) -> str | None:
        if self.process is not None and not self.process.is_alive():
            return f"the engine core exited (code {self.process.exitcode})"
        if self.process is None and not _pid_alive(self.handle.pid):
            return f"the engine core (pid {self.handle.pid}) is gone"
        silent_s = time.monotonic() - self._last_heartbeat_s
        if silent_s > self.heartbeat_timeout_s:
            return f"no heartbeat from the engine core for {silent_s:.1f} s"
        return None

    def _die(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        log.error("engine core is dead: %s", reason)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineCoreError(reason))
        try:
            self.on_dead(reason)
        except Exception:  # noqa: BLE001
            log.exception("on_dead raised")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
