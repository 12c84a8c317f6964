"""Regressions from an audit of the HTTP layer: each request here once got a 5xx, a dropped
connection, a silently ignored parameter or a stalled event loop; now a 4xx naming the
parameter (or the right answer), and the server keeps serving."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest
from server_thread import ServerThread

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
GENSCORE = "/v1/generative-scores"
MSG = [{"role": "user", "content": "hi"}]
LONE = "\ud800"  # a lone surrogate: valid JSON ("\ud800"), not text


def _post_text(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    # JSON text: httpx's own encoding cannot carry a lone surrogate.
    return http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def _error(r: httpx.Response, param: str) -> dict[str, Any]:
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["param"] is not None and err["param"].split(".")[0] == param, err
    return err


# (path, body, param named) — each was a 500 (an exception past validation).
FIVE_HUNDREDS: list[tuple[str, dict[str, Any], str]] = [
    # str.isdigit() takes "²", int() does not: the logit_bias validator let it through
    (CHAT, {"messages": MSG, "logit_bias": {"²": 1}}, "logit_bias"),
    (CMPL, {"prompt": "a", "logit_bias": {"1²": 1}}, "logit_bias"),
    # grammar sources with a lone surrogate reached the compiler (utf-8 encode failed)
    (CHAT, {"messages": MSG, "structured_outputs": {"regex": LONE}}, "structured_outputs"),
    (CHAT, {"messages": MSG, "structured_outputs": {"choice": ["a" + LONE]}}, "structured_outputs"),
    # vLLM's generative scores took plain str: the tokenizer (or the 404's JSON) failed
    (GENSCORE, {"query": LONE, "items": ["a"], "label_token_ids": [1]}, "query"),
    (GENSCORE, {"query": "q", "items": ["a", LONE], "label_token_ids": [1]}, "items"),
    (GENSCORE, {"query": "q", "items": ["a"], "label_token_ids": [1], "model": LONE}, "model"),
    # the tokenizer endpoints too
    ("/tokenize", {"prompt": LONE}, "prompt"),
    ("/tokenize", {"prompt": "a", "model": LONE}, "model"),
    ("/detokenize", {"tokens": [1], "model": LONE}, "model"),
]


@pytest.mark.parametrize(("path", "body", "param"), FIVE_HUNDREDS)
def test_bad_text_is_a_400_not_a_500(
    http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    _error(_post_text(http, path, body), param)


@pytest.mark.parametrize("request_id", ["a\nb", "a\r\nX-Injected: 1", "nul\x00", "a b", "é"])
def test_generative_request_id_that_cannot_be_a_header_is_a_400(
    http: httpx.Client, request_id: str
) -> None:
    """The body's `request_id` becomes the X-Request-Id header: a control character in it made
    uvicorn drop the connection without an answer (and put a line break in the access log).
    It now takes what an X-Request-Id header may carry (app/logs.py), and 400 otherwise."""
    body = {"query": "q", "items": ["a"], "label_token_ids": [1], "request_id": request_id}
    _error(_post_text(http, GENSCORE, body), "request_id")
    ok = http.post(GENSCORE, json={**body, "request_id": "run-7.item:3"})
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "genscore-run-7.item:3"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "hi", "add_special_token": False}, "add_special_token"),
        ("/tokenize", {"messages": MSG, "chat_template": "{{ 1 }}"}, "chat_template"),
        ("/detokenize", {"tokens": [104], "skip_special_tokens": True}, "skip_special_tokens"),
    ],
)
def test_tokenizer_endpoints_name_an_unknown_field(
    http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    """They ignored unknown fields: a misspelled `add_special_tokens` changed the count
    silently."""
    err = _error(http.post(path, json=body), param)
    assert err["code"] == "unsupported_parameter"


def test_tokenize_shows_the_tools_to_the_template(http: httpx.Client) -> None:
    """vLLM's `tools` on /tokenize was dropped (so the count was not chat's); now the template
    gets them as chat's does (the fake template shows `[tools=<count>]`)."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    with_tools = http.post("/tokenize", json={"messages": MSG, "tools": tools})
    assert with_tools.status_code == 200, with_tools.text
    assert with_tools.json()["tokens"][: len(b"[tools=1]")] == list(b"[tools=1]")
    chat = http.post(CHAT, json={"messages": MSG, "tools": tools, "tool_choice": "required"})
    assert chat.json()["usage"]["prompt_tokens"] == with_tools.json()["count"]
    _error(http.post("/tokenize", json={"prompt": "hi", "tools": tools}), "tools")


