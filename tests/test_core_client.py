"""The engine core client's start-up against a scripted core (raw ZMQ sockets)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import zmq

from runtime.core.client import EngineCoreClient, EngineCoreError
from runtime.core.messages import CLIENT_DECODER, ENCODER, Heartbeat, Hello, Outputs
from runtime.core.process import CoreHandle


def _scripted_core(in_addr: str, out_addr: str, heartbeat_delay_s: float, stop: threading.Event):
    """Acknowledge the first Hello at once; send the first heartbeat `heartbeat_delay_s`
    later (a core busy at start-up), then one every 0.2 s."""
    ctx = zmq.Context()
    inp, out = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    out.setsockopt(zmq.ROUTER_MANDATORY, 1)
    inp.bind(in_addr)
    out.bind(out_addr)
    client, acked_s, next_beat_s = None, None, 0.0
    try:
        while not stop.is_set():
            if inp.poll(10):
                ident, frame = inp.recv_multipart()
                if isinstance(CLIENT_DECODER.decode(frame), Hello) and acked_s is None:
                    try:
                        out.send_multipart([ident, ENCODER.encode(Outputs([]))])
                    except zmq.ZMQError:
                        continue  # output connection not up yet: the client says hello again
                    client, acked_s = ident, time.monotonic()
                    next_beat_s = acked_s + heartbeat_delay_s
            now = time.monotonic()
            if client is not None and now >= next_beat_s:
                out.send_multipart([client, ENCODER.encode(Heartbeat({"alive": True}, {}, now))])
                next_beat_s = now + 0.2
    finally:
        inp.close(0)
        out.close(0)
        ctx.term()


def test_start_keeps_the_loop_running_until_the_first_heartbeat(tmp_path) -> None:  # noqa: ANN001
    """Between the core's acknowledgement and its first heartbeat, `start()` must yield to
    the event loop (else the reader thread's callbacks, the heartbeat's among them, never run
    and start-up times out: seen on the H200 with Python 3.12; this test fails there without
    the fix, and passes on 3.11 either way)."""
    in_addr, out_addr = f"ipc://{tmp_path}/input", f"ipc://{tmp_path}/output"
    stop = threading.Event()
    core = threading.Thread(target=_scripted_core, args=(in_addr, out_addr, 0.5, stop))
    core.start()

    async def main() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick_task = asyncio.create_task(ticker())
        client = EngineCoreClient(CoreHandle(in_addr, out_addr, {}, os.getpid()), tokenizer=None)
        try:
            await client.start(timeout_s=10.0)
        finally:
            tick_task.cancel()
            await client.close()
        return ticks

    try:
        t0 = time.monotonic()
        ticks = asyncio.run(main())
        assert time.monotonic() - t0 < 5.0
        assert ticks >= 20  # the loop ran other tasks during the 0.5 s wait
    finally:
        stop.set()
        core.join(5)


def test_a_core_shutting_down_does_not_report_its_engine_dead(tmp_path) -> None:  # noqa: ANN001
    """Seen on every replica Ray stopped: the engine thread ends inside the shutdown call and a
    heartbeat sent before the call's reply said the engine had died, so the client logged an
    error and failed its own shutdown. While stopping, only a crash is reported."""
    from types import SimpleNamespace

    from runtime.core.messages import CORE_DECODER
    from runtime.core.process import EngineCore

    crashed = False
    engine = SimpleNamespace(
        is_alive=lambda: False,  # the engine thread has ended
        stats=lambda: {"alive": not crashed},
        partition=SimpleNamespace(state=lambda: {}),
    )
    core = EngineCore(
        lambda config, sink: engine, None, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
    )
    sent: list[bytes] = []
    core._send = lambda client, frame: sent.append(frame)  # type: ignore[method-assign]
    try:

        def beat() -> bool:
            core._heartbeat(time.monotonic(), [b"client"])
            return CORE_DECODER.decode(sent[-1]).stats["alive"]

        assert beat() is False  # not stopping: the engine died
        core._stopping = True
        assert beat() is True  # a shutdown in progress
        crashed = True
        assert beat() is False  # a crash while stopping is still one
    finally:
        core._close()


def test_prompts_sent_leave_the_young_collections_walk() -> None:
    """The API server holds each prompt until its request ends; a young collection (which
    stops the event loop) must not walk its tokens (runtime/diagnostics/gc_watch.py)."""
    import gc

    from runtime.core.messages import AddRequests
    from runtime.request import Request, RequestKind

    client = EngineCoreClient(
        CoreHandle("ipc://unused-in", "ipc://unused-out", {}, os.getpid()), None
    )
    sent: list = []
    # no core: capture the message as the core would read it
    client._send_encoded = lambda data, what: sent.append(CLIENT_DECODER.decode(data))  # type: ignore[method-assign]
    prompt = list(range(100, 20_100))
    assert gc.is_tracked(prompt)
    client.add([Request("s0", RequestKind.SCORE, prompt, label_token_ids=[1, 2])])
    assert not gc.is_tracked(prompt)
    assert isinstance(sent[0], AddRequests) and sent[0].requests[0].prompt_token_ids == prompt


def test_a_request_that_cannot_be_sent_leaves_nothing_behind() -> None:
    """Encoding fails before any state is kept (a seed past 64 bits: the routes keep seeds in
    range, this is the backstop); a socket that is gone fails as the engine core's error, with
    the output processor's state for the requests dropped."""
    import zmq

    from runtime.request import Request, RequestKind, SamplingParams

    client = EngineCoreClient(
        CoreHandle("ipc://unused-in", "ipc://unused-out", {}, os.getpid()), None
    )
    bad = Request("g0", RequestKind.GENERATE, [1, 2, 3], SamplingParams(seed=2**64))
    with pytest.raises(OverflowError):
        client.add([bad])
    assert client.processor.num_tracked == 0 and "g0" not in client._unseen

    def gone(data: bytes, what: str | None) -> None:
        raise zmq.ZMQError(zmq.ENOTSOCK)

    client._send_encoded = gone  # type: ignore[method-assign]
    ok = Request("g1", RequestKind.GENERATE, [1, 2, 3], SamplingParams(seed=7))
    with pytest.raises(EngineCoreError, match="cannot reach the engine core"):
        client.add([ok])
    assert client.processor.num_tracked == 0 and "g1" not in client._unseen


