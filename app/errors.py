"""OpenAI-shaped errors: one exception type for the routes, handlers for everything else.

Every error body is `{"error": {"message", "type", "param", "code"}}`. Bad input is a 4xx,
never a 5xx: FastAPI's validation errors (422 by default) become 400 here, like OpenAI's. A 500
(a bug, or an engine failure) never carries exception text: the log has it, under the request
id the body names. `ERROR_RESPONSES` describes all this in the OpenAPI spec.
"""

from __future__ import annotations

import logging
import sys
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.protocol import ParamError
from app.security import is_json_content_type

log = logging.getLogger("greenlane.app")

# status -> OpenAI error `type`
_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    403: "permission_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}


class APIError(Exception):
    """An error the routes raise on purpose; rendered in the OpenAI error shape."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        err_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type or _ERROR_TYPES.get(status_code, "invalid_request_error")
        self.headers = headers


class _ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error shape (for the OpenAPI spec)."""

    error: _ErrorDetail


def _described(text: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": text}


# OpenAPI `responses` for the API routers. Declaring 400 (and the 4XX range) also stops FastAPI
# from documenting its default 422, which this server never sends.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _described("Invalid request: malformed JSON, a field out of range, over the context"),
    401: _described("Missing or wrong API key"),
    403: _described("Host not allowed (DNS-rebinding guard)"),
    404: _described("Unknown model"),
    413: _described("Request body over --max-body-bytes"),
    429: _described("Queue full; retry after Retry-After seconds"),
    "4XX": _described("Other client errors, in the same shape"),
    500: _described("Server or engine failure (details in the server log, by request id)"),
    503: _described("Engine not running, or shutting down"),
    504: _described("Request timed out"),
}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def error_body(
    message: str, err_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(err.message, err.err_type, err.param, err.code),
        status_code=err.status_code,
        headers=err.headers,
    )


def _loc_to_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    # FastAPI locations look like ("body", "messages", 0, "content"); drop the "body" root.
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or None


def _note(request: Request, message: str) -> None:
    """Give the request's access-log line its reason (app/logs.py)."""
    trace = getattr(request.state, "trace", None)
    if trace is not None:
        trace.error = message


async def _on_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    _note(request, exc.message)
    return error_response(exc)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {}
    param = _loc_to_param(first.get("loc", ()))
    content_type = request.headers.get("content-type")
    if first.get("type") == "json_invalid":
        # Its location is a character offset into the body, not a parameter: in the message.
        where = [p for p in first.get("loc", ()) if p != "body"]
        at = f" at character {where[0]}" if where else ""
        # FastAPI's msg is "JSON decode error"; the decoder's own reason is in ctx
        reason = (first.get("ctx") or {}).get("error") or first.get("msg", "invalid JSON")
        message = f"Malformed JSON body{at}: {reason}"
        param = None
        code = "invalid_json"
    elif tuple(first.get("loc", ())) == ("body",) and not is_json_content_type(content_type):
        # FastAPI reads a body as JSON only under a JSON content type; otherwise it validates
        # the raw bytes and says "Input should be a valid dictionary", which blames the body.
        given = f"got {content_type!r}" if content_type else "none was sent"
        message = (
            f"The body must be a JSON object sent with Content-Type: application/json ({given})"
        )
        param = None
        code = "invalid_content_type"
    else:
        blamed = (first.get("ctx") or {}).get("error")
        if isinstance(blamed, ParamError):  # a model-level check that knows its parameter
            param = f"{param}.{blamed.param}" if param else blamed.param
        # One readable message that names every bad field.
        details = "; ".join(
            f"{_loc_to_param(e.get('loc', ())) or 'body'}: {e.get('msg', 'invalid')}"
            for e in errors[:5]
        )
        message = f"Invalid request: {details}"
        code = "invalid_value"
    _note(request, message)
    return JSONResponse(error_body(message, "invalid_request_error", param, code), status_code=400)


# FastAPI's 400 for a body that json.loads refused with a ValueError other than a decode
# error: text in no encoding it knows, or an integer past Python's digit limit.
_BODY_NOT_PARSED = "There was an error parsing the body"


def _undecodable_body(cause: BaseException | None) -> str:
    """What was wrong with a body FastAPI could not parse (its exception's cause)."""
    if isinstance(cause, UnicodeDecodeError):
        return f"Malformed JSON body: not valid {cause.encoding} text (byte {cause.start})"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return f"Malformed JSON body: a number has more than {sys.get_int_max_str_digits()} digits"
    return "Malformed JSON body: it could not be decoded"


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    detail, code = str(exc.detail), {404: "not_found", 405: "method_not_allowed"}.get(status)
    if status == 400 and detail == _BODY_NOT_PARSED:
        detail, code = _undecodable_body(exc.__cause__), "invalid_json"
    _note(request, detail)
    return JSONResponse(
        error_body(detail, _ERROR_TYPES.get(status, "invalid_request_error"), None, code),
        status_code=status,
        headers=getattr(exc, "headers", None),
    )


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # A bug in the app, not bad input: log the traceback under the request's id, answer 500
    # without the exception's text (it may quote internals or other requests), keep serving.
    trace = getattr(request.state, "trace", None)
    request_id = getattr(trace, "request_id", "-")
    if request_id == "-":
        request_id = f"err-{uuid.uuid4().hex[:16]}"
        if trace is not None:
            trace.request_id = request_id
    log.error("unhandled error while serving request %s", request_id, exc_info=exc)
    _note(request, f"internal error: {type(exc).__name__}")
    return JSONResponse(
        error_body(
            f"Internal server error (request {request_id}; the server log has the details)",
            "server_error",
            None,
            "internal_error",
        ),
        status_code=500,
        # Starlette re-raises after this reply and uvicorn then drops the connection: tell the
        # client not to reuse it (else its next request meets a reset).
        headers={"Connection": "close"},
    )


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