class _SlowTokenizer:
    """The server's tokenizer, its `encode` taking `delay_s` without holding the GIL (as the
    runtime tokenizer's Rust encoder does a long text)."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self._inner = inner
        self._delay_s = delay_s

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        time.sleep(self._delay_s)
        return self._inner.encode(text, add_special_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_a_long_tokenize_does_not_stall_the_event_loop(
    server: ServerThread, http: httpx.Client
) -> None:
    """/tokenize tokenised (and serialised) on the event loop: a long prompt held every other
    client for as long (4.4 s for a 3.9 MB text with SmolLM2's tokenizer). Now on a
    preparation thread, as the other routes tokenise."""
    text = "ab" * 200_000
    gaps: list[float] = []
    done = threading.Event()

    def ping() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            while not done.is_set():
                t0 = time.monotonic()
                c.get("/health")
                gaps.append(time.monotonic() - t0)
                time.sleep(0.005)

    engine = server.engine
    real = engine.tokenizer
    pinger = threading.Thread(target=ping)
    pinger.start()
    try:
        engine.tokenizer = _SlowTokenizer(real, delay_s=1.0)
        time.sleep(0.05)
        r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    finally:
        engine.tokenizer = real
        done.set()
        pinger.join(30)
    assert r.status_code == 200
    assert r.json()["count"] == len(text)
    # On the loop it would wait the whole second; a loaded 2-core CI machine adds tenths.
    assert max(gaps) < 0.5, f"/health waited {max(gaps) * 1000:.0f} ms"


# ----------------------------------------------------------------------------- engine


def test_prompt_logprobs_of_a_one_token_prompt() -> None:
    """A one-token prompt predicts no prompt token, so the runner sends no prompt logprobs
    for it (runtime/runner.py skips an empty target list) and the scheduler sent none at
    all: completions with `echo` + `logprobs` answered 501 (e.g. `{"prompt": "Hi", "echo":
    true, "logprobs": 1}` with SmolLM2). Its one entry is None (the API's null)."""
    from policies import make_policy
    from runtime.config import EngineConfig
    from runtime.kv.block_manager import BlockManager
    from runtime.request import Request, RequestKind, SamplingParams
    from runtime.scheduler import RunnerOutput, Scheduler, StepCapacity

    cfg = EngineConfig(block_size=4, prefill_token_budget=64, prefill_policy="fcfs")
    sched = Scheduler(cfg, BlockManager(16, 4, None), make_policy("fcfs"), [99])
    sampling = SamplingParams(max_tokens=0, prompt_logprobs=1, temperature=0.0)
    sched.add(Request("one", RequestKind.GENERATE, [5], sampling))
    plan = sched.schedule(StepCapacity(prefill_token_budget=64))
    # What the runner returns for it: nothing (no token sampled, no prompt token predicted).
    outs = sched.take_pending_outputs() + sched.update(plan, RunnerOutput())
    assert [o.finished for o in outs] == [True]
    assert outs[0].prompt_logprobs == [None]


def test_a_text_part_field_that_asks_for_something_is_refused(http: httpx.Client) -> None:
    """Content parts ignored unknown fields (a message's are refused): now a 400 naming it,
    with `cache_control` (prefix caching is automatic) and empty values accepted."""
    part = {"type": "text", "text": "hi", "detail": "high"}
    r = http.post(CHAT, json={"messages": [{"role": "user", "content": [part]}], "max_tokens": 1})
    err = _error(r, "messages")
    assert "detail" in err["message"]
    for extra in ({"cache_control": {"type": "ephemeral"}}, {"annotations": []}):
        part = {"type": "text", "text": "hi", **extra}
        body = {"messages": [{"role": "user", "content": [part]}], "max_tokens": 1}
        assert http.post(CHAT, json=body).status_code == 200, extra
    # Other part types: refused by type, as before.
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    r = http.post(CHAT, json={"messages": [{"role": "user", "content": [image]}], "max_tokens": 1})
    assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]
