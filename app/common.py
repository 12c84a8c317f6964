"""Helpers the route modules share: auth, model-name check, tokenising and limits, request
traces (what the one log line and the metrics of a request need; app/logs.py writes them),
request ids, and running engine work until the client leaves.

Tokenising and template rendering run off the event loop (`off_loop`), on a small thread pool:
one huge prompt must not stall other clients' streams. The runtime tokenizer encodes without
holding the GIL, so the loop keeps running while a worker tokenises.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from fastapi import Request

from app.client import Draining, EngineClient, EngineDead, Overloaded
from app.errors import APIError, bad_request
from app.limits import check_num_messages, check_text_fits
from app.security import bearer_token, same_secret, secret_of
from app.settings import Settings
from runtime.request import RequestOutput

T = TypeVar("T")
P = ParamSpec("P")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


# ----------------------------------------------------------------------------- per-request trace


@dataclass(slots=True)
class Trace:
    """What the access log and the metrics need about one HTTP request; routes fill it in."""

    endpoint: str
    start_s: float
    request_id: str = "-"
    client_request_id: str | None = None  # a usable X-Request-Id the client sent
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    queue_s: float | None = None
    ttft_s: float | None = None
    finish_reason: str | None = None
    error: str | None = None  # why the request failed (the log line's reason)


def trace_of(request: Request) -> Trace:
    trace = getattr(request.state, "trace", None)
    if trace is None:  # route called without the middleware (should not happen)
        trace = Trace(endpoint=request.url.path, start_s=time.monotonic())
        request.state.trace = trace
    return trace


def observe_finished(request: Request, out: RequestOutput, num_output_tokens: int) -> None:
    """Record a finished engine request (`out` is its final output) in the metrics."""
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.observe_engine_request(out, num_output_tokens)


def begin_request_id(request: Request, prefix: str) -> tuple[str, str]:
    """(the id the client sees, the base of its engine requests' ids).

    The client's X-Request-Id when it sent a usable one (then engine ids get a random suffix:
    clients may reuse an id, and engine ids must be unique), else `<prefix>-<hex>` for both."""
    trace = trace_of(request)
    given = trace.client_request_id
    if given:
        public, base = given, f"{given}-{uuid.uuid4().hex[:8]}"
    else:
        public = base = new_id(prefix)
    trace.request_id = public
    return public, base


# ----------------------------------------------------------------------------- dependencies


def settings_of(request: Request) -> Settings:
    return request.app.state.settings


def client_of(request: Request) -> EngineClient:
    return request.app.state.client


def engine_of(request: Request) -> Any:
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        raise APIError(503, "engine is not running", code="engine_unavailable")
    return engine


async def require_api_key(request: Request) -> None:
    """FastAPI dependency on /v1/*: `Authorization: Bearer <api_key>` when a key is set."""
    key = secret_of(settings_of(request), "api_key")
    if key is None:
        return
    token = bearer_token(request.headers)
    if token is None or not same_secret(token, key):
        raise APIError(
            401,
            "Invalid or missing API key (send 'Authorization: Bearer <key>')",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def check_model(request: Request, name: str | None) -> None:
    settings = settings_of(request)
    if not settings.accepts_model(name):
        raise APIError(
            404,
            f"The model '{name}' does not exist; this server serves '{settings.model_name}'",
            param="model",
            code="model_not_found",
        )


# ----------------------------------------------------------------------------- tokens and limits


def vocab_size(engine: Any) -> int:
    return int(engine.model_config.vocab_size)


def encode(
    engine: Any, text: str, add_special_tokens: bool = False, param: str = "prompt"
) -> list[int]:
    """Tokenise text. `add_special_tokens`: the tokenizer's own (e.g. Llama 3's BOS), as a text
    prompt gets them (completions, scoring); labels and parts of a prompt get none. A text
    that cannot fit the context whatever its tokens is refused before tokenising."""
    check_text_fits(engine, len(text), param)
    return list(engine.tokenizer.encode(text, add_special_tokens=add_special_tokens))


_prep_pool: ThreadPoolExecutor | None = None


async def off_loop(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run request preparation (tokenising, template rendering, id checks) on the preparation
    threads, not the event loop. Its APIErrors propagate as if called here."""
    global _prep_pool
    if _prep_pool is None:  # created on first use; the threads die with the process
        _prep_pool = ThreadPoolExecutor(
            max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="greenlane-prep"
        )
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_prep_pool, functools.partial(fn, *args, **kwargs))


async def digest_off_loop(request: Request, reqs: list[Any]) -> None:
    """The engine requests' prefix-cache digests (`EngineCoreClient.digest`) on the
    preparation threads: a long prompt's take ~0.7 ms, a score call's items after a long
    query ~0.25 ms each, which the event loop would otherwise spend with every stream
    waiting. A core without digests (a test engine) is skipped; `add` digests what is left."""
    digest = getattr(client_of(request).core, "digest", None)
    if digest is not None and reqs:
        await off_loop(digest, reqs)


def _developer_role(engine: Any) -> str:
    """The role a `developer` message is rendered as: OpenAI's developer message is the system
    message of models before it, so "system" unless the model's chat template knows the
    developer role itself (a template that does not renders it as a literal turn named
    "developer", which the model was never trained on)."""
    template = getattr(engine.tokenizer, "chat_template", None) or ""
    return "developer" if "developer" in template else "system"


def chat_prompt_ids(
    engine: Any,
    messages: list[Any],
    param: str = "messages",
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Render chat messages with the model's template and tokenise them; message content is
    read as text (special-token text in it never becomes a control token).
    `template_kwargs`: variables for the template (`chat_template_kwargs`)."""
    check_num_messages(engine, len(messages), param)
    developer = _developer_role(engine)
    try:
        plain = [
            {
                "role": developer if m.role == "developer" else m.role,
                "content": m.text(),
                **m.template_fields(),
            }
            for m in messages
        ]
    except ValueError as exc:
        raise bad_request(str(exc), param) from exc
    check_text_fits(engine, sum(len(m["content"]) for m in plain), param)
    try:
        return list(
            engine.tokenizer.encode_chat(
                plain,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(template_kwargs or {}),
            )
        )
    except Exception as exc:  # a template may reject a role order, e.g. two system messages
        raise bad_request(f"chat template rejected the messages: {exc}", param) from exc


def check_token_ids(engine: Any, ids: list[int], param: str) -> None:
    vocab = vocab_size(engine)
    for tok in ids:
        if not 0 <= tok < vocab:
            raise bad_request(
                f"token id {tok} is outside the vocabulary [0, {vocab})", param, "invalid_token_id"
            )


def check_prompt_fits(
    engine: Any,
    num_prompt_tokens: int,
    max_tokens: int,
    param: str = "max_tokens",
    *,
    generate: bool = True,
    max_tokens_requested: bool = True,
) -> None:
    """Prompt + output must fit the context; a generation prompt must also fit the KV pool
    (`engine.max_prompt_tokens`; scoring keeps no KV beyond its prefix, so it is exempt).
    `max_tokens_requested` False: `max_tokens` is the default (the rest of the context), so a
    prompt that does not fit is the prompt's fault (`param`), not a max_tokens nobody sent."""
    if num_prompt_tokens == 0:
        raise bad_request("the prompt is empty", "prompt", "empty_prompt")
    max_len = int(engine.max_model_len)
    if not generate and num_prompt_tokens > max_len:
        raise bad_request(
            f"This model's maximum context length is {max_len} tokens; the scoring prompt "
            f"(query and item together) has {num_prompt_tokens}. Shorten the query or the item.",
            param,
            "context_length_exceeded",
        )
    if not max_tokens_requested and num_prompt_tokens >= max_len:
        raise bad_request(
            f"This model's maximum context length is {max_len} tokens; the prompt has "
            f"{num_prompt_tokens} and leaves no room for an output token. Reduce the prompt.",
            param,
            "context_length_exceeded",
        )
    if num_prompt_tokens + max_tokens > max_len:
        raise bad_request(
            f"This model's maximum context length is {max_len} tokens; the request has "
            f"{num_prompt_tokens} prompt tokens + {max_tokens} max_tokens = "
            f"{num_prompt_tokens + max_tokens}. Reduce the prompt or max_tokens.",
            param,
            "context_length_exceeded",
        )
    max_score = int(getattr(engine, "max_score_tokens", max_len))
    if not generate and num_prompt_tokens > max_score:
        raise bad_request(
            f"The scoring prompt has {num_prompt_tokens} tokens; this server accepts at most "
            f"{max_score} (activation memory reserved at start-up; see --max-score-tokens).",
            "prompt",
            "context_length_exceeded",
        )
    max_prompt = int(getattr(engine, "max_prompt_tokens", max_len))
    if generate and num_prompt_tokens > max_prompt:
        raise bad_request(
            f"The prompt has {num_prompt_tokens} tokens; this server accepts at most {max_prompt} "
            "(KV cache capacity).",
            "prompt",
            "context_length_exceeded",
        )


def default_max_tokens(engine: Any, num_prompt_tokens: int) -> int:
    return max(1, int(engine.max_model_len) - num_prompt_tokens)


# ----------------------------------------------------------------------------- running work


def admission_error(exc: Exception, settings: Settings) -> APIError:
    if isinstance(exc, Overloaded):
        return APIError(
            429,
            f"Server is overloaded: {exc}. Retry later.",
            code="queue_full",
            headers={"Retry-After": str(settings.retry_after_s)},
        )
    if isinstance(exc, Draining):
        return APIError(503, "Server is shutting down", code="shutting_down")
    if isinstance(exc, EngineDead):
        return APIError(503, "Engine is not running", code="engine_unavailable")
    raise exc


async def _wait_disconnect(request: Request) -> None:
    # After the body is read, the next ASGI message is http.disconnect (or never, until the
    # response is sent and this task is cancelled).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T], timeout_s: float | None) -> T:
    """Run `work`; cancel it (which aborts its engine requests) if the client goes away or
    the request timeout passes. Admission errors become their HTTP errors."""
    settings = settings_of(request)
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait(
            {task, watcher}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        watcher.cancel()
    if task in done:
        try:
            return task.result()
        except (Overloaded, Draining, EngineDead) as exc:
            raise admission_error(exc, settings) from exc
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    if watcher in done:
        # 499 (nginx's "client closed request"): nobody reads it, but the log and metrics do.
        raise APIError(499, "client disconnected", code="client_disconnected")
    raise APIError(504, f"request timed out after {timeout_s} s", code="timeout")
