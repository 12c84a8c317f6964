"""The engine core process: an `Engine` behind two ZMQ ROUTER sockets.

    API server(s) --DEALER--> `input` ROUTER  (main thread: requests, aborts, calls)
                  <--DEALER-- `output` ROUTER (the engine thread: one message of outputs per
                              step; the main thread: call results, and heartbeats with the
                              stats snapshot every 0.2 s; sends under one lock)

The engine thread runs the step loop (runtime/engine.py) and sends outputs from its sink; the
process's main thread owns the input socket. Each request remembers which client sent it, so
outputs go back to that API server only. A client silent for `CLIENT_TIMEOUT_S` (its API
server died) has its requests aborted, so their KV returns to the pool.

Start-up: `start_engine_core(...)` spawns the process, which builds the engine (loading the
model, sizing the KV pool, capturing graphs: progress goes to the log) and answers on a pipe
with the engine's `info()` or the error that stopped it. A `CoreHandle` is what API servers
need to connect: the socket addresses and that info.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from runtime.core.messages import (
    CLIENT_DECODER,
    ENCODER,
    AbortRequests,
    AddRequests,
    Call,
    CallResult,
    Heartbeat,
    Hello,
    Outputs,
)
from runtime.diagnostics.gc_watch import freeze_startup_objects
from runtime.request import EngineOutput

log = logging.getLogger("greenlane.core")

HEARTBEAT_S = 0.2
CLIENT_TIMEOUT_S = 10.0

EngineFactory = Callable[[Any, Callable[[list[EngineOutput]], None]], Any]


@dataclass(slots=True)
class CoreHandle:
    """How to reach a running engine core (picklable: passed to API-server processes)."""

    input_address: str
    output_address: str
    info: dict[str, Any]
    pid: int


IPC_PREFIX = "greenlane-core-"


def remove_ipc_folder(address: str) -> None:
    """Remove the private folder of an `ipc_addresses` address (nothing for others)."""
    folder = os.path.dirname(address.removeprefix("ipc://"))
    if address.startswith("ipc://") and os.path.basename(folder).startswith(IPC_PREFIX):
        shutil.rmtree(folder, ignore_errors=True)


def ipc_addresses() -> tuple[str, str, str]:
    """(input, output) ipc:// addresses in a fresh private folder, and the folder."""
    folder = tempfile.mkdtemp(prefix=IPC_PREFIX)
    return f"ipc://{folder}/input", f"ipc://{folder}/output", folder


def default_engine_factory(config: Any, sink: Callable[[list[EngineOutput]], None]) -> Any:
    from runtime.engine import Engine  # imported in the core process: loads torch

    return Engine(config, sink)


