"""Operations endpoints: GET /health and GET /metrics (no API key: probes and scrapers)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.metrics import CONTENT_TYPE

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while the engine loop is alive and the server admits requests, 503 otherwise."""
    engine = getattr(request.app.state, "engine", None)
    client = request.app.state.client
    if engine is None or not engine.is_alive():
        return JSONResponse({"status": "engine_dead"}, status_code=503)
    if client.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)
