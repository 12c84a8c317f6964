"""The FastAPI app factory and its lifespan (engine core start-up and shutdown).

`create_app(settings)` wires: the engine client (admission + per-request queues), the engine
core (a process of its own, started in the lifespan unless `core` names one already running,
as with `--api-server-count N`), metrics, error handlers, the access-log middleware and the
routers. Handlers find everything on `app.state`: `settings`, `client`, `engine` (an
`app.engine_view.EngineView`), `metrics`.
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
from app.engine_view import EngineView, load_frontend_tokenizer, load_sampling_defaults
from app.errors import install_error_handlers
from app.gate import Gate
from app.load_watch import FrontEndLoad
from app.metrics import Metrics
from app.settings import Settings
from runtime.config import EngineConfig
from runtime.core.client import EngineCoreClient
from runtime.core.process import (
    CoreHandle,
    default_engine_factory,
    remove_ipc_folder,
    start_engine_core,
)
from runtime.diagnostics.gc_watch import freeze_startup_objects
from runtime.request import EngineOutput

log = logging.getLogger("greenlane.app")

# engine_factory(config, sink) builds the engine inside the engine core process: it must be
# picklable (a module-level callable), e.g. runtime.engine.Engine or a test's fake engine.
EngineFactory = Callable[[EngineConfig, Callable[[list[EngineOutput]], None]], Any]


def stop_engine(app: FastAPI, grace_s: float) -> None:
    """Stop admitting, let running requests finish within `grace_s`, abort the rest.

    Idempotent; call it from any thread but the event loop's (the signal handler's drain
    thread, the lifespan's worker thread). An API server that does not own the engine core
    (one of several) only stops admitting: the launcher shuts the core down."""
    state = app.state
    with state.stop_lock:
        if state.engine_stopped:
            return
        state.engine_stopped = True
    state.client.start_draining()
    engine = getattr(state, "engine", None)
    loop = getattr(state, "loop", None)
    if engine is None or loop is None or not state.owns_core:
        return
    log.info("shutting down the engine (grace %.1f s)", grace_s)
    fut = asyncio.run_coroutine_threadsafe(engine.shutdown(grace_s), loop)
    try:
        fut.result(timeout=grace_s + 60.0)
    except Exception as e:  # noqa: BLE001 - a dead core needs no shutdown
        log.warning("engine shutdown: %s", e)


def _join_core(process: Any, timeout_s: float = 30.0) -> None:
    """Wait for the engine core process to exit after its shutdown; kill it if it hangs."""
    process.join(timeout_s)
    if process.is_alive():
        log.warning("the engine core did not exit in %.0f s: killing it", timeout_s)
        process.kill()
        process.join(5)


def _sampling_defaults(settings: Settings, info: dict[str, Any]) -> dict[str, float]:
    """What a request that leaves a sampling parameter out gets (`--generation-config`),
    said once at start-up."""
    found, notes = load_sampling_defaults(info)
    for note in notes:
        log.warning("%s", note)
    if not found:
        return {}
    shown = ", ".join(f"{k}={v:g}" for k, v in found.items())
    if settings.generation_config == "none":
        log.info(
            "the model's generation_config.json has %s: not used (--generation-config none)", shown
        )
        return {}
    log.info(
        "sampling defaults from the model's generation_config.json: %s (for requests that "
        "leave them out; --generation-config none for the server's own)",
        shown,
    )
    return found


def create_app(
    settings: Settings | None = None,
    engine_factory: EngineFactory | None = None,
    core: CoreHandle | None = None,
    freeze_gc_at_start: bool = False,
) -> FastAPI:
    """Build the app. Its lifespan starts an engine core process with `engine_factory(config,
    sink)` (default: the real engine; tests pass a fake), or connects to the running `core`.
    freeze_gc_at_start: once started, move every object alive to the collector's permanent
    generation (the server's own process only: the CLI sets it; an embedding process or a
    test keeps its collector as it is)."""
    settings = settings or Settings()
    factory = engine_factory or default_engine_factory
    metrics = Metrics()
    client = EngineClient(
        max_in_flight=settings.max_num_seqs + settings.max_queue, max_queue=settings.max_queue
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.loop = asyncio.get_running_loop()
        process = None
        handle = core
        if handle is None:
            config = settings.to_engine_config()
            log.info(
                "starting engine core: model=%s served as %r", config.model, settings.model_name
            )
            handle, process = await asyncio.to_thread(
                start_engine_core, config, factory, log_level=settings.log_level
            )
        app.state.owns_core = process is not None
        tokenizer = await asyncio.to_thread(load_frontend_tokenizer, handle.info)
        core_client = EngineCoreClient(handle, tokenizer, process=process)
        try:
            await core_client.start()
        except Exception:
            if process is not None:
                process.kill()
                process.join(5)
                remove_ipc_folder(handle.input_address)
            raise
        client.attach(core_client)
        engine = EngineView(core_client, handle.info, tokenizer)
        app.state.engine = engine
        app.state.sampling_defaults = _sampling_defaults(settings, handle.info)
        metrics.bind_engine(engine.stats, lambda: client.num_in_flight)
        client.on_token_gaps = metrics.observe_token_gaps
        log.info("engine ready: max_model_len=%s", engine.max_model_len)
        if freeze_gc_at_start:
            # A full collection stops the event loop, and with it every stream: over what
            # start-up left (FastAPI, pydantic, the routes; ~72k objects) it took 56 ms on a
            # CPU here, ~0 ms once they are frozen (docs/benchmarks-cpu.md, section 6).
            freeze_startup_objects("API server")
        # Whether this process is what clients wait for (its CPU share; a warning when so).
        load = FrontEndLoad(settings.api_server_count, metrics.api_cpu_share.set)
        load_task = asyncio.create_task(load.run(), name="greenlane-load-watch")
        try:
            yield
        finally:
            load_task.cancel()
            await asyncio.to_thread(stop_engine, app, settings.shutdown_grace_s)
            await core_client.close()
            if process is not None:
                await asyncio.to_thread(_join_core, process)
                remove_ipc_folder(handle.input_address)

    app = FastAPI(title="Greenlane", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.client = client
    app.state.metrics = metrics
    app.state.engine = None
    app.state.sampling_defaults = {}
    app.state.loop = None
    app.state.owns_core = False
    app.state.engine_stopped = False
    app.state.stop_lock = threading.Lock()

    install_error_handlers(app)

    from app import routes_openai, routes_ops, routes_score

    app.include_router(routes_openai.router)
    app.include_router(routes_score.router)
    app.include_router(routes_score.vllm_router)
    app.include_router(routes_ops.router)
    if (Path(__file__).parent / "admin.py").exists():
        from app.admin import router as admin_router

        app.include_router(admin_router)
    else:  # only while app/admin.py is being written
        log.warning("admin API not available: app/admin.py is missing")

    app.add_middleware(Gate, settings=settings)  # inside the access log: 413/403 are logged
    logs.install(app, settings, metrics)  # access-log middleware, log format, engine line
    return app
