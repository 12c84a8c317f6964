"""Run a real uvicorn server for an app on a free loopback port, on a background thread.

Tests start one per module (they are cheap with the fake engine, a few seconds with a model).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import uvicorn
from fastapi import FastAPI

from app.main import create_app
from app.settings import Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    def __init__(self, app: FastAPI):
        self.app = app
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def engine(self) -> Any:
        """The app's view of the engine (runtime limits, tokenizer, stats snapshot)."""
        return self.app.state.engine

    def control(self, name: str, *args: Any, timeout_s: float = 30.0) -> Any:
        """A test control of the engine in the engine core process (see tests/fake_engine.py:
        "pause", "resume", "kill", "added")."""
        core = self.app.state.engine._core
        loop = self.app.state.loop
        fut = asyncio.run_coroutine_threadsafe(core.call("engine_control", name, *args), loop)
        return fut.result(timeout_s)

    def added(self) -> list[Any]:
        """Every request the (fake) engine was given, as attribute records: `request_id`,
        `kind`, `status` (a name such as "FINISHED_ABORTED"), `prompt_token_ids`, token
        counts, `label_token_ids`, `apply_softmax`, `cache_salt`, `sampling` (SamplingParams'
        fields)."""
        out = []
        for r in self.control("added"):
            rec = dict(r)
            rec["sampling"] = SimpleNamespace(**rec.get("sampling", {}))
            out.append(SimpleNamespace(**rec))
        return out

    @property
    def core_pid(self) -> int:
        """The engine core process's pid."""
        return self.app.state.engine._core.handle.pid

    def stats_after(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The engine's stats from a heartbeat sent after this call (fresh, not cached)."""
        core = self.app.state.engine._core
        loop = self.app.state.loop
        fut = asyncio.run_coroutine_threadsafe(core.call("stats"), loop)
        return fut.result(timeout_s)

    def start(self, timeout_s: float = 300.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("test server failed to start (see the log above)")
            if time.monotonic() > deadline:
                raise TimeoutError("test server did not start in time")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@contextlib.contextmanager
def running_server(
    engine_factory: Callable[..., Any] | None = None,
    *,
    freeze_gc_at_start: bool = False,
    **settings: Any,
) -> Iterator[ServerThread]:
    """A server in a thread of this process. `freeze_gc_at_start`: as the CLI's API server does,
    freeze every object alive once it is up (here the whole test process's heap, so the
    collector is given it back when the server stops)."""
    app = create_app(
        Settings(**settings), engine_factory=engine_factory, freeze_gc_at_start=freeze_gc_at_start
    )
    srv = ServerThread(app).start()
    try:
        yield srv
    finally:
        srv.stop()
        if freeze_gc_at_start:
            gc.unfreeze()


def fake_server(**settings: Any) -> contextlib.AbstractContextManager[ServerThread]:
    from fake_engine import FakeEngine

    return running_server(FakeEngine, **settings)


def parse_sse_strict(raw: bytes) -> list[str]:
    """Split an SSE body into its `data` payloads, failing on anything but `data: <x>\\n\\n`
    events (comment pings `: ...` are allowed: proxies need them, clients ignore them)."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), f"stream does not end with a blank line: {text[-40:]!r}"
    assert "\r" not in text, "events must be separated by \\n only"
    payloads = []
    for event in text[:-2].split("\n\n"):
        lines = event.split("\n")
        if all(line.startswith(":") for line in lines):
            continue
        assert len(lines) == 1, f"multi-line event: {event!r}"
        assert lines[0].startswith("data: "), f"not a data event: {event!r}"
        payloads.append(lines[0][len("data: ") :])
    return payloads
