"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

Streaming answers are SSE (`data: <json>\n\n` per event, `data: [DONE]` last): per choice a
role chunk (chat), content deltas and a chunk with `finish_reason`; then a usage chunk when
`stream_options.include_usage`. A client that disconnects aborts its requests.

`n` choices are `n` engine requests with the same prompt (seeds `seed + i` when a seed is
given); the prefix cache lets them share the prompt's KV. Completions with `echo` put the
prompt first, and with `logprobs` also its token logprobs (computed by the engine in the
prefill: `SamplingParams.prompt_logprobs`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request

from app.client import Draining, EngineDead, Overloaded, RequestStream
from app.common import (
    admission_error,
    begin_request_id,
    chat_prompt_ids,
    check_model,
    check_prompt_fits,
    check_token_ids,
    client_of,
    default_max_tokens,
    digest_off_loop,
    encode,
    engine_of,
    observe_finished,
    off_loop,
    require_api_key,
    settings_of,
    trace_of,
    until_disconnect,
)
from app.errors import ERROR_RESPONSES, APIError, bad_request, error_body
from app.json_body import FastJSONRoute
from app.limits import check_num_requests
from app.protocol import (
    GREEDY_BELOW_TEMPERATURE,
    MAX_SEED,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    NamedToolChoice,
    _SamplingFields,
    unsupported_param,
    usage,
)
from app.sse import DONE, SSEResponse
from app.tool_calls import (
    AUTO,
    NAMED,
    REPEATED_NAMES,
    ToolMode,
    new_call_id,
    parse_tool_calls,
    tool_calls_of,
    tool_choice_error,
    tool_mode,
    tool_parser,
)
from app.tool_calls import finish_reason as tool_finish_reason
from runtime.request import Request as EngineRequest
from runtime.request import RequestKind, RequestOutput, SamplingParams, TokenLogprob
from runtime.sampling.structured import (
    GrammarError,
    compile_response_format,
    compile_structured_outputs,
    grammar_conflict,
)

router = APIRouter(
    prefix="/v1",
    dependencies=[Depends(require_api_key)],
    responses=ERROR_RESPONSES,
    route_class=FastJSONRoute,
)
log = logging.getLogger("greenlane.app")  # details beside the one access line

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


def _check_params(engine: Any, body: _SamplingFields) -> None:
    """400 for a parameter we would otherwise ignore, and for token ids outside the vocabulary."""
    found = unsupported_param(body)
    if found is not None:
        param, message = found
        raise bad_request(message, param, "unsupported_parameter")
    if body.logit_bias:
        check_token_ids(engine, list(body.logit_bias_ids()), "logit_bias")
    if body.stop_token_ids:
        check_token_ids(engine, list(body.stop_token_ids), "stop_token_ids")


def _sampling(
    body: _SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    *,
    seed: int | None,
    defaults: dict[str, float],
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The request's sampling parameters; one it leaves out takes the model's default
    (`defaults`: its generation_config.json, `--generation-config auto`), else the server's."""

    def pick(value: float | None, key: str, server: float) -> float:
        return value if value is not None else defaults.get(key, server)

    top_k = int(pick(body.top_k, "top_k", 0))
    temperature = pick(body.temperature, "temperature", 1.0)
    if temperature < GREEDY_BELOW_TEMPERATURE:
        temperature = 0.0  # greedy: what a temperature this small samples anyway
    if body.min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens ({body.min_tokens}) exceeds the request's max_tokens ({max_tokens})",
            "min_tokens",
        )
    grammar = None
    if body.response_format is not None and body.structured_outputs is not None:
        raise bad_request(
            "response_format and structured_outputs both constrain the output: give one",
            "structured_outputs",
        )
    if body.response_format is not None:
        try:
            grammar = compile_response_format(body.response_format.as_dict())
        except GrammarError as e:
            raise bad_request(str(e), "response_format") from e
    if body.structured_outputs is not None:
        try:
            grammar = compile_structured_outputs(body.structured_outputs.as_dict())
        except GrammarError as e:
            raise bad_request(str(e), "structured_outputs") from e
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=pick(body.top_p, "top_p", 1.0),
        top_k=0 if top_k < 0 else top_k,
        seed=seed,
        stop=body.stop_list(),
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=pick(body.repetition_penalty, "repetition_penalty", 1.0),
        logit_bias=body.logit_bias_ids(),
        min_p=pick(body.min_p, "min_p", 0.0),
        skip_special_tokens=body.skip_special_tokens,
        min_tokens=body.min_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        grammar=grammar,
    )
    if grammar is not None and (why := grammar_conflict(sampling)) is not None:
        raise bad_request(
            why, "response_format" if body.response_format is not None else "structured_outputs"
        )
    return sampling


