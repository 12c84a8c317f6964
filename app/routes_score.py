"""POST /v1/score: label-token scoring (prefill only), SGLang's request and response; and
POST /v1/generative-scores, the same work in vLLM's shapes.

Each item becomes one SCORE engine request (query + item, or item + query with `item_first`);
all items are submitted together. With the query first, the first item computes the query and
the others wait for its blocks to enter the prefix cache (the scheduler's
`wait_for_shared_prefix_tokens`), so a long query is computed once per call, not per item. With chat `messages`, the rendered conversation (generation prompt included) plays the
query's role. Text parts are joined as text before tokenising (so BPE merges across the seam
are those of the full string); token-id parts are joined as ids. A prompt that starts with text
gets the tokenizer's special tokens around it (e.g. Llama 3's BOS first), as a text prompt does
in vLLM and SGLang; one that starts with token ids (the client chose its first tokens) or with
chat messages (whose template writes its own) gets none.

Counts (items, labels) are checked before anything is tokenised, and tokenising runs off the
event loop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request

from app.common import (
    begin_request_id,
    chat_prompt_ids,
    check_model,
    check_prompt_fits,
    check_token_ids,
    client_of,
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
from app.errors import ERROR_RESPONSES, APIError, bad_request
from app.json_body import FastJSONRoute
from app.limits import check_num_labels, check_num_requests
from app.protocol import GenerativeScoreRequest, ScoreRequest, unsupported_param
from runtime.request import Request as EngineRequest
from runtime.request import RequestKind, SamplingParams

router = APIRouter(
    prefix="/v1",
    dependencies=[Depends(require_api_key)],
    responses=ERROR_RESPONSES,
    route_class=FastJSONRoute,
)
# vLLM's unprefixed route (`/generative_scoring`, as vLLM 0.24 serves it).
vllm_router = APIRouter(
    dependencies=[Depends(require_api_key)],
    responses=ERROR_RESPONSES,
    route_class=FastJSONRoute,
)
log = logging.getLogger("greenlane.app")  # details beside the one access line


async def _refuse_counts_before_validation(request: Request) -> None:
    """The item and label counts of `/v1/score`, checked on the decoded body before pydantic
    validates it: validating 700k items (a body under the size cap) held the event loop for
    ~130 ms, every stream with it, only to be refused for their number afterwards. Same
    checks, same errors; validation keeps a list a list, so they hold for the validated body
    too. Anything else about the body is left to the validation."""
    if not await request.body():
        return
    try:
        body = await request.json()  # decoded once already: FastAPI read it before this
    except ValueError:
        return  # FastAPI reports it
    if not isinstance(body, dict):
        return
    items = body.get("items")
    if isinstance(items, list):
        check_num_requests(client_of(request), len(items), "items")
    for param in ("labels", "label_token_ids"):
        labels = body.get(param)
        if isinstance(labels, list):
            check_num_labels(engine_of(request), len(labels), param)


def _labels_and_prompts(
    engine: Any, body: ScoreRequest
) -> tuple[tuple[list[int], list[str]], list[list[int]]]:
    """`_label_ids` then `_prompts`, in one call (labels are checked first, as before)."""
    labels = _label_ids(engine, body)
    return labels, _prompts(engine, body)


def _label_ids(engine: Any, body: ScoreRequest) -> tuple[list[int], list[str]]:
    """Label token ids and their display strings; each string label must be one token."""
    if body.label_token_ids is not None:
        ids = list(body.label_token_ids)
        check_token_ids(engine, ids, "label_token_ids")
        return ids, [engine.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    labels = list(body.labels or [])
    ids = []
    for label in labels:
        toks = encode(engine, label)
        if len(toks) != 1:
            raise bad_request(
                f"label {label!r} is {len(toks)} tokens ({toks}); each label must be exactly one "
                "token (try a leading space, or pass label_token_ids)",
                "labels",
                "multi_token_label",
            )
        ids.append(toks[0])
    return ids, labels


def _special_tokens(engine: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text prompt (e.g. ([BOS], []))."""
    bare = encode(engine, "a")
    full = encode(engine, "a", add_special_tokens=True)
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return full[:start], full[start + len(bare) :]
    return [], []  # a post-processor that rewrites the text's own ids: add nothing


def _prompts(engine: Any, body: ScoreRequest) -> list[list[int]]:
    """One token-id prompt per item."""
    items: list[str] | list[list[int]] | None
    items = [body.items] if isinstance(body.items, str) else body.items

    if body.messages is not None:
        query: str | list[int] = chat_prompt_ids(engine, body.messages)
    else:
        assert body.query is not None  # the request model checks this
        query = body.query
        if isinstance(query, list):
            check_token_ids(engine, query, "query")

    special = _special_tokens(engine) if body.messages is None else ([], [])
    if not items:
        prompts = [query if isinstance(query, list) else encode(engine, query, True)]
    else:
        prompts = []
        for item in items:
            if isinstance(item, list):
                check_token_ids(engine, item, "items")
            if isinstance(query, str) and isinstance(item, str):
                text = item + query if body.item_first else query + item
                prompts.append(encode(engine, text, add_special_tokens=True))
                continue
            q_ids = query if isinstance(query, list) else encode(engine, query)
            i_ids = item if isinstance(item, list) else encode(engine, item)
            ids = i_ids + q_ids if body.item_first else q_ids + i_ids
            if isinstance(item if body.item_first else query, str):  # text first: specials
                ids = special[0] + ids + special[1]
            prompts.append(ids)
    for ids in prompts:
        # A score is one forward pass: no output tokens, so only the prompt must fit.
        check_prompt_fits(engine, len(ids), 0, param="items", generate=False)
    return prompts