class EngineCore:
    """Runs in the engine core process: the engine plus its two sockets."""

    def __init__(
        self, factory: EngineFactory, config: Any, input_address: str, output_address: str
    ) -> None:
        self._input_address = input_address
        self._ctx = zmq.Context()
        # Everything to the clients: outputs from the engine thread (and, rarely, from a caller
        # of engine.add refused at once), heartbeats and call results from the main thread:
        # hence the lock. Unbounded queues: an output is never dropped.
        self._out = self._ctx.socket(zmq.ROUTER)
        self._out.setsockopt(zmq.SNDHWM, 0)
        # Sending to a client whose output connection is not up raises instead of dropping
        # the message silently (see `_ack_output`; outputs to a client gone are dropped).
        self._out.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._out.setsockopt(zmq.LINGER, 1000)
        self._out.bind(output_address)
        self._out_lock = threading.Lock()
        # Requests and calls in: the main thread alone uses it.
        self._in = self._ctx.socket(zmq.ROUTER)
        self._in.setsockopt(zmq.SNDHWM, 0)
        self._in.setsockopt(zmq.RCVHWM, 0)
        self._in.setsockopt(zmq.LINGER, 1000)
        self._in.bind(input_address)
        self._owner: dict[str, bytes] = {}  # request id -> client identity
        self._clients: dict[bytes, float] = {}  # client identity -> last heard (monotonic)
        self._acked: set[bytes] = set()
        self._replies: queue.SimpleQueue[tuple[bytes, CallResult]] = queue.SimpleQueue()
        self._stopping = False
        self._done = threading.Event()
        # The process that started this one (the API server, or the launcher of several):
        # when it is gone (killed, crashed) nobody can shut this core down, so it exits
        # itself rather than hold the GPU as an orphan.
        self._parent_pid = os.getppid()
        self.engine = factory(config, self._sink)

    # ---- engine thread ------------------------------------------------------------------------
    def _sink(self, outputs: list[EngineOutput]) -> None:
        owner = self._owner
        by_client: dict[bytes, list[EngineOutput]] = {}
        for o in outputs:
            client = owner.pop(o.request_id, None) if o.finished else owner.get(o.request_id)
            if client is not None:
                by_client.setdefault(client, []).append(o)
        with self._out_lock:
            for client, outs in by_client.items():
                try:
                    self._out.send_multipart([client, ENCODER.encode(Outputs(outs))], copy=False)
                except zmq.ZMQError as e:  # the client went away: nobody to tell
                    log.warning("dropping %d outputs for client %r: %s", len(outs), client, e)

    def _ack_output(self, client: bytes) -> bool:
        """An empty Outputs on the output socket tells a new client its connection is up.
        False when it is not up yet (the client says hello again)."""
        with self._out_lock:
            try:
                self._out.send_multipart([client, ENCODER.encode(Outputs([]))])
            except zmq.ZMQError:
                return False
        return True

    # ---- main thread ----------------------------------------------------------------------------
    def serve(self) -> None:
        """Start the engine and serve the input socket until shut down (or the engine dies).
        The sockets are closed whatever happens, so the process can exit (a ZMQ context with
        open sockets would keep it alive, unresponsive)."""
        try:
            self._serve()
        finally:
            self._close()

    def _serve(self) -> None:
        # This process exists to run the step loop: what start-up built (torch, Triton,
        # FlashInfer, the model, the pool's bookkeeping) never needs collecting again.
        freeze_startup_objects()
        self.engine.start()
        poller = zmq.Poller()
        poller.register(self._in, zmq.POLLIN)
        next_beat = 0.0
        while not self._done.is_set():
            timeout_ms = max(0.0, next_beat - time.monotonic()) * 1e3
            if poller.poll(min(timeout_ms, 50.0)):
                while True:
                    try:
                        client, frame = self._in.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._clients[client] = time.monotonic()
                    try:
                        self._handle(client, frame)
                    except Exception:  # noqa: BLE001 - one bad message must not stop the core
                        log.exception("handling a message from client %r failed", client)
            while not self._replies.empty():
                client, reply = self._replies.get()
                self._send(client, ENCODER.encode(reply))
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + HEARTBEAT_S
                self._heartbeat(now)
                self._forget_silent_clients(now)
                if not self.engine.is_alive() and not self._stopping:
                    log.error("the engine loop died; the engine core exits")
                    break
                if os.getppid() != self._parent_pid and not self._stopping:
                    log.error(
                        "the process that started the engine core (pid %d) is gone; the "
                        "engine core stops",
                        self._parent_pid,
                    )
                    self._stopping = True
                    self.engine.shutdown(0.0)
                    break

    def _handle(self, client: bytes, frame: bytes) -> None:
        try:
            msg = CLIENT_DECODER.decode(frame)
        except msgspec.DecodeError as e:
            log.error("undecodable message from client %r: %s", client, e)
            return
        if isinstance(msg, AddRequests):
            reqs = [w.to_request() for w in msg.requests]
            for r in reqs:
                self._owner[r.request_id] = client
            self.engine.add_many(reqs)
        elif isinstance(msg, AbortRequests):
            self.engine.abort_many(msg.request_ids)
        elif isinstance(msg, Call):
            self._call(client, msg)
        elif isinstance(msg, Hello):
            if client not in self._acked:
                acked = self._ack_output(client)
                log.debug(
                    "hello from %r: output connection %s", client, "up" if acked else "not up"
                )
                if acked:
                    self._acked.add(client)
                    self._heartbeat(time.monotonic(), [client])

    def _call(self, client: bytes, call: Call) -> None:
        def reply(value: Any = None, error: BaseException | None = None) -> None:
            if error is None:
                res = CallResult(call.call_id, True, value)
            else:
                res = CallResult(call.call_id, False, None, str(error), type(error).__name__)
            self._replies.put((client, res))

        if call.method == "shutdown":
            # Blocks up to the grace period: on a thread of its own; the reply is sent when
            # every request has finished or been aborted (their outputs went out first).
            (grace_s,) = call.args or [0.0]
            self._stopping = True

            def stop() -> None:
                try:
                    self.engine.shutdown(float(grace_s))
                    reply(True)
                except Exception as e:  # noqa: BLE001
                    reply(error=e)
                finally:
                    self._done.set()

            threading.Thread(target=stop, name="greenlane-core-shutdown", daemon=True).start()
            return
        if call.method == "profile_steps":
            # Blocks until the steps are done (or its timeout): on a thread of its own, so the
            # core keeps relaying requests, outputs and heartbeats meanwhile.
            num_steps, timeout_s, keep_trace = call.args

            def profile() -> None:
                try:
                    reply(
                        self.engine.profile_steps(
                            int(num_steps), float(timeout_s), _trace_path() if keep_trace else None
                        )
                    )
                except Exception as e:  # noqa: BLE001
                    reply(error=e)

            if not hasattr(self.engine, "profile_steps"):
                reply(error=ValueError("this engine cannot profile its steps"))
                return
            threading.Thread(target=profile, name="greenlane-core-profile", daemon=True).start()
            return
        try:
            reply(self._dispatch(call.method, call.args))
        except Exception as e:  # noqa: BLE001 - the caller gets the error, the core goes on
            reply(error=e)

    def _dispatch(self, method: str, args: list[Any]) -> Any:
        engine = self.engine
        if method == "set_policy":
            engine.set_policy(args[0])
            return None
        if method == "reset_prefix_cache":
            engine.reset_prefix_cache()
            return None
        if method == "set_prefill_limits":
            budget, tbt, mixed, share = args
            engine.set_prefill_limits(
                int(budget),
                None if tbt is None else float(tbt),
                None if mixed is None else int(mixed),
                None if share is None else float(share),
            )
            return None
        if method == "set_partition":
            return _asdict(engine.partition.set_mode(args[0]))
        if method == "partition_state":
            return _asdict(engine.partition.state())
        if method == "reset_cost_model_errors":
            return engine.partition.reset_cost_model_errors()
        if method == "stats":  # fresh, for tests and benchmarks (heartbeats carry the rest)
            fresh = getattr(engine, "fresh_stats", None)
            return fresh() if fresh is not None else engine.stats()
        if method == "step_trace":
            trace = getattr(engine, "step_trace", None)
            if trace is None:
                raise ValueError("this engine keeps no step trace")
            return trace(int(args[0]))
        if method == "ping":
            return True
        if method == "engine_control":  # test engines' controls (e.g. pause a fake engine)
            control = getattr(engine, "control", None)
            if control is None:
                raise ValueError("this engine has no test controls")
            return control(*args)
        raise ValueError(f"unknown engine core call {method!r}")

    def _heartbeat(self, now: float, clients: list[bytes] | None = None) -> None:
        engine = self.engine
        # While a shutdown call runs, the engine thread ends before the call's reply is sent:
        # a heartbeat in between must not tell the clients the engine died (they would log an
        # error and fail the shutdown call). A crash is still reported (the stats' flag).
        running = bool(engine.is_alive()) or self._stopping
        try:
            stats = dict(engine.stats())
            live = getattr(engine, "live_stats", None)  # (test engines may have none)
            if live is not None:
                stats.update(live())  # a long step's progress, between its snapshots
            stats["alive"] = running and bool(stats.get("alive", True))
            part = _asdict(engine.partition.state())
            frame = ENCODER.encode(Heartbeat(stats, part, now))
        except Exception:  # noqa: BLE001 - a stats bug must not stop the heartbeat
            log.exception("building the heartbeat failed")
            frame = ENCODER.encode(Heartbeat({"alive": running}, {}, now))
        for client in clients or list(self._clients):
            self._send(client, frame)

    def _send(self, client: bytes, frame: bytes) -> None:
        with self._out_lock:
            try:
                self._out.send_multipart([client, frame])
            except zmq.ZMQError:
                pass  # its output connection is not up (yet, or any more)

    def _forget_silent_clients(self, now: float) -> None:
        for client, seen in list(self._clients.items()):
            if now - seen > CLIENT_TIMEOUT_S:
                del self._clients[client]
                self._acked.discard(client)
                orphans = [rid for rid, c in list(self._owner.items()) if c == client]
                if orphans:
                    log.warning(
                        "client %r silent for %.0f s: aborting its %d requests",
                        client,
                        now - seen,
                        len(orphans),
                    )
                    self.engine.abort_many(orphans)

    def _close(self) -> None:
        self._out.close()
        self._in.close()
        self._ctx.term()
        remove_ipc_folder(self._input_address)  # a core killed outright: its starter does


