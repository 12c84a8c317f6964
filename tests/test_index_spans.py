"""runtime.attention.base.IndexSpans: slots and rows built span by span equal the per-token
loop the FlashInfer backend used to run (the GPU tests check the backend itself)."""

from __future__ import annotations

import random

import torch

from runtime.attention.base import IndexSpans


def _slot(block_ids: list[int], p: int, bs: int) -> int:
    return block_ids[p // bs] * bs + p % bs


def test_spans_match_the_per_token_loop() -> None:
    rng = random.Random(0)
    for bs in (1, 4, 16):
        spans, slots, want_spans, want_slots = IndexSpans(), IndexSpans(), [], []
        for _ in range(40):
            # Short and long spans, starting mid-block or on a block edge, and empty ones.
            n = rng.choice([0, 1, 3, IndexSpans.LONG - 1, IndexSpans.LONG, 300, 2000])
            start = rng.choice([0, bs, rng.randint(0, 500)])
            blocks = rng.sample(range(10_000), (start + n) // bs + 1)
            spans.add_range(start, start + n)
            want_spans.extend(range(start, start + n))
            slots.add_slots(blocks, start, start + n, bs)
            want_slots.extend(_slot(blocks, p, bs) for p in range(start, start + n))
        assert spans.tensor().tolist() == want_spans
        got = slots.tensor()
        assert got.dtype == torch.int64 and got.tolist() == want_slots
    assert IndexSpans().tensor().tolist() == []
