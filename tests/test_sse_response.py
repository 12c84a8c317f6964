"""The lean SSE response (app/sse.py) and the streamed chunks' JSON templates (the framing
seen by a client is tests/test_sse.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from app.routes_openai import _chat_content_chunk, _chunk_head, _completion_chunk
from app.sse import SSEResponse, encode_events

TEXTS = ["", "plain", 'quote " and \\ backslash', "line\nbreak\ttab", "ünïcødé ✓ 中文", "\x00\x1f"]


def _canonical(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("logprobs", [None, {"content": [{"token": "a", "logprob": -0.5}]}])
def test_chat_template_matches_the_dict(text: str, logprobs: Any) -> None:
    rid, model = 'chatcmpl-"x"', "org/model \u2603"
    head = _chunk_head(rid, "chat.completion.chunk", 1700000000, model)
    want = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": model,
        "choices": [
            {"index": 3, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}
        ],
    }
    got = _chat_content_chunk(head, 3, text, logprobs)
    assert got == _canonical(want)
    assert "\n" not in got  # one SSE data line


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish", [None, "stop", "length"])
def test_completion_template_matches_the_dict(text: str, finish: str | None) -> None:
    head = _chunk_head("cmpl-1", "text_completion", 5, "m")
    want = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 5,
        "model": "m",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }
    assert _completion_chunk(head, 0, text, finish, None) == _canonical(want)


# ----------------------------------------------------------------------------- the response


class _Client:
    """An ASGI peer: records what is sent; `disconnect()` makes receive() report it."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self._gone = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def disconnect(self) -> None:
        self._gone.set()

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_each_batch_is_one_write_and_the_stream_ends() -> None:
    closed: list[bool] = []

    async def batches() -> AsyncIterator[list[str]]:
        yield ['{"a":1}', '{"b":2}']
        yield []  # nothing to send: no write
        yield ["[DONE]"]

    async def on_close() -> None:
        closed.append(True)

    async def main() -> _Client:
        client = _Client()
        await SSEResponse(batches(), on_close, ping_s=10)({}, client.receive, client.send)
        return client

    client = _run(main())
    assert client.sent[0]["type"] == "http.response.start" and client.sent[0]["status"] == 200
    headers = dict(client.sent[0]["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream")
    assert client.bodies() == [encode_events(['{"a":1}', '{"b":2}']), b"data: [DONE]\n\n", b""]
    assert client.sent[-1]["more_body"] is False
    assert closed == [True]


def test_a_disconnect_while_waiting_closes_at_once() -> None:
    """The client leaves while the route waits for its next token: the generator is closed
    (its `finally` runs: the request is aborted) and on_close runs, without another token."""
    events: list[str] = []

    async def batches() -> AsyncIterator[list[str]]:
        try:
            yield ['{"a":1}']
            await asyncio.sleep(3600)  # the next token never comes
            yield ['{"never":1}']
        finally:
            events.append("generator closed")

    async def on_close() -> None:
        events.append("on_close")

    async def main() -> _Client:
        client = _Client()
        task = asyncio.ensure_future(
            SSEResponse(batches(), on_close, ping_s=10)({}, client.receive, client.send)
        )
        await asyncio.sleep(0.05)
        client.disconnect()
        await asyncio.wait_for(task, 2)
        return client

    client = _run(main())
    assert events == ["generator closed", "on_close"]
    assert b'{"never":1}' not in b"".join(client.bodies())


def test_idle_streams_get_pings() -> None:
    async def batches() -> AsyncIterator[list[str]]:
        await asyncio.sleep(0.35)  # a long prefill
        yield ["[DONE]"]

    async def on_close() -> None:
        pass

    async def main() -> _Client:
        client = _Client()
        await SSEResponse(batches(), on_close, ping_s=0.1)({}, client.receive, client.send)
        return client

    bodies = _run(main()).bodies()
    assert 2 <= bodies.count(b": ping\n\n") <= 4
    assert bodies[-2:] == [b"data: [DONE]\n\n", b""]


def test_a_failing_generator_still_closes() -> None:
    closed: list[bool] = []

    async def batches() -> AsyncIterator[list[str]]:
        yield ['{"a":1}']
        raise RuntimeError("bug in a route")

    async def on_close() -> None:
        closed.append(True)

    async def main() -> None:
        client = _Client()
        await SSEResponse(batches(), on_close, ping_s=10)({}, client.receive, client.send)

    with pytest.raises(RuntimeError, match="bug in a route"):
        _run(main())
    assert closed == [True]