@dataclass(slots=True)
class _Scored:
    """One scoring call's results: per-item label probabilities and what the engine reported."""

    probs: list[list[float]]
    num_prompt_tokens: int
    num_cached_tokens: int
    server_s: float
    queue_s: list[float]
    ttft_s: list[float]
    e2e_s: list[float]


def _refuse_unknown(body: ScoreRequest | GenerativeScoreRequest) -> None:
    """A field the request does not define is a 400 naming it, never silently dropped (a
    misspelled `apply_softmax` would change every score)."""
    found = unsupported_param(body)
    if found is not None:
        param, message = found
        raise bad_request(message, param, "unsupported_parameter")


async def _run_scoring(
    request: Request,
    engine_base: str,
    prompts: list[list[int]],
    label_ids: list[int],
    apply_softmax: bool,
    cache_salt: str | None,
) -> _Scored:
    """Submit one SCORE engine request per prompt (together, so they batch and share the
    query's prefix) and collect each one's label probabilities, one per `label_ids` entry.
    A label given twice is scored once: with both copies in apply_softmax's softmax each would
    get half its probability; every position then gets that label's own."""
    unique = list(dict.fromkeys(label_ids))
    client = client_of(request)
    if len(prompts) > client.max_in_flight:
        raise bad_request(
            f"{len(prompts)} items exceed this server's limit of {client.max_in_flight} per call",
            "items",
            "too_many_items",
        )
    trace = trace_of(request)
    reqs = [
        EngineRequest(
            request_id=f"{engine_base}-{i}",
            kind=RequestKind.SCORE,
            prompt_token_ids=ids,
            sampling=SamplingParams(max_tokens=1, temperature=0.0),
            label_token_ids=unique,
            apply_softmax=apply_softmax,
            cache_salt=cache_salt,
        )
        for i, ids in enumerate(prompts)
    ]
    await digest_off_loop(request, reqs)
    start_s = time.monotonic()
    results = await until_disconnect(
        request, client.run_all(reqs), settings_of(request).request_timeout_s
    )
    scored = _Scored([], 0, 0, time.monotonic() - start_s, [], [], [])
    for outs in results:
        final = outs[-1]
        if final.finish_reason == "error":
            log.error("engine failed request %s: %s", final.request_id, final.error)
            raise APIError(
                500,
                f"The engine failed request {final.request_id} (the server log has the details)",
                code="engine_error",
            )
        probs = next((o.label_probs for o in reversed(outs) if o.label_probs is not None), None)
        if probs is None:
            if client.draining:
                raise APIError(
                    503, "Request aborted: server is shutting down", code="shutting_down"
                )
            log.error(
                "no label probabilities for request %s (%s: %s)",
                final.request_id,
                final.finish_reason,
                final.error,
            )
            raise APIError(
                500,
                f"The engine returned no label probabilities for request {final.request_id} "
                "(the server log has the details)",
                code="engine_error",
            )
        if len(unique) != len(label_ids):
            column = {t: j for j, t in enumerate(unique)}
            probs = [probs[column[t]] for t in label_ids]
        scored.probs.append(list(probs))
        observe_finished(request, final, 0)
        scored.num_prompt_tokens += max(o.num_prompt_tokens for o in outs)
        scored.num_cached_tokens += max(o.num_cached_tokens for o in outs)
        for src, acc in (
            (final.queue_s, scored.queue_s),
            (final.ttft_s, scored.ttft_s),
            (final.e2e_s, scored.e2e_s),
        ):
            if src is not None:
                acc.append(src)
    trace.num_prompt_tokens = scored.num_prompt_tokens
    trace.num_cached_tokens = scored.num_cached_tokens
    trace.ttft_s = min(scored.ttft_s) if scored.ttft_s else None
    trace.queue_s = min(scored.queue_s) if scored.queue_s else None
    trace.finish_reason = "stop"
    return scored


def _usage(scored: _Scored) -> dict[str, Any]:
    return {
        "prompt_tokens": scored.num_prompt_tokens,
        "completion_tokens": 0,  # a score samples nothing
        "total_tokens": scored.num_prompt_tokens,
        "prompt_tokens_details": {"cached_tokens": scored.num_cached_tokens},
    }