def _choice_seeds(seed: int | None, n: int) -> list[int | None]:
    """Choice i samples with seed + i (modulo 2**64, the seed's range), so n seeded choices
    differ and each is reproducible."""
    return [None] * n if seed is None else [(seed + i) % (MAX_SEED + 1) for i in range(n)]


def _token_text(engine: Any, token_id: int) -> str:
    return engine.tokenizer.decode([token_id], skip_special_tokens=False)


class _Collected:
    """Aggregates one request's outputs (non-streaming, or usage at the end of a stream)."""

    def __init__(self) -> None:
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.queue_s: float | None = None
        self.ttft_s: float | None = None
        self.final: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.text_parts.append(out.new_text)
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs)
        if self.prompt_logprobs is None and out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_prompt_tokens = max(self.num_prompt_tokens, out.num_prompt_tokens)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if self.ttft_s is None and out.ttft_s is not None:
            self.ttft_s = out.ttft_s
        if self.queue_s is None and out.queue_s is not None:
            self.queue_s = out.queue_s
        if out.finished:
            self.finish_reason = out.finish_reason or "stop"
            self.error = out.error
            self.final = out

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


def _fill_trace(request: Request, request_id: str, cols: list[_Collected], n: int = 1) -> None:
    """Once per HTTP request, when its engine requests are done: the trace (its log line) and
    each finished engine request's metrics."""
    for col in cols:
        if col.final is not None:
            observe_finished(request, col.final, len(col.token_ids))
    trace = trace_of(request)
    trace.request_id = request_id
    # The n choices of a prompt share it: count its tokens once.
    per_prompt = [cols[i : i + n] for i in range(0, len(cols), n)]
    trace.num_prompt_tokens = sum(max(c.num_prompt_tokens for c in g) for g in per_prompt)
    trace.num_cached_tokens = sum(max(c.num_cached_tokens for c in g) for g in per_prompt)
    trace.num_output_tokens = sum(len(c.token_ids) for c in cols)
    ttfts = [c.ttft_s for c in cols if c.ttft_s is not None]
    trace.ttft_s = min(ttfts) if ttfts else None
    queues = [c.queue_s for c in cols if c.queue_s is not None]
    trace.queue_s = min(queues) if queues else None
    trace.finish_reason = ",".join(sorted({c.finish_reason or "-" for c in cols}))
    failed = next((c for c in cols if c.finish_reason in ("error", "abort")), None)
    if failed is not None and trace.error is None:
        trace.error = f"{failed.finish_reason}: {failed.error or 'no reason given'}"
    elif trace.error is None and any(c.final is None for c in cols):
        # The response ended before the engine finished (the client went away mid-stream):
        # the rest of the request was aborted.
        trace.error = "client disconnected before the end: the request was aborted"


def _usage_of(cols: list[_Collected], prompt_lens: list[int], n: int) -> dict[str, Any]:
    """Usage like OpenAI's: each prompt counted once, every choice's completion tokens."""
    groups = [cols[i * n : (i + 1) * n] for i in range(len(prompt_lens))]
    return usage(
        sum(
            max(c.num_prompt_tokens for c in g) or p
            for g, p in zip(groups, prompt_lens, strict=True)
        ),
        sum(len(c.token_ids) for c in cols),
        sum(max(c.num_cached_tokens for c in g) for g in groups),
    )


def _openai_finish_reason(reason: str | None) -> str | None:
    # OpenAI knows stop / length; we pass abort/error through (clients treat unknown as done).
    return reason


