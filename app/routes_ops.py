"""Operations endpoints: GET /health (open: probes), GET /metrics (open to scrapers, unless an
admin token is set: then `Authorization: Bearer <token>`, like the admin's other reads) and GET
/version; the tokenizer endpoints (app/routes_tokenize.py, behind the API key) hang off this
router too."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app import __version__, routes_tokenize
from app.admin import check_admin_read
from app.metrics import CONTENT_TYPE

router = APIRouter()
router.include_router(routes_tokenize.router)

_HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The engine loop is alive and the server admits requests"},
    503: {"description": "The engine is not running, or the server is shutting down"},
}
_METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Prometheus text exposition format",
        "content": {CONTENT_TYPE: {"schema": {"type": "string"}}},
    },
    401: {"description": "An admin token is set and was not given"},
}


@router.get("/health", responses=_HEALTH_RESPONSES)
async def health(request: Request) -> JSONResponse:
    """200 while the engine loop is alive and the server admits requests, 503 otherwise."""
    engine = getattr(request.app.state, "engine", None)
    client = request.app.state.client
    if engine is None or not engine.is_alive():
        return JSONResponse({"status": "engine_dead"}, status_code=503)
    if client.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics", response_class=Response, responses=_METRICS_RESPONSES)
async def metrics(request: Request) -> Response:
    denied = check_admin_read(request)
    if denied is not None:
        return denied
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}
