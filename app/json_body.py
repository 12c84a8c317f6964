"""Request bodies decoded off the slow path: the API routers' route class.

Why: FastAPI decodes a JSON body with `json.loads` on the event loop, and no other stream is
served while it runs (a C decoder holds the GIL: a worker thread would not help). A body just
under the size cap made of 1.4M token ids took ~165 ms to decode here, 250-900 ms on a loaded
2-core machine: every stream on the server stalled that long (tests/test_stall.py). pydantic's
Rust JSON parser (`pydantic_core.from_json`, already a dependency of pydantic) decodes the same
body in ~70 ms and text-heavy bodies no slower. A body it refuses is decoded again with
`json.loads`, so invalid JSON, lone surrogates and every error FastAPI reports stay exactly as
before.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import pydantic_core
from fastapi import Request, Response
from fastapi.routing import APIRoute


class _FastJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = pydantic_core.from_json(body, allow_inf_nan=True)
            except ValueError:
                # json.loads' verdict and error (FastAPI turns its JSONDecodeError into the
                # 400 the clients know); it also accepts what the Rust parser does not.
                self._json = json.loads(body)
        return self._json


class FastJSONRoute(APIRoute):
    """An APIRoute whose request decodes its JSON body with `pydantic_core.from_json`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route_handler(request: Request) -> Response:
            return await handler(_FastJSONRequest(request.scope, request.receive))

        return route_handler
