"""GPU: aborting a long scoring prompt stops its hybrid prefill within a few layers.

Why: on the H200 a 262k-token prompt runs ~35 s; before this a client that left (or SIGTERM's
grace) waited for the whole step. On CUDA the host could enqueue layers far ahead of the
device, so asking between layers says little unless the host is kept near the device: the
runner waits for the end of layer i - 3 before enqueueing layer i (`ModelRunner._interrupt_for`).
Checked here: the abort's answer comes in well under the prompt's own time, the step is counted
as interrupted, and the pool is whole afterwards."""

from __future__ import annotations

import random
import time

import pytest
from gpu_engines import small_engine

pytestmark = pytest.mark.gpu

NUM_TOKENS = 65_536


def test_aborting_a_long_prefill_answers_within_a_few_layers() -> None:
    from runtime.request import Request, RequestKind

    # A pool far smaller than the prompt: it cannot be chunked, so it is one hybrid step.
    eng, sink = small_engine(
        max_model_len=NUM_TOKENS + 16, max_score_tokens=NUM_TOKENS, num_kv_blocks=1200
    )
    rng = random.Random(11)

    def long(rid: str) -> Request:
        ids = [rng.randrange(100, 30_000) for _ in range(NUM_TOKENS)]
        return Request(rid, RequestKind.SCORE, ids, label_token_ids=[11, 22, 33])

    try:
        eng.start()
        eng.add(long("warm"))  # first use of the long forms
        assert sink.wait(["warm"], 300)
        t0 = time.monotonic()
        eng.add(long("whole"))
        assert sink.wait(["whole"], 300)
        whole_s = time.monotonic() - t0
        eng.add(long("gone"))
        time.sleep(0.2 * whole_s)
        t1 = time.monotonic()
        eng.abort("gone")
        assert sink.wait(["gone"], 300)
        answered_s = time.monotonic() - t1
        assert sink.done["gone"].finish_reason == "abort"
        stats = eng.fresh_stats()
        assert stats["num_interrupted_steps"] == 1
        assert stats["kv_blocks_used"] == 0
        # 36 layers: three of them are ~8 % of the prompt; without the interrupt it is ~80 %.
        assert answered_s < 0.25 * whole_s, (answered_s, whole_s)
    finally:
        eng.shutdown(0)