async def _run_non_streaming(request: Request, reqs: list[EngineRequest]) -> list[_Collected]:
    client = client_of(request)
    await digest_off_loop(request, reqs)
    timeout_s = settings_of(request).request_timeout_s
    results = await until_disconnect(request, client.run_all(reqs), timeout_s)
    cols = []
    for outs in results:
        col = _Collected()
        for out in outs:
            col.add(out)
        cols.append(col)
    return cols


async def _open_streams(request: Request, reqs: list[EngineRequest]) -> list[RequestStream]:
    """Admit and submit every request, or none: a later admission failure closes (aborts)
    the ones already opened before the HTTP error is raised."""
    streams: list[RequestStream] = []
    await digest_off_loop(request, reqs)
    try:
        for req in reqs:
            streams.append(client_of(request).generate(req))
    except (Overloaded, Draining, EngineDead) as exc:
        for stream in streams:
            await stream.aclose()
        raise admission_error(exc, settings_of(request)) from exc
    return streams


Batch = list[tuple[int, RequestOutput]]


async def _merged(streams: list[RequestStream]) -> AsyncIterator[Batch]:
    """Every stream's outputs as they arrive, tagged with the stream's index, in batches of
    what is ready at once (one engine step usually brings one output per stream; a slow
    reader's backlog comes out as one batch, one write)."""
    if len(streams) == 1:
        stream = streams[0]
        async for out in stream:
            yield [(0, out)] + [(0, o) for o in stream.ready()]
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            batch: Batch = []
            for i, item in items:
                if item is None:
                    remaining -= 1
                else:
                    batch.append((i, item))
            if batch:
                yield batch
    finally:
        for task in tasks:
            task.cancel()


def _sse(batches: AsyncIterator[list[str]], streams: list[RequestStream]) -> SSEResponse:
    """The SSE response. Hazard: when the client goes away while the generator is suspended
    at a `yield`, its `finally` runs only when the generator is finalised, which may be much
    later; closing the streams once the response has ended (disconnect or not) releases
    their engine requests at once (idempotent)."""

    async def close() -> None:
        for stream in streams:
            await stream.aclose()

    return SSEResponse(batches, on_close=close, ping_s=SSE_PING_S)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _chat_content_chunk(head: str, index: int, text: str, logprobs: Any) -> str:
    """A chat chunk with a content delta, from the template `head` (`_chunk_head`): the
    per-token path. The same JSON as the dict of the other chunks (tests/test_sse_response.py)."""
    lp = "null" if logprobs is None else _dumps(logprobs)
    return (
        f'{head}{index},"delta":{{"content":{_dumps(text)}}},'
        f'"logprobs":{lp},"finish_reason":null}}]}}'
    )


def _completion_chunk(head: str, index: int, text: str, finish: str | None, logprobs: Any) -> str:
    """A text-completion chunk from the template `head` (`_chunk_head`)."""
    lp = "null" if logprobs is None else _dumps(logprobs)
    fin = "null" if finish is None else _dumps(finish)
    return f'{head}{index},"text":{_dumps(text)},"logprobs":{lp},"finish_reason":{fin}}}]}}'


def _usage_tail(col: _Collected, prompt_len: int) -> str:
    """`stream_options.continuous_usage_stats`: a choice's usage so far, as the end of a chunk
    (`_with_usage`): its completion tokens, so that a chunk after a token without text (a
    partial UTF-8 sequence, a special token: no chunk of its own) tells the client it carries
    two."""
    # The JSON of `usage(...)` by hand: this runs per token per stream (~1 us, not ~5).
    prompt, done = col.num_prompt_tokens or prompt_len, len(col.token_ids)
    return (
        f',"usage":{{"prompt_tokens":{prompt},"completion_tokens":{done},'
        f'"total_tokens":{prompt + done},'
        f'"prompt_tokens_details":{{"cached_tokens":{col.num_cached_tokens}}}}}}}'
    )


def _with_usage(payloads: list[str], marks: list[tuple[int, str]]) -> None:
    """Give each run of payloads from a mark's index to the next mark's the mark's usage
    tail (`_usage_tail`). Each payload is one JSON object ending in `}`."""
    ends = [start for start, _ in marks[1:]] + [len(payloads)]
    for (start, tail), end in zip(marks, ends, strict=True):
        for j in range(start, end):
            payloads[j] = payloads[j][:-1] + tail


