"""(e) SSE framing, parsed strictly: role chunk -> content deltas -> finish chunk -> usage -> [DONE]."""

from __future__ import annotations

import json

import httpx
import pytest
from server_thread import ServerThread, parse_sse_strict


def _stream(server: ServerThread, path: str, body: dict) -> tuple[httpx.Response, bytes]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", path, json=body) as r:
            raw = r.read()
    return r, raw


@pytest.mark.parametrize("include_usage", [True, False])
def test_chat_stream_sequence(server: ServerThread, include_usage: bool) -> None:
    body = {
        "messages": [{"role": "user", "content": "Bonjour"}],
        "stream": True,
        "max_tokens": 200,
        "stream_options": {"include_usage": include_usage},
    }
    r, raw = _stream(server, "/v1/chat/completions", body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    payloads = parse_sse_strict(raw)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)

    role, *rest = chunks
    assert role["choices"][0]["delta"]["role"] == "assistant"
    if include_usage:
        *rest, usage_chunk = rest
        assert usage_chunk["choices"] == []
        u = usage_chunk["usage"]
    else:
        assert all("usage" not in c for c in rest)
    *deltas, final = rest
    assert final["choices"][0]["finish_reason"] == "stop"
    assert final["choices"][0]["delta"] == {}
    assert deltas and all(d["choices"][0]["finish_reason"] is None for d in deltas)
    text = "".join(d["choices"][0]["delta"]["content"] for d in deltas)
    # The fake engine echoes the rendered prompt's text (template specials dropped).
    assert text == "user\nBonjour\nassistant\n"
    if include_usage:
        # One token per byte of text, plus the EOS that ended it (counted, not shown).
        assert u["completion_tokens"] == len(text.encode()) + 1
        assert (
            u["prompt_tokens"] > 0
            and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        )


def test_completion_stream_sequence_and_length(server: ServerThread) -> None:
    body = {
        "prompt": "abcdef",
        "stream": True,
        "max_tokens": 4,
        "logprobs": 1,
        "stream_options": {"include_usage": True},
    }
    r, raw = _stream(server, "/v1/completions", body)
    assert r.status_code == 200
    payloads = parse_sse_strict(raw)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    *deltas, final, usage_chunk = chunks
    assert "".join(c["choices"][0]["text"] for c in deltas) == "abcd"
    assert [c["choices"][0]["logprobs"]["tokens"] for c in deltas] == [["a"], ["b"], ["c"], ["d"]]
    assert final["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["usage"]["completion_tokens"] == 4


def _usage_steps(chunks: list[dict]) -> list[int]:
    """Completion tokens each content chunk adds (`continuous_usage_stats`)."""
    seen, steps = 0, []
    for c in chunks:
        now = c["usage"]["completion_tokens"]
        assert now >= seen and c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + now
        steps.append(now - seen)
        seen = now
    return steps


def test_chat_stream_continuous_usage_counts_tokens_without_text(server: ServerThread) -> None:
    """`stream_options.continuous_usage_stats` (vLLM's): every chunk carries the choice's
    completion tokens so far. A token without text (here the first byte of a two-byte
    character: the fake engine answers one token per byte) sends no chunk, so the chunk after
    it carries two, and a client that times tokens can tell."""
    body = {
        "messages": [{"role": "user", "content": "Grüße"}],
        "stream": True,
        "max_tokens": 200,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    r, raw = _stream(server, "/v1/chat/completions", body)
    assert r.status_code == 200
    chunks = [json.loads(p) for p in parse_sse_strict(raw)[:-1]]
    role, *rest, final, usage_chunk = chunks
    assert usage_chunk["choices"] == [] and all("usage" in c for c in chunks)
    # Every chunk's usage in the final usage chunk's shape (cached tokens included).
    assert all(c["usage"].keys() == usage_chunk["usage"].keys() for c in chunks)
    assert final["usage"] == usage_chunk["usage"]
    assert role["usage"]["completion_tokens"] == 0
    deltas = [c for c in rest if c["choices"][0]["delta"].get("content")]
    assert deltas == rest
    text = "".join(d["choices"][0]["delta"]["content"] for d in deltas)
    steps = _usage_steps(deltas)
    # One token per byte: a chunk's tokens are its text's bytes; ü and ß take two each.
    assert steps == [len(d["choices"][0]["delta"]["content"].encode()) for d in deltas]
    assert steps.count(2) == 2 and sum(steps) == len(text.encode())
    # The finish chunk counts the EOS that ended it (counted, not shown), as the last usage.
    assert final["usage"]["completion_tokens"] == len(text.encode()) + 1
    assert usage_chunk["usage"]["completion_tokens"] == final["usage"]["completion_tokens"]


def test_completion_stream_continuous_usage(server: ServerThread) -> None:
    body = {
        "prompt": "aéb",
        "stream": True,
        "max_tokens": 4,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    r, raw = _stream(server, "/v1/completions", body)
    assert r.status_code == 200
    chunks = [json.loads(p) for p in parse_sse_strict(raw)[:-1]]
    *deltas, final, usage_chunk = chunks
    assert [c["choices"][0]["text"] for c in deltas] == ["a", "é", "b"]
    assert _usage_steps(deltas) == [1, 2, 1]
    assert final["usage"]["completion_tokens"] == usage_chunk["usage"]["completion_tokens"] == 4


def test_continuous_usage_needs_include_usage(server: ServerThread) -> None:
    """Asked alone it would be ignored (vLLM sends nothing then): a 400 naming it."""
    body = {
        "prompt": "a",
        "stream": True,
        "max_tokens": 2,
        "stream_options": {"continuous_usage_stats": True},
    }
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert "continuous_usage_stats needs include_usage" in err["message"]
    assert err["param"].split(".")[0] == "stream_options"


def test_engine_error_mid_stream_is_an_error_event(server: ServerThread) -> None:
    body = {"messages": [{"role": "user", "content": "please FAIL"}], "stream": True}
    r, raw = _stream(server, "/v1/chat/completions", body)
    assert r.status_code == 200  # headers were already sent when the engine failed
    payloads = parse_sse_strict(raw)
    assert payloads[-1] == "[DONE]"
    err = json.loads(payloads[-2])
    assert err["error"]["code"] == "engine_error"
    assert "injected fault" not in err["error"]["message"]  # the log has it, not the client


def test_stop_string_ends_stream(server: ServerThread) -> None:
    body = {"prompt": "hello world", "stream": True, "max_tokens": 50, "stop": [" "]}
    r, raw = _stream(server, "/v1/completions", body)
    chunks = [json.loads(p) for p in parse_sse_strict(raw)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "hello"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
