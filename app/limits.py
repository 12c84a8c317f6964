"""Limits checked before a request costs anything: the body-size cap's rule, and the counts
(prompts, items, messages, labels) checked right after parsing, before any tokenising.

A request that can never fit (more prompts than the server can hold in flight, more messages
than the context has tokens) is a 400 that says why; 429 stays for what a retry can fix.
"""

from __future__ import annotations

from typing import Any

from app.errors import bad_request

# Default body cap: a generous bound on the JSON bytes of the longest prompt the model takes.
# Text averages ~4 bytes a token; JSON escapes ("\u4e2d": 6 bytes a character, 12 for an
# emoji), long whitespace tokens and token-id lists ("128000, ": 8 bytes) stay well under 64.
# The floor leaves room for small-context models' multi-item scoring calls.
BODY_BYTES_PER_TOKEN = 64
MIN_BODY_BYTES = 4 << 20


def default_max_body_bytes(max_model_len: int | None) -> int:
    """`--max-body-bytes` when unset: 64 bytes per token of `max_model_len`, at least 4 MiB."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * int(max_model_len or 0))


def max_requests_per_call(client: Any) -> int:
    """The most engine requests one HTTP call may make (score items, completion prompts): what
    the server can ever hold in flight at once, so a bigger call could never be admitted."""
    return int(client.max_in_flight)


def check_num_requests(client: Any, num: int, param: str) -> None:
    """400 (not 429: retrying cannot help) when one call asks for more requests than the
    server can ever hold in flight."""
    limit = max_requests_per_call(client)
    if num > limit:
        what = f"n={num} choices (a request each)" if param == "n" else f"{num} {param}"
        raise bad_request(
            f"{what} exceed this server's limit of {limit} per call (the most requests "
            "it holds in flight at once); split the call",
            param,
            "too_many_items" if param == "items" else "too_many_prompts",
        )


def check_num_messages(engine: Any, num: int, param: str = "messages") -> None:
    """Every message adds at least one token to a rendered chat, so more messages than the
    context has tokens can never fit (checked before the template renders them)."""
    max_len = int(engine.max_model_len)
    if num > max_len:
        raise bad_request(
            f"{num} messages cannot fit this model's context of {max_len} tokens",
            param,
            "context_length_exceeded",
        )


def check_num_labels(engine: Any, num: int, param: str) -> None:
    """More labels than the vocabulary has tokens can only repeat labels."""
    vocab = int(engine.model_config.vocab_size)
    if num > vocab:
        raise bad_request(
            f"{num} labels exceed the vocabulary's {vocab} tokens", param, "too_many_labels"
        )


# A normalizer may shrink text before the model sees it (NFKC ligatures, accent stripping);
# the bound leaves it this much room.
_NORMALIZER_SLACK = 2


def check_text_fits(engine: Any, num_chars: int, param: str) -> None:
    """400 before tokenising when a text of `num_chars` characters cannot fit the context
    however it tokenises: each token stands for at most `tokenizer.max_chars_per_token`
    characters. Skipped for tokenizers that do not say (test doubles)."""
    per_token = getattr(engine.tokenizer, "max_chars_per_token", None)
    if per_token is None:
        return
    max_len = int(engine.max_model_len)
    if num_chars > _NORMALIZER_SLACK * per_token * max_len:
        raise bad_request(
            f"a text of {num_chars} characters cannot fit this model's context of {max_len} tokens",
            param,
            "context_length_exceeded",
        )