@router.post("/score", dependencies=[Depends(_refuse_counts_before_validation)])
async def score(body: ScoreRequest, request: Request) -> dict[str, Any]:
    """SGLang's response (`scores`, `model`, `usage`, `object`) plus our extensions: `id`,
    the labels and their ids, the top label per item, and per-item engine timings."""
    check_model(request, body.model)
    _refuse_unknown(body)
    engine = engine_of(request)
    # Item and label counts: checked before validation (`_refuse_counts_before_validation`).
    # One hop to the preparation threads for both (a hop costs more than small id checks).
    (label_ids, label_names), prompts = await off_loop(_labels_and_prompts, engine, body)
    request_id, engine_base = begin_request_id(request, "score")
    scored = await _run_scoring(
        request, engine_base, prompts, label_ids, body.apply_softmax, body.cache_salt
    )
    scores = scored.probs
    top = [max(range(len(s)), key=s.__getitem__) for s in scores]
    return {
        "id": request_id,
        "object": "scoring",
        "model": settings_of(request).model_name,
        "scores": scores,
        "usage": _usage(scored),
        # Extensions (not in SGLang's response):
        "label_token_ids": label_ids,
        "labels": label_names,
        "top_labels": [label_names[i] for i in top],
        "top_label_token_ids": [label_ids[i] for i in top],
        "timing": {
            "server_s": scored.server_s,
            "queue_s": scored.queue_s,  # per item: arrival -> first scheduled (engine clock)
            "ttft_s": scored.ttft_s,  # per item: arrival -> probabilities ready
            "e2e_s": scored.e2e_s,
        },
    }


def _generative_prompts(engine: Any, body: GenerativeScoreRequest) -> list[list[int]]:
    """vLLM's construction: the query tokenised on its own (with special tokens unless
    `add_special_tokens` is false), each item without, joined as token ids."""
    if isinstance(body.query, str):
        query = list(
            engine.tokenizer.encode(body.query, add_special_tokens=body.add_special_tokens)
        )
    else:
        query = list(body.query)
        check_token_ids(engine, query, "query")
    prompts = []
    for item in body.items:
        if isinstance(item, str):
            item_ids = encode(engine, item)
        else:
            item_ids = list(item)
            check_token_ids(engine, item_ids, "items")
        ids = item_ids + query if body.item_first else query + item_ids
        check_prompt_fits(engine, len(ids), 0, param="items", generate=False)
        prompts.append(ids)
    return prompts


async def _generative(
    body: GenerativeScoreRequest, request: Request, id_prefix: str
) -> tuple[str, list[int], _Scored]:
    """What both of vLLM's generative-scoring routes do: (the response id, the labels once
    each, the scored items)."""
    check_model(request, body.model)
    _refuse_unknown(body)
    engine = engine_of(request)
    param = body.non_neutral_param()
    if param is not None:
        raise bad_request(
            f"{param}={getattr(body, param)!r} is not supported: generative scores are the raw "
            "next-token probabilities, so only its neutral value is accepted",
            param,
            "unsupported_parameter",
        )
    check_token_ids(engine, body.label_token_ids, "label_token_ids")
    prompts = await off_loop(_generative_prompts, engine, body)
    trace = trace_of(request)
    if body.request_id and not trace.client_request_id:  # X-Request-Id wins, as in vLLM
        trace.client_request_id = f"{id_prefix}-{body.request_id}"
    request_id, engine_base = begin_request_id(request, id_prefix)
    # The response is keyed by token id, so a label given twice is one label (as vLLM, which
    # keys before its softmax).
    labels = list(dict.fromkeys(body.label_token_ids))
    scored = await _run_scoring(
        request, engine_base, prompts, labels, body.apply_softmax, body.cache_salt
    )
    return request_id, labels, scored


def _generative_usage(scored: _Scored) -> dict[str, Any]:
    """vLLM's generative scoring samples one token per item and counts it (both versions)."""
    num_items = len(scored.probs)
    return {
        **_usage(scored),
        "completion_tokens": num_items,
        "total_tokens": scored.num_prompt_tokens + num_items,
    }


@router.post("/generative-scores")
async def generative_scores(body: GenerativeScoreRequest, request: Request) -> dict[str, Any]:
    """vLLM's earlier generative scores: the same engine work as /v1/score, in that version's
    request and response shapes (`results[i].token_probs` keyed by token id as a string)."""
    request_id, labels, scored = await _generative(body, request, "genscore")
    return {
        "id": request_id,
        "object": "generative_score",
        "created": int(time.time()),
        "model": settings_of(request).model_name,
        "results": [
            {
                "index": i,
                "token_probs": {str(t): p for t, p in zip(labels, probs, strict=True)},
            }
            for i, probs in enumerate(scored.probs)
        ],
        "usage": _generative_usage(scored),
    }


@vllm_router.post("/generative_scoring")
async def generative_scoring(body: GenerativeScoreRequest, request: Request) -> dict[str, Any]:
    """vLLM 0.24's generative scoring: the same request, `data[i].score` the first label's
    probability (softmax over the labels by default)."""
    request_id, _, scored = await _generative(body, request, "generative-scoring")
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": settings_of(request).model_name,
        "data": [
            {"index": i, "object": "score", "score": probs[0]}
            for i, probs in enumerate(scored.probs)
        ],
        "usage": _generative_usage(scored),
    }
