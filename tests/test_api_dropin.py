"""Drop-in compatibility of the request surface (fake engine): SGLang's /v1/score defaults and
response, vLLM's /v1/generative-scores and /generative_scoring, completions `echo` with prompt logprobs (the requests
lm-evaluation-harness sends), `n` choices, the sampling parameters mapped onto
`SamplingParams`, and a 400 naming every parameter we do not implement."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from fake_engine import FakeEngine, fake_label_probs, fake_prompt_logprobs
from server_thread import ServerThread, fake_server, parse_sse_strict, running_server

from runtime.request import Request, RequestKind, SamplingParams

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


def _ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    return r.json()


def _err(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert param in err["message"], err
    return err["message"]


def _added(server: ServerThread, prefix: str) -> list[Request]:
    return [r for r in server.added() if r.request_id.startswith(prefix)]


# ----------------------------------------------------------------------------- /v1/score


def test_score_defaults_to_full_vocabulary_probabilities(http: httpx.Client) -> None:
    """SGLang's apply_softmax defaults to false: each label's probability over the whole
    vocabulary (the labels' probabilities need not sum to 1)."""
    body = {"query": "q", "items": ["a", "b"], "label_token_ids": [65, 66]}
    got = _ok(http.post("/v1/score", json=body))
    for item, scores in zip("ab", got["scores"], strict=True):
        ids = [ord("q"), ord(item)]
        assert scores == pytest.approx(fake_label_probs(ids, [65, 66], False))
        assert sum(scores) < 0.5  # a vocabulary of 300: two labels hold a small share
    softmaxed = _ok(http.post("/v1/score", json={**body, "apply_softmax": True}))
    for item, scores in zip("ab", softmaxed["scores"], strict=True):
        assert scores == pytest.approx(fake_label_probs([ord("q"), ord(item)], [65, 66], True))
        assert sum(scores) == pytest.approx(1.0)
    # SGLang's response fields, with their meaning; ours beside them.
    assert got["object"] == "scoring" and got["model"] == "SmolLM2-135M-Instruct"
    assert got["usage"]["prompt_tokens"] == 4 and got["usage"]["completion_tokens"] == 0
    assert got["usage"]["total_tokens"] == 4
    assert got["label_token_ids"] == [65, 66] and got["labels"] == ["A", "B"]
    assert len(got["timing"]["e2e_s"]) == 2


def test_score_token_ids_and_item_first(http: httpx.Client) -> None:
    body = {"query": [1, 2], "items": [[3], [4, 5]], "label_token_ids": [7], "item_first": True}
    got = _ok(http.post("/v1/score", json=body))
    assert got["scores"][0] == pytest.approx(fake_label_probs([3, 1, 2], [7], False))
    assert got["scores"][1] == pytest.approx(fake_label_probs([4, 5, 1, 2], [7], False))


def test_score_routes_name_an_unknown_field_instead_of_dropping_it(http: httpx.Client) -> None:
    """A misspelled or unimplemented field would otherwise change every score unseen."""
    body = {"query": "q", "items": ["a"], "label_token_ids": [65, 66]}
    msg = _err(http.post("/v1/score", json={**body, "apply_sofmax": True}), "apply_sofmax")
    assert "unknown parameter" in msg
    _err(http.post("/v1/generative-scores", json={**body, "top_n": 3}), "top_n")
    _err(http.post("/generative_scoring", json={**body, "temprature": 0}), "temprature")
    # Identification is accepted (replicas route on it) and changes nothing.
    assert _ok(http.post("/v1/score", json={**body, "user": "u1"}))["scores"]


def test_cache_salt_reaches_the_engine_on_every_route(
    server: ServerThread, http: httpx.Client
) -> None:
    """vLLM's `cache_salt` (a prefix-cache namespace; runtime/kv/prefix_cache.py) on chat,
    completions and both scoring shapes; empty or not text: a 400."""
    score = {"query": "q", "items": ["a", "b"], "label_token_ids": [65, 66]}
    calls = [
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2}, "chatcmpl"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "cmpl"),
        ("/v1/score", score, "score"),
        ("/v1/generative-scores", score, "genscore"),
    ]
    for path, body, prefix in calls:
        before = len(_added(server, prefix))
        _ok(http.post(path, json={**body, "cache_salt": "tenant-7"}))
        new = _added(server, prefix)[before:]
        assert new and all(r.cache_salt == "tenant-7" for r in new), path
        _ok(http.post(path, json=body))
        assert all(r.cache_salt is None for r in _added(server, prefix)[before + len(new) :])
        for bad in ("", 7):
            r = http.post(path, json={**body, "cache_salt": bad})
            assert r.status_code == 400, (path, bad, r.text)


