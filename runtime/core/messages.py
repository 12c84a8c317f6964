"""Wire types between API servers and the engine core (msgspec structs, MessagePack frames).

Why ZMQ + msgspec: the engine core must run on an interpreter of its own, fed by one or more
API-server processes. ZMQ gives message framing, per-client routing (ROUTER sockets address
each client by identity), unbounded queues with no lost messages, and asyncio sockets for the
front end; msgspec encodes and decodes these typed structs several times faster than pickle
and validates them on decode. One message per engine step carries every output of that step
for one client, so the cost per token is a few microseconds.

Client -> core (DEALER -> ROUTER `input`): Hello, AddRequests, AbortRequests, Call.
Core -> client (ROUTER `output` -> DEALER): Outputs (the engine thread, once per step),
Heartbeat (stats, at a fixed rate) and CallResult (the core's main thread), under one lock.
Each client socket goes one way only: the front end sends on one from its event loop and
receives on the other in a reader thread (no socket is shared between threads, and no
asyncio ZMQ socket is needed).
"""

from __future__ import annotations

from typing import Any

import msgspec

from runtime.request import EngineOutput, Request, RequestKind, SamplingParams


class WireRequest(msgspec.Struct, array_like=True):
    request_id: str
    kind: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    label_token_ids: list[int]
    apply_softmax: bool
    arrival_s: float
    block_hashes: list[bytes]
    cache_salt: str | None

    @classmethod
    def of(cls, req: Request) -> WireRequest:
        return cls(
            req.request_id,
            str(req.kind),
            req.prompt_token_ids,
            req.sampling,
            req.label_token_ids,
            req.apply_softmax,
            req.arrival_s,
            req.block_hashes,
            req.cache_salt,
        )

    def to_request(self) -> Request:
        return Request(
            request_id=self.request_id,
            kind=RequestKind(self.kind),
            prompt_token_ids=self.prompt_token_ids,
            sampling=self.sampling,
            label_token_ids=self.label_token_ids,
            apply_softmax=self.apply_softmax,
            arrival_s=self.arrival_s,
            block_hashes=self.block_hashes,
            cache_salt=self.cache_salt,
        )


class Hello(msgspec.Struct, tag="hello"):
    """A client connects (also sent every second as a keep-alive)."""

    client_id: str


class AddRequests(msgspec.Struct, tag="add"):
    requests: list[WireRequest]


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Call(msgspec.Struct, tag="call"):
    """A control call (policy, partition, prefix-cache reset, shutdown, ...)."""

    call_id: int
    method: str
    args: list[Any] = []


class CallResult(msgspec.Struct, tag="result"):
    call_id: int
    ok: bool
    value: Any = None
    error: str | None = None
    error_type: str | None = None  # "ValueError" -> the caller raises ValueError(error)


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """The engine's latest stats snapshot; sent at a fixed rate, also during a long step."""

    stats: dict[str, Any]
    partition: dict[str, Any]
    sent_s: float


class Outputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineOutput]


ClientMessage = Hello | AddRequests | AbortRequests | Call
CoreMessage = Outputs | Heartbeat | CallResult


def _enc_hook(obj: Any) -> Any:
    """Values msgspec does not encode itself: numpy scalars (stats and cost-model figures are
    often numpy floats) as Python numbers; anything else is a bug at the call site."""
    item = getattr(obj, "item", None)
    if callable(item):
        return item()
    raise NotImplementedError(f"cannot send a {type(obj).__name__} to the engine core's peer")


ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
CLIENT_DECODER = msgspec.msgpack.Decoder(ClientMessage)
CORE_DECODER = msgspec.msgpack.Decoder(CoreMessage)
