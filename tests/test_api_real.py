"""Over HTTP against the real engine and SmolLM2-135M-Instruct (CPU):
(c) a streamed greedy answer names Paris, (d) /v1/score equals transformers' last-position
softmax over the label ids, (g) a mid-stream disconnect returns the KV blocks."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from server_thread import ServerThread, parse_sse_strict, running_server

pytest.importorskip("runtime.engine")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(default_model_dir: Path) -> Iterator[ServerThread]:
    with running_server(
        model=str(default_model_dir),
        served_model_name="smollm2",
        max_model_len=1024,
        cpu_kv_cache_gb=0.25,
        dtype="float32",
        device="cpu",
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def test_streamed_chat_names_paris(http: httpx.Client) -> None:
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "stream": True,
        "temperature": 0,
        "max_tokens": 24,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        raw = r.read()
    payloads = parse_sse_strict(raw)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert "Paris" in text, text
    assert chunks[-1]["usage"]["completion_tokens"] >= 1


def test_structured_output_through_the_openai_sdk(server: ServerThread) -> None:
    """`response_format` json_schema through the official client, streamed: the text parses
    and matches the schema (SmolLM2 answers free text otherwise), and the stream ends with
    finish_reason "stop"."""
    import openai

    schema = {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["sentiment", "confidence"],
        "additionalProperties": False,
    }
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Sentiment of 'I loved this film!' as JSON."}],
        max_tokens=40,
        temperature=0.8,
        seed=1,
        stream=True,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "sentiment", "schema": schema, "strict": True},
        },
    )
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    value = json.loads(text)
    assert value["sentiment"] in ("positive", "negative", "neutral"), text
    assert 0 <= value["confidence"] <= 100
    assert chunks[-1].choices[0].finish_reason == "stop"


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def test_forced_tool_calls_through_the_openai_sdk(server: ServerThread) -> None:
    """A named function, streamed: the SDK's accumulated deltas make one call whose arguments
    parse under the schema, finish_reason "stop" (OpenAI's for a forced call). "required",
    not streamed: one or more calls of declared tools, finish_reason "tool_calls"."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    stream = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=60,
        temperature=0,
        stream=True,
        logprobs=True,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    name, ids, arguments, finish, logprobs = None, set(), "", None, []
    for c in stream:
        if not c.choices:
            continue
        if c.choices[0].logprobs is not None:
            logprobs += c.choices[0].logprobs.content or []
        for call in c.choices[0].delta.tool_calls or []:
            name = call.function.name or name
            if call.id:
                ids.add(call.id)
            arguments += call.function.arguments or ""
        finish = c.choices[0].finish_reason or finish
    assert name == "get_weather" and len(ids) == 1 and finish == "stop"
    # one id and name however the arguments were split; the tokens' logprobs came with them
    assert "".join(lp.token for lp in logprobs).startswith(arguments)
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    resp = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=120,
        temperature=0,
        tools=[WEATHER_TOOL],
        tool_choice="required",
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert calls and all(c.function.name == "get_weather" for c in calls)
    assert all(json.loads(c.function.arguments)["unit"] in ("celsius", "fahrenheit") for c in calls)


def test_score_matches_transformers(
    server: ServerThread, http: httpx.Client, default_model_dir: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    query = "<|im_start|>user\nIs Paris the capital of France? Answer yes or no.<|im_end|>\n<|im_start|>assistant\n"
    items = ["", "Well,", "I think"]
    labels = ["yes", "no", "Yes", "No"]
    r = http.post(
        "/v1/score",
        json={"query": query, "items": items, "labels": labels, "apply_softmax": True},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    tok = server.engine.tokenizer
    label_ids = [tok.encode(lbl)[0] for lbl in labels]
    assert body["label_token_ids"] == label_ids

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(default_model_dir), torch_dtype=torch.float32
    )
    model.eval()
    for item, scores in zip(items, body["scores"], strict=True):
        ids = tok.encode(query + item)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        expected = torch.softmax(logits[label_ids], dim=-1).tolist()
        assert scores == pytest.approx(expected, abs=1e-4)
        assert abs(sum(scores) - 1.0) < 1e-5
    # SGLang's default (apply_softmax false): full-vocabulary probabilities.
    r = http.post("/v1/score", json={"query": query, "items": [""], "label_token_ids": label_ids})
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode(query)])).logits[0, -1].float()
    expected = torch.softmax(logits, dim=-1)[label_ids].tolist()
    assert r.json()["scores"][0] == pytest.approx(expected, abs=1e-4)


def test_disconnect_mid_stream_frees_kv(server: ServerThread, http: httpx.Client) -> None:
    engine = server.engine
    # Referenced blocks (idle prefix-cache blocks excluded), fresh: the last heartbeat's
    # snapshot may date from before the previous test's last step.
    baseline = server.stats_after()["kv_blocks_used"]
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.stats_after()["kv_blocks_used"] > baseline
    deadline = time.monotonic() + 30
    while True:
        stats = engine.stats()
        if (
            stats["kv_blocks_used"] == baseline
            and stats["num_running"] == 0
            and stats["num_waiting"] == 0
            and server.app.state.client.num_in_flight == 0
        ):
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    assert http.get("/health").status_code == 200


def test_multi_item_score_computes_the_shared_query_once(
    server: ServerThread, http: httpx.Client
) -> None:
    """The items of one call share the query: the first item computes it, the others wait for
    its blocks to be cached (`wait_for_shared_prefix_tokens`) instead of computing it again
    in the same batch."""
    engine = server.engine
    query = "Rate how relevant this post is to a reader who likes sailing. " * 40
    num_query = len(engine.tokenizer.encode(query))
    assert num_query > 2 * 256  # the default wait_for_shared_prefix_tokens
    items = [" Post: a regatta report.", " Post: a cake recipe.", " Post: knots.", " Post: tides."]
    before = server.stats_after()["num_prefill_tokens"]
    r = http.post("/v1/score", json={"query": query, "items": items, "labels": ["Yes", "No"]})
    assert r.status_code == 200, r.text
    assert len(r.json()["scores"]) == 4
    stats = server.stats_after()
    computed = stats["num_prefill_tokens"] - before
    # Query once, plus each item and the query's last partial block at most (block-granular
    # hits): far below the 4 x query that computing it per item would cost.
    assert num_query < computed < num_query + 4 * (stats["kv_block_size"] + 16), (
        computed,
        num_query,
    )


def test_prefix_hits_through_http_follow_the_cache_salt(http: httpx.Client) -> None:
    """The API server digests the prompt's blocks and the engine core looks them up: a
    repeated prompt is a hit, under a new salt a miss, under the same salt a hit again."""
    body = {
        "query": "Decide whether this review of a lighthouse tour is positive. " * 12,
        "items": [" Review: the keeper's stories were wonderful."],
        "labels": ["Yes", "No"],
    }

    def cached(**extra: str) -> int:
        r = http.post("/v1/score", json={**body, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    first = cached()
    hit = cached()
    assert hit > first and hit >= 64
    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") == hit
    assert cached(cache_salt="tenant-b") == 0
