"""Operations endpoints: GET /health, GET /metrics and GET /version (no API key: probes and
scrapers); the tokenizer endpoints (app/routes_tokenize.py, behind the key) hang off this router
too."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app import __version__, routes_tokenize
from app.metrics import CONTENT_TYPE

router = APIRouter()
router.include_router(routes_tokenize.router)


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


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}
