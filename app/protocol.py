"""Pydantic wire models: OpenAI chat/completions/models and the SGLang-style /v1/score.

Every field we read is validated: types, ranges and fixed counts here, before any tokenising;
vocabulary, context and per-server counts in the routes (they need the engine; `app/limits.py`).
Text fields are `Text`: valid Unicode (JSON's `"\ud800"` is a lone surrogate, which no tokenizer
can encode). Token ids are `TokenId`: JSON integers only (`false` is not token 0). Chat and
completions never ignore a parameter silently: the ones we do not implement, and unknown ones,
are kept (`extra="allow"`) so that the route can answer a 400 naming them (`unsupported_param`,
the table in README "OpenAI parameters"). Responses are plain dicts shaped like OpenAI's.
"""

from __future__ import annotations

import re
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
# The sampler divides float32 logits by the temperature: below ~1e-37 they overflow to inf and
# it samples garbage. A temperature under this is sampled as its limit, greedy (vLLM's
# _SAMPLING_EPS: the same rule), which it already is to float precision.
GREEDY_BELOW_TEMPERATURE = 1e-5
# The repetition penalty divides (or multiplies) logits too: near 0 they overflow the same way.
# 0.01 already makes a seen token's logit 100 times larger; nothing below it means more.
MIN_REPETITION_PENALTY = 0.01
_TOKEN_ID_KEY = re.compile(r"\s*-?[0-9]+\s*")  # a logit_bias key: a token id as a string
# vLLM's `request_id` body field becomes the response's id and X-Request-Id header: the same
# characters as an X-Request-Id the server takes (app/logs.py), none that breaks a header.
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:/+=@-]{1,128}$"


class ParamError(ValueError):
    """A model-level check's failure that one parameter is to blame for: pydantic locates such
    an error at the model itself, so the 400 would name no `param`; app/errors.py reads this one's
    `param` instead."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


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
MAX_CHOICES = 16  # n: each choice is an engine request (the prompt's KV is shared via the cache)
# vLLM's `cache_salt`: requests share prefix-cache blocks only with requests of the same salt
# (runtime/kv/prefix_cache.py, `salt_digest`), so a tenant cannot probe another's prompts by
# their latency. Any non-empty text, as vLLM (digested once a request: its length costs little).
CacheSalt = Annotated[Text, Field(min_length=1)]


class _Request(BaseModel):
    # strict: JSON types as the spec says them (`true` is not 1, `"5"` is not 5; an integer is
    # still a valid float). Unknown fields are ignored (clients send extras such as `user`).
    model_config = ConfigDict(extra="ignore", strict=True)


class JsonSchemaFormat(_Request):
    """OpenAI's `response_format.json_schema`. `strict` is accepted either way: the schema is
    always enforced, token by token (runtime/sampling/structured.py)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(..., min_length=1, max_length=64)
    # OpenAI shows it to the model; no chat template has a place for it, so it would be
    # accepted and ignored: a 400 instead (the schema's own "description"s stay in the schema).
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None

    @field_validator("description")
    @classmethod
    def _no_description(cls, v: str | None) -> str | None:
        if v:
            raise ValueError(
                "json_schema.description is not shown to the model by this server: leave it "
                "out (descriptions inside the schema are fine)"
            )
        return v


class ResponseFormat(_Request):
    """OpenAI's `response_format`: free text, any JSON object, or JSON under a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format has json_schema exactly when its type is json_schema")
        return self

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs` extension: exactly one constraint (runtime/sampling/structured.py
    `compile_structured_outputs` checks which and how)."""

    model_config = ConfigDict(extra="forbid")

    # Text: a lone surrogate reaches no grammar compiler (it cannot be encoded): a 400 here.
    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = Field(None, max_length=1024)
    grammar: Text | None = None
    json_object: bool | None = None
    # vLLM's "do not fall back to another backend": there is only one backend, llguidance.
    disable_fallback: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class StreamOptions(_Request):
    model_config = ConfigDict(extra="forbid")  # a stream option we do not know is a 400

    include_usage: bool = False
    # vLLM's extension: usage (the choice's completion tokens so far) in every chunk, so that a
    # client can tell how many tokens a chunk carries (a token without text sends no chunk of
    # its own: a partial UTF-8 sequence, a special token). Needs include_usage, as in vLLM.
    continuous_usage_stats: bool = False
    # Obfuscation pads chunks against length side channels; we send no padding field, which
    # clients ignore either way, so both values are accepted.
    include_obfuscation: bool | None = None

    @model_validator(mode="after")
    def _continuous_needs_usage(self) -> StreamOptions:
        # (Here, not on the request: the 400 then names `stream_options`.)
        if self.continuous_usage_stats and not self.include_usage:
            raise ParamError(
                "continuous_usage_stats", "continuous_usage_stats needs include_usage=true"
            )
        return self


