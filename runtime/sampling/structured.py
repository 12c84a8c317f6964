"""Structured outputs: a grammar that every sampled token of a request must keep valid.

A request's `SamplingParams.grammar` is an llguidance grammar (JSON text) that the front end
compiled from the API's `response_format` (`compile_response_format`) or vLLM's
`structured_outputs` (`compile_structured_outputs`), checked there so a bad schema, regex or
grammar is a 400 before anything is queued. On the engine side `GrammarMasks` keeps one
llguidance matcher per such request, advances it over the request's output tokens, and fills
the bitmask of the tokens allowed next; the runner turns the bitmask into -inf logits before
sampling. The matcher allows EOS only where the grammar may end, and only EOS once it must.

A mask needs every token before it on the host. Under overlapped scheduling a constrained
request is planned again while its previous sample is still in flight (at most one:
`runtime.scheduler.MAX_GRAMMAR_SAMPLES_AHEAD`); the runner, after enqueueing the step's
forward, waits for that one token before it fills the mask (`ModelRunner._grammar_masks`),
so the request decodes every step, and the device runs the forward meanwhile. A request whose
in-flight token ended it gets one more (surplus) sample, which the scheduler drops; its
matcher, stopped, allows only EOS then.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

log = logging.getLogger("greenlane.structured")

# JSON compile options: one-line JSON ("," and ":" with no optional whitespace). With flexible
# whitespace a small model can emit newlines and spaces until max_tokens, and OpenAI's outputs
# are compact JSON too.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The `response_format` cannot be compiled into a grammar (the message says why)."""