def _chunk_head(request_id: str, obj: str, created: int, model_name: str) -> str:
    """A stream chunk's JSON up to its one choice's index: what every chunk of a response
    shares (key order as the dicts give it)."""
    return (
        f'{{"id":{_dumps(request_id)},"object":"{obj}","created":{created},'
        f'"model":{_dumps(model_name)},"choices":[{{"index":'
    )


def _stream_error_event(cols: list[_Collected], draining: bool, request_id: str) -> str | None:
    try:
        for col in cols:
            _raise_if_failed(col, draining, request_id)
    except APIError as err:
        return _dumps(error_body(err.message, err.err_type, err.param, err.code))
    return None


# ----------------------------------------------------------------------------- /v1/models


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    engine = engine_of(request)
    card = ModelCard(id=settings_of(request).model_name, max_model_len=int(engine.max_model_len))
    return ModelList(data=[card]).model_dump()


@router.get("/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    """One model's card (the OpenAI SDK's `models.retrieve`); 404 for a name not served."""
    # `/v1/models/`: a body without `model` means the served one, an empty path names none.
    if not model_id:
        raise APIError(404, "No model id in the path (/v1/models/{model})", code="model_not_found")
    check_model(request, model_id)
    engine = engine_of(request)
    card = ModelCard(id=settings_of(request).model_name, max_model_len=int(engine.max_model_len))
    return card.model_dump()


# ----------------------------------------------------------------------------- chat


def _chat_logprobs(engine: Any, items: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        # `bytes`: the token's own bytes, so a character split over tokens can be rebuilt
        # (its text alone is U+FFFD for each part)
        text = _token_text(engine, token_id)
        raw = engine.tokenizer.token_bytes(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in items
        ]
    }


def _tools_of(
    body: ChatCompletionRequest, parser: str
) -> tuple[ToolMode | None, dict[str, Any] | None]:
    """The forced tool call the request asks for (app/tool_calls.py) and the chat template's
    variables: its `chat_template_kwargs`, plus the tools unless tool_choice is "none" (then,
    as vLLM does by default, the model is not shown them)."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice
    choice_value = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice
    why = tool_choice_error(tools, choice_value, parser)
    if why is not None:
        raise bad_request(why, "tools" if why == REPEATED_NAMES else "tool_choice")
    try:
        mode = tool_mode(tools, choice_value, body.parallel_tool_calls, parser)
    except GrammarError as e:
        raise bad_request(str(e), "tools") from e
    forced = mode is not None and mode.grammar is not None
    if forced and (body.response_format is not None or body.structured_outputs):
        raise bad_request(
            "a forced tool call and response_format / structured_outputs both constrain the "
            "output: give one",
            "tool_choice",
        )
    kwargs = body.chat_template_kwargs
    if tools and choice_value != "none":
        kwargs = {**(kwargs or {}), "tools": tools}
    return mode, kwargs


def _tool_sampling(mode: ToolMode | None, sampling: SamplingParams) -> SamplingParams:
    if mode is None:
        return sampling
    if mode.grammar is None:
        # auto: the parser reads the model's own tags, which some tokenizers mark special.
        return dataclasses.replace(sampling, skip_special_tokens=False)
    out = dataclasses.replace(sampling, grammar=mode.grammar)
    why = grammar_conflict(out)
    if why is not None:
        raise bad_request(why, "tool_choice")
    return out


