"""Pydantic wire models: OpenAI chat/completions/models and the SGLang-style /v1/score.

Requests ignore unknown fields (the `openai` client sends extras such as `user`), but every field
we read is validated: ranges here, vocabulary and context limits in the routes (they need the
engine). Responses are plain models serialised with `model_dump(exclude_none=...)` where OpenAI
omits empty fields.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_LOGPROBS = 20  # OpenAI caps top logprobs at 20


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

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

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: no limit
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)  # one choice per prompt; n > 1 is not supported
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)  # accepted, not applied
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)  # accepted, not applied

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list):
            if len(v) > 16:
                raise ValueError("at most 16 stop strings")
            if any(s == "" for s in v):
                raise ValueError("stop strings must be non-empty")
        elif v == "":
            raise ValueError("stop string must be non-empty")
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


Prompt = str | list[int] | list[str] | list[list[int]]


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


class ScoreRequest(_Request):
    """SGLang-compatible scoring request, plus chat `messages` and label strings."""

    model: str | None = None
    query: str | list[int] | None = None
    items: str | list[str] | list[list[int]] | None = None
    label_token_ids: list[int] | None = None
    labels: list[str] | None = None
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
