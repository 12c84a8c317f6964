"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize, GET /tokenizer_info.

Same request and response shapes as vLLM's, so clients that tokenize through the server
(lm-evaluation-harness' remote tokenizer, for one) work unchanged. Behind the API key, like
/v1/*: they expose the model's vocabulary.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from pydantic import ConfigDict, Field, field_validator, model_validator

from app.common import (
    chat_prompt_ids,
    check_model,
    check_token_ids,
    engine_of,
    off_loop,
    require_api_key,
    settings_of,
)
from app.errors import ERROR_RESPONSES, bad_request
from app.json_body import FastJSONRoute
from app.protocol import (
    MAX_TOOLS,
    ChatMessage,
    Text,
    Tool,
    _Request,
    check_continuation,
    check_template_kwargs,
    unsupported_param,
)

router = APIRouter(
    dependencies=[Depends(require_api_key)], responses=ERROR_RESPONSES, route_class=FastJSONRoute
)


class TokenizeRequest(_Request):
    """vLLM's two shapes in one: a text `prompt` (special tokens added by default), or chat
    `messages` rendered with the model's template (no extra special tokens by default)."""

    # Unknown fields are kept so that the route can answer a 400 naming them (a misspelled
    # `add_special_tokens` would change the count silently).
    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the tools the chat template shows (as chat shows them unless tool_choice "none")
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    return_token_strs: bool = False

    # The same checks as chat's (reserved names, a bounded number of template variables).
    _template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        check_continuation(self.add_generation_prompt, self.continue_final_message)
        return self


class DetokenizeRequest(_Request):
    model_config = ConfigDict(extra="allow")  # unknown fields: a 400 naming them

    model: Text | None = None
    tokens: list[int]


def _refuse_unknown(body: TokenizeRequest | DetokenizeRequest) -> None:
    found = unsupported_param(body)
    if found is not None:
        param, message = found
        raise bad_request(message, param, "unsupported_parameter")


_JSON_CHUNK = 1 << 14  # list items serialised per json.dumps call (each holds the GIL)


def _dumps(value: Any) -> str:
    """Compact JSON; a list in slices, so the thread writing a long prompt's ids gives the
    GIL back to the event loop between them (one json.dumps call never does)."""
    if not isinstance(value, list) or len(value) <= _JSON_CHUNK:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    parts = (_dumps(value[i : i + _JSON_CHUNK])[1:-1] for i in range(0, len(value), _JSON_CHUNK))
    return "[" + ",".join(parts) + "]"


def _json(content: dict[str, Any]) -> Response:
    """A JSON response serialised by the caller, on a preparation thread: a long prompt's ids
    through FastAPI's encoder held the event loop (every stream on the server) for seconds."""
    body = "{" + ",".join(f"{_dumps(k)}:{_dumps(v)}" for k, v in content.items()) + "}"
    return Response(body.encode("utf-8"), media_type="application/json")


def _token_str(engine: Any, token_id: int) -> str:
    piece = getattr(engine.tokenizer, "id_to_token", None)
    text = piece(token_id) if callable(piece) else None
    return text if text is not None else engine.tokenizer.decode([token_id], False)


def _tokenize(engine: Any, body: TokenizeRequest) -> Response:
    """The /tokenize answer, on a preparation thread (tokenising a long prompt and writing its
    ids as JSON take seconds: not on the event loop)."""
    if body.messages is not None:
        kwargs = body.chat_template_kwargs
        if body.tools:
            kwargs = {
                **(kwargs or {}),
                "tools": [t.model_dump(exclude_none=True) for t in body.tools],
            }
        tokens = chat_prompt_ids(
            engine,
            body.messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            template_kwargs=kwargs,
        )
        bos = getattr(engine.tokenizer, "bos_token_id", None)
        if body.add_special_tokens and bos is not None and tokens[:1] != [bos]:
            tokens = [bos, *tokens]
    else:
        if body.tools:  # (an empty list asks for nothing, as in chat)
            raise bad_request("tools are shown by the chat template: send messages", "tools")
        add = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = list(engine.tokenizer.encode(body.prompt or "", add_special_tokens=add))
    out: dict[str, Any] = {
        "count": len(tokens),
        "max_model_len": int(engine.max_model_len),
        "tokens": tokens,
    }
    if body.return_token_strs:
        out["token_strs"] = [_token_str(engine, t) for t in tokens]
    return _json(out)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    check_model(request, body.model)
    _refuse_unknown(body)
    return await off_loop(_tokenize, engine_of(request), body)


def _detokenize(engine: Any, tokens: list[int]) -> Response:
    check_token_ids(engine, tokens, "tokens")
    return _json({"prompt": engine.tokenizer.decode(tokens, skip_special_tokens=False)})


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    check_model(request, body.model)
    _refuse_unknown(body)
    return await off_loop(_detokenize, engine_of(request), body.tokens)


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict[str, Any]:
    """What vLLM's endpoint returns that a client needs: the special tokens, the chat
    template and the context length."""
    engine = engine_of(request)
    tok = engine.tokenizer
    special = dict(getattr(tok, "special_tokens", {}) or {})
    eos_ids = list(engine.model_config.eos_token_ids or [])
    if special.get("eos_token") is None and eos_ids:
        special["eos_token"] = tok.decode([eos_ids[0]], skip_special_tokens=False)
    return {
        "tokenizer_class": type(tok).__name__,
        "model": settings_of(request).model_name,
        "model_max_length": int(engine.max_model_len),
        "vocab_size": int(engine.model_config.vocab_size),
        "bos_token": special.get("bos_token"),
        "eos_token": special.get("eos_token"),
        "pad_token": special.get("pad_token"),
        "unk_token": special.get("unk_token"),
        "chat_template": getattr(tok, "chat_template", None),
    }