class ContentPart(_Request):
    # A text part's unknown fields that ask for something are a 400, as a message's are.
    # `cache_control` (a prompt-cache breakpoint some clients add) asks for what the prefix
    # cache does for every prompt anyway. Other part types are refused by `ChatMessage.text`.
    model_config = ConfigDict(extra="allow")

    type: Text
    text: Text | None = None
    cache_control: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _no_unknown_fields(self) -> ContentPart:
        if self.type == "text":
            for key, value in (self.model_extra or {}).items():
                if value not in (None, "", [], {}):
                    raise ValueError(f"text content part field {key!r} is not supported")
        return self


class ChatMessage(_Request):
    # Message fields we do not know reach no template: one that asks for something is a 400
    # (`_no_unknown_fields`); empty ones pass (the OpenAI SDK's message objects, appended back
    # to the history, carry `refusal: null`, `audio: null`, `annotations: []`, ...).
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    # An assistant turn's tool calls and a tool turn's answer to one, from a history: handed
    # to the chat template as they are (as vLLM does); whether it shows them is the template's.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: Text | None = None

    @model_validator(mode="after")
    def _no_unknown_fields(self) -> ChatMessage:
        for key, value in (self.model_extra or {}).items():
            if value not in (None, "", [], {}):
                raise ValueError(f"message field {key!r} is not supported")
        return self

    def text(self) -> str:
        """The message as plain text; only text parts are supported. Text parts are joined by
        a newline (as vLLM renders them: "Say" and "hi" must not read "Sayhi")."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"only text content parts are supported, got type {part.type!r}")
            if part.text is None:
                raise ValueError("a text content part needs its text (a string)")
            texts.append(part.text)
        return "\n".join(texts)

    def template_fields(self) -> dict[str, Any]:
        """What the chat template gets beyond role and content: the fields that were set."""
        out: dict[str, Any] = {}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class _SamplingFields(_Request):
    """The sampling knobs chat and completions share."""

    model: Text | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)  # -1 or 0: no limit
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: Text | list[Text] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices per prompt (seeds seed + i)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # vLLM/SGLang extension
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=10.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # vLLM/SGLang extension
    stop_token_ids: list[int] | None = Field(None, max_length=64)  # vLLM/SGLang extension
    skip_special_tokens: bool = True  # vLLM extension: special tokens' text left out
    min_tokens: int = Field(0, ge=0)  # vLLM/SGLang extension: no stop before this many tokens
    include_stop_str_in_output: bool = False  # vLLM extension: a matched stop string kept
    response_format: ResponseFormat | None = None  # structured outputs (JSON, JSON schema)
    structured_outputs: StructuredOutputs | None = None  # vLLM extension: json / regex / ...
    # Accepted with no effect on the output by OpenAI's own definition (identification, billing
    # and cache-routing hints); listed so they are not "unknown".
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    cache_salt: CacheSalt | None = None  # vLLM extension: a prefix-cache namespace

    model_config = ConfigDict(extra="allow")  # see `unsupported_param`

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > 300:
            raise ValueError("at most 300 logit_bias entries")
        keys: dict[int, str] = {}
        for key, bias in v.items():
            # ASCII digits only: str.isdigit() also takes "²", which int() refuses
            if _TOKEN_ID_KEY.fullmatch(key) is None:
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
            # "5", "05" and " 5" are one token: the later bias would silently replace the other
            token_id = int(key)
            if token_id in keys:
                raise ValueError(
                    f"logit_bias keys {keys[token_id]!r} and {key!r} are the same token id "
                    f"{token_id}: give it once"
                )
            keys[token_id] = key
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return v

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): float(b) for k, b in (self.logit_bias or {}).items()}

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

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed with stream=true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk (`stream_options.continuous_usage_stats`)."""
        opts = self.stream_options
        return self.include_usage and opts is not None and opts.continuous_usage_stats


