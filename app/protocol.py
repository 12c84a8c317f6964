"""Pydantic wire models: OpenAI chat/completions/models and the SGLang-style /v1/score.

Requests ignore unknown fields (the `openai` client sends extras such as `user`), but every field
we read is validated: types, ranges and fixed counts here, before any tokenising; vocabulary,
context and per-server counts in the routes (they need the engine; `app/limits.py`). Text
fields are `Text`: valid Unicode (JSON's `"\ud800"` is a lone surrogate, which no tokenizer
can encode). Token ids are `TokenId`: JSON integers only (`false` is not token 0). Responses are
plain models serialised with `model_dump(exclude_none=...)` where OpenAI omits empty fields.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    field_validator,
    model_validator,
)

MAX_LOGPROBS = 20  # OpenAI caps top logprobs at 20
MAX_STOP_STRINGS = 16
# A stop string is held back from the stream until it cannot be the start of a stop string,
# so a long one delays streaming by as many characters; 256 covers any real stop sequence.
MAX_STOP_CHARS = 256
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64-bit seeds
MAX_TOP_K = 2**31 - 1  # top_k >= the vocabulary means no limit; beyond int32 is a mistake


def _valid_unicode(value: str) -> str:
    # JSON can carry lone surrogates ("\ud800"); they are not text and no tokenizer takes
    # them. encode() is the fastest check (C); the message does not echo the value.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"text contains an unpaired UTF-16 surrogate at character {exc.start}"
        ) from None
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]
TokenId = StrictInt  # range checked against the vocabulary in the routes


class _Request(BaseModel):
    # strict: JSON types as the spec says them (`true` is not 1, `"5"` is not 5; an integer is
    # still a valid float). Unknown fields are ignored (clients send extras such as `user`).
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class ContentPart(_Request):
    type: Text
    text: Text | None = None


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None

    def text(self) -> str:
        """The message as plain text; only text parts are supported."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"only text content parts are supported, got type {part.type!r}")
            texts.append(part.text)
        return "".join(texts)


class _SamplingFields(_Request):
    """The sampling knobs chat and completions share."""

    model: Text | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)  # -1 or 0: no limit
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: Text | list[Text] | None = None
    n: int = Field(1, ge=1, le=1)  # one choice per prompt; n > 1 is not supported
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)  # accepted, not applied
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)  # accepted, not applied

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        for s in [v] if isinstance(v, str) else v or []:
            if s == "":
                raise ValueError("stop strings must be non-empty")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @property
    def max_output_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


Prompt = Text | list[TokenId] | list[Text] | list[list[TokenId]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @property
    def num_prompts(self) -> int:
        """How many prompts (engine requests) this call asks for."""
        p = self.prompt
        return len(p) if isinstance(p, list) and p and not isinstance(p[0], int) else 1


class ScoreRequest(_Request):
    """SGLang-compatible scoring request, plus chat `messages` and label strings."""

    model: Text | None = None
    query: Text | list[TokenId] | None = None
    items: Text | list[Text] | list[list[TokenId]] | None = None
    label_token_ids: list[TokenId] | None = None
    labels: list[Text] | None = None
    apply_softmax: bool = True
    item_first: bool = False
    messages: list[ChatMessage] | None = None

    @model_validator(mode="after")
    def _check(self) -> ScoreRequest:
        if (self.label_token_ids is None) == (self.labels is None):
            raise ValueError("give exactly one of label_token_ids or labels")
        num_labels = len(
            self.label_token_ids if self.label_token_ids is not None else self.labels or []
        )
        if num_labels == 0:
            raise ValueError("at least one label is required")
        if self.messages is not None:
            if self.query is not None:
                raise ValueError("give either query or messages, not both")
            if len(self.messages) == 0:
                raise ValueError("messages must not be empty")
        elif self.query is None:
            raise ValueError("query (or messages) is required")
        if isinstance(self.items, list) and len(self.items) == 0:
            raise ValueError("items must not be empty")
        return self


# ----------------------------------------------------------------------------- responses


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None  # {"cached_tokens": n}


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "greenlane"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details={"cached_tokens": cached_tokens},
    ).model_dump()
