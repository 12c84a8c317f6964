"""The FastAPI app factory and its lifespan (engine start-up and shutdown).

`create_app(settings)` wires: the engine client (admission + per-request queues), the engine
(built in the lifespan, on a worker thread, because loading a model takes seconds), metrics,
error handlers, the access log (app/logs.py) and the routers. Handlers find everything on
`app.state`: `settings`, `client`, `engine`, `metrics`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from app import logs
from app.client import EngineClient
from app.errors import install_error_handlers
from app.metrics import Metrics
from app.settings import Settings
from runtime.config import EngineConfig
from runtime.request import RequestOutput

log = logging.getLogger("greenlane.app")

EngineFactory = Callable[[EngineConfig, Callable[[RequestOutput], None]], Any]


def _real_engine(config: EngineConfig, sink: Callable[[RequestOutput], None]) -> Any:
    from runtime.engine import Engine  # imported lazily: loads torch

    return Engine(config, sink)


def stop_engine(app: FastAPI, grace_s: float) -> None:
    """Stop admitting, let running requests finish within `grace_s`, abort the rest.

    Idempotent and thread-safe: the signal handler and the lifespan both call it."""
    state = app.state
    with state.stop_lock:
        if state.engine_stopped:
            return
        state.engine_stopped = True
    state.client.start_draining()
    engine = getattr(state, "engine", None)
    if engine is not None:
        log.info("shutting down the engine (grace %.1f s)", grace_s)
        engine.shutdown(grace_s)


def create_app(
    settings: Settings | None = None, engine_factory: EngineFactory | None = None
) -> FastAPI:
    """Build the app. `engine_factory(config, sink)` makes the engine (tests pass a fake)."""
    settings = settings or Settings()
    factory = engine_factory or _real_engine
    metrics = Metrics()
    client = EngineClient(max_in_flight=settings.max_num_seqs + settings.max_queue)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        config = settings.to_engine_config()
        log.info("starting engine: model=%s served as %r", config.model, settings.model_name)
        engine = await asyncio.to_thread(factory, config, client.sink)
        client.attach(engine, loop)
        app.state.engine = engine
        metrics.bind_engine(engine.stats, lambda: client.num_in_flight)
        engine.start()
        log.info("engine ready: max_model_len=%s", getattr(engine, "max_model_len", "?"))
        try:
            yield
        finally:
            await asyncio.to_thread(stop_engine, app, settings.shutdown_grace_s)

    app = FastAPI(title="Greenlane", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.client = client
    app.state.metrics = metrics
    app.state.engine = None
    app.state.engine_stopped = False
    app.state.stop_lock = threading.Lock()

    install_error_handlers(app)

    from app import routes_openai, routes_ops, routes_score

    app.include_router(routes_openai.router)
    app.include_router(routes_score.router)
    app.include_router(routes_ops.router)
    if (Path(__file__).parent / "admin.py").exists():
        from app.admin import router as admin_router

        app.include_router(admin_router)
    else:  # only while app/admin.py is being written
        log.warning("admin API not available: app/admin.py is missing")

    logs.install(app, settings, metrics)  # access-log middleware, log format, engine line
    return app