def compile_response_format(response_format: dict[str, Any]) -> str | None:
    """OpenAI's `response_format` -> an llguidance grammar (None for `{"type": "text"}`).

    `{"type": "json_object"}`: any JSON object. `{"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}, "strict": ...}}`: JSON valid under the schema (`strict`
    changes nothing: the schema is always enforced). Raises GrammarError naming the problem."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema: dict[str, Any] = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise GrammarError("response_format json_schema needs a 'json_schema' object")
        schema_value = spec.get("schema", {"type": "object"})
        if not isinstance(schema_value, dict):
            raise GrammarError("response_format json_schema.schema must be a JSON object")
        schema = schema_value
    else:
        raise GrammarError(
            f"response_format type {kind!r} is not supported (text, json_object, json_schema)"
        )
    try:
        return _checked(_json_grammar(schema))
    except GrammarError as e:
        raise GrammarError(f"response_format schema: {str(e).removeprefix('schema: ')}") from e


def grammar_conflict(sampling: Any) -> str | None:
    """Why a grammar cannot go with these sampling parameters (None: it can). The grammar ends
    a request with EOS: `ignore_eos` would run it past the grammar's end, and `min_tokens`
    could forbid the only token the grammar allows."""
    if sampling.ignore_eos:
        return "structured outputs cannot be combined with ignore_eos"
    if sampling.min_tokens:
        return "structured outputs cannot be combined with min_tokens"
    return None


# vLLM's `structured_outputs` keys, each a kind of constraint (exactly one per request).
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def compile_structured_outputs(spec: dict[str, Any]) -> str:
    """vLLM's `structured_outputs` (its extension, since 0.12; `guided_*` before) -> an
    llguidance grammar: `json` (a JSON schema, or its text), `regex`, `choice` (the output is
    exactly one of the strings), `grammar` (Lark, or GBNF as llama.cpp / xgrammar write it),
    `json_object: true`. Exactly one of them; raises GrammarError naming the problem."""
    given = [k for k in STRUCTURED_OUTPUT_KINDS if spec.get(k) not in (None, False)]
    if len(given) != 1:
        raise GrammarError(
            f"structured_outputs takes exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}; "
            f"got {', '.join(given) or 'none'}"
        )
    kind = given[0]
    value = spec[kind]
    if kind == "json_object":
        if value is not True:
            raise GrammarError("structured_outputs.json_object must be true")
        return _checked(_json_grammar({"type": "object"}))
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise GrammarError(f"structured_outputs.json is not JSON: {e}") from e
        if not isinstance(value, dict):
            raise GrammarError("structured_outputs.json must be a JSON schema object")
        return _checked(_json_grammar(value))
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise GrammarError("structured_outputs.choice must be a list of non-empty strings")
        return _checked(
            llguidance.LLMatcher.grammar_from_regex("(?:" + "|".join(map(re.escape, value)) + ")")
        )
    if not isinstance(value, str) or not value:
        raise GrammarError(f"structured_outputs.{kind} must be a non-empty string")
    if kind == "regex":
        return _checked(llguidance.LLMatcher.grammar_from_regex(value))
    try:
        lark = any_to_lark(value)
    except GbnfToLarkError as e:
        raise GrammarError(f"structured_outputs.grammar: {e}") from e
    return _checked(llguidance.LLMatcher.grammar_from_lark(lark))


def _json_grammar(schema: dict[str, Any]) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults=_JSON_OPTIONS
        )
    except (ValueError, TypeError) as e:
        raise GrammarError(f"schema: {e}") from e


_BYTES: llguidance.LLTokenizer | None = None  # a byte-level tokenizer (262 tokens), built once


def _checked(grammar: str) -> str:
    global _BYTES
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise GrammarError(problem.strip())
    # A grammar can pass validation and still allow no output at all (a schema that only
    # refers to itself: {"$ref": "#"}): llguidance finds so only at the first mask, and on the
    # engine the request would end at once with empty text and "stop". One mask over bytes
    # tells, whatever the model's tokenizer: no byte and no EOS can start the output.
    if _BYTES is None:
        _BYTES = llguidance.LLTokenizer("byte")
    matcher = llguidance.LLMatcher(_BYTES, grammar, log_level=0)
    matcher.compute_bitmask()  # (its own matcher and buffer: safe on any thread)
    if matcher.is_error():
        raise GrammarError("the grammar allows no output (nothing can start it)")
    return grammar


class GrammarMasks:
    """Per-request grammar matchers and their next-token bitmasks: prepared where requests
    are added (`prepare`), advanced and read on the engine thread (`fill`).

    The llguidance tokenizer is built from the model's `tokenizer.json` on first use (0.2-1 s
    by vocabulary size: logged), so a server that never sees a grammar never pays for it."""

    def __init__(self, tokenizer_json: Callable[[], str], eos_token_ids: tuple[int, ...]) -> None:
        # The served tokenizer as `tokenizer.json` text, asked for on first use only (a
        # 128k-token vocabulary serialises to ~9 MB: not at start-up, not kept).
        self._tokenizer_json = tokenizer_json
        self._eos = list(eos_token_ids)
        self._lltok: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        # request id -> (matcher, output tokens it has consumed)
        self._matchers: dict[str, tuple[llguidance.LLMatcher, int]] = {}
        self._executor = llguidance.LLExecutor()

    @property
    def vocab_size(self) -> int:
        """Tokens a mask covers (the tokenizer's, added tokens included)."""
        return self._tokenizer().vocab_size

    @property
    def words_per_mask(self) -> int:
        return (self.vocab_size + 31) // 32

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltok is None:
                t0 = time.perf_counter()
                self._lltok = llguidance.LLTokenizer(
                    self._tokenizer_json(), eos_token=self._eos or None
                )
                log.info(
                    "grammar tokenizer built in %.2f s (%d tokens)",
                    time.perf_counter() - t0,
                    self._lltok.vocab_size,
                )
            return self._lltok

    def prepare(self, request_id: str, grammar: str) -> str | None:
        """Build a request's matcher now, on the caller's thread (where requests are added):
        compiling a grammar takes milliseconds, up to a second for a large schema, and the
        first one builds the tokenizer, none of which should stall the step loop. Returns the
        matcher's error (None: ready). A request id that has a matcher keeps it."""
        m = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if m.is_error():
            return f"structured outputs: {m.get_error()}"
        self._matchers.setdefault(request_id, (m, 0))  # (a dict op: atomic under the GIL)
        return None

    def fill(self, rows: list[tuple[str, str, list[int]]], out: np.ndarray) -> None:
        """Bitmasks of the tokens each row may sample next, into `out` ([len(rows), words]
        int32, C-contiguous, host memory). `rows`: (request id, grammar, output token ids so
        far, every one: the runner adds one still in flight). A stopped matcher (its grammar
        ended, or it took EOS: a surplus sample the scheduler drops) allows only EOS. So does
        one that cannot follow the tokens (an llguidance error: not expected, since every
        token was sampled under its mask), which is logged and ends the request."""
        words = out.shape[1]
        batch: list[tuple[llguidance.LLMatcher, int]] = []
        for i, (rid, grammar, output) in enumerate(rows):
            m = self._advance(rid, grammar, output)
            if m.is_stopped() or (output and output[-1] in self._eos):  # (stopped: errors too)
                if m.is_error():
                    log.warning(
                        "request %s: its grammar cannot continue (%s); ending it with EOS",
                        rid,
                        m.get_error(),
                    )
                bits = out.view(np.uint32)
                bits[i] = 0
                for t in self._eos:
                    bits[i, t // 32] |= np.uint32(1 << (t % 32))
                continue
            batch.append((m, i))
        if batch:
            # One call for the batch: llguidance computes the masks in parallel, GIL dropped.
            self._executor.unsafe_compute_mask_ptr(batch, out.ctypes.data, words * 4, len(rows))

    def _advance(self, rid: str, grammar: str, output: list[int]) -> llguidance.LLMatcher:
        entry = self._matchers.get(rid)
        if entry is None:
            entry = (llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0), 0)
        m, consumed = entry
        if output and output[-1] in self._eos:
            # EOS ends the request (only a surplus sample, dropped, follows it): the matcher
            # does not take it (llguidance reads it as a token after the end: an error).
            output = output[:-1]
        if consumed < len(output):
            m.consume_tokens(output[consumed:])
        elif consumed > len(output):  # output rolled back (not done today): start over
            m.reset()
            m.consume_tokens(output)
        self._matchers[rid] = (m, len(output))
        return m

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._matchers)
