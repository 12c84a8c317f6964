"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

Streaming answers are SSE (`data: <json>\n\n` per event, `data: [DONE]` last): a role chunk,
content deltas, a chunk with `finish_reason`, a usage chunk when
`stream_options.include_usage`. A client that disconnects aborts its request.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from sse_starlette.sse import EventSourceResponse

from app.client import Draining, EngineDead, Overloaded, RequestStream
from app.common import (
    admission_error,
    chat_prompt_ids,
    check_model,
    check_prompt_fits,
    check_token_ids,
    client_of,
    default_max_tokens,
    encode,
    engine_of,
    new_id,
    off_loop,
    require_api_key,
    settings_of,
    trace_of,
    until_disconnect,
)
from app.errors import ERROR_RESPONSES, APIError, bad_request, error_body
from app.limits import check_num_requests
from app.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    _SamplingFields,
    usage,
)
from runtime.request import Request as EngineRequest
from runtime.request import RequestKind, RequestOutput, SamplingParams, TokenLogprob

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], responses=ERROR_RESPONSES)
log = logging.getLogger("greenlane.request")

# OpenAPI: with `"stream": true` the 200 answer is Server-Sent Events.
_STREAM_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion (JSON), or with `stream` its chunks as Server-Sent "
        "Events: `data: <chunk JSON>` lines, `data: [DONE]` last",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}

SSE_PING_S = 15  # comment pings keep idle proxies from closing a long prefill's stream


# ----------------------------------------------------------------------------- shared pieces


def _sampling(body: _SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    top_k = body.top_k or 0
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if top_k < 0 else top_k,
        seed=body.seed,
        stop=body.stop_list(),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
    )


def _token_text(engine: Any, token_id: int) -> str:
    return engine.tokenizer.decode([token_id], skip_special_tokens=False)


class _Collected:
    """Aggregates one request's outputs (non-streaming, or usage at the end of a stream)."""

    def __init__(self) -> None:
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.ttft_s: float | None = None

    def add(self, out: RequestOutput) -> None:
        self.text_parts.append(out.new_text)
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs)
        self.num_prompt_tokens = max(self.num_prompt_tokens, out.num_prompt_tokens)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if self.ttft_s is None and out.ttft_s is not None:
            self.ttft_s = out.ttft_s
        if out.finished:
            self.finish_reason = out.finish_reason or "stop"
            self.error = out.error

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def _raise_if_failed(col: _Collected, draining: bool, request_id: str) -> None:
    # The engine's reason may quote an exception: it goes to the log, not to the client.
    if col.finish_reason == "error":
        log.error("engine failed request %s: %s", request_id, col.error or "unknown error")
        raise APIError(
            500,
            f"The engine failed request {request_id} (the server log has the details)",
            code="engine_error",
        )
    if col.finish_reason == "abort":
        if draining:
            raise APIError(503, "Request aborted: server is shutting down", code="shutting_down")
        log.error("engine aborted request %s: %s", request_id, col.error or "no reason given")
        raise APIError(
            500,
            f"The engine aborted request {request_id} (the server log has the details)",
            code="aborted",
        )


def _fill_trace(request: Request, request_id: str, cols: list[_Collected]) -> None:
    trace = trace_of(request)
    trace.request_id = request_id
    trace.num_prompt_tokens = sum(c.num_prompt_tokens for c in cols)
    trace.num_cached_tokens = sum(c.num_cached_tokens for c in cols)
    trace.num_output_tokens = sum(len(c.token_ids) for c in cols)
    ttfts = [c.ttft_s for c in cols if c.ttft_s is not None]
    trace.ttft_s = min(ttfts) if ttfts else None
    trace.finish_reason = ",".join(sorted({c.finish_reason or "-" for c in cols}))


def _openai_finish_reason(reason: str | None) -> str | None:
    # OpenAI knows stop / length; we pass abort/error through (clients treat unknown as done).
    return reason


async def _run_non_streaming(request: Request, reqs: list[EngineRequest]) -> list[_Collected]:
    client = client_of(request)
    timeout_s = settings_of(request).request_timeout_s
    results = await until_disconnect(request, client.run_all(reqs), timeout_s)
    cols = []
    for outs in results:
        col = _Collected()
        for out in outs:
            col.add(out)
        cols.append(col)
    return cols


