"""GPU: hybrid prefill's chunk left to auto follows the memory (`auto_prefill_chunk_tokens`).

Why: at 2,048 a cold 12-16k-token prompt enqueues more kernels than the launch queue holds
and holds the engine thread for ~0.9 of the step; 16,384 freed it and cut FCFS's mean latency
by 22-30 % (docs/scheduling.md, "The prefill chunk follows the memory"). Its temporaries are
reserved at start-up, so a tight cap keeps a small chunk. Checked here on the device: the
engine sizes it before its dry runs (so the reserve holds its peak), serves a prompt longer
than the chunk with it, and a tight cap gives the smallest choice."""

from __future__ import annotations

import math
import random

import pytest
from gpu_engines import small_engine

pytestmark = pytest.mark.gpu

PROMPT_TOKENS = 20_000  # longer than 16,384: two chunks a layer


def _serve_one(eng, sink) -> None:  # noqa: ANN001 - the engine and sink of `small_engine`
    from runtime.request import Request, RequestKind

    rng = random.Random(3)
    ids = [rng.randrange(100, 30_000) for _ in range(PROMPT_TOKENS)]
    eng.start()
    eng.add(Request("long", RequestKind.SCORE, ids, label_token_ids=[11, 22, 33]))
    assert sink.wait(["long"], 300)
    out = sink.done["long"]
    assert out.finish_reason != "error", out
    assert out.label_probs is not None and len(out.label_probs) == 3
    assert all(math.isfinite(p) and 0 <= p <= 1 for p in out.label_probs)


def test_with_room_the_chunk_is_16384_and_serves_a_longer_prompt() -> None:
    import torch

    from runtime.kv.kv_pool import CHUNK_MEMORY_SHARE, chunk_temporaries_bytes

    eng, sink = small_engine(num_kv_blocks=None, max_model_len=32_768, max_score_tokens=32_768)
    try:
        total = torch.cuda.get_device_properties(0).total_memory
        need = chunk_temporaries_bytes(eng.model_config, 16384, 2) / CHUNK_MEMORY_SHARE
        if total * 0.9 - 8 * 2**30 < need:  # the 3B's weights and more: not this GPU's case
            pytest.skip(f"a {total / 2**30:.0f} GiB GPU shares too little for 16,384")
        assert eng.config.prefill_chunk_tokens == 16384
        assert eng.fresh_stats()["prefill_chunk_tokens"] == 16384
        _serve_one(eng, sink)
    finally:
        eng.shutdown(0)


def test_under_a_tight_cap_the_chunk_is_the_smallest_choice() -> None:
    # The 3B's weights (~5.8 GiB) and 4 GiB more: 5 % of that is below 2,048's ~0.14 GiB.
    eng, sink = small_engine(
        num_kv_blocks=None, max_model_len=32_768, max_score_tokens=32_768, max_gpu_memory_gb=10
    )
    try:
        assert eng.config.prefill_chunk_tokens == 2048
        _serve_one(eng, sink)
    finally:
        eng.shutdown(0)
