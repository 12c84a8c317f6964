"""GPU: the prefill profile times a warm scoring request on the attention path a served one
takes (FlashInfer backend's plan mode, read after the step).

Why: until 2026-12-05 `Engine.measure_prefill` discarded the new tokens' KV, so every profile
point with cached context ran the "gather" path (the context copied out of the pool in every
layer), while the scheduler keeps a warm scoring request's few new tokens whenever the pool has
room and attention reads the context in place ("paged"/"paged_fa2"). The simulator and the JCT
calibration priced warm requests from those points (docs/scheduling.md, "The simulator's price
of the GPU's batches")."""

from __future__ import annotations

import random
from typing import Any

import pytest
from gpu_engines import small_engine

pytestmark = pytest.mark.gpu

PAGED = ("paged", "paged_fa2")


def _mode(eng: Any) -> str | None:
    return eng.runner.prefill_backend.debug_state()["mode"]


def test_profile_and_served_warm_scoring_take_the_same_path() -> None:
    from runtime.request import Request, RequestKind

    eng, sink = small_engine()
    try:
        # Profile side (before start): a warm point by default, then each forced path.
        eng.measure_prefill(16, 1024)
        assert _mode(eng) in PAGED
        eng.measure_prefill_batch([(16, 1024)], keep_kv=False)
        assert _mode(eng) == "gather"
        eng.measure_prefill_batch([(16, 1024)] * 4, share_context=True)
        assert _mode(eng) in PAGED
        eng.measure_prefill(150, 1024)
        profile_mode = _mode(eng)

        # Served side: a user's profile scored once (cold), then a second post after it (warm).
        eng.start()
        rng = random.Random(5)
        profile = [rng.randrange(100, 30_000) for _ in range(1024)]
        post = [rng.randrange(100, 30_000) for _ in range(150)]
        eng.add(Request("cold", RequestKind.SCORE, profile + post, label_token_ids=[5, 6]))
        assert sink.wait(["cold"], 60), "the cold request timed out"
        post2 = [rng.randrange(100, 30_000) for _ in range(150)]
        eng.add(Request("warm", RequestKind.SCORE, profile + post2, label_token_ids=[5, 6]))
        assert sink.wait(["warm"], 60), "the warm request timed out"
        assert sink.done["warm"].error is None
        assert sink.done["warm"].num_cached_tokens == 1024  # the profile's 64 blocks
        # No chat runs, so the prefill backend's last plan is the warm request's step.
        assert _mode(eng) == profile_mode
    finally:
        eng.shutdown(0)