def _open_stream(request: Request, req: EngineRequest) -> RequestStream:
    try:
        return client_of(request).generate(req)
    except (Overloaded, Draining, EngineDead) as exc:
        raise admission_error(exc, settings_of(request)) from exc


def _sse(events: AsyncIterator[dict[str, Any]]) -> EventSourceResponse:
    return EventSourceResponse(events, sep="\n", ping=SSE_PING_S)


def _json(obj: Any) -> dict[str, str]:
    return {"data": json.dumps(obj, separators=(",", ":"), ensure_ascii=False)}


def _stream_error_event(col: _Collected, draining: bool, request_id: str) -> dict[str, str] | None:
    try:
        _raise_if_failed(col, draining, request_id)
    except APIError as err:
        return _json(error_body(err.message, err.err_type, err.param, err.code))
    return None


# ----------------------------------------------------------------------------- /v1/models


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    engine = engine_of(request)
    card = ModelCard(id=settings_of(request).model_name, max_model_len=int(engine.max_model_len))
    return ModelList(data=[card]).model_dump()


# ----------------------------------------------------------------------------- chat


def _chat_logprobs(engine: Any, items: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token_text(engine, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in items
        ]
    }


@router.post("/chat/completions", responses=_STREAM_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    check_model(request, body.model)
    engine = engine_of(request)
    prompt_ids = await off_loop(chat_prompt_ids, engine, body.messages)
    max_tokens = body.max_output_tokens or default_max_tokens(engine, len(prompt_ids))
    check_prompt_fits(engine, len(prompt_ids), max_tokens)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None

    request_id = new_id("chatcmpl")
    created = int(time.time())
    model_name = settings_of(request).model_name
    req = EngineRequest(
        request_id=request_id,
        kind=RequestKind.GENERATE,
        prompt_token_ids=prompt_ids,
        sampling=_sampling(body, max_tokens, logprobs),
    )
    trace_of(request).request_id = request_id

    if not body.stream:
        (col,) = await _run_non_streaming(request, [req])
        _fill_trace(request, request_id, [col])
        _raise_if_failed(col, client_of(request).draining, request_id)
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": col.text},
                    "logprobs": _chat_logprobs(engine, col.logprobs) if body.logprobs else None,
                    "finish_reason": _openai_finish_reason(col.finish_reason),
                }
            ],
            "usage": usage(
                col.num_prompt_tokens or len(prompt_ids), len(col.token_ids), col.num_cached_tokens
            ),
        }

    stream = _open_stream(request, req)

    def chunk(
        delta: dict[str, Any], finish: str | None = None, logprobs: Any = None
    ) -> dict[str, str]:
        return _json(
            {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model_name,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                ],
            }
        )

    async def events() -> AsyncIterator[dict[str, str]]:
        col = _Collected()
        try:
            yield chunk({"role": "assistant", "content": ""})
            async for out in stream:
                col.add(out)
                if out.new_text or out.new_logprobs:
                    lp = _chat_logprobs(engine, out.new_logprobs) if body.logprobs else None
                    yield chunk({"content": out.new_text}, logprobs=lp)
            err = _stream_error_event(col, client_of(request).draining, request_id)
            if err is not None:
                yield err
            else:
                yield chunk({}, finish=_openai_finish_reason(col.finish_reason))
                if body.include_usage:
                    yield _json(
                        {
                            "id": request_id,
                            "object": "chat.completion.chunk",
                            "created": created,
                            "model": model_name,
                            "choices": [],
                            "usage": usage(
                                col.num_prompt_tokens or len(prompt_ids),
                                len(col.token_ids),
                                col.num_cached_tokens,
                            ),
                        }
                    )
            yield {"data": "[DONE]"}
        finally:
            await stream.aclose()  # aborts the request when the client went away mid-stream
            _fill_trace(request, request_id, [col])

    return _sse(events())


# ----------------------------------------------------------------------------- completions


