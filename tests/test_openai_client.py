"""(h) The official `openai` client works against the server: chat (stream and not),
completions, models, errors and the API key."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from server_thread import ServerThread, fake_server

KEY = "test-key"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with fake_server(api_key=KEY, served_model_name="fake-model") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]


def test_chat_non_stream(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=50,
        temperature=0,
    )
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "user\nHi\nassistant\n"
    assert choice.finish_reason == "stop"
    # One token per character of text, plus the EOS that ended it (counted, not shown).
    assert resp.usage is not None
    assert resp.usage.completion_tokens == len(choice.message.content) + 1


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "user"
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_chat_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        logprobs=True,
        top_logprobs=2,
    )
    content = resp.choices[0].logprobs.content
    assert [c.token for c in content] == ["u", "s"]
    assert all(len(c.top_logprobs) == 2 for c in content)


def test_completions(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="fake-model", prompt="hello", max_tokens=3, logprobs=2)
    assert resp.choices[0].text == "hel"
    lp = resp.choices[0].logprobs
    assert lp.tokens == ["h", "e", "l"] and lp.text_offset == [0, 1, 2]
    assert all(len(t) == 2 for t in lp.top_logprobs)
    # Token ids as the prompt, and a batch of prompts.
    resp = client.completions.create(model="fake-model", prompt=[104, 105], max_tokens=2)
    assert resp.choices[0].text == "hi"
    resp = client.completions.create(model="fake-model", prompt=["ab", "cd"], max_tokens=2)
    assert [c.text for c in resp.choices] == ["ab", "cd"]


def test_completions_stream(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="fake-model", prompt="hello", max_tokens=5, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == "hello"


def test_errors_map_to_openai_exceptions(client: openai.OpenAI, server: ServerThread) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="fake-model", prompt="x", max_tokens=10**6)
    assert exc.value.code == "context_length_exceeded"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
