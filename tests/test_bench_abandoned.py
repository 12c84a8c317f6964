"""`bench.abandoned` against a stand-in server whose scoring "step" takes 2 ms a token and stops
when its client leaves (or not, `stops=False`): the record says what the next request waited
against what the abandoned prompt had left, and tells the two servers apart."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from server_thread import ServerThread

from bench import abandoned

MS_PER_TOKEN = 2.0


def stand_in(stops: bool) -> FastAPI:
    app = FastAPI()
    app.state.running = 0
    lock = asyncio.Lock()  # one step at a time, as one engine

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"data": [{"id": "m"}]})

    @app.post("/v1/score")
    async def score(request: Request) -> Response:
        body = await request.json()
        n = len(body["query"]) + len(body["items"][0])
        async with lock:
            app.state.running += 1
            try:
                end = time.monotonic() + n * MS_PER_TOKEN / 1e3
                while time.monotonic() < end:
                    if stops and await request.is_disconnected():
                        return Response(status_code=499)
                    await asyncio.sleep(0.005)
            finally:
                app.state.running -= 1
        return JSONResponse({"scores": [[0.5, 0.3, 0.2]]})

    @app.get("/metrics")
    async def metrics() -> Response:
        r = app.state.running
        return Response(f"greenlane_running_requests {r}.0\ngreenlane_kv_blocks_used {r}.0\n")

    return app


@pytest.mark.parametrize("stops", [True, False])
def test_the_record_tells_a_server_that_stops_from_one_that_does_not(
    tmp_path: Path, stops: bool
) -> None:
    srv = ServerThread(stand_in(stops)).start()
    try:
        _check_record(srv.url, tmp_path, stops)
    finally:
        srv.stop()


def _check_record(url: str, tmp_path: Path, stops: bool) -> None:
    out = tmp_path / "abandoned.json"
    argv = ["--url", url, "--num-tokens", "400", "--repeats", "1", "--json", str(out)]
    assert abandoned.main([*argv, "--server-revision", "abc"]) == 0
    record = json.loads(out.read_text())
    assert record["server_revision"] == "abc" and record["num_tokens"] == 400
    (rep,) = record["repeats"]
    assert 0.8 <= rep["whole_s"] <= 3.0  # 400 tokens at 2 ms, plus HTTP
    assert rep["freed_s"] is not None
    ratio = record["next_over_rest_of_prompt"]["median"]
    if stops:
        assert ratio < 0.5  # the next request did not wait for the abandoned prompt
    else:
        assert ratio > 0.7  # it waited for the rest of it