def _prompts_of(engine: Any, body: CompletionRequest) -> list[list[int]]:
    p = body.prompt
    # Text prompts get the tokenizer's special tokens (e.g. a BOS), as vLLM and transformers
    # give them; token-id prompts are taken as they are.
    if isinstance(p, str):
        prompts = [encode(engine, p, add_special_tokens=True)]
    elif len(p) > 0 and all(isinstance(x, int) for x in p):
        prompts = [list(p)]  # type: ignore[arg-type]
    elif len(p) > 0 and all(isinstance(x, str) for x in p):
        prompts = [encode(engine, x, add_special_tokens=True) for x in p]  # type: ignore[arg-type]
    elif len(p) > 0:
        prompts = [list(x) for x in p]  # type: ignore[arg-type]
    else:
        raise bad_request("prompt must not be empty", "prompt", "empty_prompt")
    for ids in prompts:
        check_token_ids(engine, ids, "prompt")
        check_prompt_fits(engine, len(ids), body.max_tokens)
    return prompts


def _completion_logprobs(
    engine: Any, items: list[TokenLogprob], text_offset_start: int
) -> dict[str, Any]:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset_start
    for lp in items:
        text = _token_text(engine, lp.token_id)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        top_logprobs.append({_token_text(engine, t): v for t, v in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


@router.post("/completions", responses=_STREAM_RESPONSES)
async def completions(body: CompletionRequest, request: Request) -> Any:
    check_model(request, body.model)
    engine = engine_of(request)
    check_num_requests(client_of(request), body.num_prompts, "prompt")
    prompts = await off_loop(_prompts_of, engine, body)
    if body.stream and len(prompts) > 1:
        raise bad_request("streaming supports a single prompt", "prompt", "unsupported")

    request_id = new_id("cmpl")
    created = int(time.time())
    model_name = settings_of(request).model_name
    reqs = [
        EngineRequest(
            request_id=f"{request_id}-{i}",
            kind=RequestKind.GENERATE,
            prompt_token_ids=ids,
            sampling=_sampling(body, body.max_tokens, body.logprobs),
        )
        for i, ids in enumerate(prompts)
    ]
    trace_of(request).request_id = request_id
    want_logprobs = body.logprobs is not None

    if not body.stream:
        cols = await _run_non_streaming(request, reqs)
        _fill_trace(request, request_id, cols)
        for col in cols:
            _raise_if_failed(col, client_of(request).draining, request_id)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model_name,
            "choices": [
                {
                    "index": i,
                    "text": col.text,
                    "logprobs": _completion_logprobs(engine, col.logprobs, 0)
                    if want_logprobs
                    else None,
                    "finish_reason": _openai_finish_reason(col.finish_reason),
                }
                for i, col in enumerate(cols)
            ],
            "usage": usage(
                sum(c.num_prompt_tokens or len(p) for c, p in zip(cols, prompts, strict=True)),
                sum(len(c.token_ids) for c in cols),
                sum(c.num_cached_tokens for c in cols),
            ),
        }

    (req,) = reqs
    stream = _open_stream(request, req)

    def chunk(text: str, finish: str | None = None, logprobs: Any = None) -> dict[str, str]:
        return _json(
            {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": model_name,
                "choices": [
                    {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
                ],
            }
        )

    async def events() -> AsyncIterator[dict[str, str]]:
        col = _Collected()
        text_len = 0
        try:
            async for out in stream:
                col.add(out)
                if out.new_text or out.new_logprobs:
                    lp = (
                        _completion_logprobs(engine, out.new_logprobs, text_len)
                        if want_logprobs
                        else None
                    )
                    text_len += len(out.new_text)
                    yield chunk(out.new_text, logprobs=lp)
            err = _stream_error_event(col, client_of(request).draining, request_id)
            if err is not None:
                yield err
            else:
                yield chunk("", finish=_openai_finish_reason(col.finish_reason))
                if body.include_usage:
                    yield _json(
                        {
                            "id": request_id,
                            "object": "text_completion",
                            "created": created,
                            "model": model_name,
                            "choices": [],
                            "usage": usage(
                                col.num_prompt_tokens or len(req.prompt_token_ids),
                                len(col.token_ids),
                                col.num_cached_tokens,
                            ),
                        }
                    )
            yield {"data": "[DONE]"}
        finally:
            await stream.aclose()
            _fill_trace(request, request_id, [col])

    return _sse(events())