def _tool_chunks(
    mode: ToolMode,
    chunk: Any,
    index: int,
    out: RequestOutput,
    col: _Collected,
    first: bool,
    call_id: str,
    logprobs: Any,
) -> list[str]:
    """Stream chunks of a forced tool call. A named call streams its arguments as they come
    (its id, type and name in the first text's chunk, `first`; the tokens' logprobs with
    them); "required" calls are sent whole when the output ends (the array is parsed then);
    an output that is no complete call (cut by max_tokens) ends as content."""
    payloads: list[str] = []
    if mode.kind == NAMED and (out.new_text or logprobs):
        call: dict[str, Any] = {"index": 0, "function": {"arguments": out.new_text}}
        if first:
            call = {
                "index": 0,
                "id": call_id,
                "type": "function",
                "function": {"name": mode.name, "arguments": out.new_text},
            }
        payloads.append(chunk(index, {"tool_calls": [call]}, logprobs=logprobs))
    if out.finished and col.finish_reason not in ("error", "abort"):
        fin = _openai_finish_reason(col.finish_reason)
        calls = tool_calls_of(mode, col.text)
        if calls is None and mode.kind != NAMED:
            payloads.append(chunk(index, {"content": col.text}))
        elif calls is not None and mode.kind != NAMED:
            deltas = [{"index": j, **c} for j, c in enumerate(calls)]
            payloads.append(chunk(index, {"tool_calls": deltas}))
        if calls is not None:
            fin = tool_finish_reason(mode, fin)
        payloads.append(chunk(index, {}, finish=fin))
    return payloads


def _auto_chunks(
    mode: ToolMode,
    chunk: Any,
    index: int,
    out: RequestOutput,
    col: _Collected,
    parser: Any,
    logprobs: Any,
) -> list[str]:
    """Stream chunks under tool_choice auto: content as the parser lets it through (text that
    may open a call is held), each call whole when it closes; finish_reason "tool_calls" when
    the output made any."""
    assert parser is not None
    finished = out.finished and col.finish_reason not in ("error", "abort")
    content, calls = parser.feed(out.new_text, final=finished)
    payloads: list[str] = []
    if content or logprobs:
        payloads.append(chunk(index, {"content": content}, logprobs=logprobs))
    first = parser.num_calls - len(calls)
    if mode.max_calls is not None:
        calls = calls[: max(0, mode.max_calls - first)]
    if calls:
        deltas = [{"index": first + j, **c} for j, c in enumerate(calls)]
        payloads.append(chunk(index, {"tool_calls": deltas}))
    if finished:
        fin = _openai_finish_reason(col.finish_reason)
        if parser.num_calls:
            fin = tool_finish_reason(mode, fin)
        payloads.append(chunk(index, {}, finish=fin))
    return payloads


