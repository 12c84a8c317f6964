"""No request stalls another client (issue 16): while a stream runs, hostile bodies (50 MB, or
just under the size cap) are refused quickly and the stream's chunks keep their pace: no gap
over 250 ms. The fake engine makes a token every 10 ms; the gaps are measured by the client."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine
from server_thread import ServerThread, running_server

MAX_GAP_S = 0.25
STEP_S = 0.01


def _factory(config: Any, sink: Any) -> FakeEngine:
    """Module-level: the engine core process unpickles it."""
    return FakeEngine(config, sink, step_s=STEP_S)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    # Start-up objects frozen, as the CLI's API server freezes its own: in this process they
    # are the whole test session's, and a full collection walking them (100-150 ms in this
    # file alone, more deep into the suite) is a stall the served API server does not have.
    with running_server(_factory, freeze_gc_at_start=True) as srv:
        yield srv


def _stream_gaps(url: str, started: threading.Event, gaps: list[float]) -> None:
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 220,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            last = None
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                if len(gaps) == 5:
                    started.set()


def _chunks(raw: bytes, size: int = 1 << 16) -> Iterator[bytes]:
    for i in range(0, len(raw), size):
        yield raw[i : i + size]


def _hostile_bodies() -> list[tuple[str, str, Callable[[], Any], int]]:
    """(label, path, content factory, expected status)."""
    big_chat = json.dumps({"messages": [{"role": "user", "content": "a" * 50_000_000}]}).encode()
    near_cap = (4 << 20) - 1000
    under_cap_chat = json.dumps(
        {"messages": [{"role": "user", "content": "ab " * (near_cap // 3)}]}
    )
    under_cap_labels = json.dumps(
        {"query": "q", "items": ["a"], "label_token_ids": [7] * (near_cap // 3)}
    )
    under_cap_items = json.dumps({"query": "q", "items": ["a"] * (near_cap // 6), "labels": ["a"]})
    return [
        ("50 MB, Content-Length", "/v1/chat/completions", lambda: big_chat, 413),
        ("50 MB, chunked", "/v1/chat/completions", lambda: _chunks(big_chat), 413),
        ("4 MB chat text", "/v1/chat/completions", lambda: under_cap_chat.encode(), 400),
        ("4 MB label ids", "/v1/score", lambda: under_cap_labels.encode(), 400),
        ("700k score items", "/v1/score", lambda: under_cap_items.encode(), 400),
    ]


@pytest.mark.parametrize("case", range(len(_hostile_bodies())))
def test_hostile_body_does_not_stall_a_stream(server: ServerThread, case: int) -> None:
    label, path, content, status = _hostile_bodies()[case]
    started = threading.Event()
    gaps: list[float] = []
    streamer = threading.Thread(target=_stream_gaps, args=(server.url, started, gaps))
    streamer.start()
    assert started.wait(10), "the stream did not start"
    with httpx.Client(base_url=server.url, timeout=30) as c:
        t0 = time.monotonic()
        r = c.post(path, content=content(), headers={"content-type": "application/json"})
        answer_s = time.monotonic() - t0
    streamer.join(30)
    assert r.status_code == status, (label, r.status_code, r.text[:200])
    assert len(gaps) > 100, f"{label}: the stream ended early ({len(gaps)} chunks)"
    assert max(gaps) < MAX_GAP_S, f"{label}: the stream stalled {max(gaps) * 1000:.0f} ms"
    if status == 413:
        assert answer_s < 1.0, f"{label}: answered after {answer_s:.2f} s"


def test_real_tokenizer_works_off_the_event_loop(
    server: ServerThread, default_model_dir: Any
) -> None:
    """A long chat with the real tokenizer (SmolLM2's, under the fake engine): the stream keeps
    its pace while a worker thread tokenises it (the runtime tokenizer releases the GIL)."""
    from runtime.tokenizer import Tokenizer

    engine = server.engine
    fake_tokenizer = engine.tokenizer
    real_tokenizer = Tokenizer.from_dir(default_model_dir)  # loaded before the stream starts
    started = threading.Event()
    gaps: list[float] = []
    streamer = threading.Thread(target=_stream_gaps, args=(server.url, started, gaps))
    streamer.start()
    try:
        assert started.wait(10)
        engine.tokenizer = real_tokenizer
        # ~150k tokens: far over the fake's 256-token context, so a 400 after tokenising
        # (the text is short enough that the characters-per-token bound cannot refuse it).
        words = " ".join(f"w{i % 997}" for i in range(150_000))
        body = {"messages": [{"role": "user", "content": words}], "max_tokens": 1}
        with httpx.Client(base_url=server.url, timeout=30) as c:
            r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    finally:
        engine.tokenizer = fake_tokenizer
        streamer.join(30)
    assert max(gaps) < MAX_GAP_S, f"the stream stalled {max(gaps) * 1000:.0f} ms"