def test_the_api_server_sends_each_prompts_prefix_digests() -> None:
    """With a prefix cache the core's block size comes in its info, and every request goes
    with its prompt's full-block digests (the engine thread then only looks them up); the
    items of one call share the query's digests. Without one, none are computed."""
    from runtime.core.messages import AddRequests
    from runtime.kv.prefix_cache import extend_block_hashes, salt_digest
    from runtime.request import Request, RequestKind

    query = list(range(1000, 1100))
    prompts = [query + [7, 8, 9], query + list(range(40)), [5] * 15]
    for info, want in (({"prefix_block_size": 16}, 16), ({"prefix_block_size": None}, None)):
        client = EngineCoreClient(
            CoreHandle("ipc://unused-in", "ipc://unused-out", info, os.getpid()), None
        )
        sent: list = []
        client._send_encoded = lambda data, what, sent=sent: sent.append(  # type: ignore[method-assign]
            CLIENT_DECODER.decode(data)
        )
        reqs = [
            Request(f"s{i}", RequestKind.SCORE, list(p), label_token_ids=[1, 2])
            for i, p in enumerate(prompts)
        ]
        reqs[1].cache_salt = "tenant"  # its own digests, though it shares the query
        client.add(reqs)
        (msg,) = sent
        assert isinstance(msg, AddRequests)
        for wire, p, r in zip(msg.requests, prompts, reqs, strict=True):
            seed = salt_digest(r.cache_salt)
            expect = extend_block_hashes([], p, want, seed) if want else []
            assert wire.cache_salt == r.cache_salt
            assert wire.block_hashes == expect
            assert wire.to_request().block_hashes == expect