# chat_template_kwargs may not set what the server passes the template itself (the top-level
# field, or a feature it does not implement).
_RESERVED_TEMPLATE_KWARGS = {
    "messages": "it is the request's messages",
    "add_generation_prompt": "use the request's add_generation_prompt",
    "tools": "use the request's tools",
    "documents": "documents are not supported",
}
MAX_TEMPLATE_KWARGS = 32


def check_continuation(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """vLLM's rule: a prompt cannot both open an assistant turn and continue the last one."""
    if add_generation_prompt and continue_final_message:
        raise ParamError(
            "continue_final_message",
            "continue_final_message needs add_generation_prompt false (the prompt cannot both "
            "open a new assistant turn and continue the last message)"
        )


def check_template_kwargs(v: dict[str, Any] | None) -> dict[str, Any] | None:
    """`chat_template_kwargs` as a validator: bounded, template names only, none reserved."""
    if v is None:
        return v
    if len(v) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"at most {MAX_TEMPLATE_KWARGS} chat_template_kwargs")
    for key in v:
        why = _RESERVED_TEMPLATE_KWARGS.get(key)
        if why is not None:
            raise ValueError(f"chat_template_kwargs may not set {key!r}: {why}")
        if not key.isidentifier():
            raise ValueError(f"chat_template_kwargs keys are template names, got {key!r}")
    return v


class FunctionDef(_Request):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (default: an empty object)
    strict: bool | None = None  # either way: the schema is enforced (app/tool_calls.py)


class Tool(_Request):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class _FunctionName(_Request):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(_Request):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: _FunctionName


MAX_TOOLS = 128


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's template extensions: false ends the prompt after the last message (no assistant
    # turn opened); variables for the chat template (e.g. Qwen3's {"enable_thinking": false}).
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the prompt ends inside the last message
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool calls forced by a grammar: a named function or "required" (app/tool_calls.py).
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs=true")
        check_continuation(self.add_generation_prompt, self.continue_final_message)
        return self

    _template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)

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
    # 0 is allowed: with `echo` and `logprobs` it asks only for the prompt's token logprobs
    # (lm-evaluation-harness' loglikelihood requests); the engine finishes after the prefill.
    max_tokens: int = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt's text (and, with logprobs, its token logprobs) first
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)  # only = n (see the README)

    @property
    def num_prompts(self) -> int:
        """How many prompts (engine requests) this call asks for."""
        p = self.prompt
        return len(p) if isinstance(p, list) and p and not isinstance(p[0], int) else 1