# ----------------------------------------------------------------------------- vLLM's shape


def test_generative_scores_in_vllms_shape(http: httpx.Client) -> None:
    body = {"query": "q", "items": ["a", "bc"], "label_token_ids": [65, 66]}
    got = _ok(http.post("/v1/generative-scores", json=body))
    assert got["object"] == "generative_score" and got["id"].startswith("genscore-")
    assert [r["index"] for r in got["results"]] == [0, 1]
    # vLLM's default is apply_softmax true: the labels' probabilities sum to 1.
    for result, ids in zip(got["results"], ([113, 97], [113, 98, 99]), strict=True):
        probs = result["token_probs"]
        assert list(probs) == ["65", "66"]
        assert list(probs.values()) == pytest.approx(fake_label_probs(ids, [65, 66], True))
    assert got["usage"]["prompt_tokens"] == 5
    assert got["usage"]["completion_tokens"] == 2 and got["usage"]["total_tokens"] == 7
    raw = _ok(
        http.post(
            "/v1/generative-scores",
            json={**body, "apply_softmax": False, "request_id": "abc", "temperature": 0},
        )
    )
    assert raw["id"] == "genscore-abc"
    assert list(raw["results"][0]["token_probs"].values()) == pytest.approx(
        fake_label_probs([113, 97], [65, 66], False)
    )
    # A label given twice is one key, and the softmax counts it once (rows still sum to 1).
    twice = _ok(http.post("/v1/generative-scores", json={**body, "label_token_ids": [65, 65, 66]}))
    probs = twice["results"][0]["token_probs"]
    assert list(probs) == ["65", "66"] and sum(probs.values()) == pytest.approx(1.0)
    assert list(probs.values()) == pytest.approx(fake_label_probs([113, 97], [65, 66], True))


def test_generative_scoring_in_vllm_024s_shape(http: httpx.Client) -> None:
    """vLLM 0.24's `/generative_scoring`: `data[i].score` is the first label's probability
    (softmax over the labels by default), one completion token per item in `usage`."""
    body = {"query": "q", "items": ["a", "bc"], "label_token_ids": [66, 65, 66]}
    got = _ok(http.post("/generative_scoring", json=body))
    assert got["object"] == "list" and got["id"].startswith("generative-scoring-")
    assert [(d["index"], d["object"]) for d in got["data"]] == [(0, "score"), (1, "score")]
    for d, ids in zip(got["data"], ([113, 97], [113, 98, 99]), strict=True):
        # The repeated 66 counts once in the softmax, as vLLM keys labels before it.
        assert d["score"] == pytest.approx(fake_label_probs(ids, [66, 65], True)[0])
    assert got["usage"]["prompt_tokens"] == 5
    assert got["usage"]["completion_tokens"] == 2 and got["usage"]["total_tokens"] == 7
    raw = _ok(
        http.post("/generative_scoring", json={**body, "apply_softmax": False, "request_id": "x"})
    )
    assert raw["id"] == "generative-scoring-x"
    assert raw["data"][0]["score"] == pytest.approx(fake_label_probs([113, 97], [66], False)[0])
    _err(http.post("/generative_scoring", json={**body, "top_p": 0.5}), "top_p")
    bad = http.post("/generative_scoring", json={**body, "label_token_ids": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "label_token_ids"


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"temperature": 0.7}, "temperature"), ({"top_k": 5}, "top_k"), ({"top_p": 0.5}, "top_p")],
)
def test_generative_scores_refuse_sampling_knobs(
    http: httpx.Client, extra: dict[str, Any], param: str
) -> None:
    body = {"query": "q", "items": ["a"], "label_token_ids": [65], **extra}
    _err(http.post("/v1/generative-scores", json=body), param)


# ----------------------------------------------------------------------------- chat templates


