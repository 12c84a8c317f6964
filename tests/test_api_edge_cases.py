"""Regressions from an adversarial audit of the HTTP API (edge cases the other API tests do not
reach): each request here once got a wrong answer with a 200, a silently dropped parameter or
an unclear 400; now the right answer, or a 400 in the OpenAI shape that says what was wrong.
Runs against the fake-engine server."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from server_thread import ServerThread

from runtime.core.output_processor import OutputProcessor
from runtime.request import EngineOutput, Request, RequestKind, SamplingParams

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
SCORE = "/v1/score"
MSG = [{"role": "user", "content": "hi"}]


def _error(r: httpx.Response, status: int = 400, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] is not None and err["param"].split(".")[0] == param, err
    return err


def _ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text[:300]
    return r.json()


def _raw(http: httpx.Client, path: str, raw: bytes, ctype: str | None = "application/json"):
    headers = {"content-type": ctype} if ctype is not None else {}
    return http.post(path, content=raw, headers=headers)


# ----------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-38, 1e-6])
def test_a_vanishing_temperature_samples_greedily(
    http: httpx.Client, server: ServerThread, temperature: float
) -> None:
    """The sampler divides float32 logits by the temperature: 1e-300 is 0 in float32, the
    logits became inf and SmolLM2 answered garbage ("ectableectable...") with a 200, where 0
    answers greedily. A temperature under 1e-5 now samples greedily (its limit, as vLLM)."""
    _ok(http.post(CMPL, json={"prompt": "ab", "max_tokens": 1, "temperature": temperature}))
    assert server.added()[-1].sampling.temperature == 0.0
    _ok(http.post(CMPL, json={"prompt": "ab", "max_tokens": 1, "temperature": 1e-5}))
    assert server.added()[-1].sampling.temperature == 1e-5  # from the bound on: as sent


def test_a_vanishing_repetition_penalty_is_a_400(http: httpx.Client) -> None:
    """repetition_penalty divides a seen token's logit: 1e-300 overflowed it to inf (garbage
    output with a 200). Below 0.01 it is refused, naming the parameter."""
    for rep in (1e-300, 1e-3):
        r = http.post(CMPL, json={"prompt": "ab", "max_tokens": 1, "repetition_penalty": rep})
        _error(r, param="repetition_penalty")
    _ok(http.post(CMPL, json={"prompt": "ab", "max_tokens": 1, "repetition_penalty": 0.01}))


def test_logit_bias_keys_naming_one_token_twice_are_a_400(
    http: httpx.Client, server: ServerThread
) -> None:
    """ "5" and "05" are both token 5: the later bias silently replaced the other."""
    for bias in ({"5": 1, "05": -1}, {"5": 1, " 5": 2}):
        err = _error(
            http.post(CHAT, json={"messages": MSG, "logit_bias": bias}), param="logit_bias"
        )
        assert "same token id 5" in err["message"]
    _ok(http.post(CHAT, json={"messages": MSG, "max_tokens": 1, "logit_bias": {" 05 ": 3}}))
    assert server.added()[-1].sampling.logit_bias == {5: 3.0}


def test_max_tokens_and_max_completion_tokens_that_disagree_are_a_400(
    http: httpx.Client, server: ServerThread
) -> None:
    """Both given: max_tokens was silently ignored for max_completion_tokens."""
    body = {"messages": MSG, "max_tokens": 3, "max_completion_tokens": 2}
    err = _error(http.post(CHAT, json=body), param="max_tokens")
    assert "max_completion_tokens" in err["message"]
    _ok(http.post(CHAT, json={**body, "max_tokens": 2}))  # the same value: one limit
    assert server.added()[-1].sampling.max_tokens == 2


def test_include_stop_str_in_output_keeps_a_stop_tokens_text(http: httpx.Client) -> None:
    """include_stop_str_in_output applied to stop strings only: a stop token's text (a
    stop_token_ids entry, EOS) was dropped whatever it said. As in vLLM, it now keeps it (a
    special token's text with skip_special_tokens false). The fake engine echoes the prompt,
    then EOS (<|im_end|>)."""

    def text(**extra: Any) -> str:
        body = {"prompt": "abc", "max_tokens": 10, **extra}
        return _ok(http.post(CMPL, json=body))["choices"][0]["text"]

    stop_b = {"stop_token_ids": [ord("b")]}
    assert text(**stop_b) == "a"
    assert text(**stop_b, include_stop_str_in_output=True) == "ab"
    assert text(skip_special_tokens=False) == "abc"
    assert text(skip_special_tokens=False, include_stop_str_in_output=True) == "abc<|im_end|>"
    assert text(include_stop_str_in_output=True) == "abc"  # a special token's text: skipped


def test_output_processor_keeps_a_stop_token_with_include_stop() -> None:
    class Chars:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(chr(ord("a") + t) for t in ids)

    proc = OutputProcessor(Chars())
    for rid, include in (("hidden", False), ("kept", True)):
        sp = SamplingParams(max_tokens=5, stop_token_ids=[2], include_stop_str_in_output=include)
        proc.add(Request(rid, RequestKind.GENERATE, [0], sp))
    for rid, want in (("hidden", "ab"), ("kept", "abc")):
        got = [proc.process(EngineOutput(rid, new_token_ids=[t]))[0].new_text for t in (0, 1)]
        out, _ = proc.process(EngineOutput(rid, [2], finished=True, finish_reason="stop"))
        assert "".join(got) + out.new_text == want and out.finished


# ----------------------------------------------------------------------------- messages


def test_a_text_part_without_text_says_so(http: httpx.Client) -> None:
    """It said "only text content parts are supported, got type 'text'"."""
    for part in ({"type": "text"}, {"type": "text", "text": None}):
        body = {"messages": [{"role": "user", "content": [part]}]}
        err = _error(http.post(CHAT, json=body), param="messages")
        assert "needs its text" in err["message"]


# ----------------------------------------------------------------------------- scoring


def test_a_label_given_twice_gets_its_own_probability(
    http: httpx.Client, server: ServerThread
) -> None:
    """With apply_softmax both copies of a label were in the softmax: each got half its
    probability ([5, 5] scored [0.5, 0.5]). The engine now scores each label once."""
    body = {"query": "q", "items": ["a", "b"], "apply_softmax": True}
    once = _ok(http.post(SCORE, json={**body, "label_token_ids": [5, 6]}))["scores"]
    twice = _ok(http.post(SCORE, json={**body, "label_token_ids": [5, 6, 5]}))
    assert server.added()[-1].label_token_ids == [5, 6]
    assert twice["scores"] == [[p5, p6, p5] for p5, p6 in once]
    assert twice["label_token_ids"] == [5, 6, 5]
    alone = _ok(http.post(SCORE, json={**body, "items": ["a"], "label_token_ids": [5, 5]}))
    assert alone["scores"] == [[1.0, 1.0]]
    # Label strings that are one token twice, without the softmax: as before (full vocabulary).
    full = _ok(http.post(SCORE, json={**body, "apply_softmax": False, "labels": ["x", "x"]}))
    assert [len(row) for row in full["scores"]] == [2, 2]
    assert all(row[0] == row[1] < 1.0 for row in full["scores"])


# ----------------------------------------------------------------------------- bodies


def test_a_number_too_long_to_convert_is_a_clear_400(http: httpx.Client) -> None:
    """json.loads refuses integers past 4300 digits with a ValueError that is no decode error:
    FastAPI answered "There was an error parsing the body", code null."""
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + b"9" * 5000 + b"}"
    err = _error(_raw(http, CHAT, raw))
    assert err["code"] == "invalid_json" and "digits" in err["message"], err
    assert "parsing the body" not in err["message"]


def test_undecodable_text_is_a_clear_400(http: httpx.Client) -> None:
    err = _error(_raw(http, CMPL, b'\xff\xfe{"prompt": "x"}'))
    assert err["code"] == "invalid_json" and "not valid" in err["message"], err


def test_malformed_json_says_what_the_decoder_found(http: httpx.Client) -> None:
    """It said only "JSON decode error"."""
    err = _error(_raw(http, CHAT, b'{"messages": [], }'))
    assert err["code"] == "invalid_json" and "at character" in err["message"]
    assert "JSON decode error" not in err["message"] and "double quotes" in err["message"]


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", None])
@pytest.mark.parametrize("path", [CHAT, CMPL, SCORE, "/tokenize"])
def test_a_body_without_a_json_content_type_names_the_content_type(
    http: httpx.Client, server: ServerThread, path: str, ctype: str | None
) -> None:
    """FastAPI reads a body as JSON only under a JSON content type; the 400 said "body: Input
    should be a valid dictionary", blaming a body that was a JSON object (curl -d sends
    application/x-www-form-urlencoded)."""
    num_added = len(server.added())
    raw = json.dumps({"prompt": "hi", "messages": MSG, "query": "q", "label_token_ids": [1]})
    err = _error(_raw(http, path, raw.encode(), ctype))
    assert err["code"] == "invalid_content_type" and "Content-Type" in err["message"], err
    assert (repr(ctype) if ctype else "none was sent") in err["message"]
    assert len(server.added()) == num_added
    # With the right content type, a body that is not an object keeps its own message.
    err = _error(_raw(http, path, b"[1, 2]"))
    assert err["code"] == "invalid_value" and "valid dictionary" in err["message"]


# ----------------------------------------------------------------------------- admin


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"tbt_slo_ms": 1e400}', "tbt_slo_ms"),
        (b'{"chunk_fixed_share": -1e400}', "chunk_fixed_share"),
    ],
)
def test_admin_refuses_an_infinite_prefill_limit(
    http: httpx.Client, raw: bytes, param: str
) -> None:
    """tbt_slo_ms 1e400 (JSON for infinity) was taken, and the state showed it as null (the
    engine's own check refused an infinite chunk_fixed_share already; both are refused here)."""
    r = http.put("/admin/api/prefill", content=raw, headers={"content-type": "application/json"})
    assert "finite" in _error(r, param=param)["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}, "stream_options"),
        (
            CHAT,
            {"messages": MSG, "add_generation_prompt": True, "continue_final_message": True},
            "continue_final_message",
        ),
        (SCORE, {"query": "q", "items": ["a"], "label_token_ids": []}, "label_token_ids"),
        (SCORE, {"query": "q", "items": [], "labels": ["Yes"]}, "items"),
        (SCORE, {"items": ["a"], "labels": ["Yes"]}, "query"),
    ],
)
def test_a_model_level_check_names_its_parameter(
    http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    """Checks across fields run on the whole request, which pydantic locates at the body: their
    400s named no `param` (null) although each knows which parameter is wrong."""
    assert _error(http.post(path, json=body))["param"] == param


def test_a_nested_model_level_check_names_the_full_path(http: httpx.Client) -> None:
    body = {"messages": MSG, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    err = _error(http.post(CHAT, json=body))
    assert err["param"] == "stream_options.continuous_usage_stats"


def test_a_model_path_without_an_id_is_a_404(http: httpx.Client) -> None:
    """`GET /v1/models/` returned the served model's card: an empty id counted as "not given",
    as a body's missing `model` does."""
    err = _error(http.get("/v1/models/"), status=404)
    assert err["code"] == "model_not_found"
    assert _ok(http.get("/v1/models"))["data"]  # the list itself is unchanged


def test_healthy_after_the_battery(http: httpx.Client, server: ServerThread) -> None:
    assert http.get("/health").status_code == 200
    _ok(http.post(CHAT, json={"messages": MSG, "max_tokens": 3}))
    assert server.app.state.client.num_in_flight == 0