# Where profile traces go when set (`_trace_path`); app/settings.py knows it is no option.
PROFILE_DIR_ENV = "GREENLANE_PROFILE_DIR"


def _trace_path() -> str:
    """Where a profile's chrome trace goes: `$GREENLANE_PROFILE_DIR`, else `<cache>/profiles`,
    as `steps-<UTC stamp>-<pid>.json` (the server picks the file; a caller never names one)."""
    from runtime.model.convert import cache_dir

    folder = os.environ.get(PROFILE_DIR_ENV) or str(cache_dir() / "profiles")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return os.path.join(folder, f"steps-{stamp}-{os.getpid()}.json")


def _asdict(state: Any) -> dict[str, Any]:
    return dataclasses.asdict(state) if dataclasses.is_dataclass(state) else dict(state)


def run_engine_core(
    factory: EngineFactory,
    config: Any,
    input_address: str,
    output_address: str,
    ready: Any,
    log_level: str = "INFO",
) -> None:
    """The engine core process's entry point (multiprocessing spawn target)."""
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Ctrl-C in a terminal reaches the whole process group: the API server decides when the
    # core stops (it sends `shutdown` after draining), so the core ignores SIGINT. SIGTERM
    # sent to the core alone stops it at once.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        core = EngineCore(factory, config, input_address, output_address)
        info = core.engine.info()
    except BaseException as e:  # noqa: BLE001 - report why the engine could not start
        log.exception("the engine could not start")
        ready.send(("error", f"{type(e).__name__}: {e}"))
        ready.close()
        raise SystemExit(1) from None
    ready.send(("ready", info))
    ready.close()
    core.serve()


def start_engine_core(
    config: Any,
    factory: EngineFactory | None = None,
    *,
    log_level: str = "INFO",
    timeout_s: float | None = None,
) -> tuple[CoreHandle, Any]:
    """Spawn the engine core process and wait until its engine is built. Returns the handle
    and the process. Raises RuntimeError with the core's own reason if it cannot start.
    `factory(config, sink)` must be picklable (a module-level callable)."""
    in_addr, out_addr, _ = ipc_addresses()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=run_engine_core,
        args=(factory or default_engine_factory, config, in_addr, out_addr, child, log_level),
        name="greenlane-engine-core",
        daemon=False,
    )
    proc.start()
    child.close()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not parent.poll(0.1):
        if not proc.is_alive():
            raise RuntimeError(f"the engine core exited during start-up (code {proc.exitcode})")
        if deadline is not None and time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the engine core did not start within {timeout_s} s")
    try:
        kind, payload = parent.recv()
    except EOFError:
        proc.join(5)
        raise RuntimeError(
            f"the engine core exited during start-up (code {proc.exitcode})"
        ) from None
    if kind != "ready":
        proc.join(5)
        raise RuntimeError(payload)
    return CoreHandle(in_addr, out_addr, payload, proc.pid or os.getpid()), proc