@router.post("/chat/completions", responses=_STREAM_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    check_model(request, body.model)
    engine = engine_of(request)
    _check_params(engine, body)
    if body.max_tokens is not None and body.max_completion_tokens not in (None, body.max_tokens):
        # One of them would be ignored: which one the client meant is not ours to guess.
        raise bad_request(
            f"max_tokens={body.max_tokens} and max_completion_tokens="
            f"{body.max_completion_tokens} disagree: send one of them (max_completion_tokens is "
            "OpenAI's current name)",
            "max_tokens",
        )
    # n choices are n engine requests: more than the server admits at once can never run (a
    # 400, not a 429 that invites retries)
    check_num_requests(client_of(request), body.n, "n")
    mode, template_kwargs = _tools_of(body, settings_of(request).tool_call_parser)
    prompt_ids = await off_loop(
        chat_prompt_ids,
        engine,
        body.messages,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        template_kwargs=template_kwargs,
    )
    requested = body.max_output_tokens
    max_tokens = requested or default_max_tokens(engine, len(prompt_ids))
    check_prompt_fits(
        engine,
        len(prompt_ids),
        max_tokens,
        "max_tokens" if requested else "messages",
        max_tokens_requested=requested is not None,
    )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None

    request_id, engine_base = begin_request_id(request, "chatcmpl")
    created = int(time.time())
    model_name = settings_of(request).model_name
    n = body.n
    reqs = [
        EngineRequest(
            request_id=f"{engine_base}-{i}",
            kind=RequestKind.GENERATE,
            prompt_token_ids=list(prompt_ids),
            sampling=_tool_sampling(
                mode,
                _sampling(
                    body,
                    max_tokens,
                    logprobs,
                    seed=seed,
                    defaults=request.app.state.sampling_defaults,
                ),
            ),
            cache_salt=body.cache_salt,
        )
        for i, seed in enumerate(_choice_seeds(body.seed, n))
    ]

    def answer(col: _Collected) -> tuple[dict[str, Any], str | None]:
        """A finished choice's message and finish reason (tool calls when forced)."""
        fin = _openai_finish_reason(col.finish_reason)
        if mode is not None and mode.kind == AUTO:
            content, calls = parse_tool_calls(mode.parser, col.text, set(mode.tool_names))
            calls = calls[: mode.max_calls]  # (None: all)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                return message, tool_finish_reason(mode, fin)
        elif mode is not None and (calls := tool_calls_of(mode, col.text)) is not None:
            message = {"role": "assistant", "content": None, "tool_calls": calls}
            return message, tool_finish_reason(mode, fin)
        return {"role": "assistant", "content": col.text}, fin

    if not body.stream:
        cols = await _run_non_streaming(request, reqs)
        _fill_trace(request, request_id, cols, n)
        for col in cols:
            _raise_if_failed(col, client_of(request).draining, request_id)
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model_name,
            "choices": [
                {
                    "index": i,
                    "message": message,
                    "logprobs": _chat_logprobs(engine, col.logprobs) if body.logprobs else None,
                    "finish_reason": fin,
                }
                for i, (message, fin) in enumerate(map(answer, cols))
            ],
            "usage": _usage_of(cols, [len(prompt_ids)], n),
        }

    streams = await _open_streams(request, reqs)

    head = _chunk_head(request_id, "chat.completion.chunk", created, model_name)

    def chunk(
        index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None
    ) -> str:
        return _dumps(
            {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model_name,
                "choices": [
                    {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                ],
            }
        )

    continuous = body.continuous_usage  # usage in every chunk
    call_ids = [new_call_id() for _ in range(n)]  # a named call's id, in its first chunk
    named_sent = [False] * n  # whether a choice's named call has sent its first chunk
    auto = mode is not None and mode.kind == AUTO
    parsers = [
        tool_parser(mode.parser, set(mode.tool_names)) if mode is not None and auto else None
        for _ in range(n)
    ]

    async def events() -> AsyncIterator[list[str]]:
        cols = [_Collected() for _ in streams]
        merged = _merged(streams)
        try:
            first = [chunk(i, {"role": "assistant", "content": ""}) for i in range(n)]
            if continuous:
                _with_usage(first, [(i, _usage_tail(cols[i], len(prompt_ids))) for i in range(n)])
            yield first
            async for batch in merged:
                payloads = []
                marks: list[tuple[int, str]] = []
                for i, out in batch:
                    col = cols[i]
                    col.add(out)
                    if continuous:
                        marks.append((len(payloads), _usage_tail(col, len(prompt_ids))))
                    if mode is not None and mode.kind == AUTO:
                        lp = _chat_logprobs(engine, out.new_logprobs) if body.logprobs else None
                        payloads += _auto_chunks(mode, chunk, i, out, col, parsers[i], lp)
                        continue
                    if mode is not None:
                        lp = _chat_logprobs(engine, out.new_logprobs) if body.logprobs else None
                        payloads += _tool_chunks(
                            mode, chunk, i, out, col, not named_sent[i], call_ids[i], lp
                        )
                        named_sent[i] = named_sent[i] or bool(out.new_text or lp)
                        continue
                    if out.new_text or out.new_logprobs:
                        lp = _chat_logprobs(engine, out.new_logprobs) if body.logprobs else None
                        payloads.append(_chat_content_chunk(head, i, out.new_text, lp))
                    if out.finished and col.finish_reason not in ("error", "abort"):
                        payloads.append(
                            chunk(i, {}, finish=_openai_finish_reason(col.finish_reason))
                        )
                if continuous:
                    _with_usage(payloads, marks)
                yield payloads
            tail = []
            err = _stream_error_event(cols, client_of(request).draining, request_id)
            if err is not None:
                tail.append(err)
            elif body.include_usage:
                tail.append(
                    _dumps(
                        {
                            "id": request_id,
                            "object": "chat.completion.chunk",
                            "created": created,
                            "model": model_name,
                            "choices": [],
                            "usage": _usage_of(cols, [len(prompt_ids)], n),
                        }
                    )
                )
            tail.append(DONE)
            yield tail
        finally:
            await merged.aclose()
            for stream in streams:
                await stream.aclose()  # aborts the request when the client went away
            _fill_trace(request, request_id, cols, n)

    return _sse(events(), streams)


# ----------------------------------------------------------------------------- completions


def _prompts_of(engine: Any, body: CompletionRequest) -> tuple[list[list[int]], list[str]]:
    """Token ids of each prompt and its text (for `echo`: the string given, or the ids
    decoded)."""
    p = body.prompt
    texts: list[str] | None = None
    if isinstance(p, str):
        # Text prompts get the tokenizer's special tokens (e.g. a BOS), as vLLM and
        # transformers give them; token-id prompts are taken as they are.
        prompts, texts = [encode(engine, p, add_special_tokens=True)], [p]
    elif len(p) > 0 and all(isinstance(x, int) for x in p):
        prompts = [list(p)]  # type: ignore[arg-type]
    elif len(p) > 0 and all(isinstance(x, str) for x in p):
        prompts = [encode(engine, x, add_special_tokens=True) for x in p]  # type: ignore[arg-type]
        texts = list(p)  # type: ignore[arg-type]
    elif len(p) > 0:
        prompts = [list(x) for x in p]  # type: ignore[arg-type]
    else:
        raise bad_request("prompt must not be empty", "prompt", "empty_prompt")
    for ids in prompts:
        check_token_ids(engine, ids, "prompt")
        check_prompt_fits(engine, len(ids), body.max_tokens)
    if texts is None:
        texts = [engine.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]
    return prompts, texts


LogprobEntry = tuple[int, TokenLogprob | None]


def _completion_logprobs(
    engine: Any, entries: list[LogprobEntry], text_offset_start: int
) -> dict[str, Any]:
    """The legacy `logprobs` object. `top_logprobs` holds the token itself and its top
    alternatives (so up to logprobs + 1 entries, as OpenAI documents); an entry without a
    logprob (the first prompt token) is null in both lists."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset_start
    for token_id, lp in entries:
        text = _token_text(engine, token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if lp is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(lp.logprob)
        top = {text: lp.logprob}
        top.update({_token_text(engine, t): v for t, v in lp.top})
        top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _prompt_entries(prompt_ids: list[int], col: _Collected) -> list[LogprobEntry]:
    """(token id, logprob) for each prompt token, from the engine's prompt logprobs."""
    got = col.prompt_logprobs
    if got is None:
        raise APIError(
            501,
            "echo with logprobs needs prompt logprobs, which this engine did not return",
            param="echo",
            code="prompt_logprobs_unavailable",
        )
    if len(got) != len(prompt_ids):
        raise APIError(
            500,
            f"the engine returned {len(got)} prompt logprobs for {len(prompt_ids)} prompt tokens",
            code="engine_error",
        )
    return list(zip(prompt_ids, got, strict=True))


@router.post("/completions", responses=_STREAM_RESPONSES)
async def completions(body: CompletionRequest, request: Request) -> Any:
    check_model(request, body.model)
    engine = engine_of(request)
    _check_params(engine, body)
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request(
            f"best_of={body.best_of} with n={body.n} is not supported: every sampled choice is "
            "returned, none is ranked out (best_of may only equal n)",
            "best_of",
            "unsupported_parameter",
        )
    if body.max_tokens == 0 and not body.echo:
        raise bad_request(
            "max_tokens 0 asks for no output: use it with echo (prompt logprobs)",
            "max_tokens",
        )
    check_num_requests(client_of(request), body.num_prompts * body.n, "prompt")
    prompts, prompt_texts = await off_loop(_prompts_of, engine, body)
    n = body.n
    want_logprobs = body.logprobs is not None
    prompt_logprobs = body.logprobs if body.echo and want_logprobs else None

    request_id, engine_base = begin_request_id(request, "cmpl")
    created = int(time.time())
    model_name = settings_of(request).model_name
    reqs = [
        EngineRequest(
            request_id=f"{engine_base}-{p * n + i}",
            kind=RequestKind.GENERATE,
            prompt_token_ids=list(ids),
            sampling=_sampling(
                body,
                body.max_tokens,
                body.logprobs,
                seed=seed,
                defaults=request.app.state.sampling_defaults,
                prompt_logprobs=prompt_logprobs,
            ),
            cache_salt=body.cache_salt,
        )
        for p, ids in enumerate(prompts)
        for i, seed in enumerate(_choice_seeds(body.seed, n))
    ]
    prompt_of_choice = [p for p in range(len(prompts)) for _ in range(n)]

    def echo_part(index: int, col: _Collected) -> tuple[str, list[LogprobEntry]]:
        """The echoed prompt's text and logprob entries for choice `index` (empty without
        echo)."""
        if not body.echo:
            return "", []
        p = prompt_of_choice[index]
        entries = _prompt_entries(prompts[p], col) if want_logprobs else []
        return prompt_texts[p], entries

    if not body.stream:
        cols = await _run_non_streaming(request, reqs)
        _fill_trace(request, request_id, cols, n)
        for col in cols:
            _raise_if_failed(col, client_of(request).draining, request_id)
        choices = []
        for i, col in enumerate(cols):
            echo_text, echo_entries = echo_part(i, col)
            entries = echo_entries + [(lp.token_id, lp) for lp in col.logprobs]
            choices.append(
                {
                    "index": i,
                    "text": echo_text + col.text,
                    "logprobs": _completion_logprobs(engine, entries, 0) if want_logprobs else None,
                    "finish_reason": _openai_finish_reason(col.finish_reason),
                }
            )
        return {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model_name,
            "choices": choices,
            "usage": _usage_of(cols, [len(ids) for ids in prompts], n),
        }

    streams = await _open_streams(request, reqs)

    head = _chunk_head(request_id, "text_completion", created, model_name)

    def chunk(index: int, text: str, finish: str | None = None, logprobs: Any = None) -> str:
        return _completion_chunk(head, index, text, finish, logprobs)

    continuous = body.continuous_usage  # usage in every chunk

    async def events() -> AsyncIterator[list[str]]:
        cols = [_Collected() for _ in streams]
        text_lens = [0] * len(streams)
        merged = _merged(streams)
        failed = False
        try:
            async for batch in merged:
                payloads: list[str] = []
                marks: list[tuple[int, str]] = []
                for i, out in batch:
                    col = cols[i]
                    first = not col.text_parts
                    col.add(out)
                    if continuous:
                        marks.append((len(payloads), _usage_tail(col, len(prompts[i // n]))))
                    if first and body.echo and col.finish_reason not in ("error", "abort"):
                        # The prompt goes first, in a chunk of its own (with its logprobs).
                        try:
                            echo_text, echo_entries = echo_part(i, col)
                        except APIError as err:
                            payloads.append(
                                _dumps(error_body(err.message, err.err_type, err.param, err.code))
                            )
                            failed = True
                            break
                        lp = (
                            _completion_logprobs(engine, echo_entries, 0) if want_logprobs else None
                        )
                        text_lens[i] = len(echo_text)
                        payloads.append(chunk(i, echo_text, logprobs=lp))
                    if out.new_text or out.new_logprobs:
                        lp = (
                            _completion_logprobs(
                                engine, [(x.token_id, x) for x in out.new_logprobs], text_lens[i]
                            )
                            if want_logprobs
                            else None
                        )
                        text_lens[i] += len(out.new_text)
                        payloads.append(chunk(i, out.new_text, logprobs=lp))
                    if out.finished and col.finish_reason not in ("error", "abort"):
                        payloads.append(
                            chunk(i, "", finish=_openai_finish_reason(col.finish_reason))
                        )
                if failed:
                    payloads.append(DONE)
                    yield payloads
                    return
                if continuous:
                    _with_usage(payloads, marks)
                yield payloads
            tail = []
            err = _stream_error_event(cols, client_of(request).draining, request_id)
            if err is not None:
                tail.append(err)
            elif body.include_usage:
                tail.append(
                    _dumps(
                        {
                            "id": request_id,
                            "object": "text_completion",
                            "created": created,
                            "model": model_name,
                            "choices": [],
                            "usage": _usage_of(cols, [len(ids) for ids in prompts], n),
                        }
                    )
                )
            tail.append(DONE)
            yield tail
        finally:
            await merged.aclose()
            for stream in streams:
                await stream.aclose()
            _fill_trace(request, request_id, cols, n)

    return _sse(events(), streams)