# Parameters of OpenAI's chat/completions APIs that we do not implement, with the values that
# mean "off" (accepted, since they ask for nothing). Any other value is a 400 naming the
# parameter. Parameters not listed here nor declared on the request models are unknown: a 400.
_NOT_IMPLEMENTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": ((None, []), "the deprecated functions API: send tools"),
    "function_call": ((None, "none"), "the deprecated functions API: send tool_choice"),
    "suffix": ((None, ""), "suffix (insertion) is not supported"),
    # vLLM's names before 0.12, which replaced them by `structured_outputs` (as we do).
    "guided_json": ((None,), "send structured_outputs: {'json': ...} (vLLM 0.12+)"),
    "guided_regex": ((None,), "send structured_outputs: {'regex': ...} (vLLM 0.12+)"),
    "guided_choice": ((None,), "send structured_outputs: {'choice': [...]} (vLLM 0.12+)"),
    "guided_grammar": ((None,), "send structured_outputs: {'grammar': ...} (vLLM 0.12+)"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only the text modality is supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "reasoning_effort": ((None,), "reasoning_effort is not supported"),
    "verbosity": ((None,), "verbosity is not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "store": ((None, False), "stored completions are not supported"),
    "service_tier": ((None, "auto", "default"), "only the default service tier exists"),
}


def unsupported_param(body: BaseModel) -> tuple[str, str] | None:
    """(parameter, message) for the first parameter of `body` we would otherwise ignore: a
    known-but-not-implemented one set to a value that asks for something, or an unknown one."""
    for name, value in (body.model_extra or {}).items():
        spec = _NOT_IMPLEMENTED.get(name)
        if spec is None:
            return name, f"unknown parameter {name!r}: this server does not implement it"
        accepted, why = spec
        if not any(value == ok for ok in accepted):
            return name, f"{name}={value!r} is not supported: {why}"
    return None


class ScoreRequest(_Request):
    """SGLang's `/v1/score` request, with its defaults (`apply_softmax` false: each label's
    probability over the whole vocabulary), plus two extensions: label strings (`labels`, each
    one token) and chat `messages` in the query's place."""

    model: Text | None = None
    query: Text | list[TokenId] | None = None
    items: Text | list[Text] | list[list[TokenId]] | None = None
    label_token_ids: list[TokenId] | None = None
    labels: list[Text] | None = None  # extension
    apply_softmax: bool = False  # SGLang's default; true: softmax over the labels only
    item_first: bool = False
    messages: list[ChatMessage] | None = None  # extension
    cache_salt: CacheSalt | None = None  # vLLM extension: a prefix-cache namespace
    user: str | None = None  # no effect on the scores (identification; replica affinity)

    # Unknown fields are kept so that the route can answer a 400 naming them.
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="after")
    def _check(self) -> ScoreRequest:
        if (self.label_token_ids is None) == (self.labels is None):
            raise ValueError("give exactly one of label_token_ids or labels")
        given = self.label_token_ids if self.label_token_ids is not None else self.labels
        label_param = "label_token_ids" if self.label_token_ids is not None else "labels"
        num_labels = len(given or [])
        if num_labels == 0:
            raise ParamError(label_param, "at least one label is required")
        if self.messages is not None:
            if self.query is not None:
                raise ParamError("messages", "give either query or messages, not both")
            if len(self.messages) == 0:
                raise ParamError("messages", "messages must not be empty")
        elif self.query is None:
            raise ParamError("query", "query (or messages) is required")
        if isinstance(self.items, list) and len(self.items) == 0:
            raise ParamError("items", "items must not be empty")
        return self


class GenerativeScoreRequest(_Request):
    """vLLM's generative-scoring request (`/v1/generative-scores`, `/generative_scoring`). Its
    sampling knobs do not change next-token probabilities there either; we accept only their
    neutral values so none is ignored."""

    model: Text | None = None
    query: Text | list[int]
    items: list[Text] | list[list[int]] = Field(..., min_length=1)
    label_token_ids: list[int] = Field(..., min_length=1)
    apply_softmax: bool = True  # vLLM's default (SGLang's /v1/score defaults to false)
    item_first: bool = False
    add_special_tokens: bool = True  # for a text query; items never get special tokens
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    priority: int = 0
    request_id: str | None = Field(None, pattern=REQUEST_ID_PATTERN)
    cache_salt: CacheSalt | None = None  # a prefix-cache namespace, as in vLLM
    user: str | None = None  # no effect on the scores (identification; replica affinity)

    # Unknown fields are kept so that the route can answer a 400 naming them.
    model_config = ConfigDict(extra="allow", strict=True)

    def non_neutral_param(self) -> str | None:
        """The first knob set to a value that would change probabilities in a sampler (they
        come from the raw next-token logits here), or None."""
        neutral = {
            "temperature": self.temperature in (None, 0.0, 1.0),
            "top_k": self.top_k in (None, 0, -1),
            "top_p": self.top_p in (None, 1.0),
            "priority": self.priority == 0,
        }
        return next((name for name, ok in neutral.items() if not ok), None)


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
