"""The request and its outputs, as they flow front end -> engine core -> front end.

The front end builds a `Request` (token ids and sampling parameters) and sends it to the
engine core. The engine answers with `EngineOutput`s: token ids, logprobs, label
probabilities, finish reasons, counts and timings - never text. The front end's output
processor (runtime/core/output_processor.py) turns them into `RequestOutput`s with text,
applying stop strings. Once added, the engine thread is the only writer of a request's
mutable fields.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import msgspec


class RequestKind(enum.StrEnum):
    SCORE = "score"  # prefill-only: one forward, label-token probabilities, no decode
    GENERATE = "generate"  # chat / completions: prefill then decode


class RequestStatus(enum.IntEnum):
    WAITING = 0  # in the prefill queue (also after preemption)
    RUNNING = 1  # holds KV blocks; prefilling or decoding (phase derives from counters)
    # Everything after RUNNING is finished: `is_finished` is one comparison.
    FINISHED_STOPPED = 2  # EOS, a stop token or a stop string
    FINISHED_LENGTH = 3  # max_tokens reached
    FINISHED_ABORTED = 4  # client went away, shutdown, or explicit abort
    FINISHED_ERROR = 5  # an exception while running this request (others keep running)

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.RUNNING


FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True)
class SamplingParams:
    """How to pick output tokens. temperature == 0 means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k limit
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the output)
    stop_token_ids: list[int] = field(default_factory=list)  # besides the model's EOS ids
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token + top-k alternatives
    # Prompt logprobs (completions `echo` + `logprobs`): None = none; k >= 0: each prompt
    # token's logprob (the first has none) + top-k alternatives, computed in the prefill.
    prompt_logprobs: int | None = None
    # Applied on the device to the logits before sampling (OpenAI / vLLM semantics):
    presence_penalty: float = 0.0  # minus this for every token already generated
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    repetition_penalty: float = 1.0  # prompt + output tokens: logit / p if > 0 else * p
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to logit
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the top one's
    # vLLM / SGLang: no stop token (EOS unless ignore_eos, stop_token_ids) is sampled, and no
    # stop string ends the text, before this many output tokens.
    min_tokens: int = 0
    # Text only (the output processor; the engine deals in token ids), vLLM's extensions:
    skip_special_tokens: bool = True  # special tokens' text left out of the output text
    include_stop_str_in_output: bool = False  # a matched stop string ends the text, kept
    # Structured outputs: an llguidance grammar (JSON text, runtime/sampling/structured.py) every
    # sampled token must keep valid; None: unconstrained.
    grammar: str | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


@dataclass(slots=True)
class Request:
    """A scoring or generation request.

    Phase is derived from counters, never stored: a request is prefilling while
    `num_computed_tokens < num_prompt_tokens`, decoding afterwards.
    """

    request_id: str
    kind: RequestKind
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    label_token_ids: list[int] = field(default_factory=list)  # SCORE only
    apply_softmax: bool = True  # SCORE only: softmax over the label set, else full-vocab probs
    arrival_s: float = field(default_factory=time.monotonic)
    # Chain digests of the prompt's full blocks (runtime/kv/prefix_cache.py) when the API
    # server computed them, off the engine thread; empty: the scheduler computes them.
    block_hashes: list[bytes] = field(default_factory=list)
    # Requests with different salts share no prefix-cache block (vLLM's `cache_salt`); the
    # digests above are computed under it.
    cache_salt: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV exists or is being computed by a launched step
    # Tokens sampled by launched steps whose values the host has not seen yet (overlapped
    # scheduling: step N+1 is planned before step N's tokens reach the host).
    num_output_placeholders: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at admission (for usage and metrics)
    num_preemptions: int = 0
    first_token_s: float | None = (
        None  # engine clock (time.monotonic) when the first token was produced
    )
    finish_s: float | None = None
    error: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_total_tokens(self) -> int:
        """Known tokens plus those sampled on the device and not yet seen by the host."""
        return (
            len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_output_placeholders
        )

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def wait_s(self) -> float:
        return time.monotonic() - self.arrival_s


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []  # (token_id, logprob), best first


class EngineOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the engine core sends back for one request after a step: token ids, never text.

    For GENERATE: `new_token_ids` is the delta since the last output. For SCORE:
    `label_probs` holds one probability per `label_token_ids` entry. `finished` is set on
    the last output; `finish_reason` is "stop" (EOS or a stop token), "length", "abort" or
    "error". Timings use the engine's monotonic clock (system-wide on Linux).
    """

    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: list[TokenLogprob] = []
    label_probs: list[float] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first output only
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    queue_s: float | None = None  # arrival -> first scheduled
    ttft_s: float | None = None  # arrival -> first token / probabilities
    e2e_s: float | None = None  # arrival -> finish (final output)
    prefill_s: float | None = None  # first scheduled -> first token (final output)
    decode_s: float | None = None  # first token -> finish (final output)


@dataclass(slots=True)
class RequestOutput:
    """What a route receives for one request: an `EngineOutput` with its text, made by the
    front end's output processor (detokenized, stop strings applied).

    For GENERATE: `new_token_ids` and `new_text` are the delta since the last output.
    For SCORE: `label_probs` holds one probability per `label_token_ids` entry.
    `finished` is set on the last output of a request; `finish_reason` is one of
    "stop", "length", "abort", "error".
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    label_probs: list[float] | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    # Prompt logprobs (first output only, when asked): one entry per prompt token, None first.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    queue_s: float | None = None  # arrival -> first scheduled
    ttft_s: float | None = None  # arrival -> first token (engine clock)
    e2e_s: float | None = None  # arrival -> finish (engine clock)
    prefill_s: float | None = None  # first scheduled -> first token (final output only)
    decode_s: float | None = None  # first token -> finish (final output only)
