"""The front door: what every HTTP request must pass before routing, so nothing parses it
first.

1. Host (DNS rebinding, see app/security.py): on a server that listens on loopback, a request
   whose Host is not local, an IP address, `--host` or one of `--allowed-hosts` gets 403.
2. The API's own description (/docs, /redoc, /openapi.json) needs the admin token when one is
   set, like the other read endpoints (those check it in their routes).
3. Body size: a body over the cap gets 413 — at once when Content-Length says so, else as soon
   as the bytes received pass it (chunked uploads). The body is read here, whole, and handed on
   to the app, which would read all of it anyway; the cap is `--max-body-bytes`, by default
   sized from the engine's `max_model_len` once the engine exists (`app.limits`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import error_body
from app.limits import default_max_body_bytes
from app.security import bearer_token, host_allowed, listens_on_loopback, same_secret, secret_of

log = logging.getLogger("greenlane.app")

DOC_PATHS = ("/docs", "/redoc", "/openapi.json")


async def _send_error(
    send: Send, status: int, message: str, err_type: str, code: str, close: bool = False
) -> None:
    body = json.dumps(error_body(message, err_type, None, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if close:  # the rest of the request body is not read: the connection cannot be reused
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Gate:
    """Pure ASGI middleware (streaming-safe). `settings` is the server's `Settings`."""

    def __init__(self, app: ASGIApp, settings: Any) -> None:
        self.app = app
        self.settings = settings
        self.check_host = listens_on_loopback(getattr(settings, "host", None))
        self._max_body_bytes: int | None = getattr(settings, "max_body_bytes", None)

    def max_body_bytes(self, scope: Scope) -> int:
        """The cap: `--max-body-bytes`, else the default rule once the engine exists (its
        max_model_len), else (still starting) the rule on `--max-model-len` or its floor."""
        if self._max_body_bytes is not None:
            return self._max_body_bytes
        engine = getattr(getattr(scope.get("app"), "state", None), "engine", None)
        max_model_len = getattr(engine, "max_model_len", None)
        if max_model_len is None:
            return default_max_body_bytes(getattr(self.settings, "max_model_len", None))
        self._max_body_bytes = default_max_body_bytes(max_model_len)
        log.info(
            "request bodies capped at %d bytes (64 per token of max_model_len %d, at least "
            "4 MiB; --max-body-bytes sets it)",
            self._max_body_bytes,
            max_model_len,
        )
        return self._max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host = headers.get("host")
        if self.check_host and not host_allowed(host, self.settings):
            await _send_error(
                send,
                403,
                f"Host {host!r} is not allowed: this server listens on loopback and answers "
                "only local names, IP addresses and --allowed-hosts (DNS-rebinding guard)",
                "permission_error",
                "host_not_allowed",
            )
            return
        token = secret_of(self.settings, "admin_token")
        if token is not None and scope["path"].startswith(DOC_PATHS):
            given = bearer_token(headers)
            if given is None or not same_secret(given, token):
                await _send_error(
                    send,
                    401,
                    "the API description needs the admin token: Authorization: Bearer <token>",
                    "authentication_error",
                    "invalid_admin_token",
                )
                return

        cap = self.max_body_bytes(scope)
        declared = headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > cap:
            await _send_error(send, 413, _too_large(int(declared), cap), *_TOO_LARGE, close=True)
            return
        chunks: list[bytes] = []
        num_bytes = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left while sending: nothing to answer
            chunk = message.get("body", b"")
            num_bytes += len(chunk)
            if num_bytes > cap:
                await _send_error(send, 413, _too_large(None, cap), *_TOO_LARGE, close=True)
                return
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: http.disconnect, when it comes

        await self.app(scope, replay, send)


_TOO_LARGE = ("invalid_request_error", "request_too_large")


def _too_large(num_bytes: int | None, cap: int) -> str:
    size = f"of {num_bytes} bytes " if num_bytes is not None else ""
    return (
        f"The request body {size}is larger than this server's limit of {cap} bytes "
        "(--max-body-bytes)"
    )


def too_large_body(num_bytes: int | None, cap: int) -> dict[str, Any]:
    """The 413's OpenAI-shaped body, for a relay that refuses a body before this server sees
    it (app/cluster/)."""
    return error_body(_too_large(num_bytes, cap), _TOO_LARGE[0], None, _TOO_LARGE[1])
