"""The API routers decode JSON bodies with pydantic's Rust parser (app/json_body.py) and
`/v1/score` checks its item and label counts before validating: same answers as `json.loads`
for every body, valid or not, and a refused count never waits for validation."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import APIRouter, Body, FastAPI
from fastapi.testclient import TestClient
from server_thread import fake_server

from app.json_body import FastJSONRoute

BODIES = [
    b'{"a": 1}',
    b'{"big": 123456789012345678901234567890, "neg": -0.0, "f": 0.30000000000000004}',
    b'{"dup": 1, "dup": 2}',
    b'{"x": NaN, "y": Infinity, "z": -Infinity}',
    b'{"s": "\\ud800 lone surrogate", "e": "\\u00e9\\ud83d\\ude00"}',
    b'{"nested": [[1, 2], {"k": [true, false, null]}]}',
    b"[1, 2, 3]",
    b'{"a": 1,}',  # invalid: trailing comma
    b'{"a": ',  # invalid: truncated
    b"",
    b"\xff\xfe not utf-8",
    b'\xef\xbb\xbf{"bom": 1}',
    b"[" * 300 + b"]" * 300,  # deeper than the Rust parser's limit
    b'{"n": 1e400, "m": 0.1e-400}',
]


def _echo_app(route_class: type | None) -> TestClient:
    router = APIRouter(route_class=route_class) if route_class else APIRouter()

    @router.post("/echo")
    async def echo(body: Any = Body(...)) -> dict[str, Any]:
        return {"repr": repr(body)}

    app = FastAPI()
    app.include_router(router)
    return TestClient(app)


@pytest.mark.parametrize("raw", BODIES)
def test_same_answer_as_json_loads(raw: bytes) -> None:
    fast, plain = _echo_app(FastJSONRoute), _echo_app(None)
    headers = {"content-type": "application/json"}
    a = fast.post("/echo", content=raw, headers=headers)
    b = plain.post("/echo", content=raw, headers=headers)
    assert (a.status_code, a.json()) == (b.status_code, b.json()), raw


def test_counts_are_refused_before_validation() -> None:
    """More items than the server holds, beside a field that would fail validation: the count
    error comes back, so it was checked first; labels likewise. Within the limits the
    validation error is what the caller gets."""
    with fake_server(max_num_seqs=2, max_queue=0) as srv:
        with httpx.Client(base_url=srv.url, timeout=30) as http:

            def score(items: int, labels: int) -> dict[str, Any]:
                body = {
                    "query": "q",
                    "items": ["a"] * items,
                    "label_token_ids": [1] * labels,
                    "apply_softmax": "not a bool",
                }
                r = http.post("/v1/score", json=body)
                assert r.status_code == 400, r.text
                return r.json()["error"]

            assert score(5, 1)["code"] == "too_many_items"
            err = score(1, 100_000)
            assert err["code"] == "too_many_labels" and err["param"] == "label_token_ids", err
            assert score(1, 1)["param"] == "apply_softmax"
