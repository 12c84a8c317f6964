"""GPU: a step in flight is answered before a gated long prefill is launched behind it.

Why: a prefill of at least INTERRUPT_GATE_MIN_TOKENS keeps the host within two layers of the
device (so an abort stops it soon), so its launch returns only near the step's end. Under
overlapped scheduling the step before it used to be answered only then (~450 ms late on the
H200, issue 17's traces). Since `bf372e7` the engine drains the steps in flight before such a
launch (`ModelRunner.holds_host`). Checked here: a short scoring request planned just ahead of a
32k-token one is answered long before it, and the drain is counted."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
from gpu_engines import small_engine

pytestmark = pytest.mark.gpu

LONG_TOKENS = 32_768
SHORT_TOKENS = 600


class _DoneAt:
    """The engine's output sink, wrapped: when each request finished (monotonic s)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.at: dict[str, float] = {}
        self.lock = threading.Lock()

    def __call__(self, outs: list[Any]) -> None:
        now = time.monotonic()
        with self.lock:
            for o in outs:
                if o.finished:
                    self.at.setdefault(o.request_id, now)
        self.inner(outs)


def test_the_step_before_a_gated_prefill_is_answered_before_it() -> None:
    from runtime.request import Request, RequestKind
    from runtime.runner import INTERRUPT_GATE_MIN_TOKENS

    assert LONG_TOKENS >= INTERRUPT_GATE_MIN_TOKENS
    # A pool far smaller than the long prompt: it cannot be chunked, so it is one hybrid step.
    eng, sink = small_engine(
        max_model_len=LONG_TOKENS + 16, max_score_tokens=LONG_TOKENS, num_kv_blocks=1200
    )
    done_at = _DoneAt(sink)
    eng._sink = done_at  # what the engine thread delivers every iteration's outputs to
    rng = random.Random(5)

    def score(rid: str, n: int) -> Request:
        ids = [rng.randrange(100, 30_000) for _ in range(n)]
        return Request(rid, RequestKind.SCORE, ids, label_token_ids=[11, 22, 33])

    try:
        eng.start()
        eng.add(score("warm", LONG_TOKENS))  # first use of the long forms
        assert sink.wait(["warm"], 300)
        eng.add_many([score("warm-short", SHORT_TOKENS), score("warm-long", LONG_TOKENS)])
        assert sink.wait(["warm-short", "warm-long"], 300)
        before = eng.fresh_stats()["num_drains_before_held_launch"]
        t0 = time.monotonic()
        # Together, in arrival order: the short one is planned and launched first, the long
        # one (over the step budget, alone) is planned while the short one is in flight.
        eng.add_many([score("short", SHORT_TOKENS), score("long", LONG_TOKENS)])
        assert sink.wait(["short", "long"], 300)
        short_s = done_at.at["short"] - t0
        long_s = done_at.at["long"] - t0
        assert eng.fresh_stats()["num_drains_before_held_launch"] > before
        # Answered behind the long launch it would read ~0.9 of the long step.
        assert short_s < 0.3 * long_s, (short_s, long_s)
    finally:
        eng.shutdown(0)