def test_chat_template_kwargs_and_add_generation_prompt_reach_the_template(
    server: ServerThread, http: httpx.Client
) -> None:
    """vLLM's chat extensions: template variables (Qwen3's enable_thinking) and a prompt that
    opens no assistant turn."""
    opened = b"<|im_start|>assistant\n"
    for body, rid in (
        ({"chat_template_kwargs": {"enable_thinking": False}}, "tk-vars"),
        ({"add_generation_prompt": False}, "tk-nogen"),
    ):
        full = {"messages": MSG, "max_tokens": 2, **body}
        _ok(http.post(CHAT, json=full, headers={"X-Request-Id": rid}))
    (with_vars,) = _added(server, "tk-vars")
    (no_gen,) = _added(server, "tk-nogen")
    tok = server.engine.tokenizer
    assert tok.decode(with_vars.prompt_token_ids, False).startswith("[enable_thinking=False]")
    assert tok.decode(with_vars.prompt_token_ids, False).endswith(opened.decode())
    assert not tok.decode(no_gen.prompt_token_ids, False).endswith(opened.decode())
    cont = [*MSG, {"role": "assistant", "content": "Hel"}]
    body = {"messages": cont, "add_generation_prompt": False, "continue_final_message": True}
    _ok(http.post(CHAT, json={**body, "max_tokens": 1}, headers={"X-Request-Id": "tk-cont"}))
    (opened_in,) = _added(server, "tk-cont")
    assert tok.decode(opened_in.prompt_token_ids, False).endswith("assistant\nHel")
    both = http.post(CHAT, json={**body, "add_generation_prompt": True})
    assert both.status_code == 400 and "continue_final_message" in both.text
    for bad in ({"messages": []}, {"add_generation_prompt": True}, {"tools": []}, {"a-b": 1}):
        r = http.post(CHAT, json={"messages": MSG, "chat_template_kwargs": bad})
        assert r.status_code == 400 and "chat_template_kwargs" in r.text, r.text


def test_min_tokens_above_max_tokens_is_a_400(http: httpx.Client) -> None:
    body = {"messages": MSG, "max_tokens": 2, "min_tokens": 3}
    _err(http.post(CHAT, json=body), "min_tokens")
    assert (
        http.post(CMPL, json={"prompt": "a", "max_tokens": 3, "min_tokens": 3}).status_code == 200
    )


# ----------------------------------------------------------------------------- echo + logprobs


def _expected_prompt_logprobs(ids: list[int], k: int) -> list[float | None]:
    req = Request("x", RequestKind.GENERATE, ids, SamplingParams(prompt_logprobs=k))
    return [None if lp is None else lp.logprob for lp in fake_prompt_logprobs(req) or []]


