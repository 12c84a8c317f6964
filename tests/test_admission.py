"""Admission against a stats snapshot up to a heartbeat old: requests the snapshot counts that
have finished since free their places (an idle server must admit the next call)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from app.client import EngineClient, Overloaded
from runtime.core.client import EngineCoreClient
from runtime.core.messages import Heartbeat
from runtime.core.process import CoreHandle
from runtime.request import EngineOutput, Request, RequestKind


class _Core:
    """A core whose last snapshot had `running` running and `waiting` waiting."""

    def __init__(self, running: int, waiting: int = 0) -> None:
        self.snapshot = {"num_running": running, "num_waiting": waiting}
        self.num_added_since_heartbeat = 0
        self.num_finished_since_heartbeat = 0
        self.on_outputs: Any = None
        self.on_dead: Any = None

    def add(self, reqs: list[Request]) -> None:
        pass

    def abort(self, request_ids: list[str]) -> None:
        pass

    def is_alive(self) -> bool:
        return True

    def stats(self) -> dict[str, Any]:
        return self.snapshot


def _score(i: int) -> Request:
    return Request(f"s{i}", RequestKind.SCORE, [1, 2, 3], label_token_ids=[1])


def test_places_freed_since_the_snapshot_are_free() -> None:
    """--max-num-seqs 2 --max-queue 2: the snapshot still shows two running that have since
    finished; a 4-item call fits (two run, two wait), and is refused while they have not."""
    client = EngineClient(max_in_flight=4, max_queue=2)
    core = _Core(running=2)
    client.attach(core)  # type: ignore[arg-type]
    with pytest.raises(Overloaded, match="4 requests would wait"):
        client._admit([_score(i) for i in range(4)])
    core.num_finished_since_heartbeat = 2
    assert len(client._admit([_score(i) for i in range(4)])) == 4
    # Finishes beyond the running ones were waiting in the snapshot (admitted and done
    # between two heartbeats): they free queue places, never below zero.
    client = EngineClient(max_in_flight=4, max_queue=2)
    core = _Core(running=1, waiting=2)
    core.num_finished_since_heartbeat = 3
    client.attach(core)  # type: ignore[arg-type]
    assert len(client._admit([_score(i) for i in range(4)])) == 4


def test_the_core_client_counts_finishes_the_snapshot_had() -> None:
    core = EngineCoreClient(
        CoreHandle("ipc://unused-in", "ipc://unused-out", {}, os.getpid()), None
    )
    core.on_outputs = lambda outs: None
    core._send_encoded = lambda data, what: None  # type: ignore[method-assign]
    core.add([_score(1), _score(2)])  # sent after the snapshot: not in it
    core._on_message(Heartbeat({"num_running": 2}, {}, 0.0))  # now they are
    core.add([_score(3)])
    done = lambda rid: EngineOutput(rid, label_probs=[1.0], finished=True)  # noqa: E731
    core._on_message(_outputs([done("s1"), done("s3")]))
    # s1 was in the snapshot; s3 was sent after it and finished before the next one
    assert core.num_finished_since_heartbeat == 1 and core.num_added_since_heartbeat == 0
    core._on_message(Heartbeat({"num_running": 1}, {}, 0.2))
    assert core.num_finished_since_heartbeat == 0


def _outputs(outs: list[EngineOutput]) -> Any:
    from runtime.core.messages import Outputs

    return Outputs(outs)
