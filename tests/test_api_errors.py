"""(f) Bad input -> 4xx in the OpenAI error shape, never a 5xx; the server stays healthy."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fake_engine import MAX_MODEL_LEN, VOCAB_SIZE
from server_thread import ServerThread

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
SCORE = "/v1/score"
MSG = [{"role": "user", "content": "hi"}]


def _assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    return err


# (path, body, expected status, expected param or None (unchecked))
JSON_CASES: list[tuple[str, Any, int, str | None]] = [
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hello"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    (CHAT, {"messages": [{"content": "x"}]}, 400, None),
    (CHAT, {"messages": MSG, "max_tokens": -1}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": "many"}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "temperature": 5}, 400, "temperature"),
    (CHAT, {"messages": MSG, "temperature": -0.1}, 400, "temperature"),
    (CHAT, {"messages": MSG, "top_p": 0}, 400, "top_p"),
    (CHAT, {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    (CHAT, {"messages": MSG, "top_k": -2}, 400, "top_k"),
    (CHAT, {"messages": MSG, "n": 0}, 400, "n"),
    (CHAT, {"messages": MSG, "n": 17}, 400, "n"),
    (CHAT, {"messages": MSG, "stream": "yes please"}, 400, "stream"),
    (CHAT, {"messages": MSG, "stop": ""}, 400, "stop"),
    (CHAT, {"messages": MSG, "top_logprobs": 3}, 400, None),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    (CHAT, {"messages": MSG, "max_tokens": 10**9}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "model": "gpt-17"}, 404, "model"),
    (CMPL, {}, 400, "prompt"),
    (CMPL, {"prompt": ""}, 400, "prompt"),
    (CMPL, {"prompt": []}, 400, "prompt"),
    (CMPL, {"prompt": 42}, 400, "prompt"),
    (CMPL, {"prompt": [1, 2, VOCAB_SIZE]}, 400, "prompt"),
    (CMPL, {"prompt": [1, -5]}, 400, "prompt"),
    (CMPL, {"prompt": "x" * (MAX_MODEL_LEN + 1), "max_tokens": 1}, 400, None),
    (CMPL, {"prompt": "abc", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    (CMPL, {"prompt": "abc", "logprobs": 21}, 400, "logprobs"),
    (CMPL, {"prompt": "abc", "logprobs": -1}, 400, "logprobs"),
    (CMPL, {"prompt": "abc", "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
    (CMPL, {"prompt": "abc", "max_tokens": -1, "echo": True}, 400, "max_tokens"),
    (CMPL, {"prompt": "abc", "model": "nope"}, 404, "model"),
    (SCORE, {}, 400, None),
    (SCORE, {"query": "q", "items": ["a"]}, 400, None),  # no labels
    (SCORE, {"query": "q", "items": ["a"], "labels": []}, 400, None),
    (SCORE, {"query": "q", "items": ["a"], "labels": ["a"], "label_token_ids": [1]}, 400, None),
    (SCORE, {"query": "q", "items": ["a"], "labels": ["ab"]}, 400, "labels"),
    (SCORE, {"query": "q", "items": ["a"], "labels": [""]}, 400, "labels"),
    (
        SCORE,
        {"query": "q", "items": ["a"], "label_token_ids": [VOCAB_SIZE]},
        400,
        "label_token_ids",
    ),
    (SCORE, {"query": "q", "items": ["a"], "label_token_ids": [-1]}, 400, "label_token_ids"),
    (SCORE, {"query": [1, 10**6], "items": ["a"], "label_token_ids": [1]}, 400, "query"),
    (SCORE, {"query": "q", "items": [[1, 10**6]], "label_token_ids": [1]}, 400, "items"),
    (SCORE, {"query": "q", "items": [], "label_token_ids": [1]}, 400, None),
    (SCORE, {"query": "q", "items": ["a"], "label_token_ids": ["x"]}, 400, None),
    (SCORE, {"query": "q", "messages": MSG, "label_token_ids": [1]}, 400, None),
    (SCORE, {"messages": [], "label_token_ids": [1]}, 400, None),
    (SCORE, {"query": "q" * (MAX_MODEL_LEN + 1), "label_token_ids": [1]}, 400, None),
    (SCORE, {"query": "q", "items": ["a"], "label_token_ids": [1], "model": "x"}, 404, "model"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), JSON_CASES)
def test_bad_json_bodies(
    http: httpx.Client, path: str, body: Any, status: int, param: str | None
) -> None:
    err = _assert_openai_error(http.post(path, json=body), status)
    if param is not None:
        assert err["param"] is not None and err["param"].split(".")[0] == param, err


@pytest.mark.parametrize("path", [CHAT, CMPL, SCORE])
@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"null", b'{"messages": [}'])
def test_malformed_bodies(http: httpx.Client, path: str, raw: bytes) -> None:
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    _assert_openai_error(r, 400)


def test_context_error_names_the_numbers(http: httpx.Client) -> None:
    err = _assert_openai_error(http.post(CMPL, json={"prompt": "abcd", "max_tokens": 300}), 400)
    assert (
        "4" in err["message"] and "300" in err["message"] and str(MAX_MODEL_LEN) in err["message"]
    )
    assert err["code"] == "context_length_exceeded"


def test_scoring_prompt_over_the_context_says_so_without_max_tokens(http: httpx.Client) -> None:
    long = list(range(1, MAX_MODEL_LEN + 2))
    body = {"query": long, "items": [[4]], "label_token_ids": [7]}
    err = _assert_openai_error(http.post(SCORE, json=body), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "items"
    assert "scoring prompt" in err["message"] and "max_tokens" not in err["message"]


def test_scoring_prompt_over_the_reserved_length_names_the_maximum(
    http: httpx.Client, server: ServerThread
) -> None:
    engine = server.engine
    saved = engine.max_score_tokens
    engine.max_score_tokens = 5  # as if the server reserved activations for 5 tokens only
    try:
        r = http.post(
            SCORE, json={"query": [1, 2, 3], "items": [[4, 5, 6]], "label_token_ids": [7]}
        )
        err = _assert_openai_error(r, 400)
        assert "6" in err["message"] and "at most 5" in err["message"]
        assert err["code"] == "context_length_exceeded"
        ok = http.post(SCORE, json={"query": [1, 2], "items": [[4]], "label_token_ids": [7]})
        assert ok.status_code == 200, ok.text
    finally:
        engine.max_score_tokens = saved


def test_multi_token_label_is_named(http: httpx.Client) -> None:
    r = http.post(SCORE, json={"query": "q", "items": ["a"], "labels": ["y", "no"]})
    err = _assert_openai_error(r, 400)
    assert "'no'" in err["message"]


def test_unknown_route_and_method(http: httpx.Client) -> None:
    _assert_openai_error(http.get("/v1/nothing"), 404)
    _assert_openai_error(http.get(CHAT), 405)


def test_engine_failure_is_500_and_server_keeps_serving(
    http: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("ERROR", logger="greenlane.request")
    err = _assert_openai_error(http.post(CMPL, json={"prompt": "FAIL now", "max_tokens": 3}), 500)
    # The engine's reason goes to the log under the request id, never to the client.
    assert "injected fault" not in err["message"] and "cmpl-" in err["message"]
    request_id = err["message"].split("request ")[1].split(" ")[0]
    assert any(
        request_id in rec.getMessage() and "injected fault" in rec.getMessage()
        for rec in caplog.records
    )
    r = http.post(SCORE, json={"query": "FAIL", "items": ["a"], "label_token_ids": [1, 2]})
    assert "injected fault" not in _assert_openai_error(r, 500)["message"]
    assert http.post(CMPL, json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_healthy_after_the_battery(http: httpx.Client, server: ServerThread) -> None:
    # Runs last in this module: everything above must have left the server serving.
    assert http.get("/health").status_code == 200
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "use"
    assert server.app.state.client.num_in_flight == 0