def test_echo_with_logprobs_returns_prompt_token_logprobs(
    server: ServerThread, http: httpx.Client
) -> None:
    """What lm-evaluation-harness' local-completions sends for a loglikelihood request."""
    body = {"prompt": "abcd", "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    got = _ok(http.post(CMPL, json=body))
    (choice,) = got["choices"]
    assert choice["text"] == "abcd" + "a"  # the prompt, then the one generated token
    lp = choice["logprobs"]
    assert lp["tokens"] == ["a", "b", "c", "d", "a"]
    assert lp["token_logprobs"][:4] == _expected_prompt_logprobs([97, 98, 99, 100], 1)
    assert lp["token_logprobs"][4] == -0.5  # the generated token's
    assert lp["top_logprobs"][0] is None and lp["text_offset"] == [0, 1, 2, 3, 4]
    # "b" (98) at position 1 is odd: its top alternative "c" (99) at -0.1 beats it.
    assert lp["top_logprobs"][1] == {"b": lp["token_logprobs"][1], "c": -0.1}
    assert got["usage"]["prompt_tokens"] == 4 and got["usage"]["completion_tokens"] == 1
    (req,) = _added(server, got["id"])
    assert req.sampling.prompt_logprobs == 1 and req.sampling.logprobs == 1


def test_max_tokens_zero_with_echo_is_prompt_only(http: httpx.Client) -> None:
    body = {"prompt": [5, 6, 7], "echo": True, "logprobs": 0, "max_tokens": 0}
    (choice,) = _ok(http.post(CMPL, json=body))["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == _expected_prompt_logprobs([5, 6, 7], 0)
    assert len(choice["logprobs"]["tokens"]) == 3


def test_batched_token_prompts_with_echo(http: httpx.Client) -> None:
    body = {"prompt": [[97, 98], [99, 100, 101]], "echo": True, "logprobs": 1, "max_tokens": 1}
    got = _ok(http.post(CMPL, json=body))
    lens = [len(c["logprobs"]["token_logprobs"]) for c in got["choices"]]
    assert lens == [3, 4]
    assert [c["text"] for c in got["choices"]] == ["aba", "cdec"]


def test_echo_without_logprobs_and_streamed_echo(server: ServerThread, http: httpx.Client) -> None:
    got = _ok(http.post(CMPL, json={"prompt": "xy", "echo": True, "max_tokens": 2}))
    assert got["choices"][0]["text"] == "xyxy" and got["choices"][0]["logprobs"] is None
    assert _added(server, got["id"])[0].sampling.prompt_logprobs is None
    body = {"prompt": "xy", "echo": True, "logprobs": 1, "max_tokens": 2, "stream": True}
    with http.stream("POST", CMPL, json=body) as r:
        payloads = parse_sse_strict(r.read())
    chunks = [json.loads(p) for p in payloads[:-1]]
    first = chunks[0]["choices"][0]
    assert first["text"] == "xy" and first["logprobs"]["token_logprobs"][0] is None
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == "xyxy"
    offsets = [
        o
        for c in chunks
        if c["choices"][0]["logprobs"]
        for o in c["choices"][0]["logprobs"]["text_offset"]
    ]
    assert offsets == [0, 1, 2, 3]


class _NoPromptLogprobsEngine(FakeEngine):
    """An engine that does not compute prompt logprobs (the real one until it does)."""

    def add_many(self, reqs: list[Request]) -> None:
        for req in reqs:
            req.sampling.prompt_logprobs = None
        super().add_many(reqs)


def test_engine_without_prompt_logprobs_is_a_clear_501() -> None:
    with running_server(_NoPromptLogprobsEngine) as srv, httpx.Client(base_url=srv.url) as c:
        r = c.post(CMPL, json={"prompt": "ab", "echo": True, "logprobs": 1, "max_tokens": 1})
        assert r.status_code == 501, r.text
        assert r.json()["error"]["code"] == "prompt_logprobs_unavailable"


# ----------------------------------------------------------------------------- n choices


def test_chat_n_choices_with_seeds(server: ServerThread, http: httpx.Client) -> None:
    body = {"messages": MSG, "n": 3, "seed": 5, "max_tokens": 4}
    got = _ok(http.post(CHAT, json=body))
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    assert {c["message"]["content"] for c in got["choices"]} == {"user"}
    reqs = _added(server, got["id"])
    assert [r.sampling.seed for r in reqs] == [5, 6, 7]
    assert len({tuple(r.prompt_token_ids) for r in reqs}) == 1
    # The prompt is counted once, every choice's tokens are.
    assert got["usage"]["prompt_tokens"] == len(reqs[0].prompt_token_ids)
    assert got["usage"]["completion_tokens"] == 12
    unseeded = _ok(http.post(CHAT, json={**body, "seed": None}))
    assert [r.sampling.seed for r in _added(server, unseeded["id"])] == [None] * 3


def test_chat_n_choices_streamed(http: httpx.Client) -> None:
    body = {"messages": MSG, "n": 2, "max_tokens": 3, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with http.stream("POST", CHAT, json=body) as r:
        payloads = parse_sse_strict(r.read())
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(c["delta"].get("content", "") for c in mine) == "use"
        assert mine[-1]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_completions_n_over_several_prompts(http: httpx.Client) -> None:
    body = {"prompt": ["ab", "cd"], "n": 2, "max_tokens": 2, "echo": True}
    got = _ok(http.post(CMPL, json=body))
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in got["choices"]] == ["abab", "abab", "cdcd", "cdcd"]
    assert got["usage"]["prompt_tokens"] == 4 and got["usage"]["completion_tokens"] == 8
    streamed = {**body, "stream": True, "echo": False}
    with http.stream("POST", CMPL, json=streamed) as r:
        chunks = [json.loads(p) for p in parse_sse_strict(r.read())[:-1]]
    texts = [
        "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i)
        for i in range(4)
    ]
    assert texts == ["ab", "ab", "cd", "cd"]


def test_best_of_only_equal_to_n(http: httpx.Client) -> None:
    assert http.post(CMPL, json={"prompt": "a", "n": 2, "best_of": 2}).status_code == 200
    _err(http.post(CMPL, json={"prompt": "a", "n": 1, "best_of": 3}), "best_of")


def test_openai_client_n(server: ServerThread) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    resp = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MSG, n=2)
    assert [c.index for c in resp.choices] == [0, 1]


# ----------------------------------------------------------------------------- parameters


def test_sampling_parameters_reach_the_engine(server: ServerThread, http: httpx.Client) -> None:
    body = {
        "messages": MSG,
        "max_tokens": 2,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.2,
        "logit_bias": {"65": 5, "66": -100},
        "min_p": 0.1,
        "stop_token_ids": [10, 11],
        "user": "someone",
        "response_format": {"type": "text"},
        "tool_choice": "none",
        "tools": [],
    }
    got = _ok(http.post(CHAT, json=body))
    (req,) = _added(server, got["id"])
    sp = req.sampling
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -0.25, 1.2)
    assert sp.logit_bias == {65: 5.0, 66: -100.0} and sp.min_p == 0.1
    assert sp.stop_token_ids == [10, 11]
    assert sp.grammar is None  # response_format text: unconstrained
    plain = _ok(http.post(CMPL, json={"prompt": "a", "max_tokens": 1}))
    (req,) = _added(server, plain["id"])
    assert (req.sampling.repetition_penalty, req.sampling.logit_bias) == (1.0, {})
    # Structured outputs reach the engine as a grammar, on both routes.
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    for path, body in ((CHAT, {"messages": MSG}), (CMPL, {"prompt": "a"})):
        got = _ok(http.post(path, json={**body, "max_tokens": 2, "response_format": fmt}))
        (req,) = _added(server, got["id"])
        assert req.sampling.grammar is not None and '"integer"' in req.sampling.grammar
    got = _ok(http.post(CHAT, json={"messages": MSG, "structured_outputs": {"choice": ["A", "B"]}}))
    (req,) = _added(server, got["id"])
    assert req.sampling.grammar is not None and "A|B" in req.sampling.grammar


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        # tools without tool_choice ask for "auto": it needs a model-specific parser
        (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        (CHAT, {"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            CHAT,
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        (
            CHAT,
            {
                "tools": [{"type": "function", "function": {"name": "f"}}] * 2,
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            CHAT,
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            CHAT,
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        (
            CHAT,
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
                "ignore_eos": True,
            },
            "tool_choice",
        ),
        (CHAT, {"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        (CHAT, {"functions": [{"name": "f"}]}, "functions"),
        (CHAT, {"response_format": {"type": "yaml"}}, "response_format"),
        (CHAT, {"response_format": {"type": "json_schema"}}, "response_format"),
        (
            CHAT,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "description": "a person"},
                }
            },
            "response_format",
        ),
        (
            CHAT,
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format",
        ),
        (
            CMPL,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format",
        ),
        (CHAT, {"response_format": {"type": "json_object"}, "ignore_eos": True}, "response_format"),
        (CHAT, {"response_format": {"type": "json_object"}, "min_tokens": 1}, "response_format"),
        (CMPL, {"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        (CMPL, {"structured_outputs": {}}, "structured_outputs"),
        (CHAT, {"structured_outputs": {"json": {"$ref": "#"}}}, "structured_outputs"),
        (CHAT, {"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
        (
            CHAT,
            {"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
            "structured_outputs",
        ),
        (CHAT, {"audio": {"voice": "alloy"}}, "audio"),
        (CHAT, {"reasoning_effort": "low"}, "reasoning_effort"),
        (CHAT, {"store": True}, "store"),
        (CHAT, {"totally_new_knob": 1}, "totally_new_knob"),
        (
            CHAT,
            {"stream": True, "stream_options": {"include_usage": True, "new_option": True}},
            "stream_options",
        ),
        (  # implemented, but only beside include_usage (vLLM would send nothing)
            CHAT,
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options",
        ),
        (CMPL, {"suffix": "end"}, "suffix"),
        (CMPL, {"guided_json": {}}, "guided_json"),
        (CHAT, {"logit_bias": {"300": 1}}, "logit_bias"),
        (CHAT, {"logit_bias": {"a": 1}}, "logit_bias"),
        (CHAT, {"logit_bias": {"5": 101}}, "logit_bias"),
        (CMPL, {"stop_token_ids": [300]}, "stop_token_ids"),
        (CMPL, {"repetition_penalty": 0}, "repetition_penalty"),
        (CMPL, {"min_p": 1.5}, "min_p"),
    ],
)
def test_unimplemented_parameters_are_named(
    http: httpx.Client, path: str, extra: dict[str, Any], param: str
) -> None:
    body = {"messages": MSG} if path == CHAT else {"prompt": "a"}
    r = http.post(path, json={**body, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].split(".")[0] == param, err


# ----------------------------------------------------------------------------- tokenizer, version


def test_tokenize_and_detokenize_in_vllms_shapes(http: httpx.Client) -> None:
    got = _ok(http.post("/tokenize", json={"prompt": "hey", "return_token_strs": True}))
    assert got == {
        "count": 3,
        "max_model_len": 256,
        "tokens": [104, 101, 121],
        "token_strs": ["h", "e", "y"],
    }
    chat = _ok(http.post("/tokenize", json={"messages": MSG}))
    assert chat["tokens"][0] == 256 and chat["count"] == len(chat["tokens"])  # <|im_start|>
    # As chat renders it: template variables, and no assistant turn opened when asked.
    kw = {"messages": MSG, "chat_template_kwargs": {"enable_thinking": False}}
    assert _ok(http.post("/tokenize", json=kw))["tokens"][: len(b"[enable")] == list(b"[enable")
    closed = _ok(http.post("/tokenize", json={"messages": MSG, "add_generation_prompt": False}))
    assert chat["tokens"][: closed["count"]] == closed["tokens"] and closed["count"] < chat["count"]
    bad_kw = http.post("/tokenize", json={"messages": MSG, "chat_template_kwargs": {"tools": 1}})
    assert bad_kw.status_code == 400 and "chat_template_kwargs" in bad_kw.text
    assert _ok(http.post("/detokenize", json={"tokens": [256, 104, 105]})) == {
        "prompt": "<|im_start|>hi"
    }
    bad = http.post("/detokenize", json={"tokens": [1, 300]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert http.post("/tokenize", json={"prompt": "a", "messages": MSG}).status_code == 400
    info = _ok(http.get("/tokenizer_info"))
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == 256


def test_version(http: httpx.Client) -> None:
    from app import __version__

    assert _ok(http.get("/version")) == {"version": __version__}


def test_tokenizer_endpoints_need_the_api_key() -> None:
    with fake_server(api_key="k") as srv, httpx.Client(base_url=srv.url) as c:
        assert c.post("/tokenize", json={"prompt": "a"}).status_code == 401
        assert (
            c.post(
                "/tokenize", json={"prompt": "a"}, headers={"Authorization": "Bearer k"}
            ).status_code
            == 200
        )
        assert c.get("/version").status_code == 200


# ----------------------------------------------------------------------------- admin page


def test_admin_state_keeps_chat_and_scoring_latencies_apart(http: httpx.Client) -> None:
    before = _ok(http.get("/admin/api/state"))["latency"]
    for _ in range(3):
        _ok(http.post("/v1/score", json={"query": "q", "items": ["a"], "label_token_ids": [65]}))
    _ok(http.post(CHAT, json={"messages": MSG, "max_tokens": 3}))
    after = _ok(http.get("/admin/api/state"))["latency"]
    assert after["score"]["e2e_s"]["count"] - before["score"]["e2e_s"]["count"] == 3
    assert after["chat"]["e2e_s"]["count"] - before["chat"]["e2e_s"]["count"] == 1
    assert after["chat"]["tpot_s"]["count"] > before["chat"]["tpot_s"]["count"]
    assert (
        after["e2e_s"]["count"]
        == after["chat"]["e2e_s"]["count"] + after["score"]["e2e_s"]["count"]
    )


# ----------------------------------------------------------------------------- messages


def _chat_text(http: httpx.Client, messages: list[dict[str, Any]]) -> str:
    """The prompt a chat request renders to (through /tokenize, the same path)."""
    ids = _ok(http.post("/tokenize", json={"messages": messages}))["tokens"]
    return _ok(http.post("/detokenize", json={"tokens": ids}))["prompt"]


def test_text_parts_are_joined_by_a_newline(http: httpx.Client) -> None:
    parts = [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]
    assert "user\nSay\nhi" in _chat_text(http, [{"role": "user", "content": parts}])


def test_a_developer_message_is_the_system_message(http: httpx.Client) -> None:
    """OpenAI's developer message is a system message to a model whose template has no
    developer role (the fake's template has none)."""
    user = {"role": "user", "content": "hi"}
    dev = _chat_text(http, [{"role": "developer", "content": "Be terse."}, user])
    assert dev == _chat_text(http, [{"role": "system", "content": "Be terse."}, user])
    assert "developer" not in dev


def test_message_fields_reach_the_template_or_are_refused(http: httpx.Client) -> None:
    from app.common import chat_prompt_ids
    from app.protocol import ChatMessage

    class Recorder:
        chat_template = "{% for m in messages %}{{ m.role }}{% endfor %}"

        def __init__(self) -> None:
            self.messages: list[dict[str, Any]] = []

        def encode_chat(self, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
            self.messages = messages
            return [1, 2, 3]

    class Engine:
        max_model_len = 1000
        tokenizer = Recorder()

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [
        ChatMessage(role="user", content="weather?", name="Alice"),
        ChatMessage(role="assistant", content=None, tool_calls=[call], refusal=None),
        ChatMessage(role="tool", content="sunny", tool_call_id="c1"),
        ChatMessage(role="developer", content="be brief"),
    ]
    chat_prompt_ids(Engine(), history)
    sent = Engine.tokenizer.messages
    assert sent[0] == {"role": "user", "content": "weather?", "name": "Alice"}
    assert sent[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert sent[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert sent[3]["role"] == "system"  # this template has no developer role
    Recorder.chat_template = "{% if m.role == 'developer' %}...{% endif %}"
    chat_prompt_ids(Engine(), history)
    assert Engine.tokenizer.messages[3]["role"] == "developer"  # this one knows it
    # Through HTTP: an unknown message field that asks for something is a 400, an empty one
    # (the SDK's `refusal: null`, `annotations: []`) passes.
    refused = http.post(CHAT, json={"messages": [{**MSG[0], "audio": {"id": "a1"}}]})
    assert refused.status_code == 400 and "'audio'" in refused.json()["error"]["message"]
    body = {"messages": [{**MSG[0], "refusal": None, "annotations": []}], "max_tokens": 1}
    _ok(http.post(CHAT, json=body))


# ----------------------------------------------------------------------------- edges of the surface


def test_the_largest_seed_with_several_choices_wraps(
    server: ServerThread, http: httpx.Client
) -> None:
    """Choice i samples with (seed + i) mod 2**64: the last valid seed with n=2 is not a
    server error (it was a 503 'engine is not running': the second seed did not encode)."""
    top = 2**64 - 1
    got = _ok(http.post(CHAT, json={"messages": MSG, "n": 2, "seed": top, "max_tokens": 1}))
    assert [r.sampling.seed for r in _added(server, got["id"])] == [top, 0]


def test_more_choices_than_the_server_holds_is_a_400_not_a_429() -> None:
    with fake_server(max_num_seqs=1, max_queue=0) as srv, httpx.Client(base_url=srv.url) as c:
        r = c.post(CHAT, json={"messages": MSG, "n": 2, "max_tokens": 1})
        assert r.status_code == 400 and "retry-after" not in r.headers
        assert r.json()["error"]["param"] == "n" and "n=2 choices" in r.json()["error"]["message"]
        _ok(c.post(CHAT, json={"messages": MSG, "n": 1, "max_tokens": 1}))


def test_stream_options_need_a_stream(http: httpx.Client) -> None:
    body = {"messages": MSG, "stream_options": {"include_usage": True}}
    r = http.post(CHAT, json=body)
    assert r.status_code == 400 and "stream_options" in r.json()["error"]["message"]
    r = http.post(CMPL, json={"prompt": "a", "stream_options": {"include_usage": True}})
    assert r.status_code == 400


def test_malformed_json_names_no_parameter(http: httpx.Client) -> None:
    r = http.post(CHAT, content=b'{"messages": [}', headers={"content-type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] is None and err["code"] == "invalid_json"
    assert "at character" in err["message"]


def test_a_prompt_that_fills_the_context_blames_the_prompt(http: httpx.Client) -> None:
    """Without max_tokens the output gets the rest of the context: a prompt that leaves none
    is the messages' fault, not a max_tokens the client never sent."""
    long = [{"role": "user", "content": "x" * 300}]  # the fake's context: 256 tokens
    err = http.post(CHAT, json={"messages": long}).json()["error"]
    assert err["param"] == "messages" and err["code"] == "context_length_exceeded"
    assert "max_tokens" not in err["message"]
    err = http.post(CHAT, json={"messages": long, "max_tokens": 5}).json()["error"]
    assert err["param"] == "max_tokens"


def test_one_model_is_retrieved_by_its_id(server: ServerThread, http: httpx.Client) -> None:
    name = _ok(http.get("/v1/models"))["data"][0]["id"]
    card = _ok(http.get(f"/v1/models/{name}"))
    assert card["id"] == name and card["object"] == "model"
    missing = http.get("/v1/models/no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    assert client.models.retrieve(name).id == name


def test_no_request_timeout_by_default() -> None:
    """As vLLM: a long non-streaming generation is not an error (a 504 invites the OpenAI SDK
    to run the whole request again); a client that leaves aborts its request anyway."""
    from app.settings import Settings

    assert Settings().request_timeout_s is None


# ----------------------------------------------------------------------------- model defaults


def test_the_models_sampling_defaults_fill_what_a_request_leaves_out(
    server: ServerThread, http: httpx.Client
) -> None:
    """As vLLM's `--generation-config auto`: a request without temperature / top_p / top_k /
    min_p / repetition_penalty samples with the model's generation_config.json values; a
    request's own value wins, also a 0 (greedy, no top_k limit)."""
    state = server.app.state
    state.sampling_defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05}
    state.sampling_defaults["repetition_penalty"] = 1.1
    try:
        got = _ok(http.post(CHAT, json={"messages": MSG, "max_tokens": 1}))
        sp = _added(server, got["id"])[0].sampling
        assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (0.6, 0.9, 20, 0.05)
        assert sp.repetition_penalty == 1.1
        own = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "prompt": "a"}
        got = _ok(http.post(CMPL, json={**own, "max_tokens": 1}))
        sp = _added(server, got["id"])[0].sampling
        assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (0.0, 1.0, 0, 0.0)
        assert sp.repetition_penalty == 1.1  # left out: the model's
    finally:
        state.sampling_defaults = {}
    got = _ok(http.post(CHAT, json={"messages": MSG, "max_tokens": 1}))
    sp = _added(server, got["id"])[0].sampling
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty) == (
        1.0,
        1.0,
        0,
        0.0,
        1.0,
    )


def test_sampling_defaults_are_read_from_generation_config(tmp_path, caplog) -> None:  # noqa: ANN001
    from app.engine_view import load_sampling_defaults
    from app.main import _sampling_defaults
    from app.settings import Settings

    cfg = {"eos_token_id": 2, "temperature": 0.6, "top_p": 0.9, "top_k": 50, "min_p": 3.0}
    cfg["do_sample"] = True
    (tmp_path / "generation_config.json").write_text(json.dumps(cfg))
    info = {"model": str(tmp_path), "tokenizer_dir": str(tmp_path)}
    found, notes = load_sampling_defaults(info)
    assert found == {"temperature": 0.6, "top_p": 0.9, "top_k": 50}
    assert len(notes) == 1 and "min_p=3.0" in notes[0]  # out of range: said, not used
    assert load_sampling_defaults({**info, "model": "random:llama-3.1-8b"}) == ({}, [])
    assert load_sampling_defaults({"model": "m", "tokenizer_dir": str(tmp_path / "x")}) == ({}, [])
    with caplog.at_level("INFO", logger="greenlane.app"):
        assert _sampling_defaults(Settings(), info) == found
        assert _sampling_defaults(Settings(generation_config="none"), info) == {}
    said = caplog.text
    assert "temperature=0.6" in said and "--generation-config none" in said and "min_p=3.0" in said


# ----------------------------------------------------------------------------- tool_choice auto


def test_auto_tool_calls_with_the_hermes_parser() -> None:
    """`--tool-call-parser hermes`: tool_choice auto (and tools without a tool_choice) read the
    model's `<tool_call>` blocks back as tool_calls, streamed or not. The fake engine answers
    with its prompt's text, so a user message holding a call is an answer holding one."""
    # (short: the fake engine's context is 256 tokens, and its answer is the whole prompt)
    call = '<tool_call>{"name": "t"}</tool_call>'
    tools = [{"type": "function", "function": {"name": "t"}}]
    body = {"messages": [{"role": "user", "content": call}], "tools": tools, "max_tokens": 140}
    with fake_server(tool_call_parser="hermes") as srv, httpx.Client(base_url=srv.url) as http:
        got = _ok(http.post(CHAT, json=body))
        (choice,) = got["choices"]
        assert choice["finish_reason"] == "tool_calls"
        (tc,) = choice["message"]["tool_calls"]
        assert tc["function"] == {"name": "t", "arguments": "{}"}
        # The model was shown the tools (the fake template writes its variables up front).
        assert choice["message"]["content"].startswith("[tools=1]")
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", stream=True, tool_choice="auto", **body
        )
        chunks = [c for c in stream if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert "<tool_call>" not in text and text.startswith("[tools=")
        calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
        assert [(t.index, t.function.name) for t in calls] == [(0, "t")]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # parallel_tool_calls false: the model's first call only.
        two = {"role": "user", "content": call + call}
        both = _ok(http.post(CHAT, json={**body, "messages": [two]}))
        assert len(both["choices"][0]["message"]["tool_calls"]) == 2
        one = _ok(http.post(CHAT, json={**body, "messages": [two], "parallel_tool_calls": False}))
        assert len(one["choices"][0]["message"]["tool_calls"]) == 1
        # No call in the answer: plain content, finish_reason stop.
        plain = _ok(http.post(CHAT, json={**body, "messages": MSG}))
        assert plain["choices"][0]["finish_reason"] == "stop"
        assert "tool_calls" not in plain["choices"][0]["message"]
